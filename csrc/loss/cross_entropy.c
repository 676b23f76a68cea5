/*
 * cross_entropy.c - the public entries of the fused cross-entropy: validate
 * every argument once (shared by both backends), then dispatch to the CPU
 * reference (cross_entropy_cpu.c) or the CUDA kernels (cross_entropy_cuda.cu).
 * The loss family's files are named after its one op: cross_entropy.h is
 * its math header, check_cross_entropy.cu its standalone check.
 */
#include "../core/dispatch.h"
#include "cross_entropy_backend.h"

static sf_status check_logits(const char *op, const char *arg, const sf_tensor *x)
{
    SF_TRY(sf_check_float_input(op, arg, x));
    if (x->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D [N, V], got %d dimensions", op,
                       arg, x->ndim);
    if (x->shape[1] > 1 && x->strides[1] != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have unit stride along V (got %lld)",
                       op, arg, (long long)x->strides[1]);
    if (x->shape[0] > 1 && x->strides[0] < x->shape[1])
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' has overlapping rows (row stride %lld < V = %lld)",
                       op, arg, (long long)x->strides[0], (long long)x->shape[1]);
    if (x->shape[1] < 1 || x->shape[1] > 0x7fffffff)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have 1 <= V < 2^31 classes, got %lld", op,
                       arg, (long long)x->shape[1]);
    return SF_OK;
}

static sf_status check_row_vector(const char *op, const char *arg, const sf_tensor *v, sf_dtype dtype,
                                  int64_t n, const sf_tensor *logits)
{
    SF_TRY(sf_check_dtype(op, arg, v, dtype));
    if (v->ndim != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 1-D [N], got %d dimensions", op, arg,
                       v->ndim);
    return sf_check_vector(op, arg, v, dtype, n, "logits", logits, 0);
}

static sf_status check_common(const char *op, const sf_tensor *logits, const sf_tensor *labels,
                              int64_t ignore_index, float label_smoothing)
{
    SF_TRY(check_logits(op, "logits", logits));
    SF_TRY(check_row_vector(op, "labels", labels, SF_INT64, logits->shape[0], logits));
    if (!(label_smoothing >= 0.0f && label_smoothing <= 1.0f))
        return sf_fail(SF_ERR_VALUE, "%s: argument 'label_smoothing' must be in [0, 1], got %g", op,
                       (double)label_smoothing);
    if (logits->device == SF_CPU) { /* the host can read the labels: check them once here */
        const int64_t *y = (const int64_t *)labels->data;
        for (int64_t i = 0; i < logits->shape[0]; ++i)
            if (y[i] != ignore_index && (y[i] < 0 || y[i] >= logits->shape[1]))
                return sf_fail(SF_ERR_VALUE, "%s: argument 'labels' holds %lld at row %lld, outside "
                               "[0, %lld) and not ignore_index %lld", op, (long long)y[i],
                               (long long)i, (long long)logits->shape[1], (long long)ignore_index);
    }
    return SF_OK;
}

/* The bad-label record of a CUDA call (seqfuse_loss.h): both or neither; the
 * claim a writable int32 word on the logits' device, the record a writable
 * contiguous int64 [SF_LABEL_RECORD_LEN] in host memory (that the GPU can
 * write it is checked by the CUDA backend, which asks the driver). */
static sf_status check_label_record(const char *op, const sf_tensor *logits, const sf_tensor *claim,
                                    const sf_tensor *record)
{
    if (!claim != !record)
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'label_claim' and 'label_record' go together: give "
                       "both or neither (got only '%s')", op, claim ? "label_claim" : "label_record");
    if (!claim)
        return SF_OK;
    SF_TRY(sf_check_vector(op, "label_claim", claim, SF_INT32, 1, "logits", logits, 1));
    SF_TRY(sf_check_dtype(op, "label_record", record, SF_INT64));
    SF_TRY(sf_check_numel(op, "label_record", record, SF_LABEL_RECORD_LEN));
    SF_TRY(sf_check_contiguous(op, "label_record", record));
    SF_TRY(sf_check_writable(op, "label_record", record));
    if (record->device != SF_CPU)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'label_record' must be in page-locked host memory "
                       "(torch pin_memory=True), got a tensor on a GPU", op);
    return SF_OK;
}

