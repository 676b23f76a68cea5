"""Padding masks (issue 23, "no silent wrong answers"): DotProductAttention's
TE boolean attention_mask (True = masked out) with right, left and
both-sided padding and all-padding rows, bshd and sbhd, "padding" and
"padding_causal", forward and backward against torch SDPA with the same
boolean mask on the CPU; holes and malformed masks refused with the
argument and the rule named; the mask read once per mask tensor; the
Hugging Face attention function sharing the same layout code; ESM-2 with
left-padded batches against transformers' EsmForMaskedLM.  The cuda-marked
tests run the same cases on the GPU against the CPU module.

Behaviour defined here (and in DotProductAttention's docstring): outputs at
padding query positions are 0 and no gradient flows through them; a row
that is all padding is all 0 with zero gradients (torch's SDPA gives NaN
for a fully masked row, so the reference is built per row).
"""
import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from seqfuse.modules import attention as dpa_mod
from seqfuse.ops import attn as ops_attn


def keep_mask(pattern, b, s):
    """bool [b, s], True = token, for a named padding pattern."""
    keep = torch.ones(b, s, dtype=torch.bool)
    if pattern == "right":
        for i, n in enumerate([s, s - 3, 2, s - 5][:b]):
            keep[i, n:] = False
    elif pattern == "left":
        for i, n in enumerate([s, s - 3, 1, 4][:b]):
            keep[i, :s - n] = False
    elif pattern == "both":
        for i, (a, z) in enumerate([(2, s - 1), (0, s - 4), (3, s), (5, 7)][:b]):
            keep[i] = False
            keep[i, a:z] = True
    elif pattern == "all_masked_row":
        keep[1] = False
        keep[2, :3] = False
    elif pattern == "mixed":  # right, left, both and an empty row in one batch
        keep[0, s - 2:] = False
        keep[1, :4] = False
        keep[2, :1] = False
        keep[2, s - 3:] = False
        keep[3] = False
    return keep


PATTERNS = ["right", "left", "both", "all_masked_row", "mixed"]


