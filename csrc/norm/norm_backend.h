/*
 * norm_backend.h - what the norm entry points (norm.c) hand to a backend:
 * one argument block per direction, already validated, with LayerNorm and
 * RMSNorm told apart by `rms`.  The CPU reference (norm_cpu.c) and the CUDA
 * kernels (norm_cuda.cu and its units, norm_cuda.cuh) implement the same
 * four functions.
 */
#ifndef SF_NORM_BACKEND_H
#define SF_NORM_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int rms;                 /* 1: RMSNorm (no mean, no beta) */
    int zero_centered_gamma; /* weight applied is 1 + gamma */
    float eps;
    int64_t rows, hidden;
    const sf_tensor *x, *gamma, *beta; /* beta NULL: none */
    sf_tensor *y, *mean, *rstd;        /* mean, rstd NULL: not saved */
    const sf_tensor *scale;            /* non-NULL iff y is FP8 */
    sf_tensor *amax, *scale_inv;       /* optional */
} sf_norm_forward_args;

typedef struct {
    int rms;
    int zero_centered_gamma;
    int64_t rows, hidden;
    const sf_tensor *dy, *x, *mean, *rstd, *gamma; /* mean NULL for RMSNorm */
    sf_tensor *dx, *dgamma, *dbeta;                 /* dbeta NULL: none */
    sf_tensor *workspace;                           /* NULL when none is needed */
    const sf_tensor *dres;                          /* added to dx, or NULL */
} sf_norm_backward_args;

sf_status sf_norm_forward_cpu(const sf_norm_forward_args *a);
sf_status sf_norm_backward_cpu(const sf_norm_backward_args *a);
sf_status sf_norm_forward_cuda(const sf_norm_forward_args *a, sf_stream stream);
sf_status sf_norm_backward_cuda(const sf_norm_backward_args *a, sf_stream stream);
#ifdef SF_WORKBENCH
/* Check programs only (built with SF_WORKBENCH, csrc/build_checks.sh): the
 * CUDA split's knobs (elements per thread: 8, 16 or 32; threads per block),
 * forward and backward, for check_norm --sweep, which times the
 * alternatives.  The library has no such knob: it runs the defaults
 * (norm_cuda.cuh's constants; all four 0 restores them here).  Set it
 * before asking for a workspace size. */
sf_status sf_norm_cuda_tune(int forward_elems, int forward_block, int backward_elems, int backward_block);
#endif
/* Float32 elements of workspace the CUDA backward wants for rows x hidden. */
sf_status sf_norm_backward_workspace_numel_cuda(int64_t rows, int64_t hidden, sf_dtype dtype,
                                           int device_id, int64_t *numel);

#ifdef __cplusplus
}
#endif

#endif /* SF_NORM_BACKEND_H */
