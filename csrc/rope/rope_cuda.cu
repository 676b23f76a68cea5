/*
 * rope_cuda.cu - RoPE on the GPU: one block per token, on the caller's stream.
 *
 * The block first issues its global loads (each thread holds up to kBatch
 * heads' worth of one group of V pairs in registers), then computes the
 * token's rot_dim sines and cosines once, cooperatively, into shared memory
 * (each angle once per token, whatever the head count), waits once, and
 * rotates and stores: the loads are in flight while sincosf runs.  Where the
 * last dimension is unit-stride and every stride and pointer allows it, a
 * group is V pairs loaded as two 16-byte vectors (V = 8 for bf16/fp16, 4 for
 * fp32); otherwise V = 1 with any strides.  Elements past rot_dim, thd
 * tokens past the last sequence and the heads past rotate_heads are copied
 * through.  The input may come in up to three parts along the heads
 * (sf_rope_parts: a fused QKV projection's q, k and v gradients), each head
 * read from the part holding it.  The position of a thd
 * token comes from a binary search of cu_seqlens in device memory: nothing is
 * read on the host, nothing synchronizes, and the launch is capturable in a
 * CUDA graph.  A position outside freqs makes NaN (seqfuse_rope.h).
 *
 * Registers: the (cos, sin) pairs sit in shared memory as float2 and are
 * read where they are used (16 bytes of shared memory per pair against 4 of
 * global input: a quarter of shared memory's bandwidth at the copy rate),
 * and a thread rotates one head at a time while the loads of all kBatch are
 * in flight.  That keeps the kernel within 64 registers, 16+ blocks per SM;
 * holding the 4 x V angles of a group across the heads in registers, as an
 * earlier version did, took 153-157 registers and 3 blocks of 128 per SM.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "../core/visit.cuh"
#include "rope_backend.h"

namespace {

using sf_vec::from_f; /* float <-> element conversions shared with norm / act */
using sf_vec::to_f;

constexpr int kBatch = 4;          /* heads per thread whose loads are in flight together */
constexpr int kMaxRot = 6144;      /* rot_dim (cos, sin) float pairs of shared memory: 48 KB */

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
    T v[V];
};

struct RopeArgs {
    const void *in[SF_ROPE_MAX_PARTS]; /* the parts, p.part_end's order */
    void *out;
    const float *freqs;
    const int32_t *cu;
    const int32_t *start;
    sf_rope_problem p;
};

/* Position of token (i0, i1); *outside: a thd token outside every sequence
 * (copied through; its position is not read). */
