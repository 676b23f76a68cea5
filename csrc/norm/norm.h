/*
 * norm.h - the arithmetic LayerNorm and RMSNorm share between the CPU
 * reference and the CUDA kernels, so both apply the same weight and the same
 * backward formula.
 *
 * Forward:   xhat = (x - mean) * rstd      (RMSNorm: mean = 0)
 *            y    = xhat * w + beta        w = gamma, or 1 + gamma when the
 *                                          gamma is zero-centered
 * Backward:  g    = dy * w
 *            dx   = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))
 *                   (RMSNorm drops the mean_j(g) term)
 *            dgamma = sum_rows dy * xhat,  dbeta = sum_rows dy
 */
#ifndef SF_NORM_H
#define SF_NORM_H

#include "../core/float_bits.h"

SF_HD float sf_norm_weight(float gamma, int zero_centered_gamma)
{
    return zero_centered_gamma ? 1.0f + gamma : gamma;
}

#endif /* SF_NORM_H */
