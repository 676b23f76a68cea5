/*
 * optim_py.c - bindings of the optim family (multi-tensor AdamW and gradient norms (csrc/optim/)).
 */
#include "py_call.h"

PyMethodDef sf_py_optim_methods[] = {
    {NULL, NULL, 0, NULL},
};
