"""Compact per-rank profile of a few training steps (the --profile option of
benchmarks/esm2/bench_esm2.py, benchmarks/moe/bench_mixtral_train.py and
benchmarks/hf/bench_accelerate.py).

Why: the FSDP2 scaling question ("what costs time on two GPUs and not on
one?") is answered by a handful of numbers per rank, not by a 100 MB trace:
how long the GPU computes per step, how long it sits idle between kernels
(the host or a sync starving it), how much NCCL time is *exposed* (runs while
no compute kernel runs on any other stream), and which kernels dominate.

``profile_steps`` runs the given steps under torch.profiler, exports the
chrome trace to a temporary directory (deleted afterwards: nothing large is
kept), and ``summarize`` turns its events into the text written to
``DIR/rank{r}_<tag>profile.txt``.  ``summarize`` works on plain event dicts
(chrome trace format: ph "X", cat, name, ts and dur in microseconds,
args.stream), so it is tested on the CPU with synthetic events.
"""
import json
import os
import re
import tempfile
import time

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("user_annotation", "cpu_op")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
PY_CATS = ("python_function",)  # Python frames, in a profile taken with_stack
STEP = "profile_summary.step"  # profile_steps' record_function range around each step


def is_nccl(name):
    n = name.lower()
    return n.startswith("nccl") or "nccldevkernel" in n or "ncclkernel" in n


def nccl_kind(name):
    n = name.lower()
    for key, kind in (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"),
                      ("broadcast", "broadcast"), ("sendrecv", "send_recv")):
        if key in n:
            return kind
    return "other"


_MODULE = re.compile(r"\s*\((?:esm|lm_head)[^)]*\)|\s+for\s+(?:esm|lm_head)\S*")


def host_name(name):
    """FSDP2 labels name their module ("FSDP::pre_forward (esm.encoder.layers.7)"):
    drop it, so the 33 layers of 650M add up to one line per label."""
    return _MODULE.sub("", name)


def union(intervals):
    """Merged, sorted list of [start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(merged):
    return sum(b - a for a, b in merged)


def intersect(x, y):
    """Total overlap of two merged interval lists."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            tot += b - a
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def gaps(merged, top=5):
    """Idle stretches between busy intervals, longest first: (us, start)."""
    out = [(merged[k + 1][0] - merged[k][1], merged[k][1]) for k in range(len(merged) - 1)]
    return sorted(out, reverse=True)[:top]


def launchers(events, cats=HOST_CATS, keep=None):
    """correlation id -> the host ops around the runtime call that launched
    it, innermost first (at most 3 names), from the trace's cuda_runtime /
    cuda_driver events and the ranges of ``cats`` (cpu_op / user_annotation;
    PY_CATS: the Python frames of a profile taken with_stack) of the same
    thread that contain them (one sweep per thread: a thread's ranges nest).
    ``keep``: a test of a range's name; the ranges it refuses are skipped
    (seqfuse's own frames among torch's and the harness's)."""
    per_thread = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") in cats and (keep is None or keep(e["name"])):
            kind = 0
        elif e.get("cat") in RUNTIME_CATS and (e.get("args") or {}).get("correlation") is not None:
            kind = 1
        else:
            continue
        per_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], kind, -e["dur"], e))
    out = {}
    for items in per_thread.values():
        items.sort(key=lambda x: x[:3])  # by start; at one start, ranges before calls, longer ranges first
        stack = []  # open host ranges, innermost last: (end, name)
        for ts, kind, _, e in items:
            while stack and stack[-1][0] < ts:
                stack.pop()
            if kind == 0:
                stack.append((ts + e["dur"], host_name(e["name"])))
            else:
                out[e["args"]["correlation"]] = [name for _, name in reversed(stack[-3:])]
    return out


