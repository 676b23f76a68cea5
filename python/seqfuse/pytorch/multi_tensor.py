"""Transformer Engine's multi-tensor entry points of te.optimizers that
training code calls directly (Megatron-LM's gradient clipping imports
multi_tensor_applier, multi_tensor_l2norm and multi_tensor_scale from
transformer_engine.pytorch.optimizers at import time):

    multi_tensor_applier(op, noop_flag, tensor_lists, *args)
        = MultiTensorApply(2048 * 32): unwraps DTensors to their local
          shards, drops empty tensors, calls op(chunk_size, noop_flag,
          tensor_lists, *args)
    multi_tensor_scale(chunk_size, noop_flag, [src, dst], scale)
        dst = src * scale (in fp32, stored in dst's dtype); noop_flag set
        to 1 when a value of src is not finite
    multi_tensor_scale_tensor(...)  the same with scale a one-element tensor
    multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor=False)
        -> (total norm [1] fp32, per-tensor norms [n] fp32, or [0] when
            per_tensor is False); noop_flag set to 1 when the total is not
            finite
    multi_tensor_unscale_l2norm(chunk_size, noop_flag, [tensors], inv_scale,
                                per_tensor=False)
        -> the same for tensors * inv_scale (inv_scale: one-element tensor)
    multi_tensor_adam(chunk_size, noop_flag, [g, p, m, v] or [g, p, m, v,
                      p_master], lr, beta1, beta2, epsilon, step, mode,
                      bias_correction, weight_decay)
        one Adam step in place, TE's kernel's arithmetic in fp32: mode 0
        L2 (g + wd p), mode 1 decoupled (AdamW); bias_correction 1 divides
        the moments by 1 - beta^step; with p_master the step runs on the
        fp32 masters and p receives them in its dtype
    multi_tensor_adam_capturable(chunk_size, noop_flag, [g, p, m, v], lr,
                                 beta1, beta2, epsilon, step, mode,
                                 bias_correction, weight_decay, inv_scale)
    multi_tensor_adam_capturable_master(..., [g, p, m, v, p_master], ...)
        the same step for CUDA graphs: lr, step and inv_scale one-element
        tensors read on the device, g multiplied by inv_scale first (and
        left so), nothing changed when noop_flag is set
    multi_tensor_sgd(chunk_size, noop_flag, [g, w, mom] or [g, w, mom,
                     w_copy], wd, momentum, dampening, lr, nesterov,
                     first_run, wd_after_momentum, scale)
        one SGD step in place, TE's kernel's arithmetic in fp32 (g * scale;
        weight decay before or after momentum; first_run sets mom = g;
        w_copy receives w in its dtype); nothing changes when noop_flag
        is set (decided on the device: no host synchronisation)

Same arguments and results as TE's kernels; computed with torch's
multi-tensor (foreach) operations in fp32, so they run on the CPU too and
take no host synchronisation (the flag is written on the device).
chunk_size only sizes TE's kernel launches and changes no result here.
"""
from typing import List, Optional, Tuple

import torch

from ..ops.args import as_float

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_scale", "multi_tensor_scale_tensor",
           "multi_tensor_l2norm", "multi_tensor_unscale_l2norm", "multi_tensor_adam",
           "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_sgd"]


def _local(t):
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


class MultiTensorApply:
    """TE's multi-tensor apply entry: op(chunk_size, noop_flag, lists, *args)
    over the non-empty slots of aligned tensor lists (None when none is
    left)."""

    def __init__(self, chunk_size: int):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"MultiTensorApply: argument 'chunk_size' must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        if not isinstance(tensor_lists, (list, tuple)) or not tensor_lists:
            raise ValueError("multi_tensor_applier: argument 'tensor_lists' must be a non-empty list of tensor "
                             f"lists (as many as {getattr(op, '__name__', 'the op')} takes), got {tensor_lists!r}")
        for i, ts in enumerate(tensor_lists):
            if not isinstance(ts, (list, tuple)):
                raise TypeError(f"multi_tensor_applier: argument 'tensor_lists' must hold lists of tensors, got "
                                f"{type(ts).__name__} at index {i}")
        lists = [[_local(t) for t in ts] for ts in tensor_lists]
        if any(len(ts) != len(lists[0]) for ts in lists):
            raise RuntimeError("multi_tensor_applier: argument 'tensor_lists' must hold lists of one length "
                               f"(got lengths {[len(ts) for ts in lists]})")
        keep = [t.numel() > 0 for t in lists[0]]
        lists = [[t for t, k in zip(ts, keep) if k] for ts in lists]
        if not lists[0]:
            return None
        return op(self.chunk_size, noop_flag_buffer, lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)