sf_status sf_cross_entropy_forward(const sf_tensor *logits, const sf_tensor *labels,
                                   int64_t ignore_index, float label_smoothing, sf_tensor *loss,
                                   sf_tensor *lse, sf_tensor *label_claim, sf_tensor *label_record,
                                   sf_stream stream)
{
    static const char op[] = "cross_entropy_forward";
    SF_TRY(check_common(op, logits, labels, ignore_index, label_smoothing));
    int64_t n = logits->shape[0];
    SF_TRY(check_row_vector(op, "loss", loss, SF_FLOAT32, n, logits));
    SF_TRY(check_row_vector(op, "lse", lse, SF_FLOAT32, n, logits));
    SF_TRY(sf_check_writable(op, "loss", loss));
    SF_TRY(sf_check_writable(op, "lse", lse));
    SF_TRY(check_label_record(op, logits, label_claim, label_record));
    {
        const sf_mem_arg outs[] = {{"loss", loss, NULL}, {"lse", lse, NULL}, {"label_claim", label_claim, NULL},
                                   {"label_record", label_record, NULL}};
        const sf_mem_arg ins[] = {{"logits", logits, NULL}, {"labels", labels, NULL}};
        SF_TRY(sf_check_apart(op, outs, 4, ins, 2));
    }
    return SF_DISPATCH(op, "logits", logits,
                       sf_cross_entropy_forward_cpu(logits, labels, ignore_index, label_smoothing,
                                                    loss, lse),
                       sf_cross_entropy_forward_cuda(logits, labels, ignore_index, label_smoothing,
                                                     loss, lse, label_claim, label_record, stream));
}

sf_status sf_cross_entropy_backward(const sf_tensor *logits, const sf_tensor *labels,
                                    const sf_tensor *lse, const sf_tensor *grad_scale,
                                    int64_t ignore_index, float label_smoothing,
                                    sf_tensor *dlogits, sf_stream stream)
{
    static const char op[] = "cross_entropy_backward";
    SF_TRY(check_common(op, logits, labels, ignore_index, label_smoothing));
    int64_t n = logits->shape[0];
    SF_TRY(check_row_vector(op, "lse", lse, SF_FLOAT32, n, logits));
    SF_TRY(sf_check_dtype(op, "grad_scale", grad_scale, SF_FLOAT32));
    int64_t ns = sf_numel(grad_scale);
    if (ns != 1 && ns != n)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'grad_scale' must have 1 or N = %lld elements, got %lld",
                       op, (long long)n, (long long)ns);
    SF_TRY(sf_check_contiguous(op, "grad_scale", grad_scale));
    SF_TRY(sf_check_same_device(op, "logits", logits, "grad_scale", grad_scale));
    SF_TRY(check_logits(op, "dlogits", dlogits));
    SF_TRY(sf_check_dtype(op, "dlogits", dlogits, logits->dtype));
    SF_TRY(sf_check_same_shape(op, "logits", logits, "dlogits", dlogits));
    SF_TRY(sf_check_same_device(op, "logits", logits, "dlogits", dlogits));
    SF_TRY(sf_check_writable(op, "dlogits", dlogits));
    {
        /* (dlogits may be logits itself: each row is read whole before it is written) */
        const sf_mem_arg outs[] = {{"dlogits", dlogits, "logits"}};
        const sf_mem_arg ins[] = {{"logits", logits, NULL}, {"labels", labels, NULL}, {"lse", lse, NULL},
                                  {"grad_scale", grad_scale, NULL}};
        SF_TRY(sf_check_apart(op, outs, 1, ins, 4));
    }
    return SF_DISPATCH(op, "logits", logits,
                       sf_cross_entropy_backward_cpu(logits, labels, lse, grad_scale, ignore_index,
                                                     label_smoothing, dlogits),
                       sf_cross_entropy_backward_cuda(logits, labels, lse, grad_scale,
                                                      ignore_index, label_smoothing, dlogits,
                                                      stream));
}
