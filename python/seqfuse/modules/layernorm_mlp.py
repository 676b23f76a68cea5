"""LayerNormMLP: normalization, FC1, activation and FC2 in one module
(Transformer Engine's name, arguments and parameter names).

    LayerNormMLP(hidden_size, ffn_hidden_size, eps=1e-5, bias=True,
                 normalization="LayerNorm", activation="gelu",
                 zero_centered_gamma=False, params_dtype=None, device=None,
                 init_method=None, output_layer_init_method=None)

Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
``fc1_weight`` [fc1_out, hidden], ``fc1_bias``, ``fc2_weight`` [hidden, ffn],
``fc2_bias``; fc1_out is 2 x ffn for the gated activations (swiglu, geglu,
reglu: TE's layout, the activated half first, then the gate half).
Activations: gelu (tanh approximation, TE's), gelu_erf, relu, silu, swiglu,
geglu, reglu, geglu_erf.

Without FP8: norm kernel, FC1 GEMM with its bias, activation kernel, FC2 GEMM
with its bias; the backward runs the activation-gradient kernel and takes the
bias gradients from the weight GEMMs' bgrad epilogue.  For "gelu" (tanh) the
activation rides in cuBLASLt's epilogues instead (FC1: bias + GELU keeping the
pre-activation; FC2's dgrad: GELU' and FC1's bias gradient), which saves a
pass over the [tokens, ffn] activations each way.

Under autocast with DelayedScaling: ScalingState of 6 (3 per GEMM: FC1
input 0, weight 1, output gradient 2; FC2 input 3, weight 4, output gradient
5).  The norm kernel writes FC1's input in FP8, the activation kernel writes
FC2's input in FP8 (fused casts with amax), weights are cast+transposed once
per forward, output gradients are cast+transposed, and all six GEMMs run in
FP8.  Float8CurrentScaling: the same six FP8 GEMMs, each operand scaled from
its own amax just before its cast (norm and activation outputs are made in
high precision, then cast+transposed).  The activation gradient is computed in the input's dtype, summed for
FC1's bias gradient, then cast+transposed for FC1's gradient GEMMs.
Float8BlockScaling: each GEMM runs Linear's block path
(seqfuse.modules.linear.block_forward / block_backward): the norm output,
the activation output and both output gradients are made in high precision
and read once each by the kernel that writes their row-wise and column-wise
1x128 FP8 copies; the two weights are quantized in 128x128 blocks and cached
until they change.  hidden and ffn sizes must be multiples of 128, tokens of
16.
"""
import torch

from .. import ops
from ..ops import act as A
from .layernorm_linear import (TE_DEFAULTS, Quantizers, _check_normalization, _make_norm_params,
                               _reject_unsupported, _reset_norm_params, _wgrad_dtype, active_fp8_recipe, as_dtype, check_block_shapes,
                               fp8_gemm, init_weight, is_block, norm_backward,
                               norm_forward, norm_param)
from .linear import _quantize_weight, block_backward, block_forward
from ._input import check_input
from .norm import _hidden, default_device

ACTIVATIONS = ("gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu", "reglu", "geglu_erf")

MLP_TE_DEFAULTS = dict(TE_DEFAULTS, return_layernorm_output=False, seq_length=None,
                       micro_batch_size=None, ub_overlap_rs_dgrad=False, delay_wgrad_compute=False)


