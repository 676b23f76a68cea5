"""Expert parallelism (seqfuse.distributed.expert_parallel and
seqfuse.modules.ExpertParallelGroupedMLP) on the CPU over gloo.

The claims, checked in float32 against a single-process GroupedMLP that
holds every expert and sees every rank's tokens:

- EP = 1: each rank's output rows and input-gradient rows equal the
  reference's rows for its tokens, and after reduce_expert_parallel_grads
  (non-expert gradients summed over dp x ep, expert gradients over dp)
  every parameter's gradient equals the reference's; for EP = 2 and 4, one
  to four local experts (the regrouping of received rows by expert), biases,
  sigmoid scores; EP groups taken from a dp x ep DeviceMesh.
- Uneven routing: experts that receive no token anywhere, a rank whose
  experts receive nothing, a rank with no tokens at all.
- Float8CurrentScaling: EP = 2 equals the single process under the recipe.
- clip_grad_norm_ returns the reference's norm (2 and inf) and leaves the
  reference's clipped gradients; a per-rank norm (the naive one) does not.
- FSDP2 over dp of the dp x ep mesh (fully_shard_expert_parallel) with
  mean losses: gradients equal the single process's gradient of the mean
  of the ranks' losses; clip_grad_norm_ on the DTensor shards is exact.
- Checkpoints: per-rank state dicts and torch.distributed.checkpoint saved
  at EP = 2 load at EP = 1 (a GroupedMLP) and EP = 4, and back; to_full /
  full_state_dict gather the GroupedMLP.
- Bad arguments raise naming the argument.

One start of 4 worker processes (forkserver with torch and seqfuse
preloaded) runs every case and saves its results; the tests read them.
Shapes are tiny: the file takes seconds beyond the start.  The last test
(cuda-marked) runs EP = 2 over NCCL on two GPUs.
"""
import os

import pytest
import torch
import torch.distributed as dist

from helpers import REL_TOL, check_raised, needs_cpu_fsdp2, raised, rel_error, run_ranks, run_seed
from seqfuse.modules import ExpertParallelGroupedMLP, GroupedMLP

WORLD = 4
HIDDEN, FFN = 16, 24
#: (name, num_experts, topk, ep_size, extra GroupedMLP arguments)
CONFIGS = [
    ("e4-top2-ep2", 4, 2, 2, {}),                       # 2 local experts
    ("e8-top3-ep2", 8, 3, 2, {}),                       # 4 local experts
    ("e8-top2-ep4", 8, 2, 4, {}),                       # EP over the whole world
    ("e4-top1-ep4", 4, 1, 4, {}),                       # 1 local expert: no regrouping
    ("e4-top2-ep2-bias-sigmoid", 4, 2, 2, dict(bias=True, score_function="sigmoid")),
]
TOL = REL_TOL[torch.float32]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


# ---- inside a worker ---------------------------------------------------------------

def _tokens_per_rank(world, empty_rank=None):
    return [0 if r == empty_rank else 5 + 3 * r for r in range(world)]


def _full_layer(num_experts, topk, extra, seed):
    torch.manual_seed(seed)
    full = GroupedMLP(HIDDEN, FFN, num_experts, topk, device="cpu", **extra)
    with torch.no_grad():  # biases away from zero, so their gradients and loading are checked too
        for p in full.parameters():
            if p.dim() == 1:
                p.normal_()
    return full


def _data(world, seed, counts):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(counts), HIDDEN, generator=gen)
    dout = torch.randn(sum(counts), HIDDEN, generator=gen)
    offsets = [sum(counts[:r]) for r in range(world + 1)]
    return x, dout, offsets


def _reference(full, x, dout):
    x = x.clone().requires_grad_()
    full.zero_grad()
    out = full(x)
    out.backward(dout)
    return out.detach(), x.grad, {k: p.grad.clone() for k, p in full.named_parameters()}


def _run_ep(layer, x, dout, rows, dp_group, average=False):
    """The EP layer on this rank's rows, its gradients reduced; returns
    (out, input gradient)."""
    from seqfuse.distributed import reduce_expert_parallel_grads

    xl = x[rows].clone().requires_grad_()
    layer.zero_grad()
    out = layer(xl)
    out.backward(dout[rows])
    reduce_expert_parallel_grads(layer, dp_group, average=average)
    return out.detach(), xl.grad


