"""Mixture-of-experts ops: the grouped GEMM (csrc/grouped/), the router and
the token permutation (csrc/moe/), each one strict entry over seqfuse._C.

Names and semantics follow Transformer Engine's PyTorch API where it has
them, so MoE code written for TE ports by changing the import:

    grouped_gemm(a, b, m_splits, ...)              G GEMMs, one call
    cast_fp8_grouped(x, m_splits, fp8_dtype, ...)  every expert's FP8 cast, one call
    cast_fp8_current_list(weights, fp8_dtype, ...) every expert weight's FP8 cast, one call
    grouped_gemm_device(a, b, offsets, ...)        the same GEMMs, row counts on the GPU (bf16)
    grouped_gemm_device_fp8(a, sa, b, sb, offsets) its FP8 form with row-wise scales
    fused_topk_with_score_function(logits, topk, ...)  -> (probs, routing_map)
    fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
                                                   -> (routing_map, scores)
    fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens,
                       num_experts, topk, coeff)   -> load-balancing loss
    moe_z_loss(logits, coeff)                      -> router z-loss
    moe_permute(inp, routing_map, num_out_tokens)  -> (out, row_id_map)
    moe_permute_with_probs(inp, probs, routing_map, num_out_tokens)
                                                   -> (out, permuted_probs, row_id_map)
    moe_unpermute(inp, row_id_map, merging_probs)  -> tokens back, weighted
    scaled_swiglu(x, probs)                        -> silu(gate) * up * probs, one kernel
    swiglu_cast_fp8_grouped(x, probs, m_splits, ...) cast_fp8_grouped of scaled_swiglu, one pass
    swiglu_backward_cast_fp8_grouped(dout, x, probs, m_splits, ...)
                                                   -> the SwiGLU's backward over padded blocks, with
                                                      the down projection's weight-gradient operand and
                                                      dx's FP8 copies, one pass

The router, loss and permutation functions are differentiable (autograd
Functions whose backward is the C kernel of each); grouped_gemm is a plain
op (GroupedLinear holds its autograd).  seqfuse's row_id_map is [tokens,
experts] int32: the row of each (token, expert) pair in the expert-sorted
buffer, -1 where the token is not routed there (TE's layout differs; pass
it back only to these functions).

Host synchronization: the permutation needs the number of rows it writes
on the host (to allocate them); with num_out_tokens=-1 it is read from the
routing map's per-expert counts (one device-to-host copy).  The grouped
GEMM takes host row counts (m_splits): one cuBLASLt call per group;
grouped_gemm_device takes them on the GPU (bfloat16, torch._grouped_mm's
kernel), which is how GroupedMLP's bfloat16 step runs without a host
synchronization.
"""

import logging
import operator
import os

import torch

from .. import _C
from ..common.notes import note_once
from ._call import (as_float, as_int, capability_of, dense, detached, given_out, mark_written,
                    require_fp8_dlpack, stream_for)
from .device_checks import check_storage
from .gemm import FP8_DTYPES, FP8_ROW_MULTIPLE, SCALINGS, tf32_of, workspace_for
from .quant import fp8_dtype_of

# dense (ops._call's) is exported here for the grouped modules' and quantizers' gradients
__all__ = ["dense", "grouped_gemm", "grouped_gemm_device", "grouped_gemm_device_fp8",
           "grouped_gemm_device_ends_fp8", "sm90_kernel_refusal", "device_split_offsets",
           "device_split_refusal", "cast_fp8_grouped", "cast_fp8_grouped_ends", "cast_fp8_current_list",
           "cast_fp8_current_stacked",
           "pad_row_id_map", "counts_to_host",
           "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
           "fused_moe_aux_loss", "moe_z_loss", "moe_row_id_map", "moe_permute",
           "moe_permute_with_probs", "moe_permute_by_row_id_map", "moe_unpermute", "scaled_swiglu",
           "swiglu_forward", "swiglu_backward", "swiglu_cast_fp8_grouped", "swiglu_backward_cast_fp8_grouped"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SCORES = {"softmax": 0, "sigmoid": 1}


def _tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    return t


def _float_tensor(op, name, t, ndim=None):
    t = _tensor(op, name, t)
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: argument '{name}' must be float32, float16 or bfloat16, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: argument '{name}' must be {ndim}-D, got {t.dim()}-D")
    return t.contiguous()


def _split_size(op, arg, v):
    """One host row count as an int (as_int's rules: an integer of any kind,
    or a whole real number; a fractional one is a ValueError, a bool a
    TypeError), naming ``arg``."""
    return as_int(op, None, v, what=f"{arg} (a row count)")


def host_splits(op, m_splits, arg="argument 'm_splits'"):
    """m_splits as a list of Python ints (``arg`` names it in messages).  A
    CPU tensor is read; a CUDA tensor is refused (its values would need a
    host sync: this route runs one cuBLASLt call per group, sized on the
    host; grouped_gemm_device is the route for counts on the GPU)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type != "cpu":
            raise NotImplementedError(
                f"{op}: {arg} is a {m_splits.device.type} tensor; this route runs one cuBLASLt call "
                "per group sized on the host: pass a list of ints (e.g. tokens_per_expert.tolist()), or "
                "use the device-side split route (grouped_gemm_device with device_split_offsets; "
                "GroupedLinear takes it for a CUDA m_splits in bfloat16)")
        if (m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool
                or m_splits.dim() > 1):
            raise TypeError(f"{op}: {arg} must be a 1-D integer tensor, got {m_splits.dim()}-D "
                            f"{m_splits.dtype}")
        check_storage(op, arg, m_splits)  # (tolist reads it on the host: a shrunk storage past its end)
        splits = [int(v) for v in m_splits.reshape(-1).tolist()]
    elif type(m_splits) in (list, tuple) and all(type(v) is int and 0 <= v < 2 ** 63 for v in m_splits):
        splits = list(m_splits)  # (in-range plain ints, what the modules hand over: as_int returns them as they are)
    else:
        try:
            values = list(m_splits)
        except TypeError:
            raise TypeError(f"{op}: {arg} must be an integer tensor or a sequence of ints, got "
                            f"{type(m_splits).__name__}") from None
        splits = [_split_size(op, arg, v) for v in values]
    if not splits:
        raise ValueError(f"{op}: {arg} must hold at least one group")
    if any(v < 0 for v in splits):
        raise ValueError(f"{op}: {arg} must hold sizes >= 0 (row counts >= 0, one per group), got {splits}")
    return splits


def _group_shape(op, name, x, trans):
    """(rows, cols) of op(x_g) for a listed or stacked operand."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{op}: argument '{name}' is an empty list")
        shape = tuple(_tensor(op, f"{name}[0]", x[0]).shape)
    else:
        shape = tuple(x.shape[1:])
    if len(shape) != 2:
        raise ValueError(f"{op}: each group of argument '{name}' must be 2-D, got shape {shape}")
    return (shape[1], shape[0]) if trans else shape


def _scales(op, name, scale_inv, scaling, G):
    """(scale argument for C, scaling code) of one operand."""
    if scale_inv is None:
        if scaling is not None:
            raise ValueError(f"{op}: argument '{name.replace('scale_inv', 'scaling')}' needs "
                             f"'{name}'")
        return None, 0
    mode = "tensor" if scaling is None else scaling
    if mode not in SCALINGS:
        raise ValueError(f"{op}: argument '{name.replace('scale_inv', 'scaling')}' must be one of "
                         f"{sorted(SCALINGS)}, got {scaling!r}")
    if isinstance(scale_inv, (list, tuple)):
        if len(scale_inv) != G:
            raise ValueError(f"{op}: argument '{name}' as a list must hold num_groups = {G} tensors, "
                             f"got {len(scale_inv)}")
        scales = [detached(t) for t in scale_inv]
        if mode == "tensor" and any(t.is_cuda and t.data_ptr() % _SCALE_ALIGN for t in scales):
            if any(t.dtype != torch.float32 or t.numel() != 1 for t in scales):  # (refused by C with its rule)
                return scales, SCALINGS[mode]
            scales = _aligned_scalars(torch.stack([t.reshape(()) for t in scales]))
        return scales, SCALINGS[mode]
    if mode != "tensor":
        raise ValueError(f"{op}: block scales ({mode}) go per group: pass '{name}' as a list of "
                         f"num_groups tensors")
    t = detached(_tensor(op, name, scale_inv))
    if t.is_cuda and t.dtype == torch.float32 and (t.numel() > 1 and not _spaced_scalars(t)
                                                   or t.numel() == 1 and t.data_ptr() % _SCALE_ALIGN):
        return _aligned_scalars(t.reshape(-1)), SCALINGS[mode]  # (group g's scale would sit 4 g bytes in)
    return t, SCALINGS[mode]


def _spaced_scalars(t):
    """Whether the 1-D per-group scales ``t`` already sit _SCALE_ALIGN bytes
    apart from an aligned start (cast_fp8_grouped's scale inverses)."""
    return (t.dim() == 1 and t.stride(0) > 0 and (t.stride(0) * 4) % _SCALE_ALIGN == 0
            and t.data_ptr() % _SCALE_ALIGN == 0)


