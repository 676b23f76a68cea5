/*
 * act_cuda.cu - activations (forward and backward, optional FP8 output) and
 * bias + dropout + residual on the GPU: one pass, 16-byte vector accesses,
 * on the caller's stream, no host synchronization.
 *
 * Work layout: the tensor is [rows, cols] (an element-wise activation is one
 * long row; a gated one has rows of 2n inputs and n outputs; dropout has the
 * bias dimension as cols).  blockIdx.y walks rows, blockIdx.x and threadIdx.x
 * walk the vectors of a row; each thread loads U vectors of every input
 * before computing any (vec_unroll: 32 to 64 bytes of input in flight per
 * thread).
 *
 * Speed: these are pure streams (forward reads 2 bytes and writes 2 per bf16
 * element; GLUs read 4 and write 2 per output), so what matters is bytes in
 * flight per SM, i.e. occupancy, and an even end.  The activation is a
 * template parameter of the vector kernels (an earlier version switched on
 * it at run time: every kernel carried erfc's and the gated backward's
 * registers, 114-128 in all, 2 blocks of 256 per SM, and ran at 45-77 % of
 * copy, below torch's own element-wise kernels); the kernels are bounded to
 * 64 registers (4 blocks of 256 per SM at least).  The grid covers the
 * tensor once (a block is 256 threads x U vectors of one row; rows past
 * 65,535 are walked block-stride), so the hardware hands out many short
 * blocks and the last wave is a sliver: a grid of what fits at once,
 * walking the tensor grid-stride, gave each thread ceil(work / threads)
 * rounds, 3 % more than the mean at a Llama 1B MLP's 8,192 x 2 x 8,192
 * (SwiGLU forward 0.143 against 0.136 ms on an H100, backward 0.237 against
 * 0.224; bin/check_act_act's bandwidth section, s42).  Only the element-wise fallback
 * (rows not in 16-byte vectors) switches on the activation at run time.
 * When a row's vectors cannot be 16-byte aligned (a gated n, or a dropout row
 * length, not a multiple of the vector width; an offset view) the same kernel
 * runs with one element per vector; a lone element-wise row takes its tail
 * element by element.
 *
 * Dropout regenerates its keep decisions from Philox (act.h) in the backward
 * instead of storing a mask.  Its dbias is deterministic: each thread owns one
 * column vector and sums it over the rows of its block's row set; blocks write
 * float32 partial rows to the workspace, which a second kernel folds in a
 * fixed order.
 */
#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "../core/visit.cuh"
#include "act.h"
#include "act_backend.h"

