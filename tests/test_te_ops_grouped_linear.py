"""te.ops.GroupedLinear (Transformer Engine 2.20's fusible grouped linear
operation) against torch: per group i, y_i = F.linear(x_i, W_i, b_i) over the
blocks torch.split(x, split_sizes) of the input's first dimension,
concatenated; forward and backward (input, weights, biases, and the bias
scales of scale_bias=True) in float32 on the CPU backend against float64
torch.  Also: the split sizes as TE passes them (an integer tensor) or as a
list, inside te.ops.Sequential with its extra inputs, deferred
initialisation on the meta device, the RNG tracker, main_grad
accumulation, the refused arguments and bad input.  The cuda-marked test
runs the operation in bf16 on the GPU (split sizes on the GPU, as MoE code
makes them) against the same operation on the CPU in float32."""
import copy

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import needs_fp8, pair_tol, rel_error, rel_tol, torch_bound
from seqfuse.common.recipe import DelayedScaling, Float8CurrentScaling
from seqfuse.modules.grouped_linear import GroupedLinear as GroupedLinearModule

F32 = rel_tol(torch.float32, 4)


def close(out, ref, tol=F32):
    err = rel_error(out, ref)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def reference(op, x, splits, scales=None):
    """The torch reference in float64 on leaf copies of the operation's
    parameters: (y, x leaf, [W_i], [b_i], scales leaf)."""
    xr = x.detach().double().requires_grad_()
    ws = [getattr(op, f"weight{g}").detach().double().requires_grad_() for g in range(op.num_groups)]
    bs = [getattr(op, f"bias{g}").detach().double().requires_grad_() if op.has_bias else None
          for g in range(op.num_groups)]
    sr = None if scales is None else scales.detach().double().requires_grad_()
    xs = torch.split(xr, list(splits))
    ss = torch.split(sr, list(splits)) if sr is not None else [None] * len(xs)
    parts = []
    for xi, w, b, s in zip(xs, ws, bs, ss):
        if s is None:
            parts.append(F.linear(xi, w, b))
        else:  # scale_bias: the bias scaled row by row
            parts.append(F.linear(xi, w) + b * s.reshape(*s.shape, *([1] * (xi.dim() - s.dim()))))
    return torch.cat(parts), xr, ws, bs, sr


def check_grads(op, x, ref_x, ws, bs):
    close(x.grad, ref_x.grad)
    for g in range(op.num_groups):
        close(getattr(op, f"weight{g}").grad, ws[g].grad)
        if op.has_bias:
            close(getattr(op, f"bias{g}").grad, bs[g].grad)


@pytest.mark.parametrize("splits,bias,as_tensor", [([5, 0, 11, 3], True, True), ([7, 9], False, False),
                                                   ([0, 0, 6], True, False), ([16], True, True)])
