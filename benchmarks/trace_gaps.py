"""Where the GPU waits in a torch profiler trace, and what the host did meanwhile.

Why: a step whose host work outruns its GPU work shows as idle gaps between
kernels, and a profile's summary (profile_summary.py) says how much but not
where.  This reads the trace itself (the chrome-trace JSON a profile exports;
profile_summary keeps it, gzipped, where SEQFUSE_PROFILE_TRACE is set) and
prints, for the longest gaps between GPU work (kernels, copies, memsets), the
kernel before and after, when and from which host ops the next kernel was
launched, the host's slow CUDA runtime calls between the two launches (a
synchronization shows here), and the longest host ops in between.

    python benchmarks/trace_gaps.py TRACE.json[.gz] [--min-us 150] [--top 25]
    python benchmarks/trace_gaps.py TRACE.json.gz --ops FROM_MS TO_MS --tid TID

``--ops`` lists instead the host ops of thread TID that start between FROM_MS
and TO_MS (milliseconds from the first GPU event), with their durations and
the kernel launches inside each (``--depth``: how deeply nested ops are shown).
"""
import argparse
import collections
import gzip
import json

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def load(path):
    """The trace's complete ("X") events."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


class Trace:
    def __init__(self, events):
        self.gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
        self.runtime = [e for e in events if e.get("cat") in RUNTIME_CATS]
        self.by_thread = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in HOST_CATS:
                self.by_thread[e["tid"]].append(e)
        self.launch_of = {e["args"].get("correlation"): e for e in self.runtime if "args" in e}
        self.t0 = self.gpu[0]["ts"] if self.gpu else 0.0

    def ms(self, ts):
        return (ts - self.t0) / 1e3

    def stack(self, ts, tid, depth=6):
        """The names of the host ops of thread ``tid`` open at ``ts``, outermost first (the last ``depth``)."""
        open_ops = sorted((e for e in self.by_thread[tid] if e["ts"] <= ts <= e["ts"] + e["dur"]),
                          key=lambda e: e["ts"])
        return " > ".join(e["name"][:40] for e in open_ops[-depth:])

    def gaps(self, min_us):
        """(start, end, kernel before, kernel after) of every gap over ``min_us`` in the GPU's busy union."""
        out, end, prev = [], None, None
        for e in self.gpu:
            if end is not None and e["ts"] - end > min_us:
                out.append((end, e["ts"], prev, e))
            if end is None or e["ts"] + e["dur"] > end:
                end, prev = e["ts"] + e["dur"], e
        return out


def report_gaps(tr, min_us, top):
    gaps = tr.gaps(min_us)
    print(f"{len(tr.gpu)} GPU events, {len(gaps)} gaps over {min_us:g} us, "
          f"{sum(b - a for a, b, _, _ in gaps) / 1e3:.2f} ms in all")
    for a, b, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        print(f"\n== gap {(b - a) / 1e3:.3f} ms at {tr.ms(a):.2f} ms; before: {before['name'][:60]}; "
              f"after: {after['name'][:60]}")
        launch = tr.launch_of.get(after.get("args", {}).get("correlation"))
        if launch is None:
            continue
        print(f"   next launched at {tr.ms(launch['ts']):.2f} ms by thread {launch['tid']}: "
              f"{tr.stack(launch['ts'], launch['tid'])}")
        prev = tr.launch_of.get(before.get("args", {}).get("correlation"))
        lo = prev["ts"] if prev else a - 3000
        if prev:
            print(f"   previous launched at {tr.ms(prev['ts']):.2f} ms: {tr.stack(prev['ts'], prev['tid'])}")
        for e in [e for e in tr.runtime if lo <= e["ts"] <= launch["ts"] and e["dur"] > 30][:8]:
            print(f"   slow runtime call {e['name']} {e['dur']:.0f} us at {tr.ms(e['ts']):.2f} ms: "
                  f"{tr.stack(e['ts'], e['tid'])}")
        longest = sorted((e for e in tr.by_thread[launch["tid"]] if lo <= e["ts"] <= launch["ts"] and e["dur"] > 100),
                         key=lambda e: -e["dur"])
        for e in longest[:6]:
            print(f"   host op {e['name'][:70]} {e['dur']:.0f} us at {tr.ms(e['ts']):.2f} ms")


def report_ops(tr, lo_ms, hi_ms, tid, depth):
    ops = [e for e in tr.by_thread[tid] if lo_ms <= tr.ms(e["ts"]) <= hi_ms and e["name"] != "profile_summary.step"]
    launches = [e for e in tr.runtime if e["tid"] == tid and "Launch" in e["name"]]
    for e in sorted(ops, key=lambda e: e["ts"]):
        d = sum(1 for o in ops if o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"])
        if d > depth:
            continue
        n = sum(1 for r in launches if e["ts"] <= r["ts"] <= e["ts"] + e["dur"])
        print(f"{tr.ms(e['ts']):9.3f} ms  {'  ' * d}{e['name'][:60]:60s} {e['dur']:7.0f} us  launches {n}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--min-us", type=float, default=150.0, help="the shortest gap reported (microseconds)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--ops", type=float, nargs=2, metavar=("FROM_MS", "TO_MS"), default=None)
    p.add_argument("--tid", type=int, default=None, help="the host thread for --ops")
    p.add_argument("--depth", type=int, default=1)
    args = p.parse_args(argv)
    tr = Trace(load(args.trace))
    if args.ops is not None:
        if args.tid is None:
            p.error("--ops needs --tid (a thread id the gap report prints)")
        report_ops(tr, *args.ops, args.tid, args.depth)
    else:
        report_gaps(tr, args.min_us, args.top)


if __name__ == "__main__":
    main()
