"""The FP8 operands of a grouped (mixture-of-experts) GEMM module, every
expert's cast in one call.

A GroupedLinear's input and output gradient arrive as one tensor of
expert-sorted rows: G runs, one per expert, each quantized with its own
scale (under delayed scaling, its own slots of the module's ScalingState:
expert g's input is tensor 3g, its output gradient 3g + 2).  Casting them
expert by expert costs G quantizer calls and G kernel launches per operand
(G x 4 per layer and step); ``quantize_grouped`` makes them with one
``seqfuse.ops.moe.cast_fp8_grouped`` call: one launch under delayed scaling
(the scales read from, and the amaxes folded into, the state's strided
slots), three under current scaling (amaxes, then scales and casts).

The experts' weights, cast once per weight update as every module's are
(WeightQuantizer), are cast together too: ``weight_pairs`` asks each
expert's WeightQuantizer whether its cached operands still serve and, when
every expert's weight changed (an optimizer step), casts them all with one
``seqfuse.ops.moe.cast_fp8_current_list`` call (current scaling of each
weight, as WeightQuantizer's own cast; under delayed scaling the amaxes land
in the state's weight slots), handing each quantizer its expert's result.
The next such call writes that call's buffers in place where nothing else
holds them (as WeightQuantizer's own re-cast: a pending backward keeps
aliases of the scale inverses, which the storage count sees).  In training
without is_first_microbatch a GroupedLinear keeps none of them past its
forward (``lean_weights`` / ``release_weight_pairs``): the forward's copy
is freed when the forward returns, the backward keeps the transposed copy
it reads, and the next forward casts into new buffers.

GroupedMLP's down projection takes the SwiGLU's output as its input:
``quantize_grouped(..., swiglu=True, probs=...)`` computes that output in
the cast itself (seqfuse.ops.moe.swiglu_cast_fp8_grouped), so it is never
written in bf16 and read back; the values are those of the cast of
scaled_swiglu's output, bit for bit.

The result of quantize_grouped, a GroupedFloat8, holds every expert's padded row block in one
[Mp, K] tensor (the grouped GEMM takes it split by the padded counts) and
every transposed block as columns of one [K, Mp] tensor, with the per-expert
scale inverses 256 bytes apart (what cuBLASLt wants of per-tensor scales).
The values are the per-expert casts' bit for bit.

The device-split route (row counts on the GPU, torch's row-wise scaled
grouped GEMM) takes the experts' weights as one stack: ``stacked_weights_fp8``
casts W [G, N, K] with each expert's current scale into one [G, N, K]
and/or one transposed [G, K, N] copy (one call; which copies, and how long
they are kept, is the caller's choice), with the dequantization factors
laid out per row as that GEMM reads them.  Its activations and gradients
are cast one scale per row (seqfuse.ops.quant.quantize_rowwise_fp8), which
needs no row counts at all.

Where the one call does not apply, ``quantize_grouped`` returns None and
the module casts expert by expert with its role quantizers (the same
values): block scaling (its own kernels), delayed scaling's first casts (a
tensor with no amax history takes its scale from its own amax:
quantize_with_state), while FP8 statistics are recorded (they are taken per
cast), and inside an activation checkpoint's recompute (which replays its
forward's noted scales per tensor).
"""
import logging

import torch

from ..common.notes import note_once
from ..ops import device_checks
from ..ops import moe as moe_ops
from . import recompute, stats
from .gemm_quantizers import storage_holders, written_in_place
from .tensor import Float8Tensor

__all__ = ["GroupedFloat8", "StackedFloat8", "delayed_grad_slots", "lean_weights", "note_grouped", "quantize_grouped",
           "release_weight_pairs", "stacked_weights_fp8", "weight_pairs"]

_log = logging.getLogger("seqfuse")

#: The scaling-state index of each role within an expert's three (input, weight, gradient).
_ROLE_INDEX = {"input": 0, "grad": 2}


class GroupedFloat8:
    """FP8 copies of G experts' row runs.  ``data`` [Mp, K] (run g in the
    padded[g] rows after the runs before it, zero past its real rows) or None;
    ``data_t`` [K, Mp] (run g in the same columns) or None; ``scale_inv``
    [G] (1 / expert g's scale, 256 bytes apart); ``padded``: the padded row
    counts (host ints)."""

    __slots__ = ("data", "data_t", "scale_inv", "padded")

    def __init__(self, data, data_t, scale_inv, padded):
        self.data, self.data_t, self.scale_inv, self.padded = data, data_t, scale_inv, padded

    def column_blocks(self):
        """Each expert's transposed block [K, padded[g]] of ``data_t`` (the
        weight gradient's operands; their scale inverses are ``scale_inv``)."""
        return list(self.data_t.split(self.padded, 1))


