"""Llama 3 on real DNA: seqfuse's Llama against transformers' LlamaForCausalLM,
training throughput at 8,192 tokens per sequence and cached generation, in
one process on one GPU, with identical initial weights in every row.

Model: Llama 3.2 1B's shape (seqfuse.hf.llama3_config("1B"): 16 layers,
hidden 2048, 32 query / 8 key-value heads, SwiGLU 8192, tied embeddings,
Llama 3 RoPE scaling) with the nucleotide vocabulary (10 ids padded to 16).
transformers' model is built with a seed (its own initialisation); seqfuse's
is converted from it (seqfuse.hf.llama_convert.from_hf_model), so each row
starts from the same weights, and the first step's loss of every row is
compared with transformers' (``loss_check``: same weights, same batch).

Data: real genome windows (llama3_common.py: the benchmark's windows cut by
make_bench_data.py from the recipe's bacterial genomes, else the committed
lambda-phage subset, said in the log and the JSON).  Every sequence is
exactly 8,192 tokens (<bos> 8,190 bases <eos>), ``--batch-size`` sequences
per step: nothing is padded, so the padded [B, L] and packed THD layouts
hold the same tokens (padded == packed in samples and loss); they differ
only in the path the model takes, and seqfuse is measured in both.

Training rows (``--rows``), <impl>_<recipe>[_<layout>]:
  hf_bf16             transformers LlamaForCausalLM, sdpa, bf16 weights,
                      torch.optim.AdamW(fused=True);
  hf_bf16_compiled    the same under torch.compile (--compile-scope: each
                      LlamaDecoderLayer, the default, or the whole model;
                      static shapes); a failure is kept with its reason, and
                      a compiled row slower than eager says so;
  hf_bf16_liger       the same model patched by Liger-Kernel
                      (liger_kernel.transformers.apply_liger_kernel_to_llama
                      on the instance: RoPE, RMSNorm, SwiGLU MLP and fused
                      linear cross-entropy), eager; its module-level patches
                      of transformers' Llama code are undone after the row,
                      so rows after it run transformers' own code; skipped
                      with the reason where liger_kernel does not import or
                      no GPU is here (its kernels are Triton's);
  seqfuse_bf16_{padded,packed}, seqfuse_fp8_delayed_{padded,packed},
  seqfuse_fp8_block_{padded,packed}
  seqfuse_bf16_perturbed_packed
                      a control, not in the default rows: seqfuse_bf16_packed
                      with every nonzero initial weight one bf16 ulp off
                      (llama3_common.perturb_one_ulp); its distance from
                      seqfuse_bf16_packed is what the training does to any
                      perturbation (FP8's included);
                      seqfuse's Llama (bf16 weights, FusedAdamW without
                      master weights unless --master-weights), FP8 under
                      seqfuse autocast with DelayedScaling /
                      Float8BlockScaling (the LM head stays bf16).
The transformers rows (eager, compiled, Liger) are the peers: "best
transformers row" below is the fastest of them.
Every row trains the same way: the same batches in the same order, AdamW
with the same hyper-parameters (--lr, default 1e-5; betas (0.9, 0.999), eps
1e-8, weight decay 0.01; no schedule, no clipping, no dropout in Llama) and
the same update: transformers' rows step torch.optim.AdamW on bf16
parameters (fp32 math, bf16 moments, one rounding to bf16), so seqfuse's
rows use FusedAdamW(master_weights=False) with bf16 moments, which makes that
update and keeps that state.  (Session 12's
rows differed here: seqfuse kept fp32 master weights, which keep the small
updates that bf16 parameters round away, e.g. every RMSNorm weight near
1.0 ignores an update below 2^-9; at lr 1e-4 the 1B model's loss rises in
every row in these first steps, and the two optimizers rose to different
losses: 7.20 against transformers' 5.78 after six steps.  At lr 1e-4 the
bf16 rows' loss rises from 3.6 to 12.9 by the fourth step, a diverging start
in which FP8's losses leave bf16's and the check below withholds the FP8
ratio; at lr 1e-5, the default, every row's loss falls from 3.6 to 1.4 and
FP8 stays within 1.2 % of transformers' at every step on the H200.)
Each row's loss
at every step (warm-up and timed) is printed side by side with the others'
and checked against transformers' eager row within LOSS_TOL of its recipe
(bf16 2 %, FP8 5 %, float32 on the CPU 1e-4, relative); a row outside it
gets no speed ratio ("ratio_withheld" in the JSON, "WITHHELD" in the log)
and the run exits with status 2.
Timing is steady state: ``--warm-passes`` untimed passes over the very
batches that are then timed (compiled graphs, cuBLAS/cuDNN plans and FP8
scaling state exist before timing), then one timed pass with the GPU
synchronized only before and after it.  Reported: unpadded tokens/s (= all
tokens here), ratios against transformers eager and the best transformers
row (eager or compiled), MFU of the useful FLOPs (llama3_common.train_flops, causal
attention counted as the lower triangle) against the measured bf16 ceiling
(794 TFLOP/s) and the datasheet (989), peak memory, step time, host issue
time per step (the Python time to queue one step; below the step time
means the GPU, not the host, sets the pace).

Decode rows (``--decode-rows``), at ``--decode-batches`` (1 and 32) for
``--prompt-len`` (512) token prompts of the same genome windows, greedy,
``--new-tokens`` new tokens, eos ignored:
  hf_static           transformers generate() with its static cache
                      (cache_implementation="static"), eager
                      (disable_compile=True);
  hf_static_compiled  the same with transformers' own automatic compilation
                      of the decode step (what transformers documents for the
                      static cache on a GPU);
  seqfuse_bf16        SeqfuseLlamaForCausalLM.generate with an InferenceParams
                      cache allocated once for the row; on CUDA its decode
                      step is replayed as a CUDA graph (generate's default,
                      captured once, in the untimed generate; the row's note
                      gives captures and replays);
  seqfuse_bf16_eager  the same with decode_graphs=False: every layer's kernels
                      launched from Python at every step;
  seqfuse_fp8_delayed seqfuse_bf16 under fp8_autocast (not in the default
                      rows; FP8 decode is not graphed: generate logs why).
Each decode row first runs one untimed generate of the same shapes, then
``--decode-repeats`` timed ones (median).  tokens/s = batch x new tokens /
time of the whole generate() (prefill of the prompt included); the tokens of
each row are compared with transformers' (identical up to the first
divergence, which bf16 near ties can cause: the JSON says where).

Goals (the issue's): bf16 >= 1.3x and FP8 >= 1.8x the best transformers row
(eager, compiled or Liger, whichever of them ran) in unpadded tokens/s;
peak memory <= transformers'; decode at batch 1 >= 1.5x transformers'
static-cache generate (the faster of eager and compiled).

JSON: benchmarks/results/llama3.json (training) and llama3_decode.json
(decode), each with the git commit, versions and exact command
(peers/meta.py); PNGs next to them.  CPU smoke test:
``--size tiny --device cpu`` (float32, short sequences; compiled rows skipped
with the reason).
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import time
import traceback

from llama3_common import (H200_BF16_DATASHEET_TFLOPS, H200_BF16_MEASURED_TFLOPS, ROOT, build_hf, build_seqfuse,
                           data_path, fixed_length_sequences, forward_loss, load_windows, log, make_batches,
                           perturb_one_ulp, seqfuse_config, train_flops)

import torch  # noqa: E402
from harness import RESULTS, Table, compile_layers_or_model, plot_bars  # noqa: E402
from peers.meta import run_metadata  # noqa: E402

TRAIN_ROWS = ("hf_bf16", "hf_bf16_compiled", "hf_bf16_liger", "seqfuse_bf16_padded", "seqfuse_bf16_packed",
              "seqfuse_fp8_delayed_padded", "seqfuse_fp8_delayed_packed", "seqfuse_fp8_block_padded",
              "seqfuse_fp8_block_packed", "seqfuse_bf16_perturbed_packed")
#: the compiled row last: its compile takes longest, and a run cut short keeps the others
DEFAULT_TRAIN_ROWS = ("hf_bf16", "seqfuse_bf16_padded", "seqfuse_bf16_packed", "seqfuse_fp8_delayed_packed",
                      "seqfuse_fp8_block_packed", "hf_bf16_compiled")
DECODE_ROWS = ("hf_static", "hf_static_compiled", "seqfuse_bf16", "seqfuse_bf16_eager", "seqfuse_fp8_delayed")
DEFAULT_DECODE_ROWS = ("hf_static", "hf_static_compiled", "seqfuse_bf16", "seqfuse_bf16_eager")
HF_TRAIN = ("hf_bf16", "hf_bf16_compiled", "hf_bf16_liger")
HF_DECODE = ("hf_static", "hf_static_compiled")
#: Every step's loss (same weights, same batches, same AdamW update) within this fraction of transformers' loss at
#: that step (bf16: the rows' kernels round differently; FP8: quantization error on top; fp32: the CPU run).
#: bf16_perturbed: the control row (every initial weight one bf16 ulp off, llama3_common.perturb_one_ulp), held
#: to bf16's tolerance: where it fails, the training itself amplifies a perturbation that small.
LOSS_TOL = {"bf16": 2e-2, "fp8_delayed": 5e-2, "fp8_block": 5e-2, "fp32": 1e-4, "bf16_perturbed": 2e-2}


def parse_train_row(name):
    """(impl, recipe, layout) of a training row name, or ValueError."""
    if name not in TRAIN_ROWS:
        raise ValueError(f"training row {name!r}: expected one of {', '.join(TRAIN_ROWS)}")
    if name.startswith("hf_"):
        impl = {"hf_bf16_compiled": "hfcompile", "hf_bf16_liger": "liger"}.get(name, "hf")
        return impl, "bf16", "padded"
    parts = name.split("_")
    return "seqfuse", "_".join(parts[1:-1]), parts[-1]


def fp8_recipe(name):
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    return {"bf16": None, "bf16_perturbed": None, "fp8_delayed": DelayedScaling(),
            "fp8_block": Float8BlockScaling()}[name]


def compile_hf(model, scope):
    """torch.compile transformers' LlamaForCausalLM in place: each decoder
    layer (one graph shared by the 16 layers) or the whole model; static shapes."""
    return compile_layers_or_model(model, model.model.layers, scope, dynamic=False)


@contextlib.contextmanager
def liger_patched(model):
    """Liger-Kernel's Llama kernels on ``model`` for the duration of the
    block.  apply_liger_kernel_to_llama(model=...) patches the instance (its
    RMSNorm and MLP modules, its forward: fused linear cross-entropy) and
    also transformers' modeling_llama module (apply_rotary_pos_emb, read at
    call time, and the LlamaRMSNorm / LlamaMLP classes that later models
    would be built from); the module's names are put back on exit, so only
    this row runs Liger's code.  ImportError-free: raises RuntimeError with
    the reason where liger_kernel does not import."""
    from transformers.models.llama import modeling_llama

    from peers.meta import try_import

    mod, why = try_import("liger_kernel.transformers")
    if mod is None:
        raise RuntimeError(why)
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {n: getattr(modeling_llama, n) for n in names}
    try:
        mod.apply_liger_kernel_to_llama(model=model)
        del model  # the row owns its model: this frame keeps no reference until the block ends
        yield
    finally:
        for n, v in saved.items():
            setattr(modeling_llama, n, v)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_train_row(name, packed_batches, padded_batches, args, device, dtype):
    """Build the row's model and optimizer, warm up, time one pass; returns the raw figures."""
    from seqfuse.pytorch import autocast

    impl, recipe_name, layout = parse_train_row(name)
    notes = {}
    if impl == "seqfuse":
        from seqfuse.optim import FusedAdamW

        model = build_seqfuse(args.size, device, dtype, seed=args.seed)
        if recipe_name.endswith("_perturbed"):
            perturb_one_ulp(model, args.seed)
            notes["control"] = "every nonzero initial weight moved one bf16 ulp (random sign)"
        # Without --master-weights: the update and state torch.optim.AdamW(fused=True) has on the
        # transformers rows' bf16 parameters (fp32 math, bf16 moments, one rounding to the parameter's
        # dtype), so every row trains the same way and holds the same optimizer memory.
        moments = torch.float32 if args.master_weights else torch.bfloat16
        opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                         master_weights=args.master_weights, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        recipe = fp8_recipe(recipe_name)

        def context():
            return autocast(enabled=recipe is not None, recipe=recipe)
    else:
        model = build_hf(args.size, device, dtype, seed=args.seed)
        if impl == "hfcompile":
            compile_hf(model, args.compile_scope)
            notes["compile"] = f"torch.compile scope={args.compile_scope} dynamic=False"
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
        context = contextlib.nullcontext
    with contextlib.ExitStack() as row_scope:
        if impl == "liger":  # Liger's patches live as long as this row, no longer
            row_scope.enter_context(liger_patched(model))
            notes["liger"] = ("liger_kernel apply_liger_kernel_to_llama(model=...): RoPE, RMSNorm, SwiGLU MLP, "
                              "fused linear cross-entropy")
        model.train()
        packed = layout == "packed"
        batches = packed_batches if packed else padded_batches

        def step(b):
            with context():
                loss = forward_loss(model, b, device, packed)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_warm = time.perf_counter()
        warm_losses = []
        for i in range(args.warm_passes):
            for b in batches:
                warm_losses.append(float(step(b).detach()))  # untimed: a host read per step costs nothing here
        first_loss = warm_losses[0] if warm_losses else None  # same weights, same batch in every row
        _sync(device)
        warm_s = time.perf_counter() - t_warm
        losses, issue = [], []
        t0 = time.perf_counter()
        for b in batches:  # no sync inside: host issue time < step time means the GPU sets the pace
            ti = time.perf_counter()
            losses.append(step(b))
            issue.append(time.perf_counter() - ti)
        _sync(device)
        seconds = time.perf_counter() - t0
        losses = [float(x.detach()) for x in losses]
        if first_loss is None:
            first_loss = losses[0]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return dict(seconds=seconds, losses=losses, warm_losses=warm_losses, first_loss=first_loss,
                    host_ms=1000 * statistics.mean(issue),
                    peak=peak, warm_s=warm_s, notes=notes)


