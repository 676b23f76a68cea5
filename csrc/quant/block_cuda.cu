/*
 * block_cuda.cu - the block-scaled quantizers on the GPU, matching
 * block_cpu.c bit for bit (same fp8.h math, the same order of operations):
 *
 *   1x128:   one warp per block (4 values per lane), warp-shuffle amax.
 *   row-wise: rows of up to 8,192 values: one CTA per row (up to 256
 *            threads), the row held in registers (8 values a thread and
 *            vector, up to 4 vectors), a block-wide amax, then the cast: one
 *            read of x.  Longer rows: one warp per row, two passes over it
 *            (the amax, then the cast; the second reads the row back from
 *            L1/L2).
 *   128x128: one 256-thread CTA per block, 64 values per thread held in
 *            registers between the amax and the cast.
 *   MXFP8:   one warp per 32-value block (one value per lane).
 *   NVFP4:   half a warp per 16-value block; even lanes pack two codes.
 *   dequantize: one thread per value.
 * These run once per weight update or per activation; they are written for
 * clarity and coalesced access, not tuned like cast_transpose.
 */
#include <algorithm>

#include "../core/cuda_util.h"
#include "../core/visit.cuh"
#include "cast_backend.h"
#include "fp8_cuda.cuh"

namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ float ld(const T *x, int64_t i) { return sf_to_float(x[i]); }

__device__ __forceinline__ uint32_t warp_max(uint32_t v, int width = 32)
{
    for (int off = width / 2; off > 0; off >>= 1)
        v = max(v, __shfl_xor_sync(0xffffffffu, v, off, width));
    return v;
}

__device__ __forceinline__ uint8_t cvt1(float v, int e5m2)
{
    return e5m2 ? (uint8_t)sf_cvt2<true>(v, 0.0f) : (uint8_t)sf_cvt2<false>(v, 0.0f);
}

template <typename T>
__global__ void quant_1x128_kernel(const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, uint8_t *out,
                                   float *scale_inv, int64_t ld_m, int e5m2)
{
    /* rows m..mp-1 (token padding) are zero rows: data 0 and the scale of a
     * zero block (1); scale entries past mp up to ld_m are padding, 0 */
    const int lane = threadIdx.x & 31;
    const int64_t kb_n = k / 128, total = ld_m * kb_n;
    const int64_t warps = (int64_t)gridDim.x * (kThreads / 32);
    const float fmax = sf_fp8_max(e5m2);
    for (int64_t b = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); b < total;
         b += warps) {
        const int64_t kb = b / ld_m, r = b % ld_m; /* consecutive warps: consecutive rows */
        if (r >= m) {
            if (r < mp)
                *reinterpret_cast<uint32_t *>(out + r * k + kb * 128 + lane * 4) = 0u;
            if (lane == 0) /* a zero row's scale is a zero block's: from amax 0, as every other block's */
                scale_inv[kb * ld_m + r] =
                    r < mp ? __fdiv_rn(1.0f, sf_scale_from_amax(0.0f, fmax, 1.0f, 1.0f)) : 0.0f;
            continue;
        }
        const int64_t base = r * k + kb * 128 + lane * 4;
        float v[4];
        uint32_t am = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[e] = ld(x, base + e);
            am = max(am, sf_abs_bits(v[e]));
        }
        am = warp_max(am);
        const float s = sf_scale_from_amax(sf_bits_f32(am), fmax, 1.0f, 1.0f);
        if (lane == 0)
            scale_inv[kb * ld_m + r] = __fdiv_rn(1.0f, s);
        uint32_t w = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e)
            w |= (uint32_t)cvt1(__fmul_rn(v[e], s), e5m2) << (8 * e);
        *reinterpret_cast<uint32_t *>(out + base) = w; /* k % 128 == 0: 4-byte aligned */
    }
}

