"""The routes of ops.attention for the calls the cuDNN route cannot take
(packed thd, padded batches, dropout), timed side by side in one process on
the same inputs: seqfuse's own kernels (SEQFUSE_ATTN_BACKEND=seqfuse), the
flash route (torch's FlashAttention-2 through seqfuse.ops.attention, forced
with set_attention_backend("flash"); python/seqfuse/ops/attn/_torch_routes.py),
and, as the peer ceiling, torch SDPA on cuDNN on the equivalent padding-free
bshd call (the same number of tokens cut into equal sequences of the
token-weighted mean length, sum(len^2) / sum(len), so the same attention
FLOPs per token; where the call has GQA, the MHA call with as many k/v
heads as q heads: the same FLOPs).  Extra rows,
labelled: cuDNN's own ragged (thd) attention reached through
torch.ops.aten._cudnn_attention_forward with cum_seq (a candidate route, not
routed today: recorded with its error where this torch refuses it), and the
peer a Hugging Face user runs on padded batches (SDPA with a key-padding
mask, torch's choice of kernel).

Cases (bf16, forward and forward+backward):
- ESM-2 650M packed: 20 heads x 64, real UniProt lengths (recipes/esm2/data/
  subset, +2 special tokens, clamped to 50..1024; a lognormal fit where the
  data is missing) up to 16k tokens, bidirectional; and the same with
  attention dropout 0.1 (TE's default).
- Llama 3 genomic packed: GQA 32/8 x 128, causal, one 8,192-token window;
  and 4 x 2,048-token windows in one 8,192-token pack.
- ESM-2 padded bshd: 16 rows of the real lengths right-padded to 1024,
  key-padding mask ("padding"); useful FLOPs over the real tokens only.
- Dropout: bshd 16 x 1024, 20 x 64, no mask, p = 0.1; torch's peer also
  runs SDPA with dropout_p = 0.1 (its own choice of kernel).

TFLOP/s = 4 * h * d * sum(len^2) (halved when causal; q heads with GQA),
x3.5 with the backward, over the tokens each call really attends (with a
sliding window: the band's (query, key) pairs, counted exactly);
per_token_ns = time / tokens; vs_ceiling = TFLOP/s / the cuDNN ceiling's
TFLOP/s (the issue's goal is >= 0.95), vs_seqfuse = seqfuse's time / this
time.  Timing: harness.cuda_time_ms (CUDA events, L2 flushed, median of 20 after 5 warm-ups);
``--rounds R`` times each case's rows R times, the order rotated by one row
a round and reversed every other round (so neither the first place nor the
row before is always the same), and keeps the median of each row's rounds
(with their range in ms_min / ms_max); ``--queue N`` times N calls issued
back to back per step, per call (the host's work before a call then
overlaps the GPU's on the call before, as in training).

``--sweep`` replaces the cases by a grid (sweep_case): sequence 512 to
32,768 (``--sweep-seqs`` picks the lengths) x head dims 32 / 64 / 128
(``--sweep-dims``; 2048 / d heads) x full / causal, 16k tokens (32k at
32,768), b = tokens / s rows of s.  Each cell holds a group of rows per
layout, ``--sweep-layouts`` picking them (a comma list; default all; each
JSON row names its ``layout``):
- bshd: the padding-free bshd call in auto against cuDNN SDPA (the
  ceiling) and torch SDPA as a user calls it;
- thd: a packed batch of unequal lengths (uniform in [s/2, 3s/2]) in auto
  against torch's varlen_attn and against cuDNN on the equal-length call of
  the same FLOPs per token;
- padded: b rows right-padded to s, real lengths uniform in [s/2, s], a
  key-padding mask ("padding" / "padding_causal" with per-row cu_seqlens) in
  auto against torch SDPA with the boolean mask a Hugging Face model builds
  (key padding, and causal in causal cells; torch's kernel choice) and the
  cuDNN ceiling on the padding-free equal-length call of the same attention
  FLOPs per real token; FLOPs and tokens over the real tokens only;
- sbhd: the bshd problem in [s, b, h, d] tensors in auto against cuDNN SDPA
  on the same values as bshd (the ceiling);
- window (causal cells): window_size (256, 0) in auto against torch's own
  sliding-window route, varlen_attn (FlashAttention-2) with window_size
  (256, 0) on the same tensors as b sequences of s (SDPA with the banded
  boolean mask where this torch's varlen_attn takes no window); no cuDNN
  route takes a window, so no ceiling: vs_peer is its ratio;
- gqa (causal cells): 2048 / d q heads, a quarter as many k/v heads, in
  auto against cuDNN SDPA with enable_gqa (the ceiling).
Before a cell's padded, sbhd, window and gqa rows are timed, seqfuse's row
and its peer run on the same values (verify): outputs (with and without
autograd) and gradients must agree within ``--check-tol`` (2e-2) of the
peer's largest magnitude (padded: on the real queries); the figures go into
both rows (check_scaled_err, check_scaled_err_grad, check_max_abs_err), and
a layout that disagrees or raises is recorded as error rows, not timed.
Sweep rows take vs_ceiling from their own layout's ceiling only, and vs_peer
(TFLOP/s / the layout's "peer:" row's).  benchmarks/attn/run_sweep_layouts.sh
runs the four new layouts alone at 1,024-8,192 x head dims 64 / 128.

Run on the GPU machine after the build:
    python3 benchmarks/attn/bench_routes.py [--json PATH]
(about 40-60 s on an H200, about R x N times that with --rounds R --queue N;
JSON to benchmarks/results/bench_routes.json and, with --json, a copy at PATH).
The whole --sweep with every layout: about 6 minutes on an H200, estimated
(not measured) from s32's sweep (the four new layouts ~4 minutes of it, the
padded peer, SDPA with a mask over every padded pair, the most at 16k-32k);
with the build, near a device call's 10 minutes: split it with --sweep-seqs
or --sweep-layouts.
"""
import argparse
import contextlib
import inspect
import itertools
import math
import os
import random
import shutil
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: the shared harness