class StackedFloat8:
    """The E4M3 operands of G stacked expert weights W [G, N, K] for the
    device-split FP8 route: ``data`` [G, N, K] (the forward product's) and
    ``data_t`` [G, K, N] (the input gradient's), each expert cast with its
    own current scale (max |W_g|), and the dequantization factors as the
    row-wise scaled GEMM reads them: ``row_scale_inv`` [G, N] and
    ``row_scale_inv_t`` [G, K], expert g's one factor repeated.  A copy
    not made (stacked_weights_fp8's ``rowwise`` / ``transpose``) is None,
    with its factors.  ``on_transpose_cast``: None, or a callable (no
    arguments) that the device-split route's backward calls each time it
    makes the transposed copy itself, where ``data_t`` is None (the owner
    counts those casts)."""

    __slots__ = ("data", "data_t", "row_scale_inv", "row_scale_inv_t", "on_transpose_cast")

    def __init__(self, data, data_t, row_scale_inv, row_scale_inv_t, on_transpose_cast=None):
        self.data, self.data_t = data, data_t
        self.row_scale_inv, self.row_scale_inv_t = row_scale_inv, row_scale_inv_t
        self.on_transpose_cast = on_transpose_cast


def stacked_weights_fp8(stacked, *, rowwise=True, transpose=True):
    """StackedFloat8 of ``stacked`` [G, N, K] (one C call for the copies,
    ops.moe.cast_fp8_current_stacked, and a small fill of each copy's
    factors).  ``rowwise`` / ``transpose``: which copies to make (data
    and data_t; at least one).  The scales depend on ``stacked``'s values
    only: a transpose-only cast of unchanged weights pairs with an earlier
    rowwise-only one bit for bit."""
    G, N, K = stacked.shape
    data, data_t, si = moe_ops.cast_fp8_current_stacked(stacked.detach(), torch.float8_e4m3fn, rowwise=rowwise,
                                                        transpose=transpose)
    col = si.view(G, 1)
    return StackedFloat8(data, data_t, col.expand(G, N).contiguous() if rowwise else None,
                         col.expand(G, K).contiguous() if transpose else None)


def note_grouped(text, *args):
    """Log "seqfuse FP8 GroupedLinear: " + ``text % args`` (logger
    "seqfuse", INFO) the first time this text with these arguments is noted
    in the process (common.notes.note_once); later notes of it say nothing.
    The grouped FP8 path names its fallbacks through it: a one-call cast
    declined here (once per reason) and GroupedLinear's SwiGLU written out
    before its cast (once per recipe kind)."""
    note_once(_log, "seqfuse FP8 GroupedLinear: " + text, *args)


def _declined(reason):
    """None, with the reason logged once per reason (the per-expert casts follow)."""
    note_grouped("experts cast one by one (%s); steady-state delayed or current scaling casts them in "
                 "one call", reason)
    return None


def _one_call_refusal():
    """Why no grouped call casts every expert now (quantize_grouped falls
    back to per-expert casts), or None."""
    if recompute.open_contexts:
        return "inside an activation checkpoint's recompute"
    if stats.recording():
        return "FP8 statistics are being recorded"
    return None


def _delayed_slots(q, role, splits):
    """(scale, amax) of role's per-expert delayed-scaling slots in q's
    ScalingState, or None where an expert with rows has no amax history
    yet (a first cast: that tensor's scale comes from its own amax,
    quantize_with_state's; an expert with no rows is not cast, its GEMM
    skipped, so it needs none)."""
    first, state = _ROLE_INDEX[role], q.state
    if not all(state.has_history(3 * g + first) for g in range(len(splits)) if splits[g]):
        return None
    return state.role_slots(first, 3)


def delayed_grad_slots(q, splits):
    """(scale, amax, fp8 dtype) with which one grouped call casts every
    expert's output gradient for GemmQuantizers ``q`` under delayed scaling
    where quantize_grouped(q, "grad", ...) would (no checkpoint recompute,
    no FP8 statistics, every expert with rows past its first cast), else
    None: a producer that makes those bytes itself (the down projection's
    SwiGLU backward, for the gate-up layer) makes what quantize_grouped
    would."""
    if q.kind != "delayed" or _one_call_refusal():
        return None
    slots = _delayed_slots(q, "grad", splits)
    return None if slots is None else (slots[0], slots[1], q.grads[0].fp8_dtype)


