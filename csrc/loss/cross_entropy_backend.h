/*
 * cross_entropy_backend.h - the backend entry points behind
 * sf_cross_entropy_forward / _backward.  cross_entropy.c has validated every
 * argument before either is called.
 */
#ifndef SF_CROSS_ENTROPY_BACKEND_H
#define SF_CROSS_ENTROPY_BACKEND_H

#include "seqfuse.h"

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
sf_status sf_cross_entropy_forward_cuda(const sf_tensor *logits, const sf_tensor *labels,
                                        int64_t ignore_index, float label_smoothing,
                                        sf_tensor *loss, sf_tensor *lse, sf_tensor *label_claim,
                                        sf_tensor *label_record, sf_stream stream);
sf_status sf_cross_entropy_backward_cuda(const sf_tensor *logits, const sf_tensor *labels,
                                         const sf_tensor *lse, const sf_tensor *grad_scale,
                                         int64_t ignore_index, float label_smoothing,
                                         sf_tensor *dlogits, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
