"""Issue 23's CUDA corpus failures, reproduced and bisected in one run (< 60 s
on an H200): which attention route misreads row-padded, offset or strided
q/k/v, what the fix gives on every route, the cross-entropy NaN and label
rules, the cu_seqlens checks, and what the new device-side checks cost.

    PYTHONPATH=python python3 benchmarks/bisect_corpus_cuda.py

Part 1 (run last: a misaligned read may break the CUDA context) calls
torch's SDPA backends (cuDNN, then FlashAttention) directly on the mutated
views, as the torch routes did before the fix, and prints each one's max
error against the same backend on contiguous copies: the backend whose
error is ~1-2 is the one that misreads the layout.  Part 2 runs
ops.attention on each forced backend after the fix (every error should be
at bf16 rounding, < 0.03).
"""
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqfuse import ops
from seqfuse.ops.attn import _routing as routing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bad_input_cases import offset_view, row_padded_view, strided_view  # noqa: E402


# the corpus's mutations (tests/bad_input_cases.py): same values, other strides or storage offset
LAYOUTS = {"rowpad": row_padded_view, "offset": offset_view, "strided": strided_view}
# the corpus's two failing calls: DotProductAttention (sbhd, no mask) and ops.attention causal (bshd)
CASES = {"DPA sbhd no_mask": ("sbhd", (5, 2, 2, 16), False), "attention bshd causal": ("bshd", (2, 5, 2, 16), True),
         "bshd causal d=64 s=128": ("bshd", (2, 128, 4, 64), True)}
TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}


def inputs(shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).bfloat16().cuda() for _ in range(3)]


def mutated(q, k, v):
    """(label, q, k, v) with one of q, k, v in each of the LAYOUTS in turn."""
    for which in "qkv":
        for lname, fn in LAYOUTS.items():
            args = {"q": q, "k": k, "v": v}
            args[which] = fn(args[which])
            yield f"{which}:{lname}", args["q"], args["k"], args["v"]


def raw_sdpa(backend, fmt, q, k, v, causal):
    to = TO_BHSD[fmt]
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q.permute(to), k.permute(to), v.permute(to), is_causal=causal)


def part1():
    print("== 1. torch SDPA backends on the raw views (what the torch routes passed before the fix)")
    for name, (fmt, shape, causal) in CASES.items():
        q, k, v = inputs(shape)
        # (not EFFICIENT_ATTENTION: its aligned kernels read misaligned q/k/v out of bounds, pytorch#183484,
        # which would leave the CUDA context unusable; FLASH last for the same reason)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                ref = raw_sdpa(backend, fmt, q, k, v, causal)
            except RuntimeError as e:
                print(f"  {name:24s} {backend.name:20s} contiguous call refused: {str(e).splitlines()[0][:80]}")
                continue
            row = []
            for label, mq, mk, mv in mutated(q, k, v):
                try:
                    out = raw_sdpa(backend, fmt, mq, mk, mv, causal)
                    torch.cuda.synchronize()
                    row.append(f"{label}={(out.float() - ref.float()).abs().max().item():.3g}")
                except RuntimeError:
                    row.append(f"{label}=refused")
            print(f"  {name:24s} {backend.name:20s} " + " ".join(row))


def part2():
    print("== 2. ops.attention after the fix, each backend forced (max error against contiguous inputs)")
    worst = 0.0
    for mode in ("auto", "seqfuse", "cudnn", "flash"):
        routing.set_attention_backend(mode)
        for name, (fmt, shape, causal) in CASES.items():
            q, k, v = inputs(shape)
            mask = "causal" if causal else "no_mask"
            try:
                ref = ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
            except NotImplementedError as e:
                print(f"  {mode:8s} {name:24s} not taken: {str(e)[:90]}")
                continue
            row = []
            for label, mq, mk, mv in mutated(q, k, v):
                out = ops.attention(mq, mk, mv, qkv_format=fmt, attn_mask_type=mask)
                err = (out.float() - ref.float()).abs().max().item()
                worst = max(worst, err)
                row.append(f"{label}={err:.3g}")
            print(f"  {mode:8s} {name:24s} " + " ".join(row))
    routing.set_attention_backend("auto")
    print(f"  worst error after the fix: {worst:.3g} ({'OK' if worst < 0.03 else 'STILL WRONG'})")


