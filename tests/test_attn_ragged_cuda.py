"""The opt-in "cudnn_ragged" route of ops.attention on the GPU
(python/seqfuse/ops/attn/_cudnn_ragged.py: packed thd batches of unequal
lengths on cuDNN's variable-length attention through
torch.ops.aten._cudnn_attention_forward), against the float64 reference of
attn_ref.py and seqfuse's CPU backend, with the tolerances by dtype of
helpers.py:

- forced (SEQFUSE_ATTN_BACKEND=cudnn_ragged, so a call it cannot take
  raises instead of running elsewhere): protein-like lengths (1 to 1024
  tokens, an empty sequence among them), bidirectional and top-left causal
  with one cu_seqlens tensor, top-left causal with separate q and k/v
  lengths, bottom-right causal at equal lengths, grouped-query 4:1 and 8:1,
  head dims 32, 64 and 128, bfloat16 and float16, q/k/v views of one fused
  projection (strided, not contiguous);
- in auto with the opt-in on: forward-only calls take the route, calls that
  want gradients are refused (rule torch_backward: torch 2.11's ragged
  backward sizes its dQ accumulator from the head dim) and run the flash
  route, a batch with tail tokens (rule lengths) runs elsewhere and its tail
  is 0, CUDA graph capture is refused (rule graph_capture);
- off by default: auto never takes it;
- the frontend provider (SEQFUSE_ATTN_CUDNN_RAGGED=frontend: NVIDIA's
  nvidia-cudnn-frontend package, skipped where it is not installed):
  forward and gradients against the float64 reference, bidirectional and
  causal, GQA 4:1, head dims 32 to 128, and auto taking training calls.
Speed is not tested here: benchmarks/attn/ragged_probe.py times it (torch
2.11 rebuilds the cuDNN graph in every call).
Run on an H200: `python3 -m pytest -q tests/test_attn_ragged_cuda.py`."""
import pytest
import torch

import seqfuse
from attn_ref import cu_seqlens, reference
from helpers import BACKWARD_FACTOR, pair_tol, rel_error, rel_tol
from seqfuse.ops.attn import _cudnn_ragged as ragged
from seqfuse.ops.attn import _routing as routing

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not ragged.op_available(),
                                 reason=f"torch {torch.__version__} has no aten._cudnn_attention_forward")]

PROTEINS = [50, 333, 1024, 0, 97, 512, 1, 201]  # tokens per sequence; 0: an empty one


@pytest.fixture(autouse=True)
def restore_backend(monkeypatch):
    monkeypatch.setattr(routing, "_backend", routing._backend)
    monkeypatch.setattr(routing, "_ragged_on", False)
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setattr(routing, "_route_failed", {})
    monkeypatch.setattr(routing, "_logged", set())


def _case(lengths_q, lengths_k=None, h=4, hk=4, d=64, dtype=torch.bfloat16, same=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    q = torch.randn(sum(lengths_q), h, d, generator=g).to(dtype).cuda()
    k = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype).cuda()
    v = torch.randn(sum(lengths_k), hk, d, generator=g).to(dtype).cuda()
    cu_q = cu_seqlens(lengths_q, "cuda")
    cu_k = cu_q if same and lengths_k == lengths_q else cu_seqlens(lengths_k, "cuda")
    kw = dict(qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=max(lengths_q),
              max_seqlen_kv=max(lengths_k))
    return q, k, v, kw, lengths_q, lengths_k


def _check_forward(q, k, v, kw, lq, lk, mask, dtype, scale=None):
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    assert seqfuse.ops.attention_backend(q, k, v, attn_mask_type=mask, **kw)[0] == "cudnn_ragged"
    out = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, softmax_scale=scale, **kw)
    assert out.shape == q.shape and out.dtype == dtype and out.is_cuda
    ref = reference(q.cpu(), k.cpu(), v.cpu(), qkv_format="thd", attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    softmax_scale=scale)
    assert rel_error(out, ref) <= rel_tol(dtype)
    # and against seqfuse's CPU backend, the definition of correct
    seqfuse.ops.set_attention_backend("seqfuse")
    cpu_kw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    cpu = seqfuse.ops.attention(q.cpu(), k.cpu(), v.cpu(), attn_mask_type=mask, softmax_scale=scale, **cpu_kw)
    assert rel_error(out, cpu) <= pair_tol(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "causal_bottom_right"])
def test_forced_protein_lengths(dtype, mask):
    q, k, v, kw, lq, lk = _case(PROTEINS, dtype=dtype)
    _check_forward(q, k, v, kw, lq, lk, mask, dtype)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("h,hk", [(8, 8), (8, 2), (32, 4)])
def test_forced_head_dims_and_gqa(d, h, hk):
    q, k, v, kw, lq, lk = _case([17, 256, 3, 640], h=h, hk=hk, d=d, seed=d + h)
    _check_forward(q, k, v, kw, lq, lk, "padding_causal", torch.bfloat16, scale=0.7 / d ** 0.5)


def test_forced_top_left_causal_with_separate_lengths():
    q, k, v, kw, lq, lk = _case([40, 300, 7, 128], [90, 120, 7, 200], same=False)
    _check_forward(q, k, v, kw, lq, lk, "padding_causal", torch.bfloat16)
    _check_forward(q, k, v, kw, lq, lk, "padding", torch.bfloat16)
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    with pytest.raises(NotImplementedError, match="alignment: attn_mask_type 'padding_causal_bottom_right'"):
        seqfuse.ops.attention(q, k, v, attn_mask_type="padding_causal_bottom_right", **kw)


