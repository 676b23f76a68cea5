/*
 * rope.c - sf_rope and sf_rope_parts, the public entries (one tensor, or up
 * to three parts along the head dimension written into one): validates every
 * argument once (both backends share these rules and messages), describes
 * the problem in an sf_rope_problem (token grid, each part's strides, rotary
 * width, the heads turned) and dispatches to the CPU reference (rope_cpu.c)
 * or the CUDA kernel (rope_cuda.cu).
 */
#include "../core/dispatch.h"
#include "rope_backend.h"

static const char *format_name(sf_rope_format f)
{
    return f == SF_ROPE_SBHD ? "sbhd" : f == SF_ROPE_BSHD ? "bshd" : "thd";
}

static sf_status check_index_vector(const char *op, const char *arg, const sf_tensor *v,
                                    const sf_tensor *t, int64_t expected)
{
    SF_TRY(sf_check_dtype(op, arg, v, SF_INT32));
    if (v->ndim != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 1-D, got %d dimensions", op,
                       arg, v->ndim);
    if (expected >= 0)
        SF_TRY(sf_check_numel(op, arg, v, expected));
    SF_TRY(sf_check_contiguous(op, arg, v));
    return sf_check_same_device(op, "t", t, arg, v);
}

static const char *const part_names[SF_ROPE_MAX_PARTS] = {"t", "t1", "t2"};

/* Each part against out: dimensions, dtype, device, the token dimensions
 * and head dim out has; their heads, in order, fill out's (p->part_end). */
static sf_status check_parts(const char *op, const sf_tensor *const *parts, int nparts, const sf_tensor *out,
                             int want_ndim, sf_rope_problem *p)
{
    const int hd = want_ndim - 2; /* index of the head dimension */
    int64_t end = 0;
    for (int i = 0; i < nparts; ++i) {
        const sf_tensor *x = parts[i];
        const char *name = part_names[i];
        SF_TRY(sf_check_dtype(op, name, x, out->dtype));
        SF_TRY(sf_check_same_device(op, "t", parts[0], name, x));
        if (x->ndim != want_ndim)
            return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have %d dimensions, as 'out', got %d", op, name,
                           want_ndim, x->ndim);
        for (int k = 0; k < want_ndim; ++k)
            if (k != hd && x->shape[k] != out->shape[k])
                return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must match 'out' in every dimension but the heads "
                               "(%d), got %lld against %lld in dimension %d", op, name, hd,
                               (long long)x->shape[k], (long long)out->shape[k], k);
        end += x->shape[hd];
        p->part_end[i] = end;
        for (int k = 0; k < 4; ++k)
            p->in_stride[i][k] = 0;
        if (want_ndim == 3) {
            p->in_stride[i][0] = x->strides[0];
        } else {
            p->in_stride[i][0] = x->strides[0];
            p->in_stride[i][1] = x->strides[1];
        }
        p->in_stride[i][2] = x->strides[hd];
        p->in_stride[i][3] = x->strides[hd + 1];
    }
    for (int i = nparts; i < SF_ROPE_MAX_PARTS; ++i)
        p->part_end[i] = end;
    if (end != out->shape[hd])
        return sf_fail(SF_ERR_VALUE, "%s: argument 'out' must have the parts' %lld heads together, got %lld", op,
                       (long long)end, (long long)out->shape[hd]);
    return SF_OK;
}

