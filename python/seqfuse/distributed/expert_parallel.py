"""Expert parallelism on torch.distributed: the token exchange of a
mixture-of-experts layer whose experts are spread over the ranks of a
process group (the EP group), the dp x ep DeviceMesh, and the gradient
reduction and norm clipping such a model needs.  The layer itself is
seqfuse.modules.ExpertParallelGroupedMLP (modules sit above this package).

Why: with expert parallelism each of ep_size ranks holds L = num_experts /
ep_size of the experts (experts [ep_rank * L, (ep_rank + 1) * L)), and the
tokens travel to the rank that holds their expert and back.  Every rank
keeps its own tokens (the EP ranks are data parallel for all but the
experts) and the full router.

dispatch_tokens(x [T, H], probs [T, E], routing_map [T, E], ep_group, L):

    xp, pp          = permute x (and each pair's probability) by global expert
    send[r][l]      = this rank's rows for rank r's local expert l
    recv            = all_to_all(send)           the counts go first
    xr, pr          = all_to_all_single(xp), (pp) with variable split sizes
    xr, pr          = rows regrouped [source][expert] -> [expert][source]

returns xr, pr, m_splits (rows per local expert, host ints, for the grouped
GEMMs) and the handle that combine_tokens(y, handle) uses to regroup the
experts' outputs back, send them home with the reverse exchange and sum
each token's experts (un-permute).  The exchanges are autograd Functions
(all_to_all_single_autograd): the backward of an exchange is the exchange
with the split sizes swapped, so every gradient flows back to the rank its
row came from, and an expert's weight gradient sums every token of the EP
group that chose it.  One host synchronization per dispatch (the counts,
which size the buffers and the grouped GEMMs), as in GroupedMLP.

Gradients with a dp x ep mesh (init_expert_parallel_mesh): each rank's loss
covers its own tokens.  Non-expert gradients are reduced over all dp * ep
ranks, expert gradients over the dp ranks only (the exchange has summed
them over the EP group already); with mean losses both are then divided by
dp * ep, not dp for the experts (Megatron's rule):
reduce_expert_parallel_grads.  clip_grad_norm_ computes the exact global
norm: expert gradients' |g|^p summed over the EP group once, non-expert
ones (the same on every rank) counted once, FSDP2 shards (DTensor
gradients) summed over the mesh dimensions they are sharded on.

FSDP2 (fully_shard_expert_parallel): the experts of each EP layer are
sharded over the mesh's dp dimension (their gradients reduce-scattered over
dp and divided by dp * ep; with dp = 1 left unsharded, scaled by 1 / ep),
everything else over all dp * ep ranks.

A module is an EP layer for these functions when it has an ``ep_group``
attribute and ``expert_parameters()`` / ``expert_modules()`` methods (the
local experts' parameters, and the submodules that hold only them):
ExpertParallelGroupedMLP does.
"""
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..ops import moe as moe_ops
from ..ops.args import as_max_norm, exact_int

__all__ = ["all_to_all_single_autograd", "EPDispatch", "dispatch_tokens", "combine_tokens",
           "init_expert_parallel_mesh", "expert_parameters", "reduce_expert_parallel_grads",
           "fully_shard_expert_parallel", "clip_grad_norm_"]


# ---- the exchange --------------------------------------------------------------

def _exchange(x, output_splits, input_splits, group):
    x = moe_ops.dense(x)
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with host split sizes; its backward is
    the exchange with the split sizes swapped (each row goes home)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (tuple(output_splits), tuple(input_splits)), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def _index(v):
    """``v`` as an int (ops.args.exact_int); TypeError for bool, floats and the rest
    (int() would truncate 6.7 to 6)."""
    n = exact_int(v)
    if n is None:
        raise TypeError(type(v).__name__)
    return n


def _splits(name, splits, size):
    try:
        splits = [_index(v) for v in splits]
    except TypeError:
        got = repr(splits) if isinstance(splits, (list, tuple)) else type(splits).__name__
        raise TypeError(f"all_to_all_single_autograd: argument '{name}' must be a sequence of ints, got "
                        f"{got}") from None
    if len(splits) != size or any(v < 0 for v in splits):
        raise ValueError(f"all_to_all_single_autograd: argument '{name}' must hold {size} counts >= 0 "
                         f"(one per rank of the group), got {splits}")
    return splits


