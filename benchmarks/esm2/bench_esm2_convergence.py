"""ESM-2 convergence: Hugging Face bf16 vs seqfuse bf16 vs seqfuse FP8 on real
UniProt proteins, same initial weights, same samples and masks, same
optimizer settings; loss curves plotted together, final losses compared
against a stated bound.

Every run trains ``--steps`` optimizer steps of ``--tokens`` tokens from the
recipe's packed MLM batches (seqfuse runs them packed; HF gets the very same
samples and masks re-laid as a padded batch).  Numerics kept comparable:
  * hf_bf16: EsmForMaskedLM (sdpa) with fp32 parameters under
    torch.autocast(bfloat16), torch AdamW (fused) and torch's clip: what
    HF's Trainer does with bf16=True;
  * seqfuse_bf16 / seqfuse_fp8_*: bf16 parameters with FusedAdamW's fp32
    master weights and seqfuse's clip_grad_norm_, FP8 recipes under
    seqfuse's autocast (token counts padded to 16 for FP8 GEMMs).
Linear warm-up then cosine decay to 10 %, gradient clipping at 1.0.  Train
loss logged every ``--log-every`` steps (mean over those steps); validation
loss every ``--eval-every`` steps and at the end, on the first
``--val-batches`` batches of the validation split (the same tokens and
masks for every run and every evaluation).

Bounds (stated, checked, printed PASS/FAIL): at the last step every run
reached, |val(seqfuse_bf16) - val(hf_bf16)| <= ``--bound`` nats (default
0.05) and |val(seqfuse_fp8_*) - val(seqfuse_bf16)| <= ``--fp8-bound``
(default 0.05); each seqfuse run is also compared with HF by the same bound.

Robust for a one-shot GPU run:
  * ``--time-budget S``: the whole script (data, models, runs, plot) aims to
    end within S seconds.  Each run gets a deadline from the time left,
    weighted by its expected cost (HF ``--hf-weight`` x a seqfuse run); a
    run that reaches it stops early, evaluates, and says so.  A run that
    stopped early caps the later runs at its step count, so the final
    losses are always compared at one step (reported with the planned
    step count).
  * a run that raises is recorded with its error and the others go on;
  * JSON and PNG are rewritten after every run, so a kill leaves the
    finished runs on disk.

JSON: benchmarks/results/esm2_convergence.json, PNG esm2_convergence.png.
H200, ESM-2 35M, five minutes for all three runs (expected: seqfuse
~30-40 steps/s at 8k tokens, HF ~2.5x slower; the budget trims the planned
2000 steps if the GPU is slower than that, and says so):
    python benchmarks/esm2/bench_esm2_convergence.py --size 35M --steps 2000 \\
        --tokens 8192 --time-budget 270
CPU smoke test: --size tiny --device cpu --steps 6 --tokens 1024 --eval-every 3

On two GPUs the runs can go at once, one process each, then be joined:
    CUDA_VISIBLE_DEVICES=1 python ... --runs hf_bf16 --out conv_hf &
    CUDA_VISIBLE_DEVICES=0 python ... --runs seqfuse_bf16 --out conv_bf16 & ...; wait
    python benchmarks/esm2/bench_esm2_convergence.py --merge conv_hf,conv_bf16,conv_fp8
(steps/s of runs sharing a GPU or the host are then not solo figures.)
"""
import argparse
import json
import math
import os
import time
import traceback

T_START = time.perf_counter()

from common import (build_hf, build_seqfuse, data_dir, fp8_recipe, forward_loss, make_batches,  # noqa: E402
                    packed_to_padded)

import torch  # noqa: E402
from harness import RESULTS, Table, train_steps  # noqa: E402

