/*
 * norm_bwd_fp32_cuda.cu - the LayerNorm / RMSNorm backward kernels for
 * float32 rows (norm_kernels.cuh), a unit of their own so that a parallel
 * build compiles the dtypes side by side (norm_cuda.cuh).
 */
#include "norm_kernels.cuh"

template sf_status sf_norm::launch_bwd<float>(const BwdParams &p, const Config &c, bool vec, int device,
                                            int64_t bound, cudaStream_t stream, int64_t *grid);
