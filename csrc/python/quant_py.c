/*
 * quant_py.c - bindings of the quant family (csrc/quant/): amax, the FP8
 * casts, dequantization, the scaling-state updates and the block formats.
 * Optional outputs are passed as None; seqfuse.ops.quant is the friendly
 * layer above.  One SF_PY_OP line per binding (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(amax, sf_amax, "out[0] = max |x| (float32).", (T, x), (T, out));
SF_PY_OP(cast_fp8, sf_cast_fp8,
         "Scale, cast to the FP8 dtype of out/out_t, transpose into out_t, accumulate max|x| into "
         "amax.",
         (T, x), (T, scale), (OT, amax), (OT, out), (OT, out_t), (OT, scale_inv));
SF_PY_OP(column_sums, sf_column_sums,
         "out[j] = sum over p of col_sums[p][j] in a fixed order, rounded once to out's dtype (the "
         "bias gradient from a cast's per-block column sums).",
         (T, col_sums), (T, out));
SF_PY_OP(cast_fp8_grouped, sf_cast_fp8_grouped,
         "The per-expert casts of expert-sorted rows in one call: group g of x (m_splits, a CPU "
         "int64 tensor) with scale[g] into its padded block of out / out_t.",
         (T, x), (T, m_splits), (INT, row_multiple), (T, scale), (OT, amax), (OT, out), (OT, out_t),
         (T, scale_inv), (INT, current), (INT, margin));
SF_PY_OP(swiglu_cast_fp8_grouped, sf_swiglu_cast_fp8_grouped,
         "cast_fp8_grouped of silu(x[:, :K]) * x[:, K:] * probs[:, None] (a mixture-of-experts "
         "SwiGLU's output), computed in the same pass and never written in x's dtype.",
         (T, x), (OT, probs), (T, m_splits), (INT, row_multiple), (T, scale), (OT, amax), (OT, out),
         (OT, out_t), (T, scale_inv), (INT, current), (INT, margin));
SF_PY_OP(swiglu_backward_cast_fp8_grouped, sf_swiglu_backward_cast_fp8_grouped,
         "The SwiGLU's backward over the saved gate|up pairs x, dout in the grouped GEMM's padded row "
         "blocks (or the real rows), into dx and dprobs, with the SwiGLU value's transposed FP8 copy "
         "cast with the forward's scales into out_t (or none), and dx's own FP8 copies for the gate-up "
         "layer (or none), in the same pass; dx None: dx is not written (its FP8 copies are).",
         (T, dout), (T, x), (OT, probs), (T, m_splits), (INT, row_multiple), (OT, dx), (OT, dprobs),
         (OT, scale), (OT, out_t), (OT, scale_inv), (OT, grad_scale), (OT, grad_amax), (OT, grad_out),
         (OT, grad_out_t), (OT, grad_scale_inv));
SF_PY_OP(cast_fp8_grouped_ends, sf_cast_fp8_grouped_ends,
         "The delayed-scaling grouped cast with the groups' end rows in an int32 tensor on the device: "
         "each row of x cast in place with its group's scale[g] (swiglu=1: of the SwiGLU of its gate|up "
         "pair times probs).",
         (T, x), (OT, probs), (INT, swiglu), (T, row_end), (T, scale), (OT, amax), (T, out), (T, scale_inv));
SF_PY_OP(cast_fp8_current_list, sf_cast_fp8_current_list,
         "Current scaling of each tensor of a list (a grouped layer's weights) in one call.",
         (TL, xs), (OTL, out), (OTL, out_t), (T, scale), (T, amax), (T, scale_inv), (INT, margin));
SF_PY_OP(cast_fp8_current_stacked, sf_cast_fp8_current_stacked,
         "cast_fp8_current_list of the matrices of one [G, N, K] tensor into [G, N, K] / [G, K, N] copies.",
         (T, w), (OT, out), (OT, out_t), (T, scale), (T, amax), (T, scale_inv), (INT, margin));
SF_PY_OP(transpose_fp8, sf_transpose_fp8, "out_t = data viewed as [M, K], transposed (FP8 bytes).",
         (T, data), (T, out_t));
SF_PY_OP(dequantize_fp8, sf_dequantize_fp8, "out = data * scale_inv[0].", (T, data),
         (T, scale_inv), (T, out));
SF_PY_OP(fp8_scale_update, sf_fp8_scale_update,
         "The delayed-scaling update of every column in one launch.", (T, amax_history),
         (T, scale), (T, scale_inv), (T, fp8_max), (INT, algo), (INT, margin));
SF_PY_OP(fp8_compute_scale, sf_fp8_compute_scale, "Current scaling.", (T, amax), (T, scale),
         (T, scale_inv), (FLOAT, fp8_max), (INT, margin));
SF_PY_OP(quantize_block_fp8, sf_quantize_block_fp8, "1x128 / 128x128 blocks.", (T, x), (T, out),
         (T, scale_inv), (INT, block_rows));
SF_PY_OP(quantize_rowwise_fp8, sf_quantize_rowwise_fp8, "One scale per row (its own amax).", (T, x),
         (T, out), (T, scale_inv));
SF_PY_OP(quantize_block_fp8_weight, sf_quantize_block_fp8_weight,
         "A weight's 128x128-block FP8 operands in one call: w and w transposed (bytes and scales).",
         (T, w), (T, out), (T, scale_inv), (T, out_t), (T, scale_inv_t));
SF_PY_OP(block_transpose_fp8, sf_block_transpose_fp8,
         "W^T's 128x128-block operand (bytes and scales) from W's.", (T, data), (T, scale_inv), (T, out_t),
         (T, scale_inv_t));
SF_PY_OP(dequantize_block_fp8, sf_dequantize_block_fp8, "out = data times its block scales.",
         (T, data), (T, scale_inv), (INT, block_rows), (T, out));
SF_PY_OP(quantize_mxfp8, sf_quantize_mxfp8, "1x32 blocks, E8M0 scales.", (T, x), (T, out),
         (T, scales));
SF_PY_OP(dequantize_mxfp8, sf_dequantize_mxfp8, "out = data times its E8M0 block scales.",
         (T, data), (T, scales), (T, out));
SF_PY_OP(quantize_nvfp4, sf_quantize_nvfp4, "1x16 blocks of FP4 with E4M3 scales.", (T, x),
         (T, amax), (T, out), (T, block_scales), (T, global_scale_inv));
SF_PY_OP(dequantize_nvfp4, sf_dequantize_nvfp4, "out = data times its two-level scales.",
         (T, data), (T, block_scales), (T, global_scale_inv), (T, out));

/* The optional outputs added to an entry after its first form follow the
 * stream argument (so they are written out by keyword): calls that pass the
 * stream positionally keep their meaning. */