namespace {

using namespace sf_vec;

constexpr int kThreads = 256;
constexpr int kMinBlocks = 4; /* vector kernels: <= 64 registers a thread */

struct ActParams {
    const void *x, *dy;
    void *out;
    const float *scale;
    unsigned *amax;
    float *scale_inv;
    int64_t rows, n; /* n: outputs (forward) per row; the input row has in_cols */
    int64_t in_cols;
    int base, gated, out_kind;
};

/* Store VEC values at element offset `off` of the output (its dtype or FP8). */
template <typename T, int VEC>
__device__ __forceinline__ void store_out(const ActParams &p, int64_t off, const float (&v)[VEC],
                                          float scale)
{
    if (p.out_kind == kOutSame)
        store_f<T, VEC>((T *)p.out + off, v);
    else
        store_fp8<VEC>((uint8_t *)p.out + off, v, scale, p.out_kind == kOutE5M2);
}

template <int VEC>
__device__ __forceinline__ unsigned vmax(unsigned m, const float (&v)[VEC])
{
#pragma unroll
    for (int e = 0; e < VEC; ++e)
        m = max(m, abs_bits(v[e]));
    return m;
}

/* Pack<T, N> -> N floats. */
template <typename T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N> &pk, float (&out)[N])
{
#pragma unroll
    for (int k = 0; k < N; ++k)
        out[k] = to_f(pk.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_raw(const T *p)
{
    return *reinterpret_cast<const Pack<T, N> *>(p);
}

/* The raw inputs of one vector: a (activation half), b (gate half, gated
 * only) and dy (backward only). */
template <typename T, int VEC>
struct Raw {
    Pack<T, VEC> a, b, dy;
};

template <typename T, int VEC, bool BACKWARD>
__device__ __forceinline__ void load_vec(const ActParams &p, int64_t r, int64_t c, Raw<T, VEC> &raw)
{
    const T *xr = (const T *)p.x + r * p.in_cols;
    raw.a = load_raw<T, VEC>(xr + c);
    if (p.gated)
        raw.b = load_raw<T, VEC>(xr + p.n + c);
    if (BACKWARD)
        raw.dy = load_raw<T, VEC>((const T *)p.dy + r * p.n + c);
}

/* Compute and store one vector; returns the running max of |output| bits. */
template <typename T, int VEC, bool BACKWARD>
__device__ __forceinline__ unsigned compute_vec(const ActParams &p, int base, int64_t r, int64_t c,
                                                const Raw<T, VEC> &raw, float scale, unsigned m)
{
    float a[VEC], b[VEC], o[VEC];
    unpack<T, VEC>(raw.a, a);
    if (p.gated)
        unpack<T, VEC>(raw.b, b);
    if (!BACKWARD) {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            o[e] = p.gated ? sf_act_base(base, a[e]) * b[e] : sf_act_base(base, a[e]);
        store_out<T, VEC>(p, r * p.n + c, o, scale);
        return vmax<VEC>(m, o);
    }
    float dy[VEC];
    unpack<T, VEC>(raw.dy, dy);
    if (p.gated) {
        float db[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float f, df;
            sf_act_base_both(base, a[e], &f, &df);
            o[e] = sf_act_chain(base, dy[e] * b[e], df);
            db[e] = dy[e] * f;
        }
        store_out<T, VEC>(p, r * p.in_cols + p.n + c, db, scale);
        m = vmax<VEC>(m, db);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            o[e] = sf_act_chain(base, dy[e], sf_act_base_grad(base, a[e]));
    }
    store_out<T, VEC>(p, r * p.in_cols + c, o, scale);
    return vmax<VEC>(m, o);
}

/* The element-wise fallback (rows not in 16-byte vectors: VEC = 1), any
 * activation (p.base read at run time): forward (BACKWARD false) or backward over
 * every row, U elements loaded before any is computed. */
template <typename T, int VEC, bool BACKWARD>
__global__ void __launch_bounds__(kThreads) act_kernel(ActParams p)
{
    constexpr int U = BACKWARD ? 2 : 4;
    __shared__ unsigned red[kThreads / 32];
    const int base = p.base;
    const float scale = p.out_kind != kOutSame ? *p.scale : 1.0f;
    const int64_t nv = p.n / VEC;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    unsigned m = 0u;
    for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
        for (int64_t v0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v0 < nv;
             v0 += stride * U) {
            Raw<T, VEC> raw[U];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (v0 + u * stride < nv)
                    load_vec<T, VEC, BACKWARD>(p, r, (v0 + u * stride) * VEC, raw[u]);
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (v0 + u * stride < nv)
                    m = compute_vec<T, VEC, BACKWARD>(p, base, r, (v0 + u * stride) * VEC, raw[u], scale, m);
        }
    }
    if (p.amax)
        block_publish_max(m, red, p.amax);
    if (p.scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        *p.scale_inv = 1.0f / scale;
}

/* Vectors a thread loads per input before computing: 64 bytes of input in
 * flight per thread for the element-wise kernels, 48 for the gated
 * backward's three inputs, 32 for the gated forward's two (one vector each:
 * a row's x blocks then hold 256 vectors, so a block is short and the last
 * wave small; two took 0.139 against 0.136 ms at 8,192 x 2 x 8,192 on an
 * H100), within 64 registers. */
__host__ __device__ constexpr int vec_unroll(bool gated, bool backward)
{
    return backward ? (gated ? 1 : 2) : (gated ? 1 : 4);
}

/* The vector path: BASE (0 gelu-tanh, 1 gelu-erf, 2 silu, 3 relu), GATED
 * and the direction are template parameters, so each kernel holds only its
 * own registers.  Row r of x is [a | b] (b only when GATED); a thread loads
 * U 16-byte vectors of a (and of b, and of dy in the backward) before it
 * computes and stores any.  Element-wise activations are one flat row; its
 * tail (numel not a multiple of V) is done element by element by the first
 * threads of block (0, 0). */
template <typename T, int BASE, bool GATED, bool BACKWARD>
__global__ void __launch_bounds__(kThreads, kMinBlocks) act_vec_kernel(ActParams p)
{
    constexpr int V = 16 / sizeof(T);
    constexpr int U = vec_unroll(GATED, BACKWARD);
    __shared__ unsigned red[kThreads / 32];
    const float scale = p.out_kind != kOutSame ? *p.scale : 1.0f;
    const int64_t nv = p.n / V;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    unsigned m = 0u;
    for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
        const T *ar = (const T *)p.x + r * p.in_cols;
        const T *dyr = BACKWARD ? (const T *)p.dy + r * p.n : NULL;
        const int64_t orow = r * (BACKWARD ? p.in_cols : p.n); /* element offset of the output row */
        for (int64_t v0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v0 < nv; v0 += stride * U) {
            Pack<T, V> ra[U], rb[U], rd[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t v = v0 + u * stride;
                if (v < nv) {
                    ra[u] = *reinterpret_cast<const Pack<T, V> *>(ar + v * V);
                    if (GATED)
                        rb[u] = *reinterpret_cast<const Pack<T, V> *>(ar + p.n + v * V);
                    if (BACKWARD)
                        rd[u] = *reinterpret_cast<const Pack<T, V> *>(dyr + v * V);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t v = v0 + u * stride;
                if (v >= nv)
                    break;
                float a[V], o[V];
#pragma unroll
                for (int e = 0; e < V; ++e)
                    a[e] = to_f(ra[u].v[e]);
                if (!BACKWARD) {
#pragma unroll
                    for (int e = 0; e < V; ++e)
                        o[e] = GATED ? sf_act_base(BASE, a[e]) * to_f(rb[u].v[e]) : sf_act_base(BASE, a[e]);
                } else if (GATED) {
                    float g[V];
#pragma unroll
                    for (int e = 0; e < V; ++e) {
                        float f, df;
                        sf_act_base_both(BASE, a[e], &f, &df);
                        const float d = to_f(rd[u].v[e]);
                        o[e] = sf_act_chain(BASE, d * to_f(rb[u].v[e]), df);
                        g[e] = d * f;
                    }
                    store_out<T, V>(p, orow + p.n + v * V, g, scale);
                    m = vmax<V>(m, g);
                } else {
#pragma unroll
                    for (int e = 0; e < V; ++e)
                        o[e] = sf_act_chain(BASE, to_f(rd[u].v[e]), sf_act_base_grad(BASE, a[e]));
                }
                store_out<T, V>(p, orow + v * V, o, scale);
                m = vmax<V>(m, o);
            }
        }
    }
    if (!GATED && blockIdx.x == 0 && blockIdx.y == 0) { /* the flat row's tail */
        const int64_t c = nv * V + threadIdx.x;
        if (c < p.n) {
            Raw<T, 1> raw;
            load_vec<T, 1, BACKWARD>(p, 0, c, raw);
            m = compute_vec<T, 1, BACKWARD>(p, BASE, 0, c, raw, scale, m);
        }
    }
    if (p.amax)
        block_publish_max(m, red, p.amax);
    if (p.scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
        *p.scale_inv = 1.0f / scale;
}

/* ---- dropout ----------------------------------------------------------------- */

struct DropParams {
    const void *x, *bias, *residual, *dy;
    void *out;
    float *ws; /* backward with dbias: [gridDim.y][n] */
    int64_t rows, n;
    uint64_t seed, offset;
    uint32_t threshold;
    float keep_scale;
    int bias_f32;
};

/* Keep flags of VEC consecutive elements starting at flat index i (i a
 * multiple of 4 when VEC >= 4). */
template <int VEC>
__device__ __forceinline__ void keep_flags(const DropParams &p, int64_t i, bool (&keep)[VEC])
{
    if constexpr (VEC == 1) {
        sf_philox4 w = sf_philox(p.seed, p.offset + (uint64_t)i / 4u);
        keep[0] = (w.v[i & 3] >> 8) < p.threshold;
    } else {
#pragma unroll
        for (int q = 0; q < VEC / 4; ++q) {
            sf_philox4 w = sf_philox(p.seed, p.offset + (uint64_t)i / 4u + q);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                keep[q * 4 + e] = (w.v[e] >> 8) < p.threshold;
        }
    }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) bias_dropout_add_kernel(DropParams p)
{
    const int64_t nv = p.n / VEC;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
        for (int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += stride) {
            const int64_t c = v * VEC, i = r * p.n + c;
            float x[VEC], res[VEC], b[VEC], o[VEC];
            bool keep[VEC];
            load_f<T, VEC>((const T *)p.x + i, x);
            load_f<T, VEC>((const T *)p.residual + i, res);
            if (p.bias) {
                if (p.bias_f32)
                    load_f<float, VEC>((const float *)p.bias + c, b);
                else
                    load_f<T, VEC>((const T *)p.bias + c, b);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e)
                    b[e] = 0.0f;
            }
            keep_flags<VEC>(p, i, keep);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float d = keep[e] ? (x[e] + b[e]) * p.keep_scale : 0.0f;
                o[e] = res[e] + d;
            }
            store_f<T, VEC>((T *)p.out + i, o);
        }
    }
}

