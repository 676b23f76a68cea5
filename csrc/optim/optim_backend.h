/*
 * optim_backend.h - the backend entry points behind the multi-tensor ops of
 * seqfuse_optim.h.  optim.c has validated every argument before these run;
 * they see arrays of n contiguous views on one device.
 */
#ifndef SF_OPTIM_BACKEND_H
#define SF_OPTIM_BACKEND_H

#include "adamw.h"
#include "../core/dispatch.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_multi_tensor_adamw_cpu(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                    sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                    const sf_adamw_consts *k);
sf_status sf_multi_tensor_l2norm_cpu(int64_t n, const sf_tensor *tensors, sf_tensor *out);
sf_status sf_multi_tensor_scale_cpu(int64_t n, sf_tensor *tensors, const sf_tensor *scale);

sf_status sf_multi_tensor_adamw_cuda(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                     sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                     const sf_adamw_consts *k, sf_stream stream);
/* These two take the public entries' arguments (seqfuse_optim.h). */
SF_SIGNATURE_OF(sf_multi_tensor_l2norm) sf_multi_tensor_l2norm_cuda;
SF_SIGNATURE_OF(sf_multi_tensor_scale) sf_multi_tensor_scale_cuda;

#ifdef __cplusplus
}
#endif

#endif
