/*
 * float_io.h - one element of a float32 / float16 / bfloat16 buffer read as
 * float or written from float: the access every plain-loop CPU reference
 * (*_cpu.c) makes.  The entries admit only these three dtypes for the
 * tensors a backend reads this way; any other dtype reaching here is a
 * missing check, and stops the process with the dtype named
 * (sf_float_io_abort) instead of reading its bytes as another format.  The
 * three valid cases convert as float_bits.h does; the abort is a cold
 * call out of line, one more compare on the dispatch.
 */
#ifndef SF_FLOAT_IO_H
#define SF_FLOAT_IO_H

#include "float_bits.h"
#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Prints "seqfuse: <what> of an element of dtype <name> ..." to stderr and
 * aborts (status.c). */
void sf_float_io_abort(const char *what, sf_dtype dtype) __attribute__((noreturn, cold));

static inline float sf_load_float(const void *p, sf_dtype dtype, int64_t i)
{
    switch (dtype) {
    case SF_FLOAT32: return ((const float *)p)[i];
    case SF_FLOAT16: return sf_f16_to_f32(((const uint16_t *)p)[i]);
    case SF_BFLOAT16: return sf_bf16_to_f32(((const uint16_t *)p)[i]);
    default: sf_float_io_abort("a load", dtype);
    }
}

static inline void sf_store_float(void *p, sf_dtype dtype, int64_t i, float v)
{
    switch (dtype) {
    case SF_FLOAT32: ((float *)p)[i] = v; break;
    case SF_FLOAT16: ((uint16_t *)p)[i] = sf_f32_to_f16(v); break;
    case SF_BFLOAT16: ((uint16_t *)p)[i] = sf_f32_to_bf16(v); break;
    default: sf_float_io_abort("a store", dtype);
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

#ifdef __cplusplus
}
#endif

#endif /* SF_FLOAT_IO_H */