def test_grouped_linear_against_torch(splits, bias, as_tensor):
    torch.manual_seed(1)
    op = te.ops.GroupedLinear(len(splits), 24, 40, bias=bias, device="cpu", dtype=torch.float32)
    if bias:
        with torch.no_grad():  # TE initialises biases to 0: make them count
            for g in range(op.num_groups):
                getattr(op, f"bias{g}").normal_()
    x = torch.randn(sum(splits), 24, requires_grad=True)
    split_sizes = torch.tensor(splits, dtype=torch.int32) if as_tensor else splits
    y = op(x, split_sizes)
    ref, xr, ws, bs, _ = reference(op, x, splits)
    assert y.shape == (sum(splits), 40) and y.dtype == torch.float32
    close(y, ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    check_grads(op, x, xr, ws, bs)
    for g, m in enumerate(splits):  # a group that got no rows has zero gradients
        if m == 0:
            assert not getattr(op, f"weight{g}").grad.any()


def test_grouped_linear_splits_the_first_dimension():
    """A 3-D input is split along its first dimension, as TE documents
    (torch.split(x, split_sizes) then a Linear per block)."""
    torch.manual_seed(2)
    op = te.ops.GroupedLinear(2, 8, 6, device="cpu")
    x = torch.randn(5, 3, 8, requires_grad=True)
    y = op(x, torch.tensor([2, 3]))
    ref, xr, ws, bs, _ = reference(op, x, [2, 3])
    assert y.shape == (5, 3, 6)
    close(y, ref)
    y.sum().backward()
    ref.sum().backward()
    check_grads(op, x, xr, ws, bs)


def test_grouped_linear_scale_bias_against_torch():
    """scale_bias=True: two extra inputs (split sizes, scales); y_i = x_i W_i^T
    + b_i * scales_i[:, None], differentiable in the scales too."""
    torch.manual_seed(3)
    splits = [4, 0, 9]
    op = te.ops.GroupedLinear(3, 16, 12, scale_bias=True, device="cpu")
    assert op.num_extra_inputs == 2
    assert te.ops.GroupedLinear(3, 16, 12, bias=False, scale_bias=True, device="cpu").num_extra_inputs == 1
    with torch.no_grad():
        for g in range(3):
            getattr(op, f"bias{g}").normal_()
    x = torch.randn(13, 16, requires_grad=True)
    scales = torch.rand(13, requires_grad=True)
    y = op(x, torch.tensor(splits), scales)
    ref, xr, ws, bs, sr = reference(op, x, splits, scales)
    close(y, ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double())
    check_grads(op, x, xr, ws, bs)
    close(scales.grad, sr.grad)


def test_grouped_linear_in_sequential_routes_split_sizes():
    """Sequential(GroupedLinear, SwiGLU, GroupedLinear(scale_bias)) hands the
    extra inputs in order (split sizes; split sizes and scales): a
    mixture-of-experts MLP on permuted tokens, against torch."""
    torch.manual_seed(4)
    splits = [3, 6, 0, 5]
    fc1 = te.ops.GroupedLinear(4, 16, 64, device="cpu")
    fc2 = te.ops.GroupedLinear(4, 32, 16, scale_bias=True, device="cpu")
    with torch.no_grad():
        for g in range(4):
            fc1.get_parameter(f"bias{g}").normal_()
            fc2.get_parameter(f"bias{g}").normal_()
    seq = te.ops.Sequential(fc1, te.ops.SwiGLU(), fc2)
    x = torch.randn(14, 16, requires_grad=True)
    probs = torch.rand(14)
    sizes = torch.tensor(splits)
    y = seq(x, sizes, sizes, probs)
    h, xr, w1, b1, _ = reference(fc1, x, splits)
    a, gate = h.chunk(2, dim=-1)
    hr = F.silu(a) * gate
    parts = [F.linear(hi, fc2.get_parameter(f"weight{g}").double(), None)
             + fc2.get_parameter(f"bias{g}").double() * pi[:, None]
             for g, (hi, pi) in enumerate(zip(torch.split(hr, splits), torch.split(probs.double(), splits)))]
    ref = torch.cat(parts)
    close(y, ref)
    y.sum().backward()
    ref.sum().backward()
    close(x.grad, xr.grad)
    for g in range(4):
        if splits[g]:
            close(fc1.get_parameter(f"weight{g}").grad, w1[g].grad)
    with pytest.raises(ValueError, match="2 extra input.s. given, but its operations take 3"):
        seq(x, sizes, sizes)


def test_grouped_linear_initialisation_meta_and_rng_tracker():
    """TE's initialisation (Kaiming-uniform a = sqrt(5) per weight, biases 0);
    device='meta' then reset_parameters() gives the same values as direct
    construction; the RNG tracker's fork draws the weights."""
    torch.manual_seed(5)
    direct = te.ops.GroupedLinear(3, 32, 8, device="cpu")
    torch.manual_seed(5)
    deferred = te.ops.GroupedLinear(3, 32, 8, device="meta")
    assert deferred.weight0.is_meta
    deferred.reset_parameters()
    for (k, a), b in zip(direct.state_dict().items(), deferred.state_dict().values()):
        assert not b.is_meta and torch.equal(a, b), k
    bound = 1 / 32 ** 0.5  # kaiming_uniform_(a=sqrt(5)) on fan_in 32
    for g in range(3):
        w = direct.get_parameter(f"weight{g}")
        assert w.abs().max() <= bound and w.std() > bound / 3
        assert not direct.get_parameter(f"bias{g}").any()
    assert direct.weight0.data_ptr() != direct.weight1.data_ptr()

    forks = []

    class Tracker:
        def fork(self):
            forks.append(1)
            gen = torch.random.fork_rng()
            gen.__enter__()
            torch.manual_seed(99)

            class _Ctx:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    gen.__exit__(*exc)
            return _Ctx()

    op = te.ops.GroupedLinear(2, 8, 4, device="cpu", rng_state_tracker_function=Tracker)
    assert len(forks) == 2
    assert torch.equal(op.weight0, op.weight1)  # each drawn from the tracker's seed 99
    torch.manual_seed(99)
    expected = torch.empty(4, 8)
    torch.nn.init.kaiming_uniform_(expected, a=5 ** 0.5)
    assert torch.equal(op.weight0, expected)


def test_grouped_linear_accumulates_into_main_grad():
    torch.manual_seed(6)
    op = te.ops.GroupedLinear(2, 8, 4, accumulate_into_main_grad=True, device="cpu")
    x = torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="weight0 has no main_grad"):
        op(x, [2, 3])
    for g in range(2):
        op.get_parameter(f"weight{g}").main_grad = torch.ones(4, 8)
    dy = torch.randn(5, 4)
    op(x, [2, 3]).backward(dy)
    xs, dys = torch.split(x, [2, 3]), torch.split(dy, [2, 3])
    for g in range(2):
        w = op.get_parameter(f"weight{g}")
        close(w.main_grad, 1 + dys[g].double().T @ xs[g].double())
        assert w.grad is None


