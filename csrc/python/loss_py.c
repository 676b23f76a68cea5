/*
 * loss_py.c - bindings of the loss family (fused cross-entropy (csrc/loss/)).
 */
#include "py_call.h"

PyMethodDef sf_py_loss_methods[] = {
    {NULL, NULL, 0, NULL},
};
