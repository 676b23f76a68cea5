"""clip_grad_norm_ as torch.nn.utils.clip_grad_norm_ defines it for the 2-norm:
the total norm of every gradient (one multi-tensor kernel per device, the
additions in a fixed order), then every gradient multiplied by
min(1, max_norm / (norm + 1e-6)) by a multi-tensor kernel reading that
coefficient from device memory.  No host synchronization unless
``error_if_nonfinite=True`` (which must look at the norm)."""
import torch

from ..ops import optim as _ops


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                    use_main_grad=False):
    """Clip the gradients of ``parameters`` in place to a total 2-norm of at
    most ``max_norm``; returns the total norm before clipping (a 0-d float32
    tensor on the gradients' device).  ``use_main_grad``: take a parameter's
    float32 ``main_grad`` where it has one (as FusedAdamW(use_main_grad=True))."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"clip_grad_norm_: seqfuse computes the 2-norm only, got norm_type={norm_type}; "
                                  "use torch.nn.utils.clip_grad_norm_ for other norms")
    grads = []
    for p in parameters:
        g = getattr(p, "main_grad", None) if use_main_grad else None
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    if not grads:
        return torch.tensor(0.0)
    by_device = {}
    for g in grads:
        if g.is_sparse:
            raise ValueError("clip_grad_norm_: sparse gradients are not supported")
        by_device.setdefault(g.device, []).append(g)
    norms = [_ops.multi_tensor_l2norm(gs) for gs in by_device.values()]
    first = grads[0].device
    total = norms[0] if len(norms) == 1 else torch.stack([n.to(first) for n in norms]).square().sum().sqrt()
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"clip_grad_norm_: the total norm of the gradients is {total.item()}")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for device, gs in by_device.items():
        _ops.multi_tensor_scale(gs, coef.to(device))
    return total
