/*
 * cast.c - public entries of the per-tensor FP8 family: sf_cast_fp8 (scale +
 * cast + transpose + amax), sf_dequantize_fp8, and the scaling-state kernels
 * sf_fp8_scale_update (delayed scaling) and sf_fp8_compute_scale (current
 * scaling).  Every precondition is checked here once; the CPU reference
 * (cast_cpu.c) and the CUDA kernels (cast_cuda.cu) trust what they get.
 *
 * File shape (README, Layout): the quant family has three entries, each
 * with its _cpu.c reference and _cuda.cu kernels: amax.c, cast.c (this
 * file) and block.c.  Their shared math is the number formats' arithmetic,
 * fp8.h (E4M3, E5M2, E8M0, E2M1, scale computation, amax folding);
 * fp8_cuda.cuh adds the device-only pieces (16-byte loads, the hardware FP8
 * conversion, the block-wide max).  The backend entry points of cast and block are cast_backend.h's,
 * amax's amax_backend.h's.  Standalone checks: check_amax.cu,
 * check_cast.cu and check_block.cu.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/dispatch.h"
#include "cast_backend.h"

sf_status sf_quant_check_fp8(const char *op, const char *arg, const sf_tensor *t)
{
    if (t->dtype != SF_FLOAT8_E4M3 && t->dtype != SF_FLOAT8_E5M2)
        return sf_fail(SF_ERR_TYPE,
                       "%s: argument '%s' must have dtype float8_e4m3fn or float8_e5m2, got %s",
                       op, arg, sf_dtype_name(t->dtype));
    return SF_OK;
}

sf_status sf_quant_check_scalar(const char *op, const char *arg, const sf_tensor *t,
                                const sf_tensor *x, int written)
{
    return sf_check_vector(op, arg, t, SF_FLOAT32, 1, "x", x, written);
}

/* Where a transposed FP8 output lives: contiguous, writable, on the device
 * of the input `ref` (named ref_arg).  Its shape rule is the caller's. */
static sf_status check_out_t_storage(const char *op, const sf_tensor *out_t, const char *ref_arg,
                                     const sf_tensor *ref)
{
    SF_TRY(sf_check_contiguous(op, "out_t", out_t));
    SF_TRY(sf_check_writable(op, "out_t", out_t));
    return sf_check_same_device(op, ref_arg, ref, "out_t", out_t);
}

/* The checks of sf_cast_fp8, sf_cast_fp8_dbias (col_sums NULL for the
 * others) and sf_cast_fp8_current, and the problem they describe.  The
 * overlap check (sf_check_apart) is each entry's own, once: current scaling
 * writes amax and scale, which the others read. */
static sf_status cast_prepare(const char *op, const sf_tensor *x, const sf_tensor *scale,
                              sf_tensor *amax, sf_tensor *out, sf_tensor *out_t,
                              sf_tensor *scale_inv, sf_tensor *col_sums, sf_cast_args *args)
{
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_contiguous(op, "x", x));
    SF_TRY(sf_quant_check_scalar(op, "scale", scale, x, 0));
    if (amax)
        SF_TRY(sf_quant_check_scalar(op, "amax", amax, x, 1));
    if (scale_inv)
        SF_TRY(sf_quant_check_scalar(op, "scale_inv", scale_inv, x, 1));
    if (!out && !out_t)
        return sf_fail(SF_ERR_VALUE, "%s: at least one of 'out' and 'out_t' must be given", op);

    int64_t n = sf_numel(x);
    int64_t k = x->ndim == 0 ? 1 : x->shape[x->ndim - 1];
    int64_t m = k == 0 ? 0 : n / k;
    /* the outputs' rows: M, or Mp > M (token padding, written as zeros) */
    int64_t mp = m;
    if (out_t && out_t->ndim == 2 && out_t->shape[0] == k && out_t->shape[1] > m)
        mp = out_t->shape[1];
    else if (!out_t && out && out->ndim == 2 && x->ndim >= 1 && out->shape[1] == k && out->shape[0] > m)
        mp = out->shape[0];
    if (out) {
        SF_TRY(sf_quant_check_fp8(op, "out", out));
        SF_TRY(sf_check_contiguous(op, "out", out));
        SF_TRY(sf_check_writable(op, "out", out));
        SF_TRY(sf_check_same_device(op, "x", x, "out", out));
        if (mp == m)
            SF_TRY(sf_check_numel(op, "out", out, n));
        else if (out->ndim != 2 || out->shape[0] != mp || out->shape[1] != k)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument 'out' must have x's %lld elements or shape [%lld, %lld] "
                           "(the padded rows of out_t), got %lld elements",
                           op, (long long)n, (long long)mp, (long long)k, (long long)sf_numel(out));
    }
    if (out_t) {
        SF_TRY(sf_quant_check_fp8(op, "out_t", out_t));
        if (x->ndim < 1)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must have at least 1 dimension "
                           "for a transposed output", op);
        if (out_t->ndim != 2 || out_t->shape[0] != k || out_t->shape[1] < m)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument 'out_t' must have shape [%lld, Mp] with Mp >= %lld (x "
                           "viewed as [M, K] = [%lld, %lld], transposed; columns M.. are zero "
                           "padding)",
                           op, (long long)k, (long long)m, (long long)m, (long long)k);
        SF_TRY(check_out_t_storage(op, out_t, "x", x));
        if (out && out->dtype != out_t->dtype)
            return sf_fail(SF_ERR_TYPE, "%s: arguments 'out' (%s) and 'out_t' (%s) must have "
                           "the same FP8 dtype",
                           op, sf_dtype_name(out->dtype), sf_dtype_name(out_t->dtype));
    }
    if (col_sums) {
        if (!out_t)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'out_t' must be given (the column sums "
                           "come from the cast+transpose kernel)", op);
        if (k % 8 || mp % 16)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'x' viewed as [M, K] = [%lld, %lld] must "
                           "have K %% 8 == 0 and M %% 16 == 0, M counting the outputs' %lld "
                           "padded rows (the tiled kernel's rule)",
                           op, (long long)m, (long long)k, (long long)mp);
        if (x->device != SF_CPU && (uintptr_t)x->data % 16)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must be 16-byte aligned", op);
        if (x->device != SF_CPU && (uintptr_t)out_t->data % 16)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'out_t' must be 16-byte aligned", op);
        if (x->device != SF_CPU && out && (uintptr_t)out->data % 8)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'out' must be 8-byte aligned", op);
        SF_TRY(sf_check_dtype(op, "col_sums", col_sums, SF_FLOAT32));
        int64_t blocks = (mp + 127) / 128;
        if (col_sums->ndim != 2 || col_sums->shape[0] != blocks || col_sums->shape[1] != k)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'col_sums' must have shape [%lld, %lld] "
                           "(one row per 128 rows of the outputs)", op, (long long)blocks,
                           (long long)k);
        SF_TRY(sf_check_contiguous(op, "col_sums", col_sums));
        SF_TRY(sf_check_writable(op, "col_sums", col_sums));
        SF_TRY(sf_check_same_device(op, "x", x, "col_sums", col_sums));
    }
    sf_cast_args *a = args;
    a->x = x->data;
    a->x_dtype = x->dtype;
    a->m = m;
    a->k = k;
    a->mp = mp;
    a->ld_t = mp;
    a->scale = (const float *)scale->data;
    a->amax = amax ? (float *)amax->data : NULL;
    a->out = out ? (uint8_t *)out->data : NULL;
    a->out_t = out_t ? (uint8_t *)out_t->data : NULL;
    a->scale_inv = scale_inv ? (float *)scale_inv->data : NULL;
    a->e5m2 = (out ? out->dtype : out_t->dtype) == SF_FLOAT8_E5M2;
    a->col_sums = col_sums ? (float *)col_sums->data : NULL;
    return SF_OK;
}

