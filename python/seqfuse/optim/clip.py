"""clip_grad_norm_ as torch.nn.utils.clip_grad_norm_ defines it for the 2-norm:
the total norm of every gradient (one multi-tensor kernel per device, the
additions in a fixed order), then every gradient multiplied by
min(1, max_norm / (norm + 1e-6)) by a multi-tensor kernel reading that
coefficient from device memory.  No host synchronization unless
``error_if_nonfinite=True`` (which must look at the norm).

DTensor gradients (FSDP2): the kernels run on the local shards; the sum of
squares of the local shards is all-reduced over the mesh dimensions the
gradients are sharded on, once for all the gradients that share a mesh and
sharding (FSDP2: one all-reduce per call), so every rank gets the norm of the
whole unsharded gradient and scales its shards by the same coefficient."""

import torch

from ..ops import optim as _ops
from ..ops.args import as_max_norm
from ._dtensor import check_placements, is_dtensor, local, shard_key


def _sum_of_squares(tensors):
    """sum x^2 over the tensors (0-d float32 on their device); None if empty."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return None
    return _ops.multi_tensor_l2norm(tensors).square()


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                    use_main_grad=False):
    """Clip the gradients of ``parameters`` in place to a total 2-norm of at
    most ``max_norm``; returns the total norm before clipping (a plain 0-d
    float32 tensor on the gradients' device, the same on every rank for
    DTensor gradients).  ``use_main_grad``: take a parameter's float32
    ``main_grad`` where it has one (as FusedAdamW(use_main_grad=True)).

    Stricter than torch where torch gives a silently wrong answer:
    ``max_norm`` must be >= 0 and not NaN (torch flips every gradient's sign
    for a negative one and makes them NaN for NaN; inf means no clipping),
    and the gradients must be float32, bfloat16 or float16 (the kernels'
    dtypes; torch.nn.utils.clip_grad_norm_ takes others)."""
    import torch.distributed as dist

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"clip_grad_norm_: seqfuse computes the 2-norm only, got norm_type={norm_type}; "
                                  "use torch.nn.utils.clip_grad_norm_ for other norms")
    max_norm = as_max_norm("clip_grad_norm_", max_norm)
    grads = []
    for i, p in enumerate(parameters):
        g = getattr(p, "main_grad", None) if use_main_grad else None
        name = "main_grad" if g is not None else "grad"
        g = p.grad if g is None else g
        if g is not None:
            if g.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"clip_grad_norm_: the {name} of parameter {i} (shape {tuple(p.shape)}) has dtype "
                                f"{str(g.dtype).replace('torch.', '')}; seqfuse's clip_grad_norm_ takes float32, "
                                "bfloat16 or float16 gradients (torch.nn.utils.clip_grad_norm_ takes others)")
            grads.append(g)
    if not grads:
        return torch.tensor(0.0)
    # local tensors grouped by device; DTensor ones also by (mesh, sharded mesh dims)
    plain, sharded = {}, {}
    for g in grads:
        if g.is_sparse:
            raise ValueError("clip_grad_norm_: sparse gradients are not supported")
        if is_dtensor(g):
            check_placements("clip_grad_norm_", f"a gradient of shape {tuple(g.shape)}", g)
            lg = local(g)
            sharded.setdefault((lg.device,) + shard_key(g), []).append(lg)
        else:
            plain.setdefault(g.device, []).append(g)
    first = local(grads[0]).device
    if not sharded and len(plain) == 1:  # one device, no shards: the kernel's norm as is
        total = _ops.multi_tensor_l2norm(next(iter(plain.values())))
        return _scale(grads, total, max_norm, error_if_nonfinite)
    parts = []
    for (device, mesh, dims), gs in sharded.items():
        sq = _sum_of_squares(gs)
        sq = torch.zeros((), dtype=torch.float32, device=device) if sq is None else sq
        for d in dims:  # FSDP2: one mesh dim, one all-reduce for every gradient
            group = mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group()
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        parts.append(sq)
    for gs in plain.values():
        sq = _sum_of_squares(gs)
        if sq is not None:
            parts.append(sq)
    if not parts:
        total = torch.zeros((), dtype=torch.float32, device=first)
    elif len(parts) == 1:
        total = parts[0].sqrt()
    else:
        total = torch.stack([s.to(first) for s in parts]).sum().sqrt()
    return _scale(grads, total, max_norm, error_if_nonfinite)


def _scale(grads, total, max_norm, error_if_nonfinite):
    """Every gradient (its local shard) times min(1, max_norm / (total + 1e-6))."""
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(f"clip_grad_norm_: the total norm of the gradients is {total.item()}")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_device = {}
    for g in grads:
        lg = local(g)
        if lg.numel():
            by_device.setdefault(lg.device, []).append(lg)
    for device, gs in by_device.items():
        _ops.multi_tensor_scale(gs, coef.to(device))
        torch.autograd.graph.increment_version(gs)  # written in place by the kernel
    return total
