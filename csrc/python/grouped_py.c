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
 * grouped_gemm_device_ends takes the groups' end rows as a tensor instead
 * (sf_grouped_gemm_device_ends; one SF_PY_OP line).
 */
#include "py_call.h"

/* One list-or-tensor argument (a, b, out, bias, a_scale_inv, b_scale_inv). */
typedef struct {
    int given;            /* not None */
    sf_tensor whole;      /* the one tensor given (split, stacked or per-tensor scales) */
    sf_tensor *views;     /* G views (listed or stacked), else NULL */
    int own_views;        /* views allocated here (stacked) */
    sf_py_tensor_list list;
} grouped_operand;

/* Argument positions in grouped_args. */
enum { A, B, OUT, SPLITS, TRANSA, TRANSB, SA, SB, A_SCALING, B_SCALING, BIAS, BGRAD, ACCUMULATE,
       FAST_ACCUM, ALLOW_TF32, WORKSPACE, LANES, KERNEL };

/* The list-or-tensor arguments, in the order they are imported. */
enum { OP_A, OP_B, OP_OUT, OP_BIAS, OP_SA, OP_SB, N_OPERANDS };
static const struct {
    int at;
    const char *name;
} operands[N_OPERANDS] = {{A, "a"},       {B, "b"},           {OUT, "out"},
                          {BIAS, "bias"}, {SA, "a_scale_inv"}, {SB, "b_scale_inv"}};

/* What the prepare hook builds: m_splits (G host ints), the operands and the
 * C argument block. */
typedef struct {
    int64_t *m;
    grouped_operand op[N_OPERANDS];
    sf_grouped_gemm_args g;
    const char *kernel_note; /* the C entry's: why a call of the sm90 kernel's form did not take it, or NULL */
} grouped_state;

/* None, a list / tuple of G tensors (imported as views), or one tensor. */
static int operand_import(sf_py_frame *f, PyObject *obj, const char *name, Py_ssize_t G,
                          grouped_operand *o)
{
    if (obj == Py_None)
        return 0;
    o->given = 1;
    if (!PyList_Check(obj) && !PyTuple_Check(obj))
        return sf_py_tensor(&f->call, obj, name, &o->whole);
    if (sf_py_list_import(&f->call, f->stream_obj, obj, name, &o->list) < 0)
        return -1;
    if (o->list.n != G) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must hold num_groups = %zd tensors "
                     "(one per group), got %zd", f->b->op, name, G, o->list.n);
        return -1;
    }
    o->views = o->list.views;
    return 0;
}

/* a, b and out given as one tensor: 2-D is split by m_splits (no views), 3-D
 * [G, rows, cols] is G stacked matrices; bias (`vec`) as one tensor is G
 * stacked rows [G, n].  Makes the stacked ones' G views. */
static int operand_unstack(const char *op, const char *name, int G, int vec, grouped_operand *o)
{
    if (!o->given || o->views != NULL || (!vec && o->whole.ndim == 2))
        return 0;
    if (o->whole.ndim != (vec ? 2 : 3)) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be %s, got a %d-D tensor", op, name,
                     vec ? "a list of num_groups 1-D tensors or one 2-D [num_groups, n] tensor"
                         : "a 2-D tensor (split by m_splits), a 3-D [num_groups, rows, cols] tensor "
                           "or a list of num_groups 2-D tensors",
                     o->whole.ndim);
        return -1;
    }
    if (o->whole.shape[0] != G) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' stacks %lld matrices along dim 0 but "
                     "num_groups = len(m_splits) = %d", op, name, (long long)o->whole.shape[0], G);
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

/* The operand's one tensor where it came as one and was not unstacked (a
 * split operand, per-tensor scales), else NULL. */
