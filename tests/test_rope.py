"""RoPE (seqfuse.ops.rope_forward / rope_backward, seqfuse.pytorch.apply_rotary_pos_emb)
against a float64 torch reference written the way Transformer Engine's
unfused path is, on the CPU; thd against per-sequence bshd; bad inputs; and
the CUDA kernel against the CPU backend on poisoned outputs."""
import pytest
import torch

import seqfuse
import seqfuse.pytorch
import seqfuse.modules.rope as rope_module
from seqfuse.modules.rope import RotaryPositionEmbedding, apply_rotary_pos_emb, split_qkv_rope
from seqfuse.ops import rope_backward, rope_forward, rope_parts

from helpers import REL_TOL, assert_close_rel, poisoned_like


def make_freqs(s2, rot, interleaved=False, device="cpu"):
    return RotaryPositionEmbedding(rot, interleaved=interleaved, device=device)(s2)


def _rotate(x, interleaved):
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def ref_bshd(t, freqs, interleaved, start=None):
    """float64 RoPE of t [b, s, h, d]: TE's formula, angles per element."""
    t = t.double()
    b, s = t.shape[:2]
    rot = freqs.shape[-1]
    f = freqs.double().reshape(freqs.shape[0], rot)
    offs = start.tolist() if start is not None else [0] * b
    ang = torch.stack([f[o:o + s] for o in offs])[:, :, None, :]  # [b, s, 1, rot]
    x, rest = t[..., :rot], t[..., rot:]
    return torch.cat((x * ang.cos() + _rotate(x, interleaved) * ang.sin(), rest), dim=-1)


def ref(t, freqs, fmt, interleaved, cu=None, start=None):
    if fmt == "bshd":
        return ref_bshd(t, freqs, interleaved, start)
    if fmt == "sbhd":
        return ref_bshd(t.transpose(0, 1), freqs, interleaved, start).transpose(0, 1)
    out = t.double().clone()  # tokens past the last sequence pass through
    for i in range(len(cu) - 1):
        a, e = int(cu[i]), int(cu[i + 1])
        if e > a:
            st = start[i:i + 1] if start is not None else None
            out[a:e] = ref_bshd(t[a:e].unsqueeze(0), freqs, interleaved, st)[0]
    return out


def ref_grad(t, freqs, fmt, interleaved, dy, cu=None, start=None):
    x = t.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad(ref(x, freqs, fmt, interleaved, cu, start), x, dy.double())
    return g


def make_input(fmt, b, s, h, d, dtype, device="cpu", cu=None):
    shape = {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "thd": (int(cu[-1]) + 3 if cu is not None else s, h, d)}[fmt]
    return torch.randn(shape, device=device).to(dtype)


CASES = [  # b, s, h, d, rot
    (2, 7, 3, 16, 16),
    (1, 5, 2, 64, 32),   # partial rotary
    (3, 4, 1, 10, 6),    # odd pair counts, no vector path
]


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_forward_backward_cpu(fmt, interleaved, case, dtype, seed):
    b, s, h, d, rot = case
    t = make_input(fmt, b, s, h, d, dtype)
    freqs = make_freqs(s + 3, rot, interleaved)
    out = rope_forward(t, freqs, fmt, interleaved)
    assert out.dtype == dtype and out.shape == t.shape
    assert_close_rel(out, ref(t, freqs, fmt, interleaved), dtype)
    dy = torch.randn(t.shape).to(dtype)
    dx = rope_backward(dy, freqs, fmt, interleaved)
    assert_close_rel(dx, ref_grad(t, freqs, fmt, interleaved, dy), dtype)


def test_rope_passes_rest_through_exactly(seed):
    t = torch.randn(2, 3, 2, 12)
    out = rope_forward(t, make_freqs(3, 4), "bshd")
    assert torch.equal(out[..., 4:], t[..., 4:])
    assert not torch.equal(out[:, 1:, :, :4], t[:, 1:, :, :4])
    assert torch.equal(out[:, 0], t[:, 0])  # position 0: angle 0