import seqfuse  # noqa: E402
from harness import Table, cuda_time_ms  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
TOKENS = 16384
DT = torch.bfloat16
SWEEP_LAYOUTS = ("bshd", "thd", "padded", "sbhd", "window", "gqa")  # a sweep cell's row groups, in its order
WINDOW_LEFT = 256   # the window layout's window_size (left, 0), causal
GQA_GROUP = 4       # the gqa layout's q heads per k/v head
CHECK_TOL = 2e-2    # a new layout's largest error against its peer, scaled by the peer's largest magnitude


def protein_lengths(rng, tokens=TOKENS, low=50, high=1024):
    """Real UniProt lengths (+2 special tokens, clamped to [low, high]) up to
    ``tokens``, else a lognormal fit (median 345, p90 872); and the source."""
    path = os.path.join(ROOT, "recipes", "esm2", "data", "subset", "train.parquet")
    try:
        import pyarrow.parquet as pq

        seqs = pq.read_table(path, columns=["sequence"]).column("sequence").to_pylist()
        pool = [min(max(len(s) + 2, low), high) for s in seqs]
        source = f"UniProt ({os.path.relpath(path, ROOT)}, {len(pool)} proteins)"
    except Exception as e:  # pyarrow or the data missing: say so, use the fit
        mu, sigma = math.log(345), (math.log(872) - math.log(345)) / 1.2816
        pool = [min(max(int(rng.lognormvariate(mu, sigma)), low), high) for _ in range(20000)]
        source = f"lognormal fit (median 345, p90 872; real data unavailable: {type(e).__name__})"
    lengths = []
    while True:
        n = rng.choice(pool)
        if sum(lengths) + n > tokens:
            return lengths, source
        lengths.append(n)


def band_pairs(n, left=-1, right=-1):
    """The (query, key) pairs n queries over n keys compute under the window
    (left, right) of ops.attention's ``window_size`` (key c seen by query r
    when r - left <= c <= r + right; -1 unbounded): n (L + R + 1) - L (L + 1)
    / 2 - R (R + 1) / 2, with L and R capped at n - 1 (n * n unbounded,
    n (n + 1) / 2 for (-1, 0))."""
    if n <= 0:
        return 0
    lo = n - 1 if left < 0 else min(left, n - 1)
    hi = n - 1 if right < 0 else min(right, n - 1)
    return n * (lo + hi + 1) - lo * (lo + 1) // 2 - hi * (hi + 1) // 2


def attention_pairs(lengths, causal, window=None):
    """The (query, key) pairs the FLOPs count over sequences of ``lengths``:
    sum(len^2), halved when causal (the convention of every row without a
    window); with a bounded window (the window layout: (left, 0), causal) the
    band's pairs exactly (band_pairs, the right edge 0 when causal)."""
    left, right = (-1, -1) if window is None else window
    if left < 0 and (right < 0 or causal):
        return sum(n * n for n in lengths) * (0.5 if causal else 1.0)
    return float(sum(band_pairs(n, left, 0 if causal else right) for n in lengths))


def flops(lengths, h, d, causal, backward, window=None):
    return 4.0 * h * d * attention_pairs(lengths, causal, window) * (3.5 if backward else 1.0)


def timed(fn, inputs, dout, backward, queue=1):
    """Median ms of fn(*inputs) (no grad), or of its forward + backward
    (torch.autograd.grad, so nothing accumulates between repeats).  With
    ``queue`` > 1 each timed step issues that many calls back to back (after
    one L2 flush) and the figure is per call: the host's work before a
    call's first kernel then overlaps the GPU's work on the call before it,
    as in a training step, instead of adding to a call timed alone."""
    if not backward:
        def one():
            with torch.no_grad():
                fn(*inputs)
    else:
        xs = [x.detach().requires_grad_() for x in inputs]

        def one():
            out = fn(*xs)
            torch.autograd.grad(out, xs, dout)

    def step():
        for _ in range(queue):
            one()
    return cuda_time_ms(step) / queue


def via_ops(**kw):
    """seqfuse.ops.attention with these keywords (run_case sets the backend)."""
    def call(q, k, v):
        return seqfuse.ops.attention(q, k, v, **kw)
    return call


def sdpa_bshd(causal=False, p=0.0, backends=None):
    """torch SDPA on [b, s, h, d] tensors (bshd views, fewer k/v heads through
    enable_gqa), with attention dropout ``p``; ``backends`` restricts the
    kernel (sdpa_kernel), None leaves torch's choice with no context, as a
    user calls it."""
    def call(q, k, v):
        gqa = {"enable_gqa": True} if q.shape[-2] != k.shape[-2] else {}
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  dropout_p=p, is_causal=causal, **gqa).transpose(1, 2)
    return call


