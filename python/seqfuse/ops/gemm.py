"""Matrix products over cuBLASLt (csrc/gemm/), with fused epilogues and FP8.

``gemm(a, b, ...)`` computes, row-major as torch sees tensors::

    out = epilogue(alpha * op(a) @ op(b) + (out if accumulate else 0))

with ``op(x) = x.t()`` where ``transa`` / ``transb`` say so.  It is
``torch.matmul`` plus what training needs from the GEMM: a bias, GELU with
its pre-activation saved (``gelu_aux``), the GELU backward (``dgelu``), the
bias gradient (``bgrad``, ``dgelu_bgrad``), accumulation into an existing
float32 buffer (``accumulate=True``, for ``main_grad``), and FP8 operands
with their scale inverses read on the device.

On the CPU it runs seqfuse's reference GEMM (dequantized operands, float32
accumulation), which is also what the CUDA backend is tested against.
"""
import logging
import os

import torch

from .. import _C
from ._call import FAST_EXCHANGE, FP8_DLPACK, as_float, dense, detached, given_out, mark_written, stream_for
from .buffers import raw_stream


def tf32_of(allow_tf32, dtype):
    """A GEMM's TF32 choice: the caller's bool, or for None torch's matmul
    switch -- read only for float32 operands (other dtypes never use TF32,
    so the bf16 and FP8 paths skip the query on every call)."""
    if allow_tf32 is None:
        return dtype == torch.float32 and bool(torch.backends.cuda.matmul.allow_tf32)
    return bool(allow_tf32)


EPILOGUES = ("none", "bias", "gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux",
             "dgelu", "dgelu_bgrad", "bgrad")
_EPI = {name: i for i, name in enumerate(EPILOGUES)}
#: Epilogue names given by the user -> the C epilogue once a bias is known.
_WITH_BIAS = {"none": "bias", "bias": "bias", "gelu": "bias_gelu", "gelu_aux": "bias_gelu_aux",
              "bias_gelu": "bias_gelu", "bias_gelu_aux": "bias_gelu_aux"}
SCALINGS = {"tensor": 1, "block_1x128": 2, "block_128x128": 3}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8_CODE = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}  # sf_dtype values

#: cuBLASLt's recommended workspace on Hopper (32 MiB) plus room for its
#: split-k reductions; allocated once per (device, stream) and cached.
WORKSPACE_BYTES = 32 * 1024 * 1024 + 1024
_workspaces = {}