def _compare(layer, full, x, dout, offsets, rank, dp_group):
    ref_out, ref_dx, ref_grads = _reference(full, x, dout)
    rows = slice(offsets[rank], offsets[rank + 1])
    out, dx = _run_ep(layer, x, dout, rows, dp_group)
    errs = {"out": rel_error(out, ref_out[rows]), "dx": rel_error(dx, ref_dx[rows])}
    names = dict(layer.named_parameters())
    errs["params"] = {k: rel_error(p.grad, ref_grads[k]) for k, p in names.items()}
    errs["n_params"] = len(names)
    return errs


def _ep_groups(world, rank):
    """{ep_size: (EP group, DP group)} for EP 2 (dp 2) and 4 (dp 1), from
    the meshes' get_group (slicing a mesh, mesh["ep"], takes about 20 s per
    slice on torch 2.15 with gloo on these CPUs)."""
    from seqfuse.distributed import init_expert_parallel_mesh

    out = {}
    for ep in (2, 4):
        mesh = init_expert_parallel_mesh(ep)
        assert mesh.mesh_dim_names == ("dp", "ep") and tuple(mesh.shape) == (world // ep, ep)
        out[ep] = (mesh.get_group("ep"), mesh.get_group("dp"))
        out[f"mesh{ep}"] = mesh
    return out


def _equivalence(groups, rank, seed):
    res = {}
    for i, (name, e, k, ep, extra) in enumerate(CONFIGS):
        full = _full_layer(e, k, extra, seed + 10 * i)
        ep_group, dp_group = groups[ep]
        layer = ExpertParallelGroupedMLP.from_full(full, ep_group)
        x, dout, offsets = _data(WORLD, seed + 10 * i, _tokens_per_rank(WORLD))
        res[name] = _compare(layer, full, x, dout, offsets, rank, dp_group)
        res[name]["local"] = list(layer.local_experts())
    return res


def _fp8(groups, rank, seed):
    """EP = 4 (dp 1) under Float8CurrentScaling against the single process
    under the same recipe: each expert's rows (its input scale's amax) are
    the same set in both runs, so the results agree to float32 rounding.
    (With dp 2 an expert sees only its EP group's tokens, so its current
    scale differs from the single process's over every token, as in plain
    data parallelism: FP8 results are not comparable there.)  None where
    this torch cannot pass float8 tensors to seqfuse."""
    from seqfuse.common.recipe import Float8CurrentScaling
    from seqfuse.ops._call import FP8_DLPACK
    from seqfuse.quantization import fp8_autocast

    if not FP8_DLPACK:
        return None
    torch.manual_seed(seed + 600)
    full = GroupedMLP(32, 32, 4, 2, device="cpu")
    layer = ExpertParallelGroupedMLP.from_full(full, groups[4][0])
    counts = _tokens_per_rank(WORLD)
    gen = torch.Generator().manual_seed(seed + 601)
    x, dout = torch.randn(sum(counts), 32, generator=gen), torch.randn(sum(counts), 32, generator=gen)
    offsets = [sum(counts[:r]) for r in range(WORLD + 1)]
    with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
        errs = _compare(layer, full, x, dout, offsets, rank, groups[4][1])
    # delayed scaling's end-of-step amax reduction (over the world) would join different experts' histories
    from seqfuse.common.recipe import DelayedScaling

    try:
        with fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            layer(x[offsets[rank]:offsets[rank + 1]])
        errs["delayed"] = "ran"
    except NotImplementedError as e:
        errs["delayed"] = str(e)
    return errs


def _averaged(groups, rank, seed):
    """reduce_expert_parallel_grads(average=True): every gradient is the
    summed one divided by dp * ep (= 4), experts included."""
    name, e, k, ep, extra = CONFIGS[0]
    full = _full_layer(e, k, extra, seed + 400)
    layer = ExpertParallelGroupedMLP.from_full(full, groups[ep][0])
    x, dout, offsets = _data(WORLD, seed + 400, _tokens_per_rank(WORLD))
    _, _, ref_grads = _reference(full, x, dout)
    _run_ep(layer, x, dout, slice(offsets[rank], offsets[rank + 1]), groups[ep][1], average=True)
    return max(rel_error(p.grad * WORLD, ref_grads[n]) for n, p in layer.named_parameters())


def _uneven(groups, rank, seed):
    """Routing forced onto experts 0 and 1 (both on EP rank 0 at EP = 2):
    experts 2, 3 get no token anywhere, EP rank 1 receives nothing; rank 3
    has no tokens at all."""
    full = _full_layer(4, 2, {}, seed + 500)
    with torch.no_grad():
        v = torch.ones(HIDDEN)
        full.router_weight.copy_(torch.stack([3 * v, 2 * v, -2 * v, -3 * v]))
    counts = _tokens_per_rank(WORLD, empty_rank=3)
    gen = torch.Generator().manual_seed(seed + 501)
    x = torch.rand(sum(counts), HIDDEN, generator=gen) + 0.1  # positive: logits order 0 > 1 > 2 > 3
    dout = torch.randn(sum(counts), HIDDEN, generator=gen)
    offsets = [sum(counts[:r]) for r in range(WORLD + 1)]
    ep_group, dp_group = groups[2]
    layer = ExpertParallelGroupedMLP.from_full(full, ep_group)
    res = _compare(layer, full, x, dout, offsets, rank, dp_group)
    res["zero_expert_grads"] = [float(layer.fc1.get_parameter(f"weight{e}").grad.abs().sum())
                                for e in layer.local_experts()]
    return res


def _clip(groups, rank, seed):
    """clip_grad_norm_ over dp 2 x ep 2 against torch's on the reference."""
    from seqfuse.distributed import clip_grad_norm_

    res = {}
    name, e, k, ep, extra = CONFIGS[1]
    for norm_type in (2.0, float("inf")):
        full = _full_layer(e, k, extra, seed + 700)
        ep_group, dp_group = groups[ep]
        layer = ExpertParallelGroupedMLP.from_full(full, ep_group)
        x, dout, offsets = _data(WORLD, seed + 700, _tokens_per_rank(WORLD))
        _reference(full, x, dout)
        rows = slice(offsets[rank], offsets[rank + 1])
        _run_ep(layer, x, dout, rows, dp_group)
        # the naive norm (this rank's gradients only) must differ, or the test proves nothing
        naive = torch.nn.utils.get_total_norm([p.grad for p in layer.parameters()], norm_type) \
            if hasattr(torch.nn.utils, "get_total_norm") else None
        ref_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), 0.01, norm_type)
        got = clip_grad_norm_(layer, 0.01, norm_type)
        key = "l2" if norm_type == 2.0 else "inf"
        res[key] = {"norm": rel_error(got, ref_norm), "ref": float(ref_norm),
                    "naive": None if naive is None else float(naive),
                    "grads": max(rel_error(p.grad, full.get_parameter(n).grad)
                                 for n, p in layer.named_parameters())}
    return res