def idle_before(gpu, busy, top=12, launched_by=None):
    """GPU idle time by what ends it: for each idle stretch between busy
    intervals, the first kernel or copy that starts at its end and, where
    ``launched_by`` (launchers()) knows it, the host ops that launched it.
    The GPU waited for that launch: a line that collects much idle time
    points at host work (or a host sync) just before it.
    Returns [(name, total idle us, stretches)], most idle first."""
    starts = {}
    for e in gpu:
        if e["ts"] in starts:
            continue
        name = e["name"] if e.get("cat") == "kernel" else f"[{e['cat']}] {e['name']}"
        corr = (e.get("args") or {}).get("correlation")
        host = (launched_by or {}).get(corr)
        starts[e["ts"]] = f"{' < '.join(host)} -> {name}" if host else name
    by = {}
    for k in range(len(busy) - 1):
        idle = busy[k + 1][0] - busy[k][1]
        name = starts.get(busy[k + 1][0], "?")
        v = by.setdefault(name, [0.0, 0])
        v[0] += idle
        v[1] += 1
    return sorted(((n, v[0], v[1]) for n, v in by.items()), key=lambda x: -x[1])[:top]


def summarize(events, steps, host_ms=(), cpu_ms=(), title="", top=25):
    """The profile's text report and its numbers (dict)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
    lines = [f"# {title}".rstrip(), f"profiled steps: {steps}"]
    nums = {"steps": steps}
    if host_ms:
        nums["host_issue_ms_per_step"] = sum(host_ms) / len(host_ms)
        lines.append("host time to issue one step (ms, no sync inside): "
                     + ", ".join(f"{t:.1f}" for t in host_ms) + f"  (mean {nums['host_issue_ms_per_step']:.1f})")
    if cpu_ms:
        nums["host_cpu_ms_per_step"] = sum(cpu_ms) / len(cpu_ms)
        lines.append("host thread CPU time per step (ms): " + ", ".join(f"{t:.1f}" for t in cpu_ms)
                     + f"  (mean {nums['host_cpu_ms_per_step']:.1f})")
    if not gpu:
        lines.append("no GPU kernels recorded (CPU run): GPU figures not available")
        lines += host_section(events, steps)
        lines += children_section(events, steps)
        return "\n".join(lines) + "\n", nums
    t0 = min(e["ts"] for e in gpu)
    t1 = max(e["ts"] + e["dur"] for e in gpu)
    window = t1 - t0
    busy = union([e["ts"], e["ts"] + e["dur"]] for e in gpu)
    comm = [e for e in gpu if e.get("cat") == "kernel" and is_nccl(e["name"])]
    compute = [e for e in gpu if not (e.get("cat") == "kernel" and is_nccl(e["name"]))]
    comm_u = union([e["ts"], e["ts"] + e["dur"]] for e in comm)
    compute_u = union([e["ts"], e["ts"] + e["dur"]] for e in compute)
    comm_sum = sum(e["dur"] for e in comm)
    exposed = length(comm_u) - intersect(comm_u, compute_u)
    idle = window - length(busy)
    per = max(1, steps)
    nums.update(gpu_window_ms_per_step=window / 1e3 / per, gpu_busy_ms_per_step=length(busy) / 1e3 / per,
                gpu_idle_ms_per_step=idle / 1e3 / per, compute_ms_per_step=length(compute_u) / 1e3 / per,
                compute_kernel_sum_ms_per_step=sum(e["dur"] for e in compute) / 1e3 / per,
                nccl_kernel_ms_per_step=comm_sum / 1e3 / per, nccl_union_ms_per_step=length(comm_u) / 1e3 / per,
                exposed_comm_ms_per_step=exposed / 1e3 / per)
    lines += [
        "",
        "== GPU time per step (ms; window = first to last kernel of the profiled steps) ==",
        f"window {nums['gpu_window_ms_per_step']:.2f}   busy (any kernel/copy) {nums['gpu_busy_ms_per_step']:.2f}   "
        f"idle gaps {nums['gpu_idle_ms_per_step']:.2f} ({100 * idle / max(window, 1e-9):.1f}%)",
        f"compute (non-NCCL, union over streams) {nums['compute_ms_per_step']:.2f}   "
        f"sum of compute kernels {nums['compute_kernel_sum_ms_per_step']:.2f}",
        f"NCCL kernels: sum {nums['nccl_kernel_ms_per_step']:.2f}   union {nums['nccl_union_ms_per_step']:.2f}   "
        f"exposed (no compute kernel running) {nums['exposed_comm_ms_per_step']:.2f}",
    ]
    if comm:
        kinds = {}
        for e in comm:
            k = kinds.setdefault(nccl_kind(e["name"]), [0, 0.0])
            k[0] += 1
            k[1] += e["dur"]
        lines.append("NCCL by collective: " + ", ".join(
            f"{k} {v[0] / per:.1f}/step {v[1] / 1e3 / per:.2f} ms/step" for k, v in sorted(kinds.items())))
    streams = {}
    for e in gpu:
        s = (e.get("args") or {}).get("stream", e.get("tid"))
        streams.setdefault(s, []).append([e["ts"], e["ts"] + e["dur"]])
    lines.append("busy per stream (ms/step): " + ", ".join(
        f"stream {s}: {length(union(v)) / 1e3 / per:.2f}" for s, v in sorted(streams.items(), key=lambda x: str(x[0]))))
    g = gaps(busy)
    if g:
        lines.append("longest idle gaps (ms at ms from window start): "
                     + ", ".join(f"{d / 1e3:.2f} @ {(s - t0) / 1e3:.1f}" for d, s in g))
    waits = idle_before(gpu, busy, top=20, launched_by=launchers(events))
    if waits:
        lines += ["", "== GPU idle time by what ends it (per step; the host ops, innermost first, that launched "
                      "the kernel the GPU waited for) ==",
                  f"{'idle ms':>8} {'gaps':>6}  host ops -> next kernel"]
        for name, us, n in waits:
            short = name if len(name) <= 200 else name[:197] + "..."
            lines.append(f"{us / 1e3 / per:8.2f} {n / per:6.1f}  {short}")
    by = {}
    for e in gpu:
        name = e["name"] if e.get("cat") == "kernel" else f"[{e['cat']}] {e['name']}"
        k = by.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
    total = sum(v[1] for v in by.values())
    lines += ["", f"== top {top} GPU kernels by total time (per step) ==",
              f"{'ms/step':>8} {'calls/step':>10} {'avg us':>8} {'%':>5}  name"]
    for name, (n, d) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"{d / 1e3 / per:8.2f} {n / per:10.1f} {d / n:8.1f} {100 * d / max(total, 1e-9):5.1f}  {short}")
    lines += memset_section(events, gpu, per)
    lines += host_section(events, steps)
    lines += children_section(events, steps)
    lines += runtime_section(events, steps)
    return "\n".join(lines) + "\n", nums


def _seqfuse_frame(name):
    """A Python frame of seqfuse's package (from the checkout's python/ or installed)."""
    return "python/seqfuse/" in name or "site-packages/seqfuse/" in name


def memset_section(events, gpu, per, top=15):
    """The GPU's memsets by what launched them (per step): the host ops and,
    in a profile taken with_stack, seqfuse's innermost Python frames around
    the runtime call.  Each memset is a queue entry of its own in the
    stream (about a microsecond of work and the gap before the next
    kernel): a library's hidden ones show here."""
    sets = [e for e in gpu if e.get("cat") == "gpu_memset"]
    if not sets:
        return []
    hosts = launchers(events)
    frames = launchers(events, PY_CATS, keep=_seqfuse_frame)
    by = {}
    for e in sets:
        corr = (e.get("args") or {}).get("correlation")
        key = (" < ".join(hosts.get(corr, ["?"])), " < ".join(frames.get(corr, [])))
        v = by.setdefault(key, [0, 0.0])
        v[0] += 1
        v[1] += e["dur"]
    lines = ["", f"== GPU memsets by launcher (per step: {len(sets) / per:.1f} memsets, "
                 f"{sum(e['dur'] for e in sets) / 1e3 / per:.2f} ms) ==",
             f"{'count':>6} {'ms':>6}  host ops [seqfuse frames]"]
    for (host, py), (n, d) in sorted(by.items(), key=lambda x: -x[1][0])[:top]:
        text = host + (f" [{py}]" if py else "")
        lines.append(f"{n / per:6.1f} {d / 1e3 / per:6.3f}  {text if len(text) <= 220 else text[:217] + '...'}")
    return lines


