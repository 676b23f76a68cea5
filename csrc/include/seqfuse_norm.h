/*
 * seqfuse_norm.h - public C API of the norm family: LayerNorm and RMSNorm,
 * forward and backward (csrc/norm/).
 * Included by seqfuse.h; include that, not this.
 *
 * Layout: x is contiguous; its last dimension is the normalized (hidden) one
 * and every other dimension is flattened into rows.  Statistics are float32,
 * one per row: LayerNorm saves mean and rstd = 1/sqrt(var + eps), RMSNorm
 * saves rstd = 1/sqrt(mean(x^2) + eps).  With zero_centered_gamma the weight
 * applied is (1 + gamma), as in Transformer Engine.
 *
 * FP8 output: when y is float8_e4m3fn or float8_e5m2, y = fp8(scale * v) with
 * v the float32 normalized value, rounded to nearest even and saturated to the
 * format's largest finite value; `scale` (float32, one element) is read on the
 * device.  amax (optional, float32, one element) ACCUMULATES, as every cast of
 * the quant family does: amax[0] = max(amax[0], max |v|) (atomicMax on the
 * float bits; NaN wins), so one step's micro-batches fold into the same slot.
 * scale_inv (optional) receives 1/scale.  amax may also be asked for a 16-bit
 * or float32 y (current scaling of the next GEMM's input).
 *
 * Backward: dgamma and dbeta are reduced in float32, deterministically: each
 * block of the CUDA kernel owns a fixed set of rows and writes its partial
 * sums to `workspace` (float32, sf_norm_backward_workspace_numel elements, handed
 * in by the caller), then a second small kernel adds the partials in a fixed
 * order.  The CPU backend needs no workspace (numel 0).
 */
#ifndef SEQFUSE_NORM_H
#define SEQFUSE_NORM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest hidden size the kernels take (both backends share the rule). */
#define SF_NORM_MAX_HIDDEN 16384

/* LayerNorm forward.  gamma, beta: [hidden], dtype x's or float32 (beta may
 * be NULL: no bias; else its dtype is gamma's).  y: x's shape, dtype x's,
 * float8_e4m3fn or float8_e5m2.  mean, rstd: float32 [rows], each may be NULL
 * (inference).  scale: required iff y is FP8.  amax, scale_inv: may be NULL. */
sf_status sf_layernorm_forward(const sf_tensor *x, const sf_tensor *gamma,
                           const sf_tensor *beta, float eps, int zero_centered_gamma,
                           sf_tensor *y, sf_tensor *mean, sf_tensor *rstd,
                           const sf_tensor *scale, sf_tensor *amax,
                           sf_tensor *scale_inv, sf_stream stream);

/* RMSNorm forward: y = x * rstd * gamma.  Arguments as sf_layernorm_forward. */
sf_status sf_rmsnorm_forward(const sf_tensor *x, const sf_tensor *gamma, float eps,
                         int zero_centered_gamma, sf_tensor *y, sf_tensor *rstd,
                         const sf_tensor *scale, sf_tensor *amax,
                         sf_tensor *scale_inv, sf_stream stream);

/* LayerNorm backward.  dy, x: same shape and dtype; mean, rstd: as saved by
 * the forward.  dx: x's shape and dtype.  dgamma (and dbeta, may be NULL when
 * the forward had no beta): [hidden], gamma's dtype, overwritten.
 * workspace: float32, at least sf_norm_backward_workspace_numel(x) elements
 * (may be NULL when that is 0).  dres (may be NULL): x's shape and dtype,
 * contiguous, added to dx in the same pass (the gradient a residual
 * connection brings to the norm's input: dx = norm'(dy) + dres, rounded
 * once). */
sf_status sf_layernorm_backward(const sf_tensor *dy, const sf_tensor *x,
                           const sf_tensor *mean, const sf_tensor *rstd,
                           const sf_tensor *gamma, int zero_centered_gamma,
                           sf_tensor *dx, sf_tensor *dgamma, sf_tensor *dbeta,
                           sf_tensor *workspace, const sf_tensor *dres, sf_stream stream);

/* RMSNorm backward.  Arguments as sf_layernorm_backward, without mean and dbeta. */
sf_status sf_rmsnorm_backward(const sf_tensor *dy, const sf_tensor *x,
                         const sf_tensor *rstd, const sf_tensor *gamma,
                         int zero_centered_gamma, sf_tensor *dx, sf_tensor *dgamma,
                         sf_tensor *workspace, const sf_tensor *dres, sf_stream stream);

/* Float32 elements of backward workspace for an input shaped like x (the
 * same for LayerNorm and RMSNorm): 0 on the CPU. */
sf_status sf_norm_backward_workspace_numel(const sf_tensor *x, int64_t *numel);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_NORM_H */
