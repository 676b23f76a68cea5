"""GroupedLinear: Transformer Engine's GroupedLinear over seqfuse's grouped GEMM.

G linear layers applied to consecutive row blocks of one input: rows
[offset_g, offset_g + m_splits[g]) of inp go through y_g = x_g W_g^T + b_g.
This is a mixture-of-experts layer's expert GEMM after the tokens have been
permuted into expert order (seqfuse.ops.moe.moe_permute).  A training step
is three grouped GEMMs (seqfuse.ops.moe.grouped_gemm), each one call over
all experts:

    forward  y_g  = x_g  @ W_g^T  (+ b_g in the epilogue)
    dgrad    dx_g = dy_g @ W_g
    wgrad    dW_g = dy_g^T @ x_g  (+ db_g in the epilogue; zero for an
                                   expert that received no tokens)

Parameters: one per expert, named weight0 .. weight{G-1} and bias0 ..
bias{G-1} as TE names them, so TE / Megatron checkpoints map one to one.
One parameter per expert rather than one stacked [G, out, in] parameter
because (1) FSDP2's fully_shard shards each parameter along dim 0, which
for a stacked tensor would cut across experts, while per-expert
parameters shard each expert's own rows; (2) expert parallelism assigns
whole experts to ranks, which is a choice of parameters, not a slice of
one; (3) optimizers and gradient clipping see each expert as its own
tensor, as with the dense Linear.  The grouped GEMM takes the list of
weights directly, so nothing is stacked (copied) per step; the parameters
are also consecutive slices of one [G, out, in] buffer, which the
device-split route reads as one tensor (stacked_weights; torch.save and
transformers' save_pretrained handle the shared storage, safetensors'
save_model of the bare module refuses it, and saving one expert's
parameter alone writes the whole buffer).

Row counts: m_splits as host ints (TE's form) runs cuBLASLt, one call per
expert sized on the host.  m_splits as an integer tensor on the GPU (the
router's tokens_per_expert) runs the device-split route without bias
(DeviceSplitGroupedLinearFunction over ops.moe.grouped_gemm_device, torch's
grouped kernels): the kernel reads the counts, nothing waits on the host.
It computes in bfloat16, or under Float8CurrentScaling with
fp8_format=E4M3 runs the forward and input-gradient products in FP8
(ops.moe.grouped_gemm_device_fp8): activations and output gradients cast
with one scale per row (finer than the recipe's one per tensor, and it
needs no row counts), each expert's weight with its own scale, the weight
gradient in bfloat16 (torch's FP8 form of it needs 16-row groups).  Its
FP8 weight copies follow Transformer Engine's is_first_microbatch contract
(None: nothing is kept across calls; True / False: kept across
micro-batches), and go one step further in training without it: no copy
outlives its product (the forward casts the copy it reads, the backward the
transposed copy from the weights it saved, where TE keeps that one from
the forward), so no layer holds FP8 weights through the activation peak;
inference (no gradients) keeps the forward's copy per weight version
(GroupedLinear._device_fp8_weights).  Under DelayedScaling the route is
DeviceEndsFp8GroupedLinearFunction: the forward's input cast
(ops.moe.cast_fp8_grouped_ends, each expert's delayed scale) and product
(seqfuse's sm90 kernel, grouped_gemm_device_ends_fp8) read the counts on
the device, their host copy is queued in the forward and read by the
backward, which is the host-count route's; its answers are that route's
bit for bit once every expert's input has an amax history.  It needs
compute capability 9.0, bfloat16 compute, no bias and E4M3 inputs; a
layer's first FP8 forward takes host counts (its experts' first casts take
their scales from their own amaxes), and an expert that has received no
rows until then is cast on the route with its state's current scale (1
for a tensor never cast, Transformer Engine's first step), and its first
cast is noted in the backward, where the counts are on the host.  In
GroupedMLP the down projection's backward runs the SwiGLU's backward in one
pass (ops.moe.swiglu_backward_cast_fp8_grouped) that also writes its weight
gradient's FP8 operand and the gate-up layer's FP8 output gradient, which
that layer's backward takes instead of casting (GradHandoff).  GroupedMLP
runs its two layers there as one autograd node
(DeviceEndsFp8GroupedMLPFunction, through device_ends_mlp): the two
Functions' forward and backward bodies in turn, so the gate-up layer's
output gradient exists only as those FP8 copies, never in bfloat16 (the
same answers bit for bit); where either layer has module hooks, which run
only when it is called as a module, the layers stay two nodes (logged) and
the copies are taken only where the gradient received is the tensor cast.
Where the route does not apply (a bias, another dtype or recipe, a HYBRID
current-scaling format, whose E5M2 gradients torch's scaled grouped GEMM
does not take) the counts are read to the host, logged once with the
reason.

Precision: the GEMMs run in torch.autocast's dtype where it is on, else the
parameters' dtype.  Under seqfuse's FP8 autocast with host row counts (the
device-split route's FP8 form is described above) the three grouped GEMMs
run in FP8 under DelayedScaling, Float8CurrentScaling or
Float8BlockScaling, with operands made by the same quantization layer as
Linear (seqfuse.quantization.gemm_quantizers, and the GEMM operand helpers
of modules/_fp8.py): a GemmQuantizers of num_gemms GEMMs, TE's layout of
3 x num_gemms scaling slots (expert g's input 3g, weight 3g + 1, output
gradient 3g + 2), one scale (or one set of block scales) per expert and
operand.  Each expert's rows are quantized with their own scale and padded
to a multiple of 16 (the FP8 GEMMs' granularity; zero rows), every expert
in one cast call where seqfuse.quantization.grouped allows (per-tensor
recipes in steady state; else expert by expert, the same values), so the
forward and input-gradient results are computed over padded row blocks
and gathered back to the real rows (one copy of the output, where some
expert's count is not a multiple of 16; GroupedMLP under FP8 hands over
row blocks already padded, and nothing is gathered).  The weight gradient takes the experts'
transposed (column-wise) copies.  In training without is_first_microbatch
the experts' weights are cast at every forward and the forward's copy is
freed when the forward returns: only the backward's transposed copy lives
through the activation peak (quantization.grouped.lean_weights; True /
False keep both across micro-batches, and frozen experts,
keep_fp8_weights, graph capture and activation checkpoints keep them per
weight version).  MXFP8 / NVFP4 raise NotImplementedError
(their GEMMs need compute capability 10.x).

Weight-gradient accumulation: where every weight carries a float32
``main_grad``, dW_g is accumulated into it by the GEMM (beta = 1) and the
weight's .grad is left None (``grad_added_to_main_grad`` set where present).
"""
import functools
import logging

import torch

from .. import quantization as _q
from ..common.notes import note_once
from ..common.recipe import DelayedScaling, Float8CurrentScaling, Format
from ..ops import moe as moe_ops
from ..ops import quant as quant_ops
from ..ops import device_checks
from ..quantization import gemm_quantizers as _gq
from ..quantization import recompute, stats
from ..quantization.grouped import (GroupedFloat8, delayed_grad_slots, lean_weights, note_grouped,
                                     quantize_grouped, release_weight_pairs, stacked_weights_fp8, weight_pairs)
from . import _fp8 as F8
from ._base import compute_dtype, default_device, init_weight, mark_main_grad, set_linear_options, wgrad_overwrite
from ._input import check_input, gemm_rows
from .te_compat import materialize, rng_fork

__all__ = ["ACTIVE_RECIPE", "GroupedLinear", "GroupedLinearFunction", "DeviceSplitGroupedLinearFunction",
           "Fp8GroupedLinearFunction", "DeviceEndsFp8GroupedMLPFunction", "GradHandoff", "device_ends_mlp"]

_log = logging.getLogger("seqfuse")

#: device_split_refusal's default: judge for the FP8 autocast active at the call.
ACTIVE_RECIPE = object()
#: forward's and _apply_to's default: the caller has not asked device_split_refusal yet.
_UNASKED = object()

_PARALLEL = "no tensor/sequence parallelism or comm overlap here"
#: TE arguments accepted with only their default value -> (that value, why another is refused).
_TE_DEFAULTS = {**{name: (off, _PARALLEL) for name, off in (
    ("sequence_parallel", False), ("tp_group", None), ("tp_size", 1), ("parallel_mode", None),
    ("ub_overlap_ag", False), ("ub_overlap_rs", False), ("ub_name", None))},
    "delay_wgrad_compute": (False, "deferred weight-gradient GEMMs are not implemented; the weight gradients "
                                   "are computed in the backward"),
    "save_original_input": (False, "saving the unquantized input for the backward is not implemented"),
    "single_grouped_weight": (False, "the experts' weights are parameters weight0 .. weight{G-1} (one "
                                     "[G, out, in] buffer underneath), not one grouped parameter"),
    "single_grouped_bias": (False, "the experts' biases are parameters bias0 .. bias{G-1}, not one grouped "
                                   "parameter")}
#: TE arguments that only pick TE's GEMM path: no effect on the result here (logged once when set)
_TE_NO_EFFECT = {"use_grouped_tensor": None}


def _swiglu_input(h, probs, dtype):
    """The input of a down projection fed gate|up pairs ``h`` [M, 2K] and
    row scales ``probs`` [M]: scaled_swiglu(h, probs) by its forward kernel
    (ops.moe.swiglu_forward, in h's dtype), then in ``dtype``.  The forward
    makes it with this, and so does the backward for the weight gradient:
    the same kernel on the same saved tensors, the same bits."""
    a = moe_ops.swiglu_forward(h, probs)
    return a if a.dtype == dtype else a.to(dtype)


def _swiglu_grads(da, h, probs, need_dprobs):
    """(dh, dprobs or None) of _swiglu_input for its output gradient ``da``
    (in the GEMMs' dtype): da in h's dtype, as autograd hands a gradient to
    the input it belongs to, then the SwiGLU's backward kernel."""
    return moe_ops.swiglu_backward(da if da.dtype == h.dtype else da.to(h.dtype), h, probs, need_dprobs)


def _swiglu_operand(ctx, h, probs, dtype, need_grad):
    """A down projection's GEMM input from gate|up pairs ``h`` and row scales
    ``probs``, and what its backward keeps: returns (input in ``dtype``,
    kept tensor, kept probs).  Where a gradient flows to h or probs
    (``need_grad``) the SwiGLU's backward reads them, so they are kept and
    the input is not (_weight_grad_input makes it again); else the input is
    kept, being half h's size.  Sets ctx.swiglu (whether the backward runs
    the SwiGLU's backward)."""
    h, probs = moe_ops.dense(h.detach()), probs.detach()
    a = moe_ops.dense(_swiglu_input(h, probs, dtype))
    ctx.swiglu = need_grad
    return (a, h, probs) if need_grad else (a, a, None)


def _weight_grad_input(ctx, kept, probs, dtype):
    """The weight gradient's input: the kept tensor, or (ctx.swiglu) the
    SwiGLU output made again from the kept gate|up pairs and probs."""
    return moe_ops.dense(_swiglu_input(kept, probs, dtype)) if ctx.swiglu else kept


#: GroupedLinearFunction's arguments before the weights and biases.
_HOST_ARGS = 8