def _full(t):
    """The whole tensor of a DTensor (a collective), a plain tensor as is."""
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


class _Net(torch.nn.Module):
    """A non-expert layer, then the MoE layer (full or EP)."""

    def __init__(self, moe, hidden=HIDDEN):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, device=moe.router_weight.device)
        self.moe = moe

    def forward(self, x):
        return self.moe(self.proj(x))


def _fsdp2(groups, rank, seed, out_dir):
    """FSDP2 over dp of the dp 2 x ep 2 mesh (fully_shard_expert_parallel),
    each rank's loss a mean over its tokens: the gradients (DTensor shards,
    gathered) equal those of the mean of the ranks' losses in one process,
    and clip_grad_norm_ on the shards gives that process's norm.  Then the
    sharded model is saved with torch.distributed.checkpoint and loaded into
    an FSDP2 model at EP = 4 (dp 1)."""
    import torch.distributed.checkpoint as dcp

    from seqfuse.distributed import clip_grad_norm_, fully_shard_expert_parallel

    name, e, k, ep, extra = CONFIGS[0]
    full = _full_layer(e, k, extra, seed + 800)
    torch.manual_seed(seed + 801)
    ref_net = _Net(full)
    net = _Net(ExpertParallelGroupedMLP.from_full(full, groups[ep][0]))
    net.proj.load_state_dict(ref_net.proj.state_dict())
    counts = _tokens_per_rank(WORLD)
    x, dout, offsets = _data(WORLD, seed + 800, counts)
    scale = torch.cat([torch.full((c, 1), 1.0 / (WORLD * c)) for c in counts])
    ref_net(x).backward(dout * scale)  # d/dW of mean over ranks of each rank's mean loss
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 1e-3)
    fully_shard_expert_parallel(net, groups[f"mesh{ep}"])
    rows = slice(offsets[rank], offsets[rank + 1])
    net(x[rows]).backward(dout[rows] / counts[rank])
    is_dtensor = all(type(p.grad).__name__ == "DTensor" for p in net.parameters())
    norm = clip_grad_norm_(net, 1e-3)
    ref_names = dict(ref_net.named_parameters())
    grads = {n: rel_error(p.grad.full_tensor(), ref_names[n].grad) for n, p in net.named_parameters()}
    # checkpoint of the sharded EP = 2 model, loaded into a sharded EP = 4 model with other weights
    d = os.path.join(out_dir, "dcp_fsdp2_ep2")
    dcp.save(net.state_dict(), checkpoint_id=d)
    torch.manual_seed(seed + 850 + rank)
    net4 = _Net(ExpertParallelGroupedMLP(HIDDEN, FFN, e, k, groups[4][0], device="cpu", **extra))
    fully_shard_expert_parallel(net4, groups["mesh4"])
    sd = net4.state_dict()
    dcp.load(sd, checkpoint_id=d)
    net4.load_state_dict(sd)
    loaded = all(torch.equal(_full(p), ref_names[n].detach()) for n, p in net4.named_parameters())
    # the loaded dp 1 x ep 4 model trains as the reference (experts unsharded, scaled by 1 / ep)
    net4(x[rows]).backward(dout[rows] / counts[rank])
    ref_net.zero_grad()
    ref_net(x).backward(dout * scale)
    ref_norm4 = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 1e-3)
    norm4 = clip_grad_norm_(net4, 1e-3)
    grads4 = {n: rel_error(_full(p.grad), ref_names[n].grad) for n, p in net4.named_parameters()}
    return {"dtensor": is_dtensor, "norm": rel_error(norm, ref_norm), "ref": float(ref_norm), "grads": grads,
            "dcp_fsdp2_ep2_to_ep4": loaded, "dp1_grads": grads4, "dp1_norm": rel_error(norm4, ref_norm4)}


