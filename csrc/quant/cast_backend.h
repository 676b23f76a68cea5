/*
 * cast_backend.h - the backend entry points behind the FP8 casts, the
 * scaling-state update and the block formats.  Arguments have been
 * validated by cast.c / block.c before either backend is called; the
 * backends receive the problem already reduced to the numbers they need.
 */
#ifndef SF_CAST_BACKEND_H
#define SF_CAST_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks cast.c and block.c share (defined in cast.c): t is an FP8 tensor
 * (float8_e4m3fn or float8_e5m2); t is a float32 tensor of exactly one
 * element on x's device, writable where `written`. */
sf_status sf_quant_check_fp8(const char *op, const char *arg, const sf_tensor *t);
sf_status sf_quant_check_scalar(const char *op, const char *arg, const sf_tensor *t,
                                const sf_tensor *x, int written);

/* A bias gradient from a cast's per-block column sums, shared by
 * sf_column_sums and the casts that take 'dbias' (defined in cast.c): the
 * checks of out (dbias) against col_sums [P, N] (float32, contiguous), then
 * the launch.  The caller checks out apart from the buffers it writes. */
sf_status sf_quant_check_column_sums(const char *op, const char *sums_arg, const sf_tensor *col_sums,
                                     const char *out_arg, const sf_tensor *out);
sf_status sf_quant_column_sums_run(const char *op, const sf_tensor *col_sums, sf_tensor *out,
                                   sf_stream stream);

/* A cast problem after validation: x is [m, k] contiguous; pointers may be
 * NULL where the output is not wanted.  The outputs have mp >= m rows (out
 * [mp, k], out_t [k, mp]); rows m.. are written as zeros (the FP8 GEMMs'
 * token padding, made by the cast instead of a padded copy of x). */
typedef struct {
    const void *x;
    sf_dtype x_dtype;
    int64_t m, k;
    int64_t mp;       /* output rows, >= m */
    int64_t ld_t;     /* out_t's row stride, >= mp (mp for a whole tensor; a grouped cast's
                         group writes a column block of a wider out_t) */
    const float *scale;
    float *amax;      /* accumulated into (sf_cast_fp8_current_cuda: written), or NULL */
    uint8_t *out;     /* [mp, k] or NULL */
    uint8_t *out_t;   /* [k, mp] or NULL */
    float *scale_inv; /* or NULL */
    int e5m2;
    float *col_sums;  /* [ceil(mp / 128), k] per-128-row-block column sums, or NULL */
} sf_cast_args;

/* sf_column_sums after validation: ws float32 [parts, n], out [n] of
 * out_dtype (float32, bfloat16 or float16); the order of sf_column_sums. */
sf_status sf_column_sums_cpu(const float *ws, int64_t parts, int64_t n, void *out, sf_dtype out_dtype);
sf_status sf_column_sums_cuda(const float *ws, int64_t parts, int64_t n, void *out, sf_dtype out_dtype,
                              int device, sf_stream stream);

sf_status sf_cast_fp8_cpu(const sf_cast_args *a);
sf_status sf_cast_fp8_cuda(const sf_cast_args *a, int device, sf_stream stream);

/* sf_cast_fp8_current's one-launch CUDA path: a->amax receives max |x|,
 * a->scale (written) the scale, then the cast.  *launched = 0 (and nothing
 * runs) where the shapes need the three-kernel path. */
sf_status sf_cast_fp8_current_cuda(const sf_cast_args *a, float fp8_max, float pow2_neg_margin,
                                   int device, sf_stream stream, int *launched);

/* A grouped cast (sf_cast_fp8_grouped, sf_cast_fp8_current_list) after
 * validation: G groups of rows, each cast with its own scale.  Group g reads
 * x[g] [m[g], k] (contiguous) and writes out[g] [mp[g], k] and out_t[g]
 * [k, mp[g]] with row stride ld_t[g] (rows m[g].. zero: token padding).
 * The row runs of one expert-sorted tensor point into it and into blocks of
 * one [Mp, K] / [K, Mp] pair (ld_t = Mp); a list of weights points at each
 * weight and its own outputs (ld_t = mp = m).  out / out_t: NULL arrays
 * where that copy is not made.  The per-group float32 values live in
 * strided vectors (element strides: a ScalingState's slots of one role are
 * every third column).  Delayed (current = 0): scale read, max |x_g|
 * folded into amax[g] (when given), scale_inv[g] = 1 / scale[g].  Current
 * (current = 1): amax[g] = max |x_g| written, scale[g] from it (fp8.h's
 * sf_scale_from_amax with fp8_max and 2^-margin; 1 where the amax is 0 or
 * not finite), scale_inv[g] = 1 / scale[g], then the cast. */
