"""Cross-entropy for language-model heads, built on seqfuse's fused kernel.

- ``cross_entropy(logits, labels, ignore_index, label_smoothing, reduction,
  inplace_backward)`` / ``CrossEntropyLoss``: torch.nn.functional.cross_entropy
  semantics for [..., V] logits; the forward reads the logits once (online
  softmax) and keeps only a float32 log-sum-exp per row; the backward writes
  the gradient, over the logits buffer when ``inplace_backward=True`` (the
  logits must then not be read after backward starts).  The loss is float32
  whatever the logits' dtype.
- ``parallel_cross_entropy``: Transformer Engine's name and arguments
  (``reduce_loss``, ``ignore_idx``, ``overwrite_input``); no vocab-parallel
  process group yet (NotImplementedError).
- ``linear_cross_entropy(hidden, weight, labels, ...)``: logits = hidden @
  weight.T and the loss, in chunks of tokens so the [N, V] logits never exist
  at once.  Gradients are computed chunk by chunk during the forward (as
  Liger-Kernel does) and scaled by the upstream gradient in the backward.
  The chunk GEMMs run on seqfuse.ops.gemm (cuBLASLt on the GPU, the
  reference GEMM on the CPU): the logits GEMM with the bias in its epilogue,
  and the weight gradient summed across chunks by the GEMM itself (beta =
  1): in the weight's dtype by default where that is the GEMMs' (hidden's)
  dtype (each chunk's float32 sum rounded into it, as Liger-Kernel's default
  does: no [V, H] buffer beyond the gradient; a weight of another dtype sums
  in float32), or with ``weight_grad_dtype=torch.float32`` in a float32 buffer
  rounded to the weight's dtype once at the end (4 V H bytes more while the
  forward runs: 1 GiB at a 128k vocabulary and H 2048).  The first call
  logs which GEMM runs.
  With ``fp8_recipe`` (DelayedScaling or Float8CurrentScaling) the three
  GEMMs of every chunk run in FP8: the weight is cast once per call (E4M3,
  with its transposed copy for the hidden states' gradient), each chunk's
  hidden states in E4M3 and its logits' gradient in the recipe's backward
  format (E5M2 under HYBRID).  The weight and the hidden states are scaled
  from their own amax (current scaling under either recipe: the loss keeps
  no scaling state); the logits' gradient, softmax minus the target
  distribution times the loss's scale (1 / tokens for the mean), is
  bounded by that scale in magnitude, and is cast with the scale that maps
  the bound to the format's largest value (no amax pass over the chunk).
  The softmax, the loss and the logits' gradient stay in the hidden
  states' dtype and float32.  Token rows are padded to the FP8 GEMMs' 16
  inside the call; V and H must be multiples of 16.
"""
import logging
import math

import torch

from ..ops import loss as _loss
from ..ops import optim as _optim
from ..ops.args import as_float as _as_float
from ..ops.args import as_int as _as_int
from ..ops import pending_errors as _pending
from ..ops.device_checks import check_labels as _check_labels
from ..ops.device_checks import defers_label_check as _defers_label_check
from ..ops.device_checks import capturing as _capturing
from ..ops.gemm import gemm as _gemm
from ..ops.gemm import tune as _tune_gemm
from ..ops.gemm import tuning_enabled as _gemm_tuning_enabled
from ..quantization import quantize as _quantize
from ..quantization import quantize_current as _quantize_current
from ..quantization.gemm_quantizers import padded_rows as _padded_rows
from ..quantization.gemm_quantizers import row_prefix as _row_prefix
from . import _fp8 as F8

