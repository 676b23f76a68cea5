"""ESM-2 convergence: Hugging Face bf16 vs seqfuse bf16 vs seqfuse FP8 on real
UniProt proteins, same initial weights, same samples and masks, same
optimizer settings; loss curves plotted together.

Every run trains ``--steps`` optimizer steps of ``--tokens`` tokens from the
recipe's packed MLM batches (seqfuse runs them packed; HF gets the very same
samples and masks re-laid as a padded batch).  Numerics kept comparable:
  * hf_bf16: EsmForMaskedLM (sdpa) with fp32 parameters under
    torch.autocast(bfloat16) and torch AdamW (fused): what HF's Trainer does
    with bf16=True;
  * seqfuse_bf16 / seqfuse_fp8_*: bf16 parameters with FusedAdamW's fp32
    master weights, FP8 recipes under seqfuse's autocast.
Linear warm-up then cosine decay, gradient clipping at 1.0.  Validation
loss every ``--eval-every`` steps on the first ``--val-batches`` batches of
the validation split (same for every run).

Bound (stated, checked): the final validation loss of each seqfuse run is
within ``--bound`` nats (default 0.05) of HF bf16's, and within 2 % of it.

JSON: benchmarks/results/esm2_convergence.json, PNG esm2_convergence.png.
Default 35M x 1500 steps x 16k tokens: about 3 minutes for the three runs on
one H200.  CPU smoke test: --size tiny --device cpu --steps 5 --tokens 1024.
"""
import argparse
import json
import math
import os
import time

from common import (build_hf, build_seqfuse, data_dir, fp8_recipe, forward_loss, make_batches,
                    packed_to_padded)

import torch  # noqa: E402
from harness import RESULTS, Table  # noqa: E402


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def run(name, train_batches, val_batches, args, device):
    from seqfuse.pytorch import autocast

    impl, recipe_name = name.split("_", 1)
    recipe = fp8_recipe(recipe_name)
    cuda = device.type == "cuda"
    if impl == "hf":
        model = build_hf(args.size, device, torch.float32, seed=args.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01, fused=cuda)

        def fwd(b):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                return forward_loss(model, packed_to_padded(b), device)
    else:
        from seqfuse.optim import FusedAdamW, clip_grad_norm_  # noqa: F401

        model = build_seqfuse(args.size, device, torch.bfloat16 if cuda else torch.float32, seed=args.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = FusedAdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

        def fwd(b):
            with autocast(enabled=recipe is not None, recipe=recipe):
                return forward_loss(model, b, device)

    clip = torch.nn.utils.clip_grad_norm_ if impl == "hf" else __import__("seqfuse.optim", fromlist=["x"]).clip_grad_norm_

    def evaluate():
        model.eval()
        tot = n = 0.0
        with torch.no_grad():
            for b in val_batches:
                k = int((b["labels"] != -100).sum())
                tot += float(fwd(b)) * k
                n += k
        model.train()
        return tot / max(n, 1)

    losses, val = [], []
    model.train()
    t0 = time.perf_counter()
    for step, b in enumerate(train_batches):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = fwd(b)
        loss.backward()
        clip(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if (step + 1) % args.eval_every == 0 or step + 1 == len(train_batches):
            val.append((step + 1, evaluate()))
            print(f"  {name} step {step + 1}: train {float(losses[-1]):.4f} val {val[-1][1]:.4f}", flush=True)
    losses = [float(x) for x in losses]
    seconds = time.perf_counter() - t0
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"train_loss": losses, "val": val, "seconds": seconds}


def smooth(xs, w):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="35M")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--runs", default="hf_bf16,seqfuse_bf16,seqfuse_fp8_delayed")
    p.add_argument("--bound", type=float, default=0.05, help="max |final val loss - HF's| in nats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="esm2_convergence")
    args = p.parse_args()
    device = torch.device(args.device)

    from seqfuse.data import load_sequences

    d = data_dir(args.data)
    _, train_seqs = load_sequences(os.path.join(d, "train.parquet"))
    _, val_seqs = load_sequences(os.path.join(d, "validation.parquet"))
    train_b = make_batches(train_seqs, args.steps, tokens=args.tokens, max_length=args.max_length, seed=args.seed)
    from seqfuse.data import EsmTokenizer, build_mlm_loader

    tok = EsmTokenizer()
    vl = build_mlm_loader(val_seqs, tok, max_tokens=args.tokens, max_length=args.max_length, pad_to_multiple_of=16,
                          evaluation=True)
    val_b = [b for _, b in zip(range(args.val_batches), vl)]
    real_tokens = sum(int(b["num_tokens"]) for b in train_b)
    print(f"[convergence] ESM-2 {args.size}, {args.steps} steps x ~{args.tokens} tokens "
          f"({real_tokens / 1e6:.1f}M real tokens) on {d}; runs {args.runs}", flush=True)

    results = {}
    for name in args.runs.split(","):
        results[name] = run(name, train_b, val_b, args, device)

    ref = results.get("hf_bf16")
    table = Table(args.out, ["run", "final_val_loss", "diff_vs_hf", "rel_diff_pct", "final_train_loss_avg50",
                             "seconds", "within_bound"])
    for name, r in results.items():
        fv = r["val"][-1][1]
        row = dict(run=name, final_val_loss=fv, final_train_loss_avg50=sum(r["train_loss"][-50:]) / len(r["train_loss"][-50:]),
                   seconds=r["seconds"])
        if ref is not None and name != "hf_bf16":
            hv = ref["val"][-1][1]
            row["diff_vs_hf"] = fv - hv
            row["rel_diff_pct"] = 100.0 * (fv - hv) / hv
            row["within_bound"] = abs(fv - hv) <= args.bound and abs(fv - hv) <= 0.02 * hv
        table.add(**row)
    table.save(extra={"size": args.size, "steps": args.steps, "tokens_per_step": args.tokens, "lr": args.lr,
                      "bound_nats": args.bound, "data": d,
                      "curves": {k: {"train_loss": v["train_loss"], "val": v["val"]} for k, v in results.items()}})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = max(1, args.steps // 50)
    for name, r in results.items():
        line, = ax.plot(range(1, len(r["train_loss"]) + 1), smooth(r["train_loss"], w), label=f"{name} train", lw=1)
        xs, ys = zip(*r["val"])
        ax.plot(xs, ys, "o--", color=line.get_color(), label=f"{name} val", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("MLM loss (nats)")
    ax.set_title(f"ESM-2 {args.size} on UniProt: HF bf16 vs seqfuse (smoothed over {w} steps)")
    ax.legend()
    fig.tight_layout()
    png = os.path.join(RESULTS, f"{args.out}.png")
    fig.savefig(png, dpi=120)
    print(f"(plot {os.path.relpath(png)})")
    bad = [r["run"] for r in table.rows if r.get("within_bound") is False]
    print("convergence bound: " + ("PASS" if not bad else f"FAIL for {bad}") +
          f" (|final val loss - HF bf16| <= {args.bound} nats and <= 2 %)")
    print(json.dumps({r["run"]: r.get("final_val_loss") for r in table.rows}))


if __name__ == "__main__":
    main()
