/*
 * seqfuse_quant.h - public C API of the quant family: FP8/FP4 formats: amax, casts, transposes, block scales, scaling state (csrc/quant/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_QUANT_H
#define SEQFUSE_QUANT_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[0] = max |x| over all elements of x, as float32.
 * x: float32, float16 or bfloat16, any shape and strides, any size (an empty
 *    tensor gives 0).
 * out: float32, one element, same device as x.
 * NaN in x propagates to out. Runs on `stream` for CUDA tensors. */
sf_status sf_amax(const sf_tensor *x, sf_tensor *out, sf_stream stream);

/* ---- FP8 with one scale per tensor ------------------------------------
 * The FP8 format (E4M3 or E5M2) is the dtype of the output tensors.
 * Conversions round to nearest even and saturate at the format's max; NaN
 * becomes NaN (0x7f).  See csrc/quant/fp8.h for the exact rules. */

/* Scale, cast and (optionally) transpose in one pass over x.
 *   x:      float32, float16 or bfloat16, contiguous, viewed as [M, K]
 *           (K = last dimension, M = all the others).
 *   scale:  float32, 1 element: q = saturate(x * scale[0]).
 *   amax:   optional float32, 1 element: ACCUMULATES, amax[0] =
 *           max(amax[0], max |x|) (NaN wins).  Zero it first for a fresh max.
 *           A start with its sign bit set (-0.0, a negative value) counts as
 *           0 (fp8.h's sf_amax_fold); an empty x leaves amax as it was.
 *   out:    optional FP8, contiguous: x's number of elements, or [Mp, K]
 *           with Mp >= M rows.
 *   out_t:  optional FP8, contiguous [K, Mp] with Mp >= M: the transposed
 *           copy.
 *           Rows M..Mp-1 of out (columns of out_t) are written as zeros: the
 *           token padding FP8 GEMMs need, made by the cast's own pass
 *           instead of a padded copy of x.  out and out_t agree on Mp.
 *   scale_inv: optional float32, 1 element: receives 1 / scale[0], so the
 *           quantized tensor carries the inverse of the scale it was made
 *           with even after the scale moves on.
 * At least one of out, out_t.  The fast CUDA path takes K % 8 == 0,
 * Mp % 16 == 0 (when out_t is given) and 16-byte aligned pointers; other
 * shapes run a plain per-element kernel (correct, slower). */
sf_status sf_cast_fp8(const sf_tensor *x, const sf_tensor *scale, sf_tensor *amax,
                      sf_tensor *out, sf_tensor *out_t, sf_tensor *scale_inv,
                      sf_stream stream);

/* sf_cast_fp8 with out_t required, plus x's column sums per block of 128
 * rows: col_sums float32 [ceil(Mp / 128), K], row b holding the sums of rows
 * 128b .. 128b+127 (padding rows count as zeros; the bias gradient, once
 * the rows are added, when x is an output gradient: the cast's read of x
 * serves both).  Summed in float32 in the CUDA kernel's fixed order, which
 * the CPU backend repeats: the two agree bit for bit.  Needs K % 8 == 0,
 * Mp % 16 == 0 and, on CUDA, 16-byte aligned x and out_t and an 8-byte
 * aligned out (when given).  dbias (optional): col_sums' total as
 * sf_column_sums writes it, in the same call (the bias gradient: one C call
 * for the cast and the sum, two launches on CUDA). */
sf_status sf_cast_fp8_dbias(const sf_tensor *x, const sf_tensor *scale, sf_tensor *amax,
                            sf_tensor *out, sf_tensor *out_t, sf_tensor *scale_inv,
                            sf_tensor *col_sums, sf_tensor *dbias, sf_stream stream);

/* A bias gradient from a cast's per-block column sums: out[j] = the sum
 * over p of col_sums[p][j] (col_sums float32 [P, N], contiguous; out [N]
 * in float32, bfloat16 or float16, rounded once).  The adds run in a fixed
 * order, both backends: s_i = col_sums[i][j] + col_sums[i+8][j] + ... left
 * to right for i = 0..7, then s_0 + s_1 + ... + s_7 left to right.  What
 * the FP8 modules' backward runs after sf_cast_fp8_dbias or
 * sf_quantize_block_fp8_rowcol (a sum and a dtype conversion in one launch). */
