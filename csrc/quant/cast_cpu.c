/*
 * cast_cpu.c - the reference FP8 casts and scaling-state updates: plain
 * loops over every element, the definition of correct that the CUDA kernels
 * must match bit for bit.  The math lives in fp8.h, shared with the GPU.
 */
#include <math.h>
#include <stdlib.h>

#include "../core/float_io.h"
#include "../moe/moe.h" /* sf_moe_silu: the SwiGLU of sf_swiglu_cast_fp8_grouped */
#include "cast_backend.h"
#include "fp8.h"

static void column_sums(const sf_cast_args *a);

sf_status sf_cast_fp8_cpu(const sf_cast_args *a)
{
    float s = a->scale[0];
    uint32_t m = 0;
    for (int64_t r = 0; r < a->m; ++r) {
        for (int64_t c = 0; c < a->k; ++c) {
            float v = sf_load_float(a->x, a->x_dtype, r * a->k + c);
            uint32_t bits = sf_abs_bits(v);
            m = bits > m ? bits : m;
            uint8_t q = sf_f32_to_fp8(SF_MUL(v, s), a->e5m2);
            if (a->out)
                a->out[r * a->k + c] = q;
            if (a->out_t)
                a->out_t[c * a->ld_t + r] = q;
        }
    }
    for (int64_t r = a->m; r < a->mp; ++r) /* token padding */
        for (int64_t c = 0; c < a->k; ++c) {
            if (a->out)
                a->out[r * a->k + c] = 0;
            if (a->out_t)
                a->out_t[c * a->ld_t + r] = 0;
        }
    if (a->amax && a->m * a->k > 0) /* the GPU's fold (fp8.h); no element, no fold */
        a->amax[0] = sf_bits_f32(sf_amax_fold(sf_f32_bits(a->amax[0]), m));
    if (a->scale_inv)
        a->scale_inv[0] = SF_DIV(1.0f, s);
    if (a->col_sums)
        column_sums(a);
    return SF_OK;
}

/* The order of column_sum_kernel (core/vec_io.cuh): eight interleaved
 * slices of the rows, each added left to right, then the slices in turn. */
sf_status sf_column_sums_cpu(const float *ws, int64_t parts, int64_t n, void *out, sf_dtype out_dtype)
{
    for (int64_t j = 0; j < n; ++j) {
        float total = 0.0f;
        for (int i = 0; i < 8; ++i) {
            float acc = 0.0f;
            for (int64_t p = i; p < parts; p += 8)
                acc += ws[p * n + j];
            total += acc;
        }
        sf_store_float(out, out_dtype, j, total);
    }
    return SF_OK;
}

/* col_sums in the CUDA kernel's order (cast_cuda.cu): in each block of 128
 * rows, thread (warp w, half h) adds its rows 2w+h, 2w+h+16, ... in turn;
 * the halves are added, then the 8 warps in order.  Padding rows (m..mp)
 * add nothing, as in the kernel. */
static void column_sums(const sf_cast_args *a)
{
    for (int64_t b = 0; b * 128 < a->mp; ++b)
        for (int64_t c = 0; c < a->k; ++c) {
            float total = 0.0f;
            for (int w = 0; w < 8; ++w) {
                float half[2];
                for (int h = 0; h < 2; ++h) {
                    float acc = 0.0f;
                    for (int i = 0; i < 8; ++i) {
                        int64_t r = b * 128 + 2 * w + h + 16 * i;
                        if (r < a->m)
                            acc += sf_load_float(a->x, a->x_dtype, r * a->k + c);
                    }
                    half[h] = acc;
                }
                float pair = half[0] + half[1];
                total = w == 0 ? pair : total + pair;
            }
            a->col_sums[b * a->k + c] = total;
        }
}

/* Group g's SwiGLU output (swiglu = 1): silu(gate) * up * p rounded to
 * x_dtype, as sf_moe_swiglu_forward_cpu computes it, into a new buffer (the
 * caller frees it; NULL: out of memory). */
static void *swiglu_rows(const sf_cast_grouped_args *a, int64_t g)
{
    const int64_t m = a->m[g], k = a->k;
    void *y = malloc((size_t)(m * k > 0 ? m * k : 1) * sf_dtype_size(a->x_dtype));
    if (!y)
        return NULL;
    for (int64_t r = 0; r < m; ++r) {
        const float p = a->probs ? sf_load_float(a->probs[g], a->probs_dtype, r) : 1.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float gate = sf_load_float(a->x[g], a->x_dtype, r * 2 * k + j);
            const float up = sf_load_float(a->x[g], a->x_dtype, r * 2 * k + k + j);
            sf_store_float(y, a->x_dtype, r * k + j, sf_moe_silu(gate) * up * p);
        }
    }
    return y;
}