class GroupedLinearFunction(torch.autograd.Function):
    """Autograd of y_g = x_g W_g^T + b_g over host m_splits.

    forward(x [sum(m_splits), in], probs, m_splits (tuple of ints), dtype,
    num_gemms, use_bias, allow_tf32, overwrite, *weights, *biases).
    allow_tf32: float32 operands on TF32 tensor cores; None follows
    torch.backends.cuda.matmul.allow_tf32 (ops.gemm's rule, what every
    module passes).  overwrite: where the weights carry main_grad, the
    weight-gradient GEMM writes dW there instead of adding it
    (_base.wgrad_overwrite, Transformer Engine's rule).

    ``probs`` None: x is the GEMMs' input.  ``probs`` [M] (GroupedMLP's down
    projection): x is [M, 2 in] gate|up pairs and the GEMMs' input is
    scaled_swiglu(x, probs) (_swiglu_input); the backward returns the
    gradients of x and probs.  Where a gradient flows to x or probs, the
    SwiGLU's backward reads them, so they are kept and the SwiGLU output is
    not: the weight gradient makes it again from them, the forward's values
    bit for bit.  Where none does, the SwiGLU output is kept instead (half
    x's size)."""

    @staticmethod
    def forward(ctx, x, probs, m_splits, dtype, G, use_bias, allow_tf32, overwrite, *params):
        weights, biases = params[:G], params[G:] if use_bias else None
        if probs is None:
            ctx.swiglu = False
            xc = kept = (x if x.dtype == dtype else x.to(dtype)).detach()
        else:
            need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            xc, kept, probs = _swiglu_operand(ctx, x, probs, dtype, need_grad)
        wc = [(w if w.dtype == dtype else w.to(dtype)).detach() for w in weights]
        bc = None
        if use_bias:
            bc = [(b if b.dtype == dtype else b.to(dtype)).detach() for b in biases]
        y = moe_ops.grouped_gemm(xc, wc, m_splits, transb=True, bias=bc, allow_tf32=allow_tf32)
        ctx.save_for_backward(kept, probs, *wc)
        ctx.weights = weights  # the parameter objects, for main_grad
        ctx.m_splits, ctx.dtype, ctx.G, ctx.use_bias, ctx.tf32 = m_splits, dtype, G, use_bias, allow_tf32
        ctx.overwrite = overwrite
        ctx.bias_dtypes = [b.dtype for b in biases] if use_bias else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, probs, *wc = ctx.saved_tensors
        G, dtype, splits = ctx.G, ctx.dtype, ctx.m_splits
        dy = moe_ops.dense(dy if dy.dtype == dtype else dy.to(dtype))
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_dw = any(ctx.needs_input_grad[_HOST_ARGS:_HOST_ARGS + G])
        need_db = ctx.use_bias and any(ctx.needs_input_grad[_HOST_ARGS + G:])
        tf32 = ctx.tf32
        dx = dprobs = None
        if need_dx:
            dx = moe_ops.grouped_gemm(dy, wc, splits, allow_tf32=tf32)
            if ctx.swiglu:
                dx, dprobs = _swiglu_grads(dx, x, probs, ctx.needs_input_grad[1])
        dws = [None] * G
        dbs = [None] * G if ctx.use_bias else []
        if need_dw or need_db:
            xc = _weight_grad_input(ctx, x, probs, dtype)
            weights = ctx.weights
            mains = [getattr(w, "main_grad", None) for w in weights] if need_dw else [None]
            use_main = need_dw and all(m is not None for m in mains)
            if use_main:
                res = moe_ops.grouped_gemm(dy, xc, splits, transa=True, out=mains, accumulate=not ctx.overwrite,
                                           bgrad=need_db, allow_tf32=tf32)
            else:
                res = moe_ops.grouped_gemm(dy, xc, splits, transa=True, bgrad=need_db, allow_tf32=tf32)
            del xc
            if need_db:
                res, db = res
                dbs = [db[g].to(ctx.bias_dtypes[g]) for g in range(G)]
            if use_main:
                for w in weights:
                    mark_main_grad(w)
            elif need_dw:
                dws = [res[g] if res.dtype == weights[g].dtype else res[g].to(weights[g].dtype)
                       for g in range(G)]
        return (dx, dprobs, None, None, None, None, None, None, *dws, *dbs)


class DeviceSplitGroupedLinearFunction(torch.autograd.Function):
    """Autograd of y_g = x_g W_g^T with the row counts on the GPU (no
    bias): ops.moe.grouped_gemm_device for the three products in bfloat16,
    so no step of it waits on the host.

    forward(x [M, in], probs, offsets (device_split_offsets), fp8, stacked
    [G, out, in], *weights): x and stacked are computed in bfloat16
    (converted where they are not: float32 parameters under
    torch.autocast).  ``probs`` [M] (GroupedMLP's down projection; None:
    x is the products' input): x is [M, 2 in] gate|up pairs and the
    products' input is scaled_swiglu(x, probs) in bfloat16
    (_swiglu_input); the backward returns the gradients of x and probs.
    Where a gradient flows to x or probs, the SwiGLU's backward reads them,
    so they are kept and the SwiGLU output is not: the backward makes it
    again from them for the weight gradient, the forward's bfloat16 values
    bit for bit (in FP8 too: the weight gradient's operand is that bfloat16
    output, not the forward's row-wise FP8 copy, which is not kept).  Where
    none does, the SwiGLU output is kept instead (half x's size).  With
    ``weights`` (GroupedLinear's per-expert parameters, ``stacked`` their
    one-buffer view from stacked_weights) the gradient of weight g is the
    weight gradient's slice g; without them ``stacked`` is itself the
    parameter (transformers' stacked experts, hf.fuse_experts) and takes the
    whole [G, out, in] weight gradient.  Gradients come back in each
    parameter's dtype, rounded through bfloat16 (the products' output).

    ``fp8`` (a quantization.grouped.StackedFloat8 of the weights, or None;
    with it and ``weights`` given, ``stacked`` may be None):
    the forward and input-gradient products run in FP8 E4M3
    (ops.moe.grouped_gemm_device_fp8) with x and dy cast one scale per row
    (ops.quant.quantize_rowwise_fp8, no row counts needed) against the
    experts' weights cast with one scale each; the forward accumulates
    fast, the input gradient with float32 promotion.  The weight gradient
    stays in bfloat16 from the bfloat16 x and dy: torch's FP8 form of that
    product needs every group's rows in multiples of 16, which routed
    tokens are not.

    Which FP8 weight copies live how long (GroupedLinear._device_fp8_weights
    chooses): where ``fp8`` carries the transposed copy (``data_t``), the
    backward reads it (the context keeps that copy and its factors, not the
    forward's ``data``).  Where ``fp8.data_t`` is None, the forward uses
    ``fp8.data`` and keeps no FP8 copy: where the input gradient is wanted
    it saves the weights themselves (save_for_backward: ``weights``, each
    parameter with its own version counter, else ``stacked``; no copy), and
    the backward casts the transposed copy from them (transpose only,
    stacked_weights_fp8; the scales recomputed from the same values equal
    the forward's bit for bit), uses it for the input gradient and drops
    it; autograd raises its in-place modification error where a weight
    changed between the forward and the backward.  ``fp8.on_transpose_cast``
    (where given) is called at each such cast.  In bfloat16 the backward's
    weight operand is saved the same way where it is a view of the
    parameters' one buffer (the parameters saved, the view made again), so
    the version check covers every expert, not expert 0 alone."""

    @staticmethod
    def forward(ctx, x, probs, offsets, fp8, stacked, *weights):
        bf16 = torch.bfloat16
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if probs is None:
            ctx.swiglu = False
            x = kept = moe_ops.dense(x.detach().to(bf16))
        else:
            x, kept, probs = _swiglu_operand(ctx, x, probs, bf16, need_dx)
        ctx.transposed = ctx.on_transpose_cast = None
        ctx.restack = False
        saved = ()
        if fp8 is None:
            w = stacked.detach().to(bf16)
            y = moe_ops.grouped_gemm_device(x, w, offsets, transb=True)
            if not need_dx:
                pass  # no input gradient: the backward reads no weight
            elif weights and w.data_ptr() == weights[0].data_ptr():  # (a stack or a conversion is a new tensor)
                # a view of the parameters' buffer: the parameters are saved instead (each with its own
                # version counter; the view carries expert 0's only) and the view made again in the backward
                saved, ctx.restack = tuple(weights), True
            else:
                saved = (w,)  # a copy (converted or stacked now), or transformers' stacked parameter itself
        else:
            xq, x_si = quant_ops.quantize_rowwise_fp8(x)
            y = moe_ops.grouped_gemm_device_fp8(xq, x_si, fp8.data, fp8.row_scale_inv, offsets)
            if not need_dx:
                pass  # no input gradient: the backward reads no weight copy
            elif fp8.data_t is not None:
                ctx.transposed = (fp8.data_t, fp8.row_scale_inv_t)
            else:
                # the weights themselves (views of the parameters, no copy): the backward casts the
                # transposed copy from them, and autograd checks that none changed meanwhile
                saved = tuple(weights) if weights else (stacked,)
                ctx.on_transpose_cast = fp8.on_transpose_cast
        ctx.save_for_backward(kept, probs, offsets, *saved)
        ctx.weights, ctx.stacked_dtype = weights, None if stacked is None else stacked.dtype
        ctx.fp8 = fp8 is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, probs, offsets, *saved = ctx.saved_tensors
        weights = ctx.weights
        dy = moe_ops.dense(dy.to(torch.bfloat16))
        dx = dprobs = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            if not ctx.fp8:
                w = _stack(saved)[0] if ctx.restack else saved[0]
                dx = moe_ops.grouped_gemm_device(dy, w, offsets)
            else:
                dyq, dy_si = quant_ops.quantize_rowwise_fp8(dy)
                if ctx.transposed is not None:
                    w_t, w_t_si = ctx.transposed
                else:
                    # the transposed copy made now, dropped after its product
                    stacked = _stack(saved)[0] if weights else saved[0]
                    ops = stacked_weights_fp8(stacked, rowwise=False)
                    w_t, w_t_si = ops.data_t, ops.row_scale_inv_t
                    del ops, stacked
                    if ctx.on_transpose_cast is not None:
                        ctx.on_transpose_cast()
                dx = moe_ops.grouped_gemm_device_fp8(dyq, dy_si, w_t, w_t_si, offsets, fast_accum=False)
                del w_t, w_t_si, dyq, dy_si  # freed before the weight gradient's output is made
            if ctx.swiglu:
                dx, dprobs = _swiglu_grads(dx, x, probs, ctx.needs_input_grad[1])
        dstacked, dws = None, [None] * len(weights)
        if ctx.needs_input_grad[4] or any(ctx.needs_input_grad[5:]):
            a = _weight_grad_input(ctx, x, probs, torch.bfloat16)
            dw = moe_ops.grouped_gemm_device(dy, a, offsets, transa=True)
            del a
            if not weights:
                dstacked = dw.to(ctx.stacked_dtype)
            else:
                dws = [dw[g].to(p.dtype) for g, p in enumerate(weights)]
        return (dx, dprobs, None, None, dstacked, *dws)


