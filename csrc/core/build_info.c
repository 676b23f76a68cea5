/*
 * build_info.c - what was compiled in and what the machine offers now.
 *
 * Compiled in both builds.  With SF_WITH_CUDA it asks the CUDA runtime; the
 * runtime is linked statically, so importing seqfuse on a machine with no
 * driver works and simply reports zero devices.
 */
#include "seqfuse.h"

#ifdef SF_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

int sf_built_with_cuda(void)
{
#ifdef SF_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

int sf_cuda_device_count(void)
{
#ifdef SF_WITH_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
#else
    return 0;
#endif
}

sf_status sf_cuda_capability(int device_id, int *capability)
{
#ifdef SF_WITH_CUDA
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id) != cudaSuccess) {
        cudaError_t e = cudaGetLastError();
        return sf_fail(SF_ERR_RUNTIME, "cuda_capability: device %d: %s", device_id,
                       cudaGetErrorString(e));
    }
    *capability = major * 10 + minor;
    return SF_OK;
#else
    (void)device_id;
    *capability = 0;
    return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                   "cuda_capability: seqfuse was built without CUDA");
#endif
}

int sf_cuda_runtime_version(void)
{
#ifdef SF_WITH_CUDA
    return CUDART_VERSION;
#else
    return 0;
#endif
}

int sf_cuda_driver_version(void)
{
#ifdef SF_WITH_CUDA
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess)
        return 0;
    return v;
#else
    return 0;
#endif
}

size_t sf_cublaslt_version(void)
{
#ifdef SF_WITH_CUDA
    return cublasLtGetVersion();
#else
    return 0;
#endif
}

int sf_nccl_version(void)
{
#ifdef SF_WITH_CUDA
    /* The header we compiled against (the library does not link NCCL; torch's
     * process groups own the communicators). */
    return NCCL_VERSION_CODE;
#else
    return 0;
#endif
}
