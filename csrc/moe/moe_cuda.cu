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
 * along the hidden dimension (permute copies 16 bytes per access where the
 * rows allow); unpermute accumulates in float32.
 * Nothing here synchronizes the host.
 */
#include <cuda_runtime.h>

#include <initializer_list>

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

/* Copy one row of `bytes` bytes: 16 bytes per access where the caller found
 * both rows 16-byte aligned and the length a multiple of 16 (`vec`), else
 * one element (`es` = 2 or 4 bytes) per access. */
__device__ void copy_row(char *dst, const char *src, int64_t bytes, size_t es, int vec)
{
    if (vec) {
        for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
            ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
    } else if (es == 4) {
        for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x)
            ((float *)dst)[i] = ((const float *)src)[i];
    } else {
        for (int64_t i = threadIdx.x; i < bytes / 2; i += blockDim.x)
            ((uint16_t *)dst)[i] = ((const uint16_t *)src)[i];
    }
}

__global__ void permute_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                               const char *inp, size_t es, int vec, const void *probs, sf_dtype pd,
                               char *out, void *out_probs, sf_dtype opd)
{
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t e = 0; e < E; ++e) {
            int64_t r = ids[t * E + e];
            if (r < 0 || r >= N)
                continue;
            copy_row(out + r * H * (int64_t)es, inp + t * H * (int64_t)es, H * (int64_t)es, es, vec);
            if (probs && threadIdx.x == 0)
                sf_moe_st(out_probs, opd, r, sf_moe_ld(probs, pd, t * E + e));
        }
}

__global__ void unpermute_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                                 const void *inp, sf_dtype d, const void *probs, sf_dtype pd, void *out)
{
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
            float acc = 0.0f;
            for (int64_t e = 0; e < E; ++e) {
                int64_t r = ids[t * E + e];
                if (r < 0 || r >= N)
                    continue;
                float p = probs ? sf_moe_ld(probs, pd, t * E + e) : 1.0f;
                acc += p * sf_moe_ld(inp, d, r * H + h);
            }
            sf_moe_st(out, d, t * H + h, acc);
        }
}

__global__ void unpermute_backward_kernel(int64_t T, int64_t E, int64_t H, int64_t N, const int32_t *ids,
                                     const void *g, sf_dtype gd, const void *inp, sf_dtype id,
                                     const void *probs, sf_dtype pd, void *dinp, void *dprobs,
                                     sf_dtype dpd)
{
    __shared__ float shared[32];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t e = 0; e < E; ++e) {
            int64_t i = t * E + e, r = ids[i];
            int routed = r >= 0 && r < N;
            float p = probs ? sf_moe_ld(probs, pd, i) : 1.0f;
            float dot = 0.0f;
            if (routed)
                for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
                    float v = sf_moe_ld(g, gd, t * H + h);
                    sf_moe_st(dinp, gd, r * H + h, p * v);
                    if (dprobs)
                        dot += v * sf_moe_ld(inp, id, r * H + h);
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

__global__ void swiglu_forward_kernel(int64_t N, int64_t F, const void *x, sf_dtype xd, const void *probs,
                                  sf_dtype pd, void *out)
{
    GRID_STRIDE(i, N * F) {
        int64_t r = i / F, j = i - r * F;
        float p = probs ? sf_moe_ld(probs, pd, r) : 1.0f;
        float g = sf_moe_ld(x, xd, r * 2 * F + j), u = sf_moe_ld(x, xd, r * 2 * F + F + j);
        sf_moe_st(out, xd, i, sf_moe_silu(g) * u * p);
    }
}

/* One block per row (the probability gradient is a sum over the row). */
__global__ void swiglu_backward_kernel(int64_t N, int64_t F, const void *g_, sf_dtype gd, const void *x,
                                  sf_dtype xd, const void *probs, sf_dtype pd, void *dx, void *dprobs,
                                  sf_dtype dpd)
{
    __shared__ float shared[32];
    for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
        float p = probs ? sf_moe_ld(probs, pd, r) : 1.0f;
        float dp = 0.0f;
        for (int64_t j = threadIdx.x; j < F; j += blockDim.x) {
            float g = sf_moe_ld(x, xd, r * 2 * F + j), u = sf_moe_ld(x, xd, r * 2 * F + F + j);
            float d = sf_moe_ld(g_, gd, r * F + j);
            float s = sf_moe_silu(g);
            sf_moe_st(dx, xd, r * 2 * F + j, d * p * u * sf_moe_dsilu(g));
            sf_moe_st(dx, xd, r * 2 * F + F + j, d * p * s);
            dp += d * s * u;
        }
        if (dprobs) {
            float sum = block_sum(dp, shared);
            if (threadIdx.x == 0)
                sf_moe_st(dprobs, dpd, r, sum);
        }
    }
}

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