#: Byte alignment of each per-tensor scale the grouped GEMM hands cuBLASLt.  On the H200
#: (cuBLASLt 13.1) an FP8 GEMM whose scale pointer sat 4 or 8 bytes into a tensor failed with
#: CUBLAS_STATUS_NOT_SUPPORTED, while seqfuse's Linear, whose scales are allocations of their own,
#: runs; 256 bytes is the caching allocator's granularity, past any rule cuBLASLt may have.
_SCALE_ALIGN = 256
_SCALE_STEP = _SCALE_ALIGN // 4  # float32 elements between two spaced scales


def _spaced_scale_inv(G, device):
    """G float32 scale inverses, 256 bytes apart: a [G] view of a [G, 64]
    buffer (what the grouped casts write and the grouped GEMM takes)."""
    return torch.empty((G, _SCALE_STEP), dtype=torch.float32, device=device)[:, 0]


def _aligned_scalars(values):
    """The float32 scalars ``values`` [G] as one 1-D tensor whose elements sit
    256 bytes apart from an aligned start (one small copy): each group's scale
    at its own aligned address, handed to C as one tensor (the C entry steps
    through it by its stride), not G views imported one by one."""
    G = values.numel()
    buf = torch.zeros((G, _SCALE_STEP), dtype=torch.float32, device=values.device)
    buf[:, 0] = values.reshape(G).float()
    return buf[:, 0]


MAX_LANES = _C.GROUPED_MAX_LANES  # (SF_GROUPED_MAX_LANES)


def _lanes(op, lanes):
    """The C entry's lanes: 0 (None: its own choice) or 1 to MAX_LANES.
    ``lanes=None`` takes SEQFUSE_GROUPED_LANES when set (0 = the C entry's
    choice, 1 = one stream, 2-8 = that many), read at every call so a
    benchmark can compare settings in one process."""
    if lanes is None:
        env = os.environ.get("SEQFUSE_GROUPED_LANES")
        if not env:
            return 0
        try:
            lanes = int(env)
        except ValueError:
            raise ValueError(f"{op}: environment variable SEQFUSE_GROUPED_LANES must be an integer from 0 to "
                             f"{MAX_LANES}, got {env!r}") from None
        if not 0 <= lanes <= MAX_LANES:
            raise ValueError(f"{op}: environment variable SEQFUSE_GROUPED_LANES must be from 0 to {MAX_LANES}, "
                             f"got {lanes}")
        return lanes
    try:
        if isinstance(lanes, bool):
            raise TypeError
        lanes = operator.index(lanes)
    except TypeError:
        raise TypeError(f"{op}: argument 'lanes' must be an int or None, got {type(lanes).__name__}") from None
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"{op}: argument 'lanes' must be from 1 to {MAX_LANES} (concurrent CUDA "
                         f"streams), got {lanes}")
    return lanes


_log = logging.getLogger("seqfuse")

KERNELS = {"auto": 0, "cublaslt": 1, "sm90": 2}  # sf_grouped_kernel


