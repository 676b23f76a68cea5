/*
 * act_py.c - bindings of the act family (activations and their gradients,
 * bias + dropout + residual, csrc/act/).  Optional tensors are passed as
 * None; the activation is its sf_activation number (seqfuse.ops.act names
 * them).
 */
#include "py_call.h"

static int arg_u64(const char *op, const char *name, PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be an int in [0, 2**64), got %R", op,
                     name, o);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* act_fwd(activation, x, y, scale, amax, scale_inv, stream=None)
 * act_bwd(activation, dy, x, dx, scale, amax, scale_inv, stream=None) */
static PyObject *act_call(PyObject *const *args, Py_ssize_t nargs, int backward)
{
    static const sf_py_tensor_arg fwd[] = {
        {1, "x", 0}, {2, "y", 0}, {3, "scale", 1}, {4, "amax", 1}, {5, "scale_inv", 1}};
    static const sf_py_tensor_arg bwd[] = {{1, "dy", 0},    {2, "x", 0},    {3, "dx", 0},
                                           {4, "scale", 1}, {5, "amax", 1}, {6, "scale_inv", 1}};
    const char *op = backward ? "act_bwd" : "act_fwd";
    const int n_fixed = backward ? 7 : 6;
    /* the tensors after dy (absent forward) stand at the same places in a.t */
    const int k = backward ? 1 : 0;
    enum { X, OUT, SCALE, AMAX, SCALE_INV };
    if (sf_py_check_nargs(op, nargs, n_fixed, n_fixed + 1) < 0)
        return NULL;
    long act;
    sf_py_args a;
    if (sf_py_arg_long(op, "activation", args[0], &act) < 0 ||
        sf_py_begin(&a, op, args, nargs, n_fixed, backward ? bwd : fwd,
                    backward ? SF_PY_NARGS(bwd) : SF_PY_NARGS(fwd)) < 0)
        return NULL;
    sf_tensor *const *t = a.t + k;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    if (backward)
        st = sf_act_bwd((sf_activation)act, a.t[0], t[X], t[OUT], t[SCALE], t[AMAX], t[SCALE_INV],
                        sf_py_call_stream(&a.call));
    else
        st = sf_act_fwd((sf_activation)act, t[X], t[OUT], t[SCALE], t[AMAX], t[SCALE_INV],
                        sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_act_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return act_call(args, nargs, 0);
}

static PyObject *py_act_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return act_call(args, nargs, 1);
}

/* The scalars of the dropout bindings: p, seed and offset from args[at],
 * args[at + 1], args[at + 2], after the argument count check (7, then the
 * optional stream). */
static int dropout_scalars(const char *op, PyObject *const *args, Py_ssize_t nargs, int at,
                           float *p, uint64_t *seed, uint64_t *offset)
{
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0)
        return -1;
    return sf_py_arg_float(op, "p", args[at], p) < 0 ||
                   arg_u64(op, "seed", args[at + 1], seed) < 0 ||
                   arg_u64(op, "offset", args[at + 2], offset) < 0
               ? -1
               : 0;
}

/* bias_dropout_add(x, bias, residual, p, seed, offset, out, stream=None) */
static PyObject *py_bias_dropout_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "bias_dropout_add";
    static const sf_py_tensor_arg spec[] = {
        {0, "x", 0}, {1, "bias", 1}, {2, "residual", 0}, {6, "out", 0}};
    enum { X, BIAS, RESIDUAL, OUT };
    float p;
    uint64_t seed, offset;
    sf_py_args a;
    if (dropout_scalars(op, args, nargs, 3, &p, &seed, &offset) < 0 ||
        sf_py_begin(&a, op, args, nargs, 7, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_bias_dropout_add_fwd(a.t[X], a.t[BIAS], a.t[RESIDUAL], p, seed, offset, a.t[OUT],
                                 sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* dropout_bwd(dy, p, seed, offset, dx, dbias, workspace, stream=None) */
static PyObject *py_dropout_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dropout_bwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "dy", 0}, {4, "dx", 0}, {5, "dbias", 1}, {6, "workspace", 1}};
    enum { DY, DX, DBIAS, WS };
    float p;
    uint64_t seed, offset;
    sf_py_args a;
    if (dropout_scalars(op, args, nargs, 1, &p, &seed, &offset) < 0 ||
        sf_py_begin(&a, op, args, nargs, 7, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dropout_bwd(a.t[DY], p, seed, offset, a.t[DX], a.t[DBIAS], a.t[WS],
                        sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* dropout_bwd_workspace_numel(dy) -> int */
static PyObject *py_dropout_bwd_workspace_numel(PyObject *self, PyObject *const *args,
                                                Py_ssize_t nargs)
{
    (void)self;
    return sf_py_numel_query("dropout_bwd_workspace_numel", "dy", args, nargs,
                             sf_dropout_bwd_workspace_numel);
}

PyMethodDef sf_py_act_methods[] = {
    {"act_fwd", SF_PY_FASTCALL(py_act_fwd),
     "act_fwd(activation, x, y, scale, amax, scale_inv, stream=None)"},
    {"act_bwd", SF_PY_FASTCALL(py_act_bwd),
     "act_bwd(activation, dy, x, dx, scale, amax, scale_inv, stream=None)"},
    {"bias_dropout_add", SF_PY_FASTCALL(py_bias_dropout_add),
     "bias_dropout_add(x, bias, residual, p, seed, offset, out, stream=None)"},
    {"dropout_bwd", SF_PY_FASTCALL(py_dropout_bwd),
     "dropout_bwd(dy, p, seed, offset, dx, dbias, workspace, stream=None)"},
    {"dropout_bwd_workspace_numel", SF_PY_FASTCALL(py_dropout_bwd_workspace_numel),
     "dropout_bwd_workspace_numel(dy) -> int: float32 elements of dbias workspace."},
    {NULL, NULL, 0, NULL},
};
