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
    int sm_share;     /* the device's SMs / n when n groups fit side by side (each lane's
                         GEMMs are chosen and sized for these), else 0 (the whole GPU) */
    sf_stream stream[SF_GROUPED_MAX_LANES];
    void *set;        /* the lane set held (grouped_cuda.cu's) */
} sf_grouped_lanes;

/* Takes device_id's lanes for one call of `groups` non-empty groups of
 * `tiles` output tiles on average: n of them (2 <= n <=
 * SF_GROUPED_MAX_LANES), or with n = 0 as many as the device's SMs hold
 * such groups side by side, at most SF_GROUPED_AUTO_LANES, and none when
 * fewer than two fit; never more than `groups` (none, lanes->n = 0, when
 * that leaves fewer than 2, or when `stream` finds no lane set of its own
 * left: grouped_cuda.cu's note).  Each stream taken waits for the work already on `stream`; they stay the
 * caller's until sf_grouped_lanes_close, which every successful open must
 * reach (error or not). */
sf_status sf_grouped_lanes_open(int device_id, sf_stream stream, int n, int64_t tiles, int groups,
                                sf_grouped_lanes *lanes);

/* The most lanes n = 0 takes.  Measured on an H100 (s44, Mixtral-small's
 * experts at 64 groups of 512 rows, 32 tiles each): 4 lanes ran the down
 * projection at 1.73x one stream's rate, 8 at 1.67x, 2 at 1.35x; groups of
 * 128 tiles or more (8 or 16 experts) lost up to 2.9x on lanes sized for a
 * share of the SMs, and moved -5 to +10 % on 2 lanes of whole-GPU
 * algorithms, mostly up, which Mixtral-small's training step did not
 * repay (grouped_cuda.cu: none for such groups). */
#define SF_GROUPED_AUTO_LANES 4

/* `stream` waits for everything issued on the lanes; releases them.  A
 * no-op when none are open (lanes->n == 0). */
sf_status sf_grouped_lanes_close(sf_grouped_lanes *lanes);

#ifdef __cplusplus
}
#endif

#endif /* SF_GROUPED_BACKEND_H */
