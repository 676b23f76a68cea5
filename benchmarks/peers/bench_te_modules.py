"""seqfuse's modules beside Transformer Engine's (the incumbent) in one process,
on the same inputs, shapes, arguments and weights: Linear, LayerNormLinear,
LayerNormMLP and TransformerLayer, forward + backward + a weight update, in
bf16 and under FP8 delayed, current and block scaling.

Each iteration is what a training step does to the module: forward under
the library's own autocast (seqfuse.pytorch.autocast / TE's autocast, each
with its default recipe object of that name), backward with a fixed output
gradient (dx and the weight gradients), then an in-place weight update
(p -= 1e-7 * grad, the same for both) that bumps each weight's version, so
every FP8 row pays the weight cast (and, on Hopper, its transpose) every
iteration as in training, instead of hitting a weight cache.

Shapes:
  esm2_650m  hidden 1280, FFN 5120, 20 heads of 64, LayerNorm, GELU, biases,
             bidirectional (no mask), 8 x 1024 tokens
  llama_1b   hidden 2048, FFN 8192, 32 heads of 64 with 8 KV groups, RMSNorm,
             SwiGLU, no biases, causal, 2 x 4096 tokens
  tiny       a CPU smoke size (hidden 128; seqfuse only where TE cannot run)
Linear and LayerNormLinear have the fused QKV projection's shape
(hidden -> (heads + 2 x groups) x 64); LayerNormMLP and TransformerLayer the
layer's own.  Inputs are [tokens, hidden] for the first three and
[batch, seq, hidden] (bshd, RoPE from one shared angle table) for the layer.

Before timing, TE's module gets seqfuse's weights (same parameter names)
and the bf16 forward outputs are compared (rel_diff_bf16: ||y_sf - y_te|| /
||y_te||), so a row cannot compare two different computations unnoticed.

Timing: peers/timing.interleaved_ms (queues of --iters back-to-back
iterations, --rounds rounds alternating seqfuse and TE, median).  Reported per
(shape, module, recipe): ms per iteration and TFLOP/s of each, and
seqfuse_vs_te = TE ms / seqfuse ms (above 1: seqfuse faster; the goal is
>= 1.0); TransformerLayer rows name the attention TE ran (te_attention:
FusedAttention is cuDNN's, UnfusedDotProductAttention its slow fallback).
TE rows are skipped with the reason where transformer_engine does
not import (every CPU machine).

Cells run module by module (each module at every shape, then the next
module, in the --modules order), so a run under a time limit can put the
module it most needs first.

JSON: benchmarks/results/te_modules.json.  GPU: python3 bench_te_modules.py;
CPU smoke: --device cpu --shapes tiny --iters 1 --rounds 1.
"""
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from peers.meta import skip_reason  # noqa: E402
from peers.timing import (Results, error_text, interleaved_ms, parse_run_args, peak_gib, rel_diff,  # noqa: E402
                          release_cached_memory)

SHAPES = {
    "esm2_650m": dict(hidden=1280, ffn=5120, heads=20, groups=20, norm="LayerNorm", act="gelu", bias=True,
                      mask="no_mask", batch=8, seq=1024),
    "llama_1b": dict(hidden=2048, ffn=8192, heads=32, groups=8, norm="RMSNorm", act="swiglu", bias=False,
                     mask="causal", batch=2, seq=4096),
    "tiny": dict(hidden=128, ffn=256, heads=4, groups=2, norm="RMSNorm", act="swiglu", bias=False, mask="causal",
                 batch=2, seq=32),
}
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer")
RECIPES = ("bf16", "fp8_delayed", "fp8_current", "fp8_block")
TE = "transformer_engine.pytorch"
LR = 1e-7


def head_dim(c):
    return c["hidden"] // c["heads"]


def qkv_out(c):
    return (c["heads"] + 2 * c["groups"]) * head_dim(c)


