/*
 * py_call.h - what every binding in the extension uses to turn Python
 * arguments into sf_tensor views and to report failures.
 *
 * One sf_py_call lives in the frame of each call (sf_py_drive, below).  It
 * holds the op's name (for messages), the CUDA stream the op will run on, and
 * every DLPack tensor borrowed during the call, so one sf_py_call_release()
 * at the end gives each of them back exactly once.
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

/* The stream for CUDA work (resolved by the tensors imported so far). */
sf_stream sf_py_call_stream(const sf_py_call *c);

/* Give back every borrowed tensor (calls each DLPack deleter once). */
void sf_py_call_release(sf_py_call *c);

/* Raise the Python exception for a failing status, with sf_last_error(). */
PyObject *sf_py_raise(sf_status status);

/* Read an int (or bool) argument as long; a non-integer raises TypeError,
 * one past a C long ValueError, both naming op and arg. */
int sf_py_arg_long(const char *op, const char *arg, PyObject *obj, long *out);

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

/* ---- declared bindings ------------------------------------------------- *
 * Every op binding is one declaration: its Python name, the name its
 * messages use, its argument table (name, kind, default) and a small typed
 * thunk that calls the C entry.  One driver, sf_py_drive, does the rest:
 *
 *   1. match positional and keyword arguments to the table (METH_FASTCALL |
 *      METH_KEYWORDS); an argument left out takes its default or is an error;
 *   2. read the numbers and flags, in table order;
 *   3. start the call on the stream argument, then import every tensor and
 *      tensor list through DLPack, in table order (the first bad one is named);
 *   4. run the binding's prepare hook, if any (checks and conversions that
 *      need the GIL: an attention config tuple, the grouped GEMM's operands);
 *   5. call the thunk with the GIL released, give every tensor back, and
 *      return None (or the result hook's value) or the status's exception.
 *
 * A family file declares each binding in one SF_PY_OP line where the C
 * entry takes the arguments in table order (the table and the thunk are
 * generated from the (KIND, name) list), else with SF_PY_BINDING(_FULL)
 * over a written-out table, thunk and hooks; it lists them in one
 * NULL-terminated table.  module.c adds the tables to the module, with a
 * signature generated from each argument table (inspect.signature reads it).
 *
 *   SF_PY_OP(amax, sf_amax, "out[0] = max |x| (float32).", (T, x), (T, out));
 *
 * is the binding amax(x, out, stream=None) calling sf_amax(x, out, stream).
 */

typedef enum {
    SF_PY_TENSOR,          /* a tensor (anything DLPack exports) */
    SF_PY_OPT_TENSOR,      /* a tensor or None (value NULL) */
    SF_PY_TENSOR_LIST,     /* a sequence of tensors (sf_py_tensor_list) */
    SF_PY_OPT_TENSOR_LIST, /* the same or None (value NULL) */
    SF_PY_INT,             /* a Python int that fits a C int */
    SF_PY_INT64,           /* a Python int that fits int64_t */
    SF_PY_U64,             /* a Python int in [0, 2**64) */
    SF_PY_FLOAT,           /* a Python number, read as a double */
    SF_PY_BOOL,            /* any object, read as its truth value */
    SF_PY_OBJECT,          /* any object, left to the prepare hook */
    SF_PY_STREAM,          /* None or an int holding a cudaStream_t; at most one */
} sf_py_kind;

/* One argument of a binding.  `optional`: it may be left out, standing for
 * None (tensors, lists, objects, the stream) or for `dflt` (numbers). */
typedef struct {
    const char *name;
    sf_py_kind kind;
    int optional;
    double dflt;
} sf_py_arg;

/* Table rows, in the binding's positional order (SF_OT: a tensor or None,
 * to be passed; SF_OT_NONE: the same, and left out means None). */
