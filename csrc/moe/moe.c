/*
 * moe.c - the public entries of the moe family (router and token
 * permutation, seqfuse_moe.h).  Every precondition is checked here, once,
 * for both backends (dtypes, shapes, contiguity, devices, writability, topk
 * and score-function rules); the validated arguments then go to the CPU
 * reference (moe_cpu.c) or the CUDA kernels (moe_cuda.cu).
 */
#include "../core/dispatch.h"
#include "moe_backend.h"

/* A contiguous 2-D tensor [rows, cols] on ref's device. */
static sf_status check_2d(const char *op, const char *arg, const sf_tensor *t, int64_t rows,
                          int64_t cols, const sf_tensor *ref, const char *ref_arg)
{
    if (!t)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' is required", op, arg);
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [%lld, %lld]", op, arg,
                       (long long)rows, (long long)cols);
    SF_TRY(sf_check_contiguous(op, arg, t));
    if (ref && t != ref)
        SF_TRY(sf_check_same_device(op, ref_arg, ref, arg, t));
    return SF_OK;
}

static sf_status check_1d(const char *op, const char *arg, const sf_tensor *t, int64_t len,
                          const sf_tensor *ref, const char *ref_arg)
{
    if (!t)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' is required", op, arg);
    if (sf_numel(t) != len || (t->ndim != 1 && !(len == 1 && t->ndim == 0)))
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 1-D of length %lld", op, arg,
                       (long long)len);
    SF_TRY(sf_check_contiguous(op, arg, t));
    return sf_check_same_device(op, ref_arg, ref, arg, t);
}

static sf_status check_out(const char *op, const char *arg, const sf_tensor *t)
{
    return sf_check_writable(op, arg, t);
}

static sf_status check_router(const char *op, int64_t E, int topk, int score)
{
    if (score != SF_MOE_SOFTMAX && score != SF_MOE_SIGMOID)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'score_function' must be softmax (0) or sigmoid "
                       "(1), got %d", op, score);
    if (topk < 1 || topk > E)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'topk' must be in [1, num_experts = %lld], got %d",
                       op, (long long)E, topk);
    return SF_OK;
}

/* The leading tensor of a router entry: a contiguous float [tokens, experts]
 * matrix whose shape gives T and E for every other argument. */