def row_failed(results, base, label, error, device):
    """A row (train or decode) that raised: its traceback printed and
    ``label: FAILED`` logged, the row kept in ``results`` with the error, and
    the device's cached memory released so the next rows can still run."""
    traceback.print_exc()
    log(f"{label}: FAILED: {type(error).__name__}: {error}")
    results.append({**base, "error": f"{type(error).__name__}: {str(error)[:500]}"})
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_figures(r, batches, cfg):
    real = sum(int(b["num_tokens"]) for b in batches)
    total = sum(b["input_ids"].numel() for b in batches)
    lengths = [int(b["max_seqlen"]) for b in batches for _ in range(int(b["num_sequences"]))]
    flops = train_flops(lengths, cfg)
    s = r["seconds"]
    return {
        "steps": len(batches), "real_tokens": real,
        "tokens_per_s": total / s, "unpadded_tokens_per_s": real / s,
        "padding_pct": 100.0 * (1 - real / total),
        "mfu_measured_pct": 100.0 * flops / s / (H200_BF16_MEASURED_TFLOPS * 1e12),
        "mfu_datasheet_pct": 100.0 * flops / s / (H200_BF16_DATASHEET_TFLOPS * 1e12),
        "tflops_per_s": flops / s / 1e12,
        "peak_mem_gib": r["peak"], "step_ms": 1000.0 * s / len(batches), "host_issue_ms": r["host_ms"],
        "warm_s": r["warm_s"], "first_loss": r["first_loss"], "final_loss": r["losses"][-1],
        "warm_losses": r["warm_losses"], "losses": r["losses"],
    }