def _checkpoints(groups, rank, seed, out_dir):
    """EP = 2 -> files -> EP = 1 and EP = 4; EP = 1 -> EP = 2; and the same
    through torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp

    res = {}
    full = _full_layer(8, 2, dict(bias=True), seed + 900)
    ep2 = ExpertParallelGroupedMLP.from_full(full, groups[2][0])
    # per-rank state dicts: the union over one dp slice's EP ranks is the GroupedMLP checkpoint
    torch.save(ep2.state_dict(), os.path.join(out_dir, f"ep2_rank{rank}.pt"))
    dist.barrier()
    merged = {}
    for r in (0, 1):  # dp slice 0 holds EP ranks 0 and 1 on world ranks 0 and 1
        merged.update(torch.load(os.path.join(out_dir, f"ep2_rank{r}.pt")))
    one = GroupedMLP(HIDDEN, FFN, 8, 2, bias=True, device="cpu")
    one.load_state_dict(merged)  # strict: every key present, none extra
    res["files_ep2_to_ep1"] = all(torch.equal(v, full.state_dict()[k]) for k, v in one.state_dict().items())
    torch.manual_seed(seed + 901 + rank)  # a fresh EP = 4 layer with other weights, then loaded
    ep4 = ExpertParallelGroupedMLP(HIDDEN, FFN, 8, 2, groups[4][0], bias=True, device="cpu")
    ep4.load_state_dict(merged)  # other experts' entries skipped
    res["files_ep2_to_ep4"] = all(torch.equal(v, full.state_dict()[k]) for k, v in ep4.state_dict().items())
    missing = {k: v for k, v in merged.items() if k != f"fc1.weight{ep4.first_expert}"}
    try:
        ep4.load_state_dict(missing)
        res["missing_refused"] = False
    except RuntimeError as exc:
        res["missing_refused"] = f"fc1.weight{ep4.first_expert}" in str(exc)
    # to_full / full_state_dict (collectives over the EP group)
    back = ep4.to_full()
    res["to_full"] = all(torch.equal(v, full.state_dict()[k]) for k, v in back.state_dict().items())
    res["full_keys"] = list(ep2.full_state_dict()) == list(full.state_dict())
    # torch.distributed.checkpoint: saved at EP = 2 by all four ranks, loaded at EP = 1 and EP = 4
    d2 = os.path.join(out_dir, "dcp_ep2")
    dcp.save(ep2.state_dict(), checkpoint_id=d2)
    torch.manual_seed(seed + 950 + rank)
    one = GroupedMLP(HIDDEN, FFN, 8, 2, bias=True, device="cpu")
    sd = one.state_dict()
    dcp.load(sd, checkpoint_id=d2)
    one.load_state_dict(sd)
    res["dcp_ep2_to_ep1"] = all(torch.equal(v, full.state_dict()[k]) for k, v in one.state_dict().items())
    ep4 = ExpertParallelGroupedMLP(HIDDEN, FFN, 8, 2, groups[4][0], bias=True, device="cpu")
    sd = ep4.state_dict()
    dcp.load(sd, checkpoint_id=d2)
    ep4.load_state_dict(sd)
    res["dcp_ep2_to_ep4"] = all(torch.equal(v, full.state_dict()[k]) for k, v in ep4.state_dict().items())
    # and back: a GroupedMLP checkpoint (EP = 1) into EP = 2
    d1 = os.path.join(out_dir, "dcp_ep1")
    other = _full_layer(8, 2, dict(bias=True), seed + 990)
    dcp.save(other.state_dict(), checkpoint_id=d1)
    sd = ep2.state_dict()
    dcp.load(sd, checkpoint_id=d1)
    ep2.load_state_dict(sd)
    res["dcp_ep1_to_ep2"] = all(torch.equal(v, other.state_dict()[k]) for k, v in ep2.state_dict().items())
    # a loaded EP = 2 layer computes what the GroupedMLP it came from computes
    x = torch.randn(6, HIDDEN)
    res["loaded_forward"] = rel_error(ep2(x).detach(), other(x).detach())
    return res


def _bad_arguments(groups):
    from seqfuse.distributed import all_to_all_single_autograd, clip_grad_norm_, dispatch_tokens

    g = groups[2][0]
    layer = ExpertParallelGroupedMLP(HIDDEN, FFN, 4, 2, g, device="cpu")
    x = torch.randn(4, HIDDEN)
    probs, routing = torch.rand(4, 4), torch.ones(4, 4, dtype=torch.bool)
    return {
        "experts_not_divisible": raised(lambda: ExpertParallelGroupedMLP(HIDDEN, FFN, 3, 1, g, device="cpu")),
        "group_type": raised(lambda: ExpertParallelGroupedMLP(HIDDEN, FFN, 4, 1, "world", device="cpu")),
        "splits_count": raised(lambda: all_to_all_single_autograd(x, [4], [4], g)),
        "splits_sum": raised(lambda: all_to_all_single_autograd(x, [2, 2], [1, 1], g)),
        "dispatch_experts": raised(lambda: dispatch_tokens(x, probs, routing, g, 3)),
        "clip_norm_type": raised(lambda: clip_grad_norm_(layer, 1.0, 0.5)),
        "clip_model": raised(lambda: clip_grad_norm_([layer.router_weight], 1.0)),
    }


def _ranks_body(rank, world, out_dir, seed):
    """Every EP claim on this rank (run_ranks' body)."""
    groups = _ep_groups(world, rank)
    return {"equivalence": _equivalence(groups, rank, seed), "uneven": _uneven(groups, rank, seed),
            "averaged": _averaged(groups, rank, seed), "fp8": _fp8(groups, rank, seed),
            "clip": _clip(groups, rank, seed), "fsdp2": _fsdp2(groups, rank, seed, out_dir),
            "checkpoints": _checkpoints(groups, rank, seed, out_dir), "bad": _bad_arguments(groups)}


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    """[per-rank result dicts] of one start of WORLD processes (a TCP store:
    the meshes make several groups, each a rendezvous, much slower over a
    file store)."""
    d = tmp_path_factory.mktemp("ep")
    return run_ranks(_ranks_body, (str(d), run_seed()), WORLD, d, f"expert-parallel workers (world size {WORLD})",
                     store="tcp")


# ---- the tests ----------------------------------------------------------------------

@pytest.mark.parametrize("name", [c[0] for c in CONFIGS])
def test_ep_equals_single_process(ep_results, name):
    """Output rows, input-gradient rows and every parameter's gradient (after
    reduce_expert_parallel_grads) equal the single-process GroupedMLP's."""
    ep = next(c[3] for c in CONFIGS if c[0] == name)
    e = next(c[1] for c in CONFIGS if c[0] == name)
    for rank, res in enumerate(ep_results):
        r = res["equivalence"][name]
        assert r["local"] == list(range((rank % ep) * e // ep, (rank % ep + 1) * e // ep)), (rank, r["local"])
        assert r["out"] <= TOL and r["dx"] <= TOL, (rank, r["out"], r["dx"])
        assert r["params"] and max(r["params"].values()) <= TOL, (rank, r["params"])


def test_reduce_with_average_divides_by_dp_times_ep(ep_results):
    for rank, res in enumerate(ep_results):
        assert res["averaged"] <= TOL, (rank, res["averaged"])


def test_uneven_routing(ep_results):
    """Experts without tokens, an EP rank that receives nothing and a rank
    without tokens: still equal to the reference; idle experts' gradients
    are zero."""
    for rank, res in enumerate(ep_results):
        r = res["uneven"]
        assert r["out"] <= TOL and r["dx"] <= TOL, (rank, r)
        assert max(r["params"].values()) <= TOL, (rank, r["params"])
        if rank % 2 == 1:  # EP rank 1 holds experts 2 and 3, which no token chose
            assert r["zero_expert_grads"] == [0.0, 0.0], (rank, r["zero_expert_grads"])
        else:
            assert min(r["zero_expert_grads"]) > 0, (rank, r["zero_expert_grads"])


def test_fp8_current_scaling_under_ep(ep_results):
    """Float8CurrentScaling: EP = 4 equals the single process under the same
    recipe (outputs, input and parameter gradients); DelayedScaling under EP
    is refused."""
    if ep_results[0]["fp8"] is None:
        pytest.skip(f"torch {torch.__version__} cannot export float8 tensors through DLPack")
    for rank, res in enumerate(ep_results):
        r = res["fp8"]
        assert r["out"] <= TOL and r["dx"] <= TOL, (rank, r)
        assert max(r["params"].values()) <= TOL, (rank, r["params"])
        assert "DelayedScaling with expert parallelism" in r["delayed"], (rank, r["delayed"])


@pytest.mark.parametrize("norm", ["l2", "inf"])
def test_clip_grad_norm_is_exact(ep_results, norm):
    """clip_grad_norm_ over dp 2 x ep 2 returns the single process's norm and
    clips to its gradients; the per-rank (naive) norm is not it."""
    for rank, res in enumerate(ep_results):
        r = res["clip"][norm]
        assert r["ref"] > 0.01, "the reference norm must exceed max_norm so clipping happens"
        assert r["norm"] <= TOL and r["grads"] <= TOL, (rank, r)
        if r["naive"] is not None and norm == "l2":
            assert abs(r["naive"] - r["ref"]) > 1e-3 * r["ref"], (rank, r)


@needs_cpu_fsdp2
def test_fsdp2_over_dp_and_clip_on_shards(ep_results):
    """fully_shard_expert_parallel on dp 2 x ep 2 with mean losses: every
    parameter's gradient equals the single process's gradient of the mean of
    the ranks' losses (experts divided by dp * ep, not dp), and
    clip_grad_norm_ over the DTensor shards returns its norm."""
    for rank, res in enumerate(ep_results):
        r = res["fsdp2"]
        assert r["dtensor"], rank
        assert r["ref"] > 1e-3 and r["norm"] <= TOL, (rank, r)
        assert max(r["grads"].values()) <= TOL, (rank, r["grads"])


@needs_cpu_fsdp2
def test_fsdp2_checkpoint_loads_at_another_ep_size(ep_results):
    """torch.distributed.checkpoint of the FSDP2-sharded EP = 2 model loads
    into an FSDP2-sharded EP = 4 model: every parameter equal."""
    for rank, res in enumerate(ep_results):
        assert res["fsdp2"]["dcp_fsdp2_ep2_to_ep4"] is True, rank


@needs_cpu_fsdp2
def test_fsdp2_with_one_dp_rank(ep_results):
    """dp 1 x ep 4: the experts stay unsharded (scaled by 1 / ep), the rest
    sharded over the 4 ranks: gradients and the clipped norm as the single
    process's."""
    for rank, res in enumerate(ep_results):
        r = res["fsdp2"]
        assert max(r["dp1_grads"].values()) <= TOL and r["dp1_norm"] <= TOL, (rank, r["dp1_grads"], r["dp1_norm"])


CHECKPOINT_CLAIMS = ["files_ep2_to_ep1", "files_ep2_to_ep4", "missing_refused", "to_full", "full_keys",
                     "dcp_ep2_to_ep1", "dcp_ep2_to_ep4", "dcp_ep1_to_ep2"]


@pytest.mark.parametrize("claim", CHECKPOINT_CLAIMS)
def test_checkpoint_across_ep_sizes(ep_results, claim):
    for rank, res in enumerate(ep_results):
        assert res["checkpoints"][claim] is True, (rank, claim, res["checkpoints"][claim])


def test_loaded_layer_computes_the_same(ep_results):
    for rank, res in enumerate(ep_results):
        assert res["checkpoints"]["loaded_forward"] <= TOL, rank


BAD = {
    "experts_not_divisible": ("ValueError", "num_experts"),
    "group_type": ("TypeError", "ep_group"),
    "splits_count": ("ValueError", "input_splits"),
    "splits_sum": ("ValueError", "adds up to"),
    "dispatch_experts": ("ValueError", "num_local_experts"),
    "clip_norm_type": ("ValueError", "norm_type"),
    "clip_model": ("TypeError", "model"),
}


@pytest.mark.parametrize("which", sorted(BAD))
def test_bad_arguments(ep_results, which):
    check_raised(ep_results, which, BAD)


# ---- one process ---------------------------------------------------------------------

def test_without_a_group_is_grouped_mlp():
    """ep_group=None: the layer is GroupedMLP (bit for bit), with the same
    state_dict keys; to_full / from_full round-trip."""
    full = _full_layer(4, 2, {}, 3)
    layer = ExpertParallelGroupedMLP.from_full(full)
    assert list(layer.state_dict()) == list(full.state_dict())
    x = torch.randn(7, 2, HIDDEN, requires_grad=True)
    out = layer(x)
    ref = full(x)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    dx_layer = torch.autograd.grad(out, x, g)[0]
    dx_full = torch.autograd.grad(ref, x, g)[0]
    assert torch.equal(dx_layer, dx_full)
    back = layer.to_full()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in back.state_dict().items())


def test_initialisation_does_not_depend_on_the_ep_size():
    """Expert e's initial weights are the same whichever rank (EP size)
    holds it: a layer of 4 experts on 1 rank against the slices that ranks
    of an EP group of 2 would build (first_expert set by hand)."""
    from seqfuse.modules.moe_expert_parallel import _LocalExperts  # noqa: F401 - the class under test

    torch.manual_seed(11)
    one = ExpertParallelGroupedMLP(HIDDEN, FFN, 4, 2, device="cpu")
    torch.manual_seed(11)
    again = ExpertParallelGroupedMLP(HIDDEN, FFN, 4, 2, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), again.state_dict().values()))
    # distinct experts differ (a shared seed per rank would make them equal)
    assert not torch.equal(one.fc1.weight0, one.fc1.weight1)


