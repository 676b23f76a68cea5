"""ESM-2 training throughput on real UniProt proteins (max length 1024), in
one process on the same GPU, with identical initial weights, against every
peer a user would compare with:

  hf_*          Hugging Face EsmForMaskedLM (sdpa, bf16), eager;
  hfcompile_*   the same model under torch.compile (--compile-scope: each
                EsmLayer, the default, or the whole model; dynamic shapes for
                the real-length batches, --compile-dynamic);
  hfao_*        the same model on torchao's float8 training
                (torchao.float8.convert_to_float8_training,
                Float8LinearConfig.from_recipe_name "tensorwise", the
                configuration torchao documents, or "rowwise"), compiled
                exactly as the hfcompile rows (torchao's float8 only pays
                under torch.compile); every nn.Linear whose dims are
                multiples of 16 runs FP8, the others stay bf16 and the
                row's notes name them (ESM-2's tied LM decoder, 33 tokens
                wide, and the contact head, not in the MLM loss); skipped
                with the reason where torchao does not import; emulated FP8
                on a CPU;
  te_*          ESM-2 on Transformer Engine's modules in BioNeMo's layout
                (peers/te_esm2.py: te.TransformerLayer, packed thd input),
                where transformer_engine imports (else the row is skipped and
                says why); the row's note names the attention TE ran
                (te_attention: cuDNN's FusedAttention, or the slow
                UnfusedDotProductAttention fallback);
  seqfuse_*     seqfuse's ESM-2, bf16 or FP8 (delayed / current / block).
  seqfusegraph_* the same with every encoder layer run as CUDA graphs
                (fixed: SeqfuseEsmModel.graph_layers for the one batch
                shape; packed: graph_packed_layers for --tokens tokens,
                max_length, and the most sequences any warm-up or timed
                batch needs rounded up to 8, or --graph-max-sequences;
                every batch padded to them on the device).

Row names: <impl>_<recipe>_<layout>; recipes bf16, fp8_delayed, fp8_current,
fp8_block (seqfuse and te; hf and hfcompile bf16 only) and fp8_tensorwise,
fp8_rowwise (hfao only: torchao's recipes); layouts
  packed    the recipe's token-budget batches, packed THD with cu_seqlens;
  padded    the SAME samples grouped by length: shuffled pools of 50 batches'
            worth of samples sorted by length, cut by the same token budget
            and padded to each batch's longest (transformers' Trainer with
            group_by_length, with a token budget instead of a fixed batch
            size), the real-lengths reference for Hugging Face;
  unsorted  the same samples padded in the packed batches' random order
            (what the earlier HF row did: no length grouping);
  fixed     (--fixed-length) every sequence exactly 1024 tokens (windows of
            the concatenated proteins), so no layout pads anything.
Padded batches are padded to a multiple of 16 tokens, so the hfao rows'
FP8 weight-gradient GEMMs get the inner dim torchao's FP8 GEMM needs.
Every real-length row trains on exactly the same samples and masks (the JSON
records the real tokens per row, and the run checks they are equal).

Timing is steady state: each row first runs --warm-passes untimed passes over
the very batches it then times (so every batch shape, cuDNN plan and
compiled graph exists before timing starts; compile time is reported as
warm_s), then one timed pass; a compiled row that still compiles during the
timed pass says so in its note.  --warmup N adds N distinct warm-up batches
before that.

Reported: tokens/s (incl. padding), unpadded tokens/s (real tokens: the
figure that matters), ratios against the length-grouped HF row (vs_hf), the
best HF row (vs_best_hf: eager or compiled; for FP8 rows torchao's float8
HF rows too), the best peer of any kind (vs_best_peer, naming it among hf,
hfcompile, hfao and te), TE's row of the same recipe (vs_te) and, for FP8
rows, the fastest torchao float8 row (vs_ao, naming it), MFU of
the useful FLOPs (esm2_recipe.metrics.train_flops) against the measured bf16
ceiling (794 TFLOP/s) and the datasheet (989), peak memory (with start_gib,
what earlier rows left allocated; mem_vs_hf compares peaks net of it), step time.  HF
(eager, compiled, torchao) and TE train bf16 parameters with torch's fused AdamW (bf16 moments); seqfuse
bf16 parameters with FusedAdamW and fp32 master weights (12 bytes of
optimizer state per parameter against the peers' 4, counted in the peaks), or with --peer-adamw
FusedAdamW without masters and with bf16 moments: the peers' update and
state, so the memory rows compare the models alone.  The JSON records the git commit, the versions of torch,
transformers, seqfuse and the peers (torchao and Transformer Engine included), and the exact command
(peers/meta.py).

Two GPUs: ``torchrun --nproc_per_node 2 benchmarks/esm2/bench_esm2.py --fsdp2``
measures seqfuse under FSDP2 (fully_shard per layer) on both GPUs and, in
the same job, the same per-GPU batches on each GPU alone (no collectives);
the scaling is the ratio of total unpadded tokens/s (goal >= 1.85 on two).

JSON: benchmarks/results/esm2.json (esm2_fsdp2.json), PNG next to it.
Quick look: --size 35M --steps 5; CPU smoke test: --size tiny --device cpu.
"""
import argparse
import gc
import os
import re
import time
import traceback

from common import (RECIPE_NAMES, batch_shape, build_hf, build_seqfuse, data_dir, fixed_length_sequences,
                    fp8_recipe, forward_loss, load_train_sequences, make_batches, real_length_layouts, seq_lengths,
                    seqfuse_config)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from seqfuse.distributed import end_process_group  # noqa: E402
from esm2_recipe.metrics import H200_BF16_DATASHEET_TFLOPS, H200_BF16_MEASURED_TFLOPS, train_flops  # noqa: E402
from harness import RESULTS, Table, compile_layers_or_model, init_torchrun, plot_bars  # noqa: E402
from peers.meta import run_metadata, skip_reason  # noqa: E402

IMPLS = ("hf", "hfcompile", "hfao", "te", "seqfuse", "seqfusegraph")
OURS = ("seqfuse", "seqfusegraph")
LAYOUTS = ("packed", "padded", "unsorted", "fixed")
PEERS = ("hf", "hfcompile", "hfao", "te")
HF_IMPLS = ("hf", "hfcompile", "hfao")  # transformers' EsmForMaskedLM: padded batches only
COMPILED = ("hfcompile", "hfao")  # torch.compile'd per layer (or whole) by compile_hf
#: seqfuse's and Transformer Engine's recipes (the same names in both: common.fp8_recipe's)
RECIPES = RECIPE_NAMES
#: the hfao rows' recipe tokens -> torchao's Float8LinearConfig.from_recipe_name
TORCHAO_RECIPES = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise"}
DEFAULT_ROWS = ["hf_bf16_padded", "hfcompile_bf16_padded", "hfao_fp8_tensorwise_padded", "te_bf16_packed",
                "te_fp8_delayed_packed", "seqfuse_bf16_packed", "seqfuse_fp8_delayed_packed",
                "seqfuse_fp8_block_packed", "seqfusegraph_bf16_packed", "seqfusegraph_fp8_delayed_packed"]
