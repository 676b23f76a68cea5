/*
 * block_max.cuh - the block-wide maximum of 32-bit patterns, published to
 * global memory with one atomicMax per block: how every kernel that fuses an
 * amax (cast and amax in quant, act, norm) folds its threads' maxima.  The
 * bits of non-negative floats order like the floats, so an amax travels as
 * its bits.  CUDA device code only.
 */
#ifndef SF_BLOCK_MAX_CUH
#define SF_BLOCK_MAX_CUH

#include <stdint.h>

/* Max of v over the 32 lanes of a warp (every lane gets it). */
__device__ __forceinline__ uint32_t sf_warp_max_bits(uint32_t v)
{
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

/* Folds v into *out for the whole block: t is the calling thread's linear
 * index in the block and nwarps the block's warp count; red holds one
 * shared-memory slot per warp.  Every thread of the block must call it (it
 * has a barrier).  The first warp folds the warps' maxima and lane 0
 * publishes with a signed atomicMax (fp8.h's sf_amax_fold: a negative start
 * loses to 0). */
__device__ __forceinline__ void sf_block_max_publish(uint32_t v, unsigned t, int nwarps, uint32_t *red, unsigned *out)
{
    v = sf_warp_max_bits(v);
    const int lane = t & 31, warp = t >> 5;
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? red[lane] : 0u;
        v = sf_warp_max_bits(v);
        if (lane == 0)
            atomicMax(reinterpret_cast<int *>(out), (int)v);
    }
}

#endif /* SF_BLOCK_MAX_CUH */
