/*
 * attn_py.c - bindings of the attn family (fused (flash) attention forward and backward (csrc/attn/)).
 */
#include "py_call.h"

PyMethodDef sf_py_attn_methods[] = {
    {NULL, NULL, 0, NULL},
};
