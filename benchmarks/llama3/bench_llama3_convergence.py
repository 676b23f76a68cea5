"""Llama 3 on DNA: does seqfuse's FP8 training converge like bf16, and is
any gap FP8 rounding or a defect of seqfuse's FP8 path?  (issue 16)

Background: the 1B loss check of bench_llama3.py (3 steps after 3 untimed
ones, AdamW without warm-up) shows FP8 rows 17-47 % off bf16 at single steps
while the bf16 losses themselves jump between 1.7 and 3.5.  Two parts here:

1. ``--part grads``: one step's gradients from the same weights and batch,
   per parameter, in float32 on the CPU (so bf16 rounding does not blur the
   picture; on CUDA in bfloat16, which seqfuse's attention kernel needs):
     exact             transformers' LlamaForCausalLM, no quantization;
     ref_current       the same model with fp8_reference.py's plain-torch
                       FP8 emulation (per-tensor scales from the current
                       amax, E4M3 forward, E5M2 gradients);
     ref_block         the emulation of Float8BlockScaling;
     seqfuse_bf16 (no FP8), seqfuse_fp8_current, seqfuse_fp8_delayed (its
                       first step scales each tensor from its own amax, as
                       current scaling does), seqfuse_fp8_block.
   Relative error per parameter, ||g_a - g_b|| / ||g_b||.  Rule: seqfuse's
   FP8 gradients must be far closer to the emulation of the same recipe than
   FP8 is to the exact gradients: for every parameter
       rel(seqfuse_fp8_X, ref_X) <= GRAD_AGREE x rel(ref_X, exact)
                                    + 2 x rel(seqfuse_bf16, exact) + 1e-4
   (GRAD_AGREE 0.25; the middle term is the two implementations' own
   rounding difference, ~3e-7 in float32), and seqfuse_bf16 within IMPL_TOL
   of exact.  A wrong scale,
   a wrong transpose, E4M3 where E5M2 belongs, a quantized tensor that should
   not be (LM head, embeddings), or a stale weight cast breaks that rule by
   a wide margin: those give errors of FP8's own size or larger.

2. ``--part train``: training runs from the same initial weights on the same
   batches, linear warm-up then cosine decay to 10 %, gradient clipping at
   1.0, FusedAdamW with fp32 master weights in every row:
     seqfuse_bf16, seqfuse_fp8_delayed, seqfuse_fp8_block (as bench_llama3);
     seqfuse_bf16_perturbed   the control: seqfuse_bf16 with every initial
                              weight moved by one bf16 ulp (random sign), so
                              its distance from seqfuse_bf16 is the natural
                              divergence of this training, FP8 or not;
     ref_fp8_current          transformers' model under the plain-torch FP8
                              emulation (optional: hf_bf16, ref_fp8_block);
     seqfuse_fp8_delayed_layerwise (optional) layer-wise precision: FP8
                              delayed in every decoder layer but the first
                              and the last, which run bf16 (fp8_layers =
                              [2 .. L-1] in the recipe's terms).
   Per step, the relative loss difference to seqfuse_bf16; over the last
   ``--window`` steps its mean, and each row's mean loss, at the steps every
   row reached; validation every ``--eval-every`` steps and at each row's
   end, compared at the last validation step every row reached (a time
   budget stops rows at different steps).  Rule (stated, checked,
   PASS/FAIL): each FP8 row's final-window mean train loss and validation
   loss within ``--bound`` nats
   (default 0.02) of seqfuse_bf16's.  Reported next to it (not a pass/fail):
   each row's mean per-step difference over the window against the control's
   and ref_fp8_current's: an FP8 row far outside both drifts for a reason of
   its own.

Data: real genome windows, ``--seq-len`` tokens per sequence
(llama3_common.py: benchmark windows cut by make_bench_data.py, else the
committed lambda-phage subset).  Validation: the windows of whole genomes
held out of training (``--val-genomes``, default the two last by name; with
the one-genome subset, the subset's own validation file), the same batches
for every row.

JSON: benchmarks/results/llama3_convergence.json (``--out``; commit from
SEQFUSE_GIT_COMMIT, versions, command: harness.Table), PNG next to it.
H200, one call (about 130 s after the build; ``--time-budget`` trims the
steps of every row alike if the GPU is slower than expected, and says so):
    python benchmarks/llama3/bench_llama3_convergence.py --device cuda --size small --seq-len 2048 \\
        --batch-size 8 --steps 600 --time-budget 130
CPU study (benchmarks/results/llama3_convergence_cpu.json; one thread, about
5 CPU minutes, 15 wall minutes on a shared 2-core host: seqfuse's reference
attention kernel is most of it):
    python benchmarks/llama3/bench_llama3_convergence.py --device cpu --size tiny --seq-len 128 \\
        --batch-size 4 --steps 80 --warmup 10 --lr 2e-3 --window 20 --eval-batches 2 --part train \\
        --out llama3_convergence_cpu
"""
import argparse
import os
import sys
import time
import traceback

