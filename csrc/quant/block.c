/*
 * block.c - public entries of the block-scaled formats: FP8 with fp32 scales
 * per 1x128 or 128x128 block (cuBLASLt's VEC128_32F / BLK128x128_32F layout
 * on Hopper), MXFP8 (E8M0 per 32) and NVFP4 (E2M1 values, E4M3 per 16, fp32
 * per tensor), quantize and dequantize.  Every precondition is checked here
 * once, including the multiple each format needs of the last dimension.
 * The quant family's file shape: cast.c's first comment.
 */
#include "../core/dispatch.h"
#include "cast_backend.h"

/* t (argument `arg`) is contiguous, numel elements, on the device of x
 * (argument `x_name`: the input the entry works from), writable if written. */
static sf_status check_out(const char *op, const char *arg, const sf_tensor *t,
                           const char *x_name, const sf_tensor *x, int64_t numel, int written)
{
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_device(op, x_name, x, arg, t));
    SF_TRY(sf_check_numel(op, arg, t, numel));
    if (written)
        SF_TRY(sf_check_writable(op, arg, t));
    return SF_OK;
}

/* x viewed as [m, k]; k must be a multiple of `multiple`. */
static sf_status matrix_view(const char *op, const char *arg, const sf_tensor *x,
                             int64_t multiple, const char *what, int64_t *m, int64_t *k)
{
    SF_TRY(sf_check_contiguous(op, arg, x));
    if (x->ndim < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have at least 1 dimension", op, arg);
    *k = x->shape[x->ndim - 1];
    *m = *k ? sf_numel(x) / *k : 0;
    if (*k % multiple != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: the last dimension of '%s' (K = %lld) must be a multiple of %lld "
                       "for %s",
                       op, arg, (long long)*k, (long long)multiple, what);
    return SF_OK;
}

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* The rows of a 1x128 row-wise copy `out` of x [m, k]: m, or mp > m where
 * out is [mp, k] (the FP8 GEMMs' token padding, written as zero rows in
 * the same launch: no padded copy of x is needed). */
static sf_status rowwise_out_rows(const char *op, const sf_tensor *out, const sf_tensor *x, int64_t m,
                                  int64_t k, int64_t *mp)
{
    *mp = m;
    if (sf_numel(out) != m * k) {
        if (out->ndim != 2 || out->shape[1] != k || out->shape[0] < m)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument 'out' must have M x K = %lld x %lld elements, or shape "
                           "[Mp, K] with Mp > M (token rows padded with zero rows)",
                           op, (long long)m, (long long)k);
        *mp = out->shape[0];
    }
    return check_out(op, "out", out, "x", x, *mp * k, 1);
}

/* The fp32 block-scale tensor of block_rows 1 or 128 (see seqfuse_quant.h). */
static sf_status check_block_scales_named(const char *op, const char *name, const sf_tensor *s,
                                          const char *x_name, const sf_tensor *x, int block_rows, int64_t m,
                                          int64_t k, int written, int64_t *ld)
{
    int64_t rows, cols;
    if (block_rows == 1) {
        rows = k / 128;
        cols = round_up(m, 4);
    } else {
        rows = (m + 127) / 128;
        cols = round_up(k / 128, 4);
    }
    SF_TRY(sf_check_dtype(op, name, s, SF_FLOAT32));
    if (s->ndim != 2 || s->shape[0] != rows || s->shape[1] != cols)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must have shape [%lld, %lld] for %s blocks of "
                       "a [%lld, %lld] matrix (%s)",
                       op, name, (long long)rows, (long long)cols, block_rows == 1 ? "1x128" : "128x128",
                       (long long)m, (long long)k,
                       block_rows == 1 ? "[K/128, round_up(M, 4)], M fastest"
                                       : "[ceil(M/128), round_up(K/128, 4)]");
    SF_TRY(check_out(op, name, s, x_name, x, rows * cols, written));
    *ld = cols;
    return SF_OK;
}

static sf_status check_block_scales(const char *op, const sf_tensor *s, const char *x_name,
                                    const sf_tensor *x, int block_rows, int64_t m, int64_t k,
                                    int written, int64_t *ld)
{
    return check_block_scales_named(op, "scale_inv", s, x_name, x, block_rows, m, k, written, ld);
}