def test_rope_freqs_need_not_repeat(seed):
    """The kernel reads an angle per element, as TE does, not per pair."""
    t = torch.randn(2, 4, 2, 8, dtype=torch.float64).float()
    freqs = torch.randn(6, 1, 1, 8)
    for il in (False, True):
        assert_close_rel(rope_forward(t, freqs, "bshd", il), ref(t, freqs, "bshd", il), torch.float32)
        dy = torch.randn_like(t)
        assert_close_rel(rope_backward(dy, freqs, "bshd", il), ref_grad(t, freqs, "bshd", il, dy), torch.float32)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_thd_matches_per_sequence_bshd(interleaved, seed):
    lens = [5, 0, 9, 1, 4]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    h, d, rot = 3, 16, 12
    t = make_input("thd", None, None, h, d, torch.float32, cu=cu)  # 3 padding tokens at the end
    freqs = make_freqs(10, rot, interleaved)
    out = rope_forward(t, freqs, "thd", interleaved, cu_seqlens=cu)
    for i in range(len(lens)):
        a, e = int(cu[i]), int(cu[i + 1])
        if e > a:
            seq = rope_forward(t[a:e].unsqueeze(0).contiguous(), freqs, "bshd", interleaved)[0]
            assert torch.equal(out[a:e], seq), f"sequence {i}"
    assert torch.equal(out[int(cu[-1]):], t[int(cu[-1]):])
    assert_close_rel(out, ref(t, freqs, "thd", interleaved, cu), torch.float32)
    dy = torch.randn_like(t)
    dx = rope_backward(dy, freqs, "thd", interleaved, cu_seqlens=cu)
    assert_close_rel(dx, ref_grad(t, freqs, "thd", interleaved, dy, cu), torch.float32)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_rope_start_positions(fmt, seed):
    b, s, h, d = 3, 4, 2, 8
    cu = torch.tensor([0, 4, 6, 11], dtype=torch.int32) if fmt == "thd" else None
    t = make_input(fmt, b, s, h, d, torch.float32, cu=cu)
    start = torch.tensor([0, 5, 2], dtype=torch.int32)
    freqs = make_freqs(20, d)
    out = rope_forward(t, freqs, fmt, False, cu_seqlens=cu, start_positions=start)
    assert_close_rel(out, ref(t, freqs, fmt, False, cu, start), torch.float32)


def test_rope_strided_input_and_in_place(seed):
    qkv = torch.randn(2, 6, 3, 4, 16)  # b, s, (q k v), h, d
    q = qkv[:, :, 0]
    freqs = make_freqs(6, 16)
    out = rope_forward(q, freqs, "bshd")
    assert out.is_contiguous()
    assert_close_rel(out, ref(q, freqs, "bshd", False), torch.float32)
    k = qkv[:, :, 1]
    expect = ref(k, freqs, "bshd", True)
    rope_forward(k, freqs, "bshd", True, out=k)
    assert_close_rel(qkv[:, :, 1], expect, torch.float32)


def test_apply_rotary_pos_emb_autograd(seed):
    t = torch.randn(5, 2, 3, 8, dtype=torch.float32, requires_grad=True)
    freqs = make_freqs(5, 8)
    y = apply_rotary_pos_emb(t, freqs, tensor_format="sbhd")
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_close_rel(y, ref(t, freqs, "sbhd", False), torch.float32)
    assert_close_rel(t.grad, ref_grad(t, freqs, "sbhd", False, dy), torch.float32)
    assert seqfuse.pytorch.apply_rotary_pos_emb is apply_rotary_pos_emb


