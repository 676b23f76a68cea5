"""Host work per layer step with the FP8 weight cache keeping W^T alone
(the default: set_weight_rowwise_cache(False)) against keeping W and W^T
(True), seqfuse's kernels stubbed: bench_fp8_host.py's layer (LayerNormLinear
+ LayerNormMLP + Linear, 16 tokens, hidden 128, weights updated every step)
under each per-tensor and block recipe, the two settings and bf16
alternated in one process (--rounds rounds of --iters iterations each, the
best of each), and the ratios to bf16.  What the lean layout costs the host:
the forward operand's transient buffer and its own Float8Tensor per weight
and step.
"""
import argparse
import time

import torch

import bench_fp8_host as host
from harness import Table


def main(argv=None):
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
    from seqfuse.quantization import set_weight_rowwise_cache

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="ab_weight_rowwise_cache")
    args = p.parse_args(argv)
    table = Table(args.out, ["recipe", "lean_us", "keep_us", "bf16_us", "lean_vs_bf16", "keep_vs_bf16"])
    previous = set_weight_rowwise_cache(False)
    try:
        for name, recipe in (("delayed", DelayedScaling()), ("current", Float8CurrentScaling()),
                             ("block", Float8BlockScaling())):
            runs = {"lean": host.layer_runner(recipe, torch.device("cpu"), True),
                    "keep": host.layer_runner(recipe, torch.device("cpu"), True),
                    "bf16": host.layer_runner(None, torch.device("cpu"), True)}
            best = dict.fromkeys(runs, float("inf"))
            with host.stubbed_kernels():
                for r in range(args.rounds):
                    for k in (("lean", "keep", "bf16") if r % 2 else ("keep", "bf16", "lean")):
                        set_weight_rowwise_cache(k == "keep")
                        runs[k](2)
                        t0 = time.perf_counter()
                        runs[k](args.iters)
                        best[k] = min(best[k], (time.perf_counter() - t0) / args.iters * 1e6)
            table.add(recipe=name, lean_us=best["lean"], keep_us=best["keep"], bf16_us=best["bf16"],
                      lean_vs_bf16=best["lean"] / best["bf16"], keep_vs_bf16=best["keep"] / best["bf16"])
    finally:
        set_weight_rowwise_cache(previous)
    table.save({"note": "kernels stubbed, development machine's CPU; best of --rounds alternated rounds"})


if __name__ == "__main__":
    main()
