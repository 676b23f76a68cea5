/*
 * act.c - the public entries of the act family: activations forward and
 * backward, bias + dropout + residual and its gradient.  Every precondition
 * is checked here, once, for both backends; then the call goes to the CPU
 * reference (act_cpu.c) or the CUDA kernels (act_cuda.cu).
 */
#include <math.h>

#include "../core/dispatch.h"
#include "act.h"
#include "act_backend.h"

static const char *const sf_act_names[SF_NUM_ACTIVATIONS] = {
    "gelu", "gelu_erf", "silu", "relu", "geglu", "geglu_erf", "swiglu", "reglu",
};

static int act_valid(sf_activation act) { return (int)act >= 0 && act < SF_NUM_ACTIVATIONS; }

int sf_activation_is_gated(sf_activation act) { return act_valid(act) && act >= SF_ACT_GEGLU; }

const char *sf_activation_name(sf_activation act)
{
    return act_valid(act) ? sf_act_names[act] : "<invalid activation>";
}

static int is_fp8(sf_dtype d) { return d == SF_FLOAT8_E4M3 || d == SF_FLOAT8_E5M2; }

/* out: contiguous, on x's device, with x's shape except a last dimension of
 * `last`. */
static sf_status check_out_shape(const char *op, const char *arg, const sf_tensor *t,
                                 const sf_tensor *x, int64_t last)
{
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_device(op, "x", x, arg, t));
    int same = t->ndim == x->ndim;
    for (int i = 0; same && i < x->ndim - 1; ++i)
        same = t->shape[i] == x->shape[i];
    if (!same || t->shape[t->ndim - 1] != last)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have x's shape with a last dimension "
                       "of %lld", op, arg, (long long)last);
    return SF_OK;
}

/* The FP8 output arguments of an activation. */
static sf_status check_fp8_out(const char *op, const char *arg, sf_act_args *a, const sf_tensor *x)
{
    if (a->out->dtype != x->dtype && !is_fp8(a->out->dtype))
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s (the input's), "
                       "float8_e4m3fn or float8_e5m2, got %s", op, arg, sf_dtype_name(x->dtype),
                       sf_dtype_name(a->out->dtype));
    SF_TRY(sf_check_writable(op, arg, a->out));
    if (is_fp8(a->out->dtype) && !a->scale)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'scale' is required when '%s' is %s", op, arg,
                       sf_dtype_name(a->out->dtype));
    if (!is_fp8(a->out->dtype) && (a->scale || a->scale_inv))
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'scale' and 'scale_inv' apply only to an FP8 "
                       "'%s', which is %s", op, arg, sf_dtype_name(a->out->dtype));
    return sf_check_fp8_scaling(op, a->scale, a->amax, a->scale_inv, "x", x);
}

static sf_status check_act_input(const char *op, sf_activation act, const sf_tensor *x,
                                 sf_act_args *a)
{
    if (!act_valid(act))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'activation' must be one of 0..%d, got %d", op,
                       SF_NUM_ACTIVATIONS - 1, (int)act);
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_contiguous(op, "x", x));
    if (x->ndim < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must have at least one dimension", op);
    a->gated = sf_activation_is_gated(act);
    a->base = a->gated ? (int)act - SF_ACT_GEGLU : (int)act;
    const int64_t last = x->shape[x->ndim - 1];
    if (a->gated) {
        if (last % 2 != 0)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'x' of the gated activation %s must have an "
                           "even last dimension (activation half, then gate half), got %lld", op,
                           sf_activation_name(act), (long long)last);
        a->n = last / 2;
        a->rows = last ? sf_numel(x) / last : 0;
    } else { /* element-wise: the whole tensor is one row */
        a->n = sf_numel(x);
        a->rows = 1;
    }
    return SF_OK;
}