def quantize_grouped(q, role, x, splits, padded, *, rowwise=True, transpose=True, swiglu=False, probs=None):
    """x [M, K] (G runs of ``splits`` rows, ``padded`` their counts rounded
    up to the FP8 row multiple, which the caller holds already) as a
    GroupedFloat8 for role "input" or "grad" of GemmQuantizers ``q`` (G
    GEMMs), or None where one call does not apply (module note).
    ``rowwise`` / ``transpose``: which copies to make.  ``swiglu``: x is
    [M, 2K] gate|up pairs and the value quantized is scaled_swiglu(x,
    probs), computed in the cast (seqfuse.ops.moe.swiglu_cast_fp8_grouped)."""
    kind = q.kind
    if kind == "block":
        return None  # block scaling has its own per-expert kernels, no grouped one yet
    why = _one_call_refusal()
    if why:
        return _declined(why)
    if not x.is_contiguous():
        x = x.contiguous()
    if x.is_cuda and x.data_ptr() % 16:
        return _declined("an input not 16-byte aligned, which the grouped kernel reads in 16-byte vectors")
    G = len(splits)
    roles = q.inputs if role == "input" else q.grads
    fp8_dtype = roles[0].fp8_dtype
    if kind == "delayed":
        slots = _delayed_slots(q, role, splits)
        if slots is None:
            return None
        kw = dict(scale=slots[0], amax=slots[1], rowwise=rowwise, transpose=transpose)
    else:
        slots = torch.empty((2, G), dtype=torch.float32, device=x.device)
        kw = dict(scale=slots[0], amax=slots[1], rowwise=rowwise, transpose=transpose, current=True,
                  margin=q.margin)
    if swiglu:
        data, data_t, si = moe_ops.swiglu_cast_fp8_grouped(x, probs, splits, fp8_dtype, **kw)
    else:
        data, data_t, si = moe_ops.cast_fp8_grouped(x, splits, fp8_dtype, **kw)
    return GroupedFloat8(data, data_t, si, padded)


def weight_pairs(q, weights, is_first_microbatch=None):
    """Each expert's weight operand pair (WeightQuantizer.get's), the casts
    that are due made in one call where all G are due (module note); block
    scaling, a partial set of changed weights and a checkpoint's recompute
    cast expert by expert (the same values)."""
    roles = q.weights
    G = len(weights)
    if q.kind == "block" or recompute.open_contexts or G < 2:
        return _kept_list_checked(q, [roles[g].get(weights[g], is_first_microbatch) for g in range(G)])
    found = [roles[g].lookup(weights[g], is_first_microbatch) for g in range(G)]
    if any(pair is not None for pair, _ in found):
        return _kept_list_checked(q, [pair if pair is not None else roles[g].get(weights[g], is_first_microbatch)
                                      for g, (pair, _) in enumerate(found)])
    ws = [w.detach().contiguous() for w in weights]
    w0 = ws[0]
    if any(w.shape != w0.shape or w.dtype != w0.dtype or (w.is_cuda and w.data_ptr() % 16) for w in ws):
        # the list cast takes same-shaped, 16-byte aligned weights (views into a flat buffer may not be)
        _declined("expert weights of different shapes or dtypes, or not 16-byte aligned")
        q.weight_list = None
        return [roles[g].get(weights[g], is_first_microbatch) for g in range(G)]
    fp8_dtype = roles[0].fp8_dtype
    amax = q.state.role_slots(1, 3)[1] if q.kind == "delayed" else None
    notes = [note for _, note in found]
    kept = _kept_list_cast(q, roles, ws, fp8_dtype, notes)
    if kept is not None:  # the last call's buffers, which nothing else holds: written in place
        moe_ops.cast_fp8_current_list_into(ws, kept.data, kept.data_t, kept.scale,
                                           kept.amax if amax is None else amax, kept.scale_inv, q.margin)
        written_in_place(kept.scale_inv)
        return [roles[g].store(notes[g], kept.pairs[g], None) for g in range(G)]
    data, data_t, si, scale, amax_out = moe_ops.cast_fp8_current_list(ws, fp8_dtype, amax=amax, margin=q.margin)
    pairs = []
    for g, (w, s_inv) in enumerate(zip(ws, si.split(1))):
        note = notes[g]
        t = Float8Tensor(data[g], s_inv, fp8_dtype, data_t=data_t[g], dtype=w.dtype, shape=w.shape)
        # the amax / scale scratch matters only to a captured cast (store keeps it for the graph)
        scratch = (amax_out[g:g + 1], scale[g:g + 1]) if note[2] else None
        pairs.append(roles[g].store(note, (t, t), scratch))
    q.weight_list = None
    if not any(note[2] for note in notes):
        q.weight_list = _ListCast(q.kind, ws[0], fp8_dtype, data, data_t, si, scale,
                                  amax_out if amax is None else None, tuple(pairs))
    return pairs