__device__ __forceinline__ int64_t token_pos(const RopeArgs &a, int64_t i0, int64_t i1, bool *outside)
{
    const sf_rope_problem &p = a.p;
    int64_t seq, q;
    *outside = false;
    if (p.format == SF_ROPE_THD) {
        if (i0 < a.cu[0] || i0 >= a.cu[p.batch]) {
            *outside = true;
            return 0;
        }
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

/* Group g of a head: V pairs whose members sit at elements e1 + k and
 * e2 + k (half-split), or at e1 .. e1 + 2V - 1 interleaved (e2 = e1 + V). */
template <bool IL, int V>
__device__ __forceinline__ void group_offsets(int g, int64_t rot, int64_t *e1, int64_t *e2)
{
    if (IL) {
        *e1 = (int64_t)g * 2 * V;
        *e2 = *e1 + V;
    } else {
        *e1 = (int64_t)g * V;
        *e2 = *e1 + rot / 2;
    }
}

/* Head h of token (i0, i1) in the part holding it; *es: that part's element stride. */
template <typename T>
__device__ __forceinline__ const T *head_src(const RopeArgs &a, int64_t i0, int64_t i1, int64_t h, int64_t *es)
{
    const sf_rope_problem &p = a.p;
    const int k = sf_rope_part_of(&p, h);
    const int64_t *st = p.in_stride[k];
    *es = st[3];
    return static_cast<const T *>(a.in[k]) + i0 * st[0] + i1 * st[1] + (h - (k ? p.part_end[k - 1] : 0)) * st[2];
}

template <typename T, bool IL, int V>
__global__ void __launch_bounds__(128, 8) rope_kernel(RopeArgs a)
{
    extern __shared__ float2 cs[]; /* (cos, sin) of each of this token's rot angles */
    const sf_rope_problem &p = a.p;
    T *out = static_cast<T *>(a.out);
    const int64_t tok = blockIdx.x;
    const int64_t i0 = p.n1 == 1 ? tok : tok / p.n1;
    const int64_t i1 = p.n1 == 1 ? 0 : tok % p.n1;
    bool pass; /* uniform over the block */
    const int64_t pos = token_pos(a, i0, i1, &pass);
    const bool bad = !pass && (pos < 0 || pos >= p.max_pos);
    T *out_tok = out + i0 * p.out_stride[0] + i1 * p.out_stride[1];
    const int64_t os = p.out_stride[3], hos = p.out_stride[2];
    const int64_t R = p.rotate_heads; /* heads [0, R) turned, [R, heads) copied below */

    const int G = (int)(p.rot / 2 / V); /* pair groups per head */
    const int Gb = G < (int)blockDim.x ? G : (int)blockDim.x;
    const int Hb = (int)blockDim.x / Gb;
    int g = threadIdx.x % Gb;
    const int hy = threadIdx.x / Gb;
    bool have = !pass && hy < Hb && hy < R;

    Vec<T, V> ra[kBatch], rb[kBatch];
    int64_t e1 = 0, e2 = 0, h0 = hy;
    auto load_batch = [&]() {
        group_offsets<IL, V>(g, p.rot, &e1, &e2);
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
            int64_t h = h0 + (int64_t)k * Hb;
            if (h < R) {
                int64_t es;
                const T *src = head_src<T>(a, i0, i1, h, &es);
                ra[k] = *reinterpret_cast<const Vec<T, V> *>(src + e1 * es);
                rb[k] = *reinterpret_cast<const Vec<T, V> *>(src + e2 * es);
            }
        }
    };
    if (have)
        load_batch(); /* in flight while the angles are computed */

    if (!pass && R > 0) {
        const float *fr = a.freqs + pos * p.f_stride_pos;
        for (int64_t j = threadIdx.x; j < p.rot; j += blockDim.x) {
            if (bad) {
                const float nan = __int_as_float(0x7fc00000);
                cs[j] = make_float2(nan, nan);
            } else {
                float s, c;
                sincosf(fr[j * p.f_stride_dim], &s, &c);
                cs[j] = make_float2(c, s);
            }
        }
    }
    __syncthreads();

    while (have) {
        /* the angles are read from shared memory where they are used, not
         * held across the heads in registers (32 floats a thread for bf16:
         * what kept an earlier version at 153-157 registers); 16 bytes of
         * shared memory per pair against 4 bytes of global input */
#pragma unroll 1 /* one head at a time: the loads of all kBatch are already in flight */
        for (int k = 0; k < kBatch; ++k) {
            int64_t h = h0 + (int64_t)k * Hb;
            if (h >= R)
                break;
            Vec<T, V> oa, ob;
#pragma unroll
            for (int i = 0; i < V; ++i) {
                float x1, x2;
                if (IL) { /* ra rb hold 2V consecutive elements: pairs (2i, 2i+1) */
                    int m = 2 * i;
                    x1 = to_f(m < V ? ra[k].v[m] : rb[k].v[m - V]);
                    x2 = to_f(m + 1 < V ? ra[k].v[m + 1] : rb[k].v[m + 1 - V]);
                } else {
                    x1 = to_f(ra[k].v[i]);
                    x2 = to_f(rb[k].v[i]);
                }
                int64_t j1, j2;
                sf_rope_pair_index(IL, p.rot, (int64_t)g * V + i, &j1, &j2);
                const float2 a1 = cs[j1], a2 = cs[j2];
                float y1, y2;
                sf_rope_rotate(p.backward, x1, x2, a1.x, a1.y, a2.x, a2.y, &y1, &y2);
                if (IL) {
                    int m = 2 * i;
                    if (m < V) oa.v[m] = from_f<T>(y1); else ob.v[m - V] = from_f<T>(y1);
                    if (m + 1 < V) oa.v[m + 1] = from_f<T>(y2); else ob.v[m + 1 - V] = from_f<T>(y2);
                } else {
                    oa.v[i] = from_f<T>(y1);
                    ob.v[i] = from_f<T>(y2);
                }
            }
            T *dst = out_tok + h * hos;
            *reinterpret_cast<Vec<T, V> *>(dst + e1 * os) = oa;
            *reinterpret_cast<Vec<T, V> *>(dst + e2 * os) = ob;
        }
        /* next batch of heads, then the next group */
        h0 += (int64_t)Hb * kBatch;
        if (h0 >= R) {
            h0 = hy;
            g += Gb;
            if (g >= G)
                break;
        }
        load_batch();
    }

    /* pass-through: [rot, dim) of every turned head (all of it for a token
     * outside every sequence), then every element of the copied heads */
    const int64_t first = pass ? 0 : p.rot;
    const int64_t per_turned = (p.dim - first) / V, per_head = p.dim / V;
    const int64_t turned_units = per_turned * R;
    const int64_t units = turned_units + per_head * (p.heads - R);
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
        int64_t h, e;
        if (u < turned_units) {
            h = u / per_turned;
            e = first + (u % per_turned) * V;
        } else {
            h = R + (u - turned_units) / per_head;
            e = ((u - turned_units) % per_head) * V;
        }
        int64_t es;
        const T *src = head_src<T>(a, i0, i1, h, &es);
        *reinterpret_cast<Vec<T, V> *>(out_tok + h * hos + e * os) = *reinterpret_cast<const Vec<T, V> *>(src + e * es);
    }
}