#define SF_T(name) {#name, SF_PY_TENSOR, 0, 0}
#define SF_OT(name) {#name, SF_PY_OPT_TENSOR, 0, 0}
#define SF_OT_NONE(name) {#name, SF_PY_OPT_TENSOR, 1, 0}
#define SF_TL(name) {#name, SF_PY_TENSOR_LIST, 0, 0}
#define SF_OTL(name) {#name, SF_PY_OPT_TENSOR_LIST, 0, 0}
#define SF_INT(name) {#name, SF_PY_INT, 0, 0}
#define SF_INT64(name) {#name, SF_PY_INT64, 0, 0}
#define SF_U64(name) {#name, SF_PY_U64, 0, 0}
#define SF_FLOAT(name) {#name, SF_PY_FLOAT, 0, 0}
#define SF_BOOL(name) {#name, SF_PY_BOOL, 0, 0}
#define SF_OBJ(name) {#name, SF_PY_OBJECT, 0, 0}
#define SF_STREAM {"stream", SF_PY_STREAM, 1, 0}

/* One argument's value, by kind: t (tensors; NULL for None), list (lists;
 * NULL for None), i, i64, u64, f, b, o (the borrowed object; None when left
 * out); p: what a prepare hook made of an object (in the frame's scratch). */
typedef union {
    sf_tensor *t;
    sf_py_tensor_list *list;
    int i;
    int64_t i64;
    uint64_t u64;
    double f;
    int b;
    PyObject *o;
    void *p;
} sf_py_value;

#define SF_PY_MAX_ARGS 24
#define SF_PY_MAX_LISTS 6

typedef struct sf_py_binding sf_py_binding;

/* What the driver precomputes from a binding's table when the module loads,
 * so a call touches only the arguments each step needs. */
typedef struct {
    int min_args;  /* arguments with no default */
    int stream_at; /* position of the stream argument, -1 if none */
    int n_scalars, n_tensors;
    unsigned char scalars[SF_PY_MAX_ARGS]; /* positions of numbers, flags, objects */
    unsigned char tensors[SF_PY_MAX_ARGS]; /* positions of tensors and lists */
} sf_py_plan;

/* What the driver holds during one call; the hooks see it.  v[i] is argument
 * i's value; v[n_args] is a spare slot a thunk may write a result into
 * (sf_py_result_i64 returns it).  scratch: room for what a prepare hook
 * builds (an attention config; the grouped GEMM keeps a pointer to its
 * operands there).  The frame stays small: it lives on the stack of every
 * call. */
typedef struct sf_py_frame {
    const sf_py_binding *b;
    sf_py_call call;
    PyObject *stream_obj; /* the stream argument (None when left out) */
    sf_py_value v[SF_PY_MAX_ARGS + 1];
    sf_tensor views[SF_PY_MAX_BORROWS];
    sf_py_tensor_list lists[SF_PY_MAX_LISTS];
    int n_lists;
    _Alignas(16) unsigned char scratch[256];
} sf_py_frame;

/* A typed thunk: the C entry called with the values, GIL released. */
typedef sf_status (*sf_py_thunk)(sf_py_value *v, sf_stream stream);

struct sf_py_binding {
    const char *name; /* the Python name */
    const char *op;   /* the name in messages */
    const sf_py_arg *args;
    int n_args;
    sf_py_thunk call; /* NULL: nothing to run (probe, describe) */
    int (*prepare)(sf_py_frame *f);      /* GIL held, after the imports; -1 with an exception */
    void (*cleanup)(sf_py_frame *f);     /* GIL held, last; also after prepare failed */
    PyObject *(*result)(sf_py_frame *f); /* after success; NULL hook: return None */
    PyObject *(*entry)(PyObject *, PyObject *const *, Py_ssize_t, PyObject *);
    const char *doc; /* what it does; the signature comes from args */
    sf_py_plan *plan; /* filled by sf_py_add_bindings */
};

/* The one driver every declared binding runs through. */
PyObject *sf_py_drive(const sf_py_binding *b, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames);

/* Result hook: v[n_args].i64 as a Python int (the workspace size queries). */
PyObject *sf_py_result_i64(sf_py_frame *f);