static sf_status cast_run(const char *op, const sf_cast_args *a, const sf_tensor *x,
                          sf_stream stream)
{
    return SF_DISPATCH(op, "x", x, sf_cast_fp8_cpu(a), sf_cast_fp8_cuda(a, x->device_id, stream));
}

sf_status sf_quant_check_column_sums(const char *op, const char *sums_arg, const sf_tensor *col_sums,
                                     const char *out_arg, const sf_tensor *out)
{
    SF_TRY(sf_check_dtype(op, sums_arg, col_sums, SF_FLOAT32));
    if (col_sums->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D [P, N], got %d-D", op, sums_arg,
                       (int)col_sums->ndim);
    SF_TRY(sf_check_contiguous(op, sums_arg, col_sums));
    int64_t parts = col_sums->shape[0], n = col_sums->shape[1];
    if (parts > 0x7fffffff || n > 0x7fffffff)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have fewer than 2^31 rows and columns, "
                       "got [%lld, %lld]", op, sums_arg, (long long)parts, (long long)n);
    SF_TRY(sf_check_float_input(op, out_arg, out));
    SF_TRY(sf_check_numel(op, out_arg, out, n));
    SF_TRY(sf_check_contiguous(op, out_arg, out));
    SF_TRY(sf_check_same_device(op, sums_arg, col_sums, out_arg, out));
    return sf_check_writable(op, out_arg, out);
}

sf_status sf_quant_column_sums_run(const char *op, const sf_tensor *col_sums, sf_tensor *out,
                                   sf_stream stream)
{
    const int64_t parts = col_sums->shape[0], n = col_sums->shape[1];
    return SF_DISPATCH(op, "col_sums", col_sums,
                       sf_column_sums_cpu((const float *)col_sums->data, parts, n, out->data, out->dtype),
                       sf_column_sums_cuda((const float *)col_sums->data, parts, n, out->data, out->dtype,
                                           col_sums->device_id, stream));
}

/* sf_cast_fp8 and sf_cast_fp8_dbias: the checks, then the cast, then (dbias
 * given) the column sums' total. */
static sf_status cast_entry(const char *op, const sf_tensor *x, const sf_tensor *scale,
                            sf_tensor *amax, sf_tensor *out, sf_tensor *out_t,
                            sf_tensor *scale_inv, sf_tensor *col_sums, sf_tensor *dbias,
                            sf_stream stream)
{
    sf_cast_args a;
    SF_TRY(cast_prepare(op, x, scale, amax, out, out_t, scale_inv, col_sums, &a));
    if (dbias)
        SF_TRY(sf_quant_check_column_sums(op, "col_sums", col_sums, "dbias", dbias));
    /* (sf_cast_fp8_current checks its own roles, amax and scale among the outputs) */
    const sf_mem_arg outs[] = {{"out", out, NULL},       {"out_t", out_t, NULL},
                               {"amax", amax, NULL},     {"scale_inv", scale_inv, NULL},
                               {"col_sums", col_sums, NULL}, {"dbias", dbias, NULL}};
    const sf_mem_arg ins[] = {{"x", x, NULL}, {"scale", scale, NULL}};
    SF_TRY(sf_check_apart(op, outs, 6, ins, 2));
    SF_TRY(cast_run(op, &a, x, stream));
    return dbias ? sf_quant_column_sums_run(op, col_sums, dbias, stream) : SF_OK;
}

sf_status sf_cast_fp8(const sf_tensor *x, const sf_tensor *scale, sf_tensor *amax,
                      sf_tensor *out, sf_tensor *out_t, sf_tensor *scale_inv,
                      sf_stream stream)
{
    return cast_entry("cast_fp8", x, scale, amax, out, out_t, scale_inv, NULL, NULL, stream);
}

sf_status sf_cast_fp8_dbias(const sf_tensor *x, const sf_tensor *scale, sf_tensor *amax,
                            sf_tensor *out, sf_tensor *out_t, sf_tensor *scale_inv,
                            sf_tensor *col_sums, sf_tensor *dbias, sf_stream stream)
{
    if (!col_sums)
        return sf_fail(SF_ERR_VALUE, "cast_fp8_dbias: argument 'col_sums' must be given");
    return cast_entry("cast_fp8_dbias", x, scale, amax, out, out_t, scale_inv, col_sums, dbias, stream);
}

sf_status sf_column_sums(const sf_tensor *col_sums, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "column_sums";
    SF_TRY(sf_quant_check_column_sums(op, "col_sums", col_sums, "out", out));
    const sf_mem_arg outs[] = {{"out", out, NULL}};
    const sf_mem_arg ins[] = {{"col_sums", col_sums, NULL}};
    SF_TRY(sf_check_apart(op, outs, 1, ins, 1));
    return sf_quant_column_sums_run(op, col_sums, out, stream);
}

/* A float32 vector of n elements with any positive element stride (one
 * role's slots of a ScalingState are every third column), on ref's device. */
static sf_status check_strided_vector(const char *op, const char *arg, const sf_tensor *t,
                                      int64_t n, const char *ref_arg, const sf_tensor *ref,
                                      int written)
{
    SF_TRY(sf_check_dtype(op, arg, t, SF_FLOAT32));
    if (t->ndim != 1 || t->shape[0] != n || (n > 1 && t->strides[0] < 1))
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be a 1-D float32 tensor of %lld "
                       "elements (one per group; any positive stride)", op, arg, (long long)n);
    SF_TRY(sf_check_same_device(op, ref_arg, ref, arg, t));
    return written ? sf_check_writable(op, arg, t) : SF_OK;
}

static int64_t vector_stride(const sf_tensor *t) { return t->shape[0] > 1 ? t->strides[0] : 1; }

static sf_status check_margin(const char *op, int margin, float *pow2);

/* The most groups one grouped cast takes (host arrays of this many entries). */
#define SF_CAST_MAX_GROUPS (1 << 20)

/* An FP8 output of a grouped cast: `rows` x `cols`, contiguous, writable,
 * 16-byte aligned off the CPU, on ref's device. */
static sf_status check_grouped_out(const char *op, const char *arg, const sf_tensor *o, int64_t rows,
                                   int64_t cols, const char *ref_arg, const sf_tensor *ref,
                                   const char *rule)
{
    SF_TRY(sf_quant_check_fp8(op, arg, o));
    SF_TRY(sf_check_contiguous(op, arg, o));
    SF_TRY(sf_check_writable(op, arg, o));
    SF_TRY(sf_check_same_device(op, ref_arg, ref, arg, o));
    if (o->ndim != 2 || o->shape[0] != rows || o->shape[1] != cols)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [%lld, %lld] (%s)", op, arg,
                       (long long)rows, (long long)cols, rule);
    if (o->device != SF_CPU && (uintptr_t)o->data % 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 16-byte aligned", op, arg);
    return SF_OK;
}

/* What the grouped entries share once their groups are laid out in `a`:
 * the scaling vectors' checks and their fields of `a`, the FP8 format. */
