/*
 * gemm_py.c - bindings of the gemm family (matrix products over cuBLASLt,
 * csrc/gemm/).  seqfuse.ops.gemm is the Python-facing op; this is its thin,
 * positional, METH_FASTCALL door into sf_gemm (a Linear step makes three
 * calls per layer, so the binding parses nothing it does not need).
 */
#include "py_call.h"

/* A uint8 view standing for an fp8 tensor takes the named format. */
static int reinterpret_fp8(const char *op, sf_tensor *t, const char *name, long format)
{
    if (format == 0)
        return 0;
    if ((format != SF_FLOAT8_E4M3 && format != SF_FLOAT8_E5M2) || t->dtype != SF_UINT8) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s_format' names an fp8 format (%d or %d) for a uint8 view; "
                     "got format %ld for a %s tensor",
                     op, name, (int)SF_FLOAT8_E4M3, (int)SF_FLOAT8_E5M2, format,
                     sf_dtype_name(t->dtype));
        return -1;
    }
    t->dtype = (sf_dtype)format;
    return 0;
}

/* gemm(a, b, out, transa, transb, a_scale_inv, b_scale_inv, a_scaling,
 *      b_scaling, bias, aux, epilogue, accumulate, fast_accum, allow_tf32,
 *      alpha, workspace, a_format, b_format, stream=None)
 * a_format / b_format: 0, or the sf_dtype of an fp8 operand passed as a uint8
 * view (torch releases that cannot export float8 through DLPack). */
static PyObject *py_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "gemm";
    static const sf_py_tensor_arg spec[] = {
        {0, "a", 0},           {1, "b", 0},    {2, "out", 0},  {5, "a_scale_inv", 1},
        {6, "b_scale_inv", 1}, {9, "bias", 1}, {10, "aux", 1}, {16, "workspace", 1}};
    enum { A, B, OUT, A_SCALE_INV, B_SCALE_INV, BIAS, AUX, WORKSPACE };
    if (sf_py_check_nargs(op, nargs, 19, 20) < 0)
        return NULL;
    long transa, transb, a_scaling, b_scaling, epilogue, accumulate, fast_accum, allow_tf32;
    long a_format, b_format;
    if (sf_py_arg_long(op, "transa", args[3], &transa) < 0 ||
        sf_py_arg_long(op, "transb", args[4], &transb) < 0 ||
        sf_py_arg_long(op, "a_scaling", args[7], &a_scaling) < 0 ||
        sf_py_arg_long(op, "b_scaling", args[8], &b_scaling) < 0 ||
        sf_py_arg_long(op, "epilogue", args[11], &epilogue) < 0 ||
        sf_py_arg_long(op, "accumulate", args[12], &accumulate) < 0 ||
        sf_py_arg_long(op, "fast_accum", args[13], &fast_accum) < 0 ||
        sf_py_arg_long(op, "allow_tf32", args[14], &allow_tf32) < 0 ||
        sf_py_arg_long(op, "a_format", args[17], &a_format) < 0 ||
        sf_py_arg_long(op, "b_format", args[18], &b_format) < 0)
        return NULL;
    double alpha = PyFloat_AsDouble(args[15]);
    if (alpha == -1.0 && PyErr_Occurred())
        return NULL;

    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 19, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    if (reinterpret_fp8(op, a.t[A], "a", a_format) < 0 ||
        reinterpret_fp8(op, a.t[B], "b", b_format) < 0) {
        sf_py_call_release(&a.call);
        return NULL;
    }

    sf_gemm_args g;
    sf_gemm_args_init(&g);
    g.a = a.t[A];
    g.b = a.t[B];
    g.out = a.t[OUT];
    g.transa = transa != 0;
    g.transb = transb != 0;
    g.a_scale_inv = a.t[A_SCALE_INV];
    g.b_scale_inv = a.t[B_SCALE_INV];
    g.a_scaling = (sf_gemm_scaling)a_scaling;
    g.b_scaling = (sf_gemm_scaling)b_scaling;
    g.bias = a.t[BIAS];
    g.aux = a.t[AUX];
    g.epilogue = (sf_gemm_epilogue)epilogue;
    g.accumulate = accumulate != 0;
    g.fast_accum = fast_accum != 0;
    g.allow_tf32 = allow_tf32 != 0;
    g.alpha = (float)alpha;
    g.workspace = a.t[WORKSPACE];

    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_gemm(&g, sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_gemm_plan_cache_size(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(sf_gemm_plan_cache_size());
}

static PyObject *py_gemm_plan_cache_clear(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    sf_gemm_plan_cache_clear();
    Py_RETURN_NONE;
}

static PyObject *py_gemm_heuristic_queries(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLongLong((long long)sf_gemm_heuristic_queries());
}

PyMethodDef sf_py_gemm_methods[] = {
    {"gemm", SF_PY_FASTCALL(py_gemm),
     "gemm(a, b, out, transa, transb, a_scale_inv, b_scale_inv, a_scaling, b_scaling, "
     "bias, aux, epilogue, accumulate, fast_accum, allow_tf32, alpha, workspace, "
     "a_format, b_format, stream=None): out = epilogue(alpha * op(a) @ op(b) + beta * out). See "
     "seqfuse.ops.gemm."},
    {"gemm_plan_cache_size", py_gemm_plan_cache_size, METH_NOARGS,
     "Number of cached cuBLASLt plans."},
    {"gemm_plan_cache_clear", py_gemm_plan_cache_clear, METH_NOARGS,
     "Drop every cached cuBLASLt plan."},
    {"gemm_heuristic_queries", py_gemm_heuristic_queries, METH_NOARGS,
     "How many times the cuBLASLt heuristic was queried."},
    {NULL, NULL, 0, NULL},
};
