/*
 * py_call.c - DLPack import into sf_tensor views, stream resolution, the
 * status -> exception mapping, and the one driver every declared binding runs
 * through (sf_py_drive).  See py_call.h for the two import paths and the
 * binding tables.
 *
 * DLPack rules followed here:
 *   - a capsule named "dltensor_versioned" / "dltensor" is consumed by
 *     renaming it "used_dltensor_versioned" / "used_dltensor"; from then on
 *     the consumer (us) calls the managed tensor's deleter, exactly once, and
 *     the producer's capsule destructor does nothing;
 *   - a versioned tensor whose major version we do not know is given back at
 *     once without reading any other field;
 *   - the stream argument of __dlpack__ is the consumer's stream, so the
 *     producer only synchronizes when it differs from its own; the legacy
 *     default stream (0 in torch) is spelled 1 there.
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "py_call.h"

#include "dlpack_abi.h"

/* ---- exceptions ------------------------------------------------------- */

PyObject *sf_py_raise(sf_status status)
{
    PyObject *type;
    switch (status) {
    case SF_ERR_TYPE: type = PyExc_TypeError; break;
    case SF_ERR_VALUE: type = PyExc_ValueError; break;
    case SF_ERR_NOT_IMPLEMENTED: type = PyExc_NotImplementedError; break;
    default: type = PyExc_RuntimeError; break;
    }
    const char *msg = sf_last_error();
    PyErr_SetString(type, msg[0] ? msg : "seqfuse: unknown error");
    return NULL;
}

/* ---- the per-type cache ------------------------------------------------ *
 * One lookup per tensor type, then a pointer compare per argument.  Types
 * stay referenced while cached, so an address is never reused under us.
 * Each entry keeps the type's DLPack C exchange API (NULL: none we can use)
 * and its `is_neg` method, if it has one (torch's).
 *
 * Why is_neg: torch can mark a tensor "negative" (torch._neg_view(x), the
 * imaginary part of a conjugate view) without touching its memory, and DLPack
 * has no field for that bit: both import paths hand over x's memory, so the op
 * would silently compute with x where the caller means -x.  The bit lives in
 * torch's dispatch keys, out of C's reach without libtorch, so the import asks
 * the tensor through the method descriptor (a vectorcall, no attribute
 * lookup).  torch's conjugate bit needs no question: only complex tensors
 * carry it, and seqfuse takes no complex dtype. */

#define SF_API_CACHE 8

typedef struct {
    PyTypeObject *type;
    const DLPackExchangeAPI *api; /* NULL: the type has none we can use */
    PyObject *is_neg;             /* the type's is_neg method (new ref), or NULL */
    PyCFunction is_neg_c;         /* its C function where it is a METH_NOARGS method
                                   * descriptor of a base of the type, else NULL */
    PyObject *storage;            /* the type's untyped_storage method (new ref), or NULL */
} sf_type_entry;

static sf_type_entry sf_type_cache[SF_API_CACHE];
static int sf_type_cache_used;
static int sf_exchange_enabled = 1;

void sf_py_set_exchange_api(int enabled) { sf_exchange_enabled = enabled != 0; }
int sf_py_exchange_api_enabled(void) { return sf_exchange_enabled; }

/* Usable only if it speaks our major version and has both non-owning
 * entries we call. */
static int sf_exchange_api_usable(const DLPackExchangeAPI *api)
{
    return api != NULL && api->header.version.major == SF_DLPACK_MAJOR &&
           api->dltensor_from_py_object_no_sync != NULL && api->current_work_stream != NULL;
}

