"""The FP8 operands of the GEMM modules, made in one place.

Every seqfuse module that runs GEMMs under FP8 autocast (Linear,
LayerNormLinear, LayerNormMLP, and what is built the same way) owns one
GemmQuantizers: three tensor roles per GEMM, each a quantizer object,

    InputQuantizer   the GEMM's activation operand  (state index 3g + 0)
    WeightQuantizer  the weight                     (state index 3g + 1)
    GradQuantizer    the output gradient            (state index 3g + 2)

with Transformer Engine's names for the indices (FP8FwdTensors.GEMM1_INPUT,
GEMM1_WEIGHT, GEMM2_INPUT, ...; FP8BwdTensors.GRAD_OUTPUT1, ...).  The set
knows the active recipe by its type (DelayedScaling, Float8CurrentScaling,
Float8BlockScaling; MXFP8 and NVFP4 refuse on Hopper) and, under delayed
scaling, owns the module's ScalingState (child ``fp8_state``, so the
state_dict carries it).  ``init_fp8_state(model, recipe)`` makes every
module's state at once, before a checkpoint is loaded, without a forward.

Any number of rows.  Hopper's FP8 GEMMs take K-major operands whose row
stride is a multiple of 16 bytes, so the weight gradient (dW = dy^T x, a
reduction over the tokens) needs the transposed copies of x and dy with a
token count that is a multiple of 16.  The quantizers pad the token rows of
every FP8 operand they make to the next multiple of 16 with zeros (the
row-wise copy [Mp, K], the transposed copy [K, Mp]: the per-tensor and
block casts write the zero rows in their own pass over x; the norm's and
activation's own FP8 outputs are written into the first rows of a padded
buffer whose other rows are zeroed, one memset); the forward and input-
gradient GEMMs then run on Mp rows and their outputs are cut back to the M
real rows (``row_prefix``: the same storage, no copy, not an autograd
view).  Zero rows add nothing to the weight and bias gradients, and the
amaxes are taken over the real rows only, so the real rows' results are the
aligned computation's.  Aligned inputs take exactly the old path.

Under delayed scaling a weight's cast takes the scale of its amax history,
as Transformer Engine's does and as every other tensor of the recipe is
scaled: one pass over the weight, where a cast from its own amax needs two
(the amax, then the cast).  Only where the history describes the weight:
one torch.optim step was its only write since its last cast (same storage,
one step more, the step's hooks seeing the cast's version counter before it
and the current one after it), or a resumed run's first cast finds the
checkpoint's history beside the checkpoint's weights.  A first step, a
weight written outside an optimizer or beside a step (a copy, a load into a
running model, an in-place rescale or clamp, before or after the step),
several steps since the last cast, and a cast under CUDA graph capture take
the weight's own amax,
which is also written into the state's weight slot.  A training call that
reuses a cast made under no_grad (a validation pass, whose scaling work
restore_scaling undoes) folds the weight's amax into that slot as its own
cast would: validation passes leave training's bytes as they were, and a
resumed run casts the bytes the uninterrupted one did.  A weight that
outgrew its history in one step saturates for that step (TE's behaviour).
``module.fp8_weight_history = False`` (read when the module adopts a
recipe) keeps every cast of that module on its own amax; GroupedLinear does
(its one-launch cast of every expert's weight computes each scale).  Current
and block scaling always cast from the weight itself.

Weights are cast once per weight update: WeightQuantizer keeps the FP8
weight and its transposed copy keyed on the parameter's identity, device,
data pointer and version counter (an optimizer step bumps the version).  A
re-cast writes into the cached FP8 buffers when nothing else references
them (no pending backward: a module's FP8 forward saves an alias of the
scale inverse its backward reads, modules._fp8.weight_saved) and makes new ones
otherwise.  The write in place bypasses the caching allocator's stream
tracking: it is ordered after the GEMMs that read the old bytes only where
they ran on the stream that re-casts (a module's FP8 work moved between
streams needs the streams synchronised first).  A training loop's steady
call (the same parameter, request and recipe; a reuse, or a re-cast into
the cached buffers) takes a short path, WeightQuantizer._steady, which
checks what the general path would and leaves every other case to it.
torch's fused optimizers (``AdamW(fused=True)`` and the like) write the
parameters in their kernels without moving the version counters, so the key
also holds how many torch.optim optimizer steps covered each parameter (a
post-step hook registered at import counts them, per parameter of the
stepped optimizer): the first forward after a step casts again, and a
frozen model's casts stay cached.  Other values written without moving the version
(``.data`` copies, FSDP2's all-gather, an update outside torch.optim) are
not seen: under FSDP2 weights are cast at every forward;
after a ``.data`` write pass ``is_first_microbatch=True``.  ``is_first_microbatch`` is TE's
gradient-accumulation contract: True re-casts, False reuses, None re-casts
when the version moved.  While a CUDA graph is captured the cast is always
captured, so every replay re-casts from the weight's current values.
``weight_casts(module)`` counts the casts (tests read it).

The transposed copy W^T (per tensor: data_t; block scaling: W^T's 128x128
blocks) only feeds the input-gradient GEMM.  By default it is made with the
cast and kept beside W until the weight changes: two FP8 bytes per weight
element from the forward to the backward.  ``set_weight_transpose_cache(
False)`` keeps W alone; each backward of Linear, LayerNormLinear and
LayerNormMLP then makes W^T from W's cached bytes (a byte transpose: the
bits the cast would have written) for its GEMM and drops it: one byte per
weight element less at the activation peak, for one more pass over the FP8
weights per backward (on the H200: 0.91 GiB less and 1.4 % slower at a
Llama 1B shape, 4,096 tokens; 0.62 GiB and 0.3 % at an ESM-2 650M-shape
stack; README).  Calls that want no gradient
(inference, no_grad) never make W^T.

The row-wise copy W only feeds the forward GEMM.  In a training call of
Linear, LayerNormLinear or LayerNormMLP without is_first_microbatch (a
training loop's usual call: the weight changes before the next forward)
the cache keeps W^T alone, and the cast writes W into a transient buffer
(seqfuse.ops.buffers: one per stream, written again by the next such
weight) that only that call's forward GEMM reads: one FP8 byte per weight
element from the forward to the backward, as Transformer Engine keeps,
not two.  A forward that finds the weight unchanged makes W from W^T's
bytes (a byte transpose, the bits the cast wrote): inside
seqfuse.quantization.checkpoint's recompute for that forward alone; under
torch.inference_mode for that call alone too (a transpose and a new buffer
per weight and call, until a call outside that mode keeps W: an inference
tensor must not stay in a cache that training calls read); else (gradient
accumulation without is_first_microbatch, a no-grad eval call) it keeps W
from then on, and after such a training call that weight keeps it at every
later cast, so an accumulation loop transposes once.  With
is_first_microbatch given, under CUDA graph capture and after
``set_weight_rowwise_cache(True)`` W stays cached beside W^T (GroupedLinear
has its own rule: its module note).
A weight FSDP2 all-gathered in FP8 (seqfuse.distributed.fp8_allgather)
brings its own FP8 bytes: ``get`` takes them (and makes the transposed
copy) instead of casting, and caches nothing.
"""
import enum
import logging
import sys
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling,
                             MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from ..ops import buffers
from ..ops import quant as qops
from ..ops.gemm import FP8_ROW_MULTIPLE
from ..ops.moe import dense
from ..ops import device_checks
from ..ops.args import increment_versions
from . import recompute
from .quantize import quantize_block, state_cast_args
from .state import ScalingState
from .tensor import Float8BlockTensor, Float8Tensor

__all__ = ["FP8FwdTensors", "FP8BwdTensors", "GemmQuantizers", "quantizers_for", "recipe_kind", "fsdp2_in_use",
           "init_fp8_state", "weight_casts", "padded_rows", "row_prefix", "ROW_MULTIPLE", "weight_key",
           "same_weights"]

_log = logging.getLogger("seqfuse")

#: The FP8 GEMMs' token granularity (the wgrad operands' row stride, in bytes).
ROW_MULTIPLE = FP8_ROW_MULTIPLE

class FP8FwdTensors(enum.IntEnum):
    """Transformer Engine's names of the forward tensors' state indices."""
    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7


class FP8BwdTensors(enum.IntEnum):
    """Transformer Engine's names of the output gradients' state indices."""
    GRAD_OUTPUT1 = 2
    GRAD_OUTPUT2 = 5
    GRAD_OUTPUT3 = 8


def padded_rows(m):
    """``m`` rounded up to the FP8 GEMMs' token granularity."""
    return -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def row_prefix(t, rows):
    """The first ``rows`` rows of the contiguous result ``t`` of a padded GEMM,
    as a tensor of its own over the same storage (no copy).  A slice would be
    an autograd view of a tensor made inside a Function, which torch forbids
    callers to modify in place (a residual ``+=``)."""
    if t.shape[0] == rows:
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), (rows, *t.shape[1:]),
                               t.stride())