def part3():
    print("== 3. cross-entropy: NaN rule (VEC=1 rows of 10 float32) and labels")
    logits = torch.randn(4, 10)
    logits[0, 0], logits[3, 9] = float("nan"), float("inf")
    labels = torch.tensor([1, 2, -100, 9])
    exp = F.cross_entropy(logits.double(), labels, reduction="none")
    loss, lse = ops.cross_entropy_forward(logits.cuda(), labels.cuda())
    print(f"  NaN places: loss {loss.isnan().sum().item()} (torch {exp.isnan().sum().item()}), "
          f"lse {lse.isnan().sum().item()} (torch {torch.logsumexp(logits, -1).isnan().sum().item()})")
    for bad in (torch.tensor([1, 2, -100, 10]), torch.tensor([1, -7, -100, 9])):
        try:
            ops.cross_entropy_forward(logits.cuda(), bad.cuda())
            print("  bad labels RAN (wrong)")
        except ValueError as e:
            print(f"  bad labels refused: {e}")
        loss, _ = ops.cross_entropy_forward(logits.cuda(), bad.cuda(), check_labels=False)
        print(f"  unchecked: loss = {loss.tolist()}")


def part4():
    print("== 4. cu_seqlens on the GPU")
    q = torch.randn(8, 2, 16, device="cuda").bfloat16()
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
    for name, cq, ck in (("cu_past_end", good + 2, good), ("cu_unsorted", good, good.new_tensor([0, 6, 3]))):
        try:
            ops.attention_forward(q, q, q, qkv_format="thd", cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=5,
                              max_seqlen_kv=5)
            print(f"  attention_thd {name}: RAN (wrong)")
        except ValueError as e:
            print(f"  attention_thd {name}: {e}")
    t, freqs = torch.randn(8, 3, 8, device="cuda"), torch.randn(5, 1, 1, 8, device="cuda")
    for name, cu in (("cu_past_end", good + 1), ("cu_decreasing", good.flip(0))):
        try:
            ops.rope_forward(t, freqs, tensor_format="thd", cu_seqlens=cu)
            print(f"  rope_thd {name}: RAN (wrong)")
        except ValueError as e:
            print(f"  rope_thd {name}: {e}")


def timed(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def part5():
    print("== 5. cost of the device checks (us per call, host loop, GPU idle otherwise)")
    logits = torch.randn(8192, 32000, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 32000, (8192,), device="cuda")
    a = timed(lambda: ops.cross_entropy_forward(logits, labels), 50)
    b = timed(lambda: ops.cross_entropy_forward(logits, labels, check_labels=False), 50)
    print(f"  cross_entropy_forward 8192 x 32000 bf16: {a:.1f} us checked, {b:.1f} unchecked ({a - b:+.1f})")
    small = torch.randn(64, 128, device="cuda")
    sl = torch.randint(0, 128, (64,), device="cuda")
    a = timed(lambda: ops.cross_entropy_forward(small, sl))
    b = timed(lambda: ops.cross_entropy_forward(small, sl, check_labels=False))
    print(f"  cross_entropy_forward 64 x 128: {a:.1f} us checked, {b:.1f} unchecked ({a - b:+.1f})")
    from seqfuse.ops import device_checks as checks
    cu = torch.tensor([0, 1000, 4000, 8192], dtype=torch.int32, device="cuda")

    def fresh():
        checks._cu_facts = None
        checks.check_cu_seqlens("attention_forward", "cu_seqlens_q", cu, 8192, 8192)
    a = timed(fresh)
    c = timed(lambda: checks.check_cu_seqlens("attention_forward", "cu_seqlens_q", cu, 8192, 8192))
    print(f"  cu_seqlens check: {a:.1f} us for a new tensor (one host read), {c:.1f} us for one seen before")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    for part in (part2, part3, part4, part5, part1):
        try:
            part()
        except Exception as e:  # noqa: BLE001 - report and go on to the next part
            print(f"  {part.__name__} failed: {type(e).__name__}: {e}")
    print(f"done in {time.time() - t0:.1f} s")
