/*
 * cast_cuda.cu - the per-tensor FP8 kernels on the GPU, on the caller's
 * stream, never synchronizing the host:
 *
 *   cast_transpose: the kernel FP8 training leans on.  One pass over x [M, K]
 *     writes the row-wise FP8 copy, the column-wise (transposed) copy that
 *     Hopper's FP8 GEMMs take for the other operand, and folds max |x| into
 *     amax.  Tiles of 128 x 128: each thread loads 8 consecutive values with
 *     16-byte loads, writes their 8 FP8 bytes row-wise at once and parks them
 *     in shared memory; then each thread gathers a 16-row x 4-column patch
 *     as 16 words, transposes it with byte permutes and writes four 16-byte
 *     rows of out_t.  The shared tile is XOR-swizzled so both phases are free
 *     of bank conflicts.  Loads of a tile are all issued before any is used
 *     and kept as raw bytes (16-bit inputs: held to 64 registers, 4 CTAs
 *     per SM, ~128 KB of loads in flight per SM, no spills; at 80 registers
 *     and 3 CTAs it ran at 73-82 % of copy on the H200, at 64 / 4 it runs at
 *     84-87 %).  One CTA per tile, one amax atomic
 *     per CTA.
 *     Outputs may have more rows than x (mp >= m): the extra rows are the
 *     zero token padding of the FP8 GEMMs, written in the same pass.
 *   cast_current: current scaling and cast_transpose in one cooperative
 *     launch: each block folds max |x| over its share of x into amax, the
 *     grid meets at a barrier, every block derives the same scale from amax
 *     (fp8.h's sf_scale_from_amax), then the blocks run cast_transpose's
 *     tile loop.  The weight cast of per-tensor recipes: one launch instead
 *     of the amax, scale and cast kernels.
 *   cast (no transpose): 8 values per thread per step, 16-byte loads.
 *   transpose: FP8 bytes [M, K] -> [K, M] (the weight gradient's operand
 *     under delayed scaling, whose norm/activation kernels write FP8
 *     row-wise only): 16-byte loads into the same swizzled tile, then
 *     cast_transpose's store phase.
 *   generic: one element per thread, any shape or alignment.
 *   dequantize, and the scaling-state updates (one thread per tensor).
 */
#include <climits>
#include <cooperative_groups.h>
#include <type_traits>

#include "../core/async_copy.cuh" /* the grouped SwiGLU backward's staged loads */
#include "../core/cuda_util.h"
#include "../core/launch_cache.cuh" /* sf_allow_smem */
#include "../core/vec_io.cuh" /* launch_column_sums: sf_column_sums */
#include "../core/visit.cuh"
#include "../moe/moe.h" /* sf_moe_silu, sf_moe_ld: the SwiGLU of the fused grouped cast */
#include "cast_backend.h"
#include "fp8_cuda.cuh"

namespace {

constexpr int kTile = 128;        /* tile rows (M) and columns (K) */
constexpr int kThreads = 256;
constexpr int kWords = kTile / 4; /* 32 words of FP8 bytes per tile row */

/* XOR swizzle of the word column: rows 16 apart land on different banks. */
__device__ __forceinline__ int swz(int row, int word) { return word ^ (((row >> 4) & 7) << 2); }

/* The store phase shared by cast_transpose and transpose: tile holds the FP8
 * bytes of rows m0.. and columns k0.. (128 x 128, swizzled words); each thread
 * gathers the 16-row x 4-column patch (rows mg*16.., word column kw) as 16
 * words, transposes it with byte permutes and writes four 16-byte rows of
 * out_t [k, m] (row stride ld >= m).  Needs m % 16 == 0 and ld % 16 == 0 (whole 16-byte
 * rows of out_t). */
__device__ __forceinline__ void store_tile_transposed(const uint32_t (*tile)[kWords], int64_t m0,
                                                      int64_t k0, int64_t m, int64_t k, int64_t ld,
                                                      int kw, int mg, uint8_t *__restrict__ out_t)
{
    if (m0 + mg * 16 >= m)
        return;
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int row = mg * 16 + i;
        w[i] = tile[row][swz(row, kw)];
    }
    uint32_t o[4][4]; /* o[kk][p]: rows 4p..4p+3 of column 4kw+kk */
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        uint32_t t0 = __byte_perm(w[4 * p], w[4 * p + 1], 0x5140);
        uint32_t t1 = __byte_perm(w[4 * p], w[4 * p + 1], 0x7362);
        uint32_t t2 = __byte_perm(w[4 * p + 2], w[4 * p + 3], 0x5140);
        uint32_t t3 = __byte_perm(w[4 * p + 2], w[4 * p + 3], 0x7362);
        o[0][p] = __byte_perm(t0, t2, 0x5410);
        o[1][p] = __byte_perm(t0, t2, 0x7632);
        o[2][p] = __byte_perm(t1, t3, 0x5410);
        o[3][p] = __byte_perm(t1, t3, 0x7632);
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        int64_t col = k0 + kw * 4 + kk;
        if (col < k)
            *reinterpret_cast<uint4 *>(out_t + col * ld + m0 + mg * 16) =
                make_uint4(o[kk][0], o[kk][1], o[kk][2], o[kk][3]);
    }
}

/* The fused grouped cast's input value: silu(gate) * up * p rounded to T and
 * read back, as moe_swiglu_forward stores it (float_bits.h's rounding). */
template <typename T>
__device__ __forceinline__ float swiglu_value(float gate, float up, float p)
{
    const float v = sf_moe_silu(gate) * up * p;
    if constexpr (sizeof(T) == 4)
        return v;
    else if constexpr (std::is_same_v<T, __half>)
        return sf_f16_to_f32(sf_f32_to_f16(v));
    else
        return sf_bf16_to_f32(sf_f32_to_bf16(v));
}

/* Eight values of a loaded vector as floats: x's own (plain), or the
 * SwiGLU value of gate vector x and up vector `up` with probability p. */
template <typename T, bool SWIGLU>
__device__ __forceinline__ void unpack_value8(const sf_raw8<T> &x, const sf_raw8<T> &up, float p, float *v)
{
    sf_unpack8(x, v);
    if constexpr (SWIGLU) {
        float u[8];
        sf_unpack8(up, u);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            v[e] = swiglu_value<T>(v[e], u[e], p);
    }
}

/* Where a tile's values come from.  Plain: x [m, k].  SWIGLU: x [m, 2k] of
 * gate|up pairs and probs (dtype pd; NULL: 1), the value swiglu_value. */
struct SwigluRows {
    const void *probs;
    sf_dtype pd;
};

/* SUMS (the dbias variant) also writes col_sums[tile row][k]: each 128-row
 * block's column sums of x in float32, in a fixed order that cast_cpu.c
 * repeats: per thread its 8 rows (lr, lr+16, ...), then the two threads of a
 * warp that share the columns (rows 2w.. and 2w+1..), then the 8 warps in
 * order. */
/* One tile of cast_transpose: rows m0.. and columns k0.. of x [m, k] cast
 * with `scale` into out [mp, k] and out_t [k, mp] (row stride ld_t), max |x|
 * bits folded into local_max.  SWIGLU: x is [m, 2k] gate|up pairs and the
 * value is swiglu_value with act's probabilities. */
template <typename T, bool E5M2, bool SUMS, bool SWIGLU = false>
__device__ __forceinline__ void cast_transpose_tile(
    const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, int64_t ld_t, int64_t m0, int64_t k0,
    float scale, uint8_t *__restrict__ out, uint8_t *__restrict__ out_t, float *__restrict__ col_sums,
    uint32_t (*tile)[kWords], float (*red)[kTile], uint32_t &local_max, SwigluRows act = {nullptr, SF_FLOAT32})
{
    const int t = threadIdx.x;
    /* load phase: 16 vectors of 8 per row, 16 rows per pass, 8 passes */
    const int lj = t & 15, lr = t >> 4;
    /* store phase: word column kw (4 k values), row group mg (16 rows) */
    const int warp = t >> 5, lane = t & 31;
    const int kw = warp * 4 + (lane >> 3), mg = lane & 7;
    {
        const int64_t kc = k0 + lj * 8;
        /* the SwiGLU form loads two vectors a row: its rows go in two phases of 4,
         * so its loads in flight fit the registers of the plain form's 8 */
        constexpr int P = SWIGLU ? 4 : 8;
        float csum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ph = 0; ph < 8; ph += P) {
            sf_raw8<T> raw[P];
            sf_raw8<T> raw_up[SWIGLU ? P : 1];
            float prob[SWIGLU ? P : 1];
            bool ok[P];
#pragma unroll
            for (int j = 0; j < P; ++j) {
                int64_t r = m0 + lr + 16 * (ph + j);
                ok[j] = r < m && kc < k;
                if (ok[j]) {
                    if constexpr (SWIGLU) {
                        sf_load_raw8(x + r * 2 * k + kc, raw[j]);
                        sf_load_raw8(x + r * 2 * k + k + kc, raw_up[j]);
                        prob[j] = act.probs ? sf_moe_ld(act.probs, act.pd, r) : 1.0f;
                    } else {
                        sf_load_raw8(x + r * k + kc, raw[j]);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < P; ++j) {
                int row = lr + 16 * (ph + j);
                uint2 w = make_uint2(0u, 0u); /* rows m..mp-1: zero padding */
                if (ok[j]) {
                    float v[8], s[8];
                    unpack_value8<T, SWIGLU>(raw[j], raw_up[SWIGLU ? j : 0], SWIGLU ? prob[SWIGLU ? j : 0] : 1.0f, v);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        local_max = max(local_max, sf_abs_bits(v[e]));
                        s[e] = __fmul_rn(v[e], scale);
                        if constexpr (SUMS)
                            csum[e] = __fadd_rn(csum[e], v[e]);
                    }
                    w.x = sf_cvt4<E5M2>(s);
                    w.y = sf_cvt4<E5M2>(s + 4);
                }
                if (out && m0 + row < mp && kc < k)
                    *reinterpret_cast<uint2 *>(out + (m0 + row) * k + kc) = w;
                /* words 2lj and 2lj+1 stay adjacent under the swizzle */
                if (out_t)
                    *reinterpret_cast<uint2 *>(&tile[row][swz(row, 2 * lj)]) = w;
            }
        }
        if constexpr (SUMS) {
            /* lanes l and l ^ 16 hold rows 2w.. and 2w+1.. of the same columns */
#pragma unroll
            for (int e = 0; e < 8; ++e)
                csum[e] = __fadd_rn(csum[e], __shfl_xor_sync(0xffffffffu, csum[e], 16));
            if (lane < 16)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    red[warp][lj * 8 + e] = csum[e];
        }
        if (!out_t && !SUMS)
            return; /* (row-wise only: no tile to share, so no barrier; out_t is the same for the whole CTA) */
        __syncthreads();
        if (out_t)
            store_tile_transposed(tile, m0, k0, mp, k, ld_t, kw, mg, out_t);
        if constexpr (SUMS) {
            if (t < kTile && k0 + t < k) {
                float sum = red[0][t];
#pragma unroll
                for (int w2 = 1; w2 < kThreads / 32; ++w2)
                    sum = __fadd_rn(sum, red[w2][t]);
                col_sums[(m0 / kTile) * k + k0 + t] = sum;
            }
        }
        __syncthreads();
    }
}