#: Seconds kept back per run still to start (model build, first-step warm-up,
#: final evaluation) and for the table and plot at the end.
RESERVE_PER_RUN_S = 8.0
RESERVE_END_S = 6.0


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def run(name, train_batches, val_batches, args, device, max_steps, deadline):
    """Train one configuration for at most ``max_steps`` steps or until the
    host clock passes ``deadline`` (perf_counter seconds; None: no limit)."""
    from seqfuse.pytorch import autocast

    impl, recipe_name = name.split("_", 1)
    recipe = fp8_recipe(recipe_name)
    cuda = device.type == "cuda"
    if impl == "hf":
        if recipe is not None:
            raise ValueError(f"run {name!r}: Hugging Face runs bf16 only")
        model = build_hf(args.size, device, torch.float32, seed=args.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01, fused=cuda)
        clip = torch.nn.utils.clip_grad_norm_
        padded_val = [packed_to_padded(b) for b in val_batches]

        def forward(b):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                return forward_loss(model, packed_to_padded(b), device)

        def forward_val(i):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                return forward_loss(model, padded_val[i], device)
    elif impl == "seqfuse":
        from seqfuse.optim import FusedAdamW, clip_grad_norm_

        model = build_seqfuse(args.size, device, torch.bfloat16 if cuda else torch.float32, seed=args.seed)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = FusedAdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
        clip = clip_grad_norm_

        def forward(b):
            with autocast(enabled=recipe is not None, recipe=recipe):
                return forward_loss(model, b, device)

        def forward_val(i):
            return forward(val_batches[i])
    else:
        raise ValueError(f"run {name!r}: expected hf_bf16 or seqfuse_<bf16|fp8_delayed|fp8_current|fp8_block>")

    def evaluate():
        model.eval()
        tot = torch.zeros((), dtype=torch.float64, device=device)
        n = 0
        with torch.no_grad():
            for i, b in enumerate(val_batches):
                k = int((b["labels"] != -100).sum())
                tot += forward_val(i).double() * k
                n += k
        model.train()
        return float(tot) / max(n, 1)

    val, logged = [], []

    def after_step(done, window):
        if window is not None:
            logged.append((done, window))
        if done % args.eval_every == 0 and done < max_steps:
            val.append((done, evaluate()))
            print(f"  {name} step {done}: val loss {val[-1][1]:.4f}", flush=True)

    model.train()
    losses, stopped_early, t0 = train_steps(name, train_batches[:max_steps], forward, opt, params, clip,
                                            lambda step: lr_at(step, args), args.log_every, deadline,
                                            after_step)
    steps_done = len(losses)
    if steps_done and (not val or val[-1][0] != steps_done):
        val.append((steps_done, evaluate()))
        print(f"  {name} step {steps_done}: val loss {val[-1][1]:.4f} (final)", flush=True)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    losses = [float(x) for x in losses]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    note = (f"stopped early by --time-budget at step {steps_done} of {max_steps}" if stopped_early else "")
    return {"train_loss": losses, "logged": logged, "val": val, "seconds": seconds, "steps_done": steps_done,
            "steps_per_s": steps_done / seconds if seconds > 0 else float("nan"), "peak_mem_gib": peak,
            "stopped_early": stopped_early, "note": note}


def smooth(xs, w):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def common_val_step(results):
    """The last validation step every finished run evaluated, or None."""
    sets = [set(s for s, _ in r["val"]) for r in results.values() if "error" not in r and r["val"]]
    if not sets:
        return None
    both = set.intersection(*sets)
    return max(both) if both else None


def val_at(r, step):
    return dict(r["val"]).get(step)


def compare(results, args):
    """Bound checks at the last common validation step: rows of
    {check, a, b, step, diff, bound, pass}."""
    step = common_val_step(results)
    checks = []
    if step is None:
        return step, checks
    ok = {k: r for k, r in results.items() if "error" not in r and val_at(r, step) is not None}

    def check(a, b, bound, what):
        if a in ok and b in ok:
            d = val_at(ok[a], step) - val_at(ok[b], step)
            checks.append({"check": what, "a": a, "b": b, "step": step, "diff": d, "bound": bound,
                           "pass": abs(d) <= bound})

    for name in ok:
        if name.startswith("seqfuse_"):
            check(name, "hf_bf16", args.bound, f"|val({name}) - val(hf_bf16)| <= {args.bound}")
        if name.startswith("seqfuse_fp8"):
            check(name, "seqfuse_bf16", args.fp8_bound, f"|val({name}) - val(seqfuse_bf16)| <= {args.fp8_bound}")
    return step, checks


