/*
 * rope_cuda.cu - RoPE on the GPU: one block per token, on the caller's stream.
 *
 * Each thread owns a group of V pairs of one head at a time: it takes the 2V
 * angles freqs[pos, .] once (sincosf, once per pair where both members share
 * an angle, as TE's tables have it) and reuses them for every head it
 * visits, so the transcendental work is shared across heads.  Where the last
 * dimension is unit-stride and every stride and pointer allows it, a group is
 * loaded as two V-element vectors (V = 4: 8 bytes of bf16/fp16, 16 of fp32);
 * otherwise V = 1 with any strides.  Elements past rot_dim and thd tokens past
 * the last sequence are copied through.  The position of a thd token comes
 * from a binary search of cu_seqlens in device memory: nothing is read on the
 * host, nothing synchronizes, and the launch is capturable in a CUDA graph.
 * A position outside freqs makes NaN (documented in seqfuse_rope.h).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../core/cuda_util.h"
#include "rope_backend.h"

namespace {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
    T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T *base, int64_t stride, float (&x)[V])
{
    if (V > 1) { /* stride is 1 on this path */
        Vec<T, V> r = *reinterpret_cast<const Vec<T, V> *>(base);
#pragma unroll
        for (int k = 0; k < V; ++k)
            x[k] = to_f(r.v[k]);
    } else {
        x[0] = to_f(base[0]);
    }
    (void)stride;
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T *base, const float (&x)[V])
{
    Vec<T, V> r;
#pragma unroll
    for (int k = 0; k < V; ++k)
        r.v[k] = from_f<T>(x[k]);
    *reinterpret_cast<Vec<T, V> *>(base) = r;
}

struct RopeArgs {
    const void *in;
    void *out;
    const float *freqs;
    const int32_t *cu;
    const int32_t *start;
    sf_rope_problem p;
};

/* Position of token (i0, i1), or -1 for a thd token outside every sequence. */
__device__ __forceinline__ int64_t token_pos(const RopeArgs &a, int64_t i0, int64_t i1)
{
    const sf_rope_problem &p = a.p;
    int64_t seq, q;
    if (p.format == SF_ROPE_THD) {
        if (i0 < a.cu[0] || i0 >= a.cu[p.batch])
            return -1;
        int64_t lo = 0, hi = p.batch - 1; /* largest seq with cu[seq] <= i0 */
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) >> 1;
            if (a.cu[mid] <= i0) lo = mid;
            else hi = mid - 1;
        }
        seq = lo;
        q = i0 - a.cu[seq];
    } else if (p.format == SF_ROPE_BSHD) {
        seq = i0;
        q = i1;
    } else {
        seq = i1;
        q = i0;
    }
    return q + (a.start ? a.start[seq] : 0);
}

template <typename T, bool IL, int V>
__global__ void rope_kernel(RopeArgs a)
{
    const sf_rope_problem &p = a.p;
    const T *in = static_cast<const T *>(a.in);
    T *out = static_cast<T *>(a.out);
    int64_t tok = blockIdx.x;
    int64_t i0 = p.n1 == 1 ? tok : tok / p.n1;
    int64_t i1 = p.n1 == 1 ? 0 : tok % p.n1;
    int64_t pos = token_pos(a, i0, i1);
    bool pass = pos == -1 && p.format == SF_ROPE_THD;
    bool bad = !pass && (pos < 0 || pos >= p.max_pos);
    const T *in_tok = in + i0 * p.in_stride[0] + i1 * p.in_stride[1];
    T *out_tok = out + i0 * p.out_stride[0] + i1 * p.out_stride[1];
    const int64_t is = p.in_stride[3], os = p.out_stride[3];

    if (!pass) {
        const int G = (int)(p.rot / 2 / V); /* pair groups per head */
        const int Gb = G < (int)blockDim.x ? G : (int)blockDim.x;
        const int Hb = (int)blockDim.x / Gb;
        const int gl = threadIdx.x % Gb, hy = threadIdx.x / Gb;
        if (hy < Hb) {
            for (int g = gl; g < G; g += Gb) {
                int64_t j1[V], j2[V];
                float c1[V], s1[V], c2[V], s2[V];
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    sf_rope_pair_index(IL, p.rot, (int64_t)g * V + k, &j1[k], &j2[k]);
                    if (bad) {
                        c1[k] = s1[k] = c2[k] = s2[k] = __int_as_float(0x7fc00000);
                    } else {
                        const float *fr = a.freqs + pos * p.f_stride_pos;
                        float a1 = fr[j1[k] * p.f_stride_dim], a2 = fr[j2[k] * p.f_stride_dim];
                        sincosf(a1, &s1[k], &c1[k]);
                        if (a2 == a1) { /* TE's tables repeat each angle for both members */
                            s2[k] = s1[k];
                            c2[k] = c1[k];
                        } else {
                            sincosf(a2, &s2[k], &c2[k]);
                        }
                    }
                }
                /* element offsets of the two V-vectors this group reads */
                int64_t e1 = IL ? (int64_t)g * 2 * V : (int64_t)g * V;
                int64_t e2 = IL ? e1 + V : e1 + p.rot / 2;
                for (int64_t h = hy; h < p.heads; h += Hb) {
                    const T *src = in_tok + h * p.in_stride[2];
                    T *dst = out_tok + h * p.out_stride[2];
                    float x1[V], x2[V], y1[V], y2[V];
                    if (V == 1) {
                        x1[0] = to_f(src[j1[0] * is]);
                        x2[0] = to_f(src[j2[0] * is]);
                    } else {
                        float a1[V], a2[V];
                        load_vec<T, V>(src + e1, 1, a1);
                        load_vec<T, V>(src + e2, 1, a2);
#pragma unroll
                        for (int k = 0; k < V; ++k) {
                            if (IL) { /* a1 a2 hold 2V consecutive elements: pairs (2k, 2k+1) */
                                int m = 2 * k;
                                x1[k] = m < V ? a1[m] : a2[m - V];
                                x2[k] = m + 1 < V ? a1[m + 1] : a2[m + 1 - V];
                            } else {
                                x1[k] = a1[k];
                                x2[k] = a2[k];
                            }
                        }
                    }
#pragma unroll
                    for (int k = 0; k < V; ++k)
                        sf_rope_rotate(p.backward, x1[k], x2[k], c1[k], s1[k], c2[k], s2[k],
                                       &y1[k], &y2[k]);
                    if (V == 1) {
                        dst[j1[0] * os] = from_f<T>(y1[0]);
                        dst[j2[0] * os] = from_f<T>(y2[0]);
                    } else {
                        float b1[V], b2[V];
#pragma unroll
                        for (int k = 0; k < V; ++k) {
                            if (IL) {
                                int m = 2 * k;
                                if (m < V) b1[m] = y1[k]; else b2[m - V] = y1[k];
                                if (m + 1 < V) b1[m + 1] = y2[k]; else b2[m + 1 - V] = y2[k];
                            } else {
                                b1[k] = y1[k];
                                b2[k] = y2[k];
                            }
                        }
                        store_vec<T, V>(dst + e1, b1);
                        store_vec<T, V>(dst + e2, b2);
                    }
                }
            }
        }
    }

    /* pass-through: [rot, dim) of every head, or all of a token outside every sequence */
    const int64_t first = pass ? 0 : p.rot;
    const int64_t per_head = (p.dim - first) / V;
    const int64_t units = per_head * p.heads;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
        int64_t h = u / per_head, e = first + (u % per_head) * V;
        const T *src = in_tok + h * p.in_stride[2];
        T *dst = out_tok + h * p.out_stride[2];
        if (V == 1) {
            dst[e * os] = src[e * is];
        } else {
            *reinterpret_cast<Vec<T, V> *>(dst + e) = *reinterpret_cast<const Vec<T, V> *>(src + e);
        }
    }
}

