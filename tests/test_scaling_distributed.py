"""Amax reduction across a process group: two processes on the gloo backend,
each quantizing different data under autocast; after the step every rank
holds the same scales, computed from the max over ranks, reached with one
all-reduce for all the states of the step."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank, init_file, out_dir):
    import seqfuse.pytorch as te
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.quantization import INPUT, WEIGHT, ScalingState, quantize_with_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        calls.append(a[0].numel())
        return real(*a, **k)

    dist.all_reduce = counting
    r = DelayedScaling(amax_history_len=4, margin=1)
    states = [ScalingState.for_linear(r) for _ in range(5)]
    for step in range(3):
        with te.autocast(enabled=True, recipe=r, amax_reduction_group=dist.group.WORLD):
            for i, st in enumerate(states):
                # rank 0 has the larger input of even states, rank 1 of odd ones
                big = (i % 2) == rank
                x = torch.full((8, 8), float(10 * (i + 1) * (step + 1) if big else 1.0))
                quantize_with_state(x, st, INPUT)
                quantize_with_state(x * 0 + (rank + 1), st, WEIGHT)
    dist.all_reduce = real
    torch.save({"scales": torch.stack([s.scale.clone() for s in states]),
                "history": torch.stack([s.amax_history.clone() for s in states]),
                "calls": calls}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_amax_reduction_two_processes_gloo(tmp_path):
    from seqfuse.ops._call import FP8_DLPACK
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if not FP8_DLPACK:
        pytest.skip("this torch cannot export float8 through DLPack")
    init_file = tmp_path / "init"
    mp.spawn(_worker, args=(str(init_file), str(tmp_path)), nprocs=WORLD, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # one all-reduce per step, over all 15 tensors of the 5 states at once
    assert res[0]["calls"] == res[1]["calls"] == [15, 15, 15]
    assert torch.equal(res[0]["scales"], res[1]["scales"])
    assert torch.equal(res[0]["history"], res[1]["history"])
    for i in range(5):
        amax = 10.0 * (i + 1) * 3  # the max over ranks of the last step (history max)
        assert res[0]["scales"][i, 0].item() == (torch.tensor(448.0) / torch.tensor(amax) * 0.5).item()
        assert res[0]["scales"][i, 1].item() == (torch.tensor(448.0) / torch.tensor(2.0) * 0.5).item()
        assert res[0]["scales"][i, 2].item() == 1.0  # no gradient amax: kept