def write_outputs(results, args, meta, final):
    """JSON table and PNG of what has finished so far (called after every run)."""
    step, checks = compare(results, args)
    table = Table(args.out, ["run", "steps_done", "val_at_common_step", "final_val_loss", "diff_vs_hf",
                             "final_train_loss_avg50", "steps_per_s", "seconds", "peak_mem_gib", "note", "error"])
    ref = results.get("hf_bf16")
    for name, r in results.items():
        if "error" in r:
            table.add(run=name, error=r["error"])
            continue
        row = dict(run=name, steps_done=r["steps_done"], steps_per_s=r["steps_per_s"], seconds=r["seconds"],
                   peak_mem_gib=r["peak_mem_gib"], note=r["note"])
        if r["val"]:
            row["final_val_loss"] = r["val"][-1][1]
        here = val_at(r, step) if step is not None else None
        if here is not None:
            row["val_at_common_step"] = here
            there = val_at(ref, step) if ref is not None and "error" not in ref else None
            if there is not None and name != "hf_bf16":
                row["diff_vs_hf"] = here - there
        tail = r["train_loss"][-50:]
        if tail:
            row["final_train_loss_avg50"] = sum(tail) / len(tail)
        table.add(**row)
    extra = dict(meta, common_val_step=step, checks=checks, complete=final,
                 all_pass=bool(checks) and all(c["pass"] for c in checks),
                 curves={k: {"train_loss": v.get("train_loss"), "logged": v.get("logged"), "val": v.get("val")}
                         for k, v in results.items() if "error" not in v})
    table.save(extra=extra)
    try:
        plot(results, args, step)
    except Exception as e:  # a plot must never cost the results
        print(f"[convergence] plot failed: {type(e).__name__}: {e}")
    return step, checks


