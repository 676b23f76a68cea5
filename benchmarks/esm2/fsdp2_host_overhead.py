"""Host (CPU) time per training step that FSDP2 adds to seqfuse's ESM-2,
measured without GPUs and without communication: one process, torch's fake
process group (world size 2: every collective returns at once), a narrow
model with ESM-2 650M's 33 layers (hidden 64) on a few tokens, so the
kernels cost next to nothing and what is timed is Python, dispatch and
FSDP2's per-unit hooks, copies and DTensor bookkeeping.

Why: two GPUs only scale if the host issues a step faster than the GPUs run
it.  On one GPU seqfuse's modules already spend host time per layer; FSDP2
adds its own per unit (all-gather copy-in/out, reshard, pre/post-backward
hooks, reduce-scatter and the sharded-gradient DTensors).  If that sum
exceeds the GPU step (about 204 ms at 650M with 16k tokens on an H200) the
2-GPU step is host-bound, which bench_esm2.py --fsdp2 --profile then shows
as GPU idle gaps.  Settings are the --configs of bench_esm2.py (FSDP2 ones;
'plain' is the unwrapped model).  Steps of the settings are interleaved
(one step of each in turn) and the median reported, so a busy machine
skews them alike.

    PYTHONPATH=python python benchmarks/esm2/fsdp2_host_overhead.py
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def build(cfg, args):
    from bench_esm2 import fsdp2_config, shard_model
    from seqfuse.optim import FusedAdamW

    common.TINY = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                       intermediate_size=4 * args.hidden)
    model = common.build_seqfuse("tiny", torch.device("cpu"), torch.float32)
    if cfg != "plain":
        c = fsdp2_config(cfg, argparse.Namespace(reshard_after_forward=1, reduce_dtype="float32", prefetch=0,
                                                 layers_per_unit=1))
        if c["ddp"] or c["same"] or c["bal"]:
            raise ValueError(f"{cfg!r}: only FSDP2 wrapping settings are measured here (no ddp / same / bal)")
        shard_model(model, c)
    opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="plain,default,raf0,rbf16,pf1,g3,raf0+rbf16+g3")
    p.add_argument("--layers", type=int, default=33)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--recipe", default="bf16", choices=["bf16", "fp8_delayed", "fp8_current"],
                   help="precision recipe of every step (FP8 GEMMs are emulated on the CPU: a cost both "
                        "plain and FSDP2 pay, so compare the differences)")
    p.add_argument("--out", default="esm2_fsdp2_host")
    args = p.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness import Table

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    configs = args.configs.split(",")
    runs = {c: build(c, args) for c in configs}
    t = args.tokens
    ids = torch.randint(4, 24, (t,))
    cu = torch.tensor([0, t // 2, t], dtype=torch.int32)
    times = {c: [] for c in configs}
    import seqfuse.pytorch as te

    recipe = common.fp8_recipe(args.recipe)
    for i in range(args.warmup + args.steps):
        for c in configs:  # interleaved: a load spike hits every setting alike
            model, opt = runs[c]
            t0 = time.perf_counter()
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(input_ids=ids, labels=ids, cu_seqlens=cu, max_seqlen=t - t // 2).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= args.warmup:
                times[c].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    table = Table(args.out, ["config", "forward_ms", "backward_ms", "opt_ms", "step_ms", "vs_plain"])
    ref = None
    for c in configs:
        med = [1e3 * statistics.median(x[k] for x in times[c]) for k in range(4)]
        ref = med[3] if c == "plain" else ref
        table.add(config=c, forward_ms=med[0], backward_ms=med[1], opt_ms=med[2], step_ms=med[3],
                  vs_plain=med[3] / ref if ref else float("nan"))
    table.save(extra={"layers": args.layers, "hidden": args.hidden, "tokens": args.tokens, "steps": args.steps,
                      "recipe": args.recipe,
                      "what": "host ms per step (median), fake process group of 2, CPU, kernels ~free"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