/* `on` (named on_arg): the tensor whose device runs the op. */
static sf_status dispatch(const char *op, const char *on_arg, const sf_tensor *on,
                          sf_block_args *a, int quantize, sf_stream stream)
{
    return SF_DISPATCH(op, on_arg, on,
                       quantize ? sf_block_quantize_cpu(a) : sf_block_dequantize_cpu(a),
                       quantize ? sf_block_quantize_cuda(a, on->device_id, stream)
                                : sf_block_dequantize_cuda(a, on->device_id, stream));
}

/* The pointers and dtypes of a validated FP8 block quantization (x -> out,
 * one scale per block into scales) and of its dequantization. */
static void fp8_quantize_fields(sf_block_args *a, const sf_tensor *x, sf_tensor *out,
                                sf_tensor *scales)
{
    a->x = x->data;
    a->x_dtype = x->dtype;
    a->data = (uint8_t *)out->data;
    a->e5m2 = out->dtype == SF_FLOAT8_E5M2;
    a->scales = scales->data;
}

static void fp8_dequantize_fields(sf_block_args *a, const sf_tensor *data,
                                  const sf_tensor *scales, sf_tensor *out)
{
    a->data = (uint8_t *)data->data;
    a->e5m2 = data->dtype == SF_FLOAT8_E5M2;
    a->scales = scales->data;
    a->y = out->data;
    a->x_dtype = out->dtype;
}

sf_status sf_quantize_block_fp8(const sf_tensor *x, sf_tensor *out, sf_tensor *scale_inv,
                                int block_rows, sf_stream stream)
{
    static const char op[] = "quantize_block_fp8";
    SF_TRY(sf_check_float_input(op, "x", x));
    if (block_rows != 1 && block_rows != 128)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'block_rows' must be 1 (1x128 blocks) or 128 "
                       "(128x128 blocks), got %d", op, block_rows);
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "x", x, 128, block_rows == 1 ? "1x128 blocks" : "128x128 blocks",
                       &a.m, &a.k));
    SF_TRY(sf_quant_check_fp8(op, "out", out));
    if (block_rows == 1)
        SF_TRY(rowwise_out_rows(op, out, x, a.m, a.k, &a.mp));
    else
        SF_TRY(check_out(op, "out", out, "x", x, a.m * a.k, 1));
    SF_TRY(sf_check_aligned(op, "out", out, 8));
    SF_TRY(check_block_scales(op, scale_inv, "x", x, block_rows, block_rows == 1 ? a.mp : a.m, a.k, 1,
                              &a.scale_ld));
    a.format = block_rows == 1 ? SF_BLOCK_FP8_1X128 : SF_BLOCK_FP8_128X128;
    fp8_quantize_fields(&a, x, out, scale_inv);
    return dispatch(op, "x", x, &a, 1, stream);
}

/* The transposed operand of a 128x128-block weight whose forward operand
 * (named src_name, of `dtype`) is [a->m, a->k]: out_t FP8 [K, M] of the same
 * dtype, 16-byte aligned, and scale_inv_t the 128x128 scales of [K, M]
 * (sets a->scale_ld_t, a->scales_t).  `on` (on_name) is the input the entry
 * works from. */
static sf_status check_transposed(const char *op, const char *on_name, const sf_tensor *on, const char *src_name,
                                  sf_dtype dtype, sf_tensor *out_t, sf_tensor *scale_inv_t, sf_block_args *a)
{
    SF_TRY(sf_quant_check_fp8(op, "out_t", out_t));
    if (out_t->dtype != dtype)
        return sf_fail(SF_ERR_TYPE, "%s: arguments '%s' and 'out_t' must have the same FP8 dtype", op, src_name);
    if (out_t->ndim != 2 || out_t->shape[0] != a->k || out_t->shape[1] != a->m)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'out_t' must have shape [K, M] = [%lld, %lld]", op,
                       (long long)a->k, (long long)a->m);
    SF_TRY(check_out(op, "out_t", out_t, on_name, on, a->k * a->m, 1));
    SF_TRY(sf_check_aligned(op, "out_t", out_t, 16));
    SF_TRY(check_block_scales_named(op, "scale_inv_t", scale_inv_t, on_name, on, 128, a->k, a->m, 1,
                                    &a->scale_ld_t));
    a->scales_t = (float *)scale_inv_t->data;
    return SF_OK;
}

