"""Fused cross-entropy (seqfuse.ops.cross_entropy_*, seqfuse.modules.cross_entropy)
against torch.nn.functional.cross_entropy in float64 on the CPU (ignored
labels, label smoothing, every reduction, in-place backward), the chunked
linear + cross-entropy against the unchunked torch computation, bad inputs,
and the CUDA kernels against the CPU backend on poisoned outputs."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import seqfuse
import seqfuse.pytorch
from seqfuse.modules.cross_entropy import CrossEntropyLoss, cross_entropy, linear_cross_entropy, parallel_cross_entropy
from seqfuse.ops import cross_entropy_backward, cross_entropy_forward
from seqfuse.ops.gemm import workspace_for

from helpers import REL_TOL, assert_close_rel, poisoned_like, rel_error

# the module itself (seqfuse.modules re-exports its cross_entropy function under the module's name)
ce_module = importlib.import_module("seqfuse.modules.cross_entropy")


def make_labels(n, v, ignore_frac=0.25, ignore_index=-100, device="cpu"):
    y = torch.randint(0, v, (n,), device=device)
    y[torch.rand(n, device=device) < ignore_frac] = ignore_index
    return y


def torch_ref(logits, labels, ignore_index, smoothing, reduction):
    x = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(x, labels, ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
    return x, loss


@pytest.mark.parametrize("n,v", [(1, 5), (13, 37), (64, 1000), (7, 4096 + 3)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_rows_cpu(n, v, smoothing, dtype, seed):
    logits = (torch.randn(n, v) * 3).to(dtype)
    labels = make_labels(n, v)
    loss, lse = cross_entropy_forward(logits, labels, -100, smoothing)
    _, ref = torch_ref(logits, labels, -100, smoothing, "none")
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close_rel(loss, ref, torch.float32)
    assert_close_rel(lse, torch.logsumexp(logits.double(), -1), torch.float32)
    assert (loss[labels == -100] == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_matches_torch_cpu(reduction, smoothing, inplace, dtype, seed):
    n, v, ignore = 40, 301, 7
    logits = (torch.randn(n, v) * 2).to(dtype).requires_grad_(True)
    labels = make_labels(n, v, ignore_index=ignore)
    x, ref = torch_ref(logits, labels, ignore, smoothing, reduction)
    src = logits.detach().clone().requires_grad_(True)
    work = src * 1  # a non-leaf the in-place backward may overwrite
    loss = cross_entropy(work, labels, ignore, smoothing, reduction, inplace_backward=inplace)
    assert_close_rel(loss, ref, torch.float32)
    g = torch.randn(ref.shape, dtype=torch.float64)
    ref.backward(g)
    loss.backward(g.float())
    assert_close_rel(src.grad, x.grad, dtype)
    assert (src.grad[labels == ignore] == 0).all()


def test_inplace_backward_reuses_the_logits_buffer(seed):
    logits = torch.randn(8, 50)
    work = logits.clone().requires_grad_(True)
    y = work * 1
    ptr = y.data_ptr()
    grads = {}
    y.register_hook(lambda gr: grads.setdefault("g", gr))
    cross_entropy(y, make_labels(8, 50), inplace_backward=True).backward()
    assert grads["g"].data_ptr() == ptr


def test_3d_logits_and_module(seed):
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 1] = -100
    loss = CrossEntropyLoss(label_smoothing=0.05)(logits, labels)
    ref = F.cross_entropy(logits.double().reshape(-1, 11), labels.reshape(-1), label_smoothing=0.05)
    assert_close_rel(loss, ref, torch.float32)
    none = cross_entropy(logits, labels, reduction="none")
    assert none.shape == (2, 5)


def test_all_ignored_mean_is_nan_like_torch():
    logits = torch.randn(4, 9)
    labels = torch.full((4,), -100)
    assert torch.isnan(cross_entropy(logits, labels)) and torch.isnan(F.cross_entropy(logits, labels))


def test_parallel_cross_entropy_te_signature(seed):
    inp = torch.randn(3, 4, 17, requires_grad=True)
    target = torch.randint(0, 17, (12,))
    target[5] = -100
    per_token = parallel_cross_entropy(inp, target)
    assert per_token.shape == (3, 4) and per_token.dtype == torch.float32
    ref = F.cross_entropy(inp.double().reshape(12, 17), target, reduction="none").reshape(3, 4)
    assert_close_rel(per_token, ref, torch.float32)
    mean = parallel_cross_entropy(inp, target, reduce_loss=True)
    assert_close_rel(mean, ref.sum() / 11, torch.float32)
    assert seqfuse.pytorch.parallel_cross_entropy is parallel_cross_entropy


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1000.0, -1000.0, 0.0], [-float("inf"), 5.0, 5.0]])
    labels = torch.tensor([0, 1])
    loss, lse = cross_entropy_forward(logits, labels)
    ref = F.cross_entropy(logits.double(), labels, reduction="none")
    assert torch.allclose(loss.double(), ref, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_linear_cross_entropy_scales_by_the_loss_gradient(device, seed):
    """The gradients the forward made for a loss gradient of 1 are scaled by
    the actual one in the backward: 1 leaves them as made, 1/3 multiplies in
    float32 and rounds once to bfloat16 (seqfuse.ops.multi_tensor_scale)."""
    n, h, v = 64, 32, 96
    hidden = torch.randn(n, h).to(device, torch.bfloat16)
    weight = (torch.randn(v, h) * 0.3).to(device, torch.bfloat16)
    labels = make_labels(n, v).to(device)
    grads = {}
    for g in (1.0, 1.0 / 3.0):
        hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = linear_cross_entropy(hd, wd, labels, chunk_size=32)
        loss.backward(torch.tensor(g, device=device))
        grads[g] = (hd.grad, wd.grad)
    third = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    for one, scaled in zip(grads[1.0], grads[1.0 / 3.0]):
        assert torch.equal(scaled.cpu(), (one.cpu().float() * third).to(torch.bfloat16))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_cpu(reduction, chunk, bias, seed):
    n, h, v = 50, 16, 97
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * 0.3).requires_grad_(True)
    b = torch.randn(v, requires_grad=True) if bias else None
    labels = make_labels(n, v)
    loss = linear_cross_entropy(hidden, weight, labels, bias=b, label_smoothing=0.1, reduction=reduction,
                                chunk_size=chunk)
    hd, wd = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True) if bias else None
    ref = F.cross_entropy(F.linear(hd, wd, bd), labels, label_smoothing=0.1, reduction=reduction)
    assert_close_rel(loss, ref, torch.float32)
    (loss * 2.5).backward()
    (ref * 2.5).backward()
    assert_close_rel(hidden.grad, hd.grad, torch.float32)
    assert_close_rel(weight.grad, wd.grad, torch.float32)
    if bias:
        assert_close_rel(b.grad, bd.grad, torch.float32)


def test_linear_cross_entropy_fp32_weight_bf16_hidden(seed):
    """An fp32 weight with bf16 activations (autocast style): GEMMs in bf16,
    the weight's gradient in fp32."""
    hidden = torch.randn(40, 16).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(30, 16) * 0.3).requires_grad_(True)
    labels = make_labels(40, 30)
    linear_cross_entropy(hidden, weight, labels, chunk_size=16).backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    hd = hidden.detach().double().requires_grad_(True)
    wd = weight.detach().to(torch.bfloat16).double().requires_grad_(True)
    F.cross_entropy(hd @ wd.t(), labels).backward()
    assert_close_rel(weight.grad, wd.grad, torch.bfloat16)
    assert_close_rel(hidden.grad, hd.grad, torch.bfloat16)