def lean_weights(weights, is_first_microbatch):
    """Whether a grouped layer's forward keeps none of its experts' FP8
    weight casts past its own product: training without
    is_first_microbatch (None, gradients enabled, some weight learning:
    an optimizer step usually changes them before the next forward;
    gradient accumulation without the argument casts each micro-batch
    again, as TE does), not under CUDA graph capture, nor inside an
    activation checkpoint (its forward and recompute share one cast: any
    open recompute.open_contexts, recording or replaying).  The forward operand's
    bytes are then freed when the forward returns (release_weight_pairs),
    and only what the backward saved (the input-gradient operand) lives on
    to the backward, so no layer holds both copies through the activation
    peak; the next forward casts into new buffers (TE's contract for None:
    a cast per call; True / False keep both across micro-batches)."""
    return (is_first_microbatch is None and torch.is_grad_enabled() and any(w.requires_grad for w in weights)
            and not recompute.open_contexts and not device_checks.capturing(weights[0]))


def release_weight_pairs(q):
    """Drop ``q``'s cached weight casts (each expert's pair and the last list
    cast's record): the next forward casts again (lean_weights)."""
    for role in q.weights:
        role.key = role.param = role.pair = None
    q.weight_list = None


class _ListCast:
    """A grouped module's last one-call weight cast, kept for the next one to
    write in place (GemmQuantizers.weight_list): what it was cast under
    (recipe kind, the weights' shape, dtype and device, the FP8 dtype,
    inference mode), its outputs (the data and data_t lists, the [G] scale
    inverses and scales, its own amax buffer or None where the state's slots
    took the amaxes) and the G pairs handed to the experts' quantizers.
    ``holders``: how many tensors held the scale inverses' storage right
    after the cast (the pairs' views and this record's own), the count a
    later cast must find for nothing else to hold them."""

    __slots__ = ("kind", "shape", "dtype", "device", "fp8_dtype", "inference", "holders", "data", "data_t",
                 "scale_inv", "scale", "amax", "pairs")

    def __init__(self, kind, w, fp8_dtype, data, data_t, scale_inv, scale, amax, pairs):
        self.kind, self.shape, self.dtype, self.device = kind, w.shape, w.dtype, w.device
        self.fp8_dtype, self.inference = fp8_dtype, torch.is_inference_mode_enabled()
        self.data, self.data_t, self.scale_inv, self.scale, self.amax = data, data_t, scale_inv, scale, amax
        self.pairs = pairs
        self.holders = storage_holders(scale_inv)


def _kept_list_cast(q, roles, ws, fp8_dtype, notes):
    """``q``'s kept _ListCast when this cast may write its buffers: weights
    of the same shape, dtype and device, the same recipe kind, FP8 dtype and
    inference mode, not under capture, every expert's cached pair still that
    cast's, and the scale inverses' storage held by as many tensors as right
    after that cast (a pending backward keeps aliases of them:
    modules._fp8.weight_saved).  Else None."""
    rec = getattr(q, "weight_list", None)  # (a GemmQuantizers pickled before the slot existed has none)
    if rec is None or any(note[2] for note in notes):
        return None
    w0 = ws[0]
    if (rec.holders is None or rec.kind != q.kind or rec.shape != w0.shape or rec.dtype != w0.dtype
            or rec.device != w0.device or rec.fp8_dtype is not fp8_dtype
            or rec.inference != torch.is_inference_mode_enabled() or len(rec.pairs) != len(roles)
            or any(r.pair is not p or r.key is None for r, p in zip(roles, rec.pairs))):
        return None
    return rec if storage_holders(rec.scale_inv) == rec.holders else None


def _kept_list_checked(q, pairs):
    """``pairs``, after letting ``q``'s last list cast go where an expert no
    longer uses its result (cast one by one, FSDP2's gathered weights): its
    buffers would otherwise stay alive beside the new ones."""
    rec = getattr(q, "weight_list", None)
    if rec is not None and any(p is not k for p, k in zip(pairs, rec.pairs)):
        q.weight_list = None
    return pairs