T_START = time.perf_counter()

from llama3_common import (BENCH, SUBSET_DATA, build_hf, build_seqfuse, data_path, fixed_length_sequences,  # noqa
                           forward_loss, load_windows, log, make_batches, perturb_one_ulp)

import torch  # noqa: E402
from fp8_reference import emulate_fp8  # noqa: E402
from harness import RESULTS, Table, train_steps  # noqa: E402

sys.path.insert(0, os.path.join(BENCH, "esm2"))
from bench_esm2_convergence import lr_at, smooth  # noqa: E402  (the ESM-2 run's schedule and curve smoothing)

sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "recipes"))  # recipe_common (the layer-wise row)

GRAD_ROWS = ("exact", "ref_current", "ref_block", "seqfuse_bf16", "seqfuse_fp8_current", "seqfuse_fp8_delayed",
             "seqfuse_fp8_block")
#: seqfuse FP8 row -> the emulation of the same arithmetic
GRAD_PAIRS = {"seqfuse_fp8_current": "ref_current", "seqfuse_fp8_delayed": "ref_current",
              "seqfuse_fp8_block": "ref_block"}
#: seqfuse's FP8 gradient error against the emulation, as a fraction of FP8's own error (see the note).
GRAD_AGREE = 0.25
GRAD_FLOOR = 1e-4
#: seqfuse_bf16 (no FP8) against exact by dtype: float32 (CPU) same math; bfloat16 (CUDA: its attention
#: kernel takes no float32) two implementations' roundings
IMPL_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
TRAIN_ROWS = ("seqfuse_bf16", "seqfuse_fp8_delayed", "seqfuse_fp8_block", "seqfuse_bf16_perturbed",
              "ref_fp8_current", "ref_fp8_block", "hf_bf16", "seqfuse_fp8_current", "seqfuse_fp8_delayed_layerwise")
DEFAULT_TRAIN_ROWS = ("seqfuse_bf16", "seqfuse_fp8_delayed", "seqfuse_fp8_block", "seqfuse_bf16_perturbed",
                      "ref_fp8_current")
#: Expected cost of a row relative to a seqfuse bf16 row (splits --time-budget; s15: FP8 rows 1.5x).
ROW_WEIGHT = {"ref_fp8_current": 2.0, "ref_fp8_block": 3.0, "hf_bf16": 1.5, "seqfuse_fp8_delayed": 1.5,
              "seqfuse_fp8_block": 1.6, "seqfuse_fp8_current": 1.5, "seqfuse_fp8_delayed_layerwise": 1.5}


def recipe_of(name):
    """The seqfuse recipe a row name asks for (None: no FP8)."""
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    for key, make in (("fp8_delayed", DelayedScaling), ("fp8_current", Float8CurrentScaling),
                      ("fp8_block", Float8BlockScaling)):
        if key in name:
            return make()
    return None