def _kernel(op, kernel):
    """The C entry's kernel code of ``kernel`` (None: SEQFUSE_GROUPED_KERNEL, else "auto").
    The variable takes "auto" or "cublaslt" only: it reaches every grouped
    GEMM of a model, whose backward products the sm90 kernel does not take."""
    if kernel is None:
        env = os.environ.get("SEQFUSE_GROUPED_KERNEL") or "auto"
        if env not in ("auto", "cublaslt"):
            raise ValueError(f"{op}: environment variable SEQFUSE_GROUPED_KERNEL must be 'auto' or 'cublaslt' "
                             f"(kernel='sm90' is a per-call argument), got {env!r}")
        return KERNELS[env]
    code = KERNELS.get(kernel) if isinstance(kernel, str) else None
    if code is None:
        raise ValueError(f"{op}: argument 'kernel' must be one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
    return code


def grouped_gemm(a, b, m_splits, *, transa=False, transb=False, out=None, out_dtype=None, bias=None,
                 bgrad=False, accumulate=False, a_scale_inv=None, b_scale_inv=None, a_scaling=None,
                 b_scaling=None, fast_accum=False, allow_tf32=None, workspace=None, lanes=None, kernel=None):
    """Per group g: ``out_g = op(a_g) @ op(b_g)`` (+ bias_g), G GEMMs in one call.

    Each of a, b, out is one 2-D tensor split by m_splits along dim 0 (the
    tokens, sorted by expert), or the G groups themselves: a list of 2-D
    tensors (one per expert) or a 3-D [G, rows, cols] tensor.  When all
    three are groups (FP8's weight gradient over per-expert transposed
    copies), m_splits gives G and each group's sizes come from its tensors.  The three
    products of y_g = x_g W_g^T (+ bias_g) are

        forward  grouped_gemm(x, weights, m_splits, transb=True, bias=biases)
        dgrad    grouped_gemm(dy, weights, m_splits)
        wgrad    grouped_gemm(dy, x, m_splits, transa=True[, bgrad=True])

    m_splits: G row counts (ints; a CPU tensor is read).  Empty groups are
        fine: their rows do not exist, or (wgrad) their product is zero.
    out: allocated when None: [sum(m_splits), n] when a's rows are split
        (not transposed), else a [G, m, n] tensor; a given out may be a list
        (``accumulate=True`` adds into it: main_grad buffers).
    bias: G bias vectors (list or [G, n]) added in the forward; with
        ``bgrad=True`` the wgrad also returns the bias gradients ([G, m],
        allocated when bias is None, or written into the given list).
    allow_tf32: float32 operands on TF32 tensor cores; None follows
        torch.backends.cuda.matmul.allow_tf32 (as ops.gemm).
    a_scale_inv, b_scale_inv: float8 operands' float32 scale inverses: one
        tensor of G elements (one per group) or 1 (per-tensor scaling), or
        a list of G tensors, group g's as seqfuse.ops.gemm takes them under
        a_scaling / b_scaling ("tensor", "block_1x128", "block_128x128";
        block scales need the list form).
    lanes: on CUDA, the number of streams the groups' GEMMs run on side by
        side (1: one after another on the current stream; 2 to 8: that many
        side streams forked from the current one and joined back into it,
        each group on the least loaded, each with 1/lanes of the workspace
        and, when the lanes' groups fit the GPU side by side, GEMM
        algorithms chosen for 1/lanes of the SMs).  Many small experts
        leave most of the GPU idle one at a time.  None: as many lanes as
        the SMs hold the average group's 128 x 128 output tiles side by
        side, at most 4, and one stream when fewer than two fit
        (Mixtral-small on an H100: 4 for 64 experts' down projection, one
        stream at 8 experts, where lanes cost its training step 3-11 %).  The current
        stream sees the call as one ordered step either way (CUDA graphs
        capture it); listed outputs that share memory run on it alone, as
        do the calls of a ninth and later stream to use lanes on a device
        (each stream keeps its own lane streams); the CPU ignores lanes.
    kernel: on CUDA, "auto" (None: SEQFUSE_GROUPED_KERNEL when set, "auto"
        or "cublaslt", else "auto"), "cublaslt" or "sm90".  "sm90" is seqfuse's persistent
        Hopper kernel, every group's output tiles in one launch (so the
        groups share the GPU's waves, and the call costs one launch of host
        work): the forward form only (a and out split, b a list or [G, n,
        k], transb=True, no bias, no accumulate, at most 64 groups),
        bfloat16 x bfloat16, or FP8 with per-tensor scales: e4m3 x e4m3, or
        e5m2 x e4m3 (the HYBRID format's input gradient), with
        fast_accum=True or False (False: each 128-long block of k summed
        apart and added into float32, in 128 x 128 tiles), to a bfloat16
        out; k and n multiples of 16 bytes.  "auto" takes it where the call
        fits and it measured faster on an H100: FP8 with fast accumulation
        (10 of 12 Mixtral-small rows; it lost 16 experts' balanced up
        projection by about 12 %), FP8 with split accumulation where k is at
        most 4,096 or there are more than 16 groups (the input gradients: it
        ran 8 experts at k = 7,168 at 0.78-0.90x cuBLASLt's fast_accum=0,
        elsewhere 1.04-1.72x), and bf16 where the average group has at most two waves
        of the SMs in 128 x 256 output tiles (every Mixtral-small down projection, the up
        projection at 64 experts; larger groups ran faster one cuBLASLt
        call each) and otherwise runs one cuBLASLt call per group
        (with lanes), logging once, for a call of the kernel's form, why it
        could not take it (logger "seqfuse", on Hopper); "sm90" refuses a
        call it cannot take with the rule.
    Returns out, or (out, bias_grads) with bgrad.
    """
    op = "grouped_gemm"
    lanes = _lanes(op, lanes)
    kernel_code = _kernel(op, kernel)
    splits = host_splits(op, m_splits)
    G = len(splits)
    a_scale_inv, a_code = _scales(op, "a_scale_inv", a_scale_inv, a_scaling, G)
    b_scale_inv, b_code = _scales(op, "b_scale_inv", b_scale_inv, b_scaling, G)
    a = [detached(t) for t in a] if isinstance(a, (list, tuple)) else detached(_tensor(op, "a", a))
    b = [detached(t) for t in b] if isinstance(b, (list, tuple)) else detached(_tensor(op, "b", b))
    first = a[0] if isinstance(a, list) else a
    if first.dtype in FP8_DTYPES:
        require_fp8_dlpack(op)
    written = ()
    grads = returned = None
    if out is None:
        if accumulate:
            raise ValueError(f"{op}: accumulate=True adds to the current values of 'out', so it "
                             "requires out")
        dtype = out_dtype or (torch.bfloat16 if first.dtype in FP8_DTYPES else first.dtype)
        a_split = isinstance(a, torch.Tensor) and a.dim() == 2
        b_split = isinstance(b, torch.Tensor) and b.dim() == 2
        n = (b.shape[0] if transb else b.shape[1]) if b_split else _group_shape(op, "b", b, transb)[1]
        if a_split and not transa:
            out = torch.empty((a.shape[0], n), dtype=dtype, device=first.device)
        else:
            m = (a.shape[1] if transa else a.shape[0]) if a_split else _group_shape(op, "a", a, transa)[0]
            out = torch.empty((G, m, n), dtype=dtype, device=first.device)
    elif isinstance(out, (list, tuple)):
        returned = list(out)  # the caller's tensors, as torch's out= functions return them
        out = [given_out(op, t, f"out[{g}]") for g, t in enumerate(out)]
        written = out
    else:
        written = (given_out(op, out),)  # (C writes this; out itself is returned, as torch's out= functions do)
    if bgrad:
        if bias is None:
            m = out[0].shape[0] if isinstance(out, list) else out.shape[-2]
            bias = torch.empty((G, m), dtype=(out[0] if isinstance(out, list) else out).dtype,
                               device=first.device)
        grads = bias
    elif isinstance(bias, (list, tuple)):
        bias = [detached(t) for t in bias]
    elif bias is not None:
        bias = detached(_tensor(op, "bias", bias))
    if workspace is None and first.is_cuda:
        workspace = workspace_for(first.device)
    c_out = written[0] if written and isinstance(out, torch.Tensor) else out
    note = _C.grouped_gemm(a, b, c_out, splits, bool(transa), bool(transb), a_scale_inv, b_scale_inv, a_code,
                           b_code, bias, bool(bgrad), bool(accumulate), bool(fast_accum),
                           tf32_of(allow_tf32, first.dtype), workspace, lanes, kernel_code, stream_for(first))
    if note is not None and kernel_code == 0 and first.is_cuda and capability_of(first.device) == (9, 0):
        note_once(_log, "seqfuse grouped_gemm: one cuBLASLt call per group, not the sm90 kernel: %s", note)
    if written:
        mark_written(*written)
    if returned is not None:
        out = returned
    return out if grads is None else (out, grads)


def device_split_offsets(counts, total, allow_fewer=False, routed=False):
    """The end offsets of G row groups, int32 [G] on counts' device, from the
    row counts ``counts`` (an integer tensor [G] on the GPU), computed there:
    nothing waits on the host.  Whether they add up to ``total`` (the split
    operand's rows; with ``allow_fewer`` at most ``total``: the rows past
    the last group belong to none, and a product leaves them unwritten) is
    checked on the device as well (torch._assert_async): a mismatch stops
    the next kernel of the stream with a device-side assertion naming
    m_splits, not a read past the operand (an assertion leaves the CUDA
    context unusable: the host-count route raises a ValueError instead).
    ``routed``: the counts are moe_row_id_map's of a routing map in which
    every token picks the same number of experts and ``total`` is that
    number times the tokens (GroupedMLP's own router): they hold the rule by
    construction, and the checks' four kernels are left out; counts that
    break it are then not caught here (a product would leave the rows past
    the last offset unwritten), so pass it only for such counts."""
    if not isinstance(routed, bool):
        raise TypeError(f"device_split_offsets: argument 'routed' must be a bool, got {type(routed).__name__}")
    op = "grouped_gemm_device"
    counts = _tensor(op, "m_splits", counts)
    if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise TypeError(f"{op}: argument 'm_splits' must be a 1-D integer tensor, got {counts.dim()}-D "
                        f"{counts.dtype}")
    if counts.numel() == 0:
        raise ValueError(f"{op}: argument 'm_splits' must hold at least one group")
    if total >= 2 ** 31:
        raise ValueError(f"{op}: the split operand has {total} rows; the device-split route takes fewer "
                         "than 2**31 (int32 offsets)")
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    if routed:
        return offsets
    torch._assert_async((counts >= 0).all(), f"{op}: argument 'm_splits' must hold row counts >= 0 (checked on "
                        "the device)")
    if allow_fewer:
        torch._assert_async(offsets[-1] <= total,
                            f"{op}: argument 'm_splits' must add up to at most the split operand's {total} rows "
                            "(checked on the device)")
    else:
        torch._assert_async(offsets[-1] == total,
                            f"{op}: argument 'm_splits' must add up to the split operand's {total} rows "
                            "(checked on the device)")
    return offsets


def device_split_refusal(x, dtype, features, fp8=False):
    """Why rows ``x`` computed in ``dtype`` against weights of ``features``
    (their in and out sizes) cannot take the device-split route
    (grouped_gemm_device; with ``fp8``, grouped_gemm_device_fp8 for the
    forward and input-gradient products), or None where they can."""
    if fp8:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return f"this torch ({torch.__version__}) has no torch._scaled_grouped_mm"
        if any(int(f) % 16 for f in features):
            return f"the device-split FP8 route needs feature sizes that are multiples of 16, got {tuple(features)}"
    if not x.is_cuda:
        return "the input is not on a CUDA device"
    if x.numel() == 0:
        return "the input has no rows"
    if dtype != torch.bfloat16:
        return f"the device-split route computes in bfloat16, this call in {dtype}"
    if any(int(f) % 8 for f in features):
        return f"the device-split route needs feature sizes that are multiples of 8, got {tuple(features)}"
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    cap = capability_of(x.device)
    if cap != (9, 0):
        # elsewhere torch runs a fallback that reads the offsets on the host (or, on 10.x, a kernel
        # whose empty groups' weight gradients are not zero: pytorch issue 172439)
        return (f"the device-split route runs torch._grouped_mm's Hopper kernel (compute capability 9.0), this "
                f"GPU is {cap[0]}.{cap[1]}")
    return None


def sm90_kernel_refusal(device):
    """Why seqfuse's persistent Hopper grouped kernel (the one route that reads
    the groups' ends on the device: grouped_gemm_device(kernel="sm90"),
    grouped_gemm_device_ends_fp8) cannot run on ``device``, or None where it
    can: C's answer (compute capability 9.0 and this build's sm_90a code,
    asked of the device once)."""
    if device.type != "cuda":
        return "the tensors are not on a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _C.grouped_sm90_unfit(index)


def grouped_gemm_device_ends_fp8(a, a_scale_inv, b, b_scale_inv, offsets):
    """The FP8 forward product with the groups' ends on the device:
    out [M, N] (bfloat16) with out_g = a_g @ b_g^T * a_scale_inv[g] *
    b_scale_inv[g] for a [M, K] float8_e4m3fn split by ``offsets`` (the
    groups' end rows, int32 [G], :func:`device_split_offsets`), b [G, N, K]
    float8_e4m3fn, the scale inverses float32 [G] (any element stride).
    Per-tensor scales per group (delayed or current scaling's), not the
    row-wise ones of :func:`grouped_gemm_device_fp8`; fast accumulation.
    seqfuse's sm90 kernel only (_C.grouped_gemm_device_ends: compute
    capability 9.0, K a multiple of 16, N of 8); the rows past the last end
    are not written; a call it cannot take is refused with its rule."""
    op = "grouped_gemm_device_ends_fp8"
    a, b = detached(_tensor(op, "a", a)), detached(_tensor(op, "b", b))
    offsets = _offsets_arg(op, offsets)
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{op}: argument '{name}' must be float8_e4m3fn, got {t.dtype}")
    if a.dim() != 2 or b.dim() != 3 or b.shape[0] != offsets.shape[0]:
        raise ValueError(f"{op}: takes a [M, K], b [G, N, K] and offsets [G], got {tuple(a.shape)}, "
                         f"{tuple(b.shape)} and {tuple(offsets.shape)}")
    return _device_ends(a, b, offsets, a_scale_inv, b_scale_inv)


def _device_ends(a, b, offsets, a_scale_inv, b_scale_inv):
    """out [M, N] bfloat16 of _C.grouped_gemm_device_ends (the sm90 kernel
    reading the groups' ends on the device) for checked a [M, K], b
    [G, N, K] and offsets; FP8 with the scale inverses, bfloat16 without."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    _C.grouped_gemm_device_ends(dense(a), b, dense(offsets), a_scale_inv, b_scale_inv, out, stream_for(a))
    return out


def _offsets_arg(op, offsets):
    """The device-split products' ``offsets`` argument, checked: a 1-D int32 tensor."""
    offsets = _tensor(op, "offsets", offsets)
    if offsets.dtype != torch.int32 or offsets.dim() != 1:
        raise TypeError(f"{op}: argument 'offsets' must be a 1-D int32 tensor (device_split_offsets), got "
                        f"{offsets.dim()}-D {offsets.dtype}")
    return offsets


def grouped_gemm_device(a, b, offsets, *, transa=False, transb=False, kernel=None):
    """:func:`grouped_gemm` with the row counts left on the GPU: the device-split
    route.  ``offsets`` are the groups' end rows (:func:`device_split_offsets`),
    read by the kernel itself, so nothing waits on the host and a step stays
    capturable in a CUDA graph.  The three products of y_g = x_g W_g^T over
    the experts' weights stacked as W [G, N, K]:

        forward  grouped_gemm_device(x [M, K], W, offsets, transb=True)   -> y  [M, N]
        dgrad    grouped_gemm_device(dy [M, N], W, offsets)               -> dx [M, K]
        wgrad    grouped_gemm_device(dy [M, N], x [M, K], offsets, transa=True) -> dW [G, N, K]

    bfloat16 CUDA tensors, each dimension but the split rows a multiple of
    8 (16-byte rows), float32 accumulation, the output in bfloat16.  An
    empty group's rows do not exist, or (wgrad) its product is zero.
    Route (``kernel``): None or "torch", torch._grouped_mm (CUTLASS's
    grouped kernel in torch, the same kernel transformers' grouped_mm
    experts run): cuBLASLt, seqfuse's other route, takes each group's size
    on the host.  A torch without _grouped_mm raises NotImplementedError.
    "sm90": seqfuse's persistent Hopper grouped kernel, which reads the
    offsets on the device itself (_C.grouped_gemm_device_ends, the forward
    form only: transb=True; compute capability 9.0; the rows past the last
    offset are not written); a call it cannot take is refused with its
    rule.  Against torch._grouped_mm on an H100 (s47, Mixtral-small's
    experts) it ran 1.04-1.16x at 8 experts and 0.99-1.21x at 64; not the
    default, whose backward forms (transa, dgrad) it does not take."""
    op = "grouped_gemm_device"
    if kernel not in (None, "torch", "sm90"):
        raise ValueError(f"{op}: argument 'kernel' must be None, 'torch' or 'sm90', got {kernel!r}")
    if kernel == "sm90" and (transa or not transb):
        raise ValueError(f"{op}: kernel='sm90' takes the forward form only (transa=False, transb=True)")
    if kernel != "sm90" and not hasattr(torch, "_grouped_mm"):
        raise NotImplementedError(f"{op}: this torch ({torch.__version__}) has no torch._grouped_mm, the "
                                  "device-split route's kernel: pass host row counts (a list of ints)")
    a, b = detached(_tensor(op, "a", a)), detached(_tensor(op, "b", b))
    offsets = _offsets_arg(op, offsets)
    G = offsets.shape[0]
    if transa:  # wgrad: both operands split along their rows, the product per group
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
            raise ValueError(f"{op}: the weight-gradient form takes a [M, N] and b [M, K] with the same "
                             f"rows, got {tuple(a.shape)} and {tuple(b.shape)}")
    else:
        if a.dim() != 2 or b.dim() != 3 or b.shape[0] != G:
            raise ValueError(f"{op}: takes a [M, K] split by offsets and b [G, N, K] stacked weights with "
                             f"G = {G}, got {tuple(a.shape)} and {tuple(b.shape)}")
        inner = b.shape[2] if transb else b.shape[1]
        if a.shape[1] != inner:
            raise ValueError(f"{op}: a has {a.shape[1]} columns but each group of b"
                             f"{'^T' if transb else ''} has {inner} rows")
    for name, t in (("a", a), ("b", b)):
        if any(d % 8 for d in t.shape[1:]):
            raise ValueError(f"{op}: argument '{name}' must have its non-split dimensions multiples of 8 "
                             f"(16-byte rows), got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16 or not t.is_cuda:
            raise TypeError(f"{op}: argument '{name}' must be a bfloat16 CUDA tensor, got {t.dtype} on "
                            f"{t.device.type}")
    if offsets.device != a.device or b.device != a.device:
        raise ValueError(f"{op}: a, b and offsets must be on one device, got {a.device}, {b.device} and "
                         f"{offsets.device}")
    if kernel == "sm90":
        return _device_ends(a, b, offsets, None, None)
    if transa:
        return torch._grouped_mm(dense(a).t(), dense(b), offs=offsets)
    return torch._grouped_mm(dense(a), b.transpose(1, 2) if transb else b, offs=offsets)


def grouped_gemm_device_fp8(a, a_scale_inv, b, b_scale_inv, offsets, *, fast_accum=True):
    """The FP8 form of :func:`grouped_gemm_device`'s forward product, with
    row-wise scales: out[rows of group g] = (a_g * a_scale_inv) @ (b_g *
    b_scale_inv[g][:, None])^T in float32, written in bfloat16.

    a [M, K] E4M3, split by ``offsets`` (device_split_offsets: the groups'
    end rows, read by the kernel: nothing waits on the host);
    a_scale_inv float32 [M] (row m's dequantization factor,
    seqfuse.ops.quant.quantize_rowwise_fp8's second result); b [G, N, K]
    E4M3, row-major (group g's [N, K] matrix); b_scale_inv float32 [G, N]
    (a factor per row of each b_g: per output column).  K and N multiples of
    16.  The forward product takes b = the experts' weights W [G, N, K] and
    the input-gradient product b = their transposed copies W^T [G, K, N]
    (dx_g = dy_g W_g = dy_g (W_g^T)^T).  Rows past the last offset are left
    unwritten.  ``fast_accum``: Hopper's FP8 accumulation without the
    periodic float32 promotion (faster; Transformer Engine's choice for the
    forward product, not for the gradients').  Route:
    torch._scaled_grouped_mm (its row-wise FP8 CUTLASS kernel, compute
    capability 9.0); a torch without it raises NotImplementedError."""
    op = "grouped_gemm_device_fp8"
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise NotImplementedError(f"{op}: this torch ({torch.__version__}) has no torch._scaled_grouped_mm")
    a, b = detached(_tensor(op, "a", a)), detached(_tensor(op, "b", b))
    a_scale_inv, b_scale_inv = _tensor(op, "a_scale_inv", a_scale_inv), _tensor(op, "b_scale_inv", b_scale_inv)
    offsets = _offsets_arg(op, offsets)
    G = offsets.shape[0]
    if a.dim() != 2 or b.dim() != 3 or b.shape[0] != G:
        raise ValueError(f"{op}: takes a [M, K] split by offsets and b [G, N, K] with G = {G}, got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    if b.shape[2] != K:
        raise ValueError(f"{op}: a has {K} columns but each group of b has {b.shape[2]} (b is [G, N, K])")
    if K % 16 or N % 16:
        raise ValueError(f"{op}: K and N must be multiples of 16, got K = {K}, N = {N}")
    if tuple(a_scale_inv.shape) != (M,):
        raise ValueError(f"{op}: argument 'a_scale_inv' must have shape [M] = [{M}], got "
                         f"{tuple(a_scale_inv.shape)}")
    if tuple(b_scale_inv.shape) != (G, N):
        raise ValueError(f"{op}: argument 'b_scale_inv' must have shape [G, N] = [{G}, {N}], got "
                         f"{tuple(b_scale_inv.shape)}")
    for name, t in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if t.dtype != torch.float32:
            raise TypeError(f"{op}: argument '{name}' must be float32, got {t.dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn or not t.is_cuda:
            raise TypeError(f"{op}: argument '{name}' must be a float8_e4m3fn CUDA tensor (torch's scaled "
                            f"grouped GEMM takes E4M3 only), got {t.dtype} on {t.device.type}")
    if any(t.device != a.device for t in (b, a_scale_inv, b_scale_inv, offsets)):
        raise ValueError(f"{op}: a, b, their scales and offsets must be on one device")
    return torch._scaled_grouped_mm(dense(a), dense(b).transpose(1, 2), dense(a_scale_inv), dense(b_scale_inv),
                                    offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=bool(fast_accum))


def padded_splits(m_splits, row_multiple=FP8_ROW_MULTIPLE):
    """Each row count rounded up to ``row_multiple`` (the FP8 GEMMs' 16)."""
    return tuple(-(-m // row_multiple) * row_multiple for m in m_splits)


def cast_fp8_grouped(x, m_splits, fp8_dtype, *, scale, amax=None, rowwise=True, transpose=True,
                     current=False, margin=0, row_multiple=FP8_ROW_MULTIPLE):
    """The FP8 casts of expert-sorted rows, every expert with its own scale, in
    one C call (CUDA: one launch under delayed scaling, three under current
    scaling, for up to 64 experts at a time).

    x [M, K] holds G runs of rows (``m_splits``, host ints adding up to M;
    K a multiple of 16; contiguous, 16-byte aligned on CUDA).  Run g is cast with its own scale into its own
    block of rows of the outputs, padded with zero rows to a multiple of
    ``row_multiple`` (16, the FP8 GEMMs' granularity): ``data`` [Mp, K]
    (``rowwise``) and ``data_t`` [K, Mp] (``transpose``; run g's block is
    columns p_g.. of it), Mp the padded runs' sum.  ``scale``, ``amax``:
    float32 vectors of G elements, any element stride (a ScalingState's
    slots of one role are every third column).  Delayed scaling
    (``current=False``): ``scale`` is read and max |x_g| folded into
    ``amax[g]`` where given.  ``current=True``: ``amax`` (required) and
    ``scale`` receive max |x_g| and fp8_max / max |x_g| / 2**margin.
    Returns ``(data or None, data_t or None, scale_inv)``: scale_inv holds
    1 / scale[g] for each group, 256 bytes apart (a [G] view of a
    [G, 64] buffer), the spacing cuBLASLt wants of the grouped GEMM's
    per-group scales.  Each group's results equal
    ``seqfuse.ops.quant.cast_transpose_fp8`` (``cast_fp8_current``) of its
    rows alone with ``rows`` = its padded count."""
    op = "cast_fp8_grouped"
    x = _tensor(op, "x", x)
    return _cast_grouped(op, x, False, None, m_splits, fp8_dtype, scale, amax, rowwise, transpose, current,
                         margin, row_multiple)


def swiglu_cast_fp8_grouped(x, probs, m_splits, fp8_dtype, *, scale, amax=None, rowwise=True, transpose=True,
                            current=False, margin=0, row_multiple=FP8_ROW_MULTIPLE):
    """``cast_fp8_grouped(scaled_swiglu(x, probs), ...)`` in one pass: x [M, 2K]
    (each row's gate then up values, the experts' gate-up GEMM output; K a
    multiple of 16), ``probs`` [M] (each row's routing weight) or None.  The
    SwiGLU output is computed per element, rounded to x's dtype as
    ``scaled_swiglu`` writes it and cast; it is never written itself.  Same
    arguments, results and bits as cast_fp8_grouped of that output (whose
    K is x's last dimension halved)."""
    op = "swiglu_cast_fp8_grouped"
    x = _tensor(op, "x", x)
    if x.dim() == 2 and x.shape[1] % 2:
        raise ValueError(f"{op}: argument 'x' must have an even last dimension (gate and up halves), "
                         f"got {x.shape[1]}")
    if probs is not None:
        probs = _float_tensor(op, "probs", probs, 1)
    return _cast_grouped(op, x, True, probs, m_splits, fp8_dtype, scale, amax, rowwise, transpose, current,
                         margin, row_multiple)


def swiglu_backward_cast_fp8_grouped(dout, x, probs, m_splits, fp8_dtype=None, *, scale=None, need_dprobs=True,
                                     grad_fp8_dtype=None, grad_scale=None, grad_amax=None, grad_rowwise=True,
                                     grad_transpose=True, want_dx=True, row_multiple=FP8_ROW_MULTIPLE):
    """The SwiGLU's backward in a grouped MLP's FP8 down projection, with
    that projection's weight-gradient operand, in one pass over the saved
    gate|up pairs.

    x [M, 2K] (each row's gate then up values), ``probs`` [M] or None and
    ``m_splits`` (host row counts) as :func:`swiglu_cast_fp8_grouped`'s.
    ``dout``: the gradient of the SwiGLU's output, [M, K], or [Mp, K] with
    each group's rows at the start of its block padded to ``row_multiple``
    (what the grouped GEMM writes; the padding rows are not read), x's
    dtype.  Returns ``(dx, dprobs, data_t, scale_inv, grad)``: dx [M, 2K]
    and dprobs [M] (None without probs or ``need_dprobs``) as
    :func:`swiglu_backward` gives them (dprobs summed in another order:
    within float rounding); where ``fp8_dtype`` is given, the SwiGLU
    value's transposed FP8 copy data_t [K, Mp] with its scale inverses as
    ``swiglu_cast_fp8_grouped(x, probs, m_splits, fp8_dtype, scale=scale,
    rowwise=False)`` makes them under delayed scaling with no amax (pass
    the scales the forward's cast used: the same bytes), else None, None;
    and where ``grad_fp8_dtype`` is given (with ``grad_scale``, optionally
    ``grad_amax``), dx's own FP8 copies for the gate-up layer's backward,
    ``grad`` = (data [Mp, 2K] or None, data_t [2K, Mp] or None, scale_inv)
    as ``cast_fp8_grouped(dx, m_splits, grad_fp8_dtype, scale=grad_scale,
    amax=grad_amax, rowwise=grad_rowwise, transpose=grad_transpose)``
    makes them, bit for bit (else None).  ``want_dx`` False: dx is not
    written (None in its place), for a caller that reads its FP8 copies or
    dprobs alone (GroupedMLP's one-node backward)."""
    op = "swiglu_backward_cast_fp8_grouped"
    x = _tensor(op, "x", x)
    dout = _tensor(op, "dout", dout)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D [M, 2K] (gate and up halves), got shape "
                         f"{tuple(x.shape)}")
    if probs is not None:
        probs = _float_tensor(op, "probs", probs, 1)
    splits = host_splits(op, m_splits)
    if isinstance(row_multiple, bool) or not isinstance(row_multiple, int):
        raise TypeError(f"{op}: argument 'row_multiple' must be an int, got {type(row_multiple).__name__}")
    if not isinstance(want_dx, bool):
        raise TypeError(f"{op}: argument 'want_dx' must be a bool, got {type(want_dx).__name__}")
    if not want_dx and fp8_dtype is None and grad_fp8_dtype is None and (probs is None or not need_dprobs):
        raise ValueError(f"{op}: want_dx=False with no dprobs, no fp8_dtype and no grad_fp8_dtype leaves nothing "
                         "to compute")
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if want_dx else None
    dprobs = torch.empty_like(probs) if probs is not None and need_dprobs else None
    data_t = scale_inv = None
    mp = sum(padded_splits(splits, row_multiple)) if row_multiple > 0 else 0
    if fp8_dtype is not None:
        require_fp8_dlpack(op)
        fp8_dtype = fp8_dtype_of(fp8_dtype, op)
        if scale is None:
            raise ValueError(f"{op}: argument 'scale' (the forward's per-group scales) goes with fp8_dtype")
        data_t = torch.empty((x.shape[1] // 2, mp), dtype=fp8_dtype, device=x.device)
        scale_inv = _spaced_scale_inv(len(splits), x.device)
    elif scale is not None:
        raise ValueError(f"{op}: argument 'scale' goes with fp8_dtype (the SwiGLU value's cast)")
    grad = None
    g_args = (None,) * 5
    if grad_fp8_dtype is not None:
        require_fp8_dlpack(op)
        grad_fp8_dtype = fp8_dtype_of(grad_fp8_dtype, op)
        if grad_scale is None:
            raise ValueError(f"{op}: argument 'grad_scale' (the gate-up layer's gradient scales) goes with "
                             f"grad_fp8_dtype")
        if not grad_rowwise and not grad_transpose:
            raise ValueError(f"{op}: at least one of 'grad_rowwise' and 'grad_transpose' must be True")
        g_data = torch.empty((mp, x.shape[1]), dtype=grad_fp8_dtype, device=x.device) if grad_rowwise else None
        g_data_t = torch.empty((x.shape[1], mp), dtype=grad_fp8_dtype, device=x.device) if grad_transpose else None
        grad = (g_data, g_data_t, _spaced_scale_inv(len(splits), x.device))
        g_args = (grad_scale, grad_amax, g_data, g_data_t, grad[2])
    elif grad_scale is not None or grad_amax is not None:
        raise ValueError(f"{op}: arguments 'grad_scale' and 'grad_amax' go with grad_fp8_dtype (dx's FP8 copies)")
    _C.swiglu_backward_cast_fp8_grouped(dense(dout), x, probs, torch.tensor(splits, dtype=torch.int64),
                                        int(row_multiple), dx, dprobs, scale, data_t, scale_inv, *g_args,
                                        stream_for(x))
    return dx, dprobs, data_t, scale_inv, grad


def cast_fp8_grouped_ends(x, row_end, fp8_dtype, *, scale, amax=None, swiglu=False, probs=None):
    """The delayed-scaling grouped cast of expert-sorted rows whose groups are
    given by their end rows on the device (``row_end``: int32 [G], 1 <= G <= 64,
    :func:`device_split_offsets`), read by the kernel itself: nothing waits
    on the host (the device-split route's FP8 form under delayed scaling).

    x [M, K] (K a multiple of 16; contiguous, 16-byte aligned on CUDA), or
    with ``swiglu`` [M, 2K] gate|up pairs and ``probs`` [M] (or None), the
    value cast being :func:`swiglu_cast_fp8_grouped`'s.  Group g is rows
    [row_end[g-1], row_end[g]) (each end clamped to [the previous end, M]); each of
    its rows is cast with ``scale[g]`` into the same row of ``data`` [M, K]
    (no padding; rows past the last end are zeros) and max |x_g| folded into
    ``amax[g]`` where given.  ``scale`` / ``amax``: float32 [G], any element
    stride (a ScalingState's slots of one role).  Returns ``(data,
    scale_inv)``, scale_inv as :func:`cast_fp8_grouped`'s (1 / scale[g],
    256 bytes apart).  Each group's rows equal :func:`cast_fp8_grouped`'s
    of that group bit for bit."""
    op = "cast_fp8_grouped_ends"
    require_fp8_dlpack(op)
    x = _tensor(op, "x", x)
    row_end = _tensor(op, "row_end", row_end)
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    if x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D [M, K] (the tokens in expert order), got {x.dim()}-D")
    if swiglu and x.shape[1] % 2:
        raise ValueError(f"{op}: argument 'x' must have an even last dimension (gate and up halves), got "
                         f"{x.shape[1]}")
    if probs is not None:
        if not swiglu:
            raise ValueError(f"{op}: argument 'probs' goes with swiglu=True")
        probs = _float_tensor(op, "probs", probs, 1)
    if row_end.dtype != torch.int32 or row_end.dim() != 1:
        raise TypeError(f"{op}: argument 'row_end' must be a 1-D int32 tensor (device_split_offsets), got "
                        f"{row_end.dim()}-D {row_end.dtype}")
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    data = torch.empty((x.shape[0], k), dtype=fp8_dtype, device=x.device)
    scale_inv = _spaced_scale_inv(row_end.shape[0], x.device)
    _C.cast_fp8_grouped_ends(x, probs, int(bool(swiglu)), dense(row_end), scale, amax, data, scale_inv,
                             stream_for(x))
    return data, scale_inv


def _cast_grouped(op, x, swiglu, probs, m_splits, fp8_dtype, scale, amax, rowwise, transpose, current, margin,
                  row_multiple):
    """The body of cast_fp8_grouped and (``swiglu``) swiglu_cast_fp8_grouped:
    checks, the outputs, the C call."""
    require_fp8_dlpack(op)
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    if isinstance(row_multiple, bool) or not isinstance(row_multiple, int):
        raise TypeError(f"{op}: argument 'row_multiple' must be an int, got {type(row_multiple).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be 2-D [M, K] (the tokens in expert order), got "
                         f"{x.dim()}-D")
    splits = host_splits(op, m_splits)
    if not rowwise and not transpose:
        raise ValueError(f"{op}: at least one of 'rowwise' and 'transpose' must be True")
    mp = sum(padded_splits(splits, row_multiple)) if row_multiple > 0 else 0
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    dev = x.device
    data = torch.empty((mp, k), dtype=fp8_dtype, device=dev) if rowwise else None
    data_t = torch.empty((k, mp), dtype=fp8_dtype, device=dev) if transpose else None
    scale_inv = _spaced_scale_inv(len(splits), dev)
    tail = (torch.tensor(splits, dtype=torch.int64), int(row_multiple), scale, amax, data, data_t, scale_inv,
            int(bool(current)), int(margin), stream_for(x))
    if swiglu:
        _C.swiglu_cast_fp8_grouped(x, probs, *tail)
    else:
        _C.cast_fp8_grouped(x, *tail)
    return data, data_t, scale_inv


def cast_fp8_current_list(xs, fp8_dtype, *, amax=None, margin=0, rowwise=True, transpose=True):
    """Current scaling of each of G same-shaped tensors ``xs`` (a grouped
    layer's weights, [N, K] each of one dtype, N and K multiples of 16,
    contiguous, 16-byte aligned on CUDA) in one C call (CUDA: three
    launches for up to 64 tensors).  Tensor g: amax = max |x_g|, scale =
    fp8_max / amax / 2**margin, and its FP8 copies ``data[g]`` [N, K]
    (``rowwise``) and ``data_t[g]`` [K, N] (``transpose``).  ``amax``: a
    float32 vector of G elements (any stride, e.g. a ScalingState's weight
    slots) to receive the amaxes, else one is made.  Returns ``(data list or
    None, data_t list or None, scale_inv, scale, amax)``, the last three
    [G] (scale_inv's entries 256 bytes apart, as cast_fp8_grouped's).  Each
    tensor's results equal ``seqfuse.ops.quant.cast_fp8_current``'s."""
    op = "cast_fp8_current_list"
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"{op}: argument 'xs' must be a non-empty list of tensors")
    first = _tensor(op, "xs[0]", xs[0])
    if first.dim() != 2:
        raise ValueError(f"{op}: every tensor of 'xs' must be 2-D [N, K], got {first.dim()}-D")
    for g, t in enumerate(xs):
        if not isinstance(t, torch.Tensor) or t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(f"{op}: every tensor of 'xs' must have xs[0]'s shape {tuple(first.shape)} and "
                             f"dtype {first.dtype}; xs[{g}] is "
                             + (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__))
    data, data_t, scale_inv, scale, amax = _cast_current_list(op, xs, fp8_dtype, amax, margin, rowwise, transpose,
                                                              _spaced_scale_inv(len(xs), first.device))
    return (list(data.unbind(0)) if rowwise else None), (list(data_t.unbind(0)) if transpose else None), \
        scale_inv, scale, amax


def cast_fp8_current_stacked(w, fp8_dtype, *, margin=0, rowwise=True, transpose=True, amax=None, spaced=False):
    """:func:`cast_fp8_current_list` of the G matrices of one stacked tensor
    ``w`` [G, N, K] (a device-split grouped layer's weights), the copies
    stacked too: returns ``(data [G, N, K] or None, data_t [G, K, N] or
    None, scale_inv [G])``, scale_inv contiguous (1 / each matrix's scale),
    or with ``spaced`` 256 bytes apart (:func:`cast_fp8_grouped`'s layout,
    which per-group cuBLASLt scales need).  ``rowwise`` / ``transpose``:
    which copies to make (at least one).  ``amax``: a float32 vector of G
    elements (any stride, e.g. a ScalingState's weight slots) to receive
    the amaxes, as cast_fp8_current_list's.  The scales come from the
    amaxes of ``w`` alone, whichever copies are made: a cast of the same
    values gives the same scales bit for bit."""
    op = "cast_fp8_current_stacked"
    w = _tensor(op, "w", w)
    if w.dim() != 3 or w.shape[0] == 0:
        raise ValueError(f"{op}: argument 'w' must be a [G, N, K] stack of G >= 1 matrices, got shape "
                         f"{tuple(w.shape)}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"{op}: argument 'w' must be float32, float16 or bfloat16, got {w.dtype}")
    if w.shape[1] % 16 or w.shape[2] % 16:
        raise ValueError(f"{op}: argument 'w' must have N and K multiples of 16, got shape {tuple(w.shape)}")
    if not w.is_contiguous() or (w.is_cuda and w.data_ptr() % 16):
        raise ValueError(f"{op}: argument 'w' must be contiguous and 16-byte aligned")
    G = w.shape[0]
    scale_inv = (_spaced_scale_inv(G, w.device) if spaced
                 else torch.empty(G, dtype=torch.float32, device=w.device))
    data, data_t, scale, amax = _current_outputs(op, G, w.shape[1], w.shape[2], w.device, fp8_dtype, amax,
                                                 bool(rowwise), bool(transpose))
    # (one C call on the stacks: no tensor per matrix crosses the binding)
    _C.cast_fp8_current_stacked(detached(w), data, data_t, scale, amax, scale_inv, int(margin), stream_for(w))
    return data, data_t, scale_inv


def _cast_current_list(op, xs, fp8_dtype, amax, margin, rowwise, transpose, scale_inv):
    """The call both list casts share, on G 2-D tensors ``xs`` of one shape
    and dtype (checked by the caller: cast_fp8_current_list per tensor, a
    stack's slices by construction); the FP8 copies come back as [G, N, K]
    and [G, K, N] tensors (or None)."""
    first = xs[0]
    data, data_t, scale, amax = _current_outputs(op, len(xs), first.shape[0], first.shape[1], first.device,
                                                 fp8_dtype, amax, rowwise, transpose)
    cast_fp8_current_list_into(xs, None if data is None else list(data.unbind(0)),
                               None if data_t is None else list(data_t.unbind(0)), scale, amax, scale_inv, margin)
    return data, data_t, scale_inv, scale, amax


def _current_outputs(op, G, n, k, dev, fp8_dtype, amax, rowwise, transpose):
    """The list and stacked casts' outputs for G [n, k] matrices: (data
    [G, n, k] or None, data_t [G, k, n] or None, scale [G], amax [G]: the
    caller's or a new one)."""
    require_fp8_dlpack(op)
    fp8_dtype = fp8_dtype_of(fp8_dtype, op)
    if not rowwise and not transpose:
        raise ValueError(f"{op}: at least one of 'rowwise' and 'transpose' must be True")
    data = torch.empty((G, n, k), dtype=fp8_dtype, device=dev) if rowwise else None
    data_t = torch.empty((G, k, n), dtype=fp8_dtype, device=dev) if transpose else None
    slots = torch.empty((2, G), dtype=torch.float32, device=dev)
    return data, data_t, slots[0], (slots[1] if amax is None else amax)


def cast_fp8_current_list_into(xs, data, data_t, scale, amax, scale_inv, margin=0):
    """:func:`cast_fp8_current_list` into outputs the caller has: ``data`` /
    ``data_t`` lists of G FP8 tensors (or None), ``scale``, ``amax`` and
    ``scale_inv`` [G] float32 (scale_inv as that function returns it) -- a
    grouped layer's weights re-cast into the buffers of their last cast
    (seqfuse.quantization.grouped.weight_pairs).  The C entry checks every
    argument.  Returns None."""
    require_fp8_dlpack("cast_fp8_current_list")
    _C.cast_fp8_current_list([detached(t) for t in xs], data, data_t, scale, amax, scale_inv, int(margin),
                             stream_for(xs[0]))


# ---- router --------------------------------------------------------------

def _score_code(op, score_function):
    try:
        return _SCORES[score_function]
    except KeyError:
        raise ValueError(f"{op}: argument 'score_function' must be 'softmax' or 'sigmoid', got "
                         f"{score_function!r}") from None


def _check_topk(op, topk, num_experts):
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"{op}: argument 'topk' must be an int in [1, num_experts = {num_experts}], "
                         f"got {topk!r}")


class _TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score, pre_softmax, scaling, expert_bias):
        logits, expert_bias = detached(logits), detached(expert_bias)
        probs = torch.empty_like(logits)
        routing_map = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        saved = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        _C.moe_topk_forward(logits, topk, score, pre_softmax, scaling, expert_bias, probs, routing_map,
                        saved, stream_for(logits))
        ctx.save_for_backward(routing_map, saved)
        ctx.args = (topk, score, pre_softmax, scaling, logits.dtype)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, dprobs, _dmap):
        routing_map, saved = ctx.saved_tensors
        topk, score, pre_softmax, scaling, dtype = ctx.args
        dprobs = dense(dprobs)
        dlogits = torch.empty(dprobs.shape, dtype=dtype, device=dprobs.device)
        _C.moe_topk_backward(routing_map, saved, dprobs, topk, score, pre_softmax, scaling, dlogits,
                        stream_for(dprobs))
        return dlogits, None, None, None, None, None


def fused_topk_with_score_function(logits, topk, use_pre_softmax=False, num_groups=None,
                                   group_topk=None, scaling_factor=None, score_function="softmax",
                                   expert_bias=None):
    """The router's top-k: (probs [T, E], routing_map [T, E] bool).

    score_function "softmax": with use_pre_softmax the probabilities are
    softmax(logits) at the topk largest; without, the softmax of the topk
    largest logits alone.  "sigmoid": sigmoid(logits) at the topk largest
    of sigmoid(logits) + expert_bias (the bias steers the selection only),
    renormalised to sum 1 over the selected when topk > 1.  Probabilities
    are times scaling_factor (default 1), zero off the selection; ties go
    to the lower expert index.  Differentiable in logits.
    Group-limited routing (num_groups / group_topk) is not built.
    """
    op = "fused_topk_with_score_function"
    logits = _float_tensor(op, "logits", logits, 2)
    _check_topk(op, topk, logits.shape[1])
    score = _score_code(op, score_function)
    if num_groups not in (None, 1) or group_topk is not None:
        raise NotImplementedError(f"{op}: group-limited routing (num_groups={num_groups}, "
                                  f"group_topk={group_topk}) is not built; leave both None")
    if expert_bias is not None:
        if score_function != "sigmoid":
            raise ValueError(f"{op}: argument 'expert_bias' goes with score_function='sigmoid' only "
                             "(as in Transformer Engine)")
        expert_bias = _tensor(op, "expert_bias", expert_bias).float().contiguous()
    scaling = 1.0 if scaling_factor is None else as_float(op, "scaling_factor", scaling_factor, finite=True)
    return _TopK.apply(logits, topk, score, bool(use_pre_softmax), scaling, expert_bias)


class _AuxScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score):
        logits = detached(logits)
        scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        routing_map = torch.empty(logits.shape, dtype=torch.bool, device=logits.device)
        saved = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        _C.moe_aux_scores_forward(logits, topk, score, scores, routing_map, saved, stream_for(logits))
        ctx.save_for_backward(saved)
        ctx.args = (score, logits.dtype)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _dmap, dscores):
        (saved,) = ctx.saved_tensors
        score, dtype = ctx.args
        dscores = dense(dscores)
        dlogits = torch.empty(dscores.shape, dtype=dtype, device=dscores.device)
        _C.moe_aux_scores_backward(saved, dscores, score, dlogits, stream_for(dscores))
        return dlogits, None, None


def fused_compute_score_for_moe_aux_loss(logits, topk, score_function="softmax"):
    """The scores of the load-balancing loss: (routing_map, scores), scores
    float32 softmax(logits) or sigmoid(logits) / (their sum + 1e-20), the
    routing map their topk.  Differentiable in logits."""
    op = "fused_compute_score_for_moe_aux_loss"
    logits = _float_tensor(op, "logits", logits, 2)
    _check_topk(op, topk, logits.shape[1])
    return _AuxScores.apply(logits, topk, _score_code(op, score_function))


def _counts(op, tokens_per_expert, num_experts, device):
    t = _tensor(op, "tokens_per_expert", tokens_per_expert)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: argument 'tokens_per_expert' must be int32 or int64, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != num_experts:
        raise ValueError(f"{op}: argument 'tokens_per_expert' must be 1-D of length num_experts = "
                         f"{num_experts}, got shape {tuple(t.shape)}")
    return detached(t).to(device).contiguous()


class _AuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, probs, tpe, total, topk, coeff):
        probs = detached(probs)
        loss = torch.empty((), dtype=torch.float32, device=probs.device)
        _C.moe_aux_loss_forward(probs, tpe, total, topk, coeff, loss, stream_for(probs))
        ctx.save_for_backward(tpe)
        ctx.args = (total, topk, coeff, probs.shape, probs.dtype)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        (tpe,) = ctx.saved_tensors
        total, topk, coeff, shape, dtype = ctx.args
        dprobs = torch.empty(shape, dtype=dtype, device=tpe.device)
        _C.moe_aux_loss_backward(dloss.float().contiguous(), tpe, total, topk, coeff, dprobs,
                            stream_for(dprobs))
        return dprobs, None, None, None, None


def fused_moe_aux_loss(probs, tokens_per_expert, total_num_tokens, num_experts, topk, coeff):
    """The load-balancing loss (Switch Transformer / GShard, TE's formula):
    coeff * E / (topk * T^2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e],
    a float32 scalar, differentiable in probs."""
    op = "fused_moe_aux_loss"
    probs = _float_tensor(op, "probs", probs, 2)
    if num_experts != probs.shape[1]:
        raise ValueError(f"{op}: argument 'num_experts' ({num_experts}) must equal probs.shape[1] "
                         f"({probs.shape[1]})")
    _check_topk(op, topk, num_experts)
    total = as_int(op, "total_num_tokens", total_num_tokens)
    if total < 1:
        raise ValueError(f"{op}: argument 'total_num_tokens' must be at least 1, got {total}")
    tpe = _counts(op, tokens_per_expert, num_experts, probs.device)
    return _AuxLoss.apply(probs, tpe, total, topk, as_float(op, "coeff", coeff, finite=True))


class _ZLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, coeff):
        logits = detached(logits)
        loss = torch.empty((), dtype=torch.float32, device=logits.device)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        _C.moe_z_loss_forward(logits, coeff, loss, lse, stream_for(logits))
        ctx.save_for_backward(logits, lse)
        ctx.coeff = coeff
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, lse = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        _C.moe_z_loss_backward(logits, lse, dloss.float().contiguous(), ctx.coeff, dlogits,
                          stream_for(logits))
        return dlogits, None