sf_status sf_column_sums(const sf_tensor *col_sums, sf_tensor *out, sf_stream stream);

/* Current scaling of x and its cast in one call: amax[0] = max |x| (written,
 * not accumulated), scale[0] = fp8_max / amax / 2^margin (1 where amax is 0
 * or not finite; fp8_max of the outputs' format), scale_inv[0] = 1 / scale,
 * then out / out_t as sf_cast_fp8 makes them (Mp padding rows included).
 * The result is sf_amax, sf_fp8_compute_scale and sf_cast_fp8 in turn, bit
 * for bit (the CPU backend runs exactly that).  On CUDA, where the tiled
 * cast+transpose takes the shapes (out_t given, K % 8 == 0, Mp % 16 == 0,
 * M > 0, 16-byte aligned x and out_t, 8-byte aligned out), it is one
 * cooperative launch: every block folds its part of max |x|, the blocks meet
 * at a grid barrier, each derives the scale, and they cast their tiles;
 * other shapes run the three kernels (three launches, same results).
 * amax, scale, scale_inv: float32, 1 element each, on x's device.
 * col_sums (optional, with out_t) and dbias (optional, with col_sums): the
 * per-block column sums of sf_cast_fp8_dbias and their total, made by the
 * three kernels' cast pass and one sum launch (a bias gradient under
 * current scaling in one call: amax, scale, cast+sums, total). */
sf_status sf_cast_fp8_current(const sf_tensor *x, sf_tensor *amax, sf_tensor *scale,
                              sf_tensor *scale_inv, sf_tensor *out, sf_tensor *out_t,
                              sf_tensor *col_sums, sf_tensor *dbias, int margin,
                              sf_stream stream);

/* The FP8 casts of a mixture-of-experts layer's expert-sorted tokens, every
 * expert with its own scale, in one call (CUDA: one launch under delayed
 * scaling, three under current scaling, for up to 64 experts at a time).
 * x [M, K] (K % 16 == 0; 16-byte aligned on CUDA) holds G runs of rows,
 * m_splits (a CPU int64 tensor of G >= 1 counts adding up to M) their
 * lengths.  Group g's rows go to its own block of padded rows of out
 * [Mp, K] and of the columns of out_t [K, Mp] (either may be NULL, not
 * both; same FP8 dtype), each run padded with zero rows to a multiple of
 * row_multiple (a multiple of 16; Mp = the padded runs' sum).  scale,
 * amax, scale_inv: float32 vectors of G elements with any element stride
 * (a ScalingState's slots of one role).  current = 0 (delayed scaling):
 * scale is read, max |x_g| folded into amax[g] when amax is given.
 * current = 1: amax[g] = max |x_g| and scale[g] (fp8.h's
 * sf_scale_from_amax with the format's maximum and 2^-margin) are
 * written first.  Both: scale_inv[g] = 1 / scale[g].  Each group's
 * results equal sf_cast_fp8 (sf_cast_fp8_current) of its rows alone. */
sf_status sf_cast_fp8_grouped(const sf_tensor *x, const sf_tensor *m_splits, int row_multiple,
                              sf_tensor *scale, sf_tensor *amax, sf_tensor *out, sf_tensor *out_t,
                              sf_tensor *scale_inv, int current, int margin, sf_stream stream);

/* sf_cast_fp8_grouped of a mixture-of-experts SwiGLU's output, computed in
 * the same pass: x [M, 2K] holds each row's gate (columns 0..K-1) and up
 * (K..2K-1) values, probs [M] (float32/16 or bf16; NULL: 1) the routing
 * weight of each row, and the value cast is silu(gate) * up * probs rounded
 * to x's dtype, bit for bit sf_moe_swiglu_forward's output; everything else
 * (groups, padding, outputs, scaling) as sf_cast_fp8_grouped with that
 * output as x.  The SwiGLU output itself is never written: the down
 * projection's FP8 input comes straight from the gate-up GEMM's output. */