static const DLPackExchangeAPI *sf_find_exchange_api(PyTypeObject *type)
{
    const DLPackExchangeAPI *api = NULL;
    PyObject *cap = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
    if (cap == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (PyCapsule_CheckExact(cap) && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
        api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(cap, "dlpack_exchange_api");
    } else if (PyLong_Check(cap)) {
        /* Some producers publish the table's address as an int. */
        api = (const DLPackExchangeAPI *)PyLong_AsVoidPtr(cap);
        PyErr_Clear();
    }
    if (!sf_exchange_api_usable(api))
        api = NULL;
    Py_DECREF(cap); /* the table itself lives as long as the producer */
    return api;
}

/* The type's method `name` if it has a callable one (new ref), else NULL. */
static PyObject *sf_find_method(PyTypeObject *type, const char *name)
{
    PyObject *m = PyObject_GetAttrString((PyObject *)type, name);
    if (m == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!PyCallable_Check(m))
        Py_CLEAR(m);
    return m;
}

/* The cache entry of type (filled on first sight); a type seen after the
 * cache is full gets a one-off entry in *spare, its reference kept there
 * until sf_type_entry_done. */
static const sf_type_entry *sf_lookup_type(PyTypeObject *type, sf_type_entry *spare)
{
    for (int i = 0; i < sf_type_cache_used; ++i)
        if (sf_type_cache[i].type == type)
            return &sf_type_cache[i];
    sf_type_entry e = {type, sf_find_exchange_api(type), sf_find_method(type, "is_neg"), NULL,
                       sf_find_method(type, "untyped_storage")};
    if (e.is_neg != NULL && Py_IS_TYPE(e.is_neg, &PyMethodDescr_Type)) {
        PyMethodDescrObject *d = (PyMethodDescrObject *)e.is_neg;
        if ((d->d_method->ml_flags & (METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O |
                                      METH_KEYWORDS | METH_METHOD)) == METH_NOARGS &&
            PyType_IsSubtype(type, PyDescr_TYPE(d)))
            e.is_neg_c = d->d_method->ml_meth;
    }
    if (sf_type_cache_used < SF_API_CACHE) {
        Py_INCREF(type);
        sf_type_cache[sf_type_cache_used] = e;
        return &sf_type_cache[sf_type_cache_used++];
    }
    *spare = e;
    return spare;
}

static void sf_type_entry_done(const sf_type_entry *e, sf_type_entry *spare)
{
    if (e == spare) {
        Py_CLEAR(spare->is_neg);
        Py_CLEAR(spare->storage);
    }
}

/* -1 with ValueError if obj carries torch's negative bit (or is_neg fails). */
static int sf_py_check_neg(sf_py_call *c, const sf_type_entry *e, PyObject *obj, const char *arg)
{
    if (e->is_neg == NULL)
        return 0;
    PyObject *r;
    if (e->is_neg_c != NULL) /* a C method of the type's own (torch's): call it directly */
        r = e->is_neg_c(obj, NULL);
    else
        r = PyObject_Vectorcall(e->is_neg, &obj, 1, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r); /* True and False are immortal or otherwise alive */
    if (r == Py_False)
        return 0;
    if (r == Py_True) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' has torch's negative bit set; call .resolve_neg() "
                     "first (DLPack cannot carry the bit: its memory holds the negation of "
                     "the values it stands for)",
                     c->op, arg);
        return -1;
    }
    return 0; /* not a bool: not torch's bit */
}

/* The storage check.  DLPack carries a data pointer, a shape and strides but
 * not how much memory lies behind them, and torch lets a storage shrink under
 * a tensor that keeps its shape (x.untyped_storage().resize_(n), which FSDP
 * does to resharded parameters, or a hand-made resize): the kernels would
 * then read and write past the end of the allocation (silently wrong values,
 * heap corruption or a segfault).  Where the tensor's type has
 * untyped_storage() (torch's), the bytes the view spans, from its lowest to
 * its highest element, must lie inside [storage.data_ptr(),
 * storage.data_ptr() + storage.nbytes()).  Three Python method calls per
 * tensor with elements (untyped_storage, nbytes, data_ptr): about 0.6 us per
 * tensor on the H200 machine; producers without the method (numpy, which cannot shrink an
 * array in place) are trusted, as DLPack must trust them, in all but one
 * thing: every tensor's bytes must fit in 64 bits and in the 64-bit address
 * range (a layout whose rows wrap around it would alias its own elements,
 * which the element-wise internal-overlap check cannot see; the C library
 * refuses such outputs too, sf_check_writable). */
static PyObject *sf_str_nbytes, *sf_str_data_ptr;