def moe_z_loss(logits, coeff):
    """The router z-loss (ST-MoE): coeff * mean_t logsumexp(logits[t])^2, a
    float32 scalar, differentiable in logits."""
    op = "moe_z_loss"
    logits = _float_tensor(op, "logits", logits, 2)
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"{op}: argument 'logits' must have at least one token and one expert, got "
                         f"shape {tuple(logits.shape)}")
    return _ZLoss.apply(logits, as_float(op, "coeff", coeff, finite=True))


# ---- permutation ---------------------------------------------------------

def moe_row_id_map(routing_map):
    """(row_id_map [T, E] int32, tokens_per_expert [E] int64) of a routing
    map: each routed (token, expert) pair's row in the expert-sorted buffer
    (experts in order, tokens in order within each), -1 elsewhere."""
    op = "moe_row_id_map"
    routing_map = detached(_tensor(op, "routing_map", routing_map))
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise TypeError(f"{op}: argument 'routing_map' must be a 2-D bool tensor [tokens, experts], "
                        f"got {routing_map.dim()}-D {routing_map.dtype}")
    routing_map = routing_map.contiguous()
    ids = torch.empty(routing_map.shape, dtype=torch.int32, device=routing_map.device)
    counts = torch.empty(routing_map.shape[1], dtype=torch.int64, device=routing_map.device)
    _C.moe_row_id_map(routing_map, ids, counts, stream_for(routing_map))
    return ids, counts


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, num_out, probs, zero_unrouted=False):
        inp, probs = detached(inp), detached(probs)
        alloc = torch.zeros if zero_unrouted else torch.empty
        out = alloc((num_out, inp.shape[1]), dtype=inp.dtype, device=inp.device)
        out_probs = None
        if probs is not None:
            out_probs = alloc(num_out, dtype=probs.dtype, device=inp.device)
        _C.moe_permute(inp, row_id_map, probs, out, out_probs, stream_for(inp))
        ctx.save_for_backward(row_id_map)
        ctx.args = (inp.shape, None if probs is None else probs.dtype)
        ctx.mark_non_differentiable(row_id_map)
        return out, out_probs

    @staticmethod
    def backward(ctx, dout, dout_probs):
        (row_id_map,) = ctx.saved_tensors
        shape, probs_dtype = ctx.args
        dinp = dprobs = None
        if ctx.needs_input_grad[0]:
            dout = dense(dout)
            dinp = torch.empty(shape, dtype=dout.dtype, device=dout.device)
            _C.moe_unpermute(dout, row_id_map, None, dinp, stream_for(dout))
        if probs_dtype is not None and ctx.needs_input_grad[3]:
            dprobs = torch.empty(row_id_map.shape, dtype=probs_dtype, device=row_id_map.device)
            if dout_probs is None:
                dprobs.zero_()
            else:
                _C.moe_permute_probs_backward(row_id_map, dense(dout_probs), dprobs,
                                         stream_for(dprobs))
        return dinp, None, None, dprobs, None