/* The tile loop of cast_transpose (and of cast_current after its barrier):
 * the block casts tiles blockIdx.x, blockIdx.x + gridDim.x, ... with `scale`
 * and returns its max |x| bits. */
template <typename T, bool E5M2, bool SUMS>
__device__ __forceinline__ uint32_t cast_transpose_tiles(
    const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, int64_t ld_t, float scale,
    uint8_t *__restrict__ out, uint8_t *__restrict__ out_t, float *__restrict__ col_sums,
    uint32_t (*tile)[kWords], float (*red)[kTile])
{
    const int64_t tiles_k = (k + kTile - 1) / kTile;
    const int64_t tiles = ((mp + kTile - 1) / kTile) * tiles_k;
    uint32_t local_max = 0;
    for (int64_t ti = blockIdx.x; ti < tiles; ti += gridDim.x)
        cast_transpose_tile<T, E5M2, SUMS>(x, m, mp, k, ld_t, (ti / tiles_k) * kTile, (ti % tiles_k) * kTile,
                                           scale, out, out_t, col_sums, tile, red, local_max);
    return local_max;
}

template <typename T, bool E5M2, bool SUMS = false>
__global__ void __launch_bounds__(kThreads, SUMS || sizeof(T) == 4 ? 2 : 4)
cast_transpose_kernel(const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, int64_t ld_t,
                      const float *__restrict__ scale_p, float *__restrict__ amax,
                      uint8_t *__restrict__ out, uint8_t *__restrict__ out_t,
                      float *__restrict__ scale_inv, float *__restrict__ col_sums = nullptr)
{
    __shared__ __align__(16) uint32_t tile[kTile][kWords]; /* 8- and 16-byte stores */
    __shared__ float red[SUMS ? kThreads / 32 : 1][kTile];
    const float scale = *scale_p;
    if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0)
        *scale_inv = __fdiv_rn(1.0f, scale);
    uint32_t local_max = cast_transpose_tiles<T, E5M2, SUMS>(x, m, mp, k, ld_t, scale, out, out_t, col_sums,
                                                            tile, red);
    if (amax)
        sf_block_atomic_max<kThreads>(local_max, amax);
}

/* Current scaling and cast_transpose in one cooperative launch (module note).
 * x is 16-byte aligned with k % 8 == 0, so it is read as vectors of 8. */
template <typename T, bool E5M2>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? 2 : 3)
cast_current_kernel(const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, float fp8_max,
                    float pow2_neg_margin, float *__restrict__ amax, float *__restrict__ scale_out,
                    uint8_t *__restrict__ out, uint8_t *__restrict__ out_t,
                    float *__restrict__ scale_inv)
{
    __shared__ __align__(16) uint32_t tile[kTile][kWords];
    __shared__ float red[1][kTile];
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    uint32_t local_max = 0;
    const int64_t nvec = m * k / 8, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride) {
        float v[8];
        sf_load8(x + i * 8, v);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            local_max = max(local_max, sf_abs_bits(v[e]));
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        *reinterpret_cast<unsigned *>(amax) = 0u; /* written, not accumulated */
    grid.sync();
    sf_block_atomic_max<kThreads>(local_max, amax);
    grid.sync();
    const float a = *reinterpret_cast<volatile float *>(amax);
    const float scale = sf_scale_from_amax(a, fp8_max, pow2_neg_margin, 1.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *scale_out = scale;
        *scale_inv = __fdiv_rn(1.0f, scale);
    }
    cast_transpose_tiles<T, E5M2, false>(x, m, mp, k, mp, scale, out, out_t, nullptr, tile, red);
}

template <typename T, bool E5M2>
__global__ void __launch_bounds__(kThreads)
cast_kernel(const T *__restrict__ x, int64_t n, int64_t n_out, const float *__restrict__ scale_p,
            float *__restrict__ amax, uint8_t *__restrict__ out, float *__restrict__ scale_inv)
{
    const float scale = *scale_p;
    if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0)
        *scale_inv = __fdiv_rn(1.0f, scale);
    uint32_t local_max = 0;
    const int64_t nvec = n / 8, stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t i = tid; i < nvec; i += stride) {
        float v[8];
        sf_load8(x + i * 8, v);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            local_max = max(local_max, sf_abs_bits(v[e]));
            v[e] = __fmul_rn(v[e], scale);
        }
        reinterpret_cast<uint2 *>(out)[i] = make_uint2(sf_cvt4<E5M2>(v), sf_cvt4<E5M2>(v + 4));
    }
    for (int64_t i = nvec * 8 + tid; i < n; i += stride) {
        float v = sf_to_float(x[i]);
        local_max = max(local_max, sf_abs_bits(v));
        out[i] = (uint8_t)sf_cvt2<E5M2>(__fmul_rn(v, scale), 0.0f);
    }
    for (int64_t i = n + tid; i < n_out; i += stride) /* token padding rows */
        out[i] = 0;
    if (amax)
        sf_block_atomic_max<kThreads>(local_max, amax);
}

/* Any shape and alignment: one element per thread per step. */
template <typename T>
__global__ void __launch_bounds__(kThreads)
cast_generic_kernel(const T *__restrict__ x, int64_t m, int64_t mp, int64_t k, int64_t ld_t,
                    const float *__restrict__ scale_p,
                    float *__restrict__ amax, uint8_t *__restrict__ out,
                    uint8_t *__restrict__ out_t, float *__restrict__ scale_inv, int e5m2)
{
    const float scale = *scale_p;
    if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0)
        *scale_inv = __fdiv_rn(1.0f, scale);
    uint32_t local_max = 0;
    const int64_t n = m * k, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = sf_to_float(x[i]);
        local_max = max(local_max, sf_abs_bits(v));
        uint8_t q = e5m2 ? (uint8_t)sf_cvt2<true>(__fmul_rn(v, scale), 0.0f)
                         : (uint8_t)sf_cvt2<false>(__fmul_rn(v, scale), 0.0f);
        if (out)
            out[i] = q;
        if (out_t)
            out_t[(i % k) * ld_t + i / k] = q;
    }
    for (int64_t i = n + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < mp * k; i += stride) {
        if (out) /* token padding rows */
            out[i] = 0;
        if (out_t)
            out_t[(i % k) * ld_t + i / k] = 0;
    }
    if (amax)
        sf_block_atomic_max<kThreads>(local_max, amax);
}

/* transpose: FP8 bytes [m, k] -> [k, m], one 128 x 128 tile per CTA.  Each
 * thread loads four 16-byte row pieces (rows lr + 32i, bytes 16lj..) into the
 * swizzled tile (a 16-byte piece is 4 words that the swizzle keeps together),
 * then stores as cast_transpose does.  Needs k % 16 == 0 and m % 16 == 0. */
__global__ void __launch_bounds__(kThreads)
transpose_kernel(const uint8_t *__restrict__ in, int64_t m, int64_t k, uint8_t *__restrict__ out_t)
{
    __shared__ __align__(16) uint32_t tile[kTile][kWords]; /* 8- and 16-byte stores */
    const int t = threadIdx.x;
    const int lj = t & 7, lr = t >> 3;
    const int warp = t >> 5, lane = t & 31;
    const int kw = warp * 4 + (lane >> 3), mg = lane & 7;
    const int64_t tiles_k = (k + kTile - 1) / kTile;
    const int64_t m0 = ((int64_t)blockIdx.x / tiles_k) * kTile, k0 = ((int64_t)blockIdx.x % tiles_k) * kTile;
    const int64_t kc = k0 + lj * 16;
    uint4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int64_t r = m0 + lr + 32 * i;
        v[i] = r < m && kc < k ? __ldg(reinterpret_cast<const uint4 *>(in + r * k + kc))
                               : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int row = lr + 32 * i;
        *reinterpret_cast<uint4 *>(&tile[row][swz(row, 4 * lj)]) = v[i];
    }
    __syncthreads();
    store_tile_transposed(tile, m0, k0, m, k, m, kw, mg, out_t);
}

/* Any shape and alignment: one byte per thread per step. */
__global__ void __launch_bounds__(kThreads)
transpose_generic_kernel(const uint8_t *__restrict__ in, int64_t m, int64_t k, uint8_t *__restrict__ out_t)
{
    const int64_t n = m * k, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out_t[(i % k) * m + i / k] = in[i];
}

sf_status device_sms(const char *op, int *sms)
{
    int device = 0;
    SF_CUDA_TRY(op, cudaGetDevice(&device));
    SF_CUDA_TRY(op, sf_cuda_query_sm_count(device, sms)); /* (cached: asked once a device) */
    return SF_OK;
}

