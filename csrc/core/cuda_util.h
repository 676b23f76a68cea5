/*
 * cuda_util.h - what every *_cuda.cu file needs: checked CUDA calls that turn
 * errors into sf_status with CUDA's own error text, a device guard that runs a
 * launch on the tensor's device and restores the caller's, and the launch-error
 * check that must follow every kernel launch.
 *
 * Only CUDA translation units include this header.
 */
#ifndef SF_CUDA_UTIL_H
#define SF_CUDA_UTIL_H

#include <atomic>
#include <string.h> /* memset: sf_sm90_kernel_fit */
#include <cuda_runtime.h>

#include "seqfuse.h"

#define SF_CUDA_TRY(op, call)                                                  \
    do {                                                                       \
        cudaError_t sf_err_ = (call);                                          \
        if (sf_err_ != cudaSuccess)                                            \
            return sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s (%s)", (op),    \
                           cudaGetErrorName(sf_err_), cudaGetErrorString(sf_err_), \
                           #call);                                             \
    } while (0)

/* After a <<<...>>> launch: reports bad launch configurations at once. */
#define SF_CUDA_CHECK_LAUNCH(op) SF_CUDA_TRY(op, cudaGetLastError())

/* For launches whose function must still restore the device before it
 * returns (so SF_CUDA_CHECK_LAUNCH's early return does not fit): reads and
 * clears the launch error, and gives st when it already failed, else the
 * launch error as "<op>: CUDA error <name>: <text>", else SF_OK. */
static inline sf_status sf_cuda_launch_status(const char *op, sf_status st)
{
    const cudaError_t e = cudaGetLastError();
    if (st != SF_OK || e == cudaSuccess)
        return st;
    return sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s", op, cudaGetErrorName(e),
                   cudaGetErrorString(e));
}

/* Switch to `device` for the duration of a call; restore with
 * sf_cuda_device_restore.  Costs one cudaGetDevice when already there. */
typedef struct {
    int previous;
    int switched;
} sf_cuda_device_guard;

static inline sf_status sf_cuda_device_enter(const char *op, int device,
                                             sf_cuda_device_guard *g)
{
    g->switched = 0;
    SF_CUDA_TRY(op, cudaGetDevice(&g->previous));
    if (g->previous != device) {
        SF_CUDA_TRY(op, cudaSetDevice(device));
        g->switched = 1;
    }
    return SF_OK;
}

static inline void sf_cuda_device_restore(sf_cuda_device_guard *g)
{
    if (g->switched)
        cudaSetDevice(g->previous);
}

static inline cudaStream_t sf_cuda_stream(sf_stream s) { return (cudaStream_t)s; }

/* A device attribute asked once per device and cached (launch sizing runs on
 * every call; the attribute query is not free).  The cache is read and
 * written from any host thread: one atomic int per device and attribute
 * holding the answer plus one, 0 until known (every answer is kept, a 0 of a
 * yes/no attribute too; a failed query is not: asked again next time). */
template <cudaDeviceAttr A>
static inline cudaError_t sf_cuda_query_attribute(int device, int *value)
{
    static std::atomic<int> cached[64];
    const bool cacheable = device >= 0 && device < 64;
    if (cacheable) {
        const int n = cached[device].load(std::memory_order_relaxed);
        if (n > 0) {
            *value = n - 1;
            return cudaSuccess;
        }
    }
    const cudaError_t e = cudaDeviceGetAttribute(value, A, device);
    if (e == cudaSuccess && cacheable && *value >= 0)
        cached[device].store(*value + 1, std::memory_order_relaxed);
    return e;
}

/* Multiprocessor count of a device (cached). */
static inline cudaError_t sf_cuda_query_sm_count(int device, int *sms)
{
    return sf_cuda_query_attribute<cudaDevAttrMultiProcessorCount>(device, sms);
}

/* The same, 132 (an H100 / H200) when the device cannot be asked. */
static inline int sf_cuda_sm_count(int device)
{
    int n = 0;
    if (device < 0 || device >= 64 || sf_cuda_query_sm_count(device, &n) != cudaSuccess || n <= 0)
        return 132;
    return n;
}

/* The most shared memory a block may opt in to, in bytes (cached). */
static inline cudaError_t sf_cuda_query_smem_optin(int device, int *bytes)
{
    return sf_cuda_query_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, bytes);
}

/* Blocks for a grid-stride loop over n items: enough to fill the GPU a few
 * times over, never more than the work needs. */
static inline int sf_grid_size(int64_t n, int block, int max_blocks)
{
    int64_t blocks = (n + block - 1) / block;
    if (blocks < 1)
        blocks = 1;
    return (int)(blocks < max_blocks ? blocks : max_blocks);
}

#ifdef __CUDACC__
/* The body of a wgmma (sm_90a) kernel in a build without sm_90a: the host
 * never launches it, and tells by this marker, the kernel's static shared
 * size (cudaFuncGetAttributes' sharedSizeBytes, 0 for the real kernels,
 * whose shared memory is all dynamic); launched anyway, it traps. */
#define SF_SM90_NOT_BUILT()                                                                            \
    do {                                                                                               \
        __shared__ volatile int not_built_for_sm90a[32];                                               \
        not_built_for_sm90a[threadIdx.x & 31] = 1;                                                     \
        __trap();                                                                                      \
    } while (0)
#endif

/* Whether the wgmma (sm_90a) kernel `kernel` runs on `device`: its compute
 * capability is 9.0 and the kernel was built for sm_90a (SF_SM90_NOT_BUILT's
 * marker absent; the kernel's attributes are those of the current device, so
 * `device` is made current for the question and the previous one restored).
 * Asks the device: callers cache the answer per device. */
typedef enum {
    SF_SM90_RUNS,
    SF_SM90_NO_DEVICE, /* `device` could not be made current */
    SF_SM90_CC_UNREADABLE,
    SF_SM90_NOT_HOPPER,
    SF_SM90_NOT_BUILT_FOR
} sf_sm90_fit;

static inline sf_sm90_fit sf_sm90_kernel_fit(int device, const void *kernel)
{
    sf_cuda_device_guard guard;
    if (sf_cuda_device_enter("sm90 kernel check", device, &guard) != SF_OK)
        return SF_SM90_NO_DEVICE;
    sf_sm90_fit fit = SF_SM90_RUNS;
    int major = 0, minor = 0;
    cudaFuncAttributes fa;
    memset(&fa, 0, sizeof fa);
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        (void)cudaGetLastError();
        fit = SF_SM90_CC_UNREADABLE;
    } else if (major != 9 || minor != 0) {
        fit = SF_SM90_NOT_HOPPER;
    } else if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess || fa.sharedSizeBytes != 0) {
        (void)cudaGetLastError();
        fit = SF_SM90_NOT_BUILT_FOR;
    }
    sf_cuda_device_restore(&guard);
    return fit;
}

#endif /* SF_CUDA_UTIL_H */
