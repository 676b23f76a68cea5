/*
 * amax_cpu.c - the reference amax: a plain loop over every element, in any
 * stride layout.  NaN propagates (the result is NaN if any input is).
 */
#include <math.h>

#include "../core/float_io.h"
#include "amax_backend.h"

sf_status sf_amax_cpu(const sf_tensor *x, sf_tensor *out)
{
    int64_t n = sf_numel(x);
    int64_t index[SF_MAX_DIMS] = {0};
    float result = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        int64_t offset = 0;
        for (int d = 0; d < x->ndim; ++d)
            offset += index[d] * x->strides[d];
        float a = fabsf(sf_tensor_load(x, offset));
        if (isnan(a) || a > result)
            result = isnan(result) ? result : a;
        /* advance the multi-index, last dimension fastest */
        for (int d = x->ndim - 1; d >= 0; --d) {
            if (++index[d] < x->shape[d])
                break;
            index[d] = 0;
        }
    }
    *(float *)out->data = result;
    return SF_OK;
}