int aligned(const void *p, uintptr_t bytes) { return ((uintptr_t)p % bytes) == 0; }

template <typename T>
sf_status launch_cast(const sf_cast_args *a, cudaStream_t stream)
{
    static const char op[] = "cast_fp8";
    int sms = 0;
    SF_TRY(device_sms(op, &sms));
    const T *x = (const T *)a->x;
    const int64_t n = a->m * a->k;
    if (a->out_t) {
        bool fast = a->k % 8 == 0 && a->mp % 16 == 0 && a->ld_t % 16 == 0 && aligned(x, 16) && aligned(a->out_t, 16) &&
                    (!a->out || aligned(a->out, 8));
        if (fast) {
            /* one tile per CTA: the hardware hands tiles out as CTAs finish,
             * which balances better than a fixed persistent split; the amax
             * atomics (one per CTA) are far below what L2 absorbs */
            int64_t tiles = ((a->mp + kTile - 1) / kTile) * ((a->k + kTile - 1) / kTile);
            int grid = (int)(tiles < 0x7fffffff ? tiles : 0x7fffffff);
            if (a->col_sums && a->e5m2)
                cast_transpose_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(
                    x, a->m, a->mp, a->k, a->ld_t, a->scale, a->amax, a->out, a->out_t, a->scale_inv, a->col_sums);
            else if (a->col_sums)
                cast_transpose_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(
                    x, a->m, a->mp, a->k, a->ld_t, a->scale, a->amax, a->out, a->out_t, a->scale_inv, a->col_sums);
            else if (a->e5m2)
                cast_transpose_kernel<T, true><<<grid, kThreads, 0, stream>>>(
                    x, a->m, a->mp, a->k, a->ld_t, a->scale, a->amax, a->out, a->out_t, a->scale_inv);
            else
                cast_transpose_kernel<T, false><<<grid, kThreads, 0, stream>>>(
                    x, a->m, a->mp, a->k, a->ld_t, a->scale, a->amax, a->out, a->out_t, a->scale_inv);
            SF_CUDA_CHECK_LAUNCH(op);
            return SF_OK;
        }
        if (a->col_sums) /* the entry checks the tiled kernel's rules: never leave the sums unwritten */
            return sf_fail(SF_ERR_VALUE, "%s: the column sums need the tiled kernel (K %% 8 == 0, "
                           "M %% 16 == 0, aligned x and outputs)", op);
    } else if (aligned(x, 16) && aligned(a->out, 8)) {
        int grid = sf_grid_size(n / 8 + 1, kThreads, sms * 8);
        const int64_t n_out = a->mp * a->k;
        if (a->e5m2)
            cast_kernel<T, true><<<grid, kThreads, 0, stream>>>(x, n, n_out, a->scale, a->amax, a->out,
                                                               a->scale_inv);
        else
            cast_kernel<T, false><<<grid, kThreads, 0, stream>>>(x, n, n_out, a->scale, a->amax, a->out,
                                                                a->scale_inv);
        SF_CUDA_CHECK_LAUNCH(op);
        return SF_OK;
    }
    int grid = sf_grid_size(a->mp * a->k, kThreads, sms * 8);
    cast_generic_kernel<T><<<grid, kThreads, 0, stream>>>(x, a->m, a->mp, a->k, a->ld_t, a->scale, a->amax,
                                                          a->out, a->out_t, a->scale_inv, a->e5m2);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

/* 8 elements a step (one 8-byte load, 16-byte stores) where the pointers
 * allow it, then the tail (or everything, unaligned) one element a step:
 * the same value per element either way. */
template <typename T>
__global__ void __launch_bounds__(kThreads)
dequantize_kernel(const uint8_t *__restrict__ data, int64_t n, int e5m2,
                  const float *__restrict__ scale_inv_p, T *__restrict__ out)
{
    const float si = *scale_inv_p;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t done = 0;
    if ((uintptr_t)data % 8 == 0 && (uintptr_t)out % 16 == 0) {
        const int64_t nvec = n / 8;
        for (int64_t i = tid; i < nvec; i += stride) {
            const uint2 raw = reinterpret_cast<const uint2 *>(data)[i];
            const uint8_t *b = reinterpret_cast<const uint8_t *>(&raw);
            alignas(16) T vals[8];
#pragma unroll
            for (int e = 0; e < 8; ++e)
                sf_store_dequant(vals + e, __fmul_rn(sf_fp8_to_f32(b[e], e5m2), si));
            const uint4 *src = reinterpret_cast<const uint4 *>(vals);
            uint4 *dst = reinterpret_cast<uint4 *>(out + i * 8);
#pragma unroll
            for (int w = 0; w < (int)(sizeof(T) * 8 / sizeof(uint4)); ++w)
                dst[w] = src[w];
        }
        done = nvec * 8;
    }
    for (int64_t i = done + tid; i < n; i += stride)
        sf_store_dequant(out + i, __fmul_rn(sf_fp8_to_f32(data[i], e5m2), si));
}

/* The delayed-scaling update of column j of the [h, ld] amax history, one
 * CTA per column (blockIdx.x): the column's amax (algo 0: the max over
 * every row; 1: row 0) by a block reduction over the absolute values' bits
 * (order-free, so the CPU loop's bits exactly, NaN included), the scale and
 * its inverse, then torch.roll(history, -1, 0) with row 0 cleared: row i
 * takes row i + 1 (i = 1 .. h - 2), the last row takes row 0.  The roll runs
 * in chunks of blockDim rows, each read into registers before the block
 * synchronises and writes it one row up, so no row is written before it is
 * read.  Why a CTA per column: one thread walking a column makes 2h
 * dependent strided loads, 106 us a step at the default h = 1,024 on an
 * H200 (profiled); a CTA's threads load independently. */
constexpr int kUpdateThreads = 128;

__global__ void __launch_bounds__(kUpdateThreads) scale_update_kernel(sf_scale_args a)
{
    const int64_t j = blockIdx.x;
    float *col = a.history + j;
    const int64_t h = a.h, ld = a.ld;
    const int t = threadIdx.x;
    const float first = col[0];
    uint32_t m = sf_abs_bits(first);
    if (a.algo == 0)
        for (int64_t i = 1 + t; i < h; i += kUpdateThreads)
            m = max(m, sf_abs_bits(col[i * ld]));
    __shared__ uint32_t warp_max[kUpdateThreads / 32];
    m = sf_warp_max_bits(m);
    if ((t & 31) == 0)
        warp_max[t >> 5] = m;
    __syncthreads(); /* (also: every thread has read row 0 and the rows it maxed over) */
    if (t == 0) {
        for (int w = 1; w < kUpdateThreads / 32; ++w)
            m = max(m, warp_max[w]);
        const float s = sf_scale_from_amax(sf_bits_f32(m), a.fp8_max[j], a.pow2_neg_margin, a.scale[j]);
        a.scale[j] = s;
        a.scale_inv[j] = __fdiv_rn(1.0f, s);
    }
    for (int64_t base = 1; base + 1 < h; base += kUpdateThreads) {
        const int64_t i = base + t;
        const float v = i + 1 < h ? col[(i + 1) * ld] : 0.0f;
        __syncthreads();
        if (i + 1 < h)
            col[i * ld] = v;
    }
    __syncthreads();
    if (t == 0) {
        if (h > 1)
            col[(h - 1) * ld] = first;
        col[0] = 0.0f;
    }
}

__global__ void compute_scale_kernel(sf_scale_args a)
{
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= a.n)
        return;
    float s = sf_scale_from_amax(a.amax[j], a.fp8_max_all, a.pow2_neg_margin, 1.0f);
    a.scale[j] = s;
    a.scale_inv[j] = __fdiv_rn(1.0f, s);
}

} // namespace

extern "C" sf_status sf_cast_fp8_cuda(const sf_cast_args *a, int device, sf_stream s)
{
    if (a->mp * a->k == 0 && !a->scale_inv)
        return SF_OK;
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("cast_fp8", device, &guard));
    sf_status st;
    if (a->mp * a->k == 0) {
        /* nothing to cast, but scale_inv must still follow scale */
        sf_cast_args b = *a;
        b.m = b.mp = 1;
        b.k = 0;
        b.col_sums = NULL; /* no rows: no sums to write */
        st = launch_cast<float>(&b, stream);
    } else {
        st = sf_visit_float("cast_fp8", "x", a->x_dtype, [&](auto tag) {
            return launch_cast<typename decltype(tag)::type>(a, stream);
        });
    }
    sf_cuda_device_restore(&guard);
    return st;
}

namespace {

/* cast_current_kernel<T, E5M2> on as many CTAs as fit on the GPU at once
 * (a grid barrier needs every CTA resident), at most one per tile. */
template <typename T, bool E5M2>
sf_status launch_cast_current(const sf_cast_args *a, float fp8_max, float pow2_neg_margin,
                              cudaStream_t stream)
{
    static const char op[] = "cast_fp8_current";
    /* resident CTAs per SM: a property of the kernel, asked once (any host thread may ask first) */
    static std::atomic<int> cached_per_sm{0};
    int per_sm = cached_per_sm.load(std::memory_order_relaxed);
    if (per_sm == 0) {
        SF_CUDA_TRY(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                            &per_sm, cast_current_kernel<T, E5M2>, kThreads, 0));
        cached_per_sm.store(per_sm, std::memory_order_relaxed);
    }
    int sms = 0;
    SF_TRY(device_sms(op, &sms));
    if (per_sm < 1)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: the cooperative kernel fits no CTA on an SM", op);
    int64_t tiles = ((a->mp + kTile - 1) / kTile) * ((a->k + kTile - 1) / kTile);
    int64_t resident = (int64_t)per_sm * sms;
    int grid = (int)(tiles < resident ? tiles : resident);
    const T *x = (const T *)a->x;
    int64_t m = a->m, mp = a->mp, k = a->k;
    float *amax = a->amax, *scale = (float *)a->scale, *scale_inv = a->scale_inv;
    uint8_t *out = a->out, *out_t = a->out_t;
    void *args[] = {(void *)&x, &m, &mp, &k, &fp8_max, &pow2_neg_margin, &amax, &scale, &out, &out_t,
                    &scale_inv};
    cudaError_t e = cudaLaunchCooperativeKernel((const void *)cast_current_kernel<T, E5M2>, grid,
                                                kThreads, args, 0, stream);
    if (e == cudaErrorCooperativeLaunchTooLarge || e == cudaErrorNotSupported) {
        (void)cudaGetLastError(); /* e.g. fewer SMs than the device has (MPS, green contexts) */
        return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: cooperative launch refused (%s)", op,
                       cudaGetErrorName(e));
    }
    SF_CUDA_TRY(op, e);
    return SF_OK;
}

