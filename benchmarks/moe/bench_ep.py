"""Expert parallelism on two GPUs: ExpertParallelGroupedMLP with EP = 2
(each GPU holds 4 of the 8 experts and routes its own tokens; the tokens
travel over NCCL all_to_all_single) against one GPU running the whole
GroupedMLP on the same number of tokens per GPU.

Mixtral-small layer: hidden 1024, FFN 3584, 8 experts, top-2, bf16;
TOKENS (16,384 by default) tokens per GPU, random inputs (near-balanced
routing).  A step is forward + backward (no optimizer).  Each row is the
median over ROUNDS rounds of STEPS back-to-back steps, timed with CUDA
events on every rank and the slowest rank taken (EP's ranks wait for each
other in the exchange); 5 warm-up steps first.  The one-GPU row runs on both
GPUs at once, each on its own tokens with its own whole layer (no
communication), so both rows see the same machine.

Figures: tokens/s of the whole job (EP: 2 x TOKENS per step; one GPU: TOKENS
per step), the speedup (the issue asks for EP = 2 at least 1.8x one GPU),
the time of the exchange alone (dispatch + combine forward and backward
with the experts replaced by a copy), peak memory per GPU, and the bf16
relative error of EP's output against the one-GPU layer on the same tokens.
Writes benchmarks/results/moe_ep.json (rank 0).  About 20-40 s on two
H200s after the build.

    torchrun --nproc-per-node 2 benchmarks/moe/bench_ep.py [--tokens 16384]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: harness
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))

from harness import Table, init_torchrun, ranks_step_ms  # noqa: E402

from seqfuse.modules import ExpertParallelGroupedMLP, GroupedMLP  # noqa: E402
from seqfuse.distributed import combine_tokens, dispatch_tokens  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK = 1024, 3584, 8, 2


def train_step(layer, x, dout):
    def run():
        for p in layer.parameters():
            p.grad = None
        xi = x.detach().requires_grad_()
        layer(xi).backward(dout)
    return run


def exchange_step(layer, x, dout):
    """dispatch + combine (forward and backward) around a copy: the
    exchange's own cost (the router and permutation included)."""
    def run():
        xi = x.detach().requires_grad_()
        probs, routing_map, _ = layer.route(xi)
        xr, pr, m_splits, handle = dispatch_tokens(xi, probs, routing_map, layer.ep_group, layer.num_local_experts)
        y = xr * pr.unsqueeze(1).to(xr.dtype)
        combine_tokens(y, handle).backward(dout)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per GPU per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    rank, world, dev = init_torchrun("bench_ep.py", world=2)
    torch.manual_seed(0)
    full = GroupedMLP(HIDDEN, FFN, EXPERTS, TOPK, params_dtype=torch.bfloat16, device=dev)
    group = dist.new_group([0, 1])
    ep = ExpertParallelGroupedMLP.from_full(full, group)
    gen = torch.Generator(device=dev).manual_seed(1 + rank)  # each GPU its own tokens
    x = torch.randn(args.tokens, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
    dout = torch.randn(args.tokens, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)

    with torch.no_grad():
        err = (ep(x).float() - full(x).float()).norm() / full(x).float().norm()
    err = torch.tensor([err.item()], device=dev)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)

    table = Table("moe_ep", ["config", "ms_per_step", "tokens_per_s", "speedup", "peak_mem_gib"])
    rows = {}
    for name, fn, n_tokens in (("one GPU, whole layer", train_step(full, x, dout), args.tokens),
                               ("EP=2 over 2 GPUs", train_step(ep, x, dout), world * args.tokens),
                               ("EP=2 exchange only (router, dispatch, combine)", exchange_step(ep, x, dout),
                                world * args.tokens)):
        torch.cuda.reset_peak_memory_stats()
        ms = ranks_step_ms(fn, args.steps, args.rounds)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=dev)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows[name] = (ms, n_tokens / ms * 1e3, peak.item())
    base = rows["one GPU, whole layer"][1]
    if rank == 0:
        for name, (ms, tps, peak) in rows.items():
            table.add(config=name, ms_per_step=ms, tokens_per_s=tps, speedup=tps / base, peak_mem_gib=peak)
        table.save(extra={"shape": dict(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, topk=TOPK,
                                        tokens_per_gpu=args.tokens, dtype="bf16", gpus=world),
                          "ep_vs_one_gpu_output_rel_error_bf16": err.item(),
                          "timing": f"median of {args.rounds} rounds of {args.steps} forward+backward steps, slowest rank"})
    from seqfuse.distributed import end_process_group

    del full, ep
    end_process_group(True)


if __name__ == "__main__":
    main()
