/*
 * tensor.c - sf_tensor helpers and the argument checks every op shares.
 *
 * Ops validate their arguments once, at the C API entry, with these checks,
 * so the CPU and CUDA backends see the same preconditions and the same
 * messages.  Each check names the op and the argument it looked at.
 */
#include <string.h>

#include "seqfuse.h"

int64_t sf_numel(const sf_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; ++i)
        n *= t->shape[i];
    return n;
}

int sf_is_contiguous(const sf_tensor *t)
{
    int64_t expected = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
        if (t->shape[i] == 0)
            return 1; /* an empty tensor has no layout to get wrong */
        if (t->shape[i] != 1 && t->strides[i] != expected)
            return 0;
        expected *= t->shape[i];
    }
    return 1;
}

void sf_tensor_init(sf_tensor *t, void *data, sf_dtype dtype, int ndim,
                    const int64_t *shape, sf_device_type device, int device_id)
{
    memset(t, 0, sizeof *t);
    t->data = data;
    t->dtype = dtype;
    t->ndim = ndim;
    t->device = device;
    t->device_id = device_id;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; --i) {
        t->shape[i] = shape[i];
        t->strides[i] = stride;
        stride *= shape[i] > 0 ? shape[i] : 1;
    }
}

sf_status sf_check_dtype(const char *op, const char *arg, const sf_tensor *t,
                         sf_dtype expected)
{
    if (t->dtype != expected)
        return sf_fail(SF_ERR_TYPE, "%s: argument '%s' must have dtype %s, got %s",
                       op, arg, sf_dtype_name(expected), sf_dtype_name(t->dtype));
    return SF_OK;
}

sf_status sf_check_float_input(const char *op, const char *arg,
                               const sf_tensor *t)
{
    if (t->dtype != SF_FLOAT32 && t->dtype != SF_FLOAT16 && t->dtype != SF_BFLOAT16)
        return sf_fail(SF_ERR_TYPE,
                       "%s: argument '%s' must have dtype float32, float16 or "
                       "bfloat16, got %s",
                       op, arg, sf_dtype_name(t->dtype));
    return SF_OK;
}

sf_status sf_check_contiguous(const char *op, const char *arg,
                              const sf_tensor *t)
{
    if (!sf_is_contiguous(t))
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be contiguous (row-major); call "
                       ".contiguous() on it first",
                       op, arg);
    return SF_OK;
}

int sf_tensor_bytes(const sf_tensor *t, int64_t *first, int64_t *last)
{
    int64_t below = 0, above = 0; /* element offsets of the lowest and highest element */
    for (int i = 0; i < t->ndim; ++i) {
        if (t->shape[i] == 0)
            return 0;
        int64_t reach;
        if (__builtin_mul_overflow(t->shape[i] - 1, t->strides[i], &reach) ||
            __builtin_add_overflow(reach < 0 ? below : above, reach, reach < 0 ? &below : &above))
            return -1;
    }
    const int64_t size = (int64_t)sf_dtype_size(t->dtype);
    const uintptr_t p = (uintptr_t)t->data;
    int64_t past;
    uintptr_t end;
    if (__builtin_mul_overflow(below, size, first) || __builtin_add_overflow(above, (int64_t)1, &past) ||
        __builtin_mul_overflow(past, size, last) ||
        (*first < 0 && (uintptr_t)(-(*first + 1)) + 1u > p) || /* below address 0 */
        __builtin_add_overflow(p, (uintptr_t)*last, &end))     /* past the top of the address range */
        return -1;
    return 1;
}

/* The addresses [*lo, *hi) t's elements lie in: sf_tensor_bytes' answer. */
static int byte_span(const sf_tensor *t, uintptr_t *lo, uintptr_t *hi)
{
    int64_t first, last;
    const int rc = sf_tensor_bytes(t, &first, &last);
    if (rc <= 0)
        return rc;
    const uintptr_t p = (uintptr_t)t->data;
    *lo = first < 0 ? p - ((uintptr_t)(-(first + 1)) + 1u) : p + (uintptr_t)first;
    *hi = p + (uintptr_t)last;
    return 1;
}

int sf_tensors_overlap(const sf_tensor *a, const sf_tensor *b)
{
    uintptr_t alo, ahi, blo, bhi;
    const int ra = byte_span(a, &alo, &ahi), rb = byte_span(b, &blo, &bhi);
    if (ra == 0 || rb == 0)
        return 0;
    if (ra < 0 || rb < 0) /* bytes past 64 bits or around the address range: refused as overlapping */
        return 1;
    return alo < bhi && blo < ahi;
}

/* Whether a and b are the same view: address, dtype, shape and the strides of
 * every dimension that has more than one element. */
