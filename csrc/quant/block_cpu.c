/*
 * block_cpu.c - the reference block quantizers: plain loops, one block at a
 * time, the math from fp8.h.  The CUDA kernels (block_cuda.cu) must match
 * these bit for bit.
 */
#include "../core/float_io.h"
#include "cast_backend.h"
#include "fp8.h"

/* max |x| over rows [r0, r1) x columns [c0, c1), as bits (NaN wins). */
static uint32_t block_amax(const sf_block_args *a, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
    uint32_t m = 0;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
            uint32_t b = sf_abs_bits(sf_load_float(a->x, a->x_dtype, r * a->k + c));
            m = b > m ? b : m;
        }
    return m;
}

/* 1x128 blocks: rows m..mp-1 of the output are zero rows (token padding),
 * quantized as the zero blocks they are (data 0, scale_inv 1). */
static void quantize_fp8_blocks(const sf_block_args *a, int block_rows)
{
    float fmax = sf_fp8_max(a->e5m2);
    float *si = (float *)a->scales;
    const int64_t mp = block_rows == 1 && a->mp > a->m ? a->mp : a->m;
    int64_t kb_n = a->k / 128, mb_n = block_rows == 1 ? mp : (a->m + 127) / 128;
    /* padding of the scale tensor is written as 0 */
    int64_t rows = block_rows == 1 ? kb_n : mb_n;
    for (int64_t i = 0; i < rows * a->scale_ld; ++i)
        si[i] = 0.0f;
    for (int64_t mb = 0; mb < mb_n; ++mb)
        for (int64_t kb = 0; kb < kb_n; ++kb) {
            int64_t r0 = mb * block_rows, r1 = r0 + block_rows < a->m ? r0 + block_rows : a->m;
            if (r0 >= a->m) { /* a zero row (1x128 only): a zero block's scale, from amax 0 */
                si[kb * a->scale_ld + mb] = SF_DIV(1.0f, sf_scale_from_amax(0.0f, fmax, 1.0f, 1.0f));
                for (int64_t c = kb * 128; c < kb * 128 + 128; ++c)
                    a->data[r0 * a->k + c] = 0;
                continue;
            }
            float amax = sf_bits_f32(block_amax(a, r0, r1, kb * 128, kb * 128 + 128));
            float s = sf_scale_from_amax(amax, fmax, 1.0f, 1.0f);
            if (block_rows == 1)
                si[kb * a->scale_ld + mb] = SF_DIV(1.0f, s);
            else
                si[mb * a->scale_ld + kb] = SF_DIV(1.0f, s);
            for (int64_t r = r0; r < r1; ++r)
                for (int64_t c = kb * 128; c < kb * 128 + 128; ++c)
                    a->data[r * a->k + c] =
                        sf_f32_to_fp8(SF_MUL(sf_load_float(a->x, a->x_dtype, r * a->k + c), s), a->e5m2);
        }
}

/* One scale per row: each row is a single 1 x k block (scales [m]). */
static void quantize_fp8_rows(const sf_block_args *a)
{
    float fmax = sf_fp8_max(a->e5m2);
    float *si = (float *)a->scales;
    for (int64_t r = 0; r < a->m; ++r) {
        float s = sf_scale_from_amax(sf_bits_f32(block_amax(a, r, r + 1, 0, a->k)), fmax, 1.0f, 1.0f);
        si[r] = SF_DIV(1.0f, s);
        for (int64_t c = 0; c < a->k; ++c)
            a->data[r * a->k + c] = sf_f32_to_fp8(SF_MUL(sf_load_float(a->x, a->x_dtype, r * a->k + c), s), a->e5m2);
    }
}

/* Column c's float32 sum over rows r0 .. r0 + 127 (past m: 0) in the order
 * seqfuse_quant.h fixes for col_sums (the CUDA kernel's: 16 strided partial
 * sums, paired, then added left to right). */
static float block_col_sum(const sf_block_args *a, int64_t r0, int64_t c)
{
    float s[16];
    for (int g = 0; g < 16; ++g) {
        float acc = 0.0f;
        for (int i = 0; i < 8; ++i) {
            int64_t r = r0 + g + 16 * i;
            float v = r < a->m ? sf_load_float(a->x, a->x_dtype, r * a->k + c) : 0.0f;
            acc = i == 0 ? v : acc + v;
        }
        s[g] = acc;
    }
    float total = s[0] + s[1];
    for (int w = 1; w < 8; ++w)
        total = total + (s[2 * w] + s[2 * w + 1]);
    return total;
}

/* Row-wise 1x128 (as quantize_fp8_blocks) and column-wise 1x128 along M:
 * data_t is [k, mt] with mt = round_up(m, 128); rows of x past m count as 0
 * (in the amax and in the bytes written). */
static void quantize_rowcol(const sf_block_args *a)
{
    if (a->data)
        quantize_fp8_blocks(a, 1);
    if (!a->data_t)
        return;
    float fmax = sf_fp8_max(a->e5m2);
    const int64_t mt = (a->m + 127) / 128 * 128;
    for (int64_t mb = 0; mb < mt / 128; ++mb)
        for (int64_t c = 0; c < a->k; ++c) {
            if (a->col_sums)
                a->col_sums[mb * a->k + c] = block_col_sum(a, mb * 128, c);
            int64_t r1 = mb * 128 + 128 < a->m ? mb * 128 + 128 : a->m;
            float amax = sf_bits_f32(block_amax(a, mb * 128, r1, c, c + 1));
            float s = sf_scale_from_amax(amax, fmax, 1.0f, 1.0f);
            a->scales_t[mb * a->scale_ld_t + c] = SF_DIV(1.0f, s);
            for (int64_t r = mb * 128; r < mb * 128 + 128; ++r) {
                float v = r < a->m ? sf_load_float(a->x, a->x_dtype, r * a->k + c) : 0.0f;
                a->data_t[c * mt + r] = sf_f32_to_fp8(SF_MUL(v, s), a->e5m2);
            }
        }
}

