/*
 * act_backend.h - the backend entry points behind the act family's public
 * functions (act.c validates every argument first).  The CPU reference
 * (act_cpu.c) and the CUDA kernels (act_cuda.cu) implement the same set.
 */
#ifndef SF_ACT_BACKEND_H
#define SF_ACT_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Activation forward or backward over x viewed as [rows, in_cols]: in_cols is
 * 2n for gated activations (n otherwise); out is [rows, n] (forward) or
 * [rows, in_cols] (backward, dy is [rows, n]). */
typedef struct {
    int base;   /* 0 gelu-tanh, 1 gelu-erf, 2 silu, 3 relu */
    int gated;
    int64_t rows, n;
    const sf_tensor *x, *dy;      /* dy NULL in the forward */
    sf_tensor *out;
    const sf_tensor *scale;       /* non-NULL iff out is FP8 */
    sf_tensor *amax, *scale_inv;  /* optional */
} sf_act_args;

/* bias + dropout + residual (forward) and its gradient (backward) over
 * [rows, n]. */
typedef struct {
    int64_t rows, n;
    float p;
    uint32_t threshold;  /* sf_dropout_threshold(p) */
    uint64_t seed, offset;
    const sf_tensor *x, *bias, *residual; /* forward (bias may be NULL) */
    const sf_tensor *dy;                  /* backward */
    sf_tensor *out;                       /* forward out, or backward dx */
    sf_tensor *dbias, *workspace;         /* backward, may be NULL */
} sf_dropout_args;

sf_status sf_act_forward_cpu(const sf_act_args *a);
sf_status sf_act_backward_cpu(const sf_act_args *a);
sf_status sf_bias_dropout_add_cpu(const sf_dropout_args *a);
sf_status sf_dropout_backward_cpu(const sf_dropout_args *a);

sf_status sf_act_forward_cuda(const sf_act_args *a, sf_stream stream);
sf_status sf_act_backward_cuda(const sf_act_args *a, sf_stream stream);
sf_status sf_bias_dropout_add_cuda(const sf_dropout_args *a, sf_stream stream);
sf_status sf_dropout_backward_cuda(const sf_dropout_args *a, sf_stream stream);
sf_status sf_dropout_backward_workspace_numel_cuda(int64_t rows, int64_t n, int device_id,
                                              int64_t *numel);

#ifdef __cplusplus
}
#endif

#endif /* SF_ACT_BACKEND_H */
