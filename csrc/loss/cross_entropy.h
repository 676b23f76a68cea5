/*
 * cross_entropy.h - the arithmetic of the loss family, shared by the CPU
 * reference (cross_entropy_cpu.c) and the CUDA kernels
 * (cross_entropy_cuda.cu), so both apply the same special-value rule, the
 * same label-smoothed loss and the same gradient formula.
 *
 * For one row x[0..V) with label y and label smoothing e:
 *   lse    = log sum_j exp(x_j)                        (torch.logsumexp's
 *            special values: NaN with a NaN logit, +inf with a +inf one,
 *            -inf when every logit is -inf)
 *   loss   = lse - (1 - e) x_y - (e / V) sum_j x_j     (the smoothed target
 *            puts 1 - e + e/V on the label and e/V on every class)
 *   dloss / dx_j = p_j - e/V - (1 - e)[j == y],  p_j = exp(x_j - lse)
 *
 * Precision: the reference keeps its row sums in double and evaluates these
 * formulas in double; the kernels work in float32.  sf_ce_real is that type
 * (float in CUDA units, double in C ones), so each formula is written once
 * and each backend keeps the precision it had.  The row reductions
 * themselves (max and sum of exp) differ by nature between a sequential
 * loop and a block of threads, and stay in each backend.
 */
#ifndef SF_CROSS_ENTROPY_H
#define SF_CROSS_ENTROPY_H

#include <math.h>

#include "../core/float_bits.h" /* SF_HD */

#if defined(__CUDACC__)
typedef float sf_ce_real;
#define SF_CE_LOG logf
#else
typedef double sf_ce_real;
#define SF_CE_LOG log
#endif

#define SF_CE_LOG2E 1.4426950408889634f /* log2(e): exp(t) = 2^(t log2 e) */

/* lse of a row from its max m and s = sum_j exp(x_j - m): m + log s, with
 * torch.logsumexp's special values.  has_nan: a logit of the row is NaN (s
 * cannot tell: +inf - +inf is NaN too).  An infinite m is the answer
 * itself: +inf (exp(inf - inf) made s NaN) or -inf (every logit -inf). */
SF_HD sf_ce_real sf_ce_lse(int has_nan, sf_ce_real m, sf_ce_real s)
{
    return has_nan ? (sf_ce_real)NAN : isinf(m) ? m : m + SF_CE_LOG(s);
}

/* The loss of a row whose label is a class (not ignored), from the row's
 * lse, on_label = 1 - e (the weight of the label's logit; sf_ce_grad takes
 * it too), the label's logit x_label, sum = sum_j x_j (read only when
 * smoothing), the label smoothing e and the number of classes v. */
SF_HD sf_ce_real sf_ce_loss(sf_ce_real lse, sf_ce_real on_label, sf_ce_real x_label, sf_ce_real sum,
                            sf_ce_real e, int64_t v)
{
    return lse - on_label * x_label - (e > (sf_ce_real)0 ? e / (sf_ce_real)v * sum : (sf_ce_real)0);
}

/* p_j = exp(x_j - lse), the softmax probability of a logit, in two steps
 * so that the row's part is computed once: off = sf_ce_prob_offset(lse) per
 * row, then sf_ce_prob(x_j, off) per element.  On the device p_j is
 * 2^(x log2 e - lse log2 e) (exp2f, the hardware's fast exponential, with
 * one fma for its argument): off = lse log2 e.  On the host it is libm's
 * exp(x - lse): off = lse. */
SF_HD sf_ce_real sf_ce_prob_offset(sf_ce_real lse)
{
#if defined(__CUDA_ARCH__)
    return lse * SF_CE_LOG2E;
#else
    return lse;
#endif
}

SF_HD sf_ce_real sf_ce_prob(sf_ce_real x, sf_ce_real off)
{
#if defined(__CUDA_ARCH__)
    return exp2f(fmaf(x, SF_CE_LOG2E, -off));
#else
    return exp(x - off);
#endif
}

/* dloss / dx_j per unit upstream gradient, from p_j: share = e / V (every
 * class's part of the smoothing), on_label = 1 - e, is_label: j == y. */
SF_HD sf_ce_real sf_ce_grad(sf_ce_real p, sf_ce_real share, sf_ce_real on_label, int is_label)
{
    return p - share - (is_label ? on_label : (sf_ce_real)0);
}

#endif /* SF_CROSS_ENTROPY_H */
