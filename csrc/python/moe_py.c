/*
 * moe_py.c - bindings of the moe family (router and token permutation,
 * csrc/moe/).  seqfuse.ops.moe holds the Python-facing ops; these are their
 * doors, one per sf_moe_* function, each with the argument order of the C
 * function and an optional stream last.  Each binding is an argument table
 * and a thunk calling the C entry; the driver in py_call.c does the parsing,
 * importing and error mapping.
 */
#include "py_call.h"

static const sf_py_arg topk_fwd_args[] = {
    SF_T(logits), SF_INT(topk), SF_INT(score_function), SF_INT(pre_softmax),
    SF_FLOAT(scaling_factor), SF_OT(expert_bias), SF_T(probs), SF_T(routing_map), SF_T(saved),
    SF_STREAM};
static sf_status topk_fwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_topk_fwd(v[0].t, v[1].i, (sf_moe_score)v[2].i, v[3].i, (float)v[4].f, v[5].t,
                           v[6].t, v[7].t, v[8].t, s);
}
SF_PY_BINDING(moe_topk_fwd, topk_fwd_args, topk_fwd, "Router top-k forward. See seqfuse.ops.moe.");

static const sf_py_arg topk_bwd_args[] = {
    SF_T(routing_map), SF_T(saved), SF_T(dprobs), SF_INT(topk), SF_INT(score_function),
    SF_INT(pre_softmax), SF_FLOAT(scaling_factor), SF_T(dlogits), SF_STREAM};
static sf_status topk_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_topk_bwd(v[0].t, v[1].t, v[2].t, v[3].i, (sf_moe_score)v[4].i, v[5].i,
                           (float)v[6].f, v[7].t, s);
}
SF_PY_BINDING(moe_topk_bwd, topk_bwd_args, topk_bwd, "Router top-k backward. See seqfuse.ops.moe.");

static const sf_py_arg scores_fwd_args[] = {SF_T(logits), SF_INT(topk), SF_INT(score_function),
                                            SF_T(scores), SF_T(routing_map), SF_T(saved),
                                            SF_STREAM};
static sf_status scores_fwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_aux_scores_fwd(v[0].t, v[1].i, (sf_moe_score)v[2].i, v[3].t, v[4].t, v[5].t, s);
}
SF_PY_BINDING(moe_aux_scores_fwd, scores_fwd_args, scores_fwd, "Aux-loss scores forward.");

static const sf_py_arg scores_bwd_args[] = {SF_T(saved), SF_T(dscores), SF_INT(score_function),
                                            SF_T(dlogits), SF_STREAM};
static sf_status scores_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_aux_scores_bwd(v[0].t, v[1].t, (sf_moe_score)v[2].i, v[3].t, s);
}
SF_PY_BINDING(moe_aux_scores_bwd, scores_bwd_args, scores_bwd, "Aux-loss scores backward.");

static const sf_py_arg aux_fwd_args[] = {SF_T(probs), SF_T(tokens_per_expert),
                                         SF_INT64(total_num_tokens), SF_INT(topk), SF_FLOAT(coeff),
                                         SF_T(loss), SF_STREAM};
static sf_status aux_fwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_aux_loss_fwd(v[0].t, v[1].t, v[2].i64, v[3].i, (float)v[4].f, v[5].t, s);
}
SF_PY_BINDING(moe_aux_loss_fwd, aux_fwd_args, aux_fwd, "Load-balancing loss forward.");

static const sf_py_arg aux_bwd_args[] = {SF_T(dloss), SF_T(tokens_per_expert),
                                         SF_INT64(total_num_tokens), SF_INT(topk), SF_FLOAT(coeff),
                                         SF_T(dprobs), SF_STREAM};
static sf_status aux_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_aux_loss_bwd(v[0].t, v[1].t, v[2].i64, v[3].i, (float)v[4].f, v[5].t, s);
}
SF_PY_BINDING(moe_aux_loss_bwd, aux_bwd_args, aux_bwd, "Load-balancing loss backward.");

static const sf_py_arg z_fwd_args[] = {SF_T(logits), SF_FLOAT(coeff), SF_T(loss), SF_T(lse),
                                       SF_STREAM};
