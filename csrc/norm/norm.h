/*
 * norm.h - the arithmetic LayerNorm and RMSNorm share between the CPU
 * reference (norm_cpu.c) and the CUDA kernels (norm_kernels.cuh), so both
 * apply the same weight, the same normalization and the same backward
 * formula.
 *
 * Forward:   rstd = 1 / sqrt(var + eps)
 *            xhat = (x - mean) * rstd      (RMSNorm: mean = 0)
 *            y    = xhat * w + beta        w = gamma, or 1 + gamma when the
 *                                          gamma is zero-centered
 * Backward:  g    = dy * w
 *            dx   = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))
 *                   (RMSNorm drops the mean_j(g) term)
 *            dgamma = sum_rows dy * xhat,  dbeta = sum_rows dy
 *
 * Precision: the reference keeps a row's statistics and sums in double and
 * evaluates these formulas in double; the kernels work in float32.
 * sf_norm_real is that type (float in CUDA units, double in C ones), so each
 * formula is written once and each backend keeps the precision it had.  The
 * weight is float32 in both (the kernels stage it as float32).  The row
 * reductions (mean, variance, the backward's two sums, the column sums of
 * dgamma / dbeta) differ by nature between a loop and a block of threads
 * and stay in each backend; so does the backward kernel's xhat, taken as
 * one fma, x * rstd + (-mean * rstd), a rounding away from sf_norm_xhat.
 */
#ifndef SF_NORM_H
#define SF_NORM_H

#include <math.h>

#include "../core/float_bits.h" /* SF_HD */

#if defined(__CUDACC__)
typedef float sf_norm_real;
#else
typedef double sf_norm_real;
#endif

/* The weight applied to xhat. */
SF_HD float sf_norm_weight(float gamma, int zero_centered_gamma)
{
    return zero_centered_gamma ? 1.0f + gamma : gamma;
}

/* rstd from the row's variance: rsqrtf on the device (the hardware's
 * reciprocal square root, within 2 ulp), 1 / sqrt on the host. */
SF_HD sf_norm_real sf_norm_rstd(sf_norm_real var, sf_norm_real eps)
{
#if defined(__CUDA_ARCH__)
    return rsqrtf(var + eps);
#else
    return (sf_norm_real)1 / sqrt(var + eps);
#endif
}

/* The normalized element; RMSNorm passes mean = 0. */
SF_HD sf_norm_real sf_norm_xhat(sf_norm_real x, sf_norm_real mean, sf_norm_real rstd)
{
    return (x - mean) * rstd;
}

/* dx of one element from the row's g = dy * w, its xhat and the row means
 * m1 = mean_j(g) (0 for RMSNorm) and m2 = mean_j(g * xhat). */
SF_HD sf_norm_real sf_norm_dx(sf_norm_real rstd, sf_norm_real g, sf_norm_real xhat, sf_norm_real m1,
                              sf_norm_real m2)
{
    return rstd * (g - m1 - xhat * m2);
}

#endif /* SF_NORM_H */
