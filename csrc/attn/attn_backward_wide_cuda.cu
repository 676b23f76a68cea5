/*
 * attn_backward_wide_cuda.cu - the sm80 backward's main pass at tile widths 64
 * and 128 (attn_backward_tiles.cuh), bf16 and fp16, with and without dropout: a
 * unit of its own, about the size of attn_backward_cuda.cu (which compiles 16
 * and 32), so that a parallel build compiles the two side by side.
 */
#include "attn_backward_tiles.cuh"

namespace sf_attn {
template sf_status launch_backward_tiles<__nv_bfloat16, 64, false>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__nv_bfloat16, 64, true>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__half, 64, false>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__half, 64, true>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__nv_bfloat16, 128, false>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__nv_bfloat16, 128, true>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__half, 128, false>(const sf_attn_problem &p, cudaStream_t stream);
template sf_status launch_backward_tiles<__half, 128, true>(const sf_attn_problem &p, cudaStream_t stream);
} // namespace sf_attn
