/*
 * grouped_cuda.cu - the grouped family's device work beyond sf_gemm: clearing
 * the output rows of a group whose inner dimension is empty, with
 * cudaMemset2DAsync on the caller's stream (no host synchronization, so the
 * grouped GEMM stays capturable in a CUDA graph).
 */
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