/* sf_rope and sf_rope_parts; rotate_heads < 0: every head. */
static sf_status rope_run(const sf_tensor *const *parts, int nparts, int64_t rotate_heads, const sf_tensor *freqs,
                          const sf_tensor *cu_seqlens, const sf_tensor *start_positions, sf_rope_format format,
                          int interleaved, int backward, sf_tensor *out, sf_stream stream)
{
    const char *op = backward ? "rope_backward" : "rope";
    const sf_tensor *t = parts[0];
    if (format != SF_ROPE_SBHD && format != SF_ROPE_BSHD && format != SF_ROPE_THD)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'tensor_format' must be sbhd, bshd or thd (got %d)",
                       op, (int)format);
    SF_TRY(sf_check_float_input(op, "t", t));
    SF_TRY(sf_check_dtype(op, "out", out, t->dtype));
    SF_TRY(sf_check_writable(op, "out", out));
    SF_TRY(sf_check_same_device(op, "t", t, "out", out));
    SF_TRY(sf_check_same_device(op, "t", t, "freqs", freqs));
    if (nparts == 1)
        SF_TRY(sf_check_same_shape(op, "t", t, "out", out));
    int want_ndim = format == SF_ROPE_THD ? 3 : 4;
    if (t->ndim != want_ndim)
        return sf_fail(SF_ERR_VALUE, "%s: argument 't' must have %d dimensions for tensor_format "
                       "'%s', got %d", op, want_ndim, format_name(format), t->ndim);
    if (out->ndim != want_ndim)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'out' must have %d dimensions for tensor_format "
                       "'%s', got %d", op, want_ndim, format_name(format), out->ndim);
    SF_TRY(sf_check_dtype(op, "freqs", freqs, SF_FLOAT32));
    if (freqs->ndim != 4 && freqs->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'freqs' must have shape [s2, 1, 1, rot_dim] "
                       "(or [s2, rot_dim]), got %d dimensions", op, freqs->ndim);
    if (freqs->ndim == 4 && (freqs->shape[1] != 1 || freqs->shape[2] != 1))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'freqs' must have shape [s2, 1, 1, rot_dim], "
                       "got [%lld, %lld, %lld, %lld]", op, (long long)freqs->shape[0],
                       (long long)freqs->shape[1], (long long)freqs->shape[2],
                       (long long)freqs->shape[3]);

    sf_rope_problem p;
    p.format = (int)format;
    p.interleaved = interleaved != 0;
    p.backward = backward != 0;
    SF_TRY(check_parts(op, parts, nparts, out, want_ndim, &p));
    int hd = want_ndim - 2; /* index of the head dimension */
    p.heads = out->shape[hd];
    p.dim = out->shape[hd + 1];
    if (rotate_heads > p.heads)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'rotate_heads' must be at most out's %lld heads, got %lld", op,
                       (long long)p.heads, (long long)rotate_heads);
    p.rotate_heads = rotate_heads < 0 ? p.heads : rotate_heads;
    p.rot = freqs->shape[freqs->ndim - 1];
    p.max_pos = freqs->shape[0];
    p.f_stride_pos = freqs->strides[0];
    p.f_stride_dim = freqs->strides[freqs->ndim - 1];
    if (p.rot <= 0 || p.rot % 2 != 0 || p.rot > p.dim)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'freqs' must have an even last dimension "
                       "rot_dim with 0 < rot_dim <= head dim %lld, got %lld", op,
                       (long long)p.dim, (long long)p.rot);
    p.n0 = out->shape[0];
    p.n1 = format == SF_ROPE_THD ? 1 : out->shape[1];
    p.out_stride[0] = out->strides[0];
    p.out_stride[1] = format == SF_ROPE_THD ? 0 : out->strides[1];
    p.out_stride[2] = out->strides[hd];
    p.out_stride[3] = out->strides[hd + 1];

    int64_t seq_len = format == SF_ROPE_BSHD ? out->shape[1] : out->shape[0];
    if (format == SF_ROPE_THD) {
        if (cu_seqlens == NULL)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' is required for tensor_format 'thd'", op);
        SF_TRY(check_index_vector(op, "cu_seqlens", cu_seqlens, t, -1));
        if (cu_seqlens->shape[0] < 2)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' must have batch + 1 >= 2 "
                           "elements, got %lld", op, (long long)cu_seqlens->shape[0]);
        p.batch = cu_seqlens->shape[0] - 1;
    } else {
        if (cu_seqlens != NULL)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' is only valid for tensor_format "
                           "'thd', got '%s'", op, format_name(format));
        p.batch = format == SF_ROPE_BSHD ? out->shape[0] : out->shape[1];
        if (start_positions == NULL && seq_len > p.max_pos)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'freqs' covers %lld positions but 't' has "
                           "sequence length %lld", op, (long long)p.max_pos, (long long)seq_len);
    }
    if (start_positions != NULL)
        SF_TRY(check_index_vector(op, "start_positions", start_positions, t, p.batch));
    {
        /* (out may be t itself, the only part: each element pair is read before it is written) */
        const sf_mem_arg outs[] = {{"out", out, nparts == 1 ? "t" : NULL}};
        const sf_mem_arg ins[] = {{"t", t, NULL}, {"t1", parts[1], NULL}, {"t2", parts[2], NULL},
                                  {"freqs", freqs, NULL}, {"cu_seqlens", cu_seqlens, NULL},
                                  {"start_positions", start_positions, NULL}};
        SF_TRY(sf_check_apart(op, outs, 1, ins, 6));
    }

    const int32_t *cu = cu_seqlens ? (const int32_t *)cu_seqlens->data : NULL;
    const int32_t *start = start_positions ? (const int32_t *)start_positions->data : NULL;
    if (t->device == SF_CPU) {
        /* the host can read the index vectors: check them here, once */
        if (cu != NULL) {
            if (cu[0] != 0)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' must start at 0, got %d", op, cu[0]);
            for (int64_t b = 0; b < p.batch; ++b) {
                int64_t len = (int64_t)cu[b + 1] - cu[b];
                if (len < 0)
                    return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' must be non-decreasing "
                                   "(cu_seqlens[%lld] = %d > cu_seqlens[%lld] = %d)", op, (long long)b,
                                   cu[b], (long long)b + 1, cu[b + 1]);
                int64_t off = start ? start[b] : 0;
                if (off < 0 || off + len > p.max_pos)
                    return sf_fail(SF_ERR_VALUE, "%s: sequence %lld needs positions [%lld, %lld) but "
                                   "'freqs' covers %lld", op, (long long)b, (long long)off,
                                   (long long)(off + len), (long long)p.max_pos);
            }
            if (cu[p.batch] > p.n0)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'cu_seqlens' ends at %d but 't' has %lld tokens",
                               op, cu[p.batch], (long long)p.n0);
        } else if (start != NULL) {
            for (int64_t b = 0; b < p.batch; ++b)
                if (start[b] < 0 || start[b] + seq_len > p.max_pos)
                    return sf_fail(SF_ERR_VALUE, "%s: sequence %lld needs positions [%d, %lld) but "
                                   "'freqs' covers %lld", op, (long long)b, start[b],
                                   (long long)(start[b] + seq_len), (long long)p.max_pos);
        }
        return sf_rope_cpu(&p, parts, freqs, cu, start, out);
    }
    return SF_IF_CUDA(op, "t", sf_rope_cuda(&p, parts, freqs, cu, start, out, stream));
}