static int sf_py_storage_long(PyObject *storage, PyObject *name, long long *out)
{
    PyObject *v = PyObject_CallMethodNoArgs(storage, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int sf_py_check_storage(sf_py_call *c, const sf_type_entry *e, PyObject *obj,
                               const char *arg, const sf_tensor *t)
{
    if (t->data == NULL)
        return 0;
    /* every tensor, trusted producers' too: its bytes fit in 64 bits and in the address range */
    int64_t first, last;
    const int span = sf_tensor_bytes(t, &first, &last);
    if (span == 0)
        return 0; /* no elements: nothing is read or written */
    if (span < 0)
        goto too_big;
    if (e->storage == NULL)
        return 0; /* a producer without storage (numpy, a DLPack capsule): trusted, as DLPack must */
    if (sf_str_nbytes == NULL || sf_str_data_ptr == NULL) {
        PyObject *nbytes = PyUnicode_InternFromString("nbytes");
        PyObject *data_ptr = PyUnicode_InternFromString("data_ptr");
        if (nbytes == NULL || data_ptr == NULL) {
            Py_XDECREF(nbytes);
            Py_XDECREF(data_ptr);
            return -1;
        }
        Py_XSETREF(sf_str_nbytes, nbytes);
        Py_XSETREF(sf_str_data_ptr, data_ptr);
    }
    PyObject *storage = PyObject_Vectorcall(e->storage, &obj, 1, NULL);
    if (storage == NULL) {
        /* a tensor without storage (a wrapper subclass) cannot be checked:
         * refuse it rather than trust the pointer DLPack gave */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' has no storage seqfuse can check its extent "
                     "against: %S",
                     c->op, arg, value);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    long long nbytes = 0, base = 0;
    int rc = sf_py_storage_long(storage, sf_str_nbytes, &nbytes);
    if (rc == 0)
        rc = sf_py_storage_long(storage, sf_str_data_ptr, &base);
    Py_DECREF(storage);
    if (rc < 0)
        return -1;
    {
        /* the same bytes relative to the storage's start */
        const long long at = (long long)((uintptr_t)t->data - (uintptr_t)base);
        long long lo, hi;
        if (__builtin_add_overflow((long long)first, at, &lo) ||
            __builtin_add_overflow((long long)last, at, &hi))
            goto too_big;
        if (lo >= 0 && hi <= nbytes)
            return 0;
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' spans bytes [%lld, %lld) of its storage (from its "
                     "shape, strides and storage offset) but the storage holds %lld bytes; "
                     "was the storage resized (untyped_storage().resize_()) or freed after "
                     "the tensor was made?",
                     c->op, arg, lo, hi, nbytes);
        return -1;
    }
too_big:
    PyErr_Format(PyExc_ValueError,
                 "%s: argument '%s' has shape and strides whose extent overflows 64 bits "
                 "(its bytes would wrap around the address space)",
                 c->op, arg);
    return -1;
}

/* ---- DLTensor -> sf_tensor ------------------------------------------- */

/* The DLPack dtypes seqfuse takes (all one lane), most common first. */
static const struct {
    uint8_t code;
    uint8_t bits;
    sf_dtype dtype;
} sf_dl_dtypes[] = {
    {kDLBfloat, 16, SF_BFLOAT16},      {kDLFloat, 32, SF_FLOAT32},
    {kDLFloat, 16, SF_FLOAT16},        {kDLFloat8_e4m3fn, 8, SF_FLOAT8_E4M3},
    {kDLFloat8_e5m2, 8, SF_FLOAT8_E5M2}, {kDLFloat8_e8m0fnu, 8, SF_FLOAT8_E8M0},
    {kDLInt, 32, SF_INT32},            {kDLInt, 64, SF_INT64},
    {kDLUInt, 8, SF_UINT8},            {kDLBool, 8, SF_BOOL},
};

static int sf_dtype_from_dl(const char *op, const char *arg, DLDataType dt, sf_dtype *out)
{
    if (dt.lanes == 1)
        for (size_t i = 0; i < sizeof sf_dl_dtypes / sizeof sf_dl_dtypes[0]; ++i)
            if (sf_dl_dtypes[i].code == dt.code && sf_dl_dtypes[i].bits == dt.bits) {
                *out = sf_dl_dtypes[i].dtype;
                return 0;
            }
    PyErr_Format(PyExc_TypeError,
                 "%s: argument '%s' has a dtype seqfuse does not take (DLPack code %u, "
                 "%u bits, %u lanes); use float32, float16, bfloat16, float8_e4m3fn, "
                 "float8_e5m2, float8_e8m0fnu, int32, int64, uint8 or bool (packed fp4 "
                 "travels as uint8)",
                 op, arg, dt.code, dt.bits, dt.lanes);
    return -1;
}

static int sf_view_from_dl(const char *op, const char *arg, const DLTensor *dl,
                           int readonly, sf_tensor *out)
{
    if (dl->ndim < 0 || dl->ndim > SF_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' has %d dimensions; at most %d are supported",
                     op, arg, (int)dl->ndim, SF_MAX_DIMS);
        return -1;
    }
    switch (dl->device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: /* pinned host memory: the CPU reads it directly */
        out->device = SF_CPU;
        out->device_id = 0;
        break;
    case kDLCUDA:
    case kDLCUDAManaged:
        out->device = SF_CUDA;
        out->device_id = dl->device.device_id;
        break;
    default:
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' lives on a device seqfuse cannot use (DLPack "
                     "device type %d); move it to the CPU or a CUDA GPU",
                     op, arg, (int)dl->device.device_type);
        return -1;
    }
    if (sf_dtype_from_dl(op, arg, dl->dtype, &out->dtype) < 0)
        return -1;
    out->ndim = dl->ndim;
    out->readonly = readonly;
    out->data = dl->data ? (void *)((char *)dl->data + dl->byte_offset) : NULL;
    int64_t stride = 1;
    int empty = 0;
    for (int i = dl->ndim - 1; i >= 0; --i) {
        if (dl->shape[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' has a negative size (%lld) in "
                         "dimension %d", op, arg, (long long)dl->shape[i], i);
            return -1;
        }
        empty |= dl->shape[i] == 0;
        out->shape[i] = dl->shape[i];
        out->strides[i] = dl->strides ? dl->strides[i] : stride;
        stride *= dl->shape[i];
    }
    if (dl->data == NULL && !empty) {
        /* what torch exports for a tensor whose storage was freed or resized
         * to 0 (x.untyped_storage().resize_(0), as FSDP2 does to a resharded
         * parameter) while its shape still promises elements */
        PyErr_Format(PyExc_ValueError,
                     "%s: argument '%s' has no memory (a NULL data pointer) but a non-empty "
                     "shape; was its storage freed or resized to 0?",
                     op, arg);
        return -1;
    }
    return 0;
}