def bf16_edges(model):
    """Layer-wise precision as BioNeMo's Llama 3 recipe is commonly run
    (precision.fp8_layers = [2 .. L-1], recipes/llama3): the first and the
    last decoder layer run their forward (and so their backward) with
    seqfuse's autocast off, inside the model-wide FP8 region, as the
    recipe's own loop makes them (recipe_common.trainer.run_without_fp8)."""
    from recipe_common.trainer import run_without_fp8

    layers = model.model.layers
    for layer in (layers[0], layers[-1]):
        run_without_fp8(layer)


class Row:
    """One configuration: its model, how it takes a batch, and its loss."""

    def __init__(self, name, args, device, dtype):
        self.name = name
        self.recipe = recipe_of(name)
        self.hf = name.startswith(("hf_", "ref_", "exact"))
        if self.hf:
            self.model = build_hf(args.size, device, dtype, seed=args.seed)
            for kind in ("current", "block"):
                if name.endswith(f"ref_{kind}") or name == f"ref_fp8_{kind}":
                    emulate_fp8(self.model, kind)
        else:
            self.model = build_seqfuse(args.size, device, dtype, seed=args.seed)
            if name.endswith("_perturbed"):
                perturb_one_ulp(self.model, args.seed)
            if name.endswith("_layerwise"):
                bf16_edges(self.model)
        self.device = device
        self.seq_len, self.batch_size = args.seq_len, args.batch_size

    def loss(self, packed_batch):
        from seqfuse.pytorch import autocast

        if self.hf:
            ids = packed_batch["input_ids"].view(self.batch_size, self.seq_len)
            labels = packed_batch["labels"].view(self.batch_size, self.seq_len)
            return forward_loss(self.model, {"input_ids": ids, "labels": labels}, self.device, packed=False)
        with autocast(enabled=self.recipe is not None, recipe=self.recipe):
            return forward_loss(self.model, packed_batch, self.device, packed=True)

    def named_grads(self):
        """{transformers parameter name: gradient} (seqfuse's fused QKV and gate/up split as transformers has them)."""
        if self.hf:
            return {n: p.grad.detach().float().clone() for n, p in self.model.named_parameters()}
        from seqfuse.hf.llama_convert import seqfuse_to_hf_state_dict

        sd = {n: p.grad.detach().float() for n, p in self.model.named_parameters()}
        return {k: v.clone() for k, v in seqfuse_to_hf_state_dict(sd, self.model.config).items()}


# ---------------------------------------------------------------- data
def load_data(args):
    """(train sequences, validation sequences, description) of exactly seq_len - 2 bases each."""
    path, note = data_path(args.data)
    rows = load_windows(path)
    genomes = sorted({r.get("genome", "") for r in rows})
    bases = args.seq_len - 2
    if len(genomes) >= 3:
        held = args.val_genomes.split(",") if args.val_genomes else genomes[-2:]
        unknown = [g for g in held if g not in genomes]
        if unknown:
            raise ValueError(f"--val-genomes: {unknown} not in {path} (genomes: {genomes})")
        train = [r for r in rows if r.get("genome") not in held]
        val = [r for r in rows if r.get("genome") in held]
        desc = f"{path} ({note}); validation: held-out genomes {held}"
    else:
        val_path = os.path.join(os.path.dirname(SUBSET_DATA), "validation.parquet")
        if os.path.abspath(path) != os.path.abspath(SUBSET_DATA):
            raise ValueError(f"{path}: {len(genomes)} genome(s), too few to hold whole genomes out for validation")
        train, val = rows, load_windows(val_path)
        desc = f"{path} ({note}); validation: {val_path} (one genome: held-out windows, not a held-out genome)"
    return fixed_length_sequences(train, bases), fixed_length_sequences(val, bases), desc


