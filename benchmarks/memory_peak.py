"""What holds the GPU memory at a training step's peak (the --memory option of
benchmarks/hf/bench_accelerate.py).

Why: a peak-memory figure says how much, not what.  Whether a row's peak is
reached at the end of the forward (saved activations), inside the backward
(activations and gradients at once) or at the optimizer step (gradients and
optimizer state), and which tensors make the difference between two rows,
decides which memory work pays.  Two measurements answer it:

- ``phase_peaks``: one more step, split into forward, backward and optimizer
  step, with the allocator's peak counter reset between them: the highest
  and the final allocated bytes of each phase.
- ``record`` + ``breakdown``: the CUDA caching allocator's history over a few
  steps (torch.cuda.memory._record_memory_history with Python stacks),
  replayed event by event (an ``alloc`` adds its size, a ``free_requested``
  takes it away, as torch's allocated-bytes counter moves; the history
  records the requested sizes, which the counter rounds up to 512-byte
  blocks, so the replay's total runs a little under the counter's) to find
  the moment of the highest total, and the allocations live at that moment
  grouped by the Python frames that made them (the innermost frames in
  seqfuse, transformers, Liger-Kernel or the benchmarks).  Allocations made
  before the recording began (the weights, the optimizer state) are one
  ``baseline`` figure; ``record`` also returns the counter's own peak over
  the recording, which the summary prints beside the replay's, and the
  summary says when the history reached its entry limit (older events
  dropped: the replay then starts late).

``breakdown`` and ``format_breakdown`` work on plain snapshot dicts (torch's
documented format: device_traces of action / addr / size / frames), so they
are tested on the CPU with synthetic events.
"""
import os

GiB = 2.0 ** 30
# the frames that name who made an allocation (the innermost of these, up to DEPTH of them)
PROJECT_PARTS = ("/seqfuse/", "/transformers/", "/liger_kernel/", "/benchmarks/")
DEPTH = 3


def phase_peaks(forward, backward, update, device):
    """Run one step as ``loss = forward()``, ``backward(loss)``,
    ``update()`` and return, in GiB, the allocated memory at its start and,
    for each phase, the peak within it and the allocated memory at its end
    (the allocator's peak counter is reset at each phase's start)."""
    import torch

    def sync_alloc():
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / GiB

    out = {"start": sync_alloc()}
    torch.cuda.reset_peak_memory_stats(device)
    loss = forward()
    out["forward_end"] = sync_alloc()
    out["forward_peak"] = torch.cuda.max_memory_allocated(device) / GiB
    torch.cuda.reset_peak_memory_stats(device)
    backward(loss)
    del loss
    out["backward_end"] = sync_alloc()
    out["backward_peak"] = torch.cuda.max_memory_allocated(device) / GiB
    torch.cuda.reset_peak_memory_stats(device)
    update()
    out["step_end"] = sync_alloc()
    out["step_peak"] = torch.cuda.max_memory_allocated(device) / GiB
    return out


def record(run, device, max_entries=400_000):
    """(the allocator's snapshot after ``run()`` ran with its history
    recorded (Python stacks), the bytes allocated when the recording began,
    the allocated-bytes counter's peak over the recording).  The snapshot
    carries ``max_entries`` for breakdown's truncation check."""
    import torch

    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", device=device)
    try:
        run()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    snap["max_entries"] = max_entries
    return snap, baseline, torch.cuda.max_memory_allocated(device)


def where(frames):
    """The allocation's maker: its innermost project frames (at most DEPTH,
    innermost first), else its innermost frame; '?' without frames."""
    mine = [f for f in frames or () if any(p in f.get("filename", "") for p in PROJECT_PARTS)]
    chosen = mine[:DEPTH] or list(frames or ())[:1]
    if not chosen:
        return "?"
    return " < ".join(f"{_short(f['filename'])}:{f.get('line', '?')} {f.get('name', '?')}" for f in chosen)


def _short(filename):
    for part in PROJECT_PARTS:
        i = filename.rfind(part)
        if i >= 0:
            return filename[i + 1:]
    return os.path.basename(filename)


def breakdown(snapshot, baseline=0, device_index=0, top=30):
    """The highest allocated total over the recorded events of
    ``device_index`` (``baseline`` + the recorded allocations minus the
    recorded frees), the event index where it was reached, and the
    allocations live then, grouped by :func:`where` (largest first; at most
    ``top`` groups, the rest summed as one)."""
    traces = snapshot.get("device_traces", [])
    events = traces[device_index] if device_index < len(traces) else []
    live = {}  # addr -> (size, frames) of the recorded allocations not freed yet
    total = peak = 0
    peak_at, peak_live = -1, {}
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames"))
            total += e["size"]
            if total > peak:
                peak, peak_at, peak_live = total, i, None
        elif action in ("free_requested", "free_completed") and e["addr"] in live:  # (whichever comes first)
            if peak_live is None:  # the first free after the peak: the live set then is the peak's
                peak_live = dict(live)
            total -= live.pop(e["addr"])[0]
    if peak_live is None:
        peak_live = dict(live)
    groups = {}
    for size, frames in peak_live.values():
        key = where(frames)
        n, b = groups.get(key, (0, 0))
        groups[key] = (n + 1, b + size)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])
    rows = [{"where": k, "count": n, "gib": b / GiB} for k, (n, b) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        rows.append({"where": f"({len(rest)} more places)", "count": sum(n for _, (n, _) in rest),
                     "gib": sum(b for _, (_, b) in rest) / GiB})
    limit = snapshot.get("max_entries")
    return {"peak_gib": (baseline + peak) / GiB, "baseline_gib": baseline / GiB, "recorded_peak_gib": peak / GiB,
            "peak_event": peak_at, "events": len(events), "groups": rows,
            "truncated": limit is not None and len(events) >= limit}


def format_breakdown(title, b, phases=None, counter_peak_gib=None):
    lines = [title, f"peak {b['peak_gib']:.3f} GiB allocated = {b['baseline_gib']:.3f} GiB from before the "
                    f"recording (weights, optimizer state, caches) + {b['recorded_peak_gib']:.3f} GiB made in it; "
                    f"reached at event {b['peak_event']} of {b['events']}"]
    if counter_peak_gib is not None:
        lines.append(f"the allocated-bytes counter's peak over the recording: {counter_peak_gib:.3f} GiB "
                     "(block-rounded sizes; the replay sums the requested ones)")
    if b.get("truncated"):
        lines.append("the history reached its entry limit: older events were dropped and the replay starts late")
    if phases:
        lines.append("one more step by phase (GiB allocated): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    lines.append(f"{'GiB':>8s} {'count':>6s}  live at the peak, made at (innermost project frames first)")
    lines += [f"{r['gib']:8.3f} {r['count']:6d}  {r['where']}" for r in b["groups"]]
    return "\n".join(lines) + "\n"
