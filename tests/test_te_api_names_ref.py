"""Transformer Engine names seqfuse.pytorch has that no other test checked
against a torch reference (found by the name audit in
test_te_api_table.py): te.ops.BasicOperation (and TE's base class
FusibleOperation) as the base of user-written operations inside
te.ops.Sequential, te.ops.is_op_fuser_grouped_tensor_path_supported,
te.optimizers.multi_tensor_adam_capturable(_master) against torch's Adam, te.optimizers.MultiTensorApply called
directly, and quantized_model_init / fp8_model_init (modules built inside
compute what modules built outside do, under FP8 autocast and without it,
and the context says in a log line that weights stay in high precision)."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from helpers import needs_fp8, rel_error, rel_tol
from seqfuse.common.recipe import Float8CurrentScaling

autocast_module = importlib.import_module("seqfuse.quantization.autocast")  # the module, not the function


class _ScaleBy(te.ops.BasicOperation):
    """A user-written operation: x * extra (an extra input, as TE's)."""
    num_extra_inputs = 1

    def forward(self, x, extra):
        return x * extra


def test_basic_operation_subclass_runs_in_sequential_against_torch():
    torch.manual_seed(50)
    lin = te.ops.Linear(8, 6, device="cpu")
    seq = te.ops.Sequential(lin, _ScaleBy(), te.ops.ReLU())
    assert seq.plan()[1] == (None, ["_ScaleBy"])
    x = torch.randn(4, 8, requires_grad=True)
    s = torch.rand(4, 6, requires_grad=True)
    out = seq(x, s)
    xr, sr = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    ref = F.relu(F.linear(xr, lin.weight.double(), lin.bias.double()) * sr)
    assert rel_error(out, ref) <= rel_tol(torch.float32, 4)
    out.sum().backward()
    ref.sum().backward()
    assert rel_error(x.grad, xr.grad) <= rel_tol(torch.float32, 4)
    assert rel_error(s.grad, sr.grad) <= rel_tol(torch.float32, 4)
    ops = [getattr(te.ops, n) for n in te.ops.__all__ if isinstance(getattr(te.ops, n), type)]
    ops = [op for op in ops if op not in (te.ops.Sequential, te.ops.FusibleOperation)]
    assert all(issubclass(op, te.ops.BasicOperation) for op in ops)
    # TE's base class of every operation; a basic operation is not a fused one
    assert issubclass(te.ops.BasicOperation, te.ops.FusibleOperation)
    assert isinstance(seq[1], te.ops.FusibleOperation) and not seq[1].is_fused_op


def test_grouped_tensor_path_query():
    """TE's is_op_fuser_grouped_tensor_path_supported: False for every recipe
    and dtype (seqfuse's GroupedLinear has one parameter per group and
    refuses single grouped parameters, which TE asks for only after True)."""
    from seqfuse.common.recipe import DelayedScaling
    for recipe in (None, Float8CurrentScaling(), DelayedScaling()):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert te.ops.is_op_fuser_grouped_tensor_path_supported(recipe, dtype) is False
    with pytest.raises(NotImplementedError, match="single_grouped_weight"):
        te.ops.GroupedLinear(2, 8, 8, single_grouped_weight=True, device="cpu")
    with pytest.raises(TypeError, match="argument 'dtype' must be a torch.dtype"):
        te.ops.is_op_fuser_grouped_tensor_path_supported(None, "bf16")
    with pytest.raises(TypeError, match="argument 'recipe' must be a Recipe or None"):
        te.ops.is_op_fuser_grouped_tensor_path_supported("delayed", torch.bfloat16)


def test_multi_tensor_apply_against_torch():
    torch.manual_seed(51)
    apply = te.optimizers.MultiTensorApply(1024)
    assert apply.chunk_size == 1024
    src = [torch.randn(5, 3), torch.randn(0), torch.randn(7)]
    dst = [torch.empty_like(t) for t in src]
    flag = torch.zeros(1, dtype=torch.int32)
    apply(te.optimizers.multi_tensor_scale, flag, [src, dst], 0.5)
    for a, b in zip(src, dst):
        assert torch.equal(b, a * 0.5)
    total, per = apply(te.optimizers.multi_tensor_l2norm, flag, [src], True)
    ref = torch.cat([t.double().reshape(-1) for t in src]).norm()
    assert rel_error(total, ref.reshape(1)) <= rel_tol(torch.float32)
    assert flag.item() == 0
    with pytest.raises(ValueError, match="'chunk_size' must be a positive int"):
        te.optimizers.MultiTensorApply(0)


@pytest.mark.parametrize("name", ["quantized_model_init", "fp8_model_init"])
def test_quantized_model_init_builds_the_same_model(name, monkeypatch, caplog):
    monkeypatch.setattr(autocast_module, "_logged_high_precision_weights", False)
    recipe = Float8CurrentScaling()
    torch.manual_seed(52)
    outside = te.LayerNormMLP(32, 64, device="cpu")
    torch.manual_seed(52)
    with caplog.at_level("INFO", logger="seqfuse"):
        with getattr(te, name)(enabled=True, recipe=recipe):
            inside = te.LayerNormMLP(32, 64, device="cpu")
    assert "weights in high precision" in caplog.text
    x = torch.randn(4, 32)
    for a, b in zip(inside.state_dict().values(), outside.state_dict().values()):
        assert torch.equal(a, b)
    # without FP8: the module against torch
    h = F.layer_norm(x.double(), (32,), inside.layer_norm_weight.double(), inside.layer_norm_bias.double(),
                     inside.eps)
    ref = F.linear(F.gelu(F.linear(h, inside.fc1_weight.double(), inside.fc1_bias.double()), approximate="tanh"),
                   inside.fc2_weight.double(), inside.fc2_bias.double())
    assert rel_error(inside(x), ref) <= rel_tol(torch.float32, 4)


@needs_fp8
def test_quantized_model_init_under_fp8_matches_outside():
    recipe = Float8CurrentScaling()
    torch.manual_seed(53)
    outside = te.Linear(32, 32, device="cpu")
    torch.manual_seed(53)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        inside = te.Linear(32, 32, device="cpu")
    x = torch.randn(16, 32)
    with te.autocast(recipe=recipe):
        a, b = inside(x), outside(x)
    assert torch.equal(a, b)
    ref = F.linear(x.double(), inside.weight.double(), inside.bias.double())
    assert rel_error(a, ref) <= 0.1  # E4M3 operands: a few per cent


@pytest.mark.parametrize("mode,masters", [(1, False), (0, False), (1, True)])
def test_multi_tensor_adam_capturable_against_torch(mode, masters):
    """TE's capturable Adam (lr, step, inv_scale as tensors), two steps on
    gradients scaled by 4 with inv_scale 0.25, against torch.optim.AdamW
    (mode 1) / Adam with L2 (mode 0) in float64; the gradients are left
    unscaled (as TE's kernel writes them); with noop_flag set nothing
    changes."""
    opt = te.optimizers
    torch.manual_seed(58)
    shapes = [(4, 3), (7,)]
    params = [torch.randn(s).to(torch.bfloat16 if masters else torch.float32) for s in shapes]
    master = [p.float() for p in params]
    ref = [p.double().requires_grad_(True) for p in params]
    m, v = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    torch_opt = (torch.optim.AdamW if mode == 1 else torch.optim.Adam)(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                                                       weight_decay=0.1)
    fn = opt.multi_tensor_adam_capturable_master if masters else opt.multi_tensor_adam_capturable
    flag = torch.zeros(1, dtype=torch.int32)
    lr, inv_scale = torch.tensor([1e-2]), torch.tensor([0.25])
    for step in (1, 2):
        grads = [torch.randn(s) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.double()
        torch_opt.step()
        scaled = [g * 4 for g in grads]
        lists = [scaled, params, m, v] + ([master] if masters else [])
        opt.multi_tensor_applier(fn, flag, lists, lr, 0.9, 0.99, 1e-8, torch.tensor([step], dtype=torch.int32),
                                 mode, 1, 0.1, inv_scale)
        for a, b in zip(scaled, grads):
            assert torch.equal(a, b)
    for p, r in zip(master if masters else params, ref):
        assert torch.allclose(p.double(), r.detach(), rtol=1e-5, atol=1e-6)
    if masters:
        for p, mp in zip(params, master):
            assert torch.equal(p, mp.to(torch.bfloat16))
    before = [t.clone() for t in params + m + v]
    flag.fill_(1)
    opt.multi_tensor_applier(fn, flag, lists, lr, 0.9, 0.99, 1e-8, torch.tensor([3]), mode, 1, 0.1, inv_scale)
    assert all(torch.equal(a, b) for a, b in zip(before, params + m + v))
    with pytest.raises(TypeError, match="argument 'lr' must be a one-element tensor"):
        fn(2048, flag, lists, 1e-2, 0.9, 0.99, 1e-8, torch.tensor([1]), mode, 1, 0.1, inv_scale)
    with pytest.raises(ValueError, match=f"must hold {5 if masters else 4} list"):
        fn(2048, flag, lists[:3], lr, 0.9, 0.99, 1e-8, torch.tensor([1]), mode, 1, 0.1, inv_scale)