extern "C" sf_status sf_moe_permute_cuda(const sf_moe_args *a, sf_stream s)
{
    const size_t es = sf_dtype_size(a->inp->dtype);
    const int vec = (a->H * (int64_t)es) % 16 == 0 && (uintptr_t)a->inp->data % 16 == 0 &&
                    (uintptr_t)a->out->data % 16 == 0;
    return on_device("moe_permute", a->inp->device_id, {{"probs", a->probs}, {"out_probs", a->out2}}, [&] {
        permute_kernel<<<token_blocks(a->T), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, (const char *)a->inp->data,
            es, vec, a->probs ? a->probs->data : nullptr,
            a->probs ? a->probs->dtype : SF_FLOAT32, (char *)a->out->data,
            a->out2 ? a->out2->data : nullptr, a->out2 ? a->out2->dtype : SF_FLOAT32);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_unpermute_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_unpermute", a->inp->device_id, {{"inp", a->inp}, {"probs", a->probs}}, [&] {
        unpermute_kernel<<<token_blocks(a->T), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, a->inp->data, a->inp->dtype,
            a->probs ? a->probs->data : nullptr, a->probs ? a->probs->dtype : SF_FLOAT32, a->out->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_unpermute_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_unpermute_backward", a->grad->device_id,
                     {{"dout", a->grad}, {"inp", a->inp}, {"probs", a->probs}, {"dprobs", a->out2}}, [&] {
        unpermute_backward_kernel<<<token_blocks(a->T), kThreads, 0, sf_cuda_stream(s)>>>(
            a->T, a->E, a->H, a->N, (const int32_t *)a->map->data, a->grad->data, a->grad->dtype,
            a->inp ? a->inp->data : nullptr, a->inp ? a->inp->dtype : SF_FLOAT32,
            a->probs ? a->probs->data : nullptr, a->probs ? a->probs->dtype : SF_FLOAT32,
            a->out->data, a->out2 ? a->out2->data : nullptr, a->out2 ? a->out2->dtype : SF_FLOAT32);
        return SF_OK;
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
    return on_device("moe_swiglu_forward", a->inp->device_id, {{"x", a->inp}, {"probs", a->probs}}, [&] {
        swiglu_forward_kernel<<<blocks_for(a->N * a->H, a->inp->device_id), kThreads, 0, sf_cuda_stream(s)>>>(
            a->N, a->H, a->inp->data, a->inp->dtype, a->probs ? a->probs->data : nullptr,
            a->probs ? a->probs->dtype : SF_FLOAT32, a->out->data);
        return SF_OK;
    });
}

extern "C" sf_status sf_moe_swiglu_backward_cuda(const sf_moe_args *a, sf_stream s)
{
    return on_device("moe_swiglu_backward", a->inp->device_id,
                     {{"dout", a->grad}, {"x", a->inp}, {"probs", a->probs}, {"dprobs", a->out2}}, [&] {
        swiglu_backward_kernel<<<token_blocks(a->N), kThreads, 0, sf_cuda_stream(s)>>>(
            a->N, a->H, a->grad->data, a->grad->dtype, a->inp->data, a->inp->dtype,
            a->probs ? a->probs->data : nullptr, a->probs ? a->probs->dtype : SF_FLOAT32,
            a->out->data, a->out2 ? a->out2->data : nullptr, a->out2 ? a->out2->dtype : SF_FLOAT32);
        return SF_OK;
    });
}