def add_train_ratios(rows, check=None):
    """vs_hf (eager transformers), vs_best_hf (the fastest of eager,
    compiled and Liger-patched, named in best_hf), mem_vs_hf; a compiled or
    Liger row slower than eager says so.  With ``check`` (loss_check's
    result), a row whose losses disagree with transformers' gets no speed
    ratio: ``ratio_withheld`` says why (it did not train the same model the
    same way, so its speed is not comparable), and such a transformers row
    is not a candidate for the best one."""
    ok = {r["row"]: r for r in rows if "unpadded_tokens_per_s" in r}
    nan = float("nan")
    bad = {n: c for n, c in (check or {}).get("rows", {}).items() if not c["pass"]}
    for name, c in bad.items():
        if name in ok:
            ok[name]["ratio_withheld"] = (f"losses disagree with {check['reference']}: {c['why']} (tolerance "
                                          f"{c['tol']:g} relative): no speed ratio")
    hf = ok.get("hf_bf16")
    hfs = [ok[n] for n in HF_TRAIN if n in ok and n not in bad]
    best = max(hfs, key=lambda r: r["unpadded_tokens_per_s"]) if hfs else None
    for r in ok.values():
        if r["row"] in bad:
            r["mem_vs_hf"] = r["peak_mem_gib"] / hf["peak_mem_gib"] if hf else nan
            continue
        t = r["unpadded_tokens_per_s"]
        r["vs_hf"] = t / hf["unpadded_tokens_per_s"] if hf else nan
        r["mem_vs_hf"] = r["peak_mem_gib"] / hf["peak_mem_gib"] if hf else nan
        r["vs_best_hf"], r["best_hf"] = (t / best["unpadded_tokens_per_s"], best["row"]) if best else (nan, "")
    for name, what in (("hf_bf16_compiled", "compiled"), ("hf_bf16_liger", "Liger")):
        c = ok.get(name)
        if c and hf and "vs_hf" in c and c["vs_hf"] < 1.0:  # (a withheld row has no ratio)
            c["note"] = (c.get("note", "") + "; " if c.get("note") else "") + (
                f"{what} is SLOWER than eager ({c['vs_hf']:.2f}x)")
    return rows


