"""LayerNormLinear: normalization fused in front of a linear layer
(Transformer Engine's name, arguments and parameter names).  What it shares
with LayerNormMLP is in seqfuse.modules._base.

    LayerNormLinear(in_features, out_features, eps=1e-5, bias=True,
                    normalization="LayerNorm", zero_centered_gamma=False,
                    return_layernorm_output=False, params_dtype=None, device=None,
                    init_method=None)

Parameters: ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only),
``weight`` [out, in], ``bias`` [out].

Without FP8: seqfuse's norm kernel, then one GEMM (seqfuse.ops.gemm) with the
bias in its epilogue; the backward's weight GEMM also produces the bias
gradient (cuBLASLt's bgrad epilogue), reading the norm output made again
from the saved input and statistics (the forward's kernel, the same bits:
one [tokens, in_features] tensor less kept, for one norm pass) unless it is
returned.  Parameters in another dtype than the
input (float32 master weights with bf16 activations) are cast for the GEMMs;
their gradients come back in the parameters' dtype.

Under ``seqfuse.quantization.autocast`` the GEMM runs in FP8 with operands
made by the module's GemmQuantizers (as Linear's; any token count, the
weight cast once per weight update): with DelayedScaling the norm kernel
writes its output directly in FP8 (scale and amax of the module's
ScalingState, index 0; its transposed copy for the weight gradient is a
byte transpose), the output gradient is cast and transposed (index 2,
E5M2 under Format.HYBRID) with the bias gradient summed in the same pass.
Float8CurrentScaling and Float8BlockScaling make the norm output in high
precision and cast it (block scaling: row-wise and column-wise 1x128 copies
in one pass; features multiples of 128).  MXFP8 and NVFP4 recipes raise
NotImplementedError (their GEMMs need compute capability 10.x).

Weight-gradient accumulation (TE's fuse_wgrad_accumulation): where the
weight carries a float32 ``main_grad``, dW is accumulated into it by the
GEMM and the weight's own gradient is left None (as Linear does, TE's
overwrite rule included: with fuse_wgrad_accumulation=True,
is_first_microbatch=True or the weight's ``overwrite_main_grad`` writes dW
there instead of adding it).
Unsupported TE arguments (tensor/sequence parallelism, userbuffers:
seqfuse.modules.te_compat.REFUSED) raise NotImplementedError naming them
when set to anything but their default.  ``return_bias=True`` returns (out, bias) with the bias not added
(TE: out, bias, norm output when return_layernorm_output is also set).
``device="meta"`` defers initialisation to reset_parameters(), which
materialises the parameters on the current CUDA device (CPU without one).
"""
import torch

from .. import ops
from ..quantization.gemm_quantizers import wants_weight_transpose
from . import _fp8 as F8
from ._base import (as_dtype, fp8_norm, main_grad_for, weight_and_bias_grads,
                    fp8_quantizers, hidden_dim, init_weight, make_norm_params, norm_backward,
                    norm_forward, norm_output, norm_param, reset_norm_params, same_dtype, size_arg,
                    take_norm_module_options, wgrad_overwrite, autocast_input)
from .te_compat import materialize, refuse_fp8_io, rng_fork
from ._input import check_input
from ._split import fused_params, install_split, parse_split, reset_split, weight_sources