@pytest.mark.parametrize("kw,name", [({"single_grouped_weight": True}, "single_grouped_weight"),
                                     ({"single_grouped_bias": True}, "single_grouped_bias"),
                                     ({"delay_wgrad_compute": True}, "delay_wgrad_compute")])
def test_grouped_linear_refuses_by_name(kw, name):
    with pytest.raises(NotImplementedError, match=rf"te.ops.GroupedLinear: argument '{name}'=True"):
        te.ops.GroupedLinear(2, 8, 4, device="cpu", **kw)
    te.ops.GroupedLinear(2, 8, 4, device="cpu", **{name: False})  # off: taken


def test_grouped_linear_bad_input_names_the_rule():
    op = te.ops.GroupedLinear(2, 8, 4, device="cpu")
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="'split_sizes' adds up to 4, but the input's first dimension is 5"):
        op(x, [1, 3])
    with pytest.raises(ValueError, match="'split_sizes' must hold num_groups = 2"):
        op(x, torch.tensor([5]))
    with pytest.raises(ValueError, match="sizes >= 0"):
        op(x, [6, -1])
    with pytest.raises(TypeError, match="'split_sizes' must be a 1-D integer tensor"):
        op(x, torch.tensor([2.0, 3.0]))
    with pytest.raises(ValueError, match="in_features = 8"):
        op(torch.randn(5, 7), [2, 3])
    with pytest.raises(ValueError, match="'scales' is taken exactly when scale_bias=True"):
        op(x, [2, 3], torch.ones(5))
    with pytest.raises(ValueError, match="argument 'num_groups' must be a positive int"):
        te.ops.GroupedLinear(0, 8, 4, device="cpu")
    with pytest.raises(ValueError, match="argument 'dtype' must be float32, float16 or bfloat16"):
        te.ops.GroupedLinear(2, 8, 4, device="cpu", dtype=torch.float64)
    sb = te.ops.GroupedLinear(2, 8, 4, scale_bias=True, device="cpu")
    with pytest.raises(ValueError, match="'scales' must be a tensor with one value per row"):
        sb(x, [2, 3], torch.ones(4))


def test_grouped_linear_deepcopy_runs_on_its_own_parameters():
    torch.manual_seed(7)
    op = te.ops.GroupedLinear(2, 8, 4, device="cpu")
    x = torch.randn(5, 8)
    op(x, [2, 3])  # the runner exists
    twin = copy.deepcopy(op)
    with torch.no_grad():
        twin.weight0.mul_(2)
    ref, *_ = reference(twin, x, [2, 3])
    close(twin(x, [2, 3]), ref)
    assert not torch.allclose(op(x, [2, 3]), twin(x, [2, 3]))