static sf_status grouped_scaling(const char *op, const char *ref_arg, const sf_tensor *ref,
                                 sf_cast_grouped_args *a, sf_tensor *scale, sf_tensor *amax,
                                 sf_tensor *scale_inv, sf_dtype fp8, int current, int margin)
{
    const int64_t G = a->groups;
    SF_TRY(check_strided_vector(op, "scale", scale, G, ref_arg, ref, current));
    SF_TRY(check_strided_vector(op, "scale_inv", scale_inv, G, ref_arg, ref, 1));
    if (amax)
        SF_TRY(check_strided_vector(op, "amax", amax, G, ref_arg, ref, 1));
    else if (current)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'amax' must be given under current scaling "
                       "(it receives each group's max |x|)", op);
    {
        /* (one state's roles are every third column of its chunk: interleaved vectors, apart) */
        const sf_mem_arg outs[] = {{"scale_inv", scale_inv, NULL}, {"amax", amax, NULL},
                                   {"scale", current ? scale : NULL, NULL}};
        const sf_mem_arg ins[] = {{"scale", current ? NULL : scale, NULL}, {ref_arg, ref, NULL}};
        SF_TRY(sf_check_apart(op, outs, 3, ins, 2));
    }
    float pow2_neg_margin = 1.0f; /* check_margin sets it */
    SF_TRY(check_margin(op, margin, &pow2_neg_margin));
    a->scale = (float *)scale->data;
    a->amax = amax ? (float *)amax->data : NULL;
    a->scale_inv = (float *)scale_inv->data;
    a->scale_stride = vector_stride(scale);
    a->amax_stride = amax ? vector_stride(amax) : 0;
    a->scale_inv_stride = vector_stride(scale_inv);
    a->e5m2 = fp8 == SF_FLOAT8_E5M2;
    a->current = current != 0;
    a->fp8_max = a->e5m2 ? 57344.0f : 448.0f;
    a->pow2_neg_margin = pow2_neg_margin;
    return SF_OK;
}

/* grouped_scaling, then the host-count grouped cast on ref's device. */
static sf_status grouped_run(const char *op, const char *ref_arg, const sf_tensor *ref,
                             sf_cast_grouped_args *a, sf_tensor *scale, sf_tensor *amax,
                             sf_tensor *scale_inv, sf_dtype fp8, int current, int margin,
                             sf_stream stream)
{
    SF_TRY(grouped_scaling(op, ref_arg, ref, a, scale, amax, scale_inv, fp8, current, margin));
    return SF_DISPATCH(op, ref_arg, ref, sf_cast_fp8_grouped_cpu(a),
                       sf_cast_fp8_grouped_cuda(a, ref->device_id, stream));
}

/* Host arrays of a grouped cast's layout: x, out, out_t, probs pointers and m, mp,
 * ld_t counts of G groups, in one allocation (freed by the caller). */
typedef struct {
    const void **x, **probs;
    uint8_t **out, **out_t;
    int64_t *m, *mp, *ld_t;
} grouped_layout;

static sf_status layout_alloc(const char *op, int64_t G, grouped_layout *l, void **block)
{
    *block = malloc((size_t)G * 7 * sizeof(int64_t));
    if (!*block)
        return sf_fail(SF_ERR_RUNTIME, "%s: out of host memory for %lld groups", op, (long long)G);
    char *p = (char *)*block;
    size_t step = (size_t)G * sizeof(int64_t);
    l->x = (const void **)p;
    l->out = (uint8_t **)(p + step);
    l->out_t = (uint8_t **)(p + 2 * step);
    l->m = (int64_t *)(p + 3 * step);
    l->mp = (int64_t *)(p + 4 * step);
    l->ld_t = (int64_t *)(p + 5 * step);
    l->probs = (const void **)(p + 6 * step);
    return SF_OK;
}

/* The grouped casts' rows x (swiglu = 1: gate|up pairs of 2K values) and
 * their probs (or NULL): a contiguous float 2-D tensor with K a multiple of
 * 16, 16-byte aligned off the CPU; probs 1-D, one per row, on x's device.
 * *m and *k receive the rows and K. */
static sf_status check_grouped_rows(const char *op, const sf_tensor *x, int swiglu, const sf_tensor *probs,
                                    int64_t *m, int64_t *k)
{
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_contiguous(op, "x", x));
    if (x->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must be 2-D [M, %s] (the tokens in group "
                       "order), got %d dimensions", op, swiglu ? "2K" : "K", x->ndim);
    *m = x->shape[0];
    *k = swiglu ? x->shape[1] / 2 : x->shape[1];
    if (swiglu && x->shape[1] % 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must have an even last dimension (gate and up "
                       "halves), got %lld", op, (long long)x->shape[1]);
    if (*k % 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must have K (%s) a multiple of 16 (the FP8 "
                       "GEMMs' rule), got %lld", op, swiglu ? "half its last dimension" : "its last dimension",
                       (long long)*k);
    if (x->device != SF_CPU && (uintptr_t)x->data % 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' must be 16-byte aligned", op);
    if (probs && !swiglu)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'probs' (the SwiGLU's row scales) goes with the SwiGLU "
                       "form", op);
    if (probs) {
        SF_TRY(sf_check_float_input(op, "probs", probs));
        SF_TRY(sf_check_same_device(op, "x", x, "probs", probs));
        if (probs->ndim != 1 || probs->shape[0] != *m || !sf_is_contiguous(probs))
            return sf_fail(SF_ERR_VALUE, "%s: argument 'probs' must be a contiguous 1-D tensor of one "
                           "entry per row of x (%lld)", op, (long long)*m);
    }
    return SF_OK;
}

/* m rows padded to the next multiple of row_multiple (the FP8 GEMMs' token blocks). */
static int64_t padded_rows(int64_t m, int row_multiple)
{
    return (m + row_multiple - 1) / row_multiple * row_multiple;
}

/* The host row counts of a grouped entry: m_splits a contiguous 1-D int64
 * CPU tensor of 1 to SF_CAST_MAX_GROUPS non-negative counts adding up to
 * the m_total rows of x; row_multiple a positive multiple of 16.  *G and
 * *padded receive the group count and the padded counts' sum. */
static sf_status check_splits(const char *op, const sf_tensor *m_splits, int64_t m_total, int row_multiple,
                              int64_t *G_out, int64_t *padded_out)
{
    SF_TRY(sf_check_dtype(op, "m_splits", m_splits, SF_INT64));
    if (m_splits->device != SF_CPU || m_splits->ndim != 1 || !sf_is_contiguous(m_splits))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' must be a contiguous 1-D int64 CPU "
                       "tensor (the host row counts)", op);
    const int64_t G = m_splits->shape[0];
    if (G < 1 || G > SF_CAST_MAX_GROUPS)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' must hold 1 to %d row counts, got "
                       "%lld", op, SF_CAST_MAX_GROUPS, (long long)G);
    if (row_multiple < 16 || row_multiple % 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_multiple' must be a positive multiple of "
                       "16 (the FP8 GEMMs' token granularity), got %d", op, row_multiple);
    const int64_t *splits = (const int64_t *)m_splits->data;
    int64_t rows = 0, padded = 0;
    for (int64_t g = 0; g < G; ++g) {
        if (splits[g] < 0 || splits[g] > m_total - rows)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' must hold non-negative row "
                           "counts adding up to the %lld rows of 'x' (group %lld: %lld after %lld rows)",
                           op, (long long)m_total, (long long)g, (long long)splits[g],
                           (long long)rows);
        rows += splits[g];
        padded += padded_rows(splits[g], row_multiple);
    }
    if (rows != m_total)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' adds up to %lld rows but 'x' has %lld",
                       op, (long long)rows, (long long)m_total);
    *G_out = G;
    *padded_out = padded;
    return SF_OK;
}

/* sf_cast_fp8_grouped (swiglu = 0: x holds the values cast) and
 * sf_swiglu_cast_fp8_grouped (swiglu = 1: each row of x is a gate|up pair of
 * 2K values, probs (or NULL) the rows' scales). */
