/*
 * dispatch.h - the CPU/CUDA split every family's C entry ends with.
 *
 * An entry checks its arguments once, then runs the CPU reference or the
 * CUDA backend, chosen by the device of one of its tensors:
 *
 *   return SF_DISPATCH(op, "x", x, sf_amax_cpu(x, out), sf_amax_cuda(x, out, stream));
 *
 * A CPU-only build (no SF_WITH_CUDA) has no CUDA backend: there the CUDA
 * call is not compiled at all (its symbol does not exist) and a CUDA tensor
 * is a NotImplementedError naming the op and the argument that lives on the
 * GPU.  Host code only: the kernels are untouched by it.  Backend headers
 * declare their CUDA entries with SF_SIGNATURE_OF where those take the public
 * entry's own arguments.
 */
#ifndef SF_DISPATCH_H
#define SF_DISPATCH_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The failure of a CUDA tensor (argument `arg` of `op`) in a CPU-only build. */
sf_status sf_fail_no_cuda(const char *op, const char *arg);

#ifdef __cplusplus
}
#endif

/* `cuda_call` in a CUDA build, the failure above in a CPU-only one. */
#ifdef SF_WITH_CUDA
#define SF_IF_CUDA(op, arg, cuda_call) ((void)(op), (void)(arg), (cuda_call))
#else
#define SF_IF_CUDA(op, arg, cuda_call) sf_fail_no_cuda((op), (arg))
#endif

/* cpu_call where tensor t is on the CPU, else SF_IF_CUDA. */
#define SF_DISPATCH(op, arg, t, cpu_call, cuda_call) \
    ((t)->device == SF_CPU ? (cpu_call) : SF_IF_CUDA(op, arg, cuda_call))

/* The type of a public entry, for declaring a backend entry that takes
 * exactly the same arguments:
 *
 *   SF_SIGNATURE_OF(sf_cross_entropy_backward) sf_cross_entropy_backward_cuda;
 *
 * The argument list is then written once, in the public header, and a
 * definition in a .cu file that drifts from it is a compile error (two C
 * functions of one name with different types). */
#ifdef __cplusplus
#define SF_SIGNATURE_OF(public_entry) decltype(public_entry)
#else
#define SF_SIGNATURE_OF(public_entry) __typeof__(public_entry)
#endif

#endif /* SF_DISPATCH_H */
