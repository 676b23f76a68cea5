"""LayerNormLinear and LayerNormMLP against the same blocks in plain torch
(float64 on the CPU, dtype tolerances on the GPU), in FP8 under autocast
against the high-precision result, and their TE-compatible surface."""
import logging

import pytest
import torch
import torch.nn.functional as F

import seqfuse.pytorch as te
from seqfuse.quantization.gemm_quantizers import weight_casts
from seqfuse.common.recipe import DelayedScaling, Format
from seqfuse.quantization import autocast

from helpers import assert_close_rel, needs_fp8, rel_error


def ref_norm(x, w, b, eps, normalization, zc):
    w = 1 + w if zc else w
    if normalization == "RMSNorm":
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def ref_act(name, h):
    base = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "gelu_erf": F.gelu, "relu": F.relu,
            "silu": F.silu, "swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="tanh"),
            "reglu": F.relu, "geglu_erf": F.gelu}[name]
    if name in ("swiglu", "geglu", "reglu", "geglu_erf"):
        a, g = h.chunk(2, dim=-1)
        return base(a) * g
    return base(h)


def params64(m):
    return {n: p.detach().double().clone().requires_grad_() for n, p in m.named_parameters()}


def randomize(m):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layer_norm_weight" in n:
                p.normal_(0.0 if m.zero_centered_gamma else 1.0, 0.2)
            else:
                p.normal_(0.0, 0.1)


def ref_lnl(m, p, x):
    ln = ref_norm(x, p["layer_norm_weight"], p.get("layer_norm_bias"), m.eps, m.normalization,
                  m.zero_centered_gamma)
    return F.linear(ln, p["weight"], p.get("bias")), ln


def ref_mlp(m, p, x, relu_mask=None):
    """relu_mask: take ReLU's 0/1 from the module's own pre-activation
    instead of the float64 one (h * mask: the same forward up to the tiny
    values whose sign differs, and the gradient the module must produce)."""
    ln = ref_norm(x, p["layer_norm_weight"], p.get("layer_norm_bias"), m.eps, m.normalization,
                  m.zero_centered_gamma)
    h = F.linear(ln, p["fc1_weight"], p.get("fc1_bias"))
    h = h * relu_mask.to(h.dtype) if relu_mask is not None else ref_act(m.activation, h)
    return F.linear(h, p["fc2_weight"], p.get("fc2_bias"))


def saved_preactivation(out, ffn):
    """The FC1 output h LayerNormMLP's bf16 path saved for its backward (its
    sign is ReLU's 0/1 there): saved tensor 6 of the autograd node (after
    the input, the norm's weight, bias, mean and rstd, and the norm output's
    slot, None unless the norm output is returned)."""
    node = out.grad_fn
    while node is not None and "LayerNormMLP" not in type(node).__name__:
        node = node.next_functions[0][0]
    h = node.saved_tensors[6]
    assert h.shape[-1] == ffn and (h < 0).any()  # the pre-activation, not relu(h)
    return h.reshape(*out.shape[:-1], ffn)


def check_grads(m, p, x, xd, dtype, factor=1.0):
    assert_close_rel(x.grad, xd.grad, dtype, factor)
    for n, q in m.named_parameters():
        assert q.grad is not None and q.grad.dtype == q.dtype, n
        assert_close_rel(q.grad, p[n].grad, dtype, factor)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("ret_ln", [False, True])