/* ---- calls -------------------------------------------------------------- */

int sf_py_call_init(sf_py_call *c, const char *op, PyObject *stream_obj)
{
    c->op = op;
    c->n_borrows = 0;
    c->have_stream = 0;
    c->stream = NULL;
    if (stream_obj != NULL && stream_obj != Py_None) {
        if (!PyLong_Check(stream_obj)) {
            PyErr_Format(PyExc_TypeError,
                         "%s: argument 'stream' must be None or an int (a cudaStream_t, "
                         "as torch.cuda.Stream.cuda_stream gives), got %s",
                         op, Py_TYPE(stream_obj)->tp_name);
            return -1;
        }
        void *p = PyLong_AsVoidPtr(stream_obj);
        if (p == NULL && PyErr_Occurred())
            return -1;
        c->stream = p;
        c->have_stream = 1;
    }
    return 0;
}

sf_stream sf_py_call_stream(const sf_py_call *c) { return c->stream; }

/* Call a borrowed tensor's DLPack deleter (the one place that does). */
static void sf_py_give_back(void *managed, int versioned)
{
    if (versioned) {
        DLManagedTensorVersioned *m = managed;
        if (m->deleter) m->deleter(m);
    } else {
        DLManagedTensor *m = managed;
        if (m->deleter) m->deleter(m);
    }
}

static int sf_py_push_borrow(sf_py_call *c, void *managed, int versioned)
{
    if (c->n_borrows == SF_PY_MAX_BORROWS) {
        /* cannot happen with the bindings as written; give it back now */
        sf_py_give_back(managed, versioned);
        PyErr_Format(PyExc_RuntimeError, "%s: more than %d tensor arguments", c->op,
                     SF_PY_MAX_BORROWS);
        return -1;
    }
    c->borrows[c->n_borrows].managed = managed;
    c->borrows[c->n_borrows].versioned = versioned;
    c->n_borrows++;
    return 0;
}

void sf_py_call_release(sf_py_call *c)
{
    if (c->n_borrows == 0)
        return;
    /* A deleter may run Python code (a producer written in Python); keep any
     * exception this call is raising out of its way. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (int i = c->n_borrows - 1; i >= 0; --i)
        sf_py_give_back(c->borrows[i].managed, c->borrows[i].versioned);
    c->n_borrows = 0;
    PyErr_Restore(type, value, traceback);
}

/* The fast path: no capsule, nothing to give back. */
static int sf_py_tensor_exchange(sf_py_call *c, const DLPackExchangeAPI *api, PyObject *obj,
                                 const char *arg, sf_tensor *out)
{
    DLTensor dl;
    if (api->dltensor_from_py_object_no_sync(obj, &dl) != 0) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s: argument '%s' could not be exported through DLPack",
                         c->op, arg);
        } else {
            /* the producer's reason (torch: "Cannot pack tensors on meta", a
             * RuntimeError that named no argument), kept and named */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *text = value ? PyObject_Str(value) : NULL;
            const char *s = text ? PyUnicode_AsUTF8(text) : NULL;
            PyErr_Clear();
            /* torch appends a C++ backtrace after the first line */
            char first[256];
            snprintf(first, sizeof first, "%s", s ? s : "");
            first[strcspn(first, "\n")] = '\0';
            PyErr_Format(PyExc_ValueError,
                         "%s: argument '%s' cannot be exported through DLPack (a tensor on a "
                         "device seqfuse cannot use, or of a kind DLPack cannot describe): %s",
                         c->op, arg, first);
            Py_XDECREF(text);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }
    if (sf_view_from_dl(c->op, arg, &dl, 0, out) < 0)
        return -1;
    if (out->device == SF_CUDA && !c->have_stream) {
        void *stream = NULL;
        if (api->current_work_stream(kDLCUDA, dl.device.device_id, &stream) != 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_RuntimeError, "%s: the producer of '%s' gave no current stream",
                             c->op, arg);
            return -1;
        }
        c->stream = stream;
        c->have_stream = 1;
    }
    return 0;
}

/* After a failed DLPack call on obj: an AttributeError (no __dlpack__ or
 * __dlpack_device__) becomes the TypeError that names the argument; any other
 * error stays.  Returns -1. */
static int sf_py_not_dlpack(sf_py_call *c, PyObject *obj, const char *arg)
{
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' must be a tensor supporting DLPack (a torch "
                     "tensor or numpy array), got %s",
                     c->op, arg, Py_TYPE(obj)->tp_name);
    }
    return -1;
}

/* Ask obj where it lives, through __dlpack_device__ (portable path only). */
/* obj.<name> if it is callable (new ref); else -1 with the TypeError that
 * names the argument ("'int' object is not callable" named nothing). */
static PyObject *sf_py_dlpack_method(sf_py_call *c, PyObject *obj, const char *arg,
                                     const char *name)
{
    PyObject *m = PyObject_GetAttrString(obj, name);
    if (m == NULL) {
        sf_py_not_dlpack(c, obj, arg);
        return NULL;
    }
    if (!PyCallable_Check(m)) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s': %s must be callable, got %s", c->op,
                     arg, name, Py_TYPE(m)->tp_name);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

