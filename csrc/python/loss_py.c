/*
 * loss_py.c - bindings of the loss family (fused cross-entropy (csrc/loss/)).
 */
#include "py_call.h"

/* The opening both bindings share: the argument count (n_fixed, then the
 * optional stream), then ignore_index and label_smoothing from args[at] and
 * args[at + 1]. */
static int read_scalars(const char *op, PyObject *const *args, Py_ssize_t nargs,
                        Py_ssize_t n_fixed, int at, int64_t *ignore_index, float *smoothing)
{
    if (sf_py_check_nargs(op, nargs, n_fixed, n_fixed + 1) < 0)
        return -1;
    long long ig = PyLong_AsLongLong(args[at]);
    if (ig == -1 && PyErr_Occurred())
        return -1;
    double sm = PyFloat_AsDouble(args[at + 1]);
    if (sm == -1.0 && PyErr_Occurred())
        return -1;
    *ignore_index = (int64_t)ig;
    *smoothing = (float)sm;
    return 0;
}

/* cross_entropy_forward(logits, labels, ignore_index, label_smoothing, loss, lse, stream=None)
 * cross_entropy_backward(logits, labels, lse, grad_scale, ignore_index, label_smoothing,
 *                        dlogits, stream=None) */
static PyObject *ce_call(PyObject *const *args, Py_ssize_t nargs, int backward)
{
    static const sf_py_tensor_arg fwd[] = {
        {0, "logits", 0}, {1, "labels", 0}, {4, "loss", 0}, {5, "lse", 0}};
    static const sf_py_tensor_arg bwd[] = {
        {0, "logits", 0}, {1, "labels", 0}, {2, "lse", 0}, {3, "grad_scale", 0}, {6, "dlogits", 0}};
    const char *op = backward ? "cross_entropy_backward" : "cross_entropy_forward";
    const int n_fixed = backward ? 7 : 6;
    int64_t ignore_index;
    float smoothing;
    sf_py_args a;
    if (read_scalars(op, args, nargs, n_fixed, backward ? 4 : 2, &ignore_index, &smoothing) < 0 ||
        sf_py_begin(&a, op, args, nargs, n_fixed, backward ? bwd : fwd,
                    backward ? SF_PY_NARGS(bwd) : SF_PY_NARGS(fwd)) < 0)
        return NULL;
    sf_tensor **t = a.t; /* in the table's order */
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    const sf_stream stream = sf_py_call_stream(&a.call);
    st = backward ? sf_cross_entropy_backward(t[0], t[1], t[2], t[3], ignore_index, smoothing, t[4],
                                              stream)
                  : sf_cross_entropy_forward(t[0], t[1], ignore_index, smoothing, t[2], t[3], stream);
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_ce_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return ce_call(args, nargs, 0);
}

static PyObject *py_ce_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return ce_call(args, nargs, 1);
}

PyMethodDef sf_py_loss_methods[] = {
    {"cross_entropy_forward", SF_PY_FASTCALL(py_ce_forward),
     "cross_entropy_forward(logits, labels, ignore_index, label_smoothing, loss, lse, stream=None): "
     "per-row loss and log-sum-exp (float32)."},
    {"cross_entropy_backward", SF_PY_FASTCALL(py_ce_backward),
     "cross_entropy_backward(logits, labels, lse, grad_scale, ignore_index, label_smoothing, dlogits, "
     "stream=None): dlogits = grad_scale * d loss / d logits (dlogits may be logits)."},
    {NULL, NULL, 0, NULL},
};