def all_to_all_single_autograd(x, output_splits, input_splits, group):
    """Differentiable torch.distributed.all_to_all_single along dim 0.

    x: [sum(input_splits), ...]; rows [off_r, off_r + input_splits[r]) go to
    rank r; returns [sum(output_splits), ...] holding, in rank order, the
    output_splits[s] rows rank s sent here.  Split sizes are host ints (one
    per rank of ``group``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_to_all_single_autograd: argument 'x' must be a torch.Tensor, got "
                        f"{type(x).__name__}")
    size = dist.get_world_size(group)
    input_splits = _splits("input_splits", input_splits, size)
    output_splits = _splits("output_splits", output_splits, size)
    if x.dim() < 1 or sum(input_splits) != x.shape[0]:
        raise ValueError(f"all_to_all_single_autograd: argument 'input_splits' adds up to "
                         f"{sum(input_splits)} rows but 'x' has shape {tuple(x.shape)}")
    return _AllToAll.apply(x, output_splits, input_splits, group)


class _RowPermute(torch.autograd.Function):
    """out = x[index] for a permutation ``index`` of x's rows; the backward
    gathers with the inverse permutation (index_select's own backward is a
    scatter-add, atomics on a GPU, where a gather suffices)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return moe_ops.dense(grad).index_select(0, inverse), None, None


def _regroup_index(recv_counts, total):
    """Rows of the received buffer, ordered [source rank][local expert], taken
    in the order [local expert][source rank] (what the grouped GEMM needs):
    an index of ``total`` rows, computed on the counts' device (no host
    work beyond ``total``, already known)."""
    ep, L = recv_counts.shape
    starts = (torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)).view(ep, L)
    counts_t, starts_t = recv_counts.t().reshape(-1), starts.t().reshape(-1)
    out_starts = torch.cumsum(counts_t, 0) - counts_t
    shift = torch.repeat_interleave(starts_t - out_starts, counts_t, output_size=total)
    return torch.arange(total, device=recv_counts.device) + shift


# ---- dispatch and combine ---------------------------------------------------------

class EPDispatch(NamedTuple):
    """What combine_tokens needs to undo a dispatch_tokens."""
    row_id_map: torch.Tensor            # [T, E] int32: each (token, expert) pair's row in the sorted buffer
    input_splits: list                  # rows sent to each EP rank
    output_splits: list                 # rows received from each EP rank
    back: Optional[tuple]               # (received order from regrouped, its inverse); None with one local expert
    group: object                       # the EP process group (None: no exchange)


def group_size_rank(ep_group, what="ep_group"):
    """(process group or None, size, rank) of a group given as a
    ProcessGroup, a 1-D DeviceMesh, or None (a group of one: no exchange)."""
    if ep_group is None:
        return None, 1, 0
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(f"argument '{what}' as a DeviceMesh must be 1-D, got "
                             f"{ep_group.ndim}-D")
        ep_group = ep_group.get_group()
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"argument '{what}' must be a ProcessGroup, a 1-D DeviceMesh or None, got "
                        f"{type(ep_group).__name__}")
    return ep_group, dist.get_world_size(ep_group), dist.get_rank(ep_group)


