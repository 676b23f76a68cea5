"""The resumable loader under a real two-process gloo group (as torchrun runs
it): ranks read from the process group, take disjoint samples, run the same
number of steps (a collective per step would hang otherwise), and a rank
restarted from its saved position continues exactly where it stopped."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SUBSET = Path(__file__).resolve().parents[1] / "recipes" / "esm2" / "data" / "subset"


def _worker(rank, world_size, init_file, out_dir):
    from datetime import timedelta

    from seqfuse.data import EsmTokenizer, build_mlm_loader, load_sequences

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        tok = EsmTokenizer()
        _, seqs = load_sequences(SUBSET / "validation.parquet")
        make = lambda: build_mlm_loader(seqs, tok, max_tokens=2048, max_length=256, pad_to_multiple_of=16, seed=3)
        full = make()
        steps, tokens = [], torch.zeros(1, dtype=torch.long)
        for b in full:
            tokens += b["num_tokens"]
            dist.all_reduce(tokens)  # one collective per step, as a DDP step would
            steps.append((b["sample_indices"].tolist(), b["labels"].tolist()))
        stop = 4
        first = make()
        it = iter(first)
        for _ in range(stop):
            next(it)
        state = first.state_dict()
        torch.save(state, os.path.join(out_dir, f"state{rank}.pt"))
        resumed = make()
        resumed.load_state_dict(torch.load(os.path.join(out_dir, f"state{rank}.pt"), weights_only=True))
        rest = [(b["sample_indices"].tolist(), b["labels"].tolist()) for b in resumed]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": full.rank, "world": full.world_size, "steps": steps, "rest": rest, "stop": stop}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_gloo(tmp_path):
    pytest.importorskip("pyarrow")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    mp.spawn(_worker, args=(2, str(tmp_path / "pg"), str(tmp_path)), nprocs=2, join=True)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"]) for r in res] == [(0, 2), (1, 2)]
    assert len(res[0]["steps"]) == len(res[1]["steps"]) > 4
    seen = [{i for idx, _ in r["steps"] for i in idx} for r in res]
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) > 150  # most of the 200 proteins (tail batches dropped)
    for r in res:
        assert r["rest"] == r["steps"][r["stop"]:]
