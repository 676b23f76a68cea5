/*
 * grouped_backend.h - the backend entry point of the grouped family beyond
 * sf_gemm: the products themselves are sf_gemm calls (the gemm family's CPU
 * reference and cuBLASLt plans); the device work of the grouped family's
 * own is clearing the output of a group whose inner dimension is empty (a
 * weight gradient of an expert that got no tokens), which the CPU backend
 * does in grouped.c with memset, and the lanes: side streams on which the
 * groups' GEMMs run side by side (grouped_cuda.cu says why).
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

/* The side streams of one grouped call between open and close. */
typedef struct {
    int n;            /* lanes open (0: none; the groups run on the caller's stream) */
    int device_id;
    sf_stream caller; /* the stream the call was made on */
    int sm_share;     /* the device's SMs / n: each lane's GEMMs are chosen and sized for these */
    sf_stream stream[SF_GROUPED_MAX_LANES];
} sf_grouped_lanes;

/* Takes device_id's lanes (2 <= n <= SF_GROUPED_MAX_LANES) for one call: each
 * of the n streams waits for the work already on `stream`.  The lanes stay
 * the caller's until sf_grouped_lanes_close, which every successful open
 * must reach (error or not). */
sf_status sf_grouped_lanes_open(int device_id, sf_stream stream, int n, sf_grouped_lanes *lanes);

/* `stream` waits for everything issued on the lanes; releases them.  A
 * no-op when none are open (lanes->n == 0). */
sf_status sf_grouped_lanes_close(sf_grouped_lanes *lanes);

#ifdef __cplusplus
}
#endif

#endif /* SF_GROUPED_BACKEND_H */