sf_status sf_swiglu_cast_fp8_grouped(const sf_tensor *x, const sf_tensor *probs, const sf_tensor *m_splits,
                                     int row_multiple, sf_tensor *scale, sf_tensor *amax, sf_tensor *out,
                                     sf_tensor *out_t, sf_tensor *scale_inv, int current, int margin,
                                     sf_stream stream);

/* The SwiGLU's backward of a mixture-of-experts MLP's down projection
 * under FP8, with that projection's weight-gradient operand, in one pass
 * over the saved gate|up pairs x [M, 2K] (probs [M] or NULL, m_splits as
 * sf_swiglu_cast_fp8_grouped's).  dout: the SwiGLU output's gradient,
 * [M, K] or [Mp, K] where each group's rows lie in its block padded to
 * row_multiple (as the grouped GEMM writes them; padding rows are not
 * read), x's dtype.  Writes dx [M, 2K] and dprobs [M] (or NULL; needs
 * probs) as sf_moe_swiglu_backward does, and, where out_t, scale and
 * scale_inv are given (all or none), out_t [K, Mp] and scale_inv as
 * sf_swiglu_cast_fp8_grouped with delayed scaling and no amax (the
 * forward's scales: the same bytes as a transposed copy made then).
 * dprobs sums each row in its own order: within float rounding of the
 * CPU reference's.  Where grad_scale, grad_scale_inv and grad_out [Mp, 2K]
 * and/or grad_out_t [2K, Mp] are given (grad_amax optional), dx is also
 * cast for the gate-up layer's backward as sf_cast_fp8_grouped(dx, ...)
 * casts it under delayed scaling (its FP8 copies, max |dx_g| folded into
 * grad_amax[g], grad_scale_inv = 1 / grad_scale), bit for bit.  dx NULL:
 * dx is not written (a caller that wants its FP8 copies alone, or dprobs
 * alone; on the CPU it is computed into a scratch buffer). */
sf_status sf_swiglu_backward_cast_fp8_grouped(const sf_tensor *dout, const sf_tensor *x, const sf_tensor *probs,
                                              const sf_tensor *m_splits, int row_multiple, sf_tensor *dx,
                                              sf_tensor *dprobs, sf_tensor *scale, sf_tensor *out_t,
                                              sf_tensor *scale_inv, sf_tensor *grad_scale, sf_tensor *grad_amax,
                                              sf_tensor *grad_out, sf_tensor *grad_out_t, sf_tensor *grad_scale_inv,
                                              sf_stream stream);

/* The delayed-scaling grouped cast with the groups' ends on the device (a
 * mixture-of-experts layer whose routing counts never reach the host):
 * x [M, K] (or, swiglu = 1, [M, 2K] gate|up pairs and probs [M] or NULL,
 * the value cast being sf_swiglu_cast_fp8_grouped's), row_end int32 [G]
 * (1 <= G <= 64; group g is rows [end_{g-1}, end_g) with each end clamped
 * to [the previous end, M], read by the kernel itself).  Each row of a
 * group is cast with scale[g] into the same row of out [M, K] (no padding;
 * rows past the last end are written as zeros); max |x_g| is folded into
 * amax[g] when amax is given, and scale_inv[g] = 1 / scale[g] for every
 * group.  scale, amax, scale_inv: float32 vectors of G elements, any
 * element stride.  Each group's rows are bit for bit those of
 * sf_cast_fp8_grouped (sf_swiglu_cast_fp8_grouped) of that group. */
sf_status sf_cast_fp8_grouped_ends(const sf_tensor *x, const sf_tensor *probs, int swiglu, const sf_tensor *row_end,
                                   sf_tensor *scale, sf_tensor *amax, sf_tensor *out, sf_tensor *scale_inv,
                                   sf_stream stream);

