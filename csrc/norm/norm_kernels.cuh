/*
 * norm_kernels.cuh - the LayerNorm and RMSNorm kernels and their launch
 * code, included by the CUDA norm unit, norm_cuda.cu.
 *
 * LayerNorm and RMSNorm on the GPU: each direction reads its
 * inputs from memory once and writes its outputs once, on the caller's
 * stream, with no host synchronization and no allocation (the backward's
 * workspace is handed in).
 *
 * Minimum traffic per element (bf16): forward reads x and writes y (4 bytes),
 * backward reads x and dy and writes dx (6 bytes); gamma, beta and the
 * per-row statistics are a rounding error at the shapes that matter.  The
 * kernels are built to run at that minimum:
 *
 * - A row lives in registers, as packed 16-byte vectors (Pack<T, VEC>): a
 *   thread owns NV vectors of it, strided by the row's thread count tx so a
 *   warp's accesses are coalesced.  NV is a template parameter, so the
 *   register arrays are exactly as large as the configuration needs (an
 *   earlier version sized every thread for 32 elements and ran at 122-128
 *   registers, 16 warps per SM: 63 % / 54 % of copy for forward / backward).
 * - Short rows (each lane holding at most the split's elements per thread:
 *   16 forward, 16 / 32 backward for LayerNorm / RMSNorm) get one warp
 *   each: the row's sums are warp shuffles, no shared memory, no barrier.
 *   Longer rows get tx = a multiple of 32 threads (the split with the
 *   fewest idle slots); their sums cross warps through shared memory with
 *   one barrier (double-buffered, so no second barrier).  Several rows
 *   share a block (ty = block / tx).  The split's defaults come from a
 *   measured sweep (see kBackwardElemsDefault).
 * - Blocks are persistent: as many as fit on the GPU at once (occupancy
 *   query, cached), with the rows dealt out so every block walks the same
 *   number of row groups (no partial last wave).  Each block stages the
 *   weight (gamma or 1 + gamma) and beta as float32 in shared memory once.
 * - The next row's vectors are loaded into registers before the current
 *   row is reduced, so every warp keeps a row's loads in flight while it
 *   computes (software pipelining).
 *
 * Forward: mean and variance are two exact-order reductions over the row in
 * registers (no E[x^2] - E[x]^2 cancellation); mean / rstd are written for
 * the backward; the output is x's dtype or FP8 of scale * v (scale read on
 * the device), and amax is reduced per block and folded with one atomicMax
 * per block.
 *
 * Backward: one pass.  x and dy come into registers once; the two row sums
 * the dx formula needs are reduced together (one barrier per row); dx is
 * computed from the registers.  dgamma / dbeta partials for the thread's
 * columns accumulate in float32 registers across all the rows the block
 * walks; at the end the block folds its rows (fixed order) and writes one
 * float32 partial row to the workspace, and a small second kernel adds the
 * partial rows in a fixed order (deterministic, no atomics).
 *
 * Rows whose byte length is not a multiple of 16, or tensors not 16-byte
 * aligned, run the same kernels with one element per "vector" (the ops
 * layer warns once when that happens).
 */
#ifndef SF_NORM_KERNELS_CUH
#define SF_NORM_KERNELS_CUH

#include "norm_cuda.cuh"

