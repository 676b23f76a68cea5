"""The bad-input corpus of issue 23: cases, the rule each must obey, and the
subprocess worker that runs them.

Every public op of seqfuse.ops and every public module of seqfuse.pytorch
has a valid call here (an OpSpec / ModSpec).  The corpus takes each call and
breaks one thing at a time: an argument's dtype, device or rank, its layout
(a strided, row-padded, offset, expanded or negative-bit view), its storage
(shrunk under the tensor with untyped_storage().resize_(), or freed), its
values (NaN and inf), an output's dtype, shape or layout, an output aliasing
an input, a zero-size or mismatched shape.  Each case must end one of two
ways:

  * a Python exception (TypeError, ValueError or NotImplementedError) whose
    message names the argument it broke (quoted where the name is short)
    and the rule (a word of the mutation's rule, e.g. "dtype", "storage",
    "contiguous");
  * a result equal to the reference: torch's own float64 computation where
    the spec has one (always for NaN / inf inputs), else the same op on a
    clean copy of the same values (contiguous, neg bit resolved, own
    memory), which catches a layout read wrongly.  A case whose reference
    itself raises must raise.

Anything else fails the case: a crash (segfault, abort), a hang, a wrong
result, another exception type, a message that names neither.  The worker
(``python bad_input_cases.py <device> <first> <last>``) runs cases one by
one and prints "S <name>" before and "R <json>" after each, so the runner
in tests/test_bad_input_corpus.py knows which case took the process down
and restarts after it.
"""
import faulthandler
import json
import math
import os
import re
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F

import seqfuse.ops as ops
import seqfuse.pytorch as te
from seqfuse.ops import device_checks
from seqfuse.ops.gemm import fp8_gemm_nt

F8 = torch.float8_e4m3fn
ACCEPTED = (TypeError, ValueError, NotImplementedError)

