"""Mixtral-small training on one GPU: the Mixtral recipe's model
(recipes/mixtral, SeqfuseMixtralForCausalLM: fused router, token
permutation, grouped GEMMs) against transformers' MixtralForCausalLM in
bf16, eager (not compiled), on the same real-DNA batches from the same
initial weights, in one process.

Model: the recipe's ``mixtral_small`` config (8 layers, hidden 1024, 16
heads / 4 key-value heads, 8 experts of SwiGLU 3584, top-2, nucleotide
vocabulary; ``--config`` picks another recipe config, e.g. L0_sanity for a
CPU smoke run).  transformers' model is built with a seed (its own
initialisation) and seqfuse's converted from it
(seqfuse.hf.mixtral_convert.from_hf_model), so every row starts from the
same weights; each row's first-step loss is compared with transformers'.
Both compute the same objective: cross-entropy + router_aux_loss_coef x
the load-balancing loss (output_router_logits=True).

Data: the Llama 3 benchmark's genome windows (benchmarks/llama3/
llama3_common.py: make_bench_data.py's 8,192-base windows when carried,
else the committed lambda-phage subset, said in the log and the JSON);
every sequence exactly ``--seq-len`` tokens, ``--batch-size`` per step, so
transformers' [B, L] batches (no mask) and seqfuse's packed THD batches
(cu_seqlens, the recipe's layout) hold the same tokens.

Rows (``--rows``):
  hf_bf16             transformers, sdpa attention, experts_implementation
                      "grouped_mm" (torch._grouped_mm: transformers' default
                      where it dispatches), bf16 weights, torch AdamW(fused)
                      with the recipe's lr, betas, eps and weight decay;
  hf_bf16_loop        the same with experts_implementation "eager" (its
                      Python loop over the experts);
  hf_bf16_compile     hf_bf16 with every decoder layer torch.compile'd
                      (module.compile(); compiles in the warm passes);
  hf_bf16_liger       hf_bf16 with liger_kernel's
                      apply_liger_kernel_to_mixtral(model=...) (RMSNorm,
                      RoPE, SwiGLU of the loop experts, fused linear
                      cross-entropy);
  seqfuse_bf16, seqfuse_fp8_delayed, seqfuse_fp8_current, seqfuse_fp8_block
                      the recipe's model, forward_loss and optimizer
                      (FusedAdamW: fp32 master weights and fp32 moments, 12
                      bytes of state a parameter against the transformers
                      row's 4), FP8 under seqfuse's autocast (the LM head
                      and router stay bf16);
  seqfuse_bf16_torch_adamw, seqfuse_fp8_delayed_torch_adamw,
  seqfuse_fp8_current_torch_adamw
                      the recipe's model with the transformers row's own
                      optimizer (torch AdamW(fused), bf16 moments, no master
                      copy, every parameter decayed): the like-for-like rows
                      for speed and peak memory;
  seqfuse_fp8_current_e4m3_torch_adamw
                      seqfuse_fp8_current_torch_adamw with
                      precision.fp8_format=e4m3 (E4M3 gradients too): the
                      experts' GEMMs take the device-split FP8 route
                      (torch's row-wise scaled grouped GEMM, the counts on
                      the GPU; the weight gradient in bf16);
  seqfuse_fp8_current_e4m3_hostsplits_torch_adamw
                      the same recipe with the counts read to the host
                      (seqfuse's cuBLASLt FP8 grouped GEMMs, all three
                      products in FP8, per-expert scales);
  seqfusegraph_bf16_torch_adamw, seqfusegraph_fp8_current_e4m3_torch_adamw
                      the same models with every decoder layer captured as
                      CUDA graphs (DecoderStack.graph_layers) for the
                      [batch, seq] windows, fed as unpadded bshd batches
                      (the same tokens and causal windows as the packed
                      rows): what the step gives once its host work is two
                      graph launches a layer;
  seqfusegraph_fp8_delayed_torch_adamw
                      seqfuse_fp8_delayed_torch_adamw, its batches fed as
                      the graphed rows', with each decoder layer's attention
                      block (QKV with its norm, RoPE, attention, projection,
                      residual) captured as CUDA graphs and the rest (norm,
                      router, experts) run eagerly: under delayed scaling
                      the experts' backward reads the routing counts on the
                      host, so the layer cannot be captured whole
                      (graph_layers' experts="auto", which logs it);
  seqfuse_fp8_delayed_fused_adamw, seqfusegraph_fp8_delayed_fused_adamw
                      the _torch_adamw rows with seqfuse's
                      optimizer set to the transformers row's update and
                      state (FusedAdamW, master_weights=False, bf16
                      moments, every parameter decayed: the same math and
                      4 bytes of state a parameter, on seqfuse's
                      multi-tensor kernel instead of torch's fused one);
  seqfuse_fp8_delayed_hostsplits_torch_adamw
                      seqfuse_fp8_delayed_torch_adamw with the routing counts
                      read to the host in every MoE block, the route delayed
                      scaling took before its device-ends form (the forward's
                      cast and product reading the counts on the GPU);
  seqfuse_bf16_hostsplits_torch_adamw
                      seqfuse_bf16_torch_adamw with the routing counts read
                      to the host in every MoE block (GroupedMLP's
                      device_splits off: cuBLASLt's grouped GEMM, one call
                      per expert) instead of the device-split route (the
                      counts stay on the GPU, torch._grouped_mm's kernel):
                      what the route's removal of the host synchronization
                      gives.
A row that fails keeps its error and the others run.  ``--profile DIR``:
after a row's timed passes, ``--profile-steps`` more steps under
torch.profiler, summarised to DIR/<row>_profile.txt
(benchmarks/profile_summary.py: GPU busy and idle time, the top kernels),
and on the GPU the Python stacks of one step's synchronizing CUDA calls in
DIR/<row>_syncs.txt (a profiled run is for finding where a step waits:
take headline figures from a run without ``--profile``, whose profiler
may still be attached when the next row is timed).  Timing: ``--warm-passes``
(default 2: s17 saw an FP8 row 14-23 % faster after more untimed steps)
untimed passes over the very batches, then ``--timed-passes`` (default 5)
timed passes, each with the GPU synchronized before and after it only; a
row's rate is the median pass's (of an even count the slower middle one),
every pass's kept in the JSON (pass_tokens_per_s); the final loss and the
peak memory are after all of them.  A graphed row captures its layers
inside that window, before its first untimed step or, with
``--eager-before-graphs N``, after N eager ones (under delayed scaling 2
keep the first graphed steps from running eagerly beside the graphs'
pool, where the row's peak otherwise falls).  Reported: unpadded tokens/s, vs_hf (against
hf_bf16), vs_best_hf (against the fastest transformers row timed before it:
put the hf rows first) and vs_hf_loop, MFU of the active weights' FLOPs
(mixtral_recipe.trainer.train_flops) against the measured bf16 ceiling (794
TFLOP/s), peak memory (torch.cuda.max_memory_allocated over all of the row's
steps: peak_gib, the ratios' figure; steady_peak_gib over the timed passes
alone and warm_peaks_gib after each untimed step say where the peak falls;
steady_reserved_gib: torch.cuda.max_memory_reserved over the timed passes,
which counts what a CUDA graph's private pool holds for its captured
intermediates, where max_memory_allocated does not)
and its ratio to transformers', and start_gib: what was still allocated
when the row began (rows are freed between, torch.compile's caches too;
a row's peak includes what an earlier row left).  Issue 18's goals:
>= 2.2x transformers' unpadded tokens/s, peak memory <= transformers'.
Writes benchmarks/results/moe_mixtral_train.json and its bar chart
moe_mixtral_train.png (``--plot JSON`` redraws a saved one's).  About 60-90 s on an H200:

    python3 benchmarks/moe/bench_mixtral_train.py
    python3 benchmarks/moe/bench_mixtral_train.py --config L0_sanity --device cpu --seq-len 256 --batch-size 2
"""
import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, os.path.join(BENCH, "llama3"))  # llama3_common (puts benchmarks/ and python/ on the path)
sys.path.insert(0, os.path.join(ROOT, "recipes", "mixtral"))