# ---- two GPUs over NCCL (cuda-marked) ---------------------------------------------------

CUDA_CASES = [("fp32", torch.float32), ("bf16", torch.bfloat16)]


def _cuda_body(rank, world, seed):
    """EP = 2 over NCCL against one GPU (run_ranks' body)."""
    from seqfuse.distributed import clip_grad_norm_, reduce_expert_parallel_grads

    dev = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    res = {}
    for name, dtype in CUDA_CASES:
        for uneven in (False, True):
            torch.manual_seed(seed)
            full = GroupedMLP(256, 512, 8, 2, params_dtype=dtype, device=dev)
            counts = [384 + 128 * r for r in range(world)]
            gen = torch.Generator().manual_seed(seed + 1)
            x = torch.randn(sum(counts), 256, generator=gen)
            if uneven:  # every token to experts 0 and 1: rank 1's experts receive nothing
                x = x.abs() + 0.1
                with torch.no_grad():
                    v = torch.full((256,), 0.05, device=dev, dtype=dtype)  # logits about 35 / 23 / -12
                    full.router_weight.copy_(torch.stack([3 * v, 2 * v] + [-v] * 6))
            x = x.to(dev, dtype)
            dout = torch.randn(sum(counts), 256, generator=gen).to(dev, dtype)
            rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
            layer = ExpertParallelGroupedMLP.from_full(full, group)
            xr = x.clone().requires_grad_()
            ref = full(xr)
            ref.backward(dout)
            xl = x[rows].clone().requires_grad_()
            out = layer(xl)
            out.backward(dout[rows])
            reduce_expert_parallel_grads(layer, None, average=False)
            grads = max(rel_error(p.grad, full.get_parameter(n).grad) for n, p in layer.named_parameters())
            ref_norm = torch.nn.utils.clip_grad_norm_(full.parameters(), 1e-3)
            norm = clip_grad_norm_(layer, 1e-3)
            res[f"{name}{'-uneven' if uneven else ''}"] = {
                "out": rel_error(out, ref[rows]), "dx": rel_error(xl.grad, xr.grad[rows]), "grads": grads,
                "norm": rel_error(norm, ref_norm)}
    res["fsdp2"] = _cuda_fsdp2(rank, world, dev, seed)
    return res


