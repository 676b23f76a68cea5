"""seqfuse.hf.accelerate() against plain transformers and its peers, in one
process on the same weights and the same batch (issue 21).

Rows (``--rows``, in this order; Liger-Kernel last because its patch of
transformers' module-level rotary function is global):

  hf_eager             transformers as loaded (sdpa attention), bf16
  hf_compile           the same with every decoder (encoder) layer torch.compile'd
                       (module.compile(): one graph reused by the layers)
  seqfuse_bf16         seqfuse.hf.accelerate(model): fused layers (the MLPs'
                       gated activation made again in the backward, the
                       default) and fused linear cross-entropy, bf16
  seqfuse_fp8_delayed  accelerate(model, recipe=DelayedScaling()) (the LM head
                       and the fused loss in bf16, the default; the MLPs'
                       activation FP8 copy made again in the backward, the
                       default)
  seqfuse_fp8_delayed_head  the same with fp8_lm_head=True: the fused loss's
                       LM-head GEMMs in FP8 too
  seqfuse_fp8_block    accelerate(model, recipe=Float8BlockScaling())
  <seqfuse row>_graphed  that row, then seqfuse.hf.graph_layers(model, batch,
                       seq): the fused layers' forward and backward replayed
                       as CUDA graphs (train mode only)
  seqfuse_bf16_keep, seqfuse_fp8_delayed_keep, seqfuse_fp8_delayed_head_keep
  (and _fused_adamw after it)
                       that row with accelerate(..., recompute_activation=False):
                       the MLPs keep their gated activation (in bf16 one
                       [tokens, FFN] tensor a layer more kept, under FP8 its
                       transposed FP8 copy; one elementwise pass less)
  seqfuse_fp8_delayed_own_amax, seqfuse_fp8_delayed_head_own_amax (and
  _fused_adamw after it)
                       that row with ``fp8_weight_history = False`` on every
                       FP8 GEMM module: every weight cast from its own amax
                       (an amax pass, then the cast) instead of its amax
                       history's scale (seqfuse.quantization's note)
  <seqfuse row>_fused_adamw  that row stepping seqfuse's FusedAdamW set to
                       torch AdamW's update and state (bf16 moments, no
                       master: peers/optimizers.py) instead of torch's fused
                       AdamW, which every other row steps: the two rows
                       side by side say what the optimizer's kernel is worth
  torchao_float8       torchao's FP8 training (torchao.float8.convert_to_float8_training,
                       its default tensorwise dynamic scaling) on the
                       Linears torchao's own filter for that recipe keeps
                       (_auto_filter_for_recipe: dimensions multiples of 16
                       and large enough to gain; at Llama 1B it leaves k/v),
                       never the LM head (as seqfuse's FP8 rows keep the head
                       in bf16), every decoder (encoder) layer torch.compile'd
                       as hf_compile's (compile fuses torchao's casts); the
                       loss is transformers' own: the FP8 peer a competent
                       user reaches without seqfuse; its wheel carried in
                       .whl (torchao 0.18.0, built for torch 2.11); a token
                       count that is not a multiple of 16 is refused
  liger                liger_kernel's apply_liger_kernel_to_<family>(model=...)
                       (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy)
  liger_compile        liger's patches, then every decoder (encoder) layer
                       torch.compile'd as hf_compile's (compile fuses what
                       Liger leaves to torch: the residual adds, the
                       attention's reshapes)

Each row copies one base model (built once with a fixed seed, bf16 on the
GPU), builds torch's fused AdamW over its parameters (a _fused_adamw row:
seqfuse's, the same update), runs ``--warmup`` steps
(a compiled row compiles in the first) and times ``--steps`` training steps
(forward with labels, backward, optimizer step) between two CUDA events:
tokens/s = batch x seq x steps / time.  Peak memory (``peak_gib``) is the
most allocated from the row's model copy on -- the copy and its conversion
(accelerate(), Liger's patch, compile wrappers), the warm-up and the timed
steps -- beyond what was allocated before it (so: the row's weights,
gradients, optimizer state and activations, and whatever the conversion
holds at once); ``convert_peak_gib`` is that peak by the end of the
conversion alone, before any step.  ``loss0`` is each row's first loss (same weights and
batch: the rows must agree to bf16/FP8 rounding; a row that does not is a
bug, not a speed-up).  ``--mode prefill`` times generation's prefill
instead: a no-grad forward over the prompt with a key cache, logits of the
last position only.

Shapes (``--shape``): llama1b (Llama 3.2 1B: hidden 2048, FFN 8192, 16
layers, 32 heads, 8 KV heads, vocabulary 128256, tied embeddings), qwen2_1.5b,
mistral (Mistral 7B's layer at fewer layers: --layers), bert_large
(BertForMaskedLM, 24 layers of 1024, dropout 0.1: train mode only, no Liger
row), tiny and tiny_bert (CPU smoke).
``--layers`` overrides the layer count, ``--batch`` / ``--seq`` the tokens.

Output: a table on stdout and benchmarks/results/<--out>.json with the run
metadata (commit, versions, command), one row per implementation with
tokens/s, ms per step, peak GiB, loss0, speed-up over hf_eager, and for
each seqfuse row its ratios over every peer row in the run (``vs_peers``:
tokens/s, and peak memory on the GPU) and over the strongest of them
(``strongest_peer``, ``vs_strongest_peer``: the fastest peer of the row's
kind, peer_ratios), and the issue's goals (seqfuse bf16 >= 1.3x and FP8
delayed >= 1.7x hf_eager, ahead of Liger's speed-up, peak memory at most
hf_eager's and Liger's).
"""
import argparse
import copy
import gc
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from peers import optimizers  # noqa: E402
from peers.meta import try_import  # noqa: E402
from peers.timing import Results, error_text, parse_list  # noqa: E402
import memory_peak  # noqa: E402

