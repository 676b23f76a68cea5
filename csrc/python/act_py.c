/*
 * act_py.c - bindings of the act family (activations and their gradients, bias+dropout+residual (csrc/act/)).
 */
#include "py_call.h"

PyMethodDef sf_py_act_methods[] = {
    {NULL, NULL, 0, NULL},
};
