"""The ESM-2 recipe's training step with its encoder layers graphed
(train.cuda_graphs=true) against the same recipe eager, at fixed length.

bench_esm2.py's seqfusegraph_*_fixed rows time the model alone (forward,
backward, optimizer) with SeqfuseEsmModel.graph_layers; this script times
what a user of the recipe gets: recipes/esm2's own train() (its loader,
forward_loss, gradient clipping, FusedAdamW, LR schedule and metric
logging), run in this process once per (precision, graphs) pair on the same
config, data.fixed_length=true and data.packed=false (every batch
[micro_batch_tokens // 1024, 1024], no padding).  The step time is the
recipe's own logged step_time_ms over the windows after the first
(--log-interval steps each; the first window holds the one-off costs), so
steady state over the later windows' steps.  The graphs are captured before
step 1, outside every timed window (the capture time is in the recipe's log).

    python benchmarks/esm2/bench_recipe_graphs.py                  # 650M, bf16 and fp8_delayed, ~80 s on an H200
    python benchmarks/esm2/bench_recipe_graphs.py --size 35M --steps 12 --log-interval 4   # quick look

Writes benchmarks/results/esm2_recipe_graphs.json (run metadata: commit,
versions, command).
"""
import argparse
import gc
import logging
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402,F401  (puts benchmarks/ and recipes/esm2 on sys.path)

from harness import Table  # noqa: E402


def run_recipe(size, recipe, graphs, args, path):
    from esm2_recipe.config import load_config
    from esm2_recipe.trainer import train

    overrides = [f"model.size={size}", "data.fixed_length=true", "data.packed=false", f"data.path={path}",
                 "data.max_length=1024", f"data.micro_batch_tokens={args.tokens}", "data.val_batches=1",
                 f"precision.recipe={recipe}", f"train.cuda_graphs={str(graphs).lower()}", f"train.steps={args.steps}",
                 f"train.log_interval={args.log_interval}", "train.eval_interval=0", "train.warmup_steps=2",
                 "logging.progress_bar=false", "device=cuda"]
    out = train(load_config("650M", overrides), "fsdp2")
    gc.collect()  # the model, its graphs and their memory pool go before the next run
    torch.cuda.empty_cache()
    later = out["rates"][1:]
    if not later:
        raise SystemExit("bench_recipe_graphs: --steps must cover at least two --log-interval windows")
    mean = lambda key: sum(r[key] for r in later) / len(later)  # noqa: E731
    return dict(step_ms=mean("step_time_ms"), tokens_per_s=mean("tokens_per_s"), mfu=mean("mfu_measured"),
                peak_mem_gib=max(r["peak_mem_gib"] for r in out["rates"]), windows=len(later),
                final_loss=out["history"]["loss"][-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="650M")
    p.add_argument("--recipes", default="bf16,fp8_delayed")
    p.add_argument("--tokens", type=int, default=16384, help="data.micro_batch_tokens (16 x 1024)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--data", default=os.path.join(common.ROOT, "recipes", "esm2", "data", "subset"),
                   help="data.path (default: the committed UniProt subset, 57 batches of 16 x 1024 per epoch: "
                        "the step time does not depend on which proteins, and it tokenizes in a moment)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_recipe_graphs: needs a CUDA GPU")
    # the recipe's own log lines (capture time, each window's rates), as its command line shows them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    path = args.data
    table = Table("esm2_recipe_graphs", ["size", "recipe", "graphs", "step_ms", "tokens_per_s", "mfu",
                                         "peak_mem_gib", "vs_eager", "windows", "final_loss"])
    for recipe in args.recipes.split(","):
        eager = None
        for graphs in (False, True):
            r = run_recipe(args.size, recipe, graphs, args, path)
            eager = eager or r["step_ms"]
            table.add(size=args.size, recipe=recipe, graphs="on" if graphs else "off", vs_eager=eager / r["step_ms"],
                      **r)
    table.save(extra={"args": vars(args), "data": path, "method": (
        "recipes/esm2 train() in this process, data.fixed_length=true, data.packed=false, max_length 1024; "
        "step_ms: mean of the recipe's logged step_time_ms over the windows after the first; graphs captured "
        "before step 1 (outside the windows)")})


if __name__ == "__main__":
    main()