/* 8 values of x from p (16-byte aligned for 2-byte T) as float. */
template <typename T>
__device__ __forceinline__ void ld8(const T *p, float (&v)[8])
{
    if constexpr (sizeof(T) == 2) {
        const uint4 raw = *reinterpret_cast<const uint4 *>(p);
        const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = sf_to_float(e[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = sf_to_float(p[i]);
    }
}

template <typename T>
__global__ void quant_row_kernel(const T *__restrict__ x, int64_t m, int64_t k, uint8_t *__restrict__ out,
                                 float *__restrict__ scale_inv, int e5m2)
{
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (kThreads / 32);
    const float fmax = sf_fp8_max(e5m2);
    for (int64_t r = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); r < m; r += warps) {
        const T *row = x + r * k;
        uint32_t am = 0;
        for (int64_t c = lane * 8; c < k; c += 256) {
            float v[8];
            ld8(row + c, v);
#pragma unroll
            for (int e = 0; e < 8; ++e)
                am = max(am, sf_abs_bits(v[e]));
        }
        am = warp_max(am);
        const float s = sf_scale_from_amax(sf_bits_f32(am), fmax, 1.0f, 1.0f);
        if (lane == 0)
            scale_inv[r] = __fdiv_rn(1.0f, s);
        for (int64_t c = lane * 8; c < k; c += 256) {
            float v[8];
            ld8(row + c, v);
            uint32_t w0 = 0, w1 = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                w0 |= (uint32_t)cvt1(__fmul_rn(v[e], s), e5m2) << (8 * e);
                w1 |= (uint32_t)cvt1(__fmul_rn(v[e + 4], s), e5m2) << (8 * e);
            }
            *reinterpret_cast<uint2 *>(out + r * k + c) = make_uint2(w0, w1); /* k % 16 == 0 */
        }
    }
}

/* One CTA per row (grid-stride over rows), the row in registers: thread t
 * holds vectors t, t + blockDim.x, ... (VPT of them, 8 values each); k % 8
 * == 0 and k <= 8 * VPT * blockDim.x. */
template <typename T, int VPT>
__global__ void __launch_bounds__(kThreads)
quant_row_cta_kernel(const T *__restrict__ x, int64_t m, int64_t k, uint8_t *__restrict__ out,
                     float *__restrict__ scale_inv, int e5m2)
{
    __shared__ uint32_t red[kThreads / 32];
    const int t = threadIdx.x, warps = blockDim.x / 32;
    const float fmax = sf_fp8_max(e5m2);
    for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
        const T *row = x + r * k;
        float v[VPT][8];
        uint32_t am = 0;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int64_t c = ((int64_t)j * blockDim.x + t) * 8;
            if (c < k) {
                ld8(row + c, v[j]);
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    am = max(am, sf_abs_bits(v[j][e]));
            }
        }
        am = warp_max(am);
        if ((t & 31) == 0)
            red[t >> 5] = am;
        __syncthreads();
        am = 0;
        for (int w = 0; w < warps; ++w)
            am = max(am, red[w]);
        __syncthreads(); /* red is reused by the next row */
        const float s = sf_scale_from_amax(sf_bits_f32(am), fmax, 1.0f, 1.0f);
        if (t == 0)
            scale_inv[r] = __fdiv_rn(1.0f, s);
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int64_t c = ((int64_t)j * blockDim.x + t) * 8;
            if (c < k) {
                uint32_t w0 = 0, w1 = 0;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    w0 |= (uint32_t)cvt1(__fmul_rn(v[j][e], s), e5m2) << (8 * e);
                    w1 |= (uint32_t)cvt1(__fmul_rn(v[j][e + 4], s), e5m2) << (8 * e);
                }
                *reinterpret_cast<uint2 *>(out + r * k + c) = make_uint2(w0, w1);
            }
        }
    }
}

/* The row-wise cast's launch: a CTA per row where the row fits in its
 * registers (threads: the row's 8-value vectors rounded up to a warp, at
 * most kThreads; VPT vectors a thread), else the two-pass warp per row. */
