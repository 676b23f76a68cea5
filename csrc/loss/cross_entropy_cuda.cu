/*
 * cross_entropy_cuda.cu - fused cross-entropy on the GPU, one block per row,
 * on the caller's stream.
 *
 * Forward: each thread streams its share of the row with 16-byte loads and
 * keeps an online softmax state (running max m, running sum s of exp(x - m))
 * plus the plain sum of x (for label smoothing); the states are merged across
 * the block, giving lse = m + log s and the loss in one read of the row.  No
 * softmax is written anywhere.
 * Backward: reads the row again with the saved lse and writes
 * scale * (exp(x - lse) - e/V - (1 - e)[j == y]); each thread reads a vector
 * before writing the same vector, so dlogits may be the logits buffer itself.
 * The upstream scale stays in device memory: no host synchronization, and
 * both launches are capturable in a CUDA graph.
 * Bad labels: a row whose label is outside [0, V) and not ignore_index gets a
 * NaN loss (and NaN gradients); when the caller passes a label record
 * (seqfuse_loss.h), the forward also writes the first such row it meets into
 * page-locked host memory, which the host reads later without a
 * synchronization (python/seqfuse/ops/pending_errors.py).
 */
#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "../core/visit.cuh"
#include "cross_entropy.h"
#include "cross_entropy_backend.h"

namespace {

using sf_vec::from_f;
using sf_vec::to_f;

/* V elements as one 16-byte access (the kernels take V = 16 / sizeof(T)). */
template <typename T, int V> using Vec = sf_vec::Pack<T, V>;

constexpr float kLog2e = SF_CE_LOG2E;

/* Merge online-softmax state (m2, s2) into (m, s). */
__device__ __forceinline__ void merge(float &m, float &s, float m2, float s2)
{
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY)
        return; /* both empty */
    s = s * exp2f((m - mm) * kLog2e) + s2 * exp2f((m2 - mm) * kLog2e);
    m = mm;
}

template <int BLOCK>
__device__ __forceinline__ void block_reduce(float &m, float &s, float &sum)
{
    __shared__ float sm[BLOCK / 32], ss[BLOCK / 32], su[BLOCK / 32];
    for (int off = 16; off > 0; off >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
        merge(m, s, m2, s2);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
        su[warp] = sum;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < BLOCK / 32 ? sm[lane] : -INFINITY;
        s = lane < BLOCK / 32 ? ss[lane] : 0.0f;
        sum = lane < BLOCK / 32 ? su[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, off);
            float s2 = __shfl_xor_sync(0xffffffffu, s, off);
            sum += __shfl_xor_sync(0xffffffffu, sum, off);
            merge(m, s, m2, s2);
        }
    }
}

/* Where the forward records a bad label: a claim word in device memory (0
 * while free) and the device address of the host record; both NULL when
 * the caller keeps no record. */
struct LabelSink {
    int *claim;
    long long *record;
};

/* One thread of a bad row: win the claim or leave the record to the row
 * that won it; the winner writes the fields, fences, then publishes STATE. */
__device__ __noinline__ void record_bad_label(LabelSink sink, int64_t row, int64_t y, int64_t v,
                                              int64_t ignore_index, const int64_t *where)
{
    if (atomicCAS(sink.claim, 0, 1) != 0)
        return;
    volatile long long *r = sink.record;
    r[SF_LABEL_ROW] = row;
    r[SF_LABEL_VALUE] = y;
    r[SF_LABEL_CLASSES] = v;
    r[SF_LABEL_IGNORE] = ignore_index;
    r[SF_LABEL_ADDRESS] = (long long)(uintptr_t)where;
    __threadfence_system(); /* the fields reach the host before STATE does */
    r[SF_LABEL_STATE] = 1;
}