def cudnn_ceiling(causal):
    """torch SDPA restricted to cuDNN (the ceiling every row is set against)."""
    return sdpa_bshd(causal, backends=[SDPBackend.CUDNN_ATTENTION])


def cudnn_ragged(cu, max_len, causal):
    """cuDNN's ragged attention through torch's private op (a candidate)."""
    def call(q, k, v):
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, causal,
                                                       False)[0]
    return call


def sdpa_bool_mask(mask):
    """torch SDPA on bshd tensors with a boolean attn_mask (True: attend)
    broadcast to [b, h, s, s], torch's choice of kernel, no sdpa_kernel
    context (as a user calls it)."""
    def call(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)
    return call


def sdpa_padded_mask(keep):
    """torch SDPA with a key-padding mask, torch's choice of kernel (how
    Hugging Face's sdpa attention runs a padded batch)."""
    return sdpa_bool_mask(keep[:, None, None, :])


def key_padding_keep(lengths, s, device=None):
    """bool [b, s]: True on each row's first ``lengths[i]`` positions (right
    padding to s)."""
    return torch.arange(s, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def padding_mask(keep, causal):
    """The boolean attn_mask a Hugging Face model hands SDPA for a right-padded
    batch: key j visible when keep[b, j] ([b, 1, 1, s]), and, when causal,
    also j <= i ([b, 1, s, s]; SDPA takes no is_causal beside a mask)."""
    mask = keep[:, None, None, :]
    if causal:
        s = keep.shape[1]
        mask = mask & torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
    return mask


def banded_mask(s, left, right=0, device=None):
    """bool [s, s]: query i sees key j when i - left <= j <= i + right
    (-1 unbounded), seqfuse's window rule (csrc/attn/attn.h
    sf_attn_allowed, equal lengths)."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    mask = torch.ones(s, s, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def padded_lengths(s, b, rng):
    """The padded layout's real lengths: b rows, each uniform in [s/2, s]
    (the batch right-padded to s)."""
    return [rng.randint(max(1, s // 2), s) for _ in range(b)]


def varlen_has_window():
    """Whether this torch's varlen_attn exists and takes ``window_size``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "window_size" in inspect.signature(varlen_attn).parameters


def torch_varlen_window(cu, max_len, window):
    """torch's varlen_attn (FlashAttention-2) with a (left, right) window,
    on [t, h, d] tensors."""
    from torch.nn.attention.varlen import varlen_attn

    def call(q, k, v):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=tuple(window))
    return call


def cudnn_padded_mask(keep, as_bias):
    """torch SDPA restricted to cuDNN with the key-padding mask as attn_mask
    (a candidate route for padded batches): boolean, or as an additive bias
    (0 / -inf) of shape [b, 1, 1, s]."""
    mask = keep[:, None, None, :]
    if as_bias:
        mask = torch.zeros(mask.shape, device=keep.device, dtype=DT).masked_fill(~mask, float("-inf"))

    def call(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=mask).transpose(1, 2)
    return call


class Case:
    """One problem: its name, its rows' callables and inputs, and the FLOPs
    and tokens each row really computes.  A row's ``meta`` holds the fields
    it adds to its JSON row (the sweep's ``layout``; ``heads`` where they
    differ from the case's; ``window``, which the FLOPs count; the check's
    figures), and ``checks`` the output checks run_case makes before timing
    (verify)."""

    def __init__(self, name, lengths, h, hk, d, causal):
        self.name, self.lengths, self.h, self.hk, self.d, self.causal = name, lengths, h, hk, d, causal
        self.rows = []  # (label, callable or None, inputs, dout, flop lengths, error, meta)
        self.checks = []  # dicts: layout, ours, peer (row labels), ours_view, peer_view, keep (verify)

    def add(self, label, fn, inputs, flop_lengths, error=None, **meta):
        dout = torch.randn_like(inputs[0]) if fn is not None else None
        self.rows.append((label, fn, inputs, dout, flop_lengths, error,
                          {k: v for k, v in meta.items() if v is not None}))


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=DT)


def thd_inputs(lengths, h, hk, d, causal, dropout=0.0):
    """q, k, v packed [t, heads, d], the cu_seqlens and ops.attention's
    keywords for the packed batch of ``lengths``."""
    t = sum(lengths)
    q, k, v = _rand(t, h, d), _rand(t, hk, d), _rand(t, hk, d)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=q.device)
    kw = dict(qkv_format="thd", attn_mask_type="padding_causal" if causal else "padding", cu_seqlens_q=cu,
              cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths), dropout_p=dropout)
    return q, k, v, cu, kw