FIXED_ROWS = ["hf_bf16_fixed", "hfcompile_bf16_fixed", "hfao_fp8_tensorwise_fixed", "te_bf16_fixed",
              "te_fp8_delayed_fixed", "seqfuse_bf16_fixed", "seqfuse_fp8_delayed_fixed", "seqfuse_fp8_block_fixed",
              "seqfusegraph_bf16_fixed", "seqfusegraph_fp8_delayed_fixed", "seqfusegraph_fp8_block_fixed"]
TE_NEEDS = "transformer_engine.pytorch"
AO_NEEDS = "torchao.float8"


def parse_row(name):
    """(impl, recipe, layout) of a row name <impl>_<recipe>_<layout>; ValueError
    for a name the bench does not run (each recipe only with the impls that
    run it: seqfuse's / TE's names with seqfuse and te, torchao's with hfao)."""
    parts = name.split("_")
    impl, layout = parts[0], parts[-1]
    recipe = "_".join(parts[1:-1])
    if impl not in IMPLS or layout not in LAYOUTS:
        raise ValueError(f"row {name!r}: expected <{'|'.join(IMPLS)}>_<{'|'.join(RECIPES + tuple(TORCHAO_RECIPES))}>_"
                         f"<{'|'.join(LAYOUTS)}>")
    if impl == "hfao":
        if recipe not in TORCHAO_RECIPES:
            raise ValueError(f"row {name!r}: hfao rows run torchao's float8 training, recipe "
                             f"{' or '.join(TORCHAO_RECIPES)} (seqfuse's / TE's recipe names are not torchao's)")
    elif recipe in TORCHAO_RECIPES:
        raise ValueError(f"row {name!r}: {recipe} is torchao's float8 recipe: hfao rows only "
                         f"(seqfuse and TE run {', '.join(RECIPES)})")
    elif recipe not in RECIPES:
        raise ValueError(f"row {name!r}: unknown recipe {recipe!r}: {', '.join(RECIPES)} (seqfuse, TE), "
                         f"{', '.join(TORCHAO_RECIPES)} (hfao)")
    if impl in ("hf", "hfcompile") and recipe != "bf16":
        raise ValueError(f"row {name!r}: Hugging Face runs bf16 padded, unsorted or fixed only "
                         f"(its FP8 rows are hfao: torchao's float8 training)")
    if impl in HF_IMPLS and layout == "packed":
        raise ValueError(f"row {name!r}: Hugging Face runs padded, unsorted or fixed batches only "
                         f"(EsmForMaskedLM takes no packed batches)")
    if impl == "seqfusegraph" and layout not in ("fixed", "packed"):
        raise ValueError(f"row {name!r}: graphed layers take fixed or packed batches (padded batches change "
                         f"their shape every step)")
    return impl, recipe, layout