template <typename T, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK) ce_forward_kernel(
    const T *__restrict__ logits, int64_t row_stride, int64_t v, const int64_t *__restrict__ labels,
    int64_t ignore_index, float smoothing, float *__restrict__ loss, float *__restrict__ lse,
    LabelSink sink)
{
    int64_t row = blockIdx.x;
    const T *x = logits + row * row_stride;
    float m = -INFINITY, s = 0.0f, sum = 0.0f;
    int has_nan = 0; /* a NaN logit in the row (the sum cannot tell: +inf + -inf is NaN too) */
    int64_t nvec = v / VEC;
    for (int64_t i = threadIdx.x; i < nvec; i += BLOCK) {
        Vec<T, VEC> r = reinterpret_cast<const Vec<T, VEC> *>(x)[i];
        float f[VEC];
        float vm = -INFINITY;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            f[k] = to_f(r.v[k]);
            vm = fmaxf(vm, f[k]);
            sum += f[k];
            has_nan |= isnan(f[k]);
        }
        if (vm > m) {
            s *= exp2f((m - vm) * kLog2e);
            m = vm;
        }
        if (m != -INFINITY) {
            float ms = m * kLog2e;
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                s += exp2f(fmaf(f[k], kLog2e, -ms));
        }
    }
    for (int64_t j = nvec * VEC + threadIdx.x; j < v; j += BLOCK) { /* tail when V % VEC != 0 */
        float f = to_f(x[j]);
        sum += f;
        has_nan |= isnan(f);
        merge(m, s, f, 1.0f);
    }
    block_reduce<BLOCK>(m, s, sum);
    const int any_nan = __syncthreads_or(has_nan);
    if (threadIdx.x == 0) {
        /* any_nan, not s: a NaN can miss s (a thread whose only logit is
         * NaN never adds to s because fmaxf skips NaN) */
        float l = sf_ce_lse(any_nan, m, s);
        lse[row] = l;
        int64_t y = labels[row];
        float value;
        if (y == ignore_index)
            value = 0.0f;
        else if (y < 0 || y >= v)
            value = __int_as_float(0x7fc00000); /* bad label: NaN, documented */
        else
            value = sf_ce_loss(l, 1.0f - smoothing, to_f(x[y]), sum, smoothing, v);
        loss[row] = value;
        if (sink.claim != nullptr && y != ignore_index && (y < 0 || y >= v))
            record_bad_label(sink, row, y, v, ignore_index, labels + row);
    }
}

template <typename T, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK) ce_backward_kernel(
    const T *logits, int64_t row_stride, int64_t v, const int64_t *__restrict__ labels,
    const float *__restrict__ lse, const float *__restrict__ grad_scale, int per_row_scale,
    int64_t ignore_index, float smoothing, T *dlogits, int64_t out_row_stride)
{
    int64_t row = blockIdx.x;
    const T *x = logits + row * row_stride;
    T *dx = dlogits + row * out_row_stride;
    int64_t y = labels[row];
    bool ignored = y == ignore_index;
    float scale = ignored ? 0.0f : grad_scale[per_row_scale ? row : 0];
    if (!ignored && (y < 0 || y >= v))
        scale = __int_as_float(0x7fc00000); /* bad label: NaN gradients, as the forward's NaN loss */
    float off = sf_ce_prob_offset(lse[row]);
    float floor_ = smoothing / (float)v;
    float on_label = 1.0f - smoothing;
    int64_t nvec = v / VEC;
    for (int64_t i = threadIdx.x; i < nvec; i += BLOCK) {
        Vec<T, VEC> r = reinterpret_cast<const Vec<T, VEC> *>(x)[i];
        Vec<T, VEC> o;
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            int64_t j = i * VEC + k;
            float g = sf_ce_grad(sf_ce_prob(to_f(r.v[k]), off), floor_, on_label, j == y);
            o.v[k] = from_f<T>(ignored ? 0.0f : g * scale);
        }
        reinterpret_cast<Vec<T, VEC> *>(dx)[i] = o;
    }
    for (int64_t j = nvec * VEC + threadIdx.x; j < v; j += BLOCK) {
        float g = sf_ce_grad(sf_ce_prob(to_f(x[j]), off), floor_, on_label, j == y);
        dx[j] = from_f<T>(ignored ? 0.0f : g * scale);
    }
}

/* 16-byte vectors when every row start is 16-byte aligned. */
static bool rows_aligned(const sf_tensor *t)
{
    size_t es = sf_dtype_size(t->dtype);
    return ((uintptr_t)t->data % 16) == 0 && (t->shape[0] <= 1 || (t->strides[0] * es) % 16 == 0);
}

constexpr int kBlock = 512;

template <typename T>
sf_status forward(const sf_tensor *logits, const int64_t *labels, int64_t ignore_index, float smoothing,
                  float *loss, float *lse, LabelSink sink, cudaStream_t stream)
{
    int64_t n = logits->shape[0], v = logits->shape[1];
    const T *x = (const T *)logits->data;
    dim3 grid((unsigned)n);
    if (rows_aligned(logits))
        ce_forward_kernel<T, 16 / sizeof(T), kBlock><<<grid, kBlock, 0, stream>>>(
            x, logits->strides[0], v, labels, ignore_index, smoothing, loss, lse, sink);
    else
        ce_forward_kernel<T, 1, kBlock><<<grid, kBlock, 0, stream>>>(
            x, logits->strides[0], v, labels, ignore_index, smoothing, loss, lse, sink);
    SF_CUDA_CHECK_LAUNCH("cross_entropy_forward");
    return SF_OK;
}

