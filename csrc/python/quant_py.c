/*
 * quant_py.c - bindings of the quant family (csrc/quant/): amax, the FP8
 * casts, dequantization, the scaling-state updates and the block formats.
 * Each takes its tensors positionally (None where an output is optional) and
 * an optional stream last; seqfuse.ops.quant is the friendly layer above.
 */
#include "py_call.h"

/* amax(x, out, stream=None): out[0] = max |x|. */
static PyObject *py_amax(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "amax";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0}, {1, "out", 0}};
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 2, 3) < 0 ||
        sf_py_begin(&a, op, args, nargs, 2, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_amax(a.t[0], a.t[1], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* Read an int argument, naming it on failure. */
static int int_arg(const char *op, PyObject *obj, const char *arg, int *out)
{
    long v;
    if (sf_py_arg_long(op, arg, obj, &v) < 0)
        return -1;
    if (v < -2147483647L || v > 2147483647L) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' is out of range", op, arg);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* cast_fp8(x, scale, amax, out, out_t, scale_inv, stream=None) */
static PyObject *py_cast_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "cast_fp8";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0},   {1, "scale", 0}, {2, "amax", 1},
                                            {3, "out", 1}, {4, "out_t", 1}, {5, "scale_inv", 1}};
    enum { X, SCALE, AMAX, OUT, OUT_T, SCALE_INV };
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0 ||
        sf_py_begin(&a, op, args, nargs, 6, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cast_fp8(a.t[X], a.t[SCALE], a.t[AMAX], a.t[OUT], a.t[OUT_T], a.t[SCALE_INV],
                     sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* cast_fp8_current(x, amax, scale, scale_inv, out, out_t, margin, stream=None) */
static PyObject *py_cast_fp8_current(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "cast_fp8_current";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0},   {1, "amax", 0},  {2, "scale", 0},
                                            {3, "scale_inv", 0}, {4, "out", 1}, {5, "out_t", 1}};
    enum { X, AMAX, SCALE, SCALE_INV, OUT, OUT_T };
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0)
        return NULL;
    int margin;
    sf_py_args a;
    if (int_arg(op, args[6], "margin", &margin) < 0 ||
        sf_py_begin(&a, op, args, nargs, 7, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cast_fp8_current(a.t[X], a.t[AMAX], a.t[SCALE], a.t[SCALE_INV], a.t[OUT], a.t[OUT_T],
                             margin, sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* cast_fp8_dbias(x, scale, amax, out, out_t, scale_inv, col_sums, stream=None) */
static PyObject *py_cast_fp8_dbias(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "cast_fp8_dbias";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0},   {1, "scale", 0}, {2, "amax", 1},
                                            {3, "out", 1}, {4, "out_t", 0}, {5, "scale_inv", 1},
                                            {6, "col_sums", 0}};
    enum { X, SCALE, AMAX, OUT, OUT_T, SCALE_INV, COL_SUMS };
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0 ||
        sf_py_begin(&a, op, args, nargs, 7, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cast_fp8_dbias(a.t[X], a.t[SCALE], a.t[AMAX], a.t[OUT], a.t[OUT_T], a.t[SCALE_INV],
                           a.t[COL_SUMS], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* transpose_fp8(data, out_t, stream=None) */
static PyObject *py_transpose_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "transpose_fp8";
    static const sf_py_tensor_arg spec[] = {{0, "data", 0}, {1, "out_t", 0}};
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 2, 3) < 0 ||
        sf_py_begin(&a, op, args, nargs, 2, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_transpose_fp8(a.t[0], a.t[1], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* dequantize_fp8(data, scale_inv, out, stream=None) */
static PyObject *py_dequantize_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dequantize_fp8";
    static const sf_py_tensor_arg spec[] = {{0, "data", 0}, {1, "scale_inv", 0}, {2, "out", 0}};
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0 ||
        sf_py_begin(&a, op, args, nargs, 3, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dequantize_fp8(a.t[0], a.t[1], a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo, margin, stream=None) */
static PyObject *py_fp8_scale_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "fp8_scale_update";
    static const sf_py_tensor_arg spec[] = {
        {0, "amax_history", 0}, {1, "scale", 0}, {2, "scale_inv", 0}, {3, "fp8_max", 0}};
    enum { HIST, SCALE, SCALE_INV, FP8_MAX };
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0)
        return NULL;
    int algo, margin;
    sf_py_args a;
    if (int_arg(op, args[4], "algo", &algo) < 0 || int_arg(op, args[5], "margin", &margin) < 0 ||
        sf_py_begin(&a, op, args, nargs, 6, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_fp8_scale_update(a.t[HIST], a.t[SCALE], a.t[SCALE_INV], a.t[FP8_MAX], algo, margin,
                             sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin, stream=None) */
static PyObject *py_fp8_compute_scale(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "fp8_compute_scale";
    static const sf_py_tensor_arg spec[] = {{0, "amax", 0}, {1, "scale", 0}, {2, "scale_inv", 0}};
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0)
        return NULL;
    double fmax = PyFloat_AsDouble(args[3]);
    if (fmax == -1.0 && PyErr_Occurred())
        return NULL;
    int margin;
    sf_py_args a;
    if (int_arg(op, args[4], "margin", &margin) < 0 ||
        sf_py_begin(&a, op, args, nargs, 5, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_fp8_compute_scale(a.t[0], a.t[1], a.t[2], (float)fmax, margin,
                              sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* quantize_block_fp8(x, out, scale_inv, block_rows, stream=None)
 * dequantize_block_fp8(data, scale_inv, block_rows, out, stream=None) */
static PyObject *block_fp8_call(PyObject *const *args, Py_ssize_t nargs, int quantize)
{
    static const sf_py_tensor_arg q[] = {{0, "x", 0}, {1, "out", 0}, {2, "scale_inv", 0}};
    static const sf_py_tensor_arg dq[] = {{0, "data", 0}, {1, "scale_inv", 0}, {3, "out", 0}};
    const char *op = quantize ? "quantize_block_fp8" : "dequantize_block_fp8";
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0)
        return NULL;
    int block_rows;
    sf_py_args a;
    if (int_arg(op, args[quantize ? 3 : 2], "block_rows", &block_rows) < 0 ||
        sf_py_begin(&a, op, args, nargs, 4, quantize ? q : dq, 3) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    const sf_stream stream = sf_py_call_stream(&a.call);
    st = quantize ? sf_quantize_block_fp8(a.t[0], a.t[1], a.t[2], block_rows, stream)
                  : sf_dequantize_block_fp8(a.t[0], a.t[1], block_rows, a.t[2], stream);
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_quantize_block_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return block_fp8_call(args, nargs, 1);
}

static PyObject *py_dequantize_block_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return block_fp8_call(args, nargs, 0);
}

/* quantize_block_fp8_rowcol(x, out, scale_inv, out_t, scale_inv_t, stream=None, col_sums=None) */
static PyObject *py_quantize_block_fp8_rowcol(PyObject *self, PyObject *const *args,
                                              Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "quantize_block_fp8_rowcol";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0},           {1, "out", 1},
                                            {2, "scale_inv", 1},   {3, "out_t", 1},
                                            {4, "scale_inv_t", 1}, {6, "col_sums", 1}};
    enum { X, OUT, SCALE_INV, OUT_T, SCALE_INV_T, COL_SUMS };
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 5, 7) < 0 ||
        sf_py_begin(&a, op, args, nargs, 5, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_quantize_block_fp8_rowcol(a.t[X], a.t[OUT], a.t[SCALE_INV], a.t[OUT_T],
                                      a.t[SCALE_INV_T], a.t[COL_SUMS], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* quantize_mxfp8(x, out, scales, stream=None) / dequantize_mxfp8(data, scales, out, stream=None) */
static PyObject *py_mxfp8(PyObject *const *args, Py_ssize_t nargs, int quantize)
{
    static const sf_py_tensor_arg q[] = {{0, "x", 0}, {1, "out", 0}, {2, "scales", 0}};
    static const sf_py_tensor_arg dq[] = {{0, "data", 0}, {1, "scales", 0}, {2, "out", 0}};
    const char *op = quantize ? "quantize_mxfp8" : "dequantize_mxfp8";
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0 ||
        sf_py_begin(&a, op, args, nargs, 3, quantize ? q : dq, 3) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    const sf_stream stream = sf_py_call_stream(&a.call);
    st = quantize ? sf_quantize_mxfp8(a.t[0], a.t[1], a.t[2], stream)
                  : sf_dequantize_mxfp8(a.t[0], a.t[1], a.t[2], stream);
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_quantize_mxfp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return py_mxfp8(args, nargs, 1);
}

static PyObject *py_dequantize_mxfp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return py_mxfp8(args, nargs, 0);
}

/* quantize_nvfp4(x, amax, out, block_scales, global_scale_inv, stream=None)
 * dequantize_nvfp4(data, block_scales, global_scale_inv, out, stream=None) */
static PyObject *nvfp4_call(PyObject *const *args, Py_ssize_t nargs, int quantize)
{
    static const sf_py_tensor_arg q[] = {{0, "x", 0},
                                         {1, "amax", 0},
                                         {2, "out", 0},
                                         {3, "block_scales", 0},
                                         {4, "global_scale_inv", 0}};
    static const sf_py_tensor_arg dq[] = {
        {0, "data", 0}, {1, "block_scales", 0}, {2, "global_scale_inv", 0}, {3, "out", 0}};
    const char *op = quantize ? "quantize_nvfp4" : "dequantize_nvfp4";
    const int n = quantize ? SF_PY_NARGS(q) : SF_PY_NARGS(dq);
    sf_py_args a;
    if (sf_py_check_nargs(op, nargs, n, n + 1) < 0 ||
        sf_py_begin(&a, op, args, nargs, n, quantize ? q : dq, n) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    const sf_stream stream = sf_py_call_stream(&a.call);
    st = quantize ? sf_quantize_nvfp4(a.t[0], a.t[1], a.t[2], a.t[3], a.t[4], stream)
                  : sf_dequantize_nvfp4(a.t[0], a.t[1], a.t[2], a.t[3], stream);
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_quantize_nvfp4(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return nvfp4_call(args, nargs, 1);
}

static PyObject *py_dequantize_nvfp4(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return nvfp4_call(args, nargs, 0);
}

PyMethodDef sf_py_quant_methods[] = {
    {"amax", SF_PY_FASTCALL(py_amax),
     "amax(x, out, stream=None): out[0] = max |x| (float32)."},
    {"cast_fp8", SF_PY_FASTCALL(py_cast_fp8),
     "cast_fp8(x, scale, amax, out, out_t, scale_inv, stream=None): scale, cast to the FP8 "
     "dtype of out/out_t, transpose into out_t, accumulate max|x| into amax."},
    {"cast_fp8_dbias", SF_PY_FASTCALL(py_cast_fp8_dbias),
     "cast_fp8_dbias(x, scale, amax, out, out_t, scale_inv, col_sums, stream=None): cast_fp8 with "
     "the transposed copy and x's column sums per block of 128 rows."},
    {"cast_fp8_current", SF_PY_FASTCALL(py_cast_fp8_current),
     "cast_fp8_current(x, amax, scale, scale_inv, out, out_t, margin, stream=None): amax = max|x|, "
     "the current-scaling scale and its inverse, then cast_fp8 (one launch on CUDA where the tiled "
     "kernel takes the shapes)."},
    {"transpose_fp8", SF_PY_FASTCALL(py_transpose_fp8),
     "transpose_fp8(data, out_t, stream=None): out_t = data viewed as [M, K], transposed (FP8 bytes)."},
    {"dequantize_fp8", SF_PY_FASTCALL(py_dequantize_fp8),
     "dequantize_fp8(data, scale_inv, out, stream=None): out = data * scale_inv[0]."},
    {"fp8_scale_update", SF_PY_FASTCALL(py_fp8_scale_update),
     "fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo, margin, stream=None): "
     "the delayed-scaling update of every column in one launch."},
    {"fp8_compute_scale", SF_PY_FASTCALL(py_fp8_compute_scale),
     "fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin, stream=None): current scaling."},
    {"quantize_block_fp8", SF_PY_FASTCALL(py_quantize_block_fp8),
     "quantize_block_fp8(x, out, scale_inv, block_rows, stream=None): 1x128 / 128x128 blocks."},
    {"quantize_block_fp8_rowcol", SF_PY_FASTCALL(py_quantize_block_fp8_rowcol),
     "quantize_block_fp8_rowcol(x, out, scale_inv, out_t, scale_inv_t, stream=None, "
     "col_sums=None): 1x128 blocks along K and (transposed) along M in one pass, and the "
     "column sums per 128-row block."},
    {"dequantize_block_fp8", SF_PY_FASTCALL(py_dequantize_block_fp8),
     "dequantize_block_fp8(data, scale_inv, block_rows, out, stream=None)."},
    {"quantize_mxfp8", SF_PY_FASTCALL(py_quantize_mxfp8),
     "quantize_mxfp8(x, out, scales, stream=None): 1x32 blocks, E8M0 scales."},
    {"dequantize_mxfp8", SF_PY_FASTCALL(py_dequantize_mxfp8),
     "dequantize_mxfp8(data, scales, out, stream=None)."},
    {"quantize_nvfp4", SF_PY_FASTCALL(py_quantize_nvfp4),
     "quantize_nvfp4(x, amax, out, block_scales, global_scale_inv, stream=None)."},
    {"dequantize_nvfp4", SF_PY_FASTCALL(py_dequantize_nvfp4),
     "dequantize_nvfp4(data, block_scales, global_scale_inv, out, stream=None)."},
    {NULL, NULL, 0, NULL},
};
