/*
 * optim.c - the public entries of the multi-tensor ops (AdamW, l2 norm,
 * scale): every tensor of every list is validated once here (dtype, size,
 * contiguity, device, writability), with the list and the index named in the
 * message, then the CPU reference (optim_cpu.c) or the CUDA kernels
 * (optim_cuda.cu) run.
 *
 * File shape (README, Layout): the family's, with the math header named
 * after the one op that has arithmetic to share: adamw.h (the AdamW element
 * update and its per-step constants; the l2 norm and the scale are a sum of
 * squares and a multiply).  The standalone check is check_adamw.cu.
 */
#include <stdio.h>

#include "../core/dispatch.h"
#include "optim_backend.h"

/* "params[3]" style names for messages. */
static const char *item(char *buf, size_t size, const char *list, int64_t i)
{
    snprintf(buf, size, "%s[%lld]", list, (long long)i);
    return buf;
}

static sf_status check_item(const char *op, const char *name, const sf_tensor *t, const sf_tensor *first,
                            int writable)
{
    SF_TRY(sf_check_contiguous(op, name, t));
    if (writable)
        SF_TRY(sf_check_writable(op, name, t));
    return sf_check_same_device(op, "params[0]", first, name, t);
}

/* The indexed names ("params[3]") cost a formatting each, per tensor and
 * step: an entry's checks run first under the lists' bare names, and again
 * with the indexed ones only where one fails, for the message (the checks
 * are pure, so the second pass fails at the same one). */
#define SF_NAME(buf, list, i, named) ((named) ? item(buf, sizeof buf, list, i) : list)

static sf_status check_count(const char *op, int64_t n)
{
    if (n < 0)
        return sf_fail(SF_ERR_VALUE, "%s: the tensor count must be >= 0, got %lld", op, (long long)n);
    return SF_OK;
}

/* Parameter i's four (five) tensors against params[0]'s dtype pd, the
 * gradients' gd and the moments' md; ``named``: messages name "params[i]"
 * (else the bare list, on the quick pass). */
static sf_status check_adamw_entry(const char *op, int64_t i, int named, sf_tensor *params, const sf_tensor *grads,
                                   sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master, sf_dtype pd,
                                   sf_dtype gd, sf_dtype md)
{
    char np[64], ng[64], nm[64], nv[64], nw[64];
    const char *p_name = SF_NAME(np, "params", i, named), *g_name = SF_NAME(ng, "grads", i, named),
               *m_name = SF_NAME(nm, "exp_avg", i, named), *v_name = SF_NAME(nv, "exp_avg_sq", i, named),
               *w_name = SF_NAME(nw, "master", i, named);
    const int64_t numel = sf_numel(&params[i]);
    SF_TRY(sf_check_dtype(op, p_name, &params[i], pd));
    SF_TRY(check_item(op, p_name, &params[i], &params[0], 1));
    SF_TRY(sf_check_dtype(op, g_name, &grads[i], gd));
    SF_TRY(sf_check_numel(op, g_name, &grads[i], numel));
    SF_TRY(check_item(op, g_name, &grads[i], &params[0], 0));
    SF_TRY(sf_check_dtype(op, m_name, &exp_avg[i], md));
    SF_TRY(sf_check_numel(op, m_name, &exp_avg[i], numel));
    SF_TRY(check_item(op, m_name, &exp_avg[i], &params[0], 1));
    if (exp_avg_sq[i].dtype != md)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s (exp_avg's: both moment lists take one "
                       "dtype), got %s", op, v_name, sf_dtype_name(md), sf_dtype_name(exp_avg_sq[i].dtype));
    SF_TRY(sf_check_numel(op, v_name, &exp_avg_sq[i], numel));
    SF_TRY(check_item(op, v_name, &exp_avg_sq[i], &params[0], 1));
    if (master != NULL) {
        SF_TRY(sf_check_dtype(op, w_name, &master[i], SF_FLOAT32));
        SF_TRY(sf_check_numel(op, w_name, &master[i], numel));
        SF_TRY(check_item(op, w_name, &master[i], &params[0], 1));
    }
    /* the four (five) tensors of one parameter, each of its own memory (the kernel reads and writes them
     * element by element in one pass; a moment list passed twice would leave one moment in both) */
    sf_mem_arg outs[] = {{p_name, &params[i], NULL}, {m_name, &exp_avg[i], NULL}, {v_name, &exp_avg_sq[i], NULL},
                         {w_name, master ? &master[i] : NULL, NULL}};
    sf_mem_arg ins[] = {{g_name, &grads[i], NULL}};
    return sf_check_apart(op, outs, 4, ins, 1);
}

