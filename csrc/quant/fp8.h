/*
 * fp8.h - the low-precision number formats of seqfuse, as plain bit
 * manipulation usable from host C and CUDA device code, so the CPU reference
 * and the CUDA kernels produce the same bits.
 *
 *   E4M3 (float8_e4m3fn): bias 7, no inf, NaN = 0x7f/0xff, max 448.
 *   E5M2 (float8_e5m2):   bias 15, IEEE-like, max 57344.
 *   E8M0 (float8_e8m0fnu): 2^(e-127), e = 0..254, 0xff = NaN (block scales).
 *   E2M1 (fp4): values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
 *
 * Narrowing is round-to-nearest-even with saturation: a finite value beyond
 * the largest finite value becomes that value (with the sign); NaN and the
 * infinities become NaN, 0x7f (both FP8 formats), so a non-finite input
 * stays non-finite through a cast (an overflow a loss scaler or the user
 * must see; the GPU's satfinite conversion alone would make an infinity the
 * largest finite value: the device helpers turn infinities into NaN first).
 * Inside the finite range the result equals torch's float8 casts, which
 * round to nearest even but turn out-of-range values into NaN (E4M3) or inf
 * (E5M2) instead of saturating.
 *
 * Arithmetic that must match bit for bit between host and device goes
 * through SF_MUL / SF_DIV, which forbid the device compiler from fusing a
 * multiply into an add (nvcc contracts a*b+c into fma by default).
 */
#ifndef SF_FP8_H
#define SF_FP8_H

#include <stdint.h>

#include "../core/float_bits.h"

#if defined(__CUDA_ARCH__)
#define SF_MUL(a, b) __fmul_rn((a), (b))
#define SF_DIV(a, b) __fdiv_rn((a), (b))
#else
#define SF_MUL(a, b) ((a) * (b))
#define SF_DIV(a, b) ((a) / (b))
#endif

#define SF_E4M3_MAX 448.0f
#define SF_E5M2_MAX 57344.0f
#define SF_E2M1_MAX 6.0f
#define SF_FLT_MAX 3.402823466e+38f

/* Round mant * 2^-shift to the nearest integer, ties to even.
 * mant < 2^24, 1 <= shift; shift >= 25 always gives 0. */
SF_HD uint32_t sf_round_shift_rne(uint32_t mant, uint32_t shift)
{
    if (shift >= 25u)
        return 0u;
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return q;
}

/* The body of a float32 -> FP8 conversion for a format with MBITS mantissa
 * bits and exponent bias BIAS, RNE, saturating: a finite value at or beyond
 * the largest finite value (float32 bits MAX_BITS, code MAX_CODE) gives that
 * code with the sign; NaN and the infinities give 0x7f.  A macro, not a function taking the
 * format, so that each format's body has literal constants: the device
 * compiler then emits exactly the code of two hand-written bodies. */
#define SF_F32_TO_FP8_BODY(f, MBITS, BIAS, MAX_BITS, MAX_CODE)                                     \
    uint32_t u = sf_f32_bits(f);                                                                    \
    uint32_t sign = (u >> 24) & 0x80u;                                                              \
    uint32_t au = u & 0x7fffffffu;                                                                  \
    if (au >= 0x7f800000u) /* NaN or an infinity: NaN */                                          \
        return 0x7f;                                                                                \
    if (au >= (MAX_BITS))                                                                           \
        return (uint8_t)(sign | (MAX_CODE));                                                        \
    if (au < (128u - (BIAS)) << 23) { /* below 2^(1 - BIAS): subnormal, step 2^(1 - BIAS - MBITS) */ \
        uint32_t e = au >> 23;                                                                      \
        if (e == 0u) /* float32 subnormals are far below half a step */                             \
            return (uint8_t)sign;                                                                   \
        uint32_t mant = (au & 0x7fffffu) | 0x800000u;                                               \
        /* value / step = mant * 2^(e - 127 - 23 + BIAS - 1 + MBITS) */                             \
        return (uint8_t)(sign | sf_round_shift_rne(mant, 151u - (BIAS) - (MBITS) - e));             \
    }                                                                                               \
    /* round away the 23 - MBITS low mantissa bits, then rebias 127 -> BIAS */                      \
    uint32_t rounded = au + ((1u << (22u - (MBITS))) - 1u) + ((au >> (23u - (MBITS))) & 1u);        \
    return (uint8_t)(sign | ((rounded - ((127u - (BIAS)) << 23)) >> (23u - (MBITS))))