import llama3_common as data  # noqa: E402
import torch  # noqa: E402
from harness import RESULTS, Table, plot_bars  # noqa: E402
from mixtral_recipe import load_config  # noqa: E402
from mixtral_recipe import trainer as recipe  # noqa: E402
from peers import optimizers  # noqa: E402

ROWS = ("hf_bf16", "hf_bf16_loop", "hf_bf16_compile", "hf_bf16_liger", "seqfuse_bf16", "seqfuse_bf16_torch_adamw",
        "seqfuse_bf16_hostsplits_torch_adamw", "seqfuse_fp8_delayed_hostsplits_torch_adamw", "seqfuse_fp8_delayed",
        "seqfuse_fp8_current", "seqfuse_fp8_block", "seqfuse_fp8_delayed_torch_adamw",
        "seqfuse_fp8_current_torch_adamw", "seqfuse_fp8_current_e4m3_torch_adamw",
        "seqfuse_fp8_current_e4m3_hostsplits_torch_adamw", "seqfusegraph_bf16_torch_adamw",
        "seqfusegraph_fp8_current_e4m3_torch_adamw", "seqfusegraph_fp8_delayed_torch_adamw",
        "seqfuse_fp8_delayed_fused_adamw", "seqfusegraph_fp8_delayed_fused_adamw")