template <typename T>
sf_status launch_cast_current_fmt(const sf_cast_args *a, float fp8_max, float p, cudaStream_t stream)
{
    return a->e5m2 ? launch_cast_current<T, true>(a, fp8_max, p, stream)
                   : launch_cast_current<T, false>(a, fp8_max, p, stream);
}

} // namespace

extern "C" sf_status sf_cast_fp8_current_cuda(const sf_cast_args *a, float fp8_max,
                                              float pow2_neg_margin, int device, sf_stream s,
                                              int *launched)
{
    *launched = a->out_t && a->m > 0 && a->k % 8 == 0 && a->mp % 16 == 0 && aligned(a->x, 16) &&
                aligned(a->out_t, 16) && (!a->out || aligned(a->out, 8)) && a->scale_inv;
    if (*launched) {
        /* cooperative launches on this device (every recent GPU: yes; a yes is cached, as this is
         * the weight cast's per-call path) */
        int yes = 0;
        if (sf_cuda_query_attribute<cudaDevAttrCooperativeLaunch>(device, &yes) != cudaSuccess)
            (void)cudaGetLastError();
        *launched = yes > 0;
    }
    if (!*launched)
        return SF_OK; /* the caller runs the three kernels */
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("cast_fp8_current", device, &guard));
    sf_status st;
    st = sf_visit_float("cast_fp8_current", "x", a->x_dtype, [&](auto tag) {
        return launch_cast_current_fmt<typename decltype(tag)::type>(a, fp8_max, pow2_neg_margin, stream);
    });
    sf_cuda_device_restore(&guard);
    if (st == SF_ERR_NOT_IMPLEMENTED) { /* no cooperative launch here: the three kernels instead */
        *launched = 0;
        return SF_OK;
    }
    return st;
}

namespace {

/* The grouped cast's kernels: every CTA takes one 128 x 128 tile of one
 * group's padded rows.  The table of one launch (up to kGroupsPerLaunch
 * groups) travels in the kernel parameters (3.9 KB of the 4 KB): each
 * group's first tile (a prefix sum, searched by the CTA), its input and
 * outputs, its rows, padded rows and out_t row stride, and for the fused
 * SwiGLU its rows' probabilities.  SWIGLU kernels read gate|up pairs
 * [m, 2k] and cast swiglu_value (sf_swiglu_cast_fp8_grouped).  Groups beyond
 * kGroupsPerLaunch take further launches. */
constexpr int kGroupsPerLaunch = 64;

struct GroupTable {
    int n;                               /* groups in this launch */
    int first;                           /* the first one's index in the whole problem */
    int tile_start[kGroupsPerLaunch + 1];/* group i's tiles: tile_start[i] .. tile_start[i + 1] */
    const void *x[kGroupsPerLaunch];
    uint8_t *out[kGroupsPerLaunch], *out_t[kGroupsPerLaunch]; /* entries NULL: no such copy */
    int64_t m[kGroupsPerLaunch], mp[kGroupsPerLaunch], ld_t[kGroupsPerLaunch];
    const void *probs[kGroupsPerLaunch]; /* the SwiGLU's row scales (entries NULL: 1) */
    sf_dtype probs_dtype;
};

struct GroupScales {
    float *scale, *amax, *scale_inv;
    int64_t scale_stride, amax_stride, scale_inv_stride;
    float fp8_max, pow2_neg_margin;
};

static_assert(sizeof(GroupTable) + sizeof(GroupScales) + sizeof(int64_t) <= 4096,
              "a grouped cast's kernel parameters must fit CUDA's 4 KB");

/* This CTA's group (the last one whose first tile is <= blockIdx.x). */
template <typename Table>
__device__ __forceinline__ int group_of_block(const Table &tab)
{
    int lo = 0, hi = tab.n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (tab.tile_start[mid] <= (int)blockIdx.x)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Current scaling, step 1: every group's amax slot set to 0 (the next
 * kernel folds into it). */
__global__ void grouped_zero_amax_kernel(GroupTable tab, GroupScales sc)
{
    for (int i = threadIdx.x; i < tab.n; i += blockDim.x)
        sc.amax[(int64_t)(tab.first + i) * sc.amax_stride] = 0.0f;
}

/* Current scaling, step 2: max |x_g| over each tile of real rows, folded into
 * amax[g] (one atomic per CTA). */
template <typename T, bool SWIGLU>
__global__ void __launch_bounds__(kThreads)
grouped_amax_kernel(int64_t k, GroupTable tab, GroupScales sc)
{
    const int i = group_of_block(tab);
    const int64_t tiles_k = (k + kTile - 1) / kTile, lt = blockIdx.x - tab.tile_start[i];
    const int64_t m0 = (lt / tiles_k) * kTile, k0 = (lt % tiles_k) * kTile, m = tab.m[i];
    const T *xg = static_cast<const T *>(tab.x[i]);
    const int lj = threadIdx.x & 15, lr = threadIdx.x >> 4;
    const int64_t kc = k0 + lj * 8;
    uint32_t local_max = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int64_t r = m0 + lr + 16 * j;
        if (r < m && kc < k) {
            float v[8];
            if constexpr (SWIGLU) {
                float up[8];
                sf_load8(xg + r * 2 * k + kc, v);
                sf_load8(xg + r * 2 * k + k + kc, up);
                const float p = tab.probs[i] ? sf_moe_ld(tab.probs[i], tab.probs_dtype, r) : 1.0f;
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    v[e] = swiglu_value<T>(v[e], up[e], p);
            } else {
                sf_load8(xg + r * k + kc, v);
            }
#pragma unroll
            for (int e = 0; e < 8; ++e)
                local_max = max(local_max, sf_abs_bits(v[e]));
        }
    }
    sf_block_atomic_max<kThreads>(local_max, sc.amax + (int64_t)(tab.first + i) * sc.amax_stride);
}

/* The cast: each CTA casts its tile of its group with the group's scale
 * (CURRENT: derived from the group's amax, as cast_current does) and, for
 * delayed scaling, folds the tile's max |x| into the group's amax.  The
 * group's first CTA writes scale_inv (and, CURRENT, the scale); CTA 0 does
 * it for groups with no rows (no tiles). */
template <typename T, bool E5M2, bool CURRENT, bool SWIGLU>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 4 ? 2 : 3)
grouped_cast_kernel(int64_t k, GroupTable tab, GroupScales sc)
{
    __shared__ __align__(16) uint32_t tile[kTile][kWords];
    __shared__ float red[1][kTile];
    const int i = group_of_block(tab);
    const int64_t g = tab.first + i;
    const int64_t tiles_k = (k + kTile - 1) / kTile, lt = blockIdx.x - tab.tile_start[i];
    float scale;
    if constexpr (CURRENT)
        scale = sf_scale_from_amax(sc.amax[g * sc.amax_stride], sc.fp8_max, sc.pow2_neg_margin, 1.0f);
    else
        scale = sc.scale[g * sc.scale_stride];
    if (lt == 0 && threadIdx.x == 0) {
        if constexpr (CURRENT)
            sc.scale[g * sc.scale_stride] = scale;
        sc.scale_inv[g * sc.scale_inv_stride] = __fdiv_rn(1.0f, scale);
    }
    if (blockIdx.x == 0)
        for (int j = threadIdx.x; j < tab.n; j += blockDim.x)
            if (tab.tile_start[j + 1] == tab.tile_start[j]) { /* a group with no rows */
                const int64_t gj = tab.first + j;
                float s = CURRENT ? 1.0f : sc.scale[gj * sc.scale_stride];
                if constexpr (CURRENT)
                    sc.scale[gj * sc.scale_stride] = s;
                sc.scale_inv[gj * sc.scale_inv_stride] = __fdiv_rn(1.0f, s);
            }
    uint32_t local_max = 0;
    cast_transpose_tile<T, E5M2, false, SWIGLU>(static_cast<const T *>(tab.x[i]), tab.m[i], tab.mp[i], k,
                                                tab.ld_t[i], (lt / tiles_k) * kTile, (lt % tiles_k) * kTile,
                                                scale, tab.out[i], tab.out_t[i], nullptr, tile, red, local_max,
                                                SwigluRows{tab.probs[i], tab.probs_dtype});
    if (!CURRENT && sc.amax)
        sf_block_atomic_max<kThreads>(local_max, sc.amax + g * sc.amax_stride);
}

