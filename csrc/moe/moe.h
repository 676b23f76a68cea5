/*
 * moe.h - the arithmetic of the moe family, shared by the CPU reference
 * (moe_cpu.c) and the CUDA kernels (moe_cuda.cu): element access by dtype
 * and the per-token router math as host/device functions.  The router works
 * one token (one row of E experts) at a time, the same function on both
 * backends: the CPU loops over tokens, the GPU gives each token a thread.
 * The permutation kernels are plain gathers and scatters, written
 * separately per backend.  The validated arguments and the backend entry
 * points are moe_backend.h's.
 */
#ifndef SF_MOE_H
#define SF_MOE_H

#include <math.h>
#include <stdint.h>

#include "../core/float_bits.h"
#include "../core/float_io.h"
#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element access (float32 / float16 / bfloat16, validated before) ----
 * On the host (the CPU reference) float_io.h's access, which stops on any
 * other dtype.  On the device the dtype's last branch reads bfloat16: the
 * CUDA launchers visit every float dtype they hand a kernel first
 * (moe_cuda.cu's on_device), so it never sees another one. */

SF_HD float sf_moe_ld(const void *p, sf_dtype d, int64_t i)
{
#ifndef __CUDA_ARCH__
    return sf_load_float(p, d, i);
#else
    if (d == SF_FLOAT32)
        return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return d == SF_FLOAT16 ? sf_f16_to_f32(h) : sf_bf16_to_f32(h);
#endif
}

SF_HD void sf_moe_st(void *p, sf_dtype d, int64_t i, float v)
{
#ifndef __CUDA_ARCH__
    sf_store_float(p, d, i, v);
#else
    if (d == SF_FLOAT32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = d == SF_FLOAT16 ? sf_f32_to_f16(v) : sf_f32_to_bf16(v);
#endif
}

#define SF_MOE_EPS 1e-20f

/* The router's sigmoid score: expf (libm's on the host, CUDA's on the device) and an IEEE division. */
SF_HD float sf_moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* The SwiGLU's sigmoid (sf_moe_silu, sf_moe_dsilu): on the device from the
 * hardware exp and division approximations, as act.h's sf_sigmoid
 * (__expf's error is 2 + floor(1.173 |x|) ulp, __fdividef's 2: once rounded
 * to 16 bits or FP8 the values mostly equal the host's, which uses libm's
 * expf and an IEEE division).  The exact forms left the
 * one-pass FP8 SwiGLU kernels issue-bound (245 registers, 8 warps an SM):
 * at Llama 1B's MLP (8,192 rows, K 8,192) the backward took 336 against
 * 285 us, the row-wise forward cast 149 against 128 (H100, session 60's
 * probe).  1 / (1 + e^-x) saturates to 0 or 1 as e^-x overflows or
 * underflows. */
#if defined(__CUDA_ARCH__)
SF_HD float sf_moe_swiglu_sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
#else
SF_HD float sf_moe_swiglu_sigmoid(float x) { return sf_moe_sigmoid(x); }
#endif

/* s[e] = softmax(l)[e] over one row of E values read from (p, d) at `off`. */
SF_HD void sf_moe_softmax_row(const void *p, sf_dtype d, int64_t off, int64_t E, float *s)
{
    float m = -INFINITY;
    for (int64_t e = 0; e < E; ++e)
        m = fmaxf(m, sf_moe_ld(p, d, off + e));
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
        s[e] = expf(sf_moe_ld(p, d, off + e) - m);
        sum += s[e];
    }
    for (int64_t e = 0; e < E; ++e)
        s[e] /= sum;
}

/* map[e] = 1 for the topk largest s[e] + bias[e] (bias may be NULL), 0
 * elsewhere; repeated arg-max, ties to the lower index. */
SF_HD void sf_moe_select_row(const float *s, const float *bias, int64_t E, int topk, uint8_t *map)
{
    for (int64_t e = 0; e < E; ++e)
        map[e] = 0;
    for (int j = 0; j < topk; ++j) {
        int64_t best = -1;
        float bv = 0.0f;
        for (int64_t e = 0; e < E; ++e) {
            if (map[e])
                continue;
            float v = s[e] + (bias ? bias[e] : 0.0f);
            if (best < 0 || v > bv) {
                best = e;
                bv = v;
            }
        }
        map[best] = 1;
    }
}

/* One token of topk_forward: logits row at `off`; writes probs, map and saved
 * (saved and map are this row's E entries). */
SF_HD void sf_moe_topk_forward_row(const void *logits, sf_dtype ld, int64_t off, int64_t E, int topk,
                               int score, int pre_softmax, float scaling, const float *bias,
                               void *probs, sf_dtype pd, uint8_t *map, float *saved)
{
    if (score == 1) {
        for (int64_t e = 0; e < E; ++e)
            saved[e] = sf_moe_sigmoid(sf_moe_ld(logits, ld, off + e));
    } else if (pre_softmax) {
        sf_moe_softmax_row(logits, ld, off, E, saved);
    } else {
        for (int64_t e = 0; e < E; ++e)
            saved[e] = sf_moe_ld(logits, ld, off + e);
    }
    sf_moe_select_row(saved, bias, E, topk, map);
    if (score == 0 && !pre_softmax) { /* softmax over the selected logits */
        float m = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; ++e)
            if (map[e])
                m = fmaxf(m, saved[e]);
        for (int64_t e = 0; e < E; ++e) {
            saved[e] = map[e] ? expf(saved[e] - m) : 0.0f;
            sum += saved[e];
        }
        for (int64_t e = 0; e < E; ++e)
            saved[e] /= sum;
    }
    float denom = 1.0f;
    if (score == 1 && topk > 1) {
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e)
            sum += map[e] ? saved[e] : 0.0f;
        denom = sum + SF_MOE_EPS;
    }
    for (int64_t e = 0; e < E; ++e)
        sf_moe_st(probs, pd, off + e, map[e] ? saved[e] / denom * scaling : 0.0f);
}