# What a message must say for each kind of mutation (a regex, searched
# case-insensitively).
RULES = {
    "dtype": r"dtype|int64|int32|float32|float16|bfloat16|float8",
    "rank": r"dimension|\bdim|-d\b|shape|rank",
    "contig": r"contiguous|stride",
    "align": r"align",
    "neg": r"negative bit",
    "storage": r"storage",
    "device": r"device|meta|dlpack",
    "tensor": r"tensor|dlpack|number",
    "shape": r"shape|size|dimension|element|length|multiple|match|same|\[|row|token|ends at|beyond",
    "overlap": r"overlap|alias|share|same memory|in.place|expanded|stride|distinct",
    "nan": r"nan|finite",
    "value": r"must|expected|out of range|invalid|outside|beyond|longer|ends at|decreas|sorted",
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    x = torch.randn(*shape, generator=_gen(seed), dtype=torch.float32) * scale
    return x.to(dtype).to(device)


# ---- the valid calls ------------------------------------------------------

class OpSpec:
    """A valid call of one op.  ``build(device)`` returns the argument dict
    (fresh tensors); ``call(a)`` runs the op and returns what to compare;
    ``ref(a)`` (optional) computes the same with torch in float64 from
    arguments already resolved and made contiguous.  ``tensors``: the
    argument paths the corpus mutates ("x", or "tensors.1" for a list
    element); ``outs``: output arguments; ``names``: extra names a message
    may use for an argument; ``extra``: op-specific mutations
    (label, fn(a) -> a, rule, names)."""

    def __init__(self, name, build, call, ref=None, tensors=(), outs=(), names=None, extra=(),
                 tol=1e-5, devices=("cpu", "cuda"), nan=True, nan_args=None, cuda_nan_ref=None):
        self.name, self.build, self.call, self.ref = name, build, call, ref
        # a second exact reference a CUDA result of a nan_inf case may equal instead of ref
        # (attention with masked keys: see _attn_zero_weight_ref)
        self.cuda_nan_ref = cuda_nan_ref
        self.tensors, self.outs, self.names = tuple(tensors), tuple(outs), names or {}
        self.extra, self.tol, self.devices, self.nan = tuple(extra), tol, devices, nan
        self.nan_args = nan_args  # the arguments given NaN / inf (None: every one)


def _get(a, path):
    if "." in path:
        k, i = path.split(".")
        return a[k][int(i)]
    return a[path]


def _set(a, path, v):
    if "." in path:
        k, i = path.split(".")
        lst = list(a[k])
        lst[int(i)] = v
        a[k] = lst
    else:
        a[path] = v


def _act_ref(name):
    base = {"gelu": lambda v: F.gelu(v, approximate="tanh"), "gelu_erf": F.gelu, "silu": F.silu,
            "relu": F.relu}
    gate = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu"}

    def f(x):
        if name in base:
            return base[name](x)
        n = x.shape[-1] // 2
        return base[gate[name]](x[..., :n]) * x[..., n:]
    return f


def _ln_ref(x, w, b, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _rms_ref(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_ref(t, freqs):
    rot = freqs.shape[-1]
    tr, rest = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    h = rot // 2
    rotated = torch.cat((-tr[..., h:], tr[..., :h]), -1)
    return torch.cat((tr * cos + rotated * sin, rest), -1)


def _grad(fn, *xs, dy):
    xs = [x.detach().double().requires_grad_(True) for x in xs]
    y = fn(*xs)
    return torch.autograd.grad(y, xs, dy.double())


def _rmsb_ref(a):
    """RMSNorm's backward given the saved rstd (as the op defines it)."""
    x, dy, w = a["x"], a["dy"], a["weight"]
    rstd = a["rstd"].reshape(*x.shape[:-1], 1)
    wdy = w * dy
    dx = rstd * (wdy - x * rstd.pow(2) * (wdy * x).mean(-1, keepdim=True))
    return dx, (dy * x * rstd).reshape(-1, x.shape[-1]).sum(0)


def _attn_ref(q, k, v, causal=False):
    """Attention [b, s, h, d] as the kernels define it: a masked key takes no
    part at all (torch's math SDPA multiplies it by 0, so an inf or NaN there
    would still reach the output)."""
    b, s, h, d = q.shape
    out = torch.empty_like(q)
    for i in range(s):
        n = i + 1 if causal else k.shape[1]
        sc = torch.einsum("bhd,bkhd->bhk", q[:, i], k[:, :n]) / math.sqrt(d)
        out[:, i] = torch.einsum("bhk,bkhd->bhd", torch.softmax(sc, -1), v[:, :n])
    return out


def _attn_zero_weight_ref(q, k, v, causal=False):
    """Attention as torch's SDPA (math, cuDNN, FlashAttention) and every
    tensor-core kernel compute it: a masked key gets weight 0 and its value
    row is still multiplied by it, so an inf or NaN in V at a key a query
    cannot see makes that query's output NaN (0 * inf).  README, Numerics:
    the CUDA result of a NaN/inf case may equal this instead of _attn_ref."""
    b, s, h, d = q.shape
    sc = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        keep = torch.ones(s, k.shape[1], dtype=torch.bool).tril()
        sc = sc.masked_fill(~keep, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, -1), v)


def _fp8_ref(x, scale):
    """A cast's reference: finite values saturate at 448; infinities (and NaN) become NaN."""
    y = x * scale
    return torch.where(y.isinf(), math.nan, y.clamp(-448, 448)).to(F8).double()


def op_specs():
    S = []
    r = rnd

    # quant: amax, per-tensor FP8
    S.append(OpSpec("amax", lambda d: {"x": r(4, 8, device=d)}, lambda a: ops.amax(a["x"]),
                    ref=lambda a: a["x"].abs().max() if a["x"].numel() else torch.zeros(()),
                    tensors=["x"]))
    S.append(OpSpec("amax_out", lambda d: {"x": r(4, 8, device=d), "out": torch.zeros((), device=d)},
                    lambda a: ops.amax(a["x"], out=a["out"]),
                    ref=lambda a: a["x"].abs().max(), tensors=["x"], outs=["out"]))

    def cast_build(d):
        return {"x": r(4, 16, device=d), "scale": torch.full((1,), 2.0, device=d),
                "amax": torch.zeros(1, device=d)}

    S.append(OpSpec("cast_fp8", cast_build,
                    lambda a: (ops.cast_fp8(a["x"], a["scale"], a["amax"], F8).float(), a["amax"]),
                    ref=lambda a: (_fp8_ref(a["x"], a["scale"]), a["x"].abs().max().reshape(1)),
                    tensors=["x", "scale", "amax"]))
    S.append(OpSpec("cast_fp8_out", lambda d: dict(cast_build(d), out=torch.empty(4, 16, dtype=F8, device=d)),
                    lambda a: ops.cast_fp8(a["x"], a["scale"], a["amax"], F8, out=a["out"]).float(),
                    ref=lambda a: _fp8_ref(a["x"], a["scale"]), tensors=["x"], outs=["out"]))
    S.append(OpSpec("cast_transpose_fp8", lambda d: cast_build(d),
                    lambda a: tuple(t.float() for t in ops.cast_transpose_fp8(a["x"], a["scale"], a["amax"], F8)),
                    ref=lambda a: (_fp8_ref(a["x"], a["scale"]), _fp8_ref(a["x"], a["scale"]).reshape(-1, 16).t()),
                    tensors=["x", "scale", "amax"]))
    S.append(OpSpec("cast_fp8_current",
                    lambda d: {"x": r(4, 16, device=d), "amax": torch.zeros(1, device=d),
                               "scale": torch.ones(1, device=d), "scale_inv": torch.ones(1, device=d)},
                    lambda a: (ops.quant.cast_fp8_current(a["x"], F8, amax=a["amax"], scale=a["scale"],
                                                          scale_inv=a["scale_inv"])[0].float(),
                               a["amax"], a["scale"], a["scale_inv"]),
                    tensors=["x", "amax", "scale", "scale_inv"]))
    # the grouped casts of a mixture-of-experts layer (seqfuse.ops.moe): two experts of 3 and 5 rows
    def grouped_cast_ref(a):
        x, s = a["x"], a["scale"]
        data = torch.zeros(32, 16, dtype=torch.float64, device=x.device)
        data[0:3] = _fp8_ref(x[0:3], s[0])
        data[16:21] = _fp8_ref(x[3:8], s[1])
        amax = torch.stack([x[0:3].abs().max(), x[3:8].abs().max()]).double()
        return data, data.t(), 1 / s.double(), amax

    def grouped_cast(a):
        data, data_t, si = ops.moe.cast_fp8_grouped(a["x"], [3, 5], F8, scale=a["scale"], amax=a["amax"])
        return data.float(), data_t.float(), si, a["amax"]

    S.append(OpSpec("cast_fp8_grouped",
                    lambda d: {"x": r(8, 16, device=d), "scale": torch.tensor([2.0, 0.5], device=d),
                               "amax": torch.zeros(2, device=d)},
                    grouped_cast, ref=grouped_cast_ref, tensors=["x", "scale", "amax"],
                    nan_args=["x", "scale"]))  # amax accumulates: a NaN already in it stays (the fold's rule)

    def swiglu_cast_ref(a):
        x, p = a["x"].double(), a["probs"].double()
        act = (torch.nn.functional.silu(x[:, :16]) * x[:, 16:] * p[:, None]).to(a["x"].dtype)
        return grouped_cast_ref(dict(a, x=act))

    def swiglu_cast(a):
        data, data_t, si = ops.moe.swiglu_cast_fp8_grouped(a["x"], a["probs"], [3, 5], F8, scale=a["scale"],
                                                           amax=a["amax"])
        return data.float(), data_t.float(), si, a["amax"]

    S.append(OpSpec("swiglu_cast_fp8_grouped",
                    lambda d: {"x": r(8, 32, device=d), "probs": torch.rand(8, device=d),
                               "scale": torch.tensor([2.0, 0.5], device=d), "amax": torch.zeros(2, device=d)},
                    swiglu_cast, ref=swiglu_cast_ref, tensors=["x", "probs", "scale", "amax"],
                    nan_args=["x", "probs", "scale"]))

    def swiglu_backward_ref(a):
        x, p, dy = a["x"].double(), a["probs"].double(), a["dout"].double()
        dy = torch.cat([dy[0:3], dy[16:21]])  # (the real rows of the padded blocks)
        d = dy * p[:, None]
        g, u = x[:, :16], x[:, 16:]
        sig = torch.sigmoid(g)
        dx = torch.cat([d * u * sig * (1 + g * (1 - sig)), d * g * sig], 1)
        _, data_t, si, _ = swiglu_cast_ref(a)
        return dx, (dy * g * sig * u).sum(1), data_t, si

    def swiglu_backward(a):
        dx, dp, data_t, si, _ = ops.moe.swiglu_backward_cast_fp8_grouped(a["dout"], a["x"], a["probs"], [3, 5], F8,
                                                                     scale=a["scale"])
        return dx, dp, data_t.float(), si

    S.append(OpSpec("swiglu_backward_cast_fp8_grouped",
                    lambda d: {"dout": r(32, 16, device=d), "x": r(8, 32, device=d), "probs": torch.rand(8, device=d),
                               "scale": torch.tensor([2.0, 0.5], device=d)},
                    swiglu_backward, ref=swiglu_backward_ref, tensors=["dout", "x", "probs", "scale"]))

    def swiglu_backward_grad_ref(a):  # (and dx's own FP8 copies, cast from dx as stored)
        dx, dp, data_t, si = swiglu_backward_ref(a)
        stored, gs = dx.to(a["x"].dtype).double(), a["grad_scale"]
        data = torch.zeros(32, 32, dtype=torch.float64, device=stored.device)
        data[0:3] = _fp8_ref(stored[0:3], gs[0])
        data[16:21] = _fp8_ref(stored[3:8], gs[1])
        amax = torch.stack([stored[0:3].abs().max(), stored[3:8].abs().max()])
        return dx, dp, data_t, si, data, data.t(), 1 / gs.double(), amax

    def swiglu_backward_grad(a):
        dx, dp, data_t, si, g = ops.moe.swiglu_backward_cast_fp8_grouped(
            a["dout"], a["x"], a["probs"], [3, 5], F8, scale=a["scale"], grad_fp8_dtype=F8,
            grad_scale=a["grad_scale"], grad_amax=a["grad_amax"])
        return dx, dp, data_t.float(), si, g[0].float(), g[1].float(), g[2], a["grad_amax"]

    S.append(OpSpec("swiglu_backward_cast_fp8_grouped_grad",
                    lambda d: {"dout": r(32, 16, device=d), "x": r(8, 32, device=d), "probs": torch.rand(8, device=d),
                               "scale": torch.tensor([2.0, 0.5], device=d),
                               "grad_scale": torch.tensor([4.0, 0.25], device=d), "grad_amax": torch.zeros(2, device=d)},
                    swiglu_backward_grad, ref=swiglu_backward_grad_ref,
                    tensors=["dout", "x", "probs", "scale", "grad_scale", "grad_amax"],
                    nan_args=["dout", "x", "probs", "scale", "grad_scale"]))  # (amax accumulates: the fold's rule)

    def swiglu_backward_copies_ref(a):  # (dx itself not written: its FP8 copies, dprobs and the value's copy)
        return swiglu_backward_grad_ref(a)[1:]

    def swiglu_backward_copies(a):
        _, dp, data_t, si, g = ops.moe.swiglu_backward_cast_fp8_grouped(
            a["dout"], a["x"], a["probs"], [3, 5], F8, scale=a["scale"], grad_fp8_dtype=F8,
            grad_scale=a["grad_scale"], grad_amax=a["grad_amax"], want_dx=a["want_dx"])
        return dp, data_t.float(), si, g[0].float(), g[1].float(), g[2], a["grad_amax"]

    S.append(OpSpec("swiglu_backward_cast_fp8_grouped_copies",
                    lambda d: {"dout": r(32, 16, device=d), "x": r(8, 32, device=d), "probs": torch.rand(8, device=d),
                               "scale": torch.tensor([2.0, 0.5], device=d),
                               "grad_scale": torch.tensor([4.0, 0.25], device=d), "grad_amax": torch.zeros(2, device=d),
                               "want_dx": False},
                    swiglu_backward_copies, ref=swiglu_backward_copies_ref,
                    tensors=["dout", "x", "probs", "scale", "grad_scale", "grad_amax"],
                    nan_args=["dout", "x", "probs", "scale", "grad_scale"],
                    extra=[("want_dx_int", lambda a: dict(a, want_dx=0), "value", ("want_dx",))]))

    def current_list(a):
        data, data_t, si, scale, amax = ops.moe.cast_fp8_current_list(a["xs"], F8)
        return [t.float() for t in data + data_t] + [si, scale, amax]

    S.append(OpSpec("cast_fp8_current_list",
                    lambda d: {"xs": [r(16, 32, device=d), r(16, 32, device=d)]},
                    current_list, tensors=["xs.0", "xs.1"], nan=False))
    # the quantizers' entries into outputs they made: no Python checks, the C entry's name each argument
    def cast_into_build(d):
        return dict(cast_build(d), out=torch.empty(4, 16, dtype=F8, device=d),
                    out_t=torch.empty(16, 4, dtype=F8, device=d), scale_inv=torch.empty(1, device=d))

    def cast_into(a):
        ops.quant.cast_fp8_into(a["x"], a["scale"], a["amax"], a["out"], a["out_t"], a["scale_inv"])
        return a["out"].float(), a["out_t"].float(), a["scale_inv"]

    S.append(OpSpec("cast_fp8_into", cast_into_build, cast_into,
                    ref=lambda a: (_fp8_ref(a["x"], a["scale"]), _fp8_ref(a["x"], a["scale"]).t(),
                                   1 / a["scale"]),
                    tensors=["x", "scale", "amax"], outs=["out", "out_t", "scale_inv"]))

    def cast_current_into(a):
        ops.quant.cast_fp8_current_into(a["x"], a["amax"], a["scale"], a["scale_inv"], a["out"], a["out_t"])
        return a["out"].float(), a["out_t"].float(), a["amax"], a["scale"], a["scale_inv"]

    S.append(OpSpec("cast_fp8_current_into", cast_into_build, cast_current_into,
                    tensors=["x", "amax", "scale"], outs=["out", "out_t", "scale_inv"]))
    S.append(OpSpec("transpose_fp8", lambda d: {"data": r(16, 32, device=d).to(F8)},
                    lambda a: ops.transpose_fp8(a["data"]).float(),
                    ref=lambda a: a["data"].double().reshape(-1, a["data"].shape[-1]).t(),
                    tensors=["data"], nan=False))
    S.append(OpSpec("dequantize_fp8",
                    lambda d: {"data": r(4, 16, device=d).to(F8), "scale_inv": torch.full((1,), 0.5, device=d)},
                    lambda a: ops.dequantize_fp8(a["data"], a["scale_inv"]),
                    ref=lambda a: a["data"].double() * a["scale_inv"], tensors=["data", "scale_inv"],
                    nan=False))
    S.append(OpSpec("fp8_scale_update",
                    lambda d: {"amax_history": r(4, 3, device=d).abs(), "scale": torch.ones(3, device=d),
                               "scale_inv": torch.ones(3, device=d),
                               "fp8_max": torch.full((3,), 448.0, device=d)},
                    lambda a: (ops.fp8_scale_update(a["amax_history"], a["scale"], a["scale_inv"], a["fp8_max"]),
                               a["amax_history"], a["scale"], a["scale_inv"])[1:],
                    tensors=["amax_history", "scale", "scale_inv", "fp8_max"]))
    S.append(OpSpec("fp8_compute_scale",
                    lambda d: {"amax": r(3, device=d).abs(), "scale": torch.ones(3, device=d),
                               "scale_inv": torch.ones(3, device=d)},
                    lambda a: (ops.fp8_compute_scale(a["amax"], a["scale"], a["scale_inv"], 448.0),
                               a["scale"], a["scale_inv"])[1:],
                    ref=lambda a: (lambda s: (s, 1 / s))(torch.where(
                        a["amax"].isfinite() & (a["amax"] > 0), 448.0 / a["amax"],
                        torch.ones((), dtype=torch.float64))),
                    tensors=["amax", "scale", "scale_inv"]))
    S.append(OpSpec("quantize_block_fp8", lambda d: {"x": r(4, 128, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_block_fp8(a["x"])), tensors=["x"]))
    S.append(OpSpec("quantize_block_fp8_128", lambda d: {"x": r(4, 128, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_block_fp8(a["x"], block_rows=128)),
                    tensors=["x"]))
    S.append(OpSpec("quantize_block_fp8_rowcol", lambda d: {"x": r(4, 128, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_block_fp8_rowcol(a["x"])), tensors=["x"]))
    S.append(OpSpec("quantize_block_fp8_weight", lambda d: {"w": r(128, 256, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_block_fp8_weight(a["w"])), tensors=["w"]))

    def btf_build(d):
        data, si = ops.quantize_block_fp8(r(128, 256), 128)
        return {"data": data.to(d), "scale_inv": si.to(d)}
    S.append(OpSpec("block_transpose_fp8", btf_build,
                    lambda a: tuple(t.float() for t in ops.block_transpose_fp8(a["data"], a["scale_inv"])),
                    tensors=["data", "scale_inv"], nan=False))

    def dqb_build(d):
        data, si = ops.quantize_block_fp8(r(4, 128))
        return {"data": data.to(d), "scale_inv": si.to(d)}
    S.append(OpSpec("dequantize_block_fp8", dqb_build,
                    lambda a: ops.dequantize_block_fp8(a["data"], a["scale_inv"]),
                    tensors=["data", "scale_inv"], nan=False))
    S.append(OpSpec("quantize_mxfp8", lambda d: {"x": r(4, 64, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_mxfp8(a["x"])), tensors=["x"]))

    def dqm_build(d):
        data, sc = ops.quantize_mxfp8(r(4, 64))
        return {"data": data.to(d), "scales": sc.to(d)}
    S.append(OpSpec("dequantize_mxfp8", dqm_build, lambda a: ops.dequantize_mxfp8(a["data"], a["scales"]),
                    tensors=["data", "scales"], nan=False))
    S.append(OpSpec("quantize_nvfp4", lambda d: {"x": r(4, 32, device=d)},
                    lambda a: tuple(t.float() for t in ops.quantize_nvfp4(a["x"])), tensors=["x"]))

    def dqn_build(d):
        data, bs, gsi = ops.quantize_nvfp4(r(4, 32))
        return {"data": data.to(d), "block_scales": bs.to(d), "global_scale_inv": gsi.to(d)}
    S.append(OpSpec("dequantize_nvfp4", dqn_build,
                    lambda a: ops.dequantize_nvfp4(a["data"], a["block_scales"], a["global_scale_inv"]),
                    tensors=["data", "block_scales", "global_scale_inv"], nan=False))

    # gemm
    S.append(OpSpec("gemm", lambda d: {"a": r(4, 8, device=d), "b": r(8, 3, device=d, seed=1)},
                    lambda a: ops.gemm(a["a"], a["b"], allow_tf32=False), ref=lambda a: a["a"] @ a["b"],
                    tensors=["a", "b"], tol=1e-4,
                    extra=[("k_mismatch", lambda a: dict(a, b=a["b"][:5]), "shape", ("a", "b")),
                           ("zero_m", lambda a: dict(a, a=a["a"][:0]), None, ("a",))]))
    S.append(OpSpec("gemm_transb", lambda d: {"a": r(4, 8, device=d), "b": r(3, 8, device=d, seed=1)},
                    lambda a: ops.gemm(a["a"], a["b"], transb=True, allow_tf32=False),
                    ref=lambda a: a["a"] @ a["b"].t(), tensors=["a", "b"], tol=1e-4))
    S.append(OpSpec("gemm_out", lambda d: {"a": r(4, 8, device=d), "b": r(8, 4, device=d, seed=1),
                                           "out": torch.zeros(4, 4, device=d)},
                    lambda a: ops.gemm(a["a"], a["b"], out=a["out"], allow_tf32=False),
                    ref=lambda a: a["a"] @ a["b"], tensors=["a", "b"], outs=["out"], tol=1e-4))
    S.append(OpSpec("gemm_accumulate", lambda d: {"a": r(4, 8, device=d), "b": r(8, 4, device=d, seed=1),
                                                  "out": r(4, 4, device=d, seed=2)},
                    lambda a: ops.gemm(a["a"], a["b"], out=a["out"], accumulate=True, allow_tf32=False),
                    ref=lambda a: a["a"] @ a["b"] + a["out"], tensors=["a", "b", "out"], tol=1e-4))
    S.append(OpSpec("gemm_bias", lambda d: {"a": r(4, 8, device=d), "b": r(8, 3, device=d, seed=1),
                                            "bias": r(3, device=d, seed=2)},
                    lambda a: ops.gemm(a["a"], a["b"], bias=a["bias"], allow_tf32=False),
                    ref=lambda a: a["a"] @ a["b"] + a["bias"], tensors=["a", "b", "bias"], tol=1e-4,
                    extra=[("bias_len", lambda a: dict(a, bias=a["bias"][:2]), "shape", ("bias",))]))
    # the FP8 GEMM modules' entry: quantized operands into an output the caller made, checked by C
    S.append(OpSpec("fp8_gemm_nt",
                    lambda d: {"a": r(16, 32, device=d).to(F8), "a_scale_inv": torch.full((1,), 0.5, device=d),
                               "b": r(16, 32, device=d, seed=1).to(F8),
                               "b_scale_inv": torch.full((1,), 2.0, device=d),
                               "out": torch.zeros(16, 16, dtype=torch.float32, device=d)},
                    lambda a: fp8_gemm_nt(a["a"], a["a_scale_inv"], None, a["b"], a["b_scale_inv"], None, a["out"]),
                    ref=lambda a: (a["a"].double() * a["a_scale_inv"].double())
                    @ (a["b"].double() * a["b_scale_inv"].double()).t(),
                    tensors=["a", "a_scale_inv", "b", "b_scale_inv"], outs=["out"], tol=1e-4, nan=False))

    # norms
    def ln_build(d):
        return {"x": r(4, 8, device=d), "weight": r(8, device=d, seed=1), "bias": r(8, device=d, seed=2)}
    S.append(OpSpec("layernorm_forward", ln_build,
                    lambda a: ops.layernorm_forward(a["x"], a["weight"], a["bias"]),
                    ref=lambda a: (_ln_ref(a["x"], a["weight"], a["bias"]), a["x"].mean(-1).reshape(-1),
                                   torch.rsqrt(a["x"].var(-1, unbiased=False) + 1e-5).reshape(-1)),
                    tensors=["x", "weight", "bias"], tol=1e-4,
                    extra=[("hidden_mismatch", lambda a: dict(a, weight=a["weight"][:6]), "shape", ("weight",)),
                           ("zero_rows", lambda a: dict(a, x=a["x"][:0]), None, ("x",))]))
    S.append(OpSpec("rmsnorm_forward", lambda d: {"x": r(4, 8, device=d), "weight": r(8, device=d, seed=1)},
                    lambda a: ops.rmsnorm_forward(a["x"], a["weight"]),
                    ref=lambda a: (_rms_ref(a["x"], a["weight"]),
                                   torch.rsqrt(a["x"].pow(2).mean(-1) + 1e-5).reshape(-1)),
                    tensors=["x", "weight"], tol=1e-4,
                    extra=[("hidden_mismatch", lambda a: dict(a, weight=a["weight"][:6]), "shape", ("weight",))]))

    def lnb_build(d):
        x, w = r(4, 8), r(8, seed=1)
        _, mean, rstd = ops.layernorm_forward(x, w, r(8, seed=2))
        return {"dy": r(4, 8, seed=3, device=d), "x": x.to(d), "mean": mean.to(d), "rstd": rstd.to(d),
                "weight": w.to(d)}
    S.append(OpSpec("layernorm_backward", lnb_build,
                    lambda a: ops.layernorm_backward(a["dy"], a["x"], a["mean"], a["rstd"], a["weight"]),
                    tensors=["dy", "x", "mean", "rstd", "weight"], tol=1e-4))

    def rmsb_build(d):
        x, w = r(4, 8), r(8, seed=1)
        _, rstd = ops.rmsnorm_forward(x, w)
        return {"dy": r(4, 8, seed=3, device=d), "x": x.to(d), "rstd": rstd.to(d), "weight": w.to(d)}
    S.append(OpSpec("rmsnorm_backward", rmsb_build,
                    lambda a: ops.rmsnorm_backward(a["dy"], a["x"], a["rstd"], a["weight"]),
                    ref=_rmsb_ref,
                    tensors=["dy", "x", "rstd", "weight"], tol=1e-4,
                    nan_args=("dy", "x", "weight")))  # an inf rstd no forward can give

    # activations and dropout
    for act in ("gelu", "relu", "silu", "swiglu"):
        S.append(OpSpec(f"act_forward_{act}", lambda d: {"x": r(4, 8, device=d)},
                        (lambda act: lambda a: ops.act_forward(a["x"], act))(act),
                        ref=(lambda act: lambda a: _act_ref(act)(a["x"]))(act), tensors=["x"], tol=1e-5))
    S.append(OpSpec("act_backward_gelu", lambda d: {"dy": r(4, 8, device=d, seed=1), "x": r(4, 8, device=d)},
                    lambda a: ops.act_backward(a["dy"], a["x"], "gelu"),
                    ref=lambda a: _grad(_act_ref("gelu"), a["x"], dy=a["dy"])[0], tensors=["dy", "x"],
                    extra=[("shape_mismatch", lambda a: dict(a, dy=a["dy"][:2]), "shape", ("dy", "x"))]))
    S.append(OpSpec("act_backward_swiglu", lambda d: {"dy": r(4, 4, device=d, seed=1), "x": r(4, 8, device=d)},
                    lambda a: ops.act_backward(a["dy"], a["x"], "swiglu"),
                    ref=lambda a: _grad(_act_ref("swiglu"), a["x"], dy=a["dy"])[0], tensors=["dy", "x"]))
    S.append(OpSpec("bias_dropout_add",
                    lambda d: {"x": r(4, 8, device=d), "bias": r(8, device=d, seed=1),
                               "residual": r(4, 8, device=d, seed=2)},
                    lambda a: ops.bias_dropout_add(a["x"], a["bias"], a["residual"], 0.0, seed=1)[0],
                    ref=lambda a: a["x"] + a["bias"] + a["residual"], tensors=["x", "bias", "residual"],
                    extra=[("residual_shape", lambda a: dict(a, residual=a["residual"][:2]), "shape",
                            ("residual", "x"))]))
    S.append(OpSpec("dropout_backward", lambda d: {"dy": r(4, 8, device=d)},
                    lambda a: ops.dropout_backward(a["dy"], 0.0, 1, dbias_dtype=torch.float32),
                    ref=lambda a: (a["dy"], a["dy"].reshape(-1, a["dy"].shape[-1]).sum(0)), tensors=["dy"],
                    tol=1e-5))

    # loss
    def ce_build(d):
        return {"logits": r(4, 10, device=d), "labels": torch.tensor([1, 2, -100, 9], device=d)}

    def ce_ref(a):
        lg, lb = a["logits"], a["labels"]
        return (F.cross_entropy(lg, lb, reduction="none", ignore_index=-100), torch.logsumexp(lg, -1))
    S.append(OpSpec("cross_entropy_forward", ce_build,
                    lambda a: ops.cross_entropy_forward(a["logits"], a["labels"]), ref=ce_ref,
                    tensors=["logits", "labels"], tol=1e-5,
                    extra=[("label_out_of_range", lambda a: dict(a, labels=a["labels"] * 0 + 10), "value",
                            ("labels",)),
                           ("label_negative", lambda a: dict(a, labels=a["labels"] * 0 - 7), "value",
                            ("labels",))]))

    def ceb_build(d):
        a = ce_build("cpu")
        _, lse = ops.cross_entropy_forward(a["logits"], a["labels"])
        return {"logits": a["logits"].to(d), "labels": a["labels"].to(d), "lse": lse.to(d),
                "grad_scale": torch.full((1,), 0.5, device=d)}

    def ceb_ref(a):  # the op's definition given lse: exp(logits - lse) - onehot
        lg, lb = a["logits"], a["labels"]
        g = torch.exp(lg - a["lse"][:, None]) - F.one_hot(lb.clamp(min=0), lg.shape[-1]).double()
        g = g * (lb != -100).double()[:, None]
        return g * a["grad_scale"]
    S.append(OpSpec("cross_entropy_backward", ceb_build,
                    lambda a: ops.cross_entropy_backward(a["logits"], a["labels"], a["lse"], a["grad_scale"]),
                    ref=ceb_ref, tensors=["logits", "labels", "lse", "grad_scale"], tol=1e-5))
    S.append(OpSpec("cross_entropy_backward_out", lambda d: dict(ceb_build(d), out=torch.zeros(4, 10, device=d)),
                    lambda a: ops.cross_entropy_backward(a["logits"], a["labels"], a["lse"], a["grad_scale"],
                                                         out=a["out"]),
                    ref=ceb_ref, tensors=["logits"], outs=["out"], tol=1e-5, names={"logits": ("labels",)}))

    # rope
    def rope_build(d):
        pos = torch.arange(5, dtype=torch.float32)[:, None]
        inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
        f = pos * inv
        freqs = torch.cat((f, f), -1).reshape(5, 1, 1, 8)
        return {"t": r(5, 2, 3, 8, device=d), "freqs": freqs.to(d)}
    S.append(OpSpec("rope_forward", rope_build, lambda a: ops.rope_forward(a["t"], a["freqs"]),
                    ref=lambda a: _rope_ref(a["t"], a["freqs"]), tensors=["t", "freqs"], tol=1e-5,
                    extra=[("freqs_short", lambda a: dict(a, freqs=a["freqs"][:3]), "shape", ("freqs",))]))
    S.append(OpSpec("rope_forward_out", lambda d: dict(rope_build(d), out=torch.zeros(5, 2, 3, 8, device=d)),
                    lambda a: ops.rope_forward(a["t"], a["freqs"], out=a["out"]),
                    ref=lambda a: _rope_ref(a["t"], a["freqs"]), tensors=["t"], outs=["out"], tol=1e-5))
    S.append(OpSpec("rope_backward", lambda d: {"grad_out": rope_build(d)["t"], "freqs": rope_build(d)["freqs"]},
                    lambda a: ops.rope_backward(a["grad_out"], a["freqs"]), tensors=["grad_out", "freqs"],
                    names={"grad_out": ("t",)}))

    def rope_thd_build(d):
        a = rope_build(d)
        return {"t": r(8, 3, 8, device=d), "freqs": a["freqs"],
                "cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32, device=d)}
    S.append(OpSpec("rope_thd", rope_thd_build,
                    lambda a: ops.rope_forward(a["t"], a["freqs"], tensor_format="thd", cu_seqlens=a["cu_seqlens"]),
                    tensors=["t", "freqs", "cu_seqlens"],
                    extra=[("cu_past_end", lambda a: dict(a, cu_seqlens=a["cu_seqlens"] + 1), "value",
                            ("cu_seqlens",)),
                           ("cu_decreasing", lambda a: dict(a, cu_seqlens=a["cu_seqlens"].flip(0)), "value",
                            ("cu_seqlens",))]))

    # optimizer ops
    S.append(OpSpec("multi_tensor_l2norm", lambda d: {"tensors": [r(3, device=d), r(4, 2, device=d, seed=1)]},
                    lambda a: ops.multi_tensor_l2norm(a["tensors"]),
                    ref=lambda a: torch.sqrt(sum(t.pow(2).sum() for t in a["tensors"])),
                    tensors=["tensors.0", "tensors.1"], names={"tensors.0": ("tensors",), "tensors.1": ("tensors",)}))

    def mts(a):
        ops.multi_tensor_scale(a["tensors"], a["scale"])
        return tuple(a["tensors"])
    S.append(OpSpec("multi_tensor_scale",
                    lambda d: {"tensors": [r(3, device=d), r(4, 2, device=d, seed=1)],
                               "scale": torch.full((1,), 0.5, device=d)},
                    mts, ref=lambda a: tuple(t * a["scale"].reshape(()) for t in a["tensors"]),
                    tensors=["tensors.0", "tensors.1", "scale"],
                    names={"tensors.0": ("tensors",), "tensors.1": ("tensors",)}))

    def adamw_build(d):
        return {"params": [r(3, device=d), r(4, 2, device=d, seed=1)],
                "grads": [r(3, device=d, seed=2), r(4, 2, device=d, seed=3)],
                "exp_avg": [torch.zeros(3, device=d), torch.zeros(4, 2, device=d)],
                "exp_avg_sq": [torch.zeros(3, device=d), torch.zeros(4, 2, device=d)]}

    def adamw(a):
        ops.multi_tensor_adamw(a["params"], a["grads"], a["exp_avg"], a["exp_avg_sq"], None, 1e-3, 0.9, 0.999,
                               1e-8, 0.01, 1)
        return tuple(a["params"]) + tuple(a["exp_avg"]) + tuple(a["exp_avg_sq"])
    S.append(OpSpec("multi_tensor_adamw", adamw_build, adamw,
                    tensors=["params.1", "grads.1", "exp_avg.1", "exp_avg_sq.1"],
                    names={"params.1": ("params",), "grads.1": ("grads",), "exp_avg.1": ("exp_avg",),
                           "exp_avg_sq.1": ("exp_avg_sq",)},
                    extra=[("grads_short", lambda a: dict(a, grads=a["grads"][:1]), "shape", ("grads",))]))

    # attention
    def attn_build(d):
        dt = torch.bfloat16 if d == "cuda" else torch.float32
        return {"q": r(2, 5, 2, 16, device=d, dtype=dt), "k": r(2, 5, 2, 16, device=d, seed=1, dtype=dt),
                "v": r(2, 5, 2, 16, device=d, seed=2, dtype=dt)}

    def sdpa_ref(a, causal=False):
        return _attn_ref(a["q"], a["k"], a["v"], causal)
    S.append(OpSpec("attention_forward", attn_build, lambda a: ops.attention_forward(a["q"], a["k"], a["v"])[0],
                    ref=sdpa_ref, tensors=["q", "k", "v"], tol=1e-4,
                    extra=[("head_dim_mismatch", lambda a: dict(a, k=a["k"][..., :8]), "shape", ("k", "q")),
                           ("batch_mismatch", lambda a: dict(a, v=a["v"][:1]), "shape", ("v", "q", "k"))]))
    S.append(OpSpec("attention_causal", attn_build,
                    lambda a: ops.attention(a["q"], a["k"], a["v"], attn_mask_type="causal"),
                    ref=lambda a: sdpa_ref(a, True), tensors=["q", "k", "v"], tol=1e-4,
                    cuda_nan_ref=lambda a: _attn_zero_weight_ref(a["q"], a["k"], a["v"], True)))

    def attn_backward_build(d):
        a = attn_build("cpu")
        out, lse = ops.attention_forward(a["q"], a["k"], a["v"])
        b = dict(a, dout=r(2, 5, 2, 16, seed=3), out=out, lse=lse)
        dt = torch.bfloat16 if d == "cuda" else torch.float32
        return {k: (v.to(d, dt) if k != "lse" else v.to(d)) for k, v in b.items()}
    S.append(OpSpec("attention_backward", attn_backward_build,
                    lambda a: ops.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"]),
                    tensors=["dout", "q", "k", "v", "out", "lse"], tol=1e-4))

    def attn_thd_build(d):
        dt = torch.bfloat16 if d == "cuda" else torch.float32
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=d)
        return {"q": r(8, 2, 16, device=d, dtype=dt), "k": r(8, 2, 16, device=d, seed=1, dtype=dt),
                "v": r(8, 2, 16, device=d, seed=2, dtype=dt), "cu_seqlens_q": cu, "cu_seqlens_kv": cu.clone()}
    S.append(OpSpec("attention_thd", attn_thd_build,
                    lambda a: ops.attention_forward(a["q"], a["k"], a["v"], qkv_format="thd",
                                                cu_seqlens_q=a["cu_seqlens_q"], cu_seqlens_kv=a["cu_seqlens_kv"],
                                                max_seqlen_q=5, max_seqlen_kv=5)[0],
                    tensors=["q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv"], tol=1e-4,
                    extra=[("cu_past_end", lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"] + 2), "value",
                            ("cu_seqlens_q",)),
                           ("cu_unsorted", lambda a: dict(a, cu_seqlens_kv=torch.tensor(
                               [0, 6, 3], dtype=torch.int32, device=a["q"].device)), "value", ("cu_seqlens_kv",))]))
    return S


# ---- modules --------------------------------------------------------------

class ModSpec:
    """A module and a valid input: ``build(device)`` returns (module, args
    dict); ``call(m, a)`` runs the forward; ``ref(m, a)`` computes it with
    torch (float64 parameters and inputs).  ``params``: parameters whose
    storage or bits the corpus breaks."""

    def __init__(self, name, build, call, ref=None, tensors=(), params=(), names=None, extra=(), tol=1e-4):
        self.name, self.build, self.call, self.ref = name, build, call, ref
        self.tensors, self.params, self.names = tuple(tensors), tuple(params), names or {}
        self.extra, self.tol = tuple(extra), tol
        self.outs, self.nan, self.devices, self.nan_args = (), True, ("cpu", "cuda"), None
        self.cuda_nan_ref = None


def _seeded(mk):
    def build(d):
        torch.manual_seed(0)
        return mk(d)
    return build


def _p(m, name):
    return getattr(m, name).detach().double()


# A module hands its tensors to ops, whose messages name the op's argument:
# Linear's weight is gemm's 'b', DotProductAttention's query_layer is 'q'.
GEMM_NAMES = {"weight": ("b",), "bias": ("bias",)}
# Linear's input (and MultiheadAttention's, through its Linear) is gemm's 'a'.
# (te.Linear refuses a strided input there, where TE's takes any strides.)
IN_GEMM = ("input", "inp", "x", "hidden_states", "a")
DPA_NAMES = {"query_layer": ("q",), "key_layer": ("k",), "value_layer": ("v",)}


def mod_specs():
    S = []
    IN = ("input", "inp", "x", "hidden_states")
    S.append(ModSpec("Linear", _seeded(lambda d: (te.Linear(8, 6, device=d), {"inp": rnd(4, 8, device=d)})),
                     lambda m, a: m(a["inp"]),
                     ref=lambda m, a: F.linear(a["inp"], _p(m, "weight"), _p(m, "bias")),
                     tensors=["inp"], params=["weight", "bias"], names=dict(GEMM_NAMES, inp=IN_GEMM)))
    S.append(ModSpec("Linear_3d", _seeded(lambda d: (te.Linear(8, 6, device=d), {"inp": rnd(2, 3, 8, device=d)})),
                     lambda m, a: m(a["inp"]),
                     ref=lambda m, a: F.linear(a["inp"], _p(m, "weight"), _p(m, "bias")),
                     tensors=["inp"], names={"inp": IN_GEMM}))
    S.append(ModSpec("LayerNorm", _seeded(lambda d: (te.LayerNorm(8, device=d), {"x": rnd(4, 8, device=d)})),
                     lambda m, a: m(a["x"]),
                     ref=lambda m, a: _ln_ref(a["x"], _p(m, "weight"), _p(m, "bias")),
                     tensors=["x"], params=["weight", "bias"],
                     names={"x": IN, "weight": ("gamma",), "bias": ("beta",)}))
    S.append(ModSpec("RMSNorm", _seeded(lambda d: (te.RMSNorm(8, device=d), {"x": rnd(4, 8, device=d)})),
                     lambda m, a: m(a["x"]), ref=lambda m, a: _rms_ref(a["x"], _p(m, "weight")),
                     tensors=["x"], params=["weight"], names={"x": IN, "weight": ("gamma",)}))

    def lnl_ref(m, a):
        h = _ln_ref(a["x"], _p(m, "layer_norm_weight"), _p(m, "layer_norm_bias"), m.eps)
        return F.linear(h, _p(m, "weight"), _p(m, "bias"))
    S.append(ModSpec("LayerNormLinear",
                     _seeded(lambda d: (te.LayerNormLinear(8, 6, device=d), {"x": rnd(4, 8, device=d)})),
                     lambda m, a: m(a["x"]), ref=lnl_ref, tensors=["x"],
                     params=["weight", "layer_norm_weight"],
                     names=dict(GEMM_NAMES, x=IN, layer_norm_weight=("gamma",))))

    def mlp_ref(m, a):
        h = _ln_ref(a["x"], _p(m, "layer_norm_weight"), _p(m, "layer_norm_bias"), m.eps)
        h = F.gelu(F.linear(h, _p(m, "fc1_weight"), _p(m, "fc1_bias")), approximate="tanh")
        return F.linear(h, _p(m, "fc2_weight"), _p(m, "fc2_bias"))
    S.append(ModSpec("LayerNormMLP",
                     _seeded(lambda d: (te.LayerNormMLP(8, 16, device=d), {"x": rnd(4, 8, device=d)})),
                     lambda m, a: m(a["x"]), ref=mlp_ref, tensors=["x"], params=["fc1_weight", "fc2_weight"],
                     names={"x": IN, "fc1_weight": ("b",), "fc2_weight": ("b",)}))

    def dpa_build(d):
        dt = torch.bfloat16 if d == "cuda" else torch.float32
        return te.DotProductAttention(2, 16, attn_mask_type="no_mask").to(d), {
            "query_layer": rnd(5, 2, 2, 16, device=d, dtype=dt), "key_layer": rnd(5, 2, 2, 16, device=d, seed=1, dtype=dt),
            "value_layer": rnd(5, 2, 2, 16, device=d, seed=2, dtype=dt)}

    def dpa_ref(m, a):  # sbhd -> bshd for _attn_ref, back to sbhd [s, b, h * d]
        # (not torch's CPU SDPA: with an inf in q it gave 16 NaN on the GPU machine, torch 2.11, and
        # 32 here, torch 2.15, for the same values; the explicit softmax gives 32 in both, as the kernels)
        q, k, v = (a[n].transpose(0, 1) for n in ("query_layer", "key_layer", "value_layer"))
        return _attn_ref(q, k, v).transpose(0, 1).reshape(5, 2, 32)
    S.append(ModSpec("DotProductAttention", _seeded(dpa_build),
                     lambda m, a: m(a["query_layer"], a["key_layer"], a["value_layer"]), ref=dpa_ref,
                     tensors=["query_layer", "key_layer", "value_layer"], names=DPA_NAMES))

    def dpa_pad_build(d):
        m, a = dpa_build(d)
        m = te.DotProductAttention(2, 16, attn_mask_type="padding", qkv_format="bshd").to(d)
        a = {k: v.transpose(0, 1).contiguous() for k, v in a.items()}
        a["attention_mask"] = torch.tensor([[False] * 5, [False] * 3 + [True] * 2], device=d)[:, None, None, :]
        return m, a
    S.append(ModSpec("DotProductAttention_padding", _seeded(dpa_pad_build),
                     lambda m, a: m(a["query_layer"], a["key_layer"], a["value_layer"],
                                    attention_mask=a["attention_mask"]),
                     tensors=["query_layer", "attention_mask"],
                     names=dict(DPA_NAMES, query_layer=("q", "k", "v", "query")),
                     extra=[("mask_len", lambda a: dict(a, attention_mask=a["attention_mask"][..., :3]), "shape",
                             ("attention_mask",)),
                            ("mask_float", lambda a: dict(a, attention_mask=a["attention_mask"].float()), "dtype",
                             ("attention_mask",)),
                            ("mask_batch", lambda a: dict(a, attention_mask=a["attention_mask"][:1]), "shape",
                             ("attention_mask",))]))
    S.append(ModSpec("MultiheadAttention",
                     _seeded(lambda d: (te.MultiheadAttention(32, 2, attention_dropout=0.0, device=d),
                                        {"hidden_states": rnd(5, 2, 32, device=d)})),
                     lambda m, a: m(a["hidden_states"]), tensors=["hidden_states"], params=["qkv.weight"],
                     names={"hidden_states": IN_GEMM, "qkv.weight": ("b",)}))
    S.append(ModSpec("TransformerLayer",
                     _seeded(lambda d: (te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                                            device=d),
                                        {"hidden_states": rnd(5, 2, 32, device=d)})),
                     lambda m, a: m(a["hidden_states"]), tensors=["hidden_states"], names={"hidden_states": IN}))
    S.append(ModSpec("apply_rotary_pos_emb",
                     lambda d: (None, dict(_rope_args(d))),
                     lambda m, a: te.apply_rotary_pos_emb(a["t"], a["freqs"]),
                     ref=lambda m, a: _rope_ref(a["t"], a["freqs"]), tensors=["t", "freqs"]))
    S.append(ModSpec("CrossEntropyLoss",
                     lambda d: (te.CrossEntropyLoss(), {"input": rnd(4, 10, device=d),
                                                        "target": torch.tensor([1, 2, -100, 9], device=d)}),
                     lambda m, a: m(a["input"], a["target"]),
                     ref=lambda m, a: F.cross_entropy(a["input"], a["target"]),
                     tensors=["input", "target"], names={"input": ("logits",), "target": ("labels",)},
                     extra=[("target_out_of_range", lambda a: dict(a, target=a["target"] * 0 + 10), "value",
                             ("target", "labels"))]))
    return S


def _rope_args(d):
    pos = torch.arange(5, dtype=torch.float32)[:, None]
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    f = pos * inv
    return {"t": rnd(5, 2, 3, 8, device=d), "freqs": torch.cat((f, f), -1).reshape(5, 1, 1, 8).to(d)}


# ---- mutations ------------------------------------------------------------

def strided_view(t):
    """Same shape and values, last dimension at stride 2 (None for a 0-d tensor)."""
    if t.dim() == 0:
        return None
    big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    big[..., ::2] = t
    return big[..., ::2]


def row_padded_view(t):
    """Same shape and values, rows padded (last dimension contiguous; None below 2 dimensions)."""
    if t.dim() < 2:
        return None
    big = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
    big[..., :t.shape[-1]] = t
    return big[..., :t.shape[-1]]


def offset_view(t):
    """Same values at storage offset 1 (misaligned by one element)."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    v = flat[1:].view(t.shape)
    v.copy_(t)
    return v


def _expanded(t):
    if t.dim() == 0 or t.shape[0] < 2:
        return None
    return t[:1].expand(t.shape)


def _shrunk(t):
    if t.numel() < 2:
        return None
    c = t.detach().clone()
    c.untyped_storage().resize_(c.untyped_storage().nbytes() // 2)
    return c


def _freed(t):
    if t.numel() < 1:
        return None
    c = t.detach().clone()
    c.untyped_storage().resize_(0)
    return c


def _nan(t):
    if not t.is_floating_point() or t.numel() < 2 or t.dtype in (F8, torch.float8_e5m2):
        return None
    c = t.clone()
    c.view(-1)[0] = math.nan
    c.view(-1)[-1] = math.inf
    return c


def _other_dtype(t, dtype):
    if t.dtype == dtype:
        return None
    if t.dtype in (F8, torch.float8_e5m2):
        return t.float().to(dtype)
    return t.to(dtype)


def _neg(t):
    if t.dtype in (F8, torch.float8_e5m2, torch.bool):
        return None
    return torch._neg_view(t.clone())


# name: (mutate, rule kinds allowed, reference kind: "canon", "torch" or None = must raise)
INPUT_MUTATIONS = {
    "float64": (lambda t: _other_dtype(t, torch.float64), ("dtype",), "canon"),
    "int32": (lambda t: _other_dtype(t, torch.int32 if t.is_floating_point() else torch.float32), ("dtype",),
              "canon"),
    "float16": (lambda t: _other_dtype(t, torch.float16) if t.dtype == torch.float32 else None, ("dtype",),
                "canon"),
    "bool": (lambda t: t != 0, ("dtype",), "canon"),
    "rank_plus": (lambda t: t.unsqueeze(0), ("rank", "shape"), "canon"),
    "rank_minus": (lambda t: t.reshape(-1) if t.dim() > 1 else t.reshape(-1)[0].clone() if t.numel() else None,
                   ("rank", "shape"), "canon"),
    "strided": (strided_view, ("contig",), "canon"),
    "rowpad": (row_padded_view, ("contig",), "canon"),
    "offset": (offset_view, ("align",), "canon"),
    "expanded": (_expanded, ("contig", "overlap"), "canon"),
    "neg_bit": (_neg, ("neg",), "canon"),
    "requires_grad": (lambda t: t.clone().requires_grad_(True) if t.is_floating_point() and
                      t.dtype not in (F8, torch.float8_e5m2) else None, (), "canon"),
    "numpy": (lambda t: t.numpy() if t.device.type == "cpu" and t.dtype in (torch.float32, torch.int64, torch.int32)
              else None, ("tensor",), "canon"),
    "meta": (lambda t: t.to("meta"), ("device",), None),
    "shrunk_storage": (_shrunk, ("storage",), None),
    "freed_storage": (_freed, ("storage",), None),
    "nan_inf": (_nan, ("nan",), "torch"),
    "zero_size": (lambda t: t[:0] if t.dim() >= 1 and t.shape[0] > 0 else None, ("shape", "rank"), "canon"),
}

CUDA_MUTATIONS = {"on_cpu": (lambda t: t.cpu() if t.is_cuda else None, ("device",), None)}


def _out_aliased(a, spec):
    src = next((n for n in spec.tensors if "." not in n and isinstance(a[n], torch.Tensor)), None)
    for o in spec.outs:
        if src and a[src].shape == a[o].shape and a[src].dtype == a[o].dtype:
            return dict(a, **{o: a[src]})
    return None


OUT_MUTATIONS = {
    "out_float64": (lambda t: torch.zeros(t.shape, dtype=torch.float64, device=t.device), ("dtype",), "canon"),
    "out_int32": (lambda t: torch.zeros(t.shape, dtype=torch.int32, device=t.device), ("dtype",), "canon"),
    "out_wrong_shape": (lambda t: torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device), ("shape", "rank"),
                        "canon"),
    "out_strided": (strided_view, ("contig",), "canon"),
    "out_expanded": (lambda t: t.reshape(-1)[:1].expand(t.reshape(-1).shape).view(t.shape) if t.numel() > 1
                     else None, ("overlap", "contig"), None),
    "out_neg_bit": (_neg, ("neg",), None),
    "out_shrunk_storage": (_shrunk, ("storage",), None),
    "out_meta": (lambda t: t.to("meta"), ("device",), None),
}


# Mutations that break a relation between arguments (same dtype, matching
# sizes): the message may name either side of it.
RELATIONAL = {"float16", "rank_plus", "rank_minus", "zero_size"}

# Names the C layer gives arguments that Python calls otherwise (the norm ops'
# weight and bias are gamma and beta there, cross_entropy_backward's out is
# dlogits): a message may use either.
C_NAMES = {"weight": ("gamma",), "bias": ("beta",), "out": ("dlogits",), "grad_out": ("t",)}


class Case:
    def __init__(self, name, spec, device, mutate, rules, ref_kind, names):
        self.name, self.spec, self.device = name, spec, device
        self.mutate, self.rules, self.ref_kind, self.names = mutate, rules, ref_kind, names

    def args(self):
        spec = self.spec
        if isinstance(spec, ModSpec):
            mod, a = spec.build(self.device)
            return mod, self.mutate(mod, a)
        return None, self.mutate(None, spec.build(self.device))


def _tensor_case(spec, device, path, label, fn, rules, ref_kind):
    def mutate(mod, a):
        v = fn(_get(a, path))
        if v is None:
            return None
        a = dict(a)
        _set(a, path, v)
        return a
    names = (path.split(".")[0],) + tuple(spec.names.get(path, ())) + C_NAMES.get(path, ())
    if label in RELATIONAL:
        names += tuple(p.split(".")[0] for p in spec.tensors + spec.outs)
        names += tuple(n for p in spec.outs for n in C_NAMES.get(p, ()))
        names += tuple(n for p in spec.tensors for n in spec.names.get(p, ()) + C_NAMES.get(p, ()))
        for p in getattr(spec, "params", ()):
            names += (p,) + tuple(spec.names.get(p, ())) + C_NAMES.get(p, ())
    return Case(f"{device}:{spec.name}:{path}:{label}", spec, device, mutate, rules, ref_kind, names)


def _param_case(spec, device, pname, label, fn, rules):
    def mutate(mod, a):
        obj = mod
        *parents, leaf = pname.split(".")
        for p in parents:
            obj = getattr(obj, p)
        v = fn(getattr(obj, leaf).detach())
        if v is None:
            return None
        if label == "neg_bit":
            getattr(obj, leaf).data = v
        else:
            with torch.no_grad():
                getattr(obj, leaf).data = v
        return a
    names = (pname.split(".")[-1], pname) + tuple(spec.names.get(pname, ()))
    return Case(f"{device}:{spec.name}:param.{pname}:{label}", spec, device, mutate, rules, None, names)


def _sole_tensor(spec, device):
    """The argument path of an op spec whose call takes exactly one tensor
    (no module, no output, no tensor list), else None."""
    if not isinstance(spec, OpSpec) or spec.outs:
        return None
    a = spec.build(device)
    tensors = [k for k, v in a.items() if isinstance(v, (torch.Tensor, list, tuple))]
    return tensors[0] if len(tensors) == 1 and tensors[0] in spec.tensors else None


def build_cases(device="cpu"):
    """Every case for ``device`` (whose mutation applies), in a fixed order."""
    cases = []
    muts = dict(INPUT_MUTATIONS, **(CUDA_MUTATIONS if device == "cuda" else {}))
    for spec in op_specs() + mod_specs():
        if device not in spec.devices:
            continue
        sole = _sole_tensor(spec, device)
        for path in spec.tensors:
            for label, (fn, rules, ref_kind) in muts.items():
                if label == "on_cpu" and path == sole:
                    # every tensor of the call is then on the CPU: a CPU call, whose result must be the
                    # CPU op's (a mixed-device call, the other on_cpu cases, must raise)
                    ref_kind = "canon"
                if label == "nan_inf" and (not spec.nan or spec.ref is None or
                                           (spec.nan_args is not None and path not in spec.nan_args)):
                    continue
                if label == "meta" and device == "cuda":
                    continue
                cases.append(_tensor_case(spec, device, path, label, fn, rules, ref_kind))
        for path in spec.outs:
            for label, (fn, rules, ref_kind) in OUT_MUTATIONS.items():
                cases.append(_tensor_case(spec, device, path, label, fn, rules, ref_kind))
            cases.append(Case(f"{device}:{spec.name}:{path}:out_aliases_input", spec, device,
                              (lambda spec: lambda mod, a: _out_aliased(a, spec))(spec), ("overlap",), "canon",
                              (path,)))
        for pname in getattr(spec, "params", ()):
            for label in ("shrunk_storage", "freed_storage", "neg_bit"):
                fn, rules, _ = INPUT_MUTATIONS[label]
                cases.append(_param_case(spec, device, pname, label, fn, rules))
            if device == "cuda":
                cases.append(_param_case(spec, device, pname, "on_cpu", CUDA_MUTATIONS["on_cpu"][0], ("device",)))
        for label, fn, rule, names in spec.extra:
            ref_kind = "canon" if rule is None else None
            rules = (rule,) if rule else ("shape",)
            names = tuple(names) + tuple(c for n in names for c in C_NAMES.get(n, ()))
            cases.append(Case(f"{device}:{spec.name}:{label}", spec, device,
                              (lambda fn: lambda mod, a: fn(dict(a)))(fn), rules, ref_kind, names))
        cases.append(Case(f"{device}:{spec.name}:valid", spec, device, lambda mod, a: a, (), "torch", ()))
    # keep only the cases whose mutation applies to the valid call
    kept = []
    for c in cases:
        try:
            _, a = c.args()
        except Exception:  # the mutation cannot be built (e.g. neg view of this dtype)
            continue
        if a is not None:
            kept.append(c)
    return kept


# ---- running one case -----------------------------------------------------

def _canon(v):
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta":
            return v
        return v.detach().resolve_neg().resolve_conj().contiguous().clone()
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v).copy())
    if isinstance(v, (list, tuple)):
        return type(v)(_canon(x) for x in v)
    return v


def _f64(v, device="cpu"):
    if isinstance(v, torch.Tensor):
        v = v.to(device)
        return v.double() if v.is_floating_point() else v
    if isinstance(v, (list, tuple)):
        return type(v)(_f64(x, device) for x in v)
    return v


def _as_list(v):
    if isinstance(v, (list, tuple)):
        return [x for x in v]
    return [v]


def _compare(got, exp, tol):
    """None if equal within tol (NaN where NaN), else a description."""
    gl, el = _as_list(got), _as_list(exp)
    if len(gl) != len(el):
        return f"{len(gl)} results, expected {len(el)}"
    for i, (g, e) in enumerate(zip(gl, el)):
        if e is None:
            continue
        if isinstance(g, np.ndarray):
            g = torch.from_numpy(g)
        if g is None or not isinstance(g, torch.Tensor):
            return f"result {i} is {type(g).__name__}, expected a tensor"
        g = g.detach().cpu().double().resolve_neg()
        e = torch.as_tensor(e).detach().cpu().double().resolve_neg()
        if g.numel() != e.numel():
            return f"result {i} has {g.numel()} elements, expected {e.numel()}"
        g, e = g.reshape(-1), e.reshape(-1)
        if not torch.equal(g.isnan(), e.isnan()):
            return f"result {i}: NaN at {g.isnan().sum().item()} places, expected {e.isnan().sum().item()}"
        ok = ~e.isnan()
        fin = ok & e.isfinite()
        if not torch.equal(g[ok & ~e.isfinite()], e[ok & ~e.isfinite()]):
            return f"result {i}: infinities differ"
        if fin.any():
            err = (g[fin] - e[fin]).abs().max().item()
            bound = tol * (1 + e[fin].abs().max().item())
            if not err <= bound:
                return f"result {i}: max abs error {err:.3g} > {bound:.3g}"
    return None


def _message_ok(exc, case):
    msg = str(exc)
    named = False
    for n in case.names:
        if len(n) <= 2:
            pat = r"['\"`(]" + re.escape(n) + r"['\"`\[)]"
        else:
            pat = r"\b" + re.escape(n) + r"\b"
        if re.search(pat, msg):
            named = True
    if not named:
        return f"message does not name {case.names}: {msg[:300]}"
    rules = case.rules or ()
    if rules and not any(re.search(RULES[r], msg, re.I) for r in rules):
        return f"message states no rule of {rules}: {msg[:300]}"
    return None


def _expected(case, mod, a):
    """('raise', None) or ('value', v, tol)."""
    spec = case.spec
    if case.ref_kind is None:
        return ("raise", None)
    try:
        ca = {k: _canon(v) for k, v in a.items()}
        if case.ref_kind == "torch" and spec.ref is not None:
            dev = "cpu"
            fa = {k: _f64(v, dev) for k, v in ca.items()}
            if isinstance(spec, ModSpec):
                return ("value", spec.ref(_mod_f64(mod) if mod is not None else None, fa))
            return ("value", spec.ref(fa))
        if isinstance(spec, ModSpec):
            with torch.no_grad():
                v = _detach(spec.call(mod, ca))
        else:
            v = _detach(spec.call(ca))
        if _defers_labels(case.device):
            # a bad label in the reference call (e.g. a neg_bit case's resolved labels) is reported
            # after the call returns: it makes the reference raise, and it is taken here so that the
            # case's own call is not handed this record in place of its own error
            ops.check_pending_errors()
        return ("value", v)
    except Exception:
        return ("raise", None)


def _defers_labels(device):
    """Whether a cross-entropy call on ``device`` reports a bad label after
    it returns (the deferred label check, seqfuse/ops/pending_errors.py):
    CUDA; tests add "cpu" with a stand-in kernel."""
    return device in device_checks.DEFERRED_DEVICES


def _mod_f64(mod):
    """The module's attributes, its parameters as float64 CPU tensors."""
    params = {n: p.detach().resolve_neg().double().cpu() for n, p in mod.named_parameters()}

    class View:
        def __getattr__(self, n):
            if n in params:
                return params[n]
            return getattr(mod, n)
    return View()


def _detach(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_detach(x) for x in v)
    return v


def run_case(case):
    """A dict: ok (bool), what happened."""
    if _defers_labels(case.device):  # a label recorded by an earlier case that raised something else first
        try:
            ops.check_pending_errors()
        except ValueError:
            pass
    mod, a = case.args()
    exp = _expected(case, mod, a)
    try:
        if isinstance(case.spec, ModSpec):
            got = case.spec.call(mod, a)
        else:
            got = case.spec.call(a)
        if case.device == "cuda":
            torch.cuda.synchronize()
        if _defers_labels(case.device):
            ops.check_pending_errors()  # a bad label the loss kernel recorded (the deferred label check)
    except ACCEPTED as e:
        bad = _message_ok(e, case)
        if case.rules == () and case.ref_kind == "torch":  # the valid call itself
            return {"ok": False, "what": f"valid call raised {type(e).__name__}: {e}"}
        return {"ok": bad is None, "what": bad or f"{type(e).__name__}: {str(e)[:200]}"}
    except Exception as e:
        return {"ok": False, "what": f"wrong exception type {type(e).__name__}: {str(e)[:300]}"}
    if exp[0] == "raise":
        return {"ok": False, "what": "ran where it must refuse (no reference result exists)"}
    tol = case.spec.tol
    if case.device == "cuda":  # bf16 attention inputs there; TF32 / other summation orders elsewhere
        sixteen = any(k in case.spec.name for k in ("ttention", "TransformerLayer"))
        tol = max(tol, 3e-2 if sixteen else 2e-3)
    bad = _compare(got, exp[1], tol)
    if bad is not None and case.device == "cuda" and case.name.endswith(":nan_inf") and \
            getattr(case.spec, "cuda_nan_ref", None) is not None:
        alt = case.spec.cuda_nan_ref({k: _f64(_canon(v)) for k, v in a.items()})
        if _compare(got, alt, tol) is None:
            return {"ok": True, "what": "result equals the zero-weight (torch SDPA) reference"}
        bad += "; nor the zero-weight (torch SDPA) reference"
    return {"ok": bad is None, "what": bad or "result equals the reference"}


def main(argv):
    device, first, last = argv[0], int(argv[1]), int(argv[2])
    torch.set_num_threads(1)
    cases = build_cases(device)
    timeout = float(os.environ.get("SEQFUSE_CASE_TIMEOUT", "30"))
    out = sys.stdout
    for c in cases[first:last]:
        out.write(f"S {c.name}\n")
        out.flush()
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            res = run_case(c)
        except Exception:
            res = {"ok": False, "what": "corpus error: " + traceback.format_exc()[-500:]}
        faulthandler.cancel_dump_traceback_later()
        out.write("R " + json.dumps(dict(res, name=c.name)) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
