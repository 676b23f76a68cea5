"""Host cost of an FP8 mixture-of-experts block's two grouped layers, with
seqfuse's compute kernels stubbed out.

Why: Mixtral-small's FP8 training step is host-bound on an H100 (the
profiles in benchmarks/results/mixtral_profile_s47/: about 57 ms of host
CPU time a step for 60 ms of GPU work, the GPU idle while the host prepares
each MoE block's FP8 operands).  This measures that preparation alone: a
GroupedMLP's two GroupedLinear layers (8 experts, the down projection
taking the SwiGLU of the gate-up output with its routing weights), forward
and backward inside a DelayedScaling autocast, once on the host-count
route (Fp8GroupedLinearFunction), once on the device-ends route
(DeviceEndsFp8GroupedLinearFunction, driven directly on the CPU with its
sm90 check answered yes, the layers' GradHandoff as GroupedMLP's two-node
form gives it) and once as GroupedMLP's one-node form of that route
(device_ends_mlp), with every seqfuse._C compute entry replaced by
a function that returns at once.  What remains is what the host does
around the kernels: Python, torch's tensor allocations and views, autograd.
Kernel launch costs are not in it (each stubbed C call is a launch or more
on the GPU: ``c_calls`` counts them).

Rows: microseconds per block step (best of --rounds rounds of --iters
steps, the two routes interleaved), C calls per step.  ``--profile ROUTE``
(host, ends or node) prints that route's cProfile by own time instead.

    python benchmarks/moe/probe_grouped_host.py [--iters 200] [--profile ends]
"""
import argparse
import contextlib
import time

import torch

#: seqfuse._C's compute entries the two routes call (bench_fp8_host's and the grouped ones).
STUBBED = ("amax", "cast_fp8", "cast_fp8_current", "cast_fp8_dbias", "fp8_compute_scale", "fp8_scale_update",
           "gemm", "transpose_fp8", "grouped_gemm", "grouped_gemm_device_ends", "cast_fp8_grouped",
           "swiglu_cast_fp8_grouped", "cast_fp8_grouped_ends", "cast_fp8_current_list", "moe_swiglu_forward",
           "moe_swiglu_backward", "swiglu_backward_cast_fp8_grouped", "cast_fp8_current_stacked")


@contextlib.contextmanager
def stubbed_kernels(counts=None):
    """seqfuse._C's compute entries return at once inside the block (restored
    after); ``counts``: a dict that receives each entry's calls."""
    from seqfuse import _C

    saved = {name: getattr(_C, name) for name in STUBBED if hasattr(_C, name)}

    def stub(name):
        def call(*args, **kwargs):
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1
        return call
    try:
        for name in saved:
            setattr(_C, name, stub(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(_C, name, fn)


def runner(route, experts=8, hidden=32, ffn=48, tokens=256):
    """``run(n)``: n steps of the block's two layers on ``route`` ("host" or
    "ends"), forward and backward in one DelayedScaling region each, the
    weights' versions moved between steps as an optimizer moves them."""
    from seqfuse.common.recipe import DelayedScaling
    from seqfuse.modules import GroupedLinear
    from seqfuse.modules.grouped_linear import GradHandoff, device_ends_mlp
    from seqfuse.ops import moe as moe_ops
    from seqfuse.quantization import fp8_autocast

    moe_ops.sm90_kernel_refusal = lambda device: None  # (the route's device check, CPU tensors here: main restores it)
    torch.manual_seed(0)
    recipe = DelayedScaling()
    kw = dict(bias=False, params_dtype=torch.bfloat16, device="cpu")
    fc1, fc2 = GroupedLinear(experts, hidden, 2 * ffn, **kw), GroupedLinear(experts, ffn, hidden, **kw)
    splits = [tokens // experts] * experts
    counts = torch.tensor(splits)
    x = torch.randn(tokens, hidden).bfloat16().requires_grad_()
    probs = torch.rand(tokens).requires_grad_()
    dy = torch.randn(tokens, hidden).bfloat16()
    with fp8_autocast(fp8_recipe=recipe):  # (the first forward's casts: every expert gets a history)
        y = fc2(fc1(x, splits), splits, swiglu_probs=probs)
    y.backward(dy)

    def run(n):
        for _ in range(n):
            with fp8_autocast(fp8_recipe=recipe):
                if route == "ends":  # (one set of offsets and one host copy of the counts, as GroupedMLP's)
                    offsets = moe_ops.device_split_offsets(counts, x.shape[0])
                    wait = moe_ops.counts_to_host(counts)
                    link = GradHandoff()
                    h = fc1._device_split(x, counts, offsets, None, None, wait, link)
                    y = fc2._device_split(h, counts, offsets, None, probs, wait, link)
                elif route == "node":  # GroupedMLP's one-node form of the same
                    offsets = moe_ops.device_split_offsets(counts, x.shape[0])
                    wait = moe_ops.counts_to_host(counts)
                    y = device_ends_mlp(fc1, fc2, x, probs, offsets, wait)
                else:
                    y = fc2(fc1(x, splits), splits, swiglu_probs=probs)
            y.backward(dy)
            x.grad = probs.grad = None
            with torch.no_grad():
                for w in (*fc1.parameters(), *fc2.parameters()):
                    w.grad = None
                    w.add_(0)  # an optimizer step's version change
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", choices=("host", "ends", "node"), default=None)
    args = ap.parse_args(argv)
    from seqfuse.ops import moe as moe_ops

    refusal = moe_ops.sm90_kernel_refusal
    try:
        probe(args)
    finally:
        moe_ops.sm90_kernel_refusal = refusal


def probe(args):
    runs = {r: runner(r) for r in ("host", "ends", "node")}
    if args.profile:
        import cProfile
        import pstats

        with stubbed_kernels():
            runs[args.profile](5)
            prof = cProfile.Profile()
            prof.enable()
            runs[args.profile](args.iters)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    best = {r: float("inf") for r in runs}
    with stubbed_kernels():
        for r in runs:
            runs[r](5)
        for _ in range(args.rounds):
            for r, run in runs.items():
                t0 = time.perf_counter()
                run(args.iters)
                best[r] = min(best[r], (time.perf_counter() - t0) / args.iters * 1e6)
    for r, run in runs.items():
        counts = {}
        with stubbed_kernels(counts):
            run(4)
        calls = sum(counts.values()) / 4
        print(f"{r:5s} {best[r]:8.1f} us a block step (forward + backward of both layers), {calls:.1f} C calls")


if __name__ == "__main__":
    main()