class GroupedLinear(torch.nn.Module):
    """G linear layers over consecutive row blocks, TE's
    ``transformer_engine.pytorch.GroupedLinear``.

    num_gemms: G (experts); in_features, out_features: sizes of each;
    bias: learn a bias per expert; params_dtype (default torch's default
    dtype); device ("cuda" where usable by default; "meta" defers
    initialization: call reset_parameters()); init_method: callable(weight)
    applied to each expert's weight in place (default normal, std 0.023, as
    TE); return_bias: return (y, [bias0, ...]) and leave the add to the
    caller; fuse_wgrad_accumulation: accepted (accumulation into main_grad
    happens whenever every weight carries one).  get_rng_state_tracker,
    rng_tracker_name: the weights are drawn inside
    ``get_rng_state_tracker().fork(rng_tracker_name)`` (TE), else from
    torch's generator; name: kept as ``self.name`` (TE's debug name).
    use_grouped_tensor (TE's choice of its own GEMM path) changes nothing
    here (logged once at INFO when given); TE's parallelism, overlap,
    deferred-wgrad and single-grouped-parameter arguments raise
    NotImplementedError unless off.

    ``keep_fp8_weights`` (an attribute, default False; host row counts and
    the device-ends route under delayed scaling):
    under FP8 in training without is_first_microbatch, False keeps none of
    the experts' weight casts past the forward (the backward keeps the
    transposed copy it reads), so no layer holds its FP8 weights through the
    activation peak; True keeps them per weight version as inference does
    (re-cast, into the same buffers where nothing else holds them, only
    when a weight changed), trading that memory for the forward's cast
    where the weights do not change between forwards.  Several forwards
    before their backwards (pipeline schedules, a layer called twice) each
    keep a transposed copy of their own under False; True (or
    is_first_microbatch) shares one.

    forward(inp [sum(m_splits), in_features] (or [..., in_features] whose
    rows add up), m_splits: G ints (host values; a CPU tensor is read) or
    a CUDA integer tensor (the device-split route, see the module note),
    is_first_microbatch, swiglu_probs: see forward).
    """

    keep_fp8_weights = False

    def __init__(self, num_gemms, in_features, out_features, *, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False, fuse_wgrad_accumulation=False, get_rng_state_tracker=None,
                 rng_tracker_name=None, name=None, **unsupported):
        super().__init__()
        for arg, value in unsupported.items():
            if arg in _TE_NO_EFFECT:
                if value is not _TE_NO_EFFECT[arg]:
                    note_once(_log, "seqfuse GroupedLinear: argument '%s'=%r picks one of Transformer Engine's "
                              "GEMM paths; it changes nothing in seqfuse (one grouped GEMM route per call, chosen "
                              "as the module note says)", arg, value)
                continue
            if arg not in _TE_DEFAULTS:
                raise TypeError(f"GroupedLinear: unexpected argument {arg!r}")
            off, why = _TE_DEFAULTS[arg]
            if value != off:
                raise NotImplementedError(f"GroupedLinear: argument '{arg}'={value!r} is not supported: {why}")
        self.get_rng_state_tracker, self.rng_tracker_name, self.name = get_rng_state_tracker, rng_tracker_name, name
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"GroupedLinear: num_gemms must be a positive int, got {num_gemms!r}")
        dtype = set_linear_options(self, "GroupedLinear", in_features, out_features, bias, return_bias,
                                   fuse_wgrad_accumulation, init_method, params_dtype)
        self.num_gemms = num_gemms
        device = default_device(device)
        # the experts' weights are slices of one [G, out, in] buffer, so the device-split route
        # reads them as one tensor without a copy (stacked_weights); set through .data, each
        # parameter keeps a version counter of its own (the FP8 weight cache follows each)
        stacked = torch.empty(num_gemms, self.out_features, self.in_features, dtype=dtype, device=device)
        for g in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=device))
            w.data = stacked[g]
            self.register_parameter(f"weight{g}", w)
            if self.use_bias:
                self.register_parameter(f"bias{g}", torch.nn.Parameter(
                    torch.empty(self.out_features, dtype=dtype, device=device)))
            else:
                self.register_parameter(f"bias{g}", None)
        # FP8: the quantizers of num_gemms GEMMs (scaling state made at the first FP8 use)
        self.__dict__["_fp8_quantizers"] = _gq.GemmQuantizers("GroupedLinear", num_gemms)
        if device.type != "meta":
            self.reset_parameters()

    def weights(self):
        params = self._parameters  # (read directly: nn.Module.__getattr__ per expert costs on every call)
        return [params[n] for n in _names("weight", self.num_gemms)]

    def biases(self):
        if not self.use_bias:
            return []
        params = self._parameters
        return [params[n] for n in _names("bias", self.num_gemms)]

    def stacked_weights(self):
        """The experts' weights as one [G, out_features, in_features] tensor
        (no autograd history): a view, no copy, where they are consecutive
        slices of one buffer, as __init__, ``module.to(...)`` and
        load_state_dict leave them (restack_weights); otherwise a stack made
        now (a copy, logged once): the forward never moves a parameter's
        storage, which another owner (an optimizer's flat buffer) may alias."""
        stacked, view = _stack(self.weights())
        if not view:
            note_once(_log, "seqfuse GroupedLinear: the experts' weights are not slices of one buffer (another "
                      "owner re-homed them, or they differ in dtype or device): they are stacked into one "
                      "tensor at every device-split call (a copy, kept for the backward; under FP8 at every "
                      "weight cast, and again in the backward where no FP8 copy is kept); restack_weights() "
                      "puts them into one buffer")
        return stacked

    @torch.no_grad()
    def restack_weights(self):
        """Move the experts' weights into one [G, out, in] buffer in order
        (each parameter's ``.data`` a slice of it; the parameter objects,
        values and version counters stay) where they are plain parameters of
        one shape, dtype and device not already so.  Called after
        ``module.to(...)`` and load_state_dict; call it after anything else
        that gave the weights storages of their own (not while an optimizer
        or wrapper aliases them into a flat buffer of its own: they would
        stop sharing it).  Returns whether it moved them."""
        ws = self.weights()
        w0 = ws[0]
        if _one_buffer(ws) or w0.device.type == "meta" or _gq.fsdp2_in_use():
            return False
        if not all(type(w) is torch.nn.Parameter and w.dtype == w0.dtype and w.device == w0.device
                   and w.shape == w0.shape for w in ws):
            return False
        stacked = torch.stack([w.detach() for w in ws])
        for g, w in enumerate(ws):
            w.data = stacked[g]
        return True

    def _apply(self, fn, recurse=True):
        # module.to(...) / .cuda() / .half() give each parameter storage of its own
        out = super()._apply(fn, recurse)
        self.restack_weights()
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # assign=True puts the loaded tensors (storages of their own) in place of the parameters
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.restack_weights()

    def device_split_refusal(self, x, recipe=ACTIVE_RECIPE):
        """Why a call with input rows ``x`` cannot take its row counts on the
        GPU (the device-split route), or None where it can.  ``recipe``: the
        FP8 recipe the call runs under (None: no FP8); by default the active
        FP8 autocast's."""
        if recipe is ACTIVE_RECIPE:
            recipe = _q.get_recipe() if _q.is_fp8_enabled() else None
        fp8 = recipe is not None
        if isinstance(recipe, DelayedScaling):
            return self._delayed_ends_refusal(x, recipe)
        if fp8:
            why = _fp8_device_refusal(recipe)
            if why is not None:
                return why
        if self.use_bias and not self.return_bias:
            return "the device-split route adds no bias"
        if all(getattr(w, "main_grad", None) is not None for w in self.weights()):
            return "the weights carry main_grad, which the cuBLASLt route accumulates into in float32"
        if _gq.fsdp2_in_use():
            return "FSDP2 manages the weights (one stacked copy per call would stay gathered until the backward)"
        return moe_ops.device_split_refusal(x, compute_dtype(x, self.weight0), (self.in_features, self.out_features),
                                            fp8=fp8)

    def _delayed_ends_refusal(self, x, recipe):
        """device_split_refusal under DelayedScaling: why the call cannot
        take DeviceEndsFp8GroupedLinearFunction (the forward's cast and
        product read the counts on the device; the backward reads their host
        copy), or None.  A layer's first FP8 forward refuses (no expert's
        input has an amax history yet): each expert input's first delayed
        cast takes its scale from its own amax, which the host-count route's
        per-expert casts compute.  After it, an expert that still has no
        history (it has received no rows) is cast on the route with its
        state's current scale, 1 for a tensor never cast (_note_fresh_experts)."""
        if stats.enabled():
            return "FP8 statistics are on (enable_stats; they are taken per cast of the host-count route)"
        if recompute.open_contexts:
            return "inside an activation checkpoint (its recompute replays the host-count route's noted scales)"
        if self.use_bias and not self.return_bias:
            return "the device-split route adds no bias"
        if _gq.fsdp2_in_use():
            return "FSDP2 manages the weights (the device-ends FP8 route is not written for its gathers)"
        if device_checks.capturing(self.weight0):
            return "CUDA graph capture (the backward reads the routing counts on the host)"
        why = moe_ops.sm90_kernel_refusal(x.device)
        if why is not None:
            return "the device-ends FP8 route runs seqfuse's sm90 grouped kernel: " + why
        if x.numel() == 0:
            return "the input has no rows"
        if compute_dtype(x, self.weight0) != torch.bfloat16:
            return f"the sm90 kernel writes bfloat16, this call computes in {compute_dtype(x, self.weight0)}"
        if self.in_features % 16 or self.out_features % 16:
            return (f"the device-ends FP8 route needs feature sizes that are multiples of 16, got "
                    f"{(self.in_features, self.out_features)}")
        if self.num_gemms > 64:
            return f"the sm90 kernel takes at most 64 experts, this layer has {self.num_gemms}"
        q = self._quantizers(recipe, x.device)
        if q.inputs[0].fp8_dtype != torch.float8_e4m3fn or q.weights[0].fp8_dtype != torch.float8_e4m3fn:
            return "the sm90 kernel's forward takes E4M3 inputs and weights"
        if not any(q.state.has_history(3 * g) for g in range(self.num_gemms)):
            return ("the layer's first FP8 forward: no expert's input has an amax history yet (a first delayed "
                    "cast takes the scale of its own amax, which the host-count route computes)")
        return None

    @torch.no_grad()
    def reset_parameters(self):
        """(Re)initialise the parameters (each weight by init_method, inside
        the RNG tracker's fork where one was given; biases zero).  On a
        module built with device="meta", first materialise them on the
        current CUDA device (the CPU without one), the weights again slices
        of one buffer, with the values direct construction gives."""
        if any(p.is_meta for p in self.parameters(recurse=False)):
            materialize(self)
            self.restack_weights()
        with rng_fork(self.get_rng_state_tracker, self.rng_tracker_name):
            for w in self.weights():
                init_weight(w, self.init_method)
        for b in self.biases():
            b.zero_()

    def extra_repr(self):
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, "
                f"params_dtype={self.weight0.dtype}")

    def fp8_features(self):
        """(name, size) of the FP8 GEMMs' feature dimensions (checked per recipe)."""
        return (("in_features", self.in_features), ("out_features", self.out_features))

    #: Marks an FP8 GEMM module for seqfuse.quantization's helpers
    #: (init_fp8_state, quantizers_for).  The count is per instance here: the
    #: module makes its GemmQuantizers of num_gemms GEMMs in __init__, which
    #: quantizers_for then finds and adopts.
    fp8_num_gemms = 1

    def _quantizers(self, recipe, device):
        """This module's GemmQuantizers under ``recipe`` (per-tensor recipes only)."""
        q = _gq.quantizers_for(self, recipe, device)
        q.weight_history = False  # (the one-launch cast of every expert's weight takes each one's own amax)
        return q

    def prefetch_fp8_weights(self, is_first_microbatch=None):
        """Under FP8 autocast, cast the experts' weights now where a forward
        with the same ``is_first_microbatch`` would (None: they changed since
        their last cast; True: always; False: only where none is cached), so
        a caller can queue the casts before it waits on the host
        (GroupedMLP: before reading the routing counts); the next forward
        with False or None reuses them; returns whether it did.  Nothing happens
        outside FP8 autocast, for block scaling (whose weight casts stay in
        the forward), under CUDA graph capture, or under FSDP2 (whose
        all-gather makes every forward cast again)."""
        if not _q.is_fp8_enabled() or _gq.fsdp2_in_use() or device_checks.capturing(self.weight0):
            return False
        q = self._quantizers(_q.get_recipe(), self.weight0.device)
        if q.kind == "block":
            return False
        weight_pairs(q, self.weights(), is_first_microbatch)
        return True

    def forward(self, inp, m_splits, is_first_microbatch=None, *, swiglu_probs=None, m_offsets=None,
                _refusal=_UNASKED, _counts_wait=None, _grad_link=None):
        """y for inp [sum(m_splits), in_features].  is_first_microbatch (TE):
        under FP8, True re-quantizes the weights, False reuses the previous
        call's, None re-quantizes a weight only when it changed; with
        gradients enabled (training) None casts at every call and keeps no
        cast past it: the forward operand is freed when the forward returns,
        the transposed copy lives in the backward's saved tensors until its
        product (quantization.grouped.lean_weights; not where no weight
        requires a gradient, under keep_fp8_weights, CUDA graph capture or
        inside an activation checkpoint, which keep them per weight version).
        On the device-split
        FP8 route (a CUDA m_splits) None with gradients enabled
        keeps no FP8 weight copy at all: the forward casts the copy it reads
        and the backward the transposed one, each freed after its product
        (a cast per call, for the memory); True / False keep both copies
        across micro-batches as above, and without gradients the forward's
        copy is kept per weight version (_device_fp8_weights).

        ``m_offsets`` (seqfuse's, with a CUDA m_splits): the row offsets
        ops.moe.device_split_offsets made of m_splits over the input's rows,
        where the caller has them (GroupedMLP's two GEMMs share one set);
        used where the call takes the device-split route.

        ``swiglu_probs`` (seqfuse's, for GroupedMLP's down projection): inp is
        [sum(m_splits), 2 x in_features] gate|up pairs (the experts' gate-up
        GEMM output) and the layer's input is scaled_swiglu(inp,
        swiglu_probs), swiglu_probs [sum(m_splits)] each row's routing
        weight.  Under FP8 delayed scaling the SwiGLU is computed inside this
        layer's input cast (quantization.grouped), so its output is never
        written in inp's dtype; otherwise (bf16, current or block scaling,
        or where the grouped cast declines) the SwiGLU output is written
        first, the values being the same.  For the backward the layer keeps
        inp and swiglu_probs (which the SwiGLU's backward reads), not the
        SwiGLU output: the weight gradient makes that again from them with
        the forward's kernel, the same bits (bf16 on either route; FP8
        current and block scaling make its FP8 copy again, delayed scaling
        keeps the forward's: Fp8GroupedLinearFunction).  Where no gradient
        flows to inp or swiglu_probs, the SwiGLU output (or its FP8 copy) is
        kept instead, being the smaller.

        ``_refusal`` (for GroupedMLP, which asks once per forward for both
        of its layers): device_split_refusal's answer for this call where
        the caller has it, so that it is not asked again; by default it is
        asked here when m_splits is a CUDA tensor.  ``_grad_link`` (for
        GroupedMLP, both layers given one GradHandoff): on the device-ends FP8
        route the down projection's backward hands the gate-up layer's backward
        its output gradient's FP8 copies."""
        cls = "GroupedLinear"
        if swiglu_probs is None:
            check_input(cls, inp, self.in_features, "in_features")
            return self._apply_to(inp, None, m_splits, is_first_microbatch, m_offsets, _refusal, _counts_wait,
                                  _grad_link)
        check_input(cls, inp, 2 * self.in_features, "2 x in_features (gate and up, with swiglu_probs)")
        rows = inp.numel() // inp.shape[-1] if inp.shape[-1] else 0
        check_input(cls, swiglu_probs, name="swiglu_probs")
        if swiglu_probs.dim() != 1 or swiglu_probs.shape[0] != rows:
            raise ValueError(f"{cls}: swiglu_probs must be 1-D with one entry per row of the input ({rows}), "
                             f"got shape {tuple(swiglu_probs.shape)}")
        if swiglu_probs.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{cls}: swiglu_probs must be float32, float16 or bfloat16, got {swiglu_probs.dtype}")
        if swiglu_probs.device != inp.device:
            raise ValueError(f"{cls}: swiglu_probs must be on the input's device ({inp.device}), got "
                             f"{swiglu_probs.device}")
        # the SwiGLU kernels read both row-major
        h, probs = inp.contiguous(), swiglu_probs.contiguous()
        return self._apply_to(h, probs, m_splits, is_first_microbatch, m_offsets, _refusal, _counts_wait, _grad_link)

    def _apply_to(self, inp, probs, m_splits, is_first_microbatch, m_offsets=None, why=_UNASKED, counts_wait=None,
                  grad_link=None):
        """forward's body; ``probs`` (None: no SwiGLU): inp holds gate|up
        pairs and probs the SwiGLU's row scales, the SwiGLU computed in the
        route's autograd Function.  ``why``: device_split_refusal's answer
        where the caller has it (for a CUDA m_splits), else asked here."""
        on_device = isinstance(m_splits, torch.Tensor) and m_splits.device.type != "cpu"
        if m_offsets is not None and not on_device:
            raise ValueError("GroupedLinear: m_offsets goes with m_splits given as a CUDA tensor (the "
                             "device-split route)")
        if on_device:
            if m_splits.device != inp.device:
                raise ValueError(f"GroupedLinear: m_splits on {m_splits.device} but the input on {inp.device}")
            if why is _UNASKED:
                why = self.device_split_refusal(inp)
            if why is None:
                return self._device_split(inp, m_splits, m_offsets, is_first_microbatch, probs, counts_wait,
                                          grad_link)
            note_once(_log, "seqfuse GroupedLinear: m_splits on the GPU read to the host (one host "
                      "synchronization per call): %s", why)
            device_checks.check_storage("GroupedLinear", "argument 'm_splits'", m_splits)  # (read below)
            m_splits = m_splits.cpu()  # (host_splits checks its dtype and rank)
        splits = tuple(moe_ops.host_splits("GroupedLinear", m_splits))
        if len(splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must hold num_gemms = {self.num_gemms} row "
                             f"counts, got {len(splits)}")
        recipe = _q.get_recipe() if _q.is_fp8_enabled() else None
        lead = inp.shape[:-1]
        x = gemm_rows(inp.reshape(-1, inp.shape[-1]))
        if sum(splits) != x.shape[0]:
            raise ValueError(f"GroupedLinear: m_splits add up to {sum(splits)} rows but the input has "
                             f"{x.shape[0]}")
        weights, biases = self.weights(), self.biases()
        dtype = compute_dtype(inp, weights[0])
        use_bias = self.use_bias and not self.return_bias
        params = weights + (biases if use_bias else [])
        overwrite = wgrad_overwrite(self, weights[0], is_first_microbatch)  # (TE reads the first weight's attribute)
        if recipe is not None:
            q = self._quantizers(recipe, x.device)
            lean = not self.keep_fp8_weights and lean_weights(weights, is_first_microbatch)
            y = Fp8GroupedLinearFunction.apply(x, probs, splits, dtype, self.num_gemms, use_bias,
                                               (q, is_first_microbatch, probs is not None, overwrite, lean),
                                               *params)
        else:
            y = GroupedLinearFunction.apply(x, probs, splits, dtype, self.num_gemms, use_bias, None, overwrite,
                                            *params)
        if inp.dim() != 2:
            y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, biases
        return y

    def _device_fp8_weights(self, is_first_microbatch):
        """The experts' FP8 operands for the device-split route
        (quantization.grouped.stacked_weights_fp8 of stacked_weights(), a
        StackedFloat8), by mode (Transformer Engine's is_first_microbatch
        contract; in the first mode leaner than TE, which keeps the
        transposed copy from the forward to the backward):

        - is_first_microbatch None with gradients enabled (training, one
          forward per optimizer step): no FP8 copy outlives its use.  Only
          the forward's copy (``data``) is cast, used by this call's forward
          product and freed when it returns; the backward casts the
          transposed copy itself from the weights (DeviceSplitGroupedLinear-
          Function), uses it for the input gradient and frees it.  The cache
          is neither read nor written, and an entry left by another mode is
          dropped (its memory freed).
        - is_first_microbatch True / False (gradient accumulation, TE's
          contract): both copies are cast and cached; False reuses the
          cached ones (recast where the cache holds no transposed copy and
          gradients are enabled), True recasts.
        - gradients disabled (inference under FP8 autocast): the forward's
          copy alone, cached and reused while every weight is the same
          parameter with the same storage and version (quantization.
          gemm_quantizers.weight_key / same_weights); is_first_microbatch
          False reuses, True recasts, as above.

        A CUDA graph capture always casts, inside the graph, and caches
        nothing (the modes' copies otherwise as above).
        ``fp8_device_weight_casts`` counts the casts made here (one per
        call that casts, whichever copies); ``fp8_device_weight_transpose_
        casts`` the backward's casts of the transposed copy in the first
        mode."""
        ws = self.weights()
        grad = torch.is_grad_enabled()
        lean = is_first_microbatch is None and grad
        capture = device_checks.capturing(self.weight0)
        d = self.__dict__
        key = None
        if lean or capture:
            d["_fp8_device_weights"] = None
        else:
            key = _gq.weight_key(ws, *(w.dtype for w in ws))
            cached = d.get("_fp8_device_weights")
            if cached is not None:
                old_key, old_ws, ops = cached
                if (ops.data_t is not None or not grad) and (
                        is_first_microbatch is False
                        or (is_first_microbatch is None and _gq.same_weights(key, ws, old_key, old_ws))):
                    return ops
        note_grouped("the device-split route runs the forward and input-gradient GEMMs in FP8 with one "
                     "scale per row of the activations and gradients (current scaling, E4M3) and one per "
                     "expert weight; the weight gradient in bfloat16")
        if lean:
            note_grouped("the device-split route's FP8 weight copies are made per call and freed after use "
                         "(the forward's in the forward, the input gradient's transposed copy in the "
                         "backward); GroupedLinear.forward's is_first_microbatch (Transformer Engine's "
                         "gradient-accumulation argument, which GroupedMLP.forward and the Mixtral decoder "
                         "layer's forward pass on) keeps them across micro-batches; the Mixtral models' forward "
                         "does not take it")
        # the transposed copy where a backward of this call reads a cached one (the second mode)
        ops = stacked_weights_fp8(self.stacked_weights(), transpose=grad and not lean)
        if lean:
            ops.on_transpose_cast = self._count_transpose_cast
        elif not capture:
            d["_fp8_device_weights"] = (key, tuple(ws), ops)
        d["fp8_device_weight_casts"] = d.get("fp8_device_weight_casts", 0) + 1
        return ops

    def _count_transpose_cast(self):
        d = self.__dict__
        d["fp8_device_weight_transpose_casts"] = d.get("fp8_device_weight_transpose_casts", 0) + 1

    def _device_split(self, inp, counts, offsets=None, is_first_microbatch=None, probs=None, counts_wait=None,
                      grad_link=None):
        """The device-split route for row counts ``counts`` on the GPU
        (DeviceSplitGroupedLinearFunction; under FP8 delayed scaling
        DeviceEndsFp8GroupedLinearFunction) (``offsets``: their
        device_split_offsets, made here when not given; ``probs``: inp holds
        gate|up pairs and the layer's input is their SwiGLU scaled by probs,
        as forward's swiglu_probs; ``counts_wait``: moe_ops.counts_to_host of
        the counts, which the delayed-scaling form's backward reads, made
        here when not given: GroupedMLP's two layers share one; ``grad_link``:
        GroupedMLP's GradHandoff between its layers, used under FP8 delayed
        scaling)."""
        if counts.dim() != 1 or counts.numel() != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must hold num_gemms = {self.num_gemms} row counts, got "
                             f"shape {tuple(counts.shape)}")
        x = gemm_rows(inp.reshape(-1, inp.shape[-1]))
        if offsets is None:
            offsets = moe_ops.device_split_offsets(counts, x.shape[0])
        recipe = _q.get_recipe() if _q.is_fp8_enabled() else None
        if isinstance(recipe, DelayedScaling):
            # the delayed-scaling form: the forward on the device, the backward from the counts' host copy
            if counts_wait is None:
                counts_wait = moe_ops.counts_to_host(counts)
            x = _ends_input(x)
            qargs, ws = self._ends_args(recipe, x.device, is_first_microbatch, grad_link)
            y = DeviceEndsFp8GroupedLinearFunction.apply(x, probs, offsets, counts_wait, torch.bfloat16,
                                                         self.num_gemms, qargs, *ws)
        else:
            if recipe is not None:
                # the weights' FP8 operands carry what the products read (where no transposed copy is kept,
                # the backward re-stacks the weights it saved): no stacked copy passes in
                stacked, fp8 = None, self._device_fp8_weights(is_first_microbatch)
            else:
                stacked, fp8 = self.stacked_weights(), None
            y = DeviceSplitGroupedLinearFunction.apply(x, probs, offsets, fp8, stacked, *self.weights())
        if inp.dim() != 2:
            y = y.view(*inp.shape[:-1], self.out_features)
        return (y, self.biases()) if self.return_bias else y


    def _ends_args(self, recipe, device, is_first_microbatch, grad_link):
        """(qargs, weights): DeviceEndsFp8GroupedLinearFunction's arguments
        past the counts for this layer under delayed scaling ``recipe``
        (GroupedMLP's one-node form passes two layers' to
        DeviceEndsFp8GroupedMLPFunction)."""
        q = self._quantizers(recipe, device)
        _note_fresh_experts(q, self.num_gemms)
        ws = self.weights()
        lean = not self.keep_fp8_weights and lean_weights(ws, is_first_microbatch)
        overwrite = wgrad_overwrite(self, ws[0], is_first_microbatch)
        # lean, with the weights in one aligned buffer and no cast kept from another mode: one cast of the
        # stack, no caches (else weight_pairs, which reuses what is cached and casts the rest)
        stacked = None
        if lean and ws[0].data_ptr() % 16 == 0 and all(r.pair is None for r in q.weights):
            stacked = _buffer_view(ws)
        return (q, is_first_microbatch, overwrite, lean, stacked, grad_link), ws


