"""FusedAdamW, clip_grad_norm_ and the multi-tensor ops against torch: fp32
parameters against torch.optim.AdamW over 20 steps, bf16 parameters with fp32
master weights against fp32 AdamW run on the masters, state_dict round trips
that resume bit for bit, the l2 norm against a float64 reference, bad inputs,
and the CUDA kernels against the CPU backend."""
import copy
import io

import pytest
import torch

import seqfuse
import seqfuse.optim
from seqfuse.optim import FusedAdamW, clip_grad_norm_
from seqfuse.ops import multi_tensor_adamw, multi_tensor_l2norm, multi_tensor_scale

SHAPES = [(7,), (33, 17), (65536 + 5,), (3, 4, 5), (1,)]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_params(dtype, device="cpu", shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes]


def fill_grads(params, step, gen_device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(device=p.device, dtype=p.dtype)


def max_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp32_matches_torch_adamw_20_steps(device, seed):
    params = make_params(torch.float32, device)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdamW(params, **HYPER)
    theirs = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for step in range(20):
        fill_grads(params, step)
        fill_grads(ref, step)
        ours.step()
        theirs.step()
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


def test_many_tensors_cross_launch_boundaries(seed):
    """More tensors than one launch's table holds (64 for AdamW)."""
    params = make_params(torch.float32, shapes=[(i % 5 + 1,) for i in range(150)])
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = FusedAdamW(params, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    for step in range(3):
        fill_grads(params, step)
        fill_grads(ref, step)
        ours.step()
        theirs.step()
    assert all(max_rel(p.detach(), r.detach()) < 1e-5 for p, r in zip(params, ref))


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
        assert max_rel(mg[i].cpu(), mc[i]) <= 1e-6
        assert max_rel(vg[i].cpu(), vc[i]) <= 1e-6
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
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = clip_grad_norm_(params, 1.0)
        opt = FusedAdamW(params, lr=1e-3)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert total.item() > 1.0