/* No two of the n tensors share a byte (the transposed copies are made from
 * the forward operand's bytes and scales). */
static sf_status check_apart(const char *op, int n, const sf_tensor *const *all, const char *const *names)
{
    for (int i = 0; i < n; ++i)
        for (int j = i + 1; j < n; ++j)
            if (sf_tensors_overlap(all[i], all[j]))
                return sf_fail(SF_ERR_VALUE, "%s: arguments '%s' and '%s' overlap in memory", op, names[i],
                               names[j]);
    return SF_OK;
}

/* W^T's 128x128 operand from W's (a->data, a->scales; validated): the bytes
 * transposed, then the real scales transposed with zero padding. */
static sf_status transpose_blocks(const char *op, const char *on_name, const sf_tensor *on, const sf_block_args *a,
                                  uint8_t *out_t, sf_stream stream)
{
    if (a->m * a->k == 0)
        return SF_OK;
    const sf_transpose_args t = {.in = a->data, .out = out_t, .m = a->m, .k = a->k};
    SF_TRY(SF_DISPATCH(op, on_name, on, sf_transpose_fp8_cpu(&t), sf_transpose_fp8_cuda(&t, on->device_id, stream)));
    return SF_DISPATCH(op, on_name, on, sf_block_scales_transpose_cpu(a),
                       sf_block_scales_transpose_cuda(a, on->device_id, stream));
}

sf_status sf_quantize_block_fp8_weight(const sf_tensor *w, sf_tensor *out, sf_tensor *scale_inv,
                                       sf_tensor *out_t, sf_tensor *scale_inv_t, sf_stream stream)
{
    static const char op[] = "quantize_block_fp8_weight";
    SF_TRY(sf_check_float_input(op, "w", w));
    if (w->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'w' must be 2-D (a weight [M, K]), got %d dimensions", op,
                       (int)w->ndim);
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "w", w, 128, "128x128 blocks", &a.m, &a.k));
    if (a.m % 128 != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: the rows of 'w' (M = %lld) must be a multiple of 128 (whole 128x128 blocks "
                       "of its transpose)", op, (long long)a.m);
    SF_TRY(sf_quant_check_fp8(op, "out", out));
    SF_TRY(check_out(op, "out", out, "w", w, a.m * a.k, 1));
    SF_TRY(sf_check_aligned(op, "out", out, 16));
    SF_TRY(check_block_scales(op, scale_inv, "w", w, 128, a.m, a.k, 1, &a.scale_ld));
    SF_TRY(check_transposed(op, "w", w, "out", out->dtype, out_t, scale_inv_t, &a));
    const sf_tensor *all[5] = {w, out, scale_inv, out_t, scale_inv_t};
    static const char *const names[5] = {"w", "out", "scale_inv", "out_t", "scale_inv_t"};
    SF_TRY(check_apart(op, 5, all, names));
    a.format = SF_BLOCK_FP8_128X128;
    fp8_quantize_fields(&a, w, out, scale_inv);
    SF_TRY(dispatch(op, "w", w, &a, 1, stream));
    return transpose_blocks(op, "w", w, &a, (uint8_t *)out_t->data, stream);
}

