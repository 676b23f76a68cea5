/*
 * grouped_py.c - binding of the grouped family (csrc/grouped/): the
 * experts' GEMMs in one call.  seqfuse.ops.moe.grouped_gemm is the
 * Python-facing op.
 *
 * An operand (a, b, out) arrives as a 2-D tensor (split by m_splits along
 * dim 0), a 3-D tensor [G, rows, cols] (G stacked matrices: the binding
 * makes the G views), or a list / tuple of G 2-D tensors (one per expert:
 * GroupedLinear's weights).  bias likewise: a list of G 1-D tensors or one
 * 2-D [G, n] tensor.  m_splits is a sequence of G Python ints (host values:
 * this route issues one cuBLASLt call per group from the host).
 */
#include "py_call.h"

typedef struct {
    int given;            /* not None */
    int split;            /* one 2-D tensor split by m_splits */
    sf_tensor whole;      /* the imported tensor (split or stacked) */
    sf_tensor *views;     /* G views (stacked or listed), else NULL */
    int own_views;        /* views allocated here (stacked) */
    sf_py_tensor_list list;
} grouped_operand;

static void operand_free(grouped_operand *o)
{
    if (o->own_views)
        PyMem_Free(o->views);
    o->views = NULL;
    sf_py_list_free(&o->list);
}

/* `vec`: the operand is a bias (G vectors): a 2-D tensor is G stacked rows. */
static int operand_import(sf_py_call *c, PyObject *stream_obj, PyObject *obj, const char *name,
                          int G, int vec, grouped_operand *o)
{
    if (obj == Py_None)
        return 0;
    o->given = 1;
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        if (sf_py_list_import(c, stream_obj, obj, name, &o->list) < 0)
            return -1;
        if (o->list.n != G) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' must hold num_groups = %d tensors "
                         "(one per group), got %zd", c->op, name, G, o->list.n);
            return -1;
        }
        o->views = o->list.views;
        return 0;
    }
    if (sf_py_tensor(c, obj, name, &o->whole) < 0)
        return -1;
    int stacked_ndim = vec ? 2 : 3;
    if (!vec && o->whole.ndim == 2) {
        o->split = 1;
        return 0;
    }
    if (o->whole.ndim != stacked_ndim) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be %s, got a %d-D tensor", c->op, name,
                     vec ? "a list of num_groups 1-D tensors or one 2-D [num_groups, n] tensor"
                         : "a 2-D tensor (split by m_splits), a 3-D [num_groups, rows, cols] tensor "
                           "or a list of num_groups 2-D tensors",
                     o->whole.ndim);
        return -1;
    }
    if (o->whole.shape[0] != G) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' stacks %lld matrices along dim 0 but "
                     "num_groups = len(m_splits) = %d", c->op, name, (long long)o->whole.shape[0], G);
        return -1;
    }
    o->views = PyMem_Calloc((size_t)G, sizeof(sf_tensor));
    if (!o->views) {
        PyErr_NoMemory();
        return -1;
    }
    o->own_views = 1;
    size_t es = sf_dtype_size(o->whole.dtype);
    for (int g = 0; g < G; ++g) {
        sf_tensor *v = &o->views[g];
        *v = o->whole;
        v->ndim = o->whole.ndim - 1;
        for (int d = 0; d < v->ndim; ++d) {
            v->shape[d] = o->whole.shape[d + 1];
            v->strides[d] = o->whole.strides[d + 1];
        }
        v->data = (char *)o->whole.data + (int64_t)g * o->whole.strides[0] * (int64_t)es;
    }
    return 0;
}

/* grouped_gemm(a, b, out, m_splits, transa, transb, a_scale_inv, b_scale_inv, a_scaling,
 *              b_scaling, bias, bgrad, accumulate, fast_accum, allow_tf32, workspace,
 *              stream=None)
 * a_scale_inv / b_scale_inv: None, one tensor (per-tensor scales: G or 1
 * elements), or a list of G scale tensors under a_scaling / b_scaling
 * (sf_gemm_scaling codes). */
