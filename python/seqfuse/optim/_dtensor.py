"""DTensor helpers for FusedAdamW and clip_grad_norm_ under FSDP2.

FSDP2 (torch.distributed.fsdp.fully_shard) turns every parameter into a
DTensor sharded on dim 0 over a device mesh, and the reduced gradient into a
DTensor with the same placements.  AdamW is elementwise, so the update of the
local shard from the local gradient shard is the update of the whole tensor:
the optimizer runs its multi-tensor kernels on ``to_local()`` views (which
share storage with the parameter) and keeps its state as DTensors of the same
mesh and placements, so state_dict() / torch.distributed.checkpoint see
sharded tensors that every rank saves its part of and reload resharded.

The gradient norm is not elementwise: each rank sums the squares of its local
shards, and those sums are added over the mesh dimensions the tensors are
sharded on (not the replicated ones, whose ranks hold the same values).
"""

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local tensor of a DTensor (a view of the same storage), else t."""
    return t.to_local() if is_dtensor(t) else t


def check_layout(op, name, p, g):
    """A parameter's gradient must be laid out like it (same mesh and
    placements, no pending reduction) for a local update to be correct."""
    if is_dtensor(p) != is_dtensor(g):
        raise TypeError(f"{op}: {name} is {'a DTensor' if is_dtensor(p) else 'a plain tensor'} but its gradient "
                        f"is {'a DTensor' if is_dtensor(g) else 'a plain tensor'}; both must be the same kind")
    if not is_dtensor(p):
        return
    if g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(f"{op}: the gradient of {name} has placements {tuple(g.placements)} on "
                         f"{g.device_mesh}, the parameter {tuple(p.placements)} on {p.device_mesh}; they must match")
    check_placements(op, name, p)


def check_placements(op, name, t):
    for pl in t.placements:
        if not isinstance(pl, (Shard, Replicate)):
            raise NotImplementedError(f"{op}: {name} has placement {pl}; only Shard and Replicate DTensors are "
                                      "supported (reduce Partial gradients first)")


def like(p, local_tensor):
    """``local_tensor`` (the local part of a tensor shaped like ``p``) as a
    DTensor with ``p``'s mesh, placements and global shape; plain if p is."""
    if not is_dtensor(p):
        return local_tensor
    return DTensor.from_local(local_tensor, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def check_state_shape(op, p, t, name):
    """Refuse loaded state ``t`` (named ``name``) whose shape is not the
    parameter's: a plain tensor must have p's shape (or, for a DTensor p,
    its local shard's), a DTensor p's global shape.  A state of another shape
    but as many elements would otherwise be stepped on reinterpreted (torch
    raises a size mismatch at its step)."""
    if is_dtensor(t) or not is_dtensor(p):
        if t.shape != p.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, but its parameter has shape "
                             f"{tuple(p.shape)}; the state must have the parameter's shape")
        return
    if t.shape != p.shape and t.shape != local(p).shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, but its parameter has shape {tuple(p.shape)} "
                         f"(local shard {tuple(local(p).shape)}); the state must have either")


def as_state_of(p, t, name="state"):
    """Loaded state ``t`` laid out like parameter ``p``: a DTensor is kept (DCP
    has already placed it); a plain tensor for a DTensor p is either p's
    local shard (taken as is) or the full tensor (every rank keeps its part,
    without communication).  A shape that is neither is refused (ValueError
    naming ``name``)."""
    check_state_shape("FusedAdamW.load_state_dict", p, t, name)
    if not is_dtensor(p) or is_dtensor(t):
        return t
    if t.shape == local(p).shape and t.shape != p.shape:
        return like(p, t)
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)


def shard_key(t):
    """(mesh, the mesh dims t is sharded on) for a DTensor: the sums of
    squares of tensors with the same key are added by the same all-reduces."""
    return t.device_mesh, tuple(i for i, pl in enumerate(t.placements) if isinstance(pl, Shard))