static int sf_py_dlpack_device(sf_py_call *c, PyObject *obj, const char *arg, int *type)
{
    PyObject *method = sf_py_dlpack_method(c, obj, arg, "__dlpack_device__");
    if (method == NULL)
        return -1;
    PyObject *dev = PyObject_CallNoArgs(method);
    Py_DECREF(method);
    if (dev == NULL) {
        return sf_py_not_dlpack(c, obj, arg);
    }
    int ok = PyTuple_Check(dev) && PyTuple_GET_SIZE(dev) == 2;
    if (ok) {
        *type = (int)PyLong_AsLong(PyTuple_GET_ITEM(dev, 0));
        ok = !PyErr_Occurred();
    }
    Py_DECREF(dev);
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' has a malformed __dlpack_device__()",
                     c->op, arg);
        return -1;
    }
    return 0;
}

static PyObject *sf_py_call_dlpack(PyObject *method, PyObject *stream, int versioned)
{
    PyObject *args = PyTuple_New(0);
    PyObject *kwargs = PyDict_New();
    PyObject *capsule = NULL;
    if (args && kwargs) {
        int ok = 1;
        if (stream != NULL)
            ok = PyDict_SetItemString(kwargs, "stream", stream) == 0;
        if (ok && versioned) {
            PyObject *v = Py_BuildValue("(ii)", SF_DLPACK_MAJOR, 0);
            ok = v && PyDict_SetItemString(kwargs, "max_version", v) == 0;
            Py_XDECREF(v);
        }
        if (ok)
            capsule = PyObject_Call(method, args, kwargs);
    }
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return capsule;
}

static int sf_py_tensor_capsule(sf_py_call *c, PyObject *obj, const char *arg, sf_tensor *out)
{
    int device_type = kDLCPU;
    if (sf_py_dlpack_device(c, obj, arg, &device_type) < 0)
        return -1;
    PyObject *stream = NULL; /* NULL: pass no stream (CPU) */
    if (device_type == kDLCUDA || device_type == kDLCUDAManaged) {
        if (!c->have_stream) {
            PyErr_Format(PyExc_ValueError,
                         "%s: argument 'stream' is required: '%s' is a CUDA tensor whose type "
                         "offers no DLPack C exchange API to ask for its current stream",
                         c->op, arg);
            return -1;
        }
        uintptr_t s = (uintptr_t)c->stream;
        stream = PyLong_FromUnsignedLongLong(s == 0 ? 1u : (unsigned long long)s);
        if (stream == NULL)
            return -1;
    }

    /* torch's __dlpack__ refuses tensors that require grad; seqfuse only
     * reads or writes their memory, so export a detached view instead. */
    PyObject *source = obj;
    Py_INCREF(source);
    PyObject *requires_grad = PyObject_GetAttrString(obj, "requires_grad");
    if (requires_grad == NULL) {
        PyErr_Clear();
    } else {
        int needs_detach = PyObject_IsTrue(requires_grad);
        Py_DECREF(requires_grad);
        if (needs_detach > 0) {
            PyObject *detached = PyObject_CallMethod(obj, "detach", NULL);
            if (detached == NULL) {
                Py_DECREF(source);
                Py_XDECREF(stream);
                return -1;
            }
            Py_SETREF(source, detached);
        } else if (needs_detach < 0) {
            PyErr_Clear();
        }
    }
    PyObject *method = sf_py_dlpack_method(c, source, arg, "__dlpack__");
    PyObject *capsule = NULL;
    if (method != NULL) {
        capsule = sf_py_call_dlpack(method, stream, 1);
        if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* a producer older than DLPack 1.0 knows no max_version */
            PyErr_Clear();
            capsule = sf_py_call_dlpack(method, stream, 0);
        }
        Py_DECREF(method);
    }
    Py_DECREF(source); /* the capsule holds what it needs */
    Py_XDECREF(stream);
    if (capsule == NULL) {
        if (method != NULL && PyErr_ExceptionMatches(PyExc_BufferError)) {
            /* the producer's refusal (torch: a conjugate view, a sparse
             * layout): keep its reason, name the argument */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' cannot be exported through DLPack: %S",
                         c->op, arg, value);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return -1;
        }
        return method == NULL ? -1 : sf_py_not_dlpack(c, obj, arg);
    }

    int rc = -1;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (m == NULL || PyCapsule_SetName(capsule, "used_dltensor_versioned") != 0)
            goto done;
        if (m->version.major != SF_DLPACK_MAJOR) {
            sf_py_give_back(m, 1);
            PyErr_Format(PyExc_TypeError,
                         "%s: argument '%s' is a DLPack %u.%u tensor; seqfuse reads major "
                         "version %d",
                         c->op, arg, m->version.major, m->version.minor, SF_DLPACK_MAJOR);
            goto done;
        }
        if (sf_py_push_borrow(c, m, 1) < 0)
            goto done;
        rc = sf_view_from_dl(c->op, arg, &m->dl_tensor,
                             (m->flags & SF_DLPACK_FLAG_READ_ONLY) != 0, out);
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (m == NULL || PyCapsule_SetName(capsule, "used_dltensor") != 0)
            goto done;
        if (sf_py_push_borrow(c, m, 0) < 0)
            goto done;
        rc = sf_view_from_dl(c->op, arg, &m->dl_tensor, 0, out);
    } else {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s'.__dlpack__() returned no unused DLPack capsule",
                     c->op, arg);
    }
