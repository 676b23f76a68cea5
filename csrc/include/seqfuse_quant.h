/*
 * seqfuse_quant.h - public C API of the quant family: FP8/FP4 formats: amax, casts, transposes, block scales, scaling state (csrc/quant/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_QUANT_H
#define SEQFUSE_QUANT_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[0] = max |x| over all elements of x, as float32.
 * x: float32, float16 or bfloat16, any shape and strides, any size (an empty
 *    tensor gives 0).
 * out: float32, one element, same device as x.
 * NaN in x propagates to out. Runs on `stream` for CUDA tensors. */
sf_status sf_amax(const sf_tensor *x, sf_tensor *out, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_QUANT_H */
