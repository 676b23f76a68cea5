/*
 * gemm_py.c - bindings of the gemm family (matrix products over cuBLASLt,
 * csrc/gemm/).  seqfuse.ops.gemm is the Python-facing op; this is its door
 * into sf_gemm: an argument table, a check of the fp8 formats and a thunk
 * that fills sf_gemm_args; the driver in py_call.c does the rest.
 */
#include "py_call.h"

/* A uint8 view standing for an fp8 tensor takes the named format. */
static int reinterpret_fp8(const char *op, sf_tensor *t, const char *name, int format)
{
    if (format == 0)
        return 0;
    if ((format != SF_FLOAT8_E4M3 && format != SF_FLOAT8_E5M2) || t->dtype != SF_UINT8) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s_format' names an fp8 format (%d or %d) for a uint8 view; "
                     "got format %d for a %s tensor",
                     op, name, (int)SF_FLOAT8_E4M3, (int)SF_FLOAT8_E5M2, format,
                     sf_dtype_name(t->dtype));
        return -1;
    }
    t->dtype = (sf_dtype)format;
    return 0;
}

/* a_format / b_format: 0, or the sf_dtype of an fp8 operand passed as a uint8
 * view (torch releases that cannot export float8 through DLPack).  The rows
 * gemm and gemm_tune share, in this order (gemm_args_of reads them). */
#define SF_GEMM_ARG_ROWS                                                    \
    SF_T(a),           SF_T(b),              SF_T(out),          SF_INT(transa), \
    SF_INT(transb),    SF_OT(a_scale_inv),   SF_OT(b_scale_inv), SF_INT(a_scaling), \
    SF_INT(b_scaling), SF_OT(bias),          SF_OT(aux),         SF_INT(epilogue), \
    SF_INT(accumulate), SF_INT(fast_accum),  SF_INT(allow_tf32), SF_FLOAT(alpha), \
    SF_OT(workspace),  SF_INT(a_format),     SF_INT(b_format),   SF_OT_NONE(addend)

static const sf_py_arg gemm_args[] = {SF_GEMM_ARG_ROWS, SF_STREAM};

/* gemm_tune: how many candidates and the host tensor its timings go into, then gemm's arguments (first:
 * gemm's rows end in an argument with a default). */
static const sf_py_arg gemm_tune_args[] = {SF_INT(candidates), SF_T(timings), SF_GEMM_ARG_ROWS, SF_STREAM};
enum { GEMM_TUNE_ROWS_AT = 2 };

/* The fp8 formats of gemm's rows starting at argument `at`. */
static int prepare_rows_at(sf_py_frame *f, int at)
{
    return reinterpret_fp8(f->b->op, f->v[at].t, "a", f->v[at + 17].i) < 0 ||
                   reinterpret_fp8(f->b->op, f->v[at + 1].t, "b", f->v[at + 18].i) < 0
               ? -1
               : 0;
}

static int gemm_prepare(sf_py_frame *f)
{
    return prepare_rows_at(f, 0);
}

static int gemm_tune_prepare(sf_py_frame *f)
{
    return prepare_rows_at(f, GEMM_TUNE_ROWS_AT);
}

static sf_gemm_args gemm_args_of(const sf_py_value *v)
{
    const sf_gemm_args g = {
        .a = v[0].t, .b = v[1].t, .out = v[2].t, .transa = v[3].i != 0, .transb = v[4].i != 0,
        .a_scale_inv = v[5].t, .b_scale_inv = v[6].t, .a_scaling = (sf_gemm_scaling)v[7].i,
        .b_scaling = (sf_gemm_scaling)v[8].i, .bias = v[9].t, .aux = v[10].t,
        .epilogue = (sf_gemm_epilogue)v[11].i, .accumulate = v[12].i != 0,
        .fast_accum = v[13].i != 0, .allow_tf32 = v[14].i != 0, .alpha = (float)v[15].f,
        .workspace = v[16].t, .addend = v[19].t};
    return g;
}

static sf_status gemm_call(sf_py_value *v, sf_stream s)
{
    const sf_gemm_args g = gemm_args_of(v);
    return sf_gemm(&g, s);
}
SF_PY_BINDING_FULL(gemm, "gemm", gemm_args, gemm_call, gemm_prepare, NULL, NULL,
                   "out = epilogue(alpha * op(a) @ op(b) + beta * (addend or out)). See seqfuse.ops.gemm.");

static sf_status gemm_tune_call(sf_py_value *v, sf_stream s)
{
    const sf_gemm_args g = gemm_args_of(v + GEMM_TUNE_ROWS_AT);
    return sf_gemm_tune(&g, v[0].i, v[1].t, s);
}
SF_PY_BINDING_FULL(gemm_tune, "gemm_tune", gemm_tune_args, gemm_tune_call, gemm_tune_prepare, NULL, NULL,
                   "Time cuBLASLt's candidates for gemm's product and keep the fastest for its plan; out is "
                   "overwritten. See seqfuse.ops.gemm.tune.");

const sf_py_binding *const sf_py_gemm_bindings[] = {&gemm_binding, &gemm_tune_binding, NULL};

SF_PY_NOARGS(py_gemm_plan_cache_size, PyLong_FromLong(sf_gemm_plan_cache_size()))
SF_PY_NOARGS(py_gemm_plan_cache_clear, (sf_gemm_plan_cache_clear(), Py_NewRef(Py_None)))
SF_PY_NOARGS(py_gemm_heuristic_queries, PyLong_FromLongLong((long long)sf_gemm_heuristic_queries()))

PyMethodDef sf_py_gemm_methods[] = {
    {"gemm_plan_cache_size", py_gemm_plan_cache_size, METH_NOARGS,
     "Number of cached cuBLASLt plans."},
    {"gemm_plan_cache_clear", py_gemm_plan_cache_clear, METH_NOARGS,
     "Drop every cached cuBLASLt plan."},
    {"gemm_heuristic_queries", py_gemm_heuristic_queries, METH_NOARGS,
     "How many times the cuBLASLt heuristic was queried."},
    {NULL, NULL, 0, NULL},
};
