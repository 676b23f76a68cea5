/*
 * optim_cpu.c - reference multi-tensor ops: plain loops, tensor by tensor,
 * element by element.  AdamW uses the same fp32 element update as the CUDA
 * kernel (adamw.h), its moments loaded from and stored to their dtype
 * (float32, or bfloat16 rounded to nearest even); the l2 norm accumulates in
 * double.
 */
#include <math.h>

#include "../core/float_io.h"
#include "optim_backend.h"

sf_status sf_multi_tensor_adamw_cpu(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                    sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                    const sf_adamw_consts *k)
{
    for (int64_t t = 0; t < n; ++t) {
        int64_t numel = sf_numel(&params[t]);
        float *w = master ? (float *)master[t].data : NULL;
        for (int64_t i = 0; i < numel; ++i) {
            float p = w ? w[i] : sf_tensor_load(&params[t], i);
            float m = sf_tensor_load(&exp_avg[t], i), v = sf_tensor_load(&exp_avg_sq[t], i);
            sf_adamw_update(k, sf_tensor_load(&grads[t], i), &p, &m, &v);
            sf_tensor_store(&exp_avg[t], i, m);
            sf_tensor_store(&exp_avg_sq[t], i, v);
            if (w)
                w[i] = p;
            sf_tensor_store(&params[t], i, p);
        }
    }
    return SF_OK;
}

sf_status sf_multi_tensor_l2norm_cpu(int64_t n, const sf_tensor *tensors, sf_tensor *out)
{
    double sum = 0.0;
    for (int64_t t = 0; t < n; ++t) {
        int64_t numel = sf_numel(&tensors[t]);
        for (int64_t i = 0; i < numel; ++i) {
            double x = sf_tensor_load(&tensors[t], i);
            sum += x * x;
        }
    }
    *(float *)out->data = (float)sqrt(sum);
    return SF_OK;
}

sf_status sf_multi_tensor_scale_cpu(int64_t n, sf_tensor *tensors, const sf_tensor *scale)
{
    float s = *(const float *)scale->data;
    if (s == 1.0f)
        return SF_OK; /* x * 1 is x (the CUDA kernel skips its pass too) */
    for (int64_t t = 0; t < n; ++t) {
        int64_t numel = sf_numel(&tensors[t]);
        for (int64_t i = 0; i < numel; ++i)
            sf_tensor_store(&tensors[t], i, sf_tensor_load(&tensors[t], i) * s);
    }
    return SF_OK;
}