class _LayerNormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, weight, bias, eps, rms, zc, ret_ln, q, sources, first_mb=None, grad=True,
                alias=False, wgrad_overwrite=False):
        in_features = x.shape[-1]
        x2 = x.reshape(-1, in_features)
        lnw, lnb = norm_param(ln_w, x2), norm_param(ln_b, x2)
        ctx.fp8 = q is not None
        if ctx.fp8:
            kind, rows, need_w = q.kind, x2.shape[0], ctx.needs_input_grad[3]
            if ret_ln:  # the norm output is returned: make it in x's dtype, then cast
                ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
                lnq = q.inputs[0].quantize(ln_out, transpose=need_w, transient=True)
            else:
                ln_out = None
                lnq, mean, rstd = fp8_norm(q, x2, lnw, lnb, eps, rms, zc, need_w)
            # grad: autograd on at the call (off inside forward); else no backward, no transposed weight copy
            want_t = wants_weight_transpose(grad and any(ctx.needs_input_grad), q.weights[0])
            pair = q.weights[0].get(weight, first_mb, sources=sources, transposed=want_t, release_rowwise=True)
            out = F8.forward(lnq, pair, kind, x.dtype, as_dtype(bias, x.dtype), rows)
            ln_col = F8.saved(F8.columnwise(lnq, kind)) if need_w else (None, None)
            w_data, w_si = F8.weight_kept(pair, kind, want_t)
            ctx.want_t = want_t
            ctx.save_for_backward(x2, lnw, mean, rstd, *ln_col, w_data, w_si)
            ctx.q, ctx.kind = q, kind
        else:
            ln_out, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
            w = as_dtype(weight, x.dtype)
            out = ops.gemm(ln_out, w, transb=True, bias=as_dtype(bias, x.dtype))
            # The norm output is made again in the backward (one norm pass) unless it is returned
            # (then it lives anyway): a [tokens, in_features] tensor less kept per module.
            ctx.save_for_backward(x2, lnw, lnb, mean, rstd, ln_out if ret_ln else None, w)
        ctx.weight = weight  # the parameter object, for its main_grad (not saved data)
        ctx.wgrad_overwrite = wgrad_overwrite  # dW written into main_grad, not added (_base.wgrad_overwrite)
        ctx.meta = (x.shape, eps, rms, zc, ln_b is not None, bias is not None, weight.dtype,
                    None if bias is None else bias.dtype, ln_w.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        ctx.ret_ln, ctx.alias = ret_ln, alias
        if alias:  # an alias no gradient reaches gets None in the backward, not a tensor of zeros to add
            ctx.set_materialize_grads(False)
            ctx.out_meta = (out.shape, out.dtype, out.device)
        outputs = (out,) + ((ln_out.view(x.shape),) if ret_ln else ()) + ((x.view_as(x),) if alias else ())
        return outputs if len(outputs) > 1 else out

    @staticmethod
    def backward(ctx, dout, *extra):
        x_shape, eps, rms, zc, has_ln_bias, has_bias, w_dtype, b_dtype, lnw_dtype = ctx.meta
        dln_extra = extra[0] if ctx.ret_ln else None  # the returned norm output's gradient
        dres = extra[-1] if ctx.alias else None  # the input alias's gradient: added in the norm's pass
        if dout is None:  # (gradients are not materialized when the alias is on) the output itself unused
            shape, dtype, device = ctx.out_meta
            dout = torch.zeros(shape, dtype=dtype, device=device)
        dout2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        dbias = None
        if ctx.fp8:
            x2, lnw, mean, rstd, ln_t, ln_si, w_t, w_si = ctx.saved_tensors
            kind, need_dw = ctx.kind, ctx.needs_input_grad[3]
            g, dbias = ctx.q.grads[0].quantize_grad(dout2, b_dtype if has_bias else None,
                                                   need_wgrad=need_dw, transient=True)
            dln, dweight = F8.backward(g, F8.restore(ln_t, ln_si, kind),
                                       F8.weight_dgrad_kept(w_t, w_si, kind, ctx.want_t), kind, x2.dtype,
                                       x2.shape[0], True, need_dw, w_dtype,
                                       main_grad_for(ctx.weight, need_dw, ctx.wgrad_overwrite))
        else:
            x2, lnw, lnb, mean, rstd, ln_out, w = ctx.saved_tensors
            ln_out = norm_output(ln_out, x2, lnw, lnb, eps, rms, zc)
            dln = ops.gemm(dout2, w)
            need_dw = ctx.needs_input_grad[3]
            # (dW accumulated into main_grad by the GEMM where the weight carries one)
            dweight, dbias = weight_and_bias_grads(dout2, ln_out, need_dw, has_bias and ctx.needs_input_grad[4],
                                                   main_grad_for(ctx.weight, need_dw, ctx.wgrad_overwrite))
            dbias = as_dtype(dbias, b_dtype)
            dweight = as_dtype(dweight, w_dtype)
        if dln_extra is not None:
            dln = dln + dln_extra.reshape(dln.shape)
        dx, dg, db = norm_backward(dln, x2, mean, rstd, lnw, rms, zc, has_ln_bias,
                                   dres=None if dres is None else dres.reshape(x2.shape))
        return (dx.view(x_shape), as_dtype(dg, lnw_dtype), as_dtype(db, lnw_dtype), dweight, dbias,
                None, None, None, None, None, None, None, None, None, None)


class LayerNormLinear(torch.nn.Module):
    """Normalization + linear layer; see the module note."""

    def __init__(self, in_features, out_features, eps=1e-5, *, bias=True, normalization="LayerNorm",
                 zero_centered_gamma=False, return_layernorm_output=False, params_dtype=None,
                 device=None, init_method=None, parameters_split=None, return_bias=False,
                 get_rng_state_tracker=None, name=None, fuse_wgrad_accumulation=False, **te_refused):
        super().__init__()
        take_norm_module_options(self, "LayerNormLinear", te_refused, normalization, return_bias,
                                 fuse_wgrad_accumulation, get_rng_state_tracker, name)
        self.in_features = hidden_dim(in_features, "LayerNormLinear", "in_features")
        self.out_features = size_arg("LayerNormLinear", "out_features", out_features)
        kw = make_norm_params(self, self.in_features, normalization, eps, zero_centered_gamma, params_dtype, device)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.use_bias = bool(bias)
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features, **kw))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features, **kw)) if bias else None
        self.init_method = init_method
        split = parse_split("LayerNormLinear", parameters_split, self.out_features)
        if split:  # TE's split of the weight rows into parameters; still one GEMM
            install_split(self, split)
        if kw["device"].type != "meta":  # meta: deferred to reset_parameters()
            self.reset_parameters()

    def reset_parameters(self):
        """(Re)initialise; materialises meta parameters first (module note)."""
        materialize(self)
        with torch.no_grad(), rng_fork(self.get_rng_state_tracker):
            reset_norm_params(self)
            if getattr(self, "parameters_split", None):
                reset_split(self, lambda w: init_weight(w, self.init_method))
                return
            init_weight(self.weight, self.init_method)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False, return_input_alias=False):
        """is_first_microbatch (TE): under FP8, True re-casts the weight, False
        reuses the previous cast (gradient-accumulation micro-batches), None
        re-casts when the weight changed.  fp8_output / fp8_grad (TE): refused
        when set.  ``return_input_alias`` (seqfuse's): also return, last, a
        view of ``inp`` (its values, no copy) whose gradient is added to
        ``inp``'s inside the norm backward's own pass: a pre-norm block hands
        it to its last GEMM as the residual (``Linear(..., residual=alias)``),
        so the residual's gradient needs no add of its own (under a
        torch.autocast that casts the input, the alias is ``inp`` itself:
        the residual keeps its values and dtype).

        Under torch.autocast (on the input's device type) the module
        computes in the autocast dtype, as TE does: the input, the norm's
        weight and bias and the weight are cast to it, and so is the output
        (and the bias return_bias hands back)."""
        refuse_fp8_io("LayerNormLinear", fp8_output, fp8_grad)
        check_input("LayerNormLinear", inp, self.in_features, "in_features")
        # under torch.autocast: the input and the norm's parameters in its dtype (TE's activation dtype)
        x, ln_w, ln_b = autocast_input(inp, self.layer_norm_weight, self.layer_norm_bias)
        alias = bool(return_input_alias)
        cast_alias = alias and x is not inp  # the caller's input itself is the alias then, not the cast copy
        q = fp8_quantizers(self, x)
        weight, bias = fused_params(self, "LayerNormLinear")
        out = _LayerNormLinearFn.apply(x, ln_w, ln_b, weight,
                                       None if self.return_bias else bias, self.eps,
                                       self.normalization == "RMSNorm", self.zero_centered_gamma,
                                       self.return_layernorm_output, q,
                                       weight_sources(self) if q is not None else None, is_first_microbatch,
                                       torch.is_grad_enabled(), alias and not cast_alias,
                                       wgrad_overwrite(self, weight, is_first_microbatch))
        if cast_alias:
            out = (out if isinstance(out, tuple) else (out,)) + (inp,)
        if not self.return_bias:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        # TE's order: output, bias (in the output's dtype, TE's cast), norm output (then seqfuse's input alias)
        return (outs[0], same_dtype(bias, outs[0].dtype)) + outs[1:]

    fp8_num_gemms = 1

    def fp8_features(self):
        """(name, size) of the FP8 GEMM's feature dimensions (checked per recipe)."""
        return (("in_features", self.in_features), ("out_features", self.out_features))

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"normalization={self.normalization}, bias={self.use_bias}")


__all__ = ["LayerNormLinear"]
