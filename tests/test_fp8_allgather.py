"""FP8 weight all-gather under FSDP2 (seqfuse.distributed.fp8_allgather).

CPU, gloo, two forked workers for everything (one start, ~10 s): per recipe
(delayed, current, block), a 2-layer model (LayerNormMLP then Linear) is
fully_shard-ed with the FP8 all-gather and, beside it, the same model under
plain FSDP2 FP8 and an unsharded copy in one process:
  * the gathered FP8 operands (bytes, transposed bytes, scale) equal the
    single process's weight quantization bit for bit;
  * two training steps (forward, backward, SGD) give the plain FSDP2 FP8
    run's losses and gradients exactly (bound: 0 -- the same bytes reach the
    same GEMMs, so any difference is a bug), including the re-gather after
    the update (FSDP2's refill path);
  * the all-gathers move uint8 of half the bf16 weight bytes, the
    reduce-scatters stay in the policy's reduce_dtype (float32 for bfloat16
    parameters), the sharded gradients are bfloat16;
  * outside FP8 autocast the gathered weights are read dequantized;
  * the state_dict holds the high-precision weights (equal to the unsharded
    copy, plain tensors through torch.save / torch.load(weights_only=True));
  * block scaling with shards of fewer than 128 rows is refused, naming the
    rule.
A cuda-marked test does the equality on two GPUs over NCCL (torchrun-free:
spawned workers), skipped with fewer GPUs.
"""
import os
import sys

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from seqfuse.distributed import end_process_group

from helpers import free_port, needs_cpu_fsdp2, needs_fp8, run_workers

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from harness import CollectiveBytes  # noqa: E402  (the bytes counter the FSDP benchmark reports with)

HIDDEN, FFN, OUT = 256, 512, 256


def _recipes():
    return {"delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling()}


def _build(device, dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        te.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation="swiglu", bias=False,
                        params_dtype=dtype, device=device),
        te.Linear(HIDDEN, OUT, bias=True, params_dtype=dtype, device=device))


def _shard(model, mesh_kw, mp):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        fully_shard(layer, mp_policy=mp, **mesh_kw)
    fully_shard(model, mp_policy=mp, **mesh_kw)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pair_bytes(pair, kind):
    w, wt = pair
    if kind == "block":
        return [w.data.view(torch.uint8), w.scale_inv, wt.data.view(torch.uint8), wt.scale_inv]
    return [w.data.view(torch.uint8), w.data_t.view(torch.uint8), w.scale_inv]