template <typename T, bool SWIGLU>
sf_status launch_cast_grouped(const sf_cast_grouped_args *a, cudaStream_t stream)
{
    const char *op = SWIGLU ? "swiglu_cast_fp8_grouped" : "cast_fp8_grouped";
    const int64_t tiles_k = (a->k + kTile - 1) / kTile;
    const GroupScales sc = {a->scale,        a->amax,        a->scale_inv, a->scale_stride,
                            a->amax_stride,  a->scale_inv_stride, a->fp8_max, a->pow2_neg_margin};
    for (int64_t first = 0; first < a->groups; first += kGroupsPerLaunch) {
        GroupTable tab;
        tab.n = (int)(a->groups - first < kGroupsPerLaunch ? a->groups - first : kGroupsPerLaunch);
        tab.first = (int)first;
        tab.probs_dtype = a->probs_dtype;
        int64_t tiles = 0;
        for (int i = 0; i < tab.n; ++i) {
            const int64_t g = first + i;
            tab.tile_start[i] = (int)tiles;
            tab.x[i] = a->x[g];
            tab.out[i] = a->out ? a->out[g] : nullptr;
            tab.out_t[i] = a->out_t ? a->out_t[g] : nullptr;
            tab.m[i] = a->m[g];
            tab.mp[i] = a->mp[g];
            tab.ld_t[i] = a->ld_t[g];
            tab.probs[i] = a->probs ? a->probs[g] : nullptr;
            tiles += (a->mp[g] + kTile - 1) / kTile * tiles_k;
            if (tiles > 0x7fffffff)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'x' has too many 128 x 128 tiles (%lld)",
                               op, (long long)tiles);
        }
        tab.tile_start[tab.n] = (int)tiles;
        /* at least one CTA: it writes the scale inverses of groups with no rows */
        const int grid = tiles > 0 ? (int)tiles : 1;
        if (a->current) {
            grouped_zero_amax_kernel<<<1, kThreads, 0, stream>>>(tab, sc);
            if (tiles > 0)
                grouped_amax_kernel<T, SWIGLU><<<grid, kThreads, 0, stream>>>(a->k, tab, sc);
            if (a->e5m2)
                grouped_cast_kernel<T, true, true, SWIGLU><<<grid, kThreads, 0, stream>>>(a->k, tab, sc);
            else
                grouped_cast_kernel<T, false, true, SWIGLU><<<grid, kThreads, 0, stream>>>(a->k, tab, sc);
        } else if (a->e5m2) {
            grouped_cast_kernel<T, true, false, SWIGLU><<<grid, kThreads, 0, stream>>>(a->k, tab, sc);
        } else {
            grouped_cast_kernel<T, false, false, SWIGLU><<<grid, kThreads, 0, stream>>>(a->k, tab, sc);
        }
        SF_CUDA_CHECK_LAUNCH(op);
    }
    return SF_OK;
}

} // namespace

/* The SwiGLU's backward over padded blocks with its value's transposed FP8
 * copy (sf_swiglu_backward_cast_fp8_grouped).  Every CTA takes one 128-row
 * block of one group and walks its run of K tiles (128 columns each): for each tile
 * it loads the gate, up and dout values of its rows once, writes dx (the
 * gate and up gradients) row-wise (unless dx is NULL), parks the FP8 bytes of the SwiGLU value
 * (swiglu_value, cast with the group's scale) in the swizzled tile and
 * writes them transposed as cast_transpose does.  GRAD: dx rounded to T is
 * also cast with the gate-up layer's gradient scale, row-wise into its
 * padded block and through two more tiles (gate and up halves) transposed,
 * max |dx| folded into that layer's amax: the bytes grouped_cast_kernel
 * makes of dx.  A row's probability
 * gradient is a sum over all K columns, so where it is asked one CTA owns
 * whole rows: each thread sums its 8 rows over its columns, the 16 threads
 * of a row add up in a fixed shuffle order, with no atomics or second pass;
 * the grid is then one CTA per 128-row block (256 CTAs at Mixtral-small's
 * shape, about two for each SM).  Without it the grid's y also splits the
 * K tiles into runs of tiles_per_cta (backward_column_runs: about four
 * waves of CTAs, so a single group of 4,096 rows -- LayerNormMLP's SwiGLU
 * at Llama 1B's shape, 32 row blocks -- fills the device as well).  Each
 * CTA must keep its own loads in flight: the rows'
 * gate, up and dout segments are staged through shared memory with cp.async
 * a phase ahead (BackwardStaging), through the compute and through the
 * barriers around each tile's transposed stores.  The tile and
 * transposed-store steps are cast_transpose_tile's (here up to three tiles
 * are stored). */
struct BackwardTable {
    int n, first;
    int tile_start[kGroupsPerLaunch + 1]; /* group i's 128-row blocks */
    int64_t row[kGroupsPerLaunch];        /* its first row of x, dx, probs, dprobs */
    int64_t drow[kGroupsPerLaunch];       /* its first row of dout */
    int64_t col[kGroupsPerLaunch];        /* its padded offset: first column of out_t / g_out_t, row of g_out */
    int64_t m[kGroupsPerLaunch], mp[kGroupsPerLaunch];
};

struct BackwardPtrs {
    const void *x, *dout, *probs;
    void *dx, *dprobs;
    sf_dtype pd, dpd;
    uint8_t *out_t;
    int64_t k, ld_t;
    int tiles_per_cta; /* the K tiles of one CTA: blockIdx.y's run starts at tile blockIdx.y * tiles_per_cta */
    const float *scale;
    float *scale_inv;
    int64_t scale_stride, scale_inv_stride;
    /* GRAD: dx's FP8 copies for the gate-up layer's backward (row-wise [Mp, 2k], transposed [2k, Mp]) */
    uint8_t *g_out, *g_out_t;
    const float *g_scale;
    float *g_amax, *g_scale_inv;
    int64_t g_scale_stride, g_amax_stride, g_scale_inv_stride;
    int g_e5m2;
};

static_assert(sizeof(BackwardTable) + sizeof(BackwardPtrs) <= 4096,
              "the grouped SwiGLU backward's kernel parameters must fit CUDA's 4 KB");

/* Group g's delayed scale; the scale inverses written by the CTAs of the
 * first column run (blockIdx.y 0): g's by the first CTA of its rows (m0 ==
 * 0), those of the launch's groups with no rows by CTA 0. */
__device__ __forceinline__ float delayed_scale(const BackwardTable &tab, int64_t g, int64_t m0, const float *scale,
                                               int64_t scale_stride, float *scale_inv, int64_t inv_stride)
{
    const float s = scale[g * scale_stride];
    if (blockIdx.y != 0)
        return s;
    if (m0 == 0 && threadIdx.x == 0)
        scale_inv[g * inv_stride] = __fdiv_rn(1.0f, s);
    if (blockIdx.x == 0)
        for (int j = threadIdx.x; j < tab.n; j += blockDim.x)
            if (tab.tile_start[j + 1] == tab.tile_start[j]) { /* a group with no rows */
                const int64_t gj = tab.first + j;
                scale_inv[gj * inv_stride] = __fdiv_rn(1.0f, scale[gj * scale_stride]);
            }
    return s;
}

/* The backward's input staging: each thread copies its own rows' 8-column
 * segments of gate, up and dout into shared memory with cp.async,
 * kBackwardStages phases ahead of the one it computes, and reads back only
 * what it copied (so the stages need no barrier).  A phase is kRows of the
 * thread's 8 rows of a 128 x 128 tile: ROWS for 16-bit T, half as many for
 * float (the same bytes); ROWS 4 makes a stage 48 KB.  The loads of the next
 * phases stay in flight through the compute and through the barriers and
 * transposed stores that close each tile.  Timed on an H100 at Mixtral-small's
 * shape (32,768 rows, K 3,584, no dx, both gradient copies; logs/s51_call2_*):
 * rows 4 / stages 2 / 1 CTA an SM 590 us (2.19 TB/s); 4 / 3 / 1 608 us;
 * 2 / 2 / 2 722 us.  Devices whose blocks get less shared memory than ROWS 4's
 * stages and tiles (sm_86 / 89 / 120: 99 KB) run ROWS 2 (kSmallRows). */
#ifndef SF_BACKWARD_ROWS /* tune_cast.sh's builds set these */
#define SF_BACKWARD_ROWS 4
#endif
#ifndef SF_BACKWARD_STAGES
#define SF_BACKWARD_STAGES 2
#endif
#ifndef SF_BACKWARD_CTAS_PER_SM
#define SF_BACKWARD_CTAS_PER_SM 1
#endif
template <typename T, int ROWS>
struct BackwardStaging {
    static constexpr int kRows = sizeof(T) == 4 && ROWS > 1 ? ROWS / 2 : ROWS;
    static constexpr int kPhases = 8 / kRows; /* per 128-column tile */
    static constexpr int kSlot = (int)sizeof(sf_raw8<T>) / 16; /* 16-byte words a thread's row segment */
    static constexpr int kBytes = kRows * 3 * kThreads * (int)sizeof(sf_raw8<T>);
};
constexpr int kBackwardStages = SF_BACKWARD_STAGES;
/* The static shared memory of one of the kernel's FP8 tiles: 128 rows of kWords words where used, one row else. */
constexpr size_t backward_tile_bytes(bool used) { return (size_t)(used ? kTile : 1) * kWords * sizeof(uint32_t); }
constexpr int kSmallRows = 2;
static_assert(kBackwardStages >= 2 && 8 % SF_BACKWARD_ROWS == 0, "the SwiGLU backward's staging");

/* Phase q's copies (tile kt0 + q / kPhases, rows kRows * (q % kPhases) ..)
 * into stage `st`: slot (j, tensor) of thread t at st + ((j * 3 + tensor) *
 * kThreads + t) * kSlot 16-byte words; rows past m and columns past k are
 * zero-filled (and not read). */
template <typename T, int ROWS>
__device__ __forceinline__ void issue_backward_phase(uint4 *st, const T *x, const T *dout, int64_t m, int64_t k,
                                                     int64_t m0, int kt0, int q, int lr, int lj)
{
    using S = BackwardStaging<T, ROWS>;
    const int64_t kc = (int64_t)(kt0 + q / S::kPhases) * kTile + lj * 8;
    const int ph = q % S::kPhases;
#pragma unroll
    for (int j = 0; j < S::kRows; ++j) {
        const int64_t r = m0 + lr + 16 * (ph * S::kRows + j);
        const bool ok = r < m && kc < k;
        const T *src[3] = {ok ? x + r * 2 * k + kc : x, ok ? x + r * 2 * k + k + kc : x,
                           ok ? dout + r * k + kc : dout};
#pragma unroll
        for (int v = 0; v < 3; ++v)
#pragma unroll
            for (int w = 0; w < S::kSlot; ++w)
                cp_async_16(smem_addr(st + ((j * 3 + v) * kThreads + threadIdx.x) * S::kSlot + w),
                            reinterpret_cast<const uint4 *>(src[v]) + (ok ? w : 0), ok ? 16 : 0);
    }
}