ROWS = ("hf_eager", "hf_compile", "seqfuse_bf16", "seqfuse_fp8_delayed", "seqfuse_fp8_delayed_head",
        "seqfuse_fp8_block", "seqfuse_bf16_keep", "seqfuse_fp8_delayed_keep", "seqfuse_fp8_delayed_head_keep",
        "seqfuse_fp8_delayed_head_keep_fused_adamw", "seqfuse_bf16_graphed", "seqfuse_fp8_delayed_graphed",
        "seqfuse_fp8_delayed_head_graphed", "seqfuse_bf16_fused_adamw", "seqfuse_fp8_delayed_fused_adamw",
        "seqfuse_fp8_delayed_head_fused_adamw", "seqfuse_fp8_delayed_own_amax", "seqfuse_fp8_delayed_head_own_amax",
        "seqfuse_fp8_delayed_head_own_amax_fused_adamw", "torchao_float8", "liger", "liger_compile")

#: The peer rows, and those a bf16 seqfuse row is held against (an FP8 row: every peer).
PEERS = ("hf_eager", "hf_compile", "liger", "liger_compile", "torchao_float8")
BF16_PEERS = ("hf_eager", "hf_compile", "liger", "liger_compile")

#: The suffix of the rows that step seqfuse's FusedAdamW (the module note).
FUSED_ADAMW = "_fused_adamw"

SHAPES = {
    "llama1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                    max_position_embeddings=131072, rms_norm_eps=1e-5),
    "qwen2_1.5b": dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rms_norm_eps=1e-6),
    "mistral": dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False,
                    max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None),
    # BERT-large (transformers' defaults: erf GELU, dropout 0.1 on attention and both residual branches),
    # masked-LM head, every token a label
    "bert_large": dict(family="bert", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, vocab_size=30522, max_position_embeddings=512),
    "tiny_bert": dict(family="bert", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=512, max_position_embeddings=512),
    "tiny": dict(family="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=512),
}