DEFAULT_ROWS = ("hf_bf16", "hf_bf16_loop", "hf_bf16_compile", "hf_bf16_liger", "seqfuse_bf16",
                "seqfuse_bf16_torch_adamw", "seqfuse_fp8_delayed", "seqfuse_fp8_block",
                "seqfuse_fp8_delayed_torch_adamw", "seqfusegraph_fp8_delayed_torch_adamw",
                "seqfusegraph_fp8_delayed_fused_adamw")
MEASURED_TFLOPS = 794.0  # the project's measured H200 bf16 ceiling (benchmarks/harness.py)


def log(msg):
    print(f"[mixtral bench] {msg}", flush=True)


def build_hf(mcfg, device, dtype, experts, seed):
    """transformers' MixtralForCausalLM of the recipe's shape, seeded, its own initialisation."""
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral import modeling_mixtral

    from seqfuse.hf.mixtral_config import to_hf_config

    torch.manual_seed(seed)
    hf_cfg = to_hf_config(mcfg)
    hf_cfg._experts_implementation = experts  # (as benchmarks/moe/bench_moe_layer.py: transformers 5.x)
    with torch.device(device):
        model = MixtralForCausalLM._from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    got = getattr(model.config, "_experts_implementation", None)
    if got != experts:
        raise RuntimeError(f"transformers built experts_implementation={got!r}, asked for {experts!r}")
    model = model.to(device=device, dtype=dtype)
    if model.model.rotary_emb.inv_freq.dtype != torch.float32:  # as from_pretrained(dtype=) keeps it
        model.model.rotary_emb = modeling_mixtral.MixtralRotaryEmbedding(model.config).to(device)
    return model


def adam_hyper(cfg):
    """The recipe's AdamW hyperparameters, as both like-for-like optimizers take them."""
    t = cfg.train
    return dict(lr=float(t.lr), betas=tuple(float(b) for b in t.betas), eps=float(t.eps),
                weight_decay=float(t.weight_decay))


def torch_adamw(model, cfg, device):
    """The transformers row's optimizer: torch AdamW (fused on the GPU) over
    every parameter with the recipe's hyperparameters."""
    return optimizers.torch_adamw(model.parameters(), device, **adam_hyper(cfg))


def fused_adamw(model, cfg):
    """seqfuse's FusedAdamW doing torch_adamw's update on the same state: bf16
    parameters updated in place (no fp32 master), bf16 moments, every
    parameter decayed, the recipe's hyperparameters."""
    return optimizers.fused_adamw_like_torch(model.parameters(), **adam_hyper(cfg))


#: A row's optimizer by its name's suffix ("": the recipe's): (what the JSON records, its builder from (model,
#: bench config, the row's recipe config, device)).
OPTIMIZERS = {
    "_torch_adamw": (optimizers.DESCRIPTIONS["torch_adamw"] + ", every parameter decayed",
                     lambda model, cfg, rcfg, device: torch_adamw(model, cfg, device)),
    "_fused_adamw": (optimizers.DESCRIPTIONS["fused_adamw"] + ", every parameter decayed",
                     lambda model, cfg, rcfg, device: fused_adamw(model, cfg)),
    "": ("the recipe's FusedAdamW: fp32 masters, moments in train.adam_moments, decay on matrices only",
         lambda model, cfg, rcfg, device: recipe.build_optimizer(model, rcfg)),
}


def optimizer_suffix(name):
    """Row ``name``'s key in OPTIMIZERS (every transformers row steps torch AdamW)."""
    if name.startswith("hf_"):
        return "_torch_adamw"
    return next((k for k in OPTIMIZERS if k and name.endswith(k)), "")


