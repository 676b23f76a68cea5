/*
 * grouped_backend.h - the backend entry point of the grouped family beyond
 * sf_gemm: the products themselves are sf_gemm calls (the gemm family's CPU
 * reference and cuBLASLt plans); the only device work of the grouped
 * family's own is clearing the output of a group whose inner dimension is
 * empty (a weight gradient of an expert that got no tokens), which the CPU
 * backend does in grouped.c with memset.
 */
#ifndef SF_GROUPED_BACKEND_H
#define SF_GROUPED_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Zero `rows` rows of `row_bytes` bytes, `pitch_bytes` apart, on `stream`. */
sf_status sf_grouped_zero_cuda(void *data, int64_t rows, int64_t row_bytes, int64_t pitch_bytes,
                               int device_id, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SF_GROUPED_BACKEND_H */