def dispatch_tokens(x, probs, routing_map, ep_group, num_local_experts):
    """Send each routed (token, expert) pair's row of x to the EP rank that
    holds the expert.  x [T, H]; probs [T, E] float (each pair's routing
    weight, carried along); routing_map [T, E] bool; experts are numbered
    globally, rank r holding [r * L, (r + 1) * L), L = num_local_experts,
    E = ep_size * L.  Returns (xr [n, H], pr [n], m_splits: L host ints,
    handle): the rows this rank's experts must compute, grouped by local
    expert, and their probabilities.  Differentiable in x and probs."""
    op = "dispatch_tokens"
    group, ep, _ = group_size_rank(ep_group)
    try:
        L = _index(num_local_experts)
    except TypeError:
        raise TypeError(f"{op}: argument 'num_local_experts' must be an int, got "
                        f"{type(num_local_experts).__name__} {num_local_experts!r}") from None
    if x.dim() != 2 or routing_map.dim() != 2 or routing_map.shape != probs.shape \
            or routing_map.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: need x [T, H], probs and routing_map [T, E], got {tuple(x.shape)}, "
                         f"{tuple(probs.shape)}, {tuple(routing_map.shape)}")
    if L < 1 or routing_map.shape[1] != ep * L:
        raise ValueError(f"{op}: argument 'routing_map' has {routing_map.shape[1]} experts, but the EP group "
                         f"of {ep} ranks with num_local_experts={num_local_experts} holds {ep * L}")
    row_ids, tokens_per_expert = moe_ops.moe_row_id_map(routing_map)
    if ep == 1:
        m_splits = tokens_per_expert.tolist()  # the one host synchronization
        xp, pp = moe_ops.moe_permute_by_row_id_map(x, row_ids, sum(m_splits), probs)
        n = sum(m_splits)
        return xp, pp, m_splits, EPDispatch(row_ids, [n], [n], None, None)
    # the counts first: send[r, l] = this rank's rows for rank r's local expert l
    send = tokens_per_expert.view(ep, L)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    counts = torch.cat([send, recv]).tolist()  # the one host synchronization
    send_h, recv_h = counts[:ep], counts[ep:]
    input_splits = [sum(r) for r in send_h]
    output_splits = [sum(r) for r in recv_h]
    m_splits = [sum(recv_h[s][l] for s in range(ep)) for l in range(L)]
    xp, pp = moe_ops.moe_permute_by_row_id_map(x, row_ids, sum(input_splits), probs)
    xr = _AllToAll.apply(xp, output_splits, input_splits, group)
    pr = _AllToAll.apply(pp, output_splits, input_splits, group)
    back = None
    if L > 1:  # rows arrive [source][expert]; the grouped GEMM takes [expert][source]
        n = sum(output_splits)
        index = _regroup_index(recv, n)
        back = torch.empty_like(index).scatter_(0, index, torch.arange(n, device=index.device))
        xr, pr = _RowPermute.apply(xr, index, back), _RowPermute.apply(pr, index, back)
        back = (back, index)
    return xr, pr, m_splits, EPDispatch(row_ids, input_splits, output_splits, back, group)


def combine_tokens(y, handle):
    """The experts' outputs y [n, H] (rows as dispatch_tokens returned them)
    back to their tokens: regrouped, sent home, and summed over each
    token's experts.  Returns [T, H].  Differentiable in y."""
    if not isinstance(handle, EPDispatch):
        raise TypeError(f"combine_tokens: argument 'handle' must be dispatch_tokens' EPDispatch, got "
                        f"{type(handle).__name__}")
    if y.dim() != 2 or y.shape[0] != sum(handle.output_splits):
        raise ValueError(f"combine_tokens: argument 'y' must be [{sum(handle.output_splits)}, H] (the rows "
                         f"dispatch_tokens returned), got {tuple(y.shape)}")
    if handle.group is not None:
        if handle.back is not None:
            y = _RowPermute.apply(y, *handle.back)
        y = _AllToAll.apply(y, handle.input_splits, handle.output_splits, handle.group)
    return moe_ops.moe_unpermute(y, handle.row_id_map)


# ---- meshes, gradient reduction and clipping ---------------------------------------