def _check(op, noop_flag, tensor_lists, n_lists):
    if not torch.is_tensor(noop_flag) or noop_flag.numel() != 1:
        raise TypeError(f"{op}: argument 'noop_flag' must be a one-element tensor")
    allowed = n_lists if isinstance(n_lists, tuple) else (n_lists,)
    if len(tensor_lists) not in allowed:
        raise ValueError(f"{op}: argument 'tensor_lists' must hold {' or '.join(map(str, allowed))} list(s), "
                         f"got {len(tensor_lists)}")
    lists = [[_local(t) for t in ts] for ts in tensor_lists]
    if any(len(ts) != len(lists[0]) for ts in lists):
        raise ValueError(f"{op}: the lists of 'tensor_lists' must have one length")
    for ts in lists[1:]:
        for a, b in zip(lists[0], ts):
            if a.numel() != b.numel():
                raise ValueError(f"{op}: tensors paired across 'tensor_lists' must have one size, "
                                 f"got {tuple(a.shape)} and {tuple(b.shape)}")
    return lists


def _flag_if(noop_flag, bad):
    """noop_flag = 1 where bad (a one-element bool tensor), on the device."""
    noop_flag.masked_fill_(bad.to(noop_flag.device).view(noop_flag.shape), 1)


def _scale(op, noop_flag, tensor_lists, scale):
    src, dst = _check(op, noop_flag, tensor_lists, 2)
    if not src:
        return
    f32 = [s.float() for s in src]
    finite = torch.stack([torch.isfinite(s).all() for s in f32]).all()
    _flag_if(noop_flag, ~finite)
    out = torch._foreach_mul(f32, scale)
    for d, o in zip(dst, out):
        d.copy_(o.view_as(d))


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                       scale: float) -> None:
    """tensor_lists = [src, dst]: dst = src * scale; noop_flag = 1 when src
    holds a value that is not finite."""
    _scale("multi_tensor_scale", noop_flag, tensor_lists, float(scale))


def multi_tensor_scale_tensor(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                              scale: torch.Tensor) -> None:
    """multi_tensor_scale with scale a one-element tensor (read on the device)."""
    op = "multi_tensor_scale_tensor"
    if not torch.is_tensor(scale) or scale.numel() != 1:
        raise TypeError(f"{op}: argument 'scale' must be a one-element tensor")
    _scale(op, noop_flag, tensor_lists, scale.float().reshape(()))