static sf_status cast_grouped_rows(const char *op, const sf_tensor *x, int swiglu, const sf_tensor *probs,
                                   const sf_tensor *m_splits, int row_multiple, sf_tensor *scale,
                                   sf_tensor *amax, sf_tensor *out, sf_tensor *out_t,
                                   sf_tensor *scale_inv, int current, int margin, sf_stream stream)
{
    int64_t m_total, k;
    SF_TRY(check_grouped_rows(op, x, swiglu, probs, &m_total, &k));
    int64_t G, padded;
    SF_TRY(check_splits(op, m_splits, m_total, row_multiple, &G, &padded));
    if (!out && !out_t)
        return sf_fail(SF_ERR_VALUE, "%s: at least one of 'out' and 'out_t' must be given", op);
    const int64_t *splits = (const int64_t *)m_splits->data;
    static const char rule[] = "every group's rows padded to a multiple of row_multiple";
    if (out)
        SF_TRY(check_grouped_out(op, "out", out, padded, k, "x", x, rule));
    if (out_t)
        SF_TRY(check_grouped_out(op, "out_t", out_t, k, padded, "x", x, rule));
    if (out && out_t && out->dtype != out_t->dtype)
        return sf_fail(SF_ERR_TYPE, "%s: arguments 'out' (%s) and 'out_t' (%s) must have the same "
                       "FP8 dtype", op, sf_dtype_name(out->dtype), sf_dtype_name(out_t->dtype));
    {
        const sf_mem_arg outs[] = {{"out", out, NULL}, {"out_t", out_t, NULL}};
        const sf_mem_arg ins[] = {{"x", x, NULL}, {"probs", probs, NULL}, {"m_splits", m_splits, NULL},
                                  {"scale", scale, NULL}, {"amax", amax, NULL}, {"scale_inv", scale_inv, NULL}};
        SF_TRY(sf_check_apart(op, outs, 2, ins, 6));
    }

    void *block = NULL;
    grouped_layout l;
    SF_TRY(layout_alloc(op, G, &l, &block));
    const size_t esize = sf_dtype_size(x->dtype), row = (size_t)(swiglu ? 2 * k : k);
    const size_t psize = probs ? sf_dtype_size(probs->dtype) : 0;
    int64_t r = 0, p = 0;
    for (int64_t g = 0; g < G; ++g) {
        l.m[g] = splits[g];
        l.mp[g] = padded_rows(splits[g], row_multiple);
        l.ld_t[g] = padded;
        l.x[g] = (const char *)x->data + (size_t)r * row * esize;
        l.probs[g] = probs ? (const char *)probs->data + (size_t)r * psize : NULL;
        l.out[g] = out ? (uint8_t *)out->data + p * k : NULL;
        l.out_t[g] = out_t ? (uint8_t *)out_t->data + p : NULL;
        r += l.m[g];
        p += l.mp[g];
    }
    sf_cast_grouped_args a = {.x_dtype = x->dtype, .k = k, .groups = G, .x = l.x,
                              .out = out ? l.out : NULL, .out_t = out_t ? l.out_t : NULL,
                              .m = l.m, .mp = l.mp, .ld_t = l.ld_t, .swiglu = swiglu,
                              .probs = probs ? l.probs : NULL,
                              .probs_dtype = probs ? probs->dtype : SF_FLOAT32};
    sf_status st = grouped_run(op, "x", x, &a, scale, amax, scale_inv, (out ? out : out_t)->dtype,
                               current, margin, stream);
    free(block);
    return st;
}

sf_status sf_cast_fp8_grouped(const sf_tensor *x, const sf_tensor *m_splits, int row_multiple,
                              sf_tensor *scale, sf_tensor *amax, sf_tensor *out, sf_tensor *out_t,
                              sf_tensor *scale_inv, int current, int margin, sf_stream stream)
{
    return cast_grouped_rows("cast_fp8_grouped", x, 0, NULL, m_splits, row_multiple, scale, amax, out,
                             out_t, scale_inv, current, margin, stream);
}

sf_status sf_swiglu_cast_fp8_grouped(const sf_tensor *x, const sf_tensor *probs, const sf_tensor *m_splits,
                                     int row_multiple, sf_tensor *scale, sf_tensor *amax, sf_tensor *out,
                                     sf_tensor *out_t, sf_tensor *scale_inv, int current, int margin,
                                     sf_stream stream)
{
    return cast_grouped_rows("swiglu_cast_fp8_grouped", x, 1, probs, m_splits, row_multiple, scale, amax,
                             out, out_t, scale_inv, current, margin, stream);
}

/* ---- the SwiGLU's backward over padded blocks (sf_swiglu_backward_cast_fp8_grouped) ----
 *
 * The backward of a mixture-of-experts MLP's down projection under FP8
 * needs from the gate|up pairs it saved: the SwiGLU's gradient (dx,
 * dprobs) from the input gradient the grouped GEMM wrote in padded row
 * blocks; for the weight gradient, the SwiGLU's value cast to FP8 and
 * transposed with the scales the forward's cast used; and, for the gate-up
 * layer's backward, dx's own FP8 copies.  One pass reads the pairs once for
 * all of them and reads the padded blocks where they lie (no copy of the
 * real rows first).  On the CPU it is the reference ops: group by group
 * sf_moe_swiglu_backward, then sf_swiglu_cast_fp8_grouped and
 * sf_cast_fp8_grouped of dx. */

/* Rows r0 .. r0 + n - 1 of a contiguous 2-D or 1-D tensor, as a view. */
static sf_tensor row_view(const sf_tensor *t, int64_t r0, int64_t n)
{
    sf_tensor v = *t;
    v.data = (char *)t->data + (size_t)(r0 * (t->ndim == 2 ? t->shape[1] : 1)) * sf_dtype_size(t->dtype);
    v.shape[0] = n;
    return v;
}

/* A dense operand of the fused backward: x's dtype, contiguous, 2-D
 * [rows, cols] (rows_alt: a second row count allowed, 0: none), on x's device,
 * 16-byte aligned off the CPU; `written`: an output. */
static sf_status check_backward_dense(const char *op, const char *arg, const sf_tensor *t, int64_t rows,
                                 int64_t rows_alt, int64_t cols, const sf_tensor *x, int written)
{
    SF_TRY(sf_check_float_input(op, arg, t));
    SF_TRY(sf_check_dtype(op, arg, t, x->dtype));
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_device(op, "x", x, arg, t));
    if (written)
        SF_TRY(sf_check_writable(op, arg, t));
    if (t->ndim != 2 || (t->shape[0] != rows && t->shape[0] != rows_alt) || t->shape[1] != cols) {
        if (rows_alt && rows_alt != rows)
            return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [%lld, %lld] (the real rows) or "
                           "[%lld, %lld] (every group's rows padded to row_multiple)", op, arg, (long long)rows,
                           (long long)cols, (long long)rows_alt, (long long)cols);
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [%lld, %lld]", op, arg, (long long)rows,
                       (long long)cols);
    }
    if (t->device != SF_CPU && (uintptr_t)t->data % 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 16-byte aligned", op, arg);
    return SF_OK;
}

/* The CPU path of sf_swiglu_backward_cast_fp8_grouped: the reference ops group by group. */
static sf_status swiglu_backward_cpu(const sf_tensor *dout, const sf_tensor *x, const sf_tensor *probs,
                                     const int64_t *splits, int64_t G, int row_multiple, int dout_padded,
                                     sf_tensor *dx, sf_tensor *dprobs, sf_tensor *scale, sf_tensor *out_t,
                                     sf_tensor *scale_inv, sf_tensor *grad_scale, sf_tensor *grad_amax,
                                     sf_tensor *grad_out, sf_tensor *grad_out_t, sf_tensor *grad_scale_inv,
                                     const sf_tensor *m_splits, sf_stream stream)
{
    int64_t r = 0, p = 0;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t mg = splits[g];
        if (mg) {
            sf_tensor dout_g = row_view(dout, dout_padded ? p : r, mg), x_g = row_view(x, r, mg);
            sf_tensor dx_g = row_view(dx, r, mg), probs_g, dprobs_g;
            if (probs)
                probs_g = row_view(probs, r, mg);
            if (dprobs)
                dprobs_g = row_view(dprobs, r, mg);
            SF_TRY(sf_moe_swiglu_backward(&dout_g, &x_g, probs ? &probs_g : NULL, &dx_g,
                                          dprobs ? &dprobs_g : NULL, stream));
        }
        r += mg;
        p += padded_rows(mg, row_multiple);
    }
    if (out_t)
        SF_TRY(sf_swiglu_cast_fp8_grouped(x, probs, m_splits, row_multiple, scale, NULL, NULL, out_t, scale_inv,
                                          0, 0, stream));
    if (grad_scale)
        SF_TRY(sf_cast_fp8_grouped(dx, m_splits, row_multiple, grad_scale, grad_amax, grad_out, grad_out_t,
                                   grad_scale_inv, 0, 0, stream));
    return SF_OK;
}

