/*
 * float_bits.h - bit-exact conversions between float32 and the 16-bit
 * formats, usable from host C and from CUDA device code.
 *
 * The CPU backend is the definition of correct, so it cannot lean on compiler
 * extensions (_Float16, __bf16) that differ between toolchains.  These are the
 * plain bit manipulations, with round-to-nearest-even for the narrowing
 * direction, matching what CUDA's __float2bfloat16_rn / __float2half_rn do.
 */
#ifndef SF_FLOAT_BITS_H
#define SF_FLOAT_BITS_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define SF_HD static inline __host__ __device__
#else
#define SF_HD static inline
#endif

SF_HD uint32_t sf_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

SF_HD float sf_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f, with an infinity replaced by NaN: what a saturating FP8 conversion (the
 * GPU's satfinite instruction) must be given so that a non-finite input stays
 * non-finite (quant/fp8.h's rule). */
SF_HD float sf_inf_to_nan(float f)
{
    return (sf_f32_bits(f) & 0x7fffffffu) == 0x7f800000u ? sf_bits_f32(0x7fffffffu) : f;
}

SF_HD float sf_bf16_to_f32(uint16_t h) { return sf_bits_f32((uint32_t)h << 16); }

SF_HD uint16_t sf_f32_to_bf16(float f)
{
    uint32_t u = sf_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

SF_HD float sf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) /* inf or NaN */
        return sf_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return sf_bits_f32(sign);
        /* subnormal: value = man * 2^-24 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return sf_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

SF_HD uint16_t sf_f32_to_f16(float f)
{
    uint32_t u = sf_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t au = u & 0x7fffffffu;
    if (au > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (au >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (au < 0x38800000u) { /* below the smallest normal 2^-14: subnormal */
        /* scale so the subnormal step 2^-24 becomes 1, then round to even */
        float a = sf_bits_f32(au) * 16777216.0f;
        uint32_t q = (uint32_t)a;
        float r = a - (float)q;
        if (r > 0.5f || (r == 0.5f && (q & 1u)))
            q++;
        return (uint16_t)(sign | q);
    }
    uint32_t rounded = au + 0xfffu + ((au >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

#endif /* SF_FLOAT_BITS_H */