FAMILY = {"llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama"),
          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "apply_liger_kernel_to_qwen2"),
          "mistral": ("MistralConfig", "MistralForCausalLM", "apply_liger_kernel_to_mistral"),
          "bert": ("BertConfig", "BertForMaskedLM", None)}


def transformer_layers(model):
    """The model's list of transformer layers (decoder or encoder)."""
    base = getattr(model, model.base_model_prefix)
    return base.layers if hasattr(base, "layers") else base.encoder.layer


def build_base(shape, layers, device):
    import transformers

    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    if layers:
        spec["num_hidden_layers"] = layers
    cfg_cls, model_cls, _ = FAMILY[family]
    cfg = getattr(transformers, cfg_cls)(**spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg)
    return model.to(torch.bfloat16), family


def compile_layers(model):
    """Every decoder (encoder) layer of ``model`` under torch.compile (module.compile)."""
    for layer in transformer_layers(model):
        layer.compile()


def prepare(row, base, family, shape=None):
    """The row's model (a copy of base) and a note on what was done to it;
    ``shape``: the (batch, seq) a _graphed row's layers are captured for."""
    if row.endswith(FUSED_ADAMW):  # (the model is the row's without the suffix; the optimizer is train_row's)
        return prepare(row[:-len(FUSED_ADAMW)], base, family, shape)
    if row.endswith("_graphed"):
        from seqfuse.hf import graph_layers

        model, note = prepare(row[:-len("_graphed")], base, family)
        model.train()
        graph_layers(model, *shape)
        return model, note + "; layers as CUDA graphs (seqfuse.hf.graph_layers)"
    if row.endswith("_own_amax"):
        model, note = prepare(row[:-len("_own_amax")], base, family, shape)
        opted = [m for m in model.modules() if getattr(type(m), "fp8_num_gemms", 0)]
        for m in opted:
            m.fp8_weight_history = False
        return model, note + f"; fp8_weight_history False on {len(opted)} modules"
    model = copy.deepcopy(base)
    if row == "hf_eager":
        return model, "transformers, attn_implementation=" + model.config._attn_implementation
    if row == "hf_compile":
        compile_layers(model)
        return model, "every decoder (encoder) layer torch.compile'd (module.compile)"
    if row.startswith("seqfuse"):
        from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling
        from seqfuse.hf import accelerate

        keep = row.endswith("_keep")
        row = row[:-len("_keep")] if keep else row
        recipe = {"seqfuse_bf16": None, "seqfuse_fp8_delayed": DelayedScaling(),
                  "seqfuse_fp8_delayed_head": DelayedScaling(), "seqfuse_fp8_block": Float8BlockScaling()}[row]
        report = accelerate(model, recipe=recipe, fp8_lm_head=row == "seqfuse_fp8_delayed_head",
                            recompute_activation=False if keep else None)
        print(report, flush=True)
        if len(report.fused) != model.config.num_hidden_layers:
            raise RuntimeError(f"accelerate fused {len(report.fused)} of {model.config.num_hidden_layers} layers:\n"
                               f"{report}")
        return model, f"fused {len(report.fused)} layers; loss: {report.loss}"
    if row == "torchao_float8":
        mod, why = try_import("torchao.float8")
        if mod is None:
            raise RuntimeError(why)
        if shape is not None and (shape[0] * shape[1]) % 16:
            raise RuntimeError(f"torchao_float8: {shape[0]} x {shape[1]} tokens; torchao's FP8 weight-gradient GEMM "
                               "needs a token count that is a multiple of 16 (pad_inner_dim off, its default)")
        head = model.get_output_embeddings()
        auto = mod._auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])

        def swapped(module, fqn):  # (the head by identity too: a tied head may carry another name)
            return module is not head and auto(module, fqn)

        mod.convert_to_float8_training(model, module_filter_fn=swapped)
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        compile_layers(model)
        return model, (f"torchao.float8.convert_to_float8_training: {converted} Linears (torchao's tensorwise "
                       "filter, not the LM head), tensorwise dynamic scaling; every decoder (encoder) layer "
                       "torch.compile'd")
    if row in ("liger", "liger_compile"):
        if FAMILY[family][2] is None:
            raise RuntimeError(f"Liger-Kernel has no apply_liger_kernel_to_* for the {family} family")
        mod, why = try_import("liger_kernel.transformers")
        if mod is None:
            raise RuntimeError(why)
        getattr(mod, FAMILY[family][2])(model=model)
        note = f"liger_kernel {FAMILY[family][2]}(model=...) (rope, rms_norm, swiglu, fused linear CE)"
        if row == "liger_compile":
            compile_layers(model)
            note += "; every decoder (encoder) layer torch.compile'd"
        return model, note
    raise ValueError(row)


