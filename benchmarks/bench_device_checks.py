"""What the device-side index checks cost (python/seqfuse/ops/device_checks.py).

On CUDA, seqfuse checks attention / RoPE cu_seqlens with a few torch
kernels and one host read each (a synchronization of the current stream),
and cross-entropy labels either the same way (SEQFUSE_CHECK_LABELS=sync) or,
by default ("deferred"), inside the loss kernel, which records a bad label in
pinned host memory for the host to raise later without waiting
(python/seqfuse/ops/pending_errors.py).  So a bad label or sequence boundary
is an exception naming it instead of a silent wrong answer.  A host read
makes the host wait for the work already queued; the GPU then idles while
the host launches what comes next.  This script times that, each check mode
against checks off, at realistic sizes, in steady state (warm-up on the very
inputs that are timed), with CUDA events around a loop of back-to-back calls
(what a training loop does), plus the host time per call:

  ce          cross_entropy forward + backward, logits [32768, 128256] bf16
              (Llama 3 1B's vocabulary at 32k tokens; labels checked
              "sync", "deferred" and "off");
  linear_ce   linear_cross_entropy forward + backward, hidden [32768, 2048]
              x weight [128256, 2048] bf16 (the chunked LM head + loss of the
              Llama recipe; the same three label modes);
  attn        packed (thd) attention forward + backward at ESM-2 650M's heads
              (20 x 64, bf16), 16,384 tokens of real UniProt protein lengths
              (the recipe's committed subset), a NEW cu_seqlens tensor each
              call (as each training step brings one: copied from pinned
              memory, so the check runs every call);
  attn_x33    the same with 33 attention calls sharing that cu_seqlens (one
              ESM-2 650M step's attention: the first call checks, the other
              32 find it in the cache);
  esm2_step   (unless --no-step) the whole ESM-2 650M training step of the
              recipe's pieces: a fresh packed batch of 16k tokens copied from
              pinned memory, forward + MLM loss under seqfuse autocast
              (--recipe), backward, FusedAdamW step (the ESM loss is torch's
              cross-entropy, so only the cu_seqlens checks of attention and
              RoPE run).

"on" is the default of cu_seqlens; for labels the rows are the three modes
of seqfuse.ops.device_checks.set_label_checks (= SEQFUSE_CHECK_LABELS), the
default being "deferred".  "off" for labels is the user's switch (= SEQFUSE_CHECK_LABELS=0);
cu_seqlens checks have no switch, so "off" here replaces check_cu_seqlens by
a no-op in the seqfuse modules that call it: a benchmark-only setting,
undone after each row.  Off removes the checks only: a host read that other
code makes of the same cu_seqlens (the attention router's
device_checks.uniform_length, where present, reuses the check's cached read;
without the check it reads on its own) stays in both rows.

Writes benchmarks/results/device_checks.json (run metadata: commit,
versions, command).  On the H200 the whole run takes well under a minute:

    PYTHONPATH=python python3 benchmarks/bench_device_checks.py
"""
import argparse
import contextlib
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "esm2"))  # common: the ESM-2 benchmarks' batches and model

from harness import Table  # noqa: E402

from seqfuse.ops import device_checks  # noqa: E402


def _no_check(*args, **kwargs):
    """check_cu_seqlens switched off (the benchmark's "off" rows)."""


@contextlib.contextmanager
def checks(mode):
    """Device checks in ``mode`` inside the region, put back at its exit:
    "sync" or "deferred" (labels checked that way, cu_seqlens checked), or
    "off"; True means "sync", False "off".  Off: set_label_checks("off") for
    labels (the user's switch) and, for cu_seqlens (no switch exists),
    check_cu_seqlens replaced by a no-op in every seqfuse module that holds
    it (found, not listed, so a module that imports it later is covered
    too)."""
    mode = {True: "sync", False: "off"}.get(mode, mode)
    previous = device_checks.set_label_checks(mode)
    real = device_checks.check_cu_seqlens
    patched = []
    if mode == "off":
        for name, mod in list(sys.modules.items()):
            if (name == "seqfuse" or name.startswith("seqfuse.")) and getattr(mod, "check_cu_seqlens", None) is real:
                setattr(mod, "check_cu_seqlens", _no_check)
                patched.append(mod)
    try:
        yield patched
    finally:
        for mod in patched:
            setattr(mod, "check_cu_seqlens", real)
        device_checks.set_label_checks(previous)


