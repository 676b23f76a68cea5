"""What limits the fused attention: Nsight Compute counters of seqfuse's
attention kernels beside torch SDPA's on the same inputs.

Issue 6 asks, where attention misses 1.0x SDPA, for the limiter from the
profiler.  This driver runs itself under ``ncu`` once per case (bshd bf16,
16k tokens, seqlen 4096, head dims 64 and 128, not causal): the workload warms
up outside the profiled range, then runs one seqfuse forward+backward and one
SDPA forward+backward inside cudaProfilerStart/Stop, so every kernel of both
(seqfuse's forward, delta, backward, dQ convert; SDPA's flash or cuDNN
kernels) is profiled once.  Per kernel it prints and saves duration, SM and
memory throughput, tensor-pipe activity, occupancy, registers and the top
warp-stall reasons (cycles per issued instruction), so the two
implementations' kernels stand side by side.

    python benchmarks/profile_attn.py            # on the GPU machine, ~1-2 min
    python benchmarks/profile_attn.py --cases d64

Results: benchmarks/results/attn_profile.json and logs/attn_profile.log.
ncu runs with --clock-control none (the device README: leave clocks alone);
durations under ncu are therefore the unlocked clocks' and comparable within
this run only.
"""
import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

from harness import RESULTS, environment, run_metadata  # (benchmarks/ is the script's folder)

CASES = {"d64": (4096, 32, 64), "d128": (4096, 16, 128)}  # seqlen, heads, head dim; 16k tokens
STALL = "smsp__average_warps_issue_stalled_"
METRICS = [f"regex:{STALL}.*_per_issue_active\\.ratio",
           "regex:sm__pipe_tensor_op_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active",
           "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "gpu__time_duration.sum", "launch__registers_per_thread",
           "sm__warps_active.avg.pct_of_peak_sustained_active",
           "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
           "smsp__inst_executed.sum"]


def workload(case):
    """Warm up, then one profiled seqfuse and one SDPA forward+backward."""
    import torch
    import torch.nn.functional as F

    import seqfuse

    s, h, d = CASES[case]
    b = 16384 // s
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)

    def ours():
        seqfuse.ops.attention(qs, ks, vs).backward(dout)

    def peer():
        F.scaled_dot_product_attention(qt, kt, vt).backward(dt)

    for _ in range(3):
        ours()
        peer()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ours()
    torch.cuda.synchronize()
    peer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def parse(text):
    """ncu --csv --page raw output: one row per kernel, a column per metric."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise RuntimeError("no ncu CSV in the output:\n" + text[-3000:])
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]  # rows[1]: units
    units = dict(zip(header, rows[1]))
    return [dict(zip(header, r)) for r in body], units


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return None


def summarize(kernel):
    name = kernel.get("Kernel Name", "?")
    stalls = sorted(((k[len(STALL):].replace("_per_issue_active.ratio", ""), num(v))
                     for k, v in kernel.items() if k.startswith(STALL) and num(v)), key=lambda kv: -kv[1])
    tensor = {k.split("sm__pipe_tensor_op_")[1].split("_cycles")[0]: num(v) for k, v in kernel.items()
              if k.startswith("sm__pipe_tensor_op_") and num(v) is not None}
    return {
        "kernel": name[:120],
        "duration_us": (num(kernel.get("gpu__time_duration.sum")) or 0) / 1e3,
        "sm_throughput_pct": num(kernel.get("sm__throughput.avg.pct_of_peak_sustained_elapsed")),
        "memory_throughput_pct": num(kernel.get("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed")),
        "dram_pct": num(kernel.get("dram__throughput.avg.pct_of_peak_sustained_elapsed")),
        "tensor_pipe_active_pct": tensor,
        "warps_active_pct": num(kernel.get("sm__warps_active.avg.pct_of_peak_sustained_active")),
        "registers": num(kernel.get("launch__registers_per_thread")),
        "smem_bank_conflicts": num(kernel.get("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum")),
        "instructions": num(kernel.get("smsp__inst_executed.sum")),
        "stall_cycles_per_issue_top": stalls[:5],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="d64,d128")
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.workload:
        workload(args.workload)
        return
    ncu = shutil.which("ncu") or next((c for c in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                       if os.path.exists(c)), None)
    if ncu is None:
        sys.exit("profile_attn: ncu (Nsight Compute) is not on this machine")
    out, log = {"environment": environment(), "run": run_metadata(), "cases": {}}, []
    for case in args.cases.split(","):
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
               "--csv", "--page", "raw", "--metrics", ",".join(METRICS),
               sys.executable, os.path.abspath(__file__), "--workload", case]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log.append(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:])
            sys.exit(f"profile_attn: ncu failed on case {case} (rc {r.returncode})")
        kernels, _ = parse(r.stdout)
        s, h, d = CASES[case]
        rows = [summarize(k) for k in kernels]
        out["cases"][case] = {"seqlen": s, "heads": h, "head_dim": d, "batch": 16384 // s, "kernels": rows}
        print(f"\n== {case}: bshd bf16 {16384 // s}x{s}x{h}x{d}, forward+backward (seqfuse first, then SDPA)")
        for k in rows:
            tp = ", ".join(f"{n} {v:.0f}%" for n, v in k["tensor_pipe_active_pct"].items() if v)
            st = ", ".join(f"{n} {v:.1f}" for n, v in k["stall_cycles_per_issue_top"][:3])
            print(f"{k['duration_us']:9.1f} us  SM {k['sm_throughput_pct'] or 0:5.1f}%  mem "
                  f"{k['memory_throughput_pct'] or 0:5.1f}%  regs {k['registers'] or 0:4.0f}  warps "
                  f"{k['warps_active_pct'] or 0:5.1f}%  tensor [{tp}]  stalls [{st}]  {k['kernel'][:70]}")
    os.makedirs(os.path.join(RESULTS, "logs"), exist_ok=True)
    with open(os.path.join(RESULTS, "attn_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(RESULTS, "logs", "attn_profile.log"), "w") as f:
        f.write("\n".join(log))
    print("\n(saved results/attn_profile.json, results/logs/attn_profile.log)")


if __name__ == "__main__":
    main()