def moe_permute_by_row_id_map(inp, row_id_map, num_out_tokens, probs=None, zero_unrouted=False):
    """The permutation given its row_id_map: (out [num_out_tokens, H],
    permuted probs [num_out_tokens] or None).  Rows past num_out_tokens are
    dropped; rows no (token, expert) pair maps to are left unwritten, so
    num_out_tokens must not exceed the routed count, unless
    ``zero_unrouted``: those rows are zero (a padded row_id_map's alignment
    rows, pad_row_id_map)."""
    op = "moe_permute"
    inp = _float_tensor(op, "inp", inp, 2)
    row_id_map = _tensor(op, "row_id_map", row_id_map)
    if probs is not None:
        probs = _float_tensor(op, "probs", probs, 2)
    return _Permute.apply(inp, row_id_map, int(num_out_tokens), probs, bool(zero_unrouted))


def pad_row_id_map(row_id_map, tokens_per_expert, row_multiple=FP8_ROW_MULTIPLE):
    """The row_id_map of an expert-sorted buffer whose experts' row blocks
    are padded to multiples of ``row_multiple`` (the FP8 GEMMs' 16): each
    routed pair's row moves down by the padding of the experts before its
    own; -1 stays -1.  On the device, from the device counts (nothing waits
    on the host).  Permute with it into sum(padded_splits(m_splits)) rows
    and ``zero_unrouted=True``; moe_unpermute takes it as it is."""
    counts = tokens_per_expert.to(torch.int64)
    padded = (counts + (row_multiple - 1)) // row_multiple * row_multiple
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    return torch.where(row_id_map >= 0, row_id_map + shift.to(row_id_map.dtype), row_id_map)


