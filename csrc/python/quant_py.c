/*
 * quant_py.c - bindings of the quant family (csrc/quant/): amax, the FP8
 * casts, dequantization, the scaling-state updates and the block formats.
 * Optional outputs are passed as None; seqfuse.ops.quant is the friendly
 * layer above.  Each binding is an argument table and a thunk calling the C
 * entry; the driver in py_call.c does the parsing, importing and error
 * mapping.
 */
#include "py_call.h"

static const sf_py_arg amax_args[] = {SF_T(x), SF_T(out), SF_STREAM};
static sf_status amax(sf_py_value *v, sf_stream s) { return sf_amax(v[0].t, v[1].t, s); }
SF_PY_BINDING(amax, amax_args, amax, "out[0] = max |x| (float32).");

static const sf_py_arg cast_args[] = {SF_T(x),      SF_T(scale),      SF_OT(amax), SF_OT(out),
                                      SF_OT(out_t), SF_OT(scale_inv), SF_STREAM};
static sf_status cast(sf_py_value *v, sf_stream s)
{
    return sf_cast_fp8(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, s);
}
SF_PY_BINDING(cast_fp8, cast_args, cast,
              "Scale, cast to the FP8 dtype of out/out_t, transpose into out_t, accumulate "
              "max|x| into amax.");

static const sf_py_arg cast_dbias_args[] = {SF_T(x),     SF_T(scale),      SF_OT(amax),
                                            SF_OT(out),  SF_T(out_t),      SF_OT(scale_inv),
                                            SF_T(col_sums), SF_STREAM};
static sf_status cast_dbias(sf_py_value *v, sf_stream s)
{
    return sf_cast_fp8_dbias(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].t, s);
}
SF_PY_BINDING(cast_fp8_dbias, cast_dbias_args, cast_dbias,
              "cast_fp8 with the transposed copy and x's column sums per block of 128 rows.");

static const sf_py_arg cast_current_args[] = {SF_T(x),   SF_T(amax),   SF_T(scale),  SF_T(scale_inv),
                                              SF_OT(out), SF_OT(out_t), SF_INT(margin), SF_STREAM};
static sf_status cast_current(sf_py_value *v, sf_stream s)
{
    return sf_cast_fp8_current(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].i, s);
}
SF_PY_BINDING(cast_fp8_current, cast_current_args, cast_current,
              "amax = max|x|, the current-scaling scale and its inverse, then cast_fp8 (one "
              "launch on CUDA where the tiled kernel takes the shapes).");

static const sf_py_arg transpose_args[] = {SF_T(data), SF_T(out_t), SF_STREAM};
static sf_status transpose(sf_py_value *v, sf_stream s)
{
    return sf_transpose_fp8(v[0].t, v[1].t, s);
}
SF_PY_BINDING(transpose_fp8, transpose_args, transpose,
              "out_t = data viewed as [M, K], transposed (FP8 bytes).");