sf_status sf_swiglu_backward_cast_fp8_grouped(const sf_tensor *dout, const sf_tensor *x, const sf_tensor *probs,
                                              const sf_tensor *m_splits, int row_multiple, sf_tensor *dx,
                                              sf_tensor *dprobs, sf_tensor *scale, sf_tensor *out_t,
                                              sf_tensor *scale_inv, sf_tensor *grad_scale, sf_tensor *grad_amax,
                                              sf_tensor *grad_out, sf_tensor *grad_out_t, sf_tensor *grad_scale_inv,
                                              sf_stream stream)
{
    static const char op[] = "swiglu_backward_cast_fp8_grouped";
    int64_t m, k, G, padded;
    SF_TRY(check_grouped_rows(op, x, 1, probs, &m, &k));
    SF_TRY(check_splits(op, m_splits, m, row_multiple, &G, &padded));
    SF_TRY(check_backward_dense(op, "dout", dout, m, padded, k, x, 0));
    if (dx)
        SF_TRY(check_backward_dense(op, "dx", dx, m, 0, 2 * k, x, 1));
    if (dprobs) {
        if (!probs)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'dprobs' goes with 'probs'", op);
        SF_TRY(sf_check_float_input(op, "dprobs", dprobs));
        SF_TRY(sf_check_contiguous(op, "dprobs", dprobs));
        SF_TRY(sf_check_writable(op, "dprobs", dprobs));
        SF_TRY(sf_check_same_device(op, "x", x, "dprobs", dprobs));
        if (dprobs->ndim != 1 || dprobs->shape[0] != m)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'dprobs' must be 1-D with one entry per row of x (%lld)",
                           op, (long long)m);
    }
    if (!out_t != !scale || !out_t != !scale_inv)
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'out_t', 'scale' and 'scale_inv' go together (the "
                       "SwiGLU's value cast for the weight gradient), or all three are left out", op);
    static const char rule[] = "every group's rows padded to a multiple of row_multiple";
    if (out_t)
        SF_TRY(check_grouped_out(op, "out_t", out_t, k, padded, "x", x, rule));
    const int grad = grad_scale || grad_amax || grad_out || grad_out_t || grad_scale_inv;
    if (grad) {
        if (!grad_scale || !grad_scale_inv || (!grad_out && !grad_out_t))
            return sf_fail(SF_ERR_VALUE, "%s: dx's FP8 copies take 'grad_scale', 'grad_scale_inv' and at least one "
                           "of 'grad_out' and 'grad_out_t'", op);
        if (grad_out)
            SF_TRY(check_grouped_out(op, "grad_out", grad_out, padded, 2 * k, "x", x, rule));
        if (grad_out_t)
            SF_TRY(check_grouped_out(op, "grad_out_t", grad_out_t, 2 * k, padded, "x", x, rule));
        if (grad_out && grad_out_t && grad_out->dtype != grad_out_t->dtype)
            return sf_fail(SF_ERR_TYPE, "%s: arguments 'grad_out' (%s) and 'grad_out_t' (%s) must have the same "
                           "FP8 dtype", op, sf_dtype_name(grad_out->dtype), sf_dtype_name(grad_out_t->dtype));
        SF_TRY(check_strided_vector(op, "grad_scale", grad_scale, G, "x", x, 0));
        SF_TRY(check_strided_vector(op, "grad_scale_inv", grad_scale_inv, G, "x", x, 1));
        if (grad_amax)
            SF_TRY(check_strided_vector(op, "grad_amax", grad_amax, G, "x", x, 1));
    }
    {
        const sf_mem_arg outs[] = {{"dx", dx, NULL}, {"dprobs", dprobs, NULL}, {"out_t", out_t, NULL},
                                   {"scale_inv", scale_inv, NULL}, {"grad_out", grad_out, NULL},
                                   {"grad_out_t", grad_out_t, NULL}, {"grad_amax", grad_amax, NULL},
                                   {"grad_scale_inv", grad_scale_inv, NULL}};
        const sf_mem_arg ins[] = {{"dout", dout, NULL}, {"x", x, NULL}, {"probs", probs, NULL},
                                  {"m_splits", m_splits, NULL}, {"scale", scale, NULL},
                                  {"grad_scale", grad_scale, NULL}};
        SF_TRY(sf_check_apart(op, outs, 8, ins, 6));
    }
    sf_cast_grouped_args a = {.x_dtype = x->dtype, .k = k, .groups = G, .swiglu = 1,
                              .probs_dtype = probs ? probs->dtype : SF_FLOAT32};
    if (out_t)
        SF_TRY(grouped_scaling(op, "x", x, &a, scale, NULL, scale_inv, out_t->dtype, 0, 0));
    sf_cast_grouped_args ga = {.x_dtype = x->dtype, .k = 2 * k, .groups = G};
    if (grad) {
        ga.scale = (float *)grad_scale->data;
        ga.amax = grad_amax ? (float *)grad_amax->data : NULL;
        ga.scale_inv = (float *)grad_scale_inv->data;
        ga.scale_stride = vector_stride(grad_scale);
        ga.amax_stride = grad_amax ? vector_stride(grad_amax) : 0;
        ga.scale_inv_stride = vector_stride(grad_scale_inv);
        ga.e5m2 = (grad_out ? grad_out : grad_out_t)->dtype == SF_FLOAT8_E5M2;
    }
    const int dout_padded = dout->shape[0] != m;
    const int64_t *splits = (const int64_t *)m_splits->data;
    if (x->device == SF_CPU) {
        /* dx not wanted: the reference ops write it into a scratch buffer, which its FP8 copies read */
        sf_tensor scratch;
        void *block = NULL;
        if (!dx) {
            block = malloc((size_t)(m * 2 * k) * sf_dtype_size(x->dtype) + 1);
            if (!block)
                return sf_fail(SF_ERR_RUNTIME, "%s: out of host memory for dx's scratch (%lld x %lld)", op,
                               (long long)m, (long long)(2 * k));
            scratch = *x;
            scratch.data = block;
            scratch.shape[0] = m;
            scratch.shape[1] = 2 * k;
            scratch.strides[0] = 2 * k;
            scratch.strides[1] = 1;
            scratch.readonly = 0;
            dx = &scratch;
        }
        sf_status st = swiglu_backward_cpu(dout, x, probs, splits, G, row_multiple, dout_padded, dx, dprobs, scale,
                                           out_t, scale_inv, grad ? grad_scale : NULL, grad_amax, grad_out,
                                           grad_out_t, grad_scale_inv, m_splits, stream);
        free(block);
        return st;
    }
    int64_t *mp = (int64_t *)malloc((size_t)G * sizeof(int64_t));
    if (!mp)
        return sf_fail(SF_ERR_RUNTIME, "%s: out of host memory for %lld groups", op, (long long)G);
    for (int64_t g = 0; g < G; ++g)
        mp[g] = padded_rows(splits[g], row_multiple);
    sf_swiglu_backward_grouped_args b = {
        .dtype = x->dtype, .k = k, .groups = G, .m = splits, .mp = mp, .x = x->data, .dout = dout->data,
        .dout_padded = dout_padded, .probs = probs ? probs->data : NULL,
        .probs_dtype = probs ? probs->dtype : SF_FLOAT32, .dx = dx ? dx->data : NULL,
        .dprobs = dprobs ? dprobs->data : NULL, .dprobs_dtype = dprobs ? dprobs->dtype : SF_FLOAT32,
        .out_t = out_t ? (uint8_t *)out_t->data : NULL, .ld_t = padded, .cast = out_t ? &a : NULL,
        .grad = grad ? &ga : NULL, .grad_out = grad_out ? (uint8_t *)grad_out->data : NULL,
        .grad_out_t = grad_out_t ? (uint8_t *)grad_out_t->data : NULL};
    sf_status st = SF_IF_CUDA(op, "x", sf_swiglu_backward_grouped_cuda(&b, x->device_id, stream));
    free(mp);
    return st;
}