/* The common case in one line per binding: SF_PY_OP(pyname, entry, doc,
 * (KIND, name)...) declares binding `pyname` whose table is the listed
 * arguments then the stream, and whose thunk calls
 * entry(<each argument's value, in order>, stream).  KIND is T, OT, TL, INT,
 * INT64, U64, FLOAT or BOOL (the SF_T... rows above); a TL argument passes two
 * values, the list's length and its views.  Up to 16 arguments; a binding
 * whose C entry takes its arguments in another order, or which needs a hook,
 * writes its table and thunk out (SF_PY_BINDING_FULL). */
#define SF_PY_OP(pyname, entry, docstr, ...)                                                  \
    static const sf_py_arg pyname##_args[] = {SF_PY_EACH(SF_PY_ROW, __VA_ARGS__) SF_STREAM};  \
    static sf_status pyname##_thunk(sf_py_value *v, sf_stream s)                              \
    {                                                                                          \
        return entry(SF_PY_EACH(SF_PY_VALUE, __VA_ARGS__) s);                                  \
    }                                                                                          \
    SF_PY_BINDING(pyname, pyname##_args, pyname##_thunk, docstr)

/* SF_PY_OP's machinery: SF_PY_EACH(f, a0, a1, ...) is f(0, a0) f(1, a1) ...;
 * a (KIND, name) pair becomes the row SF_KIND(name) and the value
 * SF_PY_V_KIND(v[i]). */
#define SF_PY_ROW(i, pair) SF_PY_ROW_ pair,
#define SF_PY_ROW_(kind, name) SF_##kind(name)
#define SF_PY_VALUE(i, pair) SF_PY_VALUE_(i, SF_PY_KIND_ pair)
#define SF_PY_KIND_(kind, name) kind
#define SF_PY_VALUE_(i, kind) SF_PY_VALUE__(i, kind)
#define SF_PY_VALUE__(i, kind) SF_PY_V_##kind(v[i]),
#define SF_PY_V_T(x) x.t
#define SF_PY_V_OT(x) x.t
#define SF_PY_V_OT_NONE(x) x.t
#define SF_PY_V_TL(x) x.list->n, x.list->views
#define SF_PY_V_OTL(x) (x.list ? x.list->n : 0), (x.list ? x.list->views : NULL)
#define SF_PY_V_INT(x) x.i
#define SF_PY_V_INT64(x) x.i64
#define SF_PY_V_U64(x) x.u64
#define SF_PY_V_FLOAT(x) x.f
#define SF_PY_V_BOOL(x) x.b
#define SF_PY_E1(f, i, a) f(i, a)
#define SF_PY_E2(f, i, a, ...) f(i, a) SF_PY_E1(f, i + 1, __VA_ARGS__)
#define SF_PY_E3(f, i, a, ...) f(i, a) SF_PY_E2(f, i + 1, __VA_ARGS__)
#define SF_PY_E4(f, i, a, ...) f(i, a) SF_PY_E3(f, i + 1, __VA_ARGS__)
#define SF_PY_E5(f, i, a, ...) f(i, a) SF_PY_E4(f, i + 1, __VA_ARGS__)
#define SF_PY_E6(f, i, a, ...) f(i, a) SF_PY_E5(f, i + 1, __VA_ARGS__)
#define SF_PY_E7(f, i, a, ...) f(i, a) SF_PY_E6(f, i + 1, __VA_ARGS__)
#define SF_PY_E8(f, i, a, ...) f(i, a) SF_PY_E7(f, i + 1, __VA_ARGS__)
#define SF_PY_E9(f, i, a, ...) f(i, a) SF_PY_E8(f, i + 1, __VA_ARGS__)
#define SF_PY_E10(f, i, a, ...) f(i, a) SF_PY_E9(f, i + 1, __VA_ARGS__)
#define SF_PY_E11(f, i, a, ...) f(i, a) SF_PY_E10(f, i + 1, __VA_ARGS__)
#define SF_PY_E12(f, i, a, ...) f(i, a) SF_PY_E11(f, i + 1, __VA_ARGS__)
#define SF_PY_E13(f, i, a, ...) f(i, a) SF_PY_E12(f, i + 1, __VA_ARGS__)
#define SF_PY_E14(f, i, a, ...) f(i, a) SF_PY_E13(f, i + 1, __VA_ARGS__)
#define SF_PY_E15(f, i, a, ...) f(i, a) SF_PY_E14(f, i + 1, __VA_ARGS__)
#define SF_PY_E16(f, i, a, ...) f(i, a) SF_PY_E15(f, i + 1, __VA_ARGS__)
#define SF_PY_NTH(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, n, ...) n
#define SF_PY_EACH(f, ...)                                                                     \
    SF_PY_NTH(__VA_ARGS__, SF_PY_E16, SF_PY_E15, SF_PY_E14, SF_PY_E13, SF_PY_E12, SF_PY_E11,  \
              SF_PY_E10, SF_PY_E9, SF_PY_E8, SF_PY_E7, SF_PY_E6, SF_PY_E5, SF_PY_E4, SF_PY_E3, \
              SF_PY_E2, SF_PY_E1, _)(f, 0, __VA_ARGS__)

/* Declare binding `pyname` (opname: its name in messages) with argument
 * table `argtab`, thunk `thunk` and hooks (NULL where unused); defines
 * pyname##_binding for the family's table. */
#define SF_PY_BINDING_FULL(pyname, opname, argtab, thunk, prep, clean, res, docstr)           \
    static const sf_py_binding pyname##_binding;                                               \
    static sf_py_plan pyname##_plan;                                                           \
    static PyObject *pyname##_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs,   \
                                    PyObject *kwnames)                                         \
    {                                                                                          \
        (void)self;                                                                            \
        return sf_py_drive(&pyname##_binding, args, nargs, kwnames);                           \
    }                                                                                          \
    static const sf_py_binding pyname##_binding = {                                            \
        #pyname, opname, argtab, (int)(sizeof(argtab) / sizeof((argtab)[0])), thunk, prep,      \
        clean, res, pyname##_entry, docstr, &pyname##_plan}

/* The common case: the op is named as the binding, no hooks. */
#define SF_PY_BINDING(pyname, argtab, thunk, docstr) \
    SF_PY_BINDING_FULL(pyname, #pyname, argtab, thunk, NULL, NULL, NULL, docstr)

/* Add a NULL-terminated table of bindings to module m as functions whose
 * docstrings open with the signature made from each argument table; -1 with
 * an exception set on failure. */
int sf_py_add_bindings(PyObject *m, const sf_py_binding *const *table);

/* Each family file's table of bindings, added in module.c. */
extern const sf_py_binding *const sf_py_core_bindings[];
extern const sf_py_binding *const sf_py_quant_bindings[];
extern const sf_py_binding *const sf_py_gemm_bindings[];
extern const sf_py_binding *const sf_py_norm_bindings[];
extern const sf_py_binding *const sf_py_act_bindings[];
extern const sf_py_binding *const sf_py_rope_bindings[];
extern const sf_py_binding *const sf_py_loss_bindings[];
extern const sf_py_binding *const sf_py_embed_bindings[];
extern const sf_py_binding *const sf_py_optim_bindings[];
extern const sf_py_binding *const sf_py_attn_bindings[];
extern const sf_py_binding *const sf_py_grouped_bindings[];
extern const sf_py_binding *const sf_py_moe_bindings[];

/* Functions that are no op binding (build information, switches) stay
 * plain method tables.  SF_PY_NOARGS defines such a function of no
 * arguments whose result is `expr` (a new reference). */
#define SF_PY_NOARGS(fname, expr) \
    static PyObject *fname(PyObject *self, PyObject *unused) { return expr; }
extern PyMethodDef sf_py_core_methods[];
extern PyMethodDef sf_py_gemm_methods[];
extern PyMethodDef sf_py_optim_methods[];
extern PyMethodDef sf_py_attn_methods[];

#endif /* SF_PY_CALL_H */
