/*
 * module.c - the seqfuse._C extension module: joins the method tables of the
 * binding files (one per kernel family) and holds the core bindings: build
 * and device information, the exchange-API switch, the overhead probe, and
 * the status codes and limits Python reads (GROUPED_MAX_LANES).
 *
 * Only this folder includes Python.h.  Each op binding is declared once in
 * its family file (an argument table and a thunk, see py_call.h); the one
 * driver in py_call.c parses, imports through DLPack, calls the C entry with
 * the GIL released and maps a failing status to an exception.
 */
#include "py_call.h"

#ifndef SF_CUDA_ARCHS
#define SF_CUDA_ARCHS ""
#endif
#ifndef SF_COMPILER_DESC
#define SF_COMPILER_DESC "cc"
#endif

static PyObject *py_build_info(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("{s:O,s:s,s:i,s:n,s:i,s:s,s:s}",
                         "cuda", sf_built_with_cuda() ? Py_True : Py_False,
                         "cuda_archs", SF_CUDA_ARCHS,
                         "cuda_runtime", sf_cuda_runtime_version(),
                         "cublaslt", (Py_ssize_t)sf_cublaslt_version(),
                         "nccl", sf_nccl_version(),
                         "compiler", SF_COMPILER_DESC,
                         "python", PY_VERSION);
}

SF_PY_NOARGS(py_cuda_device_count, PyLong_FromLong(sf_cuda_device_count()))
SF_PY_NOARGS(py_cuda_driver_version, PyLong_FromLong(sf_cuda_driver_version()))
SF_PY_NOARGS(py_exchange_api_enabled, PyBool_FromLong(sf_py_exchange_api_enabled()))

static PyObject *py_cuda_capability(PyObject *self, PyObject *arg)
{
    long device;
    if (sf_py_arg_long("cuda_capability", "device", arg, &device) < 0)
        return NULL;
    int cap = 0;
    sf_status st = sf_cuda_capability((int)device, &cap);
    if (st != SF_OK)
        return sf_py_raise(st);
    return Py_BuildValue("(ii)", cap / 10, cap % 10);
}

static PyObject *py_grouped_sm90_unfit(PyObject *self, PyObject *arg)
{
    long device;
    if (sf_py_arg_long("grouped_sm90_unfit", "device", arg, &device) < 0)
        return NULL;
    const char *why = sf_grouped_sm90_unfit_device((int)device);
    return why ? PyUnicode_FromString(why) : Py_NewRef(Py_None);
}

static PyObject *py_set_exchange_api(PyObject *self, PyObject *arg)
{
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0)
        return NULL;
    int previous = sf_py_exchange_api_enabled();
    sf_py_set_exchange_api(enabled);
    return PyBool_FromLong(previous);
}

/* probe(a, b, c, stream=None): import three tensors and give them back,
 * launching nothing.  Its time is the host overhead every op pays. */
static const sf_py_arg probe_args[] = {SF_T(a), SF_T(b), SF_T(c), SF_STREAM};
SF_PY_BINDING(probe, probe_args, NULL, "Import three tensors and release them.");

/* describe(x, stream=None): the view seqfuse reads from x, for tests of the
 * DLPack path. */
static PyObject *describe_result(sf_py_frame *f)
{
    const sf_tensor *x = f->v[0].t;
    PyObject *shape = PyTuple_New(x->ndim), *strides = PyTuple_New(x->ndim), *result = NULL;
    if (shape != NULL && strides != NULL) {
        for (int i = 0; i < x->ndim; ++i) {
            PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(x->shape[i]));
            PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(x->strides[i]));
        }
        result = Py_BuildValue("{s:s,s:O,s:O,s:s,s:i,s:K,s:O,s:O}",
                               "dtype", sf_dtype_name(x->dtype),
                               "shape", shape,
                               "strides", strides,
                               "device", x->device == SF_CUDA ? "cuda" : "cpu",
                               "device_id", x->device_id,
                               "data", (unsigned long long)(uintptr_t)x->data,
                               "readonly", x->readonly ? Py_True : Py_False,
                               "contiguous", sf_is_contiguous(x) ? Py_True : Py_False);
    }
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    return result;
}
static const sf_py_arg describe_args[] = {SF_T(x), SF_STREAM};
SF_PY_BINDING_FULL(describe, "describe", describe_args, NULL, NULL, NULL, describe_result,
                   "-> dict: the view seqfuse reads from x.");

