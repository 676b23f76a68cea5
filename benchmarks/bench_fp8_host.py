"""Host cost of one transformer layer's GEMM modules under each precision, with
seqfuse's compute kernels stubbed out.

Why: on two H200s the ESM-2 650M FP8 step is host-bound (FSDP2 rows in
benchmarks/results/PERFORMANCE_HISTORY.md): the host's work per layer, not
the GPU's, sets the pace.  This
measures that work alone: LayerNormLinear (QKV) + LayerNormMLP (gelu) +
Linear (projection), forward and backward, inside the recipe's autocast,
with every seqfuse._C compute entry (GEMM, casts, norms, activations,
quantizers, scale update) replaced by a function that returns at once.
What remains is what the host does around the kernels: Python, torch's
tensor allocations and autograd.  Kernel launch costs are not in it.

Rows: bf16, FP8 delayed, FP8 current, FP8 block; microseconds per layer
(best of --rounds rounds, default 5, of --iters iterations, the rows
interleaved within each round), and the ratio to bf16.  Tiny shapes
(16 tokens, hidden 128, FFN 512) keep torch's own remaining ops cheap.
``--device cuda`` allocates on the GPU (the caching allocator's cost
included; no kernel of seqfuse runs).  Between iterations nothing but
the layer's own work runs by default (``--step-work none``: an optimizer
step's version bump without a kernel, gradients dropped as zero_grad()
drops them); ``--step-work kernels`` adds an in-place multiply per weight
and lets gradients accumulate, the same work in every row, as the figures
up to session 36 did.  JSON: results/fp8_host.json.

Each row also counts its seqfuse._C calls per layer step (``c_calls``,
per entry in the JSON's ``c_entries``): on the GPU each is a launch or more,
host time the stubbed figures leave out; and its Python-level function
calls per layer step (``py_calls``, cProfile's count): the interpreter's
work, which the host's load does not move as it moves the timings.

``--kernels real`` lets seqfuse's kernels run and times the host's issue
time instead (on CUDA, the GPU drained outside the timed blocks): the whole
host work of a layer step, seqfuse's C entries and the launches included,
which the stubbed figures leave out.

``--profile ROW`` (bf16, fp8_delayed, fp8_current or fp8_block; with
``--weights unchanged`` for the accumulation setting) times nothing and
writes no JSON: it runs that row's iterations under cProfile and prints
the functions by own time and by cumulative time, and torch's tensor
allocations per layer step (torch.empty / empty_like / zeros calls) --
where a row's host time goes.

``--parts ROW`` (fp8_delayed, fp8_current or fp8_block) times that row as
it runs and again with one part of its FP8 work replaced by the part's
result from an earlier call (a dictionary lookup: the weights' casts,
WeightQuantizer.get; the output gradients' casts, quantize_grad; the
activations' own casts, quantize; the delayed-scaling update at the
autocast exit), all interleaved with bf16 in rotating rounds: what each
part costs where it runs, cold caches and autograd's frees included, which
a profiler's per-call figures (taken in a hot loop, or slowed by the
profiler) do not say.  The lookup left in place makes each figure a
lower bound.  JSON: results/fp8_host_parts.json.
"""
import argparse
import contextlib
import importlib
import time

import torch

from harness import Table

STUBBED = ("act_backward", "act_forward", "amax", "cast_fp8", "cast_fp8_current", "cast_fp8_dbias", "column_sums",
           "fp8_compute_scale",
           "fp8_scale_update",
           "gemm", "layernorm_backward", "layernorm_forward", "rmsnorm_backward", "rmsnorm_forward", "transpose_fp8",
           "quantize_block_fp8", "quantize_block_fp8_rowcol", "quantize_block_fp8_weight",
           "block_transpose_fp8")