_log = logging.getLogger("seqfuse")
_REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction, allowed=_REDUCTIONS):
    if reduction not in allowed:
        raise ValueError(f"cross_entropy: argument 'reduction' must be one of {allowed}, got {reduction!r}")


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd Function over seqfuse.ops.cross_entropy_forward / _backward."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index, label_smoothing, reduction, inplace_backward, named=None):
        # named: (op, argument) a bad label's error names, default the op's own ("labels")
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        flat_labels = labels.reshape(-1)
        loss, lse = _loss.cross_entropy_forward(flat, flat_labels, ignore_index, label_smoothing,
                                                labels_of=named and (named[0], named[1], flat_labels))
        count = None
        if reduction == "mean":
            count = (flat_labels != ignore_index).sum().to(torch.float32)
            out = loss.sum() / count
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.view(labels.shape)
        ctx.save_for_backward(flat, flat_labels, lse, count)
        ctx.shape = logits.shape
        ctx.args = (ignore_index, label_smoothing, reduction, inplace_backward)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _pending.raise_pending()  # a bad label the forward's kernel recorded, if it has finished
        flat, labels, lse, count = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, inplace = ctx.args
        scale = grad_out.detach().to(torch.float32).reshape(-1)
        if reduction == "mean":
            scale = scale / count
        elif reduction == "none":
            scale = scale.contiguous()
        if inplace and torch.is_grad_enabled():
            raise RuntimeError("cross_entropy: inplace_backward=True writes the gradient over the logits, which a "
                               "backward with create_graph=True (a double backward) cannot differentiate through; "
                               "pass inplace_backward=False")
        grad = _loss.cross_entropy_backward(flat, labels, lse, scale, ignore_index, label_smoothing,
                                            out=flat if inplace else None, check_labels=False)  # forward did
        return grad.view(ctx.shape), None, None, None, None, None, None


def cross_entropy(logits, labels, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  inplace_backward=False):
    """Cross-entropy of ``logits`` [..., V] against int64 ``labels`` [...], as
    torch.nn.functional.cross_entropy with class indices computes it
    (mean over non-ignored rows, 'sum', or 'none' per row), in float32."""
    _check_reduction(reduction)
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("cross_entropy: arguments 'logits' and 'labels' must be torch.Tensors")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: argument 'labels' must have shape {tuple(logits.shape[:-1])} "
                         f"(logits without V), got {tuple(labels.shape)}")
    op = "cross_entropy"
    return CrossEntropyFunction.apply(logits, labels, _as_int(op, "ignore_index", ignore_index),
                                      _as_float(op, "label_smoothing", label_smoothing), reduction,
                                      bool(inplace_backward))


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss (class indices, no class weights) on the fused kernel."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False):
        super().__init__()
        _check_reduction(reduction)
        self.ignore_index = _as_int("CrossEntropyLoss", "ignore_index", ignore_index)
        self.reduction = reduction
        self.label_smoothing = _as_float("CrossEntropyLoss", "label_smoothing", label_smoothing)
        self.inplace_backward = inplace_backward

    def forward(self, logits, labels):
        return cross_entropy(logits, labels, self.ignore_index, self.label_smoothing, self.reduction,
                             self.inplace_backward)


def parallel_cross_entropy(inp, target, label_smoothing=0.0, reduce_loss=False, dist_process_group=None,
                           ignore_idx=-100, is_cg_capturable=False, *, overwrite_input=False):
    """Transformer Engine's parallel_cross_entropy: ``inp`` (B, SQ, V) or
    (SQ, B, V), ``target`` int64 with B * SQ elements; float32 loss per token,
    or its mean over non-ignored tokens with ``reduce_loss``.  Always graph
    capturable here (nothing is read on the host)."""
    if dist_process_group is not None and not (torch.distributed.is_available()
                                               and isinstance(dist_process_group, torch.distributed.ProcessGroup)):
        raise TypeError(f"parallel_cross_entropy: argument 'dist_process_group' must be a "
                        f"torch.distributed.ProcessGroup or None, got {type(dist_process_group).__name__}")
    if dist_process_group is not None and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(dist_process_group) > 1:
        raise NotImplementedError("parallel_cross_entropy: vocab-parallel loss over a process group "
                                  "is not supported by seqfuse yet")
    op = "parallel_cross_entropy"
    if not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor):
        bad, name = (inp, "inp") if not isinstance(inp, torch.Tensor) else (target, "target")
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(bad).__name__}")
    if inp.dim() < 2:
        raise ValueError(f"{op}: argument 'inp' must be (B, SQ, V) or (SQ, B, V), got shape {tuple(inp.shape)}")
    tokens = math.prod(inp.shape[:-1])
    if target.numel() != tokens:
        raise ValueError(f"{op}: argument 'target' must hold one label per token of 'inp' ({tokens} = "
                         f"{' x '.join(map(str, inp.shape[:-1]))}), got shape {tuple(target.shape)}")
    labels = target.reshape(inp.shape[:-1])
    _check_reduction("mean" if reduce_loss else "none")
    return CrossEntropyFunction.apply(inp, labels, _as_int(op, "ignore_idx", ignore_idx),
                                      _as_float(op, "label_smoothing", label_smoothing),
                                      "mean" if reduce_loss else "none", bool(overwrite_input),
                                      ("parallel_cross_entropy", "target"))