def _body(rank, world, device, result_path):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from seqfuse.distributed import enable_fp8_all_gather, fp8_all_gather_params
    from seqfuse.quantization.gemm_quantizers import quantizers_for

    out = {}
    dtype = torch.bfloat16
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for name, recipe in _recipes().items():
        single = _build(device, dtype)
        plain = _shard(_build(device, dtype), {}, mp)
        fp8ag = _build(device, dtype)
        converted = enable_fp8_all_gather(fp8ag, recipe)
        _shard(fp8ag, {}, mp)
        res = {"converted": converted, "params": fp8_all_gather_params(fp8ag)}

        # 1. the gathered operands against one process's quantization of the full weight
        # (plain FSDP2 casts its gathered bf16 weight the same way: checked too,
        # and its delayed-scaling state then records the same weight amaxes)
        same = []
        for i, (mods, names) in enumerate(((0, ("fc1_weight", "fc2_weight")), (1, ("weight",)))):
            layer, ref, pl = fp8ag[mods], single[mods], plain[mods]
            layer.unshard()
            pl.unshard()
            qa, qr, qp = (quantizers_for(m, recipe, device) for m in (layer, ref, pl))
            for g, pname in enumerate(names):
                got = _pair_bytes(qa.weights[g].get(getattr(layer, pname)), qa.kind)
                want = _pair_bytes(qr.weights[g].get(getattr(ref, pname)), qr.kind)
                other = _pair_bytes(qp.weights[g].get(getattr(pl, pname)), qp.kind)
                same.append(all(torch.equal(a, b) and torch.equal(b, c)
                                for a, b, c in zip(got, want, other)))
                res.setdefault("gathered_type", type(getattr(layer, pname)).__name__)
            layer.reshard()
            pl.reshard()
        res["bitwise"] = same

        # 2. training steps against plain FSDP2 FP8
        losses, grads = {"plain": [], "fp8ag": []}, {"plain": [], "fp8ag": []}
        snaps = {}
        with CollectiveBytes() as wire:
            for tag, model in (("plain", plain), ("fp8ag", fp8ag)):
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                torch.manual_seed(100 + rank)
                start = (len(wire.gathers), len(wire.scatters))
                for step in range(2):
                    x = torch.randn(64, HIDDEN, device=device, dtype=dtype)
                    with te.autocast(enabled=True, recipe=recipe):
                        y = model(x)
                    loss = (y.float() ** 2).mean()
                    loss.backward()
                    losses[tag].append(loss.detach().cpu())
                    grads[tag].append([p.grad.full_tensor().cpu() for p in model.parameters()])
                    res.setdefault(f"grad_dtypes_{tag}", [str(p.grad.dtype) for p in model.parameters()])
                    opt.step()
                    opt.zero_grad()
                res[f"wire_{tag}"] = (wire.gathers[start[0]:], wire.scatters[start[1]:])
                # right after its own steps: every autocast exit updates all delayed-scaling
                # states of the recipe in the process, so the other model's steps move it too
                snaps[tag] = {k: _full(v).clone() for k, v in model.state_dict().items()}
        res["loss_equal"] = all(torch.equal(a, b) for a, b in zip(losses["plain"], losses["fp8ag"]))
        res["grads_equal"] = all(torch.equal(a, b) for sa, sb in zip(grads["plain"], grads["fp8ag"])
                                 for a, b in zip(sa, sb))
        res["losses"] = [float(v) for v in losses["plain"] + losses["fp8ag"]]

        # read outside FP8 autocast: the gathered weights dequantized (FP8 values x scale),
        # so the output is the bf16 model's up to E4M3 rounding of the weights: relative
        # 2**-4 per element at most, about 2**-4/sqrt(3) = 3.6 % RMS per weight, three
        # weights in series (fc1, fc2, the Linear) about sqrt(3) x that = 6.2 %: bound
        # 0.08 (measured 0.053-0.054); and not bit-equal to the bf16 output
        torch.manual_seed(7)
        x = torch.randn(32, HIDDEN, device=device, dtype=dtype)
        with torch.no_grad():
            y_ag, y_pl = fp8ag(x).float(), plain(x).float()
        res["nofp8_err"] = float((y_ag - y_pl).norm() / y_pl.norm())

        # 3. state_dict: the high-precision weights, plain tensors on disk
        sd = fp8ag.state_dict()
        assert sorted(snaps["fp8ag"]) == sorted(snaps["plain"])
        # Delayed scaling's state buffers too: scales and this step's amaxes (row 0 of
        # the history).  Older history rows are not comparable: every autocast exit
        # rolls the history of every state of the recipe in the process, so the model
        # trained second has seen two more rolls.
        def cut(k, t):
            return t[:1] if k.endswith("amax_history") else t
        res["sd_differ"] = [k for k in snaps["plain"]
                            if not torch.equal(cut(k, snaps["fp8ag"][k]), cut(k, snaps["plain"][k]))]
        res["sd_equal"] = not res["sd_differ"]
        weights = [k for k in sd if hasattr(sd[k], "full_tensor")]
        res["sd_dtypes"] = sorted({str(sd[k].dtype) for k in weights})
        local = {k: sd[k].to_local() for k in weights}
        path = f"{result_path}.{name}.{rank}.pt"
        torch.save(local, path)
        back = torch.load(path, weights_only=True)
        res["sd_types"] = sorted({type(v).__name__ for v in back.values()})
        res["sd_roundtrip"] = all(torch.equal(back[k], local[k]) for k in local)
        os.remove(path)
        out[name] = res

    # 4. block scaling with 128-row shards of a 128-row weight: refused
    small = torch.nn.Sequential(te.Linear(HIDDEN, 128, params_dtype=dtype, device=device))
    enable_fp8_all_gather(small, Float8BlockScaling())
    _shard(small, {}, mp)
    try:
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            small(torch.randn(16, HIDDEN, device=device, dtype=dtype))
        out["block_refusal"] = None
    except ValueError as e:
        out["block_refusal"] = str(e)
    if rank == 0:
        torch.save(out, result_path)