static int same_view(const sf_tensor *a, const sf_tensor *b)
{
    if (a->data != b->data || a->dtype != b->dtype || a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; ++i)
        if (a->shape[i] != b->shape[i] || (a->shape[i] > 1 && a->strides[i] != b->strides[i]))
            return 0;
    return 1;
}

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        const int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Where t's bytes can lie, as a residue interval: every byte is at
 * data + [0, *run) plus a multiple of *g, where *run is the dense run of the
 * innermost dimensions (bytes) and *g the gcd of the strides outside it
 * (bytes; 0 when t is one dense run).  0 where t has a stride that is not
 * positive on a dimension of more than one element. */
static int residue_run(const sf_tensor *t, int64_t *run, int64_t *g)
{
    int64_t size[SF_MAX_DIMS], stride[SF_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < t->ndim; ++i) {
        if (t->shape[i] == 1)
            continue;
        if (t->strides[i] <= 0)
            return 0;
        int j = n++;
        for (; j > 0 && stride[j - 1] > t->strides[i]; --j) { /* insertion sort by stride */
            stride[j] = stride[j - 1];
            size[j] = size[j - 1];
        }
        stride[j] = t->strides[i];
        size[j] = t->shape[i];
    }
    const int64_t esize = (int64_t)sf_dtype_size(t->dtype);
    int64_t chunk = 1;
    int i = 0;
    for (; i < n && stride[i] == chunk; ++i)
        if (__builtin_mul_overflow(chunk, size[i], &chunk))
            return 0;
    int64_t gg = 0;
    for (; i < n; ++i)
        gg = gcd64(gg, stride[i]);
    return esize > 0 && !__builtin_mul_overflow(chunk, esize, run) && !__builtin_mul_overflow(gg, esize, g);
}

/* Whether a and b, whose byte spans meet, still share no byte because they
 * interleave: with G the gcd of both tensors' residue periods (residue_run),
 * each one's bytes lie in one interval modulo G, and the two intervals are
 * disjoint.  q, k and v sliced out of one packed [tokens, heads, dim] tensor
 * are such views, with equal head counts or, under grouped-query attention,
 * unequal ones.  0 where this cannot be shown. */
static int interleaved_apart(const sf_tensor *a, const sf_tensor *b)
{
    int64_t run_a, g_a, run_b, g_b;
    if (!residue_run(a, &run_a, &g_a) || !residue_run(b, &run_b, &g_b))
        return 0;
    const int64_t g = gcd64(g_a, g_b);
    if (g == 0 || run_a > g || run_b > g)
        return 0; /* a dense block, or runs that wrap around the period */
    const int64_t diff = (int64_t)((intptr_t)b->data - (intptr_t)a->data);
    const int64_t r = (diff % g + g) % g; /* where b's interval starts, from a's */
    return r >= run_a && g - r >= run_b;
}

static int meet(const sf_tensor *a, const sf_tensor *b)
{
    return sf_tensors_overlap(a, b) && !interleaved_apart(a, b);
}

sf_status sf_check_apart(const char *op, const sf_mem_arg *outs, int n_out,
                         const sf_mem_arg *ins, int n_in)
{
    for (int i = 0; i < n_out; ++i) {
        const sf_tensor *o = outs[i].t;
        if (!o)
            continue;
        for (int j = i + 1; j < n_out; ++j)
            if (outs[j].t && meet(o, outs[j].t))
                return sf_fail(SF_ERR_VALUE,
                               "%s: outputs '%s' and '%s' share memory; each output needs memory "
                               "of its own", op, outs[i].name, outs[j].name);
        for (int j = 0; j < n_in; ++j) {
            const sf_tensor *in = ins[j].t;
            if (!in || !meet(o, in))
                continue;
            const int in_place = outs[i].in_place_of && strcmp(outs[i].in_place_of, ins[j].name) == 0;
            if (in_place && same_view(o, in))
                continue;
            return sf_fail(SF_ERR_VALUE,
                           "%s: output '%s' shares memory with input '%s' (the kernels read '%s' "
                           "while they write '%s', so the result would be wrong); give '%s' memory "
                           "of its own%s%s%s",
                           op, outs[i].name, ins[j].name, ins[j].name, outs[i].name, outs[i].name,
                           in_place ? ", or pass exactly '" : "", in_place ? ins[j].name : "",
                           in_place ? "' itself for an in-place call" : "");
        }
    }
    return SF_OK;
}

/* Whether two elements of t share memory: a stride-0 (expanded) dimension,
 * or strides that fold onto each other.  Dimensions of size > 1 sorted by
 * |stride|: each stride must step past everything the smaller ones span. */
