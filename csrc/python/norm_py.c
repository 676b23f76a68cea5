/*
 * norm_py.c - bindings of the norm family (LayerNorm and RMSNorm, forward and
 * backward, csrc/norm/).  Optional tensors are passed as None.  Each binding
 * imports its tensors, calls one sf_* function with the GIL released and
 * turns a failing status into the matching Python exception.
 */
#include "py_call.h"

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
    static const sf_py_tensor_arg spec[] = {
        {0, "x", 0},    {1, "gamma", 0}, {2, "beta", 1},  {5, "y", 0},         {6, "mean", 1},
        {7, "rstd", 1}, {8, "scale", 1}, {9, "amax", 1}, {10, "scale_inv", 1}};
    enum { X, GAMMA, BETA, Y, MEAN, RSTD, SCALE, AMAX, SCALE_INV };
    if (sf_py_check_nargs(op, nargs, 11, 12) < 0)
        return NULL;
    float eps;
    int zc;
    sf_py_args a;
    if (sf_py_arg_float(op, "eps", args[3], &eps) < 0 || arg_bool(args[4], &zc) < 0 ||
        sf_py_begin(&a, op, args, nargs, 11, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_layernorm_fwd(a.t[X], a.t[GAMMA], a.t[BETA], eps, zc, a.t[Y], a.t[MEAN], a.t[RSTD],
                          a.t[SCALE], a.t[AMAX], a.t[SCALE_INV], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* rmsnorm_fwd(x, gamma, eps, zero_centered_gamma, y, rstd, scale, amax,
 *             scale_inv, stream=None) */
static PyObject *py_rmsnorm_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "rmsnorm_fwd";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0},     {1, "gamma", 0}, {4, "y", 0},
                                            {5, "rstd", 1},  {6, "scale", 1}, {7, "amax", 1},
                                            {8, "scale_inv", 1}};
    enum { X, GAMMA, Y, RSTD, SCALE, AMAX, SCALE_INV };
    if (sf_py_check_nargs(op, nargs, 9, 10) < 0)
        return NULL;
    float eps;
    int zc;
    sf_py_args a;
    if (sf_py_arg_float(op, "eps", args[2], &eps) < 0 || arg_bool(args[3], &zc) < 0 ||
        sf_py_begin(&a, op, args, nargs, 9, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rmsnorm_fwd(a.t[X], a.t[GAMMA], eps, zc, a.t[Y], a.t[RSTD], a.t[SCALE], a.t[AMAX],
                        a.t[SCALE_INV], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* layernorm_bwd(dy, x, mean, rstd, gamma, zero_centered_gamma, dx, dgamma,
 *               dbeta, workspace, stream=None) */
static PyObject *py_layernorm_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "layernorm_bwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "dy", 0}, {1, "x", 0},      {2, "mean", 0},  {3, "rstd", 0},      {4, "gamma", 0},
        {6, "dx", 0}, {7, "dgamma", 0}, {8, "dbeta", 1}, {9, "workspace", 1}};
    enum { DY, X, MEAN, RSTD, GAMMA, DX, DGAMMA, DBETA, WS };
    if (sf_py_check_nargs(op, nargs, 10, 11) < 0)
        return NULL;
    int zc;
    sf_py_args a;
    if (arg_bool(args[5], &zc) < 0 ||
        sf_py_begin(&a, op, args, nargs, 10, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_layernorm_bwd(a.t[DY], a.t[X], a.t[MEAN], a.t[RSTD], a.t[GAMMA], zc, a.t[DX],
                          a.t[DGAMMA], a.t[DBETA], a.t[WS], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* rmsnorm_bwd(dy, x, rstd, gamma, zero_centered_gamma, dx, dgamma, workspace,
 *             stream=None) */
static PyObject *py_rmsnorm_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "rmsnorm_bwd";
    static const sf_py_tensor_arg spec[] = {{0, "dy", 0},    {1, "x", 0},  {2, "rstd", 0},
                                            {3, "gamma", 0}, {5, "dx", 0}, {6, "dgamma", 0},
                                            {7, "workspace", 1}};
    enum { DY, X, RSTD, GAMMA, DX, DGAMMA, WS };
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0)
        return NULL;
    int zc;
    sf_py_args a;
    if (arg_bool(args[4], &zc) < 0 ||
        sf_py_begin(&a, op, args, nargs, 8, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rmsnorm_bwd(a.t[DY], a.t[X], a.t[RSTD], a.t[GAMMA], zc, a.t[DX], a.t[DGAMMA], a.t[WS],
                        sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
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
