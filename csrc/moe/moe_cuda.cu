/*
 * moe_cuda.cu - the router and token permutation on the GPU.
 *
 * Router: one thread per token runs moe.h's row functions (the same code as
 * the CPU reference; E is tens to hundreds of experts, so a token's row is a
 * short serial loop and the tokens fill the GPU).  The two losses reduce
 * per block in shared memory and add one partial per block atomically into
 * the float32 loss, cleared on the stream first (so their float32 sums may
 * differ from the CPU's in the last bits: the order of additions differs).
 *
 * Permutation: row ids in two launches, one block per expert each: a block
 * scan of the expert's column of the routing map gives each routed token
 * its rank and the expert's count; then each block adds the counts of the
 * experts before it (its offset in the expert-sorted buffer).  permute,
 * unpermute and unpermute_backward give each token a block whose threads run
 * along the hidden dimension; unpermute accumulates in float32.
 *
 * Row kernels (permute, unpermute and its backward, the probability-scaled
 * SwiGLU and its backward) are memory-bound: they are templated on their
 * element types (visit.cuh's static switch) and move kVec = 8 consecutive
 * elements per access (16 bytes of a 16-bit type) where every row length is
 * a multiple of 8 and every row pointer aligned to 8 elements; elsewhere
 * the same template runs one element per access.  Each element's arithmetic
 * follows the CPU reference's (moe.h's functions, float_bits.h's conversions,
 * the same operation order), but values agree to rounding, not bit for bit:
 * nvcc contracts multiply-adds into FMAs, the device expf differs from libm's
 * in the last bit (the SwiGLU's sigmoid uses the hardware approximations:
 * a few ulp, moe.h), and sums across threads (dprobs) add in another order.
 * Nothing here synchronizes the host.
 */
#include <cuda_runtime.h>

#include <initializer_list>
#include <type_traits>

#include "../core/cuda_util.h"
#include "../core/visit.cuh"
#include "moe.h"
#include "moe_backend.h"

namespace {

constexpr int kThreads = 256;

/* Blocks for a grid-stride loop over n items. */
int blocks_for(int64_t n, int device) { return sf_grid_size(n, kThreads, sf_cuda_sm_count(device) * 16); }

/* Blocks for one block per token (capped; the kernels stride over tokens). */
int token_blocks(int64_t T) { return (int)(T < 65535 * 16 ? T : 65535 * 16); }

#define GRID_STRIDE(i, n) \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* Sum of v over the block, returned to every thread; blockDim.x a multiple
 * of 32, at most 1024; `shared` holds 32 floats. */
__device__ float block_sum(float v, float *shared)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    __syncthreads(); /* shared may still be read by a previous call */
    if (lane == 0)
        shared[warp] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < nw; ++w)
        s += shared[w];
    return s;
}

__global__ void topk_forward_kernel(int64_t T, int64_t E, int topk, int score, int pre, float scaling,
                                const void *logits, sf_dtype ld, const float *bias, void *probs,
                                sf_dtype pd, uint8_t *map, float *saved)
{
    GRID_STRIDE(t, T)
        sf_moe_topk_forward_row(logits, ld, t * E, E, topk, score, pre, scaling, bias, probs, pd,
                            map + t * E, saved + t * E);
}

__global__ void topk_backward_kernel(int64_t T, int64_t E, int topk, int score, int pre, float scaling,
                                const uint8_t *map, const float *saved, const void *g, sf_dtype gd,
                                void *dl, sf_dtype od)
{
    GRID_STRIDE(t, T)
        sf_moe_topk_backward_row(map + t * E, saved + t * E, g, gd, t * E, E, topk, score, pre, scaling,
                            dl, od);
}

__global__ void aux_scores_forward_kernel(int64_t T, int64_t E, int topk, int score, const void *logits,
                                      sf_dtype ld, void *scores, sf_dtype sd, uint8_t *map,
                                      float *saved)
{
    GRID_STRIDE(t, T)
        sf_moe_aux_scores_forward_row(logits, ld, t * E, E, topk, score, scores, sd, map + t * E,
                                  saved + t * E);
}