static int sf_has_internal_overlap(const sf_tensor *t)
{
    int64_t size[SF_MAX_DIMS], stride[SF_MAX_DIMS];
    int n = 0;
    for (int i = 0; i < t->ndim; ++i) {
        if (t->shape[i] == 0)
            return 0; /* no elements */
        if (t->shape[i] == 1)
            continue;
        int64_t s = t->strides[i] < 0 ? -t->strides[i] : t->strides[i];
        if (s == 0)
            return 1;
        int j = n++;
        for (; j > 0 && stride[j - 1] > s; --j) { /* insertion sort by stride */
            stride[j] = stride[j - 1];
            size[j] = size[j - 1];
        }
        stride[j] = s;
        size[j] = t->shape[i];
    }
    int64_t span = 0; /* elements spanned by the dimensions so far, minus one */
    for (int i = 0; i < n; ++i) {
        if (stride[i] <= span)
            return 1;
        if (__builtin_mul_overflow(size[i] - 1, stride[i], &size[i]) ||
            __builtin_add_overflow(span, size[i], &span))
            return 1; /* cannot be a real allocation */
    }
    return 0;
}

sf_status sf_check_writable(const char *op, const char *arg, const sf_tensor *t)
{
    if (t->readonly)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' is an output but its memory is read-only",
                       op, arg);
    int64_t first, last; /* (sf_has_internal_overlap reasons in elements: it cannot see a wrap) */
    if (sf_tensor_bytes(t, &first, &last) < 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' has shape and strides whose bytes overflow 64 bits (they "
                       "would wrap around the address range onto other elements)",
                       op, arg);
    if (sf_has_internal_overlap(t))
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' is an output whose elements may overlap in memory (a "
                       "stride-0 / expanded view, or strides that fold onto each other: seqfuse "
                       "cannot show each result has a place of its own); give it memory of its "
                       "own (torch.empty, or .contiguous())",
                       op, arg);
    return SF_OK;
}

static const char *sf_device_name(sf_device_type d)
{
    return d == SF_CUDA ? "cuda" : "cpu";
}

sf_status sf_check_same_device(const char *op, const char *arg_a,
                               const sf_tensor *a, const char *arg_b,
                               const sf_tensor *b)
{
    if (a->device != b->device || (a->device == SF_CUDA && a->device_id != b->device_id))
        return sf_fail(SF_ERR_VALUE,
                       "%s: arguments '%s' (%s:%d) and '%s' (%s:%d) must be on the "
                       "same device",
                       op, arg_a, sf_device_name(a->device), a->device_id, arg_b,
                       sf_device_name(b->device), b->device_id);
    return SF_OK;
}

sf_status sf_check_numel(const char *op, const char *arg, const sf_tensor *t,
                         int64_t expected)
{
    int64_t n = sf_numel(t);
    if (n != expected)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must have %lld element(s), got %lld", op,
                       arg, (long long)expected, (long long)n);
    return SF_OK;
}

sf_status sf_check_aligned(const char *op, const char *arg, const sf_tensor *t,
                           size_t bytes)
{
    if (((uintptr_t)t->data) % bytes != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be %zu-byte aligned (its data "
                       "pointer is %p)",
                       op, arg, bytes, t->data);
    return SF_OK;
}

sf_status sf_check_same_shape(const char *op, const char *arg_a,
                              const sf_tensor *a, const char *arg_b,
                              const sf_tensor *b)
{
    int same = a->ndim == b->ndim;
    for (int i = 0; same && i < a->ndim; ++i)
        same = a->shape[i] == b->shape[i];
    if (!same)
        return sf_fail(SF_ERR_VALUE, "%s: arguments '%s' and '%s' must have the same shape",
                       op, arg_a, arg_b);
    return SF_OK;
}

sf_status sf_check_vector(const char *op, const char *arg, const sf_tensor *t,
                          sf_dtype dtype, int64_t n, const char *ref_arg,
                          const sf_tensor *ref, int writable)
{
    SF_TRY(sf_check_dtype(op, arg, t, dtype));
    SF_TRY(sf_check_numel(op, arg, t, n));
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_device(op, ref_arg, ref, arg, t));
    return writable ? sf_check_writable(op, arg, t) : SF_OK;
}

sf_status sf_check_like(const char *op, const char *arg, const sf_tensor *t,
                        const char *ref_arg, const sf_tensor *ref, int writable)
{
    SF_TRY(sf_check_dtype(op, arg, t, ref->dtype));
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_shape(op, ref_arg, ref, arg, t));
    SF_TRY(sf_check_same_device(op, ref_arg, ref, arg, t));
    return writable ? sf_check_writable(op, arg, t) : SF_OK;
}

sf_status sf_check_fp8_scaling(const char *op, const sf_tensor *scale, const sf_tensor *amax,
                               const sf_tensor *scale_inv, const char *ref_arg,
                               const sf_tensor *ref)
{
    if (scale)
        SF_TRY(sf_check_vector(op, "scale", scale, SF_FLOAT32, 1, ref_arg, ref, 0));
    if (amax)
        SF_TRY(sf_check_vector(op, "amax", amax, SF_FLOAT32, 1, ref_arg, ref, 1));
    if (scale_inv)
        SF_TRY(sf_check_vector(op, "scale_inv", scale_inv, SF_FLOAT32, 1, ref_arg, ref, 1));
    return SF_OK;
}