/* dx = dy * keep * keep_scale.  With ws: gridDim.x * blockDim.x * VEC covers
 * the row exactly once, so each thread owns one column vector and sums it
 * over this block's rows into ws[blockIdx.y]. */
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) dropout_backward_kernel(DropParams p)
{
    const int64_t nv = p.n / VEC;
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= nv)
        return;
    const int64_t c = v * VEC;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e)
        acc[e] = 0.0f;
    /* kRows rows' dy loads in flight before any is used (one at a time left
     * each thread waiting a full memory latency per row) */
    constexpr int kRows = 4;
    const int64_t ystep = gridDim.y;
    for (int64_t r0 = blockIdx.y; r0 < p.rows; r0 += ystep * kRows) {
        Pack<T, VEC> raw[kRows];
#pragma unroll
        for (int j = 0; j < kRows; ++j)
            if (r0 + j * ystep < p.rows)
                raw[j] = *reinterpret_cast<const Pack<T, VEC> *>((const T *)p.dy + (r0 + j * ystep) * p.n + c);
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
            const int64_t r = r0 + j * ystep;
            if (r >= p.rows)
                break;
            const int64_t i = r * p.n + c;
            float dx[VEC];
            bool keep[VEC];
            keep_flags<VEC>(p, i, keep);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                dx[e] = keep[e] ? to_f(raw[j].v[e]) * p.keep_scale : 0.0f;
                acc[e] += dx[e];
            }
            store_f<T, VEC>((T *)p.out + i, dx);
        }
    }
    if (p.ws)
        store_f<float, VEC>(p.ws + (int64_t)blockIdx.y * p.n + c, acc);
}