def test_forced_views_of_a_fused_projection():
    """q, k, v as strided views of one [t, 3, h, d] tensor, as a fused QKV
    projection gives them (token stride 3 * h * d)."""
    lengths = [120, 5, 600, 33]
    qkv = torch.randn(sum(lengths), 3, 4, 64, device="cuda").bfloat16()
    q, k, v = qkv.unbind(1)
    cu = cu_seqlens(lengths, "cuda")
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
              max_seqlen_kv=max(lengths))
    _check_forward(q, k, v, kw, lengths, lengths, "padding", torch.bfloat16)


def test_training_calls_are_refused():
    q, k, v, kw, _, _ = _case(PROTEINS)
    q.requires_grad_()
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    with pytest.raises(NotImplementedError, match="torch_backward: gradients wanted"):
        seqfuse.ops.attention(q, k, v, **kw)
    seqfuse.ops.set_attention_backend("auto")
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "flash"
    flash_was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)  # flash off: the reason shows why cudnn_ragged refused it too
    try:
        name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    finally:
        torch.backends.cuda.enable_flash_sdp(flash_was)
    assert name == "seqfuse" and "; cudnn_ragged route: torch_backward: gradients wanted" in reason
    with torch.no_grad():
        assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"


def test_auto_opt_in_and_default():
    q, k, v, kw, lq, lk = _case(PROTEINS)
    seqfuse.ops.set_attention_backend("auto")
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "seqfuse"  # off: forward-only stays on seqfuse
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    assert seqfuse.ops.attention_backend(q, k, v, **kw)[0] == "cudnn_ragged"
    out = seqfuse.ops.attention(q, k, v, **kw)
    ref = reference(q.cpu(), k.cpu(), v.cpu(), qkv_format="thd", seqlens_q=lq, seqlens_kv=lk)
    assert rel_error(out, ref) <= rel_tol(torch.bfloat16)


def test_tail_tokens_run_elsewhere_and_stay_zero():
    lengths = [100, 37, 250]
    q = torch.randn(sum(lengths) + 13, 4, 64, device="cuda").bfloat16()
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = cu_seqlens(lengths, "cuda")
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=250, max_seqlen_kv=250)
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name != "cudnn_ragged" and "cudnn_ragged route: lengths: tokens past the last sequence" in reason
    out = seqfuse.ops.attention(q, k, v, **kw)
    assert torch.equal(out[sum(lengths):], torch.zeros_like(out[sum(lengths):]))
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    with pytest.raises(NotImplementedError, match="lengths: tokens past the last sequence"):
        seqfuse.ops.attention(q, k, v, **kw)


def test_graph_capture_is_refused():
    q, k, v, kw, _, _ = _case([30, 70])
    seqfuse.ops.attn.set_attention_cudnn_ragged(True)
    seqfuse.ops.attention(q, k, v, **kw)  # the cu_seqlens check reads its facts before capture
    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g, stream=stream):
            x.add_(1)
            name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name != "cudnn_ragged" and "cudnn_ragged route: graph_capture: " in reason


# ------------------------------------------------------------ the frontend provider (nvidia-cudnn-frontend)
needs_frontend = pytest.mark.skipif(ragged.frontend_sdpa() is None,
                                    reason="nvidia-cudnn-frontend (cudnn.sdpa_torch) is not installed")


def _reference_with_grads(q, k, v, dout, lq, lk, mask, scale=None):
    q64, k64, v64 = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    out = reference(q64, k64, v64, qkv_format="thd", attn_mask_type=mask, seqlens_q=lq, seqlens_kv=lk,
                    softmax_scale=scale)
    return out.detach(), torch.autograd.grad(out, (q64, k64, v64), dout.cpu().double())


@needs_frontend
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("h,hk,d", [(4, 4, 64), (8, 2, 128), (4, 4, 32)])
def test_frontend_provider_forward_and_gradients(mask, h, hk, d):
    """The frontend provider takes training calls: output and dq, dk, dv
    against the float64 reference (BACKWARD_FACTOR for gradients)."""
    q, k, v, kw, lq, lk = _case(PROTEINS, h=h, hk=hk, d=d, seed=h + d)
    seqfuse.ops.set_attention_backend("cudnn_ragged")
    seqfuse.ops.attn.set_attention_cudnn_ragged(True, "frontend")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert seqfuse.ops.attention_backend(q, k, v, attn_mask_type=mask, **kw)[0] == "cudnn_ragged"
    out = seqfuse.ops.attention(q, k, v, attn_mask_type=mask, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, ref_grads = _reference_with_grads(q, k, v, dout, lq, lk, mask)
    assert rel_error(out, ref) <= rel_tol(torch.bfloat16)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_error(g, r) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR), f"d{name}"


@needs_frontend
def test_frontend_provider_in_auto_takes_training_calls():
    q, k, v, kw, lq, lk = _case([77, 512, 3, 129], [77, 512, 3, 129])
    seqfuse.ops.set_attention_backend("auto")
    seqfuse.ops.attn.set_attention_cudnn_ragged(True, "frontend")
    q.requires_grad_()
    name, reason = seqfuse.ops.attention_backend(q, k, v, **kw)
    assert name == "cudnn_ragged" and reason.endswith("nvidia-cudnn-frontend's cudnn.sdpa_torch")
    out = seqfuse.ops.attention(q, k, v, **kw)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, (q,), dout)
    ref, ref_grads = _reference_with_grads(q, k, v, dout, lq, lk, "padding")
    assert rel_error(out, ref) <= rel_tol(torch.bfloat16)
    assert rel_error(dq, ref_grads[0]) <= rel_tol(torch.bfloat16, BACKWARD_FACTOR)
