/*
 * grouped_cuda.cu - the grouped family's device work beyond sf_gemm:
 *
 * 1. Clearing the output rows of a group whose inner dimension is empty,
 *    with cudaMemset2DAsync on the caller's stream.
 * 2. Lanes: a few side streams per device on which the per-group cuBLASLt
 *    calls of one grouped GEMM run side by side.  One expert's GEMM at
 *    many experts is small (Mixtral-small's down projection at 64 experts:
 *    512 x 1024 outputs, 32 tiles of 128 x 128 on a 132-SM H100), so
 *    issued one after another on one stream most of the GPU idles; on
 *    several streams their tiles share the GPU as one grouped kernel's
 *    would.  When the n lanes' groups fit the GPU side by side (n times the
 *    average group's 128 x 128 output tiles at most the SM count), each
 *    lane's GEMMs ask cuBLASLt for algorithms sized for their share of the
 *    SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET: the device's count / n),
 *    not for a whole GPU the others are using; larger groups keep
 *    whole-GPU algorithms and the lanes only overlap one GEMM's tail with
 *    the next one's start.  Asked for no number (lanes = 0), a call takes
 *    as many lanes as the SMs hold its groups side by side, at most
 *    SF_GROUPED_AUTO_LANES, and 2 when a group fills the GPU alone.  A
 *    call forks from the caller's stream with one event (each
 *    lane waits on it) and joins with one event per lane (the caller's
 *    stream waits on each), so the caller's stream sees the grouped GEMM
 *    as one ordered step: tensors freed or reused after it on that stream
 *    are safe without record_stream, and a CUDA graph captured on the
 *    caller's stream takes the lanes in as forked branches.
 *
 * No host synchronization anywhere, so the grouped GEMM stays capturable.
 * One device's lanes serve one grouped call at a time: the open call holds
 * the device's lock until its close (both in sf_grouped_gemm's one cleanup
 * path), since the fork / join events are reused from call to call.
 */
#include <mutex>

#include <cuda_runtime.h>

#include "../core/cuda_util.h"
#include "grouped_backend.h"

extern "C" sf_status sf_grouped_zero_cuda(void *data, int64_t rows, int64_t row_bytes,
                                          int64_t pitch_bytes, int device_id, sf_stream stream)
{
    if (rows <= 0 || row_bytes <= 0)
        return SF_OK;
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("grouped_gemm", device_id, &guard));
    cudaError_t e = cudaMemset2DAsync(data, (size_t)(rows == 1 ? row_bytes : pitch_bytes), 0,
                                      (size_t)row_bytes, (size_t)rows, sf_cuda_stream(stream));
    sf_cuda_device_restore(&guard);
    if (e != cudaSuccess)
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (clearing an empty group's "
                       "output)", cudaGetErrorName(e), cudaGetErrorString(e));
    return SF_OK;
}

namespace {

constexpr int kMaxDevices = 64;

/* One device's lanes, created on first use and kept for the process. */
struct LaneSet {
    std::mutex lock;
    int created = 0; /* streams[0, created) and join[0, created) exist */
    cudaStream_t streams[SF_GROUPED_MAX_LANES] = {};
    cudaEvent_t join[SF_GROUPED_MAX_LANES] = {};
    cudaEvent_t fork = nullptr;
};

LaneSet g_lanes[kMaxDevices];

/* Streams and events up to n (the current device is the lanes' device). */
sf_status lanes_create(LaneSet &s, int n)
{
    if (!s.fork)
        SF_CUDA_TRY("grouped_gemm", cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
    for (; s.created < n; ++s.created) {
        SF_CUDA_TRY("grouped_gemm", cudaStreamCreateWithFlags(&s.streams[s.created], cudaStreamNonBlocking));
        cudaError_t e = cudaEventCreateWithFlags(&s.join[s.created], cudaEventDisableTiming);
        if (e != cudaSuccess) {
            cudaStreamDestroy(s.streams[s.created]);
            s.streams[s.created] = nullptr;
            return sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (creating a lane's event)",
                           cudaGetErrorName(e), cudaGetErrorString(e));
        }
    }
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_grouped_lanes_open(int device_id, sf_stream stream, int n, int64_t tiles,
                                           int groups, sf_grouped_lanes *lanes)
{
    lanes->n = 0;
    if (n == 1 || n < 0 || n > SF_GROUPED_MAX_LANES || device_id < 0 || device_id >= kMaxDevices)
        return sf_fail(SF_ERR_VALUE, "grouped_gemm: %d lanes on device %d: lanes run 2 to %d "
                       "streams on devices 0 to %d", n, device_id, SF_GROUPED_MAX_LANES, kMaxDevices - 1);
    int sms = 0;
    if (cudaError_t e = sf_cuda_query_sm_count(device_id, &sms); e != cudaSuccess)
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (asking device %d's SM count)",
                       cudaGetErrorName(e), cudaGetErrorString(e), device_id);
    const int64_t fit = sms / (tiles > 0 ? tiles : 1); /* groups the SMs hold side by side */
    if (n == 0)
        n = fit < 2 ? 2 : fit < SF_GROUPED_AUTO_LANES ? (int)fit : SF_GROUPED_AUTO_LANES;
    n = n < groups ? n : groups;
    if (n < 2)
        return SF_OK;
    LaneSet &s = g_lanes[device_id];
    s.lock.lock();
    sf_cuda_device_guard guard;
    sf_status st = sf_cuda_device_enter("grouped_gemm", device_id, &guard);
    if (st == SF_OK) {
        st = lanes_create(s, n);
        cudaError_t e = st == SF_OK ? cudaEventRecord(s.fork, sf_cuda_stream(stream)) : cudaSuccess;
        for (int i = 0; e == cudaSuccess && st == SF_OK && i < n; ++i)
            e = cudaStreamWaitEvent(s.streams[i], s.fork, 0);
        if (st == SF_OK && e != cudaSuccess)
            st = sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (forking onto the lanes)",
                         cudaGetErrorName(e), cudaGetErrorString(e));
        sf_cuda_device_restore(&guard);
    }
    if (st != SF_OK) {
        s.lock.unlock();
        return st;
    }
    lanes->sm_share = n <= fit ? sms / n : 0;
    lanes->n = n;
    lanes->device_id = device_id;
    lanes->caller = stream;
    for (int i = 0; i < n; ++i)
        lanes->stream[i] = (sf_stream)s.streams[i];
    return SF_OK;
}

extern "C" sf_status sf_grouped_lanes_close(sf_grouped_lanes *lanes)
{
    if (lanes->n < 2)
        return SF_OK;
    LaneSet &s = g_lanes[lanes->device_id];
    sf_cuda_device_guard guard;
    sf_status st = sf_cuda_device_enter("grouped_gemm", lanes->device_id, &guard);
    cudaError_t e = cudaSuccess;
    /* every lane is joined even after a failed one (the caller's stream
     * must not run ahead of any lane's work) */
    for (int i = 0; st == SF_OK && i < lanes->n; ++i) {
        cudaError_t ei = cudaEventRecord(s.join[i], s.streams[i]);
        if (ei == cudaSuccess)
            ei = cudaStreamWaitEvent(sf_cuda_stream(lanes->caller), s.join[i], 0);
        if (e == cudaSuccess)
            e = ei;
    }
    if (st == SF_OK)
        sf_cuda_device_restore(&guard);
    lanes->n = 0;
    s.lock.unlock();
    SF_TRY(st);
    if (e != cudaSuccess)
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (joining the lanes)",
                       cudaGetErrorName(e), cudaGetErrorString(e));
    return SF_OK;
}
