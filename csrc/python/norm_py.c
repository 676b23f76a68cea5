/*
 * norm_py.c - bindings of the norm family (LayerNorm and RMSNorm, forward and
 * backward, csrc/norm/).  Optional tensors are passed as None.  Each binding
 * imports its tensors, calls one sf_* function with the GIL released and
 * turns a failing status into the matching Python exception.
 */
#include "py_call.h"

/* Read a float / bool positional argument. */
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

static int arg_bool(PyObject *o, int *out)
{
    int v = PyObject_IsTrue(o);
    if (v < 0)
        return -1;
    *out = v;
    return 0;
}


/* layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma, y, mean, rstd,
 *               scale, amax, scale_inv, stream=None) */
static PyObject *py_layernorm_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "layernorm_fwd";
    if (sf_py_check_nargs(op, nargs, 11, 12) < 0)
        return NULL;
    float eps;
    int zc;
    if (arg_float(op, "eps", args[3], &eps) < 0 || arg_bool(args[4], &zc) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 11 ? args[11] : Py_None) < 0)
        return NULL;
    sf_tensor x, gamma, beta, y, mean, rstd, scale, amax, scale_inv;
    int has_beta, has_mean, has_rstd, has_scale, has_amax, has_si;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 ||
        sf_py_tensor(&c, args[1], "gamma", &gamma) < 0 ||
        sf_py_optional_tensor(&c, args[2], "beta", &beta, &has_beta) < 0 ||
        sf_py_tensor(&c, args[5], "y", &y) < 0 ||
        sf_py_optional_tensor(&c, args[6], "mean", &mean, &has_mean) < 0 ||
        sf_py_optional_tensor(&c, args[7], "rstd", &rstd, &has_rstd) < 0 ||
        sf_py_optional_tensor(&c, args[8], "scale", &scale, &has_scale) < 0 ||
        sf_py_optional_tensor(&c, args[9], "amax", &amax, &has_amax) < 0 ||
        sf_py_optional_tensor(&c, args[10], "scale_inv", &scale_inv, &has_si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_layernorm_fwd(&x, &gamma, has_beta ? &beta : NULL, eps, zc, &y,
                          has_mean ? &mean : NULL, has_rstd ? &rstd : NULL,
                          has_scale ? &scale : NULL, has_amax ? &amax : NULL,
                          has_si ? &scale_inv : NULL, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* rmsnorm_fwd(x, gamma, eps, zero_centered_gamma, y, rstd, scale, amax,
 *             scale_inv, stream=None) */
static PyObject *py_rmsnorm_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "rmsnorm_fwd";
    if (sf_py_check_nargs(op, nargs, 9, 10) < 0)
        return NULL;
    float eps;
    int zc;
    if (arg_float(op, "eps", args[2], &eps) < 0 || arg_bool(args[3], &zc) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 9 ? args[9] : Py_None) < 0)
        return NULL;
    sf_tensor x, gamma, y, rstd, scale, amax, scale_inv;
    int has_rstd, has_scale, has_amax, has_si;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 ||
        sf_py_tensor(&c, args[1], "gamma", &gamma) < 0 ||
        sf_py_tensor(&c, args[4], "y", &y) < 0 ||
        sf_py_optional_tensor(&c, args[5], "rstd", &rstd, &has_rstd) < 0 ||
        sf_py_optional_tensor(&c, args[6], "scale", &scale, &has_scale) < 0 ||
        sf_py_optional_tensor(&c, args[7], "amax", &amax, &has_amax) < 0 ||
        sf_py_optional_tensor(&c, args[8], "scale_inv", &scale_inv, &has_si) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rmsnorm_fwd(&x, &gamma, eps, zc, &y, has_rstd ? &rstd : NULL,
                        has_scale ? &scale : NULL, has_amax ? &amax : NULL,
                        has_si ? &scale_inv : NULL, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* layernorm_bwd(dy, x, mean, rstd, gamma, zero_centered_gamma, dx, dgamma,
 *               dbeta, workspace, stream=None) */
static PyObject *py_layernorm_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "layernorm_bwd";
    if (sf_py_check_nargs(op, nargs, 10, 11) < 0)
        return NULL;
    int zc;
    if (arg_bool(args[5], &zc) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 10 ? args[10] : Py_None) < 0)
        return NULL;
    sf_tensor dy, x, mean, rstd, gamma, dx, dgamma, dbeta, ws;
    int has_dbeta, has_ws;
    if (sf_py_tensor(&c, args[0], "dy", &dy) < 0 ||
        sf_py_tensor(&c, args[1], "x", &x) < 0 ||
        sf_py_tensor(&c, args[2], "mean", &mean) < 0 ||
        sf_py_tensor(&c, args[3], "rstd", &rstd) < 0 ||
        sf_py_tensor(&c, args[4], "gamma", &gamma) < 0 ||
        sf_py_tensor(&c, args[6], "dx", &dx) < 0 ||
        sf_py_tensor(&c, args[7], "dgamma", &dgamma) < 0 ||
        sf_py_optional_tensor(&c, args[8], "dbeta", &dbeta, &has_dbeta) < 0 ||
        sf_py_optional_tensor(&c, args[9], "workspace", &ws, &has_ws) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_layernorm_bwd(&dy, &x, &mean, &rstd, &gamma, zc, &dx, &dgamma,
                          has_dbeta ? &dbeta : NULL, has_ws ? &ws : NULL,
                          sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* rmsnorm_bwd(dy, x, rstd, gamma, zero_centered_gamma, dx, dgamma, workspace,
 *             stream=None) */
static PyObject *py_rmsnorm_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "rmsnorm_bwd";
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0)
        return NULL;
    int zc;
    if (arg_bool(args[4], &zc) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 8 ? args[8] : Py_None) < 0)
        return NULL;
    sf_tensor dy, x, rstd, gamma, dx, dgamma, ws;
    int has_ws;
    if (sf_py_tensor(&c, args[0], "dy", &dy) < 0 ||
        sf_py_tensor(&c, args[1], "x", &x) < 0 ||
        sf_py_tensor(&c, args[2], "rstd", &rstd) < 0 ||
        sf_py_tensor(&c, args[3], "gamma", &gamma) < 0 ||
        sf_py_tensor(&c, args[5], "dx", &dx) < 0 ||
        sf_py_tensor(&c, args[6], "dgamma", &dgamma) < 0 ||
        sf_py_optional_tensor(&c, args[7], "workspace", &ws, &has_ws) < 0) {
        sf_py_call_release(&c);
        return NULL;
    }
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rmsnorm_bwd(&dy, &x, &rstd, &gamma, zc, &dx, &dgamma, has_ws ? &ws : NULL,
                        sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* norm_bwd_workspace_numel(x) -> int */
static PyObject *py_norm_bwd_workspace_numel(PyObject *self, PyObject *const *args,
                                             Py_ssize_t nargs)
{
    (void)self;
    return sf_py_numel_query("norm_bwd_workspace_numel", "x", args, nargs,
                             sf_norm_bwd_workspace_numel);
}

PyMethodDef sf_py_norm_methods[] = {
    {"layernorm_fwd", SF_PY_FASTCALL(py_layernorm_fwd),
     "layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma, y, mean, rstd, scale, amax, "
     "scale_inv, stream=None)"},
    {"rmsnorm_fwd", SF_PY_FASTCALL(py_rmsnorm_fwd),
     "rmsnorm_fwd(x, gamma, eps, zero_centered_gamma, y, rstd, scale, amax, scale_inv, "
     "stream=None)"},
    {"layernorm_bwd", SF_PY_FASTCALL(py_layernorm_bwd),
     "layernorm_bwd(dy, x, mean, rstd, gamma, zero_centered_gamma, dx, dgamma, dbeta, "
     "workspace, stream=None)"},
    {"rmsnorm_bwd", SF_PY_FASTCALL(py_rmsnorm_bwd),
     "rmsnorm_bwd(dy, x, rstd, gamma, zero_centered_gamma, dx, dgamma, workspace, "
     "stream=None)"},
    {"norm_bwd_workspace_numel", SF_PY_FASTCALL(py_norm_bwd_workspace_numel),
     "norm_bwd_workspace_numel(x) -> int: float32 elements of backward workspace."},
    {NULL, NULL, 0, NULL},
};
