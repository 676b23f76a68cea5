/*
 * attn_backward_cuda.cu - the flash-attention backward on the GPU (the
 * flash-attention 2 scheme), four launches on the caller's stream:
 *
 *  1. delta_kernel:  delta_r = dout_r . out_r (float32, one warp per row).
 *  2. dkdv_kernel:   one block of 4 warps per 128-key tile (64 at head dim
 *     128) of one key/value head; each warp owns 32 keys (16) and keeps
 *     their dK and dV in registers while the block walks the query tiles
 *     (32 rows per step, the next step's Q, dO, lse and delta fetched while
 *     the current one is computed) that may see the tile, for every query
 *     head of the GQA group (so dK, dV of a shared head are summed in
 *     registers, in a fixed order).  Per query tile it recomputes
 *     S^T = K Q^T and P^T = exp2(S^T * scale*log2e - lse*log2e) from the
 *     forward's lse, dP^T = V dO^T, dS^T = P^T (dP^T - delta), then
 *     dV += P^T dO and dK += dS^T Q on tensor cores, with P^T and dS^T fed
 *     straight from registers.  In the default mode it also stages dS in
 *     shared memory and adds dQ = dS K into a float32 workspace with
 *     atomicAdd (as flash-attention 2 does: the order of the additions, and so
 *     the last bits of dQ, vary run to run).
 *     On Hopper, with the wgmma backward selected (backward_sm90_selected), step 2
 *     is attn_backward_sm90_cuda.cu's kernel instead (head dims 64 and 128, not
 *     deterministic).
 *  3. dq_convert_kernel: dQ = workspace, rounded to the input dtype.
 *     Deterministic mode replaces 2's atomics and 3 by dq_kernel: one block
 *     per 64-query tile walks its key tiles and accumulates dQ in registers
 *     (S and dP recomputed once more: about 40 % more backward math).
 *  4. THD: the rows past the last sequence are zeroed.
 *
 * Dropout (separate instantiations, kDropout): the keep bits of each score
 * tile are regenerated from attn_philox.h (keep_cols / keep_rows in
 * attn_cuda.cuh); dV += dropout(P)^T dO, dP = dropout(dO V^T) (mask and
 * 1 / (1 - p)), dS = P (dP - delta) with P undropped; delta = dO . O with
 * the dropped O is still rowsum(dP o P) (flash-attention 2).
 *
 * Head dims: kernels for tile widths 16, 32, 64 and 128; head dim 24 runs in
 * the 32-wide kernels with its last 8 columns zero-filled on load (they add
 * nothing to S, dP, dV, dK or dQ) and not stored.
 *
 * Files: step 2's kernels are in attn_backward_tiles.cuh; this unit compiles
 * them for every tile width (16, 32, 64, 128) besides the entry and steps 1,
 * 3 and 4.  One unit, not two: split by tile width, the pair cost 11 % more
 * CPU than the one unit, each half repeating the front end
 * (benchmarks/results/logs/build_units_s13.txt).
 */
#include "../core/cuda_util.h"
#include "attn_backend.h"
#include "attn_backward_tiles.cuh"

namespace sf_attn {

template <typename T>
__global__ void delta_kernel(const sf_attn_problem p)
{
    const int h = blockIdx.y, b = blockIdx.z;
    const int r = blockIdx.x * blockDim.y + threadIdx.y, lane = threadIdx.x;
    int64_t qs;
    int sq;
    sf_attn_seq_q(&p, b, &qs, &sq);
    const int rows_total = p.thd ? sq : p.max_sq;
    if (r >= rows_total)
        return;
    float acc = 0.f;
    if (r < sq) {
        const T *o = view_ptr<const T>(p.o, b, qs + r, h);
        const T *d = view_ptr<const T>(p.dout, b, qs + r, h);
        for (int c = 2 * lane; c < p.head_dim; c += 64) {
            float2 a = Mma<T>::unpack(*reinterpret_cast<const uint32_t *>(o + c));
            float2 e = Mma<T>::unpack(*reinterpret_cast<const uint32_t *>(d + c));
            acc += a.x * e.x + a.y * e.y;
        }
        for (int s = 16; s > 0; s >>= 1)
            acc += __shfl_xor_sync(0xffffffffu, acc, s);
    }
    if (lane == 0)
        p.delta[lse_at(p, b, h, qs + r)] = acc;
}

/* dq = dq_accum rounded to T, every row of the view (the workspace was
 * zeroed, so rows no query reached come out 0). */
template <typename T>
__global__ void dq_convert_kernel(const sf_attn_problem p, int64_t rows_per_batch, int64_t total_rows)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; i < total_rows;
         i += (int64_t)gridDim.x * blockDim.y) {
        const int h = (int)(i % p.heads);
        const int64_t t = (i / p.heads) % rows_per_batch;
        const int b = (int)(i / p.heads / rows_per_batch);
        const float *src = reinterpret_cast<const float *>(p.dq_accum.ptr) + (int64_t)b * p.dq_accum.sb +
                           t * p.dq_accum.ss + (int64_t)h * p.dq_accum.sh;
        T *dst = view_ptr<T>(p.dq, b, t, h);
        for (int c = 2 * threadIdx.x; c < p.head_dim; c += 64) {
            float2 v = *reinterpret_cast<const float2 *>(src + c);
            *reinterpret_cast<uint32_t *>(dst + c) = Mma<T>::pack(v.x, v.y);
        }
    }
}

