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
#include "py_call.h"
#include "attn/attn_sm90.h"

/* The config tuple's entries in order, named as the Python API names them:
 * 'i' an int the kernels count in a C int (from `low`: window sizes take -1
 * for unbounded), 'f' a float, 'u' a dropout rng word in [0, 2**64). */
static const struct {
    const char *name;
    char kind;
    int low;
} cfg_entries[] = {
    {"qkv_format", 'i', 0},      {"attn_mask_type", 'i', 0},   {"window_size[0]", 'i', -1},
    {"window_size[1]", 'i', -1}, {"softmax_scale", 'f', 0},    {"max_seqlen_q", 'i', 0},
    {"max_seqlen_kv", 'i', 0},   {"deterministic", 'i', 0},    {"dropout_p", 'f', 0},
    {"dropout_seed", 'u', 0},    {"dropout_offset", 'u', 0},
};
enum { kCfgLen = sizeof cfg_entries / sizeof cfg_entries[0] };

static int parse_config(const char *op, PyObject *obj, sf_attn_config *cfg)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != kCfgLen) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'cfg' must be a tuple of %d numbers", op, kCfgLen);
        return -1;
    }
    union { long i; double f; unsigned long long u; } e[kCfgLen];
    for (int k = 0; k < kCfgLen; ++k) {
        PyObject *item = PyTuple_GET_ITEM(obj, k);
        const char kind = cfg_entries[k].kind;
        int failed;
        if (kind == 'f') {
            e[k].f = PyFloat_AsDouble(item);
            failed = e[k].f == -1.0;
        } else if (kind == 'i') {
            e[k].i = PyLong_AsLong(item);
            failed = e[k].i == -1;
        } else {
            e[k].u = PyLong_AsUnsignedLongLong(item);
            failed = e[k].u == (unsigned long long)-1;
        }
        /* out of range (OverflowError) is reported below, anything else as raised */
        int overflow = 0;
        if (failed && PyErr_Occurred()) {
            if (kind == 'f' || !PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear();
            overflow = 1;
        }
        if (kind == 'u' && overflow) {
            PyErr_Format(PyExc_ValueError, "%s: config entry %d (%s) must be in [0, 2**64)", op, k,
                         cfg_entries[k].name);
            return -1;
        }
        if (kind == 'i' && (overflow || e[k].i < cfg_entries[k].low || e[k].i > 0x7fffffffL)) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be in [%d, 2**31 - 1] (the "
                         "kernels count in 32-bit ints), got %S",
                         op, cfg_entries[k].name, cfg_entries[k].low, item);
            return -1;
        }
    }
    *cfg = (sf_attn_config){.format = (sf_attn_format)e[0].i, .mask = (sf_attn_mask)e[1].i,
                            .window_left = (int)e[2].i, .window_right = (int)e[3].i,
                            .softmax_scale = (float)e[4].f, .max_seqlen_q = (int)e[5].i,
                            .max_seqlen_kv = (int)e[6].i, .deterministic = (int)e[7].i,
                            .dropout_p = e[8].f, .dropout_seed = e[9].u, .dropout_offset = e[10].u};
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

static const sf_py_arg forward_args[] = {SF_T(q),   SF_T(k),   SF_T(v), SF_OT(cu_seqlens_q),
                                     SF_OT(cu_seqlens_kv), SF_T(out), SF_T(lse), SF_OBJ(cfg),
                                     SF_STREAM};
static int forward_prepare(sf_py_frame *f) { return prepare_config(f, 7); }
static sf_status forward(sf_py_value *v, sf_stream s)
{
    return sf_attn_forward(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[7].p, v[5].t, v[6].t, s);
}
SF_PY_BINDING_FULL(attn_forward, "attention_forward", forward_args, forward, forward_prepare, NULL, NULL,
                   "Fused attention forward into out and lse (float32).");

static const sf_py_arg backward_args[] = {
    SF_T(q),  SF_T(k),  SF_T(v),  SF_T(out), SF_T(dout), SF_T(lse), SF_OT(cu_seqlens_q),
    SF_OT(cu_seqlens_kv), SF_T(dq), SF_T(dk), SF_T(dv), SF_T(dq_accum), SF_T(delta), SF_OBJ(cfg),
    SF_STREAM};