/* ---- host side --------------------------------------------------------------- */

/* The grid of an act kernel: the tensor once over (see the note at the top):
 * x: enough blocks to give each thread U vectors of a row, y: the rows, at
 * most 65,535 (the kernels walk further rows block-stride). */
dim3 act_grid(int64_t rows, int64_t vecs_per_row, int unroll)
{
    int64_t gx = (vecs_per_row + (int64_t)kThreads * unroll - 1) / ((int64_t)kThreads * unroll);
    gx = gx < 1 ? 1 : gx;
    int64_t gy = rows < 1 ? 1 : rows > 65535 ? 65535 : rows;
    return dim3((unsigned)gx, (unsigned)gy);
}

template <typename K>
sf_status launch_with(const char *op, K kernel, const ActParams &p, int64_t vecs_per_row, int unroll,
                      cudaStream_t stream)
{
    kernel<<<act_grid(p.rows, vecs_per_row, unroll), kThreads, 0, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

template <typename T, int BASE, bool BACKWARD>
sf_status launch_vec(const char *op, const ActParams &p, cudaStream_t stream)
{
    /* the x blocks cover the row's vectors (an element-wise row's tail
     * elements are block (0, 0)'s, after its vectors) exactly, so
     * none holds a sliver of work (a gated row of 1,024 vectors, n 8,192 in
     * bf16, takes four blocks of 256 threads x 1 vector forward) */
    constexpr int64_t V = 16 / (int64_t)sizeof(T);
    const int64_t vecs = (p.n + V - 1) / V;
    if (p.gated)
        return launch_with(op, act_vec_kernel<T, BASE, true, BACKWARD>, p, vecs,
                           vec_unroll(true, BACKWARD), stream);
    return launch_with(op, act_vec_kernel<T, BASE, false, BACKWARD>, p, vecs,
                       vec_unroll(false, BACKWARD), stream);
}

template <typename T, bool BACKWARD>
sf_status launch_act_dir(const char *op, const ActParams &p, bool vec, cudaStream_t stream)
{
    if (!vec)
        return launch_with(op, act_kernel<T, 1, BACKWARD>, p, p.n, BACKWARD ? 2 : 4, stream);
    switch (p.base) {
    case 0:  return launch_vec<T, 0, BACKWARD>(op, p, stream);
    case 1:  return launch_vec<T, 1, BACKWARD>(op, p, stream);
    case 2:  return launch_vec<T, 2, BACKWARD>(op, p, stream);
    default: return launch_vec<T, 3, BACKWARD>(op, p, stream);
    }
}

template <typename T>
sf_status launch_act(const char *op, const ActParams &p, bool vec, bool backward, cudaStream_t stream)
{
    return backward ? launch_act_dir<T, true>(op, p, vec, stream)
               : launch_act_dir<T, false>(op, p, vec, stream);
}

__global__ void write_scale_inv_kernel(const float *scale, float *scale_inv) { *scale_inv = 1.0f / *scale; }

sf_status act(const sf_act_args *a, bool backward, cudaStream_t stream)
{
    const char *op = backward ? "act_backward" : "act_forward";
    ActParams p;
    p.x = a->x->data;
    p.dy = a->dy ? a->dy->data : NULL;
    p.out = a->out->data;
    p.scale = a->scale ? (const float *)a->scale->data : NULL;
    p.amax = a->amax ? (unsigned *)a->amax->data : NULL;
    p.scale_inv = a->scale_inv ? (float *)a->scale_inv->data : NULL;
    p.rows = a->rows;
    p.n = a->n;
    p.in_cols = a->gated ? 2 * a->n : a->n;
    p.base = a->base;
    p.gated = a->gated;
    p.out_kind = a->out->dtype == SF_FLOAT8_E4M3 ? kOutE4M3
                 : a->out->dtype == SF_FLOAT8_E5M2 ? kOutE5M2 : kOutSame;
    if (a->rows == 0 || a->n == 0) {
        if (p.scale_inv) {
            write_scale_inv_kernel<<<1, 1, 0, stream>>>(p.scale, p.scale_inv);
            SF_CUDA_CHECK_LAUNCH(op);
        }
        return SF_OK;
    }
    const int64_t ve = 16 / (int64_t)sf_dtype_size(a->x->dtype);
    /* gated rows must start on vector boundaries in both halves; an
     * element-wise row (rows == 1) takes its tail element by element */
    const bool vec = (!a->gated || a->n % ve == 0) && aligned16(p.x) && aligned16(p.out) &&
                     (!p.dy || aligned16(p.dy));
    return sf_visit_float(op, "x", a->x->dtype, [&](auto tag) {
        return launch_act<typename decltype(tag)::type>(op, p, vec, backward, stream);
    });
}

/* The dropout kernels' shape: one thread per column vector across x, row
 * sets across y.  Vectors only when every row starts on a 16-byte boundary. */
struct DropShape {
    bool vec;
    int v;
    dim3 grid;
};

sf_status drop_shape(const char *op, int device, int64_t rows, int64_t n, sf_dtype dtype,
                     bool aligned, DropShape *s)
{
    const int ve = 16 / (int)sf_dtype_size(dtype);
    s->vec = aligned && n % ve == 0;
    s->v = s->vec ? ve : 1;
    int sms;
    SF_TRY(sm_count(op, device, &sms));
    const int64_t gx = (n / s->v + kThreads - 1) / kThreads;
    int64_t gy = (int64_t)sms * 8 / (gx > 0 ? gx : 1);
    gy = gy < 1 ? 1 : gy > rows ? rows : gy;
    gy = gy > 65535 ? 65535 : gy;
    s->grid = dim3((unsigned)(gx > 0 ? gx : 1), (unsigned)(gy > 0 ? gy : 1));
    return SF_OK;
}

DropParams drop_params(const sf_dropout_args *a)
{
    DropParams p;
    p.x = a->x ? a->x->data : NULL;
    p.bias = a->bias ? a->bias->data : NULL;
    p.residual = a->residual ? a->residual->data : NULL;
    p.dy = a->dy ? a->dy->data : NULL;
    p.out = a->out->data;
    p.ws = NULL;
    p.rows = a->rows;
    p.n = a->n;
    p.seed = a->seed;
    p.offset = a->offset;
    p.threshold = a->threshold;
    p.keep_scale = sf_dropout_scale(a->p);
    p.bias_f32 = a->bias && a->bias->dtype == SF_FLOAT32;
    return p;
}

/* The bias + dropout + residual forward or the dropout backward, 16-byte
 * vectors where the shape allows (s.vec), else one element per thread. */
template <typename T>
sf_status launch_drop(bool backward, const DropParams &p, const DropShape &s, cudaStream_t stream)
{
    constexpr int kVec = 16 / sizeof(T);
    void (*kernel)(DropParams) =
        backward ? (s.vec ? dropout_backward_kernel<T, kVec> : dropout_backward_kernel<T, 1>)
                 : (s.vec ? bias_dropout_add_kernel<T, kVec> : bias_dropout_add_kernel<T, 1>);
    kernel<<<s.grid, kThreads, 0, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH(backward ? "dropout_backward" : "bias_dropout_add");
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_act_forward_cuda(const sf_act_args *a, sf_stream s)
{
    return sf_on_device("act_forward", a->x->device_id, [&] { return act(a, false, sf_cuda_stream(s)); });
}

extern "C" sf_status sf_act_backward_cuda(const sf_act_args *a, sf_stream s)
{
    return sf_on_device("act_backward", a->x->device_id, [&] { return act(a, true, sf_cuda_stream(s)); });
}

extern "C" sf_status sf_bias_dropout_add_cuda(const sf_dropout_args *a, sf_stream s)
{
    static const char op[] = "bias_dropout_add";
    if (a->rows == 0 || a->n == 0)
        return SF_OK;
    return sf_on_device(op, a->x->device_id, [&] {
        DropParams p = drop_params(a);
        DropShape shape;
        const bool aligned = aligned16(p.x) && aligned16(p.residual) && aligned16(p.out) &&
                             (!p.bias || aligned16(p.bias));
        SF_TRY(drop_shape(op, a->x->device_id, a->rows, a->n, a->x->dtype, aligned, &shape));
        cudaStream_t stream = sf_cuda_stream(s);
        return sf_visit_float(op, "x", a->x->dtype, [&](auto tag) {
            return launch_drop<typename decltype(tag)::type>(false, p, shape, stream);
        });
    });
}

extern "C" sf_status sf_dropout_backward_workspace_numel_cuda(int64_t rows, int64_t n, int device_id,
                                                         int64_t *numel)
{
    *numel = 0;
    if (rows == 0 || n == 0)
        return SF_OK;
    /* an upper bound of gridDim.y for any vector width: one partial row
     * per y block */
    int sms;
    SF_TRY(sm_count("dropout_backward_workspace_numel", device_id, &sms));
    int64_t gy = (int64_t)sms * 8;
    gy = gy > rows ? rows : gy;
    gy = gy > 65535 ? 65535 : gy;
    *numel = gy * n;
    return SF_OK;
}

extern "C" sf_status sf_dropout_backward_cuda(const sf_dropout_args *a, sf_stream s)
{
    static const char op[] = "dropout_backward";
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, a->dy->device_id, &guard));
    sf_status st = SF_OK;
    if (a->rows == 0 || a->n == 0) {
        if (a->dbias && a->n > 0) {
            cudaError_t e = cudaMemsetAsync(a->dbias->data, 0, a->n * sf_dtype_size(a->dbias->dtype), stream);
            if (e != cudaSuccess)
                st = sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s (zeroing 'dbias')", op,
                             cudaGetErrorName(e), cudaGetErrorString(e));
        }
        sf_cuda_device_restore(&guard);
        return st;
    }
    DropParams p = drop_params(a);
    p.ws = a->dbias ? (float *)a->workspace->data : NULL;
    DropShape shape;
    const bool aligned = aligned16(p.dy) && aligned16(p.out) && (!p.ws || aligned16(p.ws));
    st = drop_shape(op, a->dy->device_id, a->rows, a->n, a->dy->dtype, aligned, &shape);
    if (st == SF_OK) {
        st = sf_visit_float(op, "dy", a->dy->dtype, [&](auto tag) {
            return launch_drop<typename decltype(tag)::type>(true, p, shape, stream);
        });
    }
    if (st == SF_OK && a->dbias) {
        const int parts = (int)shape.grid.y;
        st = sf_visit_float(op, "dbias", a->dbias->dtype, [&](auto tag) {
            return launch_column_sums<typename decltype(tag)::type>(op, p.ws, parts, a->n, a->dbias->data, stream);
        });
    }
    sf_cuda_device_restore(&guard);
    return st;
}
