/*
 * moe_py.c - bindings of the moe family (router and token permutation,
 * csrc/moe/).  seqfuse.ops.moe holds the Python-facing ops; these are their
 * doors, one per sf_moe_* function, each with the argument order of the C
 * function and an optional stream last: one SF_PY_OP line each (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(moe_topk_fwd, sf_moe_topk_fwd, "Router top-k forward. See seqfuse.ops.moe.", (T, logits),
         (INT, topk), (INT, score_function), (INT, pre_softmax), (FLOAT, scaling_factor),
         (OT, expert_bias), (T, probs), (T, routing_map), (T, saved));
SF_PY_OP(moe_topk_bwd, sf_moe_topk_bwd, "Router top-k backward. See seqfuse.ops.moe.",
         (T, routing_map), (T, saved), (T, dprobs), (INT, topk), (INT, score_function),
         (INT, pre_softmax), (FLOAT, scaling_factor), (T, dlogits));
SF_PY_OP(moe_aux_scores_fwd, sf_moe_aux_scores_fwd, "Aux-loss scores forward.", (T, logits),
         (INT, topk), (INT, score_function), (T, scores), (T, routing_map), (T, saved));
SF_PY_OP(moe_aux_scores_bwd, sf_moe_aux_scores_bwd, "Aux-loss scores backward.", (T, saved),
         (T, dscores), (INT, score_function), (T, dlogits));
SF_PY_OP(moe_aux_loss_fwd, sf_moe_aux_loss_fwd, "Load-balancing loss forward.", (T, probs),
         (T, tokens_per_expert), (INT64, total_num_tokens), (INT, topk), (FLOAT, coeff), (T, loss));
SF_PY_OP(moe_aux_loss_bwd, sf_moe_aux_loss_bwd, "Load-balancing loss backward.", (T, dloss),
         (T, tokens_per_expert), (INT64, total_num_tokens), (INT, topk), (FLOAT, coeff),
         (T, dprobs));
SF_PY_OP(moe_z_loss_fwd, sf_moe_z_loss_fwd, "Router z-loss forward.", (T, logits), (FLOAT, coeff),
         (T, loss), (T, lse));
SF_PY_OP(moe_z_loss_bwd, sf_moe_z_loss_bwd, "Router z-loss backward.", (T, logits), (T, lse),
         (T, dloss), (FLOAT, coeff), (T, dlogits));
SF_PY_OP(moe_row_id_map, sf_moe_row_id_map, "Rows of the expert-sorted buffer.", (T, routing_map),
         (T, row_id_map), (T, tokens_per_expert));
SF_PY_OP(moe_permute, sf_moe_permute, "Tokens into the expert-sorted buffer.", (T, inp),
         (T, row_id_map), (OT, probs), (T, out), (OT, out_probs));
SF_PY_OP(moe_unpermute, sf_moe_unpermute, "Expert outputs back to tokens, weighted.", (T, inp),
         (T, row_id_map), (OT, probs), (T, out));
SF_PY_OP(moe_unpermute_bwd, sf_moe_unpermute_bwd, "Backward of moe_unpermute.", (T, dout),
         (OT, inp), (T, row_id_map), (OT, probs), (T, dinp), (OT, dprobs));
SF_PY_OP(moe_permute_probs_bwd, sf_moe_permute_probs_bwd, "Backward of the permuted probs.",
         (T, row_id_map), (T, dout_probs), (T, dprobs));
SF_PY_OP(moe_swiglu_fwd, sf_moe_swiglu_fwd, "SwiGLU scaled by routing probabilities.", (T, x),
         (OT, probs), (T, out));
SF_PY_OP(moe_swiglu_bwd, sf_moe_swiglu_bwd, "Backward of moe_swiglu_fwd.", (T, dout), (T, x),
         (OT, probs), (T, dx), (OT, dprobs));

const sf_py_binding *const sf_py_moe_bindings[] = {
    &moe_swiglu_fwd_binding,     &moe_swiglu_bwd_binding,   &moe_topk_fwd_binding,
    &moe_topk_bwd_binding,       &moe_aux_scores_fwd_binding, &moe_aux_scores_bwd_binding,
    &moe_aux_loss_fwd_binding,   &moe_aux_loss_bwd_binding, &moe_z_loss_fwd_binding,
    &moe_z_loss_bwd_binding,     &moe_row_id_map_binding,   &moe_permute_binding,
    &moe_unpermute_binding,      &moe_unpermute_bwd_binding, &moe_permute_probs_bwd_binding,
    NULL};