_UNSUPPORTED_NOTE = ("its GEMMs need compute capability 10.x (Blackwell) in cuBLASLt; on Hopper use "
                     "DelayedScaling, Float8CurrentScaling or Float8BlockScaling")


def recipe_kind(recipe, cls):
    """"delayed", "current" or "block" for the recipe's type; recipes whose
    GEMMs this GPU generation cannot run raise NotImplementedError naming
    the module ``cls``."""
    if isinstance(recipe, DelayedScaling):
        return "delayed"
    if isinstance(recipe, Float8CurrentScaling):
        return "current"
    if isinstance(recipe, Float8BlockScaling):
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
        if dims != (1, 2, 1):
            raise NotImplementedError(
                f"{cls}: Float8BlockScaling is supported with x_block_scaling_dim=1, "
                f"w_block_scaling_dim=2, grad_block_scaling_dim=1 (cuBLASLt takes no 128x128 x "
                f"128x128 product), got {dims}")
        return "block"
    if isinstance(recipe, (MXFP8BlockScaling, NVFP4BlockScaling)):
        raise NotImplementedError(f"{cls}: FP8 recipe {type(recipe).__name__} is not supported: "
                                  f"{_UNSUPPORTED_NOTE}")
    if isinstance(recipe, Recipe):
        raise NotImplementedError(f"{cls}: recipe {type(recipe).__name__} has no GEMM path here")
    raise TypeError(f"{cls}: the FP8 recipe must be a seqfuse.common.recipe recipe, got "
                    f"{type(recipe).__name__}")


def check_features(cls, kind, *features):
    """The shape rules left once tokens are padded: per GEMM (name, size)
    pairs, multiples of 16 (the operands' row strides), of 128 for block
    scaling (whole blocks)."""
    mult = 128 if kind == "block" else 16
    for name, size in features:
        if size % mult:
            what = ("block-scaled FP8 (1x128 / 128x128 blocks)" if kind == "block" else "FP8 GEMMs")
            raise ValueError(f"{cls}: {what} need {name} to be a multiple of {mult}, got {size} "
                             f"(run this layer outside FP8 autocast, or pick a size that is)")


_weight_transpose_cache = [True]
_weight_rowwise_cache = [False]


def _swap_setting(name, setting, enabled):
    """``setting[0] = enabled`` (a bool, else TypeError naming the setter
    ``name``); returns the previous value."""
    if not isinstance(enabled, bool):
        raise TypeError(f"{name}: argument 'enabled' must be a bool, got {type(enabled).__name__}")
    previous, setting[0] = setting[0], enabled
    return previous


def set_weight_rowwise_cache(enabled):
    """Whether a training call of Linear, LayerNormLinear and LayerNormMLP
    keeps the weight's row-wise FP8 copy (the forward operand) in the weight
    cache until the weight changes (True) or gives it to its forward GEMM
    alone (False, the default: the cache keeps W^T, which the backward
    reads); see the module note.  Returns the previous setting."""
    return _swap_setting("set_weight_rowwise_cache", _weight_rowwise_cache, enabled)


def weight_rowwise_cache():
    """The setting of :func:`set_weight_rowwise_cache`."""
    return _weight_rowwise_cache[0]


def set_weight_transpose_cache(enabled):
    """Whether the weights' transposed FP8 copies are made with the cast and
    kept (True, the default) or made in each backward from the kept FP8
    bytes (False: less memory, a transpose per weight and backward); see
    the module note.  Applies from the next weight cast on.  Returns the
    previous setting."""
    return _swap_setting("set_weight_transpose_cache", _weight_transpose_cache, enabled)


def weight_transpose_cache():
    """The setting of :func:`set_weight_transpose_cache`."""
    return _weight_transpose_cache[0]


def wants_weight_transpose(grad, role):
    """WeightQuantizer.get's ``transposed`` for a module call whose weight
    is ``role``: whether a backward follows (``grad``) and the transposed
    copies are cached; inside a checkpoint's recompute, the forward's
    answer (the backward reads what the recompute saves with the forward's
    bookkeeping, even if the setting changed in between)."""
    want = grad and _weight_transpose_cache[0]
    return recompute.choice_for(("weight_transpose", id(role)), want) if recompute.open_contexts else want


# ---- the three roles -------------------------------------------------------------

def _state_without_caches(obj):
    """The pickle state of a slotted object (a role, a module's GemmQuantizers):
    its slots, those its class names in ``_caches`` set to None."""
    slots = {name: getattr(obj, name) for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())
             if hasattr(obj, name)}
    slots.update(dict.fromkeys(type(obj)._caches))
    return None, slots