/* Current scaling of each of n tensors (a grouped layer's weights) in one
 * call: x[g] [N_g, K] (contiguous, one dtype, K and every N_g multiples of
 * 16, 16-byte aligned on CUDA) is cast with its own amax into out[g]
 * [N_g, K] and out_t[g] [K, N_g] (either list may be NULL, not both; one
 * FP8 dtype).  amax[g] = max |x_g|, scale[g] and scale_inv[g] as
 * sf_cast_fp8_grouped's current scaling; float32 vectors of n elements, any
 * element stride.  Each tensor's results equal sf_cast_fp8_current's. */
sf_status sf_cast_fp8_current_list(int64_t n, const sf_tensor *x, int64_t n_out, sf_tensor *out,
                                   int64_t n_out_t, sf_tensor *out_t, sf_tensor *scale,
                                   sf_tensor *amax, sf_tensor *scale_inv, int margin,
                                   sf_stream stream);

/* sf_cast_fp8_current_list of the G matrices of one stacked tensor: w
 * [G, N, K] contiguous, out [G, N, K] and out_t [G, K, N] contiguous (either
 * NULL, not both), matrix g cast as the list's tensor g (the same checks,
 * bytes and scales): a device-split grouped layer's weights in one call
 * without a tensor per expert crossing the binding. */
sf_status sf_cast_fp8_current_stacked(const sf_tensor *w, sf_tensor *out, sf_tensor *out_t, sf_tensor *scale,
                                      sf_tensor *amax, sf_tensor *scale_inv, int margin, sf_stream stream);

/* out_t = data^T: data an FP8 tensor viewed as [M, K] (K its last
 * dimension, contiguous), out_t [K, M] contiguous with data's dtype.  The
 * bytes move unchanged (same scale).  Under delayed scaling the norm and
 * activation kernels write their FP8 outputs row-wise only; the weight
 * gradient's K-major operand is this transpose, made in the backward.  The
 * fast CUDA path takes K % 16 == 0, M % 16 == 0 and 16-byte aligned
 * pointers; other shapes run a per-element kernel (correct, slower). */
sf_status sf_transpose_fp8(const sf_tensor *data, sf_tensor *out_t, sf_stream stream);

/* out = float(data) * scale_inv[0], out float32/float16/bfloat16 with the
 * shape of data (contiguous both). */
sf_status sf_dequantize_fp8(const sf_tensor *data, const sf_tensor *scale_inv,
                            sf_tensor *out, sf_stream stream);

/* The delayed-scaling update of every tensor of a step, in one launch.
 *   amax_history: float32 [H, N], row stride >= N, unit column stride.
 *                 Row 0 holds the amaxes accumulated this step.
 *   scale, scale_inv: float32 [N] contiguous, updated in place.
 *   fp8_max:      float32 [N]: 448 or 57344 per tensor.
 *   algo:         0 = max over the H rows, 1 = most_recent (row 0).
 *   margin:       scale = fp8_max / amax / 2^margin.
 * Per column: a = algo(history); scale = a finite and > 0 ? that : the old
 * scale (an infinite result becomes FLT_MAX); scale_inv = 1 / scale; then
 * the history rolls as Transformer Engine rolls it: torch.roll(history, -1,
 * 0) followed by row 0 = 0.  Row 0 is then ready to accumulate the next
 * step, and rows 1..H-1 keep the last H-1 steps (the oldest drops out). */
sf_status sf_fp8_scale_update(sf_tensor *amax_history, sf_tensor *scale,
                              sf_tensor *scale_inv, const sf_tensor *fp8_max,
                              int algo, int margin, sf_stream stream);

/* Current scaling: scale[i] = fp8_max / amax[i] / 2^margin (1 where amax is 0
 * or not finite), scale_inv[i] = 1 / scale[i].  All float32 [N]. */
sf_status sf_fp8_compute_scale(const sf_tensor *amax, sf_tensor *scale,
                               sf_tensor *scale_inv, float fp8_max, int margin,
                               sf_stream stream);

/* ---- block-scaled formats -----------------------------------------------
 * x is float32/float16/bfloat16, contiguous, viewed as [M, K]; blocks run
 * along K.  A dimension that is not a multiple the format needs is a
 * ValueError naming the multiple. */