def workspace_for(device):
    """The cuBLASLt workspace of ``device``'s current stream (a uint8 tensor,
    allocated with torch the first time and kept): one per stream, so GEMMs
    running concurrently on two streams never share scratch memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, raw_stream(index))
    ws = _workspaces.get(key)
    if ws is None:
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
        _workspaces[key] = ws
    return ws


def _scaling_code(name, scale_inv, arg):
    if scale_inv is None:
        return 0
    if name is None:
        if scale_inv.numel() == 1:
            return 1
        raise ValueError(f"gemm: argument '{arg}' is not a single element; name its layout "
                         f"with {arg.replace('scale_inv', 'scaling')}='block_1x128' or "
                         f"'block_128x128'")
    try:
        return SCALINGS[name]
    except KeyError:
        raise ValueError(f"gemm: argument '{arg.replace('scale_inv', 'scaling')}' must be one "
                         f"of {sorted(SCALINGS)}, got {name!r}") from None


def gemm(a, b, *, transa=False, transb=False, out=None, out_dtype=None, bias=None,
         epilogue="none", aux=None, accumulate=False, a_scale_inv=None, b_scale_inv=None,
         a_scaling=None, b_scaling=None, fast_accum=False, allow_tf32=None, alpha=1.0,
         workspace=None, addend=None):
    """``epilogue(alpha * op(a) @ op(b) [+ out or + addend])`` as one cuBLASLt call.

    a, b: 2-D tensors, both float32 / float16 / bfloat16 (the same), or both
        float8 (e4m3fn, or one e5m2: the gradient GEMMs).  op(a) is [m, k],
        op(b) is [k, n].  Row- or column-major views are both fine.
    transa, transb: use a.t() / b.t().
    out: [m, n] row-major output (allocated when None); with
        ``accumulate=True`` its current values are added (beta = 1).
    addend: [m, n] in out's dtype and row stride, added in the epilogue
        (beta = 1 on another tensor: a residual added with no pass of its
        own); not with ``accumulate`` (which adds out's own values), and
        sharing no memory with out.
    out_dtype: dtype of a new ``out``: the operands' dtype by default,
        bfloat16 for float8 operands; float32 is always allowed.
    bias: [n] added before the activation (forward epilogues).
    epilogue: "none", "gelu" (tanh approximation), "gelu_aux" (also returns
        the pre-GELU values), "dgelu" (multiplies by GELU'(aux); give aux),
        "dgelu_bgrad" (also returns sum over rows of the result), "bgrad"
        (also returns sum over k of op(a), a bias gradient of length m).
        "bias" / "bias_gelu" / "bias_gelu_aux" are spelled by passing bias.
    aux: the pre-GELU input for "dgelu*", or a buffer for "gelu_aux".
    a_scale_inv, b_scale_inv: float32 device tensors for float8 operands:
        one element (per-tensor), or block scales, with a_scaling /
        b_scaling = "block_1x128" / "block_128x128" (layouts: see
        csrc/include/seqfuse_gemm.h).  float8 needs both operands K-major
        (a as [m, k], b as [n, k] with transb=True) and m, n, k multiples of
        16.
    fast_accum: float8 only: skip the periodic float32 promotion inside
        the tensor-core accumulation (faster; the forward GEMM uses it,
        gradient GEMMs should not).
    allow_tf32: float32 operands on TF32 tensor cores; None (the default)
        follows torch.backends.cuda.matmul.allow_tf32, torch's own switch
        for float32 matmuls (off unless the user turns it on), so a module
        swapped into a torch model computes float32 as the model did.

    Returns ``out``; with "gelu_aux" ``(out, aux)``; with "bgrad" /
    "dgelu_bgrad" ``(out, bias_grad)``.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        bad, name = (a, "a") if not isinstance(a, torch.Tensor) else (b, "b")
        raise TypeError(f"gemm: argument '{name}' must be a torch.Tensor, got {type(bad).__name__}")
    if epilogue is None:
        epilogue = "none"
    if epilogue not in _EPI:
        raise ValueError(f"gemm: argument 'epilogue' must be one of {EPILOGUES}, got {epilogue!r}")
    if bias is not None and epilogue in _WITH_BIAS:
        epilogue = _WITH_BIAS[epilogue]
    given_bias, given_aux = bias, aux  # (outputs under the bgrad / gelu_aux epilogues: checked as out= below)
    a, b, bias, aux, addend = detached(a), detached(b), detached(bias), detached(aux), detached(addend)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: arguments 'a' and 'b' must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    m = a.shape[1] if transa else a.shape[0]
    k = a.shape[0] if transa else a.shape[1]
    n = b.shape[0] if transb else b.shape[1]
    user_out = out
    if out is not None:
        out = given_out("gemm", out)
    else:
        if accumulate:
            raise ValueError("gemm: accumulate=True adds to the current values of 'out', so it "
                             "requires out (a new output would hold uninitialised memory)")
        if out_dtype is None:
            out_dtype = torch.bfloat16 if a.dtype in FP8_DTYPES else a.dtype
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    extra = user_extra = None
    if epilogue in ("gelu_aux", "bias_gelu_aux"):
        if aux is not None:  # an output here (dgelu reads it)
            user_extra, aux = given_aux, given_out("gemm", given_aux, "aux")
        else:
            aux_dtype = torch.bfloat16 if (a.dtype in FP8_DTYPES and out.dtype == torch.float32) else out.dtype
            aux = torch.empty((m, n), dtype=aux_dtype, device=a.device)
        extra = aux
    elif epilogue in ("bgrad", "dgelu_bgrad"):
        if bias is not None:  # an output here (the forward epilogues read it)
            user_extra, bias = given_bias, given_out("gemm", given_bias, "bias")
        else:
            bias_dtype = out.dtype
            if a.dtype in FP8_DTYPES:
                bias_dtype = torch.float16 if out.dtype == torch.float16 else torch.bfloat16
            bias = torch.empty(m if epilogue == "bgrad" else n, dtype=bias_dtype, device=a.device)
        extra = bias
    empty = m == 0 or n == 0 or k == 0
    if empty:
        if addend is not None and accumulate:
            raise ValueError("gemm: arguments 'accumulate' and 'addend' exclude each other (accumulate adds out's "
                             "own values; addend adds another tensor's)")
        # (torch calls an empty tensor of any strides contiguous; the C entry's layout checks read them)
        a, b = dense(a), dense(b)
    a_code = _scaling_code(a_scaling, a_scale_inv, "a_scale_inv")
    b_code = _scaling_code(b_scaling, b_scale_inv, "b_scale_inv")
    if workspace is None and a.is_cuda:
        workspace = workspace_for(a.device)
    a_fmt = b_fmt = 0
    ca, cb = a, b
    if not FP8_DLPACK and a.dtype in FP8_DTYPES:
        # this torch cannot export float8: pass uint8 views and name the format
        a_fmt, b_fmt = _FP8_CODE[a.dtype], _FP8_CODE.get(b.dtype, 0)
        ca, cb = a.view(torch.uint8), b.view(torch.uint8) if b_fmt else b
    # an empty product gets the same checks from the C entry, which then launches nothing: its
    # answer (zeros through the epilogue) is computed here
    _C.gemm(ca, cb, out, transa, transb, a_scale_inv, b_scale_inv, a_code, b_code, bias, aux,
            _EPI[epilogue], accumulate, fast_accum, tf32_of(allow_tf32, a.dtype),
            as_float("gemm", "alpha", alpha), workspace, a_fmt, b_fmt, addend, stream_for(a))
    if empty:
        _empty_product(a, transa, out, bias, aux, epilogue, accumulate, m, n, k, addend)
    if user_out is not None:
        mark_written(out)
        out = user_out
    if user_extra is not None:
        mark_written(extra)
        extra = user_extra
    return out if extra is None else (out, extra)


#: Scaling names of the FP8 operand triples -> the C codes (None: one scale per tensor).
_OPERAND_SCALING = {None: 1, "tensor": 1, "block_1x128": 2, "block_128x128": 3}

#: The FP8 GEMMs' token granularity: the weight gradient reduces over the tokens with K-major operands
#: whose row stride must be a multiple of 16 bytes, so FP8 operands carry their token rows padded to it.
FP8_ROW_MULTIPLE = 16


def fp8_gemm_nt(a, a_scale_inv, a_scaling, b, b_scale_inv, b_scaling, out, *, bias=None,
                accumulate=False, fast_accum=False, addend=None):
    """``out [m, n] (+)= a [m, k] @ b [n, k]^T (+ bias)``: :func:`gemm` with
    ``transb=True`` over two float8 operands that seqfuse's quantizers made
    (the FP8 GEMM modules' forward, input-gradient and weight-gradient
    products), into ``out`` the caller made (with ``accumulate`` its values
    are added).  ``a_scaling`` / ``b_scaling``: None or "tensor" (one scale
    per tensor), "block_1x128" or "block_128x128".  ``bias`` [n] in the output's
    bfloat16 / float16; ``addend`` [m, n] (out's dtype and row stride) added
    in the epilogue, as :func:`gemm`'s.  The hot path of those modules: only the ranks its
    shape arithmetic needs are checked here (the C entry checks every tensor
    and names it); an empty product goes through :func:`gemm`.  Returns
    ``out``."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        _fp8_gemm_nt_refusal(a, a_scaling, b, b_scaling)
    # (the other checks cost nothing on the happy path: the exceptions say what was wrong)
    try:
        a_code, b_code = _OPERAND_SCALING[a_scaling], _OPERAND_SCALING[b_scaling]
        m, k = a.shape
        n, _ = b.shape
    except (KeyError, TypeError, AttributeError, ValueError):
        _fp8_gemm_nt_refusal(a, a_scaling, b, b_scaling)
        raise
    if not (m and n and k):
        return gemm(a, b, transb=True, out=out, bias=bias, accumulate=accumulate, a_scale_inv=a_scale_inv,
                    b_scale_inv=b_scale_inv, a_scaling=a_scaling, b_scaling=b_scaling, fast_accum=fast_accum,
                    addend=addend)
    if bias is not None and bias.requires_grad:
        bias = bias.detach()
    workspace = workspace_for(a.device) if a.is_cuda else None
    a_fmt = b_fmt = 0
    if not FP8_DLPACK:
        # this torch cannot export float8: pass uint8 views and name the format
        a_fmt, b_fmt = _FP8_CODE[a.dtype], _FP8_CODE[b.dtype]
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    _C.gemm(a, b, out, False, True, a_scale_inv, b_scale_inv, a_code, b_code, bias, None,
            _EPI_NONE if bias is None else _EPI_BIAS, accumulate, fast_accum, False, 1.0, workspace, a_fmt, b_fmt,
            addend, None if FAST_EXCHANGE else stream_for(a))  # (stream_for's first test, without the call)
    return out


_EPI_NONE, _EPI_BIAS = _EPI["none"], _EPI["bias"]


def _fp8_gemm_nt_refusal(a, a_scaling, b, b_scaling):
    """The error of an fp8_gemm_nt call whose operands or scalings are not
    what it takes (raised here; returns where the cause is elsewhere)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"fp8_gemm_nt: arguments 'a' and 'b' must be torch.Tensors, got {type(a).__name__} "
                        f"and {type(b).__name__}")
    for name, mode in (("a_scaling", a_scaling), ("b_scaling", b_scaling)):
        if not isinstance(mode, (str, type(None))) or mode not in _OPERAND_SCALING:
            raise ValueError(f"fp8_gemm_nt: argument '{name}' must be one of None, 'tensor', 'block_1x128' "
                             f"or 'block_128x128', got {mode!r}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8_gemm_nt: arguments 'a' and 'b' must be 2-D, got {a.dim()}-D and {b.dim()}-D")


def _empty_product(a, transa, out, bias, aux, epilogue, accumulate, m, n, k, addend=None):
    """m, n or k is 0: cuBLASLt takes no such problem, and the answer needs no
    GEMM: the product is all zeros (k == 0), so only the epilogue remains
    (the C entry has checked every argument)."""
    if m == 0 or n == 0:
        if epilogue == "dgelu_bgrad":
            bias.zero_()  # a sum over no rows (or an empty vector)
        elif epilogue == "bgrad" and m > 0:  # n == 0 does not empty op(a)
            bias.copy_(a.float().sum(0 if transa else 1) if k > 0 else 0)
        return
    acc = (out.float() if accumulate else addend.float() if addend is not None
           else torch.zeros((m, n), dtype=torch.float32, device=out.device))
    if epilogue in ("bias", "bias_gelu", "bias_gelu_aux"):
        acc = acc + bias.float()
    if epilogue in ("gelu_aux", "bias_gelu_aux"):
        aux.copy_(acc)
    if epilogue in ("gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux"):
        acc = torch.nn.functional.gelu(acc, approximate="tanh")
    if epilogue in ("dgelu", "dgelu_bgrad"):
        x = aux.float().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(torch.nn.functional.gelu(x, approximate="tanh").sum(), x)
        acc = acc * g
    if epilogue == "dgelu_bgrad":
        bias.copy_(acc.sum(0))
    if epilogue == "bgrad":
        bias.zero_()  # sum over an empty k
    out.copy_(acc)


_log = logging.getLogger("seqfuse")


#: set_tuning's setting: None while the environment's SEQFUSE_GEMM_TUNE decides.
_tuning = [None]
#: Whether the last tuning_enabled() call found torch's deterministic algorithms on (the plans are dropped,
#: and the change logged, each time that turns on).
_deterministic_seen = [False]
_ENV_TUNE = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def _env_tuning():
    """SEQFUSE_GEMM_TUNE read: True, False, or None where unset or empty;
    any other value a ValueError naming the variable."""
    env = os.environ.get("SEQFUSE_GEMM_TUNE", "").strip().lower()
    if not env:
        return None
    if env not in _ENV_TUNE:
        raise ValueError(f"seqfuse gemm: environment variable SEQFUSE_GEMM_TUNE must be 1 / true / on / yes or "
                         f"0 / false / off / no, got {os.environ['SEQFUSE_GEMM_TUNE']!r}")
    return _ENV_TUNE[env]


def tuning_enabled():
    """Whether seqfuse's own callers time cuBLASLt's candidates for the
    GEMMs they tune (:func:`tune`; the fused loss's weight-gradient sum):
    :func:`set_tuning`'s setting, else SEQFUSE_GEMM_TUNE (1 / 0, true /
    false, on / off, yes / no), else on -- but off while
    torch.use_deterministic_algorithms(True) holds (a timed choice may
    differ between processes, and with it the last bits of a sum): when that
    turns on the plans are dropped, so the ones tuned before it ask the
    heuristic again, said once in the log each time.  Each process (each
    rank of a distributed run) times on its own, so ranks may keep
    different algorithms.  On an H100 the tuned sum made accelerate()'s FP8
    Llama 1B step 1.012x faster (session 64's A/B)."""
    if _tuning[0] is not None:
        return _tuning[0]
    env = _env_tuning()
    if env is not None:
        return env
    deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic != _deterministic_seen[0]:
        _deterministic_seen[0] = deterministic
        if deterministic:
            plan_cache_clear()
            _log.info("seqfuse gemm: no GEMM tuning while torch.use_deterministic_algorithms(True) holds (each "
                      "GEMM runs cuBLASLt's first choice, the tuned plans dropped; SEQFUSE_GEMM_TUNE=1 or "
                      "set_tuning(True) tunes anyway)")
    return not deterministic


#: A bad SEQFUSE_GEMM_TUNE is refused when seqfuse is imported, not at the first tuned GEMM mid-training.
_env_tuning()


def set_tuning(enabled):
    """Tuning on (True) or off (False) for this process, or back to the
    environment's SEQFUSE_GEMM_TUNE (None); returns the previous setting.
    The plan cache is dropped (a plan keeps the algorithm it was tuned to
    whatever the setting says later), so each problem's next call asks the
    heuristic again and, tuning on, its next tune times again."""
    if not (enabled is None or isinstance(enabled, bool)):
        raise TypeError(f"set_tuning: argument 'enabled' must be True, False or None, got {enabled!r}")
    previous = _tuning[0]
    _tuning[0] = enabled
    plan_cache_clear()
    return previous


#: The problems tune() has handed to the C entry since the plan cache was last dropped (plan_cache_clear):
#: a later call of one returns at once, with no C call (the C plan would say "tuned before" too).  A plan the
#: C table drops on its own when it fills (3,072 plans) is not tuned again.
_tuned = set()


def _alignment(ptr):
    """The largest power of two up to 256 dividing ``ptr`` (the alignments the C plan key tells apart)."""
    return min(256, ptr & -ptr) if ptr else 256


def tune(a, b, out, *, transa=False, transb=False, accumulate=False, allow_tf32=None, candidates=8):
    """Time up to ``candidates`` (1..16) of cuBLASLt's algorithms for the
    product :func:`gemm` computes with these arguments (no bias, epilogue,
    FP8 scales or addend) and keep the fastest for every later call of its
    plan (the C entry's rule: the heuristic's first choice stays unless
    another is at least 3 % faster).  The product runs several times into
    ``out``, so ``out`` holds none of the caller's values afterwards (with
    ``accumulate`` it was added into over and over): call it just before a
    call that writes ``out`` anew.  The host waits for the timed runs, once
    per plan; not under CUDA graph capture (a ValueError).  Returns
    (the heuristic's choice's microseconds a run, the kept one's, its rank
    in the heuristic's order) where something was timed, else None (CPU
    tensors, an empty product, a plan tuned before); the first tuning of a
    plan is logged."""
    if not all(isinstance(t, torch.Tensor) for t in (a, b, out)):
        raise TypeError("gemm_tune: arguments 'a', 'b' and 'out' must be torch.Tensors")
    if isinstance(candidates, bool) or not isinstance(candidates, int):
        raise TypeError(f"gemm_tune: argument 'candidates' must be an int, got {type(candidates).__name__}")
    a, b = detached(a), detached(b)
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm_tune: arguments 'a' and 'b' must be 2-D, got {a.dim()}-D and {b.dim()}-D")
    tf32 = tf32_of(allow_tf32, a.dtype)
    key = (a.device, a.dtype, out.dtype, tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), tuple(out.shape),
           out.stride(), bool(transa), bool(transb), bool(accumulate), tf32,
           _alignment(a.data_ptr()), _alignment(b.data_ptr()), _alignment(out.data_ptr()))
    if key in _tuned:
        return None
    out = given_out("gemm_tune", out)
    if a.numel() == 0 or b.numel() == 0:
        a, b = dense(a), dense(b)  # (the C entry's layout checks read an empty tensor's strides: as gemm's)
    timings = torch.empty(3, dtype=torch.float32)
    workspace = workspace_for(a.device) if a.is_cuda else None
    try:
        _C.gemm_tune(candidates, timings, a, b, out, transa, transb, None, None, 0, 0, None, None, _EPI["none"],
                     accumulate, False, tf32, 1.0, workspace, 0, 0, None, stream_for(a))
    finally:
        if a.is_cuda:
            mark_written(out)  # (the candidates' runs may have overwritten it, also where the call then failed)
    if a.is_cuda:
        _tuned.add(key)
    first, kept, rank = timings.tolist()
    if rank < 0:
        return None
    m, k = (a.shape[1], a.shape[0]) if transa else (a.shape[0], a.shape[1])
    n = b.shape[0] if transb else b.shape[1]
    _log.info("seqfuse gemm: timed cuBLASLt's candidates for [%d x %d] x [%d x %d]%s (%s): kept #%d, %.1f us a run "
              "against the heuristic's first choice's %.1f us",
              m, k, k, n, " + out" if accumulate else "", str(a.dtype).replace("torch.", ""), int(rank), kept,
              first)
    return first, kept, int(rank)


def plan_cache_size():
    """Number of cuBLASLt plans (descriptor + chosen algorithm) cached."""
    return _C.gemm_plan_cache_size()


def plan_cache_clear():
    """Forget every cached plan (the next call of each problem queries the
    cuBLASLt heuristic again, and a tune() of it times again)."""
    _C.gemm_plan_cache_clear()
    _tuned.clear()


def heuristic_queries():
    """How many times the cuBLASLt heuristic has been queried in this process."""
    return _C.gemm_heuristic_queries()