def batches(seqs, n, args, seed):
    packed, _ = make_batches(seqs, n, max_length=args.seq_len, batch_size=args.batch_size, seed=seed)
    return packed


# ---------------------------------------------------------------- part 1: gradients
def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grad_study(args, device, batch, dtype=torch.float32):
    """One step's gradients of every GRAD_ROWS row from the same weights and batch."""
    grads, losses = {}, {}
    for name in GRAD_ROWS:
        row = Row(name, args, device, dtype)
        loss = row.loss(batch)
        loss.backward()
        grads[name], losses[name] = row.named_grads(), float(loss.detach())
        del row
    exact = grads["exact"]
    params = list(exact)
    per_param, checks = [], []
    for p in params:
        entry = {"param": p, "seqfuse_bf16_vs_exact": rel(grads["seqfuse_bf16"][p], exact[p])}
        for ref in ("ref_current", "ref_block"):
            entry[f"{ref}_vs_exact"] = rel(grads[ref][p], exact[p])
        for sf, ref in GRAD_PAIRS.items():
            entry[f"{sf}_vs_{ref}"] = rel(grads[sf][p], grads[ref][p])
            entry[f"{sf}_vs_exact"] = rel(grads[sf][p], exact[p])
        per_param.append(entry)
    impl_tol = IMPL_TOL[dtype]
    for e in per_param:
        impl = e["seqfuse_bf16_vs_exact"]
        checks.append({"param": e["param"], "check": "seqfuse_bf16 vs exact", "value": impl,
                       "limit": impl_tol, "pass": impl <= impl_tol})
        for sf, ref in GRAD_PAIRS.items():
            v, fp8 = e[f"{sf}_vs_{ref}"], e[f"{ref}_vs_exact"]
            limit = GRAD_AGREE * fp8 + 2 * impl + GRAD_FLOOR
            checks.append({"param": e["param"], "check": f"{sf} vs {ref}", "value": v, "limit": limit,
                           "fp8_error": fp8, "pass": v <= limit})
    return {"losses": losses, "per_param": per_param, "checks": checks,
            "all_pass": all(c["pass"] for c in checks),
            "dtype": str(dtype),
            "rule": (f"for every parameter: rel(seqfuse_fp8_X, ref_X) <= {GRAD_AGREE} x rel(ref_X, exact) + "
                     f"2 x rel(seqfuse_bf16, exact) + {GRAD_FLOOR} (X current, delayed's first step against "
                     f"ref_current, block); rel(seqfuse_bf16, exact) <= {impl_tol}; rel = ||a - b|| / ||b||, "
                     f"{dtype}")}


def print_grads(g):
    log("one-step losses: " + ", ".join(f"{k} {v:.6f}" for k, v in g["losses"].items()))
    cols = ["seqfuse_bf16_vs_exact", "ref_current_vs_exact", "seqfuse_fp8_current_vs_ref_current",
            "seqfuse_fp8_delayed_vs_ref_current", "seqfuse_fp8_current_vs_exact", "seqfuse_fp8_delayed_vs_exact",
            "ref_block_vs_exact",
            "seqfuse_fp8_block_vs_ref_block", "seqfuse_fp8_block_vs_exact"]
    short = ["sf_bf16|exact", "refcur|exact", "sfcur|refcur", "sfdel|refcur", "sfcur|exact", "sfdel|exact",
             "refblk|exact",
             "sfblk|refblk", "sfblk|exact"]
    print("relative gradient error per parameter:\n" + f"{'param':44s}" + "".join(f"{s:>14s}" for s in short))
    for e in g["per_param"]:
        print(f"{e['param'][-44:]:44s}" + "".join(f"{e[c]:14.3e}" for c in cols))
    bad = [c for c in g["checks"] if not c["pass"]]
    print(f"gradient rule: {g['rule']}: {'PASS' if not bad else 'FAIL'} ({len(g['checks']) - len(bad)} of "
          f"{len(g['checks'])} checks)")
    for c in bad[:20]:
        print(f"  FAIL {c['param']}: {c['check']} {c['value']:.3e} > {c['limit']:.3e}")