def _worker(rank, world, port, result_path, backend):
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    ok = False
    try:
        _body(rank, world, device, result_path)
        ok = True
    finally:
        end_process_group(ok)


def _check(out):
    for name in ("delayed", "current", "block"):
        res = out[name]
        assert res["converted"] == ["0.fc1_weight", "0.fc2_weight", "1.weight"], res["converted"]
        assert res["params"] == res["converted"]
        assert res["gathered_type"] == "GatheredFP8Weight"
        assert res["bitwise"] == [True, True, True], (name, res["bitwise"])
        assert res["loss_equal"] and res["grads_equal"], (name, res["losses"])
        assert res["grad_dtypes_fp8ag"] == res["grad_dtypes_plain"]
        assert set(res["grad_dtypes_fp8ag"]) == {"torch.bfloat16"}
        gp, sp = res["wire_plain"]
        gf, sf = res["wire_fp8ag"]
        assert len(gp) == len(gf) and len(sp) == len(sf) and gp and sp
        # weights dominate every unit: the FP8 gathers move uint8, about half the bytes
        assert {d for d, _ in gf} == {torch.uint8}, gf
        ratio = sum(b for _, b in gf) / sum(b for _, b in gp)
        assert 0.45 < ratio < 0.56, (name, ratio)
        # the reduce-scatters: float32 (the reduce dtype) and byte for byte the plain run's
        assert sf == sp and {d for d, _ in sf} == {torch.float32}, sf
        assert res["sd_equal"] and res["sd_roundtrip"], (name, res["sd_differ"])
        assert 0.0 < res["nofp8_err"] < 0.08, (name, res["nofp8_err"])
        assert res["sd_dtypes"] == ["torch.bfloat16"] and res["sd_types"] == ["Tensor"]
    msg = out["block_refusal"]
    assert msg is not None and "multiple of 128 rows" in msg and "(0.weight)" in msg, msg


@needs_fp8
@needs_cpu_fsdp2
def test_fp8_allgather_gloo(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    result = str(tmp_path / "fp8ag.pt")
    run_workers(_worker, (2, free_port(), result, "gloo"), 2, "fork", "FP8 all-gather workers")
    _check(torch.load(result, weights_only=False))


def test_enable_fp8_all_gather_bad_arguments():
    from seqfuse.common.recipe import MXFP8BlockScaling
    from seqfuse.distributed import enable_fp8_all_gather
    model = _build("cpu", torch.float32)
    with pytest.raises(TypeError, match="recipe"):
        enable_fp8_all_gather(model, "delayed")
    with pytest.raises(TypeError, match="model"):
        enable_fp8_all_gather(object(), DelayedScaling())
    with pytest.raises(NotImplementedError, match="MXFP8"):
        enable_fp8_all_gather(model, MXFP8BlockScaling())
    meta = torch.nn.Sequential(te.Linear(32, 32, device="meta"))
    with pytest.raises(ValueError, match="meta"):
        enable_fp8_all_gather(meta, DelayedScaling())
    # converted in place; the values, dtype and training flag are the weight's
    w = model[1].weight.detach().clone()
    names = enable_fp8_all_gather(model, DelayedScaling())
    assert names == ["0.fc1_weight", "0.fc2_weight", "1.weight"]
    assert torch.equal(model[1].weight, w) and model[1].weight.requires_grad
    assert enable_fp8_all_gather(model, DelayedScaling()) == []  # already converted: nothing to do
    # a model built under quantized_model_init (seqfuse keeps its weights in high
    # precision and casts them per update) converts the same way
    with te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling()):
        qmodel = _build("cpu", torch.bfloat16)
    assert enable_fp8_all_gather(qmodel, Float8CurrentScaling()) == ["0.fc1_weight", "0.fc2_weight", "1.weight"]


