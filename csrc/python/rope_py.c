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
    static const sf_py_tensor_arg spec[] = {{0, "t", 0},
                                            {1, "freqs", 0},
                                            {2, "cu_seqlens", 1},
                                            {3, "start_positions", 1},
                                            {7, "out", 0}};
    enum { T, FREQS, CU, START, OUT };
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0)
        return NULL;
    long format;
    if (sf_py_arg_long(op, "format", args[4], &format) < 0)
        return NULL;
    int interleaved = PyObject_IsTrue(args[5]);
    int backward = PyObject_IsTrue(args[6]);
    if (interleaved < 0 || backward < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 8, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_rope(a.t[T], a.t[FREQS], a.t[CU], a.t[START], (sf_rope_format)format, interleaved,
                 backward, a.t[OUT], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

PyMethodDef sf_py_rope_methods[] = {
    {"rope", SF_PY_FASTCALL(py_rope),
     "rope(t, freqs, cu_seqlens, start_positions, tensor_format, interleaved, backward, out, "
     "stream=None): rotary position embedding (tensor_format 0 sbhd, 1 bshd, 2 thd)."},
    {NULL, NULL, 0, NULL},
};