static sf_status check_lead(const char *op, const char *arg, const sf_tensor *t, int64_t *T,
                            int64_t *E)
{
    if (!t || t->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D [tokens, experts]", op, arg);
    SF_TRY(sf_check_float_input(op, arg, t));
    *T = t->shape[0];
    *E = t->shape[1];
    return check_2d(op, arg, t, *T, *E, NULL, NULL);
}

/* A [rows, cols] tensor of exactly `dtype` on ref's device. */
static sf_status check_2d_dtype(const char *op, const char *arg, const sf_tensor *t, int64_t rows,
                                int64_t cols, sf_dtype dtype, const sf_tensor *ref,
                                const char *ref_arg)
{
    SF_TRY(check_2d(op, arg, t, rows, cols, ref, ref_arg));
    return sf_check_dtype(op, arg, t, dtype);
}

/* A [rows, cols] float tensor on ref's device (any float dtype). */
static sf_status check_float_2d(const char *op, const char *arg, const sf_tensor *t, int64_t rows,
                                int64_t cols, const sf_tensor *ref, const char *ref_arg)
{
    SF_TRY(check_2d(op, arg, t, rows, cols, ref, ref_arg));
    return sf_check_float_input(op, arg, t);
}

/* A gradient output of the router backward: a writable float [T, E]. */
static sf_status check_grad_out(const char *op, const char *arg, const sf_tensor *t, int64_t T,
                                int64_t E, const sf_tensor *ref, const char *ref_arg)
{
    SF_TRY(check_float_2d(op, arg, t, T, E, ref, ref_arg));
    return check_out(op, arg, t);
}

/* The three outputs of topk_forward and aux_scores_forward, all [T, E] on
 * logits' device: the float result `out` (probs or scores), the bool
 * routing_map and the float32 `saved` the backward reads.  Shapes and dtypes
 * are checked before writability, as they are in every entry. */
static sf_status check_router_outputs(const char *op, const char *out_arg, const sf_tensor *out,
                                      const sf_tensor *routing_map, const sf_tensor *saved,
                                      int64_t T, int64_t E, const sf_tensor *logits)
{
    SF_TRY(check_float_2d(op, out_arg, out, T, E, logits, "logits"));
    SF_TRY(check_2d_dtype(op, "routing_map", routing_map, T, E, SF_BOOL, logits, "logits"));
    SF_TRY(check_2d_dtype(op, "saved", saved, T, E, SF_FLOAT32, logits, "logits"));
    SF_TRY(check_out(op, out_arg, out));
    SF_TRY(check_out(op, "routing_map", routing_map));
    return check_out(op, "saved", saved);
}

/* The validated arguments `a` to sf_moe_<name>_cpu or _cuda by the device of
 * tensor `on` (named as its variable is). */
#define SF_MOE_RUN(name, on, a, stream)                                                       \
    SF_DISPATCH(op, #on, on, sf_moe_##name##_cpu(a), sf_moe_##name##_cuda((a), (stream)))

/* ---- router ------------------------------------------------------------ */

sf_status sf_moe_topk_forward(const sf_tensor *logits, int topk, sf_moe_score score, int pre_softmax,
                          float scaling, const sf_tensor *expert_bias, sf_tensor *probs,
                          sf_tensor *routing_map, sf_tensor *saved, sf_stream stream)
{
    static const char op[] = "moe_topk_forward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "logits", logits, &T, &E));
    SF_TRY(check_router(op, E, topk, score));
    if (expert_bias) {
        if (score != SF_MOE_SIGMOID)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'expert_bias' goes with the sigmoid score "
                           "function only (as in Transformer Engine)", op);
        SF_TRY(sf_check_dtype(op, "expert_bias", expert_bias, SF_FLOAT32));
        SF_TRY(check_1d(op, "expert_bias", expert_bias, E, logits, "logits"));
    }
    SF_TRY(check_router_outputs(op, "probs", probs, routing_map, saved, T, E, logits));
    const sf_moe_args a = {.T = T, .E = E, .topk = topk, .score = score,
                           .pre_softmax = pre_softmax != 0, .scaling = scaling, .logits = logits,
                           .bias = expert_bias, .out = probs, .out2 = routing_map, .out3 = saved};
    if (T == 0)
        return SF_OK;
    return SF_MOE_RUN(topk_forward, logits, &a, stream);
}

sf_status sf_moe_topk_backward(const sf_tensor *routing_map, const sf_tensor *saved,
                          const sf_tensor *dprobs, int topk, sf_moe_score score, int pre_softmax,
                          float scaling, sf_tensor *dlogits, sf_stream stream)
{
    static const char op[] = "moe_topk_backward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "dprobs", dprobs, &T, &E));
    SF_TRY(check_router(op, E, topk, score));
    SF_TRY(check_2d_dtype(op, "routing_map", routing_map, T, E, SF_BOOL, dprobs, "dprobs"));
    SF_TRY(check_2d_dtype(op, "saved", saved, T, E, SF_FLOAT32, dprobs, "dprobs"));
    SF_TRY(check_grad_out(op, "dlogits", dlogits, T, E, dprobs, "dprobs"));
    const sf_moe_args a = {.T = T, .E = E, .topk = topk, .score = score,
                           .pre_softmax = pre_softmax != 0, .scaling = scaling, .map = routing_map,
                           .saved = saved, .grad = dprobs, .out = dlogits};
    if (T == 0)
        return SF_OK;
    return SF_MOE_RUN(topk_backward, dprobs, &a, stream);
}

sf_status sf_moe_aux_scores_forward(const sf_tensor *logits, int topk, sf_moe_score score,
                                sf_tensor *scores, sf_tensor *routing_map, sf_tensor *saved,
                                sf_stream stream)
{
    static const char op[] = "moe_aux_scores_forward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "logits", logits, &T, &E));
    SF_TRY(check_router(op, E, topk, score));
    SF_TRY(check_router_outputs(op, "scores", scores, routing_map, saved, T, E, logits));
    const sf_moe_args a = {.T = T, .E = E, .topk = topk, .score = score, .logits = logits,
                           .out = scores, .out2 = routing_map, .out3 = saved};
    if (T == 0)
        return SF_OK;
    return SF_MOE_RUN(aux_scores_forward, logits, &a, stream);
}

sf_status sf_moe_aux_scores_backward(const sf_tensor *saved, const sf_tensor *dscores,
                                sf_moe_score score, sf_tensor *dlogits, sf_stream stream)
{
    static const char op[] = "moe_aux_scores_backward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "dscores", dscores, &T, &E));
    SF_TRY(check_router(op, E, 1, score));
    SF_TRY(check_2d_dtype(op, "saved", saved, T, E, SF_FLOAT32, dscores, "dscores"));
    SF_TRY(check_grad_out(op, "dlogits", dlogits, T, E, dscores, "dscores"));
    const sf_moe_args a = {.T = T, .E = E, .score = score, .saved = saved, .grad = dscores,
                           .out = dlogits};
    if (T == 0)
        return SF_OK;
    return SF_MOE_RUN(aux_scores_backward, dscores, &a, stream);
}

static sf_status check_tpe(const char *op, const sf_tensor *tpe, int64_t E, const sf_tensor *ref,
                           const char *ref_arg)
{
    if (!tpe)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'tokens_per_expert' is required", op);
    if (tpe->dtype != SF_INT32 && tpe->dtype != SF_INT64)
        return sf_fail(SF_ERR_TYPE, "%s: argument 'tokens_per_expert' must have dtype int32 or "
                       "int64, got %s", op, sf_dtype_name(tpe->dtype));
    return check_1d(op, "tokens_per_expert", tpe, E, ref, ref_arg);
}

/* The arguments both aux-loss entries share: tokens_per_expert [E] on ref's
 * device, the global token count and topk. */
static sf_status check_aux_loss_args(const char *op, const sf_tensor *tpe, int64_t E, int64_t total,
                                     int topk, const sf_tensor *ref, const char *ref_arg)
{
    SF_TRY(check_tpe(op, tpe, E, ref, ref_arg));
    if (total < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'total_num_tokens' must be at least 1, got %lld",
                       op, (long long)total);
    if (topk < 1 || topk > E)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'topk' must be in [1, num_experts = %lld], got %d",
                       op, (long long)E, topk);
    return SF_OK;
}