__global__ void aux_scores_backward_kernel(int64_t T, int64_t E, int score, const float *saved,
                                      const void *g, sf_dtype gd, void *dl, sf_dtype od)
{
    GRID_STRIDE(t, T)
        sf_moe_aux_scores_backward_row(saved + t * E, g, gd, t * E, E, score, dl, od);
}

/* loss += c * sum_t sum_e probs[t, e] * tpe[e] */
__global__ void aux_loss_forward_kernel(int64_t T, int64_t E, const void *probs, sf_dtype pd,
                                    const void *tpe, sf_dtype td, float c, float *loss)
{
    __shared__ float shared[32];
    float part = 0.0f;
    GRID_STRIDE(i, T * E)
        part += sf_moe_ld(probs, pd, i) * sf_moe_ld_count(tpe, td, i % E);
    float s = block_sum(part, shared);
    if (threadIdx.x == 0)
        atomicAdd(loss, s * c);
}

__global__ void aux_loss_backward_kernel(int64_t T, int64_t E, const float *dloss, const void *tpe,
                                    sf_dtype td, float c, void *dprobs, sf_dtype od)
{
    float g = dloss[0] * c;
    GRID_STRIDE(i, T * E)
        sf_moe_st(dprobs, od, i, g * sf_moe_ld_count(tpe, td, i % E));
}

__global__ void z_loss_forward_kernel(int64_t T, int64_t E, const void *logits, sf_dtype ld, float c,
                                  float *loss, float *lse)
{
    __shared__ float shared[32];
    float part = 0.0f;
    GRID_STRIDE(t, T) {
        float v = sf_moe_lse_row(logits, ld, t * E, E);
        lse[t] = v;
        part += v * v;
    }
    float s = block_sum(part, shared);
    if (threadIdx.x == 0)
        atomicAdd(loss, s * c);
}

__global__ void z_loss_backward_kernel(int64_t T, int64_t E, const void *logits, sf_dtype ld,
                                  const float *lse, const float *dloss, float c, void *dl, sf_dtype od)
{
    float g = dloss[0] * c;
    GRID_STRIDE(i, T * E) {
        float l = lse[i / E];
        sf_moe_st(dl, od, i, g * l * expf(sf_moe_ld(logits, ld, i) - l));
    }
}

/* Block e: ids[t, e] = rank of token t among the tokens routed to e (or -1),
 * count[e] = their number.  The column is walked in chunks of blockDim.x
 * tokens, each chunk scanned in shared memory. */
__global__ void row_rank_kernel(int64_t T, int64_t E, const uint8_t *map, int32_t *ids, int64_t *count)
{
    __shared__ int scan[1024];
    const int64_t e = blockIdx.x;
    int base = 0;
    for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
        int64_t t = t0 + threadIdx.x;
        int flag = t < T && map[t * E + e] ? 1 : 0;
        scan[threadIdx.x] = flag;
        __syncthreads();
        for (int o = 1; o < (int)blockDim.x; o <<= 1) { /* Hillis-Steele inclusive scan */
            int v = threadIdx.x >= (unsigned)o ? scan[threadIdx.x - o] : 0;
            __syncthreads();
            scan[threadIdx.x] += v;
            __syncthreads();
        }
        if (t < T)
            ids[t * E + e] = flag ? base + scan[threadIdx.x] - 1 : -1;
        int total = scan[blockDim.x - 1];
        __syncthreads();
        base += total;
    }
    if (threadIdx.x == 0)
        count[e] = base;
}

/* Block e: add the counts of experts 0..e-1 to the column's row ids. */
__global__ void row_offset_kernel(int64_t T, int64_t E, const int64_t *count, int32_t *ids)
{
    __shared__ long long offset;
    if (threadIdx.x == 0) {
        long long s = 0;
        for (int64_t j = 0; j < (int64_t)blockIdx.x; ++j)
            s += count[j];
        offset = s;
    }
    __syncthreads();
    const int64_t e = blockIdx.x;
    for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
        int32_t v = ids[t * E + e];
        if (v >= 0)
            ids[t * E + e] = (int32_t)(v + offset);
    }
}

/* An element type's storage and its float value, through float_bits.h's
 * conversions (the CPU reference's, so both backends round alike). */
