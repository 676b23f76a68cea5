/*
 * act_py.c - bindings of the act family (activations and their gradients,
 * bias + dropout + residual, csrc/act/).  Optional tensors are passed as
 * None; the activation is its sf_activation number (seqfuse.ops.act names
 * them).
 */
#include "py_call.h"

static int arg_int(const char *op, const char *name, PyObject *o, long *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be an int, got %s", op, name,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = v;
    return 0;
}

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

static int arg_float(const char *op, const char *name, PyObject *o, float *out)
{
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be a float, got %s", op, name,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (float)v;
    return 0;
}


/* act_fwd(activation, x, y, scale, amax, scale_inv, stream=None)
 * act_bwd(activation, dy, x, dx, scale, amax, scale_inv, stream=None) */
static PyObject *act_call(PyObject *const *args, Py_ssize_t nargs, int backward)
{
    const char *op = backward ? "act_bwd" : "act_fwd";
    const Py_ssize_t n_fixed = backward ? 7 : 6;
    if (sf_py_check_nargs(op, nargs, n_fixed, n_fixed + 1) < 0)
        return NULL;
    long act;
    if (arg_int(op, "activation", args[0], &act) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > n_fixed ? args[n_fixed] : Py_None) < 0)
        return NULL;
    sf_tensor dy, x, out, scale, amax, si;
    int has_scale, has_amax, has_si;
    int k = 1;
    if ((backward && sf_py_tensor(&c, args[k++], "dy", &dy) < 0) ||
        sf_py_tensor(&c, args[k++], "x", &x) < 0 ||
        sf_py_tensor(&c, args[k++], backward ? "dx" : "y", &out) < 0 ||
        sf_py_optional_tensor(&c, args[k++], "scale", &scale, &has_scale) < 0 ||
        sf_py_optional_tensor(&c, args[k++], "amax", &amax, &has_amax) < 0 ||
        sf_py_optional_tensor(&c, args[k++], "scale_inv", &si, &has_si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    if (backward)
        st = sf_act_bwd((sf_activation)act, &dy, &x, &out, has_scale ? &scale : NULL,
                        has_amax ? &amax : NULL, has_si ? &si : NULL, sf_py_call_stream(&c));
    else
        st = sf_act_fwd((sf_activation)act, &x, &out, has_scale ? &scale : NULL,
                        has_amax ? &amax : NULL, has_si ? &si : NULL, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
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

/* bias_dropout_add(x, bias, residual, p, seed, offset, out, stream=None) */
static PyObject *py_bias_dropout_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "bias_dropout_add";
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0)
        return NULL;
    float p;
    uint64_t seed, offset;
    if (arg_float(op, "p", args[3], &p) < 0 || arg_u64(op, "seed", args[4], &seed) < 0 ||
        arg_u64(op, "offset", args[5], &offset) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 7 ? args[7] : Py_None) < 0)
        return NULL;
    sf_tensor x, bias, residual, out;
    int has_bias;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 ||
        sf_py_optional_tensor(&c, args[1], "bias", &bias, &has_bias) < 0 ||
        sf_py_tensor(&c, args[2], "residual", &residual) < 0 ||
        sf_py_tensor(&c, args[6], "out", &out) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_bias_dropout_add_fwd(&x, has_bias ? &bias : NULL, &residual, p, seed, offset, &out,
                                 sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* dropout_bwd(dy, p, seed, offset, dx, dbias, workspace, stream=None) */
static PyObject *py_dropout_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "dropout_bwd";
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0)
        return NULL;
    float p;
    uint64_t seed, offset;
    if (arg_float(op, "p", args[1], &p) < 0 || arg_u64(op, "seed", args[2], &seed) < 0 ||
        arg_u64(op, "offset", args[3], &offset) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 7 ? args[7] : Py_None) < 0)
        return NULL;
    sf_tensor dy, dx, dbias, ws;
    int has_dbias, has_ws;
    if (sf_py_tensor(&c, args[0], "dy", &dy) < 0 ||
        sf_py_tensor(&c, args[4], "dx", &dx) < 0 ||
        sf_py_optional_tensor(&c, args[5], "dbias", &dbias, &has_dbias) < 0 ||
        sf_py_optional_tensor(&c, args[6], "workspace", &ws, &has_ws) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_dropout_bwd(&dy, p, seed, offset, &dx, has_dbias ? &dbias : NULL,
                        has_ws ? &ws : NULL, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
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
