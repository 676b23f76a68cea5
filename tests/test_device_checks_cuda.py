"""Issue 23's CUDA corpus failures, one test each (GPU only, `cuda` marker):

- attention on every route (auto, seqfuse, cudnn, flash) with q, k or v
  row-padded (19-element rows), at a 2-byte storage offset, or strided in the
  head dim equals the same call on contiguous copies (the corpus saw max
  errors of 2 on the cuDNN route);
- cross-entropy labels outside [0, V): a ValueError naming the row, NaN
  loss and NaN gradients where the check is skipped; a NaN logit makes lse
  and loss NaN on every kernel path (rows of 10 float32, read one element at a
  time, gave a finite loss), as on the CPU;
- bad cu_seqlens in GPU memory: the ValueError the CPU gives, for attention
  and RoPE; under CUDA graph capture the check steps aside with a log line.
"""
import logging

import pytest
import torch

from seqfuse import ops
from seqfuse.ops import device_checks as checks
from seqfuse.ops.attn import _routing as routing

from bad_input_cases import offset_view, row_padded_view, strided_view
from helpers import pair_tol

pytestmark = pytest.mark.cuda


# q, k or v as a view of a larger buffer (the corpus's mutations)
LAYOUTS = {"rowpad": row_padded_view, "offset": offset_view, "strided": strided_view}
SHAPES = {"bshd": (2, 5, 2, 16), "sbhd": (5, 2, 2, 16), "bshd_64": (2, 128, 4, 64)}


@pytest.fixture
def backend(request, monkeypatch):
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setattr(routing, "_route_failed", {})
    monkeypatch.setattr(routing, "_backend", request.param)
    return request.param


@pytest.mark.parametrize("backend", ["auto", "seqfuse", "cudnn", "flash"], indirect=True)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_attention_reads_any_layout(backend, layout, which, shape, mask):
    fmt = shape.split("_")[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(SHAPES[shape], device="cuda", generator=g).bfloat16() for _ in range(3))
    ref = ops.attention(q, k, v, qkv_format=fmt, attn_mask_type=mask)
    args = {"q": q, "k": k, "v": v}
    args[which] = LAYOUTS[layout](args[which])
    assert torch.equal(args[which], {"q": q, "k": k, "v": v}[which])
    out = ops.attention(args["q"], args["k"], args["v"], qkv_format=fmt, attn_mask_type=mask)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= pair_tol(torch.bfloat16) * (1 + ref.float().abs().max().item()), \
        f"{backend} {fmt} {mask} {which}:{layout}: max error {err} against the contiguous call"


def test_cross_entropy_bad_labels_raise_on_cuda():
    """The synchronous mode raises at the call (the deferred default:
    test_label_record_cuda.py)."""
    logits = torch.randn(4, 10, device="cuda")
    previous = checks.set_label_checks("sync")
    try:
        for labels in (torch.tensor([1, 2, -100, 10]), torch.tensor([1, -7, -100, 9])):
            labels = labels.cuda()
            with pytest.raises(ValueError, match="argument 'labels' holds .* at row 1|argument 'labels' holds 10 at row 3"):
                ops.cross_entropy_forward(logits, labels)
            with pytest.raises(ValueError, match="argument 'labels' holds"):
                ops.cross_entropy_backward(logits, labels, torch.zeros(4, device="cuda"),
                                           torch.ones(1, device="cuda"))
    finally:
        checks.set_label_checks(previous)


@pytest.mark.parametrize("v", [10, 16, 1000])
def test_cross_entropy_unchecked_bad_label_is_nan_never_a_number(v):
    logits = torch.randn(4, v, device="cuda")
    labels = torch.tensor([1, v, -100, -3], device="cuda")
    loss, lse = ops.cross_entropy_forward(logits, labels, check_labels=False)
    assert torch.isfinite(loss[[0, 2]]).all() and loss[[1, 3]].isnan().all(), loss
    grad = ops.cross_entropy_backward(logits, labels, lse, torch.ones(1, device="cuda"), check_labels=False)
    assert torch.isfinite(grad[[0, 2]]).all() and grad[[1, 3]].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [10, 16, 37, 4096])
