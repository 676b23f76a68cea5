"""What each FP8 weight-cache layout costs and saves in training
(seqfuse.quantization.set_weight_transpose_cache and
set_weight_rowwise_cache): FP8 delayed-scaling training steps with

  both        W and W^T cast together and both kept until the weight changes
              (set_weight_rowwise_cache(True))
  transpose   W^T kept, W written for each forward into a transient buffer
              (the default)
  rowwise     W kept, W^T made in each backward from its bytes
              (set_weight_transpose_cache(False))

in one process on the same model and inputs: interleaved rounds of
pipelined steps (median reported) and each mode's peak memory over two
steps.

Rows: esm650 (33 seqfuse.pytorch.TransformerLayer at ESM-2 650M's shape,
hidden 1,280, FFN 5,120, 20 heads, 16 x 1,024 tokens fixed length, sbhd, no
mask, no dropout), llama1b (transformers' Llama 3.2 1B shape after
seqfuse.hf.accelerate with DelayedScaling, 1 x 4,096 tokens), tiny (a CPU
smoke test).  Run on the GPU machine:
    python benchmarks/bench_fp8_weight_transpose.py --rows esm650,llama1b
Writes results/fp8_weight_transpose.json (--out another name).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf"))

from harness import Table  # noqa: E402

import seqfuse.pytorch as te  # noqa: E402
from seqfuse.common.recipe import DelayedScaling  # noqa: E402
from seqfuse.quantization import set_weight_rowwise_cache, set_weight_transpose_cache  # noqa: E402

#: mode -> (set_weight_transpose_cache's setting, set_weight_rowwise_cache's)
MODES = {"both": (True, True), "transpose": (True, False), "rowwise": (False, False)}


def layer_stack(device, layers, hidden, ffn, heads, seq, batch):
    stack = torch.nn.Sequential(*[te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                                      self_attn_mask_type="no_mask", params_dtype=torch.bfloat16,
                                                      device=device) for _ in range(layers)])
    x = torch.randn(seq, batch, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-5, fused=device.type == "cuda")
    recipe = DelayedScaling()

    def step():
        with te.autocast(recipe=recipe):
            y = stack(x)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def llama1b(device):
    import bench_accelerate as B

    base, family = B.build_base("llama1b", None, device.type)
    model, _ = B.prepare("seqfuse_fp8_delayed", base, family)
    model.train()
    ids = torch.randint(0, base.config.vocab_size, (1, 4096), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


ROWS = {"esm650": lambda d: layer_stack(d, 33, 1280, 5120, 20, 1024, 16), "llama1b": llama1b,
        "tiny": lambda d: layer_stack(d, 2, 128, 256, 4, 32, 2)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(step, device, rounds, steps, modes=tuple(MODES)):
    """({mode: [ms per step of each round]}, {mode: peak GiB over two steps})."""
    times, peak = {m: [] for m in modes}, {}
    previous = set_weight_transpose_cache(True), set_weight_rowwise_cache(False)

    def use(mode):
        set_weight_transpose_cache(MODES[mode][0])
        set_weight_rowwise_cache(MODES[mode][1])

    try:
        for mode in modes:  # warm each mode; its peak over two steps after the warm-up
            use(mode)
            for _ in range(3):
                step()
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step()
            step()
            sync(device)
            peak[mode] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        for _ in range(rounds):
            for mode in modes:
                use(mode)
                step()  # the first step of a mode re-casts (the weights moved)
                sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                sync(device)
                times[mode].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        set_weight_transpose_cache(previous[0])
        set_weight_rowwise_cache(previous[1])
    return times, peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="esm650,llama1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="fp8_weight_transpose")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    table = Table(args.out, ["row", "mode", "ms", "gib", "time_vs_both", "gib_vs_both"])
    for name in args.rows.split(","):
        times, peak = measure(ROWS[name](device), device, args.rounds, args.steps)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        for mode in MODES:
            print(f"{name} {mode}: step ms {['%.2f' % t for t in times[mode]]}", flush=True)
            table.add(row=name, mode=mode, ms=med[mode], gib=peak[mode], time_vs_both=med[mode] / med["both"],
                      gib_vs_both=peak[mode] - peak["both"] if device.type == "cuda" else float("nan"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table.save({"note": "FP8 delayed training step, median of --rounds interleaved rounds of --steps pipelined "
                        "steps; modes (the module note): both = W and W^T kept, transpose = W^T kept and W "
                        "transient (the default), rowwise = set_weight_transpose_cache(False); time_vs_both = "
                        "ms / both's ms; gib_vs_both = peak GiB - both's; peaks over two steps"})


if __name__ == "__main__":
    main()
