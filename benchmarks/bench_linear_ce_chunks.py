"""What the chunk size and the weight gradient's summation cost seqfuse's
linear_cross_entropy at a language model's LM head, and what they save.

Why: the chunked loss computes its gradients in the forward, at the end of
the model's forward, where the saved activations peak; one chunk's logits
(and, with weight_grad_dtype=torch.float32 and more than one chunk, a
float32 weight-gradient buffer) are then the loss's share of the step's
peak memory.  Smaller chunks hold less and
run more, smaller GEMMs, each adding its weight gradient into the running
sum (a read and a write of [V, H] in the sum's dtype).  This times, at the
Llama 3.2 1B head (H 2048, V 128,256; ``--hidden`` / ``--vocab``) and
``--tokens`` rows, forward + backward of every chunk size in ``--chunks``
(0: one chunk) with the sum in the weight's dtype (the default) and in
float32 (weight_grad_dtype=torch.float32), beside Liger-Kernel's fused
linear cross-entropy where it imports (its own chunking, bf16 sum), in one
process on the same inputs: milliseconds (median of CUDA-event repeats,
harness.cuda_time_ms, after warm-up) and the peak memory above the inputs.

  python3 benchmarks/bench_linear_ce_chunks.py --tokens 4096,8192 --chunks 0,2048,1024,512

``--tune-ab`` times instead, for each chunk size below the token count, the
weight-gradient sum on the algorithm seqfuse.ops.gemm.tune keeps against
cuBLASLt's first choice (seqfuse.ops.gemm.set_tuning), in ``--rounds`` alternating
rounds (the plan cache dropped at each switch; the round's warm-up tunes
again), medians of the rounds' medians, seqfuse's tune line logged.

JSON: results/<--out>.json (default linear_ce_chunks).
"""
import argparse
import importlib
import logging
import statistics

import torch

import peers  # noqa: F401  (seqfuse from a source checkout)
from harness import Table, cuda_time_ms
from peers.meta import try_import
from seqfuse.modules.cross_entropy import default_chunk_size, linear_cross_entropy


def peak_above(fn):
    """GB allocated at fn()'s peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def tune_ab(hidden, weight, labels, chunk, rounds):
    """{"tuned": ms, "first choice": ms}: the loss's forward + backward at
    ``chunk`` rows, tuning on and off alternately (set_tuning drops the
    plan cache at each switch: a plan keeps what it was tuned to)."""
    gemm = importlib.import_module("seqfuse.ops.gemm")  # (the package exports the op under the module's name)

    def step():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        return torch.autograd.grad(loss, (hidden, weight))

    times = {"tuned": [], "first choice": []}
    before = gemm.set_tuning(None)
    try:
        for r in range(rounds):
            for mode in (("tuned", "first choice") if r % 2 == 0 else ("first choice", "tuned")):
                gemm.set_tuning(mode == "tuned")  # (the plan cache dropped: the round's warm-up tunes again)
                times[mode].append(cuda_time_ms(step, warmup=2, repeats=10))
    finally:
        gemm.set_tuning(before)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--chunks", default="0,2048,1024,512", help="rows per chunk; 0: all rows in one chunk")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default="linear_ce_chunks")
    p.add_argument("--tune-ab", action="store_true", help="the summing GEMM tuned against the first choice")
    p.add_argument("--rounds", type=int, default=4, help="--tune-ab's alternating rounds")
    args = p.parse_args(argv)
    h, v = args.hidden, args.vocab
    if args.tune_ab:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("seqfuse").setLevel(logging.INFO)
        table = Table(args.out, ["tokens", "chunk", "tuned_ms", "first_choice_ms", "ratio"])
        torch.manual_seed(0)
        weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
        for n in (int(t) for t in args.tokens.split(",")):
            hidden = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
            labels = torch.randint(0, v, (n,), device="cuda")
            for c in (int(c) for c in args.chunks.split(",")):
                if 0 < c < n:
                    t = tune_ab(hidden, weight, labels, c, args.rounds)
                    table.add(tokens=n, chunk=c, tuned_ms=t["tuned"], first_choice_ms=t["first choice"],
                              ratio=t["first choice"] / t["tuned"])
        table.save({"hidden": h, "vocab": v, "rounds": args.rounds,
                    "note": "forward + backward of the loss alone; medians over alternating rounds of the "
                            "rounds' medians (10 CUDA-event repeats each); ratio = first choice / tuned"})
        return
    liger, why = try_import("liger_kernel.ops.fused_linear_cross_entropy")
    table = Table(args.out, ["tokens", "impl", "chunk", "sum", "ms", "vs_one_chunk", "peak_GB"])
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_(True)
    for n in (int(t) for t in args.tokens.split(",")):
        hidden = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_(True)
        labels = torch.randint(0, v, (n,), device="cuda")
        rows = {}
        for c in sorted({0, *(int(c) for c in args.chunks.split(","))}):  # (0 always: the ratios' base)
            chunk = n if c == 0 else c
            for acc in (None, torch.float32):
                def step(chunk=chunk, acc=acc):
                    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, weight_grad_dtype=acc)
                    return torch.autograd.grad(loss, (hidden, weight))
                rows[(chunk, "weight dtype" if acc is None else "float32")] = step
        if liger is not None:
            def liger_step():
                loss = liger.LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)
                loss = loss[0] if isinstance(loss, tuple) else loss
                return torch.autograd.grad(loss, (hidden, weight))
            rows[("liger", "weight dtype")] = liger_step
        times = {k: cuda_time_ms(f, warmup=3, repeats=10) for k, f in rows.items()}
        one = times[(n, "weight dtype")]
        for (chunk, acc), ms in times.items():
            table.add(tokens=n, impl="liger" if chunk == "liger" else "seqfuse",
                      chunk="own" if chunk == "liger" else chunk, sum=acc, ms=ms, vs_one_chunk=one / ms,
                      peak_GB=peak_above(rows[(chunk, acc)]))
        print(f"tokens {n}: seqfuse's default chunk {default_chunk_size(n, v, 2)} rows", flush=True)
    table.save({"hidden": h, "vocab": v, "liger": "imported" if liger is not None else why,
                "note": "forward + backward of the loss alone (gradients of hidden and weight); peak_GB above the "
                        "inputs; vs_one_chunk: the one-chunk row's time over the row's"})


if __name__ == "__main__":
    main()
