/*
 * optim_py.c - bindings of the optim family (multi-tensor AdamW and gradient norms (csrc/optim/)).
 *
 * These take Python lists of tensors, imported by sf_py_list_import
 * (py_call.h): a list may be far longer than the per-call borrow limit.
 */
#include "py_call.h"

static int same_length(const char *op, const sf_py_tensor_list *a, const char *an,
                       const sf_py_tensor_list *b, const char *bn)
{
    if (a->n != b->n) {
        PyErr_Format(PyExc_ValueError, "%s: arguments '%s' (%zd tensors) and '%s' (%zd tensors) must have "
                     "the same length", op, an, a->n, bn, b->n);
        return -1;
    }
    return 0;
}

/* The common end of a list binding, once its lists are freed: where the
 * kernel did not run, an import or check failed and set the Python error
 * (release the call, return NULL); otherwise sf_py_finish turns the
 * kernel's status into None or a raise. */
static PyObject *finish_lists(sf_py_call *c, int ran, sf_status st)
{
    if (!ran) {
        sf_py_call_release(c);
        return NULL;
    }
    return sf_py_finish(c, st);
}

/* multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps,
 *                    weight_decay, step, stream=None); master: None or a list */
static PyObject *py_adamw(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "multi_tensor_adamw";
    if (sf_py_check_nargs(op, nargs, 11, 12) < 0)
        return NULL;
    sf_adamw_config cfg;
    double *fields[5] = {&cfg.lr, &cfg.beta1, &cfg.beta2, &cfg.eps, &cfg.weight_decay};
    for (int i = 0; i < 5; ++i) {
        *fields[i] = PyFloat_AsDouble(args[5 + i]);
        if (*fields[i] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    long long step = PyLong_AsLongLong(args[10]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    cfg.step = step;
    PyObject *stream_obj = nargs > 11 ? args[11] : Py_None;
    sf_py_call c;
    if (sf_py_call_init(&c, op, stream_obj) < 0)
        return NULL;
    sf_py_tensor_list p = {0}, g = {0}, m = {0}, v = {0}, w = {0};
    sf_status st = SF_OK;
    int ran = 0;
    int has_master = args[4] != Py_None;
    if (sf_py_list_import(&c, stream_obj, args[0], "params", &p) < 0 ||
        sf_py_list_import(&c, stream_obj, args[1], "grads", &g) < 0 ||
        sf_py_list_import(&c, stream_obj, args[2], "exp_avg", &m) < 0 ||
        sf_py_list_import(&c, stream_obj, args[3], "exp_avg_sq", &v) < 0 ||
        (has_master && sf_py_list_import(&c, stream_obj, args[4], "master", &w) < 0))
        goto done;
    if (same_length(op, &p, "params", &g, "grads") < 0 || same_length(op, &p, "params", &m, "exp_avg") < 0 ||
        same_length(op, &p, "params", &v, "exp_avg_sq") < 0 ||
        (has_master && same_length(op, &p, "params", &w, "master") < 0))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    st = sf_multi_tensor_adamw(p.n, p.views, g.views, m.views, v.views, has_master ? w.views : NULL, &cfg,
                               sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    ran = 1;
done:
    sf_py_list_free(&p);
    sf_py_list_free(&g);
    sf_py_list_free(&m);
    sf_py_list_free(&v);
    sf_py_list_free(&w);
    return finish_lists(&c, ran, st);
}

/* multi_tensor_l2norm(tensors, workspace, out, stream=None)
 * multi_tensor_scale(tensors, scale, stream=None): one list, then plain tensors. */
static PyObject *list_then_tensors(PyObject *const *args, Py_ssize_t nargs, int l2norm)
{
    static const sf_py_tensor_arg l2[] = {{1, "workspace", 0}, {2, "out", 0}};
    static const sf_py_tensor_arg sc[] = {{1, "scale", 0}};
    const char *op = l2norm ? "multi_tensor_l2norm" : "multi_tensor_scale";
    const int n_fixed = l2norm ? 3 : 2;
    if (sf_py_check_nargs(op, nargs, n_fixed, n_fixed + 1) < 0)
        return NULL;
    PyObject *stream_obj = nargs > n_fixed ? args[n_fixed] : Py_None;
    sf_py_args a;
    if (sf_py_call_init(&a.call, op, stream_obj) < 0)
        return NULL;
    sf_py_tensor_list l = {0};
    sf_status st = SF_OK;
    int ran = 0;
    if (sf_py_list_import(&a.call, stream_obj, args[0], "tensors", &l) == 0 &&
        sf_py_import(&a, args, nargs, l2norm ? l2 : sc, n_fixed - 1) == 0) {
        Py_BEGIN_ALLOW_THREADS
        const sf_stream stream = sf_py_call_stream(&a.call);
        st = l2norm ? sf_multi_tensor_l2norm(l.n, l.views, a.t[0], a.t[1], stream)
                    : sf_multi_tensor_scale(l.n, l.views, a.t[0], stream);
        Py_END_ALLOW_THREADS
        ran = 1;
    }
    sf_py_list_free(&l);
    return finish_lists(&a.call, ran, st);
}

static PyObject *py_l2norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return list_then_tensors(args, nargs, 1);
}

static PyObject *py_scale(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return list_then_tensors(args, nargs, 0);
}

static PyObject *py_chunk_size(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(SF_MT_CHUNK);
}

PyMethodDef sf_py_optim_methods[] = {
    {"multi_tensor_adamw", SF_PY_FASTCALL(py_adamw),
     "multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, "
     "step, stream=None): one AdamW update of every tensor in the lists (master: None or fp32 copies)."},
    {"multi_tensor_l2norm", SF_PY_FASTCALL(py_l2norm),
     "multi_tensor_l2norm(tensors, workspace, out, stream=None): out[0] = sqrt(sum x^2) over all tensors."},
    {"multi_tensor_scale", SF_PY_FASTCALL(py_scale),
     "multi_tensor_scale(tensors, scale, stream=None): x *= scale[0] for every tensor."},
    {"multi_tensor_chunk_size", py_chunk_size, METH_NOARGS,
     "Elements per chunk of the multi-tensor kernels (one workspace float per chunk for l2norm)."},
    {NULL, NULL, 0, NULL},
};