template <typename T>
void launch_rows(const sf_block_args *a, int sms, cudaStream_t stream)
{
    const T *x = (const T *)a->x;
    const int64_t vecs = a->k / 8;
    const int threads = (int)std::min<int64_t>(kThreads, (vecs + 31) / 32 * 32);
    const int64_t vpt = (vecs + threads - 1) / threads;
    const unsigned grid = (unsigned)std::min<int64_t>(a->m, (int64_t)sms * 16);
    float *si = (float *)a->scales;
    if (vpt == 1)
        quant_row_cta_kernel<T, 1><<<grid, threads, 0, stream>>>(x, a->m, a->k, a->data, si, a->e5m2);
    else if (vpt == 2)
        quant_row_cta_kernel<T, 2><<<grid, threads, 0, stream>>>(x, a->m, a->k, a->data, si, a->e5m2);
    else if (vpt <= 4)
        quant_row_cta_kernel<T, 4><<<grid, threads, 0, stream>>>(x, a->m, a->k, a->data, si, a->e5m2);
    else
        quant_row_kernel<T><<<sf_grid_size(a->m * 32, kThreads, sms * 16), kThreads, 0, stream>>>(
            x, a->m, a->k, a->data, si, a->e5m2);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
quant_128x128_kernel(const T *__restrict__ x, int64_t m, int64_t k, uint8_t *out,
                     float *scale_inv, int64_t ld_k, int e5m2)
{
    const int64_t kb_n = k / 128;
    const int64_t mb = blockIdx.x / ld_k, kb = blockIdx.x % ld_k;
    const int t = threadIdx.x;
    if (kb >= kb_n) { /* a padding column of the scale tensor */
        if (t == 0)
            scale_inv[mb * ld_k + kb] = 0.0f;
        return;
    }
    const int col = (t & 15) * 8, row0 = t >> 4;
    float v[8][8];
    uint32_t am = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t r = mb * 128 + row0 + 16 * i;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            v[i][e] = r < m ? ld(x, r * k + kb * 128 + col + e) : 0.0f;
            am = max(am, sf_abs_bits(v[i][e]));
        }
    }
    __shared__ uint32_t red[kThreads / 32];
    am = warp_max(am);
    if ((t & 31) == 0)
        red[t >> 5] = am;
    __syncthreads();
    am = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w)
        am = max(am, red[w]);
    const float s = sf_scale_from_amax(sf_bits_f32(am), sf_fp8_max(e5m2), 1.0f, 1.0f);
    if (t == 0)
        scale_inv[mb * ld_k + kb] = __fdiv_rn(1.0f, s);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int64_t r = mb * 128 + row0 + 16 * i;
        if (r >= m)
            continue;
        uint32_t w0 = 0, w1 = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            w0 |= (uint32_t)cvt1(__fmul_rn(v[i][e], s), e5m2) << (8 * e);
            w1 |= (uint32_t)cvt1(__fmul_rn(v[i][e + 4], s), e5m2) << (8 * e);
        }
        *reinterpret_cast<uint2 *>(out + r * k + kb * 128 + col) = make_uint2(w0, w1);
    }
}

/* 1x128 blocks along K (row-wise copy) and along M (column-wise copy, the
 * transposed matrix) from one read of x: a CTA per 128 x 128 tile, loads as
 * in cast_transpose; row amaxes by shuffles over the 16 lanes of a row,
 * column amaxes (and, when asked, column sums) through shared memory; the
 * column-wise bytes go through the swizzled tile and leave as 16-byte rows
 * of out_t.  Conversions take two values per cvt instruction (the format is
 * a template parameter, so no per-value branch).  M need not be a multiple
 * of 128: rows past M read as 0, so the column-wise copy (rows of
 * mt = round_up(M, 128) bytes) ends in zeros and its last block's scale
 * comes from the real rows only; the row-wise copy stops at row mp >= M
 * (rows M..mp-1 are those zero rows: the FP8 GEMMs' token padding, made in
 * this launch instead of a padded copy of x; its scale padding up to ld_m
 * is written 0).  Traffic per element: 2 (bf16) bytes
 * read, 2 bytes written, plus 8 bytes of scales per 128 elements. */
__device__ __forceinline__ int swz(int row, int word) { return word ^ (((row >> 4) & 7) << 2); }

