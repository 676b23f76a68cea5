"""Transformer Engine names added to seqfuse.pytorch for issue 22, against
torch references: Fp8Padding / Fp8Unpadding (each split padded to a
multiple of the alignment with zero rows, the alignment from the recipe
when not given), moe_sort_chunks_by_index(_with_probs) (chunks reordered),
and the refused names' "off" settings (onnx_export, get_cpu_offload_context
with enabled=False behave as TE's).  The refusals themselves are checked in
test_te_api_table.py against REFUSED_NAMES.  CPU only: these are row copies
with no CUDA kernel of their own."""
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.common.recipe import DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
from seqfuse.quantization import _autocast_state


def _pad_reference(x, m_splits, align):
    out, start = [], 0
    for m in m_splits:
        p = (m + align - 1) // align * align
        out += [x[start:start + m], x.new_zeros((p - m, x.shape[1]))]
        start += m
    return torch.cat(out)


@pytest.mark.parametrize("m_splits,align", [([3, 0, 17, 16], 16), ([1, 40], 32), ([5], 8)])
def test_fp8_padding_round_trip_against_torch(m_splits, align):
    torch.manual_seed(0)
    x = torch.randn(sum(m_splits), 6, requires_grad=True)
    out, padded = te.Fp8Padding(len(m_splits), align_size=align)(x, m_splits)
    assert padded == [(m + align - 1) // align * align for m in m_splits]
    assert torch.equal(out, _pad_reference(x.detach(), m_splits, align))
    back = te.Fp8Unpadding(len(m_splits), align_size=align)(out, m_splits)
    assert torch.equal(back, x.detach())
    g = torch.randn_like(back)
    back.backward(g)
    assert torch.equal(x.grad, g)
    # the padding rows' gradient is dropped: Fp8Padding's backward keeps only the real rows
    x2 = x.detach().clone().requires_grad_(True)
    out2, _ = te.Fp8Padding(len(m_splits), align_size=align)(x2, m_splits)
    gp = torch.randn_like(out2)
    out2.backward(gp)
    assert torch.equal(x2.grad, te.Fp8Unpadding(len(m_splits), align_size=align)(gp, m_splits))


def test_fp8_padding_returns_input_when_aligned():
    x = torch.randn(48, 4)
    out, padded = te.Fp8Padding(2)(x, [16, 32])
    assert out is x and padded == [16, 32]
    assert te.Fp8Unpadding(2)(x, [16, 32]) is x


@pytest.mark.parametrize("recipe,align", [(DelayedScaling(), 16), (MXFP8BlockScaling(), 32),
                                          (NVFP4BlockScaling(), 128)])
def test_fp8_padding_alignment_follows_the_recipe(monkeypatch, recipe, align):
    monkeypatch.setattr(_autocast_state.autocast_state(), "recipe", recipe)
    pad = te.Fp8Padding(1)
    assert pad.align_size is None  # decided at the first forward, as TE
    _, padded = pad(torch.randn(3, 4), [3])
    assert padded == [align] and pad.align_size == align


def test_fp8_padding_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="num_gemms"):
        te.Fp8Padding(0)
    with pytest.raises(ValueError, match="align_size"):
        te.Fp8Unpadding(2, align_size=0)
    with pytest.raises(ValueError, match="m_splits.*num_gemms"):
        te.Fp8Padding(2)(torch.randn(4, 2), [4])
    with pytest.raises(ValueError, match="rows but sum"):
        te.Fp8Padding(2)(torch.randn(4, 2), [1, 2])
    with pytest.raises(ValueError, match="rows but sum"):
        te.Fp8Unpadding(2)(torch.randn(4, 2), [1, 2])


@pytest.mark.parametrize("sizes,order", [([2, 0, 3, 1], [3, 1, 0, 2]), ([4], [0]), ([1, 2, 3], [2, 0, 1])])
def test_sort_chunks_by_index_against_torch(sizes, order):
    torch.manual_seed(1)
    x = torch.randn(sum(sizes), 5, requires_grad=True)
    probs = torch.rand(sum(sizes), requires_grad=True)
    chunks, pchunks = torch.split(x.detach(), sizes), torch.split(probs.detach(), sizes)
    ref = torch.cat([chunks[i] for i in order])
    out = te.moe_sort_chunks_by_index(x, torch.tensor(sizes), torch.tensor(order))
    assert torch.equal(out, ref)
    out2, p2 = te.moe_sort_chunks_by_index_with_probs(x, probs, torch.tensor(sizes), torch.tensor(order))
    assert torch.equal(out2, ref) and torch.equal(p2, torch.cat([pchunks[i] for i in order]))
    g, gp = torch.randn_like(out2), torch.randn_like(p2)
    torch.autograd.backward([out2, p2], [g, gp])
    # the gradient goes back through the inverse order
    inv = [order.index(i) for i in range(len(order))]
    gs, gps = torch.split(g, [sizes[i] for i in order]), torch.split(gp, [sizes[i] for i in order])
    assert torch.equal(x.grad, torch.cat([gs[j] for j in inv]))
    assert torch.equal(probs.grad, torch.cat([gps[j] for j in inv]))


def test_sort_chunks_bad_input_names_the_argument():
    x = torch.randn(5, 2)
    with pytest.raises(ValueError, match="sum\\(split_sizes\\)"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="sorted_index.*permutation"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2, 3]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="split_sizes"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2.0, 3.0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="probs"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(4), torch.tensor([2, 3]), torch.tensor([1, 0]))


def test_refused_names_off_settings_are_tes():
    model = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    with te.onnx_export(enabled=False):
        y = model(x)
    assert torch.equal(y, model(x))
    ctx, sync = te.get_cpu_offload_context(enabled=False, num_layers=2, model_layers=2)
    with ctx:
        y = model(x)
    assert sync(y) is y
    ctx, sync, controller = te.get_cpu_offload_context(enabled=False, manual_synchronization=True)
    assert controller is None and sync(x) is x
    with pytest.raises(TypeError, match="enabled"):
        te.get_cpu_offload_context(enabled=1)
    with pytest.raises(TypeError, match="enabled"), te.onnx_export(enabled="yes"):
        pass
