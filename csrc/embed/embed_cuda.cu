/*
 * embed_cuda.cu - the embedding-gradient add on the GPU, on the caller's
 * stream: one block per (position in sorted order, slice of the columns).
 *
 * A block whose position starts a run of equal indices (the first, or one
 * whose index differs from the previous) sums that run's rows of dy over its
 * columns in float32, in sorted order, then adds the sum to the index's row
 * of dweight and rounds once; every other block returns at once.  No two
 * blocks write one element, so there are no atomics and the result is the
 * CPU reference's to the bit.  The run's rows are loaded four at a time
 * (the index at the fourth row equal to the first's means all four belong
 * to the run: the indices are sorted) and added in order, so a long run (a
 * small vocabulary: DNA) keeps four loads in flight.  A thread covers V
 * consecutive columns as one 16-byte access where the width, the row
 * strides and both base pointers allow it, else V = 1.  Nothing is read on
 * the host: the launch is capturable in a CUDA graph.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "../core/visit.cuh"
#include "embed_backend.h"

namespace {

using sf_vec::load_f;
using sf_vec::store_f;

constexpr int kThreads = 128;

struct EmbedArgs {
    const void *dy;
    void *dw;
    const int64_t *ids;
    const int64_t *order;
    sf_embed_problem p;
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) embed_backward_add_kernel(EmbedArgs a)
{
    const sf_embed_problem &p = a.p;
    const int64_t j = blockIdx.x;
    const int64_t id = a.ids[j];
    if ((j > 0 && a.ids[j - 1] == id) || id == p.padding_idx || id < 0 || id >= p.v)
        return;
    const int64_t col = ((int64_t)blockIdx.y * kThreads + threadIdx.x) * V;
    if (col >= p.h)
        return;
    const T *dy = (const T *)a.dy + col;
    float acc[V];
#pragma unroll
    for (int c = 0; c < V; ++c)
        acc[c] = 0.0f;
    int64_t k = j;
    for (; k + 3 < p.n && a.ids[k + 3] == id; k += 4) {
        float r[4][V];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            load_f<T, V>(dy + a.order[k + u] * p.dy_stride, r[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int c = 0; c < V; ++c)
                acc[c] += r[u][c];
    }
    for (; k < p.n && a.ids[k] == id; ++k) {
        float r[V];
        load_f<T, V>(dy + a.order[k] * p.dy_stride, r);
#pragma unroll
        for (int c = 0; c < V; ++c)
            acc[c] += r[c];
    }
    T *w = (T *)a.dw + id * p.dw_stride + col;
    float cur[V];
    load_f<T, V>(w, cur);
#pragma unroll
    for (int c = 0; c < V; ++c)
        cur[c] += acc[c];
    store_f<T, V>(w, cur);
}

template <typename T>
sf_status launch(const EmbedArgs &a, const sf_tensor *dy, const sf_tensor *dw, cudaStream_t stream)
{
    const sf_embed_problem &p = a.p;
    constexpr int VV = 16 / sizeof(T);
    const bool vec = p.h % VV == 0 && p.dy_stride % VV == 0 && p.dw_stride % VV == 0 &&
                     (uintptr_t)dy->data % 16 == 0 && (uintptr_t)dw->data % 16 == 0;
    const int v = vec ? VV : 1;
    const int64_t slices = (p.h + (int64_t)kThreads * v - 1) / ((int64_t)kThreads * v);
    if (p.n > 0x7fffffff || slices > 65535)
        return sf_fail(SF_ERR_VALUE, "embedding_backward_add: %lld rows of width %lld exceed the kernel's grid "
                       "(at most 2^31 - 1 rows and 65,535 x %d columns)", (long long)p.n, (long long)p.h,
                       kThreads * v);
    dim3 grid((unsigned)p.n, (unsigned)slices);
    if (vec)
        embed_backward_add_kernel<T, VV><<<grid, kThreads, 0, stream>>>(a);
    else
        embed_backward_add_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a);
    SF_CUDA_CHECK_LAUNCH("embedding_backward_add");
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_embedding_backward_add_cuda(const sf_embed_problem *p, const sf_tensor *dy,
                                                    const int64_t *sorted_ids, const int64_t *order,
                                                    sf_tensor *dweight, sf_stream s)
{
    if (p->n == 0 || p->h == 0)
        return SF_OK;
    EmbedArgs a;
    a.dy = dy->data;
    a.dw = dweight->data;
    a.ids = sorted_ids;
    a.order = order;
    a.p = *p;
    cudaStream_t stream = sf_cuda_stream(s);
    return sf_on_device("embedding_backward_add", dy->device_id, [&] {
        return sf_visit_float("embedding_backward_add", "dy", dy->dtype, [&](auto tag) {
            return launch<typename decltype(tag)::type>(a, dy, dweight, stream);
        });
    });
}
