/*
 * cross_entropy_backend.h - the backend entry points behind
 * sf_cross_entropy_forward / _backward.  cross_entropy.c has validated every
 * argument before either is called.
 */
#ifndef SF_CROSS_ENTROPY_BACKEND_H
#define SF_CROSS_ENTROPY_BACKEND_H

#include "seqfuse.h"
#include "../core/dispatch.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_cross_entropy_forward_cpu(const sf_tensor *logits, const sf_tensor *labels,
                                       int64_t ignore_index, float label_smoothing,
                                       sf_tensor *loss, sf_tensor *lse);
sf_status sf_cross_entropy_backward_cpu(const sf_tensor *logits, const sf_tensor *labels,
                                        const sf_tensor *lse, const sf_tensor *grad_scale,
                                        int64_t ignore_index, float label_smoothing,
                                        sf_tensor *dlogits);
/* The CUDA entries take the public entries' arguments (seqfuse_loss.h). */
SF_SIGNATURE_OF(sf_cross_entropy_forward) sf_cross_entropy_forward_cuda;
SF_SIGNATURE_OF(sf_cross_entropy_backward) sf_cross_entropy_backward_cuda;

#ifdef __cplusplus
}
#endif

#endif