@needs_fp8
@pytest.mark.parametrize("recipe", [Float8CurrentScaling, DelayedScaling], ids=["current", "delayed"])
def test_grouped_linear_under_fp8_autocast(recipe):
    """Under FP8 autocast the operation runs seqfuse's FP8 grouped GEMMs: the
    same values as seqfuse's GroupedLinear module on the same parameters,
    within FP8's error of float64 torch, and gradients reach every weight
    that got rows."""
    torch.manual_seed(9)
    splits = [10, 0, 30]
    op = te.ops.GroupedLinear(3, 32, 48, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        for g in range(3):
            op.get_parameter(f"bias{g}").normal_()
    module = GroupedLinearModule(3, 32, 48, device="cpu", params_dtype=torch.bfloat16)
    module.load_state_dict(op.state_dict())
    x = torch.randn(40, 32, dtype=torch.bfloat16)
    with te.autocast(recipe=recipe()):
        y = op(x, torch.tensor(splits))
        y_module = module(x, splits)
    assert torch.equal(y, y_module)
    ref, *_ = reference(op, x, splits)
    assert rel_error(y, ref) <= 0.08  # E4M3 operands: a few per cent
    y.float().sum().backward()
    assert op.weight0.grad is not None and op.weight2.grad is not None and not op.weight1.grad.any()


# ---------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("scale_bias", [False, True])
def test_cuda_grouped_linear_matches_cpu(scale_bias):
    """bf16 on the GPU (split sizes a CUDA tensor, as tokens_per_expert is)
    against the same operation in float32 on the CPU; forward and backward."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(8)
    splits = [100, 0, 333, 16, 1]
    cpu = te.ops.GroupedLinear(5, 256, 128, scale_bias=scale_bias, device="cpu")
    with torch.no_grad():
        for g in range(5):
            cpu.get_parameter(f"bias{g}").normal_()
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    x = torch.randn(sum(splits), 256)
    dy = torch.randn(sum(splits), 128)
    extra = (torch.rand(sum(splits)),) if scale_bias else ()
    xc = x.clone().requires_grad_()
    yc = cpu(xc, torch.tensor(splits), *extra)
    yc.backward(dy)
    xg = x.to("cuda", torch.bfloat16).requires_grad_()
    yg = gpu(xg, torch.tensor(splits, device="cuda"), *(e.cuda() for e in extra))
    assert yg.dtype == torch.bfloat16 and yg.is_cuda
    yg.backward(dy.to("cuda", torch.bfloat16))
    # torch's own bf16 computation of the same thing (per-group F.linear, the bias scaled per row)
    ws = [cpu.get_parameter(f"weight{g}").detach().to("cuda", torch.bfloat16).requires_grad_() for g in range(5)]
    bs = [cpu.get_parameter(f"bias{g}").detach().to("cuda", torch.bfloat16).requires_grad_() for g in range(5)]
    xt = x.to("cuda", torch.bfloat16).requires_grad_()
    sc = extra[0].to("cuda", torch.bfloat16) if scale_bias else None
    outs, start = [], 0
    for g, n in enumerate(splits):
        rows = xt[start:start + n]
        y = F.linear(rows, ws[g])
        y = y + bs[g] * sc[start:start + n, None] if scale_bias else y + bs[g]
        outs.append(y)
        start += n
    torch.cat(outs).backward(dy.to("cuda", torch.bfloat16))

    def bound(ours, theirs, exact):  # at most twice torch's own bf16 error (tests/helpers.py), floor pair_tol
        return rel_error(ours, exact) <= torch_bound(rel_error(theirs, exact), floor=pair_tol(torch.bfloat16))
    assert bound(yg, torch.cat(outs), yc)
    assert bound(xg.grad, xt.grad, xc.grad)
    for g in range(5):
        if splits[g]:
            assert bound(gpu.get_parameter(f"weight{g}").grad, ws[g].grad, cpu.get_parameter(f"weight{g}").grad), g
            assert bound(gpu.get_parameter(f"bias{g}").grad, bs[g].grad, cpu.get_parameter(f"bias{g}").grad), g


@pytest.mark.cuda
@needs_fp8
def test_cuda_grouped_linear_under_fp8_matches_the_module():
    """FP8 current scaling on the GPU: the operation equals seqfuse's
    GroupedLinear module on the same parameters, within FP8's error of the
    float32 CPU operation."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(10)
    splits = [64, 0, 200, 16]
    cpu = te.ops.GroupedLinear(4, 256, 128, device="cpu")
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    module = GroupedLinearModule(4, 256, 128, device="cuda", params_dtype=torch.bfloat16)
    module.load_state_dict(gpu.state_dict())
    x = torch.randn(sum(splits), 256)
    ref = cpu(x, splits)
    xg = x.to("cuda", torch.bfloat16)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = gpu(xg, torch.tensor(splits, device="cuda"))
        y_module = module(xg, splits)
    assert torch.equal(y, y_module)
    assert rel_error(y, ref) <= 0.08
