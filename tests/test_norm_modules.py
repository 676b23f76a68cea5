"""seqfuse.pytorch.LayerNorm / RMSNorm against torch.nn.LayerNorm / RMSNorm:
outputs and the gradients of input, weight and bias."""
import pytest
import torch

import seqfuse.pytorch as te

from helpers import assert_close_rel


def torch_rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def compare(mod, ref_fn, x, dtype, ref_params):
    x1 = x.clone().requires_grad_()
    x2 = x.double().clone().requires_grad_()
    y = mod(x1)
    r = ref_fn(x2)
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)
    r.backward(dy.double())
    assert_close_rel(y, r, dtype)
    assert_close_rel(x1.grad, x2.grad, dtype)
    for p, rp in zip([mod.weight, mod.bias], ref_params):
        if p is not None:
            assert p.grad is not None and p.grad.dtype == p.dtype
            assert_close_rel(p.grad, rp.grad, dtype if p.dtype == torch.float32 else p.dtype)


@pytest.mark.parametrize("zc", [False, True])
def test_layernorm_module_cpu(zc, seed):
    m = te.LayerNorm(96, eps=1e-6, zero_centered_gamma=zc, device="cpu")
    assert m.weight.dtype == torch.float32 and m.bias.shape == (96,)
    assert torch.all(m.weight == (0.0 if zc else 1.0))
    with torch.no_grad():
        m.weight.normal_(0.0 if zc else 1.0, 0.3)
        m.bias.normal_()
    w = m.weight.detach().double().requires_grad_()
    b = m.bias.detach().double().requires_grad_()
    fn = lambda x: torch.nn.functional.layer_norm(x, (96,), (1 + w) if zc else w, b, 1e-6)
    compare(m, fn, torch.randn(4, 7, 96), torch.float32, [w, b])


@pytest.mark.parametrize("zc", [False, True])
def test_rmsnorm_module_cpu(zc, seed):
    m = te.RMSNorm(80, eps=1e-5, zero_centered_gamma=zc, device="cpu")
    assert m.bias is None
    with torch.no_grad():
        m.weight.normal_(0.0 if zc else 1.0, 0.3)
    w = m.weight.detach().double().requires_grad_()
    fn = lambda x: torch_rmsnorm(x, (1 + w) if zc else w, 1e-5)
    compare(m, fn, torch.randn(6, 80), torch.float32, [w])


def test_rmsnorm_matches_torch_nn_rmsnorm(seed):
    if not hasattr(torch.nn, "RMSNorm"):
        pytest.skip("torch.nn.RMSNorm needs torch >= 2.4")
    ours = te.RMSNorm(64, eps=1e-6, device="cpu")
    theirs = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 64)
    assert_close_rel(ours(x), theirs(x), torch.float32)


def test_layernorm_matches_torch_nn_layernorm(seed):
    ours = te.LayerNorm(64, device="cpu")
    theirs = torch.nn.LayerNorm(64)
    x = torch.randn(3, 64)
    assert_close_rel(ours(x), theirs(x), torch.float32)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))


def test_norm_module_params_dtype_bf16_on_float32_input(seed):
    m = te.LayerNorm(32, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(5, 32, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and m.weight.grad.dtype == torch.bfloat16


def test_norm_module_bf16_input_float32_params(seed):
    m = te.RMSNorm(128, device="cpu")
    x = torch.randn(9, 128).bfloat16().requires_grad_()
    y = m(x)
    y.float().pow(2).sum().backward()
    assert y.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16


def test_norm_module_bad_shape():
    with pytest.raises(NotImplementedError, match="last dimension only"):
        te.LayerNorm((4, 8), device="cpu")


def test_norm_module_hidden_mismatch():
    m = te.LayerNorm(16, device="cpu")
    # the module names its input's rule (normalized_shape), not its weight's length
    with pytest.raises(ValueError, match="LayerNorm: input's last dimension must be normalized_shape = 16"):
        m(torch.randn(2, 17))


@pytest.mark.cuda
@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_module_cuda(cls, dtype, seed):
    m = getattr(te, cls)(4096, eps=1e-5, device="cuda")
    assert m.weight.is_cuda
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
        if m.bias is not None:
            m.bias.normal_()
    w = m.weight.detach().double().requires_grad_()
    b = m.bias.detach().double().requires_grad_() if m.bias is not None else None
    if cls == "LayerNorm":
        fn = lambda x: torch.nn.functional.layer_norm(x, (4096,), w, b, 1e-5)
    else:
        fn = lambda x: torch_rmsnorm(x, w, 1e-5)
    compare(m, fn, torch.randn(2, 300, 4096, device="cuda").to(dtype), dtype, [w, b])


def _residual_block(m, x, alias, use):
    """alias + f(norm(alias)) (``use``: which outputs the loss reads: "both", "y", "alias")."""
    if alias:
        y, r = m(x, return_input_alias=True)
    else:
        y, r = m(x), x
    f = torch.tanh(y.float()) * 0.5
    return {"both": r.float() + f, "y": f, "alias": r.float() * 1.5}[use]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use", ["both", "y", "alias"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_norm_input_alias_adds_the_residual_gradient_in_its_pass(device, cls, dtype, use, contiguous, seed):
    """return_input_alias: the alias holds the input's values, and the
    gradients (input, weight, bias) of a pre-norm residual block through it
    equal the plain form's, where autograd adds the residual's gradient;
    also when only the output or only the alias reaches the loss, and for
    a non-contiguous input (the alias is then a view of the norm's
    contiguous copy)."""
    m = getattr(te, cls)(256, device=device)
    with torch.no_grad():
        m.weight.normal_(1.0, 0.2)
    x = torch.randn(3, 40, 256, device=device).to(dtype)
    if not contiguous:
        x = torch.randn(40, 3, 256, device=device).to(dtype).transpose(0, 1)
    grads = []
    for alias in (False, True):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = _residual_block(m, xi, alias, use)
        out.backward(torch.ones_like(out))
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    y, r = m(x, return_input_alias=True)
    assert torch.equal(r, x) and torch.equal(y, m(x))
    for a, b in zip(*grads):
        if a is None or b is None:
            assert a is None and b is None
        else:  # (the fused pass adds in float32 before rounding once: within one rounding of dtype)
            assert_close_rel(b, a, dtype)
