/*
 * seqfuse_gemm.h - public C API of the gemm family: matrix products over cuBLASLt (csrc/gemm/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_GEMM_H
#define SEQFUSE_GEMM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_GEMM_H */
