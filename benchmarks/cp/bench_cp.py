"""Context-parallel attention on 2 GPUs against one GPU, at long sequences.

What it answers: how fast one causal attention layer (forward + backward)
runs when its sequence is spread over cp GPUs (seqfuse.distributed.
context_parallel_attention, cp_comm_type p2p and all_gather), against the
same attention on one GPU over the whole sequence, and how much memory each
GPU then holds.  Shapes: Llama 3 8B heads (32 query heads, 8 KV heads, head
dim 128), batch 1, bf16, causal, sequences of 32k, 64k and 128k tokens.

Rows (one per sequence length and method):
- single_seqfuse: one GPU, seqfuse's kernels (attention_forward + attention_backward,
  the kernels the CP blocks run);
- single_auto: one GPU, seqfuse.ops.attention with its default backend
  choice (cuDNN fused attention on Hopper for this call): the strongest
  single-GPU peer;
- cp_p2p, cp_all_gather: every GPU of the CP group, its share of the
  tokens (load-balanced split); time is the slowest rank's median.
- ring_exchange: one ring step's K/V transfer alone (isend/irecv of the
  [2, 1, s/cp, 8, 128] bf16 block), giving the link's GB/s per direction.
TFLOP/s per GPU = 4 * h * s^2 * d / 2 (causal) * 3.5 (forward + backward) / time /
GPUs; speedup = single_auto time / this time; peak_gib = the largest
max_memory_allocated over the GPUs during the timed steps (inputs, outputs
and gradients included).  A shape that does not fit one GPU is recorded as
"oom", not skipped silently.

Timing: wall time of each step between device synchronizations (steps
last tens of ms to seconds here, so the launch overhead is noise), median
of --repeats after one warm-up, ranks aligned by a barrier before every
step.

Run on a 2-GPU machine after the build (about 40 s at the default sizes):
    python3 benchmarks/cp/bench_cp.py [--world 2] [--seqs 32768,65536,131072] [--repeats 3]
JSON to benchmarks/results/cp.json.  ``--cpu`` runs the same code on the
CPU over gloo in float32 at tiny sizes (a smoke test of the script; its
figures mean nothing): python3 benchmarks/cp/bench_cp.py --cpu --seqs 64
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: the shared harness

HEADS, KV_HEADS, DIM = 32, 8, 128
CFG = {"device": "cuda", "dtype": torch.bfloat16}  # --cpu: "cpu", float32 (the CPU kernels' dtype)


def flops(s):
    return 4 * HEADS * s * s * DIM / 2 * 3.5


def sync():
    if CFG["device"] == "cuda":
        torch.cuda.synchronize()


def step_times(fn, repeats, group):
    """Median wall time (ms) of fn() on this rank, the device synchronized
    around each step and the ranks aligned before it; with a group, the
    slowest rank's median (all ranks return it)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], device=CFG["device"])
    if group is not None:
        dist.all_reduce(med, op=dist.ReduceOp.MAX, group=group)
    return med.item()


def reset_peak():
    if CFG["device"] == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(group):
    """The largest peak allocation over the group's GPUs (None on the CPU)."""
    if CFG["device"] != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak.item()


def randn(*shape, gen):
    return torch.randn(*shape, device=CFG["device"], generator=gen).to(CFG["dtype"])


def single_rows(s, repeats):
    """Rank 0 alone: the whole sequence on one GPU, both routes."""
    import seqfuse.ops as ops

    rows = []
    for name in ("single_seqfuse", "single_auto"):
        q = k = v = dout = None
        reset_peak()
        try:
            g = torch.Generator(device=CFG["device"]).manual_seed(0)
            q = randn(1, s, HEADS, DIM, gen=g)
            k = randn(1, s, KV_HEADS, DIM, gen=g)
            v = randn(1, s, KV_HEADS, DIM, gen=g)
            dout = randn(1, s, HEADS, DIM, gen=g)
            if name == "single_seqfuse":
                def fn():
                    out, lse = ops.attention_forward(q, k, v, attn_mask_type="causal")
                    ops.attention_backward(dout, q, k, v, out, lse, attn_mask_type="causal")
            else:
                for t in (q, k, v):
                    t.requires_grad_()

                def fn():
                    q.grad = k.grad = v.grad = None
                    ops.attention(q, k, v, attn_mask_type="causal").backward(dout)
            ms = step_times(fn, repeats, None)
            rows.append(dict(method=name, seq=s, gpus=1, ms=ms, tflops_per_gpu=flops(s) / ms / 1e9,
                             peak_gib=peak_gib(None)))
        except torch.cuda.OutOfMemoryError as e:
            rows.append(dict(method=name, seq=s, gpus=1, ms=None, note=f"oom: {str(e)[:120]}"))
        finally:
            q = k = v = dout = None
    return rows