static sf_status dispatch_act(const char *op, const sf_act_args *a, int backward, sf_stream stream)
{
    return SF_DISPATCH(op, "x", a->x, backward ? sf_act_backward_cpu(a) : sf_act_forward_cpu(a),
                       backward ? sf_act_backward_cuda(a, stream) : sf_act_forward_cuda(a, stream));
}

sf_status sf_act_forward(sf_activation act, const sf_tensor *x, sf_tensor *y, const sf_tensor *scale,
                     sf_tensor *amax, sf_tensor *scale_inv, sf_stream stream)
{
    static const char op[] = "act_forward";
    sf_act_args a = {.x = x, .out = y, .scale = scale, .amax = amax, .scale_inv = scale_inv};
    SF_TRY(check_act_input(op, act, x, &a));
    const int64_t last = x->shape[x->ndim - 1];
    SF_TRY(check_out_shape(op, "y", y, x, a.gated ? last / 2 : last));
    SF_TRY(check_fp8_out(op, "y", &a, x));
    /* (an element-wise activation may write x itself: each element is read before it is written) */
    const sf_mem_arg outs[] = {{"y", y, "x"}, {"amax", amax, NULL}, {"scale_inv", scale_inv, NULL}};
    const sf_mem_arg ins[] = {{"x", x, NULL}, {"scale", scale, NULL}};
    SF_TRY(sf_check_apart(op, outs, 3, ins, 2));
    return dispatch_act(op, &a, 0, stream);
}

sf_status sf_act_backward(sf_activation act, const sf_tensor *dy, const sf_tensor *x, sf_tensor *dx,
                     const sf_tensor *scale, sf_tensor *amax, sf_tensor *scale_inv,
                     sf_stream stream)
{
    static const char op[] = "act_backward";
    sf_act_args a = {.x = x, .dy = dy, .out = dx, .scale = scale, .amax = amax,
                     .scale_inv = scale_inv};
    SF_TRY(check_act_input(op, act, x, &a));
    const int64_t last = x->shape[x->ndim - 1];
    SF_TRY(sf_check_dtype(op, "dy", dy, x->dtype));
    SF_TRY(check_out_shape(op, "dy", dy, x, a.gated ? last / 2 : last));
    SF_TRY(check_out_shape(op, "dx", dx, x, last));
    SF_TRY(check_fp8_out(op, "dx", &a, x));
    const sf_mem_arg outs[] = {{"dx", dx, NULL}, {"amax", amax, NULL}, {"scale_inv", scale_inv, NULL}};
    const sf_mem_arg ins[] = {{"dy", dy, NULL}, {"x", x, NULL}, {"scale", scale, NULL}};
    SF_TRY(sf_check_apart(op, outs, 3, ins, 3));
    return dispatch_act(op, &a, 1, stream);
}

/* ---- dropout ------------------------------------------------------------- */

static sf_status check_p(const char *op, float p)
{
    if (!(p >= 0.0f && p <= 1.0f))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'p' must be in [0, 1], got %g", op, (double)p);
    return SF_OK;
}

static sf_status check_bias(const char *op, const char *arg, const sf_tensor *b, const sf_tensor *x,
                            int64_t n)
{
    if (b->dtype != x->dtype && b->dtype != SF_FLOAT32)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s (the input's) or float32, "
                       "got %s", op, arg, sf_dtype_name(x->dtype), sf_dtype_name(b->dtype));
    SF_TRY(sf_check_contiguous(op, arg, b));
    SF_TRY(sf_check_numel(op, arg, b, n));
    return sf_check_same_device(op, "x", x, arg, b);
}

