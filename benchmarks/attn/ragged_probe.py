"""Does torch expose cuDNN's variable-length (ragged) attention in a form
seqfuse can route packed thd batches to, and is it equal to and faster than
seqfuse's current thd route?  One GPU script (about 2-3 minutes on an H200),
one line per route and case.

Cases (bf16, forward and forward+backward):
- "ESM-2 650M packed": 20 heads x 64, bidirectional, real UniProt lengths
  (recipes/esm2/data/subset, as benchmarks/attn/bench_routes.py draws them:
  +2 special tokens, clamped to 50..1024) up to 16,384 tokens; and the same
  sequences packed longest first;
- "Llama 1B GQA causal packed": 32 q / 8 k/v heads x 64, top-left causal,
  eight genomic windows of 512 to 4,096 tokens, 16,384 in all.

Routes:
- current: seqfuse.ops.attention in auto, the reference of every check (a
  training call takes the flash route, torch's FlashAttention-2; a
  forward-only call seqfuse's own kernels; the line names both);
- seqfuse kernels: SEQFUSE_ATTN_BACKEND=seqfuse;
- torch varlen_attn: torch.nn.attention.varlen.varlen_attn (FlashAttention-2
  in torch 2.11, whose cuDNN branch is switched off);
- cudnn_ragged (seqfuse route, forced): the opt-in route of
  python/seqfuse/ops/attn/_cudnn_ragged.py; forward only where it refuses
  gradients (the line says so and why);
- torch cuDNN ragged op, direct: torch.ops.aten._cudnn_attention_forward
  with cum_seq_q/k, backward through torch's autograd
  (_cudnn_attention_backward), run in a child process: torch 2.11's ragged
  backward is reported (PyTorch PR #186142) to size its dQ accumulator from
  the head dim, which can fault the CUDA context;
- nested jagged SDPA on cuDNN: scaled_dot_product_attention on
  torch.nested jagged tensors under SDPBackend.CUDNN_ATTENTION with
  TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1, in a child process too (k/v heads
  expanded for GQA: nested SDPA does not broadcast heads in training);
- cuDNN frontend torch op: cudnn.sdpa_torch of the nvidia-cudnn-frontend
  package (PyPI; 1.32 registers torch.ops.cudnn.sdpa_forward/sdpa_backward with THD
  cu_seqlens, autograd, and a graph cache keyed by batch size and
  max_seqlen, not by total tokens), in a child; absent unless installed
  (on the GPU machine: python3 -m pip install -q --no-index --no-deps
  .te/nvidia_cudnn_frontend-*.whl, from shared/peers/prepare_te.py); and
  the same with the batch size bucketed (rounded up to a multiple of 16
  with empty sequences) and max_seqlen rounded up to a power of two, so
  that another batch reuses the graph; and seqfuse's cudnn_ragged route
  with that op as its provider (SEQFUSE_ATTN_CUDNN_RAGGED=frontend: the
  same bucketing, training calls taken); and the op once per group of
  sequences whose lengths are within a factor of 2 (longest first; a
  batch out of that order permuted inside the call), in case cuDNN's
  ragged kernels size their work by max_seqlen (s13: the whole batch in
  one call ran 1.55x slower than FlashAttention-2 at ESM-2 lengths,
  though cuDNN's padding-free kernels are 1.3-2.3x faster than it);
- ceiling: cuDNN SDPA on the equivalent padding-free bshd call (the same
  tokens cut into equal sequences of the token-weighted mean length, the
  same FLOPs; timing only, not the same problem).

Checks: each candidate's output and gradients (dq, dk, dv) against the
current route's, within tests/helpers.py's pair_tol for bfloat16 (x
BACKWARD_FACTOR for gradients: both carry their own error); err64 columns give
each route's error against a float64 reference on the GPU, for context.
Timing: CUDA events, median after warm-up on the very shapes (fewer repeats
for calls slower than 20 ms).  The child routes also report the wall time
of their first forward, first forward+backward, and the first
forward+backward of a second batch with one sequence fewer (the cost of a
graph build per new batch shape).  A route that is absent, refuses the
call, raises, or crashes its child prints one line with the reason instead.

Run on the GPU machine after the build:
    python3 benchmarks/attn/ragged_probe.py [--json PATH]
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the shared tolerance policy
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: harness

from harness import cuda_time_ms, environment, run_metadata  # noqa: E402
from helpers import BACKWARD_FACTOR, pair_tol  # noqa: E402

DT = torch.bfloat16
TOKENS = 16384
CHILD_TIMEOUT_S = 60
CHILD_BUDGET_S = 110  # no child route starts after this many seconds (the whole probe stays under ~180 s)
LLAMA_WINDOWS = [4096, 1536, 2048, 512, 3072, 1024, 2560, 1536]  # 16,384 tokens


def log(msg):
    print(f"[ragged_probe] {msg}", flush=True)


# ------------------------------------------------------------------ problems
def esm2_lengths():
    """Real protein lengths as bench_routes.py draws them (seeded), and the source."""
    import random

    from bench_routes import protein_lengths
    return protein_lengths(random.Random(0), tokens=TOKENS)


def cases():
    lengths, source = esm2_lengths()
    return [dict(name="ESM-2 650M packed", lengths=lengths, h=20, hk=20, d=64, causal=False, seed=1, source=source),
            dict(name="ESM-2 650M packed, sorted by length", lengths=sorted(lengths, reverse=True), h=20, hk=20,
                 d=64, causal=False, seed=1, source=source + ", longest first (as a collator could pack them)"),
            dict(name="Llama 1B GQA causal packed", lengths=LLAMA_WINDOWS, h=32, hk=8, d=64, causal=True, seed=2,
                 source="fixed genomic windows")]


def make_inputs(spec, device="cuda"):
    """q, k, v, dout (bf16, seeded: the same in the parent and the children), cu_seqlens, max length."""
    g = torch.Generator(device=device).manual_seed(spec["seed"])
    t = sum(spec["lengths"])
    q = torch.randn(t, spec["h"], spec["d"], device=device, generator=g).to(DT)
    k = torch.randn(t, spec["hk"], spec["d"], device=device, generator=g).to(DT)
    v = torch.randn(t, spec["hk"], spec["d"], device=device, generator=g).to(DT)
    dout = torch.randn(t, spec["h"], spec["d"], device=device, generator=g).to(DT)
    bounds = [0]
    for n in spec["lengths"]:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return q, k, v, dout, cu, max(spec["lengths"])


def flops(spec, backward):
    f = 4.0 * spec["h"] * spec["d"] * sum(n * n for n in spec["lengths"]) * (0.5 if spec["causal"] else 1.0)
    return f * (3.5 if backward else 1.0)


def float64_reference(spec, q, k, v, dout):
    """out and (dq, dk, dv) in float64 on q's device, sequence by sequence."""
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    g = spec["h"] // spec["hk"]
    scale = spec["d"] ** -0.5
    outs, start = [], 0
    for n in spec["lengths"]:
        qs, ks, vs = (x[start:start + n] for x in (q64, k64, v64))
        ks, vs = ks.repeat_interleave(g, dim=1), vs.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if spec["causal"]:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vs))
        start += n
    out = torch.cat(outs)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), grads


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    if torch.isnan(a).any():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------ timing
def time_ms(step):
    """Median ms of step() by CUDA events after warm-up (harness.cuda_time_ms,
    no L2 flush): 10 repeats after 3 warm-up calls, or 3 after 1 when a
    call takes longer than 20 ms (the cuDNN ragged op of torch 2.11 takes
    about 50 ms: it rebuilds its graph every call)."""
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    slow = time.perf_counter() - t0 > 0.02
    return cuda_time_ms(step, warmup=1 if slow else 3, repeats=3 if slow else 10, flush=False)