def counts_to_host(counts):
    """Start the copy of small device counts to the host; returns a function
    that waits for that copy alone and gives the values as a list.  Work
    queued between the two keeps the GPU busy while the host waits and
    after it resumes (a .tolist() waits for the whole queue to drain at the
    point of the call).  CPU tensors: read at once."""
    if not counts.is_cuda:
        values = counts.tolist()
        return lambda: values
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    with torch.cuda.device(counts.device):  # the copy and the event on counts' device's stream
        host.copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

    def wait():
        done.synchronize()
        return host.tolist()
    return wait


def _permute(op, inp, routing_map, num_out_tokens, probs):
    inp = _float_tensor(op, "inp", inp, 2)
    ids, counts = moe_row_id_map(routing_map)
    if ids.shape[0] != inp.shape[0]:
        raise ValueError(f"{op}: argument 'routing_map' has {ids.shape[0]} tokens but 'inp' has "
                         f"{inp.shape[0]} rows")
    n = -1 if num_out_tokens is None else as_int(op, "num_out_tokens", num_out_tokens)
    routed = int(counts.sum().item())
    n = routed if n < 0 else n
    if n > routed:
        raise ValueError(f"{op}: argument 'num_out_tokens' ({n}) exceeds the {routed} routed "
                         "(token, expert) pairs; rows past them would be left unwritten")
    out, out_probs = moe_permute_by_row_id_map(inp, ids, n, probs)
    return out, out_probs, ids