/* The vector path needs unit stride along d, every other stride (of a
 * dimension longer than 1) a multiple of V, and both pointers aligned to V
 * elements. */
static bool vector_ok(const sf_rope_problem &p, const sf_tensor *const *parts, const sf_tensor *out, int V)
{
    if (p.rot % (2 * V) || p.dim % V)
        return false;
    const size_t bytes = sf_dtype_size(out->dtype) * V;
    const int64_t sizes[3] = {p.n0, p.n1, p.heads};
    if (p.out_stride[3] != 1 || (uintptr_t)out->data % bytes)
        return false;
    for (int k = 0; k < 3; ++k)
        if (sizes[k] > 1 && p.out_stride[k] % V)
            return false;
    for (int i = 0; i < SF_ROPE_MAX_PARTS && parts[i]; ++i) {
        const int64_t *st = p.in_stride[i];
        if (st[3] != 1 || (uintptr_t)parts[i]->data % bytes)
            return false;
        for (int k = 0; k < 3; ++k) /* (a stride of a dimension of length 1 is never used: any) */
            if ((k == 2 ? parts[i]->shape[parts[i]->ndim - 2] : sizes[k]) > 1 && st[k] % V)
                return false;
    }
    return true;
}

template <typename T, bool IL, int V>
void launch_one(const RopeArgs &a, cudaStream_t stream)
{
    const sf_rope_problem &p = a.p;
    /* about kBatch heads per thread: each thread's loads of a token go out together */
    int64_t groups = p.rot / 2 / V;
    int64_t rows = (p.rotate_heads + kBatch - 1) / kBatch;
    int64_t want = rows * groups;
    const int64_t copies = (p.heads - p.rotate_heads) * (p.dim / V) / kBatch; /* the copied heads' vectors */
    want = want > copies ? want : copies;
    int block = (int)((want + 31) / 32 * 32);
    block = block < 32 ? 32 : block > 128 ? 128 : block;
    size_t smem = (size_t)p.rot * sizeof(float2);
    rope_kernel<T, IL, V><<<(unsigned)(p.n0 * p.n1), block, smem, stream>>>(a);
}

template <typename T>
sf_status launch(const RopeArgs &a, bool vec, cudaStream_t stream)
{
    const sf_rope_problem &p = a.p;
    int64_t tokens = p.n0 * p.n1;
    if (tokens > 0x7fffffff)
        return sf_fail(SF_ERR_VALUE, "rope: argument 't' has %lld tokens; at most 2^31 - 1 are supported",
                       (long long)tokens);
    constexpr int VV = 16 / sizeof(T);
    if (p.interleaved) {
        if (vec) launch_one<T, true, VV>(a, stream);
        else     launch_one<T, true, 1>(a, stream);
    } else {
        if (vec) launch_one<T, false, VV>(a, stream);
        else     launch_one<T, false, 1>(a, stream);
    }
    SF_CUDA_CHECK_LAUNCH("rope");
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_rope_cuda(const sf_rope_problem *p, const sf_tensor *const *parts, const sf_tensor *freqs,
                                  const int32_t *cu_seqlens, const int32_t *start_positions,
                                  sf_tensor *out, sf_stream s)
{
    if (p->n0 * p->n1 == 0 || p->heads == 0)
        return SF_OK;
    if (p->rot > kMaxRot)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED, "rope: argument 'freqs' has rot_dim %lld; the CUDA kernel keeps "
                       "a token's sines and cosines in shared memory and takes rot_dim <= %d",
                       (long long)p->rot, kMaxRot);
    RopeArgs a;
    for (int i = 0; i < SF_ROPE_MAX_PARTS; ++i)
        a.in[i] = parts[i] ? parts[i]->data : NULL;
    a.out = out->data;
    a.freqs = (const float *)freqs->data;
    a.cu = cu_seqlens;
    a.start = start_positions;
    a.p = *p;
    const sf_tensor *t = parts[0];
    bool vec = vector_ok(*p, parts, out, (int)(16 / sf_dtype_size(t->dtype)));
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("rope", t->device_id, &guard));
    cudaStream_t stream = sf_cuda_stream(s);
    sf_status st;
    st = sf_visit_float("rope", "t", t->dtype, [&](auto tag) {
        return launch<typename decltype(tag)::type>(a, vec, stream);
    });
    sf_cuda_device_restore(&guard);
    return st;
}