done:
    Py_DECREF(capsule); /* renamed "used_*": its destructor leaves the tensor to us */
    return rc;
}

int sf_py_tensor(sf_py_call *c, PyObject *obj, const char *arg, sf_tensor *out)
{
    sf_type_entry spare;
    const sf_type_entry *e = sf_lookup_type(Py_TYPE(obj), &spare);
    int rc = sf_py_check_neg(c, e, obj, arg);
    if (rc == 0)
        rc = sf_exchange_enabled && e->api != NULL ? sf_py_tensor_exchange(c, e->api, obj, arg, out)
                                                   : sf_py_tensor_capsule(c, obj, arg, out);
    if (rc == 0)
        rc = sf_py_check_storage(c, e, obj, arg, out);
    sf_type_entry_done(e, &spare);
    return rc;
}

/* ---- lists of tensors (see py_call.h) ---- */

void sf_py_list_free(sf_py_tensor_list *l)
{
    Py_XDECREF(l->tuple);
    PyMem_Free(l->views);
    l->tuple = NULL;
    l->views = NULL;
}

/* Item i of list l's tuple into l->views[i] under the name ``arg``, taking
 * the stream c has (or giving c the one it finds). */
static int list_item_import(sf_py_call *c, PyObject *stream_obj, sf_py_tensor_list *l, Py_ssize_t i,
                            const char *arg)
{
    sf_py_call one;
    if (sf_py_call_init(&one, c->op, stream_obj) < 0)
        return -1;
    if (c->have_stream) {
        one.stream = c->stream;
        one.have_stream = 1;
    }
    int rc = sf_py_tensor(&one, PyTuple_GET_ITEM(l->tuple, i), arg, &l->views[i]);
    if (rc == 0 && !c->have_stream && one.have_stream) {
        c->stream = one.stream;
        c->have_stream = 1;
    }
    sf_py_call_release(&one);
    return rc;
}

int sf_py_list_import(sf_py_call *c, PyObject *stream_obj, PyObject *seq, const char *name,
                       sf_py_tensor_list *l)
{
    l->views = NULL;
    l->tuple = PySequence_Tuple(seq);
    if (l->tuple == NULL) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be a list of tensors, got %s", c->op, name,
                     Py_TYPE(seq)->tp_name);
        return -1;
    }
    l->n = PyTuple_GET_SIZE(l->tuple);
    l->views = PyMem_Calloc(l->n > 0 ? (size_t)l->n : 1, sizeof(sf_tensor));
    if (l->views == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < l->n; ++i) {
        /* under the list's bare name: the indexed one ("grads[3]") costs a formatting per tensor and
         * call, so it is made only for a refusal's message, by importing that tensor again under it */
        if (list_item_import(c, stream_obj, l, i, name) == 0)
            continue;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        char arg[64];
        snprintf(arg, sizeof arg, "%s[%zd]", name, i);
        if (list_item_import(c, stream_obj, l, i, arg) < 0) {
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        } else {
            PyErr_Restore(type, value, tb); /* (a producer that refused once and not twice: its first word) */
        }
        return -1;
    }
    return 0;
}

/* ---- the binding driver (see py_call.h) --------------------------------- */

/* The argument-count TypeError, worded as CPython words it. */
static int count_error(const sf_py_binding *b, Py_ssize_t given)
{
    const int min = b->plan->min_args;
    if (min == b->n_args)
        PyErr_Format(PyExc_TypeError, "%s() takes %d positional arguments (%zd given)", b->op, min,
                     given);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes from %d to %d positional arguments (%zd given)",
                     b->op, min, b->n_args, given);
    return -1;
}

/* obj[i]: the object given for argument i, positionally or by keyword, or
 * NULL where it was left out (allowed only for an optional argument). */
static int gather(const sf_py_binding *b, PyObject *const *args, Py_ssize_t nargs,
                  PyObject *kwnames, PyObject **obj)
{
    const int n = b->n_args;
    if (nargs > n)
        return count_error(b, nargs);
    for (int i = 0; i < n; ++i)
        obj[i] = i < nargs ? args[i] : NULL;
    if (kwnames == NULL && nargs >= b->plan->min_args)
        return 0; /* the usual call: every required argument in place */
    const Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; ++k) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(key, b->args[i].name) != 0)
            ++i;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", b->op, key);
            return -1;
        }
        if (obj[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", b->op,
                         b->args[i].name);
            return -1;
        }
        obj[i] = args[nargs + k];
    }
    for (int i = (int)nargs; i < n; ++i) {
        if (obj[i] != NULL || b->args[i].optional)
            continue;
        if (nkw == 0) /* positional only: CPython's wording, as before keywords */
            return count_error(b, nargs);
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' is missing", b->op, b->args[i].name);
        return -1;
    }
    return 0;
}