/* FP8 with fp32 block scales for cuBLASLt's block-scaled GEMMs on Hopper.
 *   block_rows = 1:   1x128 blocks (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F),
 *     scale_inv float32 [K/128, round_up(M, 4)]: element [kb, m] belongs to
 *     x[m, 128 kb : 128 kb + 128]; M runs fastest (outer-dimension-major) and
 *     is padded to a multiple of 4 (16 bytes); padding is written as 0.
 *   block_rows = 128: 128x128 blocks (..._BLK128x128_32F),
 *     scale_inv float32 [ceil(M/128), round_up(K/128, 4)]: element [mb, kb]
 *     belongs to the block x[128 mb :, 128 kb :]; padding written as 0.
 * K must be a multiple of 128; M is any (the last row block may be partial).
 * Where the layout comes from: cuBLASLt's docs name the modes but the stored
 * copies we could search did not show their layout text; torch's scaled_mm
 * tests transpose 1x128 scales to "outer-dim-major" ([M, K/128] with strides
 * (1, M)), and public block-FP8 GEMM code calling cuBLASLt notes it "wants
 * the activation scales token-major with the token count a multiple of 4 and
 * the weight's K blocks padded to a multiple of 4" -- the two shapes above.
 * Not yet run through a cuBLASLt block-scaled GEMM here: confirm on the GPU.
 * seqfuse.ops.gemm currently checks 1x128 scales as [K/128, M] unpadded:
 * the same tensor whenever M % 4 == 0.
 * q = saturate(x * s) with s = fp8_max / block_amax (1 for an all-zero
 * block), scale_inv = 1 / s; dequantization is q * scale_inv. */
sf_status sf_quantize_block_fp8(const sf_tensor *x, sf_tensor *out,
                                sf_tensor *scale_inv, int block_rows,
                                sf_stream stream);
sf_status sf_dequantize_block_fp8(const sf_tensor *data, const sf_tensor *scale_inv,
                                  int block_rows, sf_tensor *out, sf_stream stream);

/* A weight's two block-scaled FP8 operands in one call: w [M, K] (M and K
 * multiples of 128) in 128x128 blocks as sf_quantize_block_fp8 with
 * block_rows = 128 (out FP8 [M, K], scale_inv [M/128, round_up(K/128, 4)]),
 * and its transpose, the input-gradient GEMM's operand: out_t FP8 [K, M]
 * (16-byte aligned, out's dtype) holding out's bytes transposed and
 * scale_inv_t float32 [K/128, round_up(M/128, 4)] holding scale_inv's real
 * entries transposed, its padding 0.  A 128x128 block of w^T is a block of
 * w, so these are bit for bit what quantizing w^T would give, for a byte
 * transpose instead of a second quantization.  No two of the tensors may
 * overlap. */
sf_status sf_quantize_block_fp8_weight(const sf_tensor *w, sf_tensor *out, sf_tensor *scale_inv,
                                       sf_tensor *out_t, sf_tensor *scale_inv_t, sf_stream stream);

/* The transposed operand from a 128x128-block FP8 weight's own, as the last
 * steps of sf_quantize_block_fp8_weight: data FP8 [M, K] (M, K multiples
 * of 128, 16-byte aligned) with its scale_inv [M/128, round_up(K/128, 4)]
 * -> out_t [K, M] (data's bytes transposed, data's dtype) and scale_inv_t
 * [K/128, round_up(M/128, 4)] (the real scales transposed, padding 0).  For
 * a weight whose transposed copy was not kept (or arrived in FP8 from an
 * all-gather).  No two of the tensors may overlap. */
sf_status sf_block_transpose_fp8(const sf_tensor *data, const sf_tensor *scale_inv, sf_tensor *out_t,
                                 sf_tensor *scale_inv_t, sf_stream stream);

/* FP8 with one fp32 scale per row: x [M, K] (K % 16 == 0, 16-byte aligned),
 * out FP8 [M, K] (16-byte aligned), scale_inv float32 [M] (contiguous).
 * Row r is one 1 x K block: s = fp8_max / max|x[r, :]| (1 for an all-zero
 * or non-finite amax), out[r, :] = saturate(x[r, :] * s), scale_inv[r] = 1 / s.
 * The row-wise scaled operands of torch._scaled_grouped_mm (the device-split
 * FP8 grouped GEMM): every row scaled along the contraction dimension, from
 * its own amax, with no host involvement (CUDA: one read of x for rows of up
 * to 8,192 values, two passes over each row beyond). */
