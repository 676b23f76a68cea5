/*
 * attn_sm90.h - the C face of the kernel choice on Hopper, for the Python
 * binding and the checks: which forward kernel (90: wgmma,
 * attn_forward_sm90_cuda.cu; 80: mma.sync, attn_forward_cuda.cu) and which backward
 * kernel (90: wgmma, attn_backward_sm90_cuda.cu; 80: mma.sync, attn_backward_cuda.cu)
 * a call takes, and switches between them.  Defined in attn_forward_sm90_cuda.cu
 * and attn_backward_sm90_cuda.cu (CUDA builds only).  The C library reads no
 * environment: SEQFUSE_ATTN_FORWARD_KERNEL / SEQFUSE_ATTN_BACKWARD_KERNEL are read by
 * seqfuse.ops (python/seqfuse/ops/attn/_routing.py), which calls the setters.
 */
#ifndef SF_ATTN_SM90_H
#define SF_ATTN_SM90_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pick the forward kernel for the process: 90 (wgmma, where supported; the
 * default) or 80 (mma.sync). */
sf_status sf_attn_set_forward_kernel(int arch);

#ifdef SF_WORKBENCH
/* Check programs only (built with SF_WORKBENCH, csrc/build_checks.sh): the
 * wgmma forward's schedule, 0 to 4 (attn_forward_sm90_workbench.cuh), or -1 for
 * the library's own (forward_schedule in attn_forward_sm90_cuda.cu). */
sf_status sf_attn_set_forward_sm90_schedule(int schedule);
#endif

/* The kernel a forward with this head dim, with dropout (1) or not (0), takes
 * on `device` now: 90 or 80 (dropout runs in the sm80 kernel).
 * When 80, *why (may be NULL) says why: "" where 80 is simply the kernel
 * for that device (not compute capability 9.0), otherwise the reason a
 * Hopper device gets the slower kernel (choice, head dim, build). */
int sf_attn_forward_kernel_for(int head_dim, int dropout, int device, const char **why);

/* Pick the backward kernel for the process: 90 (wgmma, where supported; the
 * default) or 80 (mma.sync). */
sf_status sf_attn_set_backward_kernel(int arch);

/* The kernel a backward with this head dim, deterministic flag and dropout
 * (1) or not (0) takes on `device` now: 90 or 80, *why as in
 * sf_attn_forward_kernel_for (plus the deterministic mode, which the wgmma
 * backward's atomic dQ cannot give, and dropout, which it lacks). */
int sf_attn_backward_kernel_for(int head_dim, int deterministic, int dropout, int device, const char **why);

#ifdef __cplusplus
}
#endif

#endif /* SF_ATTN_SM90_H */