def _ends_input(x):
    """x as the device-ends route's input cast reads it: dense and 16-byte aligned (else copied, logged)."""
    x = moe_ops.dense(x)  # (the cast reads whole rows in 16-byte vectors)
    if x.data_ptr() % 16:
        note_grouped("an input not 16-byte aligned is copied for the device-ends route's cast, which "
                     "reads it in 16-byte vectors")
        x = x.clone()
    return x


def _note_fresh_experts(q, G):
    """Before a device-ends forward: experts whose inputs have no amax
    history (no row of theirs cast yet) are cast on the route with their
    state's current scale (1 for a tensor never cast: Transformer Engine's
    first-step scale), where the host-count route's first cast takes the
    scale of the rows' own amax; logged once.  Which of them get rows is
    known on the host in the backward, which notes their first casts
    (DeviceEndsFp8GroupedLinearFunction.backward), so that the next update
    gives them a history, as the host route's first casts do."""
    if not all(q.state.has_history(3 * g) for g in range(G)):
        note_grouped("experts whose inputs have no amax history yet (no rows so far) are cast on the "
                     "device-ends route with their scaling state's current scale (1 for a tensor never cast, "
                     "Transformer Engine's first-step scale), not with one from their own amax as the host-count "
                     "route's first casts are")


def _fp8_device_refusal(recipe):
    """Why FP8 autocast under ``recipe`` keeps a grouped layer off the
    device-split route (its FP8 form computes current scales, E4M3, no
    margin), or None where it may take it."""
    if not isinstance(recipe, Float8CurrentScaling):
        return (f"the device-split FP8 route computes current scales (one per row); {type(recipe).__name__} "
                "takes host row counts")
    if recipe.fp8_format != Format.E4M3:
        return ("torch's scaled grouped GEMM takes E4M3 operands only: Float8CurrentScaling with "
                f"fp8_format={recipe.fp8_format.name} (E5M2 gradients) takes host row counts")
    if recipe.margin:
        return f"the device-split FP8 route scales without a margin; margin={recipe.margin} takes host row counts"
    if stats.enabled():
        # refused on every step while statistics are on, not only on the steps that record, so that the
        # recorded casts are those of the route every step runs
        return "FP8 statistics are on (enable_stats; they are taken per cast of the host-count route)"
    return None


