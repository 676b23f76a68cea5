/*
 * attn_py.c - bindings of the attn family (fused attention forward and
 * backward, csrc/attn/).  The attention configuration travels as one tuple
 * of plain numbers so each call parses it in a few C calls:
 *   cfg = (format, mask, window_left, window_right, softmax_scale,
 *          max_seqlen_q, max_seqlen_kv, deterministic)
 */
#include "py_call.h"
#include "attn/attn_sm90.h"

static int parse_config(const char *op, PyObject *obj, sf_attn_config *cfg)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 8) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'cfg' must be a tuple of 8 numbers", op);
        return -1;
    }
    long v[8];
    for (int i = 0; i < 8; ++i) {
        if (i == 4)
            continue;
        v[i] = PyLong_AsLong(PyTuple_GET_ITEM(obj, i));
        if (v[i] == -1 && PyErr_Occurred())
            return -1;
        if (v[i] < -1 || v[i] > 0x7fffffffL) {
            PyErr_Format(PyExc_ValueError, "%s: config entry %d out of range: %ld", op, i, v[i]);
            return -1;
        }
    }
    double scale = PyFloat_AsDouble(PyTuple_GET_ITEM(obj, 4));
    if (scale == -1.0 && PyErr_Occurred())
        return -1;
    cfg->format = (sf_attn_format)v[0];
    cfg->mask = (sf_attn_mask)v[1];
    cfg->window_left = (int)v[2];
    cfg->window_right = (int)v[3];
    cfg->softmax_scale = (float)scale;
    cfg->max_seqlen_q = (int)v[5];
    cfg->max_seqlen_kv = (int)v[6];
    cfg->deterministic = (int)v[7];
    return 0;
}

/* attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, cfg, stream=None) */
static PyObject *py_attn_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_fwd";
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0)
        return NULL;
    sf_attn_config cfg;
    if (parse_config(op, args[7], &cfg) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 8 ? args[8] : Py_None) < 0)
        return NULL;
    sf_tensor q, k, v, cuq, cuk, out, lse;
    int has_cuq = 0, has_cuk = 0;
    if (sf_py_tensor(&c, args[0], "q", &q) < 0 || sf_py_tensor(&c, args[1], "k", &k) < 0 ||
        sf_py_tensor(&c, args[2], "v", &v) < 0 ||
        sf_py_optional_tensor(&c, args[3], "cu_seqlens_q", &cuq, &has_cuq) < 0 ||
        sf_py_optional_tensor(&c, args[4], "cu_seqlens_kv", &cuk, &has_cuk) < 0 ||
        sf_py_tensor(&c, args[5], "out", &out) < 0 || sf_py_tensor(&c, args[6], "lse", &lse) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_fwd(&q, &k, &v, has_cuq ? &cuq : NULL, has_cuk ? &cuk : NULL, &cfg, &out,
                     &lse, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
}

/* attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv,
 *          dq_accum, delta, cfg, stream=None) */
static PyObject *py_attn_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "attention_bwd";
    if (sf_py_check_nargs(op, nargs, 14, 15) < 0)
        return NULL;
    sf_attn_config cfg;
    if (parse_config(op, args[13], &cfg) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 14 ? args[14] : Py_None) < 0)
        return NULL;
    sf_tensor q, k, v, out, dout, lse, cuq, cuk, dq, dk, dv, acc, delta;
    int has_cuq = 0, has_cuk = 0;
    if (sf_py_tensor(&c, args[0], "q", &q) < 0 || sf_py_tensor(&c, args[1], "k", &k) < 0 ||
        sf_py_tensor(&c, args[2], "v", &v) < 0 || sf_py_tensor(&c, args[3], "out", &out) < 0 ||
        sf_py_tensor(&c, args[4], "dout", &dout) < 0 ||
        sf_py_tensor(&c, args[5], "lse", &lse) < 0 ||
        sf_py_optional_tensor(&c, args[6], "cu_seqlens_q", &cuq, &has_cuq) < 0 ||
        sf_py_optional_tensor(&c, args[7], "cu_seqlens_kv", &cuk, &has_cuk) < 0 ||
        sf_py_tensor(&c, args[8], "dq", &dq) < 0 || sf_py_tensor(&c, args[9], "dk", &dk) < 0 ||
        sf_py_tensor(&c, args[10], "dv", &dv) < 0 ||
        sf_py_tensor(&c, args[11], "dq_accum", &acc) < 0 ||
        sf_py_tensor(&c, args[12], "delta", &delta) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_attn_bwd(&q, &k, &v, &out, &dout, &lse, has_cuq ? &cuq : NULL,
                     has_cuk ? &cuk : NULL, &cfg, &dq, &dk, &dv, &acc, &delta,
                     sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
}

/* attn_set_fwd_kernel(arch) / attn_set_bwd_kernel(arch): the CUDA forward
 * / backward on Hopper, 90 (wgmma) or 80 (mma.sync);
 * attn_set_fwd_sm90_variant(v): the wgmma forward's schedule;
 * attn_fwd_kernel_for(head_dim, device) and attn_bwd_kernel_for(head_dim,
 * device, deterministic) -> (arch, reason): which kernel a call takes
 * (attn_sm90.h).  Tests, benchmarks and the once-per-reason log of
 * ops/attn.py. */
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

static PyObject *py_attn_bwd_kernel_for(PyObject *self, PyObject *args)
{
    (void)self;
    int head_dim, device, deterministic;
    if (!PyArg_ParseTuple(args, "iip", &head_dim, &device, &deterministic))
        return NULL;
    const char *why = "";
    int arch = 80;
#ifdef SF_WITH_CUDA
    arch = sf_attn_bwd_kernel_for(head_dim, deterministic, device, &why);
#endif
    return Py_BuildValue("(is)", arch, why ? why : "");
}

static PyObject *py_attn_fwd_kernel_for(PyObject *self, PyObject *args)
{
    (void)self;
    int head_dim, device;
    if (!PyArg_ParseTuple(args, "ii", &head_dim, &device))
        return NULL;
    const char *why = "";
    int arch = 80;
#ifdef SF_WITH_CUDA
    arch = sf_attn_fwd_kernel_for(head_dim, device, &why);
#endif
    return Py_BuildValue("(is)", arch, why ? why : "");
}

PyMethodDef sf_py_attn_methods[] = {
    {"attn_set_fwd_kernel", py_attn_set_fwd_kernel, METH_O,
     "attn_set_fwd_kernel(arch): CUDA forward kernel on Hopper, 90 (wgmma) or 80 (mma.sync)."},
    {"attn_set_fwd_sm90_variant", py_attn_set_fwd_sm90_variant, METH_O,
     "attn_set_fwd_sm90_variant(v): wgmma forward schedule, 0 (in order), 1 (softmax overlapped with P V), "
     "2 (1 warp-specialized: producer warpgroup, mbarrier pipeline), 3 (2 + consumer ping-pong) "
     "or 4 (3 with three consumer warpgroups of 192 rows at head dim 64)."},
    {"attn_fwd_kernel_for", py_attn_fwd_kernel_for, METH_VARARGS,
     "attn_fwd_kernel_for(head_dim, device) -> (arch, reason): the forward kernel a call takes."},
    {"attn_set_bwd_kernel", py_attn_set_bwd_kernel, METH_O,
     "attn_set_bwd_kernel(arch): CUDA backward kernel on Hopper, 90 (wgmma) or 80 (mma.sync)."},
    {"attn_bwd_kernel_for", py_attn_bwd_kernel_for, METH_VARARGS,
     "attn_bwd_kernel_for(head_dim, device, deterministic) -> (arch, reason): the backward kernel a call takes."},
    {"attn_fwd", SF_PY_FASTCALL(py_attn_fwd),
     "attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, cfg, stream=None): "
     "fused attention forward into out and lse (float32)."},
    {"attn_bwd", SF_PY_FASTCALL(py_attn_bwd),
     "attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_kv, dq, dk, dv, dq_accum, "
     "delta, cfg, stream=None): fused attention backward."},
    {NULL, NULL, 0, NULL},
};
