"""FusedAdamW, clip_grad_norm_ and the multi-tensor ops against torch: fp32
parameters against torch.optim.AdamW over 20 steps, bf16 parameters with fp32
master weights against fp32 AdamW run on the masters, state_dict round trips
that resume bit for bit, the l2 norm against a float64 reference, bad inputs,
and the CUDA kernels against the CPU backend."""
import copy
import os
import io

import pytest
import torch

import seqfuse
import seqfuse.optim
from seqfuse.distributed import end_process_group
from seqfuse.optim import FusedAdamW, clip_grad_norm_
from seqfuse.ops import multi_tensor_adamw, multi_tensor_l2norm, multi_tensor_scale
from helpers import needs_cpu_fsdp2, no_host_sync

SHAPES = [(7,), (33, 17), (65536 + 5,), (3, 4, 5), (1,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(dtype, device="cpu", shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]


def fill_grads(params, step, gen_device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(device=p.device, dtype=p.dtype)


def step_both(ours, params, theirs, ref, steps, first=0):
    """``steps`` updates of both optimizers, each on the same gradients
    (fill_grads of steps first, first + 1, ...)."""
    for step in range(first, first + steps):
        fill_grads(params, step)
        fill_grads(ref, step)
        ours.step()
        theirs.step()


def max_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp32_matches_torch_adamw_20_steps(device, seed):
    params = make_params(torch.float32, device)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdamW(params, **HYPER)
    theirs = torch.optim.AdamW(ref, foreach=False, **HYPER)
    step_both(ours, params, theirs, ref, 20)
    for p, r in zip(params, ref):
        assert max_rel(p.detach(), r.detach()) < 1e-5
        st, rt = ours.state[p], theirs.state[r]
        assert max_rel(st["exp_avg"], rt["exp_avg"]) < 1e-5
        assert max_rel(st["exp_avg_sq"], rt["exp_avg_sq"]) < 1e-5
        assert st["step"] == 20


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_match_fp32_adamw_on_the_master(device, dtype, seed):
    params = make_params(dtype, device)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = FusedAdamW(params, **HYPER)
    theirs = torch.optim.AdamW(masters, foreach=False, **HYPER)
    for step in range(20):
        fill_grads(params, step)
        for m, p in zip(masters, params):
            m.grad = p.grad.float()  # the same low-precision gradient, widened
        ours.step()
        theirs.step()
    for p, m in zip(params, masters):
        master = ours.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert max_rel(master, m.detach()) < 1e-5
        assert torch.equal(p.detach(), master.to(dtype)), "params must be the rounded master"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_without_master_rounds_every_step(device, seed):
    params = make_params(torch.bfloat16, device, shapes=[(100,)])
    opt = FusedAdamW(params, master_weights=False, **HYPER)
    ref = params[0].detach().float().clone()
    m = torch.zeros_like(ref)
    v = torch.zeros_like(ref)
    for step in range(1, 6):
        fill_grads(params, step)
        g = params[0].grad.float()
        opt.step()
        # the same fp32 formula, rounding the parameter to bf16 after each step
        ref = ref * (1 - HYPER["lr"] * HYPER["weight_decay"])
        m = m.lerp(g, 1 - 0.9)
        v = v * 0.95 + 0.05 * g * g
        denom = v.sqrt() / (1 - 0.95 ** step) ** 0.5 + 1e-8
        ref = (ref - HYPER["lr"] / (1 - 0.9 ** step) * m / denom).to(torch.bfloat16).float()
    assert "master_param" not in opt.state[params[0]]
    assert max_rel(params[0].detach().float(), ref) < 1e-2


def bf16_moment_reference(p, m, v, g, step):
    """One step of the bf16-moment update in float64: the moments read from
    bf16, updated, stored rounded to bf16; the parameter updated from the
    unrounded moments, then rounded to bf16 (torch's fused AdamW on bf16
    parameters).  Returns the bf16 (p, m, v) and, for each, the scale of the
    terms it was computed from (fp32 arithmetic is exact to about 2^-24 of
    that scale, which is more than a bf16 ulp of a result that cancels to
    near zero)."""
    p64, m64, v64, g64 = p.double(), m.double(), v.double(), g.double()
    p64 = p64 * (1 - HYPER["lr"] * HYPER["weight_decay"])
    m_new = m64 + (1 - 0.9) * (g64 - m64)
    v_new = v64 * 0.95 + 0.05 * g64 * g64
    denom = v_new.sqrt() / (1 - 0.95 ** step) ** 0.5 + 1e-8
    delta = HYPER["lr"] / (1 - 0.9 ** step) * m_new / denom
    scales = (torch.maximum(p64.abs(), delta.abs()), torch.maximum(m64.abs(), g64.abs()),
              torch.maximum(v64, g64 * g64))
    return (p64 - delta).to(torch.bfloat16), m_new.to(torch.bfloat16), v_new.to(torch.bfloat16), scales


def ulps_apart(a, b, scale=None):
    """The largest distance between two bf16 tensors in units of the larger
    value's last place (or, where the values cancelled to below 2^-13 of
    ``scale``, of that floor's: a last place of 2^-20 of the terms, the few
    fp32 roundings of a result made from terms that size)."""
    a, b = a.double(), b.double()
    size = torch.maximum(a.abs(), b.abs())
    if scale is not None:
        size = torch.maximum(size, scale.double() * 2.0 ** -13)
    return ((a - b).abs() / (size.clamp_min(1e-30) * 2.0 ** -7)).max().item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("master", [False, True])
def test_bf16_moments_match_a_float64_reference(device, master, seed):
    """bf16 moments: every step's moments and parameter within one bf16 ulp
    of a float64 emulation fed the kernel's own previous state (so the test
    measures one step's rounding, not drift)."""
    params = make_params(torch.bfloat16, device)
    opt = FusedAdamW(params, master_weights=master, exp_avg_dtype=torch.bfloat16,
                     exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    for step in range(1, 8):
        fill_grads(params, step)
        before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone(),
                   opt.state[p].get("master_param")) if opt.state[p] else
                  (p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p), None) for p in params]
        before = [(b[0] if b[3] is None else b[3].clone(), b[1], b[2]) for b in before]
        opt.step()
        for p, (p0, m0, v0) in zip(params, before):
            st = opt.state[p]
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
            rp, rm, rv, (sp, sm, sv) = bf16_moment_reference(p0, m0, v0, p.grad, step)
            assert ulps_apart(st["exp_avg"], rm, sm) <= 1 and ulps_apart(st["exp_avg_sq"], rv, sv) <= 1, step
            assert ulps_apart(p.detach(), rp, sp) <= 1, step
            if master:
                assert st["master_param"].dtype == torch.float32
                assert torch.equal(p.detach(), st["master_param"].to(torch.bfloat16))


@pytest.mark.cuda
def test_bf16_moments_make_torch_fused_adamws_update(seed):
    """The point of bf16 moments: torch.optim.AdamW(fused=True) on bf16
    parameters keeps bf16 moments and computes in fp32; FusedAdamW with
    master_weights=False and bf16 moments makes that update.  After three
    steps each on its own (the trajectories part by roundings: the two fp32
    formulas differ in operation order), FusedAdamW takes torch's parameters
    and moments and both take one more step: every parameter within one
    bf16 ulp of its value or of the step's size (lr), every moment within
    one ulp; the state takes 4 bytes per parameter, as torch's does."""
    params = make_params(torch.bfloat16, "cuda")
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdamW(params, master_weights=False, exp_avg_dtype=torch.bfloat16,
                      exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    theirs = torch.optim.AdamW(ref, fused=True, **HYPER)
    step_both(ours, params, theirs, ref, 3)
    with torch.no_grad():
        for p, r in zip(params, ref):
            p.copy_(r)
            for key in ("exp_avg", "exp_avg_sq"):
                ours.state[p][key].copy_(theirs.state[r][key])
    step_both(ours, params, theirs, ref, 1, first=3)
    ulp = 2.0 ** -7
    for p, r in zip(params, ref):
        a, b = p.detach().float(), r.detach().float()
        assert ((a - b).abs() <= (torch.maximum(a.abs(), b.abs()) + HYPER["lr"]) * ulp).all()
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = ours.state[p][key], theirs.state[r][key]
            assert x.dtype == y.dtype == torch.bfloat16
            x, y = x.float(), y.float()
            assert ((x - y).abs() <= torch.maximum(x.abs(), y.abs()) * ulp + 1e-7).all(), key
    state_bytes = sum(t.numel() * t.element_size() for st in ours.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor))
    assert state_bytes == 4 * sum(p.numel() for p in params)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_moments_state_dict_resumes_bit_exactly(device, seed):
    params = make_params(torch.bfloat16, device) + make_params(torch.float32, device, shapes=[(9, 9)])
    opt = FusedAdamW(params, master_weights=False, exp_avg_dtype=torch.bfloat16,
                     exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    for step in range(4):
        fill_grads(params, step)
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
    # the hyper-parameters come from the state dict, the moment dtype from the constructor (TE's rule)
    opt2 = FusedAdamW(params2, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt2.load_state_dict(ckpt["opt"])
    for step in range(4, 9):
        for ps, o in ((params, opt), (params2, opt2)):
            fill_grads(ps, step)
            o.step()
    for p, q in zip(params, params2):
        assert torch.equal(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[q][key].dtype == torch.bfloat16
            assert torch.equal(opt.state[p][key], opt2.state[q][key]), key


def test_load_state_dict_converts_moments_only_when_asked(caplog):
    """A checkpoint with fp32 moments loaded into a bf16-moment optimizer is
    refused (it was converted to bf16, rounding the saved moments, with only
    a log line); setting the state dict's moment_dtype to bf16 asks for the
    conversion: the moments are rounded to bf16 and a warning says so.  The
    other way round (bf16 saved, fp32 asked for) they are widened exactly.
    tests/test_optim_bad_inputs.py has the refusals in detail."""
    params = make_params(torch.bfloat16, shapes=[(64,)])
    fp32 = FusedAdamW(params, **HYPER)
    fill_grads(params, 0)
    fp32.step()
    bf16 = FusedAdamW(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **HYPER)
    sd = fp32.state_dict()
    with pytest.raises(ValueError, match="saved with moment_dtype=torch.float32, but this optimizer's "
                                         r"param_groups\[0\] keeps its moments in torch.bfloat16"):
        bf16.load_state_dict(sd)
    assert not bf16.state
    sd["param_groups"][0]["moment_dtype"] = torch.bfloat16
    with caplog.at_level("WARNING", logger="seqfuse"):
        bf16.load_state_dict(sd)
    st = bf16.state[params[0]]
    assert st["exp_avg"].dtype == torch.bfloat16 and bf16.param_groups[0]["moment_dtype"] == torch.bfloat16
    assert torch.equal(st["exp_avg"], fp32.state[params[0]]["exp_avg"].to(torch.bfloat16))
    assert "saved exp_avg in torch.float32 converted to this optimizer's torch.bfloat16" in caplog.text
    back = FusedAdamW(params, **HYPER)
    sd = bf16.state_dict()
    sd["param_groups"][0]["moment_dtype"] = torch.float32
    back.load_state_dict(sd)
    assert torch.equal(back.state[params[0]]["exp_avg_sq"], st["exp_avg_sq"].float())


def test_moment_dtype_rules():
    p = make_params(torch.bfloat16, shapes=[(4,)])
    with pytest.raises(NotImplementedError, match="'exp_avg_dtype'=torch.float16 is not supported"):
        FusedAdamW(p, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    with pytest.raises(TypeError, match="'exp_avg_sq_dtype' must be a torch.dtype, got str"):
        FusedAdamW(p, exp_avg_sq_dtype="bf16")
    with pytest.raises(NotImplementedError, match="'exp_avg_dtype'=torch.float16"):
        FusedAdamW(p).add_param_group({"params": make_params(torch.bfloat16, shapes=[(2,)]),
                                       "moment_dtype": torch.float16})
    with pytest.raises(NotImplementedError, match="'exp_avg_dtype'.*'exp_avg_sq_dtype'.*must be equal"):
        FusedAdamW(p, exp_avg_dtype=torch.bfloat16)
    # the op: the two moment lists in one dtype, float32 or bfloat16
    g = [torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match="exp_avg_sq\\[0\\].*bfloat16"):
        multi_tensor_adamw([p[0]], g, [torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)], None,
                           1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match="exp_avg\\[0\\].*float32 or bfloat16"):
        multi_tensor_adamw([p[0]], g, [torch.zeros(4, dtype=torch.float16)], [torch.zeros(4, dtype=torch.float16)],
                           None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_state_dict_resumes_bit_exactly(device, seed):
    def run(params, opt, steps):
        for step in steps:
            fill_grads(params, step)
            opt.step()

    params = make_params(torch.bfloat16, device) + make_params(torch.float32, device, shapes=[(9, 9)])
    opt = FusedAdamW(params, **HYPER)
    run(params, opt, range(5))
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    run(params, opt, range(5, 12))

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    params2 = [torch.nn.Parameter(t.clone()) for t in ckpt["params"]]
    opt2 = FusedAdamW(params2, lr=0.5)  # hyper-parameters come from the state dict
    opt2.load_state_dict(ckpt["opt"])
    assert opt2.param_groups[0]["lr"] == HYPER["lr"]
    assert opt2.state[params2[0]]["master_param"].dtype == torch.float32
    run(params2, opt2, range(5, 12))
    for p, q in zip(params, params2):
        assert torch.equal(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in opt.state[p]:
                assert torch.equal(opt.state[p][key], opt2.state[q][key]), key
        assert opt.state[p]["step"] == opt2.state[q]["step"] == 12


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_main_grad_fp32_gradients_for_bf16_params(device, seed):
    """use_main_grad: bf16 params updated from float32 main_grad buffers (p.grad None),
    exactly as fp32 AdamW on the masters with those gradients."""
    params = make_params(torch.bfloat16, device)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = FusedAdamW(params, use_main_grad=True, **HYPER)
    theirs = torch.optim.AdamW(masters, foreach=False, **HYPER)
    for step in range(5):
        for p, m in zip(params, masters):
            p.main_grad = torch.randn(p.shape, device=device) * 0.1
            m.grad = p.main_grad.clone()
            assert p.grad is None
        ours.step()
        theirs.step()
    for p, m in zip(params, masters):
        assert max_rel(ours.state[p]["master_param"], m.detach()) < 1e-5
    total = clip_grad_norm_(params, 1e9, use_main_grad=True)
    expect = torch.sqrt(sum((p.main_grad.double() ** 2).sum() for p in params))
    assert abs(total.item() - expect.item()) < 1e-5 * expect.item()


def test_params_without_grad_and_groups(seed):
    a, b, c = make_params(torch.float32, shapes=[(4,), (5,), (6,)])
    opt = FusedAdamW([{"params": [a, b]}, {"params": [c], "lr": 0.0, "weight_decay": 0.0}], **HYPER)
    c0 = c.detach().clone()
    b0 = b.detach().clone()
    fill_grads([a, c], 0)
    opt.step()
    assert torch.equal(b.detach(), b0) and b not in opt.state
    assert torch.equal(c.detach(), c0)  # lr 0 and no decay: unchanged
    fill_grads([a, b, c], 1)
    opt.step()  # a at step 2, b at step 1: separate launches
    assert opt.state[a]["step"] == 2 and opt.state[b]["step"] == 1


def test_closure_and_zero_grad(seed):
    p = make_params(torch.float32, shapes=[(3,)])[0]
    opt = FusedAdamW([p], **HYPER)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() > 0 and opt.state[p]["step"] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_l2norm_and_clip_match_torch(device, seed):
    shapes = SHAPES + [(200, 1000)]
    params = [torch.nn.Parameter(torch.randn(s, device=device).to(dt))
              for s, dt in zip(shapes, [torch.float32, torch.bfloat16, torch.float16] * 3)]
    for p in params:
        p.grad = torch.randn(p.shape, device=device).to(p.dtype)
    ref_params = copy.deepcopy(params)
    for p, r in zip(params, ref_params):
        r.grad = p.grad.clone()
    expect = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    norm = multi_tensor_l2norm([p.grad for p in params])
    assert norm.dtype == torch.float32 and norm.device.type == device
    assert abs(norm.item() - expect.item()) / expect.item() < 1e-5
    orig = [p.grad.clone() for p in params]
    total = clip_grad_norm_(params, 1.5)
    assert abs(total.item() - expect.item()) / expect.item() < 1e-5
    # torch takes each tensor's norm in its own dtype (bf16/fp16 rounding): agree loosely
    ref_total = torch.nn.utils.clip_grad_norm_(ref_params, 1.5)
    assert abs(total.item() - ref_total.item()) / ref_total.item() < 1e-3
    coef = min(1.0, 1.5 / (expect.item() + 1e-6))
    for p, g in zip(params, orig):
        tol = 1e-6 if p.dtype == torch.float32 else 1e-2
        assert max_rel(p.grad, (g.double() * coef).to(p.dtype)) <= tol
    # already small: the coefficient is clamped to 1, gradients unchanged
    before = [p.grad.clone() for p in params]
    clip_grad_norm_(params, 1e6)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))


def test_l2norm_deterministic_and_empty(seed):
    ts = [torch.randn(1000), torch.randn(0), torch.randn(3)]
    a, b = multi_tensor_l2norm(ts), multi_tensor_l2norm(ts)
    assert torch.equal(a, b)
    assert multi_tensor_l2norm([torch.zeros(0)]).item() == 0.0
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0  # no grads


def test_multi_tensor_scale(seed):
    ts = [torch.randn(10), torch.randn(7).to(torch.bfloat16)]
    ref = [t.float() * 0.25 for t in ts]
    multi_tensor_scale(ts, torch.tensor(0.25))
    assert torch.equal(ts[0], ref[0]) and torch.equal(ts[1], ref[1].to(torch.bfloat16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_multi_tensor_scale_by_one_keeps_every_bit(device, seed):
    """A scale of exactly 1 leaves every bit as it was (the pass is skipped:
    a signalling NaN, which a multiply by 1 quiets, -0 and infinities
    included); the next float32 above 1 multiplies."""
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0])
    f32 = torch.cat([torch.randn(5000), special]).to(device)
    f32.view(torch.int32)[0] = 0x7F800123  # (a signalling NaN: a multiply by 1 would quiet it)
    bf16 = torch.cat([torch.randn(3000), special]).to(device, torch.bfloat16)
    bf16.view(torch.int16)[0] = 0x7F81
    ts = [f32, bf16]
    before = [t.clone() for t in ts]
    multi_tensor_scale(ts, torch.ones((), device=device))
    assert all(torch.equal(t.view(torch.uint8), b.view(torch.uint8)) for t, b in zip(ts, before))
    up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    multi_tensor_scale(ts, up.to(device))
    ref = before[0].double() * up.double()
    finite = torch.isfinite(ref) & (ref != 0)
    assert not torch.equal(ts[0][finite], before[0][finite])
    assert torch.equal(ts[0][finite], (before[0][finite] * up.to(device))), "float32: one rounding of x * s"


def test_many_tensors_cross_launch_boundaries(seed):
    """More tensors than one launch's table holds (64 for AdamW)."""
    params = make_params(torch.float32, shapes=[(i % 5 + 1,) for i in range(150)])
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = FusedAdamW(params, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    step_both(ours, params, theirs, ref, 3)
    # (an absolute floor: a one-element parameter that ends near zero, e.g. 4.4e-5, differs from torch's in
    # float32's last bits, 4.7e-10, which is a relative 1.06e-5 at seed 1135666803)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-8)


def test_bad_inputs():
    p = torch.zeros(4)
    g = torch.zeros(4)
    m, v = torch.zeros(4), torch.zeros(4)
    with pytest.raises(TypeError, match=r"'grads\[0\]' must have dtype float32 \(the params'\) or float32, got bfloat16"):
        multi_tensor_adamw([p], [g.bfloat16()], [m], [v], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match=r"'grads\[1\]' must have dtype float32, got bfloat16"):
        multi_tensor_adamw([p.bfloat16()] * 2, [g, g.bfloat16()], [m, m.clone()], [v, v.clone()], None,
                           0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"'exp_avg\[0\]' must have 4 element"):
        multi_tensor_adamw([p], [g], [torch.zeros(3)], [v], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match=r"'exp_avg_sq\[0\]' must have dtype float32"):
        multi_tensor_adamw([p], [g], [m], [v.half()], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="'master' is for fp16/bf16 params"):
        multi_tensor_adamw([p], [g], [m], [v], [torch.zeros(4)], 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="'step' must be >= 1"):
        multi_tensor_adamw([p], [g], [m], [v], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 0)
    with pytest.raises(ValueError, match="'betas' must lie in"):
        multi_tensor_adamw([p], [g], [m], [v], None, 0.1, 1.0, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"'params' \(1 tensors\) and 'grads' \(2 tensors\)"):
        multi_tensor_adamw([p], [g, g], [m], [v], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"'params\[1\]' must be contiguous"):
        multi_tensor_adamw([p, torch.zeros(4, 2).t()], [g, torch.zeros(8)], [m, torch.zeros(8)],
                           [v, torch.zeros(8)], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match="must be a list of tensors"):
        multi_tensor_adamw(p, [g], [m], [v], None, 0.1, 0.9, 0.99, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match=r"'tensors\[0\]' must have dtype float32, float16 or bfloat16"):
        multi_tensor_l2norm([torch.zeros(3, dtype=torch.int32)])
    with pytest.raises(NotImplementedError, match="2-norm only"):
        clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0, norm_type=1.0)
    with pytest.raises(ValueError, match="'lr' must be >= 0"):
        FusedAdamW([torch.nn.Parameter(p)], lr=-1.0)
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdamW([torch.nn.Parameter(p)], amsgrad=True)
    assert seqfuse.optim.FusedAdamW is FusedAdamW


# ---- CUDA -----------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype,master,fp32_grads", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                     (torch.bfloat16, False, False), (torch.float16, True, False),
                                                     (torch.bfloat16, True, True), (torch.float16, False, True)])
def test_cuda_adamw_matches_cpu_backend(dtype, master, fp32_grads, seed):
    shapes = [(5,), (65536 * 3 + 7,), (1000, 333), (1,)] + [(i + 1,) for i in range(70)]
    base = [torch.randn(s).to(dtype) for s in shapes]
    grads = [torch.randn(s).to(torch.float32 if fp32_grads else dtype) for s in shapes]
    ms = [torch.randn(s).abs() * 0.1 for s in shapes]
    vs = [torch.randn(s).abs() * 0.01 for s in shapes]
    ws = [b.float() + torch.randn(b.shape) * 1e-3 for b in base] if master else None

    def run(device):
        p = [b.to(device, copy=True) for b in base]  # copies: each backend starts from the same state
        if device == "cuda":  # poison what the kernel writes, keeping the inputs it reads
            if master:
                for t in p:
                    t.fill_(float("nan"))
        args = ([g.to(device, copy=True) for g in grads], [m.to(device, copy=True) for m in ms],
                [v.to(device, copy=True) for v in vs], [w.to(device, copy=True) for w in ws] if master else None)
        multi_tensor_adamw(p, *args, 3e-3, 0.9, 0.95, 1e-8, 0.1, 7)
        return p, args

    pc, (_, mc, vc, wc) = run("cpu")
    pg, (_, mg, vg, wg) = run("cuda")
    for i in range(len(shapes)):
        assert max_rel(pg[i].cpu(), pc[i]) <= (1e-6 if dtype == torch.float32 else 1e-2)
        # the moments to fp32's precision of the terms they are made from (a moment that cancels to
        # near zero carries the terms' rounding, and the GPU contracts multiply-adds where the CPU does not)
        g = grads[i].float()
        assert ((mg[i].cpu() - mc[i]).abs() <= 1e-6 * torch.maximum(ms[i].abs(), g.abs())).all()
        assert ((vg[i].cpu() - vc[i]).abs() <= 1e-6 * torch.maximum(vs[i], g * g)).all()
        if master:
            assert max_rel(wg[i].cpu(), wc[i]) <= 1e-6


@pytest.mark.cuda
def test_cuda_unaligned_views(seed):
    flat = torch.randn(10001, device="cuda")
    views = [flat[1:4097], flat[4097:9000], flat[9001:]]  # 4-byte offsets: scalar path
    grads = [torch.randn_like(v) for v in views]
    ref = [torch.nn.Parameter(v.detach().cpu().clone()) for v in views]
    for r, g in zip(ref, grads):
        r.grad = g.cpu()
    torch.optim.AdamW(ref, foreach=False, **HYPER).step()
    ms = [torch.zeros_like(v) for v in views]
    vs = [torch.zeros_like(v) for v in views]
    multi_tensor_adamw(views, grads, ms, vs, None, HYPER["lr"], 0.9, 0.95, 1e-8, HYPER["weight_decay"], 1)
    for v, r in zip(views, ref):
        assert max_rel(v.cpu(), r.detach()) < 1e-5
    norm = multi_tensor_l2norm(views)
    assert abs(norm.item() - torch.cat([v.double() for v in views]).norm().item()) < 1e-4 * norm.item()


@pytest.mark.cuda
def test_cuda_clip_does_not_sync():
    params = [torch.nn.Parameter(torch.randn(1 << 20, device="cuda")) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    with no_host_sync():
        total = clip_grad_norm_(params, 1.0)
        opt = FusedAdamW(params, lr=1e-3)
        opt.step()
    assert total.item() > 1.0


# ---- FSDP2 (DTensor parameters), two processes on gloo -------------------
#
# Each worker shards a small model with fully_shard (dim-0 shards, uneven:
# 33 rows over 2 ranks, and a (1,) bias that leaves rank 1 an empty shard)
# and holds an unsharded copy of the same model.  Results go to files the
# test reads.

FSDP_WORLD = 2
FSDP_HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _fsdp_model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 9),
                               torch.nn.GELU(), torch.nn.Linear(9, 1)).to(dtype)


def _fsdp_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_worker(rank, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=FSDP_WORLD)
    ok = False
    try:
        _fsdp_body(rank, out_dir)  # its models and meshes are garbage once it returns
        ok = True
    finally:
        end_process_group(ok)


def _fsdp_body(rank, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = init_device_mesh("cpu", (FSDP_WORLD,))
    out = {}

    # 1. fp32: FSDP2 + FusedAdamW + seqfuse clip against the unsharded model +
    #    torch AdamW + torch clip, 6 steps of real backward passes.
    ref = _fsdp_model(torch.float32)
    model = _fsdp_shard(_fsdp_model(torch.float32), mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt = FusedAdamW(model.parameters(), **FSDP_HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **FSDP_HYPER)
    g = torch.Generator().manual_seed(7)
    norms, ref_norms, calls = [], [], []
    real_all_reduce = dist.all_reduce
    for step in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        half = slice(4 * rank, 4 * rank + 4)  # each rank its half of the batch; FSDP2 averages gradients
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        dist.all_reduce = lambda *a, **k: (calls.append(step), real_all_reduce(*a, **k))[1]
        try:
            norms.append(clip_grad_norm_(list(model.parameters()), 0.05).item())
        finally:
            dist.all_reduce = real_all_reduce
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["norms"], out["ref_norms"], out["calls"] = norms, ref_norms, calls
    out["param_err"] = max(max_rel(p.full_tensor(), r.detach()) for p, r in zip(model.parameters(), ref.parameters()))
    st = opt.state[next(model.parameters())]
    out["state_kinds"] = [type(st[k]).__name__ for k in ("exp_avg", "exp_avg_sq")]
    out["state_placements"] = [str(st["exp_avg"].placements), str(next(model.parameters()).placements)]
    out["moment_err"] = max(max_rel(opt.state[p]["exp_avg_sq"].full_tensor(), ref_opt.state[r]["exp_avg_sq"])
                            for p, r in zip(model.parameters(), ref.parameters()))

    # 2. bf16 parameters: the fp32 master copies are sharded DTensors, and
    #    given the same gradients the sharded update equals the unsharded
    #    FusedAdamW's bit for bit (params and masters).
    full = _fsdp_model(torch.bfloat16)
    sharded = _fsdp_shard(_fsdp_model(torch.bfloat16), mesh)
    opt_full, opt_sh = FusedAdamW(full.parameters(), **FSDP_HYPER), FusedAdamW(sharded.parameters(), **FSDP_HYPER)
    for step in range(4):
        gg = torch.Generator().manual_seed(100 + step)
        for p, q in zip(full.parameters(), sharded.parameters()):
            p.grad = (torch.randn(p.shape, generator=gg) * 0.1).to(torch.bfloat16)
            q.grad = distribute_tensor(p.grad.clone(), mesh, q.placements, src_data_rank=None)
        opt_full.step()
        opt_sh.step()
    exact = True
    for p, q in zip(full.parameters(), sharded.parameters()):
        m = opt_sh.state[q]["master_param"]
        assert isinstance(m, DTensor) and m.dtype == torch.float32 and m.placements == q.placements
        assert m.to_local().shape == q.to_local().shape
        exact &= torch.equal(q.full_tensor(), p.detach())
        exact &= torch.equal(m.full_tensor(), opt_full.state[p]["master_param"])
    out["bf16_exact"] = bool(exact)

    # 3. DCP round trip of the optimizer state (fp32 model of part 1): save
    #    at step 6, run 3 more steps; a fresh sharded model + optimizer
    #    loaded from the checkpoint runs the same 3 steps to the same values.
    ckpt_dir = os.path.join(out_dir, "dcp")
    osd = get_optimizer_state_dict(model, opt)
    assert any(isinstance(v, DTensor) for s in osd["state"].values() for v in s.values())
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=ckpt_dir)

    def more_steps(m, o):
        gm = torch.Generator().manual_seed(55)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=gm), torch.randn(8, 1, generator=gm)
            torch.nn.functional.mse_loss(m(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
            clip_grad_norm_(list(m.parameters()), 0.05)
            o.step()
            o.zero_grad()
        return [p.full_tensor() for p in m.parameters()]

    want = more_steps(model, opt)
    fresh = _fsdp_shard(_fsdp_model(torch.float32), mesh)
    fresh_opt = FusedAdamW(fresh.parameters(), lr=0.5)  # hyper-parameters come from the checkpoint
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    p0 = next(fresh.parameters())
    out["loaded_step"] = fresh_opt.state[p0]["step"]
    out["loaded_lr"] = fresh_opt.param_groups[0]["lr"]
    out["loaded_kind"] = type(fresh_opt.state[p0]["exp_avg"]).__name__
    got = more_steps(fresh, fresh_opt)
    out["resume_exact"] = all(torch.equal(a, b) for a, b in zip(want, got))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@needs_cpu_fsdp2
def test_fsdp2_two_processes_gloo(tmp_path):
    """FusedAdamW and clip_grad_norm_ on FSDP2 DTensor shards (2 processes,
    gloo, CPU): 6 steps equal torch.optim.AdamW + torch's clip on the
    unsharded model (params and moments within fp32 tolerance), the clip
    norm equals the unsharded norm with one all-reduce per call, bf16 master
    weights are sharded and the sharded update is bit-identical to the
    unsharded FusedAdamW's, and a DCP save / load of the optimizer state
    resumes bit for bit."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    pytest.importorskip("torch.distributed.fsdp")
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=FSDP_WORLD, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(FSDP_WORLD)]
    for r in res:
        assert r["norms"] == res[0]["norms"]  # every rank the same global norm
        for n, rn in zip(r["norms"], r["ref_norms"]):
            assert abs(n - rn) <= 1e-5 * rn, (r["norms"], r["ref_norms"])
        assert max(r["norms"]) > 0.05  # the clipping was active
        assert r["calls"] == list(range(6)), r["calls"]  # one all-reduce per clip, for all parameters
        assert r["param_err"] < 1e-5 and r["moment_err"] < 1e-4, (r["param_err"], r["moment_err"])
        assert r["state_kinds"] == ["DTensor", "DTensor"]
        assert r["state_placements"][0] == r["state_placements"][1] and "Shard(dim=0)" in r["state_placements"][0]
        assert r["bf16_exact"]
        assert r["loaded_step"] == 6 and r["loaded_lr"] == FSDP_HYPER["lr"] and r["loaded_kind"] == "DTensor"
        assert r["resume_exact"]


def test_step_bumps_versions_so_fp8_weight_caches_refresh(seed):
    """The kernels write parameters (and clipped gradients) behind torch's
    back; FusedAdamW / clip_grad_norm_ bump their version counters, so
    seqfuse.pytorch.Linear's FP8 weight cache (keyed on the weight's
    version) re-quantizes the updated weight at the next FP8 forward instead
    of reusing the pre-update one."""
    import seqfuse.pytorch as te
    from seqfuse.common.recipe import DelayedScaling
    from helpers import rel_error

    lin = te.Linear(64, 64)
    opt = FusedAdamW(lin.parameters(), lr=0.05, weight_decay=0.0)
    x = torch.randn(32, 64)
    recipe = DelayedScaling()
    w_old = lin.weight.detach().clone()
    v0 = lin.weight._version
    for _ in range(2):
        with te.autocast(enabled=True, recipe=recipe):
            y = lin(x)
        y.square().mean().backward()
        g0 = lin.weight.grad._version
        clip_grad_norm_(list(lin.parameters()), 1e-3)
        assert lin.weight.grad._version > g0
        opt.step()
        opt.zero_grad()
    assert lin.weight._version > v0
    with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    new = x @ lin.weight.detach().t() + lin.bias.detach()
    old = x @ w_old.t() + lin.bias.detach()
    assert rel_error(old, new) > 0.2  # the update is large enough to tell the two apart
    assert rel_error(y, new) < 0.1, (rel_error(y, new), rel_error(y, old))


def test_list_refusals_name_the_item():
    """A refused tensor of a multi-tensor op's list is named with its index, by the
    binding (not a tensor) and by each op's checks (wrong size, shared memory, another
    dtype): the checks run under the bare list names first and name the item only for
    the message."""
    def z(n=4, dtype=torch.float32):
        return torch.zeros(n, dtype=dtype)

    ps = [z() for _ in range(3)]
    # (the checked op refuses a non-tensor in Python; FusedAdamW's path leaves it to the binding)
    from seqfuse.ops.optim import multi_tensor_adamw_prechecked

    with pytest.raises(TypeError, match=r"argument 'grads\[1\]' must be a tensor supporting DLPack"):
        multi_tensor_adamw_prechecked(ps, [z(), "x", z()], [z() for _ in range(3)], [z() for _ in range(3)], None,
                                      1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"argument 'grads\[2\]' must have 4 element\(s\), got 5"):
        multi_tensor_adamw(ps, [z(), z(), z(5)], [z() for _ in range(3)], [z() for _ in range(3)], None, 1e-3,
                           0.9, 0.999, 1e-8, 0.0, 1)
    shared = [z() for _ in range(3)]
    with pytest.raises(ValueError, match=r"outputs 'exp_avg\[0\]' and 'exp_avg_sq\[0\]' share memory"):
        multi_tensor_adamw(ps, [z() for _ in range(3)], shared, shared, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match=r"argument 'exp_avg_sq\[1\]' must have dtype float32"):
        multi_tensor_adamw(ps, [z() for _ in range(3)], [z() for _ in range(3)],
                           [z(), z(dtype=torch.bfloat16), z()], None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match=r"argument 'tensors\[1\]' must be contiguous"):
        multi_tensor_l2norm([z(), torch.zeros(4, 2)[:, 0]])
    with pytest.raises(TypeError, match=r"'tensors\[2\]'"):
        multi_tensor_scale([z(), z(), torch.zeros(4, dtype=torch.int32)], 0.5)