def _split_qkv_rope_case(device, dtype, heads, kv_heads, d, rot, used):
    """split_qkv_rope against torch.split + apply_rotary_pos_emb on q and k:
    the same values and the same mixed gradient (bit for bit: the same
    kernels, only fewer launches), with the outputs in ``used`` taking part
    in the loss (the others get no gradient)."""
    b, s = 2, 24
    mixed = torch.randn(b, s, (heads + 2 * kv_heads) * d, dtype=dtype, device=device, requires_grad=True)
    freqs = make_freqs(s, rot, device=device)
    ref_in = mixed.detach().clone().requires_grad_()
    q, k, v = torch.split(ref_in, [heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want = (apply_rotary_pos_emb(q.reshape(b, s, heads, d), freqs, "bshd"),
            apply_rotary_pos_emb(k.reshape(b, s, kv_heads, d), freqs, "bshd"), v.reshape(b, s, kv_heads, d))
    got = split_qkv_rope(mixed, freqs, heads, kv_heads, d)
    # one launch: q, k and v are views of one new tensor; else q and k of one, v of another
    assert (got[0].untyped_storage().data_ptr() == got[2].untyped_storage().data_ptr()) == rope_module.ONE_LAUNCH
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
        # no output keeps mixed's storage alive (what the attention saves of q, k and v holds none of it)
        assert g.untyped_storage().data_ptr() != mixed.untyped_storage().data_ptr()
    with torch.no_grad():  # no backward to keep anything for: v stays a view of mixed (no copy)
        v = split_qkv_rope(mixed, freqs, heads, kv_heads, d)[2]
        assert v.untyped_storage().data_ptr() == mixed.untyped_storage().data_ptr() and torch.equal(v, want[2])
    # gradients laid out as attention's backward gives them ([b, heads, s, d] seen as bshd: not contiguous)
    weights = [torch.randn(w.shape[0], w.shape[2], w.shape[1], w.shape[3], dtype=w.dtype, device=device).transpose(1, 2)
               for w in want]
    sum((w * c).float().sum() for i, (w, c) in enumerate(zip(want, weights)) if i in used).backward()
    calls = []
    real = rope_module._rope.rope_parts
    rope_module._rope.rope_parts = lambda *a, **k: calls.append(k.get("backward")) or real(*a, **k)
    try:
        sum((g * c).float().sum() for i, (g, c) in enumerate(zip(got, weights)) if i in used).backward()
    finally:
        rope_module._rope.rope_parts = real
    assert torch.equal(mixed.grad, ref_in.grad)
    # the backward's one launch where all three gradients come (else the per-part path)
    assert calls == ([True] if rope_module.ONE_LAUNCH and len(used) == 3 else [])


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("used", [(0, 1, 2), (0,), (1, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_qkv_rope_equals_split_and_rope(used, dtype, one_launch, seed, monkeypatch):
    monkeypatch.setattr(rope_module, "ONE_LAUNCH", one_launch)
    _split_qkv_rope_case("cpu", dtype, 4, 2, 16, 16, used)
    _split_qkv_rope_case("cpu", dtype, 3, 3, 8, 4, used)  # no grouping; a partial rotary width


@pytest.mark.cuda
@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_qkv_rope_cuda(dtype, one_launch, seed, monkeypatch):
    monkeypatch.setattr(rope_module, "ONE_LAUNCH", one_launch)
    _split_qkv_rope_case("cuda", dtype, 32, 8, 64, 64, (0, 1, 2))
    _split_qkv_rope_case("cuda", dtype, 12, 2, 128, 64, (0, 2))


def _parts_case(fmt, dtype, device, interleaved=False, backward=False, heads=(3, 2, 2), rotate=5, d=16, rot=16,
                unaligned=False):
    """rope_parts of ``heads`` parts (strided views: each part a slice of a
    wider tensor, the middle one laid out [b, h, s, d] as attention's
    gradients are) against rope_forward / rope_backward of their
    concatenation's first ``rotate`` heads and a copy of the rest, on a
    poisoned out; returns (got, want)."""
    b, s, cu = 2, 9, None
    fn = rope_backward if backward else rope_forward
    total = sum(heads)
    if fmt == "thd":
        cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)  # an empty sequence, 2 tokens past the last
        tok = (13,)
    else:
        tok = (b, s) if fmt == "bshd" else (s, b)
    parts = []
    for i, h in enumerate(heads):
        pad = d + 1 if unaligned else d
        wide = torch.randn(*tok, h + 1, pad).to(dtype).to(device)
        part = wide[..., 1:, pad - d:]
        if i == 1 and fmt == "bshd":
            part = torch.randn(b, h, s, d).to(dtype).to(device).transpose(1, 2)
        parts.append(part)
    freqs = make_freqs(16, rot, interleaved, device=device)
    cu_d = None if cu is None else cu.to(device)
    out = poisoned_like(torch.empty(*tok, total, d, dtype=dtype, device=device))
    rope_parts(tuple(parts), freqs, rotate, out, fmt, interleaved, cu_seqlens=cu_d, backward=backward)
    whole = torch.cat(parts, dim=-2)
    want = whole.clone()
    if rotate:
        want[..., :rotate, :] = fn(whole[..., :rotate, :].contiguous(), freqs, fmt, interleaved, cu_seqlens=cu_d)
    return out, want


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_parts_equals_rope_of_the_rotated_heads_and_a_copy(fmt, dtype, seed):
    for interleaved in (False, True):
        for backward in (False, True):
            for heads, rotate in (((3, 2, 2), 5), ((3, 2, 2), 2), ((3, 2, 2), 4), ((4,), 3), ((2, 3), 5),
                                  ((2, 1), 0)):
                got, want = _parts_case(fmt, dtype, "cpu", interleaved, backward, heads, rotate, rot=8)
                assert torch.equal(got, want), (interleaved, backward, heads, rotate)


def test_rope_parts_refuses_what_does_not_fit():
    t = torch.zeros(2, 5, 3, 8)
    freqs = make_freqs(5, 8)
    with pytest.raises(ValueError, match=r"rope: argument 'rotate_heads' must be at most out's 5 heads, got 6"):
        rope_parts((t, t[:, :, :2]), freqs, 6, torch.empty(2, 5, 5, 8), "bshd")
    with pytest.raises(ValueError, match=r"rope: argument 'rotate_heads' must be >= 0, got -1"):
        rope_parts((t,), freqs, -1, torch.empty(2, 5, 3, 8), "bshd")
    with pytest.raises(ValueError, match=r"rope: argument 'out' must have the parts' 6 heads together, got 5"):
        rope_parts((t, t), freqs, 2, torch.empty(2, 5, 5, 8), "bshd")
    with pytest.raises(ValueError, match=r"rope_backward: argument 't1' must match 'out' in every dimension but "
                                         r"the heads \(2\), got 4 against 5 in dimension 1"):
        rope_parts((t, t[:, :4]), freqs, 2, torch.empty(2, 5, 6, 8), "bshd", backward=True)
    with pytest.raises(TypeError, match=r"rope: argument 't2' must have dtype float32, float16 or bfloat16"):
        rope_parts((t, t, t.double()), freqs, 2, torch.empty(2, 5, 9, 8), "bshd")
    with pytest.raises(TypeError, match=r"rope: argument 't1' must have dtype float32, got bfloat16"):
        rope_parts((t, t.bfloat16()), freqs, 2, torch.empty(2, 5, 6, 8), "bshd")
    out = torch.empty(2, 5, 6, 8)
    with pytest.raises(ValueError, match=r"output 'out' shares memory with input 't1'"):
        rope_parts((t, out[:, :, 3:]), freqs, 2, out, "bshd")
    with pytest.raises(TypeError, match=r"rope: argument 'parts' must be a tuple of tensors, got Tensor"):
        rope_parts(t, freqs, 2, torch.empty(2, 5, 3, 8), "bshd")
    with pytest.raises(TypeError, match=r"rope_parts: argument 'out' must be a tensor"):
        rope_parts((t,), freqs, 2, "out", "bshd")
    with pytest.raises(ValueError, match=r"rope: argument 't2' is given without 't1' \(the parts come in order\)"):
        seqfuse._C.rope_parts(t, None, t, 2, freqs, None, None, 1, False, False, torch.empty(2, 5, 6, 8), None)
    with pytest.raises(ValueError, match=r"argument 'parts' must hold 1 to 3 tensors, got 4"):
        rope_parts((t,) * 4, freqs, 2, torch.empty(2, 5, 12, 8), "bshd")
    with pytest.raises(TypeError, match=r"argument 'rotate_heads' must be an int, got float"):
        rope_parts((t,), freqs, 2.0, torch.empty(2, 5, 3, 8), "bshd")
    same = torch.randn(2, 5, 3, 8)  # the only part may be out itself
    want = torch.cat([rope_forward(same[:, :, :2].contiguous(), freqs, "bshd"), same[:, :, 2:]], dim=2)
    assert rope_parts((same,), freqs, 2, same, "bshd") is same and torch.equal(same, want)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_parts_cuda_matches_cpu(fmt, dtype, seed):
    for interleaved in (False, True):
        for backward in (False, True):
            for heads, rotate, d, rot, unaligned in (((32, 8, 8), 40, 64, 64, False), ((3, 2, 2), 2, 16, 8, False),
                                                     ((3, 2, 2), 4, 16, 16, False),
                                                     ((40,), 40, 64, 64, False), ((5, 3), 4, 16, 16, True),
                                                     ((2, 1), 0, 16, 16, False), ((7, 300), 7, 16, 16, False)):
                torch.manual_seed(seed)
                got, want_gpu = _parts_case(fmt, dtype, "cuda", interleaved, backward, heads, rotate, d, rot, unaligned)
                torch.manual_seed(seed)
                cpu, _ = _parts_case(fmt, dtype, "cpu", interleaved, backward, heads, rotate, d, rot, unaligned)
                assert_close_rel(got, cpu, dtype, factor=0.5)
                assert torch.equal(got, want_gpu), (interleaved, backward, heads, rotate, d, rot, unaligned)


def test_split_qkv_rope_refuses_a_mismatched_width():
    with pytest.raises(ValueError, match=r"split_qkv_rope: argument 'mixed' must be .*\[b, s, 64\]"):
        split_qkv_rope(torch.zeros(1, 4, 60), make_freqs(4, 8), 2, 1, 16)


def test_rotary_position_embedding_table():
    m = RotaryPositionEmbedding(8, rotary_percent=0.5, device="cpu")
    f = m(6)
    assert f.shape == (6, 1, 1, 4) and f.dtype == torch.float32
    inv = 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4)
    expect = torch.outer(torch.arange(6).float(), inv)
    assert torch.equal(f[:, 0, 0], torch.cat((expect, expect), -1))
    fi = RotaryPositionEmbedding(4, interleaved=True, device="cpu")(6)
    assert torch.equal(fi[:, 0, 0, 0::2], expect) and torch.equal(fi[:, 0, 0, 1::2], expect)


def test_rope_bad_inputs():
    t = torch.randn(2, 4, 2, 8)
    f = make_freqs(4, 8)
    with pytest.raises(TypeError, match="argument 't' must have dtype"):
        rope_forward(t.to(torch.int32), f)
    with pytest.raises(TypeError, match="rope: argument 'freqs' must have dtype float32, got float16"):
        rope_forward(t, f.half())
    with pytest.raises(ValueError, match="tensor_format"):
        rope_forward(t, f, "bhsd")
    with pytest.raises(ValueError, match="'cu_seqlens' is required"):
        rope_forward(t[0], f, "thd")
    with pytest.raises(ValueError, match="only valid for tensor_format 'thd'"):
        rope_forward(t, f, "bshd", cu_seqlens=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="'cu_seqlens' must be an int32"):
        rope_forward(t[0], f, "thd", cu_seqlens=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="must have 3 dimensions for tensor_format 'thd'"):
        rope_forward(t, f, "thd", cu_seqlens=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="even last dimension"):
        rope_forward(t, make_freqs(4, 8)[..., :5])
    with pytest.raises(ValueError, match="rot_dim <= head dim 8"):
        rope_forward(t, make_freqs(4, 10))
    with pytest.raises(ValueError, match="'freqs' covers 3 positions but 't' has sequence length 4"):
        rope_forward(t, make_freqs(3, 8), "bshd")
    with pytest.raises(ValueError, match=r"shape \[s2, 1, 1, rot_dim\]"):
        rope_forward(t, f.expand(4, 2, 1, 8))
    thd = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        rope_forward(thd, f, "thd", cu_seqlens=torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="must start at 0"):
        rope_forward(thd, f, "thd", cu_seqlens=torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends at 11 but 't' has 10 tokens"):
        rope_forward(thd, make_freqs(20, 8), "thd", cu_seqlens=torch.tensor([0, 3, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sequence 1 needs positions \[0, 5\) but 'freqs' covers 4"):
        rope_forward(thd, f, "thd", cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"sequence 0 needs positions \[2, 6\)"):
        rope_forward(t, f, "bshd", start_positions=torch.tensor([2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="'start_positions' must have 2 element"):
        rope_forward(t, f, "bshd", start_positions=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="'out' must have the same shape"):
        rope_forward(t, f, "bshd", out=torch.empty(2, 4, 2, 9))
    with pytest.raises(TypeError, match="'out' must have dtype float32, got bfloat16"):
        rope_forward(t, f, "bshd", out=torch.empty(2, 4, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="start_positions with context parallelism"):
        apply_rotary_pos_emb(t, f, "bshd", cp_size=2, start_positions=torch.tensor([0, 0], dtype=torch.int32))


# ---- CUDA -----------------------------------------------------------------

GPU_CASES = [  # b, s, h, d, rot
    (2, 128, 8, 64, 64),
    (3, 77, 5, 128, 64),
    (1, 33, 3, 10, 6),      # scalar path
    (4, 512, 16, 128, 128),
    (2, 16, 300, 16, 16),   # more heads than threads
    (1, 8, 2, 1024, 1024),  # more pair groups than threads
]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_cuda_matches_cpu(fmt, interleaved, case, dtype, seed):
    b, s, h, d, rot = case
    t = make_input(fmt, b, s, h, d, dtype, device="cuda")
    freqs = make_freqs(s, rot, interleaved, device="cuda")
    for backward in (False, True):
        fn = rope_backward if backward else rope_forward
        out = poisoned_like(t)
        fn(t, freqs, fmt, interleaved, out=out)
        cpu = fn(t.cpu(), freqs.cpu(), fmt, interleaved)
        assert_close_rel(out, cpu, dtype, factor=0.5)
        if not backward:
            assert_close_rel(out, ref(t.cpu(), freqs.cpu(), fmt, interleaved), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cuda_thd(interleaved, dtype, seed):
    lens = torch.randint(0, 300, (17,))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
    h, d, rot = 8, 128, 64
    t = make_input("thd", None, None, h, d, dtype, device="cuda", cu=cu)
    start = torch.randint(0, 50, (17,), dtype=torch.int32)
    freqs = make_freqs(400, rot, interleaved, device="cuda")
    for st in (None, start):
        for fn in (rope_forward, rope_backward):
            out = poisoned_like(t)
            fn(t, freqs, "thd", interleaved, cu_seqlens=cu.cuda(), out=out,
               start_positions=None if st is None else st.cuda())
            cpu = fn(t.cpu(), freqs.cpu(), "thd", interleaved, cu_seqlens=cu, start_positions=st)
            assert_close_rel(out, cpu, dtype, factor=0.5)
            assert torch.equal(out[int(cu[-1]):].cpu(), t[int(cu[-1]):].cpu())


@pytest.mark.cuda
def test_rope_cuda_strided_and_unaligned(seed):
    qkv = torch.randn(2, 64, 3, 8, 64, device="cuda", dtype=torch.bfloat16)
    freqs = make_freqs(64, 32, device="cuda")
    views = [("bshd", qkv[:, :, 1]),                 # q/k view of packed qkv: vector path
             ("bshd", qkv[:, :, 0, :, 1:33]),         # 2-byte offset: scalar path
             ("sbhd", qkv[:, :, 2, :, :32].transpose(0, 1))]
    for fmt, view in views:
        for il in (False, True):
            out = poisoned_like(view)
            rope_forward(view, freqs, fmt, il, out=out)
            assert_close_rel(out, rope_forward(view.cpu(), freqs.cpu(), fmt, il), torch.bfloat16, factor=0.5)


@pytest.mark.cuda
def test_rope_cuda_position_past_freqs():
    """A packed sequence longer than ``freqs`` covers: eagerly a ValueError
    naming cu_seqlens (the offsets' one host read); under CUDA graph capture,
    where nothing reads the host, the kernel writes NaN at the positions past
    ``freqs`` rather than reading past its end, as it does at a negative
    position (start_positions are not read on the host)."""
    t = torch.randn(6, 2, 8, device="cuda")
    cu = torch.tensor([0, 6], dtype=torch.int32, device="cuda")
    freqs = make_freqs(4, 8, device="cuda")
    with pytest.raises(ValueError, match="'cu_seqlens' holds a sequence of length 6, longer than the 4 "
                                         "positions 'freqs' covers"):
        rope_forward(t, freqs, "thd", cu_seqlens=cu)
    cu = cu.clone()  # a tensor the eager check has not read
    out = torch.full_like(t, 7.0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rope_forward(t, freqs, "thd", cu_seqlens=cu, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert not out[:4].isnan().any() and out[4:].isnan().all()
    # a start position that puts a token at position -1: NaN too (not the copy of a token outside every sequence)
    start = torch.tensor([-1], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    out = rope_forward(t, freqs, "thd", cu_seqlens=cu, start_positions=start)
    assert out[0].isnan().all() and not out[1:4].isnan().any() and torch.equal(out[4:], t[4:])


@pytest.mark.cuda
def test_rope_cuda_graph_capture(seed):
    t = torch.randn(4, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    freqs = make_freqs(64, 64, device="cuda")
    out = torch.empty_like(t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rope_forward(t, freqs, "bshd", out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rope_forward(t, freqs, "bshd", out=out)
    t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, rope_forward(t.cpu(), freqs.cpu(), "bshd"), torch.bfloat16, factor=0.5)


def test_copy_rows_moves_words_where_the_layout_allows(seed, caplog, monkeypatch):
    """split_qkv_rope's value-head copies: as int64 words where both layouts
    allow (the bytes of an element-wise copy, checked bit for bit on
    NaN-carrying data), element by element otherwise, said once."""
    rope_mod = rope_module
    monkeypatch.setattr(rope_mod, "_logged_element_copy", [])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        mixed = torch.randn(2, 24, 12 * 16).to(dtype)
        mixed.view(-1)[::7] = float("nan")
        src = mixed[..., 8 * 16:].view(2, 24, 4, 16)  # (a strided slice, as the value heads of a QKV output)
        assert rope_mod._as_words(src) is not None
        dst = torch.empty(src.shape, dtype=dtype)
        assert rope_mod._copy_rows(dst, src) is dst
        assert torch.equal(dst.view(torch.uint8), src.contiguous().view(torch.uint8))
        # the backward's layout: attention's gradient ([b, h, s, d] seen as bshd) into a slice of the QKV gradient
        grad = torch.randn(2, 4, 24, 16).to(dtype).transpose(1, 2)
        dmixed = torch.zeros(2, 24, 12 * 16, dtype=dtype)
        into = dmixed[..., 8 * 16:].view(2, 24, 4, 16)
        assert rope_mod._as_words(into) is not None and rope_mod._as_words(grad) is not None
        rope_mod._copy_rows(into, grad)
        assert torch.equal(into, grad) and not dmixed[..., :8 * 16].any()
    assert not rope_mod._logged_element_copy  # (every copy above moved words)
    odd = torch.randn(4, 3).bfloat16()  # (a row of 6 bytes: no whole words)
    assert rope_mod._as_words(odd) is None
    with caplog.at_level("INFO", logger="seqfuse"):
        out = rope_mod._copy_rows(torch.empty(4, 3, dtype=torch.bfloat16), odd)
        rope_mod._copy_rows(torch.empty(4, 3, dtype=torch.bfloat16), odd)
    assert torch.equal(out, odd) and caplog.text.count("copied element by element") == 1
    # another dtype: torch's element copy converts (word views would move the other format's bytes)
    halves = torch.randn(2, 24, 4, 16).bfloat16()
    assert torch.equal(rope_mod._copy_rows(torch.empty(2, 24, 4, 16), halves), halves.float())
