"""The Llama 3 recipe under context parallelism (recipes/llama3/train_fsdp2_cp.py,
config L0_sanity_cp) on the CPU over gloo, on the committed lambda-phage
subset.

Claims: (1) CPBatches cuts a batch so that the CP ranks' shares together
hold every token once, with the next-token targets of the full sequences
(packed with uneven lengths and under FP8 padding, and padded rows);
(2) on two processes with cp_size=2 (one dp rank, both ranks one CP group)
the run trains (the loss falls well below an untrained model's ln 10), a run
resumed from its step-4 checkpoint logs the uninterrupted run's losses
bit for bit, and the Hugging Face export (gathered from the FSDP2 shards)
loads in transformers' LlamaForCausalLM with the checkpoint's weights, and
the same run without CP (cp_size=1, one process, the same batches) logs
the same losses (step 1 within float32 rounding, later steps within 1e-4
after Adam updates); (3) the other scripts refuse cp_size > 1, and a world that is not a
multiple of cp_size is refused naming cp_size.

The two-process runs are one start of forkserver workers (torch, seqfuse and
the recipe preloaded) calling the recipe's train() with torchrun's
environment variables set, so the runs pay no interpreter start.  The real
command line (torchrun train_fsdp2_cp.py --config-name L0_sanity_cp
cp_size=2) runs in the cuda-marked test on two GPUs.
"""
import math
import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from helpers import free_port, run_workers
from recipe_checks import CAUSAL_TINY, LN10, recipe_path  # noqa: E402
from recipe_checks import losses as _losses  # noqa: E402
from recipe_checks import torchrun  # noqa: E402

RECIPE = recipe_path("llama3")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from llama3_recipe import trainer  # noqa: E402
from llama3_recipe.config import ConfigError, load_config  # noqa: E402
from llama3_recipe.context_parallel import CPBatches  # noqa: E402
from recipe_common import checkpoint as ckpt  # noqa: E402

TINY = CAUSAL_TINY + ["train.warmup_steps=2"]


# ------------------------------------------------------------ the batch cut, in this process
def _packed_batch():
    from seqfuse.data.collate import PackedTHDCollator

    g = torch.Generator().manual_seed(3)
    samples = [{"input_ids": torch.randint(4, 10, (n,), generator=g)} for n in (9, 4, 7)]
    for s in samples:
        s["labels"] = s["input_ids"].clone()
    return PackedTHDCollator(pad_token_id=0, pad_to_multiple_of=16)(samples)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("multiple", [None, 16])
def test_cp_batches_packed_cover_every_token_once(cp, multiple):
    from seqfuse.hf.llama import shift_labels

    batch = _packed_batch()  # 20 real tokens + the collator's 12-token FP8 padding segment
    shares = [CPBatches([batch], cp, r, 0, multiple).share(batch) for r in range(cp)]
    cu = shares[0]["cu_seqlens"]
    assert all(torch.equal(s["cu_seqlens"], cu) for s in shares)
    lengths = (cu[1:] - cu[:-1]).tolist()
    assert all(n % (2 * cp) == 0 for n in lengths), lengths
    local = [s["input_ids"].numel() for s in shares]
    assert len(set(local)) == 1 and sum(local) == int(cu[-1])
    if multiple:
        assert local[0] % multiple == 0, local
    assert sum(s["num_tokens"] for s in shares) == 20
    assert shares[0]["seq_lengths"] == [9, 4, 7]
    # the targets: every real token's next token once, over all ranks
    want = shift_labels(batch["labels"], batch["cu_seqlens"])
    got = torch.cat([s["labels"] for s in shares])
    assert sorted(got[got != -100].tolist()) == sorted(want[want != -100].tolist())
    # rank 0's first chunk of sequence 0 is that sequence's start, targets shifted
    c0 = lengths[0] // (2 * cp)
    assert torch.equal(shares[0]["input_ids"][:c0], batch["input_ids"][:c0])
    assert torch.equal(shares[0]["labels"][:c0], want[:c0])


def test_cp_batches_padded_rows():
    ids = torch.tensor([[2, 5, 6, 7, 8, 3], [2, 9, 3, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[6], [3]])).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    shares = [CPBatches([batch], 2, r, 0).share(batch) for r in range(2)]
    assert all(s["input_ids"].shape == (2, 4) for s in shares)  # rows padded 6 -> 8, cut in two
    assert "attention_mask" not in shares[0]
    assert shares[0]["num_tokens"] + shares[1]["num_tokens"] == 9
    # rank 0 holds columns 0,1 and 6,7; rank 1 columns 2..5
    assert shares[0]["labels"][0].tolist() == [5, 6, -100, -100]
    assert shares[1]["labels"][0].tolist() == [7, 8, 3, -100]
    assert shares[1]["labels"][1].tolist() == [-100, -100, -100, -100]