/* The number readers' one failure path: a value of the right kind too
 * large for C (OverflowError) is a ValueError, anything else a TypeError. */
static int arg_fail(const char *op, const char *arg, PyObject *obj, const char *kind)
{
    const int overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (overflow)
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' is out of range, got %R", op, arg, obj);
    else
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be %s, got %s", op, arg, kind,
                     Py_TYPE(obj)->tp_name);
    return -1;
}

int sf_py_arg_long(const char *op, const char *arg, PyObject *obj, long *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return arg_fail(op, arg, obj, "an int");
    *out = v;
    return 0;
}

/* Step 2: a number, flag, object or the stream (o NULL: left out). */
static int read_scalar(sf_py_frame *f, const sf_py_arg *a, PyObject *o, sf_py_value *v)
{
    const char *op = f->b->op;
    switch (a->kind) {
    case SF_PY_INT: {
        long x = (long)a->dflt;
        if (o != NULL && sf_py_arg_long(op, a->name, o, &x) < 0)
            return -1;
        if (x < INT_MIN || x > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' must fit in a C int, got %ld", op,
                         a->name, x);
            return -1;
        }
        v->i = (int)x;
        return 0;
    }
    case SF_PY_INT64:
        v->i64 = o != NULL ? PyLong_AsLongLong(o) : (int64_t)a->dflt;
        return v->i64 == -1 && PyErr_Occurred() ? arg_fail(op, a->name, o, "an int") : 0;
    case SF_PY_U64:
        v->u64 = o != NULL ? PyLong_AsUnsignedLongLong(o) : (uint64_t)a->dflt;
        if (v->u64 == (uint64_t)-1 && PyErr_Occurred()) {
            const int overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
            PyErr_Clear();
            if (overflow) /* negative or past 2**64 */
                PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be an int in [0, 2**64), got %R",
                             op, a->name, o);
            else
                PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be an int in [0, 2**64), got %s",
                             op, a->name, Py_TYPE(o)->tp_name);
            return -1;
        }
        return 0;
    case SF_PY_FLOAT:
        v->f = o != NULL ? PyFloat_AsDouble(o) : a->dflt;
        return v->f == -1.0 && PyErr_Occurred() ? arg_fail(op, a->name, o, "a float") : 0;
    case SF_PY_BOOL:
        v->b = o != NULL ? PyObject_IsTrue(o) : a->dflt != 0;
        return v->b < 0 ? -1 : 0;
    case SF_PY_OBJECT:
        v->o = o != NULL ? o : Py_None;
        return 0;
    default: /* tensors and lists (step 3) and the stream are not scalars */
        return 0;
    }
}

/* Step 3: a tensor or list argument (o NULL: left out). */
static int import_arg(sf_py_frame *f, const sf_py_arg *a, PyObject *o, int *n_views,
                      sf_py_value *v)
{
    const int opt = a->kind == SF_PY_OPT_TENSOR || a->kind == SF_PY_OPT_TENSOR_LIST;
    if (opt && (o == NULL || o == Py_None)) {
        v->t = NULL;
        v->list = NULL;
        return 0;
    }
    if (a->kind == SF_PY_TENSOR || a->kind == SF_PY_OPT_TENSOR) {
        v->t = &f->views[(*n_views)++];
        return sf_py_tensor(&f->call, o, a->name, v->t);
    }
    sf_py_tensor_list *l = &f->lists[f->n_lists++];
    memset(l, 0, sizeof *l);
    v->list = l;
    return sf_py_list_import(&f->call, f->stream_obj, o, a->name, l);
}

PyObject *sf_py_drive(const sf_py_binding *b, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames)
{
    PyObject *obj[SF_PY_MAX_ARGS];
    if (gather(b, args, nargs, kwnames, obj) < 0)
        return NULL;
    sf_py_frame f;
    f.b = b;
    f.stream_obj = Py_None;
    f.n_lists = 0;
    const sf_py_arg *spec = b->args;
    const sf_py_plan *plan = b->plan;
    for (int k = 0; k < plan->n_scalars; ++k) {
        const int i = plan->scalars[k];
        if (read_scalar(&f, &spec[i], obj[i], &f.v[i]) < 0)
            return NULL;
    }
    if (plan->stream_at >= 0 && obj[plan->stream_at] != NULL)
        f.stream_obj = obj[plan->stream_at];
    if (sf_py_call_init(&f.call, b->op, f.stream_obj) < 0)
        return NULL;

    int ok = 1, n_views = 0, prepared = 0;
    for (int k = 0; ok && k < plan->n_tensors; ++k) {
        const int i = plan->tensors[k];
        ok = import_arg(&f, &spec[i], obj[i], &n_views, &f.v[i]) == 0;
    }
    if (ok && b->prepare != NULL) {
        prepared = 1;
        ok = b->prepare(&f) == 0;
    }
    sf_status st = SF_OK;
    PyObject *result = NULL;
    if (ok && b->call != NULL) {
        Py_BEGIN_ALLOW_THREADS
        st = b->call(f.v, f.call.stream);
        Py_END_ALLOW_THREADS
    }
    if (ok && st == SF_OK)
        result = b->result != NULL ? b->result(&f) : Py_NewRef(Py_None);

    if (prepared && b->cleanup != NULL)
        b->cleanup(&f);
    for (int i = 0; i < f.n_lists; ++i)
        sf_py_list_free(&f.lists[i]);
    sf_py_call_release(&f.call);
    if (ok && st != SF_OK)
        return sf_py_raise(st);
    return result;
}