static const sf_py_arg dequantize_args[] = {SF_T(data), SF_T(scale_inv), SF_T(out), SF_STREAM};
static sf_status dequantize(sf_py_value *v, sf_stream s)
{
    return sf_dequantize_fp8(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(dequantize_fp8, dequantize_args, dequantize, "out = data * scale_inv[0].");

static const sf_py_arg scale_update_args[] = {SF_T(amax_history), SF_T(scale), SF_T(scale_inv),
                                              SF_T(fp8_max),      SF_INT(algo), SF_INT(margin),
                                              SF_STREAM};
static sf_status scale_update(sf_py_value *v, sf_stream s)
{
    return sf_fp8_scale_update(v[0].t, v[1].t, v[2].t, v[3].t, v[4].i, v[5].i, s);
}
SF_PY_BINDING(fp8_scale_update, scale_update_args, scale_update,
              "The delayed-scaling update of every column in one launch.");

static const sf_py_arg compute_scale_args[] = {SF_T(amax),      SF_T(scale),    SF_T(scale_inv),
                                               SF_FLOAT(fp8_max), SF_INT(margin), SF_STREAM};
static sf_status compute_scale(sf_py_value *v, sf_stream s)
{
    return sf_fp8_compute_scale(v[0].t, v[1].t, v[2].t, (float)v[3].f, v[4].i, s);
}
SF_PY_BINDING(fp8_compute_scale, compute_scale_args, compute_scale, "Current scaling.");

static const sf_py_arg qblock_args[] = {SF_T(x), SF_T(out), SF_T(scale_inv), SF_INT(block_rows),
                                        SF_STREAM};
static sf_status qblock(sf_py_value *v, sf_stream s)
{
    return sf_quantize_block_fp8(v[0].t, v[1].t, v[2].t, v[3].i, s);
}
SF_PY_BINDING(quantize_block_fp8, qblock_args, qblock, "1x128 / 128x128 blocks.");

static const sf_py_arg rowcol_args[] = {SF_T(x),      SF_OT(out),         SF_OT(scale_inv),
                                        SF_OT(out_t), SF_OT(scale_inv_t), SF_STREAM,
                                        SF_OT_NONE(col_sums)};
static sf_status rowcol(sf_py_value *v, sf_stream s)
{
    return sf_quantize_block_fp8_rowcol(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[6].t, s);
}
SF_PY_BINDING(quantize_block_fp8_rowcol, rowcol_args, rowcol,
              "1x128 blocks along K and (transposed) along M in one pass, and the column sums "
              "per 128-row block.");

static const sf_py_arg dqblock_args[] = {SF_T(data), SF_T(scale_inv), SF_INT(block_rows), SF_T(out),
                                         SF_STREAM};
static sf_status dqblock(sf_py_value *v, sf_stream s)
{
    return sf_dequantize_block_fp8(v[0].t, v[1].t, v[2].i, v[3].t, s);
}
SF_PY_BINDING(dequantize_block_fp8, dqblock_args, dqblock, "out = data times its block scales.");

static const sf_py_arg qmx_args[] = {SF_T(x), SF_T(out), SF_T(scales), SF_STREAM};
static sf_status qmx(sf_py_value *v, sf_stream s)
{
    return sf_quantize_mxfp8(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(quantize_mxfp8, qmx_args, qmx, "1x32 blocks, E8M0 scales.");

static const sf_py_arg dqmx_args[] = {SF_T(data), SF_T(scales), SF_T(out), SF_STREAM};
static sf_status dqmx(sf_py_value *v, sf_stream s)
{
    return sf_dequantize_mxfp8(v[0].t, v[1].t, v[2].t, s);
}
SF_PY_BINDING(dequantize_mxfp8, dqmx_args, dqmx, "out = data times its E8M0 block scales.");

static const sf_py_arg qnv_args[] = {SF_T(x), SF_T(amax), SF_T(out), SF_T(block_scales),
                                     SF_T(global_scale_inv), SF_STREAM};
static sf_status qnv(sf_py_value *v, sf_stream s)
{
    return sf_quantize_nvfp4(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, s);
}
SF_PY_BINDING(quantize_nvfp4, qnv_args, qnv, "1x16 blocks of FP4 with E4M3 scales.");

static const sf_py_arg dqnv_args[] = {SF_T(data), SF_T(block_scales), SF_T(global_scale_inv),
                                      SF_T(out), SF_STREAM};
static sf_status dqnv(sf_py_value *v, sf_stream s)
{
    return sf_dequantize_nvfp4(v[0].t, v[1].t, v[2].t, v[3].t, s);
}
SF_PY_BINDING(dequantize_nvfp4, dqnv_args, dqnv, "out = data times its two-level scales.");

const sf_py_binding *const sf_py_quant_bindings[] = {
    &amax_binding,           &cast_fp8_binding,         &cast_fp8_dbias_binding,
    &cast_fp8_current_binding, &transpose_fp8_binding,  &dequantize_fp8_binding,
    &fp8_scale_update_binding, &fp8_compute_scale_binding, &quantize_block_fp8_binding,
    &quantize_block_fp8_rowcol_binding, &dequantize_block_fp8_binding, &quantize_mxfp8_binding,
    &dequantize_mxfp8_binding, &quantize_nvfp4_binding, &dequantize_nvfp4_binding, NULL};