def _rel(a, b):
    return abs(a - b) / abs(b) if b else abs(a - b)


def loss_check(rows, fp32):
    """Every row's losses against transformers' eager row (hf_bf16; where the
    run has none, the compiled one, hf_bf16_compiled: the same model and
    update, its kernels rounding differently), relative difference within
    LOSS_TOL of the row's recipe: the first step's loss
    (same weights, same batch) and, where the rows carry them, the loss of
    every step after it (warm-up and timed steps: same batches, same
    optimizer semantics, so the rows must train alike).  A row's entry gives
    first_loss, rel_diff (first step), max_step_rel_diff and its step (over
    all steps, "w<i>" warm-up / "t<i>" timed), tol, pass and, when it
    fails, why.  Without either reference row nothing is checked and
    ``pass`` is None."""
    ok = {r["row"]: r for r in rows if "first_loss" in r}
    ref_name = next((n for n in ("hf_bf16", "hf_bf16_compiled") if n in ok), None)
    ref = ok.get(ref_name)
    out = {"reference": ref_name, "rows": {}, "pass": True if ref else None,
           "tolerances": {k: f"{v:g} relative" for k, v in LOSS_TOL.items()},
           "rule": "every step's loss of a row within its recipe's tolerance of the reference row's loss at that "
                   "step (hf_bf16, else hf_bf16_compiled); a row outside it gets no speed ratio"}
    if ref is None:
        return out
    ref_steps = step_losses(ref)
    for name, r in ok.items():
        tol = LOSS_TOL["fp32"] if fp32 and r["recipe"] == "bf16" else LOSS_TOL[r["recipe"]]
        rel = _rel(r["first_loss"], ref["first_loss"])
        entry = {"first_loss": r["first_loss"], "rel_diff": rel, "tol": tol, "pass": rel <= tol}
        if not rel <= tol:  # NaN fails too
            entry["why"] = f"first-step loss {r['first_loss']:.5g} vs {ref['first_loss']:.5g} ({rel:.3g} relative)"
        steps = step_losses(r)
        if steps and ref_steps:
            if list(steps) != list(ref_steps):
                raise ValueError(f"loss_check: row {name} has steps {list(steps)}, {ref_name} {list(ref_steps)}")
            diffs = {k: _rel(steps[k], ref_steps[k]) for k in steps}
            worst = max(diffs, key=lambda k: (diffs[k] != diffs[k], diffs[k]))  # a NaN loss is the worst
            entry.update(max_step_rel_diff=diffs[worst], worst_step=worst)
            if not diffs[worst] <= tol:
                entry["pass"] = False
                entry.setdefault("why", f"step {worst} loss {steps[worst]:.5g} vs {ref_steps[worst]:.5g} "
                                        f"({diffs[worst]:.3g} relative)")
        out["rows"][name] = entry
        out["pass"] &= entry["pass"]
    return out