def packed_graph_bounds(batches, tokens, max_length, max_sequences=None):
    """graph_packed_layers' (tokens, max_sequences, max_seqlen) for these
    packed batches: the token budget, ``max_sequences`` or else the most
    sequences a batch needs once padded to it (its own and its padding
    sequences of PackedLayout's PAD_SEGMENT tokens) rounded up to 8, and
    max_length."""
    from seqfuse.hf.layer_graphs import PackedLayout

    probe = PackedLayout("bench", tokens, tokens, max_length)
    if max_sequences is None:
        need = max(probe.sequences_wanted(b["input_ids"].numel(), b["cu_seqlens"].numel() - 1) for b in batches)
        max_sequences = -(-need // 8) * 8
    return tokens, max(max_sequences, PackedLayout.min_sequences(tokens, max_length)), max_length


def compile_hf(model, scope, dynamic):
    """torch.compile a transformers EsmForMaskedLM in place: each EsmLayer
    (scope "layers": one graph reused by every layer) or the whole model."""
    return compile_layers_or_model(model, model.esm.encoder.layer, scope, dynamic)


def torchao_float8(model, recipe, emulate=False):
    """Convert a transformers EsmForMaskedLM in place to torchao's float8
    training: convert_to_float8_training with
    Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe]), the
    configuration torchao's README gives a user.  Every nn.Linear whose two
    dims are multiples of 16 (torchao's FP8 GEMMs need it; its module_filter_fn
    decides) becomes a Float8Linear; the others stay in the model's dtype (bf16
    on the GPU), and the returned notes name them (ESM-2: the LM decoder,
    hidden -> 33 tokens, tied to the embeddings, and the contact head's
    regression, layers x heads -> 1).  ``emulate``: torchao's emulated FP8
    (no FP8 GEMM on a CPU: a smoke test whose speed means nothing)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[recipe])
    if emulate:
        cfg = dataclasses.replace(cfg, emulate=True)
    converted, kept = [], []

    def dims_of_16(mod, fqn):
        ok = mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        (converted if ok else kept).append(f"{fqn} [{mod.in_features}->{mod.out_features}]")
        return ok

    convert_to_float8_training(model, module_filter_fn=dims_of_16, config=cfg)
    notes = {"torchao": f"float8 training, Float8LinearConfig.from_recipe_name({TORCHAO_RECIPES[recipe]!r})"
                        + (", emulate=True (CPU)" if emulate else "")
                        + f", {len(converted)} nn.Linear converted to Float8Linear",
             "bf16_linears": (", ".join(kept) + " (a dim not a multiple of 16: not converted, they run in the "
                              "model's dtype, bf16 on the GPU; ESM-2's contact head is not in the MLM loss)")
                             if kept else "none"}
    return notes


def _compiled_graphs():
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def build_model(impl, args, device, dtype, layout, recipe="bf16"):
    """(model, optimizer, notes) for one row.  hfao: Hugging Face's model on
    torchao's float8 training (torchao_float8), then compiled exactly as the
    hfcompile rows are (torchao's float8 is meant to run under torch.compile,
    which fuses its casts)."""
    notes = {}
    if impl in HF_IMPLS:
        model = build_hf(args.size, device, dtype)
        if impl == "hfao":
            notes.update(torchao_float8(model, recipe, emulate=device.type != "cuda"))
        if impl in COMPILED:
            dyn = {"auto": layout != "fixed", "true": True, "false": False}[args.compile_dynamic]
            compile_hf(model, args.compile_scope, dyn)
            notes["compile"] = f"torch.compile scope={args.compile_scope} dynamic={dyn}"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    elif impl == "te":
        from peers.te_esm2 import from_seqfuse

        sf = build_seqfuse(args.size, device, dtype)
        model = from_seqfuse(sf, "thd" if layout == "packed" else "bshd", dtype=dtype, device=device)
        del sf
        notes["layout"] = "te.TransformerLayer " + ("thd (packed, cu_seqlens)" if layout == "packed" else "bshd")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    else:
        raise ValueError(f"build_model: {impl!r} (seqfuse rows are built in run_row)")
    return model, opt, notes


def run_row(impl, recipe_name, warm, timed, args, device, fsdp=None, torch_adamw=False, alone=False, profile=None,
            warm_passes=0, layout="packed"):
    """One row: build, run the ``warm`` batches, then ``warm_passes`` untimed
    passes over ``timed``, then time one pass over ``timed``.  ``fsdp``: None
    (plain module) or an FSDP2 setting dict (see fsdp2_config).  ``profile``:
    None or (path, title): afterwards profile --profile-steps more steps."""
    import contextlib
    import dataclasses

    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.pytorch import autocast

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # what earlier rows left allocated (a compiled model's caches, graph pools): this row's peaks include it
    start_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    recipe = None if recipe_name in TORCHAO_RECIPES else fp8_recipe(recipe_name)  # torchao's: build_model's
    amax_group = None
    if alone and isinstance(recipe, DelayedScaling):  # one rank of a job: no amax all-reduce with the others
        recipe = dataclasses.replace(recipe, reduce_amax=False)
    elif fsdp is not None and isinstance(recipe, DelayedScaling) and fsdp.get("amax") == "off":
        recipe = dataclasses.replace(recipe, reduce_amax=False)  # diagnostic: each rank its own scales
    elif fsdp is not None and fsdp.get("amax") == "own":
        amax_group = _own_amax_group()
    notes = {}
    if impl in OURS:
        model = build_seqfuse(args.size, device, dtype)
        if fsdp is not None and fsdp["ddp"]:  # the comparison: DDP, bucketed all-reduce hooks in C++
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True)
        elif fsdp is not None:
            shard_model(model, fsdp)
        params = [p for p in model.parameters() if p.requires_grad]
        if torch_adamw or args.torch_adamw:
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        else:  # FusedAdamW takes FSDP2's DTensor shards too (local update, sharded state)
            from seqfuse.optim import FusedAdamW

            opt = (FusedAdamW(params, lr=1e-4, master_weights=False, exp_avg_dtype=torch.bfloat16,
                              exp_avg_sq_dtype=torch.bfloat16) if args.peer_adamw else FusedAdamW(params, lr=1e-4))

        def context():
            return autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group)
    else:
        model, opt, notes = build_model(impl, args, device, dtype, layout, recipe=recipe_name)
        if impl == "te":
            from peers.te_esm2 import te_autocast, te_recipe

            te_r = te_recipe(recipe_name)

            def context():
                return te_autocast(te_r is not None, te_r)
        else:
            context = contextlib.nullcontext
    model.train()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the reserved peak counts this row's blocks only
        torch.cuda.reset_peak_memory_stats()  # from here: eager steps before graphs, the capture, the warm-up

    def step(batch):
        with context():
            loss = forward_loss(model, batch, device)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if impl == "seqfusegraph":  # every encoder layer's forward and backward as CUDA graphs, one batch shape
        first = list(warm or timed)
        eager = [first[i % len(first)] for i in range(getattr(args, "eager_before_graphs", 0))]
        for b in eager:  # training steps before the capture (FP8 delayed: the amax history the graphs need)
            step(b)
        if layout == "packed":
            bounds = packed_graph_bounds(list(warm) + list(timed), args.tokens, args.max_length,
                                         getattr(args, "graph_max_sequences", None))
            model.esm.graph_packed_layers(*bounds, fp8_recipe=recipe)
            notes["graphs"] = ("encoder layers graphed for packed batches of at most (tokens, sequences, "
                               f"max_seqlen) {bounds} (SeqfuseEsmModel.graph_packed_layers)")
        else:
            shape = tuple(first[0]["input_ids"].shape)
            model.esm.graph_layers(*shape, fp8_recipe=recipe)
            notes["graphs"] = f"encoder layers graphed for input_ids {shape} (SeqfuseEsmModel.graph_layers)"
        notes["graphs"] += f" after {len(eager)} eager training steps" if eager else ""
    cfg = seqfuse_config(args.size)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t_warm = time.perf_counter()
    for b in list(warm) + list(timed) * warm_passes:
        step(b)
    sync()
    warm_s = time.perf_counter() - t_warm
    # the peak of the warm-up (first FP8 steps, graph captures' eager steps) and of the timed pass alone
    warm_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    warm_reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else float("nan")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    graphs_before = _compiled_graphs() if impl in COMPILED else 0
    losses, issue = [], []
    t0 = time.perf_counter()
    for b in timed:  # no sync inside: issue time < step time means the host runs ahead of the GPU
        ti = time.perf_counter()
        losses.append(step(b))
        issue.append(time.perf_counter() - ti)
    sync()
    dt = time.perf_counter() - t0
    steady_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    # what the caching allocator held at most (graphs' private pools included, allocated or not)
    reserved = max(warm_reserved, torch.cuda.max_memory_reserved() / 2**30) if device.type == "cuda" else float("nan")
    if impl == "te":  # which attention TE ran (its unfused fallback is a handicapped peer: the row must say)
        from peers.te_esm2 import te_attention_backend

        notes["te_attention"] = te_attention_backend()
    if impl in COMPILED:
        notes["dynamo_graphs_so_far"] = _compiled_graphs()
        if notes["dynamo_graphs_so_far"] > graphs_before:
            notes["recompiled_in_timed_pass"] = notes["dynamo_graphs_so_far"] - graphs_before
    prof = None
    if profile is not None:
        from profile_summary import profile_steps, sync_points

        prof = profile_steps(step, timed[: args.profile_steps], sync, profile[0], profile[1],
                             cuda=device.type == "cuda")
        if device.type == "cuda" and fsdp is None:  # and the Python stack of every host synchronization of a step
            stem = profile[0][:-len("_profile.txt")] if profile[0].endswith("_profile.txt") else profile[0]
            notes["syncs_per_step"] = sync_points(lambda: step(timed[0]), f"{stem}_syncs.txt", profile[1])
    losses = [float(x.detach()) for x in losses]
    real = sum(int(b["num_tokens"]) for b in timed)
    total = sum(b["input_ids"].numel() for b in timed)
    flops = sum(train_flops(seq_lengths(b), cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers)
                for b in timed)
    peak = max(warm_peak, steady_peak)
    del model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(seconds=dt, real=real, total=total, flops=flops, peak=peak, steady_peak=steady_peak, reserved=reserved,
                start_gib=start_gib, losses=losses,
                host_ms=1000.0 * sum(issue) / max(1, len(issue)), profile=prof, warm_s=warm_s, notes=notes,
                shapes=len({batch_shape(b) for b in timed}))


_AMAX_GROUP = []


def _own_amax_group():
    """A process group of all ranks for the delayed-scaling amax all-reduce
    alone (its own NCCL communicator, apart from the one FSDP2 / DDP use)."""
    if not _AMAX_GROUP:
        _AMAX_GROUP.append(dist.new_group(list(range(dist.get_world_size()))))
    return _AMAX_GROUP[0]


def net_peak(row):
    """A result row's peak allocated GiB net of what earlier rows left
    allocated (rows without a start figure: the raw peak)."""
    return row.get("net_peak_mem_gib", row["peak_mem_gib"])


def figures(r, world=1):
    return {
        "tokens_per_s": r["total"] / r["seconds"],
        "unpadded_tokens_per_s": r["real"] / r["seconds"],
        "padding_pct": 100.0 * (1 - r["real"] / r["total"]),
        "mfu_measured_pct": 100.0 * r["flops"] / r["seconds"] / (H200_BF16_MEASURED_TFLOPS * 1e12 * world),
        "mfu_datasheet_pct": 100.0 * r["flops"] / r["seconds"] / (H200_BF16_DATASHEET_TFLOPS * 1e12 * world),
        "peak_mem_gib": r["peak"],
        "start_gib": r.get("start_gib", 0.0),
        "net_peak_mem_gib": r["peak"] - r.get("start_gib", 0.0),
        "steady_peak_mem_gib": r.get("steady_peak", float("nan")),
        "peak_reserved_gib": r.get("reserved", float("nan")),
        "step_ms": 1000.0 * r["seconds"] / max(1, args_steps(r)),
        "final_loss": r["losses"][-1] if r["losses"] else float("nan"),
        "host_issue_ms": r.get("host_ms", float("nan")),
    }


def args_steps(r):
    return len(r["losses"])


TIMING = ("steady state: {warm} distinct warm-up batch(es), then {passes} untimed pass(es) over the very batches "
          "that are then timed (all shapes, cuDNN plans and compiled graphs built before timing), then one timed "
          "pass; CUDA synchronized before and after the timed pass only")
def seqfuse_optimizer(args):
    if args.torch_adamw:
        return "torch.optim.AdamW(foreach)"
    if args.peer_adamw:
        return "seqfuse FusedAdamW without master weights, bf16 moments (the peers' update and state)"
    return "seqfuse FusedAdamW with fp32 master weights and fp32 moments"


def optimizers(args):
    return ("hf, hfcompile, hfao, te: torch.optim.AdamW(fused=True) on bf16 parameters (bf16 moments); seqfuse: "
            + seqfuse_optimizer(args))


def length_class(row):
    return "fixed" if row["layout"] == "fixed" else "real"


def add_ratios(rows):
    """Fill each measured row's ratios against the peers of its length class
    (real lengths or fixed 1024): vs_hf (the length-grouped / fixed HF eager
    row), vs_best_hf (the fastest Hugging Face row, named in best_hf: eager
    or compiled bf16, and for an FP8 row also torchao's float8 rows, hfao),
    vs_best_peer (the fastest of HF, compiled HF, torchao float8 HF and TE,
    named in best_peer), vs_te (TE's row of the same recipe, same layout where
    measured, named in te_peer) and, for an FP8 row, vs_ao (the fastest hfao
    row, same layout where measured, named in ao_peer).  A compiled HF row
    slower than eager HF, or an hfao row slower than compiled bf16 HF, says so
    in its note."""
    ok = [r for r in rows if "unpadded_tokens_per_s" in r]
    nan = float("nan")

    def tps(r):
        return r["unpadded_tokens_per_s"]

    def best(cands):
        return max(cands, key=tps) if cands else None

    for r in ok:
        c = length_class(r)
        mates = [p for p in ok if length_class(p) == c]
        ref = next((p for p in mates if p["row"] == ("hf_bf16_fixed" if c == "fixed" else "hf_bf16_padded")), None)
        r["vs_hf"] = tps(r) / tps(ref) if ref else nan
        # peaks net of what earlier rows left allocated (start_gib), both sides
        r["mem_vs_hf"] = net_peak(r) / net_peak(ref) if ref else nan
        fp8 = r["recipe"].startswith("fp8")
        bh = best([p for p in mates if p["impl"] in (HF_IMPLS if fp8 else ("hf", "hfcompile"))])
        r["vs_best_hf"], r["best_hf"] = (tps(r) / tps(bh), bh["row"]) if bh else (nan, "")
        bp = best([p for p in mates if p["impl"] in PEERS])
        r["vs_best_peer"], r["best_peer"] = (tps(r) / tps(bp), bp["row"]) if bp else (nan, "")
        tes = [p for p in mates if p["impl"] == "te" and p["recipe"] == r["recipe"]]
        te = next((p for p in tes if p["layout"] == r["layout"]), None) or best(tes)
        r["vs_te"], r["te_peer"] = (tps(r) / tps(te), te["row"]) if te else (nan, "")
        aos = [p for p in mates if p["impl"] == "hfao"] if fp8 else []
        ao = best([p for p in aos if p["layout"] == r["layout"]]) or best(aos)
        r["vs_ao"], r["ao_peer"] = (tps(r) / tps(ao), ao["row"]) if ao else (nan, "")
        for impl, base, key, what in (("hfcompile", "hf", "vs_hf_eager", "compiled is SLOWER than eager"),
                                      ("hfao", "hfcompile", "vs_hfcompile",
                                       "torchao float8 is SLOWER than compiled bf16 HF")):
            if r["impl"] != impl:
                continue
            ref = next((p for p in mates if p["impl"] == base and p["layout"] == r["layout"]), None)
            if ref:
                r[key] = tps(r) / tps(ref)
                if r[key] < 1.0:
                    r["note"] = (r.get("note", "") + "; " if r.get("note") else "") + f"{what} ({r[key]:.2f}x)"
    return rows


def sample_check(rows):
    """Every real-length row must have trained on the same real tokens (same samples)."""
    real = {r["row"]: r["real_tokens"] for r in rows if "real_tokens" in r and length_class(r) == "real"}
    fixed = {r["row"]: r["real_tokens"] for r in rows if "real_tokens" in r and length_class(r) == "fixed"}
    same = len(set(real.values())) <= 1 and len(set(fixed.values())) <= 1
    return {"same_samples": same, "real_tokens_real_lengths": real, "real_tokens_fixed": fixed}


def _note(notes):
    return "; ".join(f"{k}={v}" if not isinstance(v, str) or k != "compile" else v for k, v in notes.items())


def single(args, device):
    data = data_dir(args.data)
    seqs = load_train_sequences(data)
    rows = args.rows.split(",") if args.rows else DEFAULT_ROWS + (FIXED_ROWS if args.fixed_length else [])
    parsed = [(name, *parse_row(name)) for name in rows]  # every name checked before anything runs
    warmup = args.warmup or 0
    pin = device.type == "cuda"
    layouts = {}

    def batches_for(layout):
        if layout not in layouts:
            if layout == "fixed":
                fx = fixed_length_sequences(seqs, args.max_length - 2)
                b = make_batches(fx, warmup + args.steps, tokens=args.tokens, max_length=args.max_length,
                                 packed=False, pin=pin)
                layouts["fixed"] = (b[:warmup], b[warmup:])
            else:
                layouts.update(real_length_layouts(seqs, args.steps, warmup, tokens=args.tokens,
                                                   max_length=args.max_length, pin=pin, pool=args.group_pool))
        return layouts[layout]

    meta = run_metadata(__file__)
    extra = {"size": args.size, "tokens_per_batch": args.tokens, "max_length": args.max_length,
             "packed_batches": args.steps, "warmup": warmup, "warm_passes": args.warm_passes,
             "timing": TIMING.format(warm=warmup, passes=args.warm_passes),
             "layouts": {"packed": "the recipe's token-budget packed THD batches (the sample set of every "
                                   "real-length row)",
                         "padded": "the same samples grouped by length: shuffled pools of "
                                   f"{'50 batches worth' if args.group_pool is None else args.group_pool} of samples "
                                   "sorted by length, cut by the token budget, padded to each batch's longest "
                                   "(multiple of 16), batches shuffled",
                         "unsorted": "the same samples padded in the packed batches' random order",
                         "fixed": "windows of exactly max_length tokens, no padding"},
             "compile": {"scope": args.compile_scope, "dynamic": args.compile_dynamic},
             "optimizers": optimizers(args), "data": data, "run": meta}
    results = []
    path = os.path.join(RESULTS, f"{args.out}.json")

    def save_partial():
        import json

        os.makedirs(RESULTS, exist_ok=True)
        with open(path + ".tmp", "w") as fh:
            json.dump({"name": args.out, "complete": False, "rows": add_ratios([dict(r) for r in results]), **extra},
                      fh, indent=1, default=str)
        os.replace(path + ".tmp", path)

    # TE before any row runs: once torch's cuDNN attention has loaded torch's
    # cuDNN, TE's import can pick up another libcudnn_cnn and fail on a symbol
    te_why = skip_reason(TE_NEEDS, need_cuda=True) if any(p[1] == "te" for p in parsed) else None
    # torchao runs on a CPU too (emulated FP8, a smoke test): only its import can rule it out
    ao_why = skip_reason(AO_NEEDS, need_cuda=False) if any(p[1] == "hfao" for p in parsed) else None
    if any(p[1] == "hfao" for p in parsed):
        extra["torchao"] = ao_why or ("hfao rows: transformers' EsmForMaskedLM, torchao.float8."
                                      "convert_to_float8_training (Float8LinearConfig.from_recipe_name: "
                                      + ", ".join(f"{k} = {v!r}" for k, v in TORCHAO_RECIPES.items())
                                      + ") on every nn.Linear whose dims are multiples of 16, then torch.compile "
                                      "as the hfcompile rows" + ("; emulated FP8 (no GPU)" if device.type != "cuda"
                                                                 else ""))
    for name, impl, recipe, layout in parsed:
        base = dict(row=name, impl=impl, recipe=recipe, layout=layout)
        why = {"te": te_why, "hfao": ao_why}.get(impl)
        if why:
            print(f"[esm2 bench] {name}: SKIPPED: {why}", flush=True)
            results.append({**base, "skipped": why})
            continue
        try:
            warm, timed = batches_for(layout)
            prof = ((os.path.join(args.profile, f"{name}_profile.txt"), f"{name} on one GPU")
                    if args.profile else None)
            r = run_row(impl, recipe, warm, timed, args, device, profile=prof, warm_passes=args.warm_passes,
                        layout=layout)
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others; the reason is kept
            traceback.print_exc()
            print(f"[esm2 bench] {name}: FAILED: {type(e).__name__}: {e}", flush=True)
            results.append({**base, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            save_partial()
            continue
        f = figures(r)
        f.update(steps=len(timed), real_tokens=r["real"], warm_s=r["warm_s"], batch_shapes=r["shapes"])
        if r["notes"]:
            f["note"] = _note(r["notes"])
            f["notes"] = r["notes"]
        results.append({**base, **f})
        print(f"[esm2 bench] {name}: {f['unpadded_tokens_per_s'] / 1e3:.1f}k unpadded tok/s, {len(timed)} steps "
              f"of {f['step_ms']:.1f} ms, padding {f['padding_pct']:.1f} %, warm-up {r['warm_s']:.1f} s"
              + (f" ({f['note']})" if r["notes"] else ""), flush=True)
        save_partial()

    add_ratios(results)
    check = sample_check(results)
    if not check["same_samples"]:
        print(f"[esm2 bench] SAMPLE MISMATCH: rows trained on different real tokens: {check}", flush=True)
    cols = ["row", "steps", "unpadded_tokens_per_s", "padding_pct", "vs_hf", "vs_best_hf", "vs_best_peer",
            "best_peer", "vs_te", "te_peer", "vs_ao", "ao_peer", "mfu_measured_pct", "peak_mem_gib",
            "start_gib", "steady_peak_mem_gib", "peak_reserved_gib", "mem_vs_hf", "step_ms",
            "host_issue_ms", "warm_s", "final_loss", "note", "error", "skipped"]
    table = Table(args.out, cols)
    for r in results:
        table.add(**r)
    goals = check_goals(table.rows)
    for g in goals:
        print(f"goal {g['goal']}: {g['value']:.3g} (need {g['need']}) -> {'PASS' if g['pass'] else 'FAIL'}")
    table.save(extra={**extra, "complete": True, "goals": goals, "sample_check": check})
    ok = [r for r in table.rows if "unpadded_tokens_per_s" in r]
    if ok and device.type == "cuda":
        png = os.path.join(RESULTS, f"{args.out}.png")
        plot_bars(png, f"ESM-2 {args.size} training on one GPU: unpadded tokens/s", [r["row"] for r in ok],
                  {"unpadded tokens/s (thousands)": [r["unpadded_tokens_per_s"] / 1e3 for r in ok]},
                  "thousand tokens/s")
        print(f"(plot {os.path.relpath(png)})")
    if not check["same_samples"]:
        raise SystemExit(2)


FP8_HF = "eager, compiled or torchao float8 compiled"


def check_goals(rows):
    """The issue's goals, each against the strongest peer measured."""
    by = {r["row"]: r for r in rows if "unpadded_tokens_per_s" in r}
    out = []

    def goal(name, row, need, key, le=False):
        if row in by and by[row].get(key) == by[row].get(key):  # present and not NaN
            v = by[row][key]
            out.append({"goal": name, "row": row, "key": key, "value": v,
                        "need": (f"<= {need}" if le else f">= {need}"), "pass": v <= need if le else v >= need})

    goal("packed FP8 delayed vs length-grouped HF, real lengths", "seqfuse_fp8_delayed_packed", 3.0, "vs_hf")
    goal("packed FP8 block vs length-grouped HF, real lengths", "seqfuse_fp8_block_packed", 3.0, "vs_hf")
    goal("packed FP8 delayed graphed vs length-grouped HF, real lengths", "seqfusegraph_fp8_delayed_packed", 3.0,
         "vs_hf")
    # best HF: eager or compiled bf16; for FP8 rows also torchao's float8 HF rows (add_ratios)
    goal("bf16 vs best HF (eager or compiled), all 1024", "seqfuse_bf16_fixed", 1.3, "vs_best_hf")
    goal(f"FP8 delayed vs best HF ({FP8_HF}), all 1024", "seqfuse_fp8_delayed_fixed", 1.7, "vs_best_hf")
    goal(f"FP8 block vs best HF ({FP8_HF}), all 1024", "seqfuse_fp8_block_fixed", 1.7, "vs_best_hf")
    for rec, need in (("bf16", 1.3), ("fp8_delayed", 1.7), ("fp8_block", 1.7)):
        goal(f"{rec} graphed vs best HF ({FP8_HF if rec != 'bf16' else 'eager or compiled'}), all 1024",
             f"seqfusegraph_{rec}_fixed", need, "vs_best_hf")
    for row, r in by.items():
        if r["impl"] in OURS and r.get("te_peer"):
            goal(f"{row} vs Transformer Engine ({r['te_peer']})", row, 1.0, "vs_te")
    for row, r in by.items():
        if r["impl"] in OURS and r.get("ao_peer"):
            goal(f"{row} vs torchao float8 ({r['ao_peer']})", row, 1.0, "vs_ao")
    for row, r in by.items():
        if r["impl"] in OURS and r["layout"] != "packed":
            goal(f"peak memory vs HF ({row})", row, 1.0, key="mem_vs_hf", le=True)
    return out


FSDP2_CONFIG_HELP = ("'+'-joined tokens: default (the --reshard-after-forward / --reduce-dtype / --prefetch "
                     "flags), raf0 / raf1 (reshard_after_forward), rbf16 / rfp32 (gradient reduce dtype), "
                     "pfN (explicit forward+backward prefetch of N units; pf0: FSDP2's implicit), gK (K layers per FSDP unit), "
                     "same (every "
                     "rank trains rank 0's batches: the scaling without per-rank load imbalance, a diagnostic), "
                     "ddp (torch DDP instead of FSDP2, for comparison: the FSDP2 tokens do not apply), bal (each step's "
                     "samples re-dealt over the ranks by cost: TokenBudgetBatchSampler(balance_ranks=True); "
                     "its own one-GPU baseline on those batches), amaxown (FP8 delayed scaling's amax all-reduce "
                     "on its own process group), amaxoff (no amax all-reduce: each rank keeps its own scales, "
                     "a diagnostic)")


def fsdp2_config(name, args):
    """An FSDP2 setting from a config name such as 'raf0+rbf16+pf1'."""
    cfg = dict(name=name, reshard=bool(args.reshard_after_forward), reduce=args.reduce_dtype,
               prefetch=int(args.prefetch), layers_per_unit=int(args.layers_per_unit), same=False, ddp=False, bal=False,
               amax="world")
    for tok in name.split("+"):
        if tok == "default":
            continue
        if tok in ("raf0", "raf1"):
            cfg["reshard"] = tok == "raf1"
        elif tok in ("rbf16", "rfp32"):
            cfg["reduce"] = "bfloat16" if tok == "rbf16" else "float32"
        elif re.fullmatch(r"pf\d+", tok):
            cfg["prefetch"] = int(tok[2:])
        elif re.fullmatch(r"g[1-9]\d*", tok):
            cfg["layers_per_unit"] = int(tok[1:])
        elif tok == "same":
            cfg["same"] = True
        elif tok == "ddp":
            cfg["ddp"] = True
        elif tok == "bal":
            cfg["bal"] = True
        elif tok in ("amaxown", "amaxoff"):
            cfg["amax"] = tok[4:]
        else:
            raise ValueError(f"--configs: unknown token {tok!r} in {name!r}; {FSDP2_CONFIG_HELP}")
    return cfg


def shard_model(model, cfg):
    from esm2_recipe.fsdp import shard_model as shard

    return shard(model, reshard_after_forward=cfg["reshard"], reduce_dtype=cfg["reduce"], prefetch=cfg["prefetch"],
                 layers_per_unit=cfg["layers_per_unit"])


def gather_rows(values, device):
    """[world, len(values)] float64 on the host: every rank's values."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def fsdp2(args):
    """Two (or more) GPUs under torchrun: seqfuse FSDP2 vs each GPU alone.

    Per row: the one-GPU baseline once (every rank alone on its own GPU, on
    its own batches, at once, no collectives), then each --configs setting
    under FSDP2 on the same per-GPU batches.  Baseline = the mean over ranks
    of the alone unpadded tokens/s (each rank's batches differ a little);
    FSDP2 = the unpadded tokens of all ranks / the slowest rank's time.
    Warm-up steps are excluded from both."""
    rank, world, device = init_torchrun("bench_esm2.py --fsdp2", cpu=args.device == "cpu")  # cpu: a gloo smoke test
    started = time.perf_counter()
    seqs = load_train_sequences(data_dir(args.data))
    warmup = 3 if args.warmup is None else args.warmup
    n = warmup + args.steps
    rows = args.rows.split(",") if args.rows else ["seqfuse_bf16_packed", "seqfuse_fp8_delayed_packed"]
    configs = [fsdp2_config(c, args) for c in args.configs.split(",")]
    want_prof = set(args.profile_configs.split(",")) if args.profile else set()
    table = Table(args.out + "_fsdp2", ["row", "config", "gpus", "unpadded_tokens_per_s", "scaling", "step_ms",
                                        "host_issue_ms", "mfu_measured_pct", "peak_mem_gib", "rank_seconds",
                                        "gpu_idle_ms", "exposed_comm_ms", "nccl_ms", "error"])

    def prof_path(tag):
        return os.path.join(args.profile, f"rank{rank}_{tag + '_' if tag else ''}profile.txt")

    def out_of_time():
        """Same answer on every rank (rank 0's clock decides)."""
        if not args.time_budget:
            return False
        flag = torch.tensor([float(time.perf_counter() - started > args.time_budget)], device=device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    for name in rows:
        impl, recipe, layout = parse_row(name)
        if impl != "seqfuse" or layout == "fixed":
            raise ValueError(f"--fsdp2 rows are seqfuse padded/packed rows, got {name!r}")
        if out_of_time():
            break
        mk = dict(tokens=args.tokens, max_length=args.max_length, packed=layout == "packed", world_size=world,
                  pin=device.type == "cuda")
        batches, bases = {}, {}

        def batches_for(bal, who=rank):
            if (bal, who) not in batches:
                batches[(bal, who)] = make_batches(seqs, n, rank=who, balance_ranks=bal, **mk)
            return batches[(bal, who)]

        def baseline(bal):
            """The one-GPU baseline on the same per-GPU batches and optimizer, run
            by every rank on its own GPU at once (no collectives): so every rank
            makes the same FP8 scaling states, whose amaxes the FSDP2 run then
            all-reduces as one buffer of equal size.  Balanced batches (config
            'bal') get their own baseline."""
            if bal in bases:
                return bases[bal]
            tag = "_bal" if bal else ""
            alone_prof = ((prof_path(f"{name}_alone{tag}"), f"{name} alone{tag} on rank {rank}")
                          if args.profile and not bal else None)
            bb = batches_for(bal)
            one = run_row(impl, recipe, bb[:warmup], bb[warmup:], args, device, fsdp=None, alone=True,
                          profile=alone_prof)
            g = gather_rows([one["real"], one["seconds"], one["host_ms"]], device)
            base = float((g[:, 0] / g[:, 1]).mean())  # mean over ranks of one GPU's unpadded tokens/s
            if rank == 0:
                f1 = figures(one)
                secs = "/".join(f"{x:.3f}" for x in g[:, 1].tolist())
                table.add(row=name, config="one_gpu" + tag, gpus=1, unpadded_tokens_per_s=base, scaling=1.0,
                          step_ms=f1["step_ms"], host_issue_ms=f1["host_issue_ms"],
                          mfu_measured_pct=f1["mfu_measured_pct"], peak_mem_gib=f1["peak_mem_gib"], rank_seconds=secs,
                          **prof_cols(one))
                print(f"[fsdp2] {name} one GPU{' (rank-balanced batches)' if bal else ''}: {base / 1e3:.1f}k unpadded "
                      f"tok/s (mean of ranks; alone seconds per rank {secs}), step {f1['step_ms']:.1f} ms, host issue "
                      f"{f1['host_issue_ms']:.1f} ms/step", flush=True)
            bases[bal] = base
            return base

        baseline(False)
        best = None
        for cfg in configs:
            if out_of_time():
                if rank == 0:
                    print(f"[fsdp2] {name} {cfg['name']}: skipped (--time-budget {args.time_budget} s spent)", flush=True)
                continue
            dist.barrier()
            prof = ((prof_path("" if cfg is configs[0] and len(rows) == 1 else f"{name}_{cfg['name']}"),
                     f"{name} FSDP2 {cfg['name']} on rank {rank} of {world}") if cfg["name"] in want_prof else None)
            base = baseline(cfg["bal"])
            mine = batches_for(cfg["bal"], 0 if cfg["same"] else rank)
            r = run_row(impl, recipe, mine[:warmup], mine[warmup:], args, device, fsdp=cfg, profile=prof)
            line = fsdp2_line(table, name, cfg, r, base, world, device)
            if rank == 0 and line is not None:
                s = line["scaling"]
                if not cfg["same"] and (best is None or s > best[1]):
                    best = (cfg, s)
        if "best" in want_prof:  # also profile the best-scaling setting (a re-run, not re-reported)
            nb = [best[0]["name"] if rank == 0 and best is not None else None]
            dist.broadcast_object_list(nb, 0)  # rank 0 decided: every rank takes the same branch
            if nb[0] is not None and nb[0] not in want_prof and not out_of_time():
                cfg = fsdp2_config(nb[0], args)
                bb = batches_for(cfg["bal"], 0 if cfg["same"] else rank)
                run_row(impl, recipe, bb[:warmup], bb[warmup:], args, device, fsdp=cfg,
                        profile=(prof_path(f"{name}_best_{cfg['name']}"), f"{name} FSDP2 best {cfg['name']} rank {rank}"))
    if rank == 0:
        table.save(extra={"size": args.size, "tokens_per_gpu_batch": args.tokens, "steps": args.steps,
                          "warmup": warmup, "world_size": world, "configs": configs, "run": run_metadata(__file__),
                          "baseline": "mean over ranks of one GPU alone on that rank's batches",
                          "optimizer": seqfuse_optimizer(args) + " in all rows (sharded under FSDP2)",
                          "profile_dir": args.profile})
        ok = [r for r in table.rows if "error" not in r]
        png = os.path.join(RESULTS, f"{args.out}_fsdp2.png")
        plot_bars(png, f"ESM-2 {args.size}: FSDP2 scaling", [f"{r['row']} {r['config']} x{r['gpus']}" for r in ok],
                  {"unpadded tokens/s (thousands)": [r["unpadded_tokens_per_s"] / 1e3 for r in ok]},
                  "thousand tokens/s")
    end_process_group()  # the rows' models are garbage now (run_row made them)


def prof_cols(r):
    p = r.get("profile") or {}
    return {k: p[v] for k, v in (("gpu_idle_ms", "gpu_idle_ms_per_step"), ("exposed_comm_ms", "exposed_comm_ms_per_step"),
                                 ("nccl_ms", "nccl_kernel_ms_per_step")) if v in p}


def fsdp2_line(table, name, cfg, r, base, world, device):
    """Aggregate one FSDP2 run over ranks, add its row, print its line (rank 0)."""
    g = gather_rows([r["real"], r["flops"], r["seconds"], r["peak"], r["host_ms"]], device)
    if dist.get_rank() != 0:
        return None
    seconds = float(g[:, 2].max())  # the slowest rank's time is the job's
    agg = {"seconds": seconds, "real": float(g[:, 0].sum()), "total": float(g[:, 0].sum()),
           "flops": float(g[:, 1].sum()), "peak": float(g[:, 3].max()), "losses": r["losses"], "host_ms": r["host_ms"]}
    f = figures(agg, world)
    s = f["unpadded_tokens_per_s"] / base
    row = table.add(row=name, config=cfg["name"], gpus=world, unpadded_tokens_per_s=f["unpadded_tokens_per_s"],
                    scaling=s, step_ms=f["step_ms"], host_issue_ms=f["host_issue_ms"],
                    mfu_measured_pct=f["mfu_measured_pct"], peak_mem_gib=f["peak_mem_gib"],
                    rank_seconds="/".join(f"{x:.3f}" for x in g[:, 2].tolist()), **prof_cols(r))
    need = 1.85 * world / 2
    what = ("torch DDP" if cfg["ddp"] else
            f"reshard_after_forward={int(cfg['reshard'])}, reduce {cfg['reduce']}, prefetch {cfg['prefetch']}, "
            f"{cfg['layers_per_unit']} layer(s)/unit") + (", same batches on all ranks" if cfg["same"] else "") + (
                ", rank-balanced batches" if cfg["bal"] else "") + (
                f", amax all-reduce: {cfg['amax']}" if cfg["amax"] != "world" else "")
    print(f"[fsdp2] {name} {cfg['name']} ({what}): {world} GPUs "
          f"{f['unpadded_tokens_per_s'] / 1e3:.1f}k unpadded tok/s = {s:.3f}x one GPU ({base / 1e3:.1f}k; goal >= "
          f"{need:.2f}: {'PASS' if s >= need else 'FAIL'}), step {f['step_ms']:.1f} ms, host issue "
          f"{f['host_issue_ms']:.1f} ms/step, peak {f['peak_mem_gib']:.1f} GiB", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="650M", help="8M 35M 150M 650M 3B, or tiny (CPU smoke test)")
    p.add_argument("--tokens", type=int, default=16384, help="token budget per batch (per GPU)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10,
                   help="packed batches whose samples every real-length row trains on (fixed rows: batches)")
    p.add_argument("--warmup", type=int, default=None,
                   help="distinct warm-up batches before the timed ones (default: 0 on one GPU, whose rows warm up "
                        "on their timed batches, see --warm-passes; 3 under --fsdp2)")
    p.add_argument("--warm-passes", type=int, default=1,
                   help="one GPU: untimed passes over the very batches that are then timed (>= 1 for steady state)")
    p.add_argument("--group-pool", type=int, default=None,
                   help="samples per length-sorted pool of the 'padded' layout (default: 50 batches' worth, "
                        "transformers' LengthGroupedSampler mega-batch)")
    p.add_argument("--compile-scope", default="layers", choices=("layers", "model"),
                   help="hfcompile rows: torch.compile each EsmLayer (one graph shared by all layers) or the model")
    p.add_argument("--compile-dynamic", default="auto", choices=("auto", "true", "false"),
                   help="hfcompile rows: dynamic shapes (auto: dynamic for real-length batches, static at fixed length)")
    p.add_argument("--rows", default=None, help=f"comma list; default {','.join(DEFAULT_ROWS)}")
    p.add_argument("--fixed-length", action="store_true", help=f"also the rows {','.join(FIXED_ROWS)}")
    p.add_argument("--data", default=None, help="directory with train.parquet (default: data/full, else subset)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--torch-adamw", action="store_true", help="seqfuse rows use torch AdamW instead of FusedAdamW")
    p.add_argument("--peer-adamw", action="store_true",
                   help="seqfuse rows use FusedAdamW without master weights and with bf16 moments: the update and "
                        "optimizer state of the peers' torch AdamW on bf16 parameters")
    p.add_argument("--fsdp2", action="store_true", help="under torchrun: FSDP2 scaling")
    p.add_argument("--reshard-after-forward", type=int, default=1, choices=(0, 1),
                   help="FSDP2: free the gathered layer weights after forward (1, ZeRO-3) or keep them for the "
                        "backward (0: one all-gather per step instead of two)")
    p.add_argument("--reduce-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="FSDP2: dtype of the gradient reduce-scatter")
    p.add_argument("--prefetch", type=int, default=0,
                   help="FSDP2: explicit forward/backward prefetch of the next N layers (0: FSDP2's implicit)")
    p.add_argument("--layers-per-unit", type=int, default=1, help="FSDP2: consecutive layers sharded as one unit")
    p.add_argument("--configs", default="default", help=f"FSDP2 settings to compare in one job: {FSDP2_CONFIG_HELP}")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="FSDP2: skip the remaining settings once this many seconds are spent (0: no limit)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, profile --profile-steps more steps: one GPU: DIR/<row>_profile.txt; "
                        "FSDP2: on every rank DIR/rank{r}_profile.txt (first config), rank{r}_<row>_alone_profile.txt "
                        "(one GPU) ...")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--eager-before-graphs", type=int, default=0, metavar="N",
                   help="seqfusegraph rows: N eager training steps (on the warm-up batches) before the layers "
                        "are graphed; under FP8 delayed scaling 2 give every FP8 tensor an amax history, so no "
                        "step runs eagerly beside the graphs' memory pool")
    p.add_argument("--graph-max-sequences", type=int, default=None, metavar="N",
                   help="seqfusegraph packed rows: graph_packed_layers' max_sequences (default: the most any "
                        "batch needs, rounded up to 8)")
    p.add_argument("--profile-configs", default="default,best",
                   help="which --configs to profile (comma list; 'best': also the best-scaling one, re-run)")
    p.add_argument("--out", default="esm2")
    args = p.parse_args(argv)
    if args.warm_passes < 0 or args.steps < 1:
        p.error("--steps must be >= 1 and --warm-passes >= 0")
    if args.torch_adamw and args.peer_adamw:
        p.error("--torch-adamw and --peer-adamw are two choices of the seqfuse rows' optimizer: give one")
    if args.fsdp2:
        return fsdp2(args)
    device = torch.device(args.device)
    return single(args, device)


if __name__ == "__main__":
    main()
