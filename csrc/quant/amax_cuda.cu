/*
 * amax_cuda.cu - amax on the GPU in one pass, on the caller's stream.
 *
 * Each block reduces its grid-stride share with 16-byte loads (contiguous
 * input) or strided loads (any layout), then folds its result into out[0]
 * with atomicMax on the float's bit pattern: for non-negative floats the
 * unsigned integer order is the float order, and a NaN's bits (0x7fc00000 and
 * up) compare above +inf, so NaN wins the way the CPU reference says it must.
 * out is zeroed by a memset on the same stream first; both are capturable in a
 * CUDA graph and neither synchronizes the host.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../core/cuda_util.h"
#include "../core/visit.cuh"
#include "amax_backend.h"
#include "fp8_cuda.cuh"

namespace {

constexpr int kBlock = 512;

__device__ __forceinline__ unsigned abs_bits(float v)
{
    return __float_as_uint(v) & 0x7fffffffu;
}

template <typename T>
__global__ void amax_contiguous_kernel(const T *__restrict__ x, int64_t n,
                                       unsigned *__restrict__ out)
{
    constexpr int kVec = 16 / sizeof(T);
    unsigned m = 0;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    /* peel the head so the vector loop reads 16-byte aligned chunks */
    int64_t head = (int64_t)(((16 - ((uintptr_t)x & 15)) & 15) / sizeof(T));
    if (head > n)
        head = n;
    if (tid < head)
        m = abs_bits(sf_to_float(x[tid]));
    const T *xv = x + head;
    int64_t nvec = (n - head) / kVec;
    for (int64_t i = tid; i < nvec; i += stride) {
        uint4 raw = __ldg(reinterpret_cast<const uint4 *>(xv) + i);
        const T *vals = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int k = 0; k < kVec; ++k)
            m = max(m, abs_bits(sf_to_float(vals[k])));
    }
    for (int64_t i = head + nvec * kVec + tid; i < n; i += stride)
        m = max(m, abs_bits(sf_to_float(x[i])));
    sf_block_atomic_max_bits<kBlock>(m, out);
}

struct Layout {
    int ndim;
    int64_t shape[SF_MAX_DIMS];
    int64_t strides[SF_MAX_DIMS];
};

template <typename T>
__global__ void amax_strided_kernel(const T *__restrict__ x, int64_t n, Layout l,
                                    unsigned *__restrict__ out)
{
    unsigned m = 0;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t rem = i, offset = 0;
        for (int d = l.ndim - 1; d >= 0; --d) {
            offset += (rem % l.shape[d]) * l.strides[d];
            rem /= l.shape[d];
        }
        m = max(m, abs_bits(sf_to_float(x[offset])));
    }
    sf_block_atomic_max_bits<kBlock>(m, out);
}

template <typename T>
sf_status launch(const sf_tensor *x, unsigned *out, cudaStream_t stream)
{
    int64_t n = sf_numel(x);
    int sms = sf_cuda_sm_count(x->device_id);
    if (sf_is_contiguous(x)) {
        int64_t work = n / (16 / sizeof(T)) + 1;
        int grid = sf_grid_size(work, kBlock, sms * 4);
        amax_contiguous_kernel<T><<<grid, kBlock, 0, stream>>>((const T *)x->data, n, out);
    } else {
        Layout l;
        l.ndim = x->ndim;
        for (int d = 0; d < x->ndim; ++d) {
            l.shape[d] = x->shape[d];
            l.strides[d] = x->strides[d];
        }
        int grid = sf_grid_size(n, kBlock, sms * 4);
        amax_strided_kernel<T><<<grid, kBlock, 0, stream>>>((const T *)x->data, n, l, out);
    }
    SF_CUDA_CHECK_LAUNCH("amax");
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_amax_cuda(const sf_tensor *x, sf_tensor *out, sf_stream s)
{
    cudaStream_t stream = sf_cuda_stream(s);
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("amax", x->device_id, &guard));
    sf_status st = SF_OK;
    cudaError_t e = cudaMemsetAsync(out->data, 0, sizeof(float), stream);
    if (e != cudaSuccess) {
        st = sf_fail(SF_ERR_RUNTIME, "amax: CUDA error %s: %s (zeroing 'out')",
                     cudaGetErrorName(e), cudaGetErrorString(e));
    } else if (sf_numel(x) > 0) {
        unsigned *o = (unsigned *)out->data;
        st = sf_visit_float("amax", "x", x->dtype, [&](auto tag) {
            return launch<typename decltype(tag)::type>(x, o, stream);
        });
    }
    sf_cuda_device_restore(&guard);
    return st;
}