typedef struct {
    sf_dtype x_dtype;
    int64_t k, groups;
    const void *const *x;     /* host arrays of `groups` entries */
    uint8_t *const *out;      /* or NULL */
    uint8_t *const *out_t;    /* or NULL */
    const int64_t *m, *mp, *ld_t;
    float *scale, *amax, *scale_inv; /* amax may be NULL when current = 0 */
    int64_t scale_stride, amax_stride, scale_inv_stride;
    int e5m2;
    int current;
    float fp8_max, pow2_neg_margin;
    /* swiglu = 1 (sf_swiglu_cast_fp8_grouped): x[g] points at group g's rows
     * of gate|up pairs [m[g], 2k], and the value cast is silu(gate) * up *
     * probs[g][row] rounded to x_dtype (sf_moe_swiglu_forward's output, bit
     * for bit); probs NULL: no scaling.  probs_dtype: float32/16 or bf16. */
    int swiglu;
    const void *const *probs;
    sf_dtype probs_dtype;
} sf_cast_grouped_args;

sf_status sf_cast_fp8_grouped_cpu(const sf_cast_grouped_args *a);
sf_status sf_cast_fp8_grouped_cuda(const sf_cast_grouped_args *a, int device, sf_stream stream);

/* sf_swiglu_backward_cast_fp8_grouped after validation: group g's m[g]
 * rows start at row sum(m[..g]) of x [M, 2k] (gate|up pairs), dx, probs
 * and dprobs, and at row sum(m[..g]) (dout_padded: sum(mp[..g])) of dout
 * [., k]; cast (NULL: no cast) holds the scaling vectors and format of
 * the SwiGLU value's transposed copy out_t [k, ld_t], group g's block at
 * column sum(mp[..g]). */
typedef struct {
    sf_dtype dtype; /* x, dout, dx */
    int64_t k, groups;
    const int64_t *m, *mp; /* host arrays */
    const void *x, *dout, *probs;
    int dout_padded;
    sf_dtype probs_dtype;
    void *dx, *dprobs;
    sf_dtype dprobs_dtype;
    uint8_t *out_t;
    int64_t ld_t;
    const sf_cast_grouped_args *cast;
    /* grad (NULL: none): dx's FP8 copies for the gate-up layer's backward,
     * grad_out [Mp, 2k] (group g's block at row sum(mp[..g])) and grad_out_t
     * [2k, Mp] (either may be NULL), with grad's scaling vectors and format */
    const sf_cast_grouped_args *grad;
    uint8_t *grad_out, *grad_out_t;
} sf_swiglu_backward_grouped_args;

sf_status sf_swiglu_backward_grouped_cuda(const sf_swiglu_backward_grouped_args *a, int device, sf_stream stream);

/* The most groups sf_cast_fp8_grouped_ends takes (its kernel keeps the
 * groups' ends, scales and amaxes in shared memory). */
#define SF_CAST_ENDS_MAX_GROUPS 64

/* sf_cast_fp8_grouped_ends after validation: `grouped` holds the dtypes,
 * k, the group count, swiglu / probs_dtype and the scaling vectors (its
 * per-group arrays unused); x [m, k] (or [m, 2k] gate|up pairs) and probs
 * [m] (or NULL) whole, row_end int32 [groups] on the device, out [m, k]. */
typedef struct {
    const sf_cast_grouped_args *grouped;
    const void *x, *probs;
    const int32_t *row_end;
    uint8_t *out;
    int64_t m;
} sf_cast_ends_args;

sf_status sf_cast_fp8_grouped_ends_cuda(const sf_cast_ends_args *a, int device, sf_stream stream);