/* Eight values times their scales -> eight FP8 bytes (v[0] lowest). */
template <bool E5M2>
__device__ __forceinline__ uint2 cvt8(const float *v, const float *s)
{
    float q[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
        q[e] = __fmul_rn(v[e], s[e]);
    return make_uint2(sf_cvt4<E5M2>(q), sf_cvt4<E5M2>(q + 4));
}

template <typename T, bool E5M2>
__global__ void __launch_bounds__(kThreads)
quant_rowcol_kernel(const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, uint8_t *out, float *scale_inv,
                    int64_t ld_m, uint8_t *out_t, float *scale_inv_t, int64_t ld_k, int64_t mt,
                    float *col_sums)
{
    __shared__ uint32_t tile[128][32];
    __shared__ uint32_t colmax[8][128];
    __shared__ float colsum[8][128];
    __shared__ float colscale[128];
    const int64_t tiles_k = k / 128;
    const int64_t m0 = (blockIdx.x / tiles_k) * 128, k0 = (blockIdx.x % tiles_k) * 128;
    const int t = threadIdx.x, lj = t & 15, lr = t >> 4, lane = t & 31, warp = t >> 5;
    const float fmax = sf_fp8_max(E5M2);
    /* rows of this tile inside x (rem), inside the row-wise copy (rem_p: rows
     * past M up to mp are zero rows, whose zero input gives the scale of a zero
     * block) and inside its scale tensor, whose padding up to ld_m is written
     * 0; 32-bit, as are the row tests */
    const int rem = (int)min(m - m0, (int64_t)128), rem_p = (int)max(min(mp - m0, (int64_t)128), (int64_t)0),
              rem_ld = (int)min(ld_m - m0, (int64_t)128);
    const T *xt = x + m0 * k + k0 + lj * 8;
    sf_raw8<T> raw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) { /* rows past M load row m0 (always there) and become 0 */
        const int row = lr + 16 * i;
        sf_load_raw8(xt + (int64_t)(row < rem ? row : 0) * k, raw[i]);
        if (row >= rem)
            raw[i] = sf_raw8<T>{}; /* zero bits: 0.0 */
    }
    uint32_t cmax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float v[8];
        sf_unpack8(raw[i], v);
        uint32_t rmax = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            uint32_t b = sf_abs_bits(v[e]);
            rmax = max(rmax, b);
            cmax[e] = max(cmax[e], b);
        }
        if (out) {
            rmax = warp_max(rmax, 16); /* the 16 lanes of this row (all lanes shuffle) */
            const float s = sf_scale_from_amax(sf_bits_f32(rmax), fmax, 1.0f, 1.0f);
            const int row = lr + 16 * i;
            if (lj == 0 && row < rem_ld)
                scale_inv[(k0 / 128) * ld_m + m0 + row] = row < rem_p ? __fdiv_rn(1.0f, s) : 0.0f;
            const float sv[8] = {s, s, s, s, s, s, s, s};
            if (row < rem_p)
                *reinterpret_cast<uint2 *>(out + (m0 + row) * k + k0 + lj * 8) = cvt8<E5M2>(v, sv);
        }
    }
    if (!out_t)
        return;
    /* column amax: the two rows of a warp, then the 8 warps via shared memory */
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        cmax[e] = max(cmax[e], __shfl_xor_sync(0xffffffffu, cmax[e], 16));
        if (lane < 16)
            colmax[warp][lj * 8 + e] = cmax[e];
    }
    __syncthreads();
    if (t < 128) {
        uint32_t cm = colmax[0][t];
#pragma unroll
        for (int w = 1; w < 8; ++w)
            cm = max(cm, colmax[w][t]);
        const float s = sf_scale_from_amax(sf_bits_f32(cm), fmax, 1.0f, 1.0f);
        colscale[t] = s;
        scale_inv_t[(m0 / 128) * ld_k + k0 + t] = __fdiv_rn(1.0f, s);
    }
    __syncthreads();
    /* the column-wise bytes into the tile, and (col_sums) the column sums in
     * seqfuse_quant.h's order: this thread's 8 rows, its warp's two rows,
     * then the 8 warps below */
    float cs[8], csum[8];