@pytest.mark.parametrize("hdtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_one_chunk_matches_chunks(hdtype, wdtype, bias, seed, monkeypatch):
    """All rows in one chunk (the weight gradient written in its dtype by one
    GEMM where the GEMM can write it) against four chunks summed in the
    weight's dtype (the default: each chunk's GEMM adds into it where that
    is hidden's dtype) and in a float32 buffer (weight_grad_dtype), each
    against float64, every gradient in its tensor's own dtype; mixed dtypes
    run the GEMMs in hidden's and sum in float32.  The weight-gradient GEMMs'
    output dtypes are recorded."""
    real_gemm = ce_module._gemm
    wgrad_out = []

    def recording_gemm(a, b, **kw):
        if kw.get("transa"):
            wgrad_out.append((kw["out"].dtype, kw.get("accumulate", False)))
        return real_gemm(a, b, **kw)

    monkeypatch.setattr(ce_module, "_gemm", recording_gemm)
    n, h, v = 64, 16, 40
    hidden = torch.randn(n, h).to(hdtype)
    weight = (torch.randn(v, h) * 0.3).to(wdtype)
    b = (torch.randn(v) * 0.1).to(wdtype) if bias else None
    labels = make_labels(n, v)
    grads = []
    for chunk, acc in ((None, None), (16, None), (16, torch.float32)):
        hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        bd = b.clone().requires_grad_(True) if bias else None
        wgrad_out.clear()
        linear_cross_entropy(hd, wd, labels, bias=bd, chunk_size=chunk, weight_grad_dtype=acc).backward()
        assert hd.grad.dtype == hdtype and wd.grad.dtype == wdtype and (not bias or bd.grad.dtype == wdtype)
        summed = wdtype if wdtype == hdtype and (chunk is None or acc is None) else torch.float32
        assert wgrad_out == [(summed, i > 0) for i in range(1 if chunk is None else n // chunk)], (chunk, acc)
        grads.append((hd.grad, wd.grad, bd.grad if bias else None))
    gemm = hdtype  # the GEMMs run in hidden's dtype: the reference sees the weight rounded to it
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.to(gemm).double().requires_grad_(True)
    b64 = b.to(gemm).double().requires_grad_(True) if bias else None
    F.cross_entropy(F.linear(h64, w64, b64), labels).backward()
    low = torch.float32 if torch.float32 == hdtype == wdtype else torch.bfloat16
    for i, (gh, gw, gb) in enumerate(grads):
        assert_close_rel(gh, h64.grad, low)
        # (four roundings of the partial sums in the weight's dtype: within a few of its ulps)
        assert_close_rel(gw, w64.grad, low, factor=4 if i == 1 else 1)
        if bias:
            assert_close_rel(gb, b64.grad, low)
    torch.testing.assert_close(grads[0][1].double(), grads[2][1].double(), rtol=2 ** -7, atol=1e-6)


def test_linear_cross_entropy_weight_grad_dtype_rules(seed):
    """weight_grad_dtype: the weight's own dtype is the default's sum (the
    same bits as None); another dtype is refused, naming the argument."""
    hidden, weight = torch.randn(40, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    labels = make_labels(40, 6)
    grads = []
    for acc in (None, torch.bfloat16):
        w = weight.clone().requires_grad_(True)
        linear_cross_entropy(hidden, w, labels, chunk_size=16, weight_grad_dtype=acc).backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])
    with pytest.raises(ValueError, match=r"'weight_grad_dtype' must be None or the weight's dtype \(torch.float32\), "
                                         r"or torch.float32, got torch.bfloat16"):
        linear_cross_entropy(hidden.float(), weight.float(), labels, weight_grad_dtype=torch.bfloat16)


def test_linear_cross_entropy_no_tokens():
    hidden = torch.zeros(0, 4, requires_grad=True)
    weight = torch.randn(6, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.int64), reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(weight.grad, torch.zeros(6, 4))


def test_linear_cross_entropy_under_no_grad(seed):
    hidden, weight = torch.randn(10, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    labels = torch.randint(0, 6, (10,))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
    assert not loss.requires_grad
    assert_close_rel(loss, F.cross_entropy(hidden.double() @ weight.double().t(), labels), torch.float32)


def test_bad_inputs():
    x = torch.randn(4, 10)
    y = torch.randint(0, 10, (4,))
    with pytest.raises(TypeError, match="'labels' must be an int64"):
        cross_entropy_forward(x, y.int())
    with pytest.raises(TypeError, match="'logits' must have dtype"):
        cross_entropy_forward(x.double(), y)
    with pytest.raises(ValueError, match=r"'labels' must have shape \[N\] = \[4\]"):
        cross_entropy_forward(x, y[:3])
    with pytest.raises(ValueError, match="2-D"):
        cross_entropy_forward(x[None], y)
    with pytest.raises(ValueError, match="holds 10 at row 2, outside \\[0, 10\\) and not ignore_index -100"):
        cross_entropy_forward(x, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="'label_smoothing' must be in \\[0, 1\\]"):
        cross_entropy_forward(x, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="unit stride along V"):
        cross_entropy_forward(torch.randn(10, 4).t(), y)
    _, lse = cross_entropy_forward(x, y)
    with pytest.raises(ValueError, match="'grad_scale' must have 1 or N = 4 elements, got 3"):
        cross_entropy_backward(x, y, lse, torch.ones(3))
    with pytest.raises(TypeError, match="'dlogits' must have dtype float32, got bfloat16"):
        cross_entropy_backward(x, y, lse, torch.ones(1), out=torch.empty(4, 10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'reduction' must be one of"):
        cross_entropy(x, y, reduction="avg")
    with pytest.raises(ValueError, match="'reduction' must be one of \\('mean', 'sum'\\)"):
        linear_cross_entropy(x, torch.randn(5, 10), y, reduction="none")
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16"):
        linear_cross_entropy(x, torch.randn(5, 10, dtype=torch.float64), y)
    with pytest.raises(TypeError, match="'bias' must be \\[V\\] = \\[5\\]"):
        linear_cross_entropy(x, torch.randn(5, 10), y, bias=torch.randn(4))
    with pytest.raises(ValueError, match="must share H"):
        linear_cross_entropy(x, torch.randn(5, 9), y)


# ---- CUDA -----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("n,v", [(1, 7), (300, 1000), (1024, 32000), (64, 128256), (33, 50257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cuda_matches_cpu(n, v, dtype, smoothing, seed):
    logits = (torch.randn(n, v, device="cuda") * 4).to(dtype)
    labels = make_labels(n, v, device="cuda")
    loss, lse = cross_entropy_forward(logits, labels, -100, smoothing)
    loss_c, lse_c = cross_entropy_forward(logits.cpu(), labels.cpu(), -100, smoothing)
    assert_close_rel(loss, loss_c, torch.float32, factor=10)
    assert_close_rel(lse, lse_c, torch.float32, factor=10)
    scale = torch.rand(n, device="cuda")
    for s in (scale, scale[:1]):
        out = poisoned_like(logits)
        cross_entropy_backward(logits, labels, lse, s, -100, smoothing, out=out)
        ref = cross_entropy_backward(logits.cpu(), labels.cpu(), lse_c, s.cpu(), -100, smoothing)
        # a row's gradient is s * (softmax - target): where the label's probability is near 1 the two
        # cancel, so rounding is relative to the terms (norm <= 2 s a row), not to their difference
        terms = 2 * s.cpu().double().expand(n).norm()
        err = (out.cpu().double() - ref.double()).norm() / (ref.double().norm() + terms)
        assert err <= REL_TOL[dtype] * 0.5, f"relative error {err:.3e} for {dtype}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_unaligned_rows_and_in_place(dtype, seed):
    base = torch.randn(50, 1003, device="cuda").to(dtype)
    logits = base[:, 1:1001]  # row stride 1003, 2- or 4-byte offset: scalar path
    labels = make_labels(50, 1000, device="cuda")
    loss, lse = cross_entropy_forward(logits, labels)
    loss_c, lse_c = cross_entropy_forward(logits.cpu(), labels.cpu())
    assert_close_rel(loss, loss_c, torch.float32, factor=10)
    x = (torch.randn(64, 4096, device="cuda") * 3).to(dtype)
    y = make_labels(64, 4096, device="cuda")
    _, l2 = cross_entropy_forward(x, y)
    ref = cross_entropy_backward(x.cpu(), y.cpu(), l2.cpu(), torch.ones(1))
    cross_entropy_backward(x, y, l2, torch.ones(1, device="cuda"), out=x)
    assert_close_rel(x, ref, dtype, factor=0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_autograd_vs_torch(reduction, seed):
    logits = (torch.randn(2048, 32000, device="cuda") * 2).to(torch.bfloat16).requires_grad_(True)
    labels = make_labels(2048, 32000, device="cuda")
    ref = F.cross_entropy(logits.float(), labels, label_smoothing=0.1, reduction=reduction)
    (gref,) = torch.autograd.grad(ref.sum(), logits)
    loss = cross_entropy(logits, labels, label_smoothing=0.1, reduction=reduction)
    (g,) = torch.autograd.grad(loss.sum(), logits)
    assert_close_rel(loss, ref, torch.float32, factor=10)
    assert_close_rel(g, gref, torch.bfloat16)


@pytest.mark.cuda
def test_cuda_bad_label_gives_nan():
    """A label out of range marks its row NaN in every mode: "off" (no
    check), "deferred" (the default: raised later, here by
    check_pending_errors) and "sync" raises at the call
    (tests/test_label_record_cuda.py has the rest)."""
    from seqfuse.ops import check_pending_errors
    from seqfuse.ops.device_checks import set_label_checks
    logits = torch.randn(3, 10, device="cuda")
    labels = torch.tensor([1, 10, -100], device="cuda")
    previous = set_label_checks("sync")
    try:
        with pytest.raises(ValueError, match="'labels' holds 10 at row 1"):
            cross_entropy_forward(logits, labels)
        for mode in ("off", "deferred"):
            set_label_checks(mode)
            loss, _ = cross_entropy_forward(logits, labels)
            assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0
        with pytest.raises(ValueError, match="'labels' holds 10 at row 1"):
            check_pending_errors()
    finally:
        set_label_checks(previous)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk,acc", [(1000, None), (1000, torch.float32), (None, None)])  # None: one chunk
def test_cuda_linear_cross_entropy(dtype, chunk, acc, seed):
    """Against float32 torch; the peak holds one chunk's logits and the
    gradients, no float32 [V, H] buffer, unless weight_grad_dtype asks for
    it."""
    n, h, v = 4096, 512, 32000
    hidden = (torch.randn(n, h, device="cuda") * 0.5).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") * 0.05).to(dtype).requires_grad_(True)
    labels = make_labels(n, v, device="cuda")
    workspace_for(hidden.device)  # the GEMMs' workspace exists before the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, weight_grad_dtype=acc)
    peak = torch.cuda.max_memory_allocated() - base
    if acc is None and dtype != torch.float32:
        # one chunk's logits and the gradients in their own dtype: a float32 [V, H] buffer (65 MB more) fails
        e = hidden.element_size()
        assert peak <= min(n, chunk or n) * v * e + v * h * e + n * h * e + (8 << 20), peak
    elif acc is torch.float32 and dtype != torch.float32:
        # the float32 buffer it asked for, beside a chunk's logits and the hidden states' gradient
        e = hidden.element_size()
        assert peak >= min(n, chunk or n) * v * e + v * h * 4 + n * h * e, peak
    loss.backward()
    hd, wd = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    ref = F.cross_entropy(hd @ wd.t(), labels)
    ref.backward()
    assert_close_rel(loss, ref, dtype)
    assert_close_rel(hidden.grad, hd.grad, dtype, factor=2)
    assert_close_rel(weight.grad, wd.grad, dtype, factor=2)


@pytest.mark.cuda
@pytest.mark.parametrize("switch", ["1", None, "0"])
def test_cuda_linear_cross_entropy_tunes_its_weight_gradient_sum(switch, seed, monkeypatch):
    """Over several chunks the first chunk times the summing GEMM's
    candidates (ops.gemm.tune, accumulate) before it writes the weight
    gradient (the default, and SEQFUSE_GEMM_TUNE=1); with 0 it times
    nothing; one chunk sums nothing."""
    ce = importlib.import_module("seqfuse.modules.cross_entropy")
    importlib.import_module("seqfuse.ops.gemm").plan_cache_clear()  # (nothing tuned before this test)
    calls, tune = [], ce._tune_gemm

    def counted(*args, **kwargs):
        calls.append((kwargs["accumulate"], tune(*args, **kwargs) is not None))
        return None

    monkeypatch.setattr(ce, "_tune_gemm", counted)
    if switch is None:
        monkeypatch.delenv("SEQFUSE_GEMM_TUNE", raising=False)
    else:
        monkeypatch.setenv("SEQFUSE_GEMM_TUNE", switch)
    n, h, v = 1024, 256, 8000
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") * 0.05).bfloat16().requires_grad_(True)
    labels = make_labels(n, v, device="cuda")
    for chunk, want in ((256, [(True, True)]), (256, [(True, False)]), (None, [])):
        calls.clear()  # (the first forward times the candidates; the second finds the plan tuned)
        hidden.grad = weight.grad = None
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk).backward()
        assert calls == (want if switch != "0" else []), (chunk, calls)
        hd, wd = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
        F.cross_entropy(hd @ wd.t(), labels).backward()
        assert_close_rel(weight.grad, wd.grad, torch.bfloat16, factor=2)


@pytest.mark.cuda
def test_cuda_linear_cross_entropy_goes_on_when_tuning_fails(seed, monkeypatch, caplog):
    """A tune that raises is named in a warning; the loss's gradients are
    the untuned ones and this process tunes no more."""
    ce = importlib.import_module("seqfuse.modules.cross_entropy")
    monkeypatch.setattr(ce, "_tune_failed", [])
    monkeypatch.setenv("SEQFUSE_GEMM_TUNE", "1")

    def failing(*args, **kwargs):
        raise RuntimeError("gemm_tune: CUDA error (a test's)")

    monkeypatch.setattr(ce, "_tune_gemm", failing)
    n, h, v = 512, 128, 4000
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda") * 0.05).bfloat16().requires_grad_(True)
    labels = make_labels(n, v, device="cuda")
    with caplog.at_level("WARNING", logger="seqfuse"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=128).backward()
    assert "timing the weight gradient's GEMM candidates failed" in caplog.text and len(ce._tune_failed) == 1
    assert not ce._ChunkGemms(weight, None, sums=True).tune
    hd, wd = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    F.cross_entropy(hd @ wd.t(), labels).backward()
    assert_close_rel(weight.grad, wd.grad, torch.bfloat16, factor=2)


@pytest.mark.cuda
def test_cuda_graph_capture(seed):
    logits = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    labels = make_labels(256, 4096, device="cuda")
    loss, lse = cross_entropy_forward(logits, labels)
    dl = torch.empty_like(logits)
    scale = torch.ones(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cross_entropy_backward(logits, labels, lse, scale, out=dl)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cross_entropy_backward(logits, labels, lse, scale, out=dl)
    scale.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    ref = cross_entropy_backward(logits.cpu(), labels.cpu(), lse.cpu(), torch.full((1,), 3.0))
    assert_close_rel(dl, ref, torch.bfloat16, factor=0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("v", [8, 1003])  # the vector loop and the tail
def test_lse_of_infinite_and_nan_rows_follows_torch(device, v):
    """torch.logsumexp: +inf with a +inf logit, also beside -inf (the row's sum
    is NaN there, which must not read as a NaN logit); NaN with a NaN logit;
    -inf when every logit is -inf."""
    logits = torch.zeros(5, v, device=device)
    logits[0, 3], logits[0, 5] = float("inf"), -float("inf")
    logits[1, 2] = float("inf")
    logits[2, 1], logits[2, 6] = float("nan"), float("inf")
    logits[3, 7] = -float("inf")
    logits[4] = -float("inf")
    labels = torch.zeros(5, dtype=torch.int64, device=device)
    _, lse = cross_entropy_forward(logits, labels)
    want = torch.logsumexp(logits.cpu().double(), -1).float()
    assert torch.equal(lse.cpu().isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.allclose(lse.cpu()[keep], want[keep], rtol=1e-6, atol=1e-6)


def _fp8_round(x, fp8_dtype, bound=None):
    """x (float64) through an FP8 cast scaled so that ``bound`` (default: its
    own amax) maps to the format's largest value, back in float64."""
    s = torch.finfo(fp8_dtype).max / (x.abs().max() if bound is None else bound)
    return (x * s).to(fp8_dtype).double() / s


def _fp8_linear_ce_emulated(hidden, weight, bias, labels, fmt, chunk, sum_dtype=torch.float64):
    """linear_cross_entropy's FP8 computation in float64 torch: per chunk the
    hidden states (with their own amax) and the logits' gradient (rounded to
    the GEMMs' output dtype first; with its bound, 1 / tokens) cast, the
    weight once (its own amax); the weight gradient's running sum rounded to
    ``sum_dtype`` after each chunk (the GEMMs adding into it); (loss,
    dhidden, dweight, dbias) of the mean loss."""
    fd, bd = fmt.forward_dtype, fmt.backward_dtype
    wq = _fp8_round(weight.double(), fd)
    count = (labels != -100).sum()
    loss, dh, dw, db = 0.0, [], 0.0, 0.0
    for s in range(0, hidden.shape[0], chunk):
        hq = _fp8_round(hidden[s:s + chunk].double(), fd)
        lg = F.linear(hq, wq, None if bias is None else bias.double()).to(hidden.dtype).double().requires_grad_(True)
        part = F.cross_entropy(lg, labels[s:s + chunk], reduction="sum") / count
        part.backward()
        loss = loss + part.detach()
        db = db + lg.grad.sum(0)
        gq = _fp8_round(lg.grad.to(hidden.dtype).double(), bd, 1.0 / count.double())
        dh.append(gq @ wq)
        dw = (dw + gq.t() @ hq).to(sum_dtype).double()
    return loss, torch.cat(dh), dw, db


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n,h,v,chunk", [(50, 32, 112, None), (100, 64, 256, 48), (37, 16, 96, 16),
                                         (300, 128, 4096, 256)])
@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("acc", [None, torch.float32])
def test_linear_cross_entropy_fp8(device, n, h, v, chunk, fmt, bias, dtype, acc, seed):
    """fp8_recipe: the chunk GEMMs over FP8 operands (the weight and hidden
    states scaled from their own amax, the logits' gradient from its bound).
    Equal to the same computation emulated in float64: bf16 rounding of the
    outputs; six times bf16's bound for the gradients, because a logit one
    rounding step apart moves an element of the logits' gradient across an
    E5M2 rounding boundary now and then (25 % of that element), and the
    largest elements dominate these small shapes' norms (the worst of 1,800
    seeded cases came to 3.7e-2, the usual 1.7e-3).  Within FP8's distance
    of the exact float64 result, and at least three times the high-precision
    route's distance from it (a route that did not quantize fails).  The
    weight gradient's sum over the chunks: in the weight's dtype (``acc``
    None, the emulation rounding it after each chunk) or in float32."""
    from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling, Format

    fmt = Format[fmt]
    recipe = (DelayedScaling if n % 2 else Float8CurrentScaling)(fp8_format=fmt)
    hidden = torch.randn(n, h, device=device).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device=device) * 0.3).to(dtype).requires_grad_(True)
    b = (torch.randn(v, device=device) * 0.1).to(dtype).requires_grad_(True) if bias else None
    labels = make_labels(n, v, device=device)
    loss = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk, fp8_recipe=recipe,
                                weight_grad_dtype=acc)
    loss.backward()
    e_loss, e_dh, e_dw, e_db = _fp8_linear_ce_emulated(
        hidden.detach(), weight.detach(), None if b is None else b.detach(), labels, fmt, chunk or n,
        dtype if acc is None else torch.float32)
    assert_close_rel(loss, e_loss, torch.bfloat16)
    assert_close_rel(hidden.grad, e_dh, torch.bfloat16, factor=6)
    assert_close_rel(weight.grad, e_dw, torch.bfloat16, factor=6)
    hd, wd = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    bd = b.detach().double().requires_grad_(True) if bias else None
    ref = F.cross_entropy(F.linear(hd, wd, bd), labels)
    ref.backward()
    w_hp = weight.detach().clone().requires_grad_(True)
    linear_cross_entropy(hidden.detach(), w_hp, labels, bias=None if b is None else b.detach(),
                         chunk_size=chunk).backward()
    err_exact = rel_error(weight.grad, wd.grad)
    assert 3 * rel_error(w_hp.grad, wd.grad) < err_exact < 0.1, (err_exact, rel_error(w_hp.grad, wd.grad))
    assert rel_error(hidden.grad, hd.grad) < 0.1 and rel_error(loss, ref) < 1e-2
    if bias:  # summed from the logits' gradient before its cast
        assert_close_rel(b.grad, e_db, torch.bfloat16, factor=3)
        assert rel_error(b.grad, bd.grad) < 0.1


@pytest.mark.parametrize("n,chunk,chunks", [(40, 16, 3), (32, 16, 2), (5, 16, 1), (40, None, 1), (3, 1, 3)])
def test_linear_cross_entropy_fp8_lets_the_weights_rowwise_copy_go(n, chunk, chunks, monkeypatch):
    """Under fp8_recipe the weight's row-wise FP8 copy (the logits' operand)
    is let go after the last chunk's logits: that chunk's gradients run
    without it (one [V, H] byte buffer less at the loss's peak), the earlier
    chunks' with it; the loss and gradients are those of a run that keeps
    it."""
    from seqfuse.common.recipe import DelayedScaling

    ce = importlib.import_module("seqfuse.modules.cross_entropy")  # (the package's name is the function)
    seen = []
    real = ce._Fp8ChunkGemms.grads

    def grads(self, *args, **kwargs):
        seen.append(self.wq.data is None)
        return real(self, *args, **kwargs)

    torch.manual_seed(n)
    hidden = torch.randn(n, 32).to(torch.bfloat16)
    weight = torch.randn(48, 32).to(torch.bfloat16)
    labels = make_labels(n, 48)
    results = []
    for release in (True, False):
        if not release:  # (the reference: the copy kept to the end)
            logits = ce._Fp8ChunkGemms.logits
            monkeypatch.setattr(ce._Fp8ChunkGemms, "logits", lambda self, h, last=False: logits(self, h))
        monkeypatch.setattr(ce._Fp8ChunkGemms, "grads", grads)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = linear_cross_entropy(h, w, labels, chunk_size=chunk, fp8_recipe=DelayedScaling())
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
        if release:
            assert seen == [False] * (chunks - 1) + [True]
    for u, v in zip(*results):
        assert torch.equal(u, v)


def test_linear_cross_entropy_fp8_rules():
    from seqfuse.common.recipe import DelayedScaling, Float8BlockScaling

    hidden = torch.randn(8, 32).to(torch.bfloat16)
    weight = torch.randn(48, 32).to(torch.bfloat16)
    labels = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="'fp8_recipe' must be a per-tensor recipe"):
        linear_cross_entropy(hidden, weight, labels, fp8_recipe=Float8BlockScaling())
    with pytest.raises(TypeError, match="'fp8_recipe' must be a seqfuse.common.recipe recipe"):
        linear_cross_entropy(hidden, weight, labels, fp8_recipe="delayed")
    with pytest.raises(ValueError, match="V \\(weight rows\\) to be a multiple of 16, got 40"):
        linear_cross_entropy(hidden, weight[:40], labels, fp8_recipe=DelayedScaling())
    with pytest.raises(ValueError, match="H to be a multiple of 16, got 24"):
        linear_cross_entropy(hidden[:, :24], weight[:, :24], labels, fp8_recipe=DelayedScaling())


def test_default_chunk_size_rule():
    """The default chunk: a quarter of the full logits within 256-512 MiB, in
    multiples of 256 rows, at least 256, never more than the rows there are;
    an explicit budget is taken as given."""
    from seqfuse.modules.cross_entropy import default_chunk_size

    v = 128256
    assert default_chunk_size(4096, v, 2) == 1024  # (a quarter: 256 MiB)
    assert default_chunk_size(8192, v, 2) == 2048  # (a quarter: 512 MiB)
    assert default_chunk_size(32768, v, 2) == 2048  # (512 MiB at most)
    assert default_chunk_size(1000, v, 2) == 1000  # (the floor of 256 MiB: one chunk)
    assert default_chunk_size(4096, 32000, 2) == 4096
    assert default_chunk_size(8192, v, 4) == 1024  # (float32 logits: the same bytes, half the rows)
    assert default_chunk_size(0, v, 2) == 1
    assert default_chunk_size(8192, v, 2, budget_bytes=1 << 20) == 256
    for n in (300, 5000, 9000, 70000):
        rows = default_chunk_size(n, v, 2)
        assert rows == n or (rows % 256 == 0 and 256 <= rows and rows * v * 2 <= 512 << 20), (n, rows)


@pytest.mark.parametrize("fp8", [False, True])
def test_default_chunk_counts_the_fp8_copies(fp8, monkeypatch):
    """The default chunk's budget counts what a chunk holds per logit: its
    bytes in the hidden states' dtype, and under fp8_recipe also the
    gradient's FP8 copy and its transpose (twice the bf16 logits' bytes)."""
    import importlib

    from seqfuse.common.recipe import Float8CurrentScaling

    ce = importlib.import_module("seqfuse.modules.cross_entropy")
    seen = []
    rule = ce.default_chunk_size

    def spy(n, v, element_size, budget_bytes=None):
        seen.append(element_size)
        return rule(n, v, element_size, budget_bytes)

    monkeypatch.setattr(ce, "default_chunk_size", spy)
    hidden = torch.randn(64, 32).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(128, 32) * 0.3).to(torch.bfloat16).requires_grad_(True)
    labels = make_labels(64, 128)
    linear_cross_entropy(hidden, weight, labels, fp8_recipe=Float8CurrentScaling() if fp8 else None).backward()
    assert seen == [4 if fp8 else 2]
