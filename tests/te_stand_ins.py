"""Plain-torch stand-ins for seqfuse.pytorch's Linear, LayerNorm, LayerNormLinear
and LayerNormMLP, with Transformer Engine's constructor arguments and
parameter names.  Tests of the layers built on top of them (MultiheadAttention,
TransformerLayer, the HF models) use these only for the modules a checkout
does not have yet (``install_missing``), so the composition logic is tested
before every kernel family has landed; where the real module exists, it is
used."""

import torch
import torch.nn.functional as F
from torch import nn

import seqfuse.pytorch


def _p(*shape, dtype=None, device=None):
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


def _norm(x, w, b, eps, normalization, zero_centered_gamma):
    w = w + 1 if zero_centered_gamma else w
    if normalization == "RMSNorm":
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (y * w.float()).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w.to(x.dtype), None if b is None else b.to(x.dtype), eps)


def act(name, x):
    if name == "gelu":  # TE's gelu is the tanh approximation
        return F.gelu(x, approximate="tanh")
    if name == "gelu_erf":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "swiglu":
        a, g = x.chunk(2, dim=-1)
        return F.silu(a) * g
    if name == "geglu":
        a, g = x.chunk(2, dim=-1)
        return F.gelu(a, approximate="tanh") * g
    raise ValueError(name)


def _linear_params(m, in_features, out_features, bias, params_dtype, device):
    """m.weight ~ N(0, 0.02) and m.bias zeros (or None)."""
    m.weight = _p(out_features, in_features, dtype=params_dtype, device=device)
    m.bias = _p(out_features, dtype=params_dtype, device=device) if bias else None
    nn.init.normal_(m.weight, std=0.02)
    if m.bias is not None:
        nn.init.zeros_(m.bias)


class Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None, init_method=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        _linear_params(self, in_features, out_features, bias, params_dtype, device)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, sequence_parallel=None, params_dtype=None,
                 zero_centered_gamma=False, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x):
        return _norm(x, self.weight, self.bias, self.eps, "LayerNorm", False)


class LayerNormLinear(nn.Module):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None, device=None,
                 init_method=None):
        super().__init__()
        self.eps, self.normalization, self.zcg = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype, device=device))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(in_features, dtype=params_dtype, device=device))
                                if normalization == "LayerNorm" else None)
        _linear_params(self, in_features, out_features, bias, params_dtype, device)

    def forward(self, x):
        ln = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zcg)
        out = F.linear(ln, self.weight, self.bias)
        return (out, ln) if self.return_layernorm_output else out


class LayerNormMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", zero_centered_gamma=False, params_dtype=None, device=None,
                 init_method=None, output_layer_init_method=None):
        super().__init__()
        self.eps, self.normalization, self.zcg, self.activation = eps, normalization, zero_centered_gamma, activation
        fc1_out = 2 * ffn_hidden_size if activation in ("swiglu", "geglu") else ffn_hidden_size
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.layer_norm_bias = (nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
                                if normalization == "LayerNorm" else None)
        self.fc1_weight = _p(fc1_out, hidden_size, dtype=params_dtype, device=device)
        self.fc1_bias = _p(fc1_out, dtype=params_dtype, device=device) if bias else None
        self.fc2_weight = _p(hidden_size, ffn_hidden_size, dtype=params_dtype, device=device)
        self.fc2_bias = _p(hidden_size, dtype=params_dtype, device=device) if bias else None
        for w in (self.fc1_weight, self.fc2_weight):
            nn.init.normal_(w, std=0.02)
        for b in (self.fc1_bias, self.fc2_bias):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x):
        ln = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zcg)
        h = act(self.activation, F.linear(ln, self.fc1_weight, self.fc1_bias))
        return F.linear(h, self.fc2_weight, self.fc2_bias)


NAMES = ("Linear", "LayerNorm", "LayerNormLinear", "LayerNormMLP")


def missing():
    return [n for n in NAMES if not hasattr(seqfuse.pytorch, n)]


def install_missing(monkeypatch):
    """Put stand-ins into seqfuse.pytorch for the names it lacks; returns them."""
    names = missing()
    for n in names:
        monkeypatch.setattr(seqfuse.pytorch, n, globals()[n], raising=False)
    return names