def step_losses(r):
    """A row's losses by step name: w1.. the warm-up steps, t1.. the timed steps (empty when not recorded)."""
    steps = {f"w{i + 1}": v for i, v in enumerate(r.get("warm_losses", []))}
    steps.update({f"t{i + 1}": v for i, v in enumerate(r.get("losses", []))})
    return steps


def loss_table(rows, check):
    """The per-step losses of every row side by side (one line per step), the tolerance and each row's verdict."""
    measured = [r for r in rows if step_losses(r)]
    if not measured:
        return []
    names = [r["row"] for r in measured]
    width = max(12, *(len(n) for n in names))
    lines = ["per-step training loss (w: warm-up steps, t: timed steps; same batches in every row):",
             "step  " + "  ".join(f"{n:>{width}}" for n in names)]
    by = [step_losses(r) for r in measured]
    for k in by[0]:
        lines.append(f"{k:<4}  " + "  ".join(f"{s.get(k, float('nan')):>{width}.5f}" for s in by))
    for n in names:
        c = check["rows"].get(n)
        if c:
            lines.append(f"{n}: max step difference {c.get('max_step_rel_diff', c['rel_diff']):.3g} relative to "
                         f"{check['reference']} (tolerance {c['tol']:g}) -> "
                         f"{'AGREES' if c['pass'] else 'DISAGREES: ' + c['why']}")
    return lines


#: The transformers rows a competent user would run instead of eager: a speed goal "vs best transformers row" is
#: withheld unless at least one of them was measured.
STRONG_HF = ("hf_bf16_compiled", "hf_bf16_liger")


def train_goals(rows):
    by = {r["row"]: r for r in rows if "unpadded_tokens_per_s" in r}
    out = []
    no_strong_peer = (None if any(n in by for n in STRONG_HF) else
                      f"strongest peer not measured: none of {', '.join(STRONG_HF)} ran (eager alone is a weak peer)")

    def goal(what, row, need, key, le=False):
        withheld = by[row].get("ratio_withheld") if row in by and key != "mem_vs_hf" else None
        if row in by and key == "vs_best_hf" and no_strong_peer:
            withheld = no_strong_peer
        if withheld:
            out.append({"goal": what, "row": row, "key": key, "value": None, "need": f"{'<=' if le else '>='} {need}",
                        "pass": False, "withheld": withheld})
        elif row in by and key in by[row] and by[row][key] == by[row][key]:
            v = by[row][key]
            out.append({"goal": what, "row": row, "key": key, "value": v, "need": f"{'<=' if le else '>='} {need}",
                        "pass": v <= need if le else v >= need})

    for layout in ("padded", "packed"):
        goal(f"bf16 ({layout}) vs best transformers row", f"seqfuse_bf16_{layout}", 1.3, "vs_best_hf")
        goal(f"FP8 delayed ({layout}) vs best transformers row", f"seqfuse_fp8_delayed_{layout}", 1.8, "vs_best_hf")
        goal(f"FP8 block ({layout}) vs best transformers row", f"seqfuse_fp8_block_{layout}", 1.8, "vs_best_hf")
    for row, r in by.items():
        if r["impl"] == "seqfuse":
            goal(f"peak memory vs transformers ({row})", row, 1.0, "mem_vs_hf", le=True)
    return out