/* A byte transpose: in [m, k] -> out [k, m], both contiguous. */
typedef struct {
    const uint8_t *in;
    uint8_t *out;
    int64_t m, k;
} sf_transpose_args;

sf_status sf_transpose_fp8_cpu(const sf_transpose_args *a);
sf_status sf_transpose_fp8_cuda(const sf_transpose_args *a, int device, sf_stream stream);

typedef struct {
    const uint8_t *data;
    int e5m2;
    int64_t n;
    const float *scale_inv;
    void *out;
    sf_dtype out_dtype;
} sf_dequant_args;

sf_status sf_dequantize_fp8_cpu(const sf_dequant_args *a);
sf_status sf_dequantize_fp8_cuda(const sf_dequant_args *a, int device, sf_stream stream);

typedef struct {
    float *history;       /* [h, n] with row stride ld */
    int64_t h, n, ld;
    float *scale, *scale_inv;
    const float *fp8_max; /* per column (update) */
    float fp8_max_all;    /* one value (compute_scale) */
    const float *amax;    /* compute_scale: [n] */
    int algo;             /* 0 max, 1 most_recent */
    float pow2_neg_margin;
} sf_scale_args;

sf_status sf_fp8_scale_update_cpu(const sf_scale_args *a);
sf_status sf_fp8_scale_update_cuda(const sf_scale_args *a, int device, sf_stream stream);
sf_status sf_fp8_compute_scale_cpu(const sf_scale_args *a);
sf_status sf_fp8_compute_scale_cuda(const sf_scale_args *a, int device, sf_stream stream);

/* Block formats: x [m, k] contiguous. */
typedef enum {
    SF_BLOCK_FP8_1X128 = 0,
    SF_BLOCK_FP8_128X128 = 1,
    SF_BLOCK_MXFP8 = 2,
    SF_BLOCK_NVFP4 = 3,
    SF_BLOCK_FP8_ROWCOL = 4, /* 1x128 along K (data) and along M (data_t) */
    SF_BLOCK_FP8_ROW = 5,    /* one scale per row (a 1 x K block) */
} sf_block_format;

typedef struct {
    sf_block_format format;
    const void *x;        /* quantize: input; dequantize: unused */
    sf_dtype x_dtype;     /* quantize: input dtype; dequantize: output dtype */
    void *y;              /* dequantize: output [m, k] */
    int64_t m, k;
    int64_t mp;           /* 1x128 / rowcol: rows of the row-wise copy, >= m (0: m); rows m..mp-1
                             are zero rows (data 0, the scale of a zero block), the FP8 GEMMs'
                             token padding */
    uint8_t *data;        /* fp8 [mp, k] (1x128 / rowcol), [m, k] otherwise, or packed fp4 [m, k/2] */
    int e5m2;
    void *scales;         /* fp32 / e8m0 / e4m3, layout by format */
    int64_t scale_ld;     /* fp32 block scales: row length of the scale tensor */
    const float *amax;    /* nvfp4: tensor amax */
    float *global_scale_inv; /* nvfp4 */
    uint8_t *data_t;      /* rowcol: [k, round_up(m, 128)] or NULL (data may be NULL too) */
    float *scales_t;      /* rowcol: [round_up(m, 128)/128, scale_ld_t] */
    int64_t scale_ld_t;
    float *col_sums;      /* rowcol: [round_up(m, 128)/128, k] block column sums, or NULL */
} sf_block_args;

sf_status sf_block_quantize_cpu(const sf_block_args *a);
sf_status sf_block_quantize_cuda(const sf_block_args *a, int device, sf_stream stream);
sf_status sf_block_dequantize_cpu(const sf_block_args *a);
/* The 128x128 scales of [m, k] (a->scales, row length a->scale_ld) transposed
 * into those of [k, m] (a->scales_t, row length a->scale_ld_t), padding 0:
 * sf_quantize_block_fp8_weight's last step. */
sf_status sf_block_scales_transpose_cpu(const sf_block_args *a);
sf_status sf_block_scales_transpose_cuda(const sf_block_args *a, int device, sf_stream stream);
sf_status sf_block_dequantize_cuda(const sf_block_args *a, int device, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