sf_status sf_block_transpose_fp8(const sf_tensor *data, const sf_tensor *scale_inv, sf_tensor *out_t,
                                 sf_tensor *scale_inv_t, sf_stream stream)
{
    static const char op[] = "block_transpose_fp8";
    SF_TRY(sf_quant_check_fp8(op, "data", data));
    SF_TRY(sf_check_contiguous(op, "data", data));
    if (data->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'data' must be 2-D (a weight's FP8 bytes [M, K]), got %d "
                       "dimensions", op, (int)data->ndim);
    sf_block_args a = {0};
    a.m = data->shape[0];
    a.k = data->shape[1];
    if (a.m % 128 != 0 || a.k % 128 != 0)
        return sf_fail(SF_ERR_VALUE, "%s: the dimensions of 'data' ([M, K] = [%lld, %lld]) must be multiples "
                       "of 128 (whole 128x128 blocks)", op, (long long)a.m, (long long)a.k);
    SF_TRY(sf_check_aligned(op, "data", data, 16));
    SF_TRY(check_block_scales(op, scale_inv, "data", data, 128, a.m, a.k, 0, &a.scale_ld));
    SF_TRY(check_transposed(op, "data", data, "data", data->dtype, out_t, scale_inv_t, &a));
    const sf_tensor *all[4] = {data, scale_inv, out_t, scale_inv_t};
    static const char *const names[4] = {"data", "scale_inv", "out_t", "scale_inv_t"};
    SF_TRY(check_apart(op, 4, all, names));
    a.data = (uint8_t *)data->data;
    a.scales = scale_inv->data;
    return transpose_blocks(op, "data", data, &a, (uint8_t *)out_t->data, stream);
}

sf_status sf_quantize_rowwise_fp8(const sf_tensor *x, sf_tensor *out, sf_tensor *scale_inv, sf_stream stream)
{
    static const char op[] = "quantize_rowwise_fp8";
    SF_TRY(sf_check_float_input(op, "x", x));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "x", x, 16, "row-wise FP8 (the scaled GEMMs' 16-byte FP8 rows)", &a.m, &a.k));
    SF_TRY(sf_check_aligned(op, "x", x, 16));
    SF_TRY(sf_quant_check_fp8(op, "out", out));
    SF_TRY(check_out(op, "out", out, "x", x, a.m * a.k, 1));
    SF_TRY(sf_check_aligned(op, "out", out, 16));
    SF_TRY(sf_check_dtype(op, "scale_inv", scale_inv, SF_FLOAT32));
    SF_TRY(check_out(op, "scale_inv", scale_inv, "x", x, a.m, 1));
    a.format = SF_BLOCK_FP8_ROW;
    fp8_quantize_fields(&a, x, out, scale_inv);
    return dispatch(op, "x", x, &a, 1, stream);
}