sf_status sf_quantize_rowwise_fp8(const sf_tensor *x, sf_tensor *out, sf_tensor *scale_inv,
                                  sf_stream stream);

/* 1x128 blocks of x [M, K] along both dimensions in one pass: the row-wise
 * copy (out, scale_inv as sf_quantize_block_fp8 with block_rows = 1) and the
 * column-wise copy out_t [K, Mt] = the transposed matrix in 1x128 blocks
 * along M, Mt = round_up(M, 128), zero past column M, with scale_inv_t
 * float32 [Mt/128, round_up(K, 4)] in the same layout (element [mb, k]
 * belongs to x[128 mb : min(128 mb + 128, M), k]).  Either pair may be NULL
 * (not both).  K must be a multiple of 128, x 16-byte aligned; M is any.
 * What Float8BlockScaling's weight-gradient GEMMs take for activations and
 * gradients (the zero padding makes their k a whole number of blocks).
 * col_sums (optional, with out_t): float32 [Mt/128, K], the sum of each
 * column over each 128-row block -- a bias gradient is col_sums summed over
 * its rows, without another pass over x.  The order of the float32 adds is
 * fixed (both backends): with rows r = 128 mb + g + 16 i (g = 0..15,
 * i = 0..7; rows past M read as 0), s_g = x[g] + x[g+16] + ... + x[g+112]
 * left to right, p_w = s_2w + s_2w+1, col_sums = p_0 + p_1 + ... + p_7 left
 * to right.  dbias (optional, with col_sums): their total as sf_column_sums
 * writes it, in the same call. */
sf_status sf_quantize_block_fp8_rowcol(const sf_tensor *x, sf_tensor *out, sf_tensor *scale_inv,
                                       sf_tensor *out_t, sf_tensor *scale_inv_t,
                                       sf_tensor *col_sums, sf_tensor *dbias, sf_stream stream);

/* MXFP8: 1x32 blocks along K with E8M0 scales, K % 32 == 0.
 *   out: FP8 [M, K]; scales: float8_e8m0fnu or uint8 [M, K/32], row-major
 *   (the plain layout; Blackwell GEMMs want it swizzled into 128x4 tiles).
 * scale = 2^ceil(log2(block_amax / fp8_max)), so nothing saturates;
 * q = saturate(x / scale) computed as x * 2^-e exactly. */
sf_status sf_quantize_mxfp8(const sf_tensor *x, sf_tensor *out, sf_tensor *scales,
                            sf_stream stream);
sf_status sf_dequantize_mxfp8(const sf_tensor *data, const sf_tensor *scales,
                              sf_tensor *out, sf_stream stream);

/* NVFP4: 16-element blocks along K of E2M1 values (two per byte, the first
 * in the low nibble), an E4M3 scale per block and one fp32 scale per tensor.
 * K % 16 == 0.
 *   amax: float32, 1 element: max |x| of the whole tensor (sf_amax).
 *   out: uint8 [M, K/2]; block_scales: float8_e4m3fn or uint8 [M, K/16];
 *   global_scale_inv: float32, 1 element, receives 1 / S with
 *   S = 448 * 6 / amax (S = 1 where amax is 0 or not finite).
 * Per block: d = e4m3(block_amax / 6 * S); q = e2m1(x * (S / d)) (0 where
 * d is 0).  Dequantization: e2m1 * d * global_scale_inv. */
sf_status sf_quantize_nvfp4(const sf_tensor *x, const sf_tensor *amax, sf_tensor *out,
                            sf_tensor *block_scales, sf_tensor *global_scale_inv,
                            sf_stream stream);
sf_status sf_dequantize_nvfp4(const sf_tensor *data, const sf_tensor *block_scales,
                              const sf_tensor *global_scale_inv, sf_tensor *out,
                              sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_QUANT_H */