@functools.lru_cache(maxsize=None)
def _names(kind, count):
    """("weight0", ..., "weight<count-1>"): GroupedLinear's parameter names
    of one kind."""
    return tuple(f"{kind}{g}" for g in range(count))


def _stack(ws):
    """(the weights ``ws`` as one [G, out, in] tensor without autograd
    history, whether it is a view): a view of their buffer where they are
    consecutive slices of one (_one_buffer), else a stack made now (a copy)."""
    view = _buffer_view(ws)
    if view is not None:
        return view, True
    return torch.stack([w.detach() for w in ws]), False


def _buffer_view(ws):
    """The weights ``ws`` as one [G, out, in] view of their buffer without
    autograd history where they are consecutive slices of one
    (_one_buffer), else None."""
    if not _one_buffer(ws):
        return None
    w0 = ws[0]
    return w0.detach().as_strided((len(ws), *w0.shape), (w0.numel(), *w0.stride()))


def _one_buffer(ws):
    """Whether the weights ``ws`` are consecutive, equally shaped, contiguous
    slices of one storage, in order (w0's storage holds them all: separate
    allocations never share bytes, so an address inside it is its own)."""
    w0 = ws[0]
    step, es, p0 = w0.numel(), w0.element_size(), w0.data_ptr()
    storage = w0.untyped_storage()
    if p0 + len(ws) * step * es > storage.data_ptr() + storage.nbytes():
        return False
    return all(w.dtype == w0.dtype and w.shape == w0.shape and w.is_contiguous()
               and w.data_ptr() == p0 + g * step * es for g, w in enumerate(ws))


# ---- FP8 ---------------------------------------------------------------------

def _empty_operand(k, fp8_dtype, device):
    """The FP8 operand triple of an expert with no rows: [0, k] data, its
    [k, 0] transposed copy, a scale inverse that is never read (the group
    is skipped, or its product is the empty sum)."""
    data = torch.empty((0, k), dtype=fp8_dtype, device=device)
    data_t = torch.empty((k, 0), dtype=fp8_dtype, device=device)
    return data, data_t, torch.ones(1, dtype=torch.float32, device=device)


def _unpad(y, splits, padded):
    """The real rows of a result computed over padded row blocks."""
    if tuple(splits) == tuple(padded):
        return y
    parts, o = [], 0
    for m, p in zip(splits, padded):
        if m:
            parts.append(y[o:o + m])
        o += p
    if not parts:
        return y.new_empty((0, y.shape[1]))
    return torch.cat(parts)


class _Columns:
    """A GroupedFloat8's transposed blocks as a grouped-GEMM operand (the
    weight gradient's): one [K, padded[g]] view per expert, and the experts'
    scale inverses as one per-group tensor."""
    __slots__ = ("blocks", "scale_inv")

    def __init__(self, gq):
        self.blocks, self.scale_inv = gq.column_blocks(), gq.scale_inv


class _Stacked:
    """The experts' FP8 weights as one [G, rows, cols] tensor and their
    per-tensor scale inverses as one [G] tensor, a grouped-GEMM operand
    (the device-ends route's lean input gradient)."""
    __slots__ = ("data", "scale_inv")

    def __init__(self, data, scale_inv):
        self.data, self.scale_inv = data, scale_inv


def _operand(x):
    """(data, scale_inv, scaling) of a grouped FP8 GEMM operand: a list of
    per-expert triples (data, scale_inv, scaling), a GroupedFloat8 (its
    row-wise copy, split by the padded counts), _Columns or _Stacked."""
    if isinstance(x, GroupedFloat8):
        return x.data, x.scale_inv, "tensor"
    if isinstance(x, (_Columns, _Stacked)):
        return (x.blocks if isinstance(x, _Columns) else x.data), x.scale_inv, "tensor"
    return [t[0] for t in x], [t[1] for t in x], _mode(x)


def _grouped(a, b, splits, out, **kw):
    """The grouped FP8 GEMM over two operands (_operand's forms), b given as
    [n, k] (transb)."""
    a_data, a_si, a_mode = _operand(a)
    b_data, b_si, b_mode = _operand(b)
    return moe_ops.grouped_gemm(a_data, b_data, splits, transb=True, out=out, a_scale_inv=a_si,
                                b_scale_inv=b_si, a_scaling=a_mode, b_scaling=b_mode, **kw)


def _mode(triples):
    modes = {t[2] for t in triples if t[0].numel()}
    return (modes.pop() if modes else None) or "tensor"


def _expert_casts(roles, x, splits, kind, need_w):
    """(row-wise, column-wise) operand triples of each expert's rows of x,
    cast one expert at a time by its role quantizer (column-wise None
    without ``need_w``)."""
    K = x.shape[1]
    x_row, x_col = [], []
    for g, xg in enumerate(x.split(list(splits))):
        if splits[g] == 0:
            d, dt, si = _empty_operand(K, roles[g].fp8_dtype, x.device)
            x_row.append((d, si, None))
            x_col.append((dt, si, None))
            continue
        xq = roles[g].quantize(xg, transpose=need_w)
        x_row.append(F8.rowwise(xq, kind))
        x_col.append(F8.columnwise(xq, kind) if need_w else None)
    return x_row, x_col


