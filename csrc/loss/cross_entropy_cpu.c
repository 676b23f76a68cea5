/*
 * cross_entropy_cpu.c - the reference cross-entropy: plain loops per row,
 * accumulated in double (max, then sum of exp, then the loss), the
 * definition of correct the CUDA kernels are tested against.
 */
#include <math.h>

#include "../core/float_io.h"
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
        /* log-sum-exp as torch.logsumexp: NaN with a NaN logit, +inf with a
         * +inf one, -inf where every logit is -inf (m + log(s) is NaN there) */
        double l = has_nan ? NAN : isinf(m) ? m : m + log(s);
        ((float *)lse->data)[i] = (float)l;
        double value = 0.0;
        if (y[i] != ignore_index)
            value = l - (1.0 - e) * load(logits, row + y[i]) - (e > 0.0 ? e / (double)v * sum : 0.0);
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
        double l = ((const float *)lse->data)[i];
        int ignored = y[i] == ignore_index;
        for (int64_t j = 0; j < v; ++j) {
            double g = 0.0;
            if (!ignored)
                g = scale * (exp(load(logits, in_row + j) - l) - e / (double)v -
                             (j == y[i] ? 1.0 - e : 0.0));
            sf_tensor_store(dlogits, out_row + j, (float)g);
        }
    }
    return SF_OK;
}