template <typename T, int ROWS, bool E5M2, bool CAST, bool GRAD>
__global__ void __launch_bounds__(kThreads, SF_BACKWARD_CTAS_PER_SM)
grouped_swiglu_backward_kernel(BackwardTable tab, BackwardPtrs pt)
{
    using S = BackwardStaging<T, ROWS>;
    extern __shared__ __align__(16) uint4 staged[]; /* kBackwardStages x S::kBytes */
    __shared__ __align__(16) uint32_t tile[CAST ? kTile : 1][kWords];
    __shared__ __align__(16) uint32_t tile_g[GRAD ? kTile : 1][kWords], tile_u[GRAD ? kTile : 1][kWords];
    const int i = group_of_block(tab);
    const int64_t g = tab.first + i, m = tab.m[i], mp = tab.mp[i], k = pt.k;
    const int64_t m0 = (int64_t)(blockIdx.x - tab.tile_start[i]) * kTile;
    const float scale = CAST ? delayed_scale(tab, g, m0, pt.scale, pt.scale_stride, pt.scale_inv,
                                             pt.scale_inv_stride) : 1.0f;
    const float gscale = GRAD ? delayed_scale(tab, g, m0, pt.g_scale, pt.g_scale_stride, pt.g_scale_inv,
                                              pt.g_scale_inv_stride) : 1.0f;
    if (tab.tile_start[i + 1] == tab.tile_start[i])
        return; /* (the one CTA of a launch whose groups have no rows) */
    uint8_t *g_out = GRAD && pt.g_out ? pt.g_out + tab.col[i] * 2 * k : nullptr;
    uint8_t *g_out_t = GRAD ? pt.g_out_t : nullptr;
    if (g_out_t)
        g_out_t += tab.col[i];
    uint32_t local_max = 0;
    const T *x = static_cast<const T *>(pt.x) + tab.row[i] * 2 * k;
    const T *dout = static_cast<const T *>(pt.dout) + tab.drow[i] * k;
    T *dx = pt.dx ? static_cast<T *>(pt.dx) + tab.row[i] * 2 * k : nullptr; /* (NULL: its FP8 copies alone) */
    uint8_t *out_t = CAST ? pt.out_t + tab.col[i] : nullptr;
    const int t = threadIdx.x, lj = t & 15, lr = t >> 4;
    const int warp = t >> 5, lane = t & 31, kw = warp * 4 + (lane >> 3), mg = lane & 7;
    float dp[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float pr[8]; /* the thread's rows' probabilities (rows lr + 16 jj) */
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        const int64_t r = m0 + lr + 16 * jj;
        pr[jj] = pt.probs && r < m ? sf_moe_ld(pt.probs, pt.pd, tab.row[i] + r) : 1.0f;
    }
    /* this CTA's run of K tiles (the host makes every run non-empty) */
    const int tiles_k = (int)((k + kTile - 1) / kTile), kt0 = (int)blockIdx.y * pt.tiles_per_cta;
    const int kt1 = min(tiles_k, kt0 + pt.tiles_per_cta), phases = (kt1 - kt0) * S::kPhases;
    constexpr int kStageWords = S::kBytes / 16;
#pragma unroll
    for (int q = 0; q < kBackwardStages - 1; ++q) {
        if (q < phases)
            issue_backward_phase<T, ROWS>(staged + q * kStageWords, x, dout, m, k, m0, kt0, q, lr, lj);
        cp_async_commit();
    }
    int stage = 0; /* phase q's stage: q % kBackwardStages */
    for (int kt = kt0; kt < kt1; ++kt) {
        const int64_t k0 = (int64_t)kt * kTile, kc = k0 + lj * 8;
#pragma unroll
        for (int ph = 0; ph < S::kPhases; ++ph) {
            const int q = (kt - kt0) * S::kPhases + ph;
            cp_async_wait<kBackwardStages - 2>(); /* this thread's copies of phase q have landed */
            sf_raw8<T> rg[S::kRows], ru[S::kRows], rd[S::kRows];
            const uint4 *src = staged + stage * kStageWords;
#pragma unroll
            for (int j = 0; j < S::kRows; ++j) {
                const uint4 *slot = src + (j * 3 * kThreads + t) * S::kSlot;
                rg[j] = *reinterpret_cast<const sf_raw8<T> *>(slot);
                ru[j] = *reinterpret_cast<const sf_raw8<T> *>(slot + kThreads * S::kSlot);
                rd[j] = *reinterpret_cast<const sf_raw8<T> *>(slot + 2 * kThreads * S::kSlot);
            }
            /* refill the stage phase q - 1 used (read back in the last step) */
            const int next = stage == 0 ? kBackwardStages - 1 : stage - 1;
            if (q + kBackwardStages - 1 < phases)
                issue_backward_phase<T, ROWS>(staged + next * kStageWords, x, dout, m, k, m0, kt0,
                                              q + kBackwardStages - 1, lr, lj);
            cp_async_commit();
            stage = stage == kBackwardStages - 1 ? 0 : stage + 1;
#pragma unroll
            for (int j = 0; j < S::kRows; ++j) {
                const int jj = ph * S::kRows + j, row = lr + 16 * jj;
                const int64_t r = m0 + row;
                const bool ok = r < m && kc < k;
                const float p = pr[jj];
                uint2 w = make_uint2(0u, 0u); /* rows m..mp-1: zero padding */
                uint2 wg = make_uint2(0u, 0u), wu = make_uint2(0u, 0u);
                if (ok) {
                    float gv[8], uv[8], dv[8], dg[8], du[8];
                    sf_unpack8(rg[j], gv);
                    sf_unpack8(ru[j], uv);
                    sf_unpack8(rd[j], dv);
#pragma unroll
                    for (int h = 0; h < 2; ++h) { /* (four values at a time: the FP8 word of each half) */
                        float sv[4];
#pragma unroll
                        for (int e = 4 * h; e < 4 * h + 4; ++e) { /* (moe_swiglu_backward's expressions) */
                            const float s = sf_moe_silu(gv[e]);
                            dg[e] = dv[e] * p * uv[e] * sf_moe_dsilu(gv[e]);
                            du[e] = dv[e] * p * s;
                            dp[jj] += dv[e] * s * uv[e];
                            if constexpr (CAST)
                                sv[e - 4 * h] = __fmul_rn(swiglu_value<T>(gv[e], uv[e], p), scale);
                        }
                        if constexpr (CAST)
                            (h ? w.y : w.x) = sf_cvt4<E5M2>(sv);
                    }
                    if (dx) {
                        sf_vec::store_f<T, 8>(dx + r * 2 * k + kc, dg);
                        sf_vec::store_f<T, 8>(dx + r * 2 * k + k + kc, du);
                    }
                    if constexpr (GRAD) { /* dx as stored, cast with the gate-up layer's gradient scale */
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            dg[e] = sf_vec::to_f(sf_vec::from_f<T>(dg[e]));
                            du[e] = sf_vec::to_f(sf_vec::from_f<T>(du[e]));
                            local_max = max(local_max, max(sf_abs_bits(dg[e]), sf_abs_bits(du[e])));
                            dg[e] = __fmul_rn(dg[e], gscale);
                            du[e] = __fmul_rn(du[e], gscale);
                        }
                        if (pt.g_e5m2) {
                            wg = make_uint2(sf_cvt4<true>(dg), sf_cvt4<true>(dg + 4));
                            wu = make_uint2(sf_cvt4<true>(du), sf_cvt4<true>(du + 4));
                        } else {
                            wg = make_uint2(sf_cvt4<false>(dg), sf_cvt4<false>(dg + 4));
                            wu = make_uint2(sf_cvt4<false>(du), sf_cvt4<false>(du + 4));
                        }
                    }
                }
                if constexpr (CAST)
                    *reinterpret_cast<uint2 *>(&tile[row][swz(row, 2 * lj)]) = w;
                if constexpr (GRAD) {
                    if (g_out && r < mp && kc < k) { /* (rows m..mp-1: the zero padding) */
                        *reinterpret_cast<uint2 *>(g_out + r * 2 * k + kc) = wg;
                        *reinterpret_cast<uint2 *>(g_out + r * 2 * k + k + kc) = wu;
                    }
                    *reinterpret_cast<uint2 *>(&tile_g[row][swz(row, 2 * lj)]) = wg;
                    *reinterpret_cast<uint2 *>(&tile_u[row][swz(row, 2 * lj)]) = wu;
                }
            }
        }
        if constexpr (CAST || GRAD) {
            __syncthreads();
            if constexpr (CAST)
                store_tile_transposed(tile, m0, k0, mp, k, pt.ld_t, kw, mg, out_t);
            if constexpr (GRAD) {
                if (g_out_t) {
                    store_tile_transposed(tile_g, m0, k0, mp, k, pt.ld_t, kw, mg, g_out_t);
                    store_tile_transposed(tile_u, m0, k0, mp, k, pt.ld_t, kw, mg, g_out_t + k * pt.ld_t);
                }
            }
            __syncthreads();
        }
    }
    if constexpr (GRAD)
        if (pt.g_amax) { /* one atomic a warp (the three tiles fill the 48 KB of static shared memory) */
            const uint32_t w = __reduce_max_sync(0xffffffffu, local_max);
            if (lane == 0) /* (signed, as fp8.h's sf_amax_fold: a start of -0 or below loses) */
                atomicMax(reinterpret_cast<int *>(pt.g_amax + g * pt.g_amax_stride), (int)w);
        }
    if (pt.dprobs) { /* (one run of all K tiles: gridDim.y 1) */
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float v = dp[j]; /* the 16 threads of row lr + 16 j: one half of a warp */
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            const int64_t r = m0 + lr + 16 * j;
            if (lj == 0 && r < m)
                sf_moe_st(pt.dprobs, pt.dpd, tab.row[i] + r, v);
        }
    }
}