def _expert_grad_casts(roles, dy, splits, kind, bias_dtypes, need_dx, need_dw):
    """(row-wise triples, column-wise triples, bias gradients) of each
    expert's rows of dy, cast one expert at a time (bias_dtypes None: no
    bias gradients, a list of Nones)."""
    N = dy.shape[1]
    g_row, g_col, dbs = [], [], []
    for g, dyg in enumerate(dy.split(list(splits))):
        if splits[g] == 0:
            d, dt, si = _empty_operand(N, roles[g].fp8_dtype, dy.device)
            g_row.append((d, si, None))
            g_col.append((dt, si, None))
            dbs.append(torch.zeros(N, dtype=bias_dtypes[g], device=dy.device) if bias_dtypes else None)
            continue
        gq, db = roles[g].quantize_grad(dyg, bias_dtypes[g] if bias_dtypes else None,
                                        need_dgrad=need_dx, need_wgrad=need_dw)
        g_row.append(F8.rowwise(gq, kind) if need_dx else None)
        g_col.append(F8.columnwise(gq, kind) if need_dw else None)
        dbs.append(db)
    return g_row, g_col, dbs


def _swiglu_columns(q, h, probs, splits, padded):
    """The transposed FP8 copy of scaled_swiglu(h, probs) for the weight
    gradient under current or block scaling (GemmQuantizers ``q``), made
    as Fp8GroupedLinearFunction's forward makes it: the SwiGLU kernel, then
    every expert's cast in one call, else expert by expert (the same
    values); the scales come from the values, so the bytes and scales are
    the forward's."""
    a = moe_ops.swiglu_forward(h, probs)
    gx = quantize_grouped(q, "input", a, splits, padded, rowwise=False, transpose=True)
    if gx is not None:
        return _Columns(gx)
    return _expert_casts(q.inputs, a, splits, q.kind, True)[1]


#: Fp8GroupedLinearFunction's arguments before the weights and biases.
_FP8_ARGS = 7

class Fp8GroupedLinearFunction(torch.autograd.Function):
    """Autograd of y_g = x_g W_g^T + b_g with FP8 grouped GEMMs (see the module
    note).  forward(x, probs, m_splits, dtype, num_gemms, use_bias,
    (quantizers, is_first_microbatch, swiglu, overwrite, lean), *weights,
    *biases); ``lean`` (lean_weights): the experts' weight casts are let go
    once the forward's product is issued.  The input
    and output gradient are cast for all experts in one call where
    quantization.grouped allows (a GroupedFloat8: its row-wise copy split
    by the padded counts, its transposed blocks as _Columns), else per
    expert into modules._fp8's triples (data, scale_inv, scaling); the
    weights are per-expert triples either way.  ``swiglu`` (GroupedMLP's
    down projection): the layer's input is scaled_swiglu(x, probs) for x
    [M, 2K] gate|up pairs, computed inside the input's FP8 cast (never
    written in x's dtype, where the cast is grouped), and the backward
    returns the gradients of x and probs; else probs is None.  The fused
    cast serves delayed scaling; current and block scaling write the SwiGLU
    output first (logged once).  With ``swiglu`` the weight gradient's
    operand, the SwiGLU output's transposed FP8 copy, is made again in the
    backward under current and block scaling and kept from the forward
    under delayed scaling (why: the note in forward)."""

    @staticmethod
    def forward(ctx, x, probs, m_splits, dtype, G, use_bias, qargs, *params):
        q, first, swiglu, overwrite, lean = qargs
        kind = q.kind
        weights, biases = params[:G], params[G:] if use_bias else None
        need_w = any(ctx.needs_input_grad[_FP8_ARGS:_FP8_ARGS + G])
        x = x.detach()
        probs = probs.detach() if probs is not None else None
        K = x.shape[1] // 2 if swiglu else x.shape[1]
        padded = tuple(_gq.padded_rows(m) for m in m_splits)
        pairs = weight_pairs(q, weights, first)  # every expert's weight cast in one call where all are due
        # every expert's input cast in one call, else expert by expert (quantization.grouped).  The SwiGLU
        # inside the cast under delayed scaling only: current scaling's fused cast reads x twice (amax,
        # then cast) and measured slower than the SwiGLU kernel then the grouped cast (check_cast 8, H200)
        fused = swiglu and kind == "delayed"
        if swiglu and not fused:
            note_grouped("%s scaling writes the SwiGLU output, then casts it (the fused SwiGLU cast serves "
                         "delayed scaling; under current scaling it reads the input twice and is slower)", kind)
        # The weight gradient's operand, the SwiGLU output's transposed FP8 copy ([K, Mp], one byte an
        # element): under current and block scaling not kept but made again in the backward from the
        # gate|up pairs and probabilities the SwiGLU's backward keeps (_swiglu_columns: the same kernels,
        # scales from the same values, so the same bytes and scales; where no gradient flows to them the
        # copy is kept, being smaller than they are).  Under delayed scaling kept from this cast: its scales
        # are the scaling state's now, which the step's update at the autocast region's exit replaces
        # before the backward, so a cast there would not give these bytes (and would fold its amaxes into
        # the state again).
        swiglu_grad = swiglu and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        recast = swiglu_grad and need_w and kind != "delayed"
        keep_t = need_w and not recast
        inp = moe_ops.swiglu_forward(x, probs) if swiglu and not fused else x
        gx = quantize_grouped(q, "input", inp, m_splits, padded, transpose=keep_t, swiglu=fused, probs=probs)
        if gx is not None:
            x_row, x_col = gx, None
        else:
            act = moe_ops.swiglu_forward(x, probs) if fused else inp
            x_row, x_col = _expert_casts(q.inputs, act, m_splits, kind, keep_t)
        w_forward = [F8.weight_forward(p, kind) for p in pairs]
        bias = None
        if use_bias:
            # cuBLASLt's FP8 kernels take the bias in bfloat16 (float16 for a float16 output)
            want = torch.float16 if dtype == torch.float16 else torch.bfloat16
            bias = [b.detach().to(want) for b in biases]
        N = w_forward[0][0].shape[0]
        out = torch.empty((sum(padded), N), dtype=dtype, device=x.device)
        y = _unpad(_grouped(x_row, w_forward, padded, out, bias=bias, fast_accum=kind != "block"),
                   m_splits, padded)
        w_dg = [F8.weight_dgrad(p, kind) for p in pairs]
        saved = [t for op in w_dg for t in F8.weight_saved(op)]
        if lean:  # the forward operand's bytes go with this call's references to them
            release_weight_pairs(q)
        if keep_t and gx is not None:  # the transposed copy [K, Mp] and the scale inverses
            saved += [gx.data_t, gx.scale_inv]
        elif keep_t:
            saved += [t for op in x_col for t in op[:2]]
        # the SwiGLU's backward reads its input (kept where a gradient flows to it)
        ctx.swiglu, ctx.recast = swiglu_grad, recast
        ctx.overwrite = overwrite
        if swiglu_grad:
            saved += [x, probs]
        ctx.save_for_backward(*saved)
        ctx.modes = ([op[2] for op in w_dg], (gx is not None) if keep_t else None,
                     [op[2] for op in x_col] if keep_t and gx is None else None)
        ctx.q, ctx.G, ctx.dtype, ctx.m_splits, ctx.padded, ctx.K = q, G, dtype, m_splits, padded, K
        ctx.weights = weights
        ctx.bias_dtypes = [b.dtype for b in biases] if use_bias else None
        return y

    @staticmethod
    def backward(ctx, dy):
        G, splits, padded = ctx.G, ctx.m_splits, ctx.padded
        saved = ctx.saved_tensors
        w_modes, x_grouped, x_modes = ctx.modes
        h = probs = None
        if ctx.swiglu:
            saved, (h, probs) = saved[:-2], saved[-2:]
        w_dg = [(saved[2 * g], saved[2 * g + 1], w_modes[g]) for g in range(G)]
        if ctx.recast:
            def x_col():
                return _swiglu_columns(ctx.q, h, probs, splits, padded)
        elif x_grouped:
            x_col = _Columns(GroupedFloat8(None, saved[2 * G], saved[2 * G + 1], padded))
        elif x_modes is not None:
            x_col = [(saved[2 * G + 2 * g], saved[2 * G + 2 * g + 1], x_modes[g]) for g in range(G)]
        else:
            x_col = None
        return _fp8_grouped_backward(ctx, dy, splits, padded, w_dg, x_col, h, probs)


def _fp8_grouped_backward(ctx, dy, splits, padded, w_dg, x_col, h=None, probs=None, swiglu_cast=None, link_out=None,
                          link_in=None):
    """The backward both FP8 grouped Functions share (Fp8GroupedLinearFunction,
    DeviceEndsFp8GroupedLinearFunction), given the host row counts
    ``splits`` and their ``padded`` counts: the output gradient cast for
    every expert in one call (else expert by expert), the input gradient
    against the weights' dgrad operands ``w_dg`` (per-expert triples or _Stacked; with
    ``ctx.swiglu`` then the SwiGLU's backward over its input ``h`` and row
    scales ``probs``), and the weight gradients against the input's
    transposed FP8 copy ``x_col`` (_operand's forms, or a callable that
    makes it, called only where a weight gradient is wanted), accumulated
    into main_grad where every weight has one.  The SwiGLU's backward reads
    the input gradient in the grouped GEMM's padded blocks
    (swiglu_backward_cast_fp8_grouped); given ``swiglu_cast`` (the
    forward's per-expert scales and FP8 dtype of the SwiGLU value's cast)
    and a weight gradient to make, the same pass makes x_col (the value's
    transposed copy with those scales: the bytes a forward copy would hold)
    instead of ``x_col``; given ``link_out`` (a GradHandoff whose consumer
    expects them), it also makes the input gradient's FP8 copies for the
    gate-up layer, which takes them through ``link_in`` instead of casting
    its output gradient.  ``ctx`` carries G, q, dtype,
    K, swiglu, overwrite, bias_dtypes, weights and the Function's
    needs_input_grad (x and probs first, the weights from _FP8_ARGS on);
    returns the Function's gradients."""
    G, q, dtype = ctx.G, ctx.q, ctx.dtype
    kind = q.kind
    device = ctx.weights[0].device
    need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need_dw = any(ctx.needs_input_grad[_FP8_ARGS:_FP8_ARGS + G])
    need_db = ctx.bias_dtypes is not None and any(ctx.needs_input_grad[_FP8_ARGS + G:])
    weights = ctx.weights
    # every expert's gradient cast in one call, else expert by expert (also for bias gradients,
    # which the per-expert casts sum in their own pass)
    gg = link_in.take(dy, padded, need_dx, need_dw) if link_in is not None and not need_db else None
    if gg is None:
        if dy is None:  # (DeviceEndsFp8GroupedMLPFunction hands over dy's FP8 copies alone)
            raise RuntimeError("GroupedLinear: the gate-up layer's backward got neither its output gradient nor "
                               "its FP8 copies (an internal error of GroupedMLP's one-node backward)")
        dy = moe_ops.dense(dy)
        if not need_db:
            gg = quantize_grouped(q, "grad", dy, splits, padded, rowwise=need_dx, transpose=need_dw)
    if gg is not None:
        g_row, g_col, dbs = gg, _Columns(gg) if need_dw else None, []
    else:
        g_row, g_col, dbs = _expert_grad_casts(q.grads, dy, splits, kind, ctx.bias_dtypes if need_db else None,
                                               need_dx, need_dw)
    dx = dprobs = None
    if need_dx:
        out = torch.empty((sum(padded), ctx.K), dtype=dtype, device=device)
        dgrad = _grouped(g_row, w_dg, padded, out)
        del out
        unfused = _swiglu_unfused(dgrad, h) if ctx.swiglu else None
        if ctx.swiglu and unfused is None:
            cast = swiglu_cast if need_dw else None
            grad_kw = link_out.producer_args(splits) if link_out is not None else {}
            # dx itself where someone reads it: not in GroupedMLP's one-node form, whose gate-up layer takes
            # its FP8 copies (made here) alone, nor where only dprobs is wanted
            want_dx = ctx.needs_input_grad[0] and not (grad_kw and link_out.fused)
            dx, dprobs, data_t, si, g = moe_ops.swiglu_backward_cast_fp8_grouped(
                dgrad, h, probs, splits, cast[1] if cast else None, scale=cast[0] if cast else None,
                need_dprobs=ctx.needs_input_grad[1], want_dx=want_dx, **grad_kw)
            if data_t is not None:
                x_col = _Columns(GroupedFloat8(None, data_t, si, padded))
            if g is not None:
                link_out.put(dx, GroupedFloat8(g[0], g[1], g[2], padded))
        elif ctx.swiglu:
            note_grouped("the SwiGLU's backward runs unfused (its input gradient unpadded first, the weight "
                         "gradient's FP8 operand cast apart): %s", unfused)
            dx, dprobs = moe_ops.swiglu_backward(_unpad(dgrad, splits, padded), h, probs, ctx.needs_input_grad[1])
        else:
            dx = _unpad(dgrad, splits, padded)
        del dgrad  # (before the weight gradient's product)
        if not ctx.needs_input_grad[0]:
            dx = None
    dws = [None] * G
    if need_dw:
        if callable(x_col):
            x_col = x_col()
        mains = [getattr(w, "main_grad", None) for w in weights]
        if all(m is not None for m in mains):
            _grouped(g_col, x_col, padded, mains, accumulate=not ctx.overwrite)
            for w in weights:
                mark_main_grad(w)
        else:
            res = _grouped(g_col, x_col, padded, None, out_dtype=F8.wgrad_dtype(weights[0].dtype))
            dws = [res[g] if res.dtype == weights[g].dtype else res[g].to(weights[g].dtype)
                   for g in range(G)]
    grads_b = []
    if ctx.bias_dtypes is not None:
        grads_b = dbs if need_db else [None] * G
    return (dx, dprobs, *(None,) * (_FP8_ARGS - 2), *dws, *grads_b)