/* 2^(127 - e) exactly, for an E8M0 exponent e in 0..254. */
static float e8m0_inverse(uint8_t e)
{
    return e == 254u ? sf_bits_f32(0x00400000u) : sf_bits_f32((uint32_t)(254u - e) << 23);
}

static void quantize_mxfp8(const sf_block_args *a)
{
    float fmax = sf_fp8_max(a->e5m2);
    uint8_t *sc = (uint8_t *)a->scales;
    for (int64_t r = 0; r < a->m; ++r)
        for (int64_t b = 0; b < a->k / 32; ++b) {
            float amax = sf_bits_f32(block_amax(a, r, r + 1, b * 32, b * 32 + 32));
            uint8_t e = amax == 0.0f ? 127u : sf_e8m0_ceil(SF_DIV(amax, fmax));
            sc[r * (a->k / 32) + b] = e;
            float mul = e == 0xffu ? sf_bits_f32(0x7fc00000u) : e8m0_inverse(e);
            for (int64_t c = b * 32; c < b * 32 + 32; ++c)
                a->data[r * a->k + c] =
                    sf_f32_to_fp8(SF_MUL(sf_load_float(a->x, a->x_dtype, r * a->k + c), mul), a->e5m2);
        }
}

static void quantize_nvfp4(const sf_block_args *a)
{
    float S = sf_scale_from_amax(a->amax[0], SF_E4M3_MAX * SF_E2M1_MAX, 1.0f, 1.0f);
    a->global_scale_inv[0] = SF_DIV(1.0f, S);
    uint8_t *sc = (uint8_t *)a->scales;
    for (int64_t r = 0; r < a->m; ++r)
        for (int64_t b = 0; b < a->k / 16; ++b) {
            float amax = sf_bits_f32(block_amax(a, r, r + 1, b * 16, b * 16 + 16));
            uint8_t d = sf_f32_to_e4m3(SF_MUL(SF_DIV(amax, SF_E2M1_MAX), S));
            sc[r * (a->k / 16) + b] = d;
            float df = sf_e4m3_to_f32(d);
            float mul = df == 0.0f ? 0.0f : SF_DIV(S, df);
            for (int64_t c = b * 16; c < b * 16 + 16; c += 2) {
                uint8_t lo = sf_f32_to_e2m1(SF_MUL(sf_load_float(a->x, a->x_dtype, r * a->k + c), mul));
                uint8_t hi = sf_f32_to_e2m1(SF_MUL(sf_load_float(a->x, a->x_dtype, r * a->k + c + 1), mul));
                a->data[(r * a->k + c) / 2] = (uint8_t)(lo | (hi << 4));
            }
        }
}

sf_status sf_block_quantize_cpu(const sf_block_args *a)
{
    switch (a->format) {
    case SF_BLOCK_FP8_1X128: quantize_fp8_blocks(a, 1); break;
    case SF_BLOCK_FP8_128X128: quantize_fp8_blocks(a, 128); break;
    case SF_BLOCK_MXFP8: quantize_mxfp8(a); break;
    case SF_BLOCK_FP8_ROWCOL: quantize_rowcol(a); break;
    case SF_BLOCK_FP8_ROW: quantize_fp8_rows(a); break;
    default: quantize_nvfp4(a); break;
    }
    return SF_OK;
}

sf_status sf_block_dequantize_cpu(const sf_block_args *a)
{
    for (int64_t r = 0; r < a->m; ++r)
        for (int64_t c = 0; c < a->k; ++c) {
            int64_t i = r * a->k + c;
            float v;
            switch (a->format) {
            case SF_BLOCK_FP8_1X128:
                v = SF_MUL(sf_fp8_to_f32(a->data[i], a->e5m2),
                           ((const float *)a->scales)[(c / 128) * a->scale_ld + r]);
                break;
            case SF_BLOCK_FP8_128X128:
                v = SF_MUL(sf_fp8_to_f32(a->data[i], a->e5m2),
                           ((const float *)a->scales)[(r / 128) * a->scale_ld + c / 128]);
                break;
            case SF_BLOCK_MXFP8:
                v = SF_MUL(sf_fp8_to_f32(a->data[i], a->e5m2),
                           sf_e8m0_to_f32(((const uint8_t *)a->scales)[i / 32]));
                break;
            default: {
                uint8_t byte = a->data[i / 2];
                uint8_t code = (i & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 15u);
                float d = sf_e4m3_to_f32(((const uint8_t *)a->scales)[i / 16]);
                v = SF_MUL(SF_MUL(sf_e2m1_to_f32(code), d), a->global_scale_inv[0]);
                break;
            }
            }
            sf_store_float(a->y, a->x_dtype, i, v);
        }
    return SF_OK;
}

sf_status sf_block_scales_transpose_cpu(const sf_block_args *a)
{
    const float *si = (const float *)a->scales;
    const int64_t rb = a->m / 128, cb = a->k / 128;
    for (int64_t c = 0; c < cb; ++c)
        for (int64_t r = 0; r < a->scale_ld_t; ++r)
            a->scales_t[c * a->scale_ld_t + r] = r < rb ? si[r * a->scale_ld + c] : 0.0f;
    return SF_OK;
}
