/*
 * async_copy.cuh - Ampere-style asynchronous copies from global into shared
 * memory (cp.async), for kernels that keep loads in flight while they
 * compute or wait at a barrier (the grouped SwiGLU backward's staged rows).
 * The attention kernels keep their own forms in attn_cuda.cuh, without the
 * clobbers: a barrier follows each of their waits.
 *
 * A thread issues 16-byte copies, closes them into a group (commit) and
 * later waits until at most N of its groups are still in flight (wait<N>).
 * The wait covers this thread's own copies only: data another thread
 * copied also needs a barrier.  The asm statements clobber memory, so the
 * compiler keeps ordinary shared-memory reads and writes on their side of
 * them.  Only CUDA translation units include this header.
 */
#ifndef SF_ASYNC_COPY_CUH
#define SF_ASYNC_COPY_CUH

#include <stdint.h>

/* The shared-window address of a pointer into shared memory. */
__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* 16 bytes global -> shared; src_bytes = 0 writes 16 zero bytes, reads nothing. */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif /* SF_ASYNC_COPY_CUH */