def _swiglu_unfused(dgrad, h):
    """Why the SwiGLU's backward cannot take its one grouped pass
    (swiglu_backward_cast_fp8_grouped) over the input gradient ``dgrad`` and
    the saved gate|up pairs ``h``, or None."""
    if dgrad.dtype != h.dtype:
        return f"the input gradient is {dgrad.dtype}, the saved gate|up pairs {h.dtype}"
    if h.is_cuda and h.data_ptr() % 16:
        return "the saved gate|up pairs are not 16-byte aligned (the pass reads 16-byte vectors)"
    return None


def _stacked_fp8_weights(w_forward):
    """(b [G, N, K], b_scale_inv [G]) of the experts' forward weight
    operands from weight_pairs (per-expert (data, scale_inv, mode) triples)
    for the device-ends GEMM: each as one strided view where the experts'
    tensors are evenly spaced views of one tensor (what weight_pairs'
    one-call cast makes), else stacked into one (a copy; for the weights
    logged once)."""
    datas = [op[0] for op in w_forward]
    sis = [op[1] if op[1].dim() == 1 else op[1].reshape(1) for op in w_forward]
    b = _one_view(datas)
    if b is None:
        note_grouped("the experts' FP8 weights were not cast into one buffer (cast expert by expert): the "
                     "device-ends route stacks them (a copy of each) for its one grouped product")
        b = torch.stack(datas)
    b_si = _one_view(sis)
    return b, (b_si.reshape(len(sis)) if b_si is not None else torch.cat(sis))


