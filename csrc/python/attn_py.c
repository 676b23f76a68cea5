/*
 * attn_py.c - bindings of the attn family (fused attention forward and
 * backward, csrc/attn/).  The attention configuration travels as one tuple
 * of plain numbers so each call parses it in a few C calls:
 *   cfg = (format, mask, window_left, window_right, softmax_scale,
 *          max_seqlen_q, max_seqlen_kv, deterministic,
 *          dropout_p, dropout_seed, dropout_offset)
 */
#include <limits.h>

#include "py_call.h"
#include "attn/attn_sm90.h"

enum { kCfgLen = 11, kCfgScale = 4, kCfgDropout = 8, kCfgSeed = 9, kCfgOffset = 10 };

static int parse_config(const char *op, PyObject *obj, sf_attn_config *cfg)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != kCfgLen) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'cfg' must be a tuple of %d numbers", op, kCfgLen);
        return -1;
    }
    /* the integer entries, named as the Python API names them; each must fit
     * the C int the kernels take (window sizes: -1 for unbounded) */
    static const char *const names[kCfgScale + 4] = {
        "qkv_format", "attn_mask_type", "window_size[0]", "window_size[1]", NULL,
        "max_seqlen_q", "max_seqlen_kv", "deterministic"};
    long v[kCfgScale + 4];
    for (int i = 0; i < kCfgScale + 4; ++i) {
        if (i == kCfgScale)
            continue;
        PyObject *item = PyTuple_GET_ITEM(obj, i);
        v[i] = PyLong_AsLong(item);
        if (v[i] == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear();
            v[i] = LONG_MAX; /* reported below with the value itself */
        }
        const long low = (i == 2 || i == 3) ? -1 : 0;
        if (v[i] < low || v[i] > 0x7fffffffL) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be in [%ld, 2**31 - 1] (the "
                         "kernels count in 32-bit ints), got %S",
                         op, names[i], low, item);
            return -1;
        }
    }
    double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, kCfgScale));
    if (scale == -1.0 && PyErr_Occurred())
        return -1;
    double dropout = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, kCfgDropout));
    if (dropout == -1.0 && PyErr_Occurred())
        return -1;
    unsigned long long rng[2];
    static const char *const rng_names[2] = {"dropout_seed", "dropout_offset"};
    for (int i = 0; i < 2; ++i) {
        rng[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(obj, kCfgSeed + i));
        if (rng[i] == (unsigned long long)-1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "%s: config entry %d (%s) must be in [0, 2**64)", op,
                             kCfgSeed + i, rng_names[i]);
            }
            return -1;
        }
    }
    cfg->format = (sf_attn_format)v[0];
    cfg->mask = (sf_attn_mask)v[1];
    cfg->window_left = (int)v[2];
    cfg->window_right = (int)v[3];
    cfg->softmax_scale = (float)scale;
    cfg->max_seqlen_q = (int)v[5];
    cfg->max_seqlen_kv = (int)v[6];
    cfg->deterministic = (int)v[7];
    cfg->dropout_p = dropout;
    cfg->dropout_seed = (uint64_t)rng[0];
    cfg->dropout_offset = (uint64_t)rng[1];
    return 0;
}

/* The common opening: nargs (the config at position cfg_at, the stream
 * after it), the config, then the call and every tensor of spec
 * (sf_py_begin).  0 on success (end with sf_py_finish), -1 with an exception
 * set and nothing borrowed. */
static int begin_call(const char *op, PyObject *const *args, Py_ssize_t nargs, int cfg_at,
                      const sf_py_tensor_arg *spec, int n, sf_attn_config *cfg, sf_py_args *a)
{
    if (sf_py_check_nargs(op, nargs, cfg_at + 1, cfg_at + 2) < 0 || parse_config(op, args[cfg_at], cfg) < 0)
        return -1;
    return sf_py_begin(a, op, args, nargs, cfg_at + 1, spec, n);
}

/* attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, cfg, stream=None) */
static PyObject *py_attn_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_fwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "q", 0}, {1, "k", 0}, {2, "v", 0}, {3, "cu_seqlens_q", 1}, {4, "cu_seqlens_kv", 1},
        {5, "out", 0}, {6, "lse", 0},
    };
    enum { Q, K, V, CUQ, CUK, OUT, LSE };
    sf_attn_config cfg;
    sf_py_args a;
    if (begin_call(op, args, nargs, 7, spec, SF_PY_NARGS(spec), &cfg, &a) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_fwd(a.t[Q], a.t[K], a.t[V], a.t[CUQ], a.t[CUK], &cfg, a.t[OUT], a.t[LSE],
                     sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv,
 *          dq_accum, delta, cfg, stream=None) */
static PyObject *py_attn_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_bwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "q", 0}, {1, "k", 0}, {2, "v", 0}, {3, "out", 0}, {4, "dout", 0}, {5, "lse", 0},
        {6, "cu_seqlens_q", 1}, {7, "cu_seqlens_kv", 1}, {8, "dq", 0}, {9, "dk", 0}, {10, "dv", 0},
        {11, "dq_accum", 0}, {12, "delta", 0},
    };
    enum { Q, K, V, OUT, DOUT, LSE, CUQ, CUK, DQ, DK, DV, ACC, DELTA };
    sf_attn_config cfg;
    sf_py_args a;
    if (begin_call(op, args, nargs, 13, spec, SF_PY_NARGS(spec), &cfg, &a) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_bwd(a.t[Q], a.t[K], a.t[V], a.t[OUT], a.t[DOUT], a.t[LSE], a.t[CUQ], a.t[CUK], &cfg,
                     a.t[DQ], a.t[DK], a.t[DV], a.t[ACC], a.t[DELTA], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* attn_set_fwd_kernel(arch) / attn_set_bwd_kernel(arch): the CUDA forward
 * / backward on Hopper, 90 (wgmma) or 80 (mma.sync);
 * attn_set_fwd_sm90_variant(v): the wgmma forward's schedule;
 * attn_fwd_kernel_for(head_dim, device, dropout=0) and
 * attn_bwd_kernel_for(head_dim, device, deterministic, dropout=0) ->
 * (arch, reason): which kernel a call takes (attn_sm90.h).  Tests,
 * benchmarks and the once-per-reason log of ops/attn.py. */
static PyObject *py_attn_set_int(const char *op, const char *name, PyObject *arg, sf_status (*set)(int))
{
    long v;
    if (sf_py_arg_long(op, name, arg, &v) < 0)
        return NULL;
#ifdef SF_WITH_CUDA
    sf_status st = set((int)v);
#else
    (void)set;
    sf_status st = sf_fail(SF_ERR_NOT_IMPLEMENTED, "attention: the kernel choice exists only in a CUDA build");
#endif
    if (st != SF_OK)
        return sf_py_raise(st);
    Py_RETURN_NONE;
}

#ifndef SF_WITH_CUDA
#define sf_attn_set_fwd_kernel NULL
#define sf_attn_set_fwd_sm90_variant NULL
#define sf_attn_set_bwd_kernel NULL
#endif

static PyObject *py_attn_set_fwd_kernel(PyObject *self, PyObject *arg)
{
    (void)self;
    return py_attn_set_int("attn_set_fwd_kernel", "arch", arg, sf_attn_set_fwd_kernel);
}

static PyObject *py_attn_set_fwd_sm90_variant(PyObject *self, PyObject *arg)
{
    (void)self;
    return py_attn_set_int("attn_set_fwd_sm90_variant", "variant", arg, sf_attn_set_fwd_sm90_variant);
}

static PyObject *py_attn_set_bwd_kernel(PyObject *self, PyObject *arg)
{
    (void)self;
    return py_attn_set_int("attn_set_bwd_kernel", "arch", arg, sf_attn_set_bwd_kernel);
}

/* (arch, reason) of the forward (bwd 0; args head_dim, device[, dropout])
 * or the backward (bwd 1; head_dim, device, deterministic[, dropout]). */
static PyObject *kernel_for(PyObject *args, int bwd)
{
    int head_dim, device, deterministic = 0, dropout = 0;
    if (bwd ? !PyArg_ParseTuple(args, "iip|i", &head_dim, &device, &deterministic, &dropout)
            : !PyArg_ParseTuple(args, "ii|i", &head_dim, &device, &dropout))
        return NULL;
    const char *why = "";
    int arch = 80;
#ifdef SF_WITH_CUDA
    arch = bwd ? sf_attn_bwd_kernel_for(head_dim, deterministic, dropout, device, &why)
               : sf_attn_fwd_kernel_for(head_dim, dropout, device, &why);
#else
    (void)head_dim;
    (void)device;
#endif
    return Py_BuildValue("(is)", arch, why ? why : "");
}

static PyObject *py_attn_fwd_kernel_for(PyObject *self, PyObject *args)
{
    (void)self;
    return kernel_for(args, 0);
}

static PyObject *py_attn_bwd_kernel_for(PyObject *self, PyObject *args)
{
    (void)self;
    return kernel_for(args, 1);
}

PyMethodDef sf_py_attn_methods[] = {
    {"attn_set_fwd_kernel", py_attn_set_fwd_kernel, METH_O,
     "attn_set_fwd_kernel(arch): CUDA forward kernel on Hopper, 90 (wgmma) or 80 (mma.sync)."},
    {"attn_set_fwd_sm90_variant", py_attn_set_fwd_sm90_variant, METH_O,
     "attn_set_fwd_sm90_variant(v): wgmma forward schedule, 0 (in order), 1 (softmax overlapped with P V), "
     "2 (1 warp-specialized: producer warpgroup, mbarrier pipeline), 3 (2 + consumer ping-pong) "
     "or 4 (3 with three consumer warpgroups of 192 rows at head dim 64)."},
    {"attn_fwd_kernel_for", py_attn_fwd_kernel_for, METH_VARARGS,
     "attn_fwd_kernel_for(head_dim, device, dropout=0) -> (arch, reason): the forward kernel a call takes."},
    {"attn_set_bwd_kernel", py_attn_set_bwd_kernel, METH_O,
     "attn_set_bwd_kernel(arch): CUDA backward kernel on Hopper, 90 (wgmma) or 80 (mma.sync)."},
    {"attn_bwd_kernel_for", py_attn_bwd_kernel_for, METH_VARARGS,
     "attn_bwd_kernel_for(head_dim, device, deterministic, dropout=0) -> (arch, reason): the backward kernel a "
     "call takes."},
    {"attn_fwd", SF_PY_FASTCALL(py_attn_fwd),
     "attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, cfg, stream=None): "
     "fused attention forward into out and lse (float32)."},
    {"attn_bwd", SF_PY_FASTCALL(py_attn_bwd),
     "attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv, dq_accum, "
     "delta, cfg, stream=None): fused attention backward."},
    {NULL, NULL, 0, NULL},
};