@pytest.mark.cuda
@needs_fp8
def test_fp8_allgather_nccl_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    result = str(tmp_path / "fp8ag_nccl.pt")
    run_workers(_worker, (2, free_port(), result, "nccl"), 2, "spawn", "FP8 all-gather NCCL workers",
                timeout=300)
    _check(torch.load(result, weights_only=False))


def test_gathered_weight_makes_new_tensors_shaped_like_it():
    """zeros_like / empty_like / ones_like / new_zeros / new_empty of an
    FP8-gathered weight read no values: plain tensors of the weight's shape,
    dtype and device (they raised on an expanded empty tensor)."""
    from seqfuse.distributed.fp8_allgather import GatheredFP8Weight

    w = GatheredFP8Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(1), torch.ones(1), None, torch.bfloat16)
    for make in (torch.zeros_like, torch.empty_like, torch.ones_like):
        t = make(w)
        assert type(t) is torch.Tensor and t.shape == (4, 8) and t.dtype == torch.bfloat16
    assert torch.equal(torch.ones_like(w), torch.ones(4, 8, dtype=torch.bfloat16))
    assert torch.equal(w.new_zeros((2, 3)), torch.zeros(2, 3, dtype=torch.bfloat16))
    assert w.new_empty((5,)).shape == (5,)


@needs_fp8
@pytest.mark.parametrize("kind", ["current", "block"])
def test_gathered_weight_pair_without_transposed_copy(kind, monkeypatch):
    """A gathered FP8 weight asked for its forward operand only (no gradient
    wanted, or set_weight_transpose_cache(False)) makes no transpose: the
    pair's second element is None and the forward operand is the full
    pair's."""
    from types import SimpleNamespace

    from seqfuse import ops
    from seqfuse.distributed.fp8_allgather import GatheredFP8Weight
    from seqfuse.quantization.gemm_quantizers import quantizers_for

    lin = te.Linear(256, 128, params_dtype=torch.bfloat16)
    recipe = Float8BlockScaling() if kind == "block" else Float8CurrentScaling()
    wq = quantizers_for(lin, recipe, lin.weight.device).weights[0]
    cfg = SimpleNamespace(kind=kind, fp8_dtype=torch.float8_e4m3fn, margin=0, name="test")
    w = torch.randn(128, 256)
    if kind == "block":
        data, si = ops.quantize_block_fp8(w, 128, torch.float8_e4m3fn)
    else:
        si = torch.full((1,), 0.01)
        data = (w / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    g = GatheredFP8Weight(data, si, torch.ones(1), cfg, torch.bfloat16)
    transposes = []
    for name in ("transpose_fp8", "block_transpose_fp8"):
        real = getattr(ops.quant, name)
        monkeypatch.setattr(ops.quant, name, lambda *a, real=real, name=name: transposes.append(name) or real(*a))
    full = g.sf_fp8_pair(wq)
    assert full[1] is not None and len(transposes) == 1
    first, second = g.sf_fp8_pair(wq, transposed=False)
    assert second is None and len(transposes) == 1
    assert torch.equal(first.data.view(torch.uint8), full[0].data.view(torch.uint8))
    assert torch.equal(first.scale_inv, full[0].scale_inv)
