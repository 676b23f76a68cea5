/*
 * vec_io.cuh - device helpers the memory-bound kernels share (norm, act and
 * rope use all of it; loss and optim the conversions and vector type): N
 * elements moved as one 16-byte (or narrower) vector access and converted to
 * / from float, FP8 stores of scaled values, and the block-wide max that
 * folds an amax into global memory with one atomicMax on the float's bits per
 * block (non-negative floats order like their bits; a NaN's bits order above
 * +inf, so NaN wins, as the CPU references say), and the occupancy query that
 * sizes their grids (cached for every host thread: launch_cache.cuh).
 *
 * FP8 encoding: the hardware conversion (cvt.rn.satfinite) on sm_89 and newer,
 * given NaN for an infinity, else quant/fp8.h's bit manipulation, which is the
 * same rule (round to nearest even, saturate a finite value to the largest
 * finite value, NaN and infinities -> 0x7f).
 */
#ifndef SF_VEC_IO_CUH
#define SF_VEC_IO_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "seqfuse.h"
#include "block_max.cuh"
#include "cuda_util.h"
#include "launch_cache.cuh"
#include "../quant/fp8.h"

namespace sf_vec {

/* What an output holds: the input's dtype, or FP8 of the scaled value. */
enum OutKind { kOutSame = 0, kOutE4M3 = 1, kOutE5M2 = 2 };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}

/* N elements moved as one (or two, past 16 bytes) vector access. */
template <typename T, int N>
struct alignas(N * sizeof(T) >= 16 ? 16 : N * sizeof(T)) Pack {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_f(const T *p, float (&out)[N])
{
    Pack<T, N> pk = *reinterpret_cast<const Pack<T, N> *>(p);
#pragma unroll
    for (int k = 0; k < N; ++k)
        out[k] = to_f(pk.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store_f(T *p, const float (&v)[N])
{
    Pack<T, N> pk;
#pragma unroll
    for (int k = 0; k < N; ++k)
        pk.v[k] = from_f<T>(v[k]);
    *reinterpret_cast<Pack<T, N> *>(p) = pk;
}

/* gamma / beta are x's dtype or float32, decided per call (a uniform branch). */
template <typename T, int N>
__device__ __forceinline__ void load_param(const void *p, int f32, int64_t i, float (&out)[N])
{
    if (f32)
        load_f<float, N>((const float *)p + i, out);
    else
        load_f<T, N>((const T *)p + i, out);
}

__device__ __forceinline__ uint8_t enc_e4m3(float f)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    f = sf_inf_to_nan(f); /* (satfinite alone would saturate an infinity: fp8.h's rule) */
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
#else
    return sf_f32_to_e4m3(f);
#endif
}

__device__ __forceinline__ uint8_t enc_e5m2(float f)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    f = sf_inf_to_nan(f); /* (satfinite alone would saturate an infinity: fp8.h's rule) */
    return (uint8_t)__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E5M2);
#else
    return sf_f32_to_e5m2(f);
#endif
}

template <int N>
__device__ __forceinline__ void store_fp8(uint8_t *p, const float (&v)[N], float scale, int e5m2)
{
    Pack<uint8_t, N> pk;
#pragma unroll
    for (int k = 0; k < N; ++k)
        pk.v[k] = e5m2 ? enc_e5m2(v[k] * scale) : enc_e4m3(v[k] * scale);
    *reinterpret_cast<Pack<uint8_t, N> *>(p) = pk;
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

/* Block-wide max of bit patterns, folded into *out by one atomicMax, for
 * blocks of any shape (block_max.cuh). */
__device__ __forceinline__ void block_publish_max(unsigned m, unsigned *red, unsigned *out)
{
    sf_block_max_publish(m, threadIdx.y * blockDim.x + threadIdx.x, (blockDim.x * blockDim.y) >> 5, red, out);
}

/* Column sums of per-block partials, in a fixed order (deterministic):
 * out0[j] = sum_p ws[p][j] (blockIdx.y 0) and out1[j] = sum_p ws[parts + p][j]
 * (blockIdx.y 1), ws being [2][parts][n] float32.  Block (32, 8): 32 columns,
 * 8 interleaved slices of the parts, folded in shared memory. */
template <typename G>
__global__ void column_sum_kernel(const float *ws, int parts, int hidden, G *out0, G *out1)
{
    __shared__ float s[8][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    const float *src = ws + (int64_t)blockIdx.y * parts * hidden;
    float acc = 0.0f;
    if (col < hidden)
        for (int j = threadIdx.y; j < parts; j += 8)
            acc += src[(int64_t)j * hidden + col];
    s[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < hidden) {
        float t = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            t += s[i][threadIdx.x];
        G *dst = blockIdx.y ? out1 : out0;
        dst[col] = from_f<G>(t);
    }
}

/* column_sum_kernel over ws [parts, n] into out [n] of G (out1 unused): one
 * column of 32 threads by 8 slices per block.  `op` names the caller in a
 * launch failure. */
template <typename G>
inline sf_status launch_column_sums(const char *op, const float *ws, int parts, int64_t n, void *out,
                                    cudaStream_t stream)
{
    dim3 grid((unsigned)((n + 31) / 32), 1);
    column_sum_kernel<G><<<grid, dim3(32, 8), 0, stream>>>(ws, parts, (int)n, (G *)out, (G *)NULL);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

/* Multiprocessors of a device (cached: asked once per device). */
inline sf_status sm_count(const char *op, int device, int *sms)
{
    cudaError_t e = sf_cuda_query_sm_count(device, sms);
    if (e != cudaSuccess)
        return sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s (multiprocessor count)", op,
                       cudaGetErrorName(e), cudaGetErrorString(e));
    return SF_OK;
}

inline int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Blocks of a kernel that fit on one SM at once (asked once per kernel,
 * block size, shared memory and device, then remembered): the size of a
 * persistent or grid-stride launch that fills the GPU exactly once. */
struct OccupancyKey {
    const void *kernel;
    int threads;
    size_t smem;
    int device;
    bool operator==(const OccupancyKey &o) const
    {
        return kernel == o.kernel && threads == o.threads && smem == o.smem && device == o.device;
    }
};

template <typename K>
sf_status blocks_per_sm(const char *op, K kernel, int threads, size_t smem, int device, int *per_sm)
{
    static sf_launch_cache<OccupancyKey, 128> cache;
    const OccupancyKey key = {(const void *)kernel, threads, smem, device};
    int64_t known;
    if (cache.find(key, &known)) {
        *per_sm = (int)known;
        return SF_OK;
    }
    int n = 0;
    SF_CUDA_TRY(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    if (n < 1)
        n = 1;
    {
        std::lock_guard<std::mutex> hold(cache.lock());
        cache.put(key, n);
    }
    *per_sm = n;
    return SF_OK;
}

} // namespace sf_vec

#endif /* SF_VEC_IO_CUH */