#pragma unroll
    for (int e = 0; e < 8; ++e)
        cs[e] = colscale[lj * 8 + e];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float v[8];
        sf_unpack8(raw[i], v);
        const int row = lr + 16 * i;
        *reinterpret_cast<uint2 *>(&tile[row][swz(row, 2 * lj)]) = cvt8<E5M2>(v, cs);
        if (col_sums) {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                csum[e] = i == 0 ? v[e] : __fadd_rn(csum[e], v[e]);
        }
    }
    if (col_sums) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            csum[e] = __fadd_rn(csum[e], __shfl_xor_sync(0xffffffffu, csum[e], 16));
            if (lane < 16)
                colsum[warp][lj * 8 + e] = csum[e];
        }
    }
    __syncthreads();
    if (col_sums && t >= 128) { /* threads 0..127 took the amaxes above */
        const int c = t - 128;
        float sum = colsum[0][c];
#pragma unroll
        for (int w = 1; w < 8; ++w)
            sum = __fadd_rn(sum, colsum[w][c]);
        col_sums[(m0 / 128) * k + k0 + c] = sum;
    }
    const int kw = warp * 4 + (lane >> 3), mg = lane & 7;
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int row = mg * 16 + i;
        w[i] = tile[row][swz(row, kw)];
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const uint32_t t0 = __byte_perm(w[4 * p], w[4 * p + 1], 0x5140);
        const uint32_t t1 = __byte_perm(w[4 * p], w[4 * p + 1], 0x7362);
        const uint32_t t2 = __byte_perm(w[4 * p + 2], w[4 * p + 3], 0x5140);
        const uint32_t t3 = __byte_perm(w[4 * p + 2], w[4 * p + 3], 0x7362);
        w[4 * p] = __byte_perm(t0, t2, 0x5410);
        w[4 * p + 1] = __byte_perm(t0, t2, 0x7632);
        w[4 * p + 2] = __byte_perm(t1, t3, 0x5410);
        w[4 * p + 3] = __byte_perm(t1, t3, 0x7632);
    }
    /* w[4p + kk]: rows 4p..4p+3 of column 4kw + kk */
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
        *reinterpret_cast<uint4 *>(out_t + (k0 + kw * 4 + kk) * mt + m0 + mg * 16) =
            make_uint4(w[kk], w[4 + kk], w[8 + kk], w[12 + kk]);
}

__device__ __forceinline__ float e8m0_inverse(uint32_t e)
{
    return e == 254u ? sf_bits_f32(0x00400000u) : sf_bits_f32((254u - e) << 23);
}

template <typename T>
__global__ void quant_mxfp8_kernel(const T *__restrict__ x, int64_t n, uint8_t *out,
                                   uint8_t *scales, int e5m2)
{
    const int lane = threadIdx.x & 31;
    const int64_t blocks = n / 32, warps = (int64_t)gridDim.x * (kThreads / 32);
    const float fmax = sf_fp8_max(e5m2);
    for (int64_t b = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); b < blocks;
         b += warps) {
        const float v = ld(x, b * 32 + lane);
        const float amax = sf_bits_f32(warp_max(sf_abs_bits(v)));
        const uint8_t e = amax == 0.0f ? 127u : sf_e8m0_ceil(__fdiv_rn(amax, fmax));
        if (lane == 0)
            scales[b] = e;
        const float mul = e == 0xffu ? sf_bits_f32(0x7fc00000u) : e8m0_inverse(e);
        out[b * 32 + lane] = cvt1(__fmul_rn(v, mul), e5m2);
    }
}

