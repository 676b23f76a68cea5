/*
 * attn_py.c - bindings of the attn family (fused attention forward and
 * backward, csrc/attn/).  The attention configuration travels as one tuple
 * of plain numbers so each call parses it in a few C calls:
 *   cfg = (format, mask, window_left, window_right, softmax_scale,
 *          max_seqlen_q, max_seqlen_kv, deterministic,
 *          dropout_p, dropout_seed, dropout_offset)
 * Each binding is an argument table and a thunk calling the C entry; the
 * config tuple is parsed by the prepare hook, the rest by the driver in
 * py_call.c.
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

/* The prepare hook of both calls: the config tuple at args[at] parsed into
 * the frame's scratch, its address left in v[at].p for the thunk. */
static int prepare_config(sf_py_frame *f, int at)
{
    _Static_assert(sizeof(sf_attn_config) <= sizeof f->scratch, "frame scratch too small");
    sf_attn_config *cfg = (sf_attn_config *)f->scratch;
    if (parse_config(f->b->op, f->v[at].o, cfg) < 0)
        return -1;
    f->v[at].p = cfg;
    return 0;
}

static const sf_py_arg fwd_args[] = {SF_T(q),   SF_T(k),   SF_T(v), SF_OT(cu_seqlens_q),
                                     SF_OT(cu_seqlens_kv), SF_T(out), SF_T(lse), SF_OBJ(cfg),
                                     SF_STREAM};
static int fwd_prepare(sf_py_frame *f) { return prepare_config(f, 7); }
static sf_status fwd(sf_py_value *v, sf_stream s)
{
    return sf_attn_fwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[7].p, v[5].t, v[6].t, s);
}
SF_PY_BINDING_FULL(attn_fwd, "attention_fwd", fwd_args, fwd, fwd_prepare, NULL, NULL,
                   "Fused attention forward into out and lse (float32).");

static const sf_py_arg bwd_args[] = {
    SF_T(q),  SF_T(k),  SF_T(v),  SF_T(out), SF_T(dout), SF_T(lse), SF_OT(cu_seqlens_q),
    SF_OT(cu_seqlens_kv), SF_T(dq), SF_T(dk), SF_T(dv), SF_T(dq_accum), SF_T(delta), SF_OBJ(cfg),
    SF_STREAM};
static int bwd_prepare(sf_py_frame *f) { return prepare_config(f, 13); }
static sf_status bwd(sf_py_value *v, sf_stream s)
{
    return sf_attn_bwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].t, v[7].t, v[13].p,
                       v[8].t, v[9].t, v[10].t, v[11].t, v[12].t, s);
}
SF_PY_BINDING_FULL(attn_bwd, "attention_bwd", bwd_args, bwd, bwd_prepare, NULL, NULL,
                   "Fused attention backward.");

/* attn_set_fwd_kernel(arch) / attn_set_bwd_kernel(arch): the CUDA forward
 * / backward on Hopper, 90 (wgmma) or 80 (mma.sync). */
#ifdef SF_WITH_CUDA
#define SET_KERNEL(setter, value) setter(value)
#else
#define SET_KERNEL(setter, value) \
    ((void)(value), sf_fail(SF_ERR_NOT_IMPLEMENTED, "attention: the kernel choice exists only in a CUDA build"))
#endif
static const sf_py_arg arch_args[] = {SF_INT(arch)};
static sf_status set_fwd(sf_py_value *v, sf_stream s)
{
    (void)s;
    return SET_KERNEL(sf_attn_set_fwd_kernel, v[0].i);
}
static sf_status set_bwd(sf_py_value *v, sf_stream s)
{
    (void)s;
    return SET_KERNEL(sf_attn_set_bwd_kernel, v[0].i);
}
SF_PY_BINDING(attn_set_fwd_kernel, arch_args, set_fwd,
              "CUDA forward kernel on Hopper, 90 (wgmma) or 80 (mma.sync).");
SF_PY_BINDING(attn_set_bwd_kernel, arch_args, set_bwd,
              "CUDA backward kernel on Hopper, 90 (wgmma) or 80 (mma.sync).");

const sf_py_binding *const sf_py_attn_bindings[] = {
    &attn_fwd_binding, &attn_bwd_binding, &attn_set_fwd_kernel_binding, &attn_set_bwd_kernel_binding, NULL};

/* attn_fwd_kernel_for(head_dim, device, dropout=0) and
 * attn_bwd_kernel_for(head_dim, device, deterministic, dropout=0) ->
 * (arch, reason): which kernel a call takes (attn_sm90.h), for tests,
 * benchmarks and the once-per-reason log of ops/attn.py. */
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
    {"attn_fwd_kernel_for", py_attn_fwd_kernel_for, METH_VARARGS,
     "attn_fwd_kernel_for(head_dim, device, dropout=0) -> (arch, reason): the forward kernel a call takes."},
    {"attn_bwd_kernel_for", py_attn_bwd_kernel_for, METH_VARARGS,
     "attn_bwd_kernel_for(head_dim, device, deterministic, dropout=0) -> (arch, reason): the backward kernel a "
     "call takes."},
    {NULL, NULL, 0, NULL},
};
