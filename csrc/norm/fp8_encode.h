/*
 * fp8_encode.h - float32 -> FP8 (E4M3 / E5M2) encoding with round to nearest
 * even and saturation to the largest finite value, as the fused "output in
 * FP8" paths of the norm and act families need it.  Usable from host C and
 * device code.
 *
 * The bit manipulation below is the definition (the CPU backends use it);
 * on sm_89 and newer the CUDA kernels use the hardware conversion
 * (cvt.rn.satfinite), which rounds the same way: the standalone checks compare
 * the two bit for bit.  NaN encodes as 0x7F in both formats; infinity
 * saturates like any other out-of-range value (what .satfinite does).
 *
 * E4M3 (e4m3fn): bias 7, 3 mantissa bits, max 448 (0x7E), min normal 2^-6,
 *   subnormal step 2^-9.
 * E5M2: bias 15, 2 mantissa bits, max 57344 (0x7B), min normal 2^-14,
 *   subnormal step 2^-16.
 */
#ifndef SF_FP8_ENCODE_H
#define SF_FP8_ENCODE_H

#include <math.h>
#include <stdint.h>

#include "../core/float_bits.h"

#define SF_E4M3_MAX 448.0f
#define SF_E5M2_MAX 57344.0f

/* Round a non-negative finite float to `mant` mantissa bits, keeping its
 * float encoding (round to nearest, ties to even). */
SF_HD uint32_t sf_fp8_round_bits(uint32_t u, int mant)
{
    int drop = 23 - mant;
    u += (1u << (drop - 1)) - 1u + ((u >> drop) & 1u);
    return u & ~((1u << drop) - 1u);
}

SF_HD uint8_t sf_f32_to_e4m3(float f)
{
    uint32_t u = sf_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u)
        return 0x7f;
    float a = sf_bits_f32(au);
    if (a > SF_E4M3_MAX)
        return (uint8_t)(sign | 0x7e);
    if (a < 0.015625f) { /* 2^-6: subnormal, step 2^-9 (q = 8 is the min normal) */
        float q = rintf(a * 512.0f);
        return (uint8_t)(sign | (uint8_t)q);
    }
    uint32_t r = sf_fp8_round_bits(au, 3);
    uint32_t e = (r >> 23) - 127u + 7u;
    return (uint8_t)(sign | (e << 3) | ((r >> 20) & 7u));
}

SF_HD uint8_t sf_f32_to_e5m2(float f)
{
    uint32_t u = sf_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u)
        return 0x7f;
    float a = sf_bits_f32(au);
    if (a > SF_E5M2_MAX)
        return (uint8_t)(sign | 0x7b);
    if (a < 6.103515625e-05f) { /* 2^-14: subnormal, step 2^-16 */
        float q = rintf(a * 65536.0f);
        return (uint8_t)(sign | (uint8_t)q);
    }
    uint32_t r = sf_fp8_round_bits(au, 2);
    uint32_t e = (r >> 23) - 127u + 15u;
    return (uint8_t)(sign | (e << 2) | ((r >> 21) & 3u));
}

#endif /* SF_FP8_ENCODE_H */