template <typename T> struct Io;
template <> struct Io<float> {
    using raw = float;
    static __device__ float ld(float v) { return v; }
    static __device__ float st(float v) { return v; }
};
template <> struct Io<__half> {
    using raw = uint16_t;
    static __device__ float ld(uint16_t h) { return sf_f16_to_f32(h); }
    static __device__ uint16_t st(float v) { return sf_f32_to_f16(v); }
};
template <> struct Io<__nv_bfloat16> {
    using raw = uint16_t;
    static __device__ float ld(uint16_t h) { return sf_bf16_to_f32(h); }
    static __device__ uint16_t st(float v) { return sf_f32_to_bf16(v); }
};
template <typename T> using Raw = typename Io<T>::raw;

/* Elements a row kernel moves per access where the rows allow it. */
constexpr int kVec = 8;

template <typename T, int VEC> struct alignas(sizeof(Raw<T>) * VEC) Pack {
    Raw<T> v[VEC];
};

/* f[k] = p[k] for k < VEC, one access. */
template <typename T, int VEC> __device__ __forceinline__ void load(const Raw<T> *p, float (&f)[VEC])
{
    const Pack<T, VEC> v = *reinterpret_cast<const Pack<T, VEC> *>(p);
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        f[k] = Io<T>::ld(v.v[k]);
}

/* p[k] = f[k] rounded to T, one access. */
template <typename T, int VEC> __device__ __forceinline__ void store(Raw<T> *p, const float (&f)[VEC])
{
    Pack<T, VEC> v;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        v.v[k] = Io<T>::st(f[k]);
    *reinterpret_cast<Pack<T, VEC> *>(p) = v;
}

/* A row pointer and its element size, for rows_vectorize. */
struct RowPtr {
    const void *p;
    size_t es;
};

/* Can rows of n elements at these pointers be moved kVec elements at a time
 * (n a multiple of kVec, each pointer aligned to kVec of its elements)? */
bool rows_vectorize(int64_t n, std::initializer_list<RowPtr> ptrs)
{
    if (n % kVec)
        return false;
    for (const RowPtr &r : ptrs)
        if (r.p && (uintptr_t)r.p % (r.es * kVec))
            return false;
    return true;
}

/* fn(std::integral_constant<int, VEC>{}) with VEC = kVec when `vec`, else 1. */
template <typename Fn> void with_vec(bool vec, Fn &&fn)
{
    if (vec)
        fn(std::integral_constant<int, kVec>{});
    else
        fn(std::integral_constant<int, 1>{});
}

/* Threads of a block that walks a row of n accesses: the fewest warps that
 * cover it in the fewest rounds of at most 256 threads (a row of 448
 * accesses takes 224 threads, two rounds, none idle). */
int row_threads(int64_t n)
{
    const int64_t rounds = n > 0 ? (n + kThreads - 1) / kThreads : 1;
    const int64_t t = ((n + rounds - 1) / rounds + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > kThreads ? kThreads : t);
}

/* Token t's rows go to rows ids[t, e] of out (those in [0, N)). */
template <typename D, int VEC>
__global__ void permute_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                               const Raw<D> *inp, const void *probs, sf_dtype pd, Raw<D> *out,
                               void *out_probs, sf_dtype opd)
{
    using P = Pack<D, VEC>;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t e = 0; e < E; ++e) {
            int64_t r = ids[t * E + e];
            if (r < 0 || r >= N)
                continue;
            for (int64_t h = threadIdx.x * VEC; h < H; h += blockDim.x * VEC)
                *reinterpret_cast<P *>(out + r * H + h) = *reinterpret_cast<const P *>(inp + t * H + h);
            if (probs && threadIdx.x == 0)
                sf_moe_st(out_probs, opd, r, sf_moe_ld(probs, pd, t * E + e));
        }
}