def build(lib, module, c, dtype, device):
    """The module ``module`` of ``lib`` (seqfuse.pytorch or transformer_engine.pytorch) for shape ``c``."""
    common = dict(params_dtype=dtype, device=device)
    if module == "Linear":
        return lib.Linear(c["hidden"], qkv_out(c), bias=c["bias"], **common)
    if module == "LayerNormLinear":
        return lib.LayerNormLinear(c["hidden"], qkv_out(c), eps=1e-5, bias=c["bias"], normalization=c["norm"],
                                   **common)
    if module == "LayerNormMLP":
        return lib.LayerNormMLP(c["hidden"], c["ffn"], eps=1e-5, bias=c["bias"], normalization=c["norm"],
                                activation=c["act"], **common)
    if module == "TransformerLayer":
        return lib.TransformerLayer(c["hidden"], c["ffn"], c["heads"], num_gqa_groups=c["groups"],
                                    layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
                                    self_attn_mask_type=c["mask"], normalization=c["norm"], activation=c["act"],
                                    attn_input_format="bshd", fuse_qkv_params=True, bias=c["bias"],
                                    layer_type="encoder", **common)
    raise ValueError(f"--modules: unknown module {module!r}; choose from {', '.join(MODULES)}")


def flops(module, c):
    """Forward + backward FLOPs (3x the forward GEMMs; attention 4 b h s^2 d, halved when causal)."""
    t, h = c["batch"] * c["seq"], c["hidden"]
    fc1 = c["ffn"] * (2 if c["act"] == "swiglu" else 1)
    mlp = 2 * t * (h * fc1 + c["ffn"] * h)
    qkv = 2 * t * h * qkv_out(c)
    if module in ("Linear", "LayerNormLinear"):
        forward_flops = qkv
    elif module == "LayerNormMLP":
        forward_flops = mlp
    else:
        attn = 4 * c["batch"] * c["seq"] ** 2 * c["heads"] * head_dim(c) * (0.5 if c["mask"] == "causal" else 1.0)
        forward_flops = qkv + 2 * t * h * h + mlp + attn
    return 3.0 * forward_flops


def train_step(forward, params, x, dy):
    """One training iteration of a module: forward(), backward(dy), then the
    in-place update p -= LR * grad that makes every FP8 weight cast again."""
    y = forward()
    y.backward(dy)
    with torch.no_grad():
        torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)
    for p in params:
        p.grad = None
    x.grad = None


def make_inputs(module, c, device, dtype):
    """(x, dy) for ``module`` at shape ``c``: [tokens, hidden] ([b, s, hidden] for the layer), seeded."""
    torch.manual_seed(0)
    if module == "TransformerLayer":
        x = (torch.randn(c["batch"], c["seq"], c["hidden"], device=device) * 0.5).to(dtype).requires_grad_()
        out_shape = x.shape
    else:
        x = (torch.randn(c["batch"] * c["seq"], c["hidden"], device=device) * 0.5).to(dtype).requires_grad_()
        out_shape = (x.shape[0], qkv_out(c) if module in ("Linear", "LayerNormLinear") else c["hidden"])
    return x, (torch.randn(out_shape, device=device) * 0.1).to(dtype)


def copy_weights(src, dst):
    """dst's parameters := src's, by name; a name missing on either side raises KeyError."""
    s = dict(src.named_parameters())
    d = dict(dst.named_parameters())
    if set(s) != set(d):
        raise KeyError(f"parameter names differ: only seqfuse {sorted(set(s) - set(d))}, "
                       f"only TE {sorted(set(d) - set(s))}")
    with torch.no_grad():
        for n, p in d.items():
            p.copy_(s[n])


class Case:
    """One module of one library with its inputs, autocast and training iteration."""

    def __init__(self, lib_name, module, c, recipe, x, dy, freqs):
        self.lib_name, self.module, self.x, self.dy, self.freqs = lib_name, module, x, dy, freqs
        if lib_name == "seqfuse":
            import seqfuse.pytorch as lib
            from seqfuse.common import recipe as rmod

            self.autocast = lambda: lib.autocast(enabled=self.recipe is not None, recipe=self.recipe)
        else:
            import transformer_engine.pytorch as lib
            from transformer_engine.common import recipe as rmod

            from peers.te_esm2 import te_autocast

            self.autocast = lambda: te_autocast(self.recipe is not None, self.recipe)
        self.recipe = None if recipe == "bf16" else {"fp8_delayed": rmod.DelayedScaling,
                                                     "fp8_current": rmod.Float8CurrentScaling,
                                                     "fp8_block": rmod.Float8BlockScaling}[recipe]()
        self.mod = build(lib, module, c, x.dtype, x.device)
        self.params = [p for p in self.mod.parameters() if p.requires_grad]

    def forward(self):
        with self.autocast():
            if self.module == "TransformerLayer":
                return self.mod(self.x, rotary_pos_emb=self.freqs)
            return self.mod(self.x)

    def step(self):
        train_step(self.forward, self.params, self.x, self.dy)


