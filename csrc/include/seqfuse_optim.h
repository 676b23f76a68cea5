/*
 * seqfuse_optim.h - public C API of the optim family: multi-tensor AdamW and gradient norms (csrc/optim/).
 * Included by seqfuse.h; include that, not this.
 *
 * "Multi-tensor": each call takes arrays of n tensor views (all the
 * parameters of an optimizer group, say) and updates them in a few kernel
 * launches, each launch carrying a table of pointers and sizes for up to a
 * few dozen tensors, cut into chunks of SF_MT_CHUNK elements that blocks
 * pick up.  Every tensor must be contiguous; empty tensors are skipped.
 */
#ifndef SEQFUSE_OPTIM_H
#define SEQFUSE_OPTIM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per chunk of the multi-tensor kernels (and per entry of the
 * l2-norm workspace). */
#define SF_MT_CHUNK 65536

/* AdamW hyper-parameters of one update.  step is the 1-based count of this
 * update, kept by the caller (on the host) and used for bias correction. */
typedef struct sf_adamw_config {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
} sf_adamw_config;

/*
 * sf_multi_tensor_adamw: one AdamW update of n parameters, as
 * torch.optim.AdamW defines it (decoupled weight decay, bias correction):
 *   p  = p * (1 - lr wd)
 *   m  = lerp(m, g, 1 - beta1)           v = v beta2 + (1 - beta2) g^2
 *   p  = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
 * all in fp32.
 *   params      fp32, fp16 or bf16, all the same dtype
 *   grads       all in the params' dtype, or all float32 for fp16/bf16 params
 *               (a float32 main_grad accumulated by the wgrad GEMMs)
 *   exp_avg, exp_avg_sq   one per parameter, same numel, all float32 or all
 *               bfloat16 (the state torch.optim.AdamW keeps for bf16 params:
 *               the update reads them, computes in fp32 and stores them
 *               rounded to nearest even; the parameter's step uses the
 *               unrounded values, as torch's fused kernel does)
 *   master      NULL, or n fp32 master copies: then p above is the master,
 *               and params receive its value rounded to their dtype
 *               (params must then be fp16 or bf16)
 */
sf_status sf_multi_tensor_adamw(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                const sf_adamw_config *cfg, sf_stream stream);

/* Floats of workspace sf_multi_tensor_l2norm needs: one per chunk. */
int64_t sf_multi_tensor_l2norm_workspace(int64_t n, const sf_tensor *tensors);

/*
 * sf_multi_tensor_l2norm: out[0] = sqrt(sum over all tensors of x^2), the
 * tensors in any mix of fp32 / fp16 / bf16.  Per-chunk partial sums go to
 * workspace (fp32, at least sf_multi_tensor_l2norm_workspace floats) and
 * are added in a fixed order: the result is deterministic.  Nothing is read
 * back to the host.
 */
sf_status sf_multi_tensor_l2norm(int64_t n, const sf_tensor *tensors, sf_tensor *workspace,
                                 sf_tensor *out, sf_stream stream);

/* sf_multi_tensor_scale: x *= scale[0] for every tensor (scale: fp32, one
 * element, same device: e.g. a clipping coefficient computed on the GPU). */
sf_status sf_multi_tensor_scale(int64_t n, sf_tensor *tensors, const sf_tensor *scale,
                                sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_OPTIM_H */
