/*
 * attn_py.c - bindings of the attn family (fused attention forward and
 * backward, csrc/attn/).  The attention configuration travels as one tuple
 * of plain numbers so each call parses it in a few C calls:
 *   cfg = (format, mask, window_left, window_right, softmax_scale,
 *          max_seqlen_q, max_seqlen_kv, deterministic,
 *          dropout_p, dropout_seed, dropout_offset)
 */
#include "py_call.h"
#include "attn/attn_sm90.h"

enum { kCfgLen = 11, kCfgScale = 4, kCfgDropout = 8, kCfgSeed = 9, kCfgOffset = 10 };

static int parse_config(const char *op, PyObject *obj, sf_attn_config *cfg)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != kCfgLen) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'cfg' must be a tuple of %d numbers", op, kCfgLen);
        return -1;
    }
    long v[kCfgScale + 4];
    for (int i = 0; i < kCfgScale + 4; ++i) {
        if (i == kCfgScale)
            continue;
        v[i] = PyLong_AsLong(PyTuple_GET_ITEM(obj, i));
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
        if (v[i] < -1 || v[i] > 0x7fffffffL) {
            PyErr_Format(PyExc_ValueError, "%s: config entry %d out of range: %ld", op, i, v[i]);
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

/* A tensor argument: position, name, destination; `present` non-NULL marks
 * an optional one (None allowed, *present says whether it was given). */
typedef struct tensor_arg {
    int index;
    const char *name;
    sf_tensor *t;
    int *present;
} tensor_arg;

/* The common start of a call: nargs (the config at position n_tensors, the
 * stream after it), the config, the call and every tensor.  0 with the call
 * initialized (release or finish it), -1 with an exception set. */
static int begin_call(const char *op, PyObject *const *args, Py_ssize_t nargs, int n_tensors,
                      const tensor_arg *spec, sf_attn_config *cfg, sf_py_call *c)
{
    if (sf_py_check_nargs(op, nargs, n_tensors + 1, n_tensors + 2) < 0 ||
        parse_config(op, args[n_tensors], cfg) < 0 ||
        sf_py_call_init(c, op, nargs > n_tensors + 1 ? args[n_tensors + 1] : Py_None) < 0)
        return -1;
    for (int i = 0; i < n_tensors; ++i) {
        const tensor_arg *a = &spec[i];
        int rc = a->present ? sf_py_optional_tensor(c, args[a->index], a->name, a->t, a->present)
                            : sf_py_tensor(c, args[a->index], a->name, a->t);
        if (rc < 0) {
            sf_py_call_release(c);
            return -1;
        }
    }
    return 0;
}

/* attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, cfg, stream=None) */
static PyObject *py_attn_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_fwd";
    sf_tensor q, k, v, cuq, cuk, out, lse;
    int has_cuq = 0, has_cuk = 0;
    const tensor_arg spec[] = {
        {0, "q", &q, NULL}, {1, "k", &k, NULL}, {2, "v", &v, NULL},
        {3, "cu_seqlens_q", &cuq, &has_cuq}, {4, "cu_seqlens_kv", &cuk, &has_cuk},
        {5, "out", &out, NULL}, {6, "lse", &lse, NULL},
    };
    sf_attn_config cfg;
    sf_py_call c;
    if (begin_call(op, args, nargs, 7, spec, &cfg, &c) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_fwd(&q, &k, &v, has_cuq ? &cuq : NULL, has_cuk ? &cuk : NULL, &cfg, &out,
                     &lse, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv,
 *          dq_accum, delta, cfg, stream=None) */
static PyObject *py_attn_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_bwd";
    sf_tensor q, k, v, out, dout, lse, cuq, cuk, dq, dk, dv, acc, delta;
    int has_cuq = 0, has_cuk = 0;
    const tensor_arg spec[] = {
        {0, "q", &q, NULL}, {1, "k", &k, NULL}, {2, "v", &v, NULL}, {3, "out", &out, NULL},
        {4, "dout", &dout, NULL}, {5, "lse", &lse, NULL},
        {6, "cu_seqlens_q", &cuq, &has_cuq}, {7, "cu_seqlens_kv", &cuk, &has_cuk},
        {8, "dq", &dq, NULL}, {9, "dk", &dk, NULL}, {10, "dv", &dv, NULL},
        {11, "dq_accum", &acc, NULL}, {12, "delta", &delta, NULL},
    };
    sf_attn_config cfg;
    sf_py_call c;
    if (begin_call(op, args, nargs, 13, spec, &cfg, &c) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_bwd(&q, &k, &v, &out, &dout, &lse, has_cuq ? &cuq : NULL,
                     has_cuk ? &cuk : NULL, &cfg, &dq, &dk, &dv, &acc, &delta,
                     sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
}

/* attn_set_fwd_kernel(arch) / attn_set_bwd_kernel(arch): the CUDA forward
 * / backward on Hopper, 90 (wgmma) or 80 (mma.sync);
 * attn_set_fwd_sm90_variant(v): the wgmma forward's schedule;
 * attn_fwd_kernel_for(head_dim, device, dropout=0) and
 * attn_bwd_kernel_for(head_dim, device, deterministic, dropout=0) ->
 * (arch, reason): which kernel a call takes (attn_sm90.h).  Tests,
 * benchmarks and the once-per-reason log of ops/attn.py. */
static PyObject *py_attn_set_int(PyObject *arg, sf_status (*set)(int))
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
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
    return py_attn_set_int(arg, sf_attn_set_fwd_kernel);
}

static PyObject *py_attn_set_fwd_sm90_variant(PyObject *self, PyObject *arg)
{
    (void)self;
    return py_attn_set_int(arg, sf_attn_set_fwd_sm90_variant);
}

static PyObject *py_attn_set_bwd_kernel(PyObject *self, PyObject *arg)
{
    (void)self;
    return py_attn_set_int(arg, sf_attn_set_bwd_kernel);
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