def outputs(fn, q, k, v, dout):
    """out and (dq, dk, dv) of fn(q, k, v) for the cotangent dout."""
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    return out.detach(), torch.autograd.grad(out, xs, dout)


def measure(fn, q, k, v, dout, backward):
    """(out, grads or None, forward ms, forward+backward ms or None) of fn(q, k, v) -> [t, h, d]."""
    with torch.no_grad():
        forward_ms = time_ms(lambda: fn(q, k, v))
    if not backward:
        with torch.no_grad():
            return fn(q, k, v), None, forward_ms, None
    xs = [x.detach().requires_grad_() for x in (q, k, v)]

    def step():
        out = fn(*xs)
        torch.autograd.grad(out, xs, dout)
    both_ms = time_ms(step)
    return (*outputs(fn, q, k, v, dout), forward_ms, both_ms)


# ------------------------------------------------------------------ the routes
def seqfuse_call(spec, cu, max_len, backend):
    """seqfuse.ops.attention on the case, under ``backend`` (set here, once:
    setting it forgets the cached route choices; auto with the cudnn_ragged
    opt-in off, whatever SEQFUSE_ATTN_CUDNN_RAGGED says: the current route);
    and its keywords."""
    import seqfuse

    mask = "padding_causal" if spec["causal"] else "padding"
    kw = dict(qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
              max_seqlen_kv=max_len)
    seqfuse.ops.attn.set_attention_cudnn_ragged(False)
    seqfuse.ops.set_attention_backend(backend)

    def call(q, k, v):
        return seqfuse.ops.attention(q, k, v, **kw)
    return call, kw


