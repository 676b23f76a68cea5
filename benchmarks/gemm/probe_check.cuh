/*
 * probe_check.cuh - the error check the standalone cuBLAS / cuBLASLt probes in
 * this folder share: CK(call) prints the file, line and status of a call
 * that did not return 0 (cudaSuccess, CUBLAS_STATUS_SUCCESS) and exits.
 * Included by path from each probe, so each still builds with one nvcc line.
 */
#ifndef SEQFUSE_PROBE_CHECK_CUH
#define SEQFUSE_PROBE_CHECK_CUH

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                       \
    do {                                                                            \
        int e_ = (int)(x);                                                          \
        if (e_ != 0) {                                                              \
            printf("ERR %s:%d status %d\n", __FILE__, __LINE__, e_);                \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

#endif
