/*
 * attn_backend.h - the backend entry points behind sf_attn_forward / sf_attn_backward:
 * the CPU reference (attn_cpu.c) and the CUDA kernels (attn_forward_cuda.cu and
 * attn_backward_cuda.cu, which hand Hopper's calls to the sm90 kernels).  attn.c
 * has validated the call and resolved it into an sf_attn_problem (attn.h)
 * before either is called.
 */
#ifndef SF_ATTN_BACKEND_H
#define SF_ATTN_BACKEND_H

#include "attn.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_attn_forward_cpu(const sf_attn_problem *p);
sf_status sf_attn_backward_cpu(const sf_attn_problem *p);
sf_status sf_attn_forward_cuda(const sf_attn_problem *p, sf_stream stream, int device);
sf_status sf_attn_backward_cuda(const sf_attn_problem *p, sf_stream stream, int device);

#ifdef __cplusplus
}
#endif

#endif /* SF_ATTN_BACKEND_H */