/* The K tiles of one CTA of the SwiGLU backward: all of them where the
 * probability gradient is asked (a row's sum over K stays in one CTA), else
 * runs sized so that the launch's row blocks times the runs make about four
 * waves of the device's CTAs (one run where the row blocks alone do), every
 * run non-empty.  Sets *runs, the grid's y. */
static int backward_column_runs(int64_t blocks, int64_t tiles_k, bool dprobs, int sms, int *runs)
{
    *runs = 1;
    if (dprobs || blocks <= 0 || tiles_k <= 1) /* (no columns: one CTA a row block writes the scale inverses) */
        return tiles_k > 1 ? (int)tiles_k : 1;
    const int64_t want = 4LL * sms * SF_BACKWARD_CTAS_PER_SM, fill = (want + blocks - 1) / blocks;
    const int64_t r = fill < tiles_k ? fill : tiles_k, per = (tiles_k + r - 1) / r;
    *runs = (int)((tiles_k + per - 1) / per);
    return (int)per;
}

template <typename T>
sf_status launch_swiglu_backward_grouped(const sf_swiglu_backward_grouped_args *a, int device, cudaStream_t stream)
{
    static const char op[] = "swiglu_backward_cast_fp8_grouped";
    const sf_cast_grouped_args *c = a->cast, *gr = a->grad;
    /* the staging the device's blocks hold beside the kernel's static tiles (CAST one, GRAD two) */
    int optin = 0, sms = 0;
    SF_CUDA_TRY(op, sf_cuda_query_smem_optin(device, &optin));
    SF_CUDA_TRY(op, sf_cuda_query_sm_count(device, &sms));
    const size_t tiles = backward_tile_bytes(c) + 2 * backward_tile_bytes(gr);
    const size_t smem_big = (size_t)kBackwardStages * BackwardStaging<T, SF_BACKWARD_ROWS>::kBytes;
    const size_t smem_small = (size_t)kBackwardStages * BackwardStaging<T, kSmallRows>::kBytes;
    const bool big = smem_big + tiles <= (size_t)optin;
    if (!big && smem_small + tiles > (size_t)optin)
        return sf_fail(SF_ERR_RUNTIME, "%s: the device gives a block %d bytes of shared memory; the kernel needs %zu",
                       op, optin, smem_small + tiles);
    const size_t smem = big ? smem_big : smem_small;
    BackwardPtrs pt = {a->x, a->dout, a->probs, a->dx, a->dprobs, a->probs_dtype, a->dprobs_dtype, a->out_t, a->k,
                  a->ld_t, 0, c ? c->scale : nullptr, c ? c->scale_inv : nullptr, c ? c->scale_stride : 0,
                  c ? c->scale_inv_stride : 0, a->grad_out, a->grad_out_t, gr ? gr->scale : nullptr,
                  gr ? gr->amax : nullptr, gr ? gr->scale_inv : nullptr, gr ? gr->scale_stride : 0,
                  gr ? gr->amax_stride : 0, gr ? gr->scale_inv_stride : 0, gr ? gr->e5m2 : 0};
    int64_t row = 0, prow = 0;
    for (int64_t first = 0; first < a->groups; first += kGroupsPerLaunch) {
        BackwardTable tab;
        tab.n = (int)(a->groups - first < kGroupsPerLaunch ? a->groups - first : kGroupsPerLaunch);
        tab.first = (int)first;
        int64_t blocks = 0;
        for (int i = 0; i < tab.n; ++i) {
            const int64_t g = first + i;
            tab.tile_start[i] = (int)blocks;
            tab.row[i] = row;
            tab.drow[i] = a->dout_padded ? prow : row;
            tab.col[i] = prow;
            tab.m[i] = a->m[g];
            tab.mp[i] = a->mp[g];
            row += a->m[g];
            prow += a->mp[g];
            blocks += (a->mp[g] + kTile - 1) / kTile;
            if (blocks > 0x7fffffff)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'x' has too many 128-row blocks (%lld)", op,
                               (long long)blocks);
        }
        tab.tile_start[tab.n] = (int)blocks;
        if (blocks == 0 && !c && !gr)
            continue;
        /* at least one CTA: with a cast it writes the scale inverses of groups with no rows */
        int runs = 1;
        pt.tiles_per_cta = backward_column_runs(blocks, (a->k + kTile - 1) / kTile, a->dprobs != nullptr, sms, &runs);
        const dim3 grid(blocks > 0 ? (unsigned)blocks : 1u, (unsigned)runs);
        auto pick = [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            return !c ? (gr ? grouped_swiglu_backward_kernel<T, R, false, false, true>
                            : grouped_swiglu_backward_kernel<T, R, false, false, false>)
                   : c->e5m2 ? (gr ? grouped_swiglu_backward_kernel<T, R, true, true, true>
                                   : grouped_swiglu_backward_kernel<T, R, true, true, false>)
                             : (gr ? grouped_swiglu_backward_kernel<T, R, false, true, true>
                                   : grouped_swiglu_backward_kernel<T, R, false, true, false>);
        };
        auto kernel = big ? pick(std::integral_constant<int, SF_BACKWARD_ROWS>{})
                          : pick(std::integral_constant<int, kSmallRows>{});
        SF_TRY(sf_allow_smem(op, kernel, smem, tiles, device));
        kernel<<<grid, kThreads, smem, stream>>>(tab, pt);
        SF_CUDA_CHECK_LAUNCH(op);
    }
    return SF_OK;
}

/* The entries have checked K % 16 == 0, 16-byte aligned inputs and outputs,
 * padded rows and out_t row strides multiples of 16: the tiled kernel's rules. */
extern "C" sf_status sf_cast_fp8_grouped_cuda(const sf_cast_grouped_args *a, int device, sf_stream s)
{
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    const char *op = a->swiglu ? "swiglu_cast_fp8_grouped" : "cast_fp8_grouped";
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    sf_status st = sf_visit_float(op, "x", a->x_dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        return a->swiglu ? launch_cast_grouped<T, true>(a, stream) : launch_cast_grouped<T, false>(a, stream);
    });
    sf_cuda_device_restore(&guard);
    return st;
}