static const sf_py_arg dbias_args[] = {SF_T(x),       SF_T(scale),    SF_OT(amax),
                                       SF_OT(out),    SF_T(out_t),    SF_OT(scale_inv),
                                       SF_T(col_sums), SF_STREAM,     SF_OT_NONE(dbias)};
static sf_status dbias_cast(sf_py_value *v, sf_stream s)
{
    return sf_cast_fp8_dbias(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].t, v[8].t, s);
}
SF_PY_BINDING(cast_fp8_dbias, dbias_args, dbias_cast,
              "cast_fp8 with the transposed copy and x's column sums per block of 128 rows; with "
              "dbias, their total (column_sums) in the same call.");

static const sf_py_arg current_args[] = {SF_T(x),      SF_T(amax),      SF_T(scale),
                                         SF_T(scale_inv), SF_OT(out),   SF_OT(out_t),
                                         SF_INT(margin), SF_STREAM,     SF_OT_NONE(col_sums),
                                         SF_OT_NONE(dbias)};
static sf_status current_cast(sf_py_value *v, sf_stream s)
{
    return sf_cast_fp8_current(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[8].t, v[9].t, v[6].i, s);
}
SF_PY_BINDING(cast_fp8_current, current_args, current_cast,
              "amax = max|x|, the current-scaling scale and its inverse, then cast_fp8 (one launch on "
              "CUDA where the tiled kernel takes the shapes); with col_sums (and dbias) the column "
              "sums per block of 128 rows (and their total) as cast_fp8_dbias makes them.");

static const sf_py_arg rowcol_args[] = {SF_T(x),      SF_OT(out),         SF_OT(scale_inv),
                                        SF_OT(out_t), SF_OT(scale_inv_t), SF_STREAM,
                                        SF_OT_NONE(col_sums), SF_OT_NONE(dbias)};
static sf_status rowcol(sf_py_value *v, sf_stream s)
{
    return sf_quantize_block_fp8_rowcol(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[6].t, v[7].t, s);
}
SF_PY_BINDING(quantize_block_fp8_rowcol, rowcol_args, rowcol,
              "1x128 blocks along K and (transposed) along M in one pass, and the column sums "
              "per 128-row block (with dbias, their total in the same call).");

const sf_py_binding *const sf_py_quant_bindings[] = {
    &amax_binding,           &cast_fp8_binding,         &cast_fp8_dbias_binding, &column_sums_binding,
    &cast_fp8_current_binding, &cast_fp8_grouped_binding, &swiglu_cast_fp8_grouped_binding,
    &swiglu_backward_cast_fp8_grouped_binding,
    &cast_fp8_grouped_ends_binding,
    &cast_fp8_current_list_binding,
    &cast_fp8_current_stacked_binding,
    &transpose_fp8_binding,  &dequantize_fp8_binding,
    &fp8_scale_update_binding, &fp8_compute_scale_binding, &quantize_block_fp8_binding,
    &quantize_rowwise_fp8_binding, &quantize_block_fp8_rowcol_binding, &quantize_block_fp8_weight_binding,
    &block_transpose_fp8_binding, &dequantize_block_fp8_binding, &quantize_mxfp8_binding,
    &dequantize_mxfp8_binding, &quantize_nvfp4_binding, &dequantize_nvfp4_binding, NULL};