def peer_ratios(row, r, by):
    """A seqfuse row's result ``r`` against the peer rows of the run
    (``by``: row name -> result): {"vs_peers": {peer: {"tokens_per_s": ratio,
    "peak_memory": ratio or None}}, "strongest_peer": the fastest peer of the
    row's kind (bf16: BF16_PEERS; FP8: every peer, torchao's FP8 among them),
    "vs_strongest_peer": the row's tokens/s over it}; {} without a peer."""
    vs = {}
    for peer in PEERS:
        p = by.get(peer)
        if p is not None:
            mem = r["peak_gib"] / p["peak_gib"] if p["peak_gib"] == p["peak_gib"] else None  # (NaN off the GPU)
            vs[peer] = {"tokens_per_s": r["tokens_per_s"] / p["tokens_per_s"], "peak_memory": mem}
    kind = BF16_PEERS if row.startswith("seqfuse_bf16") else PEERS
    held = [peer for peer in kind if peer in vs]
    if not held:
        return {}
    strongest = max(held, key=lambda peer: by[peer]["tokens_per_s"])
    return {"vs_peers": vs, "strongest_peer": strongest, "vs_strongest_peer": vs[strongest]["tokens_per_s"]}


def train_row(model, ids, warmup, steps, device, row=""):
    model.train()
    if row.endswith(FUSED_ADAMW):
        opt = optimizers.fused_adamw_like_torch(model.parameters(), lr=1e-5)
    else:
        opt = optimizers.torch_adamw(model.parameters(), device, lr=1e-5)
    cache_off = {} if model.config.model_type == "bert" else {"use_cache": False}  # (an encoder has no cache)

    def forward():
        # use_cache=False as a training loop passes it: a key cache built in every training forward costs
        # every row, and under torch.compile its per-layer state forces recompiles (the s9 run hit the limit)
        return model(input_ids=ids, labels=ids, **cache_off).loss

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        loss = forward()
        loss.backward()
        update()
        return loss

    step.phases = lambda: memory_peak.phase_peaks(forward, torch.Tensor.backward, update, device)
    loss0 = float(step().detach())
    for _ in range(max(0, warmup - 1)):
        step()
    return loss0, _timed(step, steps, device), step


def prefill_row(model, ids, warmup, steps, device, row=""):
    model.eval()

    @torch.no_grad()
    def step():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

    first = step()
    loss0 = float(first.float().logsumexp(-1).mean())  # a fingerprint of the last position's logits
    for _ in range(max(0, warmup - 1)):
        step()
    return loss0, _timed(step, steps, device), step


