/*
 * rope_py.c - bindings of the rope family (rotary position embeddings on bshd, sbhd and packed thd (csrc/rope/)).
 */
#include "py_call.h"

PyMethodDef sf_py_rope_methods[] = {
    {NULL, NULL, 0, NULL},
};
