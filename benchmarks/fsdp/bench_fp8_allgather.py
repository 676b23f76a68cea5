"""FSDP2 with and without the FP8 weight all-gather (seqfuse.distributed.
enable_fp8_all_gather) on two GPUs: tokens/s and the bytes FSDP2 all-gathers
per step, at ESM-2 650M and Llama 3 1B layer shapes.

A model is LAYERS seqfuse TransformerLayers of the shape (ESM-2 650M: hidden
1280, FFN 5120, 20 heads, LayerNorm, GELU, biases, no mask, 16 x 1024 tokens
per GPU; Llama 3 1B: hidden 2048, FFN 8192, 32 heads / 8 KV groups, RMSNorm,
SwiGLU, no biases, causal, 2 x 4096 tokens per GPU; QKV fused in one weight,
as seqfuse.hf's ESM-2 and Llama build it), bf16 parameters, FSDP2
as the recipes shard it (recipes/recipe_common/fsdp.py shard_model: one unit
per layer, reshard after forward, float32 reduce-scatter), fused AdamW.
A step is forward, backward and the optimizer step.  Rows per shape:

  bf16              FSDP2, no FP8
  fp8 <recipe>      FSDP2 with FP8 autocast, weights gathered in bf16 and cast
                    by each layer at every forward
  fp8 <recipe> +ag  the same with the FP8 all-gather (the shards cast before
                    the gather, the gathered FP8 weight used as is)

Each row: the median over ROUNDS rounds of STEPS steps, timed with CUDA events
on every rank, the slowest rank taken; 5 warm-up steps first.  tokens/s is
the whole job's (2 GPUs).  gathered MB/step: the bytes of FSDP2's
all-gathers in one step as seen by one rank's output buffers (counted by
wrapping torch.distributed's all-gather calls during one untimed step);
reduce MB/step likewise for the reduce-scatters.  Peak memory per GPU.
Writes benchmarks/results/fsdp_fp8_allgather.json (rank 0).  About 60-90 s
on two H200s after the build with the defaults.

    torchrun --nproc-per-node 2 benchmarks/fsdp/bench_fp8_allgather.py \\
        [--shapes esm2_650m,llama_1b] [--layers 8] [--recipe delayed|current|block]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: harness
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from harness import CollectiveBytes, Table, init_torchrun, ranks_step_ms  # noqa: E402

import seqfuse.pytorch as te  # noqa: E402
from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling  # noqa: E402
from seqfuse.distributed import end_process_group, enable_fp8_all_gather, gathered_bytes  # noqa: E402
from seqfuse.optim import FusedAdamW  # noqa: E402
from recipe_common.fsdp import shard_model  # noqa: E402

SHAPES = {
    "esm2_650m": dict(hidden=1280, ffn=5120, heads=20, groups=20, norm="LayerNorm", act="gelu", bias=True,
                      mask="no_mask", batch=16, seq=1024),
    "llama_1b": dict(hidden=2048, ffn=8192, heads=32, groups=8, norm="RMSNorm", act="swiglu", bias=False,
                     mask="causal", batch=2, seq=4096),
}
DEVICE = "cuda"
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}


class Stack(torch.nn.Module):
    def __init__(self, s, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(s["hidden"], s["ffn"], s["heads"], num_gqa_groups=s["groups"], hidden_dropout=0.0,
                                attention_dropout=0.0, bias=s["bias"], activation=s["act"],
                                normalization=s["norm"], self_attn_mask_type=s["mask"],
                                attn_input_format="bshd", fuse_qkv_params=True, qkv_weight_interleaved=True,
                                params_dtype=torch.bfloat16, device=DEVICE)
            for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(shape_name, mode, recipe_name, args, world):
    s = SHAPES[shape_name]
    torch.manual_seed(0)
    model = Stack(s, args.layers)
    recipe = RECIPES[recipe_name]() if mode != "bf16" else None
    if mode == "fp8+ag":
        enable_fp8_all_gather(model, recipe)
    shard_model(model, list(model.layers), reshard_after_forward=True, reduce_dtype="float32",
                prefetch=args.prefetch)
    opt = FusedAdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(s["batch"], s["seq"], s["hidden"], device=DEVICE, dtype=torch.bfloat16,
                    requires_grad=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()

    cuda = DEVICE == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize()
    with CollectiveBytes() as wire:
        step()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ms = ranks_step_ms(step, args.steps, args.rounds)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    tokens = s["batch"] * s["seq"] * world
    row = dict(shape=shape_name, mode=mode if mode == "bf16" else f"fp8 {recipe_name}" + (" +ag" if mode == "fp8+ag" else ""),
               layers=args.layers, ms_per_step=ms, tokens_per_s=tokens / ms * 1e3,
               gathered_mb_per_step=wire.total(wire.gathers) / 1e6, gather_dtypes=wire.dtype_names(wire.gathers),
               reduce_mb_per_step=wire.total(wire.scatters) / 1e6, reduce_dtypes=wire.dtype_names(wire.scatters),
               model_gather_mb=gathered_bytes(model) / 1e6, peak_gib=peak)
    del model, opt, x
    if cuda:
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="esm2_650m,llama_1b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--recipe", default="delayed", choices=sorted(RECIPES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=1, help="shard_model's explicit prefetch (layers)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU and gloo, 1 layer of hidden 256, 1 x 64 tokens, nothing saved: checks the "
                         "script runs")
    args = ap.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        args.layers = 1
        for s in SHAPES.values():  # the layer's structure at a size the CPU reference runs in seconds
            s.update(hidden=256, ffn=512, heads=4, groups=4 if s["groups"] == s["heads"] else 2, batch=1, seq=64)
    rank, world, _ = init_torchrun("bench_fp8_allgather.py", cpu=args.smoke)
    table = Table("fsdp_fp8_allgather", ["shape", "mode", "layers", "ms_per_step", "tokens_per_s",
                                         "gathered_mb_per_step", "gather_dtypes", "reduce_mb_per_step",
                                         "reduce_dtypes", "peak_gib"])
    ok = False
    try:
        for shape in args.shapes.split(","):
            if shape not in SHAPES:
                raise ValueError(f"--shapes: unknown shape {shape!r}; known: {sorted(SHAPES)}")
            base = None
            for mode in ("bf16", "fp8", "fp8+ag"):
                row = run(shape, mode, args.recipe, args, world)
                if mode == "bf16":
                    base = row["tokens_per_s"]
                row["vs_bf16"] = row["tokens_per_s"] / base
                if rank == 0:
                    table.add(**row)
        if rank == 0 and not args.smoke:
            table.save(extra={"world_size": world, "args": vars(args)})
        elif rank == 0:
            print(table.text())
        ok = True
    finally:
        end_process_group(ok)


if __name__ == "__main__":
    main()