def _one_view(ts):
    """The same-shaped, same-strided tensors ``ts`` as one [G, ...] view
    where they are views of one tensor (as unbind and split make them), each
    a fixed positive step of elements after the one before, else None."""
    t0 = ts[0]
    if len(ts) == 1:
        return t0.unsqueeze(0)
    base, p0, size, dtype = t0._base, t0.data_ptr(), t0.element_size(), t0.dtype
    step = ts[1].data_ptr() - p0
    if base is None or step <= 0 or step % size:
        return None
    shape, stride = t0.shape, t0.stride()
    for g, t in enumerate(ts):
        if (t._base is not base or t.dtype != dtype or t.data_ptr() != p0 + g * step or t.shape != shape
                or t.stride() != stride):
            return None
    return t0.as_strided((len(ts),) + tuple(shape), (step // size,) + tuple(stride))


class GradHandoff:
    """The gate-up layer's FP8 output gradient, made by the down projection's
    backward in GroupedMLP (device-ends route, FP8 delayed scaling).

    The down projection's SwiGLU backward writes the gate-up layer's output
    gradient dx; the pass that writes it can cast it too, with the gate-up
    layer's gradient scales, into the copies that layer's backward would
    otherwise cast from dx at once (quantize_grouped(q, "grad", dx, ...):
    the same bytes, amaxes and scale inverses).  GroupedMLP gives both
    layers one GradHandoff: the gate-up layer's forward says which copies
    its backward reads (``expect``), the down projection's backward makes
    them (``producer_args``, ``put``) where quantize_grouped would cast in
    one call, and the gate-up layer's backward ``take``s them where the
    gradient it receives is that very dx (anything else, a gradient
    accumulated from elsewhere or changed in place, and it casts its own,
    logged).  The cast's amaxes go to a scratch vector, folded into the
    state's slots when the copies are taken: a gradient cast again folds
    only its own.  ``fused`` (GroupedMLP's one-node form,
    DeviceEndsFp8GroupedMLPFunction): the gate-up layer's backward runs
    right after in the same node and receives no dx at all (the pass does
    not write it), so the copies are always taken and their amaxes go to
    the state's slots directly, with no scratch and no end-of-pass drop."""
    __slots__ = ("q", "rowwise", "transpose", "stash", "amax_slots", "scratch", "fused")

    def __init__(self, fused=False):
        self.q = self.stash = self.amax_slots = self.scratch = None
        self.rowwise = self.transpose = False
        self.fused = bool(fused)

    def expect(self, q, *, rowwise, transpose):
        self.q, self.rowwise, self.transpose = q, rowwise, transpose

    def producer_args(self, splits):
        """swiglu_backward_cast_fp8_grouped's grad_* arguments, or {} where
        the consumer expects nothing or would not cast in one call."""
        if self.q is None or not (self.rowwise or self.transpose):
            return {}
        slots = delayed_grad_slots(self.q, splits)
        if slots is None:
            return {}
        self.amax_slots = slots[1]
        # (the one-node form's copies are always taken: their amaxes go to the state's slots at once)
        self.scratch = None if self.fused else torch.zeros(len(splits), dtype=torch.float32, device=slots[1].device)
        return dict(grad_fp8_dtype=slots[2], grad_scale=slots[0],
                    grad_amax=self.amax_slots if self.fused else self.scratch,
                    grad_rowwise=self.rowwise, grad_transpose=self.transpose)

    def put(self, dx, gq):
        """The copies ``gq`` of ``dx`` (their amaxes in producer_args' scratch), kept until the gate-up
        layer's backward takes them or, where this backward pass does not reach it, its end."""
        self.stash = (dx, None if dx is None else dx._version, gq)
        if not self.fused:  # (the one node takes them within its own backward)
            torch.autograd.Variable._execution_engine.queue_callback(self._drop)

    def _drop(self):
        self.stash = None

    def _fold(self):
        """The copies' amaxes into the state's slots, as the cast folds them (fp8.h's sf_amax_fold: the
        larger bits, compared signed); the one-node form's were folded by the cast."""
        if self.scratch is None:
            return
        bits = self.amax_slots.view(torch.int32)
        bits.copy_(torch.maximum(bits, self.scratch.view(torch.int32)))

    def take(self, dy, padded, rowwise, transpose):
        """The stashed GroupedFloat8 where ``dy`` is the dx it was made of
        and it holds the copies wanted, else None (logged where one was made)."""
        st, self.stash = self.stash, None
        if st is None:
            return None
        dx, version, gq = st
        holds = (tuple(gq.padded) == tuple(padded) and (gq.data is not None or not rowwise)
                 and (gq.data_t is not None or not transpose))
        if dx is None or dy is None:  # (the one-node form: dx was never written, only cast)
            same = dx is None and dy is None
        else:
            same = (dy.data_ptr() == dx.data_ptr() and dy.shape == dx.shape and dy.stride() == dx.stride()
                    and dy.dtype == dx.dtype and dy._version == version)
        if same and holds:
            self._fold()
            return gq
        note_grouped("the gate-up layer's output gradient is not the tensor the down projection's backward "
                     "cast (accumulated with another gradient, changed in place, or other copies wanted): "
                     "cast again")
        return None


class DeviceEndsFp8GroupedLinearFunction(torch.autograd.Function):
    """Autograd of y_g = x_g W_g^T under FP8 delayed scaling with the row
    counts on the GPU (the device-split route's delayed-scaling form): the
    forward waits on nothing the GPU computes.  forward(x [M, in] (or
    [M, 2 in] gate|up pairs with ``probs`` [M]: the layer's input is their
    scaled SwiGLU, cast in the same pass), probs or None, offsets
    (device_split_offsets of the counts), counts_wait (moe_ops.counts_to_host
    of the counts: queued in the forward, read in the backward), dtype,
    num_gemms, (quantizers, is_first_microbatch, overwrite, lean, stacked,
    link), *weights; ``stacked``: None, or with ``lean`` the weights' [G, out, in]
    view of their one buffer, to be cast in one call; ``link``: GroupedMLP's
    GradHandoff, or None).

    Forward: the input cast with each expert's delayed scale by
    ops.moe.cast_fp8_grouped_ends (the groups' ends read on the device, the
    amaxes folded into the state's slots as the host-count cast folds them,
    each row cast in place: no padding), the experts' weights cast as the
    host-count route casts them (weight_pairs; given ``stacked``, which
    lean training passes where no cast is cached, one cast of the stacked
    weights into the stacked operands the product and the input gradient
    read: the same C cast, bytes, scales and amaxes, counted in each
    expert's WeightQuantizer.casts, without the per-expert caches), and the
    product by the sm90
    kernel with the ends on the device (grouped_gemm_device_ends_fp8); the
    output has the input's rows.  Backward: the counts, copied to the host
    during the forward, have long landed; with them the backward is the
    host-count route's (_fp8_grouped_backward): the output gradient cast
    per expert into 16-row padded blocks, the input gradient and weight
    gradients by cuBLASLt or the grouped kernel.  The weight gradient's
    operand, the input's transposed FP8 copy, is made in the backward from
    the input this Function saves (x, or the gate|up pairs and row scales
    the SwiGLU's backward keeps anyway) with the scales the forward's cast
    used (a copy of the G scales taken then): the same bytes as a
    transposed copy made in the forward, the forward writing only the
    row-wise copy its product reads.  With the SwiGLU that copy comes out of
    the SwiGLU's backward pass (swiglu_backward_cast_fp8_grouped), which in
    GroupedMLP (qargs' GradHandoff, shared by its two layers) also casts
    the gate-up layer's output gradient for that layer's backward."""

    @staticmethod
    def forward(ctx, x, probs, offsets, counts_wait, dtype, G, qargs, *weights):
        q, first, overwrite, lean, stacked, link = qargs
        swiglu = probs is not None
        need_w = any(ctx.needs_input_grad[_FP8_ARGS:_FP8_ARGS + G])
        need_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        x = x.detach()
        probs = probs.detach() if swiglu else None
        if stacked is not None:
            b, b_t, b_si = moe_ops.cast_fp8_current_stacked(stacked, q.weights[0].fp8_dtype, margin=q.margin,
                                                            transpose=need_dx, spaced=True,
                                                            amax=q.state.role_slots(1, 3)[1])
            for role in q.weights:  # (each expert's weight cast once, as weight_pairs counts it)
                role.casts += 1
            pairs = None
        else:
            pairs = weight_pairs(q, weights, first)
            b, b_si = _stacked_fp8_weights([F8.weight_forward(p, "delayed") for p in pairs])
            if lean:  # the forward operand's bytes go with this call's references to them
                release_weight_pairs(q)
        scale, amax = q.state.role_slots(0, 3)
        fp8_dtype = q.inputs[0].fp8_dtype
        scale_used = scale.clone() if need_w else None  # (the state's scales change at the autocast exit)
        xq, x_si = moe_ops.cast_fp8_grouped_ends(x, offsets, fp8_dtype, scale=scale, amax=amax, swiglu=swiglu,
                                                 probs=probs)
        y = moe_ops.grouped_gemm_device_ends_fp8(xq, x_si, b, b_si, offsets)
        del xq, b
        if pairs is None:  # (lean: the transposed stack and its scale inverses, one operand in the backward)
            saved, ctx.w_modes, ctx.w_stacked = ([b_t, b_si] if need_dx else []), [], need_dx
        else:
            w_dg = [F8.weight_dgrad(p, "delayed") for p in pairs] if need_dx else []
            saved = [t for op in w_dg for t in F8.weight_saved(op)]
            ctx.w_modes, ctx.w_stacked = [op[2] for op in w_dg], False
        # the input the weight gradient's transposed copy is made from, and the SwiGLU's backward reads
        ctx.swiglu = swiglu and need_dx
        keep = need_w or ctx.swiglu
        if keep:
            saved += [x, probs] if swiglu else [x]
        if need_w:
            saved.append(scale_used)
        ctx.save_for_backward(*saved)
        ctx.keep, ctx.has_probs, ctx.fp8_dtype = keep, swiglu, fp8_dtype
        # GroupedMLP's layers: the down projection (swiglu) hands its input gradient's FP8 copies to the gate-up
        # layer, which says here which copies its backward reads
        ctx.link_out = link if swiglu else None
        ctx.link_in = link if link is not None and not swiglu else None
        if ctx.link_in is not None:
            link.expect(q, rowwise=need_dx, transpose=need_w)
        ctx.counts_wait, ctx.rows = counts_wait, x.shape[0]
        ctx.q, ctx.G, ctx.dtype, ctx.overwrite = q, G, dtype, overwrite
        ctx.K = x.shape[1] // 2 if swiglu else x.shape[1]
        ctx.weights, ctx.bias_dtypes = weights, None
        return y

    @staticmethod
    def backward(ctx, dy):
        G = ctx.G
        saved = list(ctx.saved_tensors)
        if ctx.w_stacked:
            w_dg, rest = _Stacked(*saved[:2]), saved[2:]
        else:
            n_w = len(ctx.w_modes)
            w_dg = [(saved[2 * g], saved[2 * g + 1], ctx.w_modes[g]) for g in range(n_w)]
            rest = saved[2 * n_w:]
        x = h = probs = scale_used = None
        if ctx.keep:
            if ctx.has_probs:
                h, probs, rest = rest[0], rest[1], rest[2:]
            else:
                x, rest = rest[0], rest[1:]
        if rest:
            scale_used = rest[0]
        splits = [int(m) for m in ctx.counts_wait()]
        if len(splits) != G or any(m < 0 for m in splits) or sum(splits) != ctx.rows:
            raise RuntimeError(f"GroupedLinear: the routing counts read in the backward ({splits}) are not "
                               f"{G} non-negative counts adding up to the forward's {ctx.rows} rows")
        padded = tuple(_gq.padded_rows(m) for m in splits)
        fp8_dtype = ctx.fp8_dtype
        state = ctx.q.state
        for g, m in enumerate(splits):  # (the forward's first casts: known now, _note_fresh_experts)
            if m and not state.has_history(3 * g):
                state.note_first_cast(3 * g)

        def x_col():
            if ctx.has_probs:
                _, data_t, si = moe_ops.swiglu_cast_fp8_grouped(h, probs, splits, fp8_dtype, scale=scale_used,
                                                                rowwise=False, transpose=True)
            else:
                _, data_t, si = moe_ops.cast_fp8_grouped(x, splits, fp8_dtype, scale=scale_used, rowwise=False,
                                                         transpose=True)
            return _Columns(GroupedFloat8(None, data_t, si, padded))
        # (with the SwiGLU's backward, that pass makes x_col itself with the same scales)
        swiglu_cast = (scale_used, fp8_dtype) if ctx.has_probs and scale_used is not None else None
        return _fp8_grouped_backward(ctx, dy, splits, padded, w_dg, x_col, h, probs, swiglu_cast, ctx.link_out,
                                     ctx.link_in)


def device_ends_mlp(fc1, fc2, x, probs, offsets, counts_wait, is_first_microbatch=None):
    """GroupedMLP's experts on the device-ends route under FP8 delayed
    scaling, as one autograd node (DeviceEndsFp8GroupedMLPFunction): the
    down projection ``fc2`` of the scaled SwiGLU (row scales ``probs``) of
    the gate-up layer ``fc1``'s output for the expert-sorted rows ``x``;
    ``offsets`` / ``counts_wait``: the routing counts' device_split_offsets
    and moe_ops.counts_to_host (both layers share them).  The caller has
    asked device_split_refusal of both layers and found no module hooks on
    them (the node does not call them as modules)."""
    if fc1.num_gemms != fc2.num_gemms or fc1.out_features != 2 * fc2.in_features:
        raise ValueError(f"device_ends_mlp: fc1 ({fc1.num_gemms} experts, out_features {fc1.out_features}) and fc2 "
                         f"({fc2.num_gemms} experts, in_features {fc2.in_features}) must have the same experts and "
                         "fc1.out_features == 2 x fc2.in_features (gate|up pairs)")
    link = GradHandoff(fused=True)
    recipe = _q.get_recipe()
    x = _ends_input(gemm_rows(x))
    q1, w1 = fc1._ends_args(recipe, x.device, is_first_microbatch, link)
    q2, w2 = fc2._ends_args(recipe, x.device, is_first_microbatch, link)
    return DeviceEndsFp8GroupedMLPFunction.apply(x, probs.contiguous(), offsets, counts_wait, fc1.num_gemms, q1, q2,
                                                 *w1, *w2)


#: DeviceEndsFp8GroupedMLPFunction's arguments before the weights (x, probs, offsets, counts_wait, G, qargs1, qargs2).
_MLP_ARGS = 7


class _LayerCtx:
    """One layer's autograd context inside a node that runs two layers
    (DeviceEndsFp8GroupedMLPFunction): what a layer Function's forward and
    backward read of ctx (needs_input_grad, save_for_backward,
    saved_tensors, their own attributes).  The tensors a layer saves go
    through the node's own ctx.save_for_backward (saved-tensor hooks,
    version checks and frees as for any node): ``saved`` holds them only
    between the layer's forward and the node's save."""

    def __init__(self, needs_input_grad):
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved = ()

    def save_for_backward(self, *tensors):
        self.saved = tensors


class DeviceEndsFp8GroupedMLPFunction(torch.autograd.Function):
    """GroupedMLP's two device-ends layers under FP8 delayed scaling as one
    autograd node: forward(x [M, H] expert-sorted rows, probs [M] (the
    down projection's SwiGLU row scales), offsets, counts_wait, G, qargs1,
    qargs2, *weights1, *weights2) runs DeviceEndsFp8GroupedLinearFunction's
    forward for the gate-up layer, then for the down projection over its
    gate|up output h; the backward runs the down projection's backward,
    whose SwiGLU pass casts the gate-up layer's output gradient into the
    FP8 copies that layer's backward reads (qargs' GradHandoff, fused), and
    then the gate-up layer's backward with them.  h's gradient itself is
    never written in bfloat16 (2 x M x F values a layer): no other consumer
    of h exists inside the node.  The answers are the two Functions' bit for
    bit.  Autograd frees a node's saved tensors when its backward returns,
    so the down projection's (h, its row scales, its transposed FP8 weights)
    live through the gate-up layer's backward here, where two nodes freed
    them before it (measured in s49: the Mixtral step's peak 0.13 GiB lower
    all the same, the bfloat16 gradient being larger).  Its gradients are
    not differentiable again (a double backward raises)."""

    @staticmethod
    def forward(ctx, x, probs, offsets, counts_wait, G, qargs1, qargs2, *weights):
        nig = ctx.needs_input_grad
        off = _MLP_ARGS  # (the weights' place in this node's arguments)
        w1, w2 = weights[:G], weights[G:]
        c1 = _LayerCtx((nig[0], False) + (False,) * (_FP8_ARGS - 2) + tuple(nig[off:off + G]))
        h = DeviceEndsFp8GroupedLinearFunction.forward(c1, x, None, offsets, counts_wait, torch.bfloat16, G,
                                                       qargs1, *w1)
        c2 = _LayerCtx((any(c1.needs_input_grad), nig[1]) + (False,) * (_FP8_ARGS - 2) + tuple(nig[off + G:]))
        y = DeviceEndsFp8GroupedLinearFunction.forward(c2, h, probs, offsets, counts_wait, torch.bfloat16, G,
                                                       qargs2, *w2)
        ctx.save_for_backward(*c1.saved, *c2.saved)
        ctx.layers, ctx.n1, ctx.G = (c1, c2), len(c1.saved), G
        c1.saved = c2.saved = ()
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        c1, c2 = ctx.layers
        saved = ctx.saved_tensors
        G = ctx.G
        try:
            c1.saved_tensors, c2.saved_tensors = saved[:ctx.n1], saved[ctx.n1:]
            g2 = DeviceEndsFp8GroupedLinearFunction.backward(c2, dy)
            g1 = (None,) * (_FP8_ARGS + G)
            if any(c1.needs_input_grad):
                g1 = DeviceEndsFp8GroupedLinearFunction.backward(c1, g2[0])
        finally:  # (a backward that raised keeps nothing alive through the graph)
            c1.saved_tensors = c2.saved_tensors = None
            link = c1.link_in
            if link is not None:
                link.stash = None
        return (g1[0], g2[1], *(None,) * (_MLP_ARGS - 2), *g1[_FP8_ARGS:], *g2[_FP8_ARGS:])