def init_expert_parallel_mesh(ep_size, dp_size=None, device_type=None):
    """A 2-D DeviceMesh ("dp", "ep") over the default process group: EP groups
    are runs of ep_size consecutive ranks (on one node where ep_size fits in
    it, so the token exchange stays on NVLink), DP groups stride across
    them.  mesh.get_group("ep") is the group to give
    ExpertParallelGroupedMLP, mesh.get_group("dp") the one to reduce the
    experts over (reduce_expert_parallel_grads); fully_shard_expert_parallel
    takes the mesh itself.
    device_type: "cuda" under NCCL, "cpu" otherwise, by default."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("init_expert_parallel_mesh: torch.distributed is not initialized "
                           "(call init_process_group first, e.g. under torchrun)")
    world = dist.get_world_size()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"init_expert_parallel_mesh: argument 'ep_size' must be a positive int dividing "
                         f"the world size {world}, got {ep_size!r}")
    if dp_size is not None:
        try:
            dp_size = _index(dp_size)
        except TypeError:
            raise TypeError(f"init_expert_parallel_mesh: argument 'dp_size' must be an int or None, got "
                            f"{type(dp_size).__name__} {dp_size!r}") from None
    dp = world // ep_size if dp_size is None else dp_size
    if dp * ep_size != world:
        raise ValueError(f"init_expert_parallel_mesh: dp_size * ep_size must equal the world size {world}, "
                         f"got {dp} * {ep_size}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dp, ep_size), mesh_dim_names=("dp", "ep"))


def _ep_layers(model):
    return [m for m in model.modules() if hasattr(m, "ep_group") and callable(getattr(m, "expert_parameters", None))]


def expert_parameters(model):
    """The local expert parameters of every EP layer in ``model`` (found by
    module, so they stay found after FSDP2 replaces them with DTensors)."""
    return [p for m in _ep_layers(model) for p in m.expert_parameters()]


def _ep_group_of(model, ep_group):
    """The EP group: the given one, else the one every EP layer of model holds."""
    if ep_group is not None:
        return group_size_rank(ep_group)[0]
    groups = {id(m.ep_group): m.ep_group for m in _ep_layers(model)}
    if len(groups) > 1:
        raise ValueError("the model's EP layers hold different EP groups: pass 'ep_group'")
    return next(iter(groups.values())) if groups else None


def _group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _flat_all_reduce(tensors, group):
    """Sum ``tensors`` in place over ``group``: one all-reduce per dtype."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


@torch.no_grad()
def reduce_expert_parallel_grads(model, dp_group=None, ep_group=None, average=True):
    """Data-parallel gradient reduction of a model with EP layers, for runs
    without FSDP2 / DDP (plain-tensor gradients).

    Non-expert gradients are summed over dp x ep (over dp_group, then over
    ep_group), expert gradients over dp_group only (the token exchange has
    summed them over the EP group already).  average=True (each rank's loss
    a mean over its tokens): both are then divided by dp * ep, which makes
    them the gradients of the mean of the ranks' losses.  dp_group /
    ep_group: ProcessGroups, 1-D DeviceMeshes or None (a group of one; the
    EP group defaults to the one the layers hold)."""
    dp = group_size_rank(dp_group, "dp_group")[0]
    ep = _ep_group_of(model, ep_group)
    experts = {id(p) for p in expert_parameters(model)}
    exp_g, rest_g = [], []
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p.grad, torch.Tensor) and type(p.grad) is not torch.Tensor:
            raise TypeError("reduce_expert_parallel_grads: gradients are DTensors (FSDP2 reduces them "
                            "itself); this function is for plain-tensor gradients")
        (exp_g if id(p) in experts else rest_g).append(p.grad)
    if dp is not None and _group_size(dp) > 1:
        _flat_all_reduce(exp_g + rest_g, dp)
    if ep is not None and _group_size(ep) > 1 and rest_g:
        _flat_all_reduce(rest_g, ep)
    if average:
        n = _group_size(dp) * _group_size(ep)
        if n > 1:
            torch._foreach_div_(exp_g + rest_g, float(n))


def _set_divide_factor(module, factor, group):
    """FSDP2 divides the module's reduced gradients by ``factor``.  A custom
    factor makes FSDP2 reduce with PREMUL_SUM, which gloo lacks: there FSDP2
    is asked for plain sums and a separate scaling (force_sum_reduction)."""
    if hasattr(module, "set_gradient_divide_factor"):
        module.set_gradient_divide_factor(factor)
    elif hasattr(module, "set_reduce_scatter_divide_factor"):  # the name in older torch
        module.set_reduce_scatter_divide_factor(factor)
    else:
        raise NotImplementedError("fully_shard_expert_parallel: this torch's FSDP2 cannot set the gradient "
                                  "divide factor the experts need (dp * ep)")
    if dist.get_backend(group) != "nccl":
        if not hasattr(module, "set_force_sum_reduction_for_comms"):
            raise NotImplementedError(f"fully_shard_expert_parallel: the experts' divide factor needs "
                                      f"PREMUL_SUM, which the {dist.get_backend(group)} backend lacks, and this "
                                      "torch's FSDP2 has no set_force_sum_reduction_for_comms")
        module.set_force_sum_reduction_for_comms(True)


