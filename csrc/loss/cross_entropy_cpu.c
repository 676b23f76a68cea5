/*
 * cross_entropy_cpu.c - the reference cross-entropy: plain loops per row,
 * accumulated in double (max, then sum of exp, then the loss), the
 * definition of correct the CUDA kernels are tested against.  The formulas
 * (special values of lse, the smoothed loss, the gradient) are
 * cross_entropy.h's, evaluated in double.
 */
#include <math.h>

#include "../core/float_io.h"
#include "cross_entropy.h"
#include "cross_entropy_backend.h"

/* Read as double: the sums here run in double. */
static double load(const sf_tensor *x, int64_t off) { return sf_tensor_load(x, off); }

sf_status sf_cross_entropy_forward_cpu(const sf_tensor *logits, const sf_tensor *labels,
                                       int64_t ignore_index, float label_smoothing,
                                       sf_tensor *loss, sf_tensor *lse)
{
    int64_t n = logits->shape[0], v = logits->shape[1];
    const int64_t *y = (const int64_t *)labels->data;
    double e = label_smoothing;
    for (int64_t i = 0; i < n; ++i) {
        int64_t row = i * logits->strides[0];
        double m = -INFINITY, s = 0.0, sum = 0.0;
        int has_nan = 0;
        for (int64_t j = 0; j < v; ++j) {
            double x = load(logits, row + j);
            m = fmax(m, x);
            has_nan |= x != x;
        }
        for (int64_t j = 0; j < v; ++j) {
            double x = load(logits, row + j);
            s += exp(x - m);
            sum += x;
        }
        double l = sf_ce_lse(has_nan, m, s);
        ((float *)lse->data)[i] = (float)l;
        double value = 0.0;
        if (y[i] != ignore_index)
            value = sf_ce_loss(l, 1.0 - e, load(logits, row + y[i]), sum, e, v);
        ((float *)loss->data)[i] = (float)value;
    }
    return SF_OK;
}

sf_status sf_cross_entropy_backward_cpu(const sf_tensor *logits, const sf_tensor *labels,
                                        const sf_tensor *lse, const sf_tensor *grad_scale,
                                        int64_t ignore_index, float label_smoothing,
                                        sf_tensor *dlogits)
{
    int64_t n = logits->shape[0], v = logits->shape[1];
    const int64_t *y = (const int64_t *)labels->data;
    const float *scales = (const float *)grad_scale->data;
    int per_row = sf_numel(grad_scale) != 1;
    double e = label_smoothing;
    for (int64_t i = 0; i < n; ++i) {
        int64_t in_row = i * logits->strides[0], out_row = i * dlogits->strides[0];
        double scale = scales[per_row ? i : 0];
        double off = sf_ce_prob_offset(((const float *)lse->data)[i]);
        int ignored = y[i] == ignore_index;
        for (int64_t j = 0; j < v; ++j) {
            double g = 0.0;
            if (!ignored)
                g = scale * sf_ce_grad(sf_ce_prob(load(logits, in_row + j), off), e / (double)v, 1.0 - e,
                                       j == y[i]);
            sf_tensor_store(dlogits, out_row + j, (float)g);
        }
    }
    return SF_OK;
}