template <typename T>
__global__ void quant_nvfp4_kernel(const T *__restrict__ x, int64_t n, const float *amax_p,
                                   uint8_t *out, uint8_t *scales, float *global_scale_inv)
{
    const float S = sf_scale_from_amax(*amax_p, SF_E4M3_MAX * SF_E2M1_MAX, 1.0f, 1.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *global_scale_inv = __fdiv_rn(1.0f, S);
    const int lane = threadIdx.x & 31, half = lane & 15;
    const int64_t pairs = n / 32, warps = (int64_t)gridDim.x * (kThreads / 32);
    const int64_t nblocks = n / 16;
    for (int64_t p = (int64_t)blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
         p < (nblocks + 1) / 2; p += warps) {
        const int64_t b = p * 2 + (lane >> 4);
        const bool live = b < nblocks;
        const float v = live ? ld(x, b * 16 + half) : 0.0f;
        const float amax = sf_bits_f32(warp_max(sf_abs_bits(v), 16));
        const uint8_t d = sf_f32_to_e4m3(__fmul_rn(__fdiv_rn(amax, SF_E2M1_MAX), S));
        const float df = sf_e4m3_to_f32(d);
        const float mul = df == 0.0f ? 0.0f : __fdiv_rn(S, df);
        const uint32_t code = sf_f32_to_e2m1(__fmul_rn(v, mul));
        const uint32_t next = __shfl_down_sync(0xffffffffu, code, 1);
        if (live && half == 0)
            scales[b] = d;
        if (live && (half & 1) == 0)
            out[(b * 16 + half) / 2] = (uint8_t)(code | (next << 4));
    }
    (void)pairs;
}

template <typename O>
__global__ void dequant_kernel(sf_block_args a, O *__restrict__ y)
{
    const int64_t n = a.m * a.k, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const int64_t r = i / a.k, c = i % a.k;
        float v;
        switch (a.format) {
        case SF_BLOCK_FP8_1X128:
            v = __fmul_rn(sf_fp8_to_f32(a.data[i], a.e5m2),
                          ((const float *)a.scales)[(c / 128) * a.scale_ld + r]);
            break;
        case SF_BLOCK_FP8_128X128:
            v = __fmul_rn(sf_fp8_to_f32(a.data[i], a.e5m2),
                          ((const float *)a.scales)[(r / 128) * a.scale_ld + c / 128]);
            break;
        case SF_BLOCK_MXFP8:
            v = __fmul_rn(sf_fp8_to_f32(a.data[i], a.e5m2),
                          sf_e8m0_to_f32(((const uint8_t *)a.scales)[i / 32]));
            break;
        default: {
            const uint8_t byte = a.data[i / 2];
            const uint8_t code = (i & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 15u);
            const float d = sf_e4m3_to_f32(((const uint8_t *)a.scales)[i / 16]);
            v = __fmul_rn(__fmul_rn(sf_e2m1_to_f32(code), d), a.global_scale_inv[0]);
            break;
        }
        }
        sf_store_from_float(y + i, v);
    }
}

/* sf_block_scales_transpose_cuda: one thread per entry of the [cb, ld_t]
 * transposed scale matrix (a weight's: a few thousand entries). */
__global__ void scales_transpose_kernel(const float *__restrict__ si, int64_t rb, int64_t cb, int64_t ld,
                                        float *__restrict__ si_t, int64_t ld_t)
{
    const int64_t n = cb * ld_t;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = i / ld_t, r = i % ld_t;
        si_t[i] = r < rb ? si[r * ld + c] : 0.0f;
    }
}

sf_status sms_of_current(const char *what, int *sms)
{
    int device = 0;
    SF_CUDA_TRY(what, cudaGetDevice(&device));
    SF_CUDA_TRY(what, sf_cuda_query_sm_count(device, sms)); /* (cached: asked once a device) */
    return SF_OK;
}

