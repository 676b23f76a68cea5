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

/* What the prepare hook builds in the frame's scratch. */
typedef struct {
    int64_t *m; /* m_splits, G host ints */
    grouped_operand a, b, out, bias;
    sf_py_tensor_list scale_list[2];
    sf_tensor scale[2];
    sf_grouped_gemm_args g;
} grouped_state;

/* m_splits: a sequence of 1 to 2^20 ints; fills st->m, returns G or -1. */
static Py_ssize_t read_splits(const char *op, PyObject *obj, grouped_state *st)
{
    PyObject *splits = PySequence_Fast(obj, "grouped_gemm: argument 'm_splits' must be a sequence of ints");
    if (!splits)
        return -1;
    Py_ssize_t G = PySequence_Fast_GET_SIZE(splits);
    if (G < 1 || G > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'm_splits' must hold 1 to 2^20 row counts, "
                     "got %zd", op, G);
        G = -1;
    } else if ((st->m = PyMem_Malloc((size_t)G * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        G = -1;
    }
    for (Py_ssize_t g = 0; G > 0 && g < G; ++g) {
        long v;
        if (sf_py_arg_long(op, "m_splits", PySequence_Fast_GET_ITEM(splits, g), &v) < 0)
            G = -1;
        else
            st->m[g] = v;
    }
    Py_DECREF(splits);
    return G;
}

/* a_scale_inv / b_scale_inv: None, one tensor (per-tensor scales: G or 1
 * elements), or a list of G scale tensors. */
static int scale_import(sf_py_frame *f, PyObject *obj, const char *name, Py_ssize_t G,
                        sf_py_tensor_list *list, sf_tensor *one, const sf_tensor **t,
                        const sf_tensor **t_list)
{
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        if (sf_py_list_import(&f->call, f->stream_obj, obj, name, list) < 0)
            return -1;
        if (list->n != G) {
            PyErr_Format(PyExc_ValueError, "%s: a list of scale inverses must hold num_groups = "
                         "%zd tensors", f->b->op, G);
            return -1;
        }
        *t_list = list->views;
        return 0;
    }
    if (obj == Py_None)
        return 0;
    *t = one;
    return sf_py_tensor(&f->call, obj, name, one);
}

/* Argument positions in grouped_args. */
enum { A, B, OUT, SPLITS, TRANSA, TRANSB, SA, SB, A_SCALING, B_SCALING, BIAS, BGRAD, ACCUMULATE,
       FAST_ACCUM, ALLOW_TF32, WORKSPACE };
static const sf_py_arg grouped_args[] = {
    SF_OBJ(a),          SF_OBJ(b),          SF_OBJ(out),         SF_OBJ(m_splits),
    SF_INT(transa),     SF_INT(transb),     SF_OBJ(a_scale_inv), SF_OBJ(b_scale_inv),
    SF_INT(a_scaling),  SF_INT(b_scaling),  SF_OBJ(bias),        SF_INT(bgrad),
    SF_INT(accumulate), SF_INT(fast_accum), SF_INT(allow_tf32),  SF_OT(workspace),
    SF_STREAM};

/* The state lives on the heap (the frame's scratch holds its address): it
 * is larger than the small frame every call carries. */
static int grouped_prepare(sf_py_frame *f)
{
    grouped_state *st = PyMem_Calloc(1, sizeof *st);
    memcpy(f->scratch, &st, sizeof st);
    if (st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    sf_py_value *v = f->v;
    const Py_ssize_t G = read_splits(f->b->op, v[SPLITS].o, st);
    if (G < 0)
        return -1;
    sf_grouped_gemm_args *g = &st->g;
    sf_grouped_gemm_args_init(g);
    if (operand_import(&f->call, f->stream_obj, v[A].o, "a", (int)G, 0, &st->a) < 0 ||
        operand_import(&f->call, f->stream_obj, v[B].o, "b", (int)G, 0, &st->b) < 0 ||
        operand_import(&f->call, f->stream_obj, v[OUT].o, "out", (int)G, 0, &st->out) < 0 ||
        operand_import(&f->call, f->stream_obj, v[BIAS].o, "bias", (int)G, 1, &st->bias) < 0 ||
        scale_import(f, v[SA].o, "a_scale_inv", G, &st->scale_list[0], &st->scale[0],
                     &g->a_scale_inv, &g->a_scale_list) < 0 ||
        scale_import(f, v[SB].o, "b_scale_inv", G, &st->scale_list[1], &st->scale[1],
                     &g->b_scale_inv, &g->b_scale_list) < 0)
        return -1;
    if (!st->a.given || !st->b.given || !st->out.given) {
        PyErr_Format(PyExc_ValueError, "%s: arguments 'a', 'b' and 'out' are required", f->b->op);
        return -1;
    }
    g->num_groups = (int)G;
    g->m_splits = st->m;
    g->a = st->a.split ? &st->a.whole : NULL;
    g->a_list = st->a.split ? NULL : st->a.views;
    g->b = st->b.split ? &st->b.whole : NULL;
    g->b_list = st->b.split ? NULL : st->b.views;
    g->out = st->out.split ? &st->out.whole : NULL;
    g->out_list = st->out.split ? NULL : st->out.views;
    g->transa = v[TRANSA].i != 0;
    g->transb = v[TRANSB].i != 0;
    g->a_scaling = (sf_gemm_scaling)v[A_SCALING].i;
    g->b_scaling = (sf_gemm_scaling)v[B_SCALING].i;
    g->bias_list = st->bias.given ? st->bias.views : NULL;
    g->bgrad = v[BGRAD].i != 0;
    g->accumulate = v[ACCUMULATE].i != 0;
    g->fast_accum = v[FAST_ACCUM].i != 0;
    g->allow_tf32 = v[ALLOW_TF32].i != 0;
    g->workspace = v[WORKSPACE].t;
    v[SPLITS].p = g;
    return 0;
}

static void grouped_cleanup(sf_py_frame *f)
{
    grouped_state *st;
    memcpy(&st, f->scratch, sizeof st);
    if (st == NULL)
        return;
    sf_py_list_free(&st->scale_list[0]);
    sf_py_list_free(&st->scale_list[1]);
    operand_free(&st->a);
    operand_free(&st->b);
    operand_free(&st->out);
    operand_free(&st->bias);
    PyMem_Free(st->m);
    PyMem_Free(st);
}

static sf_status grouped_call(sf_py_value *v, sf_stream s)
{
    return sf_grouped_gemm(v[SPLITS].p, s);
}
SF_PY_BINDING_FULL(grouped_gemm, "grouped_gemm", grouped_args, grouped_call, grouped_prepare,
                   grouped_cleanup, NULL,
                   "Per group g, out_g = op(a_g) @ op(b_g). See seqfuse.ops.moe.grouped_gemm.");

const sf_py_binding *const sf_py_grouped_bindings[] = {&grouped_gemm_binding, NULL};