def cp_rows(s, repeats, group, rank, world):
    from seqfuse.distributed import context_parallel_attention, local_token_index

    rows = []
    idx = local_token_index(torch.tensor([s]), world, rank).to(CFG["device"])
    for comm in ("p2p", "all_gather"):
        reset_peak()
        g = torch.Generator(device=CFG["device"]).manual_seed(0)  # the full tensors, then this rank's share
        q, k, v, dout = (randn(1, s, n, DIM, gen=g).index_select(1, idx) for n in (HEADS, KV_HEADS, KV_HEADS, HEADS))
        reset_peak()
        for t in (q, k, v):
            t.requires_grad_()

        def fn():
            q.grad = k.grad = v.grad = None
            context_parallel_attention(q, k, v, cp_group=group, cp_comm_type=comm, qkv_format="bshd",
                                       attn_mask_type="causal").backward(dout)

        ms = step_times(fn, repeats, group)
        rows.append(dict(method=f"cp_{comm}", seq=s, gpus=world, ms=ms,
                         tflops_per_gpu=flops(s) / ms / 1e9 / world, peak_gib=peak_gib(group)))
    # one ring step's K/V transfer alone
    kv = torch.zeros(2, 1, s // world, KV_HEADS, DIM, device=CFG["device"], dtype=CFG["dtype"])
    recv = torch.empty_like(kv)
    members = dist.get_process_group_ranks(group)

    def exchange():
        ops_ = [dist.P2POp(dist.isend, kv, members[(rank + 1) % world], group),
                dist.P2POp(dist.irecv, recv, members[(rank - 1) % world], group)]
        for w in dist.batch_isend_irecv(ops_):
            w.wait()

    ms = step_times(exchange, max(repeats, 10), group)
    nbytes = kv.numel() * kv.element_size()
    rows.append(dict(method="ring_exchange", seq=s, gpus=world, ms=ms, gbps=nbytes / ms / 1e6,
                     note=f"{nbytes / 2**20:.1f} MiB per direction"))
    return rows


def worker(rank, world, port, seqs, repeats, result_path, cpu):
    if cpu:
        CFG.update(device="cpu", dtype=torch.float32)
        torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(world)))
    rows = []
    try:
        for s in seqs:
            if rank == 0:
                rows += single_rows(s, repeats)
            dist.barrier()
            rows += cp_rows(s, repeats, group, rank, world)
            if rank == 0:
                for r in rows:
                    if r["seq"] == s:
                        print(r, flush=True)
        if rank == 0:
            torch.save(rows, result_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="smoke-run on the CPU over gloo (figures meaningless)")
    args = ap.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    for s in seqs:
        if s % (2 * args.world):
            raise SystemExit(f"--seqs: {s} is not a multiple of 2*world = {2 * args.world}")
    if not args.cpu and torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs, found {torch.cuda.device_count()} (--cpu smoke-runs it)")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result_path = f"/tmp/bench_cp_{os.getpid()}.pt"
    t0 = time.time()
    mp.spawn(worker, args=(args.world, port, seqs, args.repeats, result_path, args.cpu), nprocs=args.world,
             join=True)
    rows = torch.load(result_path)
    os.remove(result_path)
    from harness import Table

    singles = {r["seq"]: r["ms"] for r in rows if r["method"] == "single_auto" and r.get("ms")}
    for r in rows:
        if r.get("ms") and r["method"] != "ring_exchange" and r["seq"] in singles:
            r["speedup"] = singles[r["seq"]] / r["ms"]
    table = Table("cp_cpu_smoke" if args.cpu else "cp",
                  ["method", "seq", "gpus", "ms", "tflops_per_gpu", "speedup", "peak_gib", "gbps", "note"])
    for r in rows:
        table.add(**r)
    table.save({"command": "python3 " + " ".join(sys.argv), "seconds": round(time.time() - t0, 1),
                "shape": dict(batch=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM,
                              dtype="float32" if args.cpu else "bf16", mask="causal", layout="bshd"),
                "note": "TFLOP/s per GPU counts 4*h*s^2*d/2 (causal) x3.5 for forward+backward; speedup = single_auto "
                        "time / this time; cp rows time the slowest rank"})


if __name__ == "__main__":
    main()
