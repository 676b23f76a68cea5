/*
 * embed.c - sf_embedding_backward_add, the public entry: validates every
 * argument once (both backends share these rules and messages), describes
 * the problem in an sf_embed_problem and dispatches to the CPU reference
 * (embed_cpu.c) or the CUDA kernel (embed_cuda.cu).
 */
#include "../core/dispatch.h"
#include "embed_backend.h"

static sf_status check_rows(const char *op, const char *arg, const sf_tensor *t)
{
    if (t->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D, got %d dimensions", op, arg, t->ndim);
    if (t->shape[1] > 1 && t->strides[1] != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have unit stride along its last dimension (got %lld)",
                       op, arg, (long long)t->strides[1]);
    if (t->shape[0] > 1 && t->strides[0] < t->shape[1])
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' has overlapping rows (row stride %lld < width %lld)", op,
                       arg, (long long)t->strides[0], (long long)t->shape[1]);
    return SF_OK;
}

sf_status sf_embedding_backward_add(const sf_tensor *dy, const sf_tensor *sorted_ids, const sf_tensor *order,
                                    int64_t padding_idx, sf_tensor *dweight, sf_stream stream)
{
    const char *op = "embedding_backward_add";
    SF_TRY(sf_check_float_input(op, "dy", dy));
    SF_TRY(check_rows(op, "dy", dy));
    SF_TRY(sf_check_dtype(op, "dweight", dweight, dy->dtype));
    SF_TRY(check_rows(op, "dweight", dweight));
    SF_TRY(sf_check_writable(op, "dweight", dweight));
    SF_TRY(sf_check_same_device(op, "dy", dy, "dweight", dweight));
    if (dweight->shape[1] != dy->shape[1])
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'dy' and 'dweight' must have the same width, got %lld and %lld",
                       op, (long long)dy->shape[1], (long long)dweight->shape[1]);
    int64_t n = dy->shape[0];
    SF_TRY(sf_check_vector(op, "sorted_ids", sorted_ids, SF_INT64, n, "dy", dy, 0));
    SF_TRY(sf_check_vector(op, "order", order, SF_INT64, n, "dy", dy, 0));
    {
        const sf_mem_arg outs[] = {{"dweight", dweight, NULL}};
        const sf_mem_arg ins[] = {{"dy", dy, NULL}, {"sorted_ids", sorted_ids, NULL}, {"order", order, NULL}};
        SF_TRY(sf_check_apart(op, outs, 1, ins, 3));
    }
    sf_embed_problem p;
    p.n = n;
    p.h = dy->shape[1];
    p.v = dweight->shape[0];
    p.dy_stride = dy->strides[0];
    p.dw_stride = dweight->strides[0];
    p.padding_idx = padding_idx < 0 ? -1 : padding_idx;
    const int64_t *ids = (const int64_t *)sorted_ids->data;
    const int64_t *ord = (const int64_t *)order->data;
    if (dy->device == SF_CPU) { /* the host can read the indices: check them here, once */
        for (int64_t j = 0; j < n; ++j) {
            if (ids[j] < 0 || ids[j] >= p.v)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'sorted_ids' holds %lld at %lld, outside [0, %lld) "
                               "(the rows of 'dweight')", op, (long long)ids[j], (long long)j, (long long)p.v);
            if (j > 0 && ids[j] < ids[j - 1])
                return sf_fail(SF_ERR_VALUE, "%s: argument 'sorted_ids' must be non-decreasing (%lld at %lld "
                               "after %lld)", op, (long long)ids[j], (long long)j, (long long)ids[j - 1]);
            if (ord[j] < 0 || ord[j] >= n)
                return sf_fail(SF_ERR_VALUE, "%s: argument 'order' holds %lld at %lld, outside [0, %lld) (the "
                               "rows of 'dy')", op, (long long)ord[j], (long long)j, (long long)n);
        }
        return sf_embedding_backward_add_cpu(&p, dy, ids, ord, dweight);
    }
    return SF_IF_CUDA(op, "dy", sf_embedding_backward_add_cuda(&p, dy, ids, ord, dweight, stream));
}