/* float32 -> E4M3 bits (448 = 0x43e00000 is code 0x7e). */
SF_HD uint8_t sf_f32_to_e4m3(float f) { SF_F32_TO_FP8_BODY(f, 3u, 7u, 0x43e00000u, 0x7eu); }

/* float32 -> E5M2 bits (57344 = 0x47600000 is code 0x7b). */
SF_HD uint8_t sf_f32_to_e5m2(float f) { SF_F32_TO_FP8_BODY(f, 2u, 15u, 0x47600000u, 0x7bu); }
#undef SF_F32_TO_FP8_BODY /* the two functions above are its only users */

SF_HD float sf_e4m3_to_f32(uint8_t b)
{
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    if ((b & 0x7fu) == 0x7fu)
        return sf_bits_f32(sign | 0x7fc00000u);
    if (exp == 0u) { /* man * 2^-9, exact */
        float v = (float)man * (1.0f / 512.0f);
        return sign ? -v : v;
    }
    return sf_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

SF_HD float sf_e5m2_to_f32(uint8_t b)
{
    /* E5M2 is the top byte of an IEEE half */
    return sf_f16_to_f32((uint16_t)((uint16_t)b << 8));
}

/* What dequantization writes for NaN: a NaN code (E4M3 0x7f/0xff, E5M2
 * exponent 31 with a nonzero mantissa) times scale_inv, or any NaN product,
 * becomes the positive default quiet NaN of the output dtype on both
 * backends.  Sign and payload are not kept: the GPU's multiply and
 * conversions replace them with their own canonical NaN (0x7fffffff,
 * 0x7fff) while the host's keep them (E5M2 0x7d would give 0x7fe00000), so
 * only an explicit pattern is the same bits on both. */
#define SF_DEQUANT_NAN_F32 0x7fc00000u
#define SF_DEQUANT_NAN_F16 ((uint16_t)0x7e00u)
#define SF_DEQUANT_NAN_BF16 ((uint16_t)0x7fc0u)

/* Which FP8 format: 0 = E4M3, 1 = E5M2 (kernels take it as a flag). */
SF_HD uint8_t sf_f32_to_fp8(float f, int e5m2)
{
    return e5m2 ? sf_f32_to_e5m2(f) : sf_f32_to_e4m3(f);
}

SF_HD float sf_fp8_to_f32(uint8_t b, int e5m2)
{
    return e5m2 ? sf_e5m2_to_f32(b) : sf_e4m3_to_f32(b);
}

SF_HD float sf_fp8_max(int e5m2) { return e5m2 ? SF_E5M2_MAX : SF_E4M3_MAX; }

/* ---- E2M1 (fp4) ---------------------------------------------------------
 * Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.  RNE on this
 * grid: a tie goes to the even code.  NaN has no encoding: it becomes +6
 * (block scales of a NaN block are NaN, which is where it shows). */
SF_HD uint8_t sf_f32_to_e2m1(float f)
{
    uint32_t u = sf_f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 28) & 0x8u);
    float a = sf_bits_f32(u & 0x7fffffffu);
    if (!(a == a))
        return 0x7;
    uint8_t code;
    if (a <= 0.25f) code = 0;       /* 0.25: tie 0 | 0.5 -> 0 (even) */
    else if (a < 0.75f) code = 1;   /* 0.75: tie 0.5 | 1 -> 1 */
    else if (a <= 1.25f) code = 2;  /* 1.25: tie 1 | 1.5 -> 1 */
    else if (a < 1.75f) code = 3;   /* 1.75: tie 1.5 | 2 -> 2 */
    else if (a <= 2.5f) code = 4;   /* 2.5: tie 2 | 3 -> 2 */
    else if (a < 3.5f) code = 5;    /* 3.5: tie 3 | 4 -> 4 */
    else if (a <= 5.0f) code = 6;   /* 5: tie 4 | 6 -> 4 */
    else code = 7;                  /* saturate at 6 */
    return (uint8_t)(sign | code);
}