def varlen_call(spec, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn  # ImportError: absent

    window = (-1, 0) if spec["causal"] else (-1, -1)

    def call(q, k, v):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window)
    return call


def cudnn_direct_call(spec, cu, max_len):
    def call(q, k, v):
        wants = torch.is_grad_enabled() and q.requires_grad
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, wants, 0.0,
                                                       spec["causal"], False)[0]
    return call


def nested_call(spec, cu):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    offsets = cu.long()
    g = spec["h"] // spec["hk"]

    def call(q, k, v):
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(nq, nk, nv, is_causal=spec["causal"])
        return out.transpose(1, 2).values()
    return call


def frontend_call(spec, cu, max_len, bucketed):
    """cuDNN's own torch op from the nvidia-cudnn-frontend package
    (cudnn.sdpa_torch: torch.ops.cudnn.sdpa_forward / sdpa_backward, THD with
    cu_seqlens, its graphs cached by batch size and max_seqlen, autograd
    with return_lse=True).  ``bucketed``: the batch size rounded up to a
    multiple of 16 with empty sequences and max_seqlen to a power of two, so
    that batches of other lengths reuse one graph."""
    import cudnn  # ImportError: absent

    sdpa = cudnn.sdpa_torch
    if bucketed:
        b = cu.numel() - 1
        extra = -(-b // 16) * 16 - b
        cu = torch.cat((cu, cu[-1:].expand(extra))) if extra else cu
        max_len = 1 << (max_len - 1).bit_length()

    def call(q, k, v):
        wants = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = sdpa(q, k, v, is_causal=spec["causal"], cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                   max_seqlen_kv=max_len, return_lse=wants)
        return out[0] if wants else out
    return call


def length_groups(lengths, ratio=2):
    """The sequences in order of length, longest first, cut into groups
    whose shortest is more than 1/``ratio`` of their longest: (token
    permutation into that order or None where the batch is in it already,
    [(first token, end token, lengths) per group]) -- what
    frontend_split_call runs one cuDNN call per group on."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    perm = None if order == list(range(len(lengths))) else \
        [t for i in order for t in range(starts[i], starts[i + 1])]
    ordered = [lengths[i] for i in order]
    groups, i, t0 = [], 0, 0
    while i < len(ordered) and ordered[i] > 0:  # (empty sequences, last in this order, hold no tokens)
        j = i
        while j < len(ordered) and ordered[j] * ratio > ordered[i]:
            j += 1
        groups.append((t0, t0 + sum(ordered[i:j]), ordered[i:j]))
        t0 += sum(ordered[i:j])
        i = j
    return perm, groups


def frontend_split_call(spec, cu, max_len):
    """The cuDNN frontend op once per group of similar lengths (within a
    factor of 2, longest first): each call's max_seqlen bounds its own
    sequences, so a kernel that sizes its work by max_seqlen does the
    group's work, not the batch's.  A batch not in that order is permuted
    into it (q, k, v gathered, the output gathered back: in the timing, and
    in autograd); a recipe's collator could hand the packed batch sorted
    (the "sorted by length" case measures that).  The groups are views from
    torch.split (their gradients come back as one concatenation, not a
    zero-filled full-size tensor per group as slices' would), the outputs
    one concatenation: a pass over q, k, v and the output each way that a
    route writing into preallocated outputs would not make.  The setup here
    (the lengths read to the host, the order, the permutation) is per batch:
    child_case's second-batch time includes it."""
    import cudnn  # ImportError: absent

    sdpa = cudnn.sdpa_torch
    lengths = [int(b) - int(a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    perm, groups = length_groups(lengths)
    dev = cu.device
    calls = []
    for a, b, lens in groups:
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        calls.append((a, b, torch.tensor(bounds, dtype=torch.int32, device=dev), max(lens)))
    if perm is not None:
        perm = torch.tensor(perm, dtype=torch.int64, device=dev)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=dev)

    sizes = [b - a for a, b, _, _ in calls]

    def call(q, k, v):
        if q.shape[0] != sum(sizes):
            raise ValueError(f"frontend_split: the batch has {q.shape[0]} tokens, its sequences {sum(sizes)} "
                             "(tokens past the last sequence are not taken)")
        wants = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if perm is not None:
            q, k, v = (x.index_select(0, perm) for x in (q, k, v))
        outs = []
        for (_, _, cu_g, m), qg, kg, vg in zip(calls, q.split(sizes), k.split(sizes), v.split(sizes)):
            out = sdpa(qg, kg, vg, is_causal=spec["causal"], cu_seqlens_q=cu_g, cu_seqlens_kv=cu_g,
                       max_seqlen_q=m, max_seqlen_kv=m, return_lse=wants)
            outs.append(out[0] if wants else out)
        out = torch.cat(outs)
        return out if perm is None else out.index_select(0, inv)
    return call


def seqfuse_frontend_call(spec, cu, max_len):
    """seqfuse's cudnn_ragged route, forced, with the frontend provider
    (batch size and max lengths bucketed by the route)."""
    import cudnn  # noqa: F401  (ImportError: absent)
    import seqfuse

    call, _ = seqfuse_call(spec, cu, max_len, "cudnn_ragged")
    seqfuse.ops.attn.set_attention_cudnn_ragged(True, "frontend")
    return call


def second_batch(spec, cu):
    """cu_seqlens of another batch of the same tokens: the two shortest
    neighbouring sequences merged (one sequence fewer, the same max length)."""
    lengths = list(spec["lengths"])
    i = min(range(len(lengths) - 1), key=lambda j: lengths[j] + lengths[j + 1])
    lengths[i:i + 2] = [lengths[i] + lengths[i + 1]]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=cu.device), max(lengths)


def ceiling_call(spec):
    """cuDNN SDPA on [b, s] bshd tensors with the case's tokens and FLOPs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = sum(spec["lengths"])
    s = min(t, max(64, round(sum(n * n for n in spec["lengths"]) / t / 64) * 64))
    b = max(1, t // s)
    gqa = {"enable_gqa": True} if spec["h"] != spec["hk"] else {}

    def call(q, k, v):
        qb, kb, vb = (x[:b * s].view(b, s, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=spec["causal"], **gqa)
        out = out.transpose(1, 2).reshape(b * s, q.shape[1], q.shape[2])
        return F.pad(out, (0, 0, 0, 0, 0, t - b * s))  # back to the case's t rows, so its dout fits (a 3 % copy)
    return call, f"{b} x {s}", b * s


# ------------------------------------------------------------------ reporting
def row(spec, route, status, forward_ms=None, both_ms=None, err=None, err_grad=None, err64=None, err64_grad=None,
        tokens=None, note=""):
    r = dict(case=spec["name"], route=route, status=status, forward_ms=forward_ms, forward_backward_ms=both_ms, err_forward=err,
             err_grad=err_grad, err64_forward=err64, err64_grad=err64_grad, note=note)
    scale = (tokens or sum(spec["lengths"])) / sum(spec["lengths"])
    r["tflops_forward"] = None if forward_ms is None else flops(spec, False) * scale / forward_ms / 1e9
    r["tflops_forward_backward"] = None if both_ms is None else flops(spec, True) * scale / both_ms / 1e9
    if err is not None:
        ok = err <= pair_tol(DT) and (err_grad is None or err_grad <= pair_tol(DT, BACKWARD_FACTOR))
        r["within_tol"] = bool(ok)
    fields = [f"case={spec['name']}", f"route={route}", f"status={status}"]
    for key, fmt in (("forward_ms", "{:.3f}"), ("tflops_forward", "{:.1f}"), ("forward_backward_ms", "{:.3f}"),
                     ("tflops_forward_backward", "{:.1f}"), ("err_forward", "{:.2e}"), ("err_grad", "{:.2e}"),
                     ("err64_forward", "{:.2e}"), ("err64_grad", "{:.2e}")):
        if r.get(key) is not None:
            fields.append(f"{key}=" + fmt.format(r[key]))
    if "within_tol" in r:
        fields.append(f"equal_to_current={'yes' if r['within_tol'] else 'NO'} (pair_tol bf16 "
                      f"{pair_tol(DT):.0e}, grads {pair_tol(DT, BACKWARD_FACTOR):.0e})")
    if note:
        fields.append(f"note={note}")
    log("  ".join(fields))
    return r


def compare(out, grads, ref_out, ref_grads, exact_out, exact_grads):
    err = rel(out, ref_out)
    err64 = rel(out, exact_out)
    if grads is None:
        return err, None, err64, None
    err_grad = max(rel(g, r) for g, r in zip(grads, ref_grads))
    err64_grad = max(rel(g, r) for g, r in zip(grads, exact_grads))
    return err, err_grad, err64, err64_grad


def why(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# ------------------------------------------------------------------ child processes
CHILD_ROUTES = {
    "direct": lambda spec, cu, max_len: cudnn_direct_call(spec, cu, max_len),
    "nested": lambda spec, cu, max_len: nested_call(spec, cu),
    "frontend": lambda spec, cu, max_len: frontend_call(spec, cu, max_len, False),
    "frontend_bucketed": lambda spec, cu, max_len: frontend_call(spec, cu, max_len, True),
    "seqfuse_frontend": seqfuse_frontend_call,
    "frontend_split": frontend_split_call,
}


def child(mode, specs):
    """Runs one risky route in this (child) process on each case; prints one
    JSON line per case as soon as it is done (a fault in a later case keeps
    the earlier lines)."""
    for spec in specs:
        print(json.dumps(child_case(mode, spec)), flush=True)


def child_case(mode, spec):
    """One case of a child route: errors against the current route, steady
    times, and the wall time of the first (cold) forward call, of the first
    forward+backward, and of the first forward+backward of a second batch
    with one sequence fewer (what a new batch pays where graphs are built
    per batch shape)."""
    q, k, v, dout, cu, max_len = make_inputs(spec)
    current, _ = seqfuse_call(spec, cu, max_len, "auto")
    ref = outputs(current, q, k, v, dout)
    result = {}
    try:
        fn = CHILD_ROUTES[mode](spec, cu, max_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn(q, k, v)
        torch.cuda.synchronize()
        result["cold_forward_ms"] = (time.perf_counter() - t0) * 1e3
        result["err_forward"] = rel(out, ref[0])
        with torch.no_grad():
            result["forward_ms"] = time_ms(lambda: fn(q, k, v))
    except Exception as e:  # the route refuses the call: say how
        result["error"] = "forward: " + why(e)
        return result
    try:
        t0 = time.perf_counter()
        outputs(fn, q, k, v, dout)
        torch.cuda.synchronize()
        result["cold_forward_backward_ms"] = (time.perf_counter() - t0) * 1e3
        out, grads, _, both_ms = measure(fn, q, k, v, dout, True)
        torch.cuda.synchronize()
        result["forward_backward_ms"] = both_ms
        result["err_grad"] = max(rel(g, r) for g, r in zip(grads, ref[1]))
        cu2, max2 = second_batch(spec, cu)
        t0 = time.perf_counter()  # (the route's per-batch setup included)
        fn2 = CHILD_ROUTES[mode](spec, cu2, max2)
        outputs(fn2, q, k, v, dout)
        torch.cuda.synchronize()
        result["second_batch_cold_forward_backward_ms"] = (time.perf_counter() - t0) * 1e3
    except Exception as e:
        result["error"] = "backward: " + why(e)
    return result


def run_child(mode, specs):
    """[(result dict, None) or (None, why the child failed)] per case: one
    child process runs every case of the route."""
    env = dict(os.environ)
    if mode == "nested":
        env["TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--spec", json.dumps(specs)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        stdout, failure = p.stdout, None
        if p.returncode != 0:
            tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-3:]
            failure = f"child exited {p.returncode}: " + " | ".join(tail)[:400]
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        failure = f"child timed out after {CHILD_TIMEOUT_S} s"
    done = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    return [(done[i], None) if i < len(done) else (None, failure or "child printed no result")
            for i in range(len(specs))]


# ------------------------------------------------------------------ main
def probe_case(spec, children):
    """The rows of one case; ``children``: {mode: (result, failure)} of the
    child routes for this case, run before."""
    import seqfuse
    from seqfuse.ops.attn import _cudnn_ragged as ragged

    q, k, v, dout, cu, max_len = make_inputs(spec)
    t = sum(spec["lengths"])
    log(f"case={spec['name']}  sequences={len(spec['lengths'])}  tokens={t}  max_len={max_len}  heads={spec['h']}/"
        f"{spec['hk']}  d={spec['d']}  causal={spec['causal']}  lengths from {spec['source']}")
    exact_out, exact_grads = float64_reference(spec, q, k, v, dout)
    rows = []

    current, kw = seqfuse_call(spec, cu, max_len, "auto")
    with torch.no_grad():
        forward_route = seqfuse.ops.attention_backend(q, k, v, **kw)[0]
    train_route = seqfuse.ops.attention_backend(q.detach().requires_grad_(), k, v, **kw)[0]
    ref_out, ref_grads, forward_ms, both_ms = measure(current, q, k, v, dout, True)
    _, _, e64, e64g = compare(ref_out, ref_grads, ref_out, ref_grads, exact_out, exact_grads)
    rows.append(row(spec, "current (seqfuse auto)", "ok", forward_ms, both_ms, err64=e64, err64_grad=e64g,
                    note=f"forward-only calls take {forward_route}, training calls {train_route}"))

    def add(route, make, backward=True, note=""):
        try:
            fn = make()
            out, grads, f_ms, b_ms = measure(fn, q, k, v, dout, backward)
        except Exception as e:  # absent or refused: say why, go on
            status = "absent" if isinstance(e, (ImportError, AttributeError)) else "refused"
            rows.append(row(spec, route, f"{status}: {why(e)}"))
            return
        err, err_g, e64, e64g = compare(out, grads, ref_out, ref_grads, exact_out, exact_grads)
        rows.append(row(spec, route, "ok", f_ms, b_ms, err, err_g, e64, e64g, note=note))

    add("seqfuse kernels", lambda: seqfuse_call(spec, cu, max_len, "seqfuse")[0])
    add("torch varlen_attn", lambda: varlen_call(spec, cu, max_len),
        note="FlashAttention-2 (torch 2.11's varlen_attn has its cuDNN branch switched off)")

    # the seqfuse route, forced; forward only where it refuses gradients
    fn = seqfuse_call(spec, cu, max_len, "cudnn_ragged")[0]
    train_refusal = ""
    try:
        seqfuse.ops.attention_backend(q.detach().requires_grad_(), k, v, **kw)
    except NotImplementedError as e:
        train_refusal = str(e).split("cannot run cuDNN's ragged fused attention: ")[-1][:200]
    add("cudnn_ragged (seqfuse route, forced)", lambda: fn, backward=not train_refusal,
        note=f"training calls refused: {train_refusal}" if train_refusal else "")
    seqfuse.ops.set_attention_backend("auto")

    for mode, route in (("direct", "torch aten._cudnn_attention_forward ragged + autograd backward (child)"),
                        ("nested", "nested jagged SDPA on CUDNN_ATTENTION (child, "
                                   "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1)"),
                        ("frontend", "cuDNN frontend torch op cudnn.sdpa_torch (child, nvidia-cudnn-frontend)"),
                        ("frontend_bucketed", "cuDNN frontend torch op, batch size and max_seqlen bucketed (child)"),
                        ("seqfuse_frontend", "cudnn_ragged (seqfuse route, forced, frontend provider; child)"),
                        ("frontend_split", "cuDNN frontend torch op, one call per group of lengths within 2x "
                                           "(child; a batch out of length order permuted inside the call)")):
        if mode == "direct" and not ragged.op_available():
            rows.append(row(spec, route, f"absent: torch {torch.__version__} has no aten._cudnn_attention_forward"))
            continue
        result, failure = children[mode]
        if failure:
            rows.append(row(spec, route, failure if failure.startswith("not run") else f"crashed: {failure}"))
            continue
        error = result.get("error", "")
        status = "ok" if not error else (
            f"absent: {error}" if "ModuleNotFoundError" in error or "ImportError" in error else f"refused: {error}")
        notes = ["k/v heads expanded"] if mode == "nested" and spec["h"] != spec["hk"] else []
        notes += [f"{name} {result[key]:.1f} ms" for name, key in (
            ("first forward", "cold_forward_ms"), ("first forward+backward", "cold_forward_backward_ms"),
            ("a new batch's first forward+backward (its setup included)", "second_batch_cold_forward_backward_ms"))
                  if key in result]
        rows.append(row(spec, route, status, result.get("forward_ms"), result.get("forward_backward_ms"), result.get("err_forward"),
                        result.get("err_grad"), note="; ".join(notes)))

    try:
        fn, shape, tokens = ceiling_call(spec)
        _, _, f_ms, b_ms = measure(fn, q, k, v, dout, True)
        rows.append(row(spec, f"ceiling: cuDNN SDPA bshd {shape} (not the same problem)", "ok", f_ms, b_ms,
                        tokens=tokens))
    except Exception as e:
        rows.append(row(spec, "ceiling: cuDNN SDPA bshd", f"refused: {why(e)}"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows and facts here")
    ap.add_argument("--child", choices=tuple(CHILD_ROUTES), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ragged_probe.py needs a CUDA GPU")
    if args.child:
        return child(args.child, json.loads(args.spec))
    import seqfuse  # noqa: F401  (fails here, not in a child, when the build is missing)
    from seqfuse.ops.attn import _cudnn_ragged as ragged

    start = time.perf_counter()
    facts = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                 device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                 cudnn_attention_forward=ragged.op_available(),
                 ragged_backward_trusted_from=ragged.RAGGED_BACKWARD_FROM)
    try:
        from torch.nn.attention import varlen
        facts["varlen_should_use_cudnn"] = bool(varlen._should_use_cudnn(torch.cuda.current_device()))
    except Exception as e:  # absent in this torch
        facts["varlen_should_use_cudnn"] = f"absent: {why(e)}"
    try:
        import cudnn
        facts["cudnn_frontend"] = f"{cudnn.__version__} (backend {cudnn.backend_version()})"
    except Exception as e:  # not installed: its rows say absent
        facts["cudnn_frontend"] = f"absent: {why(e)}"
    log("  ".join(f"{k}={v}" for k, v in facts.items()))
    rows = []
    specs = cases()
    # the child routes first, while this process holds no GPU memory, one child per route for every case
    children = [{} for _ in specs]
    for mode in CHILD_ROUTES:
        late = time.perf_counter() - start > CHILD_BUDGET_S
        got = [(None, f"not run: the probe's {CHILD_BUDGET_S} s budget for child routes is spent")] * len(specs) \
            if late else run_child(mode, specs)
        for i, one in enumerate(got):
            children[i][mode] = one
    for spec, got in zip(specs, children):
        try:
            rows += probe_case(spec, got)
        except Exception:  # one case failing must not hide the other
            log(f"case={spec['name']} failed:\n{traceback.format_exc()}")
    log(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(facts=facts, environment=environment(), run=run_metadata(), rows=rows), f, indent=1, default=str)


if __name__ == "__main__":
    main()
