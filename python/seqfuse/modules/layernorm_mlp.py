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
pass over the [tokens, ffn] activations each way.  The norm output is not
kept for the backward: FC1's weight gradient reads it made again from the
saved input and statistics by the forward's own kernel (the same bits; one
[tokens, hidden] tensor less from the forward to the backward, for one norm
pass), unless it is returned (then it lives anyway and is kept).

Under FP8 autocast the six GEMMs run in FP8 with operands made by the
module's GemmQuantizers (as Linear's: any token count, each weight cast once
per weight update).  DelayedScaling: ScalingState of 6 (3 per GEMM: FC1
input 0, weight 1, output gradient 2; FC2 input 3, weight 4, output gradient
5); the norm kernel writes FC1's input in FP8 and the activation kernel
FC2's (fused casts with amax); without an FC1 bias the activation-gradient
kernel likewise writes FC1's output gradient in FP8 (_fp8_act_grad); other
output gradients are cast and transposed with their bias gradients summed
in the same pass.  Float8CurrentScaling and Float8BlockScaling make the
norm and activation outputs and the activation gradient in high precision
and cast them (block: hidden and ffn sizes multiples of 128).

``checkpoint=True`` (TE's selective activation recomputation): the forward
keeps only its input, the norm statistics and the (cast) weights; the
backward runs the norm, FC1 and the activation again (not FC2, whose output
the backward does not need) before the usual gradients.  Under FP8 autocast
the whole module is recomputed by seqfuse.quantization.checkpoint instead
(FC2 included, with the forward's scales; said once in a log line).
``recompute_activation=True`` (seqfuse's, not TE's; not with "gelu"): without FP8
the forward keeps FC1's output but not the activation, and the backward
makes the activation again from it for FC2's weight gradient by the
forward's own kernel (the same bits): one [tokens, ffn] tensor less from
the forward to the backward (for swiglu, a third of the MLP's
activations), for one more elementwise pass over FC1's output.  What
Liger-Kernel's fused SwiGLU does.  Under FP8 the forward writes only the
activation's row-wise FP8 copy (FC2's input) and keeps neither copy; the
backward makes the transposed FP8 copy FC2's weight gradient reads again
from FC1's output, with the forward's kernel and scale (the forward's
bytes): one byte an element less kept, for one more pass over FC1's output
and the transpose.
Under delayed scaling with an amax history, swiglu and no FC1 bias, the
SwiGLU runs on the grouped MLP's kernels with one group of the token rows
(_one_pass_swiglu): the forward's FP8 cast of the SwiGLU value
(seqfuse.ops.moe.swiglu_cast_fp8_grouped, its transposed copy in the same
pass where it is kept), and in the backward one pass over FC1's output
(swiglu_backward_cast_fp8_grouped) writes FC1's output gradient in FP8
with its transposed copy and, with recompute_activation, FC2's
weight-gradient operand, after FC2's input gradient and before its weight
gradient; the activation kernels take up to four passes for these (the
activation made again, its transpose, the FP8 gradient, its transpose).
The pass splits its columns among CTAs (no routing gradient is asked), and
the SwiGLU's sigmoid is the device's approximation (moe.h).  The SwiGLU
value is rounded to the input's dtype before its cast on this path (as
the grouped MLP and the first step's unfused cast round it).
``return_layernorm_output=True`` also returns the norm's output (a second
output whose gradient flows back through the norm); ``return_bias=True``
returns FC2's bias instead of adding it (TE's order: output, bias, norm
output).  fuse_wgrad_accumulation: where fc1_weight / fc2_weight carry a
float32 ``main_grad``, their gradients are accumulated into it by the
GEMMs (as Linear does, with TE's overwrite rule: is_first_microbatch=True
or a weight's ``overwrite_main_grad`` writes dW there instead of adding).  seqfuse.modules.te_compat.REFUSED lists the
refused arguments.  ``seq_length`` and ``micro_batch_size`` only size buffers in TE
(JIT warm-up); they are kept as attributes and change nothing here.
``device="meta"`` defers initialisation: reset_parameters() materialises the
parameters on the current CUDA device (CPU without one) with the
initialisation of direct construction.
"""
import logging

import torch

from .. import ops
from ..ops import act as A
from ..ops import moe as M
from ..quantization.gemm_quantizers import padded_rows, transposed, wants_weight_transpose
from ..quantization.tensor import Float8Tensor
from . import _fp8 as F8
from ._base import (as_dtype, fp8_norm, main_grad_for, weight_and_bias_grads,
                    fp8_quantizers, hidden_dim, init_weight, make_norm_params, norm_backward,
                    norm_forward, norm_output, norm_param, reset_norm_params, same_dtype, size_arg,
                    take_norm_module_options, wgrad_overwrite, autocast_input)
from ._input import check_input, check_residual
from .te_compat import materialize, rng_fork

_log = logging.getLogger("seqfuse")
_logged_fp8_checkpoint = False
_logged_act_grad_with_bias = []

ACTIVATIONS = ("gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu", "reglu", "geglu_erf")



class _LayerNormMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_w, ln_b, w1, b1, w2, b2, eps, rms, zc, activation, q, ckpt=False, ret_ln=False,
                first_mb=None, recompute_act=False, grad=True, residual=None, residual_is_input=False,
                wgrad_overwrite=(False, False)):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        if residual_is_input:  # out = x + MLP(x): its backward adds dout into the norm's dx in one pass
            residual = x2 if x2.is_contiguous() else x2.contiguous()
        lnw, lnb = norm_param(ln_w, x2), norm_param(ln_b, x2)
        dt = x.dtype
        ctx.fp8 = q is not None
        if ctx.fp8:
            kind, rows = q.kind, x2.shape[0]
            need_w1, need_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
            lnq, mean, rstd = fp8_norm(q, x2, lnw, lnb, eps, rms, zc, need_w1)
            # grad: autograd on at the call (off inside forward); else no backward, no transposed weight copies
            # (inputs 0-6: x and the parameters; the residual's gradient needs no weight transpose)
            want_t = wants_weight_transpose(grad and any(ctx.needs_input_grad[:7]), q.weights[0])
            p1 = q.weights[0].get(w1, first_mb, transposed=want_t, release_rowwise=True)
            h = F8.forward(lnq, p1, kind, dt, as_dtype(b1, dt), rows)
            remake = recompute_act and need_w2 and grad  # FC2's wgrad operand made again in the backward
            ctx.one_pass = b1 is None and _one_pass_swiglu(q, h, activation)
            aq, act_scale = _fp8_act(q, h, activation, need_w2 and not remake, remake, ctx.one_pass)
            p2 = q.weights[1].get(w2, first_mb, transposed=want_t, release_rowwise=True)
            out = F8.forward(aq, p2, kind, dt, as_dtype(b2, dt), rows, residual)
            ln_col = F8.saved(F8.columnwise(lnq, kind)) if need_w1 else (None, None)
            if remake:  # (the a_col slots: no bytes, the forward's scale where the backward needs it)
                a_col = (None, act_scale)
                ctx.act_remake = (act_scale is not None, getattr(aq, "fp8_dtype", None), q.margin)
            else:
                a_col = F8.saved(F8.columnwise(aq, kind)) if need_w2 else (None, None)
                ctx.act_remake = None
            ctx.save_for_backward(x2, lnw, mean, rstd, h, *ln_col, *a_col,
                                  *F8.weight_kept(p1, kind, want_t), *F8.weight_kept(p2, kind, want_t))
            ctx.want_t = want_t
            ctx.q, ctx.kind = q, kind
            ln = None
        else:
            w1c, w2c, b1c = as_dtype(w1, dt), as_dtype(w2, dt), as_dtype(b1, dt)
            ln, mean, rstd, h, a = _fc1_act(x2, lnw, lnb, eps, rms, zc, w1c, b1c, activation)
            out = ops.gemm(a, w2c, transb=True, bias=as_dtype(b2, dt), addend=residual)
            if ckpt:  # keep what the recompute needs, not the [tokens, ffn] activations
                ctx.save_for_backward(x2, lnw, lnb, mean, rstd, b1c, w1c, w2c)
            else:  # the norm output is made again in the backward (one norm pass), unless returned;
                # with recompute_act the activation too (from FC1's output, by the forward's kernel)
                ctx.save_for_backward(x2, lnw, lnb, mean, rstd, ln if ret_ln else None, h,
                                      None if recompute_act else a, w1c, w2c)
        ctx.ckpt, ctx.eps, ctx.residual_is_input = ckpt, eps, residual_is_input
        ctx.w1, ctx.w2 = w1, w2  # the parameter objects, for their main_grad (not saved data)
        ctx.wgrad_overwrite = wgrad_overwrite  # per weight: dW written into main_grad, not added
        ctx.meta = (x.shape, rms, zc, activation, ln_b is not None, ln_w.dtype, w1.dtype, w2.dtype,
                    None if b1 is None else b1.dtype, None if b2 is None else b2.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        if ret_ln:
            if ln is None:  # FP8: the norm output was written in FP8; return it in x's dtype
                ln, _, _ = norm_forward(x2, lnw, lnb, eps, rms, zc)
            return out, ln.view(x.shape)
        return out

    @staticmethod
    def backward(ctx, dout, dln_extra=None):
        x_shape, rms, zc, activation, has_ln_bias, lnw_dt, w1_dt, w2_dt, b1_dt, b2_dt = ctx.meta
        dout2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        db1 = db2 = None
        if ctx.fp8:
            (x2, lnw, mean, rstd, h, ln_t, ln_si, a_t, a_si, w1_t, w1_si, w2_t,
             w2_si) = ctx.saved_tensors
            dt, kind, q, rows = x2.dtype, ctx.kind, ctx.q, x2.shape[0]
            need_w1, need_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
            ow1, ow2 = ctx.wgrad_overwrite
            mg1, mg2 = main_grad_for(ctx.w1, need_w1, ow1), main_grad_for(ctx.w2, need_w2, ow2)
            # the bias gradients come out of the gradients' cast passes where the kernels take them
            g2, db2 = q.grads[1].quantize_grad(dout2, b2_dt, need_wgrad=need_w2, transient=True)
            w2_dgrad = F8.weight_dgrad_kept(w2_t, w2_si, kind, ctx.want_t)
            if _one_pass_backward(ctx, q):
                # FC2's input gradient first, then one pass over h writes FC1's output gradient in FP8 with its
                # transposed copy and, where it is made again, FC2's wgrad operand (the forward's bytes); then
                # FC2's weight gradient
                remade = ctx.act_remake is not None
                a_col = None if remade else F8.restore(a_t, a_si, kind)
                da, dw2 = F8.backward(g2, a_col, w2_dgrad, kind, dt, rows, True, need_w2 and not remade, w2_dt,
                                      mg2)
                made, g1 = _one_pass_swiglu_backward(q, da, h, a_si if remade else None,
                                                     ctx.act_remake[1] if remade else None, need_w1)
                del da, a_col
                if remade:
                    _, dw2 = F8.backward(g2, made, None, kind, dt, rows, False, need_w2, w2_dt, mg2)
                del made
                db1 = None
            else:
                a_col = F8.restore(a_t, a_si, kind) if ctx.act_remake is None else \
                    _fp8_act_remade(q, kind, h, activation, a_si, *ctx.act_remake, one_pass=ctx.one_pass)
                da, dw2 = F8.backward(g2, a_col, w2_dgrad, kind, dt, rows, True, need_w2, w2_dt, mg2)
                del a_col  # (read by FC2's weight gradient only)
                g1, db1 = _fp8_act_grad(q, da, h, activation, b1_dt, need_w1)
                del da  # (read by the activation's backward alone: freed before FC1's GEMMs)
            w1_dgrad = F8.weight_dgrad_kept(w1_t, w1_si, kind, ctx.want_t)
            dln, dw1 = F8.backward(g1, F8.restore(ln_t, ln_si, kind), w1_dgrad, kind, dt, rows, True, need_w1, w1_dt,
                                   mg1)
        else:
            mg1 = main_grad_for(ctx.w1, ctx.needs_input_grad[3], ctx.wgrad_overwrite[0])
            mg2 = main_grad_for(ctx.w2, ctx.needs_input_grad[5], ctx.wgrad_overwrite[1])
            if ctx.ckpt:  # recompute the norm, FC1 and the activation
                x2, lnw, lnb, mean, rstd, b1c, w1c, w2c = ctx.saved_tensors
                ln, _, _, h, a = _fc1_act(x2, lnw, lnb, ctx.eps, rms, zc, w1c, b1c, activation)
            else:
                x2, lnw, lnb, mean, rstd, ln, h, a, w1c, w2c = ctx.saved_tensors
                if a is None:  # recompute_act: the same kernel on the same input, the same bits
                    a = A.act_forward(h, activation)
            dw2, db2 = _wgrad(dout2, a, b2_dt, mg2)
            del a  # (read by FC2's weight gradient only: freed before the input-gradient GEMMs)
            gelu = activation == "gelu"
            if gelu:  # GELU' (and FC1's bias gradient) in the dgrad epilogue
                if b1_dt is not None:
                    dh, db1 = ops.gemm(dout2, w2c, aux=h, epilogue="dgelu_bgrad")
                else:
                    dh = ops.gemm(dout2, w2c, aux=h, epilogue="dgelu")
            else:
                dh = A.act_backward(ops.gemm(dout2, w2c), h, activation)
            dln = ops.gemm(dh, w1c)
            # FC1's bias gradient from its weight GEMM where GELU's dgrad epilogue did not give it
            dw1, db1_w = _wgrad(dh, norm_output(ln, x2, lnw, lnb, ctx.eps, rms, zc), None if gelu else b1_dt, mg1)
            if not gelu:
                db1 = db1_w
        if dln_extra is not None:  # gradient of the returned norm output
            dln = dln + dln_extra.reshape(dln.shape).to(dln.dtype)
        dx, dg, db = norm_backward(dln, x2, mean, rstd, lnw, rms, zc, has_ln_bias,
                                   dres=dout2 if ctx.residual_is_input else None)
        return (dx.view(x_shape), as_dtype(dg, lnw_dt), as_dtype(db, lnw_dt), as_dtype(dw1, w1_dt),
                as_dtype(db1, b1_dt), as_dtype(dw2, w2_dt), as_dtype(db2, b2_dt),
                None, None, None, None, None, None, None, None, None, None,
                dout2 if ctx.needs_input_grad[17] else None, None, None)


def _fc1_act(x2, lnw, lnb, eps, rms, zc, w1c, b1c, activation):
    """(norm output, mean, rstd, FC1 output h, activation a) of the
    high-precision forward, also its recompute under checkpoint=True."""
    ln, mean, rstd = norm_forward(x2, lnw, lnb, eps, rms, zc)
    if activation == "gelu":  # GELU in FC1's epilogue, pre-activation kept as aux
        a, h = ops.gemm(ln, w1c, transb=True, bias=b1c, epilogue="gelu_aux")
    else:
        h = ops.gemm(ln, w1c, transb=True, bias=b1c)
        a = A.act_forward(h, activation)
    return ln, mean, rstd, h, a


def _act_width(h, activation):
    """The activation's output width for FC1's output ``h`` (half of it for the gated ones)."""
    return h.shape[1] // 2 if activation in A.GATED else h.shape[1]


def _one_pass_swiglu(q, h, activation):
    """Whether FC2's FP8 input is the grouped SwiGLU cast's (one group:
    seqfuse.ops.moe.swiglu_cast_fp8_grouped) and its backward one pass of
    the grouped SwiGLU backward (swiglu_backward_cast_fp8_grouped): FC1's
    output gradient in FP8 with its transposed copy and, with
    recompute_activation, FC2's weight-gradient operand (the forward's
    bytes: both round the SwiGLU value to h's dtype and cast it with the
    forward's scale), where the activation-gradient kernel, its transpose
    and (recompute_activation) the activation made again with its
    transpose took up to four passes.  Delayed scaling with an
    amax history (the producer kernels' fused casts), swiglu, h contiguous,
    16-byte aligned, its halves multiples of 16 wide; the forward asks only
    where FC1 has no bias."""
    return (activation == "swiglu" and q.kind == "delayed" and q.inputs[1].fused_cast and h.is_contiguous()
            and h.shape[1] % 32 == 0 and h.data_ptr() % 16 == 0)


def _one_pass_backward(ctx, q):
    """The backward's one-pass SwiGLU (_one_pass_swiglu): where the
    forward cast with it (FC1 without a bias: its gradient would sum the
    high-precision rows) and FC1's output gradient has an amax history.
    Its FP8 bytes are the same whether FC2's wgrad operand was kept or is
    made again."""
    return ctx.one_pass and q.grads[0].fused_cast


def _one_pass_swiglu_backward(q, da, h, scale, fp8_dtype, need_col):
    """(FC2's wgrad operand or None, FC1's output gradient as a padded
    Float8Tensor) from one grouped SwiGLU backward pass over h (one group of
    h's rows) given the SwiGLU output's gradient ``da``; the wgrad operand
    where ``fp8_dtype`` and the forward's ``scale`` are given."""
    g_scale, g_amax, g_dtype = q.grads[0].scale
    _, _, data_t, si, grad = M.swiglu_backward_cast_fp8_grouped(
        da, h, None, [h.shape[0]], fp8_dtype, scale=scale, need_dprobs=False, grad_fp8_dtype=g_dtype,
        grad_scale=g_scale, grad_amax=g_amax, grad_rowwise=True, grad_transpose=need_col, want_dx=False)
    g_data, g_data_t, g_si = grad
    g1 = Float8Tensor(g_data, g_si, g_dtype, data_t=g_data_t, dtype=h.dtype, shape=h.shape)
    return (None if data_t is None else (data_t, si, None)), g1


def _fp8_act(q, h, activation, need_col, keep_scale=False, one_pass=False):
    """(the activation of FC1's output as FC2's quantized input, the scale
    it was cast with or None): written in FP8 by the activation kernel under
    delayed scaling once it has an amax history (``one_pass``: by the
    grouped SwiGLU cast, into buffers of its own), else (other recipes, the
    first step) made in h's dtype and cast.  The activation kernel's
    row-wise copy is a transient buffer, as fp8_norm's.  ``keep_scale``
    (recompute_activation): the fused kernel's scale comes back as a copy of the state's (which the
    step's update rewrites before the backward), for _fp8_act_remade; the
    casts of h's-dtype activations take their scale from its own amax (current
    scaling, and delayed scaling's first step), which the backward finds again."""
    iq = q.inputs[1]
    if one_pass:  # (_one_pass_swiglu: the grouped SwiGLU cast of one group, its transposed copy in the same pass)
        scale, amax, fp8_dtype = iq.scale
        data, data_t, si = M.swiglu_cast_fp8_grouped(h, None, [h.shape[0]], fp8_dtype, scale=scale, amax=amax,
                                                     rowwise=True, transpose=need_col)
        if need_col:  # (kept for the backward: 4 bytes of its own, not a view of the op's 256-byte spaced buffer)
            si = si.clone()
        k = h.shape[1] // 2
        return Float8Tensor(data, si, fp8_dtype, data_t=data_t, dtype=h.dtype, shape=(h.shape[0], k)), \
            (scale.clone() if keep_scale else None)
    if iq.fused_cast:
        scale, amax, fp8_dtype, si, buf, a = iq.fused_outputs(h.shape[0], _act_width(h, activation), h.device,
                                                              place=iq.input_place(h))
        A.act_forward(h, activation, fp8_dtype, scale, amax, si, out=a)
        return iq.fp8_output(buf, a.shape, si, h.dtype), (scale.clone() if keep_scale else None)
    return iq.quantize(A.act_forward(h, activation), transpose=need_col, transient=True), None


def _fp8_act_remade(q, kind, h, activation, scale, fused, fp8_dtype, margin, one_pass=False):
    """FC2's weight-gradient operand (the activation's column-wise FP8 copy)
    made again in the backward from FC1's output ``h`` (recompute_activation):
    the forward's kernel with the forward's scale, so the forward's bytes.
    ``fused``: the activation kernel (``one_pass``: the grouped SwiGLU
    cast) wrote FP8 with ``scale`` (_fp8_act's copy); else the activation
    in h's dtype, cast with the scale of its own amax (per tensor,
    ``margin``) or in 1x128 blocks -- what the forward's
    cast did.  The forward never wrote a column-wise copy (nor, with
    ``fused``, any bytes this needs): one [tokens, ffn] FP8 tensor less from
    the forward to the backward, for one more pass over h.  While this runs
    the layer's backward also holds its temporaries: the activation in h's
    dtype, or (fused) the row-wise bytes in a transient buffer -- the
    backward's own place for this role (seqfuse.ops.buffers keys places by
    device, stream and thread, and autograd's CUDA backward runs on a thread
    of its own), kept allocated within the transient pool's limit."""
    rows = h.shape[0]
    iq = q.inputs[1]
    if fused and one_pass:  # (the forward's grouped SwiGLU cast: the same kernel and scale, the same bytes)
        _, data_t, si = M.swiglu_cast_fp8_grouped(h, None, [rows], fp8_dtype, scale=scale, rowwise=False)
        return data_t, si, None
    if fused:
        # (the row-wise bytes only feed the transpose, enqueued before this returns: a transient buffer)
        buf, view = iq.fp8_output_buffer(rows, _act_width(h, activation), fp8_dtype, h.device, iq.input_place(h))
        si = torch.empty(1, dtype=torch.float32, device=h.device)
        A.act_forward(h, activation, fp8_dtype, scale, None, si, out=view)
        return transposed(Float8Tensor(buf, si, fp8_dtype, dtype=h.dtype, shape=view.shape)), si, None
    a = A.act_forward(h, activation)
    if kind == "block":  # (the column-wise copy is [ffn, round_up(rows, 128)] whatever the row-wise rows)
        _, _, data_t, si_t = ops.quantize_block_fp8_rowcol(a, iq.fp8_dtype, rowwise=False)
        return data_t, si_t, "block_1x128"
    # per tensor: the forward cast the row-wise copy alone, so through the three launches (amax, scale,
    # cast); this one-launch cast with the transposed copy gives the same bits (seqfuse_quant.h's rule
    # for cast_fp8_current: both are sf_amax, sf_fp8_compute_scale and sf_cast_fp8 in turn)
    data_t = torch.empty(a.shape[1], padded_rows(rows), dtype=iq.fp8_dtype, device=h.device)
    amax, scale = torch.empty(2, dtype=torch.float32, device=h.device).split(1)  # (scratch)
    si = torch.empty(1, dtype=torch.float32, device=h.device)
    ops.quant.cast_fp8_current_into(a, amax, scale, si, None, data_t, margin)
    return data_t, si, None


def _fp8_act_grad(q, da, h, activation, bias_dtype, need_col):
    """(FC1's output gradient as its GEMMs' quantized operand, FC1's bias
    gradient or None).  Under delayed scaling with an amax history and no
    FC1 bias, the activation-gradient kernel writes it in FP8 itself (the
    forward activation's fused cast, mirrored): the [tokens, fc1_out]
    gradient is never written in high precision and read again by a cast
    (at Llama 1B's shape 192 MB less traffic a layer), and the weight
    gradient's transposed copy is a byte transpose of the FP8 rows.  With a
    bias (its gradient is the high-precision gradient's column sums) or
    another recipe: the gradient in h's dtype, then quantize_grad's cast."""
    gq = q.grads[0]
    fused = gq.fused_cast
    if bias_dtype is not None or not fused:
        if fused and not _logged_act_grad_with_bias:
            _logged_act_grad_with_bias.append(True)
            _log.info("LayerNormMLP: FC1's output gradient is made in %s and cast to FP8 after the activation "
                      "gradient (an FC1 bias: its gradient sums the high-precision rows); without an FC1 bias "
                      "the activation-gradient kernel writes it in FP8", h.dtype)
        dh = A.act_backward(da, h, activation)
        return gq.quantize_grad(dh, bias_dtype, need_wgrad=need_col, transient=True)
    # (read only by FC1's GEMMs in this backward: transient buffers, as quantize_grad's transient=True)
    return gq.fused_grad(h, h.shape[1], lambda fp8_dtype, scale, amax, si, out: A.act_backward(
        da, h, activation, fp8_dtype, scale, amax, si, out=out), need_col), None


def _wgrad(dy, inp, bias_dtype, main_grad=None):
    """(dW = dy^T @ inp, the bias gradient: from the same GEMM where
    weight_and_bias_grads can); with ``main_grad`` (a MainGrad) dW goes
    there and is returned as None."""
    return weight_and_bias_grads(dy, inp, True, bias_dtype is not None, main_grad)


class LayerNormMLP(torch.nn.Module):
    """Norm + FC1 + activation + FC2; see the module note."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, *, bias=True, normalization="LayerNorm",
                 activation="gelu", zero_centered_gamma=False, params_dtype=None, device=None,
                 init_method=None, output_layer_init_method=None, return_layernorm_output=False,
                 checkpoint=False, seq_length=None, micro_batch_size=None, get_rng_state_tracker=None,
                 name=None, return_bias=False, fuse_wgrad_accumulation=False, recompute_activation=False,
                 **te_refused):
        super().__init__()
        take_norm_module_options(self, "LayerNormMLP", te_refused, normalization, return_bias,
                                 fuse_wgrad_accumulation, get_rng_state_tracker, name)
        self.return_layernorm_output = bool(return_layernorm_output)
        self.checkpoint = bool(checkpoint)
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: argument 'activation' must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.hidden_size = hidden_dim(hidden_size, "LayerNormMLP", "hidden_size")
        self.ffn_hidden_size = size_arg("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size)
        kw = make_norm_params(self, self.hidden_size, normalization, eps, zero_centered_gamma, params_dtype, device)
        self.activation = activation
        self.recompute_activation = recompute_activation  # (its rule reads the activation)
        self.use_bias = bool(bias)
        fc1_out = 2 * self.ffn_hidden_size if activation in A.GATED else self.ffn_hidden_size
        self.fc1_weight = torch.nn.Parameter(torch.empty(fc1_out, self.hidden_size, **kw))
        self.fc1_bias = torch.nn.Parameter(torch.empty(fc1_out, **kw)) if bias else None
        self.fc2_weight = torch.nn.Parameter(torch.empty(self.hidden_size, self.ffn_hidden_size, **kw))
        self.fc2_bias = torch.nn.Parameter(torch.empty(self.hidden_size, **kw)) if bias else None
        self.init_method = init_method
        self.output_layer_init_method = output_layer_init_method
        if kw["device"].type != "meta":  # meta: deferred to reset_parameters()
            self.reset_parameters()

    def reset_parameters(self):
        """(Re)initialise; materialises meta parameters first (module note)."""
        materialize(self)
        with torch.no_grad(), rng_fork(self.get_rng_state_tracker):
            reset_norm_params(self)
            init_weight(self.fc1_weight, self.init_method)
            init_weight(self.fc2_weight, self.output_layer_init_method)
            for b in (self.fc1_bias, self.fc2_bias):
                if b is not None:
                    b.zero_()

    def forward(self, inp, is_first_microbatch=None, residual=None):
        """is_first_microbatch (TE): as LayerNormLinear's, for both weights.
        residual (seqfuse's): a tensor of the output's shape and dtype (the
        input's) added in FC2's GEMM epilogue, ``out = FC2(...) + residual``
        with no pass of its own; its gradient is out's.  A pre-norm block's
        ``x + mlp(x)`` is ``mlp(x, residual=x)``: given the input itself (the
        same tensor object), the backward also adds out's gradient to the
        input's in the norm's backward pass (one gradient for the input, no
        add of two).

        Under torch.autocast (on the input's device type) the module
        computes in the autocast dtype, as TE does: the input, the norm's
        weight and bias and the FC weights are cast to it, and so is the
        output (and the bias return_bias hands back).  A residual in
        another dtype (the input itself, cast) is then added to the output
        after FC2, in torch's promoted dtype, not in its epilogue."""
        check_input("LayerNormMLP", inp, self.hidden_size, "hidden_size")
        # under torch.autocast: the input and the norm's parameters in its dtype (TE's activation dtype)
        x, ln_w, ln_b = autocast_input(inp, self.layer_norm_weight, self.layer_norm_bias)
        after = None  # a residual added after the module (not in FC2's epilogue): see the docstring
        if x is not inp and residual is not None and (residual is inp or residual.dtype != x.dtype):
            check_residual("LayerNormMLP", residual, x.shape, residual.dtype, x.device)
            after, residual = residual, None
        residual_is_input = residual is not None and residual is x
        if residual is not None:
            residual = None if residual_is_input else check_residual("LayerNormMLP", residual, x.shape,
                                                                      x.dtype, x.device)
        q = fp8_quantizers(self, x)
        args = (x, ln_w, ln_b, self.fc1_weight, self.fc1_bias,
                self.fc2_weight, None if self.return_bias else self.fc2_bias, self.eps,
                self.normalization == "RMSNorm", self.zero_centered_gamma, self.activation, q)
        ret_ln = self.return_layernorm_output
        out = self._run(args, q, ret_ln, is_first_microbatch, residual, residual_is_input)
        if after is not None:
            out = (out[0] + after, out[1]) if ret_ln else out + after
        if not self.return_bias:
            return out
        bias = same_dtype(self.fc2_bias, x.dtype)  # (TE: cast to the activation dtype)
        return (out[0], bias, out[1]) if ret_ln else (out, bias)

    def _run(self, args, q, ret_ln, first_mb, residual, residual_is_input):
        # TE's rule for writing main_grad rather than adding to it (per weight)
        overwrite = (wgrad_overwrite(self, self.fc1_weight, first_mb), wgrad_overwrite(self, self.fc2_weight, first_mb))
        if self.checkpoint and q is not None and torch.is_grad_enabled():
            global _logged_fp8_checkpoint
            if not _logged_fp8_checkpoint:
                _log.info("LayerNormMLP: checkpoint=True under FP8 autocast recomputes the whole module "
                          "(FC2 included) through seqfuse.quantization.checkpoint")
                _logged_fp8_checkpoint = True
            from ..quantization import checkpoint as fp8_checkpoint
            # ckpt False (the checkpoint is this call), recompute_act False, grad True (autograd is on here)
            return fp8_checkpoint(_LayerNormMLPFn.apply, *args, False, ret_ln, first_mb, False, True, residual,
                                  residual_is_input, overwrite)
        return _LayerNormMLPFn.apply(*args, self.checkpoint, ret_ln, first_mb, self.recompute_activation,
                                     torch.is_grad_enabled(), residual, residual_is_input, overwrite)

    fp8_num_gemms = 2

    def fp8_features(self):
        """(name, size) of the FP8 GEMMs' feature dimensions (checked per recipe)."""
        return (("hidden_size", self.hidden_size), ("FC1's output (ffn_hidden_size, x2 when gated)",
                                                    self.fc1_weight.shape[0]),
                ("ffn_hidden_size", self.ffn_hidden_size))

    @property
    def recompute_activation(self):
        """Whether the backward makes the activation again (module note)."""
        return self.__dict__.get("_recompute_activation", False)  # (False for a module unpickled from before)

    @recompute_activation.setter
    def recompute_activation(self, value):
        if value and self.activation == "gelu":
            raise ValueError("LayerNormMLP: recompute_activation=True needs an activation other than 'gelu': the "
                             "tanh GELU runs in FC1's GEMM epilogue, whose result the activation kernel would not "
                             "reproduce bit for bit; 'gelu_erf' and the gated activations take it")
        self.__dict__["_recompute_activation"] = bool(value)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}"
                + (", recompute_activation=True" if self.recompute_activation else ""))


__all__ = ["LayerNormMLP"]
