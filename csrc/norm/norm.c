/*
 * norm.c - the public LayerNorm / RMSNorm entries: every precondition is
 * checked here, once, then the call goes to the CPU reference (norm_cpu.c) or
 * the CUDA kernels (norm_cuda.cu).  Messages name the op, the argument and
 * the rule, e.g. "layernorm_forward: argument 'gamma' must have 4096 element(s)".
 * The CUDA side is one unit, norm_cuda.cu, with its kernels in
 * norm_kernels.cuh.
 */
#include <math.h>

#include "../core/dispatch.h"
#include "norm_backend.h"

static int is_fp8(sf_dtype d) { return d == SF_FLOAT8_E4M3 || d == SF_FLOAT8_E5M2; }

/* x: float input, contiguous, at least one dimension, hidden in range. */
static sf_status check_input(const char *op, const char *arg, const sf_tensor *x,
                             int64_t *rows, int64_t *hidden)
{
    SF_TRY(sf_check_float_input(op, arg, x));
    SF_TRY(sf_check_contiguous(op, arg, x));
    if (x->ndim < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have at least one dimension "
                       "(the normalized one is the last)", op, arg);
    *hidden = x->shape[x->ndim - 1];
    if (*hidden < 1 || *hidden > SF_NORM_MAX_HIDDEN)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' has hidden size (last dimension) "
                       "%lld; it must be between 1 and %d",
                       op, arg, (long long)*hidden, SF_NORM_MAX_HIDDEN);
    *rows = sf_numel(x) / *hidden;
    return SF_OK;
}

/* gamma / beta / dgamma / dbeta: [hidden], x's dtype or float32. */
static sf_status check_param(const char *op, const char *arg, const sf_tensor *p,
                             const sf_tensor *x, int64_t hidden)
{
    if (p->dtype != x->dtype && p->dtype != SF_FLOAT32)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s (the input's) or "
                       "float32, got %s", op, arg, sf_dtype_name(x->dtype),
                       sf_dtype_name(p->dtype));
    SF_TRY(sf_check_contiguous(op, arg, p));
    SF_TRY(sf_check_numel(op, arg, p, hidden));
    return sf_check_same_device(op, "x", x, arg, p);
}

/* An output shaped like x. */
static sf_status check_like_x(const char *op, const char *arg, const sf_tensor *t,
                              const sf_tensor *x)
{
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_shape(op, "x", x, arg, t));
    return sf_check_same_device(op, "x", x, arg, t);
}

static sf_status norm_forward(const char *op, sf_norm_forward_args *a, sf_stream stream)
{
    const sf_tensor *x = a->x;
    SF_TRY(check_input(op, "x", x, &a->rows, &a->hidden));
    if (!(a->eps >= 0.0f) || !isfinite(a->eps))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'eps' must be finite and >= 0, got %g", op,
                       (double)a->eps);
    SF_TRY(check_param(op, "gamma", a->gamma, x, a->hidden));
    if (a->beta) {
        SF_TRY(check_param(op, "beta", a->beta, x, a->hidden));
        if (a->beta->dtype != a->gamma->dtype)
            return sf_fail(SF_ERR_TYPE, "%s: argument 'beta' must have gamma's dtype %s, got %s",
                           op, sf_dtype_name(a->gamma->dtype), sf_dtype_name(a->beta->dtype));
    }
    sf_tensor *y = a->y;
    if (y->dtype != x->dtype && !is_fp8(y->dtype))
        return sf_fail(SF_ERR_TYPE, "%s: argument 'y' must have dtype %s (the input's), "
                       "float8_e4m3fn or float8_e5m2, got %s", op, sf_dtype_name(x->dtype),
                       sf_dtype_name(y->dtype));
    SF_TRY(check_like_x(op, "y", y, x));
    SF_TRY(sf_check_writable(op, "y", y));
    if (a->mean)
        SF_TRY(sf_check_vector(op, "mean", a->mean, SF_FLOAT32, a->rows, "x", x, 1));
    if (a->rstd)
        SF_TRY(sf_check_vector(op, "rstd", a->rstd, SF_FLOAT32, a->rows, "x", x, 1));
    if (is_fp8(y->dtype) && !a->scale)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'scale' is required when 'y' is %s", op,
                       sf_dtype_name(y->dtype));
    if (!is_fp8(y->dtype) && (a->scale || a->scale_inv))
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'scale' and 'scale_inv' apply only to an "
                       "FP8 'y', which is %s", op, sf_dtype_name(y->dtype));
    SF_TRY(sf_check_fp8_scaling(op, a->scale, a->amax, a->scale_inv, "x", x));
    const sf_mem_arg outs[] = {{"y", y, NULL}, {"mean", a->mean, NULL}, {"rstd", a->rstd, NULL},
                               {"amax", a->amax, NULL}, {"scale_inv", a->scale_inv, NULL}};
    const sf_mem_arg ins[] = {{"x", x, NULL}, {"gamma", a->gamma, NULL}, {"beta", a->beta, NULL},
                              {"scale", a->scale, NULL}};
    SF_TRY(sf_check_apart(op, outs, 5, ins, 4));

    return SF_DISPATCH(op, "x", x, sf_norm_forward_cpu(a), sf_norm_forward_cuda(a, stream));
}