/* out[t] = sum over t's routed e, in expert order, of probs[t, e] * inp[ids[t, e]]. */
template <typename D, int VEC>
__global__ void unpermute_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                                 const Raw<D> *inp, const void *probs, sf_dtype pd, Raw<D> *out)
{
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t h = threadIdx.x * VEC; h < H; h += blockDim.x * VEC) {
            float acc[VEC];
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                acc[k] = 0.0f;
            for (int64_t e = 0; e < E; ++e) {
                int64_t r = ids[t * E + e];
                if (r < 0 || r >= N)
                    continue;
                float p = probs ? sf_moe_ld(probs, pd, t * E + e) : 1.0f, v[VEC];
                load<D, VEC>(inp + r * H + h, v);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    acc[k] += p * v[k];
            }
            store<D, VEC>(out + t * H + h, acc);
        }
}

/* dinp[ids[t, e]] = probs[t, e] * dout[t]; dprobs[t, e] = dout[t] . inp[ids[t, e]]
 * (0 where t is not routed to e).  G: dout and dinp, D: inp. */
template <typename G, typename D, int VEC>
__global__ void unpermute_backward_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                                     const Raw<G> *g, const Raw<D> *inp, const void *probs, sf_dtype pd,
                                     Raw<G> *dinp, void *dprobs, sf_dtype dpd)
{
    __shared__ float shared[32];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t e = 0; e < E; ++e) {
            int64_t i = t * E + e, r = ids[i];
            if (r < 0 || r >= N) { /* the same for the whole block */
                if (dprobs && threadIdx.x == 0)
                    sf_moe_st(dprobs, dpd, i, 0.0f);
                continue;
            }
            float p = probs ? sf_moe_ld(probs, pd, i) : 1.0f;
            float dot = 0.0f;
            for (int64_t h = threadIdx.x * VEC; h < H; h += blockDim.x * VEC) {
                float v[VEC], o[VEC];
                load<G, VEC>(g + t * H + h, v);
#pragma unroll
                for (int k = 0; k < VEC; ++k)
                    o[k] = p * v[k];
                store<G, VEC>(dinp + r * H + h, o);
                if (dprobs) {
                    float x[VEC];
                    load<D, VEC>(inp + r * H + h, x);
#pragma unroll
                    for (int k = 0; k < VEC; ++k)
                        dot += v[k] * x[k];
                }
            }
            if (dprobs) {
                float s = block_sum(dot, shared); /* every thread of the block calls it */
                if (threadIdx.x == 0)
                    sf_moe_st(dprobs, dpd, i, s);
            }
        }
}

__global__ void permute_probs_backward_kernel(int64_t n, int64_t N, const int32_t *ids, const void *g,
                                         sf_dtype gd, void *out, sf_dtype od)
{
    GRID_STRIDE(i, n) {
        int64_t r = ids[i];
        sf_moe_st(out, od, i, r >= 0 && r < N ? sf_moe_ld(g, gd, r) : 0.0f);
    }
}

/* out[r, j] = silu(x[r, j]) * x[r, F + j] * probs[r]; a thread per VEC outputs. */
template <typename D, int VEC>
__global__ void swiglu_forward_kernel(int64_t N, int64_t F, const Raw<D> *x, const void *probs, sf_dtype pd,
                                  Raw<D> *out)
{
    const int64_t fv = F / VEC;
    GRID_STRIDE(i, N * fv) {
        const int64_t r = i / fv, j = (i - r * fv) * VEC;
        const float p = probs ? sf_moe_ld(probs, pd, r) : 1.0f;
        float g[VEC], u[VEC], o[VEC];
        load<D, VEC>(x + r * 2 * F + j, g);
        load<D, VEC>(x + r * 2 * F + F + j, u);
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            o[k] = sf_moe_silu(g[k]) * u[k] * p;
        store<D, VEC>(out + r * F + j, o);
    }
}

/* One block per row (the probability gradient is a sum over the row).
 * D: x and dx, G: dout. */