def _cuda_fsdp2(rank, world, dev, seed):
    """fully_shard_expert_parallel on a dp 1 x ep 2 mesh over NCCL (the
    experts' divide factor through NCCL's PREMUL_SUM), mean losses: the
    gradients and the clipped norm against one GPU (float32)."""
    from seqfuse.distributed import clip_grad_norm_, fully_shard_expert_parallel, init_expert_parallel_mesh

    mesh = init_expert_parallel_mesh(2)
    torch.manual_seed(seed + 5)
    full = GroupedMLP(256, 512, 8, 2, device=dev)
    ref_net = _Net(full, 256)
    net = _Net(ExpertParallelGroupedMLP.from_full(full, mesh.get_group("ep")), 256)
    net.proj.load_state_dict(ref_net.proj.state_dict())
    counts = [384 + 128 * r for r in range(world)]
    gen = torch.Generator().manual_seed(seed + 6)
    x = torch.randn(sum(counts), 256, generator=gen).to(dev)
    dout = torch.randn(sum(counts), 256, generator=gen).to(dev)
    scale = torch.cat([torch.full((c, 1), 1.0 / (world * c)) for c in counts]).to(dev)
    ref_net(x).backward(dout * scale)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_net.parameters(), 1e-4)
    fully_shard_expert_parallel(net, mesh)
    rows = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    net(x[rows]).backward(dout[rows] / counts[rank])
    norm = clip_grad_norm_(net, 1e-4)
    ref_names = dict(ref_net.named_parameters())
    grads = max(rel_error(_full(p.grad), ref_names[n].grad) for n, p in net.named_parameters())
    return {"grads": grads, "norm": rel_error(norm, ref_norm), "ref": float(ref_norm)}