sf_status sf_multi_tensor_adamw(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                const sf_adamw_config *cfg, sf_stream stream)
{
    static const char op[] = "multi_tensor_adamw";
    SF_TRY(check_count(op, n));
    if (n == 0)
        return SF_OK;
    if (!(cfg->lr >= 0.0))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'lr' must be >= 0, got %g", op, cfg->lr);
    if (!(cfg->beta1 >= 0.0 && cfg->beta1 < 1.0) || !(cfg->beta2 >= 0.0 && cfg->beta2 < 1.0))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'betas' must lie in [0, 1), got (%g, %g)", op,
                       cfg->beta1, cfg->beta2);
    if (!(cfg->eps >= 0.0))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'eps' must be >= 0, got %g", op, cfg->eps);
    if (!(cfg->weight_decay >= 0.0))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'weight_decay' must be >= 0, got %g", op,
                       cfg->weight_decay);
    if (cfg->step < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'step' must be >= 1 (the count of this update), got %lld",
                       op, (long long)cfg->step);
    sf_dtype pd = params[0].dtype;
    SF_TRY(sf_check_float_input(op, "params[0]", &params[0]));
    /* gradients in the params' dtype, or float32 for 16-bit params (main_grad) */
    sf_dtype gd = grads[0].dtype;
    if (gd != pd && !(gd == SF_FLOAT32 && pd != SF_FLOAT32))
        return sf_fail(SF_ERR_TYPE, "%s: argument 'grads[0]' must have dtype %s (the params') or float32, got %s",
                       op, sf_dtype_name(pd), sf_dtype_name(gd));
    /* moments: all float32, or all bfloat16 (both lists one dtype) */
    sf_dtype md = exp_avg[0].dtype;
    if (md != SF_FLOAT32 && md != SF_BFLOAT16)
        return sf_fail(SF_ERR_TYPE, "%s: argument 'exp_avg[0]' must have dtype float32 or bfloat16, got %s",
                       op, sf_dtype_name(md));
    if (master != NULL && pd == SF_FLOAT32)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'master' is for fp16/bf16 params; params are float32", op);
    for (int64_t i = 0; i < n; ++i) {
        const sf_status st = check_adamw_entry(op, i, 0, params, grads, exp_avg, exp_avg_sq, master, pd, gd, md);
        if (st != SF_OK) {
            const sf_status named = check_adamw_entry(op, i, 1, params, grads, exp_avg, exp_avg_sq, master, pd,
                                                      gd, md);
            return named != SF_OK ? named : st;
        }
    }
    sf_adamw_consts k = sf_adamw_derive(cfg);
    return SF_DISPATCH(op, "params", &params[0],
                       sf_multi_tensor_adamw_cpu(n, params, grads, exp_avg, exp_avg_sq, master, &k),
                       sf_multi_tensor_adamw_cuda(n, params, grads, exp_avg, exp_avg_sq, master,
                                                  &k, stream));
}

int64_t sf_multi_tensor_l2norm_workspace(int64_t n, const sf_tensor *tensors)
{
    int64_t chunks = 0;
    for (int64_t i = 0; i < n; ++i)
        chunks += (sf_numel(&tensors[i]) + SF_MT_CHUNK - 1) / SF_MT_CHUNK;
    return chunks > 0 ? chunks : 1;
}

static sf_status check_list_item(const char *op, const char *list, int64_t i, int named, const sf_tensor *t,
                                 int writable)
{
    char buf[64];
    const char *name = SF_NAME(buf, list, i, named);
    SF_TRY(sf_check_float_input(op, name, &t[i]));
    SF_TRY(sf_check_contiguous(op, name, &t[i]));
    if (writable)
        SF_TRY(sf_check_writable(op, name, &t[i]));
    if (t[i].device != t[0].device || t[i].device_id != t[0].device_id)
        return sf_fail(SF_ERR_VALUE, "%s: arguments '%s[0]' and '%s' must be on the same device", op, list, name);
    return SF_OK;
}

static sf_status check_list(const char *op, const char *list, int64_t n, const sf_tensor *t,
                            int writable)
{
    for (int64_t i = 0; i < n; ++i) {
        const sf_status st = check_list_item(op, list, i, 0, t, writable);
        if (st != SF_OK) {
            const sf_status named = check_list_item(op, list, i, 1, t, writable);
            return named != SF_OK ? named : st;
        }
    }
    return SF_OK;
}

sf_status sf_multi_tensor_l2norm(int64_t n, const sf_tensor *tensors, sf_tensor *workspace,
                                 sf_tensor *out, sf_stream stream)
{
    static const char op[] = "multi_tensor_l2norm";
    SF_TRY(check_count(op, n));
    SF_TRY(check_list(op, "tensors", n, tensors, 0));
    SF_TRY(sf_check_dtype(op, "out", out, SF_FLOAT32));
    SF_TRY(sf_check_numel(op, "out", out, 1));
    SF_TRY(sf_check_writable(op, "out", out));
    if (n > 0)
        SF_TRY(sf_check_same_device(op, "tensors[0]", &tensors[0], "out", out));
    if (out->device == SF_CPU)
        return sf_multi_tensor_l2norm_cpu(n, tensors, out);
    SF_TRY(sf_check_dtype(op, "workspace", workspace, SF_FLOAT32));
    SF_TRY(sf_check_contiguous(op, "workspace", workspace));
    SF_TRY(sf_check_writable(op, "workspace", workspace));
    SF_TRY(sf_check_same_device(op, "out", out, "workspace", workspace));
    int64_t need = sf_multi_tensor_l2norm_workspace(n, tensors);
    if (sf_numel(workspace) < need)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'workspace' must hold at least %lld floats (one per "
                       "%d-element chunk), got %lld", op, (long long)need, SF_MT_CHUNK,
                       (long long)sf_numel(workspace));
    return SF_IF_CUDA(op, "out", sf_multi_tensor_l2norm_cuda(n, tensors, workspace, out, stream));
}

sf_status sf_multi_tensor_scale(int64_t n, sf_tensor *tensors, const sf_tensor *scale,
                                sf_stream stream)
{
    static const char op[] = "multi_tensor_scale";
    SF_TRY(check_count(op, n));
    SF_TRY(check_list(op, "tensors", n, tensors, 1));
    SF_TRY(sf_check_dtype(op, "scale", scale, SF_FLOAT32));
    SF_TRY(sf_check_numel(op, "scale", scale, 1));
    if (n == 0)
        return SF_OK;
    SF_TRY(sf_check_same_device(op, "tensors[0]", &tensors[0], "scale", scale));
    return SF_DISPATCH(op, "scale", scale, sf_multi_tensor_scale_cpu(n, tensors, scale),
                       sf_multi_tensor_scale_cuda(n, tensors, scale, stream));
}
