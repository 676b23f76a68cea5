"""FP8 attention on the GPU: cuDNN's FP8 graphs (seqfuse/ops/attn/_fp8.py,
through nvidia-cudnn-frontend; skipped where it is not installed) against the
CPU route on the same FP8 inputs and scales, and the module path
(DotProductAttention under DelayedScaling(fp8_dpa=True)) against the float64
exact attention within test_fp8_attention.py's stated bounds.

- kernel calls: forward and backward outputs written into poisoned buffers
  (every element written), bshd and sbhd, no mask and causal, grouped-query,
  head dim 128 (the forward also 32 and 64), a sequence length that is no
  multiple of 64; each route's dequantized results against the exact
  attention of the same FP8 inputs, cuDNN's error at most EXACT_FACTOR times
  the CPU route's or within KERNEL_BOUND_FORWARD / _BACKWARD (cuDNN tiles the key range
  and rescales its running maximum, so its probabilities and dS round
  differently from the CPU route's one block); both errors are printed;
- the module path over several training steps: outputs and gradients within
  FORWARD_BOUND / BACKWARD_BOUND of the exact attention, every scale finite, the
  history filled after the updates;
- the FP8 attention against torch's bf16 SDPA of the same inputs: both within
  bounds of the exact result.
Speed: benchmarks/attn/bench_fp8_attention.py.
Run on an H200: `python3 -m pytest -q tests/test_fp8_attention_cuda.py`."""
import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import poisoned_like, rel_error
from seqfuse.common.recipe import DelayedScaling
from seqfuse.ops import attn as attn_ops
from seqfuse.quantization import attention as fp8a
from seqfuse.quantization import autocast
from test_fp8_attention import BACKWARD_BOUND, FORWARD_BOUND, exact

_why = attn_ops.fp8_attention_unavailable("cuda") if torch.cuda.is_available() else "no GPU"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_why is not None, reason=str(_why))]

#: cuDNN against the CPU route on the same FP8 inputs: the probabilities
#: (and dS) round differently (cuDNN's running maximum and its own dS
#: format), so the bounds are about FP8's rounding error, not bf16's
KERNEL_BOUND_FORWARD = 0.03
KERNEL_BOUND_BACKWARD = 0.08
#: and against the exact attention of the same FP8 inputs, cuDNN's error at
#: most this many times the CPU route's (or the bound above)
EXACT_FACTOR = 1.5
DEV = "cuda"


