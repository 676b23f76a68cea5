/*
 * float_io.h - one element of a float32 / float16 / bfloat16 buffer read as
 * float or written from float: the access every plain-loop CPU reference
 * (*_cpu.c) makes.  The entries validate dtypes before a backend runs, so any
 * dtype other than float32 and float16 is read and written as bfloat16 here.
 */
#ifndef SF_FLOAT_IO_H
#define SF_FLOAT_IO_H

#include "float_bits.h"
#include "seqfuse.h"

static inline float sf_load_float(const void *p, sf_dtype dtype, int64_t i)
{
    switch (dtype) {
    case SF_FLOAT32: return ((const float *)p)[i];
    case SF_FLOAT16: return sf_f16_to_f32(((const uint16_t *)p)[i]);
    default:         return sf_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static inline void sf_store_float(void *p, sf_dtype dtype, int64_t i, float v)
{
    switch (dtype) {
    case SF_FLOAT32: ((float *)p)[i] = v; break;
    case SF_FLOAT16: ((uint16_t *)p)[i] = sf_f32_to_f16(v); break;
    default:         ((uint16_t *)p)[i] = sf_f32_to_bf16(v); break;
    }
}

/* The same for element i of a tensor view (i in elements from data). */
static inline float sf_tensor_load(const sf_tensor *t, int64_t i)
{
    return sf_load_float(t->data, t->dtype, i);
}

static inline void sf_tensor_store(sf_tensor *t, int64_t i, float v)
{
    sf_store_float(t->data, t->dtype, i, v);
}

#endif /* SF_FLOAT_IO_H */
