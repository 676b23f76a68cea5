/*
 * gemm_backend.h - the backend entry points behind sf_gemm: the CPU
 * reference (gemm_cpu.c) and cuBLASLt (gemm_cuda.cu).  gemm.c has validated
 * the call and folded it into an sf_gemm_problem (gemm.h) before either is
 * called.
 */
#ifndef SF_GEMM_BACKEND_H
#define SF_GEMM_BACKEND_H

#include "gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_gemm_cpu(const sf_gemm_problem *p);
sf_status sf_gemm_cuda(const sf_gemm_problem *p, sf_stream stream);
/* sf_gemm_tune's CUDA part: times[0..2] as its timings (written). */
sf_status sf_gemm_tune_cuda(const sf_gemm_problem *p, int candidates, float *times, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SF_GEMM_BACKEND_H */