def fp8_inputs(layout, b, s_q, s_kv, h, h_kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(s, heads, amp):
        shape = (b, s, heads, d) if layout == "bshd" else (s, b, heads, d)
        return (torch.randn(shape, generator=g) * amp).clamp(-440, 440).to(torch.float8_e4m3fn)

    return t(s_q, h, 60.0), t(s_kv, h_kv, 60.0), t(s_kv, h_kv, 60.0)


def scalars(values, device):
    return [torch.tensor([float(x)], device=device) for x in values]


def run_both(layout, b, s_q, s_kv, h, h_kv, d, causal, backward=True):
    """Forward and (``backward``) backward of the kernel calls on the CPU and
    on the GPU from the same FP8 tensors and scales; returns the dequantized
    results."""
    q, k, v = fp8_inputs(layout, b, s_q, s_kv, h, h_kv, d)
    do = (torch.randn(q.shape, generator=torch.Generator().manual_seed(3)) * 100).to(torch.float8_e5m2)
    res = {}
    for dev in ("cpu", DEV):
        qq, kk, vv, dd = (x.to(dev) for x in (q, k, v, do))
        dq_, dk_, dv_, ss, dss, so = scalars((1 / 60, 1 / 60, 1 / 60, 448.0, 1 / 448.0, 448.0 / 120), dev)
        o = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=dev)
        stats = torch.empty((b, h, s_q, 1), device=dev)
        amax_s, amax_o = torch.empty(1, device=dev), torch.empty(1, device=dev)
        if dev != "cpu":
            o, stats, amax_s, amax_o = (poisoned_like(x) for x in (o, stats, amax_s, amax_o))
        attn_ops.fp8_attention_forward(qq, kk, vv, dq_, dk_, dv_, ss, dss, so, o=o, stats=stats, amax_s=amax_s,
                                       amax_o=amax_o, layout=layout, causal=causal)
        if not backward:
            res[dev] = dict(o=o.float().cpu() * 120 / 448, stats=stats.cpu(), amax_s=amax_s.cpu(),
                            amax_o=amax_o.cpu())
            continue
        descale_o, descale_do, s_dp, s_g = scalars((120 / 448.0, 1 / 100, 2.0 ** 10, 2.0 ** 8), dev)
        descale_dp = torch.reciprocal(s_dp)
        grads = [torch.empty(x.shape, dtype=torch.float8_e5m2, device=dev) for x in (q, k, v)]
        amaxes = [torch.empty(1, device=dev) for _ in range(4)]
        if dev != "cpu":
            grads = [poisoned_like(x) for x in grads]
            amaxes = [poisoned_like(x) for x in amaxes]
        attn_ops.fp8_attention_backward(qq, kk, vv, o, dd, stats, dq_, dk_, dv_, descale_o, descale_do, dss,
                                        descale_dp, ss, s_dp, s_g, s_g, s_g, dq=grads[0], dk=grads[1],
                                        dv=grads[2], amax_dq=amaxes[0], amax_dk=amaxes[1], amax_dv=amaxes[2],
                                        amax_dp=amaxes[3], layout=layout, causal=causal)
        res[dev] = dict(o=o.float().cpu() * 120 / 448, stats=stats.cpu(), amax_s=amax_s.cpu(), amax_o=amax_o.cpu(),
                        dq=grads[0].float().cpu() / 2 ** 8, dk=grads[1].float().cpu() / 2 ** 8,
                        dv=grads[2].float().cpu() / 2 ** 8, amaxes=torch.cat(amaxes).cpu())
    return res["cpu"], res[DEV]


@pytest.mark.parametrize("layout,b,s_q,s_kv,h,h_kv,d,causal", [
    ("bshd", 2, 256, 256, 4, 4, 128, False),
    ("bshd", 2, 256, 256, 4, 4, 128, True),
    ("sbhd", 1, 256, 256, 8, 2, 128, True),
    ("bshd", 1, 128, 384, 4, 1, 128, False),
])
def test_kernel_calls_match_the_cpu_route(layout, b, s_q, s_kv, h, h_kv, d, causal):
    cpu, gpu = run_both(layout, b, s_q, s_kv, h, h_kv, d, causal)
    errs = {name: rel_error(gpu[name], cpu[name]) for name in ("o", "dq", "dk", "dv", "stats")}
    # each route against the exact attention (float64) of the same FP8 inputs: cuDNN's own roundings
    # may differ from the CPU route's, but must not be worse by much
    q, k, v = (x.double() / 60 for x in fp8_inputs(layout, b, s_q, s_kv, h, h_kv, d))
    do = (torch.randn(q.shape, generator=torch.Generator().manual_seed(3)) * 100).to(torch.float8_e5m2).double() / 100
    xs = [x.requires_grad_() for x in (q, k, v)]
    o = exact(*xs, layout, causal)
    o.backward(do)
    ref = dict(o=o.detach(), dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad)
    to_exact = {name: (rel_error(gpu[name], ref[name]), rel_error(cpu[name], ref[name])) for name in ref}
    print(f"\nfp8 attention cuDNN vs CPU route {layout} b{b} s{s_q}/{s_kv} h{h}/{h_kv} d{d} causal={causal}: "
          + " ".join(f"{n} {e:.4f}" for n, e in errs.items())
          + " | against exact, cuDNN/CPU: " + " ".join(f"{n} {g:.4f}/{c:.4f}" for n, (g, c) in to_exact.items())
          + f" | amax_s {gpu['amax_s'].item():.4g}/{cpu['amax_s'].item():.4g}"
          + f" amax_o {gpu['amax_o'].item():.4g}/{cpu['amax_o'].item():.4g}"
          + f" amaxes {gpu['amaxes'].tolist()} / {cpu['amaxes'].tolist()}")
    for name in ("o", "dq", "dk", "dv"):
        assert torch.isfinite(gpu[name]).all(), name
        bound = KERNEL_BOUND_FORWARD if name == "o" else KERNEL_BOUND_BACKWARD
        g, c = to_exact[name]
        assert g <= max(EXACT_FACTOR * c, bound), (name, g, c)
    assert errs["o"] <= KERNEL_BOUND_FORWARD and errs["stats"] <= 1e-4
    # the amaxes the delayed scales come from: max P / rowsum, max|O|, max|dQ|, |dK|, |dV|, and max|dS| for "dP"
    assert gpu["amax_s"].item() == pytest.approx(cpu["amax_s"].item(), rel=KERNEL_BOUND_FORWARD)
    assert gpu["amax_o"].item() == pytest.approx(cpu["amax_o"].item(), rel=KERNEL_BOUND_FORWARD)
    assert torch.allclose(gpu["amaxes"], cpu["amaxes"], rtol=KERNEL_BOUND_BACKWARD)


