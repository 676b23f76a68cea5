/*
 * rope_py.c - bindings of the rope family (rotary position embeddings on bshd, sbhd and packed thd (csrc/rope/)).
 */
#include "py_call.h"

/* rope(t, freqs, cu_seqlens, start_positions, tensor_format, interleaved,
 *      backward, out, stream=None) */
static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "rope";
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0)
        return NULL;
    long format = PyLong_AsLong(args[4]);
    if (format == -1 && PyErr_Occurred())
        return NULL;
    int interleaved = PyObject_IsTrue(args[5]);
    int backward = PyObject_IsTrue(args[6]);
    if (interleaved < 0 || backward < 0)
        return NULL;
    sf_py_call c;
    if (sf_py_call_init(&c, op, nargs > 8 ? args[8] : Py_None) < 0)
        return NULL;
    sf_tensor t, freqs, cu, start, out;
    int has_cu = 0, has_start = 0;
    if (sf_py_tensor(&c, args[0], "t", &t) < 0 || sf_py_tensor(&c, args[1], "freqs", &freqs) < 0 ||
        sf_py_optional_tensor(&c, args[2], "cu_seqlens", &cu, &has_cu) < 0 ||
        sf_py_optional_tensor(&c, args[3], "start_positions", &start, &has_start) < 0 ||
        sf_py_tensor(&c, args[7], "out", &out) < 0)
        goto done;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rope(&t, &freqs, has_cu ? &cu : NULL, has_start ? &start : NULL,
                 (sf_rope_format)format, interleaved, backward, &out, sf_py_call_stream(&c));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&c, st);
done:
    sf_py_call_release(&c);
    return NULL;
}

PyMethodDef sf_py_rope_methods[] = {
    {"rope", SF_PY_FASTCALL(py_rope),
     "rope(t, freqs, cu_seqlens, start_positions, tensor_format, interleaved, backward, out, "
     "stream=None): rotary position embedding (tensor_format 0 sbhd, 1 bshd, 2 thd)."},
    {NULL, NULL, 0, NULL},
};