sf_status sf_quantize_block_fp8_rowcol(const sf_tensor *x, sf_tensor *out, sf_tensor *scale_inv,
                                       sf_tensor *out_t, sf_tensor *scale_inv_t,
                                       sf_tensor *col_sums, sf_tensor *dbias, sf_stream stream)
{
    static const char op[] = "quantize_block_fp8_rowcol";
    SF_TRY(sf_check_float_input(op, "x", x));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "x", x, 128, "1x128 blocks", &a.m, &a.k));
    SF_TRY(sf_check_aligned(op, "x", x, 16));
    /* the column-wise copy's rows: M rounded up to whole 128-row blocks */
    const int64_t mt = (a.m + 127) / 128 * 128;
    if (!out && !out_t)
        return sf_fail(SF_ERR_VALUE, "%s: at least one of 'out' and 'out_t' must be given", op);
    if ((out == NULL) != (scale_inv == NULL) || (out_t == NULL) != (scale_inv_t == NULL))
        return sf_fail(SF_ERR_VALUE, "%s: 'out' comes with 'scale_inv' and 'out_t' with "
                       "'scale_inv_t'", op);
    if (out) {
        SF_TRY(sf_quant_check_fp8(op, "out", out));
        SF_TRY(rowwise_out_rows(op, out, x, a.m, a.k, &a.mp));
        if (a.mp > mt)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'out' has %lld rows; padded rows go up to "
                           "round_up(M, 128) = %lld at most", op, (long long)a.mp, (long long)mt);
        SF_TRY(sf_check_aligned(op, "out", out, 16));
        SF_TRY(check_block_scales(op, scale_inv, "x", x, 1, a.mp, a.k, 1, &a.scale_ld));
        a.e5m2 = out->dtype == SF_FLOAT8_E5M2;
    }
    if (out_t) {
        SF_TRY(sf_quant_check_fp8(op, "out_t", out_t));
        if (out_t->ndim != 2 || out_t->shape[0] != a.k || out_t->shape[1] != mt)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument 'out_t' must have shape [K, round_up(M, 128)] = "
                           "[%lld, %lld]", op, (long long)a.k, (long long)mt);
        SF_TRY(check_out(op, "out_t", out_t, "x", x, mt * a.k, 1));
        SF_TRY(sf_check_aligned(op, "out_t", out_t, 16));
        if (out && out->dtype != out_t->dtype)
            return sf_fail(SF_ERR_TYPE, "%s: arguments 'out' and 'out_t' must have the same "
                           "FP8 dtype", op);
        /* the transposed [K, mt] matrix's 1x128 layout: [mt/128, round_up(K, 4)] */
        SF_TRY(check_block_scales_named(op, "scale_inv_t", scale_inv_t, "x", x, 1, a.k, mt, 1,
                                        &a.scale_ld_t));
        a.e5m2 = out_t->dtype == SF_FLOAT8_E5M2;
    }
    if (col_sums) {
        if (!out_t)
            return sf_fail(SF_ERR_VALUE, "%s: 'col_sums' comes with the column-wise copy "
                           "('out_t'), whose pass computes it", op);
        SF_TRY(sf_check_dtype(op, "col_sums", col_sums, SF_FLOAT32));
        if (col_sums->ndim != 2 || col_sums->shape[0] != mt / 128 || col_sums->shape[1] != a.k)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument 'col_sums' must have shape [round_up(M, 128)/128, K] = "
                           "[%lld, %lld]", op, (long long)(mt / 128), (long long)a.k);
        SF_TRY(check_out(op, "col_sums", col_sums, "x", x, mt / 128 * a.k, 1));
    }
    if (dbias) {
        if (!col_sums)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'dbias' comes with 'col_sums' (the total of "
                           "its per-block sums)", op);
        SF_TRY(sf_quant_check_column_sums(op, "col_sums", col_sums, "dbias", dbias));
    }
    {
        const sf_mem_arg outs[] = {{"out", out, NULL},     {"scale_inv", scale_inv, NULL},
                                   {"out_t", out_t, NULL}, {"scale_inv_t", scale_inv_t, NULL},
                                   {"col_sums", col_sums, NULL}, {"dbias", dbias, NULL}};
        const sf_mem_arg ins[] = {{"x", x, NULL}};
        SF_TRY(sf_check_apart(op, outs, 6, ins, 1));
    }
    a.format = SF_BLOCK_FP8_ROWCOL;
    a.x = x->data;
    a.x_dtype = x->dtype;
    a.data = out ? (uint8_t *)out->data : NULL;
    a.scales = scale_inv ? scale_inv->data : NULL;
    a.data_t = out_t ? (uint8_t *)out_t->data : NULL;
    a.scales_t = scale_inv_t ? (float *)scale_inv_t->data : NULL;
    a.col_sums = col_sums ? (float *)col_sums->data : NULL;
    SF_TRY(dispatch(op, "x", x, &a, 1, stream));
    return dbias ? sf_quant_column_sums_run(op, col_sums, dbias, stream) : SF_OK;
}

sf_status sf_dequantize_block_fp8(const sf_tensor *data, const sf_tensor *scale_inv,
                                  int block_rows, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "dequantize_block_fp8";
    SF_TRY(sf_quant_check_fp8(op, "data", data));
    if (block_rows != 1 && block_rows != 128)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'block_rows' must be 1 or 128, got %d", op,
                       block_rows);
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "data", data, 128, block_rows == 1 ? "1x128 blocks" : "128x128 blocks",
                       &a.m, &a.k));
    SF_TRY(sf_check_float_input(op, "out", out));
    SF_TRY(check_out(op, "out", out, "data", data, a.m * a.k, 1));
    SF_TRY(check_block_scales(op, scale_inv, "data", data, block_rows, a.m, a.k, 0, &a.scale_ld));
    a.format = block_rows == 1 ? SF_BLOCK_FP8_1X128 : SF_BLOCK_FP8_128X128;
    fp8_dequantize_fields(&a, data, scale_inv, out);
    return dispatch(op, "data", data, &a, 0, stream);
}

static sf_status check_byte_scales(const char *op, const char *arg, const sf_tensor *s,
                                   sf_dtype typed)
{
    if (s->dtype != typed && s->dtype != SF_UINT8)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s or uint8, got %s", op,
                       arg, sf_dtype_name(typed), sf_dtype_name(s->dtype));
    return SF_OK;
}

