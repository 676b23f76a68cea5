"""Forward arguments of Transformer Engine 2.20's eight core modules, passed
by keyword under TE's names, against float64 torch references: Linear /
LayerNormLinear (inp, is_first_microbatch), LayerNormMLP, LayerNorm /
RMSNorm (input); DotProductAttention (query/key/value_layer, per-call
qkv_format, attn_mask_type, window_size, attention_mask, packed thd with
cu_seqlens / their *_padded twins / max_seqlen, checkpoint_core_attention,
fast_zero_fill); MultiheadAttention and TransformerLayer (hidden_states,
attention_mask, encoder_output, enc_dec_attn_mask and its mask type and
window, rotary_pos_emb, packed thd, checkpoint_core_attention,
fast_zero_fill, is_first_microbatch, including its meaning under FP8:
False reuses the weights' FP8 cast, True makes it again).

tests/test_te_api_table.py holds the audit: every TE forward argument is
either named in its FORWARD_COVERAGE (a test that passes it by keyword and
checks the result) or in FORWARD_REFUSED (the module raises
NotImplementedError naming it when it is switched on), and checks those
refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import BACKWARD_FACTOR, needs_fp8, norm_reference, pair_tol, rel_error, rel_tol
from seqfuse.common.recipe import Float8CurrentScaling
from test_te_api import SavedBytes, close, mha_reference, rope_angles
from test_transformer_layer import _attention, make_layer, pad_mask, reference_layer, rope_freqs

F32 = rel_tol(torch.float32, 4)


def _leaf(x):
    return x.detach().double().requires_grad_()


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


# ---------------------------------------------------------------- GEMM modules and norms
def test_gemm_and_norm_forward_keywords_against_torch():
    torch.manual_seed(40)
    x = torch.randn(3, 5, 16, requires_grad=True)
    lin = te.Linear(16, 12, name="fc", device="cpu")  # name: TE's debug name, kept
    assert lin.name == "fc"
    lnl = te.LayerNormLinear(16, 12, normalization="RMSNorm", device="cpu")
    mlp = te.LayerNormMLP(16, 24, activation="gelu", device="cpu")
    ln, rms = te.LayerNorm(16, device="cpu"), te.RMSNorm(16, device="cpu")
    for m in (lin, lnl, mlp, ln, rms):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.rand_like(p) * 0.3)
    P = lambda t: t.detach().double()  # noqa: E731
    refs = {
        "Linear": (lambda: lin(inp=x, is_first_microbatch=True),
                   lambda xr: F.linear(xr, P(lin.weight), P(lin.bias))),
        "LayerNormLinear": (lambda: lnl(inp=x, is_first_microbatch=False),
                            lambda xr: F.linear(norm_reference(xr, P(lnl.layer_norm_weight), None, lnl.eps, "RMSNorm"),
                                                P(lnl.weight), P(lnl.bias))),
        "LayerNormMLP": (lambda: mlp(inp=x, is_first_microbatch=None),
                         lambda xr: F.linear(F.gelu(F.linear(
                             norm_reference(xr, P(mlp.layer_norm_weight), P(mlp.layer_norm_bias), mlp.eps, "LayerNorm"),
                             P(mlp.fc1_weight), P(mlp.fc1_bias)), approximate="tanh"), P(mlp.fc2_weight),
                             P(mlp.fc2_bias))),
        "LayerNorm": (lambda: ln(input=x),
                      lambda xr: norm_reference(xr, P(ln.weight), P(ln.bias), ln.eps, "LayerNorm")),
        "RMSNorm": (lambda: rms(input=x), lambda xr: norm_reference(xr, P(rms.weight), None, rms.eps, "RMSNorm")),
    }
    for name, (run, ref_fn) in refs.items():
        x.grad = None
        out = run()
        xr = _leaf(x)
        ref = ref_fn(xr)
        close(out, ref)
        g = torch.randn_like(out)
        out.backward(g)
        ref.backward(g.double())
        close(x.grad, xr.grad, rel_tol(torch.float32, 8))


@needs_fp8
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "MultiheadAttention",
                                  "TransformerLayer"])
def test_is_first_microbatch_under_fp8(kind):
    """TE's meaning: under FP8, False reuses the weights' FP8 cast made by the
    previous call (gradient-accumulation micro-batches), True casts again."""
    torch.manual_seed(41)
    build = {"Linear": lambda: te.Linear(32, 32, device="cpu"),
             "LayerNormLinear": lambda: te.LayerNormLinear(32, 32, device="cpu"),
             "LayerNormMLP": lambda: te.LayerNormMLP(32, 64, device="cpu"),
             "MultiheadAttention": lambda: te.MultiheadAttention(32, 2, attention_dropout=0.0, qkv_format="bshd",
                                                                 device="cpu"),
             "TransformerLayer": lambda: te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                                             attn_input_format="bshd", device="cpu")}
    m = build[kind]()
    x = torch.randn(2, 16, 32)
    recipe = Float8CurrentScaling()  # the input's scale comes from the input alone: only the weights can differ
    with te.autocast(recipe=recipe):
        first = m(x, is_first_microbatch=True)
    with torch.no_grad():  # a new weight the next micro-batch must not see
        for p in m.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.05)
    fresh = build[kind]()
    fresh.load_state_dict(m.state_dict())
    with te.autocast(recipe=recipe):
        reused = m(x, is_first_microbatch=False)
        recast = m(x, is_first_microbatch=True)
        expect = fresh(x)  # the new weights, cast for the first time
    assert torch.equal(reused, first)
    assert torch.equal(recast, expect) and not torch.allclose(recast, first)


# ---------------------------------------------------------------- DotProductAttention
def test_dot_product_attention_forward_keywords_against_torch():
    """A module built sbhd / causal, called with TE's per-call overrides and
    the tensors by keyword; checkpoint_core_attention=True keeps fewer
    saved tensors and gives the same values and gradients."""
    torch.manual_seed(42)
    dpa = te.DotProductAttention(4, 8, num_gqa_groups=2, attention_dropout=0.0)
    q = torch.randn(2, 7, 4, 8, requires_grad=True)
    k, v = (torch.randn(2, 7, 2, 8, requires_grad=True) for _ in range(2))
    results = []
    g = torch.randn(2, 7, 32)
    for ckpt in (False, True):
        for t in (q, k, v):
            t.grad = None
        counter = SavedBytes()
        with counter.counting():
            out = dpa(query_layer=q, key_layer=k, value_layer=v, qkv_format="bshd", attn_mask_type="causal",
                      window_size=(2, 0), checkpoint_core_attention=ckpt, fast_zero_fill=ckpt)
        qr, kr, vr = (_leaf(t) for t in (q, k, v))
        ref = _attention(qr, kr, vr, [7, 7], [7, 7], True, 1 / math.sqrt(8), window=(2, 0))
        close(out, ref)
        out.backward(g)
        ref.backward(g.double())
        for t, tr in ((q, qr), (k, kr), (v, vr)):
            close(t.grad, tr.grad, rel_tol(torch.float32, 12))
        results.append((out.detach(), q.grad.clone(), counter.nbytes))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[1][2] < results[0][2]


def test_dot_product_attention_padding_and_packed_keywords_against_torch():
    torch.manual_seed(43)
    dpa = te.DotProductAttention(2, 8, attention_dropout=0.0, qkv_format="bshd", attn_mask_type="causal",
                                 layer_number=3, name="core")
    assert dpa.name == "core" and dpa.layer_number == 3  # bookkeeping: kept, the results below unchanged
    lengths, s = [6, 3, 5], 6
    q, k, v = (torch.randn(3, s, 2, 8) for _ in range(3))
    scale = 1 / math.sqrt(8)
    # padding: TE's boolean mask (True = padding), the mask type given per call
    out = dpa(q, k, v, attention_mask=pad_mask(lengths, s), attn_mask_type="padding")
    ref = _attention(q.double(), k.double(), v.double(), lengths, lengths, False, scale)
    for i, n in enumerate(lengths):
        close(out[i, :n], ref[i, :n])
    # packed thd: cu_seqlens, their *_padded twins equal to them (no padding between sequences), max_seqlen
    cu = _cu(lengths)
    pq, pk, pv = (torch.cat([t[i, :n] for i, n in enumerate(lengths)]).requires_grad_() for t in (q, k, v))
    out = dpa(pq, pk, pv, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
              cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths),
              max_seqlen_kv=max(lengths))
    qr, kr, vr = (_leaf(t) for t in (q, k, v))
    ref = _attention(qr, kr, vr, lengths, lengths, True, scale)
    ref = torch.cat([ref[i, :n] for i, n in enumerate(lengths)])
    close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    close(pq.grad, torch.cat([qr.grad[i, :n] for i, n in enumerate(lengths)]), rel_tol(torch.float32, 12))
    # *_padded different from cu_seqlens (padding between sequences): refused by name
    with pytest.raises(NotImplementedError, match="cu_seqlens_q_padded"):
        dpa(pq, pk, pv, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu * 2, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


# ---------------------------------------------------------------- MultiheadAttention
def _mha(seed):
    torch.manual_seed(seed)
    m = te.MultiheadAttention(32, 4, num_gqa_groups=2, attention_dropout=0.0, input_layernorm=True,
                              qkv_format="bshd", device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.rand_like(p) * 0.1)
    return m


def test_multihead_attention_forward_keywords_against_torch():
    m = _mha(44)
    x = torch.randn(2, 6, 32, requires_grad=True)
    freqs, angles = rope_angles(6, 8)
    out = m(hidden_states=x, attention_mask=None, encoder_output=None, attn_mask_type="causal",
            window_size=(-1, 0), is_first_microbatch=True, checkpoint_core_attention=True, rotary_pos_emb=freqs,
            fast_zero_fill=False, inference_params=None, pad_between_seqs=False)
    xr = _leaf(x)
    ref = mha_reference(m, xr, angles, causal=True)
    close(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    close(x.grad, xr.grad, rel_tol(torch.float32, 12))


def test_multihead_attention_padding_and_packed_keywords_against_torch():
    m = _mha(45)
    lengths, s = [6, 2, 4], 6
    x = torch.randn(3, s, 32)
    freqs, angles = rope_angles(s, 8)
    refs = [mha_reference(m, x[i:i + 1, :n], angles[:n], causal=True)[0] for i, n in enumerate(lengths)]
    out = m(hidden_states=x, attention_mask=pad_mask(lengths, s), attn_mask_type="padding_causal",
            rotary_pos_emb=freqs)
    for i, n in enumerate(lengths):
        close(out[i, :n], refs[i])
    cu = _cu(lengths)
    packed = torch.cat([x[i, :n] for i, n in enumerate(lengths)])
    out = m(hidden_states=packed, qkv_format="thd", attn_mask_type="padding_causal", rotary_pos_emb=freqs,
            cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
            max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    close(out, torch.cat(refs))


# ---------------------------------------------------------------- TransformerLayer
def test_transformer_layer_decoder_forward_keywords_against_torch():
    """A decoder layer: the self-attention padding mask and type, the
    encoder output with its own padding mask (enc_dec_attn_mask) and
    per-call enc_dec_attn_mask_type / enc_dec_window_size, RoPE,
    checkpoint_core_attention, fast_zero_fill, is_first_microbatch."""
    torch.manual_seed(46)
    layer = make_layer(hidden=32, ffn=48, heads=2, layer_type="decoder", mask="causal")
    lengths, enc_lengths, s, s_enc = [5, 3], [7, 4], 5, 7
    x = torch.randn(2, s, 32, requires_grad=True)
    enc = torch.randn(2, s_enc, 32)
    freqs = rope_freqs(s_enc, 16)  # the cross-attention's keys turn by the encoder's 7 positions
    out = layer(hidden_states=x, attention_mask=pad_mask(lengths, s), self_attn_mask_type="padding_causal",
                window_size=(-1, 0), encoder_output=enc, enc_dec_attn_mask=(pad_mask(lengths, s), pad_mask(enc_lengths, s_enc)),
                enc_dec_attn_mask_type="padding", enc_dec_window_size=(-1, -1), is_first_microbatch=True,
                checkpoint_core_attention=True, rotary_pos_emb=freqs, fast_zero_fill=False,
                inference_params=None, pad_between_seqs=False)
    xr = _leaf(x)
    ref = reference_layer(layer, xr, lengths, True, freqs[:, 0, 0, :], "gelu", "LayerNorm", 1e-5,
                          encoder=enc, enc_lengths=enc_lengths)
    for i, n in enumerate(lengths):
        close(out[i, :n], ref[i, :n])
    g = torch.randn_like(out)
    for i, n in enumerate(lengths):
        g[i, n:] = 0  # padded rows' outputs are not compared
    out.backward(g)
    ref.backward(g.double())
    for i, n in enumerate(lengths):
        close(x.grad[i, :n], xr.grad[i, :n], rel_tol(torch.float32, 12))


def test_transformer_layer_packed_keywords_against_torch():
    torch.manual_seed(47)
    layer = make_layer(hidden=32, ffn=48, heads=2, groups=1, mask="padding_causal")
    lengths, s = [4, 6, 1], 6
    x = torch.randn(3, s, 32)
    freqs = rope_freqs(s, 16)
    ref = reference_layer(layer, x, lengths, True, freqs[:, 0, 0, :], "gelu", "LayerNorm", 1e-5)
    cu = _cu(lengths)
    packed = torch.cat([x[i, :n] for i, n in enumerate(lengths)])
    out = layer(hidden_states=packed, qkv_format="thd", self_attn_mask_type="padding_causal", rotary_pos_emb=freqs,
                cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    close(out, torch.cat([ref[i, :n] for i, n in enumerate(lengths)]))


# ---------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("fmt,mask", [("bshd", "causal"), ("sbhd", "no_mask"), ("bshd", "padding"),
                                      ("thd", "padding_causal")])
def test_cuda_float32_attention_matches_the_cpu_module(fmt, mask):
    """te.DotProductAttention in float32 on CUDA (TE computes it; seqfuse's
    exact torch route) against the same module on the CPU backend, forward
    and backward, GQA included."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(48)
    dpa = te.DotProductAttention(4, 64, num_gqa_groups=2, attention_dropout=0.0, qkv_format=fmt,
                                 attn_mask_type=mask)
    lengths = [37, 64, 5]
    kw = {}
    if fmt == "thd":
        t = sum(lengths)
        q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
        cu = _cu(lengths)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    else:
        shape = (lambda n: (3, 64, n, 64)) if fmt == "bshd" else (lambda n: (64, 3, n, 64))
        q, k, v = torch.randn(shape(4)), torch.randn(shape(2)), torch.randn(shape(2))
        if mask == "padding":
            kw = dict(attention_mask=pad_mask(lengths, 64))
    outs, grads = [], []
    for device in ("cpu", "cuda"):
        ts = [x.detach().to(device).requires_grad_() for x in (q, k, v)]  # a leaf on each device
        kwd = {n: (x.to(device) if torch.is_tensor(x) else x) for n, x in kw.items()}
        out = dpa(*ts, **kwd)
        assert out.dtype == torch.float32 and out.device.type == device
        g = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1], device=device)
        out.backward(g)
        outs.append(out.detach().cpu())
        grads.append([x.grad.cpu() for x in ts])
    if mask == "padding":  # padded query rows are not compared
        rows = torch.stack([torch.arange(64) < n for n in lengths])
        outs = [o[rows] for o in outs]
        grads = [[gr[rows] for gr in gs] for gs in grads]
    assert rel_error(outs[1], outs[0]) <= pair_tol(torch.float32)
    for a, b in zip(grads[1], grads[0]):
        assert rel_error(a, b) <= pair_tol(torch.float32, BACKWARD_FACTOR)