def sdpa_reference(q, k, v, keep_q, keep_kv, causal, scale=None):
    """torch SDPA on [b, s, h, d] inputs, row by row, with the boolean mask
    keep_kv (and tril when causal) over the padded positions; rows (and
    padding queries) without a key are 0, as seqfuse defines them."""
    b, s_q, h, _ = q.shape
    hk = k.shape[2]
    out = torch.zeros_like(q)
    for i in range(b):
        if not keep_kv[i].any():
            continue
        allowed = keep_kv[i][None, :].expand(s_q, -1)
        if causal:
            allowed = allowed & torch.ones(s_q, k.shape[1], dtype=torch.bool).tril()
        o = F.scaled_dot_product_attention(
            q[i].transpose(0, 1), k[i].transpose(0, 1).repeat_interleave(h // hk, 0),
            v[i].transpose(0, 1).repeat_interleave(h // hk, 0), attn_mask=allowed, scale=scale).transpose(0, 1)
        rows = keep_q[i] & allowed.any(1)
        out = out.index_put((torch.tensor(i), rows.nonzero()[:, 0]), o[rows])
    return out


def run_module(fmt, mask_type, q, k, v, te_mask, dout, h, hk, d):
    """The module on [b, s, h, d] inputs given in fmt; (out [b, s, h, d], grads [b, s, .])."""
    to = (lambda x: x.transpose(0, 1).contiguous()) if fmt == "sbhd" else (lambda x: x.contiguous())
    back = (lambda x: x.transpose(0, 1)) if fmt == "sbhd" else (lambda x: x)
    qi, ki, vi = (to(x).detach().requires_grad_(True) for x in (q, k, v))
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=fmt, attn_mask_type=mask_type)
    out = attn(qi, ki, vi, attention_mask=te_mask)
    out.backward(to(dout).reshape(out.shape))
    b, s = q.shape[:2]
    return back(out.detach().view(*out.shape[:2], h, d)), [back(x.grad) for x in (qi, ki, vi)]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_module_padding_matches_sdpa(fmt, mask_type, pattern, seed):
    b, s, h, hk, d = 4, 11, 4, 2, 16
    q, k, v = (torch.randn(b, s, n, d) for n in (h, hk, hk))
    dout = torch.randn(b, s, h, d)
    keep = keep_mask(pattern, b, s)
    out, (dq, dk, dv) = run_module(fmt, mask_type, q, k, v, ~keep[:, None, None, :], dout, h, hk, d)

    # the reference in float64 (seqfuse's CPU backend computes in double, rounds to float32)
    qr, kr, vr = (x.double().requires_grad_(True) for x in (q, k, v))
    ref = sdpa_reference(qr, kr, vr, keep, keep, mask_type == "padding_causal")
    (ref * dout.double()).sum().backward()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert (out[~keep] == 0).all()  # padding query positions: 0
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (dq[~keep] == 0).all() and (dk[~keep] == 0).all() and (dv[~keep] == 0).all()


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_module_padding_float32_and_2d_mask(fmt, seed):
    """float32 (the training dtype on CPU) and the [b, s] mask spelling."""
    b, s, h, d = 4, 9, 2, 8
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    keep = keep_mask("mixed", b, s)
    out, _ = run_module(fmt, "padding_causal", q, k, v, ~keep, torch.randn(b, s, h, d), h, h, d)
    ref = sdpa_reference(q, k, v, keep, keep, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_left_padding_was_wrong_on_right_padding_layout():
    """The defect: a left-padded row run as a right-padded one (its
    lengths only) is far from SDPA; the module now matches."""
    b, s, h, d = 2, 8, 2, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    keep = keep_mask("left", b, s)
    ref = sdpa_reference(q, k, v, keep, keep, False)
    cu = torch.tensor([0, 8, 13], dtype=torch.int32)  # the lengths, as the old code made them
    wrong = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu).view(b, s, h, d)
    assert (wrong - ref)[keep].abs().max() > 0.1
    out = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")(
        q, k, v, attention_mask=~keep[:, None, None, :]).view(b, s, h, d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal_bottom_right"])
def test_pair_masks_cross_attention(mask_type, seed):
    """A (q_mask, kv_mask) pair over different lengths, both left/both-sided
    padded: each row's query tokens against its key tokens (causal aligned
    within the tokens, bottom-right: the last query with the last key)."""
    b, s_q, s_kv, h, d = 3, 7, 10, 2, 8
    q = torch.randn(b, s_q, h, d, requires_grad=True)
    k, v = (torch.randn(b, s_kv, h, d, requires_grad=True) for _ in range(2))
    keep_q = torch.zeros(b, s_q, dtype=torch.bool)
    keep_kv = torch.zeros(b, s_kv, dtype=torch.bool)
    for i, ((a, z), (c, e)) in enumerate([((2, 7), (0, 10)), ((0, 4), (3, 9)), ((1, 6), (6, 10))]):
        keep_q[i, a:z] = True
        keep_kv[i, c:e] = True
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type=mask_type, attention_type="cross")
    out = attn(q, k, v, attention_mask=(~keep_q[:, None, None, :], ~keep_kv[:, None, None, :])).view(b, s_q, h, d)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref = torch.zeros_like(out)
    for i in range(b):
        qi = q[i][keep_q[i]].transpose(0, 1)
        ki, vi = (x[i][keep_kv[i]].transpose(0, 1) for x in (k, v))
        allowed = None
        if mask_type != "padding":
            lq, lk = qi.shape[1], ki.shape[1]
            allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed).transpose(0, 1)
        ref = ref.index_put((torch.tensor(i), keep_q[i].nonzero()[:, 0]), o)
    assert (out[~keep_q] == 0).all()
    want = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-6)


def test_hole_is_refused_naming_the_row_and_position():
    b, s, h, d = 4, 20, 2, 8
    q = torch.randn(b, s, h, d)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 15:] = False          # right padding: fine
    keep[3, :2] = False           # left padding ...
    keep[3, 17] = False           # ... and a hole
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"attention_mask: .*row 3 has a hole at position 17"):
        attn(q, q, q, attention_mask=~keep[:, None, None, :])
    attn = te.DotProductAttention(h, d, qkv_format="sbhd", attn_mask_type="padding_causal")
    with pytest.raises(ValueError, match=r"attention_mask: .*row 3 has a hole at position 17"):
        attn(q.transpose(0, 1), q.transpose(0, 1), q.transpose(0, 1), attention_mask=~keep[:, None, None, :])
    pair = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    good = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask\[1\]: .*row 3 has a hole at position 17"):
        pair(q, q, q, attention_mask=(good, ~keep[:, None, None, :]))


