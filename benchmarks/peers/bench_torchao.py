"""seqfuse's FP8 Linear and LayerNormMLP beside torchao's float8 training
(Float8Linear through torchao.float8.convert_to_float8_training, recipes
"tensorwise" and "rowwise"), eager and under torch.compile (how torchao's
float8 training is meant to run: compile fuses its casts), and beside plain
torch bf16 eager and compiled, in one process on the same inputs, shapes and
weights.

Modules (shapes from bench_te_modules.SHAPES):
  Linear        hidden -> the fused QKV width, biases as the shape says;
  LayerNormMLP  norm -> fc1 -> GELU (tanh form) or SwiGLU -> fc2, written in
                torch (nn.LayerNorm / nn.RMSNorm, two nn.Linear) for torch and
                torchao (whose conversion swaps the two nn.Linear), and
                seqfuse.pytorch.LayerNormMLP, all holding seqfuse's weights.
Each iteration: forward, backward with a fixed output gradient, in-place
weight update (bench_te_modules.train_step: FP8 weight casts every
iteration).  Timing: peers/timing.interleaved_ms.  Ratios for each seqfuse
FP8 row: vs_best_torchao (the fastest torchao row, eager or compiled, any
recipe, named in best_torchao) and vs_torch_compile_bf16.  Before timing,
each torch-side model's bf16 (or FP8) output is compared with seqfuse's
bf16 output (rel_diff_vs_seqfuse_bf16).

torchao rows are skipped with the reason where torchao does not import; on a
CPU (the smoke test) they run torchao's emulated FP8 (emulate=True) and
--no-compile leaves the compiled rows out; the figures then mean nothing for
speed.  JSON: benchmarks/results/torchao.json.
"""
import dataclasses
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import peers  # noqa: E402,F401  (seqfuse from a source checkout)
from peers.bench_te_modules import SHAPES, build, flops, make_inputs, qkv_out, train_step  # noqa: E402
from peers.meta import skip_reason  # noqa: E402
from peers.timing import (Results, error_text, interleaved_ms, parse_run_args, rel_diff,  # noqa: E402
                          release_cached_memory)

MODULES = ("Linear", "LayerNormMLP")
SEQFUSE_RECIPES = ("bf16", "fp8_current", "fp8_delayed", "fp8_block")
TORCHAO_RECIPES = ("tensorwise", "rowwise")


class TorchMLP(nn.Module):
    """LayerNormMLP written in torch: norm -> fc1 -> activation -> fc2."""

    def __init__(self, c, dtype, device):
        super().__init__()
        h, f = c["hidden"], c["ffn"]
        self.act = c["act"]
        self.norm = (nn.LayerNorm(h, eps=1e-5, bias=c["bias"], dtype=dtype, device=device)
                     if c["norm"] == "LayerNorm" else nn.RMSNorm(h, eps=1e-5, dtype=dtype, device=device))
        self.fc1 = nn.Linear(h, f * (2 if self.act == "swiglu" else 1), bias=c["bias"], dtype=dtype, device=device)
        self.fc2 = nn.Linear(f, h, bias=c["bias"], dtype=dtype, device=device)

    def forward(self, x):
        y = self.fc1(self.norm(x))
        if self.act == "swiglu":
            a, gate = y.chunk(2, dim=-1)
            y = F.silu(a) * gate
        else:
            y = F.gelu(y, approximate="tanh")
        return self.fc2(y)


def torch_model(module, c, sf_mod, dtype, device):
    """The torch model of ``module`` holding the weights of seqfuse's ``sf_mod``."""
    w = dict(sf_mod.named_parameters())
    if module == "Linear":
        m = nn.Sequential(nn.Linear(c["hidden"], qkv_out(c), bias=c["bias"], dtype=dtype, device=device))
        pairs = [(m[0].weight, "weight"), (m[0].bias, "bias")]
    else:
        m = TorchMLP(c, dtype, device)
        pairs = [(m.norm.weight, "layer_norm_weight"), (getattr(m.norm, "bias", None), "layer_norm_bias"),
                 (m.fc1.weight, "fc1_weight"), (m.fc1.bias, "fc1_bias"), (m.fc2.weight, "fc2_weight"),
                 (m.fc2.bias, "fc2_bias")]
    with torch.no_grad():
        for dst, name in pairs:
            if dst is None:
                continue
            if name not in w:
                raise KeyError(f"torch_model: seqfuse {module} has no parameter {name!r}")
            dst.copy_(w[name])
    return m