@pytest.mark.parametrize("layout,b,s,h,h_kv,d,causal", [("bshd", 2, 256, 4, 4, 64, True), ("sbhd", 1, 200, 8, 2, 64, False),
                                                     ("bshd", 1, 300, 2, 1, 32, True)])
def test_kernel_forward_at_other_head_dims(layout, b, s, h, h_kv, d, causal):
    """The FP8 forward (inference) at head dims other than 128; the backward
    there is refused by cuDNN (DotProductAttention then trains in bf16)."""
    cpu, gpu = run_both(layout, b, s, s, h, h_kv, d, causal, backward=False)
    assert torch.isfinite(gpu["o"]).all()
    assert rel_error(gpu["o"], cpu["o"]) <= KERNEL_BOUND_FORWARD, rel_error(gpu["o"], cpu["o"])
    assert rel_error(gpu["stats"], cpu["stats"]) <= 1e-4


def test_kernel_backward_at_200_tokens_is_less_exact():
    """Why DotProductAttention trains FP8 only at sequence lengths that are
    multiples of 128: at 200 tokens (causal) cuDNN's dQ error against the
    exact attention is about 1.5x the CPU route's (dK, dV and O agree); if a
    cuDNN release fixes it, this fails and the rule can go."""
    cpu, gpu = run_both("bshd", 1, 200, 200, 8, 2, 128, True)
    q, k, v = (x.double() / 60 for x in fp8_inputs("bshd", 1, 200, 200, 8, 2, 128))
    do = (torch.randn(q.shape, generator=torch.Generator().manual_seed(3)) * 100).to(torch.float8_e5m2).double() / 100
    xs = [x.requires_grad_() for x in (q, k, v)]
    exact(*xs, "bshd", True).backward(do)
    g, c = rel_error(gpu["dq"], xs[0].grad), rel_error(cpu["dq"], xs[0].grad)
    assert g > 1.3 * c, (g, c)
    for name, x in (("dk", xs[1]), ("dv", xs[2])):
        assert rel_error(gpu[name], x.grad) <= 1.05 * rel_error(cpu[name], x.grad)