/* sm90: the dK/dV/dQ pass runs on the wgmma kernel (attn_backward_sm90_cuda.cu,
 * head dims 64 and 128, never deterministic, never with dropout); delta and
 * the dQ conversion are these kernels either way. */
template <typename T, int D, bool kDropout>
static sf_status launch_backward(const sf_attn_problem &p, bool sm90, cudaStream_t stream)
{
    static const char op[] = "attention_backward";
    const int rows_q = p.max_sq, batch = p.batch;
    {
        dim3 grid((rows_q + 7) / 8, p.heads, batch);
        delta_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(p);
        SF_CUDA_CHECK_LAUNCH(op);
    }
    if (p.deterministic)
        return launch_backward_tiles<T, D, kDropout>(p, stream);
    const int64_t rows_per_batch = p.thd ? p.extent_q : p.max_sq;
    const int64_t total_rows = (p.thd ? 1 : batch) * rows_per_batch * p.heads;
    SF_CUDA_TRY(op, cudaMemsetAsync(p.dq_accum.ptr, 0, (size_t)total_rows * p.head_dim * sizeof(float), stream));
    if (sm90 && !kDropout) /* backward_sm90_selected never picks it with dropout */
        SF_TRY(launch_backward_sm90(p, stream));
    else
        SF_TRY((launch_backward_tiles<T, D, kDropout>(p, stream)));
    if (total_rows > 0) {
        const int grid = (int)((total_rows + 7) / 8 < 65536 ? (total_rows + 7) / 8 : 65536);
        dq_convert_kernel<T><<<grid, dim3(32, 8), 0, stream>>>(p, rows_per_batch, total_rows);
        SF_CUDA_CHECK_LAUNCH(op);
    }
    return SF_OK;
}

static sf_status launch_backward_any(const sf_attn_problem &p, bool sm90, cudaStream_t stream)
{
    return with_kernel_params("attention_backward", p, [&](auto t, auto w, auto drop) {
        return launch_backward<typename decltype(t)::type, decltype(w)::value, decltype(drop)::value>(p, sm90, stream);
    });
}

} // namespace sf_attn

extern "C" sf_status sf_attn_backward_cuda(const sf_attn_problem *p, sf_stream s, int device)
{
    using namespace sf_attn;
    cudaStream_t stream = sf_cuda_stream(s);
    return run_on_device(
        "attention_backward", *p, device,
        [&]() -> sf_status {
            if (p->batch == 0 || (p->max_sq == 0 && p->max_sk == 0))
                return SF_OK;
            const bool sm90 = backward_sm90_selected(*p, device, NULL); /* wgmma kernel, attn_backward_sm90_cuda.cu */
            return launch_backward_any(*p, sm90, stream);
        },
        [&] {
            if (p->deterministic)
                launch_zero_tail(*p, p->dq, p->heads, p->cu_q, p->extent_q, NULL, stream);
            launch_zero_tail(*p, p->dk, p->heads_kv, p->cu_k, p->extent_k, NULL, stream);
            launch_zero_tail(*p, p->dv, p->heads_kv, p->cu_k, p->extent_k, NULL, stream);
        });
}