sf_status sf_layernorm_forward(const sf_tensor *x, const sf_tensor *gamma,
                           const sf_tensor *beta, float eps, int zero_centered_gamma,
                           sf_tensor *y, sf_tensor *mean, sf_tensor *rstd,
                           const sf_tensor *scale, sf_tensor *amax,
                           sf_tensor *scale_inv, sf_stream stream)
{
    sf_norm_forward_args a = {.rms = 0, .zero_centered_gamma = zero_centered_gamma != 0, .eps = eps,
                          .x = x, .gamma = gamma, .beta = beta, .y = y, .mean = mean,
                          .rstd = rstd, .scale = scale, .amax = amax, .scale_inv = scale_inv};
    return norm_forward("layernorm_forward", &a, stream);
}

sf_status sf_rmsnorm_forward(const sf_tensor *x, const sf_tensor *gamma, float eps,
                         int zero_centered_gamma, sf_tensor *y, sf_tensor *rstd,
                         const sf_tensor *scale, sf_tensor *amax,
                         sf_tensor *scale_inv, sf_stream stream)
{
    sf_norm_forward_args a = {.rms = 1, .zero_centered_gamma = zero_centered_gamma != 0, .eps = eps,
                          .x = x, .gamma = gamma, .y = y, .rstd = rstd, .scale = scale,
                          .amax = amax, .scale_inv = scale_inv};
    return norm_forward("rmsnorm_forward", &a, stream);
}

static sf_status workspace_numel(const sf_tensor *x, int64_t rows, int64_t hidden,
                                 int64_t *numel)
{
    *numel = 0;
    return SF_DISPATCH("norm_backward_workspace_numel", "x", x, SF_OK,
                       sf_norm_backward_workspace_numel_cuda(rows, hidden, x->dtype, x->device_id,
                                                        numel));
}

sf_status sf_norm_backward_workspace_numel(const sf_tensor *x, int64_t *numel)
{
    int64_t rows, hidden;
    SF_TRY(check_input("norm_backward_workspace_numel", "x", x, &rows, &hidden));
    return workspace_numel(x, rows, hidden, numel);
}

