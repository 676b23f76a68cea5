/*
 * moe_py.c - bindings of the moe family (router and token permutation,
 * csrc/moe/).  seqfuse.ops.moe holds the Python-facing ops; these are their
 * doors, one per sf_moe_* function, each with the argument order of the C
 * function and an optional stream last: one SF_PY_OP line each (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(moe_topk_forward, sf_moe_topk_forward, "Router top-k forward. See seqfuse.ops.moe.", (T, logits),
         (INT, topk), (INT, score_function), (INT, pre_softmax), (FLOAT, scaling_factor),
         (OT, expert_bias), (T, probs), (T, routing_map), (T, saved));
SF_PY_OP(moe_topk_backward, sf_moe_topk_backward, "Router top-k backward. See seqfuse.ops.moe.",
         (T, routing_map), (T, saved), (T, dprobs), (INT, topk), (INT, score_function),
         (INT, pre_softmax), (FLOAT, scaling_factor), (T, dlogits));
SF_PY_OP(moe_aux_scores_forward, sf_moe_aux_scores_forward, "Aux-loss scores forward.", (T, logits),
         (INT, topk), (INT, score_function), (T, scores), (T, routing_map), (T, saved));
SF_PY_OP(moe_aux_scores_backward, sf_moe_aux_scores_backward, "Aux-loss scores backward.", (T, saved),
         (T, dscores), (INT, score_function), (T, dlogits));
SF_PY_OP(moe_aux_loss_forward, sf_moe_aux_loss_forward, "Load-balancing loss forward.", (T, probs),
         (T, tokens_per_expert), (INT64, total_num_tokens), (INT, topk), (FLOAT, coeff), (T, loss));
SF_PY_OP(moe_aux_loss_backward, sf_moe_aux_loss_backward, "Load-balancing loss backward.", (T, dloss),
         (T, tokens_per_expert), (INT64, total_num_tokens), (INT, topk), (FLOAT, coeff),
         (T, dprobs));
SF_PY_OP(moe_z_loss_forward, sf_moe_z_loss_forward, "Router z-loss forward.", (T, logits), (FLOAT, coeff),
         (T, loss), (T, lse));
SF_PY_OP(moe_z_loss_backward, sf_moe_z_loss_backward, "Router z-loss backward.", (T, logits), (T, lse),
         (T, dloss), (FLOAT, coeff), (T, dlogits));
SF_PY_OP(moe_row_id_map, sf_moe_row_id_map, "Rows of the expert-sorted buffer.", (T, routing_map),
         (T, row_id_map), (T, tokens_per_expert));
SF_PY_OP(moe_permute, sf_moe_permute, "Tokens into the expert-sorted buffer.", (T, inp),
         (T, row_id_map), (OT, probs), (T, out), (OT, out_probs));
SF_PY_OP(moe_unpermute, sf_moe_unpermute, "Expert outputs back to tokens, weighted.", (T, inp),
         (T, row_id_map), (OT, probs), (T, out));
SF_PY_OP(moe_unpermute_backward, sf_moe_unpermute_backward, "Backward of moe_unpermute.", (T, dout),
         (OT, inp), (T, row_id_map), (OT, probs), (T, dinp), (OT, dprobs));
SF_PY_OP(moe_permute_probs_backward, sf_moe_permute_probs_backward, "Backward of the permuted probs.",
         (T, row_id_map), (T, dout_probs), (T, dprobs));
SF_PY_OP(moe_swiglu_forward, sf_moe_swiglu_forward, "SwiGLU scaled by routing probabilities.", (T, x),
         (OT, probs), (T, out));
SF_PY_OP(moe_swiglu_backward, sf_moe_swiglu_backward, "Backward of moe_swiglu_forward.", (T, dout), (T, x),
         (OT, probs), (T, dx), (OT, dprobs));

const sf_py_binding *const sf_py_moe_bindings[] = {
    &moe_swiglu_forward_binding,     &moe_swiglu_backward_binding,   &moe_topk_forward_binding,
    &moe_topk_backward_binding,       &moe_aux_scores_forward_binding, &moe_aux_scores_backward_binding,
    &moe_aux_loss_forward_binding,   &moe_aux_loss_backward_binding, &moe_z_loss_forward_binding,
    &moe_z_loss_backward_binding,     &moe_row_id_map_binding,   &moe_permute_binding,
    &moe_unpermute_binding,      &moe_unpermute_backward_binding, &moe_permute_probs_backward_binding,
    NULL};
