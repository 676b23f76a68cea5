"""What LayerNormMLP's recompute_activation trades at ESM-2 650M's step: the
activation not kept for the backward (bf16: the GELU output; FP8: its
transposed FP8 copy, made again in the backward) against the time of making
it again.  16 x 1,024 tokens at fixed length (random tokens: a trade
measurement of the option, not a model claim), seqfuse's eager layers, torch
AdamW (fused), 3 warm-up and 10 timed steps, step time and peak memory.

One row per process, so no row's peak memory holds what an earlier row
left; each run appends its row to --out (JSON lines):

    for p in fp8 bf16; do for r in kept remade; do
      python3 benchmarks/esm2/probe_recompute_activation.py $p $r --out rows.jsonl; done; done
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "python"))

import seqfuse.pytorch as te  # noqa: E402
from seqfuse.common.recipe import DelayedScaling  # noqa: E402
from seqfuse.hf.esm import SeqfuseEsmForMaskedLM  # noqa: E402
from seqfuse.hf.esm_config import esm2_config  # noqa: E402


def row(fp8, remake, steps=10, warm=3):
    torch.manual_seed(0)
    model = SeqfuseEsmForMaskedLM(esm2_config("650M")).to(device="cuda", dtype=torch.bfloat16)
    for layer in model.esm.encoder.layers:
        layer.layernorm_mlp.recompute_activation = remake
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(4, 24, (16, 1024), device="cuda", generator=gen)
    recipe = DelayedScaling() if fp8 else None

    def step():
        with te.autocast(enabled=fp8, recipe=recipe):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1e3
    return dict(fp8=fp8, recompute_activation=remake, step_ms=ms, tokens_per_s=16 * 1024 / ms * 1e3,
                peak_gib=torch.cuda.max_memory_allocated() / 2**30, loss=float(loss))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("precision", choices=["fp8", "bf16"], help="fp8: DelayedScaling under autocast")
    ap.add_argument("activation", choices=["kept", "remade"], help="remade: recompute_activation=True")
    ap.add_argument("--out", required=True, help="JSON-lines file the row is appended to")
    args = ap.parse_args()
    r = row(args.precision == "fp8", args.activation == "remade")
    r.update(commit=os.environ.get("SEQFUSE_GIT_COMMIT"), torch=torch.__version__,
             device=torch.cuda.get_device_name(), command=" ".join(sys.argv))
    print(json.dumps(r))
    with open(args.out, "a") as f:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