/* The grouped cast: each group is a whole-tensor cast of its rows
 * (sf_cast_fp8_cpu) into its outputs; under current scaling its amax and
 * scale are computed first, as sf_cast_fp8_current does. */
sf_status sf_cast_fp8_grouped_cpu(const sf_cast_grouped_args *a)
{
    for (int64_t g = 0; g < a->groups; ++g) {
        const void *x = a->x[g];
        void *act = NULL;
        if (a->swiglu) {
            act = swiglu_rows(a, g);
            if (!act)
                return sf_fail(SF_ERR_RUNTIME, "swiglu_cast_fp8_grouped: out of host memory for group "
                               "%lld's %lld x %lld values", (long long)g, (long long)a->m[g], (long long)a->k);
            x = act;
        }
        float *scale = a->scale + g * a->scale_stride;
        float *amax = a->amax ? a->amax + g * a->amax_stride : NULL;
        if (a->current) {
            uint32_t bits = 0;
            for (int64_t i = 0; i < a->m[g] * a->k; ++i) {
                uint32_t b = sf_abs_bits(sf_load_float(x, a->x_dtype, i));
                bits = b > bits ? b : bits;
            }
            *amax = sf_bits_f32(bits);
            *scale = sf_scale_from_amax(*amax, a->fp8_max, a->pow2_neg_margin, 1.0f);
        }
        sf_cast_args b = {
            .x = x, .x_dtype = a->x_dtype, .m = a->m[g], .k = a->k, .mp = a->mp[g],
            .ld_t = a->ld_t[g], .scale = scale, .amax = a->current ? NULL : amax,
            .out = a->out ? a->out[g] : NULL, .out_t = a->out_t ? a->out_t[g] : NULL,
            .scale_inv = a->scale_inv + g * a->scale_inv_stride, .e5m2 = a->e5m2, .col_sums = NULL};
        const sf_status st = sf_cast_fp8_cpu(&b);
        free(act);
        SF_TRY(st);
    }
    return SF_OK;
}

sf_status sf_transpose_fp8_cpu(const sf_transpose_args *a)
{
    for (int64_t r = 0; r < a->m; ++r)
        for (int64_t c = 0; c < a->k; ++c)
            a->out[c * a->m + r] = a->in[r * a->k + c];
    return SF_OK;
}

sf_status sf_dequantize_fp8_cpu(const sf_dequant_args *a)
{
    float si = a->scale_inv[0];
    for (int64_t i = 0; i < a->n; ++i) {
        float v = SF_MUL(sf_fp8_to_f32(a->data[i], a->e5m2), si);
        if (!isnan(v))
            sf_store_float(a->out, a->out_dtype, i, v);
        else if (a->out_dtype == SF_FLOAT32)
            ((uint32_t *)a->out)[i] = SF_DEQUANT_NAN_F32;
        else
            ((uint16_t *)a->out)[i] = a->out_dtype == SF_FLOAT16 ? SF_DEQUANT_NAN_F16
                                                                 : SF_DEQUANT_NAN_BF16;
    }
    return SF_OK;
}

sf_status sf_fp8_scale_update_cpu(const sf_scale_args *a)
{
    for (int64_t j = 0; j < a->n; ++j) {
        float *col = a->history + j;
        uint32_t m = sf_abs_bits(col[0]);
        if (a->algo == 0)
            for (int64_t i = 1; i < a->h; ++i) {
                uint32_t b = sf_abs_bits(col[i * a->ld]);
                m = b > m ? b : m;
            }
        float s = sf_scale_from_amax(sf_bits_f32(m), a->fp8_max[j], a->pow2_neg_margin,
                                     a->scale[j]);
        a->scale[j] = s;
        a->scale_inv[j] = SF_DIV(1.0f, s);
        /* torch.roll(history, -1, 0); history[0] = 0 */
        if (a->h > 1) {
            float first = col[0];
            for (int64_t i = 1; i + 1 < a->h; ++i)
                col[i * a->ld] = col[(i + 1) * a->ld];
            col[(a->h - 1) * a->ld] = first;
        }
        col[0] = 0.0f;
    }
    return SF_OK;
}

sf_status sf_fp8_compute_scale_cpu(const sf_scale_args *a)
{
    for (int64_t j = 0; j < a->n; ++j) {
        float s = sf_scale_from_amax(a->amax[j], a->fp8_max_all, a->pow2_neg_margin, 1.0f);
        a->scale[j] = s;
        a->scale_inv[j] = SF_DIV(1.0f, s);
    }
    return SF_OK;
}