namespace sf_norm {

__device__ __forceinline__ float warp_sum(float v)
{
    /* xor butterfly: every lane adds the same pairs, so all lanes agree bit for bit */
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* Sum N values over the threads of this row (same threadIdx.y); every thread
 * gets the same sums, added in a fixed order.  With one warp per row it is
 * shuffles only; otherwise warp partials go through `red` (2 buffers of 32
 * warps x N floats, alternated by `phase`: the barrier of the next call
 * orders this call's reads before that buffer is written again). */
template <int N>
__device__ __forceinline__ void row_sum(float (&v)[N], float *red, int &phase)
{
#pragma unroll
    for (int n = 0; n < N; ++n)
        v[n] = warp_sum(v[n]);
    if (blockDim.x == 32)
        return;
    const int nw = blockDim.x >> 5;
    float *buf = red + (phase * 32 + threadIdx.y * nw) * N;
    phase ^= 1;
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int n = 0; n < N; ++n)
            buf[(threadIdx.x >> 5) * N + n] = v[n];
    __syncthreads();
#pragma unroll
    for (int n = 0; n < N; ++n)
        v[n] = 0.0f;
    for (int i = 0; i < nw; ++i)
#pragma unroll
        for (int n = 0; n < N; ++n)
            v[n] += buf[i * N + n];
}

/* Shared-memory layout of the staged parameters.  Thread c reads the VEC
 * floats of its vector c; stored plainly (vector c at c * VEC) a warp's
 * 16-byte reads would stride by VEC * 4 = 32 bytes for 16-bit rows, two-way
 * bank conflicts on every read, and LayerNorm's forward reads w and beta
 * (64 bytes of shared memory per 16 bytes of x).  So the floats go in
 * chunks of CH = 4 (one float4), chunk j of every vector together: chunk j
 * of vector c at (j * nvec + c) * CH.  A warp's float4 reads of one chunk
 * are then 512 contiguous bytes, conflict free.  For VEC <= 4 this is the
 * plain layout.  Measured on the H200, the forward ran no faster for it
 * (LayerNorm 62 % of copy at 16384 x 4096 before and after): shared memory
 * was not what limits it; the layout stays because it costs nothing. */
template <int VEC>
__device__ __forceinline__ int staged_index(int i, int nvec)
{
    constexpr int CH = VEC >= 4 ? 4 : VEC;
    const int c = i / VEC, e = i % VEC;
    return ((e / CH) * nvec + c) * CH + e % CH;
}

/* The VEC staged floats of vector c. */
template <int VEC>
__device__ __forceinline__ void load_staged(const float *sm, int c, int nvec, float (&out)[VEC])
{
    constexpr int CH = VEC >= 4 ? 4 : VEC;
#pragma unroll
    for (int j = 0; j < VEC / CH; ++j) {
        float part[CH];
        load_f<float, CH>(sm + (j * nvec + c) * CH, part);
#pragma unroll
        for (int e = 0; e < CH; ++e)
            out[j * CH + e] = part[e];
    }
}

/* Stage the weight w (gamma, or 1 + gamma) and, when bsm is given, beta as
 * float32 in shared memory (layout: staged_index); every thread of the
 * block helps, then all wait. */
template <typename T, int VEC>
__device__ __forceinline__ void stage_params(const void *gamma, const void *beta, int f32, int zc,
                                             int hidden, float *wsm, float *bsm)
{
    const int nvec = hidden / VEC;
    for (int i = threadIdx.y * blockDim.x + threadIdx.x; i < hidden; i += blockDim.x * blockDim.y) {
        const float g = f32 ? ((const float *)gamma)[i] : to_f(((const T *)gamma)[i]);
        const int at = staged_index<VEC>(i, nvec);
        wsm[at] = sf_norm_weight(g, zc);
        if (bsm)
            bsm[at] = !beta ? 0.0f : f32 ? ((const float *)beta)[i] : to_f(((const T *)beta)[i]);
    }
    __syncthreads();
}

/* The NV raw vectors this thread owns in `row` (none past the row's end or
 * past the last row). */
template <typename T, int VEC, int NV>
__device__ __forceinline__ void load_row(const T *x, int64_t row, int64_t rows, int hidden,
                                         Pack<T, VEC> (&raw)[NV])
{
    if (row >= rows)
        return;
    const int nvec = hidden / VEC;
    const T *xr = x + row * (int64_t)hidden;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nvec)
            raw[k] = *reinterpret_cast<const Pack<T, VEC> *>(xr + (int64_t)c * VEC);
    }
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(NV * VEC <= kForwardElems ? 1024 : 512) norm_forward_kernel(ForwardParams p)
{
    constexpr bool PREFETCH = NV * VEC <= kForwardElems; /* next row in flight */
    __shared__ float red[2 * 32];
    __shared__ unsigned amax_red[32];
    extern __shared__ float4 smem4[];
    float *wsm = reinterpret_cast<float *>(smem4);
    float *bsm = wsm + ((p.hidden + 3) & ~3);
    stage_params<T, VEC>(p.gamma, p.beta, p.gamma_f32, p.zc, p.hidden, wsm, p.rms ? NULL : bsm);
    const int nvec = p.hidden / VEC;
    const float inv_h = 1.0f / (float)p.hidden;
    const float scale = p.out_kind != kOutSame ? *p.scale : 1.0f;
    const int64_t step = (int64_t)gridDim.x * blockDim.y;
    unsigned amax = 0u;
    int phase = 0;

    const T *X = (const T *)p.x;
    Pack<T, VEC> next[NV];
    int64_t base = (int64_t)blockIdx.x * blockDim.y;
    if (PREFETCH)
        load_row<T, VEC, NV>(X, base + threadIdx.y, p.rows, p.hidden, next);
    for (; base < p.rows; base += step) { /* uniform over the block: barriers inside */
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        /* this row stays packed (16-bit types: half the registers of floats)
         * and is converted where it is used */
        Pack<T, VEC> cur[NV];
        if (PREFETCH) {
#pragma unroll
            for (int k = 0; k < NV; ++k)
                cur[k] = next[k];
            load_row<T, VEC, NV>(X, row + step, p.rows, p.hidden, next);
        } else {
            load_row<T, VEC, NV>(X, row, p.rows, p.hidden, cur);
        }
        float s[1] = {0.0f};
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (active && c < nvec)
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    s[0] += to_f(cur[k].v[e]);
        }

        float mean = 0.0f;
        if (!p.rms) {
            row_sum<1>(s, red, phase);
            mean = s[0] * inv_h;
        }
        float q[1] = {0.0f};
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (active && c < nvec)
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float d = to_f(cur[k].v[e]) - mean;
                    q[0] += d * d;
                }
        }
        row_sum<1>(q, red, phase);
        const float rstd = sf_norm_rstd(q[0] * inv_h, p.eps);
        if (active && threadIdx.x == 0) {
            if (p.mean)
                p.mean[row] = mean;
            if (p.rstd)
                p.rstd[row] = rstd;
        }
        if (!active)
            continue; /* after the last barrier of this row */
        const int64_t roff = row * (int64_t)p.hidden;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c >= nvec)
                continue;
            float w[VEC], o[VEC];
            load_staged<VEC>(wsm, c, nvec, w);
            if (p.rms) {
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    o[e] = sf_norm_xhat(to_f(cur[k].v[e]), 0.0f, rstd) * w[e];
            } else {
                float b[VEC];
                load_staged<VEC>(bsm, c, nvec, b);
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    o[e] = sf_norm_xhat(to_f(cur[k].v[e]), mean, rstd) * w[e] + b[e];
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                amax = max(amax, abs_bits(o[e]));
            const int64_t off = roff + (int64_t)c * VEC;
            if (p.out_kind == kOutSame)
                store_f<T, VEC>((T *)p.y + off, o);
            else
                store_fp8<VEC>((uint8_t *)p.y + off, o, scale, p.out_kind == kOutE5M2);
        }
    }
    if (p.amax)
        block_publish_max(amax, amax_red, p.amax);
    if (p.scale_inv && blockIdx.x == 0 && threadIdx.x == 0 && threadIdx.y == 0)
        *p.scale_inv = 1.0f / scale;
}