static PyObject *py_grouped_gemm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "grouped_gemm";
    if (sf_py_check_nargs(op, nargs, 16, 17) < 0)
        return NULL;
    long transa, transb, a_scaling, b_scaling, bgrad, accumulate, fast_accum, allow_tf32;
    if (sf_py_arg_long(op, "transa", args[4], &transa) < 0 ||
        sf_py_arg_long(op, "transb", args[5], &transb) < 0 ||
        sf_py_arg_long(op, "a_scaling", args[8], &a_scaling) < 0 ||
        sf_py_arg_long(op, "b_scaling", args[9], &b_scaling) < 0 ||
        sf_py_arg_long(op, "bgrad", args[11], &bgrad) < 0 ||
        sf_py_arg_long(op, "accumulate", args[12], &accumulate) < 0 ||
        sf_py_arg_long(op, "fast_accum", args[13], &fast_accum) < 0 ||
        sf_py_arg_long(op, "allow_tf32", args[14], &allow_tf32) < 0)
        return NULL;
    PyObject *splits = PySequence_Fast(args[3], "grouped_gemm: argument 'm_splits' must be a sequence of ints");
    if (!splits)
        return NULL;
    Py_ssize_t G = PySequence_Fast_GET_SIZE(splits);
    if (G < 1 || G > (1 << 20)) {
        Py_DECREF(splits);
        return PyErr_Format(PyExc_ValueError, "%s: argument 'm_splits' must hold 1 to 2^20 row counts, "
                            "got %zd", op, G);
    }
    int64_t *m = PyMem_Malloc((size_t)G * sizeof(int64_t));
    if (!m) {
        Py_DECREF(splits);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t g = 0; g < G; ++g) {
        long v;
        if (sf_py_arg_long(op, "m_splits", PySequence_Fast_GET_ITEM(splits, g), &v) < 0) {
            Py_DECREF(splits);
            PyMem_Free(m);
            return NULL;
        }
        m[g] = v;
    }
    Py_DECREF(splits);

    PyObject *stream_obj = nargs > 16 ? args[16] : Py_None;
    sf_py_call c;
    if (sf_py_call_init(&c, op, stream_obj) < 0) {
        PyMem_Free(m);
        return NULL;
    }
    grouped_operand a, b, out, bias;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    memset(&out, 0, sizeof out);
    memset(&bias, 0, sizeof bias);
    sf_py_tensor_list sal = {0}, sbl = {0};
    sf_tensor sa, sb, ws;
    int has_sa = 0, has_sb = 0, has_ws = 0, ran = 0;
    int list_sa = PyList_Check(args[6]) || PyTuple_Check(args[6]);
    int list_sb = PyList_Check(args[7]) || PyTuple_Check(args[7]);
    sf_status st = SF_OK;
    if (operand_import(&c, stream_obj, args[0], "a", (int)G, 0, &a) < 0 ||
        operand_import(&c, stream_obj, args[1], "b", (int)G, 0, &b) < 0 ||
        operand_import(&c, stream_obj, args[2], "out", (int)G, 0, &out) < 0 ||
        operand_import(&c, stream_obj, args[10], "bias", (int)G, 1, &bias) < 0 ||
        (list_sa ? sf_py_list_import(&c, stream_obj, args[6], "a_scale_inv", &sal)
                 : sf_py_optional_tensor(&c, args[6], "a_scale_inv", &sa, &has_sa)) < 0 ||
        (list_sb ? sf_py_list_import(&c, stream_obj, args[7], "b_scale_inv", &sbl)
                 : sf_py_optional_tensor(&c, args[7], "b_scale_inv", &sb, &has_sb)) < 0 ||
        sf_py_optional_tensor(&c, args[15], "workspace", &ws, &has_ws) < 0)
        goto done;
    if ((list_sa && sal.n != G) || (list_sb && sbl.n != G)) {
        PyErr_Format(PyExc_ValueError, "%s: a list of scale inverses must hold num_groups = %zd tensors",
                     op, G);
        goto done;
    }
    if (!a.given || !b.given || !out.given) {
        PyErr_Format(PyExc_ValueError, "%s: arguments 'a', 'b' and 'out' are required", op);
        goto done;
    }
    sf_grouped_gemm_args g;
    sf_grouped_gemm_args_init(&g);
    g.num_groups = (int)G;
    g.m_splits = m;
    g.a = a.split ? &a.whole : NULL;
    g.a_list = a.split ? NULL : a.views;
    g.b = b.split ? &b.whole : NULL;
    g.b_list = b.split ? NULL : b.views;
    g.out = out.split ? &out.whole : NULL;
    g.out_list = out.split ? NULL : out.views;
    g.transa = transa != 0;
    g.transb = transb != 0;
    g.a_scale_inv = has_sa ? &sa : NULL;
    g.b_scale_inv = has_sb ? &sb : NULL;
    g.a_scale_list = list_sa ? sal.views : NULL;
    g.b_scale_list = list_sb ? sbl.views : NULL;
    g.a_scaling = (sf_gemm_scaling)a_scaling;
    g.b_scaling = (sf_gemm_scaling)b_scaling;
    g.bias_list = bias.given ? bias.views : NULL;
    g.bgrad = bgrad != 0;
    g.accumulate = accumulate != 0;
    g.fast_accum = fast_accum != 0;
    g.allow_tf32 = allow_tf32 != 0;
    g.workspace = has_ws ? &ws : NULL;
    Py_BEGIN_ALLOW_THREADS
    st = sf_grouped_gemm(&g, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    ran = 1;
done:
    sf_py_list_free(&sal);
    sf_py_list_free(&sbl);
    operand_free(&a);
    operand_free(&b);
    operand_free(&out);
    operand_free(&bias);
    PyMem_Free(m);
    if (!ran) {
        sf_py_call_release(&c);
        return NULL;
    }
    return sf_py_finish(&c, st);
}

PyMethodDef sf_py_grouped_methods[] = {
    {"grouped_gemm", SF_PY_FASTCALL(py_grouped_gemm),
     "grouped_gemm(a, b, out, m_splits, transa, transb, a_scale_inv, b_scale_inv, a_scaling, "
     "b_scaling, bias, bgrad, accumulate, fast_accum, allow_tf32, workspace, stream=None): per "
     "group g, out_g = op(a_g) @ op(b_g). See seqfuse.ops.moe.grouped_gemm."},
    {NULL, NULL, 0, NULL},
};
