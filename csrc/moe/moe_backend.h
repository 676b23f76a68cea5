/*
 * moe_backend.h - what the moe entries (moe.c) hand to a backend: one
 * argument block for every op, already validated, and the CPU (moe_cpu.c)
 * and CUDA (moe_cuda.cu) entry point of each op.
 */
#ifndef SF_MOE_BACKEND_H
#define SF_MOE_BACKEND_H

#include <stdint.h>

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The arguments of any moe op after moe.c validated them; an op reads the
 * fields its public function documents. */
typedef struct {
    int64_t T, E, H, N;                /* tokens, experts, hidden, permuted rows */
    int topk, score, pre_softmax;
    float scaling, coeff;
    int64_t total_tokens;
    const sf_tensor *logits, *bias, *map, *saved, *grad, *inp, *probs, *tpe, *lse, *dloss;
    sf_tensor *out, *out2, *out3;
} sf_moe_args;

#define SF_MOE_OPS(X) X(topk_forward) X(topk_backward) X(aux_scores_forward) X(aux_scores_backward) \
    X(aux_loss_forward) X(aux_loss_backward) X(z_loss_forward) X(z_loss_backward) X(row_id_map) X(permute) \
    X(unpermute) X(unpermute_backward) X(permute_probs_backward) X(swiglu_forward) X(swiglu_backward)
#define SF_MOE_DECLARE(name)                                      \
    sf_status sf_moe_##name##_cpu(const sf_moe_args *a);          \
    sf_status sf_moe_##name##_cuda(const sf_moe_args *a, sf_stream stream);
SF_MOE_OPS(SF_MOE_DECLARE)
#undef SF_MOE_DECLARE

#ifdef __cplusplus
}
#endif

#endif /* SF_MOE_BACKEND_H */
