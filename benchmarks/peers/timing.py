"""Timing and bookkeeping shared by the peer benchmarks (bench_te_modules.py,
bench_torchao.py, bench_liger.py).

``interleaved_ms(fns)`` times each callable over a queue of ``iters`` calls
issued back to back (one CUDA event pair around the whole queue, no sync in
between, as calls follow each other in a training step: a call's fixed host
cost hides behind the GPU work queued before it unless the host is the
bottleneck, which then shows), in ``rounds`` rounds that alternate between
the implementations (so clock and thermal drift hit all of them alike), and
returns the median per-call milliseconds of each.  No L2 flush: a training
step's kernels run warm.  On a CPU the same loop is timed with perf_counter
(the smoke tests' path; those figures mean nothing for speed).

``parse_run_args`` reads a peer benchmark's command line (its comma-list
options checked against the known items, and the run options every peer
benchmark takes).

``Results`` collects rows, prints each as it comes (a run cut short keeps
its figures in the log), and writes benchmarks/results/<name>.json with
peers/meta.run_metadata() after every row, so a timeout loses nothing
already measured.
"""
import argparse
import json
import os
import statistics
import time
import traceback

import torch

from .meta import run_metadata

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def queue_ms(fn, iters, device):
    """Milliseconds per call of ``iters`` back-to-back calls of fn()."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def interleaved_ms(fns, device, iters=10, rounds=3, warmup=3):
    """{name: median ms per call} for {name: fn}; see the module note.  A
    callable that raises is reported as {name: exception} (the others run on)."""
    out, live = {}, {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            live[name] = fn
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, the others still run
            out[name] = e
    times = {name: [] for name in live}
    for _ in range(rounds):
        for name, fn in list(live.items()):
            try:
                times[name].append(queue_ms(fn, iters, device))
            except Exception as e:  # noqa: BLE001
                out[name] = e
                del live[name]
    for name in live:
        out[name] = statistics.median(times[name])
    return out


def peak_gib(fn, device):
    """Peak memory (GiB) above what was allocated before one call of fn()."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel_diff(a, b):
    """||a - b|| / ||b|| in float32 (nan when b is all zero)."""
    a, b = a.detach().float(), b.detach().float()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else float("nan")


def add_run_args(parser, out, iters=10, compile_option=False):
    """The options every peer benchmark takes: --iters --rounds --warmup --device --out
    (and --no-compile where it has compiled rows)."""
    parser.add_argument("--iters", type=int, default=iters, help="calls per timed queue")
    parser.add_argument("--rounds", type=int, default=3, help="timed queues per implementation, alternating")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up calls (a compiled row compiles in the first)")
    if compile_option:
        parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows (CPU smoke)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=out, help="result name (benchmarks/results/NAME.json) or a .json path")


def check_run_args(parser, args):
    if min(args.iters, args.rounds) < 1 or args.warmup < 0:
        parser.error("--iters and --rounds must be >= 1, --warmup >= 0")


def parse_list(parser, option, value, known):
    """The comma list ``value`` of ``option``, every item one of ``known`` (else parser.error)."""
    given = value.split(",")
    bad = [g for g in given if g not in known]
    if bad:
        parser.error(f"{option}: unknown {bad}; choose from {', '.join(known)}")
    return given


def parse_run_args(argv, description, out, lists, iters=10, compile_option=False, more=None):
    """The command line of a peer benchmark: its comma-list options ``lists``,
    (option, default, known) triples, each returned parsed into a list of
    items of ``known`` (anything else is the parser's error exit, as is a bad
    --iters / --rounds / --warmup); ``more(parser)`` adds the script's other
    options; then add_run_args's options (``out``, ``iters``,
    ``compile_option`` as there)."""
    p = argparse.ArgumentParser(description=description)
    for option, default, known in lists:
        p.add_argument(option, default=default, help=f"comma list of {', '.join(known)}")
    if more is not None:
        more(p)
    add_run_args(p, out, iters=iters, compile_option=compile_option)
    args = p.parse_args(argv)
    check_run_args(p, args)
    for option, _, known in lists:
        dest = option.lstrip("-").replace("-", "_")
        setattr(args, dest, parse_list(p, option, getattr(args, dest), known))
    return args


def release_cached_memory(device):
    """Hand the caching allocator's free blocks back after a case (its tensors
    already dropped), so the next case's peak memory starts from what it uses."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(e, limit=300):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:limit] if str(e) else ''}"


class Results:
    """Rows of one benchmark, printed as added and saved after each (see the module note)."""

    def __init__(self, name, script, extra=None, out_dir=RESULTS):
        self.name, self.rows = name, []
        self.path = name if name.endswith(".json") else os.path.join(out_dir, f"{name}.json")
        self.doc = {"name": os.path.basename(name).removesuffix(".json"), "run": run_metadata(script),
                    **(extra or {})}

    def add(self, **row):
        self.rows.append(row)
        shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        print(f"[{self.doc['name']}] {shown}", flush=True)
        self.save(complete=False)
        return row

    def guard(self, fn, *args, **keys):
        """fn(*args); an exception becomes a row of ``keys`` and its error (printed with its
        traceback), so one failing case does not lose the ones after it."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            self.add(**keys, error=error_text(e))

    def finish(self, key, describe, need=1.0):
        """Goals ``row[key] >= need`` for every row that has ``key`` (named by describe(row)),
        printed and saved with the rows."""
        goals = [{"goal": describe(r), "value": r[key], "need": f">= {need}", "pass": r[key] >= need}
                 for r in self.rows if key in r]
        for g in goals:
            print(f"goal {g['goal']}: {g['value']:.3f} -> {'PASS' if g['pass'] else 'FAIL'}")
        return self.save(goals=goals)

    def save(self, complete=True, **extra):
        self.doc.update(extra)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({**self.doc, "complete": complete, "rows": self.rows}, f, indent=1, default=str)
        os.replace(tmp, self.path)
        if complete:
            print(f"(saved {os.path.relpath(self.path)})", flush=True)
        return self.path