def plot(results, args, step):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    done = {k: r for k, r in results.items() if "error" not in r and r["train_loss"]}
    longest = max((len(r["train_loss"]) for r in done.values()), default=1)
    w = max(1, longest // 50)
    for name, r in done.items():
        line, = ax.plot(range(1, len(r["train_loss"]) + 1), smooth(r["train_loss"], w), label=f"{name} train",
                        lw=1)
        if r["val"]:
            xs, ys = zip(*r["val"])
            ax.plot(xs, ys, "o--", color=line.get_color(), label=f"{name} validation", ms=4)
    if step is not None and step < args.steps:
        ax.axvline(step, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("MLM loss (nats)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title(f"ESM-2 {args.size} on UniProt, {args.tokens} tokens/step: HF bf16 vs seqfuse "
                 f"(train smoothed over {w} steps)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(RESULTS, f"{args.out}.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"(plot {os.path.relpath(png)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="35M", help="8M 35M 150M 650M, or tiny (CPU smoke test)")
    p.add_argument("--steps", type=int, default=2000, help="planned optimizer steps per run")
    p.add_argument("--tokens", type=int, default=8192, help="token budget per step (packed)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--runs", default="hf_bf16,seqfuse_bf16,seqfuse_fp8_delayed")
    p.add_argument("--bound", type=float, default=0.05, help="max |val(seqfuse) - val(HF)| in nats")
    p.add_argument("--fp8-bound", type=float, default=0.05, help="max |val(seqfuse FP8) - val(seqfuse bf16)|")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole script; runs stop early (and say so) to end within it")
    p.add_argument("--hf-weight", type=float, default=2.5,
                   help="expected time of the HF run relative to a seqfuse run (splits --time-budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="esm2_convergence")
    p.add_argument("--merge", default=None, metavar="NAME,NAME,...",
                   help="join finished runs saved under these result names (one --runs each) into --out")
    args = p.parse_args()
    if args.merge:
        return merge(args)
    for k in ("steps", "tokens", "log_every", "eval_every", "val_batches"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    device = torch.device(args.device)
    runs = [r for r in args.runs.split(",") if r]

    from seqfuse.data import EsmTokenizer, build_mlm_loader, load_sequences

    d = data_dir(args.data)
    _, train_seqs = load_sequences(os.path.join(d, "train.parquet"))
    _, val_seqs = load_sequences(os.path.join(d, "validation.parquet"))
    t = time.perf_counter()
    train_b = make_batches(train_seqs, args.steps, tokens=args.tokens, max_length=args.max_length, seed=args.seed)
    tok = EsmTokenizer()
    vl = build_mlm_loader(val_seqs, tok, max_tokens=args.tokens, max_length=args.max_length, pad_to_multiple_of=16,
                          evaluation=True)
    val_b = [b for _, b in zip(range(args.val_batches), vl)]
    real_tokens = sum(int(b["num_tokens"]) for b in train_b)
    epoch_tokens = sum(min(len(s) + 2, args.max_length) for s in train_seqs)
    print(f"[convergence] ESM-2 {args.size}, {args.steps} steps x ~{args.tokens} tokens "
          f"({real_tokens / 1e6:.1f}M real tokens, {real_tokens / max(1, epoch_tokens):.1f} epochs of "
          f"{len(train_seqs)} proteins) on {d}; validation {len(val_b)} batches, "
          f"{sum(int((b['labels'] != -100).sum()) for b in val_b)} masked tokens; runs {','.join(runs)}; "
          f"batches built in {time.perf_counter() - t:.1f} s", flush=True)
    meta = {"size": args.size, "steps_planned": args.steps, "tokens_per_step": args.tokens, "lr": args.lr,
            "warmup": args.warmup, "bound_nats": args.bound, "fp8_bound_nats": args.fp8_bound, "data": d,
            "train_proteins": len(train_seqs), "real_train_tokens_planned": real_tokens,
            "time_budget_s": args.time_budget, "runs": runs}

    results = {}
    cap = args.steps
    for i, name in enumerate(runs):
        deadline = None
        if args.time_budget:
            weights = [args.hf_weight if r.startswith("hf") else 1.0 for r in runs[i:]]
            left = args.time_budget - (time.perf_counter() - T_START) - RESERVE_END_S \
                - RESERVE_PER_RUN_S * len(weights)
            deadline = time.perf_counter() + max(0.0, left) * weights[0] / sum(weights)
            print(f"[convergence] {name}: up to {cap} steps, deadline in {deadline - time.perf_counter():.0f} s",
                  flush=True)
        try:
            r = run(name, train_b, val_b, args, device, cap, deadline)
        except Exception as e:  # recorded; the other runs still go
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}"}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[name] = r
        if "error" not in r and r["stopped_early"] and r["steps_done"] > 0:
            cap = r["steps_done"]  # the later runs stop at the same step: one comparison point
            print(f"[convergence] {name}: {r['note']}; later runs capped at {cap} steps", flush=True)
        write_outputs(results, args, meta, final=False)

    report(results, args, meta)
    print(f"[convergence] total {time.perf_counter() - T_START:.0f} s")


def report(results, args, meta):
    """Final JSON/PNG and the bound checks, printed."""
    step, checks = write_outputs(results, args, meta, final=True)
    if step is None:
        print("convergence bound: NOT CHECKED (no run finished with a validation loss)")
    else:
        where = f"step {step}" + ("" if step == args.steps else f" (planned {args.steps}: time budget)")
        for c in checks:
            print(f"convergence bound at {where}: {c['check']}: diff {c['diff']:+.4f} -> "
                  f"{'PASS' if c['pass'] else 'FAIL'}")
        if not checks:
            print(f"convergence bound: NOT CHECKED (runs missing: {[k for k, r in results.items() if 'error' in r]})")
    print(json.dumps({k: (r["val"][-1][1] if "error" not in r and r["val"] else r.get("error"))
                      for k, r in results.items()}))


def merge(args):
    """Join runs made by separate processes (``--runs`` one each, ``--out``
    a name each, e.g. on different GPUs at once) into one comparison under
    ``--out``: curves, rows and the bound checks at their last common
    validation step.  The parts must share size, tokens, steps and seed."""
    results, meta, names = {}, None, [n for n in args.merge.split(",") if n]
    for name in names:
        with open(os.path.join(RESULTS, f"{name}.json")) as f:
            part = json.load(f)
        key = {k: part.get(k) for k in ("size", "steps_planned", "tokens_per_step", "lr", "warmup",
                                        "train_proteins")}
        if meta is None:
            meta = {k: v for k, v in part.items() if k not in ("name", "environment", "rows", "date", "curves",
                                                               "checks", "common_val_step", "complete",
                                                               "all_pass")}
            meta["runs"], meta["merged_from"], first = [], names, (name, key)
        elif key != first[1]:
            raise SystemExit(f"--merge: {name} ran {key}, {first[0]} ran {first[1]}: not one comparison")
        if not part.get("complete"):
            raise SystemExit(f"--merge: {name} did not finish (complete is false)")
        for row in part["rows"]:
            run_name = row["run"]
            if run_name in results:
                raise SystemExit(f"--merge: run {run_name} is in two parts ({name} and an earlier one)")
            if row.get("error"):
                results[run_name] = {"error": row["error"]}
            else:
                c = part["curves"][run_name]
                results[run_name] = dict(train_loss=c["train_loss"], logged=c["logged"],
                                         val=[tuple(v) for v in c["val"]], seconds=row["seconds"],
                                         steps_done=row["steps_done"], steps_per_s=row["steps_per_s"],
                                         peak_mem_gib=row["peak_mem_gib"], note=row.get("note") or "")
            meta["runs"].append(run_name)
    args.size, args.steps, args.tokens = meta["size"], meta["steps_planned"], meta["tokens_per_step"]
    report(results, args, meta)

if __name__ == "__main__":
    main()
