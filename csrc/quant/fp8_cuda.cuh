/*
 * fp8_cuda.cuh - device helpers shared by the quant kernels: loading eight
 * input values as floats with 16-byte loads, converting pairs to FP8, and
 * the block-wide max that publishes an amax with one atomic per block.
 *
 * FP8 conversion: on sm_89 and newer the hardware instruction
 * cvt.rn.satfinite.{e4m3,e5m2}x2.f32 converts two floats at once with
 * round-to-nearest-even and saturation, the same rule as fp8.h once an
 * infinity is made NaN first (the instruction alone would saturate it; NaN
 * gives 0x7f; check_cast.cu compares the two over all 2^32 float32 inputs).
 * Define SF_FP8_SOFTWARE_CVT to use fp8.h's integer code on the device as
 * well.
 */
#ifndef SF_FP8_CUDA_CUH
#define SF_FP8_CUDA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "../core/block_max.cuh"
#include "fp8.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(SF_FP8_SOFTWARE_CVT)
#define SF_FP8_HW_CVT 1
#endif

/* Two floats -> two FP8 bytes, a in the low byte. */
template <bool E5M2>
__device__ __forceinline__ uint32_t sf_cvt2(float a, float b)
{
#if defined(SF_FP8_HW_CVT)
    a = sf_inf_to_nan(a);
    b = sf_inf_to_nan(b);
    unsigned short r;
    if (E5M2)
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(a), "f"(b));
    else
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(a), "f"(b));
    return r;
#else
    return (uint32_t)sf_f32_to_fp8(a, E5M2) | ((uint32_t)sf_f32_to_fp8(b, E5M2) << 8);
#endif
}

/* Four floats -> one word of FP8 bytes (v[0] in the low byte). */
template <bool E5M2>
__device__ __forceinline__ uint32_t sf_cvt4(const float *v)
{
    return sf_cvt2<E5M2>(v[0], v[1]) | (sf_cvt2<E5M2>(v[2], v[3]) << 16);
}

__device__ __forceinline__ float sf_to_float(float v) { return v; }
__device__ __forceinline__ float sf_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float sf_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

/* Eight consecutive values as floats; p must be 16-byte aligned. */
template <typename T>
__device__ __forceinline__ void sf_load8(const T *p, float *v)
{
    if constexpr (sizeof(T) == 4) {
        float4 a = __ldg(reinterpret_cast<const float4 *>(p));
        float4 b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        uint4 raw = __ldg(reinterpret_cast<const uint4 *>(p));
        const T *h = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = sf_to_float(h[i]);
    }
}

/* The raw 16 bytes (2-byte types) or 32 bytes (float32) of eight values:
 * loads issued early keep few registers busy until they are converted. */
template <typename T>
struct sf_raw8 {
    uint4 a;
};
template <>
struct sf_raw8<float> {
    uint4 a, b;
};

template <typename T>
__device__ __forceinline__ void sf_load_raw8(const T *p, sf_raw8<T> &r)
{
    r.a = __ldg(reinterpret_cast<const uint4 *>(p));
    if constexpr (sizeof(T) == 4)
        r.b = __ldg(reinterpret_cast<const uint4 *>(p) + 1);
}

template <typename T>
__device__ __forceinline__ void sf_unpack8(const sf_raw8<T> &r, float *v)
{
    if constexpr (sizeof(T) == 4) {
        const float *a = reinterpret_cast<const float *>(&r.a);
        const float *b = reinterpret_cast<const float *>(&r.b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = a[i];
            v[i + 4] = b[i];
        }
    } else {
        const T *h = reinterpret_cast<const T *>(&r.a);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = sf_to_float(h[i]);
    }
}

__device__ __forceinline__ void sf_store_from_float(float *p, float v) { *p = v; }
__device__ __forceinline__ void sf_store_from_float(__half *p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void sf_store_from_float(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }

/* A dequantized value: NaN as the bits fp8.h defines (SF_DEQUANT_NAN_*), the
 * same as the CPU reference writes, not the conversion's canonical NaN. */
__device__ __forceinline__ void sf_store_dequant(float *p, float v)
{
    *p = isnan(v) ? __uint_as_float(SF_DEQUANT_NAN_F32) : v;
}
__device__ __forceinline__ void sf_store_dequant(__half *p, float v)
{
    *p = isnan(v) ? __ushort_as_half(SF_DEQUANT_NAN_F16) : __float2half_rn(v);
}
__device__ __forceinline__ void sf_store_dequant(__nv_bfloat16 *p, float v)
{
    *p = isnan(v) ? __ushort_as_bfloat16(SF_DEQUANT_NAN_BF16) : __float2bfloat16_rn(v);
}

/* Block-wide unsigned max; thread 0 folds it into *out with atomicMax.
 * Every thread of the block must call it. */
template <int kThreads>
__device__ __forceinline__ void sf_block_atomic_max_bits(uint32_t v, unsigned *out)
{
    __shared__ uint32_t warp_max[kThreads / 32];
    sf_block_max_publish(v, threadIdx.x, kThreads / 32, warp_max, out);
}

/* The same folding a float amax held as its bits (the bits of a
 * non-negative float order like the float; NaN wins). */
template <int kThreads>
__device__ __forceinline__ void sf_block_atomic_max(uint32_t v, float *out)
{
    sf_block_atomic_max_bits<kThreads>(v, reinterpret_cast<unsigned *>(out));
}

#endif /* SF_FP8_CUDA_CUH */