@pytest.mark.cuda
def test_cuda_meta_model_materialises_and_trains():
    """A model built on the meta device, materialised by reset_parameters()
    on the current CUDA device, trains (bf16 parameters, FusedAdam)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(49)
    model = torch.nn.Sequential(te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                    attn_input_format="bshd", device="meta",
                                                    params_dtype=torch.bfloat16),
                                te.LayerNormLinear(64, 16, device="meta", params_dtype=torch.bfloat16))
    for m in model:
        m.reset_parameters()
    assert all(p.is_cuda for p in model.parameters())
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(4, 32, 16, device="cuda")
    losses = []
    for _ in range(10):
        loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def _cross_attention(q, k, v, lengths_k, scale, window):
    """Non-causal attention of q [b, s, h, d] over k, v [b, s_k, g, d] with
    key padding (lengths_k) and TE's sliding window for non-causal masks
    (bottom_right_diagonal's default, True there): query i of a sequence
    keeps keys [i + len_k - len_q - window[0], i + len_k - len_q + window[1]]."""
    b, s, h, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    qi, ki = torch.arange(s)[:, None], torch.arange(k.shape[1])[None, :]
    keep = torch.zeros(b, 1, s, k.shape[1], dtype=torch.bool)
    for n in range(b):
        row = ki < lengths_k[n]
        if window is not None:
            shift = lengths_k[n] - s
            row = row & (ki >= qi + shift - window[0]) & (ki <= qi + shift + window[1])
        keep[n, 0] = row
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, h * d)


def _decoder_reference(layer, x, enc, enc_lengths, cross_window):
    """A decoder TransformerLayer (causal self-attention, RoPE off, cross
    attention over the encoder output with a key padding mask and a
    sliding window) in float64 torch from its own parameters."""
    P = {n: p.detach().double() for n, p in layer.named_parameters()}
    sa = layer.self_attention
    h, g, d = sa.num_attention_heads, sa.num_gqa_groups, sa.kv_channels
    b, s, _ = x.shape
    eps, scale = layer.layernorm_mlp.eps, 1 / math.sqrt(d)
    x = x.double()
    ln = norm_reference(x, P["self_attention.layernorm_qkv.layer_norm_weight"],
                        P["self_attention.layernorm_qkv.layer_norm_bias"], eps, "LayerNorm")
    mixed = F.linear(ln, P["self_attention.layernorm_qkv.weight"], P["self_attention.layernorm_qkv.bias"])
    grouped = mixed.view(b, s, g, h // g + 2, d)  # TE's interleaved QKV rows
    q, k, v = grouped[..., :h // g, :].reshape(b, s, h, d), grouped[..., h // g, :], grouped[..., h // g + 1, :]
    a = _attention(q, k, v, [s] * b, [s] * b, True, scale)
    x = x + F.linear(a, P["self_attention.proj.weight"], P["self_attention.proj.bias"])
    ln = norm_reference(x, P["inter_attention.layernorm_query.layer_norm_weight"],
                        P["inter_attention.layernorm_query.layer_norm_bias"], eps, "LayerNorm")
    q = F.linear(ln, P["inter_attention.layernorm_query.weight"], P["inter_attention.layernorm_query.bias"])
    kv = F.linear(enc.double(), P["inter_attention.key_value.weight"], P["inter_attention.key_value.bias"])
    kv = kv.view(b, enc.shape[1], g, 2, d)
    a = _cross_attention(q.view(b, s, h, d), kv[..., 0, :], kv[..., 1, :], enc_lengths, scale, cross_window)
    x = x + F.linear(a, P["inter_attention.proj.weight"], P["inter_attention.proj.bias"])
    ln = norm_reference(x, P["layernorm_mlp.layer_norm_weight"], P["layernorm_mlp.layer_norm_bias"], eps, "LayerNorm")
    hid = F.gelu(F.linear(ln, P["layernorm_mlp.fc1_weight"], P["layernorm_mlp.fc1_bias"]), approximate="tanh")
    return x + F.linear(hid, P["layernorm_mlp.fc2_weight"], P["layernorm_mlp.fc2_bias"])


def test_transformer_layer_cross_attention_arguments_against_torch():
    """kv_channels (apart from hidden / heads), enc_dec_attn_mask_type with
    enc_dec_attn_mask, and enc_dec_window_size, given to the constructor and
    per call, compute what torch computes: the cross attention masks the
    encoder's padding and keeps keys within the window (aligned to the
    bottom right of each sequence's scores, TE's rule for non-causal
    masks)."""
    from test_transformer_layer import randomize
    torch.manual_seed(54)
    kw = dict(kv_channels=12, layer_type="decoder", self_attn_mask_type="causal", hidden_dropout=0.0,
              attention_dropout=0.0, attn_input_format="bshd", fuse_qkv_params=True, device="cpu")
    built = te.TransformerLayer(32, 48, 2, enc_dec_attn_mask_type="padding", enc_dec_window_size=(1, 1), **kw)
    randomize(built)
    per_call = te.TransformerLayer(32, 48, 2, **kw)
    per_call.load_state_dict(built.state_dict())
    s, enc_lengths = 6, [6, 3]
    x, enc = torch.randn(2, s, 32), torch.randn(2, s, 32)
    masks = (pad_mask([s, s], s), pad_mask(enc_lengths, s))
    ref = _decoder_reference(built, x, enc, enc_lengths, (1, 1))
    close(built(x, encoder_output=enc, enc_dec_attn_mask=masks), ref)
    close(per_call(x, encoder_output=enc, enc_dec_attn_mask=masks, enc_dec_attn_mask_type="padding",
                   enc_dec_window_size=(1, 1)), ref)
    # the window and the padding each change the result (the test can fail)
    assert not torch.allclose(ref, _decoder_reference(built, x, enc, enc_lengths, None))
    assert not torch.allclose(ref, _decoder_reference(built, x, enc, [s, s], (1, 1)))


def test_transformer_layer_hidden_dropout_against_its_formula():
    """hidden_dropout (TE's bias-dropout-add): in training each element of
    the attention branch is kept with probability 1 - p and scaled by
    1 / (1 - p), or dropped; in eval the layer is the plain one.  The MLP
    branch is zeroed so the attention branch shows alone."""
    torch.manual_seed(55)
    p = 0.25
    layer = te.TransformerLayer(32, 48, 2, hidden_dropout=p, attention_dropout=0.0, attn_input_format="bshd",
                                device="cpu")
    with torch.no_grad():
        layer.layernorm_mlp.fc2_weight.zero_()
        layer.layernorm_mlp.fc2_bias.zero_()
    x = torch.randn(4, 16, 32)
    layer.eval()
    branch = layer(x) - x  # the attention branch, no dropout
    layer.train()
    dropped = layer(x) - x
    kept = dropped != 0
    close(dropped[kept], branch[kept].double() / (1 - p))
    frac = 1 - kept.double().mean().item()  # 2048 elements: p +- 4.5 standard deviations
    assert abs(frac - p) < 4.5 * (p * (1 - p) / kept.numel()) ** 0.5, frac