static int backward_prepare(sf_py_frame *f) { return prepare_config(f, 13); }
static sf_status backward(sf_py_value *v, sf_stream s)
{
    return sf_attn_backward(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].t, v[7].t, v[13].p,
                       v[8].t, v[9].t, v[10].t, v[11].t, v[12].t, s);
}
SF_PY_BINDING_FULL(attn_backward, "attention_backward", backward_args, backward, backward_prepare, NULL, NULL,
                   "Fused attention backward.");

/* attn_set_forward_kernel(arch) / attn_set_backward_kernel(arch): the CUDA forward
 * / backward on Hopper, 90 (wgmma) or 80 (mma.sync). */
#ifdef SF_WITH_CUDA
#define SET_KERNEL(setter, value) setter(value)
#else
#define SET_KERNEL(setter, value) \
    ((void)(value), sf_fail(SF_ERR_NOT_IMPLEMENTED, "attention: the kernel choice exists only in a CUDA build"))
#endif
#define SETTER(pyname, setter, arg, docstr)                                                   \
    static const sf_py_arg pyname##_args[] = {SF_INT(arg)};                                    \
    static sf_status pyname##_thunk(sf_py_value *v, sf_stream s)                               \
    {                                                                                          \
        return SET_KERNEL(setter, v[0].i);                                                     \
    }                                                                                          \
    SF_PY_BINDING(pyname, pyname##_args, pyname##_thunk, docstr)
SETTER(attn_set_forward_kernel, sf_attn_set_forward_kernel, arch,
       "CUDA forward kernel on Hopper, 90 (wgmma) or 80 (mma.sync).");
SETTER(attn_set_backward_kernel, sf_attn_set_backward_kernel, arch,
       "CUDA backward kernel on Hopper, 90 (wgmma) or 80 (mma.sync).");

const sf_py_binding *const sf_py_attn_bindings[] = {
    &attn_forward_binding, &attn_backward_binding, &attn_set_forward_kernel_binding, &attn_set_backward_kernel_binding, NULL};

/* attn_forward_kernel_for(head_dim, device, dropout=0) and
 * attn_backward_kernel_for(head_dim, device, deterministic, dropout=0) ->
 * (arch, reason): which kernel a call takes (attn_sm90.h), for tests,
 * benchmarks and the once-per-reason log of ops/attn.py.  backward: 0 forward,
 * 1 backward. */
static PyObject *kernel_for(PyObject *args, int backward)
{
    int head_dim, device, deterministic = 0, dropout = 0;
    if (backward ? !PyArg_ParseTuple(args, "iip|i", &head_dim, &device, &deterministic, &dropout)
            : !PyArg_ParseTuple(args, "ii|i", &head_dim, &device, &dropout))
        return NULL;
    const char *why = "";
    int arch = 80;
#ifdef SF_WITH_CUDA
    arch = backward ? sf_attn_backward_kernel_for(head_dim, deterministic, dropout, device, &why)
               : sf_attn_forward_kernel_for(head_dim, dropout, device, &why);
#endif
    return Py_BuildValue("(is)", arch, why ? why : "");
}
static PyObject *py_attn_forward_kernel_for(PyObject *self, PyObject *args) { return kernel_for(args, 0); }
static PyObject *py_attn_backward_kernel_for(PyObject *self, PyObject *args) { return kernel_for(args, 1); }

PyMethodDef sf_py_attn_methods[] = {
    {"attn_forward_kernel_for", py_attn_forward_kernel_for, METH_VARARGS,
     "attn_forward_kernel_for(head_dim, device, dropout=0) -> (arch, reason): the forward kernel a call takes."},
    {"attn_backward_kernel_for", py_attn_backward_kernel_for, METH_VARARGS,
     "attn_backward_kernel_for(head_dim, device, deterministic, dropout=0) -> (arch, reason): the backward kernel a "
     "call takes."},
    {NULL, NULL, 0, NULL},
};
