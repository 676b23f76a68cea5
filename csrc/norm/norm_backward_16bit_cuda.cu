/*
 * norm_backward_16bit_cuda.cu - the LayerNorm / RMSNorm backward kernels for
 * float16 and bfloat16 rows (norm_kernels.cuh): a unit of their own, about
 * the size of norm_cuda.cu, so that a parallel build compiles the two side
 * by side.
 */
#include "norm_kernels.cuh"

template sf_status sf_norm::launch_backward<__half>(const BackwardParams &p, const Config &c, bool vec, int device,
                                               int64_t bound, cudaStream_t stream, int64_t *grid);
template sf_status sf_norm::launch_backward<__nv_bfloat16>(const BackwardParams &p, const Config &c, bool vec, int device,
                                                      int64_t bound, cudaStream_t stream, int64_t *grid);