/* Fold one VEC-wide column slice across the block's rows (threadIdx.y) in a
 * fixed order and store it at column slice c of dst.  All threads call it. */
template <int VEC>
__device__ __forceinline__ void fold_store(const float (&val)[VEC], int c, int nvec, float *fold,
                                           float *dst)
{
    if (blockDim.y == 1) {
        if (c < nvec)
            store_f<float, VEC>(dst + (int64_t)c * VEC, val);
        return;
    }
    float *mine = fold + ((int)threadIdx.y * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e)
        mine[e] = val[e];
    __syncthreads();
    if (threadIdx.y == 0 && c < nvec) {
        float s[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            s[e] = 0.0f;
        for (int j = 0; j < (int)blockDim.y; ++j) {
            const float *f = fold + (j * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                s[e] += f[e];
        }
        store_f<float, VEC>(dst + (int64_t)c * VEC, s);
    }
    __syncthreads();
}

/* RMS: no mean, no dbeta (compile-time, so RMSNorm does not hold dbeta
 * registers).  PREFETCH: load the next row's x and dy before reducing this
 * one (off where the registers would not fit). */
template <typename T, int VEC, int NV, bool RMS>
__global__ void __launch_bounds__(NV * VEC <= kBackwardElems ? 1024 : 512) norm_backward_kernel(BackwardParams p)
{
    constexpr bool PREFETCH = NV * VEC <= kBackwardElems; /* next row in flight */
    __shared__ float red[2 * 32 * 2];
    /* dynamic shared memory: the weight w = gamma (or 1 + gamma) as float32,
     * staged once per block (the block is persistent), then the fold buffer
     * of blockDim.x * blockDim.y * VEC floats */
    extern __shared__ float4 smem4[];
    float *wsm = reinterpret_cast<float *>(smem4);
    float *fold = wsm + ((p.hidden + 3) & ~3);
    stage_params<T, VEC>(p.gamma, NULL, p.gamma_f32, p.zc, p.hidden, wsm, NULL);
    const int nvec = p.hidden / VEC;
    const float inv_h = 1.0f / (float)p.hidden;

    float dg[NV][VEC], db[RMS ? 1 : NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            dg[k][e] = 0.0f;
            db[RMS ? 0 : k][e] = 0.0f;
        }

    const T *X = (const T *)p.x, *DY = (const T *)p.dy;
    const int64_t step = (int64_t)gridDim.x * blockDim.y;
    int phase = 0;
    int64_t base = (int64_t)blockIdx.x * blockDim.y;
    /* the row's statistics, loaded with (PREFETCH: one row ahead of) x and dy */
    auto load_stats = [&](int64_t r, float &m, float &rs) {
        m = (r < p.rows && !RMS) ? p.mean[r] : 0.0f;
        rs = r < p.rows ? p.rstd[r] : 0.0f;
    };
    Pack<T, VEC> nx[NV], ndy[NV];
    float nmean = 0.0f, nrstd = 0.0f;
    if (PREFETCH) {
        load_row<T, VEC, NV>(X, base + threadIdx.y, p.rows, p.hidden, nx);
        load_row<T, VEC, NV>(DY, base + threadIdx.y, p.rows, p.hidden, ndy);
        load_stats(base + threadIdx.y, nmean, nrstd);
    }
    for (; base < p.rows; base += step) { /* uniform over the block: barriers inside */
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        Pack<T, VEC> cx[NV], cdy[NV];
        float mean, rstd;
        if (PREFETCH) {
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                cx[k] = nx[k];
                cdy[k] = ndy[k];
            }
            mean = nmean;
            rstd = nrstd;
            load_row<T, VEC, NV>(X, row + step, p.rows, p.hidden, nx);
            load_row<T, VEC, NV>(DY, row + step, p.rows, p.hidden, ndy);
            load_stats(row + step, nmean, nrstd);
        } else {
            load_row<T, VEC, NV>(X, row, p.rows, p.hidden, cx);
            load_row<T, VEC, NV>(DY, row, p.rows, p.hidden, cdy);
            load_stats(row, mean, rstd);
        }
        const float nmr = -mean * rstd; /* xhat = x * rstd + nmr, one fma (norm.h) */

        float s[2] = {0.0f, 0.0f}; /* sum g, sum g * xhat; g = dy * w */
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (!(active && c < nvec))
                continue;
            float w[VEC];
            load_staged<VEC>(wsm, c, nvec, w);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float dyv = to_f(cdy[k].v[e]);
                const float xhat = fmaf(to_f(cx[k].v[e]), rstd, nmr);
                const float g = dyv * w[e];
                s[0] += g;
                s[1] += g * xhat;
                dg[k][e] += dyv * xhat;
                if (!RMS)
                    db[RMS ? 0 : k][e] += dyv;
            }
        }
        row_sum<2>(s, red, phase);
        if (!active)
            continue; /* after the row's only barrier */
        const float m1 = RMS ? 0.0f : s[0] * inv_h;
        const float m2 = s[1] * inv_h;
        const int64_t roff = row * (int64_t)p.hidden;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = threadIdx.x + k * blockDim.x;
            if (c >= nvec)
                continue;
            float w[VEC], dxv[VEC];
            load_staged<VEC>(wsm, c, nvec, w);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float xhat = fmaf(to_f(cx[k].v[e]), rstd, nmr);
                const float g = to_f(cdy[k].v[e]) * w[e];
                dxv[e] = sf_norm_dx(rstd, g, xhat, m1, m2);
            }
            if (p.dres) { /* a residual's gradient, added before the one rounding */
                const Pack<T, VEC> r = *reinterpret_cast<const Pack<T, VEC> *>((const T *)p.dres + roff +
                                                                               (int64_t)c * VEC);
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    dxv[e] += to_f(r.v[e]);
            }
            store_f<T, VEC>((T *)p.dx + roff + (int64_t)c * VEC, dxv);
        }
    }

    float *wsg = p.ws + (int64_t)blockIdx.x * p.hidden;
    float *wsb = p.ws + ((int64_t)gridDim.x + blockIdx.x) * p.hidden;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        fold_store<VEC>(dg[k], c, nvec, fold, wsg);
        if (!RMS && p.want_dbeta)
            fold_store<VEC>(db[RMS ? 0 : k], c, nvec, fold, wsb);
    }
}