def bshd_forward(model, router_logits):
    """A row's loss on a batch laid out as its unpadded [batch, seq] windows (the transformers rows and
    the graphed rows; ``router_logits``: output_router_logits, which adds the load-balancing loss)."""
    def forward(b):
        return model(input_ids=b["input_ids"].view(b["shape"]), labels=b["labels"].view(b["shape"]),
                     output_router_logits=router_logits).loss
    return forward


def build_row(name, cfg, mcfg, device, dtype, seed, shape=None):
    """(model, optimizer, context, forward, capture) of a row (``shape``: the batches' [batch, seq], which a
    graphed row captures).  ``capture``: None, or for a graphed row the call that captures its layers (the
    forward runs them eagerly before it, as graphs after it)."""
    from seqfuse.pytorch import autocast

    if name.startswith("hf_"):
        model = build_hf(mcfg, device, dtype, "eager" if name.endswith("_loop") else "grouped_mm", seed)
        if name == "hf_bf16_compile":
            for layer in model.model.layers:
                layer.compile()
        elif name == "hf_bf16_liger":
            from liger_kernel.transformers import apply_liger_kernel_to_mixtral

            apply_liger_kernel_to_mixtral(model=model)
        return model, torch_adamw(model, cfg, device), contextlib.nullcontext, bshd_forward(model, True), None
    from seqfuse.hf.mixtral_convert import from_hf_model

    hf = build_hf(mcfg, device, dtype, "eager", seed)
    model = from_hf_model(hf)
    del hf
    graphed = name.startswith("seqfusegraph_")
    opt_key = optimizer_suffix(name)
    fp8 = name.split("_", 1)[1].removesuffix(opt_key).removesuffix("_hostsplits")
    overrides = []
    if fp8.endswith("_e4m3"):
        fp8 = fp8.removesuffix("_e4m3")
        overrides.append("precision.fp8_format=e4m3")
    if "_hostsplits" in name:
        for m in model.modules():
            if hasattr(m, "device_splits"):
                m.device_splits = False
    rcfg = load_config(cfg.config_name, [f"precision.recipe={fp8}", *overrides])
    fp8_recipe = recipe.fp8_recipe(rcfg)
    opt = OPTIMIZERS[opt_key][1](model, cfg, rcfg, device)

    def context():
        return autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe)

    if graphed:
        # every decoder layer's forward and backward as CUDA graphs for the [batch, seq] windows (bshd,
        # unpadded: the same tokens and causal attention as the packed rows, whose cu_seqlens cut the
        # batch into those very windows); the step's host work is then two graph launches a layer
        model.train()

        def capture():
            model.model.graph_layers(*shape, fp8_recipe=fp8_recipe)
        return model, opt, context, bshd_forward(model, float(model.config.router_aux_loss_coef) > 0), capture

    def forward(b):
        return recipe.forward_loss(model, b)
    return model, opt, context, forward, None


def add_ratios(done):
    """Each row's ratios against the transformers rows of the whole run, in
    whatever order they ran: vs_hf / mem_vs_hf against eager ``hf_bf16``,
    vs_hf_loop, and vs_best_hf / mem_vs_best_hf against the fastest
    transformers row (best_hf_row, the strongest peer measured); memory
    ratios net of what earlier rows left allocated (peak_gib - start_gib);
    reserved_vs_best_hf the same over the timed passes' reserved memory
    (steady_reserved_gib - start_reserved_gib: a graph pool counted)."""
    def net(r):
        return r["peak_gib"] - r["start_gib"]

    def net_reserved(r):
        return r["steady_reserved_gib"] - r["start_reserved_gib"]

    hf = [n for n in done if n.startswith("hf_")]
    best = max(hf, key=lambda n: done[n]["unpadded_tokens_per_s"]) if hf else None
    for name, r in done.items():
        for ref, key in (("hf_bf16", "vs_hf"), ("hf_bf16_loop", "vs_hf_loop")):
            if ref in done:
                r[key] = r["unpadded_tokens_per_s"] / done[ref]["unpadded_tokens_per_s"]
        if "hf_bf16" in done:
            r["mem_vs_hf"] = net(r) / net(done["hf_bf16"])
            r["first_loss_rel_diff_vs_hf"] = abs(r["first_loss"] - done["hf_bf16"]["first_loss"]) / \
                done["hf_bf16"]["first_loss"]
        if best is not None and best != name:
            r["vs_best_hf"] = r["unpadded_tokens_per_s"] / done[best]["unpadded_tokens_per_s"]
            r["mem_vs_best_hf"] = net(r) / net(done[best])
            r["best_hf_row"] = best
            if "steady_reserved_gib" in r and "steady_reserved_gib" in done[best]:
                r["reserved_vs_best_hf"] = net_reserved(r) / net_reserved(done[best])


