/*
 * seqfuse_moe.h - public C API of the moe family (csrc/moe/): the router of a
 * mixture-of-experts layer and the token permutation around the experts'
 * grouped GEMMs.  Included by seqfuse.h; include that, not this.
 *
 * Names and semantics follow Transformer Engine's PyTorch router and
 * permutation functions (fused_topk_with_score_function,
 * fused_compute_score_for_moe_aux_loss, fused_moe_aux_loss, moe_permute /
 * moe_unpermute with a routing map).  Every tensor is contiguous; T tokens,
 * E experts, H hidden, N permuted rows.  Float tensors are float32, float16
 * or bfloat16 unless a dtype is named; arithmetic is float32.
 *
 * Router.  topk_forward: scores = softmax(logits) (score 0) or sigmoid(logits)
 * (score 1); the topk experts of each token are those of largest score
 * (+ expert_bias [E] float32, sigmoid only: it steers the selection and is
 * not part of the probabilities; ties go to the lower expert index).  probs
 * [T, E] holds the selected experts' probabilities, zero elsewhere:
 *   softmax, pre_softmax=1: softmax(logits) at the selected experts;
 *   softmax, pre_softmax=0: softmax over the selected logits only;
 *   sigmoid: sigmoid(logits), divided by their sum over the selected
 *            experts (+1e-20) when topk > 1;
 * all times `scaling`.  routing_map [T, E] bool marks the selection; saved
 * [T, E] float32 keeps what the backward needs (the scores, or for
 * pre_softmax=0 the probabilities before scaling).  topk_backward takes dprobs
 * [T, E] and gives dlogits [T, E].
 * aux_scores_forward: the scores of the load-balancing loss, softmax(logits) or
 * sigmoid(logits) / (their sum + 1e-20), with the topk routing map of those
 * scores; aux_scores_backward its gradient.
 * aux_loss_forward: loss[0] = coeff * E / (topk * total_tokens^2) *
 *   sum_e (sum_t probs[t, e]) * tokens_per_expert[e]   (int32 or int64 [E]);
 * aux_loss_backward: dprobs[t, e] = dloss[0] * the same factor * tokens_per_expert[e].
 * z_loss_forward: loss[0] = coeff * mean_t logsumexp(logits[t])^2, lse [T]
 *   float32 saved; z_loss_backward: dlogits = dloss[0] * coeff * 2 lse_t / T *
 *   softmax(logits[t]).  loss and dloss are one-element float32 tensors.
 *
 * Permutation.  row_id_map: from routing_map [T, E], row_id_map [T, E] int32
 * gives each (token, expert) pair its row in the expert-sorted buffer
 * (experts in order, tokens in order within an expert), -1 where not routed;
 * tokens_per_expert [E] int64.  permute: out[row_id_map[t, e]] = inp[t]
 * (rows >= N are dropped), out_probs[row] = probs[t, e] when given.
 * unpermute: out[t] = sum_e probs[t, e] * inp[row_id_map[t, e]] (probs
 * NULL: weight 1; also the backward of permute).  unpermute_backward: dinp[row] =
 * probs[t, e] * dout[t], dprobs[t, e] = <dout[t], inp[row]> (0 where not
 * routed); inp, probs and dprobs are given together or all NULL: without
 * probs dinp[row] = dout[t] (the forward of permute).  permute_probs_backward: dprobs[t, e] = dout_probs[row_id_map[t, e]]
 * (0 where not routed or dropped).
 *
 * SwiGLU scaled by the routing probability, between the experts' two GEMMs:
 * swiglu_forward: out[r, j] = silu(x[r, j]) * x[r, F + j] * probs[r] for x
 * [N, 2F], out [N, F] in x's dtype, probs [N] (NULL: 1).  swiglu_backward: dx
 * [N, 2F] from dout [N, F], and dprobs[r] = sum_j dout[r, j] * silu(x[r, j])
 * * x[r, F + j] when probs is given (dprobs may be NULL then).
 */
#ifndef SEQFUSE_MOE_H
#define SEQFUSE_MOE_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sf_moe_score {
    SF_MOE_SOFTMAX = 0,
    SF_MOE_SIGMOID = 1,
} sf_moe_score;

sf_status sf_moe_topk_forward(const sf_tensor *logits, int topk, sf_moe_score score, int pre_softmax,
                          float scaling, const sf_tensor *expert_bias, sf_tensor *probs,
                          sf_tensor *routing_map, sf_tensor *saved, sf_stream stream);
sf_status sf_moe_topk_backward(const sf_tensor *routing_map, const sf_tensor *saved,
                          const sf_tensor *dprobs, int topk, sf_moe_score score, int pre_softmax,
                          float scaling, sf_tensor *dlogits, sf_stream stream);
sf_status sf_moe_aux_scores_forward(const sf_tensor *logits, int topk, sf_moe_score score,
                                sf_tensor *scores, sf_tensor *routing_map, sf_tensor *saved,
                                sf_stream stream);
sf_status sf_moe_aux_scores_backward(const sf_tensor *saved, const sf_tensor *dscores,
                                sf_moe_score score, sf_tensor *dlogits, sf_stream stream);
sf_status sf_moe_aux_loss_forward(const sf_tensor *probs, const sf_tensor *tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, sf_tensor *loss,
                              sf_stream stream);
sf_status sf_moe_aux_loss_backward(const sf_tensor *dloss, const sf_tensor *tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, sf_tensor *dprobs,
                              sf_stream stream);
sf_status sf_moe_z_loss_forward(const sf_tensor *logits, float coeff, sf_tensor *loss, sf_tensor *lse,
                            sf_stream stream);
sf_status sf_moe_z_loss_backward(const sf_tensor *logits, const sf_tensor *lse, const sf_tensor *dloss,
                            float coeff, sf_tensor *dlogits, sf_stream stream);

sf_status sf_moe_row_id_map(const sf_tensor *routing_map, sf_tensor *row_id_map,
                            sf_tensor *tokens_per_expert, sf_stream stream);
sf_status sf_moe_permute(const sf_tensor *inp, const sf_tensor *row_id_map, const sf_tensor *probs,
                         sf_tensor *out, sf_tensor *out_probs, sf_stream stream);
sf_status sf_moe_unpermute(const sf_tensor *inp, const sf_tensor *row_id_map,
                           const sf_tensor *probs, sf_tensor *out, sf_stream stream);
sf_status sf_moe_unpermute_backward(const sf_tensor *dout, const sf_tensor *inp,
                               const sf_tensor *row_id_map, const sf_tensor *probs,
                               sf_tensor *dinp, sf_tensor *dprobs, sf_stream stream);
sf_status sf_moe_permute_probs_backward(const sf_tensor *row_id_map, const sf_tensor *dout_probs,
                                   sf_tensor *dprobs, sf_stream stream);

sf_status sf_moe_swiglu_forward(const sf_tensor *x, const sf_tensor *probs, sf_tensor *out,
                            sf_stream stream);
sf_status sf_moe_swiglu_backward(const sf_tensor *dout, const sf_tensor *x, const sf_tensor *probs,
                            sf_tensor *dx, sf_tensor *dprobs, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_MOE_H */