static sf_status z_fwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_z_loss_fwd(v[0].t, (float)v[1].f, v[2].t, v[3].t, s);
}
SF_PY_BINDING(moe_z_loss_fwd, z_fwd_args, z_fwd, "Router z-loss forward.");

static const sf_py_arg z_bwd_args[] = {SF_T(logits), SF_T(lse), SF_T(dloss), SF_FLOAT(coeff),
                                       SF_T(dlogits), SF_STREAM};
static sf_status z_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_z_loss_bwd(v[0].t, v[1].t, v[2].t, (float)v[3].f, v[4].t, s);
}
SF_PY_BINDING(moe_z_loss_bwd, z_bwd_args, z_bwd, "Router z-loss backward.");

static const sf_py_arg row_id_map_args[] = {SF_T(routing_map), SF_T(row_id_map),
                                            SF_T(tokens_per_expert), SF_STREAM};
static sf_status row_id_map(sf_py_value *v, sf_stream s)
{
    return sf_moe_row_id_map(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(moe_row_id_map, row_id_map_args, row_id_map, "Rows of the expert-sorted buffer.");

static const sf_py_arg permute_args[] = {SF_T(inp), SF_T(row_id_map), SF_OT(probs), SF_T(out),
                                         SF_OT(out_probs), SF_STREAM};
static sf_status permute(sf_py_value *v, sf_stream s)
{
    return sf_moe_permute(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, s);
}
SF_PY_BINDING(moe_permute, permute_args, permute, "Tokens into the expert-sorted buffer.");

static const sf_py_arg unpermute_args[] = {SF_T(inp), SF_T(row_id_map), SF_OT(probs), SF_T(out),
                                           SF_STREAM};
static sf_status unpermute(sf_py_value *v, sf_stream s)
{
    return sf_moe_unpermute(v[0].t, v[1].t, v[2].t, v[3].t, s);
}
SF_PY_BINDING(moe_unpermute, unpermute_args, unpermute, "Expert outputs back to tokens, weighted.");

static const sf_py_arg unpermute_bwd_args[] = {SF_T(dout),  SF_OT(inp), SF_T(row_id_map),
                                               SF_OT(probs), SF_T(dinp), SF_OT(dprobs), SF_STREAM};
static sf_status unpermute_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_unpermute_bwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, s);
}
SF_PY_BINDING(moe_unpermute_bwd, unpermute_bwd_args, unpermute_bwd, "Backward of moe_unpermute.");

static const sf_py_arg probs_bwd_args[] = {SF_T(row_id_map), SF_T(dout_probs), SF_T(dprobs),
                                           SF_STREAM};
static sf_status probs_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_permute_probs_bwd(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(moe_permute_probs_bwd, probs_bwd_args, probs_bwd, "Backward of the permuted probs.");

static const sf_py_arg swiglu_fwd_args[] = {SF_T(x), SF_OT(probs), SF_T(out), SF_STREAM};
static sf_status swiglu_fwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_swiglu_fwd(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(moe_swiglu_fwd, swiglu_fwd_args, swiglu_fwd, "SwiGLU scaled by routing probabilities.");

static const sf_py_arg swiglu_bwd_args[] = {SF_T(dout), SF_T(x), SF_OT(probs), SF_T(dx),
                                            SF_OT(dprobs), SF_STREAM};
static sf_status swiglu_bwd(sf_py_value *v, sf_stream s)
{
    return sf_moe_swiglu_bwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, s);
}
SF_PY_BINDING(moe_swiglu_bwd, swiglu_bwd_args, swiglu_bwd, "Backward of moe_swiglu_fwd.");

const sf_py_binding *const sf_py_moe_bindings[] = {
    &moe_swiglu_fwd_binding,     &moe_swiglu_bwd_binding,   &moe_topk_fwd_binding,
    &moe_topk_bwd_binding,       &moe_aux_scores_fwd_binding, &moe_aux_scores_bwd_binding,
    &moe_aux_loss_fwd_binding,   &moe_aux_loss_bwd_binding, &moe_z_loss_fwd_binding,
    &moe_z_loss_bwd_binding,     &moe_row_id_map_binding,   &moe_permute_binding,
    &moe_unpermute_binding,      &moe_unpermute_bwd_binding, &moe_permute_probs_bwd_binding,
    NULL};