/* ---- the groups' ends on the device (sf_cast_fp8_grouped_ends) ----------
 *
 * The delayed-scaling grouped cast for a mixture-of-experts layer whose
 * routing counts stay on the GPU (the device-split route): each row is cast
 * with its group's scale in place (no padding: out has x's rows), the
 * groups given by their end rows in an int32 device tensor that the kernel
 * reads itself, so nothing waits on the host.  On the CPU the ends are read
 * here and each group goes through the host-count grouped cast's reference
 * (sf_cast_fp8_grouped_cpu with no padding rows). */

static sf_status cast_ends_cpu(const sf_tensor *x, int swiglu, const sf_tensor *probs, const sf_tensor *row_end,
                               sf_tensor *out, sf_cast_grouped_args *a)
{
    const int64_t G = a->groups, k = a->k, m = out->shape[0];
    void *block = NULL;
    grouped_layout l;
    SF_TRY(layout_alloc("cast_fp8_grouped_ends", G, &l, &block));
    const size_t esize = sf_dtype_size(x->dtype), row = (size_t)(swiglu ? 2 * k : k);
    const size_t psize = probs ? sf_dtype_size(probs->dtype) : 0;
    int64_t r = 0;
    for (int64_t g = 0; g < G; ++g) {
        /* the end as the kernel reads it: clamped to [the previous end, m] */
        int64_t end = ((const int32_t *)row_end->data)[g * row_end->strides[0]];
        end = end < r ? r : end > m ? m : end;
        l.m[g] = l.mp[g] = end - r;
        l.ld_t[g] = 0; /* (no transposed copy) */
        l.x[g] = (const char *)x->data + (size_t)r * row * esize;
        l.probs[g] = probs ? (const char *)probs->data + (size_t)r * psize : NULL;
        l.out[g] = (uint8_t *)out->data + r * k;
        r = end;
    }
    a->x = l.x;
    a->out = l.out;
    a->out_t = NULL;
    a->m = l.m;
    a->mp = l.mp;
    a->ld_t = l.ld_t;
    a->probs = probs ? l.probs : NULL;
    sf_status st = sf_cast_fp8_grouped_cpu(a);
    if (st == SF_OK && r < m) /* rows past the last end: zeros */
        memset((uint8_t *)out->data + r * k, 0, (size_t)((m - r) * k));
    free(block);
    return st;
}

sf_status sf_cast_fp8_grouped_ends(const sf_tensor *x, const sf_tensor *probs, int swiglu, const sf_tensor *row_end,
                                   sf_tensor *scale, sf_tensor *amax, sf_tensor *out, sf_tensor *scale_inv,
                                   sf_stream stream)
{
    static const char op[] = "cast_fp8_grouped_ends";
    int64_t m, k;
    SF_TRY(check_grouped_rows(op, x, swiglu, probs, &m, &k));
    SF_TRY(sf_check_dtype(op, "row_end", row_end, SF_INT32));
    SF_TRY(sf_check_same_device(op, "x", x, "row_end", row_end));
    if (row_end->ndim != 1 || row_end->shape[0] < 1 || row_end->shape[0] > SF_CAST_ENDS_MAX_GROUPS ||
        !sf_is_contiguous(row_end))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_end' must be a contiguous 1-D int32 tensor of 1 to %d "
                       "group end rows", op, SF_CAST_ENDS_MAX_GROUPS);
    const int64_t G = row_end->shape[0];
    SF_TRY(check_grouped_out(op, "out", out, m, k, "x", x, "x's rows, each cast in place"));
    {
        const sf_mem_arg outs[] = {{"out", out, NULL}};
        const sf_mem_arg ins[] = {{"x", x, NULL}, {"probs", probs, NULL}, {"row_end", row_end, NULL},
                                  {"scale", scale, NULL}, {"amax", amax, NULL}, {"scale_inv", scale_inv, NULL}};
        SF_TRY(sf_check_apart(op, outs, 1, ins, 6));
    }
    sf_cast_grouped_args a = {.x_dtype = x->dtype, .k = k, .groups = G, .swiglu = swiglu,
                              .probs_dtype = probs ? probs->dtype : SF_FLOAT32};
    SF_TRY(grouped_scaling(op, "x", x, &a, scale, amax, scale_inv, out->dtype, 0, 0));
    if (x->device == SF_CPU)
        return cast_ends_cpu(x, swiglu, probs, row_end, out, &a);
    sf_cast_ends_args e = {.grouped = &a, .x = x->data, .probs = probs ? probs->data : NULL,
                           .row_end = (const int32_t *)row_end->data, .out = (uint8_t *)out->data, .m = m};
    return SF_IF_CUDA(op, "x", sf_cast_fp8_grouped_ends_cuda(&e, x->device_id, stream));
}

/* Matrix g of a contiguous 3-D tensor as a 2-D view. */
static sf_tensor matrix_view(const sf_tensor *t, int64_t g)
{
    sf_tensor v = *t;
    v.ndim = 2;
    v.shape[0] = t->shape[1];
    v.shape[1] = t->shape[2];
    v.strides[0] = t->shape[2];
    v.strides[1] = 1;
    v.data = (char *)t->data + (size_t)(g * t->shape[1] * t->shape[2]) * sf_dtype_size(t->dtype);
    return v;
}

sf_status sf_cast_fp8_current_stacked(const sf_tensor *w, sf_tensor *out, sf_tensor *out_t, sf_tensor *scale,
                                      sf_tensor *amax, sf_tensor *scale_inv, int margin, sf_stream stream)
{
    static const char op[] = "cast_fp8_current_stacked";
    SF_TRY(sf_check_contiguous(op, "w", w));
    if (w->ndim != 3 || w->shape[0] < 1 || w->shape[0] > SF_CAST_MAX_GROUPS)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'w' must be a [G, N, K] stack of 1 to %d matrices", op,
                       SF_CAST_MAX_GROUPS);
    const int64_t G = w->shape[0];
    const sf_tensor *outs[2] = {out, out_t};
    static const char *names[2] = {"out", "out_t"};
    for (int i = 0; i < 2; ++i) {
        const sf_tensor *o = outs[i];
        if (!o)
            continue;
        SF_TRY(sf_check_contiguous(op, names[i], o));
        const int64_t r = i ? w->shape[2] : w->shape[1], c = i ? w->shape[1] : w->shape[2];
        if (o->ndim != 3 || o->shape[0] != G || o->shape[1] != r || o->shape[2] != c)
            return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [%lld, %lld, %lld]", op, names[i],
                           (long long)G, (long long)r, (long long)c);
    }
    sf_tensor *views = (sf_tensor *)malloc((size_t)(3 * G) * sizeof(sf_tensor));
    if (!views)
        return sf_fail(SF_ERR_RUNTIME, "%s: out of host memory for %lld matrices", op, (long long)G);
    for (int64_t g = 0; g < G; ++g) {
        views[g] = matrix_view(w, g);
        if (out)
            views[G + g] = matrix_view(out, g);
        if (out_t)
            views[2 * G + g] = matrix_view(out_t, g);
    }
    sf_status st = sf_cast_fp8_current_list(G, views, out ? G : 0, out ? views + G : NULL, out_t ? G : 0,
                                            out_t ? views + 2 * G : NULL, scale, amax, scale_inv, margin, stream);
    free(views);
    return st;
}