def _timed(step, steps, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3 / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama1b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count (0: the shape's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--mode", default="train", choices=("train", "prefill"))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (a compiled row compiles in these)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="result name (benchmarks/results/NAME.json); default from the shape")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after each row's timed steps, profile --profile-steps more into DIR/<out>_<row>_profile.txt "
                        "(benchmarks/profile_summary.py; the peak memory then covers them too) and, on the GPU, "
                        "the Python stacks of one step's synchronizing CUDA calls into DIR/<out>_<row>_syncs.txt")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--profile-stacks", action="store_true",
                   help="record Python frames in the profile (with_stack): its memsets are then named by seqfuse's "
                        "frames that launched them; the profiler's cost per frame inflates the host times")
    p.add_argument("--memory", default=None, metavar="DIR",
                   help="GPU, train mode: after each row's timed steps, record the allocator's history over two "
                        "more steps and write what is live at their peak, by the Python frames that made it, to "
                        "DIR/<out>_<row>_memory.txt (benchmarks/memory_peak.py)")
    args = p.parse_args(argv)
    rows = parse_list(p, "--rows", args.rows, ROWS)
    rows = [r for r in ROWS if r in rows]  # Liger's rows last: its rotary patch is module-wide
    if min(args.batch, args.seq, args.steps) < 1 or args.warmup < 1:
        p.error("--batch, --seq, --steps and --warmup must be >= 1")
    spec = SHAPES[args.shape]
    if spec["family"] == "bert" and args.mode == "prefill":
        p.error(f"--shape {args.shape}: an encoder has no generation prefill (--mode train)")
    if spec["family"] == "bert" and args.seq > spec["max_position_embeddings"]:  # (absolute position embeddings)
        p.error(f"--seq {args.seq} exceeds --shape {args.shape}'s {spec['max_position_embeddings']} positions "
                "(e.g. bert_large: --batch 8 --seq 512)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu --shape tiny for a smoke run)")
    tokens = args.batch * args.seq
    out = args.out or f"hf_accelerate_{args.shape}{'_prefill' if args.mode == 'prefill' else ''}_{tokens}"
    base, family = build_base(args.shape, args.layers, device)
    cfg = base.config
    res = Results(out, __file__, extra=dict(
        shape=args.shape, mode=args.mode, batch=args.batch, seq=args.seq, tokens=tokens,
        layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
        heads=cfg.num_attention_heads, kv_heads=getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        vocab=cfg.vocab_size,
        warmup=args.warmup, steps=args.steps,
        optimizer=f"{optimizers.DESCRIPTIONS['torch_adamw']}, bf16 weights; the {FUSED_ADAMW} rows: "
                  f"{optimizers.DESCRIPTIONS['fused_adamw']}"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
    run = train_row if args.mode == "train" else prefill_row
    for row in rows:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        model = step = None
        try:
            model, note = prepare(row, base, family, tuple(ids.shape))
            convert_peak = float("nan")
            if device.type == "cuda":  # the row's model copy and its conversion, apart from the steps' peak
                convert_peak = (torch.cuda.max_memory_allocated() - before) / 2**30
            loss0, ms, step = run(model, ids, args.warmup, args.steps, device, row)
            if args.profile:
                from profile_summary import profile_row

                stem = os.path.join(args.profile, f"{out}_{row}")
                _, syncs = profile_row(lambda _: step(), [None] * args.profile_steps, device, stem,
                                       f"{row}: {args.shape} {args.mode}, {args.batch} x {args.seq} tokens",
                                       stacks=args.profile_stacks)
                print(f"{row}: profile in {stem}_profile.txt; synchronizing CUDA calls in one step: {syncs}",
                      flush=True)
        except Exception as e:  # noqa: BLE001 - a failing row is recorded, the others still run
            import traceback

            traceback.print_exc()
            res.add(row=row, error=error_text(e))
            model = step = None
            continue
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else float("nan")
        extra = {}
        if device.type == "cuda" and args.mode == "train":  # where in the step the memory goes (one more step)
            phases = {k: v - before / 2**30 for k, v in step.phases().items()}
            extra["memory_phases_gib"] = phases
            if args.memory:
                os.makedirs(args.memory, exist_ok=True)
                snap, at, counter = memory_peak.record(lambda: [step() for _ in range(2)], device)
                index = device.index if device.index is not None else torch.cuda.current_device()
                b = memory_peak.breakdown(snap, at - before, index)
                name = f"{out}_{row}_memory.txt"
                with open(os.path.join(args.memory, name), "w") as f:
                    f.write(memory_peak.format_breakdown(
                        f"{row}: {args.shape}, {args.batch} x {args.seq} tokens, two training steps; GiB beyond "
                        f"what was allocated before the row", b, phases, (counter - before) / 2**30))
                extra["memory_breakdown"] = {k: b[k] for k in ("peak_gib", "baseline_gib", "truncated")} | {
                    "counter_peak_gib": (counter - before) / 2**30, "file": name}
                del snap
        res.add(row=row, tokens_per_s=tokens / (ms / 1e3), ms_per_step=ms, peak_gib=peak,
                convert_peak_gib=convert_peak, loss0=loss0,
                wall_s=time.perf_counter() - t0, note=note, **extra)
        model = step = None  # (the step holds the row's optimizer and model: gone before the next row's baseline)
    by = {r["row"]: r for r in res.rows if "tokens_per_s" in r}
    base_row = by.get("hf_eager")
    if base_row:
        for r in by.values():
            r["vs_hf_eager"] = r["tokens_per_s"] / base_row["tokens_per_s"]
    print(f"\n{args.mode} {args.shape} ({cfg.num_hidden_layers} layers), {args.batch} x {args.seq} tokens")
    print(f"{'row':38s} {'tokens/s':>12s} {'ms/step':>9s} {'peak GiB':>9s} {'vs eager':>9s} {'loss0':>9s}")
    for r in res.rows:
        if "error" in r:
            print(f"{r['row']:38s} ERROR {r['error']}")
        else:
            print(f"{r['row']:38s} {r['tokens_per_s']:12.0f} {r['ms_per_step']:9.2f} {r['peak_gib']:9.2f} "
                  f"{r.get('vs_hf_eager', float('nan')):9.3f} {r['loss0']:9.4f}")
    for r in res.rows:
        if "memory_phases_gib" in r:
            print(f"{r['row']:38s} GiB allocated by phase of a step: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in r["memory_phases_gib"].items()))
    for r in res.rows:
        if r["row"].startswith("seqfuse") and "tokens_per_s" in r:
            r.update(peer_ratios(r["row"], r, by))
            if "strongest_peer" in r:
                print(f"{r['row']:38s} {r['vs_strongest_peer']:.3f}x the strongest peer in this run, "
                      f"{r['strongest_peer']}")
    goals = []
    if base_row and args.mode == "train":
        liger = by.get("liger")
        for row in ROWS:  # (the goals: bf16 >= 1.3x, FP8 delayed >= 1.7x; block rows have none)
            if not row.startswith("seqfuse") or "block" in row:
                continue
            need = 1.3 if row.startswith("seqfuse_bf16") else 1.7
            r = by.get(row)
            if r is None:
                continue
            goals.append({"goal": f"{row} >= {need}x hf_eager", "value": r["vs_hf_eager"],
                          "pass": r["vs_hf_eager"] >= need})
            if liger:
                goals.append({"goal": f"{row} ahead of liger", "value": r["vs_hf_eager"] / liger["vs_hf_eager"],
                              "pass": r["vs_hf_eager"] > liger["vs_hf_eager"]})
            for peer in ("hf_eager", "liger"):
                if peer in by and device.type == "cuda":
                    goals.append({"goal": f"{row} peak memory <= {peer}'s",
                                  "value": r["peak_gib"] / by[peer]["peak_gib"],
                                  "pass": r["peak_gib"] <= by[peer]["peak_gib"]})
    for gl in goals:
        print(f"goal {gl['goal']}: {gl['value']:.3f} -> {'PASS' if gl['pass'] else 'FAIL'}")
    res.save(goals=goals)


if __name__ == "__main__":
    main()