def _cast_input(x):
    """(x without autograd history, row-major; M; K): a cast's input seen as [M, K]."""
    if x.requires_grad:
        x = x.detach()
    x = dense(x)
    k = x.shape[-1]
    return x, (x.numel() // k if k else 0), k


class _Role:
    __slots__ = ("owner", "index", "scratch")
    #: The slots that are caches (buffers and cast results made again at the next use): a copy
    #: (deepcopy, pickle, torch.save of the module) starts without them, so it never shares a buffer
    #: with the original or carries FP8 bytes (which plain pickle cannot load back in torch 2.x).
    _caches = ("scratch",)

    def __init__(self, owner, index):
        self.owner, self.index = owner, index
        self.scratch = None

    def __getstate__(self):
        return _state_without_caches(self)

    @property
    def fp8_dtype(self):
        return self.owner.recipe.fp8_format._value_.dtypes[self.index % 3 == 2]

    def _scratch(self, x, in_capture=None):
        """(amax, scale): one-element float32 buffers on x's device that a
        per-tensor cast computes its scale in and reads back in its own
        launches.  Nothing reads them after the cast and the casts of a role
        run in stream order, so the role keeps one pair for all of them (a
        module's FP8 casts on two streams at once are not supported: its
        delayed-scaling amaxes and these scratch values would race).
        Under CUDA graph capture a new pair (kept alive by the graph), so
        eager casts never share the buffers a replay writes (``in_capture``:
        whether one is being captured, where the caller asked already)."""
        if in_capture is None:
            in_capture = device_checks.capturing(x)
        s = self.scratch
        if s is not None and not in_capture and s[0].get_device() == x.get_device():
            return s
        s = (torch.empty(1, device=x.device), torch.empty(1, device=x.device))
        if not in_capture:
            self.scratch = s
        return s

    def cast_outputs(self, x, sums_rows=None):
        """(scale inverse, block sums or None): the float32 buffers a
        per-tensor cast of ``x`` [M, K] writes besides its FP8 copies -- its
        one-element scale inverse and, given ``sums_rows`` (the copies'
        rows), the dbias pass's sums of each 128-row block [ceil(sums_rows /
        128), K].  New ones per cast here (an activation's operand is saved
        for the backward and must outlive the role's next cast)."""
        dev = x.device
        si = torch.empty(1, dtype=torch.float32, device=dev)
        if sums_rows is None:
            return si, None
        return si, torch.empty(*qops.block_sums_shape(sums_rows, x.shape[-1]), dtype=torch.float32, device=dev)

    def _cast(self, x, transpose, dbias=None, rows=None, kept=False, row_place=None, col_place=None, grad_at=None,
              keep_scale=False):
        """Per-tensor cast of x [M, K] under the owner's recipe, the copies
        padded to ``rows`` token rows (None: M): a Float8Tensor, with
        ``dbias`` (a dtype) also x's column sums in it.  What quantize_with_state /
        quantize_current do, with the outputs made here in one place (the
        shapes are known: no argument checks on this path, the C entry
        checks the tensors).  ``kept``: the scale inverse and sums are
        GradQuantizer.kept_outputs' (its transient scale inverse where
        ``row_place`` is given).  ``row_place`` / ``col_place``: the row-wise
        / transposed copy is the transient buffer there (a
        (transient_stream, purpose) pair: seqfuse.ops.buffers).  ``grad_at``:
        a module backward's transient_stream, where every buffer of a
        gradient cast is transient (GradQuantizer.transient_outputs; the
        other buffer arguments are then unused).  ``keep_scale`` (delayed
        scaling, no ``dbias``): returns (the Float8Tensor, a copy of the
        scale it was cast with)."""
        o = self.owner
        x, m, k = _cast_input(x)
        delayed = o.kind == "delayed"
        if delayed:
            scale, amax, fp8_dtype = state_cast_args(o.state, self.index, x)
            if keep_scale:
                scale = scale.clone()
        else:
            fp8_dtype = self.fp8_dtype
            amax, scale = self._scratch(x)
        dev = x.device
        mp = m if rows is None else rows
        # (sizes as separate ints: torch parses them faster than a torch.Size or a tuple)
        sums_rows = None if dbias is None else mp
        if grad_at is not None:
            scale_inv, sums, out, out_t = self.transient_outputs(x, grad_at, fp8_dtype, m, mp, transpose, sums_rows)
        else:
            if kept:
                scale_inv, sums = self.kept_outputs(x, sums_rows, where=None if row_place is None else row_place[0])
            else:
                scale_inv, sums = self.cast_outputs(x, sums_rows)
            out = buffers.new_or_transient(row_place, dev, fp8_dtype, *(x.shape if mp == m else (mp, k)))
            out_t = buffers.new_or_transient(col_place, dev, fp8_dtype, k, mp) if transpose else None
        if dbias is None:
            if delayed:
                qops.cast_fp8_into(x, scale, amax, out, out_t, scale_inv)
            else:
                qops.cast_fp8_current_into(x, amax, scale, scale_inv, out, out_t, o.margin)
            q = Float8Tensor(out, scale_inv, fp8_dtype, data_t=out_t, dtype=x.dtype, shape=x.shape)
            return (q, scale) if keep_scale else q
        # the cast+dbias pass and the block sums' total in one C call (current scaling: x's amax and
        # the scale first, four launches in all; the one-launch current cast writes no sums)
        db = torch.empty(k, dtype=dbias, device=dev)
        if delayed:
            qops.cast_fp8_into(x, scale, amax, out, out_t, scale_inv, sums, db)
        else:
            qops.cast_fp8_current_into(x, amax, scale, scale_inv, out, out_t, o.margin, sums, db)
        return Float8Tensor(out, scale_inv, fp8_dtype, data_t=out_t, dtype=x.dtype, shape=x.shape), db

    def quantize(self, x, transpose=True, transient=False, keep_scale=False):
        """x [M, K] -> Float8Tensor whose data (and data_t) carry
        ``padded_rows(M)`` token rows, the extra ones zero; ``shape`` stays
        x's.  Block scaling: a Float8BlockTensor with the row-wise and (if
        ``transpose``) column-wise 1x128 copies, rows padded likewise.  Both
        kinds of cast write the zero rows in their own pass, so the results
        are the hand-padded computation's bit for bit at no extra pass.
        ``transient`` (a module's forward that reads the row-wise copy only
        in its GEMM and keeps the transposed one): the row-wise copy is a
        transient buffer (input_place).  ``keep_scale`` (delayed scaling
        alone: InputQuantizer.quantize_source_kept): returns (the operand, a
        copy of the scale it was cast with)."""
        m = x.shape[0]
        mp = padded_rows(m)
        rows = None if mp == m else mp
        if self.owner.kind == "block" and not transpose:  # (the row-and-column entry wants 16-byte aligned x)
            return quantize_block(dense(x), 1, self.fp8_dtype, rows=rows)
        place = self.input_place(x) if transient else None
        if self.owner.kind == "block":
            return self._block_cast(x, rows, row_place=place)
        return self._cast(x, transpose, rows=rows, row_place=place, keep_scale=keep_scale)

    def input_place(self, x):
        """The transient place of this role's row-wise FP8 copy of ``x`` in a
        module's forward (purpose: the role's slot, so the two inputs of one
        LayerNormMLP never share a buffer)."""
        return buffers.transient_stream(x), ("input", self.index)

    def _block_cast(self, x, rows, rowwise=True, sums=None, row_place=None, col_place=None, dbias=None):
        """1x128-block cast of x [M, K] with its column-wise copy (what
        quantize_block(..., 1, columnwise=True, rowwise=rowwise, rows=rows)
        makes), its outputs made here: a Float8BlockTensor; ``sums`` (float32
        [ceil(M / 128), K]) receives the dbias pass's block sums and
        ``dbias`` (a [K] tensor, with ``sums``) their total, in the same C call.
        ``row_place`` / ``col_place``: transient buffers for the copies (_cast's)."""
        x, m, k = _cast_input(x)
        outs = qops.rowcol_outputs(x, m, k, self.fp8_dtype, rows, rowwise, True, row_place, col_place)
        qops.quantize_block_fp8_rowcol_into(x, *outs, sums, dbias)
        data, si, data_t, si_t = outs
        return Float8BlockTensor(data, si, 1, dtype=x.dtype, data_t=data_t, scale_inv_t=si_t, shape=x.shape)

    @staticmethod
    def fp8_output_buffer(m, k, fp8_dtype, device, place=None):
        """(buffer, view) for a producer kernel's FP8 output [m, k] (norm,
        activation: delayed scaling's fused casts): the kernel writes ``view``,
        the first m rows of a [padded_rows(m), k] ``buffer`` whose other rows
        are zeroed here (one memset: no padded copy of the output).
        ``place``: the buffer is the transient one there (_cast's)."""
        mp = padded_rows(m)
        buf = buffers.new_or_transient(place, device, fp8_dtype, mp, k)
        if mp == m:
            return buf, buf
        buf[m:].view(torch.uint8).zero_()  # (float8 has no zero_ kernel everywhere: zero the bytes)
        return buf, buf[:m]

    def fused_outputs(self, m, k, device, scale_inv=None, place=None):
        """Delayed scaling, where ``fused_cast`` holds (the caller's check):
        what a producer kernel (norm, activation, activation gradient) takes
        to write this operand [m, k] in FP8 itself, as (scale, amax slot,
        FP8 dtype, scale inverse, buffer, view): the kernel writes ``view``,
        the first m rows of the padded ``buffer`` (fp8_output_buffer), and
        the scale inverse (a new one-element tensor unless ``scale_inv`` is
        given); ``fp8_output`` then makes the operand.  ``place``: the buffer
        is the transient one there (_cast's: a module's forward input, read
        by its GEMM alone, input_place; a gradient operand in a module's
        backward, GradQuantizer's class note)."""
        scale, amax, fp8_dtype = self.scale
        if scale_inv is None:
            scale_inv = torch.empty(1, dtype=torch.float32, device=device)
        buf, view = self.fp8_output_buffer(m, k, fp8_dtype, device, place)
        return scale, amax, fp8_dtype, scale_inv, buf, view

    def fp8_output(self, buf, shape, scale_inv, dtype):
        """The producer's output written into fp8_output_buffer's ``buf`` (real
        rows ``shape``) as this role's padded Float8Tensor standing for
        ``dtype``, without the transposed copy (``transposed()`` makes it)."""
        return Float8Tensor(buf, scale_inv, buf.dtype, dtype=dtype, shape=shape)

    @property
    def scale(self):
        """Delayed scaling: (scale, amax slot, fp8 dtype) for a producer kernel's fused cast."""
        st = self.owner.state
        args = None if recompute.open_contexts else st.steady_cast_args(self.index)
        return args if args is not None else (st.scale_of(self.index), st.amax_of(self.index),
                                              st.fp8_dtype(self.index))

    @property
    def fused_cast(self):
        """Delayed scaling: whether a producer kernel (norm, activation) may
        write this operand in FP8 itself with the state's scale.  Not while
        the tensor has no amax history (the first step): its scale would be
        the initial 1, which puts small activations (a SwiGLU output of
        ~1e-2) into E4M3's subnormals; the producer then writes high
        precision and ``quantize`` casts it with the scale of its own amax,
        as every other first cast (quantize_with_state), so the first step
        is current scaling's throughout.  A checkpoint's recompute (after the
        step's update has given the tensor a history) repeats its forward's
        choice."""
        o = self.owner
        if o.kind != "delayed":
            return False
        # under CUDA graph capture the fused kernel is recorded even before a history exists:
        # make_graphed_callables replays only once the history is there (graphs.py)
        fused = o.state.has_history(self.index) or device_checks.capturing()
        return recompute.choice_for(("fused_cast", id(o.state), self.index), fused) if recompute.open_contexts \
            else fused


def transposed(q, place=None):
    """The [K, Mp] transposed copy of a padded Float8Tensor (made now if the
    cast did not make it; ``place``: into the transient buffer there)."""
    if q.data_t is not None:
        return q.data_t
    d = q.data  # (a producer's [Mp, K] output: fp8_output_buffer's; viewed as [M, K] all the same)
    k = d.shape[-1]
    mp = d.numel() // k if k else 0
    out = buffers.new_or_transient(place, d.device, d.dtype, k, mp)
    qops.transpose_fp8_into(d, out)
    return out


class InputQuantizer(_Role):
    """A GEMM's activation operand.

    A module that keeps its input in its own precision for the backward
    (Linear's save_original_input: an input another module keeps anyway,
    such as the attention output its projection reads) casts it row-wise
    only in the forward (quantize_source_kept) and makes the weight
    gradient's transposed FP8 copy again in the backward
    (columnwise_again): the bytes the forward's cast would have written.
    Per tensor that needs the forward's scale: delayed scaling's is a copy
    taken at the cast (the step's update moves the state's before the
    backward); current scaling takes x's amax again (the same value); block
    scaling's 1x128 blocks depend on x alone."""
    __slots__ = ()

    def quantize_source_kept(self, x):
        """(x's row-wise FP8 operand for the forward GEMM, as
        quantize(transpose=False, transient=True) makes it; the scale it was
        cast with under delayed scaling, a copy, else None): what
        columnwise_again takes with x in the backward."""
        if self.owner.kind != "delayed":
            return self.quantize(x, transpose=False, transient=True), None
        return self.quantize(x, transpose=False, transient=True, keep_scale=True)

    def columnwise_again(self, x, scale):
        """x's transposed FP8 copy for the weight-gradient GEMM, made in the
        backward from x [M, K] as the forward's cast would have made it
        (``scale``: quantize_source_kept's), into a transient buffer (read
        by the GEMM its module enqueues next).  Under delayed scaling the
        cast records its amax into a scratch slot, not the step's history
        (the forward recorded it)."""
        o = self.owner
        m = x.shape[0]
        mp = padded_rows(m)
        rows = None if mp == m else mp
        place = (buffers.transient_stream(x), ("input_again", self.index))
        if o.kind == "block":
            return self._block_cast(x, rows, rowwise=False, col_place=place)
        x, m, k = _cast_input(x)
        fp8_dtype = o.state.fp8_dtype(self.index) if o.kind == "delayed" else self.fp8_dtype
        out_t = buffers.new_or_transient(place, x.device, fp8_dtype, k, mp)
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        amax, scratch_scale = self._scratch(x)
        if o.kind == "delayed":
            qops.cast_fp8_into(x, scale, amax, None, out_t, scale_inv)
        else:
            qops.cast_fp8_current_into(x, amax, scratch_scale, scale_inv, None, out_t, o.margin)
        return Float8Tensor(None, scale_inv, fp8_dtype, data_t=out_t, dtype=x.dtype, shape=x.shape)


class GradQuantizer(_Role):
    """A GEMM's output gradient (the recipe's backward format).  The dbias
    pass's block sums, which the cast's C call totals right after the pass, are a
    transient buffer (seqfuse.ops.buffers: one place per device, stream
    and thread for every cast).  In the backward of Linear, LayerNormLinear
    and LayerNormMLP (``quantize_grad(..., transient=True)``, and
    LayerNormMLP's fused activation-gradient cast) the cast operand is read
    only by the GEMMs of that backward call (the input and weight
    gradients), which it enqueues before it returns: the FP8 copies and
    their scale inverse are transient buffers too.  Otherwise (GroupedLinear
    casts every expert's rows before its GEMMs) the copies are new and the
    scale inverse is one kept tensor per role, read by GEMMs enqueued before
    the role's next cast (as the amax and scale of ``_scratch``).  A cast
    through the role's public ``quantize`` makes its own."""
    __slots__ = ("kept_scale_inv",)
    _caches = _Role._caches + __slots__
    _fallback_logged = []

    def __init__(self, owner, index):
        super().__init__(owner, index)
        self.kept_scale_inv = None

    def transient_outputs(self, x, where, fp8_dtype, m, mp, transpose, sums_rows):
        """(scale inverse, block sums or None, row-wise copy, transposed copy
        or None): every buffer a gradient cast of ``x`` viewed as [m, K]
        (padded to ``mp`` rows) writes in a module's backward, all transient
        at ``where`` (the class note).  A request seen before is one lookup
        (buffers.kept_set: the same views transient() would give, kept only
        while transient() keeps every one of them)."""
        key = ("grad_cast", where, fp8_dtype, x.shape, mp, transpose, sums_rows)
        outs = buffers.kept_set(key)
        if outs is not None:
            return outs
        si, sums = self.kept_outputs(x, sums_rows, where=where)
        k = x.shape[-1]
        shape = tuple(x.shape) if mp == m else (mp, k)
        out = buffers.transient((where, "grad"), fp8_dtype, *shape)
        out_t = buffers.transient((where, "grad_t"), fp8_dtype, k, mp) if transpose else None
        outs = (si, sums, out, out_t)
        sums_shape = None if sums is None else qops.block_sums_shape(sums_rows, k)
        buffers.keep_set(key, outs, (((where, "grad_scale_inv"), torch.float32, (1,)),
                                     None if sums is None else ((where, "grad_sums"), torch.float32, sums_shape),
                                     ((where, "grad"), fp8_dtype, shape),
                                     None if out_t is None else ((where, "grad_t"), fp8_dtype, (k, mp))))
        return outs

    def kept_outputs(self, x, sums_rows=None, scale_inv=True, where=None):
        """The buffers a gradient cast of ``x`` writes besides its FP8 copies
        (see the class note): the scale inverse (None with ``scale_inv``
        False) and, given ``sums_rows``, the block sums.  ``where``: the
        transient_stream of a module's backward, whose scale inverse is a
        transient buffer there; None: the role's kept scale inverse, and the
        sums' place asked of x.  Under CUDA graph capture new ones that the
        graph keeps (as _scratch's)."""
        transient = where is not None
        if not transient:
            where = buffers.transient_stream(x)
        si = None
        if scale_inv:
            if transient:
                si = buffers.transient((where, "grad_scale_inv"), torch.float32, 1)
            else:
                si = self.kept_scale_inv
                dev = x.device
                if si is None or where[1] is None or si.device != dev:
                    si = torch.empty(1, dtype=torch.float32, device=dev)
                    if where[1] is not None:  # (not under capture)
                        self.kept_scale_inv = si
        if sums_rows is None:
            return si, None
        return si, buffers.transient((where, "grad_sums"), torch.float32,
                                     *qops.block_sums_shape(sums_rows, x.shape[-1]))

    def fused_grad(self, h, k, write, need_col):
        """The operand a producer kernel writes in FP8 itself in a module's
        backward (LayerNormMLP's activation gradient, [h's rows, k]):
        ``write(fp8_dtype, scale, amax, scale_inv, out)`` launches it into
        the transient buffers of quantize_grad's ``transient`` (see the
        class note); with ``need_col`` the transposed copy, transient too."""
        rows_at, cols_at = self.grad_places(h)
        si = self.kept_outputs(h, where=rows_at[0])[0]
        scale, amax, fp8_dtype, si, buf, view = self.fused_outputs(h.shape[0], k, h.device, scale_inv=si,
                                                                   place=rows_at)
        write(fp8_dtype, scale, amax, si, view)
        g = self.fp8_output(buf, view.shape, si, h.dtype)
        if need_col:
            g.data_t = transposed(g, cols_at)
        return g

    @staticmethod
    def grad_places(dy):
        """The transient places of a gradient operand's row-wise and
        transposed FP8 copies in a module's backward (see the class note)."""
        where = buffers.transient_stream(dy)
        return (where, "grad"), (where, "grad_t")

    def quantize_grad(self, dy, bias_dtype, need_dgrad=True, need_wgrad=True, transient=False):
        """(padded FP8 dy [M, N] with its transposed copy where the weight
        gradient needs it, the bias gradient in ``bias_dtype`` or None).  The
        bias gradient comes out of the cast's own pass over dy where its
        kernel takes dy (aligned rows, K % 8, 16-byte aligned); otherwise a
        separate float32 column sum, logged once.  ``transient``: the caller
        reads the FP8 operand only in GEMMs it enqueues before it returns,
        and keeps nothing of it (see the class note)."""
        o = self.owner
        m = dy.shape[0]
        want_db = bias_dtype is not None
        # the casts' sums come out in the bias's dtype (float32 then converted for any other)
        sum_dtype = bias_dtype if bias_dtype in qops.SUM_DTYPES else torch.float32
        if o.kind == "block":
            return self._block_grad(dy, want_db, need_dgrad, need_wgrad, bias_dtype, sum_dtype, transient)
        mp = padded_rows(m)
        rows = None if mp == m else mp
        db = None
        at = buffers.transient_stream(dy) if transient else None
        if want_db and need_wgrad and qops.dbias_fusable(dy, rows=mp):
            g, db = self._cast(dy, True, dbias=sum_dtype, rows=rows, kept=True, grad_at=at)
        else:
            g = self._cast(dy, need_wgrad, rows=rows, kept=True, grad_at=at)
        if want_db and db is None:
            if need_wgrad and not GradQuantizer._fallback_logged:
                GradQuantizer._fallback_logged.append(True)
                _log.warning("seqfuse FP8: a bias gradient is summed in a separate pass over the output "
                             "gradient (shape %s, contiguous %s, 16-byte aligned %s: the fused cast takes "
                             "[M, K] with K %% 8 == 0, M %% 16 == 0, contiguous and aligned)",
                             tuple(dy.shape), dy.is_contiguous(), dy.data_ptr() % 16 == 0)
            db = dy.sum(0, dtype=torch.float32)
        return g, (db if db is None or db.dtype == bias_dtype else db.to(bias_dtype))

    def _block_grad(self, dy, want_db, need_dgrad, need_wgrad, bias_dtype, sum_dtype, transient):
        dy = dense(dy)
        m = dy.shape[0]
        mp = padded_rows(m)
        rows = None if mp == m else mp  # (the casts write the zero rows: no padded copy of dy)
        db = None
        if need_wgrad:
            places = self.grad_places(dy) if transient else (None, None)
            sums = self.kept_outputs(dy, m, scale_inv=False, where=places[0][0] if transient else None)[1] \
                if want_db else None
            db = torch.empty(dy.shape[1], dtype=sum_dtype, device=dy.device) if want_db else None
            q = self._block_cast(dy, rows, rowwise=need_dgrad, sums=sums, row_place=places[0], col_place=places[1],
                                 dbias=db)
        else:
            g, g_si = qops.quantize_block_fp8(dy, 1, self.fp8_dtype, rows=rows)
            q = Float8BlockTensor(g, g_si, 1, dtype=dy.dtype, shape=dy.shape)
        if want_db and db is None:
            db = dy.sum(0, dtype=torch.float32)
        return q, (db if db is None or db.dtype == bias_dtype else db.to(bias_dtype))


class WeightQuantizer(_Role):
    """The weight, cast once per weight update (see the module note): under
    delayed scaling with its amax history's scale where the history describes
    it, else from its own amax (_cast_into).  A cached cast keeps its own
    scale inverse, so a later scale update never changes bytes already cast."""
    __slots__ = ("key", "param", "pair", "casts", "captured", "inference", "reused")
    _caches = _Role._caches + ("key", "param", "pair", "captured", "inference", "reused")
    _captured_reuse_logged = []

    def __init__(self, owner, index):
        super().__init__(owner, index)
        self.key = self.param = self.pair = self.captured = None
        self.casts = 0
        self.inference = False  # (the cached pair was cast under torch.inference_mode)
        self.reused = None  # (True once a lean cast was used again: _rowwise_answer)

    def get(self, weight, is_first_microbatch=None, sources=None, transposed=True, release_rowwise=False):
        """(forward operand, input-gradient operand): for per-tensor recipes
        one Float8Tensor with data [N, K] and data_t [K, N] (both); for block
        scaling two Float8BlockTensors in 128x128 blocks (W and W^T).
        ``sources``: the parameters ``weight`` was made from when it is not a
        parameter itself (TE's parameters_split concatenates its pieces on
        every call): the cache follows their versions.

        ``transposed`` False makes the forward operand only, the pair's
        second element None: a call that wants no gradient (inference keeps
        one FP8 byte per weight element), or any call of Linear,
        LayerNormLinear and LayerNormMLP after set_weight_transpose_cache(
        False) (their backward makes W^T from the cached bytes:
        modules._fp8.weight_kept).  A call with ``transposed`` True on a pair
        cached without it makes the input-gradient operand from the cached
        bytes (a byte transpose: the bits the cast would have written) and
        keeps it.  Under CUDA graph capture both are made.

        ``release_rowwise`` (Linear, LayerNormLinear and LayerNormMLP ask
        it): where the call is a training one (``transposed``, no capture)
        with ``is_first_microbatch`` None and set_weight_rowwise_cache(False)
        holds, the cache keeps W^T alone and the forward operand's bytes
        live only in the pair returned (see the module note)."""
        param = self.param
        lean = (release_rowwise and transposed and is_first_microbatch is None and not _weight_rowwise_cache[0]
                and not self.reused)
        if sources is None and param is not None and len(param) == 1 and param[0] is weight:
            pair = self._steady(weight, is_first_microbatch, transposed, lean)
            if pair is not None:
                return pair
        in_capture = device_checks.capturing(weight)
        grad = transposed or in_capture
        pair, note = self.lookup(weight, is_first_microbatch, sources, grad, in_capture)
        w = None
        if pair is None:
            spare = self._spare(note, grad)
            if lean and not in_capture and spare is not None and spare[0].data is None:
                w = self._rowwise_buffer(self._transposed_bytes(spare))
            history = not in_capture and self._history_describes(note[0], note[1])
            pair = self.store(note, *self._cast_weight(weight.detach(), grad, spare, in_capture, rowwise=w,
                                                       from_history=history))
        elif grad and pair[1] is None:
            pair = self.pair = (pair[0], self._transposed_operand(pair[0]))
            if self.owner.weight_history:
                self._fold_amax(weight)
        if pair is not self.pair:  # (an FSDP2-gathered weight's pair: nothing kept here)
            return pair
        # (a captured cast's buffers belong to the graph, which writes and reads them at every replay: kept)
        return self._rowwise_answer(pair, lean and not in_capture, w)

    def _rowwise_answer(self, pair, lean, w=None):
        """get's answer from the cached ``pair``.  ``lean`` (get's
        release_rowwise rule, the pair with its W^T): a pair whose forward
        operand has its bytes (just cast, or cached by an earlier call) gives
        them to the answer alone and the cache keeps W^T; a cached pair
        without them (a lean call's) has them made again from W^T's bytes by
        a byte transpose (the bits the cast wrote: per tensor both copies of
        one cast, block scaling's W and W^T the same 128x128 blocks): inside
        a checkpoint's recompute (seqfuse.quantization.checkpoint) into the
        transient buffer for the answer alone (_rowwise_buffer); under
        torch.inference_mode in a pair cast outside it, into a new buffer for
        the answer alone; else kept in the cache from then on -- a lean call
        that finds its weight unchanged since the cast (gradient accumulation
        without is_first_microbatch, torch's own checkpoint) makes this role
        keep W at every cast after (``reused``), so such a loop transposes
        once, not at every micro-batch.  ``w``: the forward operand's bytes this call's re-cast
        wrote into that buffer."""
        q, qt = pair
        if w is None:
            w = q.data
            if w is None:
                wt = self._transposed_bytes(pair)
                if lean and recompute.open_contexts and recompute.replaying():
                    w = qops.transpose_fp8(wt, out=self._rowwise_buffer(wt))
                elif torch.is_inference_mode_enabled() and not self.inference:
                    # (an inference tensor kept in a pair cast outside that mode would be saved by a later
                    # training call's backward, which autograd refuses: made for this call alone)
                    w = qops.transpose_fp8(wt)
                else:
                    self.reused = self.reused or lean
                    q.data = qops.transpose_fp8(wt)
                    return pair
            elif not lean or qt is None:
                return pair
            q.data = None
            if qt is not q and self.owner.kind != "block":
                qt.data = None  # (a pair given W^T after a no-grad cast, _transposed_operand: W's bytes there too)
        if self.owner.kind == "block":
            return Float8BlockTensor(w, q.scale_inv, 128, dtype=q.dtype, shape=q.shape), qt
        return Float8Tensor(w, q.scale_inv, q.fp8_dtype, data_t=q.data_t, dtype=q.dtype, shape=q.shape), qt

    def _transposed_bytes(self, pair):
        """W^T's bytes [K, N] in a cached ``pair`` (per tensor the operand's
        data_t; block scaling the second operand's data)."""
        return pair[1].data if self.owner.kind == "block" else pair[1].data_t

    @staticmethod
    def _rowwise_buffer(wt):
        """The forward operand's bytes [N, K] of a lean call (W^T's bytes
        ``wt`` [K, N] beside it): a transient buffer (seqfuse.ops.buffers),
        read only by the GEMM its module enqueues next; the next lean weight
        of that stream writes it again (the module note)."""
        return buffers.transient((buffers.transient_stream(wt), "weight_rowwise"), wt.dtype, wt.shape[1],
                                 wt.shape[0])

    def _spare(self, note, transposed):
        """The cached pair, when the cast lookup() asked for with ``note`` may
        be written into its buffers: an eager cast (not captured, not an
        FSDP2-gathered weight) of a weight of the same shape, dtype, device
        and recipe, made with the same ``transposed`` request and inference
        mode (per tensor, in the form the cast makes: not a pair given W^T
        later from the bytes, whose data_t the cast would not write; a block
        pair's four buffers the cast writes either way), whose scale inverses'
        storage no other tensor shares (a pending backward keeps an alias of
        the scale inverse beside the bytes it reads:
        modules._fp8.weight_saved).  Else None: the cast makes new buffers.
        Reusing them saves every weight cast after the first its
        allocations and frees."""
        old = self.pair
        if (old is None or self.key is None or note[2] or self.key[:-1] != note[0][:-1]
                or self.inference != torch.is_inference_mode_enabled()):
            return None
        return old if self._writable(old, transposed) else None

    def _writable(self, pair, transposed):
        """Whether a cast with the request ``transposed`` may write into the
        cached ``pair``'s buffers (_spare's rules on the pair itself): it is
        in the form that cast makes, and no other tensor holds its scale
        inverses' storage."""
        q, qt = pair
        if (qt is not None) != transposed:
            return False
        if self.owner.kind == "block":  # (the four buffers of W and W^T; no spare for W alone)
            return qt is not None and _unshared(q.scale_inv) and _unshared(qt.scale_inv)
        # per tensor, the form _cast_weight makes: one operand serving both GEMMs, with its data_t
        # where transposed (not a pair whose W^T was made later from the bytes: _transposed_operand)
        if (qt is q) != transposed or (q.data_t is not None) != transposed:
            return False
        return _unshared(q.scale_inv)

    def _steady(self, weight, is_first_microbatch, transposed, lean=False):
        """get's answer for a training loop's steady case, taken without the
        general path's frames and key building, or None (get's general path
        then decides, with the same checks).  The case: ``weight`` is the
        very tensor the cached pair was cast from (get's check: ``param``),
        no capture, the recipe kind and format, inference mode and
        ``transposed`` form the pair was cast under.  Then what lookup()
        decides: reuse (is_first_microbatch False; None with the weight's
        key unchanged and no FSDP2), else a re-cast of a weight of the same
        shape, dtype and device into the pair's own buffers where _writable
        allows, counted and keyed as store() keys it."""
        key, pair = self.key, self.pair
        if key is None or pair is None or device_checks.capturing(weight):
            return None
        o = self.owner
        inference = torch.is_inference_mode_enabled()
        if (key[0] != o.kind or key[1] != o.recipe.fp8_format or self.inference != inference
                or (pair[1] is not None) != transposed):
            return None
        if is_first_microbatch is False:
            return self._rowwise_answer(pair, False)
        # (weight_key's layout, read by position here and rebuilt below: kind, format, shape, dtype, device,
        # then the sources' stamps; tests/test_weight_cast_paths.py holds the two paths' decisions equal)
        if key[2] != weight.shape or key[3] != weight.dtype or key[4] != weight.device:
            return None
        stamp = _stamp(weight)
        if is_first_microbatch is None and (stamp,) == key[5] and not fsdp2_in_use():
            return self._rowwise_answer(pair, lean)
        if not self._writable(pair, transposed):
            return None
        q = pair[0]
        w = None
        if lean and q.data is None:  # (W into the transient buffer, W^T into the cached one)
            w = self._rowwise_buffer(self._transposed_bytes(pair))
        # (no detach: the C entries take a tensor that requires grad as its memory)
        self._recast(weight, pair, rowwise=w, from_history=o.weight_history and _stepped_one(key[5][0], stamp, weight))
        self.casts += 1
        self.key = (*key[:5], (stamp,))
        return self._rowwise_answer(pair, lean, w)

    def _history_describes(self, key, src):
        """Whether the weight keyed ``key`` may be cast with its amax
        history's scale (under a module's fp8_weight_history): optimizer
        step was its only write since this role's last cast (_stepped), or
        this role holds no key and the state holds a history for the weight:
        a resumed run's first cast (the checkpoint's weights and their
        history, which the uninterrupted run's cast used), an eager call
        after a CUDA graph capture (whose replays kept the history current),
        or a copy of the module (deepcopy and pickling leave the key out)."""
        o = self.owner
        if not o.weight_history:
            return False
        if self.key is None:
            return o.state.has_history(self.index)
        return _stepped(self.key, key, src)

    def _fold_amax(self, weight):
        """Fold max |weight| into this step's amax slot of the weight (two
        launches): a training call that reuses a cast made under no_grad (a
        validation pass, whose scaling work restore_scaling undid) records
        the amax the cast would have, as a training call's own cast does."""
        slot = self.owner.state.amax_of(self.index)
        torch.maximum(slot, qops.amax(weight.detach()).reshape(1), out=slot)

    def _transposed_operand(self, q):
        """The input-gradient operand from the forward operand ``q``'s FP8
        bytes: block scaling's W^T in 128x128 blocks; per tensor, a
        Float8Tensor over the same data and scale with the transposed copy."""
        if self.owner.kind == "block":
            return block_weight_transposed(q)
        return Float8Tensor(q.data, q.scale_inv, q.fp8_dtype, data_t=qops.transpose_fp8(q.data), dtype=q.dtype,
                            shape=q.shape)

    def lookup(self, weight, is_first_microbatch=None, sources=None, transposed=True, in_capture=None):
        """(the operand pair to use, None) where no cast is needed now (the
        cached pair, or a weight FSDP2 gathered in FP8); else (None, note):
        the weight must be cast, and ``store(note, pair, scratch)`` keeps
        the cast's result (get() does both; a grouped layer casts all its
        experts' weights in one call between the two).  ``transposed``: a
        gathered weight's input-gradient operand is made (get's request).
        ``in_capture``: whether a CUDA graph is being captured, where the
        caller asked already (else asked here)."""
        o = self.owner
        wtype = type(weight)
        if sources is None and wtype is not torch.nn.Parameter and hasattr(wtype, "sf_fp8_pair"):
            # FSDP2 gathered this weight in FP8 (seqfuse.distributed.fp8_allgather):
            # its bytes are the cast of the current weight; nothing is cached
            # here, so no later call can reuse an operand of an older gather
            self.key = self.param = self.pair = None
            return weight.sf_fp8_pair(self, transposed), None
        if in_capture is None:
            in_capture = device_checks.capturing(weight)
        src = (weight,) if sources is None else sources
        kind, fmt = o.kind, o.recipe.fp8_format  # (o.fmt's read, without the property's call)
        key = weight_key(src, kind, fmt, weight.shape, weight.dtype, weight.device)
        old = self.key
        # (a pair cast under torch.inference_mode holds inference tensors, which autograd refuses
        # to save: outside that mode it is cast again)
        if (self.pair is not None and old is not None and old[0] == kind and old[1] == fmt and not in_capture
                and (not self.inference or torch.is_inference_mode_enabled())):
            if is_first_microbatch is False:
                return self.pair, None
            if (is_first_microbatch is None and same_weights(key, src, old, self.param)
                    and not fsdp2_in_use()):
                return self.pair, None
        if in_capture and is_first_microbatch is False and not WeightQuantizer._captured_reuse_logged:
            # a graph that read the eager pair would read buffers a later eager cast rewrites or frees
            WeightQuantizer._captured_reuse_logged.append(True)
            _log.warning("seqfuse FP8: is_first_microbatch=False is not honoured while a CUDA graph is captured: "
                         "the weight's cast is captured, so every replay casts it again from the weight's "
                         "current values")
        return None, (key, src, in_capture)

    def store(self, note, pair, scratch):
        """Keep ``pair``, the cast of the weight lookup() gave ``note`` for
        (``scratch``: the amax / scale buffers the cast wrote, or None), and
        return it (the cached pair again where the cast wrote its buffers:
        _spare)."""
        key, src, in_capture = note
        self.pair = pair
        self.casts += 1
        self.inference = torch.is_inference_mode_enabled()
        if in_capture:
            # a captured cast fills its buffers only when the graph replays: an eager call
            # (a graphed module's first FP8 step, an eval-mode call) must cast again, not read
            # them; the graph's buffers stay referenced here for as long as the graph may run
            # (with the scale / amax scratch the captured kernels write: _scratch gave the
            # capture a pair of its own); with no key, the first eager call after the capture casts
            # again, which also notes a weight without a history (graphs.py's first-step rule waits on it)
            self.captured, self.key, self.param = (pair, scratch), None, None
        else:
            self.key, self.param = key, tuple(src)
        return pair

    def _cast_weight(self, w, transposed=True, spare=None, in_capture=None, rowwise=None, from_history=False):
        """(the operand pair, the (amax, scale) scratch the cast used or None);
        ``transposed`` False: the input-gradient operand left out (None).
        ``spare``: a cached pair of this weight's shape and request whose
        buffers the cast writes (_spare's; none for block scaling's forward
        operand alone); it is then the pair returned.  ``in_capture``: as
        lookup's.  ``rowwise``: with ``spare``, _recast's.  ``from_history``:
        _cast_into's."""
        o = self.owner
        if o.kind == "block":
            if not transposed:  # (no spare: _spare offers none here)
                return (quantize_block(w, 128, self.fp8_dtype), None), None
            # W and W^T's 128x128 blocks (bytes and scales) in one call
            if spare is not None:
                return spare, self._recast(w, spare, in_capture, rowwise, from_history)
            w = w.contiguous()
            data, si, data_t, si_t = qops.block_weight_outputs(w.shape[0], w.shape[1], self.fp8_dtype, w.device)
            qops.quantize_block_fp8_weight_into(w, data, si, data_t, si_t)
            return (Float8BlockTensor(data, si, 128, dtype=w.dtype, shape=w.shape),
                    Float8BlockTensor(data_t, si_t, 128, dtype=w.dtype)), None
        if spare is not None:
            return spare, self._recast(w, spare, in_capture, rowwise, from_history)
        fp8_dtype = self.fp8_dtype
        dev = w.device
        k = w.shape[-1]
        scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
        data = torch.empty(*w.shape, dtype=fp8_dtype, device=dev)
        data_t = torch.empty(k, w.numel() // k if k else 0, dtype=fp8_dtype, device=dev) if transposed else None
        scratch = self._cast_into(w, scale_inv, data, data_t, in_capture, from_history)
        q = Float8Tensor(data, scale_inv, fp8_dtype, data_t=data_t, dtype=w.dtype, shape=w.shape)
        return (q, q if transposed else None), scratch

    def _cast_into(self, w, scale_inv, data, data_t, in_capture=None, from_history=False):
        """The per-tensor cast of the weight ``w`` into ``data`` [N, K] and
        ``data_t`` [K, N] (or None) with its scale inverse.  ``from_history``
        (the caller's _history_describes / _steady answer, false outside a
        module's weight_history: delayed scaling, fp8_weight_history not False): with
        the scale of the weight's amax history, as every other tensor of the
        recipe (quantize.state_cast_args), its amax folded into the state's
        weight slot, one pass over w.  Else from w's own amax (an amax pass,
        then the cast, in one launch; under delayed scaling that amax written
        into the state's weight slot, and the slot noted as cast so the next
        update starts its history).  Returns the (amax, scale) scratch an
        own-amax cast used, or None."""
        o = self.owner
        w = w.contiguous()
        if from_history:
            scale, amax, _ = state_cast_args(o.state, self.index, w)
            qops.cast_fp8_into(w, scale, amax, data, data_t, scale_inv)
            return None
        scratch = self._scratch(w, in_capture)
        amax = o.state.amax_of(self.index) if o.kind == "delayed" else scratch[0]
        qops.cast_fp8_current_into(w, amax, scratch[1], scale_inv, data, data_t, o.margin)
        if o.weight_history and not o.state.has_history(self.index):
            o.state.note_first_cast(self.index)  # (its amax is in the slot: a history from the next update on)
        return scratch

    def _recast(self, w, spare, in_capture=False, rowwise=None, from_history=False):
        """Cast the weight ``w`` into the buffers of the cached pair ``spare``
        (_spare's or _steady's: _writable holds), both copies in one call;
        returns the (amax, scale) scratch the cast used, or None.
        ``rowwise``: where the forward operand's bytes go instead of the
        pair's own buffer (a lean call's transient one, _rowwise_buffer); a
        pair kept without them (a lean call's) otherwise gets a new one."""
        o = self.owner
        q, qt = spare
        data = rowwise
        if data is None:
            if q.data is None:  # (a lean pair: the cache kept W^T alone, _rowwise_answer)
                wt = self._transposed_bytes(spare)
                q.data = torch.empty(wt.shape[1], wt.shape[0], dtype=wt.dtype, device=wt.device)
            data = q.data
        if o.kind == "block":
            qops.quantize_block_fp8_weight_into(w.contiguous(), data, q.scale_inv, qt.data, qt.scale_inv)
            written_in_place(q.scale_inv, qt.scale_inv)
            return None
        scratch = self._cast_into(w, q.scale_inv, data, q.data_t, in_capture, from_history)
        increment_versions((q.scale_inv,))  # (written_in_place, without its frame)
        return scratch


# A cached weight pair's buffers are written again only where no other tensor shares their scale
# inverses' storage.  A backward keeps the scale inverse of what it reads of the weight as an alias
# (modules._fp8.weight_saved: a detached tensor of its own over the same storage), which autograd frees
# after that backward (kept with retain_graph, or while saved-tensor hooks keep it); torch's storage
# use count sees it.  The rule for every backward: keep a weight operand only through weight_saved
# (the count cannot see the same tensor saved again, nor raw pointers).  As a net under that rule, a
# write in place moves the scale inverses' version counters (written_in_place), which an alias
# shares: a saved operand the count missed makes its backward raise torch's "modified by an inplace
# operation" instead of reading the new bytes.  The count of a storage only its tensor holds is read once here,
# as _unshared reads it (the UntypedStorage object that the read makes holds one more); where torch
# lacks the count, or reading it fails, re-casts make new buffers.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _sole_owner_count():
    if _use_count is None:
        return None
    try:
        t = torch.empty(1, device="cpu")  # (explicitly on the CPU: never initialise CUDA at import)
        return _use_count(t.untyped_storage()._cdata)
    except Exception:  # noqa: BLE001 - a private entry of torch's: its absence only costs allocations
        return None


_SOLE_OWNER = _sole_owner_count()


def storage_holders(t):
    """How many tensors hold ``t``'s storage (``t`` and its views and aliases),
    or None where torch cannot tell (then nothing is written in place)."""
    if _SOLE_OWNER is None:
        return None
    return _use_count(t.untyped_storage()._cdata) - _SOLE_OWNER + 1


def _unshared(t):
    """Whether no tensor but ``t`` holds its storage (storage_holders(t) == 1)."""
    return _SOLE_OWNER is not None and _use_count(t.untyped_storage()._cdata) == _SOLE_OWNER


def written_in_place(*scale_invs):
    """Move the version counters of the scale inverses a re-cast wrote (every
    saved weight operand keeps its scale inverse beside its bytes; a view's
    counter is its base's).  The hot re-cast of one per-tensor weight calls
    increment_versions((scale_inv,)) itself."""
    increment_versions(scale_invs)



def weight_key(src, *head):
    """The key a weight cast made from the tensors ``src`` is cached under:
    ``head`` (what else the cast depends on), then each tensor's storage
    address, version counter (an in-place update bumps it; ``.to()`` or a
    load moves the storage) and count of the optimizer steps that covered
    it (torch's fused optimizers do not bump versions: see the module
    note).  Compared with same_weights; WeightQuantizer and GroupedLinear's
    device-split FP8 weights (each keeping its own cache) share it."""
    if len(src) == 1:  # (a module's own weight: the common case, without a comprehension)
        return (*head, (_stamp(src[0]),))
    return (*head, tuple([_stamp(t) for t in src]))


def _stepped(old, new, src):
    """Whether the weight made from the tensors ``src``, keyed ``new``, was
    last cast under the key ``old`` and changed since by one torch.optim step
    alone: the same cast settings and, for every source, the same storage,
    one optimizer step more, that step's hooks seeing the cast's version
    before it and the current version after it (no other write on either
    side of the step: a copy, a load, a rescale, a clamp_).  Else the cast
    takes the weight's own amax (WeightQuantizer._cast_into)."""
    if old is None or old[:5] != new[:5] or len(old[5]) != len(new[5]):
        return False
    return all(_stepped_one(a, b, t) for a, b, t in zip(old[5], new[5], src))


def _stepped_one(old, new, t):
    """_stepped's test for one source tensor ``t`` whose stamp (_stamp) was
    ``old`` at the last cast and is ``new`` now (WeightQuantizer._steady
    asks it for its one parameter)."""
    if old[0] != new[0] or new[2] != old[2] + 1:
        return False
    entry = _param_counters.get(id(t))
    return entry is not None and entry[0]() is t and entry[2][0] == old[1] and entry[2][1] == new[1]


def _stamp(t):
    """What weight_key keeps of the source tensor ``t``."""
    return t.data_ptr(), t._version, _steps_of(t)


# A fused optimizer's kernel writes the parameters without moving their version counters, so the
# weight key also counts optimizer steps.  Each torch.optim optimizer gets one counter (a one-element
# list) that its step moves; its parameters point at it (registered again when its parameter count
# changes), a parameter in several optimizers at each of theirs.  Parameters are found by id (a dict
# lookup on every weight-cache check; torch's WeakIdKeyDictionary builds a weak reference per lookup,
# ~1 us), each entry holding a weak reference that tells a reused id apart and drops the entry when
# its parameter dies.  The entry also keeps the parameter's version counter just before and just
# after its optimizers' last step (a pre- and a post-step hook, a pass over the optimizer's
# parameters each: ~0.2 us a parameter): _stepped's test that the step was the only write.
_param_counters = {}  # id(parameter) -> (weak reference, step counters, [version before, after the last step])
_optimizer_counters = weakref.WeakKeyDictionary()  # optimizer -> (its counter, parameters registered)


def _steps_of(t):
    entry = _param_counters.get(id(t))
    if entry is None or entry[0]() is not t:
        return 0
    counters = entry[1]
    return counters[0][0] if len(counters) == 1 else sum(c[0] for c in counters)


def _forget_parameter(ref, pid):
    """A registered parameter died: drop its entry (unless its id already serves a newer one)."""
    entry = _param_counters.get(pid)
    if entry is not None and entry[0] is ref:
        del _param_counters[pid]


def _before_optimizer_step(optimizer, args, kwargs):
    """Register the optimizer's parameters where their count changed (each
    entry gets the optimizer's step counter), then note their versions
    before the step."""
    n = sum(len(group["params"]) for group in optimizer.param_groups)
    counter, registered = _optimizer_counters.get(optimizer, (None, -1))
    if registered != n:
        counter = counter or [0]
        for group in optimizer.param_groups:
            for p in group["params"]:
                pid = id(p)
                entry = _param_counters.get(pid)
                if entry is None or entry[0]() is not p:
                    entry = (weakref.ref(p, lambda ref, pid=pid: _forget_parameter(ref, pid)), (), [None, None])
                if not any(c is counter for c in entry[1]):
                    _param_counters[pid] = (entry[0], entry[1] + (counter,), entry[2])
        _optimizer_counters[optimizer] = (counter, n)
    _note_versions(optimizer, 0)


def _after_optimizer_step(optimizer, args, kwargs):
    """Count the step and note the parameters' versions after it (a step
    whose pre-step hook did not run, hooks registered while it ran, counts
    from the next one)."""
    counted = _optimizer_counters.get(optimizer)
    if counted is None:
        return
    counted[0][0] += 1
    _note_versions(optimizer, 1)


def _note_versions(optimizer, slot):
    """Each registered parameter's version counter into slot 0 (before the
    step) or 1 (after it) of its entry."""
    counters = _param_counters
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = counters.get(id(p))
            if entry is not None:
                entry[2][slot] = p._version


_optimizer_step_hooks = (register_optimizer_step_pre_hook(_before_optimizer_step),
                         register_optimizer_step_post_hook(_after_optimizer_step))


def same_weights(key, src, old_key, old_src):
    """Whether a cast cached under ``old_key`` (weight_key's) from the
    tensors ``old_src`` serves the tensors ``src`` whose key is ``key``:
    equal keys and the very same tensor objects (a new tensor may reuse a
    freed one's address, and its version counter starts again)."""
    if old_src is None or len(old_src) != len(src) or old_key != key:
        return False
    return old_src[0] is src[0] if len(src) == 1 else all(a is b for a, b in zip(old_src, src))


def high_precision(t):
    """``t``, or its dequantized values when it is a weight FSDP2 gathered in
    FP8 (seqfuse.distributed.fp8_allgather) and read by a non-FP8 GEMM path."""
    return t.dequantized() if hasattr(type(t), "sf_fp8_pair") else t


def fsdp2_in_use():
    """Whether torch's FSDP2 (fully_shard) manages modules in this process.
    FSDP2 re-gathers every weight into the same unsharded parameter each step
    with its version counter preserved, so version keys cannot see the new
    values: weights are then cast at every forward, as the all-gather runs at
    every forward.  (Read from sys.modules: a process that never imported
    FSDP2 cannot be using it, and importing it here would load about 600
    modules into every seqfuse process.)"""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return bool(cls is not None and cls.__subclasses__())


def block_weight_transposed(q):
    """W^T in 128x128 blocks from W's: the blocks are the same sets of values,
    so the bytes are W's transposed and the scales W's scale matrix
    transposed (re-padded to 4 blocks per row) -- bit for bit what quantizing
    W.t() gives, for a byte transpose instead of a 16-bit transpose and a
    second quantization (one C call: ops.quant.block_transpose_fp8, which
    takes W's bytes [M, K] with M and K multiples of 128, 16-byte aligned, and
    their scales in exactly quantize_block_fp8's 128x128 shape)."""
    data_t, si_t = qops.block_transpose_fp8(q.data, q.scale_inv)
    return Float8BlockTensor(data_t, si_t, 128, dtype=q.dtype)


def transposed_weight_parts(data, scale_inv, kind):
    """(W^T's bytes, its scale inverse(s)) from the forward operand's: the
    bits the weight's cast writes into its transposed copy, by a byte
    transpose (block scaling: with the scale matrix transposed)."""
    if kind == "block":
        return qops.block_transpose_fp8(data, scale_inv)
    return qops.transpose_fp8(data), scale_inv


# ---- one module's set -------------------------------------------------------------

class GemmQuantizers:
    """The quantizers of one module's ``num_gemms`` GEMMs under one recipe.
    ``inputs[g]``, ``weights[g]``, ``grads[g]``; ``state`` (delayed scaling:
    the module's ScalingState of 3 x num_gemms tensors, else None)."""

    __slots__ = ("cls", "num_gemms", "recipe", "kind", "state", "inputs", "weights", "grads", "weight_list",
                 "weight_history")
    _caches = ("weight_list",)

    def __init__(self, cls, num_gemms):
        self.cls, self.num_gemms = cls, num_gemms
        self.recipe = self.kind = self.state = None
        self.weight_history = False
        self.inputs = [InputQuantizer(self, 3 * g) for g in range(num_gemms)]
        self.weights = [WeightQuantizer(self, 3 * g + 1) for g in range(num_gemms)]
        self.grads = [GradQuantizer(self, 3 * g + 2) for g in range(num_gemms)]
        # a grouped module's last one-call cast of all its weights (quantization.grouped.weight_pairs),
        # whose outputs the next such cast writes in place: a cache, left out of copies as the roles' are
        self.weight_list = None

    def __getstate__(self):
        return _state_without_caches(self)

    @property
    def fmt(self):
        """The recipe's format, read each time (a recipe changed in place is seen)."""
        return self.recipe.fp8_format

    @property
    def margin(self):
        return int(getattr(self.recipe, "margin", 0))

    def quantizer(self, index):
        """The quantizer of state index ``index`` (an int or a TE enum member)."""
        g, role = divmod(int(index), 3)
        return (self.inputs, self.weights, self.grads)[role][g]

    def adopt(self, module, recipe, device):
        """Take ``recipe`` (called at each FP8 forward; the same recipe object
        costs one identity check)."""
        if recipe is self.recipe:
            if self.state is not None:
                self.state.ensure_pooled()
            return self
        kind = recipe_kind(recipe, self.cls)
        check_features(self.cls, kind, *module.fp8_features())
        self.recipe, self.kind = recipe, kind
        # the history scale of the weights' casts under delayed scaling (the module note), unless the module
        # says False (GroupedLinear: its one-launch cast of every expert's weight takes each one's own amax)
        self.weight_history = kind == "delayed" and getattr(module, "fp8_weight_history", True) is not False
        if kind == "delayed":
            state = getattr(module, "fp8_state", None)
            if state is None:
                state = ScalingState(3 * self.num_gemms, recipe,
                                     backward_indices=tuple(3 * g + 2 for g in range(self.num_gemms)),
                                     device=device)
                module.add_module("fp8_state", state)
            elif state.recipe is not recipe and state.recipe != recipe:
                state.set_recipe(recipe)
            state.ensure_pooled()
            self.state = state
        else:
            self.state = None
        return self


def quantizers_for(module, recipe, device):
    """``module``'s GemmQuantizers under ``recipe`` (made at the first call;
    the module class says how many GEMMs it has: ``fp8_num_gemms``)."""
    q = module.__dict__.get("_fp8_quantizers")
    if q is None:
        q = module.__dict__["_fp8_quantizers"] = GemmQuantizers(type(module).__name__,
                                                                 type(module).fp8_num_gemms)
    return q.adopt(module, recipe, device)


def weight_casts(model):
    """How many weight casts to FP8 the modules of ``model`` (itself
    included) have made so far, all GEMMs together."""
    n = 0
    for m in model.modules():
        q = m.__dict__.get("_fp8_quantizers")
        if q is not None:
            n += sum(w.casts for w in q.weights)
    return n


@torch.no_grad()
def init_fp8_state(model, recipe):
    """Make every FP8 GEMM module's scaling state under ``recipe`` now, at its
    initial values (amax history 0, scale 1), without running the model:
    a resumed run then finds a place for each saved state when it loads the
    checkpoint.  Returns the number of states made or adopted (0 for recipes
    that keep none: current and block scaling).  Under a DelayedScaling
    recipe with fp8_dpa=True, the attention modules' FP8 states
    (``init_fp8_attention_state``, on the model's parameters' device) are
    made too and counted."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"init_fp8_state: argument 'recipe' must be a seqfuse.common.recipe recipe, "
                        f"got {type(recipe).__name__}")
    n = 0
    attention = isinstance(recipe, DelayedScaling) and recipe.fp8_dpa
    first = next(iter(model.parameters()), None)
    for m in list(model.modules()):  # (states are added as children on the way)
        if getattr(type(m), "fp8_num_gemms", 0):
            p = next(iter(m.parameters(recurse=False)), None)
            device = p.device if p is not None and p.device.type != "meta" else None
            q = quantizers_for(m, recipe, device)
            if q.state is not None:
                n += 1
        init_attention = getattr(m, "init_fp8_attention_state", None)
        if attention and callable(init_attention):
            init_attention(recipe, first.device if first is not None and first.device.type != "meta" else None)
            n += 1
    return n