template <typename T>
void launch_quantize(const sf_block_args *a, int sms, cudaStream_t stream)
{
    const T *x = (const T *)a->x;
    const int64_t n = a->m * a->k;
    switch (a->format) {
    case SF_BLOCK_FP8_1X128: {
        int64_t warps = a->scale_ld * (a->k / 128);
        int grid = sf_grid_size(warps * 32, kThreads, sms * 16);
        quant_1x128_kernel<T><<<grid, kThreads, 0, stream>>>(x, a->m, std::max(a->mp, a->m), a->k, a->data,
                                                             (float *)a->scales, a->scale_ld, a->e5m2);
        break;
    }
    case SF_BLOCK_FP8_ROW:
        launch_rows<T>(a, sms, stream);
        break;
    case SF_BLOCK_FP8_128X128: {
        int64_t grid = ((a->m + 127) / 128) * a->scale_ld;
        quant_128x128_kernel<T><<<(unsigned)grid, kThreads, 0, stream>>>(
            x, a->m, a->k, a->data, (float *)a->scales, a->scale_ld, a->e5m2);
        break;
    }
    case SF_BLOCK_FP8_ROWCOL: {
        const int64_t mt = (a->m + 127) / 128 * 128;
        int64_t tiles = (mt / 128) * (a->k / 128);
        if (a->e5m2)
            quant_rowcol_kernel<T, true><<<(unsigned)tiles, kThreads, 0, stream>>>(
                x, a->m, std::max(a->mp, a->m), a->k, a->data, (float *)a->scales, a->scale_ld, a->data_t,
                a->scales_t, a->scale_ld_t, mt, a->col_sums);
        else
            quant_rowcol_kernel<T, false><<<(unsigned)tiles, kThreads, 0, stream>>>(
                x, a->m, std::max(a->mp, a->m), a->k, a->data, (float *)a->scales, a->scale_ld, a->data_t,
                a->scales_t, a->scale_ld_t, mt, a->col_sums);
        break;
    }
    case SF_BLOCK_MXFP8: {
        int grid = sf_grid_size(n, kThreads, sms * 16);
        quant_mxfp8_kernel<T><<<grid, kThreads, 0, stream>>>(x, n, a->data, (uint8_t *)a->scales,
                                                             a->e5m2);
        break;
    }
    default: {
        int grid = sf_grid_size(n / 2 + 32, kThreads, sms * 16);
        quant_nvfp4_kernel<T><<<grid, kThreads, 0, stream>>>(x, n, a->amax, a->data,
                                                             (uint8_t *)a->scales,
                                                             a->global_scale_inv);
        break;
    }
    }
}

/* `launch(sms, stream)` on `device` (its status, then the launch's, reported
 * under `what`), with the device guard every entry below takes. */
template <typename Launch>
sf_status on_device(const char *what, int device, sf_stream s, Launch launch)
{
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(what, device, &guard));
    int sms = 0;
    sf_status st = sms_of_current(what, &sms);
    if (st == SF_OK)
        st = sf_cuda_launch_status(what, launch(sms, stream));
    sf_cuda_device_restore(&guard);
    return st;
}

} // namespace

extern "C" sf_status sf_block_quantize_cuda(const sf_block_args *a, int device, sf_stream s)
{
    /* an empty matrix has no blocks and no scales, but NVFP4 still owes its
     * per-tensor scale */
    if (std::max(a->mp, a->m) * a->k == 0 && a->format != SF_BLOCK_NVFP4)  /* (padded rows are written) */
        return SF_OK;
    return on_device("block quantize", device, s, [&](int sms, cudaStream_t stream) {
        return sf_visit_float("block quantize", "x", a->x_dtype, [&](auto tag) {
            launch_quantize<typename decltype(tag)::type>(a, sms, stream);
            return SF_OK;
        });
    });
}

extern "C" sf_status sf_block_dequantize_cuda(const sf_block_args *a, int device, sf_stream s)
{
    if (a->m * a->k == 0)
        return SF_OK;
    return on_device("block dequantize", device, s, [&](int sms, cudaStream_t stream) {
        const int grid = sf_grid_size(a->m * a->k, kThreads, sms * 16);
        /* x_dtype holds the dtype of the dequantized output here */
        return sf_visit_float("block dequantize", "out", a->x_dtype, [&](auto tag) {
            using T = typename decltype(tag)::type;
            dequant_kernel<T><<<grid, kThreads, 0, stream>>>(*a, (T *)a->y);
            return SF_OK;
        });
    });
}

extern "C" sf_status sf_block_scales_transpose_cuda(const sf_block_args *a, int device, sf_stream s)
{
    const int64_t cb = a->k / 128, n = cb * a->scale_ld_t;
    if (n == 0)
        return SF_OK;
    return on_device("block scales transpose", device, s, [&](int sms, cudaStream_t stream) {
        scales_transpose_kernel<<<sf_grid_size(n, kThreads, sms * 4), kThreads, 0, stream>>>(
            (const float *)a->scales, a->m / 128, cb, a->scale_ld, a->scales_t, a->scale_ld_t);
        return SF_OK;
    });
}