def test_malformed_masks_name_attention_mask_and_the_rule():
    b, s, h, d = 2, 6, 2, 8
    q = torch.randn(b, s, h, d)
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    ok = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    with pytest.raises(TypeError, match="attention_mask must be a bool tensor .True = masked out"):
        attn(q, q, q, attention_mask=ok.long())
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        attn(q, q, q, attention_mask=1)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 1, 1, 5\): it must cover .* key length \(6\)"):
        attn(q, q, q, attention_mask=ok[..., :5])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 1, 1, 6\): it must cover the batch \(2\)"):
        attn(q, q, q, attention_mask=torch.zeros(3, 1, 1, s, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must be a padding mask .* 'arbitrary' mask"):
        attn(q, q, q, attention_mask=torch.zeros(b, 1, s, s, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask must be a padding mask"):
        attn(q, q, q, attention_mask=torch.zeros(b * s, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask is taken only with a padding attn_mask_type"):
        te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal")(q, q, q, attention_mask=ok)
    k = torch.randn(b, s + 2, h, d)
    with pytest.raises(ValueError, match="one attention_mask is a self-attention mask"):
        attn(q, k, k, attention_mask=torch.zeros(b, 1, 1, s + 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask\[0\] has shape"):
        attn(q, k, k, attention_mask=(torch.zeros(b, 1, 1, s + 2, dtype=torch.bool),
                                      torch.zeros(b, 1, 1, s + 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="one mask or a .q_mask, kv_mask. pair"):
        attn(q, q, q, attention_mask=(ok, ok, ok))


def test_mask_read_once_per_tensor(monkeypatch):
    """A model's layers get the same mask tensor: its layout (the one host
    read) is computed once, again for another tensor or after an in-place
    change; and the no-padding query of a model shares it."""
    calls = []
    real = dpa_mod._layout_cached.compute
    monkeypatch.setattr(dpa_mod._layout_cached, "compute", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(dpa_mod._layout_cached, "entries", [])
    b, s, h, d = 3, 8, 2, 8
    q = torch.randn(b, s, h, d)
    keep = keep_mask("left", b, s)
    mask = ~keep[:, None, None, :]
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding")
    assert dpa_mod.padding_mask_layout(mask).padded is True
    first = attn(q, q, q, attention_mask=mask)
    for _ in range(3):
        assert torch.equal(attn(q, q, q, attention_mask=mask), first)
    assert len(calls) == 1
    mask[0, ..., 0] = True  # in place: read again
    attn(q, q, q, attention_mask=mask)
    assert len(calls) == 2
    assert dpa_mod.padding_mask_layout(torch.zeros(b, 1, 1, s, dtype=torch.bool)).padded is False


def test_layout_reads_the_device_once(monkeypatch):
    """padding_layout reads its numbers back in one transfer (Tensor.tolist
    once; no .item(), no bool() of a tensor)."""
    reads = []
    for name in ("tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, (lambda r, n: lambda self, *a: reads.append(n) or r(self, *a))(
            real, name))
    ops_attn.padding_layout(keep_mask("both", 4, 9))
    ops_attn.padding_layout(keep_mask("right", 4, 9))
    assert reads == ["tolist", "tolist"]


def test_layouts():
    """Right padding keeps the padded layout (lengths); otherwise five thd
    sequences per row with separate q and kv extents."""
    keep = keep_mask("right", 3, 6)
    lay = ops_attn.padding_layout(keep)
    assert lay.qkv_format == "bshd" and lay.cu_seqlens_q.tolist() == [0, 6, 9, 11] and lay.padded is True
    keep = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    lay = ops_attn.padding_layout(keep)
    assert lay.qkv_format == "thd"
    assert lay.cu_seqlens_q.tolist() == [0, 2, 2, 5, 6, 6, 6, 6, 12, 12, 12]
    assert lay.cu_seqlens_kv.tolist() == [0, 0, 2, 5, 5, 6, 6, 6, 12, 12, 12]
    assert (lay.max_seqlen_q, lay.max_seqlen_kv) == (6, 6)


def test_hf_attention_shares_the_layout_and_zeroes_padding():
    """seqfuse.hf's attention function uses the same padding_layout (one
    piece, not a copy): left/both-sided padding matches SDPA at the tokens,
    padding positions are 0, and a hole is refused there as before."""
    pytest.importorskip("transformers")
    from seqfuse.hf import attention as hf_att
    assert hf_att.padding_layout is ops_attn.padding_layout
    assert hf_att.PerTensorCache is ops_attn.PerTensorCache and dpa_mod.padding_layout is ops_attn.padding_layout

    class M(torch.nn.Module):
        is_causal = True

    b, s, h, d = 4, 9, 2, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    keep = keep_mask("mixed", b, s)
    out, _ = hf_att.seqfuse_attention_forward(M().eval(), q, k, v, keep)
    ref = sdpa_reference(*(x.transpose(1, 2) for x in (q, k, v)), keep, keep, True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    hole = keep.clone()
    hole[0, 3] = False
    with pytest.raises(NotImplementedError, match="row 0 has a hole at position 3"):
        hf_att.seqfuse_attention_forward(M().eval(), q, k, v, hole)


# ------------------------------------------------------------ ESM-2
@pytest.fixture
def esm():
    pytest.importorskip("transformers")
    import test_hf_esm
    return test_hf_esm


def _esm_batch(esm, side, s=40):
    """4 real proteins of lengths 40, 25, 12, 33 placed right, left or in
    the middle (both-sided) of 40 positions, MLM-masked."""
    seqs = esm.proteins(4)
    ids_list = [esm.tokenize([x], n)[0] for x, n in zip(seqs, [40, 25, 12, 33])]
    ids_list, labels = esm.mlm(ids_list, seed=3)
    ids = torch.ones(4, s, dtype=torch.long)
    lab = torch.full((4, s), -100)
    mask = torch.zeros(4, s, dtype=torch.long)
    for i, (x, lb) in enumerate(zip(ids_list, labels)):
        n = len(x)
        o = {"right": 0, "left": s - n, "both": (s - n) // 2}[side]
        ids[i, o:o + n], lab[i, o:o + n], mask[i, o:o + n] = x, lb, 1
    return dict(input_ids=ids, attention_mask=mask, labels=lab)


@pytest.mark.parametrize("side", ["left", "both"])  # right: test_hf_esm.py
def test_esm_left_padding_matches_transformers(esm, side, monkeypatch):
    """SeqfuseEsmForMaskedLM against transformers' EsmForMaskedLM (converted
    with seqfuse.hf.convert): logits at the tokens, loss and every gradient
    with right, left and both-sided padding (left was 0.1-1.2 off before)."""
    act = esm.MLP_ACTIVATION[esm.SeqfuseEsmConfig().mlp_activation]
    monkeypatch.setattr(esm.modeling_esm.EsmIntermediate, "forward", lambda self, x: act(self.dense(x)))
    hf = esm.hf_model("8M", seed=4)
    sf = esm.from_hf_model(hf).eval()
    b = _esm_batch(esm, side)
    exp, out = hf(**b), sf(**b)
    real = b["attention_mask"].bool()
    assert esm.rel_error(out.logits[real], exp.logits[real]) <= 1e-5
    assert abs(out.loss.item() - exp.loss.item()) <= 1e-5 * exp.loss.item()
    exp.loss.backward()
    out.loss.backward()
    mapped = esm.hf_grads_in_seqfuse_names(hf, sf)
    for name, p in sf.named_parameters():
        if "contact_head" not in name:
            assert esm.rel_error(p.grad, mapped[name]) <= 1e-4, name


def test_esm_hole_in_attention_mask_is_refused(esm, monkeypatch):
    sf = esm.from_hf_model(esm.hf_model("8M")).eval()
    b = _esm_batch(esm, "left")
    b["attention_mask"][2, 30] = 0
    with pytest.raises(ValueError, match="attention_mask: .*row 2 has a hole at position 30"):
        sf(**b)


# ------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_module_padding_matches_cpu(fmt, mask_type, pattern, dtype, seed):
    """The GPU path of the same cases (thd packed runs with empty query or
    key extents, and the padded layout) against the CPU module and SDPA,
    head dims 64 and 128, padding content poisoned with large values."""
    for d, (b, s) in ((64, (4, 77)), (128, (4, 130))):
        h, hk = 4, 2
        keep = keep_mask(pattern, b, s)
        q, k, v = (torch.randn(b, s, n, d) for n in (h, hk, hk))
        for x in (q, k, v):
            x[~keep] = 1e4  # padding content must not reach a token
        dout = torch.randn(b, s, h, d)
        qc, kc, vc, dc = (x.to(dtype).float() for x in (q, k, v, dout))
        ref, (rq, rk, rv) = run_module(fmt, mask_type, qc, kc, vc, ~keep[:, None, None, :], dc, h, hk, d)
        out, (gq, gk, gv) = run_module(fmt, mask_type, *(x.to("cuda", dtype) for x in (qc, kc, vc)),
                                       (~keep[:, None, None, :]).cuda(), dc.to("cuda", dtype), h, hk, d)
        tol = 2e-2
        for got, want in ((out, ref), (gq, rq), (gk, rk), (gv, rv)):
            got = got.float().cpu()
            assert torch.isfinite(got).all()
            assert (got - want).norm() <= tol * want.norm() + 1e-6
        assert (out.cpu()[~keep] == 0).all()


@pytest.mark.cuda
def test_cuda_graph_capture_left_padding_and_hole_poison():
    """Under CUDA graph capture the mask is not read: a captured left-padded
    call replays exactly with new mask contents, and a row with a hole
    comes out NaN (never silently wrong)."""
    b, s, h, d = 3, 64, 2, 64
    attn = te.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="padding_causal").cuda()
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = torch.zeros(b, 1, 1, s, dtype=torch.bool, device="cuda")
    mask[1, ..., :10] = True
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        attn(q, k, v, attention_mask=mask)  # warm up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = attn(q, k, v, attention_mask=mask)
    new = torch.zeros_like(mask)
    new[0, ..., :30] = True
    new[2, ..., 50:] = True
    mask.copy_(new)
    graph.replay()
    with torch.no_grad():
        want = attn(q, k, v, attention_mask=new.clone())
    torch.testing.assert_close(out, want)
    mask[1, ..., 20] = True  # a hole in row 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