/* One token of topk_backward: dlogits from dprobs, map and saved (row at off). */
SF_HD void sf_moe_topk_backward_row(const uint8_t *map, const float *saved, const void *dprobs,
                               sf_dtype gd, int64_t off, int64_t E, int topk, int score,
                               int pre_softmax, float scaling, void *dlogits, sf_dtype od)
{
    float dot = 0.0f, sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
        if (!map[e])
            continue;
        float g = sf_moe_ld(dprobs, gd, off + e) * scaling;
        dot += g * saved[e];
        sum += saved[e];
    }
    for (int64_t e = 0; e < E; ++e) {
        float g = map[e] ? sf_moe_ld(dprobs, gd, off + e) * scaling : 0.0f;
        float s = saved[e], dl;
        if (score == 1) {
            float ds = g;
            if (topk > 1) {
                float den = sum + SF_MOE_EPS;
                ds = map[e] ? g / den - dot / (den * den) : 0.0f;
            }
            dl = ds * s * (1.0f - s);
        } else if (pre_softmax) {
            dl = s * (g - dot);       /* softmax over all experts */
        } else {
            dl = map[e] ? s * (g - dot) : 0.0f; /* softmax over the selected */
        }
        sf_moe_st(dlogits, od, off + e, dl);
    }
}

/* One token of aux_scores_forward. */
SF_HD void sf_moe_aux_scores_forward_row(const void *logits, sf_dtype ld, int64_t off, int64_t E,
                                     int topk, int score, void *scores, sf_dtype sd, uint8_t *map,
                                     float *saved)
{
    float den = 1.0f;
    if (score == 1) {
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) {
            saved[e] = sf_moe_sigmoid(sf_moe_ld(logits, ld, off + e));
            sum += saved[e];
        }
        den = sum + SF_MOE_EPS;
    } else {
        sf_moe_softmax_row(logits, ld, off, E, saved);
    }
    for (int64_t e = 0; e < E; ++e)
        sf_moe_st(scores, sd, off + e, saved[e] / den);
    /* the selection on scores: saved / den has the same order as saved */
    sf_moe_select_row(saved, NULL, E, topk, map);
}

/* One token of aux_scores_backward. */
SF_HD void sf_moe_aux_scores_backward_row(const float *saved, const void *dscores, sf_dtype gd,
                                     int64_t off, int64_t E, int score, void *dlogits, sf_dtype od)
{
    float dot = 0.0f, sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
        dot += sf_moe_ld(dscores, gd, off + e) * saved[e];
        sum += saved[e];
    }
    float den = sum + SF_MOE_EPS;
    for (int64_t e = 0; e < E; ++e) {
        float g = sf_moe_ld(dscores, gd, off + e), s = saved[e];
        float dl = score == 1 ? (g / den - dot / (den * den)) * s * (1.0f - s) : s * (g - dot);
        sf_moe_st(dlogits, od, off + e, dl);
    }
}

/* logsumexp of one row. */
SF_HD float sf_moe_lse_row(const void *p, sf_dtype d, int64_t off, int64_t E)
{
    float m = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < E; ++e)
        m = fmaxf(m, sf_moe_ld(p, d, off + e));
    if (m == -INFINITY || m == INFINITY)
        return m;
    for (int64_t e = 0; e < E; ++e)
        sum += expf(sf_moe_ld(p, d, off + e) - m);
    return m + logf(sum);
}

/* The aux-loss factor coeff * E / (topk * total^2), in double then float. */
static inline float sf_moe_aux_factor(float coeff, int64_t E, int topk, int64_t total)
{
    double t = (double)total;
    return (float)((double)coeff * (double)E / ((double)topk * t * t));
}

/* silu(g) and its derivative, for the probability-scaled SwiGLU. */
SF_HD float sf_moe_silu(float g) { return g * sf_moe_swiglu_sigmoid(g); }
SF_HD float sf_moe_dsilu(float g)
{
    float s = sf_moe_swiglu_sigmoid(g);
    return s * (1.0f + g * (1.0f - s));
}

SF_HD float sf_moe_ld_count(const void *p, sf_dtype d, int64_t i)
{
    return d == SF_INT32 ? (float)((const int32_t *)p)[i] : (float)((const int64_t *)p)[i];
}

#ifdef __cplusplus
}
#endif

#endif /* SF_MOE_H */