namespace {

/* sf_cast_fp8_grouped_ends's kernel: CTA b casts rows b * Tiling::kRows ..
 * in place, every thread taking 8 columns of a row at a time, kUnroll such
 * vectors loaded before any is used (rows in order, so a thread's group
 * changes at most a few times).  The groups'
 * ends (clamped as the grouped GEMM clamps them), scales and amaxes sit in
 * shared memory; a row's group is found by binary search over the ends;
 * each thread keeps the max |x| of its current group and folds it into the
 * group's shared amax when its group changes, and the CTA folds the shared
 * amaxes into the global ones with one atomic per group it touched.  Rows
 * past the last end are written as zeros.  CTA 0 writes every group's
 * scale inverse. */
/* Rows a CTA, vectors a thread loads at once, CTAs an SM (its register cap),
 * by form.  Timed on an H100 at Mixtral-small's shapes (32,768 rows; logs/
 * s51_call3_*): the SwiGLU cast (K 3,584) 8 / 2 / 4 252 us (2.33 TB/s),
 * 16 / 2 / 4 255, 32 / 1 / any 261, 8 / 4 / 3 279, 32 / 4 / 3 286 (spills);
 * the plain cast (K 1,024) 32 / 4 / 3 43.2 us (2.33 TB/s), 8 / 4 / 3 44.5,
 * 16 / 2 / 4 45.4, 8 / 2 / 4 47.5, 32 / 1 / any 51.6. */
#ifndef SF_ENDS_ROWS /* the SwiGLU form's; tune_cast.sh's builds set these */
#define SF_ENDS_ROWS 8
#endif
#ifndef SF_ENDS_UNROLL
#define SF_ENDS_UNROLL 2
#endif
#ifndef SF_ENDS_CTAS_PER_SM
#define SF_ENDS_CTAS_PER_SM 4
#endif
template <bool SWIGLU>
struct EndsTiling {
    static constexpr int kRows = SF_ENDS_ROWS, kUnroll = SF_ENDS_UNROLL, kCtasPerSm = SF_ENDS_CTAS_PER_SM;
};
template <>
struct EndsTiling<false> {
    static constexpr int kRows = 32, kUnroll = 4, kCtasPerSm = 3;
};

struct EndsCast {
    const void *x, *probs;
    sf_dtype probs_dtype;
    uint8_t *out;
    int64_t m, k;
    const int32_t *row_end;
    int groups;
    float *scale, *amax, *scale_inv;
    int64_t scale_stride, amax_stride, scale_inv_stride;
};

template <typename T, bool E5M2, bool SWIGLU>
__global__ void __launch_bounds__(kThreads, EndsTiling<SWIGLU>::kCtasPerSm) grouped_ends_cast_kernel(EndsCast a)
{
    constexpr int kEndsRows = EndsTiling<SWIGLU>::kRows, kEndsUnroll = EndsTiling<SWIGLU>::kUnroll;
    __shared__ int64_t ends[SF_CAST_ENDS_MAX_GROUPS];
    __shared__ float scales[SF_CAST_ENDS_MAX_GROUPS];
    __shared__ unsigned maxes[SF_CAST_ENDS_MAX_GROUPS];
    const int t = threadIdx.x, G = a.groups;
    for (int g = t; g < G; g += kThreads) { /* (loaded side by side, then clamped in order by one thread) */
        ends[g] = __ldg(a.row_end + g);
        scales[g] = a.scale[g * a.scale_stride];
        maxes[g] = 0u;
        if (blockIdx.x == 0)
            a.scale_inv[g * a.scale_inv_stride] = __fdiv_rn(1.0f, scales[g]);
    }
    __syncthreads();
    if (t == 0) {
        int64_t prev = 0;
        for (int g = 0; g < G; ++g) {
            const int64_t e = ends[g];
            ends[g] = prev = e < prev ? prev : e > a.m ? a.m : e;
        }
    }
    __syncthreads();
    const int64_t vecs = a.k / 8, r0 = (int64_t)blockIdx.x * kEndsRows;
    const T *x = static_cast<const T *>(a.x);
    int cur = -1;
    uint32_t cur_max = 0;
    /* this thread's vectors: rows r0 + lr, columns 8 lc, stepped kThreads
     * vectors at a time (no division in the loop); K = 0: none */
    const int vecs32 = (int)vecs; /* (the launch checks K / 8 + kThreads fits an int) */
    const int step_r = vecs32 ? kThreads / vecs32 : 0, step_c = vecs32 ? kThreads % vecs32 : 0;
    int lr = vecs32 ? t / vecs32 : kEndsRows, lc = vecs32 ? t % vecs32 : 0;
    while (lr < kEndsRows && r0 + lr < a.m) {
        /* the batch's loads first, all in flight together; then its math and stores in row order */
        sf_raw8<T> ra[kEndsUnroll], rb[kEndsUnroll];
        float p[kEndsUnroll];
        int rs[kEndsUnroll], cs[kEndsUnroll]; /* the vectors' rows (from r0; -1: past the CTA's rows or x's), columns */
#pragma unroll
        for (int u = 0; u < kEndsUnroll; ++u) {
            const int64_t r = r0 + lr, c = (int64_t)lc * 8;
            rs[u] = lr < kEndsRows && r < a.m ? lr : -1;
            cs[u] = lc;
            if (rs[u] >= 0 && r < ends[G - 1]) {
                if constexpr (SWIGLU) {
                    sf_load_raw8(x + r * 2 * a.k + c, ra[u]);
                    sf_load_raw8(x + r * 2 * a.k + a.k + c, rb[u]);
                    p[u] = a.probs ? sf_moe_ld(a.probs, a.probs_dtype, r) : 1.0f;
                } else {
                    sf_load_raw8(x + r * a.k + c, ra[u]);
                }
            }
            lr += step_r;
            lc += step_c;
            if (lc >= vecs32) {
                lc -= vecs32;
                ++lr;
            }
        }
#pragma unroll
        for (int u = 0; u < kEndsUnroll; ++u) {
            if (rs[u] < 0)
                break;
            const int64_t r = r0 + rs[u], c = (int64_t)cs[u] * 8;
            uint2 w = make_uint2(0u, 0u);
            if (r < ends[G - 1]) {
                int lo = cur; /* the first group whose end is past r: mostly the last vector's */
                if (cur < 0 || r >= ends[cur] || (cur > 0 && r < ends[cur - 1])) {
                    lo = 0;
                    int hi = G - 1;
                    while (lo < hi) {
                        const int mid = (lo + hi) >> 1;
                        if (ends[mid] > r)
                            hi = mid;
                        else
                            lo = mid + 1;
                    }
                }
                if (lo != cur) {
                    if (cur >= 0 && cur_max)
                        atomicMax(&maxes[cur], cur_max);
                    cur = lo;
                    cur_max = 0;
                }
                float v[8], s[8];
                unpack_value8<T, SWIGLU>(ra[u], rb[u], SWIGLU ? p[u] : 1.0f, v);
                const float scale = scales[lo];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    cur_max = max(cur_max, sf_abs_bits(v[e]));
                    s[e] = __fmul_rn(v[e], scale);
                }
                w.x = sf_cvt4<E5M2>(s);
                w.y = sf_cvt4<E5M2>(s + 4);
            }
            *reinterpret_cast<uint2 *>(a.out + r * a.k + c) = w;
        }
    }
    if (cur >= 0 && cur_max)
        atomicMax(&maxes[cur], cur_max);
    __syncthreads();
    if (a.amax)
        for (int g = t; g < G; g += kThreads)
            if (maxes[g])
                atomicMax(reinterpret_cast<int *>(a.amax + g * a.amax_stride), (int)maxes[g]); /* sf_amax_fold */
}

} // namespace

extern "C" sf_status sf_cast_fp8_grouped_ends_cuda(const sf_cast_ends_args *e, int device, sf_stream s)
{
    const sf_cast_grouped_args *g = e->grouped;
    const char *op = "cast_fp8_grouped_ends";
    const int64_t rows = g->swiglu ? EndsTiling<true>::kRows : EndsTiling<false>::kRows;
    const int64_t blocks = (e->m + rows - 1) / rows;
    if (blocks > INT_MAX)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' has too many rows (%lld)", op, (long long)e->m);
    if (g->k / 8 > INT_MAX - kThreads)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'x' has too many columns (%lld)", op, (long long)g->k);
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    const EndsCast a = {e->x,       e->probs, g->probs_dtype, e->out,         e->m,
                        g->k,       e->row_end, (int)g->groups, g->scale,     g->amax,
                        g->scale_inv, g->scale_stride, g->amax_stride, g->scale_inv_stride};
    const int grid = blocks > 0 ? (int)blocks : 1; /* (CTA 0 writes the scale inverses even with no rows) */
    sf_status st = sf_visit_float(op, "x", g->x_dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if (g->swiglu && g->e5m2)
            grouped_ends_cast_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(a);
        else if (g->swiglu)
            grouped_ends_cast_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(a);
        else if (g->e5m2)
            grouped_ends_cast_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(a);
        else
            grouped_ends_cast_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(a);
        return SF_OK;
    });
    st = sf_cuda_launch_status(op, st);
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" sf_status sf_transpose_fp8_cuda(const sf_transpose_args *a, int device, sf_stream s)
{
    static const char op[] = "transpose_fp8";
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    sf_status st = SF_OK;
    if (a->k % 16 == 0 && a->m % 16 == 0 && aligned(a->in, 16) && aligned(a->out, 16)) {
        int64_t tiles = ((a->m + kTile - 1) / kTile) * ((a->k + kTile - 1) / kTile);
        if (tiles > 0x7fffffff)
            st = sf_fail(SF_ERR_VALUE, "%s: argument 'data' has too many 128 x 128 tiles (%lld)", op,
                         (long long)tiles);
        else
            transpose_kernel<<<(int)tiles, kThreads, 0, stream>>>(a->in, a->m, a->k, a->out);
    } else {
        int sms = 0;
        st = device_sms(op, &sms);
        if (st == SF_OK)
            transpose_generic_kernel<<<sf_grid_size(a->m * a->k, kThreads, sms * 8), kThreads, 0, stream>>>(
                a->in, a->m, a->k, a->out);
    }
    st = sf_cuda_launch_status(op, st);
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" sf_status sf_dequantize_fp8_cuda(const sf_dequant_args *a, int device, sf_stream s)
{
    if (a->n == 0)
        return SF_OK;
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("dequantize_fp8", device, &guard));
    int sms = 0;
    sf_status st = device_sms("dequantize_fp8", &sms);
    if (st == SF_OK) {
        int grid = sf_grid_size(a->n, kThreads, sms * 8);
        st = sf_visit_float("dequantize_fp8", "out", a->out_dtype, [&](auto tag) {
            using T = typename decltype(tag)::type;
            dequantize_kernel<T><<<grid, kThreads, 0, stream>>>(a->data, a->n, a->e5m2, a->scale_inv,
                                                                (T *)a->out);
            return SF_OK;
        });
        st = sf_cuda_launch_status("dequantize_fp8", st);
    }
    sf_cuda_device_restore(&guard);
    return st;
}

namespace {

/* compute_scale_kernel's launch: one thread per column, on `device`. */
template <typename Kernel>
sf_status launch_scale(const char *op, Kernel kernel, const sf_scale_args *a, int device,
                       sf_stream s)
{
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    int grid = (int)((a->n + kThreads - 1) / kThreads);
    kernel<<<grid, kThreads, 0, stream>>>(*a);
    const sf_status st = sf_cuda_launch_status(op, SF_OK);
    sf_cuda_device_restore(&guard);
    return st;
}

} // namespace

extern "C" sf_status sf_fp8_scale_update_cuda(const sf_scale_args *a, int device, sf_stream s)
{
    if (a->n == 0)
        return SF_OK;
    if (a->n > INT_MAX) /* (one CTA per column: the grid's x dimension) */
        return sf_fail(SF_ERR_VALUE, "fp8_scale_update: %lld tensors in one update, more than the %d one "
                       "launch takes", (long long)a->n, INT_MAX);
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("fp8_scale_update", device, &guard));
    scale_update_kernel<<<(unsigned)a->n, kUpdateThreads, 0, stream>>>(*a); /* one CTA per column */
    const sf_status st = sf_cuda_launch_status("fp8_scale_update", SF_OK);
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" sf_status sf_fp8_compute_scale_cuda(const sf_scale_args *a, int device, sf_stream s)
{
    return launch_scale("fp8_compute_scale", compute_scale_kernel, a, device, s);
}

extern "C" sf_status sf_column_sums_cuda(const float *ws, int64_t parts, int64_t n, void *out, sf_dtype out_dtype,
                                         int device, sf_stream s)
{
    if (n == 0)
        return SF_OK;
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("column_sums", device, &guard));
    sf_status st = sf_visit_float("column_sums", "out", out_dtype, [&](auto tag) {
        return sf_vec::launch_column_sums<typename decltype(tag)::type>("column_sums", ws, (int)parts, n, out, stream);
    });
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" sf_status sf_swiglu_backward_grouped_cuda(const sf_swiglu_backward_grouped_args *a, int device, sf_stream s)
{
    static const char op[] = "swiglu_backward_cast_fp8_grouped";
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    sf_status st = sf_visit_float(op, "x", a->dtype, [&](auto tag) {
        return launch_swiglu_backward_grouped<typename decltype(tag)::type>(a, device, stream);
    });
    sf_cuda_device_restore(&guard);
    return st;
}