/* The vector path needs unit stride along d and every other stride (of a
 * dimension longer than 1) and both pointers aligned to V elements. */
static bool vector_ok(const sf_rope_problem &p, const sf_tensor *t, const sf_tensor *out, int V)
{
    if (p.rot % (2 * V) || p.dim % V)
        return false;
    if (p.dim > 1 && (p.in_stride[3] != 1 || p.out_stride[3] != 1))
        return false;
    int64_t sizes[3] = {p.n0, p.n1, p.heads};
    for (int k = 0; k < 3; ++k)
        if (sizes[k] > 1 && (p.in_stride[k] % V || p.out_stride[k] % V))
            return false;
    size_t bytes = sf_dtype_size(t->dtype) * V;
    return ((uintptr_t)t->data % bytes) == 0 && ((uintptr_t)out->data % bytes) == 0;
}

template <typename T>
sf_status launch(const RopeArgs &a, bool vec, cudaStream_t stream)
{
    const sf_rope_problem &p = a.p;
    int V = vec ? 4 : 1;
    int64_t units = p.heads * (p.rot / 2 / V);
    /* at most 128 threads: each thread then visits more heads per token, and
     * the sines and cosines it computes once serve all of them */
    int block = (int)((units + 31) / 32 * 32);
    block = block < 64 ? 64 : block > 128 ? 128 : block;
    int64_t tokens = p.n0 * p.n1;
    if (tokens > 0x7fffffff)
        return sf_fail(SF_ERR_VALUE, "rope: argument 't' has %lld tokens; at most 2^31 - 1 are supported",
                       (long long)tokens);
    dim3 grid((unsigned)tokens);
    if (p.interleaved) {
        if (vec) rope_kernel<T, true, 4><<<grid, block, 0, stream>>>(a);
        else     rope_kernel<T, true, 1><<<grid, block, 0, stream>>>(a);
    } else {
        if (vec) rope_kernel<T, false, 4><<<grid, block, 0, stream>>>(a);
        else     rope_kernel<T, false, 1><<<grid, block, 0, stream>>>(a);
    }
    SF_CUDA_CHECK_LAUNCH("rope");
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_rope_cuda(const sf_rope_problem *p, const sf_tensor *t, const sf_tensor *freqs,
                                  const int32_t *cu_seqlens, const int32_t *start_positions,
                                  sf_tensor *out, sf_stream s)
{
    if (p->n0 * p->n1 == 0 || p->heads == 0)
        return SF_OK;
    RopeArgs a;
    a.in = t->data;
    a.out = out->data;
    a.freqs = (const float *)freqs->data;
    a.cu = cu_seqlens;
    a.start = start_positions;
    a.p = *p;
    bool vec = vector_ok(*p, t, out, 4);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("rope", t->device_id, &guard));
    cudaStream_t stream = sf_cuda_stream(s);
    sf_status st;
    switch (t->dtype) {
    case SF_FLOAT32: st = launch<float>(a, vec, stream); break;
    case SF_FLOAT16: st = launch<__half>(a, vec, stream); break;
    default:         st = launch<__nv_bfloat16>(a, vec, stream); break;
    }
    sf_cuda_device_restore(&guard);
    return st;
}