SF_HD float sf_e2m1_to_f32(uint8_t code)
{
    float mag;
    switch (code & 7u) {
    case 0: mag = 0.0f; break;
    case 1: mag = 0.5f; break;
    case 2: mag = 1.0f; break;
    case 3: mag = 1.5f; break;
    case 4: mag = 2.0f; break;
    case 5: mag = 3.0f; break;
    case 6: mag = 4.0f; break;
    default: mag = 6.0f; break;
    }
    return (code & 8u) ? -mag : mag;
}

/* ---- E8M0 ---------------------------------------------------------------- */
SF_HD float sf_e8m0_to_f32(uint8_t e)
{
    if (e == 0xffu)
        return sf_bits_f32(0x7fc00000u);
    if (e == 0u)
        return sf_bits_f32(0x00400000u); /* 2^-127, a float32 subnormal */
    return sf_bits_f32((uint32_t)e << 23);
}

/* The smallest power of two >= v, as an E8M0 exponent (MXFP8 scales round
 * up so the block's amax never exceeds the element format's max).  v <= 0
 * or below 2^-127 gives 2^-127; NaN/inf give 0xff. */
SF_HD uint8_t sf_e8m0_ceil(float v)
{
    uint32_t u = sf_f32_bits(v);
    if ((u & 0x7fffffffu) >= 0x7f800000u)
        return 0xffu;
    if ((int32_t)u <= 0x00400000)   /* negative, zero, or <= 2^-127 */
        return 0u;
    uint32_t e = u >> 23;
    if (e == 0u)                    /* subnormal above 2^-127: 2^-126 */
        return 1u;
    if (u & 0x7fffffu)
        e++;
    return (uint8_t)(e > 254u ? 254u : e);
}

/* ---- scales ------------------------------------------------------------
 * The scale that maps amax to fp8_max / 2^margin:
 *   scale = (fp8_max / amax) * 2^-margin,
 * keeping `previous` where amax is 0 or not finite, and clamping an
 * infinite result (a tiny amax) to the largest float.  Shared by the delayed
 * scaling update, current scaling and the block formats (previous = 1). */
SF_HD float sf_scale_from_amax(float amax, float fp8_max, float pow2_neg_margin,
                               float previous)
{
    uint32_t au = sf_f32_bits(amax) & 0x7fffffffu;
    if (au == 0u || au >= 0x7f800000u)
        return previous;
    float s = SF_MUL(SF_DIV(fp8_max, amax), pow2_neg_margin);
    if ((sf_f32_bits(s) & 0x7fffffffu) >= 0x7f800000u)
        s = SF_FLT_MAX;
    return s;
}

/* max(|a|, |b|) on bit patterns: NaN (0x7fc00000 and up) wins, as it must
 * in an amax, and atomicMax on the same bits does the same on the GPU. */
SF_HD uint32_t sf_abs_bits(float v) { return sf_f32_bits(v) & 0x7fffffffu; }

/* The accumulating amax rule of every op with an amax argument:
 *   amax[0] = max(amax[0], m),  m = max |v| as sf_abs_bits (never negative),
 * compared as SIGNED 32-bit integers.  For floats with the sign bit clear that
 * is the float order (NaN above +inf, so NaN wins); a start with the sign bit
 * set (-0.0, any negative value) is below every m, so it counts as 0 and is
 * replaced by the true max |v|.  (An unsigned compare kept a negative start:
 * its bits are above every non-negative float's.)  The GPU folds with
 * atomicMax on int, which is this same compare. */
SF_HD uint32_t sf_amax_fold(uint32_t start, uint32_t m)
{
    return (int32_t)m > (int32_t)start ? m : start;
}

#endif /* SF_FP8_H */