@contextlib.contextmanager
def stubbed_kernels():
    """seqfuse._C's compute entries return at once inside the block (restored after)."""
    from seqfuse import _C

    saved = {name: getattr(_C, name) for name in STUBBED}
    try:
        for name in STUBBED:
            setattr(_C, name, lambda *args, **kwargs: None)
        yield
    finally:
        for name, fn in saved.items():
            setattr(_C, name, fn)


def layer_modules(device, hidden=128, ffn=512):
    from seqfuse.modules import LayerNormLinear, LayerNormMLP, Linear

    kw = dict(device=device, params_dtype=torch.bfloat16)
    return (LayerNormLinear(hidden, 3 * hidden, **kw), LayerNormMLP(hidden, ffn, activation="gelu", **kw),
            Linear(hidden, hidden, **kw))


def layer_runner(recipe, device, update=True, step_work="none", layers=1):
    """A function ``run(n)``: n iterations of ``layers`` layers' GEMM modules
    forward+backward (each layer's output the next one's input) inside one
    autocast region under ``recipe`` (its enter/exit, the delayed-scaling
    update and the backward call included), timed per layer: its caller
    divides by ``layers``.  ``update``: every
    weight's version moves between iterations, as an optimizer step moves it
    (the FP8 rows then pay their once-per-step weight casts; the same
    bump runs in every row).  ``step_work``: "none" (the default) moves the
    versions without a kernel and drops every gradient after the backward,
    as optimizer.zero_grad() does, so a row times its layer's work alone;
    "kernels" (the definition of the figures up to session 36) bumps each
    weight with an in-place multiply and lets the gradients accumulate
    across iterations: work outside the layer, the same in every row, which
    dilutes the ratios (on the CPU device the multiplies and the
    accumulating adds are real arithmetic, a third of a bf16 row)."""
    from seqfuse.pytorch import autocast

    torch.manual_seed(0)
    stack = [layer_modules(device) for _ in range(layers)]
    x = torch.randn(16, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    hidden = x.shape[-1]

    weights = [w for qkv, mlp, proj in stack for w in (qkv.weight, proj.weight, mlp.fc1_weight, mlp.fc2_weight)]
    if step_work not in ("none", "kernels"):
        raise ValueError(f"layer_runner: step_work must be 'none' or 'kernels', got {step_work!r}")
    grads_of = [p for mods in stack for m in mods for p in m.parameters()] + [x]

    def run(n):
        for _ in range(n):
            with autocast(enabled=recipe is not None, recipe=recipe):
                y = x
                for qkv, mlp, proj in stack:
                    y = proj(mlp(qkv(y)[:, :hidden]))
            y.backward(torch.ones_like(y))
            if step_work == "none":
                if update:
                    torch.autograd.graph.increment_version(weights)
                for p in grads_of:
                    p.grad = None
            elif update:
                with torch.no_grad():
                    for w in weights:
                        w.mul_(1.0)  # a torch op (not stubbed): bumps the version

    return run


def host_us(runners, iters, rounds=5, real=False):
    """Microseconds per iteration of each runner: ``rounds`` rounds that time
    every runner once in turn (interleaved, so a slower stretch of the host
    touches every row alike), the best round of each.  Each round starts one
    runner later than the one before: the runner timed right after another
    precision's runs its code cold (about 15 us a layer step on the
    development machine), and a fixed order would charge that to one row.
    ``real``: seqfuse's kernels run (``--kernels real``): the time is the
    host's issue time of ``iters`` iterations, the GPU drained before each
    timed block and after it (not timed); at these tiny shapes the GPU
    finishes each iteration's kernels sooner than the host issues them, so
    the queue never makes the host wait, and the figure is the whole host
    work: Python, seqfuse's C entries, torch's allocations and the launches."""
    best = [float("inf")] * len(runners)
    n = len(runners)
    sync = torch.cuda.synchronize if real and torch.cuda.is_available() else (lambda: None)
    with (contextlib.nullcontext() if real else stubbed_kernels()):
        for run in runners:
            run(max(10, iters // 10))
        for r in range(rounds):
            for j in range(n):
                i = (r + j) % n
                sync()
                t0 = time.perf_counter()
                runners[i](iters)
                best[i] = min(best[i], (time.perf_counter() - t0) / iters * 1e6)
                sync()
    return best


def c_calls_per_layer(run, layers=1, iters=4):
    """seqfuse._C calls per layer step of ``run`` (a layer_runner), counted
    over ``iters`` iterations with every _C entry wrapped by a counter and the
    compute entries stubbed (the count does not depend on the kernels): each
    is a CUDA launch or more on the GPU, a few microseconds of the host's
    issue time that the stubbed timings leave out.  Garbage is collected
    first: delayed scaling's update makes one call per pool chunk holding
    live scaling states, and a dead layer's states count as live until its
    reference cycles are collected.  Returns {entry: calls}."""
    import gc

    from seqfuse import _C

    gc.collect()
    counts = {}
    names = [n for n in dir(_C) if not n.startswith("_") and callable(getattr(_C, n))]
    with stubbed_kernels():
        run(2)
        saved = {n: getattr(_C, n) for n in names}

        def counted(name, fn):
            def call(*args, **kwargs):
                counts[name] = counts.get(name, 0) + 1
                return fn(*args, **kwargs)
            return call
        try:
            for n in names:
                setattr(_C, n, counted(n, saved[n]))
            run(iters)
        finally:
            for n, fn in saved.items():
                setattr(_C, n, fn)
    return {n: c / iters / layers for n, c in sorted(counts.items())}


def py_calls_per_layer(run, layers=1, iters=4):
    """Python-level function calls (cProfile's count, builtins and C methods
    included) per layer step of ``run``, kernels stubbed: a count of the
    interpreter's work that does not move with the host's load, beside the
    timings that do."""
    import cProfile
    import pstats

    with stubbed_kernels():
        run(2)
        prof = cProfile.Profile()
        prof.enable()
        run(iters)
        prof.disable()
    return sum(v[1] for v in pstats.Stats(prof).stats.values()) / iters / layers


def profile_row(name, recipe, device, update, iters, top=35, step_work="none", layers=1):
    """cProfile of one row's runner (stubbed kernels, as timed), printed by
    tottime and by cumtime, with the Python-level tensor factory calls
    (torch.empty / empty_like / zeros, Tensor.new_zeros / new_empty) per
    iteration: a count by cProfile's names for them, so other allocations
    (inside torch ops) are not in it."""
    import cProfile
    import pstats

    run = layer_runner(recipe, device, update, step_work, layers)
    with stubbed_kernels():
        run(max(10, iters // 10))
        prof = cProfile.Profile()
        prof.enable()
        run(iters)
        prof.disable()
    stats = pstats.Stats(prof)
    allocs = sum(v[1] for (_, _, fn), v in stats.stats.items()
                 if fn in ("<built-in method torch.empty>", "<built-in method torch.empty_like>",
                           "<built-in method torch.zeros>", "<method 'new_zeros' of 'torch._C.TensorBase' objects>",
                           "<method 'new_empty' of 'torch._C.TensorBase' objects>"))
    print(f"== {name}, weights {'updated every step' if update else 'unchanged'}: {iters} iterations "
          f"of {layers} layer(s) under cProfile; {allocs / iters / layers:.1f} Python-level tensor factory calls "
          f"per layer step ==")
    for key in ("tottime", "cumtime"):
        stats.sort_stats(key).print_stats(top)


def _memoized(cls, name, key):
    """A stand-in for the method ``cls.name`` that returns the result of its
    first call per ``key(*args)`` (a part's work done once, then looked up)."""
    real = getattr(cls, name)
    seen = {}

    def method(*args, **kwargs):
        k = key(*args)
        if k not in seen:
            seen[k] = real(*args, **kwargs)
        return seen[k]
    return method


def part_stand_ins():
    """{part: [(object, attribute, stand-in)]}: each FP8 part of a layer step
    replaced by its first result (--parts; see the module note)."""
    from seqfuse.quantization import gemm_quantizers as gq

    # (the module itself: the package's name `autocast` is the context manager)
    autocast_mod = importlib.import_module("seqfuse.quantization.autocast")
    return {
        "weight casts (WeightQuantizer.get)":
            [(gq.WeightQuantizer, "get", _memoized(gq.WeightQuantizer, "get", lambda role, *a: id(role)))],
        "output-gradient casts (quantize_grad)":
            [(gq.GradQuantizer, "quantize_grad",
              _memoized(gq.GradQuantizer, "quantize_grad", lambda role, dy, *a: (id(role), dy.shape)))],
        "activation casts (quantize)":
            [(gq._Role, "quantize", _memoized(gq._Role, "quantize", lambda role, x, *a: (id(role), x.shape)))],
        "delayed-scaling update (autocast exit)":
            [(autocast_mod, "reduce_and_update", lambda *args, **kwargs: None)],
    }


def parts_us(name, recipe, device, iters, rounds, layers=1):
    """Microseconds per layer step of the bf16 row, the FP8 row, and the FP8
    row with each part replaced (part_stand_ins), weights updated every
    step; rotating rounds as host_us, the best round of each."""
    variants = [("bf16", None, []), (name, recipe, [])]
    variants += [(f"{name} without {part}", recipe, swaps) for part, swaps in part_stand_ins().items()]
    runners = [layer_runner(r, device, True, layers=layers) for _, r, _ in variants]
    best = [float("inf")] * len(variants)
    with stubbed_kernels():
        for r in range(rounds + 1):
            for j in range(len(variants)):
                i = (r + j) % len(variants)
                saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in variants[i][2]]
                for obj, attr, stand_in in variants[i][2]:
                    setattr(obj, attr, stand_in)
                try:
                    runners[i](2)  # (the first calls fill the stand-ins and warm the row's code)
                    t0 = time.perf_counter()
                    runners[i](iters)
                    t = (time.perf_counter() - t0) / iters / layers * 1e6
                finally:
                    for obj, attr, real in saved:
                        setattr(obj, attr, real)
                if r:  # (round 0 warms every variant)
                    best[i] = min(best[i], t)
    return [(label, us) for (label, _, _), us in zip(variants, best)]


def main():
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of --iters iterations per row, best kept (on a shared host: more rounds of "
                        "fewer iterations, e.g. --iters 4 --rounds 250, shed more of the other processes' noise)")
    p.add_argument("--profile", choices=("bf16", "fp8_delayed", "fp8_current", "fp8_block"),
                   help="profile this row instead of timing every row (see the module note)")
    p.add_argument("--weights", choices=("updated", "unchanged"), default="updated",
                   help="with --profile: the row's weight setting")
    p.add_argument("--step-work", choices=("none", "kernels"), default="none",
                   help="what runs between iterations besides the layer: 'none' (versions bumped without a "
                        "kernel, gradients dropped as zero_grad() drops them) or 'kernels' (an in-place multiply "
                        "per weight, gradients accumulating: the definition of the figures up to session 36)")
    p.add_argument("--kernels", choices=("stubbed", "real"), default="stubbed",
                   help="'stubbed' (the default, the figures' definition): seqfuse's compute entries return at "
                        "once, so the time is the Python around them; 'real': they run, and the time is the "
                        "host's whole issue time (C entries and launches included; see host_us): a CUDA figure (on the CPU "
                        "device the kernels' own arithmetic is in it)")
    p.add_argument("--layers", type=int, default=1,
                   help="layers stacked inside one autocast region (the figures are per layer: the region's "
                        "enter/exit, the delayed-scaling update and the backward call shared by all of them, "
                        "as in a model; 1: each layer pays them alone)")
    p.add_argument("--parts", choices=("fp8_delayed", "fp8_current", "fp8_block"),
                   help="time this row with each part of its FP8 work replaced by a lookup (module note)")
    p.add_argument("--out", default=None,
                   help="result name (results/NAME.json); default fp8_host, with --parts fp8_host_parts (a smoke "
                        "run here should name its own: those files hold the committed GPU-host figures)")
    args = p.parse_args()
    if args.iters < 1 or args.rounds < 1:
        p.error(f"--iters and --rounds must be at least 1, got {args.iters} and {args.rounds}")
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    device = torch.device(args.device)
    recipes = {"bf16": None, "fp8_delayed": DelayedScaling(), "fp8_current": Float8CurrentScaling(),
               "fp8_block": Float8BlockScaling()}
    if args.parts:
        table = Table(args.out or "fp8_host_parts", ["row", "layers", "device", "us_per_layer", "part_us", "vs_bf16"])
        rows = parts_us(args.parts, recipes[args.parts], device, args.iters, args.rounds, args.layers)
        bf16, whole = rows[0][1], rows[1][1]
        for label, us in rows:
            table.add(row=label, layers=args.layers, device=str(device), us_per_layer=us,
                      part_us=whole - us if label.startswith(args.parts + " without") else None, vs_bf16=us / bf16)
        table.save({"note": "weights updated every step, --step-work none; part_us: the row's time less its time "
                            "with that part replaced by a lookup of its first result (a lower bound of the "
                            "part's cost in place)"})
        return
    if args.profile:
        profile_row(args.profile, recipes[args.profile], device, args.weights == "updated", args.iters,
                    step_work=args.step_work, layers=args.layers)
        return
    table = Table(args.out or "fp8_host", ["precision", "weights", "layers", "kernels", "step_work", "device",
                                           "us_per_layer", "vs_bf16", "c_calls", "py_calls"])
    rows = [(name, recipe, update) for update in (True, False) for name, recipe in recipes.items()]
    runners = [layer_runner(recipe, device, update, args.step_work, args.layers) for _, recipe, update in rows]
    times = host_us(runners, args.iters, args.rounds, real=args.kernels == "real")
    times = [t / args.layers for t in times]
    base = {}
    for (name, _, update), us, run in zip(rows, times, runners):
        base.setdefault(update, us)  # bf16 comes first for each setting
        calls = c_calls_per_layer(run, args.layers)
        table.add(precision=name, weights="updated every step" if update else "unchanged (accumulation)",
                  layers=args.layers, kernels=args.kernels,
                  step_work=args.step_work, device=str(device), us_per_layer=us, vs_bf16=us / base[update],
                  c_calls=sum(calls.values()), c_entries=calls, py_calls=py_calls_per_layer(run, args.layers))
    table.save({"note": "LayerNormLinear(128->384) + LayerNormMLP(128->512 gelu) + Linear(128->128) forward+backward, "
                        "16 tokens, " + ("seqfuse's compute kernels stubbed out: host work only (Python, torch's "
                                         "allocations and autograd)" if args.kernels == "stubbed" else
                                         "seqfuse's kernels running: the host's whole issue time, C entries and "
                                         "launches included, the GPU drained outside the timed blocks") +
                        "; 'updated every "
                        "step' bumps each weight's version after the backward (an optimizer "
                        "step's effect), so FP8 rows cast every weight once per iteration; step_work "
                        "'none': the bump without a kernel and the gradients dropped after each backward "
                        "(zero_grad), 'kernels': an in-place multiply per weight and gradients "
                        "accumulating (the definition up to session 36); c_calls: seqfuse._C calls per layer "
                        "step (c_entries: per entry), each a CUDA launch or more on the GPU; py_calls: Python-level function "
                        "calls per layer step (cProfile's count)"})


if __name__ == "__main__":
    main()