def _scale_grad_hook(factor):
    def hook(grad):
        return grad * factor
    return hook


def fully_shard_expert_parallel(model, mesh, **fsdp_kwargs):
    """FSDP2 over the data-parallel dimension of a ("dp", "ep") mesh
    (init_expert_parallel_mesh), for losses that are each rank's mean over
    its own tokens.  ``model`` itself is fully_shard-ed over all dp * ep
    ranks (the router and every non-expert parameter, averaged over every
    rank).  Each EP layer's expert modules:

    - dp > 1: fully_shard-ed over the mesh's dp groups, their gradients
      divided by dp * ep rather than dp (the exchange has already summed
      them over the EP group);
    - dp = 1: nothing to shard; they stay plain parameters, left out of the
      root's FSDP2 (ignored_params), their gradients scaled by 1 / ep by a
      gradient hook (FSDP2's divide factor on a one-rank mesh is applied
      twice or not at all, depending on the torch version and backend).

    fsdp_kwargs go to every fully_shard call (mp_policy,
    reshard_after_forward, ...).  Shard the model's blocks (fully_shard(block,
    mesh=...)) before calling this where you want per-block sharding; this
    function adds the experts and the root.  Returns model."""
    import inspect

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch before 2.6 keeps it under _composable
        from torch.distributed._composable.fsdp import fully_shard
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names != ("dp", "ep"):
        raise ValueError("fully_shard_expert_parallel: argument 'mesh' must be a 2-D DeviceMesh named "
                         "('dp', 'ep') (init_expert_parallel_mesh)")
    dp, ep = mesh.size(0), mesh.size(1)
    if dp * ep != dist.get_world_size():
        raise ValueError(f"fully_shard_expert_parallel: argument 'mesh' ({dp} x {ep}) must cover the world "
                         f"({dist.get_world_size()} ranks)")
    if "ignored_params" in fsdp_kwargs:
        raise ValueError("fully_shard_expert_parallel: argument 'ignored_params' is set by this function")
    layers = _ep_layers(model)
    for layer in layers:
        if _group_size(layer.ep_group) != ep:
            raise ValueError(f"fully_shard_expert_parallel: an EP layer's group has "
                             f"{_group_size(layer.ep_group)} ranks but the mesh's ep dimension {ep}")
    root_kwargs = dict(fsdp_kwargs)
    if dp > 1:
        # a 1-D mesh from the 2-D mesh's group (DeviceMesh slicing, mesh["dp"], is slow on some torch versions)
        dp_mesh = DeviceMesh.from_group(mesh.get_group("dp"), mesh.device_type, mesh_dim_names=("dp",))
        for layer in layers:
            for sub in layer.expert_modules():
                fully_shard(sub, mesh=dp_mesh, **fsdp_kwargs)
                _set_divide_factor(sub, float(dp * ep), mesh.get_group("dp"))
    elif layers:
        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise NotImplementedError("fully_shard_expert_parallel: with dp = 1 the experts must be left out "
                                      "of FSDP2, and this torch's fully_shard has no 'ignored_params'")
        experts = expert_parameters(model)
        for p in experts:
            if ep > 1:
                p.register_hook(_scale_grad_hook(1.0 / ep))
        root_kwargs["ignored_params"] = set(experts)
    world_mesh = init_device_mesh(mesh.device_type, (dp * ep,), mesh_dim_names=("dp_ep",))
    fully_shard(model, mesh=world_mesh, **root_kwargs)
    return model