def _l2norm(op, noop_flag, tensor_lists, inv_scale, per_tensor):
    (ts,) = _check(op, noop_flag, tensor_lists, 1)
    if not ts:
        raise ValueError(f"{op}: argument 'tensor_lists' holds no tensor")
    f32 = [t.float() for t in ts]
    if inv_scale is not None:
        f32 = torch._foreach_mul(f32, inv_scale)
    norms = torch.stack(list(torch._foreach_norm(f32))).float()
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_if(noop_flag, ~torch.isfinite(total))
    return total, (norms if per_tensor else torch.empty(0, dtype=torch.float32, device=total.device))


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                        per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm of all tensors together [1], per-tensor norms [n] or [0])."""
    return _l2norm("multi_tensor_l2norm", noop_flag, tensor_lists, None, bool(per_tensor))


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                                inv_scale: torch.Tensor, per_tensor: Optional[bool] = False
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """multi_tensor_l2norm of the tensors multiplied by inv_scale (a
    one-element tensor)."""
    op = "multi_tensor_unscale_l2norm"
    if not torch.is_tensor(inv_scale) or inv_scale.numel() != 1:
        raise TypeError(f"{op}: argument 'inv_scale' must be a one-element tensor")
    return _l2norm(op, noop_flag, tensor_lists, inv_scale.float().reshape(()), bool(per_tensor))


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], lr: float,
                      beta1: float, beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """One Adam step in place over tensor_lists = [grads, params, exp_avgs,
    exp_avg_sqs] (+ [fp32 master params]); see the module note."""
    op = "multi_tensor_adam"
    lists = _check(op, noop_flag, tensor_lists, (4, 5))
    if mode not in (0, 1):
        raise ValueError(f"{op}: argument 'mode' must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
    if bias_correction not in (0, 1, True, False):
        raise ValueError(f"{op}: argument 'bias_correction' must be 0 or 1, got {bias_correction!r}")
    # (with bias correction a step below 1 divides by 1 - beta ** 0 = 0: every parameter NaN)
    step = as_float(op, "step", step, minimum=1 if bias_correction else None,
                    why="(the 1-based count of this update) with bias_correction")
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    masters = lists[4] if len(lists) == 5 else [None] * len(lists[0])
    for g, p, m, v, pm in zip(lists[0], lists[1], lists[2], lists[3], masters):
        p32, m32, v32 = _adam_math(g.float(), (pm if pm is not None else p).float(), m, v, lr, beta1, beta2,
                                   epsilon, bc1, bc2, mode, weight_decay)
        m.copy_(m32)
        v.copy_(v32)
        if pm is not None:
            pm.copy_(p32)
        p.copy_(p32)


def _adam_math(g32, p32, m, v, lr, beta1, beta2, epsilon, bc1, bc2, mode, weight_decay):
    """TE's Adam kernel arithmetic in fp32: (new p, new m, new v); lr, bc1,
    bc2 numbers or one-element tensors."""
    if mode == 0:
        g32 = g32 + weight_decay * p32
    m32 = beta1 * m.float() + (1 - beta1) * g32
    v32 = beta2 * v.float() + (1 - beta2) * g32 * g32
    update = (m32 / bc1) / (torch.sqrt(v32 / bc2) + epsilon)
    if mode == 1:
        update = update + weight_decay * p32
    return p32 - lr * update, m32, v32


def _one_element(op, name, t):
    if not torch.is_tensor(t) or t.numel() != 1:
        raise TypeError(f"{op}: argument '{name}' must be a one-element tensor (capturable: read on the device)")
    return t.reshape(())


def _adam_capturable(op, noop_flag, tensor_lists, n_lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale):
    lists = _check(op, noop_flag, tensor_lists, n_lists)
    if mode not in (0, 1):
        raise ValueError(f"{op}: argument 'mode' must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
    if bias_correction not in (0, 1, True, False):
        raise ValueError(f"{op}: argument 'bias_correction' must be 0 or 1, got {bias_correction!r}")
    lr, step, inv_scale = (_one_element(op, n, t).float() for n, t in (("lr", lr), ("step", step),
                                                                        ("inv_scale", inv_scale)))
    if bias_correction:
        bc1, bc2 = 1 - torch.pow(beta1, step), 1 - torch.pow(beta2, step)
    else:
        bc1 = bc2 = 1.0
    skip = noop_flag.reshape(()) != 0  # TE's capturable kernels return at once when the flag is set
    masters = lists[4] if len(lists) == 5 else [None] * len(lists[0])
    for g, p, m, v, pm in zip(lists[0], lists[1], lists[2], lists[3], masters):
        g32 = g.float() * inv_scale
        p32, m32, v32 = _adam_math(g32, (pm if pm is not None else p).float(), m, v, lr, beta1, beta2, epsilon,
                                   bc1, bc2, mode, weight_decay)
        for dst, new in ((g, g32), (m, m32), (v, v32), (pm, p32), (p, p32)):  # g receives g * inv_scale, as in TE
            if dst is not None:
                dst.copy_(torch.where(skip, dst, new.to(dst.dtype)))


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]],
                                 lr: torch.Tensor, beta1: float, beta2: float, epsilon: float, step: torch.Tensor,
                                 mode: int, bias_correction: int, weight_decay: float,
                                 inv_scale: torch.Tensor) -> None:
    """multi_tensor_adam for CUDA graphs (TE's capturable kernel): lr, step
    and inv_scale are one-element tensors read on the device; the gradients
    are multiplied by inv_scale (and keep that value); nothing changes when
    noop_flag is set.  tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]."""
    _adam_capturable("multi_tensor_adam_capturable", noop_flag, tensor_lists, 4, lr, beta1, beta2, epsilon, step,
                     mode, bias_correction, weight_decay, inv_scale)


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: torch.Tensor,
                                        tensor_lists: List[List[torch.Tensor]], lr: torch.Tensor, beta1: float,
                                        beta2: float, epsilon: float, step: torch.Tensor, mode: int,
                                        bias_correction: int, weight_decay: float,
                                        inv_scale: torch.Tensor) -> None:
    """multi_tensor_adam_capturable with fp32 master params: tensor_lists =
    [grads, params, exp_avgs, exp_avg_sqs, masters]; the step runs on the
    masters and params receive them in their dtype."""
    _adam_capturable("multi_tensor_adam_capturable_master", noop_flag, tensor_lists, 5, lr, beta1, beta2, epsilon,
                     step, mode, bias_correction, weight_decay, inv_scale)


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: List[List[torch.Tensor]], wd: float,
                     momentum: float, dampening: float, lr: float, nesterov: bool, first_run: bool,
                     wd_after_momentum: bool, scale: float) -> None:
    """One SGD step in place over tensor_lists = [grads, weights, momentums]
    (+ [weight copies]); see the module note."""
    op = "multi_tensor_sgd"
    lists = _check(op, noop_flag, tensor_lists, (3, 4))
    skip = noop_flag.reshape(()) != 0
    copies = lists[3] if len(lists) == 4 else [None] * len(lists[0])
    for g, w, mom, out in zip(lists[0], lists[1], lists[2], copies):
        g32, w32, m32 = g.float() * scale, w.float(), mom.float()
        if wd != 0 and not wd_after_momentum:
            g32 = g32 + wd * w32
        if momentum != 0:
            m32 = g32 if first_run else m32 * momentum + (1 - dampening) * g32
            g32 = g32 + momentum * m32 if nesterov else m32
        if wd != 0 and wd_after_momentum:
            g32 = g32 + wd * w32
        new_w = torch.where(skip, w32, w32 + (-lr * g32))
        w.copy_(new_w)
        if out is not None:
            out.copy_(torch.where(skip, out.float(), new_w))
        if momentum != 0:
            mom.copy_(torch.where(skip, mom.float(), m32))