def test_other_scripts_refuse_cp_and_the_schema_takes_it():
    cfg = load_config("L0_sanity_cp", TINY)
    assert cfg.cp_size == 2 and cfg.cp_comm_type == "p2p"
    with pytest.raises(ConfigError, match="cp_size=2: context parallelism runs in train_fsdp2_cp.py"):
        trainer.check_run(cfg, torch.device("cpu"))
    trainer.check_run(cfg, torch.device("cpu"), context_parallel=True)
    with pytest.raises(ConfigError, match="cp_comm_type"):
        load_config("L0_sanity_cp", ["cp_comm_type=a2a"])
    with pytest.raises(ConfigError, match="cp_size"):
        load_config("L0_sanity_cp", ["cp_size=0"])
    from llama3_recipe.context_parallel import ContextParallelSpec

    with pytest.raises(ValueError, match="cp_size=2: the number of processes \\(1\\)"):
        ContextParallelSpec()._layout(cfg)  # one process, no group


# ------------------------------------------------------------ two processes
def _worker(rank, world, port, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LLAMA3_KEEP_PG="1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from llama3_recipe.config import load_config as load
    from llama3_recipe.context_parallel import train

    try:
        a, b = os.path.join(out_dir, "a"), os.path.join(out_dir, "b")
        base = TINY + ["train.steps=8", "checkpoint.interval=4", "checkpoint.keep_last=3"]
        first = train(load("L0_sanity_cp", base + [f"checkpoint.dir={a}", f"logging.metrics_jsonl={a}.jsonl",
                                                   f"checkpoint.export_dir={out_dir}/hf"]))
        second = train(load("L0_sanity_cp", base + [f"checkpoint.dir={b}", f"logging.metrics_jsonl={b}.jsonl",
                                                    f"checkpoint.resume_from={a}/step_00000004"]))
        if rank == 0:
            torch.save({"first": first["history"], "second": second["history"]}, os.path.join(out_dir, "runs.pt"))
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "seqfuse", "seqfuse.hf",
                                                                      "transformers"])
    d = tmp_path_factory.mktemp("llama3_cp")
    run_workers(_worker, (2, free_port(), str(d)), 2, "forkserver", "L0_sanity_cp workers (2 processes)",
                timeout=300)
    return d


def test_l0_sanity_cp_trains_resumes_bit_equal_and_exports(cp_runs):
    from transformers import LlamaForCausalLM

    d = cp_runs
    runs = torch.load(d / "runs.pt")
    h = runs["first"]
    assert h["step"] == list(range(1, 9)) and all(math.isfinite(v) for v in h["loss"])
    assert h["loss"][0] > LN10 - 0.3, h["loss"]  # starts untrained ...
    assert max(h["loss"][-2:]) < h["loss"][0] - 0.4, h["loss"]  # ... and learns
    assert [s for s, _ in ckpt.list_checkpoints(str(d / "a"))] == [4, 8]
    names = set(os.listdir(ckpt.latest_checkpoint(str(d / "a"))))
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata", "manifest.json"} <= names
    full, resumed = _losses(d / "a.jsonl"), _losses(d / "b.jsonl")
    assert sorted(resumed) == [5, 6, 7, 8], resumed
    for s in (5, 6, 7, 8):
        assert resumed[s] == full[s], (s, resumed[s], full[s])  # bit for bit

    # the same run without CP on one process (cp_size=1: the same batches, the loader's dp rank 0 of 1)
    from llama3_recipe.context_parallel import train

    one = d / "one.jsonl"
    train(load_config("L0_sanity_cp", TINY + ["train.steps=8", "cp_size=1", f"logging.metrics_jsonl={one}"]))
    plain = _losses(one)
    assert abs(plain[1] - full[1]) <= 1e-5 * full[1], (plain[1], full[1])  # before any update: rounding only
    for s in range(2, 9):
        assert abs(plain[s] - full[s]) <= 1e-4 * full[s], (s, plain[s], full[s])  # (seen: <= 1e-5)

    hf = LlamaForCausalLM.from_pretrained(str(d / "hf")).eval()
    assert hf.config.num_hidden_layers == 2 and hf.config.vocab_size == 10
    import torch.distributed.checkpoint as dcp
    emb = {"model": {"model.embed_tokens.weight": torch.empty_like(hf.model.embed_tokens.weight)}}
    dcp.load(emb, checkpoint_id=ckpt.latest_checkpoint(str(d / "a")))
    assert torch.equal(emb["model"]["model.embed_tokens.weight"], hf.model.embed_tokens.weight)
    assert os.path.isfile(d / "hf" / "tokenizer.json")


# ------------------------------------------------------------ two GPUs, the real command line
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_l0_sanity_cp_two_gpus_nccl(tmp_path, comm):
    """torchrun --nproc_per_node 2 train_fsdp2_cp.py --config-name
    L0_sanity_cp cp_size=2 on two GPUs (NCCL, bf16): it trains (the loss
    falls), checkpoints, and exports a model transformers loads."""
    from transformers import LlamaForCausalLM

    jl = tmp_path / "m.jsonl"
    torchrun(os.path.join(RECIPE, "train_fsdp2_cp.py"),
             ["--config-name", "L0_sanity_cp", "cp_size=2", f"cp_comm_type={comm}", "device=cuda",
              "logging.progress_bar=false", "train.log_interval=5", f"logging.metrics_jsonl={jl}",
              f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.export_dir={tmp_path / 'hf'}"])
    losses = _losses(jl)
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]] - 0.3, losses
    assert LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).config.num_hidden_layers == 2
