"""The FP8 quantizers keep a few per-call facts between calls to cut host
work (benchmarks/bench_fp8_host.py); these tests pin when each is made
again, so a cached value can never outlive what it was read from:

- each role's FP8 dtype and the current-scaling margin are read from the
  recipe at every forward (GemmQuantizers.adopt): a recipe changed in place
  is seen by the next forward's casts and by its backward;
- an output gradient's cast (consumed by the backward GEMMs right after it)
  writes its scale_inv into a buffer that is not new each time: the
  delayed-scaling state's live slot, or the role's own buffer under current
  scaling; a forward cast (saved for the backward) always gets its own;
- a pool chunk's used-column views (the step's scale update) follow the
  chunk's growth;
- block scaling's transposed weight scales come out contiguous whether or
  not they need padding columns.
"""
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse import quantization
from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from seqfuse.quantization import gemm_quantizers as gq
from seqfuse.quantization.state import ScalingState

from helpers import needs_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _step(m, x, recipe):
    with te.autocast(recipe=recipe):
        y = m(x)
    y.float().sum().backward()
    return y


@needs_fp8
def test_format_changed_in_place_reaches_the_next_forward_and_its_backward(seed):
    r = Float8CurrentScaling(fp8_format=Format.HYBRID)
    m = te.Linear(32, 16, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    _step(m, x, r)
    q = m._fp8_quantizers
    assert (q.inputs[0].fp8_dtype, q.weights[0].fp8_dtype, q.grads[0].fp8_dtype) == (E4M3, E4M3, E5M2)
    r.fp8_format = Format.E4M3
    seen = []
    real = gq.GradQuantizer.quantize_grad

    def spy(self, dy, *args, **kwargs):
        out = real(self, dy, *args, **kwargs)
        seen.append(out[0].fp8_dtype)
        return out

    gq.GradQuantizer.quantize_grad = spy
    try:
        _step(m, x, r)
    finally:
        gq.GradQuantizer.quantize_grad = real
    assert q.grads[0].fp8_dtype == E4M3 and seen == [E4M3]
    # and the weight was cast again: its cache is keyed on the format
    assert q.weights[0].pair[0].fp8_dtype == E4M3


@needs_fp8
def test_margin_changed_in_place_reaches_the_next_current_scaling_cast(seed):
    r = Float8CurrentScaling()
    m = te.Linear(32, 16, bias=False, device="cpu", params_dtype=torch.float32)
    x = torch.randn(16, 32)
    x[0, 0] = 7.0  # the amax
    with te.autocast(recipe=r):
        m(x)
    q = m._fp8_quantizers
    xq0 = q.inputs[0].quantize(x)
    assert xq0.scale_inv.item() == pytest.approx(7.0 / 448.0, rel=1e-6)
    r.margin = 2
    with te.autocast(recipe=r):
        m(x)
    assert q.margin_now == 2
    xq2 = q.inputs[0].quantize(x)
    assert xq2.scale_inv.item() == pytest.approx(7.0 * 4 / 448.0, rel=1e-6)
    # the first result kept its own scale_inv (a forward cast's is saved for the backward)
    assert xq0.scale_inv.item() == pytest.approx(7.0 / 448.0, rel=1e-6)


@needs_fp8
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_gradient_casts_reuse_their_scale_inv_and_forward_casts_do_not(recipe, seed):
    m = te.Linear(32, 16, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):  # under delayed scaling every tensor has an amax history after two steps
        _step(m, x, recipe)
    q = m._fp8_quantizers
    dy = torch.randn(16, 16, dtype=torch.bfloat16)
    g1, db1 = q.grads[0].quantize_grad(dy, torch.bfloat16)
    si1 = g1.scale_inv.clone()
    g2, db2 = q.grads[0].quantize_grad(dy * 3, torch.bfloat16)
    assert g1.scale_inv.data_ptr() == g2.scale_inv.data_ptr()
    a1, a2 = q.inputs[0].quantize(x.detach()), q.inputs[0].quantize(x.detach())
    assert a1.scale_inv.data_ptr() != a2.scale_inv.data_ptr()
    if isinstance(recipe, DelayedScaling):
        # the state's live slot, which holds 1 / scale: what a new tensor would have received
        st = m.fp8_state
        assert g1.scale_inv.data_ptr() == st.scale_inv_of(2).data_ptr()
        assert torch.equal(si1, 1.0 / st.scale_of(2))
        assert torch.equal(g2.scale_inv, si1)
    else:
        # current scaling: the buffer holds the last cast's value (3 x the amax)
        assert g2.scale_inv.item() == pytest.approx(3 * si1.item(), rel=1e-2)
    # the values are the ones a cast into a new scale_inv gives
    ref = quantization.quantize_current(dy * 3, E5M2, transpose=True) if not isinstance(recipe, DelayedScaling) \
        else quantization.quantize(dy * 3, m.fp8_state.scale_of(2), None, E5M2, transpose=True)
    assert torch.equal(g2.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(g2.scale_inv, ref.scale_inv)


@needs_fp8
def test_chunk_used_columns_follow_new_states(seed):
    recipe = DelayedScaling(amax_history_len=7)  # (a chunk other tests are unlikely to share)
    a = ScalingState(3, recipe)
    a.ensure_pooled()
    chunk = a._chunk_ref()
    used = chunk.used
    hist = chunk.used_columns()[0]
    assert hist.shape == (7, used) and chunk.used_columns()[0] is hist  # kept while nothing moved
    b = ScalingState(3, recipe)
    b.ensure_pooled()
    assert b._chunk_ref() is chunk and chunk.used == used + 3
    assert chunk.used_columns()[0].shape == (7, used + 3)
    # the update reaches the new state's columns
    b.amax_of(0).fill_(2.0)
    quantization.reduce_and_update(recipe)
    assert b.scale[0].item() == pytest.approx(448.0 / 2.0)


@needs_fp8
@pytest.mark.parametrize("shape", [(512, 128), (512, 384), (384, 256)])
def test_block_weight_transposed_scales_are_contiguous(shape, seed):
    """Without padding columns (out_features / 128 a multiple of 4) and with."""
    w = torch.randn(shape).bfloat16()
    got = gq.block_weight_transposed(quantization.quantize_block(w, 128))
    want = quantization.quantize_block(w.t().contiguous(), 128)
    assert got.scale_inv.is_contiguous()
    assert torch.equal(got.scale_inv, want.scale_inv)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))


@pytest.mark.cuda
@needs_fp8
def test_current_scaling_scratch_is_not_shared_with_a_captured_graph(seed):
    """A cast captured into a CUDA graph gets scratch of its own: the role's
    buffers stay the eager ones, and an eager step after the capture gives
    the eager results."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    r = Float8CurrentScaling()
    m = te.Linear(128, 128, device="cuda", params_dtype=torch.bfloat16)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _step(m, x, r)
    q = m._fp8_quantizers
    eager = q.grads[0].act_scratch
    assert eager is not None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(m, x, r)  # warm-up on the capture stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            with te.autocast(recipe=r):
                y = m(x)
            y.float().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    assert q.grads[0].act_scratch is eager
    x.grad = None
    m.weight.grad = None
    y_eager = _step(m, x, r)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_eager, y)
