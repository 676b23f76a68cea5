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

TFLOP/s = 4 * h * d * sum(len^2) (halved when causal), x3.5 with the
backward, over the tokens each call really attends; per_token_ns = time /
tokens; vs_ceiling = TFLOP/s / the cuDNN ceiling's TFLOP/s (the issue's goal
is >= 0.95), vs_seqfuse = seqfuse's time / this time.  Timing: harness.
cuda_time_ms (CUDA events, L2 flushed, median of 20 after 5 warm-ups);
``--rounds R`` times each case's rows R times, the order rotated by one row
a round and reversed every other round (so neither the first place nor the
row before is always the same), and keeps the median of each row's rounds
(with their range in ms_min / ms_max); ``--queue N`` times N calls issued
back to back per step, per call (the host's work before a call then
overlaps the GPU's on the call before, as in training).

``--sweep`` replaces the cases by a grid (sweep_case): sequence 512 to
32,768 (``--sweep-seqs`` picks the lengths) x head dims 32 / 64 / 128
(2048 / d heads) x full / causal, 16k
tokens (32k at 32,768), each as a padding-free bshd call in auto against
cuDNN SDPA, and as a packed thd batch of unequal lengths (uniform in
[s/2, 3s/2]) in auto against torch's varlen_attn and against cuDNN on the
equal-length call of the same FLOPs per token.

Run on the GPU machine after the build:
    python3 benchmarks/attn/bench_routes.py [--json PATH]
(about 40-60 s on an H200, about R x N times that with --rounds R --queue N;
JSON to benchmarks/results/bench_routes.json and, with --json, a copy at PATH).
"""
import argparse
import contextlib
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


def flops(lengths, h, d, causal, backward):
    return 4.0 * h * d * sum(n * n for n in lengths) * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)


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


def sdpa_padded_mask(keep):
    """torch SDPA with a key-padding mask, torch's choice of kernel (how
    Hugging Face's sdpa attention runs a padded batch)."""
    mask = keep[:, None, None, :]

    def call(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask).transpose(1, 2)
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
    and tokens each row really computes."""

    def __init__(self, name, lengths, h, hk, d, causal):
        self.name, self.lengths, self.h, self.hk, self.d, self.causal = name, lengths, h, hk, d, causal
        self.rows = []  # (label, callable or None, inputs, dout, flop lengths, error)

    def add(self, label, fn, inputs, flop_lengths, error=None):
        dout = torch.randn_like(inputs[0]) if fn is not None else None
        self.rows.append((label, fn, inputs, dout, flop_lengths, error))


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


def add_thd_ceiling(case, lengths, h, hk, d, causal, note=""):
    """The ceiling of a packed batch: the same tokens as padding-free bshd in
    equal sequences of the token-weighted mean length sum(len^2) / sum(len)
    (so the same attention FLOPs per token), rounded to 64, on cuDNN SDPA;
    without dropout (a dropout row's ceiling is the call it would be
    without it); GQA's FLOPs are MHA's."""
    t = sum(lengths)
    s = max(64, round(sum(n * n for n in lengths) / t / 64) * 64)
    b = max(1, t // s)
    qc, kc, vc = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    case.add(f"ceiling: cuDNN SDPA bshd {b} x {s}" + (f" (MHA, {h} k/v heads)" if hk != h else "") + note,
             cudnn_ceiling(causal), (qc, kc, vc), [s] * b)


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
    """Each row's ratio to the first ceiling row at or after it (its
    layout's: a case lists its routes, then their ceiling): sets
    ``vs_ceiling`` where both were timed.  ``figures``: route -> (ms, TFLOP/s)."""
    for i, row in enumerate(rows):
        ceiling = next((figures.get(r["route"]) for r in rows[i:] if r["route"].startswith("ceiling")), None)
        if "tflops" in row and ceiling:
            row["vs_ceiling"] = row["tflops"] / ceiling[1]


def sweep_case(s, d, causal, tokens=TOKENS, rng=None, thd=True):
    """One cell of the sweep: ``tokens`` tokens (at least one sequence of s)
    in 2048 / d heads of d (the same h * d at every head dim), as
    - the padding-free bshd call [tokens / s, s] through ops.attention in
      auto (cuDNN on an H200) and torch SDPA on cuDNN (the ceiling);
    - a packed thd batch of the same tokens in sequences of unequal lengths
      (uniform in [s/2, 3s/2], the last one filling up), through
      ops.attention in auto (the flash route on an H200) and through torch's
      varlen_attn; its ceiling is cuDNN on [b', L] with L the token-weighted
      mean length (the same attention FLOPs per token), as packed_case
      (``thd`` False: the bshd rows only).
    Beside the ceiling, torch SDPA as a user calls it (torch's choice of
    kernel, no sdpa_kernel context: its host work is the least of the three)."""
    rng = rng or random.Random(s * 1000 + d)
    h = 2048 // d
    tokens = max(tokens, s)
    b = tokens // s
    name = f"sweep s {s} d {d} {'causal' if causal else 'full'}"
    case = Case(name, [s] * b, h, h, d, causal)
    q, k, v = _rand(b, s, h, d), _rand(b, s, h, d), _rand(b, s, h, d)
    case.add("auto bshd", via_ops(attn_mask_type="causal" if causal else "no_mask"), (q, k, v), [s] * b)
    case.add(f"ceiling: cuDNN SDPA bshd {b} x {s}", cudnn_ceiling(causal), (q, k, v), [s] * b)
    case.add("peer: torch SDPA default bshd", sdpa_bshd(causal), (q, k, v), [s] * b)
    if not thd:
        return case
    lengths = sweep_lengths(s, tokens, rng)
    qt, kt, vt, cu, kw = thd_inputs(lengths, h, h, d, causal)
    case.add(f"auto thd, {len(lengths)} unequal lengths", via_ops(**kw), (qt, kt, vt), lengths)
    try:
        case.add("peer: torch varlen_attn thd", torch_varlen(cu, max(lengths), causal), (qt, kt, vt), lengths)
    except ImportError as e:
        case.add("peer: torch varlen_attn thd", None, (qt, kt, vt), lengths, error=str(e))
    add_thd_ceiling(case, lengths, h, h, d, causal, note=" (thd's FLOPs per token)")
    return case


def run_case(table, case, rounds=1, queue=1):
    """Every row of ``case`` forward, then forward+backward.  With ``rounds``
    > 1 each direction times the rows ``rounds`` times, the order rotated by
    one row a round and reversed in every other round, and a row's ms is the
    median of its rounds, with the rounds' range (ms_min, ms_max) beside it.
    A row that raises in a direction keeps that error for the direction (its
    earlier rounds dropped) and is not timed again in it."""
    backend_was = seqfuse.ops.attn._routing._read_backend()
    n = len(case.rows)
    for backward in (False, True):
        times, errors = [[] for _ in range(n)], [None] * n
        for r in range(rounds):
            order = [(j + r) % n for j in range(n)]
            for i in (order if r % 2 == 0 else order[::-1]):
                label, fn, inputs, dout, _, error = case.rows[i]
                if fn is None or errors[i] is not None:
                    continue
                backend = label.split(" ")[0]
                if backend in ("seqfuse", "flash", "auto"):
                    seqfuse.ops.set_attention_backend(backend)
                try:
                    times[i].append(timed(fn, inputs, dout, backward, queue))
                except (RuntimeError, NotImplementedError) as e:  # recorded, not hidden
                    errors[i] = str(e).strip().splitlines()[0][:300]
                finally:
                    seqfuse.ops.set_attention_backend(backend_was)
        figures = {}
        for i, (label, fn, inputs, dout, flop_lengths, error) in enumerate(case.rows):
            row = dict(case=case.name, direction="forward+backward" if backward else "forward", route=label,
                       heads=f"{case.h}/{case.hk}", head_dim=case.d, causal=case.causal,
                       tokens=sum(flop_lengths), sequences=len(flop_lengths))
            if fn is None or errors[i] is not None:  # a row that could not be made or run (its error recorded)
                row["error"] = error if fn is None else errors[i]
                table.add(**row)
                continue
            ms = statistics.median(times[i])
            tflops = flops(flop_lengths, case.h, case.d, case.causal, backward) / ms / 1e9
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also copy the JSON here")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--out", default="bench_routes", help="result name (benchmarks/results/OUT.json)")
    parser.add_argument("--sweep", action="store_true",
                        help="instead of the cases: sequence 512 to 32k x head dims 32 / 64 / 128 x full / causal, "
                             "bshd and packed thd in auto against cuDNN and torch's varlen_attn (sweep_case)")
    parser.add_argument("--sweep-layouts", choices=("bshd", "all"), default="all",
                        help="with --sweep: the padding-free bshd rows only, or bshd and packed thd")
    parser.add_argument("--sweep-seqs", default="512,1024,2048,4096,8192,16384,32768",
                        help="with --sweep: the sequence lengths (comma-separated)")
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
    table = Table(args.out, ["case", "direction", "route", "ms", "ms_min", "ms_max", "tflops", "per_token_ns",
                             "vs_ceiling", "vs_seqfuse", "error"])
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
        thd = args.sweep_layouts == "all"
        cases = [lambda s=s, d=d, c=c: sweep_case(s, d, c, thd=thd) for s in map(int, args.sweep_seqs.split(","))
                 for d in (32, 64, 128) for c in (False, True)]
    interrupted = False
    try:
        for make in cases:
            case = make()
            if args.only in case.name:
                run_case(table, case, args.rounds, args.queue)
    except KeyboardInterrupt:  # (timeout -s INT) the rows so far are saved, marked
        interrupted = True
    extra = {"protein_lengths_source": source, "protein_sequences": len(lengths), "protein_tokens": sum(lengths),
             "protein_max_len": max(lengths), "command": " ".join([sys.executable] + sys.argv),
             "flash_route": "seqfuse.ops.attention with set_attention_backend('flash')", "interrupted": interrupted}
    path = table.save(extra)
    if args.json:
        shutil.copyfile(path, args.json)


if __name__ == "__main__":
    main()