static const sf_tensor *whole_of(const grouped_operand *o)
{
    return o->given && o->views == NULL ? &o->whole : NULL;
}

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
static const sf_py_arg grouped_args[] = {
    SF_OBJ(a),          SF_OBJ(b),          SF_OBJ(out),         SF_OBJ(m_splits),
    SF_INT(transa),     SF_INT(transb),     SF_OBJ(a_scale_inv), SF_OBJ(b_scale_inv),
    SF_INT(a_scaling),  SF_INT(b_scaling),  SF_OBJ(bias),        SF_INT(bgrad),
    SF_INT(accumulate), SF_INT(fast_accum), SF_INT(allow_tf32),  SF_OT(workspace),
    SF_INT(lanes),      SF_INT(kernel),     SF_STREAM};

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
    grouped_operand *op = st->op;
    for (int k = 0; k < N_OPERANDS; ++k)
        if (operand_import(f, v[operands[k].at].o, operands[k].name, G, &op[k]) < 0 ||
            (k <= OP_BIAS &&
             operand_unstack(f->b->op, operands[k].name, (int)G, k == OP_BIAS, &op[k]) < 0))
            return -1;
    if (!op[OP_A].given || !op[OP_B].given || !op[OP_OUT].given) {
        PyErr_Format(PyExc_ValueError, "%s: arguments 'a', 'b' and 'out' are required", f->b->op);
        return -1;
    }
    st->g = (sf_grouped_gemm_args){
        .num_groups = (int)G, .m_splits = st->m,
        .a = whole_of(&op[OP_A]), .a_list = op[OP_A].views,
        .b = whole_of(&op[OP_B]), .b_list = op[OP_B].views,
        .out = whole_of(&op[OP_OUT]), .out_list = op[OP_OUT].views,
        .transa = v[TRANSA].i != 0, .transb = v[TRANSB].i != 0,
        .a_scale_inv = whole_of(&op[OP_SA]), .a_scale_list = op[OP_SA].views,
        .b_scale_inv = whole_of(&op[OP_SB]), .b_scale_list = op[OP_SB].views,
        .a_scaling = (sf_gemm_scaling)v[A_SCALING].i, .b_scaling = (sf_gemm_scaling)v[B_SCALING].i,
        .bias_list = op[OP_BIAS].views, .bgrad = v[BGRAD].i != 0,
        .accumulate = v[ACCUMULATE].i != 0, .fast_accum = v[FAST_ACCUM].i != 0,
        .allow_tf32 = v[ALLOW_TF32].i != 0, .workspace = v[WORKSPACE].t, .lanes = (int)v[LANES].i,
        .kernel = (int)v[KERNEL].i, .kernel_note = &st->kernel_note};
    v[SPLITS].p = &st->g;
    return 0;
}

static void grouped_cleanup(sf_py_frame *f)
{
    grouped_state *st;
    memcpy(&st, f->scratch, sizeof st);
    if (st == NULL)
        return;
    for (int k = 0; k < N_OPERANDS; ++k) {
        if (st->op[k].own_views)
            PyMem_Free(st->op[k].views);
        sf_py_list_free(&st->op[k].list);
    }
    PyMem_Free(st->m);
    PyMem_Free(st);
}

static sf_status grouped_call(sf_py_value *v, sf_stream s)
{
    return sf_grouped_gemm(v[SPLITS].p, s);
}
/* The result: why a call of the sm90 kernel's form did not take it (the C
 * entry's static string), else None (it ran, or the call is not of its form). */
static PyObject *grouped_result(sf_py_frame *f)
{
    grouped_state *st;
    memcpy(&st, f->scratch, sizeof st);
    if (!st->kernel_note)
        Py_RETURN_NONE;
    return PyUnicode_FromString(st->kernel_note);
}
SF_PY_BINDING_FULL(grouped_gemm, "grouped_gemm", grouped_args, grouped_call, grouped_prepare,
                   grouped_cleanup, grouped_result,
                   "Per group g, out_g = op(a_g) @ op(b_g); returns why a call of the sm90 kernel's "
                   "form did not take it, else None. See seqfuse.ops.moe.grouped_gemm.");

SF_PY_OP(grouped_gemm_device_ends, sf_grouped_gemm_device_ends,
         "Per group g, out[rows of g] = a[rows of g] @ b[g]^T, the groups' end rows in row_end (read on the "
         "device on CUDA). See seqfuse.ops.moe.grouped_gemm_device.",
         (T, a), (T, b), (T, row_end), (OT, a_scale_inv), (OT, b_scale_inv), (T, out));

const sf_py_binding *const sf_py_grouped_bindings[] = {&grouped_gemm_binding, &grouped_gemm_device_ends_binding,
                                                       NULL};