template <typename T>
sf_status backward(const sf_tensor *logits, const int64_t *labels, const float *lse, const sf_tensor *scale,
                   int64_t ignore_index, float smoothing, sf_tensor *dlogits, cudaStream_t stream)
{
    int64_t n = logits->shape[0], v = logits->shape[1];
    const T *x = (const T *)logits->data;
    T *dx = (T *)dlogits->data;
    int per_row = sf_numel(scale) != 1;
    const float *sc = (const float *)scale->data;
    dim3 grid((unsigned)n);
    if (rows_aligned(logits) && rows_aligned(dlogits))
        ce_backward_kernel<T, 16 / sizeof(T), kBlock><<<grid, kBlock, 0, stream>>>(
            x, logits->strides[0], v, labels, lse, sc, per_row, ignore_index, smoothing, dx, dlogits->strides[0]);
    else
        ce_backward_kernel<T, 1, kBlock><<<grid, kBlock, 0, stream>>>(
            x, logits->strides[0], v, labels, lse, sc, per_row, ignore_index, smoothing, dx, dlogits->strides[0]);
    SF_CUDA_CHECK_LAUNCH("cross_entropy_backward");
    return SF_OK;
}

sf_status check_rows(const char *op, int64_t n)
{
    if (n > 0x7fffffff)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'logits' has %lld rows; at most 2^31 - 1 are supported",
                       op, (long long)n);
    return SF_OK;
}

/* What both entries do around their kernel: the row limit, nothing for no
 * rows, the logits' device for the launch, and the dtype's instantiation:
 * run(T{}) with T float, __half or __nv_bfloat16. */
template <typename Run>
sf_status on_rows(const char *op, const sf_tensor *logits, Run run)
{
    SF_TRY(check_rows(op, logits->shape[0]));
    if (logits->shape[0] == 0)
        return SF_OK;
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, logits->device_id, &guard));
    sf_status st;
    st = sf_visit_float(op, "logits", logits->dtype, [&](auto tag) {
        return run(typename decltype(tag)::type{});
    });
    sf_cuda_device_restore(&guard);
    return st;
}

} // namespace

/* The device address of the label record: the driver must know it as
 * page-locked host memory mapped into the GPU's address space (torch's
 * pinned memory is, under unified addressing); anything else is refused.
 * The query is no stream work, so it is made in relaxed capture mode: a
 * call under CUDA graph capture may ask it too. */
static sf_status mapped_record(const char *op, const sf_tensor *record, long long **out)
{
    cudaPointerAttributes a;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    SF_CUDA_TRY(op, cudaThreadExchangeStreamCaptureMode(&mode));
    cudaError_t e = cudaPointerGetAttributes(&a, record->data);
    SF_CUDA_TRY(op, cudaThreadExchangeStreamCaptureMode(&mode)); /* the caller's mode back */
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); /* the failed query set the last error: clear it */
        return sf_fail(SF_ERR_VALUE, "%s: argument 'label_record' must be page-locked host memory the GPU "
                       "can write (torch pin_memory=True); the driver does not know its address (%s)", op,
                       cudaGetErrorString(e));
    }
    if (a.type != cudaMemoryTypeHost || a.devicePointer == nullptr)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'label_record' must be page-locked host memory the GPU "
                       "can write (torch pin_memory=True), got %s memory", op,
                       a.type == cudaMemoryTypeHost ? "page-locked but unmapped host" :
                       a.type == cudaMemoryTypeDevice ? "device" :
                       a.type == cudaMemoryTypeManaged ? "managed" : "pageable host");
    *out = (long long *)a.devicePointer;
    return SF_OK;
}

extern "C" sf_status sf_cross_entropy_forward_cuda(const sf_tensor *logits, const sf_tensor *labels,
                                                   int64_t ignore_index, float smoothing, sf_tensor *loss,
                                                   sf_tensor *lse, sf_tensor *label_claim,
                                                   sf_tensor *label_record, sf_stream s)
{
    static const char op[] = "cross_entropy_forward";
    const int64_t *y = (const int64_t *)labels->data;
    float *lo = (float *)loss->data, *ls = (float *)lse->data;
    return on_rows(op, logits, [&](auto t) {
        LabelSink sink = {nullptr, nullptr};
        if (label_claim != nullptr) {
            SF_TRY(mapped_record(op, label_record, &sink.record));
            sink.claim = (int *)label_claim->data;
        }
        return forward<decltype(t)>(logits, y, ignore_index, smoothing, lo, ls, sink, sf_cuda_stream(s));
    });
}

extern "C" sf_status sf_cross_entropy_backward_cuda(const sf_tensor *logits, const sf_tensor *labels,
                                                    const sf_tensor *lse, const sf_tensor *grad_scale,
                                                    int64_t ignore_index, float smoothing,
                                                    sf_tensor *dlogits, sf_stream s)
{
    const int64_t *y = (const int64_t *)labels->data;
    const float *ls = (const float *)lse->data;
    return on_rows("cross_entropy_backward", logits, [&](auto t) {
        return backward<decltype(t)>(logits, y, ls, grad_scale, ignore_index, smoothing, dlogits,
                                     sf_cuda_stream(s));
    });
}