def _local_part(g):
    """(local tensor, mesh, dims to sum over) of a gradient: a DTensor's
    shard with the mesh dimensions it is sharded on; a plain tensor as is."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.5 keeps it under _tensor
        from torch.distributed._tensor import DTensor
    if not isinstance(g, DTensor):
        return g, None, ()
    dims = []
    for d, pl in enumerate(g.placements):
        if pl.is_partial():
            raise ValueError("clip_grad_norm_: a gradient is a DTensor with a Partial placement (not yet "
                             "reduced); clip after the gradient reduction")
        if pl.is_shard():
            dims.append(d)
    return g.to_local(), g.device_mesh, tuple(dims)


@torch.no_grad()
def clip_grad_norm_(model, max_norm, norm_type=2.0, ep_group=None, error_if_nonfinite=False):
    """torch.nn.utils.clip_grad_norm_ for a model with EP layers, exact over
    EP and DP: returns the norm of the whole model's gradient (the one a
    single process holding every expert and every token would compute) and
    scales every gradient by min(1, max_norm / (norm + 1e-6)).

    Each gradient's |g|^p is summed where it lives: an FSDP2 shard (DTensor)
    over the mesh dimensions it is sharded on; then the experts' total over
    the EP group (each expert lives on one EP rank); non-expert gradients
    are the same on every EP and DP rank (after the reduction) and count
    once.  Plain-tensor gradients must already be reduced over DP
    (reduce_expert_parallel_grads).  norm_type: a float >= 1 or inf;
    max_norm: a real number >= 0 (inf: no clipping; a negative one would
    flip the gradients, so it is refused, as is NaN).  A model without
    parameters has norm 0 (torch's answer for no parameters)."""
    norm_type = float(norm_type)
    if not (norm_type >= 1.0):
        raise ValueError(f"clip_grad_norm_: argument 'norm_type' must be >= 1 or inf, got {norm_type}")
    max_norm = as_max_norm("clip_grad_norm_", max_norm)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"clip_grad_norm_: argument 'model' must be an nn.Module (its EP layers say which "
                        f"parameters are experts), got {type(model).__name__}")
    ep = _ep_group_of(model, ep_group)
    if next(model.parameters(), None) is None:
        # no parameters (the same on every rank: the model's structure is): a norm of 0, as torch's
        # clip_grad_norm_ gives for an empty iterable; no collective runs on any rank
        return torch.zeros(())
    experts = {id(p) for p in expert_parameters(model)}
    inf = norm_type == float("inf")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # every rank takes part in the collectives below, even one without gradients
    device = _local_part(grads[0])[0].device if grads else next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("clip_grad_norm_: the model's parameters are on the meta device")
    # partial sums keyed by (expert?, mesh, sharded dims), the keys taken from the parameters (a
    # parameter without a gradient adds 0): every rank then issues the same collectives in the same
    # order even where one rank's set of gradients differs from another's
    parts, meshes = {}, {}
    for p in model.parameters():
        local, mesh, dims = _local_part(p.grad if p.grad is not None else p.detach())
        if p.grad is None:
            s = torch.zeros((), device=device)
        else:
            v = local.detach().float()
            s = v.abs().max() if inf and v.numel() else (torch.zeros((), device=device) if inf else
                                                          v.abs().pow(norm_type).sum())
        key = (id(p) in experts, id(mesh), dims)
        meshes[id(mesh)] = mesh
        parts[key] = s if key not in parts else (torch.maximum(parts[key], s) if inf else parts[key] + s)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    totals = {True: torch.zeros((), device=device), False: torch.zeros((), device=device)}
    for (is_expert, mesh_id, dims), s in parts.items():
        s = s.to(device)
        for d in dims:
            dist.all_reduce(s, op=op, group=meshes[mesh_id].get_group(d))
        totals[is_expert] = torch.maximum(totals[is_expert], s) if inf else totals[is_expert] + s
    exp_total = totals[True]
    if ep is not None and _group_size(ep) > 1:
        dist.all_reduce(exp_total, op=op, group=ep)
    total = torch.maximum(exp_total, totals[False]) if inf else (exp_total + totals[False]) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"non-finite ({total.item()}), so they cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = _local_part(g)[0]
        local.mul_(coef.to(local.device, local.dtype))
    return total