_gemm_logged = False


def _log_gemm_backend(fp8=None):
    global _gemm_logged
    if not _gemm_logged:
        _gemm_logged = True
        _log.info("linear_cross_entropy: chunk GEMMs run on seqfuse.ops.gemm (cuBLASLt on CUDA, "
                  "the reference GEMM on the CPU)%s; weight gradient summed over chunks by the GEMMs in the "
                  "weight's dtype where it is hidden's, else and with weight_grad_dtype=torch.float32 in a "
                  "float32 buffer",
                  "" if fp8 is None else f" in FP8 ({fp8[0]} forward, {fp8[1]} gradients, current scaling)")


def default_chunk_size(n, v, element_size, budget_bytes=None):
    """Rows per chunk, a multiple of 256 rows, at least 256, so one chunk of
    logits takes at most ``budget_bytes``; by default a quarter of the full
    [n, v] logits, kept between 256 and 512 MiB (a 128k vocabulary in bf16:
    1,024 rows at 4,096 tokens, four chunks; 2,048 rows from 8,192 tokens
    on).  ``element_size``: the bytes a chunk holds per logit (the FP8 path
    passes twice the logits' own: its gradient's FP8 copy and transpose
    live beside them).  The chunk's logits are the loss's transient memory at the end of
    the forward, where a model's saved activations peak; each chunk after
    the first reads and writes the weight gradient once more in its GEMM
    (2 V H bytes each way in bf16: 0.5 GB at a 128k vocabulary and H 2048),
    which, with the smaller GEMMs, is what smaller chunks cost (on an H100
    at that head and 8,192 tokens, forward+backward 20.4 ms in one chunk,
    21.0 ms in 2,048-row chunks, 24.1 ms in 1,024-row ones:
    results/linear_ce_chunks_h100_s57_a198f7c.json)."""
    if budget_bytes is None:
        budget_bytes = min(max(n * v * element_size // 4, 256 << 20), 512 << 20)
    rows = max(256, (budget_bytes // max(1, v * element_size)) // 256 * 256)
    return min(n, rows) if n > 0 else 1


_SCALABLE = (torch.float32, torch.bfloat16, torch.float16)


def scale_by_loss_grad(grads, g):
    """Multiply the gradients ``grads`` the forward made (for a loss gradient
    of 1) by the loss's actual gradient ``g``, in place.  ``g`` lives on the
    device and is 1 in a plain ``loss.backward()``: seqfuse's multi-tensor
    scale then skips the pass over the gradients (the LM head's weight
    gradient is V x H: 0.5 GB at a 128k vocabulary and H 2,048) without the
    host reading ``g``.  The product is taken in float32 and rounded once,
    for gradients of another layout or device too (torch's multiply, then a
    copy back); float64 ones are multiplied in float64."""
    fast = []
    for t in grads:
        if t.dtype not in _SCALABLE:
            t.mul_(g.to(t.device, t.dtype))
        elif t.is_contiguous() and t.device == g.device:
            fast.append(t)
        else:
            t.copy_(t.to(torch.float32) * g.to(t.device, torch.float32))
    if fast:
        _optim.multi_tensor_scale(fast, g.to(torch.float32).reshape(()))


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked hidden @ weight.T + cross-entropy; gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, reduction, chunk_size,
                fp8=None, weight_grad_dtype=None, tied=None):
        # fp8: (forward FP8 dtype, backward FP8 dtype) of the chunk GEMMs' operands, or None;
        # tied: the TiedGradient the backward offers the weight's gradient to (seqfuse.modules.embedding)
        ctx.tied, ctx.handed_out = tied, False
        _log_gemm_backend(fp8)
        n = hidden.shape[0]
        v = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        # labels: each chunk's kernel records a bad one under its row in the whole tensor (deferred
        # mode), or the whole tensor is checked once here, not once per chunk ("sync": one host sync)
        chunk_check, labels_of = False, None
        if labels.dim() == 1 and labels.dtype == torch.int64:
            if _defers_label_check(labels):
                chunk_check, labels_of = True, ("linear_cross_entropy", "labels", labels)
            else:
                _check_labels("linear_cross_entropy", labels, v, ignore_index)
        count = (labels != ignore_index).sum().to(torch.float32)
        scale = (1.0 / count).reshape(1) if reduction == "mean" else torch.ones(1, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # (under FP8 a chunk also holds its gradient's FP8 copy and that copy's transpose: twice the logits' bytes)
        chunk = chunk_size or default_chunk_size(n, v, hidden.element_size() * (2 if fp8 else 1))
        weight_dtype = weight.dtype
        # the GEMMs sum the weight gradient over the chunks in the weight's dtype where that is their
        # output dtype (hidden's), unless weight_grad_dtype asks for a float32 buffer: one chunk (the
        # GEMM's own float32 sum, rounded once) writes the weight's dtype either way.  A weight of
        # another dtype than hidden's sums in float32 and is converted at the end.
        in_place = weight_dtype == hidden.dtype and (weight_grad_dtype is None or n <= chunk)
        acc_dtype = weight_dtype if in_place else torch.float32
        grad_w = torch.empty(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(v, dtype=torch.float32, device=hidden.device) if need_b else None
        ctx.bias_dtype = bias.dtype if bias is not None else None  # the gradient's dtype: the bias's own
        if weight.dtype != hidden.dtype:  # e.g. an fp32 weight under bf16 autocast: GEMMs in hidden's dtype
            weight = weight.detach().to(hidden.dtype)
            bias = bias.detach().to(hidden.dtype) if bias is not None else None
        with torch.no_grad():
            gemms = (_Fp8ChunkGemms(weight.detach(), bias, fp8, need_h, need_w, scale) if fp8
                     else _ChunkGemms(weight, bias, sums=need_w and n > chunk))
            for start in range(0, n, chunk):
                h = hidden[start:start + chunk].detach()
                y = labels[start:start + chunk]
                logits = gemms.logits(h, last=start + chunk >= n)
                loss, lse = _loss.cross_entropy_forward(logits, y, ignore_index, label_smoothing,
                                                        check_labels=chunk_check, labels_of=labels_of)
                total += loss.sum()
                if need_h or need_w or need_b:
                    _loss.cross_entropy_backward(logits, y, lse, scale, ignore_index, label_smoothing, out=logits,
                                                 check_labels=False)
                    # grad_h[chunk] = dlogits @ W; grad_w (+)= dlogits.T @ h, summed in float32 by the GEMM
                    gemms.grads(logits, h, grad_h[start:start + chunk] if need_h else None, grad_w, start > 0)
                    if need_b:
                        grad_b += logits.sum(0, dtype=torch.float32)
                del logits, loss, lse  # freed before the next chunk's logits are allocated: one chunk at a time
            del gemms  # (the FP8 weight copies)
        if grad_w is not None and n == 0:
            grad_w.zero_()  # no chunk wrote it
        if grad_w is not None and grad_w.dtype != weight_dtype:
            grad_w = grad_w.to(weight_dtype)
        out = total / count if reduction == "mean" else total
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _pending.raise_pending()  # a bad label a chunk's kernel recorded, if it has finished
        if ctx.handed_out:
            # the gradients were made in the forward and the first backward scaled them in place (and a tied
            # embedding added its rows into the weight's): a second pass would return those, scaled again
            raise RuntimeError("linear_cross_entropy: backward ran a second time through the same loss "
                               "(retain_graph=True); its gradients are made in the forward and handed out by the "
                               "first backward: compute the loss again for another backward")
        ctx.handed_out = True
        grad_h, grad_w, grad_b = ctx.saved_tensors
        g = grad_out.detach()
        scale_by_loss_grad([t for t in (grad_h, grad_w) if t is not None], g)
        if grad_b is not None:
            grad_b = (grad_b * g).to(ctx.bias_dtype)
        if ctx.tied is not None and grad_w is not None and ctx.tied.hands_over():
            ctx.tied.offer(grad_w)  # (the embedding's backward adds its rows and returns it)
            grad_w = None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


#: A tune of the summing GEMM that raised (its exception): the loss tunes no more in this process.
_tune_failed = []


class _ChunkGemms:
    """A chunk's three GEMMs in the hidden states' dtype: float32
    accumulation, no TF32 (as torch.matmul).  Where several chunks sum the
    weight gradient on the GPU, the first chunk's call first times cuBLASLt's
    candidates for the summing GEMM (ops.gemm.tune, once per plan, where
    ops.gemm.tuning_enabled: the default), while the weight gradient's buffer
    holds nothing yet: that chunk's own GEMM then writes it anew.  The
    heuristic's first choice for that product (the [V, H] gradient added
    into, K = the chunk's rows) ran 745-786 us a call against the kept
    candidate's 695-704 on an H100 at Llama 1B's head in 1,024-row chunks."""

    def __init__(self, weight, bias, sums=False):
        self.weight, self.bias = weight, bias
        self.tune = (sums and weight.is_cuda and not _tune_failed and _gemm_tuning_enabled()
                     and not _capturing(weight))

    def logits(self, h, last=False):
        return _gemm(h, self.weight, transb=True, bias=self.bias, allow_tf32=False)

    def grads(self, dlogits, h, grad_h, grad_w, accumulate):
        if grad_h is not None:
            _gemm(dlogits, self.weight, out=grad_h, allow_tf32=False)
        if grad_w is not None:
            if self.tune and not accumulate:  # (the summing GEMM's plan, timed before this chunk writes grad_w)
                try:
                    _tune_gemm(dlogits, h, grad_w, transa=True, accumulate=True, allow_tf32=False)
                except (RuntimeError, ValueError) as e:  # (the GEMMs below then run cuBLASLt's first choice)
                    _tune_failed.append(e)
                    _log.warning("seqfuse linear_cross_entropy: timing the weight gradient's GEMM candidates "
                                 "failed (%s); its GEMMs run cuBLASLt's first choice, and this process tunes "
                                 "no more", e)
            _gemm(dlogits, h, transa=True, out=grad_w, accumulate=accumulate, allow_tf32=False)


class _Fp8ChunkGemms:
    """The same GEMMs over FP8 operands (module note): the weight cast once
    (row-wise for the logits, its transposed copy for the hidden states'
    gradient), each chunk's hidden states and logits' gradient cast with
    their token rows padded to the GEMMs' 16 (zero rows, cut from the
    results).  ``grad_bound``: the loss's scale (one element on the
    device), the bound of the logits' gradient."""

    def __init__(self, weight, bias, fp8, need_h, need_w, grad_bound):
        self.forward_dtype, self.backward_dtype = fp8
        self.need_w = need_w
        self.wq = _quantize_current(weight, self.forward_dtype, transpose=need_h)
        self.bias = bias
        self.hq = None
        # fp8_max / bound; where every token is ignored (bound 1 / 0) the gradient is all zeros: scale 1
        bound = grad_bound.float()
        self.g_scale = torch.where(torch.isfinite(bound) & (bound > 0), torch.finfo(self.backward_dtype).max / bound,
                                   torch.ones_like(bound))

    def logits(self, h, last=False):
        """The chunk's logits; ``last``: the last chunk's, after which the
        weight's row-wise FP8 copy is let go (the gradients read W^T): a
        [V, H] byte buffer less while the chunk's gradient is cast."""
        rows = h.shape[0]
        mp = _padded_rows(rows)
        # the chunk's cast is kept for its weight gradient (its transposed copy)
        self.hq = _quantize_current(h, self.forward_dtype, transpose=self.need_w, rows=None if mp == rows else mp)
        out = F8.gemm(F8.rowwise(self.hq, None), (self.wq.data, self.wq.scale_inv, None), h.dtype,
                      bias=self.bias, fast_accum=True)
        if last:
            self.wq.data = None  # (its GEMM is enqueued: the caching allocator reuses it in stream order)
        return _row_prefix(out, rows)

    def grads(self, dlogits, h, grad_h, grad_w, accumulate):
        rows = dlogits.shape[0]
        mp = _padded_rows(rows)
        gq = _quantize(dlogits, self.g_scale, None, self.backward_dtype, transpose=grad_w is not None,
                       rows=None if mp == rows else mp)
        if grad_h is not None:
            w_t = (self.wq.data_t, self.wq.scale_inv, None)
            if mp == rows:
                F8.gemm(F8.rowwise(gq, None), w_t, None, out=grad_h)
            else:
                grad_h.copy_(_row_prefix(F8.gemm(F8.rowwise(gq, None), w_t, grad_h.dtype), rows))
        if grad_w is not None:
            F8.gemm(F8.columnwise(gq, None), F8.columnwise(self.hq, None), None, out=grad_w, accumulate=accumulate)
        self.hq = None


def _fp8_dtypes(recipe, hidden, weight):
    """(forward, backward) FP8 dtypes of the chunk GEMMs under ``recipe``
    (None: no FP8), after the recipe and shape rules."""
    if recipe is None:
        return None
    from ..common.recipe import Recipe

    if not isinstance(recipe, Recipe):
        raise TypeError(f"linear_cross_entropy: argument 'fp8_recipe' must be a seqfuse.common.recipe recipe or "
                        f"None, got {type(recipe).__name__}")
    if not recipe.float8_per_tensor_scaling():
        raise NotImplementedError(f"linear_cross_entropy: argument 'fp8_recipe' must be a per-tensor recipe "
                                  f"(DelayedScaling or Float8CurrentScaling), got {type(recipe).__name__}: the "
                                  "loss's FP8 GEMMs scale each operand per tensor")
    for name, size in (("V (weight rows)", weight.shape[0]), ("H", weight.shape[1])):
        if size % 16:
            raise ValueError(f"linear_cross_entropy: FP8 GEMMs (fp8_recipe) need {name} to be a multiple of 16, "
                             f"got {size}")
    return recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype


def linear_cross_entropy(hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0,
                         reduction="mean", chunk_size=None, fp8_recipe=None, weight_grad_dtype=None,
                         tied_embedding=None):
    """Cross-entropy of ``hidden`` [N, H] @ ``weight`` [V, H].T (+ ``bias`` [V])
    against int64 ``labels`` [N], processed ``chunk_size`` tokens at a time
    (default: a quarter of the logits within 256-512 MiB, default_chunk_size) so the full
    [N, V] logits are never held.  ``reduction`` is 'mean' (over non-ignored
    tokens) or 'sum'.  The GEMMs run in ``hidden``'s dtype: a weight of
    another dtype (an fp32 weight under bf16 autocast) is cast for them, and
    its gradient is returned in its own dtype (summed in float32, converted
    once).  ``weight_grad_dtype``: None (the default) or the weight's dtype
    sums the weight gradient over the chunks in the weight's dtype, each
    chunk's GEMM adding its float32 sum into it (one rounding per chunk,
    Liger-Kernel's default; no memory beyond the gradient); torch.float32
    sums it in a float32 [V, H] buffer (4 V H bytes while the forward runs)
    rounded once.  One chunk writes it in the weight's dtype either way (one
    rounding); a weight of another dtype than hidden's sums in float32.
    ``fp8_recipe`` (DelayedScaling or Float8CurrentScaling; None: no FP8):
    the chunk GEMMs in FP8 (module note).  ``tied_embedding``: a
    seqfuse.modules.embedding.TiedGradient over ``weight`` (a contiguous
    leaf shared with the input embedding that ``tied_embedding(ids, weight,
    link)`` looked up in the same forward): the backward hands it the
    weight's gradient, into which the embedding's backward adds its rows
    and which that backward returns (this one returns none for the weight).
    The gradients are handed out by the first backward: a second backward
    through the same loss (retain_graph=True) is a RuntimeError."""
    _check_reduction(reduction, ("mean", "sum"))
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"linear_cross_entropy: argument '{name}' must be a 2-D torch.Tensor")
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if hidden.dtype not in floats or weight.dtype not in floats:
        raise TypeError(f"linear_cross_entropy: arguments 'hidden' ({hidden.dtype}) and 'weight' "
                        f"({weight.dtype}) must be float32, float16 or bfloat16")
    if bias is not None and (bias.dtype != weight.dtype or bias.shape != weight.shape[:1]):
        raise TypeError(f"linear_cross_entropy: argument 'bias' must be [V] = [{weight.shape[0]}] of the "
                        f"weight's dtype {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: 'hidden' [N, {hidden.shape[1]}] and 'weight' "
                         f"[V, {weight.shape[1]}] must share H")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != hidden.shape[:1]:
        raise TypeError(f"linear_cross_entropy: argument 'labels' must be an int64 tensor of shape "
                        f"[{hidden.shape[0]}]")
    op = "linear_cross_entropy"
    if chunk_size is not None:
        chunk_size = _as_int(op, "chunk_size", chunk_size)
        if chunk_size < 1:
            raise ValueError(f"{op}: argument 'chunk_size' must be positive, got {chunk_size}")
    ignore_index = _as_int(op, "ignore_index", ignore_index)
    label_smoothing = _as_float(op, "label_smoothing", label_smoothing)
    fp8 = _fp8_dtypes(fp8_recipe, hidden, weight)
    if weight_grad_dtype == weight.dtype and weight.dtype != torch.float32:
        weight_grad_dtype = None  # (the default's sum, named)
    if weight_grad_dtype not in (None, torch.float32):
        raise ValueError(f"{op}: argument 'weight_grad_dtype' must be None or the weight's dtype ({weight.dtype}), "
                         f"or torch.float32, got {weight_grad_dtype!r}")
    if tied_embedding is not None:
        if getattr(tied_embedding, "weight", None) is not weight or not weight.is_contiguous():
            raise ValueError(f"{op}: argument 'tied_embedding' must link this 'weight' (a contiguous leaf Parameter "
                             "the input embedding shares), as seqfuse.modules.embedding.TiedGradient(weight)")
        if tied_embedding.bound:
            raise ValueError(f"{op}: argument 'tied_embedding' already serves another loss (one link per forward "
                             "pass and loss)")
        tied_embedding.bound = True
    # the chunked GEMMs read hidden and write its gradient row-major: another layout (a transposed,
    # strided or expanded view) is copied here, in autograd, so the gradient still reaches the caller's tensor
    hidden, weight = (t if t.is_contiguous() else t.contiguous() for t in (hidden, weight))
    return LinearCrossEntropyFunction.apply(hidden, weight, bias, labels, ignore_index,
                                            label_smoothing, reduction, chunk_size, fp8, weight_grad_dtype,
                                            tied_embedding)