def test_cross_entropy_nan_and_inf_logits_as_the_cpu(v, dtype):
    """A NaN logit anywhere in a row makes its lse and loss NaN (rows of 10
    float32 are not 16-byte aligned and were read one element per thread: a
    thread holding only the NaN never added it to the sum)."""
    logits = torch.randn(6, v).to(dtype)
    logits[0, 0] = float("nan")
    logits[1, v - 1] = float("nan")
    logits[2, v // 2] = float("inf")
    logits[3, 0] = float("inf")
    logits[3, 1] = -float("inf")
    logits[4, :] = -float("inf")
    labels = torch.tensor([1, 0, v // 2, 2, 0, 3])
    cpu_loss, cpu_lse = ops.cross_entropy_forward(logits, labels)
    loss, lse = ops.cross_entropy_forward(logits.cuda(), labels.cuda())
    for got, exp in ((loss.cpu(), cpu_loss), (lse.cpu(), cpu_lse)):
        assert torch.equal(got.isnan(), exp.isnan()), (got, exp)
        fin = exp.isfinite()
        assert torch.equal(got[~fin & ~exp.isnan()], exp[~fin & ~exp.isnan()])
        torch.testing.assert_close(got[fin], exp[fin], rtol=1e-4, atol=1e-4)


def _thd(cu_q, cu_kv):
    q = torch.randn(8, 2, 16, device="cuda").bfloat16()
    return ops.attention_forward(q, q, q, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=5,
                             max_seqlen_kv=5)


def test_bad_cu_seqlens_raise_on_cuda():
    good = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="'cu_seqlens_q' must start at 0"):
        _thd(good + 2, good)
    with pytest.raises(ValueError, match="'cu_seqlens_kv' must be non-decreasing"):
        _thd(good, torch.tensor([0, 4, 3], dtype=torch.int32, device="cuda"))  # lengths within max_seqlen 5
    with pytest.raises(ValueError, match="'cu_seqlens_q' ends at 10, beyond the 8 tokens"):
        _thd(torch.tensor([0, 5, 10], dtype=torch.int32, device="cuda"), good)
    q = torch.randn(8, 2, 16, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="'cu_seqlens_kv' must be non-decreasing"):
        ops.attention(q, q, q, qkv_format="thd", cu_seqlens_q=good,
                      cu_seqlens_kv=torch.tensor([0, 6, 3], dtype=torch.int32, device="cuda"))
    t = torch.randn(8, 3, 8, device="cuda")
    freqs = torch.randn(16, 1, 1, 8, device="cuda")
    with pytest.raises(ValueError, match="'cu_seqlens' must start at 0"):
        ops.rope_forward(t, freqs, tensor_format="thd", cu_seqlens=good + 1)
    with pytest.raises(ValueError, match="'cu_seqlens' must be non-decreasing"):
        ops.rope_forward(t, freqs, tensor_format="thd",
                         cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32, device="cuda"))
    _thd(good, good)  # and the good ones still run


def test_device_checks_step_aside_under_graph_capture(caplog):
    """Capture must still work (no host read): the cu_seqlens check is
    skipped and logged; the labels are recorded by the kernel on each replay
    and raised after it (the deferred label check)."""
    checks._skips_logged.clear()
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
    q = torch.randn(8, 2, 16, device="cuda").bfloat16()
    logits = torch.randn(4, 10, device="cuda")
    labels = torch.tensor([1, 2, -100, 9], device="cuda")
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        ops.attention_forward(q, q, q, **kw)
        ops.cross_entropy_forward(logits, labels)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.WARNING, logger="seqfuse"), torch.cuda.graph(graph):
        out, _ = ops.attention_forward(q, q, q, **kw)
        loss, _ = ops.cross_entropy_forward(logits, labels)
    graph.replay()
    torch.cuda.synchronize()
    msgs = [r.getMessage() for r in caplog.records if "captured into a CUDA graph" in r.getMessage()]
    assert any("'cu_seqlens_q'" in m for m in msgs) and not any("'labels'" in m for m in msgs), msgs
    ops.check_pending_errors()
    labels.copy_(torch.tensor([1, 2, -100, 10]))  # a bad label in the replay: NaN, not a number, and an error
    graph.replay()
    torch.cuda.synchronize()
    assert loss[3].isnan() and torch.isfinite(loss[:2]).all()
    with pytest.raises(ValueError, match="argument 'labels' holds 10 at row 3"):
        ops.check_pending_errors()


@pytest.mark.cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernel_layout_gives_aligned_rows(layout):
    """What every attention route reads: unit head-dim stride, a 16-byte
    aligned start and 16-byte rows, the values unchanged.  An offset view is
    contiguous, so contiguous() returned it unmoved (misaligned): the H200
    run of session 10 faulted with a misaligned address in torch's kernels."""
    from seqfuse.ops.attn._args import kernel_layout

    x = torch.randn(2, 5, 3, 16, device="cuda").bfloat16()
    view = LAYOUTS[layout](x)
    got = kernel_layout(view)
    assert got.data_ptr() % 16 == 0 and got.stride(-1) == 1
    assert all(st % 8 == 0 for st, n in zip(got.stride()[:-1], got.shape[:-1]) if n > 1)
    assert torch.equal(got, x)