def runtime_section(events, steps, top=10):
    """CUDA runtime and driver calls by total host time: a synchronizing call
    (cudaStreamSynchronize, a device-to-host cudaMemcpy) or an allocation
    (cudaMalloc) that the host waits in shows here.  Where the trace has
    profile_steps' step ranges, only calls made inside them count (not the
    harness's own synchronize after the last step)."""
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in RUNTIME_CATS and "dur" in e]
    steps_at = union([e["ts"], e["ts"] + e["dur"]] for e in events
                     if e.get("ph") == "X" and e.get("name") == STEP and "dur" in e)
    if steps_at:  # inside the steps only (any thread: the backward runs on autograd's), not the harness's sync
        calls = [e for e in calls if any(a <= e["ts"] <= b for a, b in steps_at)]
    if not calls:
        return []
    by = {}
    for e in calls:
        k = by.setdefault(e["name"], [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
    per = max(1, steps)
    out = ["", f"== top {top} CUDA runtime / driver calls by host time (per step) ==",
           f"{'ms/step':>8} {'calls/step':>10}  name"]
    for name, (n, d) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
        out.append(f"{d / 1e3 / per:8.2f} {n / per:10.1f}  {name}")
    return out


def sync_points(step, path, title, frames=8):
    """Run ``step()`` once under torch.cuda.set_sync_debug_mode("warn") and
    write every distinct Python stack that made a synchronizing CUDA call
    (a device-to-host copy, .item(), a non-blocking-unsafe op), with its
    count, to ``path``; returns the number of synchronizing calls.  A
    training step that syncs serialises the host's launches with the GPU's
    work: the host work after each sync is exposed."""
    import traceback
    import warnings

    import torch

    seen = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings.py" not in f.filename]
        if stack and stack[-1].name == "set_sync_debug_mode":  # the switch itself, not the step
            return
        key = "".join(traceback.format_list(stack[-frames:]))
        seen[key] = seen.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    total = sum(seen.values())
    lines = [f"# {title}".rstrip(), f"synchronizing CUDA calls in one step: {total} ({len(seen)} distinct stacks)"]
    for key, n in sorted(seen.items(), key=lambda x: -x[1]):
        lines += ["", f"-- {n} call(s) from:", key.rstrip()]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return total


def host_section(events, steps, top=15):
    """Host ranges by inclusive time: FSDP2's record_function labels
    (FSDP::pre_forward, FSDP::post_backward_reduce, ...) and torch ops."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS and "dur" in e]
    if not host:
        return []
    by = {}
    for e in host:
        k = by.setdefault((e["cat"], host_name(e["name"])), [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
    per = max(1, steps)
    out = ["", f"== top {top} host ranges by inclusive time (per step; nested ranges overlap; "
                "FSDP2 labels summed over modules) ==",
           f"{'ms/step':>8} {'calls/step':>10}  name"]
    for (cat, name), (n, d) in sorted(by.items(), key=lambda x: -x[1][1])[:top]:
        short = name if len(name) <= 100 else name[:97] + "..."
        out.append(f"{d / 1e3 / per:8.2f} {n / per:10.1f}  {short}" + ("  [annotation]" if cat == "user_annotation" else ""))
    fsdp = {name: v for (cat, name), v in by.items() if name.startswith("FSDP::")}
    if fsdp:
        out.append("FSDP2 host ranges (ms/step): " + ", ".join(
            f"{n} {v[1] / 1e3 / per:.2f}" for n, v in sorted(fsdp.items(), key=lambda x: -x[1][1])))
    return out


_WRAPPER = "autograd::engine::evaluate_function: "


def parents(events):
    """{index of event: index of its innermost enclosing event} for the
    host ranges, Python frames and runtime calls of ``events`` (nesting per
    thread: a range encloses another on the same pid and tid whose interval
    it contains)."""
    cats = HOST_CATS + RUNTIME_CATS + PY_CATS
    idx = [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") in cats and "dur" in e]
    by_thread = {}
    for i in idx:
        e = events[i]
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    out = {}
    for items in by_thread.values():
        items.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack = []
        for i in items:
            e = events[i]
            while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] < e["ts"] + e["dur"]:
                stack.pop()
            if stack:
                out[i] = stack[-1]
            stack.append(i)
    return out


def children_section(events, steps, ranges=3, depth=6, share=0.02):
    """Where the heaviest host ranges spend their time: for each of the
    ``ranges`` cpu_op ranges with the most inclusive time per step (the
    autograd engine's evaluate_function wrappers left out: their one child
    is the range itself), the tree of what runs inside it (torch ops, CUDA
    runtime calls and, in a profile taken with Python stacks, Python
    frames) to ``depth`` levels, each node's inclusive time per call of the
    range, nodes under ``share`` of the range's time left out; 'own' is the
    range's time in no child (Python without stacks, C code that calls no
    torch op)."""
    par = parents(events)
    ops = [i for i, e in enumerate(events) if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "dur" in e
           and not e["name"].startswith(_WRAPPER)]
    if not ops:
        return []
    incl = {}
    for i in ops:
        k = incl.setdefault(events[i]["name"], [0, 0.0])
        k[0] += 1
        k[1] += events[i]["dur"]
    heavy = [n for n, _ in sorted(incl.items(), key=lambda x: -x[1][1])[:ranges]]
    per = max(1, steps)
    out = ["", f"== inside the {len(heavy)} heaviest host ranges: what runs in them, by inclusive time "
               "(ms per call of the range, calls per call; 'own' = time in no child) =="]
    for name in heavy:
        n, total = incl[name]
        tree = {}
        for i in par:
            path, j = [], i
            while j in par and len(path) <= depth:
                path.append(events[j]["name"])
                j = par[j]
                if events[j].get("cat") == "cpu_op" and events[j]["name"] == name:
                    break
            else:
                continue
            if len(path) > depth:
                continue
            k = tree.setdefault(tuple(reversed(path)), [0, 0.0])
            k[0] += 1
            k[1] += events[i]["dur"]
        own = total - sum(v[1] for p, v in tree.items() if len(p) == 1)
        out.append(f"{name}: {n / per:.1f} calls/step, {total / n / 1e3:.3f} ms a call, own {own / n / 1e3:.3f} ms")

        def walk(prefix):
            kids = [(p, v) for p, v in tree.items() if len(p) == len(prefix) + 1 and p[:len(prefix)] == prefix]
            for p, (kn, kd) in sorted(kids, key=lambda x: -x[1][1]):
                if kd < share * total:
                    continue
                short = p[-1] if len(p[-1]) <= 90 else p[-1][:87] + "..."
                out.append(f"  {'  ' * len(prefix)}{kd / n / 1e3:8.3f} ms {kn / n:6.1f}x  {short}")
                walk(p)
        walk(())
    return out


def profile_steps(step, batches, sync, path, title, cuda=True, top=25, stacks=False):
    """Run ``step(b)`` for each batch under torch.profiler; write the summary
    to ``path`` and return its numbers.  The trace lives in a temporary
    directory only, unless the environment sets SEQFUSE_PROFILE_TRACE (then
    it is also written gzipped beside the summary, ``<stem>_trace.json.gz``;
    to read where the GPU waits on the timeline).  ``stacks``: record Python
    frames too (their times go into children_section's trees; the
    profiler's own cost per frame makes the host times larger than an
    unprofiled step's)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    host_ms, cpu_ms = [], []
    sync()
    with profile(activities=acts, record_shapes=False, with_stack=stacks, profile_memory=False) as prof:
        for b in batches:
            t0, c0 = time.perf_counter(), time.thread_time()
            with record_function(STEP):
                step(b)
            host_ms.append(1e3 * (time.perf_counter() - t0))
            cpu_ms.append(1e3 * (time.thread_time() - c0))
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f).get("traceEvents", [])
        if os.environ.get("SEQFUSE_PROFILE_TRACE"):  # (kept, gzipped, beside the summary: to read the timeline)
            import gzip
            import shutil

            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            stem = path[:-len("_profile.txt")] if path.endswith("_profile.txt") else os.path.splitext(path)[0]
            with open(trace, "rb") as src, gzip.open(stem + "_trace.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    text, nums = summarize(events, len(batches), host_ms, cpu_ms, title=title, top=top)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return nums


def profile_row(step, batches, device, stem, title, top=40, stacks=False):
    """What a bench's ``--profile`` writes for one row: profile_steps over
    ``batches`` into ``<stem>_profile.txt`` and, on the GPU, sync_points of
    ``step(batches[0])`` into ``<stem>_syncs.txt``.  Returns (the profile's
    numbers, the synchronizing calls of one step, or None off the GPU)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    nums = profile_steps(step, batches, sync, f"{stem}_profile.txt", title, cuda=cuda, top=top, stacks=stacks)
    syncs = sync_points(lambda: step(batches[0]), f"{stem}_syncs.txt", title) if cuda else None
    return nums, syncs