sf_status sf_cast_fp8_current_list(int64_t n, const sf_tensor *x, int64_t n_out, sf_tensor *out,
                                   int64_t n_out_t, sf_tensor *out_t, sf_tensor *scale,
                                   sf_tensor *amax, sf_tensor *scale_inv, int margin,
                                   sf_stream stream)
{
    static const char op[] = "cast_fp8_current_list";
    if (n < 1 || n > SF_CAST_MAX_GROUPS)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'xs' must hold 1 to %d tensors, got %lld", op,
                       SF_CAST_MAX_GROUPS, (long long)n);
    if (!out && !out_t)
        return sf_fail(SF_ERR_VALUE, "%s: at least one of 'out' and 'out_t' must be given", op);
    if ((out && n_out != n) || (out_t && n_out_t != n))
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'out' and 'out_t' must hold one tensor per "
                       "tensor of 'xs' (%lld)", op, (long long)n);
    const int64_t k = x[0].ndim == 2 ? x[0].shape[1] : 0;
    for (int64_t g = 0; g < n; ++g) {
        const sf_tensor *t = &x[g];
        SF_TRY(sf_check_float_input(op, "xs", t));
        SF_TRY(sf_check_contiguous(op, "xs", t));
        SF_TRY(sf_check_same_device(op, "xs[0]", &x[0], "xs", t));
        if (t->ndim != 2 || t->shape[1] != k || k % 16 || t->shape[0] % 16 || t->dtype != x[0].dtype)
            return sf_fail(SF_ERR_VALUE, "%s: every tensor of 'xs' must be 2-D [N, K] of xs[0]'s dtype "
                           "with K = %lld a multiple of 16 and N a multiple of 16 (the FP8 GEMMs' "
                           "rules); xs[%lld] is %dd [%lld, %lld]", op, (long long)k, (long long)g,
                           t->ndim, (long long)(t->ndim ? t->shape[0] : 0),
                           (long long)(t->ndim > 1 ? t->shape[1] : 0));
        if (t->device != SF_CPU && (uintptr_t)t->data % 16)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'xs' (tensor %lld) must be 16-byte aligned", op,
                           (long long)g);
        static const char rule[] = "xs[g]'s shape, transposed for out_t";
        if (out)
            SF_TRY(check_grouped_out(op, "out", &out[g], t->shape[0], k, "xs", t, rule));
        if (out_t)
            SF_TRY(check_grouped_out(op, "out_t", &out_t[g], k, t->shape[0], "xs", t, rule));
        const sf_dtype want = (out ? out : out_t)[0].dtype;
        if ((out && out[g].dtype != want) || (out_t && out_t[g].dtype != want))
            return sf_fail(SF_ERR_TYPE, "%s: every output must have the same FP8 dtype", op);
        const sf_mem_arg outs[] = {{"out", out ? &out[g] : NULL, NULL}, {"out_t", out_t ? &out_t[g] : NULL, NULL}};
        const sf_mem_arg ins[] = {{"xs", t, NULL}, {"scale", scale, NULL}, {"amax", amax, NULL},
                                  {"scale_inv", scale_inv, NULL}};
        SF_TRY(sf_check_apart(op, outs, 2, ins, 4));
    }
    void *block = NULL;
    grouped_layout l;
    SF_TRY(layout_alloc(op, n, &l, &block));
    for (int64_t g = 0; g < n; ++g) {
        l.m[g] = l.mp[g] = l.ld_t[g] = x[g].shape[0];
        l.x[g] = x[g].data;
        l.out[g] = out ? (uint8_t *)out[g].data : NULL;
        l.out_t[g] = out_t ? (uint8_t *)out_t[g].data : NULL;
    }
    sf_cast_grouped_args a = {.x_dtype = x[0].dtype, .k = k, .groups = n, .x = l.x,
                              .out = out ? l.out : NULL, .out_t = out_t ? l.out_t : NULL,
                              .m = l.m, .mp = l.mp, .ld_t = l.ld_t};
    sf_status st = grouped_run(op, "xs", &x[0], &a, scale, amax, scale_inv,
                               (out ? out : out_t)[0].dtype, 1, margin, stream);
    free(block);
    return st;
}

sf_status sf_transpose_fp8(const sf_tensor *data, sf_tensor *out_t, sf_stream stream)
{
    static const char op[] = "transpose_fp8";
    SF_TRY(sf_quant_check_fp8(op, "data", data));
    SF_TRY(sf_check_contiguous(op, "data", data));
    if (data->ndim < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'data' must have at least 1 dimension", op);
    int64_t n = sf_numel(data);
    int64_t k = data->shape[data->ndim - 1];
    int64_t m = k == 0 ? 0 : n / k;
    SF_TRY(sf_quant_check_fp8(op, "out_t", out_t));
    if (out_t->dtype != data->dtype)
        return sf_fail(SF_ERR_TYPE, "%s: argument 'out_t' must have data's dtype %s, got %s", op,
                       sf_dtype_name(data->dtype), sf_dtype_name(out_t->dtype));
    if (out_t->ndim != 2 || out_t->shape[0] != k || out_t->shape[1] != m)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument 'out_t' must have shape [%lld, %lld] (data viewed as "
                       "[M, K] = [%lld, %lld], transposed)",
                       op, (long long)k, (long long)m, (long long)m, (long long)k);
    SF_TRY(check_out_t_storage(op, out_t, "data", data));
    const sf_mem_arg outs[] = {{"out_t", out_t, NULL}};
    const sf_mem_arg ins[] = {{"data", data, NULL}};
    SF_TRY(sf_check_apart(op, outs, 1, ins, 1));
    const sf_transpose_args a = {.in = (const uint8_t *)data->data,
                                 .out = (uint8_t *)out_t->data, .m = m, .k = k};
    if (n == 0)
        return SF_OK;
    return SF_DISPATCH(op, "data", data, sf_transpose_fp8_cpu(&a),
                       sf_transpose_fp8_cuda(&a, data->device_id, stream));
}

sf_status sf_dequantize_fp8(const sf_tensor *data, const sf_tensor *scale_inv,
                            sf_tensor *out, sf_stream stream)
{
    static const char op[] = "dequantize_fp8";
    SF_TRY(sf_quant_check_fp8(op, "data", data));
    SF_TRY(sf_check_contiguous(op, "data", data));
    SF_TRY(sf_check_float_input(op, "out", out));
    SF_TRY(sf_check_contiguous(op, "out", out));
    SF_TRY(sf_check_writable(op, "out", out));
    SF_TRY(sf_check_same_device(op, "data", data, "out", out));
    SF_TRY(sf_check_numel(op, "out", out, sf_numel(data)));
    SF_TRY(sf_check_vector(op, "scale_inv", scale_inv, SF_FLOAT32, 1, "data", data, 0));
    const sf_mem_arg outs[] = {{"out", out, NULL}};
    const sf_mem_arg ins[] = {{"data", data, NULL}, {"scale_inv", scale_inv, NULL}};
    SF_TRY(sf_check_apart(op, outs, 1, ins, 2));
    const sf_dequant_args a = {.data = (const uint8_t *)data->data,
                               .e5m2 = data->dtype == SF_FLOAT8_E5M2, .n = sf_numel(data),
                               .scale_inv = (const float *)scale_inv->data, .out = out->data,
                               .out_dtype = out->dtype};
    return SF_DISPATCH(op, "data", data, sf_dequantize_fp8_cpu(&a),
                       sf_dequantize_fp8_cuda(&a, data->device_id, stream));
}

/* A float32 vector of n elements, 1-D (or 0-d), contiguous, on `ref`'s device. */
static sf_status check_vector(const char *op, const char *arg, const sf_tensor *t,
                              int64_t n, const char *ref_name, const sf_tensor *ref,
                              int written)
{
    if (t->ndim > 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be a contiguous 1-D tensor",
                       op, arg);
    return sf_check_vector(op, arg, t, SF_FLOAT32, n, ref_name, ref, written);
}

static sf_status check_margin(const char *op, int margin, float *pow2)
{
    if (margin < -64 || margin > 64)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'margin' must be in [-64, 64], got %d",
                       op, margin);
    *pow2 = ldexpf(1.0f, -margin);
    return SF_OK;
}

