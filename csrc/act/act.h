/*
 * act.h - the arithmetic of the act family, shared by the CPU reference and
 * the CUDA kernels: activations and their derivatives in float32, and the
 * Philox-4x32-10 generator behind dropout (bit-exact on host and device).
 *
 * exp and the divisions inside tanh/sigmoid use the hardware approximations
 * on the device (__expf, __fdividef: a few ulp) and libm on the host; both
 * are tested against float64 torch.  sigmoid(v) = 1 / (1 + e^{-v}) saturates
 * cleanly to 0 or 1 when e^{-v} overflows or underflows.
 */
#ifndef SF_ACT_H
#define SF_ACT_H

#include <math.h>
#include <stdint.h>

#include "../core/float_bits.h"
#include "../core/philox.h"

#if defined(__CUDA_ARCH__)
#define SF_ACT_EXP(x) __expf(x)
#define SF_ACT_FDIV(a, b) __fdividef((a), (b))
#else
#define SF_ACT_EXP(x) expf(x)
#define SF_ACT_FDIV(a, b) ((a) / (b))
#endif

#define SF_GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define SF_GELU_K1 0.044715f
#define SF_INV_SQRT2 0.7071067811865476f
#define SF_INV_SQRT_2PI 0.3989422804014327f

SF_HD float sf_sigmoid(float x) { return SF_ACT_FDIV(1.0f, 1.0f + SF_ACT_EXP(-x)); }

/* erfc(x) in single precision without branches: t = 1 / (1 + |x| / 2),
 * erfc(|x|) = t exp(-x^2 + P(t)) with P of degree 9 (the Chebyshev fit of
 * Numerical Recipes' erfcc, fractional error below 1.2e-7 in exact
 * arithmetic), erfc(-|x|) = 2 - erfc(|x|).  In float32 the rounding of the
 * exponent's argument bounds the relative error: measured against double
 * erfc on the CPU, at most 2e-6 for |x| < 5 and 8e-6 up to |x| = 8.5 (the
 * GPU's fast exponential adds a little), far below the 16-bit types'
 * resolution.  It replaces
 * erfcf(), whose interval branches and extra exponentials made the erf GELU
 * the one activation kernel well below the copy rate (45 % against 90 %). */
SF_HD float sf_erfc(float x)
{
    const float z = fabsf(x);
    const float t = SF_ACT_FDIV(1.0f, 1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    const float e = t * SF_ACT_EXP(p - z * z);
    return x >= 0.0f ? e : 2.0f - e;
}

/* NaN and Inf go where torch's float32 activations send them (tested against
 * torch for every activation, forward and backward).
 *
 * The base activation of `kind` (0 gelu-tanh, 1 gelu-erf, 2 silu, 3 relu).
 * Both GELUs are written without 1 + (something near -1), which cancels for
 * negative x:  0.5 (1 + tanh(u)) = sigmoid(2u),  0.5 (1 + erf(z)) =
 * 0.5 erfc(-z). */
SF_HD float sf_act_base(int kind, float x)
{
    switch (kind) {
    case 0: return x * sf_sigmoid(2.0f * SF_GELU_K0 * (x + SF_GELU_K1 * x * x * x));
    case 1: return 0.5f * x * sf_erfc(-x * SF_INV_SQRT2);
    case 2: return x * sf_sigmoid(x);
    default: return x <= 0.0f ? 0.0f : x; /* NaN stays NaN, as torch's relu */
    }
}

/* d act / dx of the base activation. */
SF_HD float sf_act_base_grad(int kind, float x)
{
    switch (kind) {
    case 0: { /* s = sigmoid(2u): gelu = x s, gelu' = s + 2 x s (1 - s) u' */
        float x2 = x * x;
        float s = sf_sigmoid(2.0f * SF_GELU_K0 * x * (1.0f + SF_GELU_K1 * x2));
        return s + 2.0f * x * s * (1.0f - s) * SF_GELU_K0 * (1.0f + 3.0f * SF_GELU_K1 * x2);
    }
    case 1:
        return 0.5f * sf_erfc(-x * SF_INV_SQRT2) + x * SF_INV_SQRT_2PI * SF_ACT_EXP(-0.5f * x * x);
    case 2: {
        float s = sf_sigmoid(x);
        return s * (1.0f + x * (1.0f - s));
    }
    default: return x <= 0.0f ? 0.0f : 1.0f; /* 1 at NaN: torch passes dy there */
    }
}

/* The activation and its derivative together (the gated backward needs
 * both): the exponential / erfc is evaluated once. */
SF_HD void sf_act_base_both(int kind, float x, float *f, float *df)
{
    switch (kind) {
    case 0: {
        float x2 = x * x;
        float s = sf_sigmoid(2.0f * SF_GELU_K0 * x * (1.0f + SF_GELU_K1 * x2));
        *f = x * s;
        *df = s + 2.0f * x * s * (1.0f - s) * SF_GELU_K0 * (1.0f + 3.0f * SF_GELU_K1 * x2);
        return;
    }
    case 1: {
        float phi = 0.5f * sf_erfc(-x * SF_INV_SQRT2);
        *f = x * phi;
        *df = phi + x * SF_INV_SQRT_2PI * SF_ACT_EXP(-0.5f * x * x);
        return;
    }
    case 2: {
        float s = sf_sigmoid(x);
        *f = x * s;
        *df = s * (1.0f + x * (1.0f - s));
        return;
    }
    default:
        *f = x <= 0.0f ? 0.0f : x;
        *df = x <= 0.0f ? 0.0f : 1.0f;
    }
}

/* The chain rule as torch's backward forms it: g * act'(x) for the smooth
 * activations; for relu torch's threshold_backward SELECTS, 0 where x <= 0
 * and g elsewhere, so a NaN or Inf g does not turn into NaN in the cut-off
 * half (g * 0 would), and g passes where x is NaN.  df: sf_act_base_grad. */
SF_HD float sf_act_chain(int kind, float g, float df)
{
    return kind == 3 ? (df != 0.0f ? g : 0.0f) : g * df;
}

/* ---- Philox-4x32-10: sf_philox(key, counter), csrc/core/philox.h ---------- */

/* Keep threshold for drop probability p: keep when (word >> 8) < threshold. */
SF_HD uint32_t sf_dropout_threshold(float p)
{
    double keep = 1.0 - (double)p;
    if (keep <= 0.0)
        return 0u;
    if (keep >= 1.0)
        return 1u << 24;
    return (uint32_t)(keep * 16777216.0);
}

/* The factor applied to kept elements. */
SF_HD float sf_dropout_scale(float p) { return p >= 1.0f ? 0.0f : 1.0f / (1.0f - p); }

#endif /* SF_ACT_H */