template <typename D, typename G, int VEC>
__global__ void swiglu_backward_kernel(int64_t N, int64_t F, const Raw<G> *dout, const Raw<D> *x,
                                  const void *probs, sf_dtype pd, Raw<D> *dx, void *dprobs, sf_dtype dpd)
{
    __shared__ float shared[32];
    for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
        const float p = probs ? sf_moe_ld(probs, pd, r) : 1.0f;
        float dp = 0.0f;
        for (int64_t j = threadIdx.x * VEC; j < F; j += blockDim.x * VEC) {
            float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
            load<D, VEC>(x + r * 2 * F + j, g);
            load<D, VEC>(x + r * 2 * F + F + j, u);
            load<G, VEC>(dout + r * F + j, d);
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                float s = sf_moe_silu(g[k]);
                dg[k] = d[k] * p * u[k] * sf_moe_dsilu(g[k]);
                du[k] = d[k] * p * s;
                dp += d[k] * s * u[k];
            }
            store<D, VEC>(dx + r * 2 * F + j, dg);
            store<D, VEC>(dx + r * 2 * F + F + j, du);
        }
        if (dprobs) {
            float sum = block_sum(dp, shared);
            if (threadIdx.x == 0)
                sf_moe_st(dprobs, dpd, r, sum);
        }
    }
}

/* An optional tensor's data and dtype as a kernel takes them: NULL and
 * float32 (never read) when it is left out. */
void *data_of(const sf_tensor *t) { return t ? t->data : nullptr; }
sf_dtype dtype_of(const sf_tensor *t) { return t ? t->dtype : SF_FLOAT32; }

/* A float tensor a kernel reads or writes through moe.h's sf_moe_ld /
 * sf_moe_st, by its argument name in the op (t NULL: an optional one left
 * out). */
struct FloatArg {
    const char *name;
    const sf_tensor *t;
};

/* Run `launch` on the tensor's device; report a bad launch with the op's
 * name.  The kernels take each float tensor's dtype at run time, and
 * sf_moe_ld / sf_moe_st read any dtype but float32 and float16 as bfloat16:
 * `floats` are visited first, on the host, so that branch never sees
 * another one. */
template <typename F>
sf_status on_device(const char *op, int device, std::initializer_list<FloatArg> floats, F launch)
{
    for (const FloatArg &f : floats)
        if (f.t)
            SF_TRY(sf_visit_float(op, f.name, f.t->dtype, [](auto) { return SF_OK; }));
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    sf_status st = launch();
    if (st == SF_OK) {
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            st = sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s (kernel launch)", op,
                         cudaGetErrorName(e), cudaGetErrorString(e));
    }
    sf_cuda_device_restore(&guard);
    return st;
}

} // namespace