@pytest.mark.cuda
def test_ep2_on_two_gpus_over_nccl(tmp_path):
    """EP = 2 over NCCL on two GPUs equals one GPU's GroupedMLP over every
    token (fp32 and bf16, balanced and all-on-one-rank routing): outputs,
    input gradients, every parameter gradient, the clipped norm; and under
    FSDP2 (fully_shard_expert_parallel, dp 1 x ep 2)."""
    from helpers import pair_tol

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    results = run_ranks(_cuda_body, (run_seed(),), 2, tmp_path, "expert-parallel NCCL workers", backend="nccl",
                        store="tcp", timeout=300)
    for rank, res in enumerate(results):
        for name, dtype in CUDA_CASES:
            for case in (name, name + "-uneven"):
                r = res[case]
                # the same kernels on the same rows: within two results' error of each other; fp32
                # GEMMs run on TF32 (grouped_gemm's allow_tf32), whose cuBLASLt algorithm may change with
                # the row counts (EP's are half the single GPU's): 5x the fp32 pair bound
                tol = pair_tol(dtype, 5.0 if dtype == torch.float32 else 1.0)
                assert r["out"] <= tol and r["dx"] <= tol, (rank, case, r)
                assert r["grads"] <= tol and r["norm"] <= tol, (rank, case, r)
        r = res["fsdp2"]
        tol = pair_tol(torch.float32, 5.0)
        assert r["ref"] > 1e-4 and r["grads"] <= tol and r["norm"] <= tol, (rank, "fsdp2", r)