/* ---- launch code ---------------------------------------------------- */

/* More than the kernels' static shared memory (the reduction scratch), for
 * sf_allow_smem: requests below 48 KB less this need no opt-in. */
constexpr size_t kNormStaticSmem = 4 * 1024;

/* Persistent grid: at most what fits at once, with the row groups dealt out
 * evenly (every block walks ceil(groups / cap) groups, or one fewer). */
inline int64_t balanced_grid(int64_t groups, int64_t cap)
{
    if (groups <= cap)
        return groups;
    const int64_t per_block = (groups + cap - 1) / cap;
    return (groups + per_block - 1) / per_block;
}

template <typename K>
sf_status persistent_grid(const char *op, K kernel, const Config &c, size_t smem, int64_t rows,
                          int device, int64_t *grid)
{
    int per_sm, sms;
    SF_TRY(blocks_per_sm(op, kernel, c.tx * c.ty, smem, device, &per_sm));
    SF_TRY(sf_vec::sm_count(op, device, &sms));
    const int64_t groups = (rows + c.ty - 1) / c.ty;
    *grid = balanced_grid(groups, (int64_t)sms * per_sm);
    return SF_OK;
}

template <typename T, int VEC, int NV>
sf_status launch_forward_nv(const ForwardParams &p, const Config &c, int device, cudaStream_t stream)
{
    const size_t smem = (p.rms ? 1 : 2) * (size_t)((p.hidden + 3) & ~3) * sizeof(float);
    auto kernel = norm_forward_kernel<T, VEC, NV>;
    SF_TRY(sf_allow_smem("norm_forward", kernel, smem, kNormStaticSmem, device));
    int64_t grid;
    SF_TRY(persistent_grid("norm_forward", kernel, c, smem, p.rows, device, &grid));
    kernel<<<(unsigned)grid, dim3(c.tx, c.ty), smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("norm_forward");
    return SF_OK;
}