sf_status sf_fp8_scale_update(sf_tensor *amax_history, sf_tensor *scale,
                              sf_tensor *scale_inv, const sf_tensor *fp8_max,
                              int algo, int margin, sf_stream stream)
{
    static const char op[] = "fp8_scale_update";
    SF_TRY(sf_check_dtype(op, "amax_history", amax_history, SF_FLOAT32));
    if (amax_history->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'amax_history' must be 2-D [history_len, "
                       "num_tensors], got %d dimensions", op, amax_history->ndim);
    int64_t h = amax_history->shape[0], n = amax_history->shape[1];
    if (h < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'amax_history' must have at least 1 row", op);
    if (n > 1 && amax_history->strides[1] != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'amax_history' must have unit column "
                       "stride (got stride %lld)", op, (long long)amax_history->strides[1]);
    int64_t ld = h > 1 ? amax_history->strides[0] : n;
    if (h > 1 && ld < n)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'amax_history' rows overlap (row stride "
                       "%lld < %lld columns)", op, (long long)ld, (long long)n);
    SF_TRY(sf_check_writable(op, "amax_history", amax_history));
    SF_TRY(check_vector(op, "scale", scale, n, "amax_history", amax_history, 1));
    SF_TRY(check_vector(op, "scale_inv", scale_inv, n, "amax_history", amax_history, 1));
    SF_TRY(check_vector(op, "fp8_max", fp8_max, n, "amax_history", amax_history, 0));
    {
        const sf_mem_arg outs[] = {{"amax_history", amax_history, NULL}, {"scale", scale, NULL},
                                   {"scale_inv", scale_inv, NULL}};
        const sf_mem_arg ins[] = {{"fp8_max", fp8_max, NULL}};
        SF_TRY(sf_check_apart(op, outs, 3, ins, 1));
    }
    if (fp8_max->device == SF_CPU) {
        /* readable here at no cost; a device vector is not read (this runs every step and must not
         * synchronize): the scaling states fill theirs from the format's largest value */
        const float *m = (const float *)fp8_max->data;
        const int64_t step = n > 1 ? fp8_max->strides[0] : 1;
        for (int64_t i = 0; i < n; ++i)
            if (!(m[i * step] > 0.0f) || isinf(m[i * step]))
                return sf_fail(SF_ERR_VALUE, "%s: argument 'fp8_max' must hold positive finite numbers, "
                               "got %g at element %lld", op, (double)m[i * step], (long long)i);
    }
    if (algo != 0 && algo != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'algo' must be 0 (max) or 1 (most_recent), "
                       "got %d", op, algo);
    float pow2_neg_margin = 1.0f; /* check_margin sets it */
    SF_TRY(check_margin(op, margin, &pow2_neg_margin));
    const sf_scale_args a = {.history = (float *)amax_history->data, .h = h, .n = n, .ld = ld,
                             .scale = (float *)scale->data, .scale_inv = (float *)scale_inv->data,
                             .fp8_max = (const float *)fp8_max->data, .algo = algo,
                             .pow2_neg_margin = pow2_neg_margin};
    if (n == 0)
        return SF_OK;
    return SF_DISPATCH(op, "amax_history", amax_history, sf_fp8_scale_update_cpu(&a),
                       sf_fp8_scale_update_cuda(&a, amax_history->device_id, stream));
}

sf_status sf_fp8_compute_scale(const sf_tensor *amax, sf_tensor *scale,
                               sf_tensor *scale_inv, float fp8_max, int margin,
                               sf_stream stream)
{
    static const char op[] = "fp8_compute_scale";
    int64_t n = sf_numel(amax);
    SF_TRY(check_vector(op, "amax", amax, n, "amax", amax, 0));
    SF_TRY(check_vector(op, "scale", scale, n, "amax", amax, 1));
    SF_TRY(check_vector(op, "scale_inv", scale_inv, n, "amax", amax, 1));
    if (!(fp8_max > 0.0f) || isinf(fp8_max))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'fp8_max' must be a positive finite number",
                       op);
    float pow2_neg_margin = 1.0f; /* check_margin sets it */
    SF_TRY(check_margin(op, margin, &pow2_neg_margin));
    const sf_scale_args a = {.n = n, .amax = (const float *)amax->data,
                             .scale = (float *)scale->data, .scale_inv = (float *)scale_inv->data,
                             .fp8_max_all = fp8_max, .pow2_neg_margin = pow2_neg_margin};
    if (n == 0)
        return SF_OK;
    return SF_DISPATCH(op, "amax", amax, sf_fp8_compute_scale_cpu(&a),
                       sf_fp8_compute_scale_cuda(&a, amax->device_id, stream));
}

sf_status sf_cast_fp8_current(const sf_tensor *x, sf_tensor *amax, sf_tensor *scale,
                              sf_tensor *scale_inv, sf_tensor *out, sf_tensor *out_t,
                              sf_tensor *col_sums, sf_tensor *dbias, int margin, sf_stream stream)
{
    static const char op[] = "cast_fp8_current";
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_quant_check_scalar(op, "amax", amax, x, 1));
    SF_TRY(sf_quant_check_scalar(op, "scale", scale, x, 1));
    SF_TRY(sf_quant_check_scalar(op, "scale_inv", scale_inv, x, 1));
    /* (the three-kernel path hands them to sf_fp8_compute_scale, which takes 1-D vectors only:
     * refused here, before sf_amax writes amax) */
    SF_TRY(check_vector(op, "amax", amax, 1, "amax", amax, 1));
    SF_TRY(check_vector(op, "scale", scale, 1, "amax", amax, 1));
    SF_TRY(check_vector(op, "scale_inv", scale_inv, 1, "amax", amax, 1));
    if (dbias && !col_sums)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'dbias' comes with 'col_sums' (the total of its "
                       "per-block sums)", op);
    {
        /* (all are written: amax, then the scale from it, then the copies and sums) */
        const sf_mem_arg outs[] = {{"amax", amax, NULL},       {"scale", scale, NULL},
                                   {"scale_inv", scale_inv, NULL}, {"out", out, NULL},
                                   {"out_t", out_t, NULL},     {"col_sums", col_sums, NULL},
                                   {"dbias", dbias, NULL}};
        const sf_mem_arg ins[] = {{"x", x, NULL}};
        SF_TRY(sf_check_apart(op, outs, 7, ins, 1));
    }
    float pow2_neg_margin = 1.0f; /* check_margin sets it */
    SF_TRY(check_margin(op, margin, &pow2_neg_margin));
    sf_cast_args a;
    SF_TRY(cast_prepare(op, x, scale, NULL, out, out_t, scale_inv, col_sums, &a));
    if (dbias)
        SF_TRY(sf_quant_check_column_sums(op, "col_sums", col_sums, "dbias", dbias));
    float fp8_max = a.e5m2 ? 57344.0f : 448.0f;
#ifdef SF_WITH_CUDA
    if (x->device != SF_CPU && !col_sums) {
        /* the one-launch path: amax, scale and the cast with a grid barrier between (it writes
         * no column sums: a call with col_sums takes the three kernels) */
        int launched = 0;
        a.amax = (float *)amax->data;
        SF_TRY(sf_cast_fp8_current_cuda(&a, fp8_max, pow2_neg_margin, x->device_id,
                                        stream, &launched));
        if (launched)
            return SF_OK;
        a.amax = NULL; /* shapes the fused kernel does not take: the three kernels */
    }
#endif
    SF_TRY(sf_amax(x, amax, stream));
    SF_TRY(sf_fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin, stream));
    SF_TRY(cast_run(op, &a, x, stream));
    return dbias ? sf_quant_column_sums_run(op, col_sums, dbias, stream) : SF_OK;
}