static sf_status check_scalar_f32(const char *op, const char *arg, const sf_tensor *t,
                                  const sf_tensor *ref, const char *ref_arg, int writable)
{
    if (!t)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' is required", op, arg);
    return sf_check_vector(op, arg, t, SF_FLOAT32, 1, ref_arg, ref, writable);
}

sf_status sf_moe_aux_loss_forward(const sf_tensor *probs, const sf_tensor *tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, sf_tensor *loss,
                              sf_stream stream)
{
    static const char op[] = "moe_aux_loss_forward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "probs", probs, &T, &E));
    SF_TRY(check_aux_loss_args(op, tokens_per_expert, E, total_tokens, topk, probs, "probs"));
    SF_TRY(check_scalar_f32(op, "loss", loss, probs, "probs", 1));
    const sf_moe_args a = {.T = T, .E = E, .topk = topk, .coeff = coeff,
                           .total_tokens = total_tokens, .probs = probs, .tpe = tokens_per_expert,
                           .out = loss};
    return SF_MOE_RUN(aux_loss_forward, probs, &a, stream);
}

sf_status sf_moe_aux_loss_backward(const sf_tensor *dloss, const sf_tensor *tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, sf_tensor *dprobs,
                              sf_stream stream)
{
    static const char op[] = "moe_aux_loss_backward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "dprobs", dprobs, &T, &E));
    SF_TRY(check_out(op, "dprobs", dprobs));
    SF_TRY(check_aux_loss_args(op, tokens_per_expert, E, total_tokens, topk, dprobs, "dprobs"));
    SF_TRY(check_scalar_f32(op, "dloss", dloss, dprobs, "dprobs", 0));
    const sf_moe_args a = {.T = T, .E = E, .topk = topk, .coeff = coeff,
                           .total_tokens = total_tokens, .dloss = dloss, .tpe = tokens_per_expert,
                           .out = dprobs};
    if (T == 0)
        return SF_OK;
    return SF_MOE_RUN(aux_loss_backward, dprobs, &a, stream);
}

