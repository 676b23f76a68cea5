/*
 * norm_fwd_cuda.cu - the LayerNorm / RMSNorm forward kernels for float32,
 * float16 and bfloat16 rows (norm_kernels.cuh), a unit of their own so that
 * a parallel build compiles them beside the backward's (norm_cuda.cuh).
 */
#include "norm_kernels.cuh"

template sf_status sf_norm::launch_fwd<float>(const FwdParams &p, bool vec, int device, cudaStream_t stream);
template sf_status sf_norm::launch_fwd<__half>(const FwdParams &p, bool vec, int device, cudaStream_t stream);
template sf_status sf_norm::launch_fwd<__nv_bfloat16>(const FwdParams &p, bool vec, int device,
                                                      cudaStream_t stream);
