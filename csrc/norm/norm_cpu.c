/*
 * norm_cpu.c - the reference LayerNorm / RMSNorm: plain loops, statistics and
 * gradient sums in double, every output rounded once to its dtype.  This is
 * the definition the CUDA kernels are tested against.  The per-element
 * formulas are norm.h's, evaluated in double.
 *
 * The forward computes v = xhat * w + beta in double, rounds it to float32
 * (the value the CUDA kernel holds), then to y's dtype; an FP8 y gets
 * fp8(scale * v); amax[0] becomes max(amax[0], max |v|)
 * (fp8.h's sf_amax_fold: a start below zero counts as 0).
 */
#include <math.h>

#include "../core/float_io.h"
#include "../quant/fp8.h"
#include "norm.h"
#include "norm_backend.h"

/* Read as double: the sums here run in double. */
static double load(const sf_tensor *t, int64_t i) { return sf_tensor_load(t, i); }

/* max |v| on bit patterns, NaN winning, as the CUDA bit-max does. */
static uint32_t max_abs(uint32_t m, float v)
{
    uint32_t b = sf_abs_bits(v);
    return b > m ? b : m;
}

sf_status sf_norm_forward_cpu(const sf_norm_forward_args *a)
{
    const int64_t H = a->hidden;
    const int fp8 = a->y->dtype == SF_FLOAT8_E4M3 || a->y->dtype == SF_FLOAT8_E5M2;
    const float scale = a->scale ? *(const float *)a->scale->data : 1.0f;
    uint32_t amax = 0; /* folded into amax[0] at the end (fp8.h's sf_amax_fold) */
    for (int64_t r = 0; r < a->rows; ++r) {
        const int64_t base = r * H;
        double mean = 0.0;
        if (!a->rms) {
            for (int64_t j = 0; j < H; ++j)
                mean += load(a->x, base + j);
            mean /= (double)H;
        }
        double var = 0.0;
        for (int64_t j = 0; j < H; ++j) {
            double d = load(a->x, base + j) - mean;
            var += d * d;
        }
        var /= (double)H;
        double rstd = sf_norm_rstd(var, a->eps);
        if (a->mean)
            ((float *)a->mean->data)[r] = (float)mean;
        if (a->rstd)
            ((float *)a->rstd->data)[r] = (float)rstd;
        for (int64_t j = 0; j < H; ++j) {
            double w = sf_norm_weight((float)load(a->gamma, j), a->zero_centered_gamma);
            double v = sf_norm_xhat(load(a->x, base + j), mean, rstd) * w;
            if (a->beta)
                v += load(a->beta, j);
            float vf = (float)v;
            amax = max_abs(amax, vf);
            if (!fp8)
                sf_tensor_store(a->y, base + j, vf);
            else if (a->y->dtype == SF_FLOAT8_E4M3)
                ((uint8_t *)a->y->data)[base + j] = sf_f32_to_e4m3(vf * scale);
            else
                ((uint8_t *)a->y->data)[base + j] = sf_f32_to_e5m2(vf * scale);
        }
    }
    if (a->amax && a->rows > 0 && H > 0) {
        float *slot = (float *)a->amax->data;
        *slot = sf_bits_f32(sf_amax_fold(sf_f32_bits(*slot), amax));
    }
    if (a->scale_inv)
        *(float *)a->scale_inv->data = 1.0f / scale;
    return SF_OK;
}

sf_status sf_norm_backward_cpu(const sf_norm_backward_args *a)
{
    const int64_t H = a->hidden;
    /* dgamma / dbeta sums in double, one per column. */
    for (int64_t j = 0; j < H; ++j) {
        double dg = 0.0, db = 0.0;
        for (int64_t r = 0; r < a->rows; ++r) {
            double mean = a->mean ? ((const float *)a->mean->data)[r] : 0.0;
            double rstd = ((const float *)a->rstd->data)[r];
            double dy = load(a->dy, r * H + j);
            dg += dy * (load(a->x, r * H + j) - mean) * rstd;
            db += dy;
        }
        sf_tensor_store(a->dgamma, j, (float)dg);
        if (a->dbeta)
            sf_tensor_store(a->dbeta, j, (float)db);
    }
    for (int64_t r = 0; r < a->rows; ++r) {
        const int64_t base = r * H;
        double mean = a->mean ? ((const float *)a->mean->data)[r] : 0.0;
        double rstd = ((const float *)a->rstd->data)[r];
        double sum_g = 0.0, sum_gx = 0.0;
        for (int64_t j = 0; j < H; ++j) {
            double w = sf_norm_weight((float)load(a->gamma, j), a->zero_centered_gamma);
            double g = load(a->dy, base + j) * w;
            double xhat = sf_norm_xhat(load(a->x, base + j), mean, rstd);
            sum_g += g;
            sum_gx += g * xhat;
        }
        double m1 = a->rms ? 0.0 : sum_g / (double)H, m2 = sum_gx / (double)H;
        for (int64_t j = 0; j < H; ++j) {
            double w = sf_norm_weight((float)load(a->gamma, j), a->zero_centered_gamma);
            double g = load(a->dy, base + j) * w;
            double xhat = sf_norm_xhat(load(a->x, base + j), mean, rstd);
            double dx = sf_norm_dx(rstd, g, xhat, m1, m2);
            if (a->dres)
                dx += load(a->dres, base + j);
            sf_tensor_store(a->dx, base + j, (float)dx);
        }
    }
    return SF_OK;
}