static sf_status norm_backward(const char *op, sf_norm_backward_args *a, sf_stream stream)
{
    const sf_tensor *x = a->x;
    SF_TRY(check_input(op, "x", x, &a->rows, &a->hidden));
    SF_TRY(sf_check_dtype(op, "dy", a->dy, x->dtype));
    SF_TRY(check_like_x(op, "dy", a->dy, x));
    SF_TRY(sf_check_dtype(op, "dx", a->dx, x->dtype));
    SF_TRY(check_like_x(op, "dx", a->dx, x));
    SF_TRY(sf_check_writable(op, "dx", a->dx));
    if (a->dres) {
        SF_TRY(sf_check_dtype(op, "dres", a->dres, x->dtype));
        SF_TRY(check_like_x(op, "dres", a->dres, x));
    }
    if (a->mean)
        SF_TRY(sf_check_vector(op, "mean", a->mean, SF_FLOAT32, a->rows, "x", x, 0));
    SF_TRY(sf_check_vector(op, "rstd", a->rstd, SF_FLOAT32, a->rows, "x", x, 0));
    SF_TRY(check_param(op, "gamma", a->gamma, x, a->hidden));
    SF_TRY(sf_check_dtype(op, "dgamma", a->dgamma, a->gamma->dtype));
    SF_TRY(check_param(op, "dgamma", a->dgamma, x, a->hidden));
    SF_TRY(sf_check_writable(op, "dgamma", a->dgamma));
    if (a->dbeta) {
        SF_TRY(sf_check_dtype(op, "dbeta", a->dbeta, a->gamma->dtype));
        SF_TRY(check_param(op, "dbeta", a->dbeta, x, a->hidden));
        SF_TRY(sf_check_writable(op, "dbeta", a->dbeta));
    }
    int64_t need;
    SF_TRY(workspace_numel(x, a->rows, a->hidden, &need));
    if (need > 0) {
        if (!a->workspace)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'workspace' is required: %lld float32 "
                           "elements (norm_backward_workspace_numel)", op, (long long)need);
        SF_TRY(sf_check_dtype(op, "workspace", a->workspace, SF_FLOAT32));
        SF_TRY(sf_check_contiguous(op, "workspace", a->workspace));
        SF_TRY(sf_check_writable(op, "workspace", a->workspace));
        SF_TRY(sf_check_same_device(op, "x", x, "workspace", a->workspace));
        if (sf_numel(a->workspace) < need)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'workspace' must have at least %lld "
                           "element(s), got %lld", op, (long long)need,
                           (long long)sf_numel(a->workspace));
    }
    {
        /* dx may be dres itself (each element is read before it is written, by the same thread) */
        const sf_mem_arg outs[] = {{"dx", a->dx, "dres"}, {"dgamma", a->dgamma, NULL}, {"dbeta", a->dbeta, NULL},
                                   {"workspace", a->workspace, NULL}};
        const sf_mem_arg ins[] = {{"dy", a->dy, NULL}, {"x", x, NULL}, {"mean", a->mean, NULL}, {"rstd", a->rstd, NULL},
                                  {"gamma", a->gamma, NULL}, {"dres", a->dres, NULL}};
        SF_TRY(sf_check_apart(op, outs, 4, ins, 6));
    }
    return SF_DISPATCH(op, "x", x, sf_norm_backward_cpu(a), sf_norm_backward_cuda(a, stream));
}

sf_status sf_layernorm_backward(const sf_tensor *dy, const sf_tensor *x,
                           const sf_tensor *mean, const sf_tensor *rstd,
                           const sf_tensor *gamma, int zero_centered_gamma,
                           sf_tensor *dx, sf_tensor *dgamma, sf_tensor *dbeta,
                           sf_tensor *workspace, const sf_tensor *dres, sf_stream stream)
{
    static const char op[] = "layernorm_backward";
    if (!mean)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'mean' is required", op);
    sf_norm_backward_args a = {.rms = 0, .zero_centered_gamma = zero_centered_gamma != 0, .dy = dy,
                          .x = x, .mean = mean, .rstd = rstd, .gamma = gamma, .dx = dx,
                          .dgamma = dgamma, .dbeta = dbeta, .workspace = workspace, .dres = dres};
    return norm_backward(op, &a, stream);
}

sf_status sf_rmsnorm_backward(const sf_tensor *dy, const sf_tensor *x,
                         const sf_tensor *rstd, const sf_tensor *gamma,
                         int zero_centered_gamma, sf_tensor *dx, sf_tensor *dgamma,
                         sf_tensor *workspace, const sf_tensor *dres, sf_stream stream)
{
    sf_norm_backward_args a = {.rms = 1, .zero_centered_gamma = zero_centered_gamma != 0, .dy = dy,
                          .x = x, .rstd = rstd, .gamma = gamma, .dx = dx, .dgamma = dgamma,
                          .workspace = workspace, .dres = dres};
    return norm_backward("rmsnorm_backward", &a, stream);
}
