/*
 * py_call.h - what every binding in the extension uses to turn Python
 * arguments into sf_tensor views and to report failures.
 *
 * One sf_py_call lives on the stack of each binding.  It holds the op's name
 * (for messages), the CUDA stream the op will run on, and every DLPack
 * tensor borrowed during the call, so one sf_py_call_release() at the single
 * cleanup label gives each of them back exactly once.
 *
 * Two import paths, chosen per tensor type:
 *   fast:   the type publishes DLPack's C exchange API; C fills a DLTensor in
 *           place (no Python call, no capsule) and asks the producer for its
 *           current stream.  torch >= 2.10 offers this.
 *   portable: obj.__dlpack__(stream=..., max_version=(1, 0)) returning a
 *           versioned capsule, or a legacy capsule from older producers.  The
 *           capsule is renamed to "used_..." and its deleter is called once,
 *           at release.
 */
#ifndef SF_PY_CALL_H
#define SF_PY_CALL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "seqfuse.h"

#define SF_PY_MAX_BORROWS 16

typedef struct {
    void *managed;  /* DLManagedTensorVersioned* or DLManagedTensor* */
    int versioned;
} sf_py_borrow;

typedef struct {
    const char *op;
    int have_stream;     /* stream resolved (explicitly or from the producer) */
    sf_stream stream;
    int n_borrows;
    sf_py_borrow borrows[SF_PY_MAX_BORROWS];
} sf_py_call;

/* Start a call.  stream_obj: None (use the producer's current stream) or an
 * int holding a cudaStream_t (0 = legacy default stream).  Returns -1 with a
 * Python exception set on a bad stream argument. */
int sf_py_call_init(sf_py_call *c, const char *op, PyObject *stream_obj);

/* Import obj as a tensor view.  `arg` names it in messages.  Returns -1 with
 * a Python exception set on failure. */
int sf_py_tensor(sf_py_call *c, PyObject *obj, const char *arg, sf_tensor *out);

/* Same, but None gives has=0 and leaves out untouched. */
int sf_py_optional_tensor(sf_py_call *c, PyObject *obj, const char *arg,
                          sf_tensor *out, int *has);

/* The stream for CUDA work (resolved by the tensors imported so far). */
sf_stream sf_py_call_stream(const sf_py_call *c);

/* Give back every borrowed tensor (calls each DLPack deleter once). */
void sf_py_call_release(sf_py_call *c);

/* The common tail of a binding whose op returns nothing: release every
 * borrowed tensor, then None on SF_OK or the status's exception. */
PyObject *sf_py_finish(sf_py_call *c, sf_status status);

/* A METH_FASTCALL entry of a method table: the cast and the flag. */
#define SF_PY_FASTCALL(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

/* Raise the Python exception for a failing status, with sf_last_error(). */
PyObject *sf_py_raise(sf_status status);

/* The body of a `<op>(tensor, stream=None) -> int` size query binding (the
 * workspace_numel entries): import the one tensor as `arg`, ask `query`,
 * return the count or raise. */
PyObject *sf_py_numel_query(const char *op, const char *arg, PyObject *const *args,
                            Py_ssize_t nargs,
                            sf_status (*query)(const sf_tensor *, int64_t *));

/* Check the positional argument count of a METH_FASTCALL binding. */
int sf_py_check_nargs(const char *op, Py_ssize_t nargs, Py_ssize_t min_args,
                      Py_ssize_t max_args);

/* Turn the fast exchange path on or off (benchmarks compare the two). */
void sf_py_set_exchange_api(int enabled);
int sf_py_exchange_api_enabled(void);

/* The method tables of each binding file, joined in module.c. */
extern PyMethodDef sf_py_core_methods[];
extern PyMethodDef sf_py_quant_methods[];
extern PyMethodDef sf_py_gemm_methods[];
extern PyMethodDef sf_py_norm_methods[];
extern PyMethodDef sf_py_act_methods[];
extern PyMethodDef sf_py_rope_methods[];
extern PyMethodDef sf_py_loss_methods[];
extern PyMethodDef sf_py_optim_methods[];
extern PyMethodDef sf_py_attn_methods[];

#endif /* SF_PY_CALL_H */