sf_status sf_rope(const sf_tensor *t, const sf_tensor *freqs, const sf_tensor *cu_seqlens,
                  const sf_tensor *start_positions, sf_rope_format format, int interleaved,
                  int backward, sf_tensor *out, sf_stream stream)
{
    const sf_tensor *parts[SF_ROPE_MAX_PARTS] = {t, NULL, NULL};
    return rope_run(parts, 1, -1, freqs, cu_seqlens, start_positions, format, interleaved, backward, out, stream);
}

sf_status sf_rope_parts(const sf_tensor *t, const sf_tensor *t1, const sf_tensor *t2, int64_t rotate_heads,
                        const sf_tensor *freqs, const sf_tensor *cu_seqlens,
                        const sf_tensor *start_positions, sf_rope_format format, int interleaved,
                        int backward, sf_tensor *out, sf_stream stream)
{
    const char *op = backward ? "rope_backward" : "rope";
    if (t2 != NULL && t1 == NULL)
        return sf_fail(SF_ERR_VALUE, "%s: argument 't2' is given without 't1' (the parts come in order)", op);
    if (rotate_heads < 0)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'rotate_heads' must be >= 0, got %lld", op,
                       (long long)rotate_heads);
    const sf_tensor *parts[SF_ROPE_MAX_PARTS] = {t, t1, t2};
    return rope_run(parts, t2 ? 3 : t1 ? 2 : 1, rotate_heads, freqs, cu_seqlens, start_positions, format,
                    interleaved, backward, out, stream);
}
