/*
 * seqfuse_act.h - public C API of the act family: activations and their
 * gradients, and bias + dropout + residual add (csrc/act/).
 * Included by seqfuse.h; include that, not this.
 *
 * Activations run over contiguous tensors, element by element.  The gated
 * ones (GeGLU, SwiGLU, ReGLU) take x of last dimension 2n and give y of last
 * dimension n, following Transformer Engine's convention: the FIRST half goes
 * through the activation and the SECOND half is the linear gate,
 *     y[..., j] = act(x[..., j]) * x[..., n + j].
 * GELU is the tanh approximation (TE's "gelu"); GELU_ERF is the exact one.
 *
 * FP8 output (forward and backward alike): when y (or dx) is float8_e4m3fn or
 * float8_e5m2 it receives fp8(scale * v) of the float32 value v (round to
 * nearest even, saturating); amax, when given, accumulates max |v| of this
 * call (amax[0] = max(amax[0], max |v|), the quant family's rule);
 * scale_inv, when given, receives 1/scale.
 *
 * Dropout draws no mask tensor: whether element i (flat index in the
 * [rows, n] tensor) is kept is decided by Philox-4x32-10 keyed by `seed`, at
 * counter `offset + i / 4`, output word i % 4; the element is kept when the
 * word's top 24 bits are below (1 - p) * 2^24.  Forward and backward given the
 * same (seed, offset, p) agree element for element, on the CPU and the GPU.
 */
#ifndef SEQFUSE_ACT_H
#define SEQFUSE_ACT_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sf_activation {
    SF_ACT_GELU = 0,      /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    SF_ACT_GELU_ERF = 1,  /* 0.5 x (1 + erf(x / sqrt(2))) */
    SF_ACT_SILU = 2,      /* x * sigmoid(x) */
    SF_ACT_RELU = 3,      /* max(x, 0) */
    SF_ACT_GEGLU = 4,     /* gelu(a) * b   (x = [a | b]) */
    SF_ACT_GEGLU_ERF = 5, /* gelu_erf(a) * b */
    SF_ACT_SWIGLU = 6,    /* silu(a) * b */
    SF_ACT_REGLU = 7,     /* relu(a) * b */
    SF_NUM_ACTIVATIONS = 8,
} sf_activation;

/* 1 for the gated activations (input last dimension 2n, output n). */
int sf_activation_is_gated(sf_activation act);
/* "gelu", "gelu_erf", "silu", "relu", "geglu", "geglu_erf", "swiglu", "reglu". */
const char *sf_activation_name(sf_activation act);

/* y = act(x).  x: float32/float16/bfloat16, contiguous.  y: contiguous, x's
 * shape (last dimension halved when gated), dtype x's or FP8.  scale: float32
 * one element, required iff y is FP8.  amax, scale_inv: optional. */
sf_status sf_act_forward(sf_activation act, const sf_tensor *x, sf_tensor *y,
                     const sf_tensor *scale, sf_tensor *amax, sf_tensor *scale_inv,
                     sf_stream stream);

/* dx = dL/dx given dy = dL/dy and the forward's input x.  dy: y's shape and
 * x's dtype; dx: x's shape, dtype x's or FP8 (then scale required). */
sf_status sf_act_backward(sf_activation act, const sf_tensor *dy, const sf_tensor *x,
                     sf_tensor *dx, const sf_tensor *scale, sf_tensor *amax,
                     sf_tensor *scale_inv, sf_stream stream);

/* out = residual + dropout(x + bias, p).  x, residual, out: same shape and
 * dtype (float32/float16/bfloat16), contiguous; bias: [last dim], x's dtype or
 * float32, may be NULL.  Kept elements are scaled by 1/(1 - p); p in [0, 1]
 * (p = 1 drops everything). */
sf_status sf_bias_dropout_add_forward(const sf_tensor *x, const sf_tensor *bias,
                                  const sf_tensor *residual, float p, uint64_t seed,
                                  uint64_t offset, sf_tensor *out, sf_stream stream);

/* The gradient through dropout(x + bias): dx = dy * keep / (1 - p) with the
 * forward's (p, seed, offset); dbias (may be NULL; x's or float32 dtype,
 * [last dim]) = sum over rows of dx in float32, deterministic through
 * `workspace` (float32, sf_dropout_backward_workspace_numel elements, may be NULL
 * when that is 0).  The residual's gradient is dy itself. */
sf_status sf_dropout_backward(const sf_tensor *dy, float p, uint64_t seed, uint64_t offset,
                         sf_tensor *dx, sf_tensor *dbias, sf_tensor *workspace,
                         sf_stream stream);

/* Float32 elements of workspace sf_dropout_backward needs for dy (0 on the CPU). */
sf_status sf_dropout_backward_workspace_numel(const sf_tensor *dy, int64_t *numel);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ACT_H */