def run_row(name, cfg, mcfg, batches, device, dtype, seed, profile=None, profile_steps=2, warm_passes=1,
            timed_passes=1, profile_stacks=False, eager_before_graphs=0):
    """(median seconds of the timed passes, every timed pass's seconds, the first and the last loss, memory,
    cuBLASLt heuristic queries a timed step) of row ``name``: ``warm_passes`` untimed passes over ``batches``,
    then ``timed_passes`` timed ones, the training going on through all of them; memory: the row's JSON fields
    peak_gib (over all steps), steady_peak_gib (the timed passes), warm_peaks_gib (the peak so far after each
    untimed step), steady_reserved_gib (reserved, the timed passes) and eager_steps_before_graphs.  A graphed
    row captures its layers after ``eager_before_graphs`` untimed steps (at most all but one), inside the peak's
    window.  A heuristic query (a plan seqfuse's GEMM cache did not hold) costs host time and can wait for the
    GPU's queued work."""
    model, opt, context, forward, capture = build_row(name, cfg, mcfg, device, dtype, seed, batches[0]["shape"])
    model.train()
    warm = batches + batches * (warm_passes - 1)  # the untimed passes' batches
    before = eager_steps_before_capture(name, eager_before_graphs, len(warm), capture is not None)

    def step(b):
        with context():
            loss = forward(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm_peaks = []  # the peak so far after each untimed step: where the row's peak is
    for i, b in enumerate(warm):
        if i == before and capture is not None:
            capture()
        loss = step(b)
        if i == 0:
            first = float(loss)  # same weights, same batch in every row
        warm_peaks.append(gib(device, torch.cuda.max_memory_allocated))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the timed passes' own peak as well (the row's peak keeps the max)
    passes = []
    queries = _gemm_module().heuristic_queries()
    for _ in range(timed_passes):
        sync()
        t0 = time.perf_counter()
        losses = [step(b) for b in batches]
        sync()
        passes.append(time.perf_counter() - t0)
    seconds = statistics.median_high(passes)  # (a pass's own time; of an even count the slower middle one)
    queries = (_gemm_module().heuristic_queries() - queries) / (timed_passes * len(batches))
    steady_peak = gib(device, torch.cuda.max_memory_allocated)
    # steady_reserved_gib: what the caching allocator held from the GPU at most over the timed passes: a CUDA
    # graph's private pool keeps the memory of its captured intermediates, which max_memory_allocated no
    # longer counts once the capture freed them (the replays write there without the allocator)
    memory = dict(peak_gib=max(warm_peaks + [steady_peak]), steady_peak_gib=steady_peak,
                  warm_peaks_gib=[round(g, 3) for g in warm_peaks],
                  steady_reserved_gib=gib(device, torch.cuda.max_memory_reserved),
                  eager_steps_before_graphs=before if capture is not None else None)
    final = float(losses[-1])
    if profile:
        from profile_summary import profile_row

        _, syncs = profile_row(step, batches[:profile_steps], device, os.path.join(profile, name),
                               f"{name}: Mixtral training step", stacks=profile_stacks)
        log(f"{name}: profile in {os.path.join(profile, name)}_profile.txt; synchronizing CUDA calls in one "
            f"step: {syncs}")
    del model, opt
    release(device)
    return seconds, passes, first, final, memory, queries


def eager_steps_before_capture(name, asked, untimed_steps, graphed):
    """How many of a row's untimed steps run eagerly before its layers are captured (--eager-before-graphs):
    0 for a row that is not graphed; else ``asked``, at most all untimed steps but one (the capture is followed
    by at least one untimed step), said in the log where that cuts what was asked."""
    if not graphed:
        return 0
    before = max(0, min(asked, untimed_steps - 1))
    if before < asked:
        log(f"{name}: --eager-before-graphs {asked} leaves no untimed step to capture after: {before} eager steps")
    return before


