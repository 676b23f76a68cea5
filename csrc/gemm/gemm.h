/*
 * gemm.h - what the gemm entry (gemm.c), the CPU reference (gemm_cpu.c) and
 * the cuBLASLt backend (gemm_cuda.cu) share:
 *
 *   - sf_gemm_problem: the arguments after validation, with every operand
 *     folded into "row-major storage + transpose flag + leading dimension",
 *     so neither backend looks at strides again;
 *   - the epilogue math (tanh-GELU and its derivative, as cuBLASLt computes
 *     them) and the FP8 decoders, as static inline functions usable from
 *     host C and device code.
 * The backend entry points are gemm_backend.h's.
 */
#ifndef SF_GEMM_INTERNAL_H
#define SF_GEMM_INTERNAL_H

#include <math.h>
#include <stdint.h>

#include "seqfuse.h"

#if defined(__CUDACC__)
#define SF_GEMM_HD static inline __host__ __device__
#else
#define SF_GEMM_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* One operand as stored: `rows` x `cols` row-major with leading dimension
 * `ld` (elements between consecutive rows); op() = storage when trans == 0,
 * its transpose when trans == 1. */
typedef struct {
    const void *data;
    sf_dtype dtype;
    int64_t rows, cols, ld;
    int trans;
} sf_gemm_operand;

typedef struct {
    sf_gemm_operand a, b;          /* op(a) is [m, k], op(b) is [k, n] */
    int64_t m, n, k;
    void *out;
    sf_dtype out_dtype;
    int64_t ld_out;
    const float *a_scale, *b_scale; /* scale inverses, or NULL */
    sf_gemm_scaling a_scaling, b_scaling;
    void *bias;                    /* input or output (epilogue), or NULL */
    sf_dtype bias_dtype;
    void *aux;
    sf_dtype aux_dtype;
    int64_t ld_aux;
    sf_gemm_epilogue epilogue;
    const void *c;                 /* beta's operand, read when accumulate: out, or the addend (out's layout) */
    int accumulate, fast_accum, allow_tf32;
    float alpha;
    void *workspace;
    size_t workspace_bytes;
    int sm_count_target;           /* 0: the device's */
    int device_id;
} sf_gemm_problem;

/* Does the epilogue read bias (1), write it (2), or neither (0)? */
static inline int sf_gemm_epi_bias_use(sf_gemm_epilogue e)
{
    switch (e) {
    case SF_GEMM_EPI_BIAS:
    case SF_GEMM_EPI_BIAS_GELU:
    case SF_GEMM_EPI_BIAS_GELU_AUX: return 1;
    case SF_GEMM_EPI_DGELU_BGRAD:
    case SF_GEMM_EPI_BGRAD: return 2;
    default: return 0;
    }
}

/* Does the epilogue write aux (1), read it (2), or neither (0)? */
static inline int sf_gemm_epi_aux_use(sf_gemm_epilogue e)
{
    switch (e) {
    case SF_GEMM_EPI_GELU_AUX:
    case SF_GEMM_EPI_BIAS_GELU_AUX: return 1;
    case SF_GEMM_EPI_DGELU:
    case SF_GEMM_EPI_DGELU_BGRAD: return 2;
    default: return 0;
    }
}

static inline const char *sf_gemm_epi_name(sf_gemm_epilogue e)
{
    static const char *const names[SF_GEMM_EPI_COUNT] = {
        "none", "bias", "gelu", "bias_gelu", "gelu_aux", "bias_gelu_aux",
        "dgelu", "dgelu_bgrad", "bgrad"};
    return (int)e >= 0 && e < SF_GEMM_EPI_COUNT ? names[e] : "<invalid>";
}

static inline const char *sf_gemm_scaling_name(sf_gemm_scaling s)
{
    switch (s) {
    case SF_GEMM_SCALE_NONE: return "none";
    case SF_GEMM_SCALE_TENSOR: return "tensor";
    case SF_GEMM_SCALE_BLOCK_1X128: return "block_1x128";
    case SF_GEMM_SCALE_BLOCK_128X128: return "block_128x128";
    }
    return "<invalid>";
}

static inline int sf_gemm_is_fp8(sf_dtype d)
{
    return d == SF_FLOAT8_E4M3 || d == SF_FLOAT8_E5M2;
}

/* ---- shared math ------------------------------------------------------ */

#define SF_GEMM_GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define SF_GEMM_GELU_K1 0.044715f

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
SF_GEMM_HD float sf_gemm_gelu(float x)
{
    float u = SF_GEMM_GELU_K0 * (x + SF_GEMM_GELU_K1 * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

/* d gelu(x) / dx for the tanh approximation. */
SF_GEMM_HD float sf_gemm_dgelu(float x)
{
    float x2 = x * x;
    float u = SF_GEMM_GELU_K0 * (x + SF_GEMM_GELU_K1 * x2 * x);
    float t = tanhf(u);
    float du = SF_GEMM_GELU_K0 * (1.0f + 3.0f * SF_GEMM_GELU_K1 * x2);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no inf, NaN is
 * S.1111.111; max 448. */
SF_GEMM_HD float sf_gemm_e4m3_to_f32(uint8_t v)
{
    int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
    float r;
    if (exp == 0xf && man == 7)
        r = NAN;
    else if (exp == 0)
        r = ldexpf((float)man, -9); /* subnormal: man * 2^-6 / 8 */
    else
        r = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -r : r;
}

/* float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa; IEEE-like, so it is
 * the upper byte of a float16. */
SF_GEMM_HD float sf_gemm_e5m2_to_f32(uint8_t v)
{
    int sign = v >> 7, exp = (v >> 2) & 0x1f, man = v & 3;
    float r;
    if (exp == 0x1f)
        r = man ? NAN : INFINITY;
    else if (exp == 0)
        r = ldexpf((float)man, -16); /* man * 2^-14 / 4 */
    else
        r = ldexpf(1.0f + (float)man / 4.0f, exp - 15);
    return sign ? -r : r;
}

#ifdef __cplusplus
}
#endif

#endif /* SF_GEMM_INTERNAL_H */
