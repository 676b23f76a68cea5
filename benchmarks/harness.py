"""Benchmark harness shared by every script in benchmarks/.

Timing: CUDA events around each repeat, after warm-up, with the L2 cache
flushed between repeats (a 256 MB write, larger than the H200's 60 MB L2) so
no repeat reads what the previous one left in cache; the median is reported.
Host-side timings (per-call overhead) use perf_counter over many calls.

Multi-GPU scripts under torchrun: `init_torchrun` joins the process group
(NCCL on this rank's GPU, gloo for a CPU smoke run) and `ranks_step_ms`
times a step on every rank and keeps the slowest rank's time;
`CollectiveBytes` counts what FSDP2's all-gathers and reduce-scatters move.

Compiled peers: `allow_recompiles` keeps dynamo compiling each shape, and
`compile_layers_or_model` compiles a Hugging Face model per layer or whole.

Results: `Table` prints an aligned table and writes JSON to
benchmarks/results/<name>.json with the device, versions and shapes, and the
run record of peers/meta.run_metadata (commit, command, script hash, library
versions), so every figure in the README can be traced to a file and a tree.
"""
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers.meta import run_metadata  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

#: Ceilings measured on the H200 of this project (see README).
H200_BF16_TFLOPS = 794.0
H200_FP8_TFLOPS = 1438.0
H200_COPY_TBS = 4.16

_flush_buffer = None


def flush_l2():
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()


