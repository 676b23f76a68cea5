/*
 * act_cpu.c - the reference activations and dropout: plain loops over every
 * element, the float32 formulas of act.h, each output rounded once to its
 * dtype (or to FP8 of the scaled value).  Column sums (dbias) in double.
 */
#include <math.h>

#include "../core/float_io.h"
#include "../quant/fp8.h"
#include "act.h"
#include "act_backend.h"

/* Store v into t[i]: the tensor's dtype, or FP8 of v * scale. */
static void store(sf_tensor *t, int64_t i, float v, float scale)
{
    switch (t->dtype) {
    case SF_FLOAT8_E4M3: ((uint8_t *)t->data)[i] = sf_f32_to_e4m3(v * scale); break;
    case SF_FLOAT8_E5M2: ((uint8_t *)t->data)[i] = sf_f32_to_e5m2(v * scale); break;
    default: sf_tensor_store(t, i, v); break;
    }
}

/* max |v| on bit patterns, NaN winning (the CUDA bit-max rule). */
static uint32_t max_abs(uint32_t m, float v)
{
    uint32_t b = sf_abs_bits(v);
    return b > m ? b : m;
}

/* amax accumulates (fp8.h's sf_amax_fold; untouched when there is no element) */
static void finish_fp8(const sf_act_args *a, uint32_t amax, float scale)
{
    if (a->amax && a->rows > 0 && a->n > 0) {
        float *slot = (float *)a->amax->data;
        *slot = sf_bits_f32(sf_amax_fold(sf_f32_bits(*slot), amax));
    }
    if (a->scale_inv)
        *(float *)a->scale_inv->data = 1.0f / scale;
}

sf_status sf_act_forward_cpu(const sf_act_args *a)
{
    const float scale = a->scale ? *(const float *)a->scale->data : 1.0f;
    const int64_t in_cols = a->gated ? 2 * a->n : a->n;
    uint32_t amax = 0;
    for (int64_t r = 0; r < a->rows; ++r)
        for (int64_t j = 0; j < a->n; ++j) {
            float v = sf_act_base(a->base, sf_tensor_load(a->x, r * in_cols + j));
            if (a->gated)
                v *= sf_tensor_load(a->x, r * in_cols + a->n + j);
            amax = max_abs(amax, v);
            store(a->out, r * a->n + j, v, scale);
        }
    finish_fp8(a, amax, scale);
    return SF_OK;
}

sf_status sf_act_backward_cpu(const sf_act_args *a)
{
    const float scale = a->scale ? *(const float *)a->scale->data : 1.0f;
    const int64_t in_cols = a->gated ? 2 * a->n : a->n;
    uint32_t amax = 0;
    for (int64_t r = 0; r < a->rows; ++r)
        for (int64_t j = 0; j < a->n; ++j) {
            const float x = sf_tensor_load(a->x, r * in_cols + j);
            const float dy = sf_tensor_load(a->dy, r * a->n + j);
            if (!a->gated) {
                float d = sf_act_chain(a->base, dy, sf_act_base_grad(a->base, x));
                amax = max_abs(amax, d);
                store(a->out, r * in_cols + j, d, scale);
                continue;
            }
            const float gate = sf_tensor_load(a->x, r * in_cols + a->n + j);
            float f, df;
            sf_act_base_both(a->base, x, &f, &df);
            float d_act = sf_act_chain(a->base, dy * gate, df);
            float d_gate = dy * f;
            amax = max_abs(max_abs(amax, d_act), d_gate);
            store(a->out, r * in_cols + j, d_act, scale);
            store(a->out, r * in_cols + a->n + j, d_gate, scale);
        }
    finish_fp8(a, amax, scale);
    return SF_OK;
}

/* Whether flat element i is kept. */
static int kept(const sf_dropout_args *a, int64_t i)
{
    sf_philox4 w = sf_philox(a->seed, a->offset + (uint64_t)i / 4u);
    return (w.v[i % 4] >> 8) < a->threshold;
}

sf_status sf_bias_dropout_add_cpu(const sf_dropout_args *a)
{
    const float keep_scale = sf_dropout_scale(a->p);
    for (int64_t r = 0; r < a->rows; ++r)
        for (int64_t j = 0; j < a->n; ++j) {
            const int64_t i = r * a->n + j;
            float v = sf_tensor_load(a->x, i);
            if (a->bias)
                v += sf_tensor_load(a->bias, j);
            v = kept(a, i) ? v * keep_scale : 0.0f;
            store(a->out, i, sf_tensor_load(a->residual, i) + v, 1.0f);
        }
    return SF_OK;
}

sf_status sf_dropout_backward_cpu(const sf_dropout_args *a)
{
    const float keep_scale = sf_dropout_scale(a->p);
    for (int64_t r = 0; r < a->rows; ++r)
        for (int64_t j = 0; j < a->n; ++j) {
            const int64_t i = r * a->n + j;
            store(a->out, i, kept(a, i) ? sf_tensor_load(a->dy, i) * keep_scale : 0.0f, 1.0f);
        }
    if (a->dbias)
        for (int64_t j = 0; j < a->n; ++j) {
            double s = 0.0;
            for (int64_t r = 0; r < a->rows; ++r) {
                const int64_t i = r * a->n + j;
                if (kept(a, i))
                    s += (double)(sf_tensor_load(a->dy, i) * keep_scale);
            }
            store(a->dbias, j, (float)s, 1.0f);
        }
    return SF_OK;
}
