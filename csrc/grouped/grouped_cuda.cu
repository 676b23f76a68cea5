/*
 * grouped_cuda.cu - the grouped family's device work beyond sf_gemm:
 *
 * 1. Clearing the output rows of a group whose inner dimension is empty,
 *    with cudaMemset2DAsync on the caller's stream.
 * 2. Lanes: side streams on which the per-group cuBLASLt calls of one
 *    grouped GEMM run side by side.  One expert's GEMM at many experts is
 *    small (Mixtral-small's down projection at 64 experts: 512 x 1024
 *    outputs, 32 tiles of 128 x 128 on a 132-SM H100), so issued one after
 *    another on one stream most of the GPU idles; on several streams their
 *    tiles share the GPU as one grouped kernel's would.  When the n lanes'
 *    groups fit the GPU side by side (n times the average group's 128 x 128
 *    output tiles at most the SM count), each lane's GEMMs ask cuBLASLt for
 *    algorithms sized for their share of the SMs
 *    (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET: the device's count / n), not
 *    for a whole GPU the others are using; larger groups keep whole-GPU
 *    algorithms and the lanes only overlap one GEMM's tail with the next
 *    one's start.  Asked for no number (lanes = 0), a call takes as many
 *    lanes as the SMs hold its groups side by side, at most
 *    SF_GROUPED_AUTO_LANES, and none (the caller's stream alone) when fewer
 *    than two fit: there the overlap of tails measured -5 to +10 % on
 *    isolated grouped GEMMs (s44), while Mixtral-small's FP8 training step,
 *    whose MoE blocks wait on the host for the routing counts, ran 3-11 %
 *    slower with it than on one stream (s46: 217k against 231k and 220k /
 *    237k against 244k tokens/s on an H100): the lanes' events and stream
 *    switches are host work the GPU waits for after each such wait.
 *
 *    A call forks from the caller's stream with one event (each lane waits
 *    on it) and joins with one event per lane (the caller's stream waits on
 *    each), so the caller's stream sees the grouped GEMM as one ordered
 *    step: tensors freed or reused after it on that stream are safe without
 *    record_stream, and a CUDA graph captured on the caller's stream takes
 *    the lanes in as forked branches.
 *
 *    Each device has kSets lane sets of SF_GROUPED_MAX_LANES streams, all
 *    created at the device's first call with lanes (so none is created
 *    while a graph is being captured, unless that first call is).  A caller
 *    stream keeps the set it first took: calls from different streams (two
 *    threads, a capture stream beside the default one, micro-batches
 *    overlapped on two streams) use different sets and neither waits for
 *    the other's lanes.  A set is never shared by two caller streams (one
 *    of them may be capturing a graph, which would take the other's lane
 *    work in): past kSets caller streams on a device, a further stream's
 *    grouped GEMMs run on that stream alone.  A set serves one call at a time: the call
 *    holds the set's lock from open to close (close is on sf_grouped_gemm's
 *    one way out), since the fork and join events are reused.
 *
 * No host synchronization anywhere, so the grouped GEMM stays capturable.
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

constexpr int kMaxDevices = 64; /* as the gemm family's plan cache */
constexpr int kSets = 8;        /* lane sets per device (see the note) */

/* One set of lanes, kept for the process. */
struct LaneSet {
    std::mutex lock;                /* held by the call using the set */
    cudaStream_t owner = nullptr;   /* the caller stream that took it */
    bool owned = false;
    cudaStream_t streams[SF_GROUPED_MAX_LANES] = {};
    cudaEvent_t join[SF_GROUPED_MAX_LANES] = {};
    cudaEvent_t fork = nullptr;
};

struct DeviceLanes {
    std::mutex lock; /* guards `made` and the sets' owners */
    bool made = false;
    LaneSet sets[kSets];
};

DeviceLanes g_devices[kMaxDevices];

sf_status lane_error(cudaError_t e, const char *what)
{
    return sf_fail(SF_ERR_RUNTIME, "grouped_gemm: CUDA error %s: %s (%s)", cudaGetErrorName(e),
                   cudaGetErrorString(e), what);
}

/* Every set's streams and events (the current device is theirs); d.lock held.
 * On failure what was made stays (destroyed never; retried next call). */