def cuda_time_ms(fn, warmup=5, repeats=20, flush=True):
    """Median device time of fn() in milliseconds, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if flush:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def init_torchrun(script, cpu=False, world=None):
    """Join the torchrun job's process group: NCCL with this process on GPU
    LOCAL_RANK (set as the current device), or gloo on the CPU when ``cpu``
    (the scripts' smoke runs).  SystemExit naming ``script`` when not under
    torchrun or, with ``world``, when the job has another number of
    processes.  Returns (rank, world size, device)."""
    import torch.distributed as dist

    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"{script}: run under torchrun --nproc-per-node {world or 'N'}")
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    rank, size = dist.get_rank(), dist.get_world_size()
    if world is not None and size != world:
        raise SystemExit(f"{script}: needs {world} processes (one per GPU), got {size}")
    return rank, size, device


def ranks_step_ms(fn, steps, rounds, warmup=5):
    """Milliseconds per fn() on the slowest rank: per round, ``steps``
    back-to-back calls between CUDA events after a barrier, the per-step
    time MAX-all-reduced over the ranks; the median over ``rounds`` rounds,
    after ``warmup`` calls.  On a CPU process group (a smoke run) one call
    timed with perf_counter after one untimed call: it shows the script
    runs, the figure means nothing for speed."""
    import torch.distributed as dist

    if not torch.cuda.is_available() or dist.get_backend() == "gloo":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) / steps], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def allow_recompiles(limit=128):
    """Benchmarks compile one peer per shape (dynamic=False, as a fixed-size
    training step would): keep dynamo from silently falling back to eager
    after its default 8 recompilations of the same function."""
    import torch._dynamo

    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(limit, getattr(torch._dynamo.config, key)))


def compile_layers_or_model(model, layers, scope, dynamic):
    """torch.compile a model in place for a compiled peer row: each module of
    ``layers`` (scope "layers": one graph that layers of one shape share) or
    the whole model (scope "model"), with dynamo's recompile limit lifted
    (allow_recompiles); ValueError naming --compile-scope for another scope.
    Returns the model."""
    allow_recompiles()
    if scope == "layers":
        for layer in layers:
            layer.compile(dynamic=dynamic)
    elif scope == "model":
        model.compile(dynamic=dynamic)
    else:
        raise ValueError(f"--compile-scope must be 'layers' or 'model', got {scope!r}")
    return model


class CollectiveBytes:
    """The buffers of the all-gathers (their outputs: what FSDP2 gathers) and
    reduce-scatters (their inputs) that torch.distributed runs while this
    context is active, as (dtype, bytes) lists ``gathers`` and ``scatters``.
    Both torch spellings of each call are wrapped; a collective that one of
    them reaches inside is not counted again.  The calls are put back at exit."""

    NAMES = (("all_gather_single", "gathers"), ("all_gather_into_tensor", "gathers"),
             ("reduce_scatter_single", "scatters"), ("reduce_scatter_tensor", "scatters"))

    def __enter__(self):
        import torch.distributed as dist

        self.gathers, self.scatters, self._depth, self._saved = [], [], 0, {}
        for name, kind in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(fn, kind))
        return self

    def _wrap(self, fn, kind):
        def call(*args, **kwargs):
            if self._depth == 0:
                # (output, input): the gathered output / the reduce-scatter's input
                t = (kwargs.get("output", args[0] if args else None) if kind == "gathers"
                     else kwargs.get("input", args[1] if len(args) > 1 else None))
                getattr(self, kind).append((t.dtype, t.numel() * t.element_size()))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return call

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    @staticmethod
    def total(calls):
        """Bytes of a list of calls."""
        return sum(n for _, n in calls)

    @staticmethod
    def dtype_names(calls):
        """The dtypes of a list of calls, sorted, comma-joined, without "torch."."""
        return ",".join(sorted({str(dtype).replace("torch.", "") for dtype, _ in calls}))


def train_steps(name, batches, loss_of, opt, params, clip, lr_at, log_every, deadline=None, after_step=None):
    """The convergence benchmarks' training loop: per step the learning rate
    ``lr_at(step)`` into every parameter group, ``loss_of(batch)``, backward,
    ``clip(params, 1.0)``, the optimizer step.  Every ``log_every`` steps the
    window's mean loss is printed (one sync) and must be finite;
    ``after_step(steps_done, window_or_None)`` runs after each step (a
    validation pass, a log of the window).  Stops before a step once
    ``time.perf_counter()`` passes ``deadline``.  Returns (losses as
    detached tensors, whether the deadline stopped it, the start time)."""
    losses, stopped = [], False
    t0 = time.perf_counter()
    for step, b in enumerate(batches):
        if deadline is not None and time.perf_counter() > deadline:
            stopped = True
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = loss_of(b)
        loss.backward()
        clip(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        done, window = step + 1, None
        if done % log_every == 0:
            window = torch.stack(losses[-log_every:]).float().mean().item()
            print(f"  {name} step {done}: train loss {window:.4f} "
                  f"({done / (time.perf_counter() - t0):.1f} steps/s)", flush=True)
            if not math.isfinite(window):
                raise FloatingPointError(f"{name}: train loss {window} at step {done}")
        if after_step is not None:
            after_step(done, window)
    return losses, stopped, t0


def host_time_us(fn, calls=20000, rounds=7):
    """Median over rounds of the mean host time of one fn() call, in µs."""
    for _ in range(calls // 10):
        fn()
    results = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(results)


def environment():
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import seqfuse

        env["seqfuse_build"] = seqfuse.build_info()
    except ImportError:
        pass
    return env


class Table:
    """Rows of results: printed as a table, saved as JSON.  Each row is also
    printed as it is added, so a run cut short by a timeout keeps its figures."""

    def __init__(self, name, columns):
        self.name, self.columns, self.rows = name, columns, []

    def add(self, **row):
        self.rows.append(row)
        shown = (f"{c}={row[c]:.3g}" if isinstance(row[c], float) else f"{c}={row[c]}"
                 for c in self.columns if c in row)
        print(f"[{self.name}] " + "  ".join(shown), flush=True)
        return row

    def text(self):
        def fmt(v):
            return f"{v:.3g}" if isinstance(v, float) else str(v)

        cells = [[fmt(r.get(c, "")) for c in self.columns] for r in self.rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
                  for i, c in enumerate(self.columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(self.columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
        return "\n".join(lines)

    def save(self, extra=None):
        os.makedirs(RESULTS, exist_ok=True)
        path = os.path.join(RESULTS, f"{self.name}.json")
        doc = {"name": self.name, "environment": environment(), "run": run_metadata(),
               "rows": self.rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        if extra:
            doc.update(extra)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
        print(f"\n== {self.name} ==\n{self.text()}\n(saved {os.path.relpath(path)})")
        return path


def plot_bars(path_png, title, labels, series, ylabel):
    """A grouped bar chart: series is {legend: [value per label]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (legend, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, values, width, label=legend)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
