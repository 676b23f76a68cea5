/*
 * gemm_cpu.c - the reference GEMM, the definition of correct for the cuBLASLt
 * backend and the CPU path of seqfuse.ops.gemm / seqfuse.pytorch.Linear.
 *
 * Each operand is first dequantized into float32 in a k-contiguous panel
 * (op(a) as [m, k], op(b)^T as [n, k]), applying FP8 scale inverses
 * (per tensor, per 1x128 run or per 128x128 block).  The product is then a
 * dot product of two contiguous rows per output element, accumulated in
 * float32 in blocks of rows and columns so both panels stay in cache.  The
 * epilogue (beta * out, bias, GELU / dGELU, aux, bias gradients) is applied
 * in float32, and the result is rounded once into the output dtype.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/float_io.h"
#include "gemm.h"
#include "gemm_backend.h"

/* FP8 here; float32 / float16 / bfloat16 by float_io.h, which stops on any
 * other dtype (the entry admits none). */
static float load_elem(const void *base, sf_dtype dtype, int64_t index)
{
    switch (dtype) {
    case SF_FLOAT8_E4M3: return sf_gemm_e4m3_to_f32(((const uint8_t *)base)[index]);
    case SF_FLOAT8_E5M2: return sf_gemm_e5m2_to_f32(((const uint8_t *)base)[index]);
    default: return sf_load_float(base, dtype, index);
    }
}

/* The scale inverse applying to element (row, kk) of an operand stored
 * K-major as [rows, k] (FP8 operands are always K-major: see gemm.c). */
static float scale_at(const float *s, sf_gemm_scaling mode, int64_t rows, int64_t k,
                      int64_t row, int64_t kk)
{
    switch (mode) {
    case SF_GEMM_SCALE_TENSOR: return s[0];
    case SF_GEMM_SCALE_BLOCK_1X128: return s[(kk / 128) * rows + row];
    case SF_GEMM_SCALE_BLOCK_128X128: {
        int64_t kb4 = ((k + 127) / 128 + 3) / 4 * 4;
        return s[(row / 128) * kb4 + kk / 128];
    }
    default: return 1.0f;
    }
}

/* panel[r * k + kk] = op(x)[r, kk] for r < outer (op(x) seen as [outer, k]),
 * dequantized.  `want_trans`: panel rows run along op(x)'s columns instead,
 * i.e. the panel holds op(x)^T (used for b, whose panel is [n, k]). */
static void fill_panel(float *panel, const sf_gemm_operand *x, const float *scale,
                       sf_gemm_scaling mode, int64_t outer, int64_t k, int want_trans)
{
    /* Storage element (i, j) lies at i * ld + j.  With op = storage^trans,
     * panel row r, column kk is storage element
     *   (r, kk)  when the panel rows are the storage rows, else (kk, r). */
    int rows_are_storage_rows = (x->trans == want_trans);
    for (int64_t r = 0; r < outer; ++r) {
        float *dst = panel + r * k;
        for (int64_t kk = 0; kk < k; ++kk) {
            int64_t idx = rows_are_storage_rows ? r * x->ld + kk : kk * x->ld + r;
            float v = load_elem(x->data, x->dtype, idx);
            if (scale)
                v *= scale_at(scale, mode, outer, k, r, kk);
            dst[kk] = v;
        }
    }
}

sf_status sf_gemm_cpu(const sf_gemm_problem *p)
{
    int64_t m = p->m, n = p->n, k = p->k;
    float *pa = malloc((size_t)(m * k) * sizeof(float));
    float *pb = malloc((size_t)(n * k) * sizeof(float));
    float *acc = malloc((size_t)(m * n) * sizeof(float));
    if (!pa || !pb || !acc) {
        free(pa);
        free(pb);
        free(acc);
        return sf_fail(SF_ERR_RUNTIME, "gemm: out of host memory for the CPU reference "
                                       "(m=%lld n=%lld k=%lld)",
                       (long long)m, (long long)n, (long long)k);
    }
    /* op(a) as [m, k]: its rows are storage rows when a is not transposed.
     * op(b)^T as [n, k]: its rows are storage rows when b is transposed. */
    fill_panel(pa, &p->a, p->a_scale, p->a_scaling, m, k, 0);
    fill_panel(pb, &p->b, p->b_scale, p->b_scaling, n, k, 1);

    /* acc[i, j] = sum_kk pa[i, kk] * pb[j, kk], in blocks that fit in cache. */
    const int64_t BI = 16, BJ = 64;
    for (int64_t i0 = 0; i0 < m; i0 += BI) {
        int64_t i1 = i0 + BI < m ? i0 + BI : m;
        for (int64_t j0 = 0; j0 < n; j0 += BJ) {
            int64_t j1 = j0 + BJ < n ? j0 + BJ : n;
            for (int64_t i = i0; i < i1; ++i) {
                const float *ra = pa + i * k;
                for (int64_t j = j0; j < j1; ++j) {
                    const float *rb = pb + j * k;
                    /* four partial sums: independent chains the CPU can overlap */
                    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                    int64_t kk = 0;
                    for (; kk + 4 <= k; kk += 4) {
                        s0 += ra[kk] * rb[kk];
                        s1 += ra[kk + 1] * rb[kk + 1];
                        s2 += ra[kk + 2] * rb[kk + 2];
                        s3 += ra[kk + 3] * rb[kk + 3];
                    }
                    for (; kk < k; ++kk)
                        s0 += ra[kk] * rb[kk];
                    acc[i * n + j] = (s0 + s1) + (s2 + s3);
                }
            }
        }
    }

    sf_gemm_epilogue e = p->epilogue;
    int bias_in = sf_gemm_epi_bias_use(e) == 1;
    float *bgrad = NULL;
    if (e == SF_GEMM_EPI_DGELU_BGRAD)
        bgrad = calloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
            float v = p->alpha * acc[i * n + j];
            int64_t o = i * p->ld_out + j;
            if (p->accumulate)
                v += load_elem(p->c, p->out_dtype, o);
            if (bias_in)
                v += load_elem(p->bias, p->bias_dtype, j);
            switch (e) {
            case SF_GEMM_EPI_GELU:
            case SF_GEMM_EPI_BIAS_GELU: v = sf_gemm_gelu(v); break;
            case SF_GEMM_EPI_GELU_AUX:
            case SF_GEMM_EPI_BIAS_GELU_AUX:
                sf_store_float(p->aux, p->aux_dtype, i * p->ld_aux + j, v);
                v = sf_gemm_gelu(v);
                break;
            case SF_GEMM_EPI_DGELU:
            case SF_GEMM_EPI_DGELU_BGRAD:
                v *= sf_gemm_dgelu(load_elem(p->aux, p->aux_dtype, i * p->ld_aux + j));
                if (bgrad)
                    bgrad[j] += v;
                break;
            default: break;
            }
            sf_store_float(p->out, p->out_dtype, o, v);
        }
    }
    if (bgrad) {
        for (int64_t j = 0; j < n; ++j)
            sf_store_float(p->bias, p->bias_dtype, j, bgrad[j]);
        free(bgrad);
    }
    if (e == SF_GEMM_EPI_BGRAD) { /* bias[i] = sum_kk op(a)[i, kk] */
        for (int64_t i = 0; i < m; ++i) {
            float s = 0.0f;
            for (int64_t kk = 0; kk < k; ++kk)
                s += pa[i * k + kk];
            sf_store_float(p->bias, p->bias_dtype, i, s);
        }
    }
    free(pa);
    free(pb);
    free(acc);
    return SF_OK;
}
