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
    if (sf_py_check_nargs(op, nargs, 2, 3) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 2 ? args[2] : Py_None) < 0)
        return NULL;
    sf_tensor x, out;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 || sf_py_tensor(&c, args[1], "out", &out) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_amax(&x, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
}

/* Read an int argument, naming it on failure. */
static int int_arg(const char *op, PyObject *obj, const char *arg, int *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be an int, got %s", op, arg,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
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
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 6 ? args[6] : Py_None) < 0)
        return NULL;
    sf_tensor x, scale, amax, out, out_t, scale_inv;
    int has_amax, has_out, has_out_t, has_si;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 ||
        sf_py_tensor(&c, args[1], "scale", &scale) < 0 ||
        sf_py_optional_tensor(&c, args[2], "amax", &amax, &has_amax) < 0 ||
        sf_py_optional_tensor(&c, args[3], "out", &out, &has_out) < 0 ||
        sf_py_optional_tensor(&c, args[4], "out_t", &out_t, &has_out_t) < 0 ||
        sf_py_optional_tensor(&c, args[5], "scale_inv", &scale_inv, &has_si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cast_fp8(&x, &scale, has_amax ? &amax : NULL, has_out ? &out : NULL,
                     has_out_t ? &out_t : NULL, has_si ? &scale_inv : NULL,
                     sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* dequantize_fp8(data, scale_inv, out, stream=None) */
static PyObject *py_dequantize_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dequantize_fp8";
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 3 ? args[3] : Py_None) < 0)
        return NULL;
    sf_tensor data, si, out;
    if (sf_py_tensor(&c, args[0], "data", &data) < 0 ||
        sf_py_tensor(&c, args[1], "scale_inv", &si) < 0 ||
        sf_py_tensor(&c, args[2], "out", &out) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dequantize_fp8(&data, &si, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo, margin, stream=None) */
static PyObject *py_fp8_scale_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "fp8_scale_update";
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0)
        return NULL;
    int algo, margin;
    if (int_arg(op, args[4], "algo", &algo) < 0 || int_arg(op, args[5], "margin", &margin) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 6 ? args[6] : Py_None) < 0)
        return NULL;
    sf_tensor hist, scale, si, fmax;
    if (sf_py_tensor(&c, args[0], "amax_history", &hist) < 0 ||
        sf_py_tensor(&c, args[1], "scale", &scale) < 0 ||
        sf_py_tensor(&c, args[2], "scale_inv", &si) < 0 ||
        sf_py_tensor(&c, args[3], "fp8_max", &fmax) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_fp8_scale_update(&hist, &scale, &si, &fmax, algo, margin, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin, stream=None) */
static PyObject *py_fp8_compute_scale(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "fp8_compute_scale";
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0)
        return NULL;
    double fmax = PyFloat_AsDouble(args[3]);
    if (fmax == -1.0 && PyErr_Occurred())
        return NULL;
    int margin;
    if (int_arg(op, args[4], "margin", &margin) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 5 ? args[5] : Py_None) < 0)
        return NULL;
    sf_tensor amax, scale, si;
    if (sf_py_tensor(&c, args[0], "amax", &amax) < 0 ||
        sf_py_tensor(&c, args[1], "scale", &scale) < 0 ||
        sf_py_tensor(&c, args[2], "scale_inv", &si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_fp8_compute_scale(&amax, &scale, &si, (float)fmax, margin, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* quantize_block_fp8(x, out, scale_inv, block_rows, stream=None) */
static PyObject *py_quantize_block_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "quantize_block_fp8";
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0)
        return NULL;
    int block_rows;
    if (int_arg(op, args[3], "block_rows", &block_rows) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 4 ? args[4] : Py_None) < 0)
        return NULL;
    sf_tensor x, out, si;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 || sf_py_tensor(&c, args[1], "out", &out) < 0 ||
        sf_py_tensor(&c, args[2], "scale_inv", &si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_quantize_block_fp8(&x, &out, &si, block_rows, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* dequantize_block_fp8(data, scale_inv, block_rows, out, stream=None) */
static PyObject *py_dequantize_block_fp8(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dequantize_block_fp8";
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0)
        return NULL;
    int block_rows;
    if (int_arg(op, args[2], "block_rows", &block_rows) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 4 ? args[4] : Py_None) < 0)
        return NULL;
    sf_tensor data, si, out;
    if (sf_py_tensor(&c, args[0], "data", &data) < 0 ||
        sf_py_tensor(&c, args[1], "scale_inv", &si) < 0 ||
        sf_py_tensor(&c, args[3], "out", &out) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dequantize_block_fp8(&data, &si, block_rows, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* quantize_block_fp8_rowcol(x, out, scale_inv, out_t, scale_inv_t, stream=None, col_sums=None) */
static PyObject *py_quantize_block_fp8_rowcol(PyObject *self, PyObject *const *args,
                                              Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "quantize_block_fp8_rowcol";
    if (sf_py_check_nargs(op, nargs, 5, 7) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 5 ? args[5] : Py_None) < 0)
        return NULL;
    sf_tensor x, out, si, out_t, si_t, sums;
    int h_out, h_si, h_out_t, h_si_t, h_sums = 0;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 ||
        sf_py_optional_tensor(&c, args[1], "out", &out, &h_out) < 0 ||
        sf_py_optional_tensor(&c, args[2], "scale_inv", &si, &h_si) < 0 ||
        sf_py_optional_tensor(&c, args[3], "out_t", &out_t, &h_out_t) < 0 ||
        sf_py_optional_tensor(&c, args[4], "scale_inv_t", &si_t, &h_si_t) < 0 ||
        (nargs > 6 && sf_py_optional_tensor(&c, args[6], "col_sums", &sums, &h_sums) < 0)) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_quantize_block_fp8_rowcol(&x, h_out ? &out : NULL, h_si ? &si : NULL,
                                      h_out_t ? &out_t : NULL, h_si_t ? &si_t : NULL,
                                      h_sums ? &sums : NULL, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* quantize_mxfp8(x, out, scales, stream=None) / dequantize_mxfp8(data, scales, out, stream=None) */
static PyObject *py_mxfp8(PyObject *const *args, Py_ssize_t nargs, int quantize)
{
    const char *op = quantize ? "quantize_mxfp8" : "dequantize_mxfp8";
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 3 ? args[3] : Py_None) < 0)
        return NULL;
    sf_tensor t0, t1, t2;
    if (sf_py_tensor(&c, args[0], quantize ? "x" : "data", &t0) < 0 ||
        sf_py_tensor(&c, args[1], quantize ? "out" : "scales", &t1) < 0 ||
        sf_py_tensor(&c, args[2], quantize ? "scales" : "out", &t2) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = quantize ? sf_quantize_mxfp8(&t0, &t1, &t2, sf_py_call_stream(&c))
                  : sf_dequantize_mxfp8(&t0, &t1, &t2, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
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

/* quantize_nvfp4(x, amax, out, block_scales, global_scale_inv, stream=None) */
static PyObject *py_quantize_nvfp4(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "quantize_nvfp4";
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 5 ? args[5] : Py_None) < 0)
        return NULL;
    sf_tensor x, amax, out, bs, gsi;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 || sf_py_tensor(&c, args[1], "amax", &amax) < 0 ||
        sf_py_tensor(&c, args[2], "out", &out) < 0 ||
        sf_py_tensor(&c, args[3], "block_scales", &bs) < 0 ||
        sf_py_tensor(&c, args[4], "global_scale_inv", &gsi) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_quantize_nvfp4(&x, &amax, &out, &bs, &gsi, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* dequantize_nvfp4(data, block_scales, global_scale_inv, out, stream=None) */
static PyObject *py_dequantize_nvfp4(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dequantize_nvfp4";
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 4 ? args[4] : Py_None) < 0)
        return NULL;
    sf_tensor data, bs, gsi, out;
    if (sf_py_tensor(&c, args[0], "data", &data) < 0 ||
        sf_py_tensor(&c, args[1], "block_scales", &bs) < 0 ||
        sf_py_tensor(&c, args[2], "global_scale_inv", &gsi) < 0 ||
        sf_py_tensor(&c, args[3], "out", &out) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dequantize_nvfp4(&data, &bs, &gsi, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

PyMethodDef sf_py_quant_methods[] = {
    {"amax", SF_PY_FASTCALL(py_amax),
     "amax(x, out, stream=None): out[0] = max |x| (float32)."},
    {"cast_fp8", SF_PY_FASTCALL(py_cast_fp8),
     "cast_fp8(x, scale, amax, out, out_t, scale_inv, stream=None): scale, cast to the FP8 "
     "dtype of out/out_t, transpose into out_t, accumulate max|x| into amax."},
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