def run_cell(shape, c, module, recipe, args, device, results, te_why):
    import seqfuse.pytorch as sf

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, dy = make_inputs(module, c, device, dtype)
    freqs = sf.RotaryPositionEmbedding(head_dim(c), device=device)(c["seq"])
    row = dict(shape=shape, module=module, recipe=recipe, tokens=c["batch"] * c["seq"])
    cases, errors = {}, {}
    for lib in ("seqfuse", "te"):
        if lib == "te" and te_why:
            row["te_skipped"] = te_why
            continue
        try:
            cases[lib] = Case(lib, module, c, recipe, x, dy, freqs)
        except Exception as e:  # noqa: BLE001 - reported in the row, the other library still runs
            errors[lib] = e
    if "seqfuse" in cases and "te" in cases:
        try:
            copy_weights(cases["seqfuse"].mod, cases["te"].mod)
            with torch.no_grad():
                if recipe == "bf16":
                    row["rel_diff_bf16"] = rel_diff(cases["seqfuse"].forward(), cases["te"].forward())
                else:
                    row["rel_diff_fp8"] = rel_diff(cases["seqfuse"].forward(), cases["te"].forward())
        except Exception as e:  # noqa: BLE001
            row["check_error"] = error_text(e)
    times = interleaved_ms({k: v.step for k, v in cases.items()}, device, iters=args.iters, rounds=args.rounds,
                           warmup=args.warmup)
    if module == "TransformerLayer" and "te" in cases:  # TE's unfused attention fallback must show in the row
        from peers.te_esm2 import te_attention_backend

        row["te_attention"] = te_attention_backend()
    f = flops(module, c)
    for lib in ("seqfuse", "te"):
        t = times.get(lib, errors.get(lib))
        if isinstance(t, Exception):
            row[f"{lib}_error"] = error_text(t)
        elif t is not None:
            row[f"{lib}_ms"] = t
            row[f"{lib}_tflops"] = f / t / 1e9
            row[f"{lib}_peak_gib"] = peak_gib(cases[lib].step, device)
    if "seqfuse_ms" in row and "te_ms" in row:
        row["seqfuse_vs_te"] = row["te_ms"] / row["seqfuse_ms"]
    results.add(**row)
    del cases
    release_cached_memory(device)


def main(argv=None):
    args = parse_run_args(argv, __doc__.splitlines()[0], "te_modules",
                          [("--shapes", "esm2_650m,llama_1b", SHAPES), ("--modules", ",".join(MODULES), MODULES),
                           ("--recipes", ",".join(RECIPES), RECIPES)])
    shapes, modules, recipes = args.shapes, args.modules, args.recipes
    device = torch.device(args.device)
    te_why = skip_reason(TE, need_cuda=True) if device.type == "cuda" else f"{TE}: runs on CUDA only (--device cpu)"
    if te_why:
        print(f"[te_modules] Transformer Engine rows skipped: {te_why}", flush=True)
    results = Results(args.out, __file__, extra={
        "peer": "Transformer Engine (transformer_engine.pytorch), same process, inputs, shapes, arguments, weights",
        "iteration": "forward under autocast + backward(dy) + in-place weight update p -= 1e-7 * grad "
                     "(FP8 weight casts every iteration)",
        "timing": f"median of {args.rounds} alternating rounds of {args.iters} back-to-back iterations "
                  f"after {args.warmup} warm-up iterations, CUDA events, no L2 flush",
        "ratio": "seqfuse_vs_te = te_ms / seqfuse_ms (> 1: seqfuse faster; goal >= 1.0)",
        "shapes": {s: SHAPES[s] for s in shapes}, "te_skipped": te_why})
    for module in modules:  # module outermost: a run cut short keeps the first-listed module at every shape
        for shape in shapes:
            for recipe in recipes:
                results.guard(run_cell, shape, SHAPES[shape], module, recipe, args, device, results, te_why,
                              shape=shape, module=module, recipe=recipe)
    results.finish("seqfuse_vs_te", lambda r: f"{r['shape']} {r['module']} {r['recipe']} seqfuse >= 1.0x TE")

if __name__ == "__main__":
    main()