sf_status sf_quantize_mxfp8(const sf_tensor *x, sf_tensor *out, sf_tensor *scales,
                            sf_stream stream)
{
    static const char op[] = "quantize_mxfp8";
    SF_TRY(sf_check_float_input(op, "x", x));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "x", x, 32, "MXFP8 (1x32 blocks)", &a.m, &a.k));
    SF_TRY(sf_quant_check_fp8(op, "out", out));
    SF_TRY(check_out(op, "out", out, "x", x, a.m * a.k, 1));
    SF_TRY(check_byte_scales(op, "scales", scales, SF_FLOAT8_E8M0));
    SF_TRY(check_out(op, "scales", scales, "x", x, a.m * a.k / 32, 1));
    a.format = SF_BLOCK_MXFP8;
    fp8_quantize_fields(&a, x, out, scales);
    return dispatch(op, "x", x, &a, 1, stream);
}

sf_status sf_dequantize_mxfp8(const sf_tensor *data, const sf_tensor *scales, sf_tensor *out,
                              sf_stream stream)
{
    static const char op[] = "dequantize_mxfp8";
    SF_TRY(sf_quant_check_fp8(op, "data", data));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "data", data, 32, "MXFP8 (1x32 blocks)", &a.m, &a.k));
    SF_TRY(check_byte_scales(op, "scales", scales, SF_FLOAT8_E8M0));
    SF_TRY(check_out(op, "scales", scales, "data", data, a.m * a.k / 32, 0));
    SF_TRY(sf_check_float_input(op, "out", out));
    SF_TRY(check_out(op, "out", out, "data", data, a.m * a.k, 1));
    a.format = SF_BLOCK_MXFP8;
    fp8_dequantize_fields(&a, data, scales, out);
    return dispatch(op, "data", data, &a, 0, stream);
}

sf_status sf_quantize_nvfp4(const sf_tensor *x, const sf_tensor *amax, sf_tensor *out,
                            sf_tensor *block_scales, sf_tensor *global_scale_inv,
                            sf_stream stream)
{
    static const char op[] = "quantize_nvfp4";
    SF_TRY(sf_check_float_input(op, "x", x));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "x", x, 16, "NVFP4 (16-element blocks)", &a.m, &a.k));
    SF_TRY(sf_quant_check_scalar(op, "amax", amax, x, 0));
    SF_TRY(sf_check_dtype(op, "out", out, SF_UINT8));
    SF_TRY(check_out(op, "out", out, "x", x, a.m * a.k / 2, 1));
    SF_TRY(check_byte_scales(op, "block_scales", block_scales, SF_FLOAT8_E4M3));
    SF_TRY(check_out(op, "block_scales", block_scales, "x", x, a.m * a.k / 16, 1));
    SF_TRY(sf_quant_check_scalar(op, "global_scale_inv", global_scale_inv, x, 1));
    a.format = SF_BLOCK_NVFP4;
    a.x = x->data;
    a.x_dtype = x->dtype;
    a.data = (uint8_t *)out->data;
    a.scales = block_scales->data;
    a.amax = (const float *)amax->data;
    a.global_scale_inv = (float *)global_scale_inv->data;
    return dispatch(op, "x", x, &a, 1, stream);
}

sf_status sf_dequantize_nvfp4(const sf_tensor *data, const sf_tensor *block_scales,
                              const sf_tensor *global_scale_inv, sf_tensor *out,
                              sf_stream stream)
{
    static const char op[] = "dequantize_nvfp4";
    SF_TRY(sf_check_dtype(op, "data", data, SF_UINT8));
    SF_TRY(sf_check_float_input(op, "out", out));
    sf_block_args a = {0};
    SF_TRY(matrix_view(op, "out", out, 16, "NVFP4 (16-element blocks)", &a.m, &a.k));
    SF_TRY(sf_check_writable(op, "out", out));
    SF_TRY(check_out(op, "data", data, "out", out, a.m * a.k / 2, 0));
    SF_TRY(check_byte_scales(op, "block_scales", block_scales, SF_FLOAT8_E4M3));
    SF_TRY(check_out(op, "block_scales", block_scales, "data", data, a.m * a.k / 16, 0));
    SF_TRY(sf_quant_check_scalar(op, "global_scale_inv", global_scale_inv, out, 0));
    a.format = SF_BLOCK_NVFP4;
    a.data = (uint8_t *)data->data;
    a.scales = block_scales->data;
    a.global_scale_inv = (float *)global_scale_inv->data;
    a.y = out->data;
    a.x_dtype = out->dtype;
    return dispatch(op, "out", out, &a, 0, stream);
}