def loop_time(fn, iters, warmup):
    """(ms per call on the GPU's clock over a back-to-back loop, µs of host
    time per call until fn returns): steady state after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - t0) / iters * 1e6
    end.synchronize()
    return start.elapsed_time(end) / iters, host


def protein_cu_seqlens(tokens, max_length=1024):
    """cu_seqlens of a packed batch of ``tokens`` tokens made of real UniProt
    protein lengths (+2 for <cls>/<eos>, cropped to max_length), in file
    order; the last sequence is cut so the batch is exactly ``tokens``."""
    from common import data_dir, load_train_sequences

    lens, total = [], 0
    for s in load_train_sequences(data_dir()):
        n = min(len(s) + 2, max_length, tokens - total)
        lens.append(n)
        total += n
        if total == tokens:
            break
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu, max(lens)


def run_pair(table, case, make_fn, iters, warmup, note, modes=("sync", "off")):
    """The same calls in each check mode (the last one "off"); one row each
    (the cost of a mode is its time minus off's).  A row named "on" is the
    "sync" mode of a case without labels."""
    res = {}
    for mode in modes:
        with checks(mode):
            fn = make_fn()
            res[mode] = loop_time(fn, iters, warmup)
    ms_off, host_off = res["off"]
    for mode in modes:
        ms, host = res[mode]
        name = "on" if mode == "sync" and len(modes) == 2 else mode
        table.add(case=case, checks=name, ms_per_call=ms, host_us_per_call=host,
                  cost_us=(ms - ms_off) * 1e3, cost_pct=100.0 * (ms - ms_off) / ms_off,
                  host_cost_us=host - host_off, iters=iters, note=note)


def bench_ce(table, args):
    from seqfuse.modules.cross_entropy import cross_entropy

    n, v = args.ce_tokens, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, v, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::10] = -100

    def make():
        def call():
            loss = cross_entropy(x, y)
            torch.autograd.grad(loss, x)
        return call

    run_pair(table, f"ce forward+backward logits [{n}, {v}] bf16", make, args.iters, args.warmup,
             "labels: sync = 1 host read per call; deferred = recorded by the kernel, no host read",
             modes=("sync", "deferred", "off"))
    del x


def bench_linear_ce(table, args):
    from seqfuse.modules.cross_entropy import linear_cross_entropy

    n, v, h = args.ce_tokens, args.vocab, args.hidden
    g = torch.Generator(device="cuda").manual_seed(1)
    hid = (torch.randn(n, h, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[::10] = -100

    def make():
        def call():
            loss = linear_cross_entropy(hid, w, y)
            torch.autograd.grad(loss, (hid, w))
        return call

    run_pair(table, f"linear_ce forward+backward [{n}, {h}] x [{v}, {h}] bf16", make, max(3, args.iters // 4),
             max(2, args.warmup // 2), "labels: sync = 1 host read per call; deferred = recorded by the kernel",
             modes=("sync", "deferred", "off"))
    del hid, w


def bench_attn(table, args):
    from seqfuse.ops.attn import attention

    cu_host, max_len = protein_cu_seqlens(args.attn_tokens)
    cu_host = cu_host.pin_memory()
    t, heads, d = args.attn_tokens, 20, 64
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(t, heads, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    dout = torch.randn(t, heads, d, device="cuda", generator=g).to(torch.bfloat16)
    seqs = cu_host.numel() - 1

    def make(calls):
        def call():
            cu = cu_host.to("cuda", non_blocking=True)  # a new tensor, as each batch brings
            outs = [attention(q, k, v, qkv_format="thd", attn_mask_type="padding", cu_seqlens_q=cu,
                              cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len) for _ in range(calls)]
            torch.autograd.grad(outs, (q, k, v), grad_outputs=[dout] * calls)
        return call

    what = f"{t} tokens, {seqs} proteins, max {max_len}"
    run_pair(table, f"attn thd forward+backward ESM-2 650M heads 20x64, {what}", lambda: make(1), args.iters, args.warmup,
             "new cu_seqlens each call: one check (1 host read) per call")
    run_pair(table, f"attn_x33 thd forward+backward, 33 calls sharing one cu_seqlens, {what}", lambda: make(33),
             max(3, args.iters // 4), max(2, args.warmup // 2),
             "one check per 33 calls (the rest hit the cache): one ESM-2 650M step's attention")
    del q, k, v, dout


def bench_esm2_step(table, args):
    from common import build_seqfuse, data_dir, fp8_recipe, load_train_sequences, make_batches

    from seqfuse.optim import FusedAdamW
    from seqfuse.pytorch import autocast

    recipe = fp8_recipe(args.recipe)
    batches = make_batches(load_train_sequences(data_dir()), args.step_batches, tokens=args.attn_tokens,
                           max_length=1024, packed=True, pad_to_multiple_of=16, pin=True)
    model = build_seqfuse(args.size, "cuda", torch.bfloat16).train()
    opt = FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    state = {"i": 0}

    def make():
        state["i"] = 0  # both rows step through the same batches

        def step():
            b = batches[state["i"] % len(batches)]
            state["i"] += 1
            d = {k: (x.to("cuda", non_blocking=True) if torch.is_tensor(x) else x) for k, x in b.items()}
            with autocast(enabled=recipe is not None, recipe=recipe):
                loss = model(input_ids=d["input_ids"], labels=d["labels"], cu_seqlens=d["cu_seqlens"],
                             max_seqlen=int(b["max_seqlen"])).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    tokens = sum(int(b["num_tokens"]) for b in batches) / len(batches)
    run_pair(table, f"esm2_step {args.size} packed {args.attn_tokens} tokens ({tokens:.0f} real), {args.recipe}",
             make, args.step_iters, args.step_warmup,
             "fresh batch each step: the cu_seqlens checks of attention and RoPE (torch's CE: no labels check)")
    del model, opt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20, help="timed calls per row (linear_ce, attn_x33: a quarter)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ce-tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--attn-tokens", type=int, default=16384)
    p.add_argument("--size", default="650M", help="ESM-2 size of the esm2_step rows")
    p.add_argument("--recipe", default="bf16", choices=("bf16", "fp8_delayed", "fp8_current", "fp8_block"))
    p.add_argument("--step-iters", type=int, default=12)
    p.add_argument("--step-warmup", type=int, default=4)
    p.add_argument("--step-batches", type=int, default=8, help="distinct batches the step rows cycle through")
    p.add_argument("--no-step", action="store_true", help="skip the whole-step rows")
    p.add_argument("--only", default=None, help="comma-separated: ce,linear_ce,attn,esm2_step")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_device_checks: needs a CUDA GPU (the checks only run on device tensors)")
    parts = {"ce": bench_ce, "linear_ce": bench_linear_ce, "attn": bench_attn, "esm2_step": bench_esm2_step}
    chosen = args.only.split(",") if args.only else [k for k in parts if not (k == "esm2_step" and args.no_step)]
    bad = [c for c in chosen if c not in parts]
    if bad:
        raise SystemExit(f"bench_device_checks: --only {bad}: not among {list(parts)}")
    table = Table("device_checks", ["case", "checks", "ms_per_call", "host_us_per_call", "cost_us", "cost_pct",
                                    "host_cost_us", "iters", "note"])
    for name in chosen:
        parts[name](table, args)
        torch.cuda.empty_cache()
    table.save(extra={"args": vars(args), "method": (
        "CUDA events around a loop of back-to-back calls after warm-up on the same inputs (ms_per_call: the "
        "GPU clock, bubbles included); host_us_per_call: perf_counter over the same loop until the last call "
        "returned; cost = mode - off.  off: set_label_checks('off') and check_cu_seqlens a no-op in the seqfuse "
        "modules that call it; other reads of cu_seqlens (routing) stay; sync / deferred: the label modes")})


if __name__ == "__main__":
    main()
