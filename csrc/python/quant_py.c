/*
 * quant_py.c - bindings of the quant family (csrc/quant/).
 */
#include "py_call.h"

/* amax(x, out, stream=None): out[0] = max |x|. */
static PyObject *py_amax(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "amax";
    if (sf_py_check_nargs(op, nargs, 2, 3) < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 2 ? args[2] : Py_None) < 0)
        return NULL;
    PyObject *result = NULL;
    sf_tensor x, out;
    if (sf_py_tensor(&c, args[0], "x", &x) < 0 || sf_py_tensor(&c, args[1], "out", &out) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_amax(&x, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    if (st != SF_OK) {
        sf_py_raise(st);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    sf_py_call_release(&c);
    return result;
}

PyMethodDef sf_py_quant_methods[] = {
    {"amax", (PyCFunction)(void (*)(void))py_amax, METH_FASTCALL,
     "amax(x, out, stream=None): out[0] = max |x| (float32)."},
    {NULL, NULL, 0, NULL},
};