def moe_permute(inp, routing_map, num_out_tokens=-1, max_token_num=-1, map_type="mask"):
    """Tokens into the expert-sorted buffer: (out [N, H], row_id_map).
    inp [T, H]; routing_map [T, E] bool; num_out_tokens: rows kept (-1: all
    routed pairs; fewer drops the last rows).  max_token_num: TE's
    buffer-size hint, which this implementation does not need (the result
    does not depend on it).  Differentiable in inp."""
    op = "moe_permute"
    if map_type != "mask":
        raise NotImplementedError(f"{op}: map_type={map_type!r}: only routing masks ('mask') are "
                                  "taken; turn top-k indices into a [tokens, experts] bool mask")
    out, _, ids = _permute(op, inp, routing_map, num_out_tokens, None)
    return out, ids


def moe_permute_with_probs(inp, probs, routing_map, num_out_tokens=-1):
    """moe_permute that also carries each pair's probability:
    (out [N, H], permuted_probs [N], row_id_map).  Differentiable in inp and
    probs."""
    return _permute("moe_permute_with_probs", inp, routing_map, num_out_tokens, probs)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, row_id_map, probs):
        inp, probs = detached(inp), detached(probs)
        T = row_id_map.shape[0]
        out = torch.empty((T, inp.shape[1]), dtype=inp.dtype, device=inp.device)
        _C.moe_unpermute(inp, row_id_map, probs, out, stream_for(inp))
        ctx.save_for_backward(inp if probs is not None else None, row_id_map, probs)
        ctx.n_rows = inp.shape[0]
        return out

    @staticmethod
    def backward(ctx, dout):
        inp, row_id_map, probs = ctx.saved_tensors
        dout = dense(dout)
        # zeros: rows of inp that no token maps to (e.g. alignment padding) get a zero gradient, not garbage
        dinp = torch.zeros((ctx.n_rows, dout.shape[1]), dtype=dout.dtype, device=dout.device)
        dprobs = None
        if probs is not None:
            dprobs = torch.empty(probs.shape, dtype=probs.dtype, device=dout.device)
        _C.moe_unpermute_backward(dout, inp, row_id_map, probs, dinp, dprobs, stream_for(dout))
        return dinp, None, dprobs