def run_pair(shape, module, args, device, results, ao_why, emulate):
    """Every implementation of ``module`` at ``shape``: timed together, one row each."""
    import seqfuse.pytorch as sf
    from seqfuse.common import recipe as rmod

    c = SHAPES[shape]
    sf_recipes = {"bf16": None, "fp8_current": rmod.Float8CurrentScaling(), "fp8_delayed": rmod.DelayedScaling(),
                  "fp8_block": rmod.Float8BlockScaling()}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, dy = make_inputs(module, c, device, dtype)
    steps, ref, diffs, errors = {}, None, {}, {}
    for r in SEQFUSE_RECIPES:
        name = f"seqfuse_{r}"
        try:
            mod = build(sf, module, c, dtype, device)
            rec = sf_recipes[r]

            def forward_step(mod=mod, rec=rec):
                with sf.autocast(enabled=rec is not None, recipe=rec):
                    return mod(x)
            if r == "bf16":
                with torch.no_grad():
                    ref = forward_step()
                sf_bf16 = mod
            steps[name] = (forward_step, [q for q in mod.parameters() if q.requires_grad])
        except Exception as e:  # noqa: BLE001 - reported in its row
            errors[name] = e
    if ref is None:
        results.add(shape=shape, module=module,
                    error=f"seqfuse bf16 failed: {error_text(errors.get('seqfuse_bf16', RuntimeError('not built')))}")
        return
    variants = [("torch_bf16", None)] + ([] if ao_why else [(f"torchao_{r}", r) for r in TORCHAO_RECIPES])
    for base, ao_recipe in variants:
        for compiled in ((False,) if args.no_compile else (False, True)):
            name = base + ("_compile" if compiled else "")
            try:
                m = torch_model(module, c, sf_bf16, dtype, device)
                if ao_recipe:
                    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                    cfg = Float8LinearConfig.from_recipe_name(ao_recipe)
                    if emulate:
                        cfg = dataclasses.replace(cfg, emulate=True)
                    convert_to_float8_training(m, config=cfg)
                with torch.no_grad():
                    diffs[name] = rel_diff(m(x), ref)
                call = torch.compile(m) if compiled else m
                steps[name] = (lambda call=call: call(x), [q for q in m.parameters() if q.requires_grad])
            except Exception as e:  # noqa: BLE001
                errors[name] = e
    fns = {k: (lambda f=f, ps=ps: train_step(f, ps, x, dy)) for k, (f, ps) in steps.items()}
    times = interleaved_ms(fns, device, iters=args.iters, rounds=args.rounds, warmup=args.warmup)
    fl = flops("LayerNormMLP" if module == "LayerNormMLP" else "Linear", c)
    ok = {k: v for k, v in times.items() if not isinstance(v, Exception)}
    ao = {k: v for k, v in ok.items() if k.startswith("torchao")}
    best_ao = min(ao, key=ao.get) if ao else None
    for name in list(steps) + [k for k in errors if k not in steps]:
        row = dict(shape=shape, module=module, impl=name, tokens=c["batch"] * c["seq"])
        t = times.get(name, errors.get(name))
        if isinstance(t, Exception) or t is None:
            row["error"] = error_text(t) if t is not None else "not run"
        else:
            row.update(ms=t, tflops=fl / t / 1e9)
            if name in diffs:
                row["rel_diff_vs_seqfuse_bf16"] = diffs[name]
            if name.startswith("seqfuse_fp8") and best_ao:
                row["vs_best_torchao"], row["best_torchao"] = ok[best_ao] / t, best_ao
            if name.startswith("seqfuse") and "torch_bf16_compile" in ok:
                row["vs_torch_compile_bf16"] = ok["torch_bf16_compile"] / t
            if name.startswith("seqfuse") and "torch_bf16" in ok:
                row["vs_torch_bf16"] = ok["torch_bf16"] / t
        results.add(**row)
    del steps, fns
    release_cached_memory(device)


def main(argv=None):
    args = parse_run_args(argv, __doc__.splitlines()[0], "torchao",
                          [("--shapes", "esm2_650m,llama_1b", SHAPES), ("--modules", ",".join(MODULES), MODULES)],
                          compile_option=True)
    shapes, modules = args.shapes, args.modules
    device = torch.device(args.device)
    ao_why = skip_reason("torchao.float8", need_cuda=False)
    emulate = device.type != "cuda"
    if ao_why:
        print(f"[torchao] torchao rows skipped: {ao_why}", flush=True)
    elif emulate:
        print("[torchao] CPU: torchao runs emulated FP8 (emulate=True); no figure here means anything for speed")
    if not args.no_compile:
        from harness import allow_recompiles

        allow_recompiles()
    results = Results(args.out, __file__, extra={
        "peers": "torchao float8 training (convert_to_float8_training, recipes tensorwise / rowwise) eager and "
                 "torch.compile'd; torch bf16 eager and torch.compile'd; same inputs, shapes, weights",
        "iteration": "forward + backward(dy) + in-place weight update (FP8 weight casts every iteration)",
        "timing": f"median of {args.rounds} alternating rounds of {args.iters} back-to-back iterations after "
                  f"{args.warmup} warm-up iterations",
        "torchao_skipped": ao_why, "torchao_emulated": emulate and not ao_why,
        "shapes": {s: SHAPES[s] for s in shapes}})
    for shape in shapes:
        for module in modules:
            results.guard(run_pair, shape, module, args, device, results, ao_why, emulate, shape=shape, module=module)
    results.finish("vs_best_torchao",
                   lambda r: f"{r['shape']} {r['module']} {r['impl']} >= 1.0x best torchao ({r['best_torchao']})")

if __name__ == "__main__":
    main()