# ---------------------------------------------------------------- part 2: training
def train_row(name, args, device, dtype, train_b, val_b, max_steps, deadline):
    """One training row; validation every --eval-every steps and at the end
    (rows stopped by the time budget end at different steps, so the rows are
    compared at a validation step they all reached)."""
    from seqfuse.optim import FusedAdamW, clip_grad_norm_

    row = Row(name, args, device, dtype)
    params = [p for p in row.model.parameters() if p.requires_grad]
    opt = FusedAdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    val = []

    def validate(step):
        row.model.eval()
        with torch.no_grad():
            val.append((step, sum(float(row.loss(b)) for b in val_b) / len(val_b)))
        row.model.train()

    def after_step(done, window):
        if done % args.eval_every == 0:
            validate(done)

    row.model.train()
    losses, stopped, t0 = train_steps(name, train_b[:max_steps], row.loss, opt, params, clip_grad_norm_,
                                      lambda step: lr_at(step, args), args.log_every, deadline, after_step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if losses and (not val or val[-1][0] != len(losses)):
        validate(len(losses))
    losses = [float(x) for x in losses]
    print(f"  {name}: {len(losses)} steps in {seconds:.1f} s, validation loss {val[-1][1] if val else float('nan'):.4f}",
          flush=True)
    return {"train_loss": losses, "val": val, "steps_done": len(losses), "seconds": seconds,
            "stopped_early": stopped}


def common_val_step(ok):
    """The last validation step every row reached (None if there is none)."""
    steps = None
    for r in ok.values():
        mine = {s for s, _ in r["val"]}
        steps = mine if steps is None else steps & mine
    return max(steps) if steps else None


def summarize(results, args):
    """Rows of the table and the bound checks against seqfuse_bf16 at the steps every row reached."""
    ok = {k: r for k, r in results.items() if "error" not in r and r["steps_done"]}
    base = ok.get("seqfuse_bf16")
    if base is None:
        return [], [], None
    n = min(r["steps_done"] for r in ok.values())
    w = min(args.window, n)
    ref = base["train_loss"][:n]
    vs = common_val_step(ok)
    val_at = {k: (dict(r["val"])[vs] if vs is not None else float("nan")) for k, r in ok.items()}
    rows, checks = [], []
    for name, r in results.items():
        if name not in ok:
            rows.append({"run": name, "error": r.get("error")})
            continue
        x = r["train_loss"][:n]
        d = [abs(a - b) / b for a, b in zip(x, ref)]
        row = {"run": name, "steps": n, "final_window_mean": sum(x[-w:]) / w,
               "final_window_diff": sum(x[-w:]) / w - sum(ref[-w:]) / w,
               "val_step": vs, "val_loss": val_at[name], "val_diff": val_at[name] - val_at["seqfuse_bf16"],
               "step_rel_diff_mean_window": sum(d[-w:]) / w, "step_rel_diff_max": max(d),
               "step_rel_diff_max_window": max(d[-w:]), "seconds": r["seconds"]}
        rows.append(row)
        if "fp8" in name and name.startswith("seqfuse"):
            for key in ("final_window_diff", "val_diff"):
                checks.append({"check": f"|{key}({name})| <= {args.bound}", "row": name, "value": row[key],
                               "bound": args.bound, "pass": abs(row[key]) <= args.bound})
    return rows, checks, n


def write_train(results, args, meta, final):
    rows, checks, n = summarize(results, args)
    cols = ["run", "steps", "final_window_mean", "final_window_diff", "val_step", "val_loss", "val_diff",
            "step_rel_diff_mean_window", "step_rel_diff_max_window", "step_rel_diff_max", "seconds", "error"]
    table = Table(args.out, cols)
    for r in rows:
        table.add(**r)
    extra = dict(meta, complete=final, common_steps=n, train_checks=checks,
                 train_pass=bool(checks) and all(c["pass"] for c in checks),
                 curves={k: v.get("train_loss") for k, v in results.items() if "error" not in v},
                 val_curves={k: v.get("val") for k, v in results.items() if "error" not in v})
    table.save(extra=extra)
    try:
        plot(results, args)
    except Exception as e:  # a plot must never cost the results
        print(f"[convergence] plot failed: {type(e).__name__}: {e}")
    return rows, checks


def plot(results, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = {k: r for k, r in results.items() if "error" not in r and r["train_loss"]}
    if not done:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = max(1, max(len(r["train_loss"]) for r in done.values()) // 40)
    base = done.get("seqfuse_bf16")
    for i, (name, r) in enumerate(done.items()):
        color = f"C{i}"  # one colour per row in both panels
        ax.plot(range(1, len(r["train_loss"]) + 1), smooth(r["train_loss"], w), label=name, lw=1, color=color)
        if base is not None and name != "seqfuse_bf16":
            n = min(len(base["train_loss"]), len(r["train_loss"]))
            d = [a - b for a, b in zip(r["train_loss"][:n], base["train_loss"][:n])]
            bx.plot(range(1, n + 1), smooth(d, w), label=f"{name} - seqfuse_bf16", lw=1, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("causal LM loss (nats)")
    ax.set_title(f"Llama, size '{args.size}' (llama3_common.SMALL), {args.batch_size} x {args.seq_len} DNA tokens "
                 f"(smoothed over {w})", fontsize=9)
    ax.legend(fontsize=7)
    bx.axhline(0, color="gray", lw=0.6)
    bx.set_xlabel("step")
    bx.set_ylabel("loss difference (nats)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{args.out}.png"), dpi=110)
    plt.close(fig)


def reused(args, meta):
    """{row: result} of the rows of ``--reuse`` that finished, in the order of --rows."""
    if not args.reuse:
        return {}
    import json

    with open(os.path.join(RESULTS, f"{args.reuse}.json")) as f:
        old = json.load(f)
    keys = ("size", "seq_len", "batch_size", "steps_planned", "lr", "warmup", "dtype", "data")
    differ = {k: (old.get(k), meta[k]) for k in keys if old.get(k) != meta[k]}
    if differ:
        raise SystemExit(f"--reuse {args.reuse}: settings differ (old, now): {differ}")
    meta["reused_from"] = {"name": args.reuse, "date": old.get("date"), "run": old.get("run")}
    out = {}
    for r in old["rows"]:
        if r["run"] in meta["row_names"] and not r.get("error"):
            curve = old["curves"][r["run"]]
            val = old.get("val_curves", {}).get(r["run"]) or [(len(curve), r["val_loss"])]
            out[r["run"]] = {"train_loss": curve, "val": [tuple(v) for v in val], "steps_done": len(curve),
                             "seconds": r["seconds"], "stopped_early": False}
    return {k: out[k] for k in meta["row_names"] if k in out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", default="grads,train", help="grads, train or both (comma-separated)")
    p.add_argument("--size", default="small", help="tiny, small, 100M (llama3_common.SMALL)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--window", type=int, default=100, help="final window (steps) for the mean losses")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (and at a row's end); "
                   "rows are compared at the last validation step all of them reached")
    p.add_argument("--bound", type=float, default=0.02, help="max |loss(FP8 row) - loss(seqfuse_bf16)| in nats")
    p.add_argument("--rows", default=",".join(DEFAULT_TRAIN_ROWS))
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole script: every row gets the same step cap, set from the first row")
    p.add_argument("--val-genomes", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--out", default="llama3_convergence")
    p.add_argument("--reuse", default=None, metavar="NAME",
                   help="take the finished rows of results/NAME.json (same settings) instead of running them again")
    args = p.parse_args(argv)
    parts = [x for x in args.part.split(",") if x]
    for x in parts:
        if x not in ("grads", "train"):
            p.error(f"--part: expected grads and/or train, got {x!r}")
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in TRAIN_ROWS:
            p.error(f"--rows: {r!r} is not one of {', '.join(TRAIN_ROWS)}")
    if "train" in parts and "seqfuse_bf16" not in rows:
        p.error("--rows must include seqfuse_bf16 (every row is compared with it)")
    for k in ("steps", "window", "log_every", "eval_batches", "eval_every", "seq_len", "batch_size"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if args.seq_len % 16:
        p.error(f"--seq-len must be a multiple of 16 (FP8 GEMM rows), got {args.seq_len}")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    train_s, val_s, desc = load_data(args)
    train_b = batches(train_s, args.steps, args, args.seed)
    val_b = batches(val_s, args.eval_batches, args, args.seed + 1)
    log(f"Llama {args.size}, {args.batch_size} x {args.seq_len} tokens per step, data {desc}: {len(train_s)} "
        f"training and {len(val_s)} validation sequences")
    meta = {"size": args.size, "seq_len": args.seq_len, "batch_size": args.batch_size, "steps_planned": args.steps,
            "lr": args.lr, "warmup": args.warmup, "schedule": "linear warm-up, cosine decay to 10 %, clip 1.0",
            "optimizer": "seqfuse FusedAdamW, betas (0.9, 0.95), weight decay 0.01, fp32 master weights",
            "dtype": str(dtype), "data": desc, "window": args.window, "bound_nats": args.bound,
            "train_rule": (f"every seqfuse FP8 row: |final-window mean train loss - seqfuse_bf16's| <= {args.bound} "
                           f"and |validation loss - seqfuse_bf16's| <= {args.bound} nats, over the steps every row "
                           "reached; per-step differences reported against the one-ulp control's"),
            "row_names": rows, "time_budget_s": args.time_budget}
    status = 0
    if "grads" in parts:
        try:
            g = grad_study(args, device, train_b[0], dtype)
            print_grads(g)
            status |= 0 if g["all_pass"] else 1
        except Exception as e:  # recorded; the training part still runs
            traceback.print_exc()
            g = {"error": f"{type(e).__name__}: {e}", "all_pass": False}
            status |= 1
        meta["grads"] = g
        if "train" not in parts:
            Table(args.out, []).save(extra=dict(meta, complete=True))
    if "train" in parts:
        results, cap = reused(args, meta), args.steps
        for i, name in enumerate(rows):
            if name in results:
                print(f"[convergence] {name}: reused from {args.reuse}")
                continue
            deadline = None
            if args.time_budget:
                weights = [ROW_WEIGHT.get(r, 1.0) for r in rows[i:]]
                left = args.time_budget - (time.perf_counter() - T_START) - 4.0 * len(weights)
                deadline = time.perf_counter() + max(0.0, left) * weights[0] / sum(weights)
            try:
                r = train_row(name, args, device, dtype, train_b, val_b, cap, deadline)
            except Exception as e:  # recorded; the other rows still run
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {e}"}
            results[name] = r
            if "error" not in r and r["stopped_early"] and r["steps_done"]:
                cap = r["steps_done"]
                print(f"[convergence] {name} stopped by --time-budget at step {cap}: later rows capped there")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if i < len(rows) - 1:
                write_train(results, args, meta, final=False)
        summary, checks = write_train(results, args, meta, final=True)
        for c in checks:
            print(f"convergence: {c['check']}: {c['value']:+.4f} -> {'PASS' if c['pass'] else 'FAIL'}")
        if not checks or not all(c["pass"] for c in checks):
            status |= 2
    print(f"[convergence] total {time.perf_counter() - T_START:.0f} s, status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