extern "C" sf_status sf_moe_topk_forward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_topk_forward", a->logits->device_id, {{"logits", a->logits}, {"probs", a->out}}, [&] {
        topk_forward_kernel<<<blocks_for(a->T, a->logits->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->topk, a->score, a->pre_softmax, a->scaling, a->logits->data,
            a->logits->dtype, a->bias ? (const float *)a->bias->data : nullptr, a->out->data,
            a->out->dtype, (uint8_t *)a->out2->data, (float *)a->out3->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_topk_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_topk_backward", a->grad->device_id, {{"dprobs", a->grad}, {"dlogits", a->out}}, [&] {
        topk_backward_kernel<<<blocks_for(a->T, a->grad->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->topk, a->score, a->pre_softmax, a->scaling, (const uint8_t *)a->map->data,
            (const float *)a->saved->data, a->grad->data, a->grad->dtype, a->out->data, a->out->dtype);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_aux_scores_forward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_aux_scores_forward", a->logits->device_id,
                     {{"logits", a->logits}, {"scores", a->out}}, [&] {
        aux_scores_forward_kernel<<<blocks_for(a->T, a->logits->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->topk, a->score, a->logits->data, a->logits->dtype, a->out->data,
            a->out->dtype, (uint8_t *)a->out2->data, (float *)a->out3->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_aux_scores_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_aux_scores_backward", a->grad->device_id,
                     {{"dscores", a->grad}, {"dlogits", a->out}}, [&] {
        aux_scores_backward_kernel<<<blocks_for(a->T, a->grad->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->score, (const float *)a->saved->data, a->grad->data, a->grad->dtype,
            a->out->data, a->out->dtype);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_aux_loss_forward_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_aux_loss_forward";
    return on_device(op, a->probs->device_id, {{"probs", a->probs}}, [&]() -> sf_status {
        cudaStream_t st = sf_cuda_stream(s);
        SF_CUDA_TRY(op, cudaMemsetAsync(a->out->data, 0, sizeof(float), st));
        if (a->T == 0 || a->E == 0)
            return SF_OK;
        float c = sf_moe_aux_factor(a->coeff, a->E, a->topk, a->total_tokens);
        aux_loss_forward_kernel<<<blocks_for(a->T * a->E, a->probs->device_id), kThreads, 0, st>>>(
            a->T, a->E, a->probs->data, a->probs->dtype, a->tpe->data, a->tpe->dtype, c,
            (float *)a->out->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_aux_loss_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_aux_loss_backward", a->out->device_id, {{"dprobs", a->out}}, [&] {
        float c = sf_moe_aux_factor(a->coeff, a->E, a->topk, a->total_tokens);
        aux_loss_backward_kernel<<<blocks_for(a->T * a->E, a->out->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, (const float *)a->dloss->data, a->tpe->data, a->tpe->dtype, c, a->out->data,
            a->out->dtype);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_z_loss_forward_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_z_loss_forward";
    return on_device(op, a->logits->device_id, {{"logits", a->logits}}, [&]() -> sf_status {
        cudaStream_t st = sf_cuda_stream(s);
        SF_CUDA_TRY(op, cudaMemsetAsync(a->out->data, 0, sizeof(float), st));
        z_loss_forward_kernel<<<blocks_for(a->T, a->logits->device_id), kThreads, 0, st>>>(
            a->T, a->E, a->logits->data, a->logits->dtype, a->coeff / (float)a->T,
            (float *)a->out->data, (float *)a->out2->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_z_loss_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_z_loss_backward", a->logits->device_id,
                     {{"logits", a->logits}, {"dlogits", a->out}}, [&] {
        z_loss_backward_kernel<<<blocks_for(a->T * a->E, a->logits->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->logits->data, a->logits->dtype, (const float *)a->lse->data,
            (const float *)a->dloss->data, a->coeff * 2.0f / (float)a->T, a->out->data, a->out->dtype);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_row_id_map_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_row_id_map", a->map->device_id, {}, [&] {
        cudaStream_t st = sf_cuda_stream(s);
        row_rank_kernel<<<(unsigned)a->E, 1024, 0, st>>>(a->T, a->E, (const uint8_t *)a->map->data,
                                                         (int32_t *)a->out->data, (int64_t *)a->out2->data);
        row_offset_kernel<<<(unsigned)a->E, kThreads, 0, st>>>(a->T, a->E, (const int64_t *)a->out2->data,
                                                               (int32_t *)a->out->data);
        return SF_OK;
    });
}

/* A visitor's element type, and with_vec's vector width, in a launcher. */
#define ELEM(tag) typename decltype(tag)::type
#define WIDTH(v) decltype(v)::value

extern "C" sf_status sf_moe_permute_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_permute";
    return on_device(op, a->inp->device_id, {{"probs", a->probs}, {"out_probs", a->out2}}, [&] {
        return sf_visit_float(op, "inp", a->inp->dtype, [&](auto dt) {
            using D = ELEM(dt);
            with_vec(rows_vectorize(a->H, {{a->inp->data, sizeof(D)}, {a->out->data, sizeof(D)}}), [&](auto v) {
                permute_kernel<D, WIDTH(v)><<<token_blocks(a->T), row_threads(a->H / WIDTH(v)), 0, sf_cuda_stream(s)>>>(
                    a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, (const Raw<D> *)a->inp->data,
                    data_of(a->probs), dtype_of(a->probs),
                    (Raw<D> *)a->out->data, data_of(a->out2),
                    dtype_of(a->out2));
            });
            return SF_OK;
        });
    });
}

extern "C" sf_status sf_moe_unpermute_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_unpermute";
    return on_device(op, a->inp->device_id, {{"probs", a->probs}}, [&] {
        return sf_visit_float(op, "inp", a->inp->dtype, [&](auto dt) {
            using D = ELEM(dt);
            with_vec(rows_vectorize(a->H, {{a->inp->data, sizeof(D)}, {a->out->data, sizeof(D)}}), [&](auto v) {
                unpermute_kernel<D, WIDTH(v)><<<token_blocks(a->T), row_threads(a->H / WIDTH(v)), 0, sf_cuda_stream(s)>>>(
                    a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, (const Raw<D> *)a->inp->data,
                    data_of(a->probs), dtype_of(a->probs),
                    (Raw<D> *)a->out->data);
            });
            return SF_OK;
        });
    });
}

extern "C" sf_status sf_moe_unpermute_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_unpermute_backward";
    /* inp is read (with vector loads) only for dprobs; sf_moe_unpermute_backward passes inp, probs and
     * dprobs together or not at all.  Where it is not read the kernel takes dout's type for it. */
    const bool reads_inp = a->out2 != nullptr;
    const sf_tensor *inp = reads_inp ? a->inp : a->grad;
    const void *inp_data = reads_inp ? a->inp->data : nullptr;
    return on_device(op, a->grad->device_id, {{"probs", a->probs}, {"dprobs", a->out2}}, [&] {
        return sf_visit_float(op, "dout", a->grad->dtype, [&](auto gt) {
            return sf_visit_float(op, "inp", inp->dtype, [&](auto dt) {
                using G = ELEM(gt);
                using D = ELEM(dt);
                const bool vec = rows_vectorize(a->H, {{a->grad->data, sizeof(G)}, {a->out->data, sizeof(G)},
                                                       {inp_data, sizeof(D)}});
                with_vec(vec, [&](auto v) {
                    unpermute_backward_kernel<G, D, WIDTH(v)>
                        <<<token_blocks(a->T), row_threads(a->H / WIDTH(v)), 0, sf_cuda_stream(s)>>>(
                            a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, (const Raw<G> *)a->grad->data,
                            (const Raw<D> *)inp_data, data_of(a->probs),
                            dtype_of(a->probs), (Raw<G> *)a->out->data,
                            data_of(a->out2), dtype_of(a->out2));
                });
                return SF_OK;
            });
        });
    });
}

extern "C" sf_status sf_moe_permute_probs_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_permute_probs_backward", a->map->device_id,
                     {{"dout_probs", a->grad}, {"dprobs", a->out}}, [&] {
        permute_probs_backward_kernel<<<blocks_for(a->T * a->E, a->map->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T * a->E, a->N, (const int32_t *)a->map->data, a->grad->data, a->grad->dtype,
            a->out->data, a->out->dtype);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_swiglu_forward_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_swiglu_forward";
    return on_device(op, a->inp->device_id, {{"probs", a->probs}}, [&] {
        return sf_visit_float(op, "x", a->inp->dtype, [&](auto dt) {
            using D = ELEM(dt);
            with_vec(rows_vectorize(a->H, {{a->inp->data, sizeof(D)}, {a->out->data, sizeof(D)}}), [&](auto v) {
                swiglu_forward_kernel<D, WIDTH(v)>
                    <<<blocks_for(a->N * (a->H / WIDTH(v)), a->inp->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
                        a->N, a->H, (const Raw<D> *)a->inp->data, data_of(a->probs),
                        dtype_of(a->probs), (Raw<D> *)a->out->data);
            });
            return SF_OK;
        });
    });
}

extern "C" sf_status sf_moe_swiglu_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    const char *op = "moe_swiglu_backward";
    return on_device(op, a->inp->device_id, {{"probs", a->probs}, {"dprobs", a->out2}}, [&] {
        return sf_visit_float(op, "x", a->inp->dtype, [&](auto dt) {
            return sf_visit_float(op, "dout", a->grad->dtype, [&](auto gt) {
                using D = ELEM(dt);
                using G = ELEM(gt);
                const bool vec = rows_vectorize(a->H, {{a->inp->data, sizeof(D)}, {a->out->data, sizeof(D)},
                                                       {a->grad->data, sizeof(G)}});
                with_vec(vec, [&](auto v) {
                    swiglu_backward_kernel<D, G, WIDTH(v)>
                        <<<token_blocks(a->N), row_threads(a->H / WIDTH(v)), 0, sf_cuda_stream(s)>>>(
                            a->N, a->H, (const Raw<G> *)a->grad->data, (const Raw<D> *)a->inp->data,
                            data_of(a->probs), dtype_of(a->probs),
                            (Raw<D> *)a->out->data, data_of(a->out2),
                            dtype_of(a->out2));
                });
                return SF_OK;
            });
        });
    });
}