def train(args, device, dtype, data, data_note, seqs, meta):
    rows = args.rows.split(",") if args.rows else list(DEFAULT_TRAIN_ROWS)
    parsed = [(n, *parse_train_row(n)) for n in rows]  # every name checked before anything runs
    packed_b, padded_b = make_batches(seqs, args.steps, max_length=args.seq_len, batch_size=args.batch_size,
                                      seed=args.seed)
    if device.type == "cuda":
        packed_b = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in b.items()} for b in packed_b]
        padded_b = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in b.items()} for b in padded_b]
    cfg = seqfuse_config(args.size)
    extra = {"part": "train", "size": args.size, "seq_len": args.seq_len, "batch_size": args.batch_size,
             "tokens_per_step": args.seq_len * args.batch_size, "timed_steps": args.steps,
             "warm_passes": args.warm_passes, "dtype": str(dtype), "data": os.path.relpath(os.path.abspath(data), ROOT),
             "data_note": data_note,
             "layouts": "every sequence exactly seq_len tokens: padded [B, L] (no mask) and packed THD "
                        "(cu_seqlens) hold the same tokens; padded == packed in samples and loss",
             "timing": (f"steady state: {args.warm_passes} untimed pass(es) over the very batches then timed, then "
                        "one timed pass, GPU synchronized before and after it only"),
             "optimizers": (f"AdamW lr={args.lr:g}, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, no schedule, "
                            "no clipping; transformers: torch.optim.AdamW(fused=True) on the bf16 parameters; "
                            "seqfuse: FusedAdamW " + (
                                "with fp32 master weights (--master-weights: NOT the transformers rows' update, "
                                "whose bf16 parameters drop updates below half a bf16 step; losses may disagree)"
                                if args.master_weights else
                                "without master weights, bf16 moments (the same update and state: fp32 math, "
                                "moments and parameters rounded to bf16)")),
             "loss_tolerances": {k: f"{v:g} relative to hf_bf16 at every step" for k, v in LOSS_TOL.items()},
             "flops": "llama3_common.train_flops: 3 x forward GEMM FLOPs + causal attention (lower triangle)",
             "mfu_ceilings_tflops": {"measured_bf16": H200_BF16_MEASURED_TFLOPS,
                                     "datasheet_bf16": H200_BF16_DATASHEET_TFLOPS},
             "compile": {"scope": args.compile_scope}, "run": meta}
    results = []
    path = os.path.join(args.results_dir, f"{args.out}.json")

    def save_partial():
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            part = [dict(r) for r in results]
            json.dump({"name": args.out, "complete": False,
                       "rows": add_train_ratios(part, loss_check(part, fp32=dtype == torch.float32)),
                       **extra}, fh, indent=1, default=str)
        os.replace(path + ".tmp", path)

    for name, impl, recipe, layout in parsed:
        base = dict(row=name, impl=impl, recipe=recipe, layout=layout)
        if impl in ("hfcompile", "liger") and device.type != "cuda":
            why = (f"{'torch.compile' if impl == 'hfcompile' else 'Liger-Kernel (Triton)'} row: needs a CUDA GPU "
                   "here (the CPU smoke run skips it)")
            log(f"{name}: SKIPPED: {why}")
            results.append({**base, "skipped": why})
            continue
        try:
            r = run_train_row(name, packed_b, padded_b, args, device, dtype)
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others; the reason is kept
            row_failed(results, base, name, e, device)
            save_partial()
            continue
        f = train_figures(r, packed_b, cfg)
        if r["notes"]:
            f["note"] = "; ".join(str(v) for v in r["notes"].values())
        results.append({**base, **f})
        log(f"{name}: {f['unpadded_tokens_per_s'] / 1e3:.1f}k tok/s, step {f['step_ms']:.1f} ms (host issue "
            f"{f['host_issue_ms']:.1f} ms), MFU {f['mfu_measured_pct']:.1f} % of 794, peak {f['peak_mem_gib']:.1f} GiB, "
            f"warm-up {f['warm_s']:.1f} s, first loss {f['first_loss']:.4f}")
        save_partial()
    check = loss_check(results, fp32=dtype == torch.float32)
    add_train_ratios(results, check)
    for line in loss_table(results, check):
        log(line)
    if check["pass"] is None:
        log("loss check: NOT RUN (no transformers row, eager or compiled, in this run)")
    elif not check["pass"]:
        log("LOSS MISMATCH: " + "; ".join(f"{n}: {c['why']}" for n, c in check["rows"].items() if not c["pass"])
            + " -> those rows' speed ratios are WITHHELD")
    goals = train_goals(results)
    for g in goals:
        if g.get("withheld"):
            log(f"goal {g['goal']}: WITHHELD ({g['withheld']})")
        else:
            log(f"goal {g['goal']}: {g['value']:.3g} (need {g['need']}) -> {'PASS' if g['pass'] else 'FAIL'}")
    cols = ["row", "steps", "unpadded_tokens_per_s", "vs_hf", "vs_best_hf", "mfu_measured_pct", "mfu_datasheet_pct",
            "peak_mem_gib", "mem_vs_hf", "step_ms", "host_issue_ms", "warm_s", "first_loss", "final_loss", "note",
            "ratio_withheld", "error", "skipped"]
    table = Table(args.out, cols)
    for r in results:
        table.add(**r)
    _save(table, args, {**extra, "complete": True, "goals": goals, "loss_check": check})
    ok = [r for r in results if "unpadded_tokens_per_s" in r]
    if ok and device.type == "cuda":
        png = os.path.join(args.results_dir, f"{args.out}.png")
        plot_bars(png, f"Llama 3 {args.size} on DNA, {args.seq_len} tokens/sequence, one GPU: tokens/s",
                  [r["row"] for r in ok], {"tokens/s (thousands)": [r["unpadded_tokens_per_s"] / 1e3 for r in ok]},
                  "thousand tokens/s")
        log(f"plot {png}")
    return results, check


def _save(table, args, extra):
    """Table.save into --results-dir (harness.RESULTS by default)."""
    import harness

    old = harness.RESULTS
    harness.RESULTS = args.results_dir
    try:
        return table.save(extra=extra)
    finally:
        harness.RESULTS = old


# ---------------------------------------------------------------- decoding
def prompts_of(seqs, batch, prompt_len):
    """[batch, prompt_len] prompt ids: <bos> and the first bases of distinct windows (cycling)."""
    from llama3_common import tokenizer

    tok = tokenizer()
    rows = []
    for i in range(batch):
        s = seqs[i % len(seqs)][: prompt_len - 1]
        if len(s) != prompt_len - 1:
            raise ValueError(f"prompts_of: windows shorter than {prompt_len - 1} bases")
        rows.append(torch.cat([torch.tensor([tok.bos_token_id]), tok.encode(s, add_special_tokens=False)]))
    return torch.stack(rows).long()