sf_status make_sets(DeviceLanes &d)
{
    for (LaneSet &s : d.sets) {
        if (!s.fork) {
            if (cudaError_t e = cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming); e != cudaSuccess)
                return lane_error(e, "creating a lane event");
        }
        for (int i = 0; i < SF_GROUPED_MAX_LANES; ++i) {
            if (!s.streams[i])
                if (cudaError_t e = cudaStreamCreateWithFlags(&s.streams[i], cudaStreamNonBlocking);
                    e != cudaSuccess)
                    return lane_error(e, "creating a lane stream");
            if (!s.join[i])
                if (cudaError_t e = cudaEventCreateWithFlags(&s.join[i], cudaEventDisableTiming);
                    e != cudaSuccess)
                    return lane_error(e, "creating a lane event");
        }
    }
    d.made = true;
    return SF_OK;
}

/* The set `caller` uses: the one it took before, else a free one (now its),
 * else none (*out = NULL: the call runs on its own stream).  Makes the sets
 * on the device's first call. */
sf_status pick_set(int device_id, cudaStream_t caller, LaneSet **out)
{
    DeviceLanes &d = g_devices[device_id];
    std::lock_guard<std::mutex> hold(d.lock);
    if (!d.made)
        SF_TRY(make_sets(d));
    for (LaneSet &s : d.sets)
        if (s.owned && s.owner == caller) {
            *out = &s;
            return SF_OK;
        }
    for (LaneSet &s : d.sets)
        if (!s.owned) {
            s.owned = true;
            s.owner = caller;
            *out = &s;
            return SF_OK;
        }
    *out = nullptr;
    return SF_OK;
}

/* The caller's stream waits for lanes [0, n) of `set` (the join). */
cudaError_t join_lanes(LaneSet &set, int n, cudaStream_t caller)
{
    cudaError_t first = cudaSuccess;
    for (int i = 0; i < n; ++i) {
        cudaError_t e = cudaEventRecord(set.join[i], set.streams[i]);
        if (e == cudaSuccess)
            e = cudaStreamWaitEvent(caller, set.join[i], 0);
        if (first == cudaSuccess)
            first = e;
    }
    return first;
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
    if (n == 0) /* (fewer than two fit: none; s46 timed Mixtral-small training FP8 3-11 % faster so) */
        n = fit < SF_GROUPED_AUTO_LANES ? (int)fit : SF_GROUPED_AUTO_LANES;
    n = n < groups ? n : groups;
    if (n < 2)
        return SF_OK;
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("grouped_gemm", device_id, &guard));
    const cudaStream_t caller = sf_cuda_stream(stream);
    LaneSet *set = nullptr;
    sf_status st = pick_set(device_id, caller, &set);
    if (st != SF_OK || set == nullptr) {
        sf_cuda_device_restore(&guard);
        return st; /* (no set left for this stream: lanes->n = 0, the groups run on it) */
    }
    set->lock.lock();
    int waiting = 0; /* lanes that wait on the fork: joined again if a later step fails */
    cudaError_t e = cudaEventRecord(set->fork, caller);
    for (; e == cudaSuccess && waiting < n; ++waiting)
        e = cudaStreamWaitEvent(set->streams[waiting], set->fork, 0);
    if (e != cudaSuccess) {
        join_lanes(*set, waiting, caller);
        set->lock.unlock();
        sf_cuda_device_restore(&guard);
        return lane_error(e, "forking onto the lanes");
    }
    sf_cuda_device_restore(&guard);
    lanes->sm_share = n <= fit ? sms / n : 0;
    lanes->n = n;
    lanes->device_id = device_id;
    lanes->caller = stream;
    lanes->set = set;
    for (int i = 0; i < n; ++i)
        lanes->stream[i] = (sf_stream)set->streams[i];
    return SF_OK;
}

extern "C" sf_status sf_grouped_lanes_close(sf_grouped_lanes *lanes)
{
    if (lanes->n < 2)
        return SF_OK;
    LaneSet *set = (LaneSet *)lanes->set;
    /* every lane is joined, whatever failed before (the caller's stream must
     * not run ahead of any lane's work; record and wait need no current
     * device) */
    const cudaError_t e = join_lanes(*set, lanes->n, sf_cuda_stream(lanes->caller));
    lanes->n = 0;
    lanes->set = NULL;
    set->lock.unlock();
    if (e != cudaSuccess)
        return lane_error(e, "joining the lanes");
    return SF_OK;
}