sf_status sf_moe_z_loss_forward(const sf_tensor *logits, float coeff, sf_tensor *loss, sf_tensor *lse,
                            sf_stream stream)
{
    static const char op[] = "moe_z_loss_forward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "logits", logits, &T, &E));
    if (T < 1 || E < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'logits' must have at least one token and one "
                       "expert (the mean over no tokens is undefined)", op);
    SF_TRY(check_scalar_f32(op, "loss", loss, logits, "logits", 1));
    SF_TRY(sf_check_dtype(op, "lse", lse, SF_FLOAT32));
    SF_TRY(check_1d(op, "lse", lse, T, logits, "logits"));
    SF_TRY(check_out(op, "lse", lse));
    const sf_moe_args a = {.T = T, .E = E, .coeff = coeff, .logits = logits, .out = loss,
                           .out2 = lse};
    return SF_MOE_RUN(z_loss_forward, logits, &a, stream);
}

sf_status sf_moe_z_loss_backward(const sf_tensor *logits, const sf_tensor *lse, const sf_tensor *dloss,
                            float coeff, sf_tensor *dlogits, sf_stream stream)
{
    static const char op[] = "moe_z_loss_backward";
    int64_t T = 0, E = 0;
    SF_TRY(check_lead(op, "logits", logits, &T, &E));
    if (T < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'logits' must have at least one token", op);
    SF_TRY(sf_check_dtype(op, "lse", lse, SF_FLOAT32));
    SF_TRY(check_1d(op, "lse", lse, T, logits, "logits"));
    SF_TRY(check_scalar_f32(op, "dloss", dloss, logits, "logits", 0));
    SF_TRY(check_grad_out(op, "dlogits", dlogits, T, E, logits, "logits"));
    const sf_moe_args a = {.T = T, .E = E, .coeff = coeff, .logits = logits, .lse = lse,
                           .dloss = dloss, .out = dlogits};
    return SF_MOE_RUN(z_loss_backward, logits, &a, stream);
}

/* ---- permutation ------------------------------------------------------- */

/* row_id_map: [T, E] int32 on ref's device. */
static sf_status check_row_id_map(const char *op, const sf_tensor *m, const sf_tensor *ref,
                                  const char *ref_arg, int64_t *T, int64_t *E)
{
    if (!m || m->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_id_map' must be 2-D [tokens, experts]", op);
    SF_TRY(sf_check_dtype(op, "row_id_map", m, SF_INT32));
    SF_TRY(sf_check_contiguous(op, "row_id_map", m));
    if (ref)
        SF_TRY(sf_check_same_device(op, ref_arg, ref, "row_id_map", m));
    *T = m->shape[0];
    *E = m->shape[1];
    return SF_OK;
}

/* A [rows, H] float matrix (H taken from it when *H < 0). */
static sf_status check_rows(const char *op, const char *arg, const sf_tensor *t, int64_t rows,
                            int64_t *H, const sf_tensor *ref, const char *ref_arg)
{
    if (!t || t->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D [rows, hidden]", op, arg);
    SF_TRY(sf_check_float_input(op, arg, t));
    if (*H < 0)
        *H = t->shape[1];
    if (rows >= 0)
        SF_TRY(check_2d(op, arg, t, rows, *H, ref, ref_arg));
    else
        SF_TRY(check_2d(op, arg, t, t->shape[0], *H, ref, ref_arg));
    return SF_OK;
}

sf_status sf_moe_row_id_map(const sf_tensor *routing_map, sf_tensor *row_id_map,
                            sf_tensor *tokens_per_expert, sf_stream stream)
{
    static const char op[] = "moe_row_id_map";
    if (!routing_map || routing_map->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'routing_map' must be 2-D [tokens, experts]", op);
    SF_TRY(sf_check_dtype(op, "routing_map", routing_map, SF_BOOL));
    int64_t T = routing_map->shape[0], E = routing_map->shape[1], T2 = 0, E2 = 0;
    SF_TRY(check_2d(op, "routing_map", routing_map, T, E, NULL, NULL));
    SF_TRY(check_row_id_map(op, row_id_map, routing_map, "routing_map", &T2, &E2));
    if (T2 != T || E2 != E)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_id_map' must have routing_map's shape [%lld, "
                       "%lld]", op, (long long)T, (long long)E);
    if (T * E >= ((int64_t)1 << 31))
        return sf_fail(SF_ERR_VALUE, "%s: tokens x experts = %lld exceeds what int32 row ids hold",
                       op, (long long)(T * E));
    SF_TRY(check_out(op, "row_id_map", row_id_map));
    SF_TRY(sf_check_dtype(op, "tokens_per_expert", tokens_per_expert, SF_INT64));
    SF_TRY(check_1d(op, "tokens_per_expert", tokens_per_expert, E, routing_map, "routing_map"));
    SF_TRY(check_out(op, "tokens_per_expert", tokens_per_expert));
    const sf_moe_args a = {.T = T, .E = E, .map = routing_map, .out = row_id_map,
                           .out2 = tokens_per_expert};
    if (E == 0)
        return SF_OK;
    return SF_MOE_RUN(row_id_map, routing_map, &a, stream);
}

/* The row_id_map and the source and destination row matrices of a
 * permutation (permute, unpermute and unpermute's backward).  The side that
 * is in token order has T rows (the source when tokens_first, else the
 * destination); the other side's row count is free.  Both have the same
 * hidden size and dtype, and the destination is written.  Gives T, E, H. */
static sf_status check_moved_rows(const char *op, const sf_tensor *row_id_map, const char *src_arg,
                                  const sf_tensor *src, const char *dst_arg, const sf_tensor *dst,
                                  int tokens_first, int64_t *T, int64_t *E, int64_t *H)
{
    *H = -1;
    SF_TRY(check_row_id_map(op, row_id_map, NULL, NULL, T, E));
    SF_TRY(check_rows(op, src_arg, src, tokens_first ? *T : -1, H, row_id_map, "row_id_map"));
    SF_TRY(check_rows(op, dst_arg, dst, tokens_first ? -1 : *T, H, row_id_map, "row_id_map"));
    if (dst->dtype != src->dtype)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have %s's dtype %s, got %s", op, dst_arg,
                       src_arg, sf_dtype_name(src->dtype), sf_dtype_name(dst->dtype));
    return check_out(op, dst_arg, dst);
}

/* A writable float 1-D output of length n on ref's device. */
static sf_status check_float_out_1d(const char *op, const char *arg, const sf_tensor *t, int64_t n,
                                    const sf_tensor *ref, const char *ref_arg)
{
    SF_TRY(sf_check_float_input(op, arg, t));
    SF_TRY(check_1d(op, arg, t, n, ref, ref_arg));
    return check_out(op, arg, t);
}

static sf_status check_probs(const char *op, const char *arg, const sf_tensor *p, int64_t T,
                             int64_t E, const sf_tensor *ref, const char *ref_arg)
{
    if (!p)
        return SF_OK;
    SF_TRY(sf_check_float_input(op, arg, p));
    return check_2d(op, arg, p, T, E, ref, ref_arg);
}

sf_status sf_moe_permute(const sf_tensor *inp, const sf_tensor *row_id_map, const sf_tensor *probs,
                         sf_tensor *out, sf_tensor *out_probs, sf_stream stream)
{
    static const char op[] = "moe_permute";
    int64_t T = 0, E = 0, H = -1;
    SF_TRY(check_moved_rows(op, row_id_map, "inp", inp, "out", out, 1, &T, &E, &H));
    int64_t N = out->shape[0];
    if ((probs != NULL) != (out_probs != NULL))
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'probs' and 'out_probs' go together", op);
    SF_TRY(check_probs(op, "probs", probs, T, E, row_id_map, "row_id_map"));
    if (out_probs) {
        SF_TRY(check_float_out_1d(op, "out_probs", out_probs, N, row_id_map, "row_id_map"));
    }
    const sf_moe_args a = {.T = T, .E = E, .H = H, .N = N, .inp = inp, .map = row_id_map,
                           .probs = probs, .out = out, .out2 = out_probs};
    if (T == 0 || N == 0)
        return SF_OK;
    return SF_MOE_RUN(permute, inp, &a, stream);
}

sf_status sf_moe_unpermute(const sf_tensor *inp, const sf_tensor *row_id_map,
                           const sf_tensor *probs, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "moe_unpermute";
    int64_t T = 0, E = 0, H = -1;
    SF_TRY(check_moved_rows(op, row_id_map, "inp", inp, "out", out, 0, &T, &E, &H));
    SF_TRY(check_probs(op, "probs", probs, T, E, row_id_map, "row_id_map"));
    const sf_moe_args a = {.T = T, .E = E, .H = H, .N = inp->shape[0], .inp = inp,
                           .map = row_id_map, .probs = probs, .out = out};
    if (T == 0 || H == 0)
        return SF_OK;
    return SF_MOE_RUN(unpermute, inp, &a, stream);
}

sf_status sf_moe_unpermute_backward(const sf_tensor *dout, const sf_tensor *inp,
                               const sf_tensor *row_id_map, const sf_tensor *probs,
                               sf_tensor *dinp, sf_tensor *dprobs, sf_stream stream)
{
    static const char op[] = "moe_unpermute_backward";
    int64_t T = 0, E = 0, H = -1;
    SF_TRY(check_moved_rows(op, row_id_map, "dout", dout, "dinp", dinp, 1, &T, &E, &H));
    int64_t N = dinp->shape[0];
    SF_TRY(check_probs(op, "probs", probs, T, E, row_id_map, "row_id_map"));
    if (probs) {
        if (!inp || !dprobs)
            return sf_fail(SF_ERR_VALUE, "%s: with 'probs', arguments 'inp' (the forward's input) and "
                           "'dprobs' are required", op);
        SF_TRY(check_rows(op, "inp", inp, N, &H, row_id_map, "row_id_map"));
        SF_TRY(check_probs(op, "dprobs", dprobs, T, E, row_id_map, "row_id_map"));
        SF_TRY(check_out(op, "dprobs", dprobs));
    } else if (dprobs) {
        return sf_fail(SF_ERR_VALUE, "%s: argument 'dprobs' needs 'probs'", op);
    } else if (inp) {
        /* inp is read only for dprobs: inp, probs and dprobs come together or not at all */
        return sf_fail(SF_ERR_VALUE, "%s: argument 'inp' is read only with 'probs' (for 'dprobs'); "
                       "pass None without them", op);
    }
    const sf_moe_args a = {.T = T, .E = E, .H = H, .N = N, .grad = dout, .inp = inp,
                           .map = row_id_map, .probs = probs, .out = dinp, .out2 = dprobs};
    if (T == 0 || (N == 0 && !dprobs))
        return SF_OK;
    return SF_MOE_RUN(unpermute_backward, dout, &a, stream);
}

sf_status sf_moe_permute_probs_backward(const sf_tensor *row_id_map, const sf_tensor *dout_probs,
                                   sf_tensor *dprobs, sf_stream stream)
{
    static const char op[] = "moe_permute_probs_backward";
    int64_t T = 0, E = 0;
    SF_TRY(check_row_id_map(op, row_id_map, NULL, NULL, &T, &E));
    if (!dout_probs || dout_probs->ndim != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'dout_probs' must be 1-D [rows]", op);
    SF_TRY(sf_check_float_input(op, "dout_probs", dout_probs));
    SF_TRY(check_1d(op, "dout_probs", dout_probs, dout_probs->shape[0], row_id_map, "row_id_map"));
    SF_TRY(check_probs(op, "dprobs", dprobs, T, E, row_id_map, "row_id_map"));
    if (!dprobs)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'dprobs' is required", op);
    SF_TRY(check_out(op, "dprobs", dprobs));
    const sf_moe_args a = {.T = T, .E = E, .N = dout_probs->shape[0], .map = row_id_map,
                           .grad = dout_probs, .out = dprobs};
    if (T == 0 || E == 0)
        return SF_OK;
    return SF_MOE_RUN(permute_probs_backward, row_id_map, &a, stream);
}

/* ---- probability-scaled SwiGLU ------------------------------------------ */

/* x [N, 2F] and probs [N] (optional); returns N and F. */
static sf_status check_swiglu_input(const char *op, const sf_tensor *x, const sf_tensor *probs,
                                    int64_t *N, int64_t *F)
{
    if (!x || x->ndim != 2 || x->shape[1] % 2 != 0)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must be 2-D [rows, 2 * ffn] (gate then up "
                       "halves), with an even last dimension", op);
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_contiguous(op, "x", x));
    *N = x->shape[0];
    *F = x->shape[1] / 2;
    if (probs) {
        SF_TRY(sf_check_float_input(op, "probs", probs));
        SF_TRY(check_1d(op, "probs", probs, *N, x, "x"));
    }
    return SF_OK;
}

sf_status sf_moe_swiglu_forward(const sf_tensor *x, const sf_tensor *probs, sf_tensor *out,
                            sf_stream stream)
{
    static const char op[] = "moe_swiglu_forward";
    int64_t N = 0, F = 0;
    SF_TRY(check_swiglu_input(op, x, probs, &N, &F));
    SF_TRY(check_2d(op, "out", out, N, F, x, "x"));
    SF_TRY(sf_check_dtype(op, "out", out, x->dtype));
    SF_TRY(check_out(op, "out", out));
    const sf_moe_args a = {.N = N, .H = F, .inp = x, .probs = probs, .out = out};
    if (N == 0 || F == 0)
        return SF_OK;
    return SF_MOE_RUN(swiglu_forward, x, &a, stream);
}

sf_status sf_moe_swiglu_backward(const sf_tensor *dout, const sf_tensor *x, const sf_tensor *probs,
                            sf_tensor *dx, sf_tensor *dprobs, sf_stream stream)
{
    static const char op[] = "moe_swiglu_backward";
    int64_t N = 0, F = 0;
    SF_TRY(check_swiglu_input(op, x, probs, &N, &F));
    SF_TRY(check_2d(op, "dout", dout, N, F, x, "x"));
    SF_TRY(sf_check_float_input(op, "dout", dout));
    SF_TRY(check_2d(op, "dx", dx, N, 2 * F, x, "x"));
    SF_TRY(sf_check_dtype(op, "dx", dx, x->dtype));
    SF_TRY(check_out(op, "dx", dx));
    if (dprobs) {
        if (!probs)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'dprobs' needs 'probs'", op);
        SF_TRY(check_float_out_1d(op, "dprobs", dprobs, N, x, "x"));
    }
    const sf_moe_args a = {.N = N, .H = F, .inp = x, .probs = probs, .grad = dout, .out = dx,
                           .out2 = dprobs};
    if (N == 0)
        return SF_OK;
    return SF_MOE_RUN(swiglu_backward, x, &a, stream);
}