def run_decode_row(name, prompts, args, device, dtype):
    """(tokens [b, new], median seconds of generate, notes) for one decode row."""
    from seqfuse.hf import InferenceParams

    b, plen = prompts.shape
    new = args.new_tokens
    ids = prompts.to(device)
    notes = {}
    if name in HF_DECODE:
        model = build_hf(args.size, device, dtype, seed=args.seed).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = model.config.pad_token_id
        kw = dict(max_new_tokens=new, do_sample=False, cache_implementation="static",
                  attention_mask=torch.ones_like(ids), disable_compile=name == "hf_static")
        if name == "hf_static_compiled":
            notes["compile"] = ("transformers' automatic compilation of the static-cache decode step"
                                + ("" if device.type == "cuda" else " (not on CPU: transformers compiles on GPUs only)"))

        def gen():
            return model.generate(ids, **kw)[:, plen:]
    else:
        import contextlib

        model = build_seqfuse(args.size, device, dtype, seed=args.seed).eval()
        cfg = model.config
        cache = InferenceParams(b, plen + new, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
        fp8 = name == "seqfuse_fp8_delayed"
        if fp8:
            from seqfuse.common.recipe import DelayedScaling
            from seqfuse.pytorch import fp8_autocast

        # seqfuse_bf16 and the FP8 row: generate's default (the decode step as a CUDA graph where it can be)
        graphs = False if name == "seqfuse_bf16_eager" else None

        def gen():
            ctx = fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()) if fp8 else contextlib.nullcontext()
            with ctx:
                return model.generate(ids, max_new_tokens=new, eos_token_id=[], inference_params=cache,
                                      decode_graphs=graphs)
    with torch.no_grad():
        t_warm = time.perf_counter()
        gen()
        _sync(device)
        notes["warm_s"] = round(time.perf_counter() - t_warm, 2)
        times = []
        for _ in range(args.decode_repeats):
            t0 = time.perf_counter()
            out = gen()
            _sync(device)
            times.append(time.perf_counter() - t0)
    if name not in HF_DECODE:
        captures = cache.graph_captures
        replays = sum(g.replays for g in cache.decode_graphs.values())
        notes["decode_step"] = (f"decode step replayed as a CUDA graph (captured {captures}x in the untimed "
                                f"generate, {replays} replays in all)" if captures else "decode step run eagerly")
    out = out.detach().cpu()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out, statistics.median(times), notes


def first_divergence(a, b):
    """Per row, the first position where two token arrays differ (None: identical)."""
    out = []
    for x, y in zip(a, b):
        d = (x != y).nonzero()
        out.append(int(d[0]) if d.numel() else None)
    return out