static sf_status rows_cols(const char *op, const char *arg, const sf_tensor *x, sf_dropout_args *a)
{
    SF_TRY(sf_check_float_input(op, arg, x));
    SF_TRY(sf_check_contiguous(op, arg, x));
    if (x->ndim < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have at least one dimension", op, arg);
    a->n = x->shape[x->ndim - 1];
    a->rows = a->n ? sf_numel(x) / a->n : 0;
    return SF_OK;
}

/* What both dropout entries check and set first: the input `arg` (rows and
 * n from its shape), p, and the random stream (seed, offset) the mask comes
 * from, so that the backward redraws the forward's mask. */
static sf_status dropout_common(const char *op, const char *arg, const sf_tensor *x, float p,
                                uint64_t seed, uint64_t offset, sf_dropout_args *a)
{
    SF_TRY(rows_cols(op, arg, x, a));
    SF_TRY(check_p(op, p));
    a->p = p;
    a->threshold = sf_dropout_threshold(p);
    a->seed = seed;
    a->offset = offset;
    return SF_OK;
}

sf_status sf_bias_dropout_add_forward(const sf_tensor *x, const sf_tensor *bias,
                                  const sf_tensor *residual, float p, uint64_t seed,
                                  uint64_t offset, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "bias_dropout_add";
    sf_dropout_args a = {0};
    SF_TRY(dropout_common(op, "x", x, p, seed, offset, &a));
    if (bias)
        SF_TRY(check_bias(op, "bias", bias, x, a.n));
    SF_TRY(sf_check_like(op, "residual", residual, "x", x, 0));
    SF_TRY(sf_check_like(op, "out", out, "x", x, 1));
    a.x = x;
    a.bias = bias;
    a.residual = residual;
    a.out = out;
    return SF_DISPATCH(op, "x", x, sf_bias_dropout_add_cpu(&a), sf_bias_dropout_add_cuda(&a, stream));
}

static sf_status dropout_ws_numel(const sf_tensor *dy, int64_t rows, int64_t n, int64_t *numel)
{
    *numel = 0;
    return SF_DISPATCH("dropout_backward", "dy", dy, SF_OK,
                       sf_dropout_backward_workspace_numel_cuda(rows, n, dy->device_id, numel));
}

sf_status sf_dropout_backward_workspace_numel(const sf_tensor *dy, int64_t *numel)
{
    sf_dropout_args a = {0};
    SF_TRY(rows_cols("dropout_backward_workspace_numel", "dy", dy, &a));
    return dropout_ws_numel(dy, a.rows, a.n, numel);
}

sf_status sf_dropout_backward(const sf_tensor *dy, float p, uint64_t seed, uint64_t offset,
                         sf_tensor *dx, sf_tensor *dbias, sf_tensor *workspace, sf_stream stream)
{
    static const char op[] = "dropout_backward";
    sf_dropout_args a = {0};
    SF_TRY(dropout_common(op, "dy", dy, p, seed, offset, &a));
    SF_TRY(sf_check_like(op, "dx", dx, "dy", dy, 1));
    if (dbias) {
        SF_TRY(check_bias(op, "dbias", dbias, dy, a.n));
        SF_TRY(sf_check_writable(op, "dbias", dbias));
        int64_t need;
        SF_TRY(dropout_ws_numel(dy, a.rows, a.n, &need));
        if (need > 0) {
            if (!workspace)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'workspace' is required with 'dbias': "
                               "%lld float32 elements (dropout_backward_workspace_numel)", op,
                               (long long)need);
            SF_TRY(sf_check_dtype(op, "workspace", workspace, SF_FLOAT32));
            SF_TRY(sf_check_contiguous(op, "workspace", workspace));
            SF_TRY(sf_check_writable(op, "workspace", workspace));
            SF_TRY(sf_check_same_device(op, "dy", dy, "workspace", workspace));
            if (sf_numel(workspace) < need)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'workspace' must have at least %lld "
                               "element(s), got %lld", op, (long long)need,
                               (long long)sf_numel(workspace));
        }
    }
    a.dy = dy;
    a.out = dx;
    a.dbias = dbias;
    a.workspace = dbias ? workspace : NULL;
    return SF_DISPATCH(op, "dy", dy, sf_dropout_backward_cpu(&a), sf_dropout_backward_cuda(&a, stream));
}