def moe_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask"):
    """Expert outputs back to their tokens: out[t] = sum_e merging_probs[t, e]
    * inp[row_id_map[t, e]] (weight 1 without merging_probs).  inp [N, H];
    returns [T, H] (reshaped to restore_shape when given).  Differentiable
    in inp and merging_probs."""
    op = "moe_unpermute"
    if map_type != "mask":
        raise NotImplementedError(f"{op}: map_type={map_type!r}: only the row_id_map of "
                                  "moe_permute / moe_permute_with_probs is taken")
    inp = _float_tensor(op, "inp", inp, 2)
    row_id_map = _tensor(op, "row_id_map", row_id_map)
    if merging_probs is not None:
        merging_probs = _float_tensor(op, "merging_probs", merging_probs, 2)
    out = _Unpermute.apply(inp, row_id_map, merging_probs)
    if restore_shape is None:
        return out
    try:
        return out.view(restore_shape)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{op}: argument 'restore_shape' {restore_shape!r} must hold the output's "
                         f"{out.numel()} elements ([{out.shape[0]} tokens, {out.shape[1]}]): {e}") from None


# ---- SwiGLU scaled by the routing probability ----------------------------

def swiglu_forward(x, probs):
    """The values of scaled_swiglu(x, probs), without autograd (for a module
    that holds the SwiGLU in its own autograd Function; arguments as checked
    by scaled_swiglu)."""
    x, probs = detached(x), detached(probs)
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _C.moe_swiglu_forward(x, probs, out, stream_for(x))
    return out


def swiglu_backward(dout, x, probs, need_dprobs=True):
    """(dx, dprobs or None) of scaled_swiglu for its output gradient
    ``dout``, without autograd (dprobs only with probs and need_dprobs)."""
    dout = dense(dout)
    dx = torch.empty_like(x)
    dprobs = torch.empty_like(probs) if probs is not None and need_dprobs else None
    _C.moe_swiglu_backward(dout, x, probs, dx, dprobs, stream_for(x))
    return dx, dprobs


class _ScaledSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs):
        x, probs = detached(x), detached(probs)
        ctx.save_for_backward(x, probs)
        return swiglu_forward(x, probs)

    @staticmethod
    def backward(ctx, dout):
        x, probs = ctx.saved_tensors
        return swiglu_backward(dout, x, probs, ctx.needs_input_grad[1])


def scaled_swiglu(x, probs=None):
    """silu(x[:, :F]) * x[:, F:] * probs[:, None] for x [N, 2F] (the experts'
    gate-up GEMM output) and probs [N] (each row's routing probability;
    None: 1), one kernel each way; differentiable in x and probs."""
    op = "scaled_swiglu"
    x = _float_tensor(op, "x", x, 2)
    if x.shape[1] % 2:
        raise ValueError(f"{op}: argument 'x' must have an even last dimension (gate and up halves), "
                         f"got {x.shape[1]}")
    if probs is not None:
        probs = _float_tensor(op, "probs", probs, 1)
        if probs.shape[0] != x.shape[0]:
            raise ValueError(f"{op}: argument 'probs' must have one entry per row of x ({x.shape[0]}), "
                             f"got {probs.shape[0]}")
    return _ScaledSwiGLU.apply(x, probs)
