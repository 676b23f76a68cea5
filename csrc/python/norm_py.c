/*
 * norm_py.c - bindings of the norm family (LayerNorm and RMSNorm, forward and backward (csrc/norm/)).
 */
#include "py_call.h"

PyMethodDef sf_py_norm_methods[] = {
    {NULL, NULL, 0, NULL},
};