def test_module_trains_fp8_only_at_multiples_of_128_tokens(caplog, monkeypatch):
    import logging
    from seqfuse.modules import attention as attention_module
    monkeypatch.setattr(attention_module, "_fp8_refusals_logged", set())
    dpa = te.DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (torch.randn(1, 200, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="seqfuse"), autocast(enabled=True,
                                                                      recipe=DelayedScaling(fp8_dpa=True)):
        dpa(q, k, v).sum().backward()
    assert "fp8_state" not in dpa._modules
    assert any("multiples of 128" in r.getMessage() for r in caplog.records)
    state = fp8a.attention_state(DelayedScaling(), DEV)
    with pytest.raises(ValueError, match="fp8_attention: on CUDA a call that will be differentiated needs sequence "
                                         "lengths that are multiples of 128"):
        fp8a.fp8_attention(q, k, v, state, attn_mask_type="causal")
    with torch.no_grad():  # inference takes any length
        assert fp8a.fp8_attention(q, k, v, state, attn_mask_type="causal").shape == q.shape


def test_module_head_dim_64_trains_bf16_with_a_warning_and_infers_fp8(caplog, monkeypatch):
    import logging
    from seqfuse.modules import attention as attention_module
    monkeypatch.setattr(attention_module, "_fp8_refusals_logged", set())
    recipe = DelayedScaling(fp8_dpa=True)
    dpa = te.DotProductAttention(8, 64, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (torch.randn(2, 256, 8, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="seqfuse"), autocast(enabled=True, recipe=recipe):
        plain = dpa(q, k, v)
    assert "fp8_state" not in dpa._modules
    assert any("head dim 128 only" in r.getMessage() for r in caplog.records)
    with torch.no_grad(), autocast(enabled=True, recipe=recipe):
        out = dpa(q, k, v)
    assert "fp8_state" in dpa._modules
    ref = exact(q, k, v, "bshd", True).reshape(out.shape)
    assert 1e-2 < rel_error(out, ref) <= FORWARD_BOUND and rel_error(plain, ref) <= 1e-2


@pytest.mark.parametrize("layout,mask,h_kv,d", [("bshd", "causal", 8, 128), ("sbhd", "no_mask", 2, 128),
                                               ("bshd", "causal_bottom_right", 1, 128)])
def test_module_training_steps_within_bounds(layout, mask, h_kv, d):
    torch.manual_seed(0)
    recipe = DelayedScaling(fp8_dpa=True, amax_history_len=8)
    dpa = te.DotProductAttention(8, d, num_gqa_groups=h_kv, qkv_format=layout, attn_mask_type=mask)
    for step in range(4):
        g = torch.Generator(device=DEV).manual_seed(step)
        shape = lambda heads: (2, 512, heads, d) if layout == "bshd" else (512, 2, heads, d)  # noqa: E731
        q = torch.randn(shape(8), generator=g, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(shape(h_kv), generator=g, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(shape(h_kv), generator=g, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(shape(8), generator=g, device=DEV, dtype=torch.bfloat16) * 1e-4
        with autocast(enabled=True, recipe=recipe):
            out = dpa(q, k, v)
        out.backward(dout.reshape(out.shape))
        xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref = exact(*xs, layout, mask != "no_mask")
        ref.backward(dout.double())
        assert rel_error(out, ref.reshape(out.shape)) <= FORWARD_BOUND
        for name, x, r in zip("qkv", (q, k, v), xs):
            assert torch.isfinite(x.grad).all()
            assert rel_error(x.grad, r.grad) <= BACKWARD_BOUND, (step, name, rel_error(x.grad, r.grad))
    state = dpa.fp8_state
    assert all(state.has_history(i) for i in range(9))
    assert bool(torch.isfinite(state.scale).all()) and bool((state.scale > 0).all())


def test_fp8_and_bf16_sdpa_both_near_exact():
    """Numerics against bf16 attention: torch's bf16 SDPA error and FP8's,
    against one exact reference, each within its bound."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 8, 128, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    state = fp8a.attention_state(DelayedScaling(), DEV)
    out = fp8a.fp8_attention(q, k, v, state, attn_mask_type="causal")
    bf16 = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
    ref = exact(q, k, v, "bshd", True)
    e_fp8, e_bf16 = rel_error(out, ref), rel_error(bf16, ref)
    assert e_bf16 <= 1e-2 and e_fp8 <= FORWARD_BOUND, (e_fp8, e_bf16)
