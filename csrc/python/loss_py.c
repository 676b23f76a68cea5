/*
 * loss_py.c - bindings of the loss family (fused cross-entropy (csrc/loss/)).
 */
#include "py_call.h"

static int read_scalars(PyObject *ignore_obj, PyObject *smoothing_obj, int64_t *ignore_index,
                        float *smoothing)
{
    long long ig = PyLong_AsLongLong(ignore_obj);
    if (ig == -1 && PyErr_Occurred())
        return -1;
    double sm = PyFloat_AsDouble(smoothing_obj);
    if (sm == -1.0 && PyErr_Occurred())
        return -1;
    *ignore_index = (int64_t)ig;
    *smoothing = (float)sm;
    return 0;
}

/* cross_entropy_forward(logits, labels, ignore_index, label_smoothing, loss, lse, stream=None) */
static PyObject *py_ce_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "cross_entropy_forward";
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0)
        return NULL;
    int64_t ignore_index;
    float smoothing;
    if (read_scalars(args[2], args[3], &ignore_index, &smoothing) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 6 ? args[6] : Py_None) < 0)
        return NULL;
    sf_tensor logits, labels, loss, lse;
    if (sf_py_tensor(&c, args[0], "logits", &logits) < 0 || sf_py_tensor(&c, args[1], "labels", &labels) < 0 ||
        sf_py_tensor(&c, args[4], "loss", &loss) < 0 || sf_py_tensor(&c, args[5], "lse", &lse) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cross_entropy_forward(&logits, &labels, ignore_index, smoothing, &loss, &lse,
                                  sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
}

/* cross_entropy_backward(logits, labels, lse, grad_scale, ignore_index, label_smoothing,
 *                        dlogits, stream=None) */
static PyObject *py_ce_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "cross_entropy_backward";
    if (sf_py_check_nargs(op, nargs, 7, 8) < 0)
        return NULL;
    int64_t ignore_index;
    float smoothing;
    if (read_scalars(args[4], args[5], &ignore_index, &smoothing) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 7 ? args[7] : Py_None) < 0)
        return NULL;
    sf_tensor logits, labels, lse, scale, dlogits;
    if (sf_py_tensor(&c, args[0], "logits", &logits) < 0 || sf_py_tensor(&c, args[1], "labels", &labels) < 0 ||
        sf_py_tensor(&c, args[2], "lse", &lse) < 0 || sf_py_tensor(&c, args[3], "grad_scale", &scale) < 0 ||
        sf_py_tensor(&c, args[6], "dlogits", &dlogits) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_cross_entropy_backward(&logits, &labels, &lse, &scale, ignore_index, smoothing, &dlogits,
                                   sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
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