def gib(device, stat):
    """torch.cuda's memory statistic ``stat`` (memory_allocated, max_memory_reserved, ...) in GiB; NaN off CUDA."""
    return stat() / 2**30 if device.type == "cuda" else float("nan")


def _gemm_module():
    """seqfuse.ops.gemm the module (the package's ``gemm`` attribute is the op)."""
    import importlib

    return importlib.import_module("seqfuse.ops.gemm")


def release(device):
    """Free what a finished row left: its objects, and torch.compile's caches,
    whose guards can keep a compiled row's modules (and their weights)
    alive, so the next row's peak memory would count them; each row's
    start_gib says what was still allocated when it began."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mixtral_small", help="a recipes/mixtral config (its model shape)")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence (default: the config's data.max_length)")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (after as many untimed)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data", default=None, help="a genome-window Parquet file (default: the benchmark's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after each row's timed passes, profile --profile-steps more steps into DIR/<row>_profile.txt")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--profile-stacks", action="store_true",
                    help="the profile records Python frames: the heaviest host ranges are split down to them "
                         "(the frames' recording inflates the profiled host times)")
    ap.add_argument("--timed-passes", type=int, default=5,
                    help="timed passes over the batches, each timed alone; a row's rate is the median pass's, and "
                         "the JSON keeps every pass's (s46's host-bound FP8 rows moved 10-20 %% between runs of "
                         "one pass each)")
    ap.add_argument("--eager-before-graphs", type=int, default=0, metavar="N",
                    help="graphed rows: the first N untimed steps run eagerly, then the layers are captured; under "
                         "FP8 delayed scaling 2 give every FP8 tensor an amax history, so no step runs eagerly "
                         "beside the graphs' memory pool (graph_layers' note)")
    ap.add_argument("--warm-passes", type=int, default=2,
                    help="untimed passes over the batches before the timed ones (the routing, so the grouped GEMMs' "
                         "row counts and the GEMM plans they need, changes as the model trains)")
    args = ap.parse_args(argv)
    if args.warm_passes < 1:
        raise SystemExit(f"--warm-passes must be >= 1, got {args.warm_passes}")
    if args.timed_passes < 1:
        raise SystemExit(f"--timed-passes must be >= 1, got {args.timed_passes}")
    rows = args.rows.split(",")
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise SystemExit(f"--rows: {bad[0]!r} is not a row (rows: {', '.join(ROWS)})")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = load_config(args.config)
    mcfg = recipe.model_config(cfg)
    seq_len = args.seq_len or int(cfg.data.max_length)
    path, note = data.data_path(args.data)
    seqs = data.fixed_length_sequences(data.load_windows(path), seq_len - 2)
    packed, _ = data.make_batches(seqs, args.steps, max_length=seq_len, batch_size=args.batch_size, seed=args.seed)
    shape = (args.batch_size, seq_len)
    batches = [{**{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()}, "shape": shape}
               for b in packed]
    real = sum(int(b["num_tokens"]) for b in packed)
    flops = sum(recipe.train_flops([seq_len] * args.batch_size, mcfg) for _ in packed)
    log(f"{args.config}: hidden {mcfg.hidden_size}, {mcfg.num_hidden_layers} layers, {mcfg.num_local_experts} "
        f"experts of {mcfg.intermediate_size}, top-{mcfg.num_experts_per_tok}; {args.steps} steps of "
        f"{args.batch_size} x {seq_len} tokens, {dtype}, data {os.path.relpath(path, ROOT)} ({note})")
    table = Table("moe_mixtral_train", ["row", "unpadded_tokens_per_s", "vs_hf", "vs_best_hf", "vs_hf_loop", "mfu_pct",
                                        "peak_gib", "start_gib", "mem_vs_hf", "mem_vs_best_hf", "first_loss",
                                        "final_loss", "error"])
    done = {}
    for name in rows:
        start = gib(device, torch.cuda.memory_allocated)  # what earlier rows left (release() frees it: about 0)
        start_reserved = gib(device, torch.cuda.memory_reserved)
        try:
            seconds, passes, first, final, memory, queries = run_row(
                name, cfg, mcfg, batches, device, dtype, args.seed, args.profile, args.profile_steps,
                args.warm_passes, args.timed_passes, args.profile_stacks, args.eager_before_graphs)
        except Exception as e:  # noqa: BLE001 - a failing row keeps its reason, the others run
            traceback.print_exc()
            table.add(row=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            release(device)
            continue
        done[name] = dict(row=name, unpadded_tokens_per_s=real / seconds, step_ms=1000 * seconds / len(batches),
                          mfu_pct=100 * flops / seconds / (MEASURED_TFLOPS * 1e12), **memory, start_gib=start,
                          start_reserved_gib=start_reserved, first_loss=first, final_loss=final,
                          pass_tokens_per_s=[round(real / s) for s in passes], gemm_queries_per_step=queries,
                          optimizer=OPTIMIZERS[optimizer_suffix(name)][0])
        log(f"{name}: {real / seconds / 1e3:.1f}k unpadded tokens/s, peak {memory['peak_gib']:.2f} GiB ({start:.2f} "
            f"left before; timed passes {memory['steady_peak_gib']:.2f}, after each untimed step "
            f"{', '.join(f'{g:.2f}' for g in memory['warm_peaks_gib'])}; reserved over the timed passes "
            f"{memory['steady_reserved_gib']:.2f}, {start_reserved:.2f} before), "
            f"{queries:.2f} cuBLASLt heuristic queries a timed step")
    add_ratios(done)
    for r in done.values():
        table.add(**r)
    goals = [{"goal": "seqfuse >= 2.2x transformers' unpadded tokens/s (eager)", "row": n, "value": r.get("vs_hf"),
              "pass": (r.get("vs_hf") or 0) >= 2.2} for n, r in done.items() if n.startswith("seqfuse")]
    goals += [{"goal": "peak memory <= the fastest transformers row's, both net of what earlier rows left allocated",
               "row": n, "value": r.get("mem_vs_best_hf"), "pass": (r.get("mem_vs_best_hf") or 9) <= 1.0}
              for n, r in done.items() if n.startswith("seqfuse")]
    goals += [{"goal": "reserved memory over the timed passes <= the fastest transformers row's, both net of what "
                       "was reserved before (a CUDA graph's pool counted)",
               "row": n, "value": r.get("reserved_vs_best_hf"), "pass": (r.get("reserved_vs_best_hf") or 9) <= 1.0}
              for n, r in done.items() if n.startswith("seqfuse")]
    table.save({"config": args.config, "seq_len": seq_len, "batch_size": args.batch_size, "timed_steps": args.steps,
                "data": os.path.relpath(path, ROOT), "data_note": note, "dtype": str(dtype), "goals": goals,
                "model": {k: getattr(mcfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "num_key_value_heads", "intermediate_size",
                                                         "num_local_experts", "num_experts_per_tok", "vocab_size")},
                "flops": "mixtral_recipe.trainer.train_flops: 3 x forward FLOPs of the active weights (router, "
                         "top-k experts) + causal attention; MFU against 794 TFLOP/s (measured H200 bf16)",
                "timing": f"{args.warm_passes} untimed pass(es) over the very batches, then {args.timed_passes} timed "
                          "pass(es), each with the GPU synchronized before and after it only; a row's rate is the "
                          "median pass's (pass_tokens_per_s: every pass's)",
                "eager_before_graphs": args.eager_before_graphs})
    for g in goals:
        log(f"goal {g['goal']} [{g['row']}]: {g['value']}: {'PASS' if g['pass'] else 'MISS'}")
    plot(table.rows, os.path.join(RESULTS, "moe_mixtral_train.png"), f"{args.config}, {args.batch_size} x {seq_len}")


def plot(rows, path_png, shape):
    """The rows' unpadded tokens/s (thousands) as bars, the failed rows left out."""
    ok = [r for r in rows if r.get("unpadded_tokens_per_s")]
    plot_bars(path_png, f"Mixtral training, one GPU, {shape}", [r["row"] for r in ok],
              {"unpadded tokens/s": [r["unpadded_tokens_per_s"] / 1e3 for r in ok]}, "thousand tokens / s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:  # redraw the PNG from a saved JSON: --plot moe_mixtral_train.json
        import json

        doc = json.load(open(sys.argv[2]))
        plot(doc["rows"], os.path.splitext(sys.argv[2])[0] + ".png",
             f"{doc['config']}, {doc['batch_size']} x {doc['seq_len']}, {doc['run']['git_commit'][:7]}")
    else:
        main()