def add_thd_ceiling(case, lengths, h, hk, d, causal, note="", layout=None):
    """The ceiling of a packed batch: the same tokens as padding-free bshd in
    equal sequences of the token-weighted mean length sum(len^2) / sum(len)
    (so the same attention FLOPs per token), rounded to 64, on cuDNN SDPA;
    without dropout (a dropout row's ceiling is the call it would be
    without it); GQA's FLOPs are MHA's.  (The padded layout's ceiling too:
    ``lengths`` its rows' real lengths.)"""
    t = sum(lengths)
    s = max(64, round(sum(n * n for n in lengths) / t / 64) * 64)
    b = max(1, t // s)
    qc, kc, vc = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    case.add(f"ceiling: cuDNN SDPA bshd {b} x {s}" + (f" (MHA, {h} k/v heads)" if hk != h else "") + note,
             cudnn_ceiling(causal), (qc, kc, vc), [s] * b, layout=layout)


def packed_case(name, lengths, h, hk, d, causal, dropout=0.0):
    case = Case(name, lengths, h, hk, d, causal)
    q, k, v, cu, kw = thd_inputs(lengths, h, hk, d, causal, dropout)
    for backend in ("seqfuse", "flash"):
        case.add(f"{backend} thd", via_ops(**kw), (q, k, v), lengths)
    if dropout == 0.0:
        case.add("cuDNN ragged thd (candidate, aten._cudnn_attention_forward)", cudnn_ragged(cu, max(lengths), causal),
                 (q, k, v), lengths)
    add_thd_ceiling(case, lengths, h, hk, d, causal)
    return case


def padded_case(name, lengths, s, h, d):
    case = Case(name, lengths, h, h, d, False)
    b = len(lengths)
    q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    kw = dict(qkv_format="bshd", attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    for backend in ("seqfuse", "flash"):
        case.add(f"{backend} bshd padding", via_ops(**kw), (q, k, v), lengths)
    keep = torch.arange(s, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
    case.add("peer: SDPA with a key-padding mask (torch's kernel choice)", sdpa_padded_mask(keep), (q, k, v),
             lengths)
    for as_bias in (False, True):
        case.add(f"candidate: cuDNN SDPA, key-padding mask as {'a bias' if as_bias else 'bool'} attn_mask",
                 cudnn_padded_mask(keep, as_bias), (q, k, v), lengths)
    case.add(f"ceiling: cuDNN SDPA bshd {b} x {s} (no padding)", cudnn_ceiling(False), (q, k, v), [s] * b)
    return case


def dropout_case(name, b, s, h, d, p, hk=None, causal=False):
    hk = hk or h
    case = Case(name, [s] * b, h, hk, d, causal)
    q, k, v = _rand(b, s, h, d), _rand(b, s, hk, d), _rand(b, s, hk, d)
    mask = "causal" if causal else "no_mask"
    for backend in ("seqfuse", "flash", "auto"):
        case.add(f"{backend} bshd dropout {p}", via_ops(dropout_p=p, attn_mask_type=mask), (q, k, v), [s] * b)
    case.add(f"peer: SDPA dropout_p={p} (torch's kernel choice)", sdpa_bshd(causal, p), (q, k, v),
             [s] * b)
    case.add(f"candidate: cuDNN SDPA dropout_p={p}", sdpa_bshd(causal, p, [SDPBackend.CUDNN_ATTENTION]),
             (q, k, v), [s] * b)
    qc = q if hk == h else _rand(b, s, h, d)
    kc, vc = (k, v) if hk == h else (_rand(b, s, h, d), _rand(b, s, h, d))
    case.add(f"ceiling: cuDNN SDPA bshd {b} x {s} (no dropout)" + (f" (MHA, {h} k/v heads)" if hk != h else ""),
             cudnn_ceiling(causal), (qc, kc, vc), [s] * b)
    return case


def torch_varlen(cu, max_len, causal):
    """torch's own variable-length attention (torch.nn.attention.varlen.varlen_attn:
    FlashAttention-2 on torch 2.11), the peer for packed batches."""
    from torch.nn.attention.varlen import varlen_attn  # ImportError: this torch has none (the row records it)

    window = (-1, 0) if causal else (-1, -1)

    def call(q, k, v):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window)
    return call


def sweep_lengths(s, tokens, rng):
    """Sequence lengths drawn uniformly from [s/2, 3s/2] until they hold
    exactly ``tokens`` tokens (the last one cut to fit)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(max(1, s // 2), s + s // 2), tokens - sum(lengths)))
    return lengths


def with_ceilings(rows, figures):
    """Each row's ratio to its layout's ceiling: sets ``vs_ceiling`` where
    both were timed.  A row without a ``layout`` (the cases) takes the first
    ceiling row at or after it (a case lists its routes, then their
    ceiling); a sweep row takes the first ceiling row of its own layout at or
    after it, else the last one before it (bshd lists torch's default SDPA
    after its ceiling), never another layout's; a layout without a ceiling
    row (window) has no ratio.  A sweep row also gets ``vs_peer``, its ratio
    to its layout's first timed "peer:" row.  ``figures``: route -> (ms,
    TFLOP/s)."""
    for i, row in enumerate(rows):
        layout = row.get("layout")
        if layout is None:
            ceiling = next((figures.get(r["route"]) for r in rows[i:] if r["route"].startswith("ceiling")), None)
        else:
            mine = [j for j, r in enumerate(rows) if r.get("layout") == layout]
            ceilings = [j for j in mine if rows[j]["route"].startswith("ceiling")]
            pick = next((j for j in ceilings if j >= i), ceilings[-1] if ceilings else None)
            ceiling = None if pick is None else figures.get(rows[pick]["route"])
            peer = next((figures[rows[j]["route"]] for j in mine
                         if rows[j]["route"].startswith("peer") and rows[j]["route"] in figures), None)
            if "tflops" in row and peer:
                row["vs_peer"] = row["tflops"] / peer[1]
        if "tflops" in row and ceiling:
            row["vs_ceiling"] = row["tflops"] / ceiling[1]


def add_padded(case, s, b, h, d, causal, rng):
    """The padded layout: b rows right-padded to s, real lengths uniform in
    [s/2, s] (padded_lengths), a key-padding mask; ops.attention in auto
    ("padding" / "padding_causal" with per-row cu_seqlens), torch SDPA with
    the boolean mask a Hugging Face model builds (torch's kernel choice),
    and the cuDNN ceiling on the padding-free equal-length call of the same
    attention FLOPs per real token (add_thd_ceiling).  FLOPs and tokens:
    the real tokens only.  Checked on the real queries (padding queries:
    seqfuse writes 0, SDPA attends the real keys)."""
    lengths = padded_lengths(s, b, rng)
    q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=q.device)
    kw = dict(qkv_format="bshd", attn_mask_type="padding_causal" if causal else "padding", cu_seqlens_q=cu,
              cu_seqlens_kv=cu)
    keep = key_padding_keep(lengths, s, q.device)
    ours = f"auto bshd padded {b} x {s}, key-padding mask"
    peer = f"peer: torch SDPA, key-padding{' + causal' if causal else ''} bool mask (torch's kernel choice)"
    case.add(ours, via_ops(**kw), (q, k, v), lengths, layout="padded")
    case.add(peer, sdpa_bool_mask(padding_mask(keep, causal)), (q, k, v), lengths, layout="padded")
    add_thd_ceiling(case, lengths, h, h, d, causal, note=" (padded's FLOPs per real token)", layout="padded")
    case.checks.append(dict(layout="padded", ours=ours, peer=peer, keep=keep))


def add_sbhd(case, s, b, h, d, causal):
    """The sbhd layout: the padding-free problem of the bshd rows in [s, b,
    h, d] tensors through ops.attention in auto, against cuDNN SDPA on the
    same values as bshd (the ceiling)."""
    qs, ks, vs = _rand(s, b, h, d), _rand(s, b, h, d), _rand(s, b, h, d)
    ours, peer = "auto sbhd", f"ceiling: cuDNN SDPA bshd {b} x {s} (sbhd's values as bshd)"
    case.add(ours, via_ops(qkv_format="sbhd", attn_mask_type="causal" if causal else "no_mask"), (qs, ks, vs),
             [s] * b, layout="sbhd")
    case.add(peer, cudnn_ceiling(causal), tuple(x.transpose(0, 1).contiguous() for x in (qs, ks, vs)), [s] * b,
             layout="sbhd")
    case.checks.append(dict(layout="sbhd", ours=ours, peer=peer, ours_view=lambda x: x.transpose(0, 1)))


def add_window(case, s, b, h, d, left=WINDOW_LEFT):
    """The window layout (causal cells): bshd with window_size (left, 0) and
    a causal mask through ops.attention in auto, against torch's own
    sliding-window route: varlen_attn (FlashAttention-2) with window_size
    (left, 0) on the same tensors as [b * s, h, d] with cu_seqlens of b
    sequences of s, or where this torch's varlen_attn has no window, SDPA
    with the banded boolean mask (torch's kernel choice, every pair
    computed).  No ceiling (no cuDNN route takes a window).  FLOPs: the
    band's pairs (attention_pairs)."""
    window = (left, 0)
    q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    ours = f"auto bshd window {window}"
    case.add(ours, via_ops(attn_mask_type="causal", window_size=window), (q, k, v), [s] * b, layout="window",
             window=window)
    if varlen_has_window():
        peer = f"peer: torch varlen_attn window {window} (bshd as thd)"
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
        flat = tuple(x.view(b * s, *x.shape[2:]) for x in (q, k, v))
        case.add(peer, torch_varlen_window(cu, s, window), flat, [s] * b, layout="window", window=window)
        case.checks.append(dict(layout="window", ours=ours, peer=peer,
                                peer_view=lambda x: x.reshape(b, s, *x.shape[1:])))
    else:
        peer = "peer: torch SDPA, banded bool mask (torch's kernel choice; no varlen_attn window here)"
        case.add(peer, sdpa_bool_mask(banded_mask(s, left, 0, q.device)), (q, k, v), [s] * b, layout="window",
                 window=window)
        case.checks.append(dict(layout="window", ours=ours, peer=peer))


def add_gqa(case, s, b, h, d, group=GQA_GROUP):
    """The gqa layout (causal cells): h q heads, h / group k/v heads, bshd
    causal through ops.attention in auto, against cuDNN SDPA with
    enable_gqa on the same tensors (the ceiling).  FLOPs: the q heads'."""
    hk = h // group
    q, k, v = _rand(b, s, h, d), _rand(b, s, hk, d), _rand(b, s, hk, d)
    ours, peer = f"auto bshd GQA {h}/{hk}", f"ceiling: cuDNN SDPA bshd {b} x {s}, enable_gqa ({h}/{hk} heads)"
    case.add(ours, via_ops(attn_mask_type="causal"), (q, k, v), [s] * b, layout="gqa", heads=f"{h}/{hk}")
    case.add(peer, cudnn_ceiling(True), (q, k, v), [s] * b, layout="gqa", heads=f"{h}/{hk}")
    case.checks.append(dict(layout="gqa", ours=ours, peer=peer))


def sweep_case(s, d, causal, tokens=TOKENS, rng=None, thd=True, layouts=None):
    """One cell of the sweep: ``tokens`` tokens (at least one sequence of s)
    in 2048 / d heads of d (the same h * d at every head dim), as the row
    groups ``layouts`` names (SWEEP_LAYOUTS; None: bshd, and thd unless
    ``thd`` is False), in this order:
    - bshd: the padding-free bshd call [tokens / s, s] through ops.attention
      in auto (cuDNN on an H200) and torch SDPA on cuDNN (the ceiling);
      beside the ceiling, torch SDPA as a user calls it (torch's choice of
      kernel, no sdpa_kernel context: its host work is the least of the three);
    - thd: a packed thd batch of the same tokens in sequences of unequal
      lengths (uniform in [s/2, 3s/2], the last one filling up), through
      ops.attention in auto (the flash route on an H200) and through torch's
      varlen_attn; its ceiling is cuDNN on [b', L] with L the token-weighted
      mean length (the same attention FLOPs per token), as packed_case;
    - padded (add_padded), sbhd (add_sbhd), and in causal cells only window
      (add_window) and gqa (add_gqa): each checked against its peer before
      it is timed (verify).
    Each row's ``layout`` names its group (vs_ceiling within it)."""
    layouts = layouts or (("bshd", "thd") if thd else ("bshd",))
    rng = rng or random.Random(s * 1000 + d)
    h = 2048 // d
    tokens = max(tokens, s)
    b = tokens // s
    name = f"sweep s {s} d {d} {'causal' if causal else 'full'}"
    case = Case(name, [s] * b, h, h, d, causal)
    if "bshd" in layouts:
        q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
        case.add("auto bshd", via_ops(attn_mask_type="causal" if causal else "no_mask"), (q, k, v), [s] * b,
                 layout="bshd")
        case.add(f"ceiling: cuDNN SDPA bshd {b} x {s}", cudnn_ceiling(causal), (q, k, v), [s] * b, layout="bshd")
        case.add("peer: torch SDPA default bshd", sdpa_bshd(causal), (q, k, v), [s] * b, layout="bshd")
    if "thd" in layouts:
        lengths = sweep_lengths(s, tokens, rng)
        qt, kt, vt, cu, kw = thd_inputs(lengths, h, h, d, causal)
        case.add(f"auto thd, {len(lengths)} unequal lengths", via_ops(**kw), (qt, kt, vt), lengths, layout="thd")
        try:
            case.add("peer: torch varlen_attn thd", torch_varlen(cu, max(lengths), causal), (qt, kt, vt), lengths,
                     layout="thd")
        except ImportError as e:
            case.add("peer: torch varlen_attn thd", None, (qt, kt, vt), lengths, error=str(e), layout="thd")
        add_thd_ceiling(case, lengths, h, h, d, causal, note=" (thd's FLOPs per token)", layout="thd")
    if "padded" in layouts:  # its own seed: the same lengths whichever layouts run beside it
        add_padded(case, s, b, h, d, causal, random.Random(f"padded {s} {d}"))
    if "sbhd" in layouts:
        add_sbhd(case, s, b, h, d, causal)
    if "window" in layouts and causal:
        add_window(case, s, b, h, d)
    if "gqa" in layouts and causal:
        add_gqa(case, s, b, h, d)
    return case


@contextlib.contextmanager
def row_backend(label):
    """The attention backend a row's label names ("seqfuse", "flash" or
    "auto" as its first word) for the body, the current one put back after."""
    was = seqfuse.ops.attn._routing._read_backend()
    backend = label.split(" ")[0]
    if backend in ("seqfuse", "flash", "auto"):
        seqfuse.ops.set_attention_backend(backend)
    try:
        yield
    finally:
        seqfuse.ops.set_attention_backend(was)


def scaled_error(ours, ref):
    """(max |ours - ref|, that / max |ref|) in float32; NaN where either
    holds a NaN (never within a tolerance), 0 / 0 read as 0."""
    diff = (ours.float() - ref.float()).abs().max().item() if ours.numel() else 0.0
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    if diff != diff or scale != scale:
        return float("nan"), float("nan")
    return diff, (diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))


def _outputs(fn, inputs, view, weight_of):
    """fn's output on ``inputs`` under autograd (as view() maps it to the
    check's common layout), its output without grad, and the gradients of
    sum(output * w) for the inputs (mapped the same way); w =
    weight_of(common output)."""
    xs = [x.detach().requires_grad_() for x in inputs]
    with torch.enable_grad():
        out = view(fn(*xs))
        grads = torch.autograd.grad((out.float() * weight_of(out)).sum(), xs)
    with torch.no_grad():
        plain = view(fn(*inputs))
    return out.detach(), plain, [view(g) for g in grads]


def verify(case, tol=CHECK_TOL):
    """Each of ``case.checks`` before any timing: the seqfuse row ("ours")
    and its peer row on their inputs (the same values), their outputs (with
    and without autograd: the forward+backward and forward timings may take
    different routes) and the gradients of sum(out * w) for one random w (0
    on padding queries) compared in a common layout (``ours_view`` /
    ``peer_view``: the rows' tensors to it; ``keep``: bool [b, s], the
    outputs compared on the real queries only).  Both rows record the
    figures (check_max_abs_err and check_scaled_err of the outputs,
    check_scaled_err_grad the worst of dq, dk, dv, scaled by the peer's
    largest magnitude; check_against).  Where a scaled error is over ``tol``
    or either row raises, every row of the layout becomes an error row
    (not timed) with the reason."""
    index = {row[0]: i for i, row in enumerate(case.rows)}
    for check in case.checks:
        i, j = index[check["ours"]], index[check["peer"]]
        keep = check.get("keep")
        weights = {}

        def weight_of(out):  # one w for both rows, 0 on padding queries
            if "w" not in weights:
                gen = torch.Generator(device=out.device).manual_seed(0)
                w = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32)
                weights["w"] = w if keep is None else w * keep[:, :, None, None]
            return weights["w"]

        results, failure = {}, None
        for which, r, view in (("ours", i, check.get("ours_view")), ("peer", j, check.get("peer_view"))):
            label, fn, inputs = case.rows[r][:3]
            if fn is None:
                failure = f"not checked: {label} could not be made ({case.rows[r][5]})"
                break
            try:
                with row_backend(label):
                    results[which] = _outputs(fn, inputs, view or (lambda x: x), weight_of)
            except Exception as e:  # recorded, not hidden: the layout is not timed
                failure = f"not checked: {label} raised {type(e).__name__}: " + \
                    (str(e).strip().splitlines() or [""])[0][:300]
                break
        figures = {}
        if failure is None:
            (out, plain, grads), (ref, _, ref_grads) = results["ours"], results["peer"]
            pick = (lambda x: x[keep]) if keep is not None else (lambda x: x)
            errs = [scaled_error(pick(o), pick(ref)) for o in (out, plain)]
            worst = max(errs, key=lambda e: e[1] if e[1] == e[1] else float("inf"))
            grad_err = max((scaled_error(g, rg)[1] for g, rg in zip(grads, ref_grads)),
                           key=lambda e: e if e == e else float("inf"))
            figures = dict(check_max_abs_err=worst[0], check_scaled_err=worst[1], check_scaled_err_grad=grad_err)
            if not (worst[1] <= tol and grad_err <= tol):
                failure = f"outputs disagree with {case.rows[j][0]}: scaled max error {worst[1]:.3g} " \
                          f"(gradients {grad_err:.3g}) over {tol:g}: not timed"
        for r, other in ((i, j), (j, i)):
            case.rows[r][6].update(figures, check_against=case.rows[other][0])
        if failure is not None:
            for r, row in enumerate(case.rows):
                if row[6].get("layout") == check["layout"]:
                    label, _, inputs, _, flop_lengths, error, meta = row
                    case.rows[r] = (label, None, inputs, None, flop_lengths, error or failure, meta)
    if case.checks and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(table, case, rounds=1, queue=1, tol=CHECK_TOL):
    """Every row of ``case`` forward, then forward+backward, after the
    case's output checks (verify, within ``tol``: a layout that fails is
    recorded as error rows, not timed).  With ``rounds``
    > 1 each direction times the rows ``rounds`` times, the order rotated by
    one row a round and reversed in every other round, and a row's ms is the
    median of its rounds, with the rounds' range (ms_min, ms_max) beside it.
    A row that raises in a direction keeps that error for the direction (its
    earlier rounds dropped) and is not timed again in it.  A row's meta
    (Case) joins its JSON row; its ``window`` counts in its FLOPs."""
    verify(case, tol)
    n = len(case.rows)
    for backward in (False, True):
        times, errors = [[] for _ in range(n)], [None] * n
        for r in range(rounds):
            order = [(j + r) % n for j in range(n)]
            for i in (order if r % 2 == 0 else order[::-1]):
                label, fn, inputs, dout = case.rows[i][:4]
                if fn is None or errors[i] is not None:
                    continue
                with row_backend(label):
                    try:
                        times[i].append(timed(fn, inputs, dout, backward, queue))
                    except (RuntimeError, NotImplementedError) as e:  # recorded, not hidden
                        errors[i] = str(e).strip().splitlines()[0][:300]
        figures = {}
        for i, (label, fn, inputs, dout, flop_lengths, error, meta) in enumerate(case.rows):
            row = dict(case=case.name, direction="forward+backward" if backward else "forward", route=label,
                       heads=f"{case.h}/{case.hk}", head_dim=case.d, causal=case.causal,
                       tokens=sum(flop_lengths), sequences=len(flop_lengths))
            row.update(meta)
            if fn is None or errors[i] is not None:  # a row that could not be made or run (its error recorded)
                row["error"] = error if fn is None else errors[i]
                table.add(**row)
                continue
            ms = statistics.median(times[i])
            tflops = flops(flop_lengths, case.h, case.d, case.causal, backward, meta.get("window")) / ms / 1e9
            figures[label] = (ms, tflops)
            row.update(ms=ms, tflops=tflops, per_token_ns=ms * 1e6 / sum(flop_lengths))
            if rounds > 1:
                row.update(ms_min=min(times[i]), ms_max=max(times[i]), rounds=len(times[i]))
            if queue > 1:
                row["queue"] = queue
            table.add(**row)
        ours = next((v for k, v in figures.items() if k.startswith("seqfuse")), None)
        rows = table.rows[-n:]
        with_ceilings(rows, figures)
        for row in rows:
            if "ms" in row and ours:
                row["vs_seqfuse"] = ours[0] / row["ms"]
    torch.cuda.empty_cache()