class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, eps, rms, zc, activation, module, recipe):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        lnw, lnb = norm_param(ln_w, x2), norm_param(ln_b, x2)
        dt = x.dtype
        ctx.fp8 = recipe is not None
        ctx.block = is_block(recipe)
        if ctx.block:  # Linear's block path, once per GEMM
            ln, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
            w1_f, w1_b = _quantize_weight(module, w1, recipe, "block", None, None, slot="fc1")
            h, ln_t = block_forward(ln, w1_f, recipe, dt, as_dtype(b1, dt), ctx.needs_input_grad[3])
            a = A.act_fwd(h, activation)
            w2_f, w2_b = _quantize_weight(module, w2, recipe, "block", None, None, slot="fc2")
            out, a_t = block_forward(a, w2_f, recipe, dt, as_dtype(b2, dt), ctx.needs_input_grad[5])
            ctx.save_for_backward(x2, lnw, mean, rstd, h, *ln_t, *a_t, w1_b.data, w1_b.scale_inv,
                                  w2_b.data, w2_b.scale_inv)
            ctx.recipe = recipe
        elif ctx.fp8:
            q = Quantizers(module, 6, (2, 5), recipe, x.device)
            ln8, ln8_t, ln_si, mean, rstd = q.norm(x2, lnw, lnb, eps, rms, zc, 0)
            w1_q = q.quantize(w1.detach(), 1)
            h = fp8_gemm(ln8, ln_si, w1_q.data, w1_q.scale_inv, dt, as_dtype(b1, dt), fast=True)
            a8, a8_t, a_si = q.act(h, activation, 3)
            w2_q = q.quantize(w2.detach(), 4)
            out = fp8_gemm(a8, a_si, w2_q.data, w2_q.scale_inv, dt, as_dtype(b2, dt), fast=True)
            ctx.save_for_backward(x2, lnw, mean, rstd, ln8, ln8_t, ln_si, h, a8, a8_t, a_si,
                                  w1_q.data_t, w1_q.scale_inv, w2_q.data_t, w2_q.scale_inv)
            ctx.quantizers = q
        else:
            ln, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
            w1c, w2c = as_dtype(w1, dt), as_dtype(w2, dt)
            if activation == "gelu":  # GELU in FC1's epilogue, pre-activation kept as aux
                a, h = ops.gemm(ln, w1c, transb=True, bias=as_dtype(b1, dt), epilogue="gelu_aux")
            else:
                h = ops.gemm(ln, w1c, transb=True, bias=as_dtype(b1, dt))
                a = A.act_fwd(h, activation)
            out = ops.gemm(a, w2c, transb=True, bias=as_dtype(b2, dt))
            ctx.save_for_backward(x2, lnw, mean, rstd, ln, h, a, w1c, w2c)
        ctx.meta = (x.shape, rms, zc, activation, ln_b is not None, ln_w.dtype, w1.dtype, w2.dtype,
                    None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        x_shape, rms, zc, activation, has_ln_bias, lnw_dt, w1_dt, w2_dt, b1_dt, b2_dt = ctx.meta
        dout2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        db1 = db2 = None
        if ctx.block:
            (x2, lnw, mean, rstd, h, ln_t, ln_t_si, a_t, a_t_si, w1_t, w1_si, w2_t,
             w2_si) = ctx.saved_tensors
            dt, recipe = x2.dtype, ctx.recipe
            # the bias gradients come out of the gradients' quantization passes
            da, dw2, db2 = block_backward(dout2, (a_t, a_t_si), (w2_t, w2_si), recipe, dt, True,
                                          ctx.needs_input_grad[5], _wgrad_dtype(w2_dt),
                                          need_dbias=b2_dt is not None)
            dh = A.act_bwd(da, h, activation)
            dln, dw1, db1 = block_backward(dh, (ln_t, ln_t_si), (w1_t, w1_si), recipe, dt, True,
                                           ctx.needs_input_grad[3], _wgrad_dtype(w1_dt),
                                           need_dbias=b1_dt is not None)
        elif ctx.fp8:
            (x2, lnw, mean, rstd, ln8, ln8_t, ln_si, h, a8, a8_t, a_si, w1_t, w1_si, w2_t,
             w2_si) = ctx.saved_tensors
            dt = x2.dtype
            q = ctx.quantizers
            g2, db2 = q.grad(dout2, 5, b2_dt)
            da = fp8_gemm(g2.data, g2.scale_inv, w2_t, w2_si, dt)
            if a8_t is None:
                a8_t = ops.transpose_fp8(a8)
            dw2 = fp8_gemm(g2.data_t, g2.scale_inv, a8_t, a_si, _wgrad_dtype(w2_dt))
            dh = A.act_bwd(da, h, activation)
            g1, db1 = q.grad(dh, 2, b1_dt)
            dln = fp8_gemm(g1.data, g1.scale_inv, w1_t, w1_si, dt)
            if ln8_t is None:
                ln8_t = ops.transpose_fp8(ln8)
            dw1 = fp8_gemm(g1.data_t, g1.scale_inv, ln8_t, ln_si, _wgrad_dtype(w1_dt))
        else:
            x2, lnw, mean, rstd, ln, h, a, w1c, w2c = ctx.saved_tensors
            dw2, db2 = _wgrad(dout2, a, b2_dt)
            if activation == "gelu":  # GELU' (and FC1's bias gradient) in the dgrad epilogue
                if b1_dt is not None:
                    dh, db1 = ops.gemm(dout2, w2c, aux=h, epilogue="dgelu_bgrad")
                else:
                    dh = ops.gemm(dout2, w2c, aux=h, epilogue="dgelu")
                dln = ops.gemm(dh, w1c)
                dw1 = ops.gemm(dh, ln, transa=True)
            else:
                da = ops.gemm(dout2, w2c)
                dh = A.act_bwd(da, h, activation)
                dln = ops.gemm(dh, w1c)
                dw1, db1 = _wgrad(dh, ln, b1_dt)
        dx, dg, db = norm_backward(dln, x2, mean, rstd, lnw, rms, zc, has_ln_bias)
        return (dx.view(x_shape), as_dtype(dg, lnw_dt), as_dtype(db, lnw_dt), as_dtype(dw1, w1_dt),
                as_dtype(db1, b1_dt), as_dtype(dw2, w2_dt), as_dtype(db2, b2_dt),
                None, None, None, None, None, None)


def _wgrad(dy, inp, bias_dtype):
    """dW = dy^T @ inp, and the bias gradient from the same GEMM."""
    if bias_dtype is None:
        return ops.gemm(dy, inp, transa=True), None
    return ops.gemm(dy, inp, transa=True, epilogue="bgrad")


class LayerNormMLP(torch.nn.Module):
    """Norm + FC1 + activation + FC2; see the module note."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", zero_centered_gamma=False, params_dtype=None, device=None,
                 init_method=None, output_layer_init_method=None, **te_kwargs):
        super().__init__()
        _reject_unsupported("LayerNormMLP", te_kwargs, MLP_TE_DEFAULTS)
        _check_normalization(normalization)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: argument 'activation' must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.hidden_size = _hidden(hidden_size)
        self.ffn_hidden_size = int(ffn_hidden_size)
        self.eps = float(eps)
        self.normalization = normalization
        self.activation = activation
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.use_bias = bool(bias)
        fc1_out = 2 * self.ffn_hidden_size if activation in A.GATED else self.ffn_hidden_size
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        kw = dict(dtype=dtype, device=default_device(device))
        _make_norm_params(self, self.hidden_size, normalization, kw)
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, self.hidden_size, **kw))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_out, **kw)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(self.hidden_size, self.ffn_hidden_size, **kw))
        self.fc2_bias = torch.nn.Parameter(torch.empty(self.hidden_size, **kw)) if bias else None
        self.init_method = init_method
        self.output_layer_init_method = output_layer_init_method
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            _reset_norm_params(self)
            init_weight(self.fc1_weight, self.init_method)
            init_weight(self.fc2_weight, self.output_layer_init_method)
            for b in (self.fc1_bias, self.fc2_bias):
                if b is not None:
                    b.zero_()

    def forward(self, x):
        check_input("LayerNormMLP", x, self.hidden_size, "hidden_size")
        recipe = active_fp8_recipe("LayerNormMLP")
        if is_block(recipe):
            check_block_shapes("LayerNormMLP", x.numel() // self.hidden_size,
                               (self.hidden_size, self.fc1_weight.shape[0]),
                               (self.ffn_hidden_size, self.hidden_size))
        return _LayerNormMLPFn.apply(x, self.layer_norm_weight, self.layer_norm_bias, self.fc1_weight,
                                     self.fc1_bias, self.fc2_weight, self.fc2_bias, self.eps,
                                     self.normalization == "RMSNorm", self.zero_centered_gamma,
                                     self.activation, self, recipe)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}")


__all__ = ["LayerNormMLP"]