const sf_py_binding *const sf_py_core_bindings[] = {&probe_binding, &describe_binding, NULL};

/* raise_status(code, message): exercise the status -> exception mapping. */
static PyObject *py_raise_status(PyObject *self, PyObject *args)
{
    int code;
    const char *message;
    if (!PyArg_ParseTuple(args, "is", &code, &message))
        return NULL;
    if (code == SF_OK)
        Py_RETURN_NONE;
    return sf_py_raise(sf_fail((sf_status)code, "%s", message));
}

PyMethodDef sf_py_core_methods[] = {
    {"build_info", py_build_info, METH_NOARGS,
     "build_info() -> dict: what this build compiled in (CUDA, architectures, "
     "cuBLASLt and NCCL versions)."},
    {"cuda_device_count", py_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: CUDA devices usable now (0 without a driver)."},
    {"cuda_driver_version", py_cuda_driver_version, METH_NOARGS,
     "cuda_driver_version() -> int: the driver's CUDA version, 0 without one."},
    {"cuda_capability", py_cuda_capability, METH_O,
     "cuda_capability(device) -> (major, minor)."},
    {"grouped_sm90_unfit", py_grouped_sm90_unfit, METH_O,
     "grouped_sm90_unfit(device) -> None or str: why CUDA device `device` cannot run the grouped GEMM's "
     "sm90 kernel."},
    {"set_exchange_api", py_set_exchange_api, METH_O,
     "set_exchange_api(enabled) -> bool: use DLPack's C exchange API where the "
     "tensor type offers it; returns the previous setting."},
    {"exchange_api_enabled", py_exchange_api_enabled, METH_NOARGS,
     "exchange_api_enabled() -> bool: whether the C exchange API path is on."},
    {"raise_status", py_raise_status, METH_VARARGS,
     "raise_status(code, message): raise the exception a C status maps to."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef *const sf_py_tables[] = {
    sf_py_core_methods, sf_py_gemm_methods, sf_py_optim_methods, sf_py_attn_methods,
};

static const sf_py_binding *const *const sf_py_binding_tables[] = {
    sf_py_core_bindings, sf_py_quant_bindings, sf_py_gemm_bindings,  sf_py_norm_bindings,
    sf_py_act_bindings,  sf_py_rope_bindings,  sf_py_loss_bindings,  sf_py_optim_bindings,
    sf_py_attn_bindings, sf_py_grouped_bindings, sf_py_moe_bindings, sf_py_embed_bindings,
};

static struct PyModuleDef sf_py_module = {
    PyModuleDef_HEAD_INIT,
    "seqfuse._C",
    "seqfuse's C/CUDA engine. Called through seqfuse.ops; not a public API.",
    -1,
    NULL,
};

PyMODINIT_FUNC PyInit__C(void)
{
    PyObject *m = PyModule_Create(&sf_py_module);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof sf_py_tables / sizeof sf_py_tables[0]; ++i) {
        if (PyModule_AddFunctions(m, sf_py_tables[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    for (size_t i = 0; i < sizeof sf_py_binding_tables / sizeof sf_py_binding_tables[0]; ++i) {
        if (sf_py_add_bindings(m, sf_py_binding_tables[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (PyModule_AddIntConstant(m, "STATUS_TYPE", SF_ERR_TYPE) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_VALUE", SF_ERR_VALUE) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_NOT_IMPLEMENTED", SF_ERR_NOT_IMPLEMENTED) < 0 ||
        PyModule_AddIntConstant(m, "STATUS_RUNTIME", SF_ERR_RUNTIME) < 0 ||
        PyModule_AddIntConstant(m, "GROUPED_MAX_LANES", SF_GROUPED_MAX_LANES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
