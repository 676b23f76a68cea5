/*
 * gemm_py.c - bindings of the gemm family (matrix products over cuBLASLt (csrc/gemm/)).
 */
#include "py_call.h"

PyMethodDef sf_py_gemm_methods[] = {
    {NULL, NULL, 0, NULL},
};