def decode(args, device, dtype, seqs, data_note, meta):
    rows = args.decode_rows.split(",") if args.decode_rows else list(DEFAULT_DECODE_ROWS)
    for n in rows:
        if n not in DECODE_ROWS:
            raise ValueError(f"decode row {n!r}: expected one of {', '.join(DECODE_ROWS)}")
    batches = [int(x) for x in args.decode_batches.split(",")]
    prompt_seqs = [s for s in seqs if len(s) >= args.prompt_len - 1]
    results = []
    tokens = {}
    path = os.path.join(args.results_dir, f"{args.out}_decode.json")
    prompts = {bsz: prompts_of(prompt_seqs, bsz, args.prompt_len) for bsz in batches}
    # compiled rows last (their compile time is the longest): a run cut short keeps the others
    order = [(n, b) for n in rows if n != "hf_static_compiled" for b in batches] + \
            [(n, b) for n in rows if n == "hf_static_compiled" for b in batches]
    for name, bsz in order:
        base = dict(row=name, batch=bsz, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        if name == "hf_static_compiled" and device.type != "cuda":
            why = "transformers compiles the static-cache decode step on GPUs only (the CPU smoke run skips it)"
            log(f"decode {name} b={bsz}: SKIPPED: {why}")
            results.append({**base, "skipped": why})
            continue
        try:
            out, secs, notes = run_decode_row(name, prompts[bsz], args, device, dtype)
        except Exception as e:  # noqa: BLE001 - keep the reason, run the other rows
            row_failed(results, base, f"decode {name} b={bsz}", e, device)
            continue
        tokens[(name, bsz)] = out
        r = {**base, "seconds": secs, "tokens_per_s": bsz * args.new_tokens / secs,
             "ms_per_token_step": 1000 * secs / args.new_tokens, "warm_s": notes.pop("warm_s")}
        if notes:
            r["note"] = "; ".join(notes.values())
        ref = tokens.get(("hf_static", bsz))
        if ref is not None:
            div = first_divergence(out, ref)
            r["same_tokens_as_hf_static"] = all(d is None for d in div)
            r["first_divergence"] = div
        graphed = tokens.get(("seqfuse_bf16", bsz)) if name == "seqfuse_bf16_eager" else None
        if graphed is not None:  # the graphed step is the eager step captured: the same tokens
            r["same_tokens_as_seqfuse_bf16"] = torch.equal(out, graphed)
        results.append(r)
        log(f"decode {name} b={bsz}: {r['tokens_per_s']:.0f} tok/s ({r['ms_per_token_step']:.2f} ms per step, "
            f"prefill included)" + ("" if ref is None else f", same tokens as hf_static: "
                                                           f"{r['same_tokens_as_hf_static']}"))
        os.makedirs(args.results_dir, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump({"name": args.out + "_decode", "complete": False, "rows": results, "run": meta}, fh, indent=1,
                      default=str)
        os.replace(path + ".tmp", path)
    nan = float("nan")
    for r in results:
        if "tokens_per_s" not in r:
            continue
        mates = [p for p in results if p["batch"] == r["batch"] and "tokens_per_s" in p and p["row"] in HF_DECODE]
        best = max(mates, key=lambda p: p["tokens_per_s"]) if mates else None
        r["vs_best_hf"], r["best_hf"] = (r["tokens_per_s"] / best["tokens_per_s"], best["row"]) if best else (nan, "")
    goals = []
    for r in results:
        if r["row"] == "seqfuse_bf16" and r["batch"] == 1 and r.get("vs_best_hf") == r.get("vs_best_hf") \
                and "vs_best_hf" in r:
            goals.append({"goal": "decode at batch 1 vs transformers' static-cache generate (best of eager/compiled)",
                          "row": "seqfuse_bf16", "value": r["vs_best_hf"], "need": ">= 1.5",
                          "pass": r["vs_best_hf"] >= 1.5})
    for g in goals:
        log(f"goal {g['goal']}: {g['value']:.3g} (need {g['need']}) -> {'PASS' if g['pass'] else 'FAIL'}")
    cols = ["row", "batch", "prompt_len", "new_tokens", "tokens_per_s", "vs_best_hf", "best_hf", "ms_per_token_step",
            "warm_s", "same_tokens_as_hf_static", "same_tokens_as_seqfuse_bf16", "note", "error", "skipped"]
    table = Table(args.out + "_decode", cols)
    for r in results:
        table.add(**r)
    _save(table, args, {"part": "decode", "size": args.size, "dtype": str(dtype), "data_note": data_note,
                        "timing": (f"one untimed generate of the same shapes, then the median of "
                                   f"{args.decode_repeats} timed ones; tokens/s = batch x new tokens / generate "
                                   "time, prefill of the prompt included"),
                        "greedy": "do_sample=False, eos ignored (transformers: generation_config.eos_token_id None; seqfuse: eos_token_id=[])",
                        "goals": goals, "run": meta})
    ok = [r for r in results if "tokens_per_s" in r]
    if ok and device.type == "cuda":
        png = os.path.join(args.results_dir, f"{args.out}_decode.png")
        plot_bars(png, f"Llama 3 {args.size} generate, {args.prompt_len}-token prompt, {args.new_tokens} new tokens",
                  [f"{r['row']} b={r['batch']}" for r in ok], {"tokens/s": [r["tokens_per_s"] for r in ok]},
                  "generated tokens/s")
        log(f"plot {png}")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1B", help="1B 3B 8B (Llama 3 shapes), or tiny (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", default="train,decode", help="train, decode or both")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 8192; tiny: 128)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per training step")
    p.add_argument("--steps", type=int, default=3, help="timed training steps (distinct batches)")
    p.add_argument("--warm-passes", type=int, default=1, help="untimed passes over the timed batches first")
    p.add_argument("--rows", default=None, help=f"training rows, comma list of {','.join(TRAIN_ROWS)}; "
                                                f"default {','.join(DEFAULT_TRAIN_ROWS)}")
    p.add_argument("--compile-scope", default="layers", choices=("layers", "model"))
    p.add_argument("--decode-rows", default=None, help=f"comma list of {','.join(DECODE_ROWS)}; default "
                                                       f"{','.join(DEFAULT_DECODE_ROWS)}")
    p.add_argument("--decode-batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; tiny: 32)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-repeats", type=int, default=2)
    p.add_argument("--data", default=None, help="a genome-window Parquet file (default: llama3_common.BENCH_DATA, else "
                                                "the committed subset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of every training row")
    p.add_argument("--master-weights", action="store_true",
                   help="seqfuse rows keep fp32 master weights (the transformers rows cannot: their losses then "
                        "differ and the loss check withholds the seqfuse rows' ratios)")
    p.add_argument("--out", default="llama3")
    p.add_argument("--results-dir", default=RESULTS)
    args = p.parse_args(argv)
    tiny = args.size == "tiny"
    args.seq_len = args.seq_len or (128 if tiny else 8192)
    args.prompt_len = args.prompt_len or (32 if tiny else 512)
    if args.steps < 1 or args.warm_passes < 0 or args.batch_size < 1 or args.seq_len % 16:
        p.error("--steps >= 1, --warm-passes >= 0, --batch-size >= 1, --seq-len a multiple of 16")
    if not args.lr > 0 or args.lr != args.lr or args.lr == float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    parts = set(args.parts.split(","))
    if not parts <= {"train", "decode"}:
        p.error("--parts: train and/or decode")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the CUDA attention takes fp16/bf16
    data, data_note = data_path(args.data)
    seqs = fixed_length_sequences(load_windows(data), args.seq_len - 2)
    log(f"data {data}: {len(seqs)} sequences of {args.seq_len - 2} bases ({data_note})")
    meta = run_metadata(__file__, argv=None if argv is None else [__file__] + list(argv))
    out = {}
    if "train" in parts:
        out["train"], out["loss_check"] = train(args, device, dtype, data, data_note, seqs, meta)
    if "decode" in parts:
        out["decode"] = decode(args, device, dtype, seqs, data_note, meta)
    if "loss_check" in out and out["loss_check"]["pass"] is False:
        raise SystemExit(2)
    return out


if __name__ == "__main__":
    main()