def test_layernorm_linear_cpu(normalization, bias, zc, ret_ln, seed):
    m = te.LayerNormLinear(48, 40, eps=1e-5, bias=bias, normalization=normalization,
                           zero_centered_gamma=zc, return_layernorm_output=ret_ln, device="cpu")
    randomize(m)
    p = params64(m)
    x = torch.randn(3, 7, 48, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    out = m(x)
    ref, ref_ln = ref_lnl(m, p, xd)
    dy = torch.randn(3, 7, 40)
    if ret_ln:
        out, ln = out
        assert_close_rel(ln, ref_ln, torch.float32)
        dln = torch.randn_like(ln)
        (out * dy).sum().add((ln * dln).sum()).backward()
        ((ref * dy.double()).sum() + (ref_ln * dln.double()).sum()).backward()
    else:
        out.backward(dy)
        ref.backward(dy.double())
    assert out.shape == (3, 7, 40)
    assert_close_rel(out, ref, torch.float32)
    check_grads(m, p, x, xd, torch.float32)


@pytest.mark.parametrize("activation", ["gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu", "reglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_mlp_cpu(activation, normalization, bias, seed):
    m = te.LayerNormMLP(32, 56, eps=1e-5, bias=bias, normalization=normalization, activation=activation,
                        device="cpu")
    randomize(m)
    p = params64(m)
    x = torch.randn(2, 9, 32, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    out = m(x)
    ref = ref_mlp(m, p, xd)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close_rel(out, ref, torch.float32)
    check_grads(m, p, x, xd, torch.float32)


def test_layernorm_mlp_parameter_names_and_shapes():
    m = te.LayerNormMLP(16, 24, activation="swiglu", device="cpu")
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"layer_norm_weight": (16,), "layer_norm_bias": (16,), "fc1_weight": (48, 16),
                      "fc1_bias": (48,), "fc2_weight": (16, 24), "fc2_bias": (16,)}
    m = te.LayerNormLinear(16, 8, normalization="RMSNorm", bias=False, device="cpu")
    assert [n for n, _ in m.named_parameters()] == ["layer_norm_weight", "weight"]


def test_layernorm_modules_params_dtype_bf16_input_float32_params(seed):
    m = te.LayerNormMLP(32, 64, device="cpu")
    x = torch.randn(16, 32).bfloat16().requires_grad_()
    y = m(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())


def test_layernorm_modules_errors():
    with pytest.raises(ValueError, match="'activation' must be one of"):
        te.LayerNormMLP(8, 8, activation="tanh", device="cpu")
    with pytest.raises(ValueError, match="'normalization' must be 'LayerNorm' or 'RMSNorm'"):
        te.LayerNormLinear(8, 8, normalization="BatchNorm", device="cpu")
    with pytest.raises(NotImplementedError, match="LayerNormLinear: argument 'tp_size'=2 is not supported"):
        te.LayerNormLinear(8, 8, tp_size=2, device="cpu")
    with pytest.raises(NotImplementedError, match="LayerNormMLP: argument 'set_parallel_mode'=True"):
        te.LayerNormMLP(8, 8, set_parallel_mode=True, device="cpu")
    with pytest.raises(TypeError, match="unexpected argument 'foo'"):
        te.LayerNormMLP(8, 8, foo=1, device="cpu")
    with pytest.raises(ValueError, match=r"LayerNormLinear: input's last dimension must be in_features = 8, "
                                         r"got shape \(2, 9\)"):
        te.LayerNormLinear(8, 4, device="cpu")(torch.randn(2, 9))
    with pytest.raises(ValueError, match=r"LayerNormMLP: input's last dimension must be hidden_size = 8, "
                                         r"got shape \(3, 7\)"):
        te.LayerNormMLP(8, 16, device="cpu")(torch.randn(3, 7))
    with pytest.raises(TypeError, match="LayerNormMLP: input must be a torch.Tensor, got list"):
        te.LayerNormMLP(8, 16, device="cpu")([[1.0] * 8])


@needs_fp8
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_fp8_cpu(activation, seed):
    m = te.LayerNormMLP(64, 128, activation=activation, device="cpu")
    randomize(m)
    x = torch.randn(32, 64, requires_grad=True)
    ref = m(x)
    ref.backward(torch.ones_like(ref))
    gref = [x.grad.clone()] + [q.grad.clone() for q in m.parameters()]
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    for _ in range(3):  # the first step runs on scale 1; later ones on the amax history
        x.grad = None
        m.zero_grad()
        with autocast(recipe=recipe):
            y = m(x)
        y.backward(torch.ones_like(y))
    assert m.fp8_state.num_tensors == 6
    assert (m.fp8_state.scale != 1).all()  # every one of the 6 tensors recorded an amax
    err = rel_error(y, ref)
    assert 1e-4 < err < 0.12, err  # FP8 did run, and close to the bf16/fp32 answer
    for g, r in zip([x.grad] + [q.grad for q in m.parameters()], gref):
        assert rel_error(g, r) < 0.15


@needs_fp8
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation,bias,rows", [("swiglu", False, 96), ("gelu_erf", False, 40),
                                                  ("swiglu", True, 96)])
def test_fp8_activation_gradient_cast_by_its_kernel(device, activation, bias, rows, monkeypatch, caplog, seed):
    """Delayed scaling with an amax history and no FC1 bias: the
    activation-gradient kernel writes FC1's output gradient in FP8 (no
    high-precision gradient, no cast of it; padded rows zero).  The step
    gives the unfused path's gradients (the gradient in the input's dtype,
    then quantize_grad) from the same scaling state, up to the one rounding
    it saves, and records the gradient's amax.  With an FC1 bias the
    unfused path runs (its gradient is the high-precision column sums)."""
    import copy

    from seqfuse.ops import act as A
    from seqfuse.quantization.gemm_quantizers import GradQuantizer

    dt = torch.bfloat16  # (the high-precision gradient is rounded to bf16 before the unfused cast)
    m = te.LayerNormMLP(128, 256, activation=activation, normalization="RMSNorm", bias=bias,
                        params_dtype=dt, device=device)
    randomize(m)
    x = torch.randn(rows, 128, device=device, dtype=dt, requires_grad=True)
    dy = torch.randn(rows, 128, device=device, dtype=dt)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    for _ in range(2):  # an amax history for every tensor
        with autocast(recipe=recipe):
            m(x).backward(dy)
    fp8_outs = []
    act_backward = A.act_backward

    def spy(*args, **kwargs):
        fp8_outs.append(len(args) > 3 and args[3] is not None)
        return act_backward(*args, **kwargs)

    monkeypatch.setattr(A, "act_backward", spy)
    from seqfuse.modules import layernorm_mlp

    one_pass = layernorm_mlp.M.swiglu_backward_cast_fp8_grouped

    def spy_one_pass(*args, **kwargs):  # (swiglu: the grouped SwiGLU backward writes it, _one_pass_swiglu)
        fp8_outs.append(kwargs.get("grad_fp8_dtype") is not None)
        return one_pass(*args, **kwargs)

    monkeypatch.setattr(layernorm_mlp.M, "swiglu_backward_cast_fp8_grouped", spy_one_pass)

    monkeypatch.setattr(layernorm_mlp, "_logged_act_grad_with_bias", [])
    grads, amaxes = [], []
    for fused in (True, False):
        mc = copy.deepcopy(m)
        if not fused:
            monkeypatch.setattr(GradQuantizer, "fused_cast", property(lambda self: False))
        xc = x.detach().clone().requires_grad_()
        with autocast(recipe=recipe):
            y = mc(xc)
        with caplog.at_level(logging.INFO, logger="seqfuse"):
            y.backward(dy)
        grads.append([xc.grad] + [p.grad for p in mc.parameters()])
        amaxes.append(mc.fp8_state.amax_history[0, 2].item())
    assert fp8_outs == [not bias, False]
    # the bias case says once why its gradient is cast separately (the switched-off run says nothing)
    assert caplog.text.count("an FC1 bias: its gradient sums the high-precision rows") == (1 if bias else 0)
    assert amaxes[0] > 0 and abs(amaxes[0] - amaxes[1]) <= 2 ** -7 * amaxes[1]  # (dh rounded to bf16 or not)
    mc = copy.deepcopy(m)  # the step without FP8: both FP8 paths' errors against it
    xc = x.detach().clone().requires_grad_()
    mc(xc).backward(dy)
    ref = [xc.grad] + [p.grad for p in mc.parameters()]
    for name, g, u, r in zip(["x"] + [n for n, _ in m.named_parameters()], *grads, ref):
        assert torch.isfinite(g).all(), name
        if bias:
            assert torch.equal(g, u), name
        else:  # E5M2 from float32, or from bf16 (a second rounding): a few percent apart, no less exact
            assert rel_error(g, u) < 0.06, name
            assert rel_error(g, r) < 1.15 * rel_error(u, r) + 1e-3, name


@needs_fp8
def test_layernorm_linear_fp8_cpu(seed):
    m = te.LayerNormLinear(64, 48, device="cpu", return_layernorm_output=True)
    randomize(m)
    x = torch.randn(32, 64, requires_grad=True)
    ref, ref_ln = m(x)
    for _ in range(2):
        with autocast(recipe=DelayedScaling()):
            y, ln = m(x)
        (y.sum() + ln.sum()).backward()
    assert 1e-4 < rel_error(y, ref) < 0.1
    assert_close_rel(ln, ref_ln, torch.float32)  # the returned norm output is not quantized


def test_layernorm_mlp_fp8_unsupported_recipe():
    from seqfuse.common.recipe import MXFP8BlockScaling

    m = te.LayerNormMLP(64, 128, device="cpu")
    with pytest.raises(NotImplementedError, match="LayerNormMLP: FP8 recipe MXFP8BlockScaling is not supported: its GEMMs need compute capability 10.x"):
        with autocast(recipe=MXFP8BlockScaling()):
            m(torch.randn(16, 64))


# ---- Float8BlockScaling: against float64 on the same quantized operands ------

def block_reference(m, x, dy, h_mod=None):
    """float64 forward and gradients of the module's block-FP8 computation
    (TE's Float8BlockScaling): every GEMM operand quantized the way the module
    must quantize it -- inputs and output gradients in 1x128 blocks, row-wise
    for the forward / dgrad GEMM and column-wise (blocks along the tokens)
    for the wgrad GEMM, weights in 128x128 blocks -- in plain torch, with the
    norm, activation and their gradients in float64.  LayerNormMLP: the
    activation (and its gradient) is taken at the module's own FC1 output
    h_mod, which is checked against the reference's FC1 output separately:
    an FP8 rounding flip of FC2's input caused by float32-vs-float64 h would
    otherwise cascade into ~3e-3 of noise that hides real errors.
    Returns (out, grads by name, with "x", and "h" for the MLP)."""
    from helpers import block128_dequantized_ref, block_dequantized_ref

    def rq(t, col=False):
        return block_dequantized_ref(t.float(), columnwise=col)

    # the quantization helpers return CPU float64: the whole reference runs there
    p = {n: t.detach().double().cpu().clone().requires_grad_() for n, t in m.named_parameters()}
    x, dy = x.detach().cpu(), dy.detach().cpu()
    h_mod = None if h_mod is None else h_mod.detach().cpu()
    xd = x.double().requires_grad_()
    ln = ref_norm(xd, p["layer_norm_weight"], p.get("layer_norm_bias"), m.eps, m.normalization,
                  m.zero_centered_gamma)
    ln_d = ln.detach()
    grads = {}
    if isinstance(m, te.LayerNormLinear):
        wq = block128_dequantized_ref(m.weight)
        out = rq(ln_d) @ wq.t() + (p["bias"].detach() if "bias" in p else 0)
        dln = rq(dy) @ wq
        grads["weight"] = rq(dy, True).t() @ rq(ln_d, True)
        if "bias" in p:
            grads["bias"] = dy.double().sum(0)
    else:
        w1q, w2q = block128_dequantized_ref(m.fc1_weight), block128_dequantized_ref(m.fc2_weight)
        grads["h"] = rq(ln_d) @ w1q.t() + (p["fc1_bias"].detach() if "fc1_bias" in p else 0)
        h = h_mod.detach().double().requires_grad_()
        a = ref_act(m.activation, h)
        a_d = a.detach()
        out = rq(a_d) @ w2q.t() + (p["fc2_bias"].detach() if "fc2_bias" in p else 0)
        da = rq(dy) @ w2q
        (dh,) = torch.autograd.grad(a, h, da)
        dln = rq(dh) @ w1q
        grads["fc2_weight"] = rq(dy, True).t() @ rq(a_d, True)
        grads["fc1_weight"] = rq(dh, True).t() @ rq(ln_d, True)
        if "fc1_bias" in p:
            grads["fc1_bias"], grads["fc2_bias"] = dh.sum(0), dy.double().sum(0)
    norm_params = [xd, p["layer_norm_weight"]] + ([p["layer_norm_bias"]] if "layer_norm_bias" in p else [])
    g = torch.autograd.grad(ln, norm_params, dln)
    grads["x"], grads["layer_norm_weight"] = g[0], g[1]
    if len(g) > 2:
        grads["layer_norm_bias"] = g[2]
    return out, grads


def run_block_fp8(cls, device, tokens, hidden, ffn, activation="gelu", normalization="LayerNorm",
                  dtype=torch.float32):
    from seqfuse.common.recipe import Float8BlockScaling

    if cls == "LayerNormLinear":
        m = te.LayerNormLinear(hidden, ffn, normalization=normalization, params_dtype=dtype,
                               device=device)
    else:
        m = te.LayerNormMLP(hidden, ffn, activation=activation, normalization=normalization,
                            params_dtype=dtype, device=device)
    randomize(m)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    out_f = ffn if cls == "LayerNormLinear" else hidden
    dy = torch.randn(tokens, out_f, device=device, dtype=dtype)
    with autocast(recipe=Float8BlockScaling()):
        y = m(x)
    # LayerNormMLP's FC1 output, saved for its backward (tensor 4 on the block path)
    h = y.grad_fn.saved_tensors[4] if cls == "LayerNormMLP" else None
    y.backward(dy)
    return m, x, dy, y, h


@pytest.mark.parametrize("cls,activation,normalization,tokens", [
    ("LayerNormLinear", None, "LayerNorm", 256),
    ("LayerNormLinear", None, "RMSNorm", 144),     # tokens not a multiple of 128
    ("LayerNormMLP", "gelu", "LayerNorm", 128),
    ("LayerNormMLP", "swiglu", "RMSNorm", 176),
])
@needs_fp8
def test_layernorm_modules_fp8_block_cpu(cls, activation, normalization, tokens, seed):
    m, x, dy, y, h = run_block_fp8(cls, "cpu", tokens, 256, 384, activation or "gelu", normalization)
    check_block_against_reference(m, x, dy, y, h, 1.0)


def check_block_against_reference(m, x, dy, y, h, factor):
    """The same quantized operands in float64: only float32 rounding, and the
    rare FP8 rounding flip it causes, separates them (CPU, 6 seeds: at most
    5e-4 for outputs and FC1's h, 3e-4 for gradients); one wrongly
    quantized operand gives 1e-2 and more."""
    ref, grads = block_reference(m, x, dy, h)
    assert rel_error(y, ref) < 2e-3 * factor
    if h is not None:
        assert rel_error(h, grads.pop("h")) < 2e-3 * factor
    assert rel_error(x.grad, grads.pop("x")) < 2e-3 * factor
    for name, g in grads.items():
        assert rel_error(m.get_parameter(name).grad, g) < 2e-3 * factor, name
    # and FP8 did run: the unquantized module is measurably elsewhere
    with torch.no_grad():
        assert rel_error(m(x), y) > 1e-2


@needs_fp8
def test_layernorm_modules_fp8_block_weight_cache_and_errors(seed):
    from seqfuse.common.recipe import Float8BlockScaling

    m = te.LayerNormMLP(128, 256, device="cpu")
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(32, 128)
    with autocast(recipe=Float8BlockScaling()):
        for step in range(2):
            for micro in range(3):  # gradient accumulation: each weight quantized once per step
                m(x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert weight_casts(m) == 4  # 2 weights x 2 updates
    lnl = te.LayerNormLinear(128, 192, device="cpu")
    with pytest.raises(ValueError, match="LayerNormLinear: block-scaled FP8 .* need out_features to be a multiple of 128, got 192"):
        with autocast(recipe=Float8BlockScaling()):
            lnl(x)
    with pytest.raises(NotImplementedError, match="w_block_scaling_dim=2"):
        with autocast(recipe=Float8BlockScaling(w_block_scaling_dim=1)):
            m(x)


# ---- CUDA --------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu", "geglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp_cuda_bf16(activation, normalization, seed):
    m = te.LayerNormMLP(1024, 2048, activation=activation, normalization=normalization,
                        params_dtype=torch.bfloat16, device="cuda")
    randomize(m)
    p = params64(m)
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    out = m(x)
    # ReLU' is a step: where bf16 rounding of the inputs flips the sign of a
    # near-zero pre-activation (~5e-4 of them), seqfuse and a float64 ReLU
    # legitimately differ by a whole dh, ~3.3e-2 relative in dx (torch's own
    # bf16 MLP shows the same).  The reference takes ReLU's mask from
    # seqfuse's own pre-activation; the rest must then be bf16 rounding.
    mask = saved_preactivation(out, 2048).double() > 0 if activation == "relu" else None
    ref = ref_mlp(m, p, xd, relu_mask=mask)
    dy = torch.randn_like(out)
    out.backward(dy)
    ref.backward(dy.double())
    assert_close_rel(out, ref, torch.bfloat16, factor=2)
    check_grads(m, p, x, xd, torch.bfloat16, factor=3)


@pytest.mark.cuda
def test_layernorm_linear_cuda_bf16(seed):
    m = te.LayerNormLinear(2048, 3072, params_dtype=torch.bfloat16, device="cuda", return_layernorm_output=True)
    randomize(m)
    p = params64(m)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd = x.detach().double().requires_grad_()
    out, ln = m(x)
    ref, ref_ln = ref_lnl(m, p, xd)
    dy = torch.randn_like(out)
    (out * dy).sum().backward()
    (ref * dy.double()).sum().backward()
    assert_close_rel(out, ref, torch.bfloat16, factor=2)
    assert_close_rel(ln, ref_ln, torch.bfloat16)
    check_grads(m, p, x, xd, torch.bfloat16, factor=3)


@needs_fp8
@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("current", [False, True], ids=["delayed", "current"])
def test_layernorm_mlp_cuda_fp8(activation, current, seed):
    from seqfuse.common.recipe import Float8CurrentScaling

    m = te.LayerNormMLP(1024, 4096, activation=activation, params_dtype=torch.bfloat16, device="cuda")
    randomize(m)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = m(x)
    ref.backward(torch.ones_like(ref))
    gref = [x.grad.clone()] + [q.grad.clone() for q in m.parameters()]
    recipe = Float8CurrentScaling() if current else DelayedScaling(fp8_format=Format.HYBRID,
                                                                    amax_history_len=16)
    for _ in range(3):
        x.grad = None
        m.zero_grad()
        with autocast(recipe=recipe):
            y = m(x)
        y.backward(torch.ones_like(y))
    assert 1e-4 < rel_error(y, ref) < 0.12
    for g, r in zip([x.grad] + [q.grad for q in m.parameters()], gref):
        assert rel_error(g, r) < 0.15


@pytest.mark.cuda
@pytest.mark.parametrize("cls,activation,tokens", [
    ("LayerNormLinear", None, 2048), ("LayerNormLinear", None, 1040),
    ("LayerNormMLP", "gelu", 2048), ("LayerNormMLP", "swiglu", 1040), ("LayerNormMLP", "geglu", 512)])
@needs_fp8
def test_layernorm_modules_cuda_fp8_block(cls, activation, tokens, seed):
    """bf16 under Float8BlockScaling against the same bf16 module without FP8
    (FP8 tolerances), and in float32 against the float64 reference of the
    quantized computation (cuBLASLt's accumulation order and its bfloat16
    bias in FP8 GEMMs loosen it to 5x the CPU bounds).  No ReLU here: FP8
    flips the sign of many near-zero pre-activations, each a whole dh of
    difference from the bf16 module (0.17 in the gradients on the CPU)."""
    from seqfuse.common.recipe import Float8BlockScaling

    hidden, ffn = 1024, (3072 if cls == "LayerNormLinear" else 4096)
    m, x, dy, y, h = run_block_fp8(cls, "cuda", tokens, hidden, ffn, activation or "gelu",
                                   "RMSNorm" if activation == "swiglu" else "LayerNorm")
    check_block_against_reference(m, x, dy, y, h, 5.0)
    mb = m.to(torch.bfloat16)
    mb.zero_grad(set_to_none=True)  # drop the float32 run's gradients
    xb = x.detach().bfloat16().requires_grad_()
    dyb = dy.bfloat16()
    ref = mb(xb)
    ref.backward(dyb)
    gref = [xb.grad.clone()] + [q.grad.clone() for q in mb.parameters()]
    xb.grad = None
    mb.zero_grad()
    with autocast(recipe=Float8BlockScaling()):
        out = mb(xb)
    out.backward(dyb)
    assert out.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert 1e-3 < rel_error(out, ref) < 0.08
    for g, r in zip([xb.grad] + [q.grad for q in mb.parameters()], gref):
        assert rel_error(g, r) < 0.1


@needs_fp8
@pytest.mark.parametrize("cls", ["LayerNormLinear", "LayerNormMLP"])
def test_layernorm_modules_fp8_current_scaling_cpu(cls, seed):
    from seqfuse.common.recipe import Float8CurrentScaling

    m = te.LayerNormLinear(64, 48, device="cpu") if cls == "LayerNormLinear" else \
        te.LayerNormMLP(64, 128, activation="swiglu", device="cpu")
    randomize(m)
    x = torch.randn(32, 64, requires_grad=True)
    ref = m(x)
    ref.backward(torch.ones_like(ref))
    gref = [x.grad.clone()] + [q.grad.clone() for q in m.parameters()]
    x.grad = None
    m.zero_grad()
    with autocast(recipe=Float8CurrentScaling()):
        y = m(x)
    y.backward(torch.ones_like(y))
    assert getattr(m, "fp8_state", None) is None  # current scaling keeps no state
    assert 1e-4 < rel_error(y, ref) < 0.1
    for g, r in zip([x.grad] + [q.grad for q in m.parameters()], gref):
        assert rel_error(g, r) < 0.15


def saved_activation_shapes(module, x, **kw):
    """The shapes of the tensors (not parameters) a forward keeps for its
    backward, one per storage."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key != x.untyped_storage().data_ptr():
            seen.setdefault(key, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, **kw)
    return list(seen.values()), out


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("ret_ln", [False, True])
def test_high_precision_modules_make_the_norm_output_again_in_the_backward(normalization, ret_ln):
    """Without FP8 the norm output is not kept for the weight gradient: the
    backward makes it again from the saved input and statistics (bit for bit
    the forward's), so the only [tokens, hidden] activation kept is the input
    itself, unless the norm output is returned (then it lives anyway and is
    kept).  Gradients equal a float64 reference."""
    torch.manual_seed(0)
    tokens, hidden = 48, 32
    for module in (te.LayerNormLinear(hidden, 64, normalization=normalization, return_layernorm_output=ret_ln),
                   te.LayerNormMLP(hidden, 64, normalization=normalization, return_layernorm_output=ret_ln)):
        randomize(module)
        x = torch.randn(tokens, hidden, requires_grad=True)
        shapes, out = saved_activation_shapes(module, x)
        assert shapes.count((tokens, hidden)) == (1 if ret_ln else 0), (type(module).__name__, shapes)
        y = out[0] if isinstance(out, tuple) else out
        gy = torch.randn_like(y)
        y.backward(gy)
        p64 = params64(module)
        x64 = x.detach().double().requires_grad_()
        ln = ref_norm(x64, p64["layer_norm_weight"], p64.get("layer_norm_bias"), module.eps, normalization, False)
        if isinstance(module, te.LayerNormLinear):
            y64 = ln @ p64["weight"].t() + p64["bias"]
        else:
            h = ln @ p64["fc1_weight"].t() + p64["fc1_bias"]
            y64 = ref_act("gelu", h) @ p64["fc2_weight"].t() + p64["fc2_bias"]
        y64.backward(gy.double())
        assert rel_error(x.grad, x64.grad) < 1e-5
        for n, p in module.named_parameters():
            assert rel_error(p.grad, p64[n].grad) < 1e-5, n


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_recomputed_norm_output_gives_the_kept_ones_gradients_bit_for_bit(device, normalization, activation):
    """The recompute is the forward's own kernel on the same inputs: a module
    that keeps its norm output (returned, return_layernorm_output=True) and
    one that makes it again give equal gradients bit for bit, with bf16
    input, float32 norm weights and zero-centred gamma."""
    torch.manual_seed(1)
    kw = dict(normalization=normalization, zero_centered_gamma=True, device=device, params_dtype=torch.float32)
    for make in (lambda ret: te.LayerNormLinear(64, 96, return_layernorm_output=ret, **kw),
                 lambda ret: te.LayerNormMLP(64, 128, activation=activation, return_layernorm_output=ret, **kw)):
        keep, again = make(True), make(False)
        randomize(keep)
        again.load_state_dict(keep.state_dict())
        for m in (keep, again):  # the GEMMs in bf16, the norm weights float32
            for n, p in m.named_parameters():
                if "layer_norm" not in n:
                    p.data = p.data.bfloat16()
        x = torch.randn(40, 64, device=device, dtype=torch.bfloat16)
        dy = None
        grads = []
        for m, ret in ((keep, True), (again, False)):
            xi = x.clone().requires_grad_()
            y = m(xi)[0] if ret else m(xi)
            dy = torch.randn_like(y) if dy is None else dy
            y.backward(dy)  # (the kept module's returned norm output takes no gradient)
            grads.append([xi.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "silu", "gelu_erf", "relu"])
def test_recompute_activation_keeps_no_activation_and_gives_the_same_bits(device, activation):
    """LayerNormMLP(recompute_activation=True) without FP8: the forward keeps
    FC1's output but not the activation (one [tokens, ffn] tensor fewer), the
    backward makes it again with the forward's kernel, so output and
    gradients equal the keeping module's bit for bit (bf16 GEMMs, float32
    norm weights).  Under FP8 the option changes nothing (the activation is
    kept as its FP8 copy either way)."""
    torch.manual_seed(2)
    tokens, hidden, ffn = 40, 64, 128
    kw = dict(activation=activation, device=device, params_dtype=torch.float32)
    keep, lean = te.LayerNormMLP(hidden, ffn, **kw), te.LayerNormMLP(hidden, ffn, recompute_activation=True, **kw)
    randomize(keep)
    lean.load_state_dict(keep.state_dict())
    for m in (keep, lean):
        for n, p in m.named_parameters():
            if "layer_norm" not in n:
                p.data = p.data.bfloat16()
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    results = []
    for m in (keep, lean):
        xi = x.clone().requires_grad_()
        shapes, y = saved_activation_shapes(m, xi)
        y.backward(dy)
        results.append((shapes, [y.detach(), xi.grad] + [p.grad for p in m.parameters()]))
    (kept_shapes, a), (lean_shapes, b) = results
    assert sorted(kept_shapes) == sorted(lean_shapes + [(tokens, ffn)]), (kept_shapes, lean_shapes)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    if device == "cpu":  # FP8 (the CPU backend): the flag is inert
        outs = []
        for m in (keep, lean):
            with autocast(recipe=DelayedScaling()):
                outs.append(m(x.clone().requires_grad_()))
        assert torch.equal(outs[0], outs[1])


def test_recompute_activation_refused_with_the_tanh_gelu_also_when_set_later():
    with pytest.raises(ValueError, match="recompute_activation=True needs an activation other than 'gelu'"):
        te.LayerNormMLP(64, 96, activation="gelu", recompute_activation=True, device="cpu")
    m = te.LayerNormMLP(64, 96, activation="gelu", device="cpu")
    with pytest.raises(ValueError, match="needs an activation other than 'gelu'"):
        m.recompute_activation = True
    assert m.recompute_activation is False and "recompute_activation" not in repr(m)
    assert "recompute_activation=True" in repr(te.LayerNormMLP(64, 96, activation="swiglu", device="cpu",
                                                              recompute_activation=True))