def positive_int(text):
    """argparse type: an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def layout_list(text):
    """argparse type of --sweep-layouts: a comma list of SWEEP_LAYOUTS names
    and "all" (every one), as a tuple in the sweep's order."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no layout named")
    for name in names:
        if name != "all" and name not in SWEEP_LAYOUTS:
            raise argparse.ArgumentTypeError(f"unknown layout {name!r} (all, {', '.join(SWEEP_LAYOUTS)})")
    return tuple(x for x in SWEEP_LAYOUTS if x in names or "all" in names)


def head_dims(text):
    """argparse type of --sweep-dims: a comma list of head dims, each
    dividing 2048 (the sweep's h * d) into at least GQA_GROUP heads."""
    dims = [int(t) for t in text.split(",") if t.strip()]
    if not dims or any(d < 1 or 2048 % d or 2048 // d < GQA_GROUP for d in dims):
        raise argparse.ArgumentTypeError(f"head dims must divide 2048 into at least {GQA_GROUP} heads, got {text!r}")
    return dims


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also copy the JSON here")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--out", default="bench_routes", help="result name (benchmarks/results/OUT.json)")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of the cases: sequence 512 to 32k x head dims 32 / 64 / 128 x full / causal, "
                             "the layouts --sweep-layouts names in auto against cuDNN and torch's peers (sweep_case)")
    parser.add_argument("--sweep-layouts", type=layout_list, default=SWEEP_LAYOUTS, metavar="LIST",
                        help="with --sweep: the row groups of each cell, a comma list of "
                             f"{', '.join(SWEEP_LAYOUTS)} or all (the default): bshd padding-free, thd packed "
                             "unequal lengths, padded bshd with a key-padding mask, sbhd padding-free, window "
                             f"({WINDOW_LEFT}, 0) and gqa (k/v heads = q heads / {GQA_GROUP}), the last two in "
                             "causal cells only (sweep_case)")
    parser.add_argument("--sweep-seqs", default="512,1024,2048,4096,8192,16384,32768",
                        help="with --sweep: the sequence lengths (comma-separated)")
    parser.add_argument("--sweep-dims", type=head_dims, default=[32, 64, 128], metavar="LIST",
                        help="with --sweep: the head dims (comma-separated, each dividing 2048 into at least "
                             f"{GQA_GROUP} heads; default 32,64,128)")
    parser.add_argument("--check-tol", type=float, default=CHECK_TOL,
                        help="the new layouts' largest error against their peer before timing, scaled by the "
                             "peer's largest magnitude (verify; default %(default)g)")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="time each case's rows this many times in rotated order, the median kept (run_case)")
    parser.add_argument("--queue", type=positive_int, default=1,
                        help="calls issued back to back in each timed step, the figure per call (timed)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_routes: needs a CUDA GPU")
    torch.manual_seed(0)
    rng = random.Random(0)
    lengths, source = protein_lengths(rng)
    table = Table(args.out, ["case", "direction", "route", "layout", "ms", "ms_min", "ms_max", "tflops",
                             "per_token_ns", "vs_ceiling", "vs_peer", "vs_seqfuse", "check_scaled_err",
                             "check_scaled_err_grad", "error"])
    cases = [
        lambda: packed_case("ESM-2 650M packed", lengths, 20, 20, 64, False),
        lambda: packed_case("ESM-2 650M packed, dropout 0.1", lengths, 20, 20, 64, False, dropout=0.1),
        lambda: packed_case("Llama GQA 32/8 x 128 causal, 1 x 8192", [8192], 32, 8, 128, True),
        lambda: packed_case("Llama GQA 32/8 x 128 causal, 4 x 2048", [2048] * 4, 32, 8, 128, True),
        lambda: padded_case("ESM-2 650M padded bshd 16 x 1024", lengths[:16], 1024, 20, 64),
        lambda: dropout_case("ESM-2 650M bshd dropout", 16, 1024, 20, 64, 0.1),
        lambda: dropout_case("ESM-2 150M bshd dropout (d 32)", 16, 1024, 20, 32, 0.1),
        lambda: dropout_case("ESM-2 8M bshd dropout (d 16)", 16, 1024, 20, 16, 0.1),
        lambda: dropout_case("TE default layer, 16 heads of 128, dropout", 4, 2048, 16, 128, 0.1),
        lambda: dropout_case("Llama GQA 32/8 x 64 causal dropout, 4 x 4096", 4, 4096, 32, 64, 0.1, hk=8, causal=True),
    ]
    if args.sweep:
        cases = [lambda s=s, d=d, c=c: sweep_case(s, d, c, layouts=args.sweep_layouts)
                 for s in map(int, args.sweep_seqs.split(",")) for d in args.sweep_dims for c in (False, True)]
    interrupted = False
    try:
        for make in cases:
            case = make()
            if args.only in case.name and case.rows:  # (a full cell of window / gqa alone has none)
                run_case(table, case, args.rounds, args.queue, args.check_tol)
    except KeyboardInterrupt:  # (timeout -s INT) the rows so far are saved, marked
        interrupted = True
    extra = {"protein_lengths_source": source, "protein_sequences": len(lengths), "protein_tokens": sum(lengths),
             "protein_max_len": max(lengths), "command": " ".join([sys.executable] + sys.argv),
             "flash_route": "seqfuse.ops.attention with set_attention_backend('flash')", "interrupted": interrupted,
             "check_tol": args.check_tol}
    if args.sweep:
        extra.update(sweep_layouts=list(args.sweep_layouts), window_size=[WINDOW_LEFT, 0], gqa_group=GQA_GROUP,
                     varlen_attn_window=varlen_has_window())
    path = table.save(extra)
    if args.json:
        shutil.copyfile(path, args.json)


if __name__ == "__main__":
    main()