PyObject *sf_py_result_i64(sf_py_frame *f)
{
    return PyLong_FromLongLong(f->v[f->b->n_args].i64);
}

/* ---- adding bindings to the module -------------------------------------- */

/* Fill b's plan.  A table mistake (too many arguments, tensors or lists,
 * two streams) is found when the module loads, not in the middle of a call. */
static int plan_binding(const sf_py_binding *b)
{
    int tensors = 0, lists = 0, streams = 0;
    sf_py_plan *p = b->plan;
    memset(p, 0, sizeof *p);
    p->stream_at = -1;
    for (int i = 0; i < b->n_args && b->n_args <= SF_PY_MAX_ARGS; ++i) {
        const sf_py_kind k = b->args[i].kind;
        tensors += k == SF_PY_TENSOR || k == SF_PY_OPT_TENSOR;
        lists += k == SF_PY_TENSOR_LIST || k == SF_PY_OPT_TENSOR_LIST;
        streams += k == SF_PY_STREAM;
        p->min_args += !b->args[i].optional;
        if (k == SF_PY_STREAM)
            p->stream_at = i;
        else if (k <= SF_PY_OPT_TENSOR_LIST) /* the four tensor kinds come first */
            p->tensors[p->n_tensors++] = (unsigned char)i;
        else
            p->scalars[p->n_scalars++] = (unsigned char)i;
    }
    if (b->n_args > SF_PY_MAX_ARGS || tensors > SF_PY_MAX_BORROWS || lists > SF_PY_MAX_LISTS ||
        streams > 1) {
        PyErr_Format(PyExc_SystemError, "seqfuse._C: binding %s declares %d arguments, %d tensors, "
                     "%d lists and %d streams (at most %d, %d, %d and 1)", b->name, b->n_args,
                     tensors, lists, streams, SF_PY_MAX_ARGS, SF_PY_MAX_BORROWS, SF_PY_MAX_LISTS);
        return -1;
    }
    return 0;
}

/* "name($module, a, b, stream=None)\n--\n\n<doc>": CPython's text-signature
 * form, which inspect.signature and help() read. */
static char *make_doc(const sf_py_binding *b)
{
    size_t size = strlen(b->name) + strlen(b->doc) + 32;
    for (int i = 0; i < b->n_args; ++i)
        size += strlen(b->args[i].name) + 32;
    char *doc = PyMem_RawMalloc(size);
    if (doc == NULL)
        return NULL;
    size_t at = (size_t)snprintf(doc, size, "%s($module", b->name);
    for (int i = 0; i < b->n_args; ++i) {
        const sf_py_arg *a = &b->args[i];
        at += (size_t)snprintf(doc + at, size - at, ", %s", a->name);
        if (!a->optional)
            continue;
        if (a->kind == SF_PY_INT || a->kind == SF_PY_INT64 || a->kind == SF_PY_U64 ||
            a->kind == SF_PY_FLOAT)
            at += (size_t)snprintf(doc + at, size - at, "=%g", a->dflt);
        else if (a->kind == SF_PY_BOOL)
            at += (size_t)snprintf(doc + at, size - at, "=%s", a->dflt != 0 ? "True" : "False");
        else
            at += (size_t)snprintf(doc + at, size - at, "=None");
    }
    snprintf(doc + at, size - at, ")\n--\n\n%s", b->doc);
    return doc;
}

int sf_py_add_bindings(PyObject *m, const sf_py_binding *const *table)
{
    int n = 0;
    while (table[n] != NULL)
        ++n;
    /* the method definitions and docstrings live as long as the process:
     * the functions made from them point into them */
    PyMethodDef *defs = PyMem_RawCalloc((size_t)n + 1, sizeof(PyMethodDef));
    if (defs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < n; ++i) {
        const sf_py_binding *b = table[i];
        if (plan_binding(b) < 0)
            return -1;
        char *doc = make_doc(b);
        if (doc == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        defs[i].ml_name = b->name;
        defs[i].ml_meth = (PyCFunction)(void (*)(void))b->entry;
        defs[i].ml_flags = METH_FASTCALL | METH_KEYWORDS;
        defs[i].ml_doc = doc;
    }
    return PyModule_AddFunctions(m, defs);
}