template <typename T>
sf_status launch_forward(const ForwardParams &p, bool vec, int device, cudaStream_t stream)
{
    constexpr int V = 16 / sizeof(T);
    const Config c = forward_config(p.hidden, vec ? V : 1);
    if (!vec)
        return launch_forward_nv<T, 1, kScalarNV>(p, c, device, stream);
    switch (c.nv) {
    case 1: return launch_forward_nv<T, V, 1>(p, c, device, stream);
    case 2: return launch_forward_nv<T, V, 2>(p, c, device, stream);
    case 4: return launch_forward_nv<T, V, 4>(p, c, device, stream);
    case 8: /* fp32 rows > 8192 */
        if constexpr (V == 4)
            return launch_forward_nv<T, V, 8>(p, c, device, stream);
    }
    return sf_fail(SF_ERR_RUNTIME, "norm_forward: no kernel holds %d vectors per thread (hidden %d)", c.nv,
                   p.hidden);
}

template <typename T, int VEC, int NV, bool RMS>
sf_status launch_backward_nv(const BackwardParams &p, const Config &c, int device, int64_t bound,
                        cudaStream_t stream, int64_t *grid)
{
    const size_t smem = (size_t)((p.hidden + 3) & ~3) * sizeof(float) +
                        (c.ty > 1 ? (size_t)c.tx * c.ty * VEC * sizeof(float) : 0);
    auto kernel = norm_backward_kernel<T, VEC, NV, RMS>;
    SF_TRY(sf_allow_smem("norm_backward", kernel, smem, kNormStaticSmem, device));
    SF_TRY(persistent_grid("norm_backward", kernel, c, smem, p.rows, device, grid));
    if (*grid > bound)
        *grid = bound; /* the workspace holds `bound` partial rows */
    kernel<<<(unsigned)*grid, dim3(c.tx, c.ty), smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("norm_backward");
    return SF_OK;
}

template <typename T, int VEC, int NV>
sf_status launch_backward_rms(const BackwardParams &p, const Config &c, int device, int64_t bound,
                         cudaStream_t stream, int64_t *grid)
{
    if (p.rms)
        return launch_backward_nv<T, VEC, NV, true>(p, c, device, bound, stream, grid);
    return launch_backward_nv<T, VEC, NV, false>(p, c, device, bound, stream, grid);
}

template <typename T>
sf_status launch_backward(const BackwardParams &p, const Config &c, bool vec, int device, int64_t bound,
                     cudaStream_t stream, int64_t *grid)
{
    constexpr int V = 16 / sizeof(T);
    if (!vec)
        return launch_backward_rms<T, 1, kScalarNV>(p, c, device, bound, stream, grid);
    switch (c.nv) {
    case 1: return launch_backward_rms<T, V, 1>(p, c, device, bound, stream, grid);
    case 2: return launch_backward_rms<T, V, 2>(p, c, device, bound, stream, grid);
    case 4: return launch_backward_rms<T, V, 4>(p, c, device, bound, stream, grid);
    case 8:
        if constexpr (V == 4)
            return launch_backward_rms<T, V, 8>(p, c, device, bound, stream, grid);
    }
    return sf_fail(SF_ERR_RUNTIME, "norm_backward: no kernel holds %d vectors per thread (hidden %d)", c.nv,
                   p.hidden);
}

} // namespace sf_norm

#endif /* SF_NORM_KERNELS_CUH */
