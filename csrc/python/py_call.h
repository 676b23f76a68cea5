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

/* One tensor argument of a binding: its position in args, its name in
 * messages, and whether None may stand for it (or, past nargs, nothing). */
typedef struct {
    int index;
    const char *name;
    int optional;
} sf_py_tensor_arg;

/* The number of entries of a binding's sf_py_tensor_arg table. */
#define SF_PY_NARGS(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* A binding's call and the tensors it imported, in its table's order:
 * t[i] points at views[i], or is NULL for an optional argument given None
 * or left out. */
typedef struct {
    sf_py_call call;
    sf_tensor *t[SF_PY_MAX_BORROWS];
    sf_tensor views[SF_PY_MAX_BORROWS];
} sf_py_args;

/* The opening every tensor binding shares: start the call with args[stream_at]
 * as its stream (None where nargs stops before it), then import the n tensors
 * that spec names, in its order (the first CUDA tensor decides the stream when
 * none was given; the first bad one is the one named).  On failure gives back
 * every borrowed tensor and returns -1 with a Python exception set, so the
 * binding simply returns NULL; on success it ends with
 * sf_py_finish(&a->call, status). */
int sf_py_begin(sf_py_args *a, const char *op, PyObject *const *args, Py_ssize_t nargs,
                int stream_at, const sf_py_tensor_arg *spec, int n);

/* The import half of sf_py_begin, for a binding that started a->call itself
 * (and imported other arguments first): same table, same failure rule. */
int sf_py_import(sf_py_args *a, PyObject *const *args, Py_ssize_t nargs,
                 const sf_py_tensor_arg *spec, int n);

/* Read a float positional argument as float; a non-number raises TypeError
 * naming op and arg. */
int sf_py_arg_float(const char *op, const char *arg, PyObject *obj, float *out);

/* Read an int (or bool) positional argument as long; a non-integer raises
 * TypeError, one past a C long ValueError, naming op and arg (as
 * sf_py_arg_float does for floats). */
int sf_py_arg_long(const char *op, const char *arg, PyObject *obj, long *out);

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

/* A Python list (any sequence) of tensors imported as views.  The sequence
 * is first copied into a tuple (so the tensors stay referenced while the GIL
 * is released), then every tensor runs through its own short sf_py_call
 * whose DLPack borrow is given back right after its view is read: a list may
 * be far longer than the per-call borrow limit, and the tuple keeps the
 * memory alive meanwhile.  The first CUDA tensor decides c's stream when it
 * has none.  Items are named "<name>[i]" in messages. */
typedef struct {
    PyObject *tuple;
    Py_ssize_t n;
    sf_tensor *views;
} sf_py_tensor_list;

/* Import `seq` into l (zero-initialise l first); -1 with a Python exception
 * set on failure (then still call sf_py_list_free). */
int sf_py_list_import(sf_py_call *c, PyObject *stream_obj, PyObject *seq, const char *name,
                      sf_py_tensor_list *l);
void sf_py_list_free(sf_py_tensor_list *l);

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
extern PyMethodDef sf_py_grouped_methods[];
extern PyMethodDef sf_py_moe_methods[];

#endif /* SF_PY_CALL_H */
