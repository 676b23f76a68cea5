/*
 * seqfuse_loss.h - public C API of the loss family: fused cross-entropy (csrc/loss/).
 * Included by seqfuse.h; include that, not this.
 *
 * Cross-entropy over rows of logits, as torch.nn.functional.cross_entropy
 * defines it (with label_smoothing e and V classes):
 *   lse  = log sum_j exp(x_j)
 *   loss = lse - (1 - e) x_y - (e / V) sum_j x_j      (0 where y == ignore_index)
 *   dx_j = scale * (softmax_j - (1 - e)[j == y] - e / V) (0 where y == ignore_index)
 * The forward streams each row once with an online (running max, running
 * sum) softmax, so no fp32 softmax is ever materialized; the backward streams
 * it again and may write the gradient over the logits themselves.
 */
#ifndef SEQFUSE_LOSS_H
#define SEQFUSE_LOSS_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * sf_cross_entropy_forward: per-row loss and log-sum-exp.
 *   logits  fp32 / fp16 / bf16 [N, V], unit stride along V, any row stride
 *   labels  int64 [N]; a label outside [0, V) other than ignore_index is an
 *           error on the CPU and gives a NaN loss on the GPU (the host never
 *           reads device labels), recorded in label_record when one is given
 *   loss    fp32 [N] (written; 0 for ignored rows)
 *   lse     fp32 [N] (written; what the backward needs)
 *   label_claim, label_record  both NULL, or both given (CUDA only; the CPU
 *           refuses a bad label at the call and ignores them):
 *           label_claim   int32, 1 element, on the logits' device, 0 while
 *                         nothing is recorded: the first bad row sets it to 1
 *                         and owns the record; later ones leave it alone
 *           label_record  int64, SF_LABEL_RECORD_LEN elements, in page-locked
 *                         host memory the GPU can write (torch pin_memory):
 *                         the kernel writes the fields below, then (after a
 *                         system-wide fence) STATE = 1, so a host that reads
 *                         STATE == 1 may read the rest without waiting
 *           The caller zeroes both after reading a record (the claim with a
 *           kernel or copy on the stream, STATE on the host).
 */
enum {
    SF_LABEL_STATE = 0,   /* 0: nothing recorded; 1: the fields below are written */
    SF_LABEL_ROW = 1,     /* the bad row, counted in this call's logits */
    SF_LABEL_VALUE = 2,   /* its label */
    SF_LABEL_CLASSES = 3, /* V of the call */
    SF_LABEL_IGNORE = 4,  /* ignore_index of the call */
    SF_LABEL_ADDRESS = 5, /* the bad label's address (labels' data + row) */
    SF_LABEL_RECORD_LEN = 6
};

sf_status sf_cross_entropy_forward(const sf_tensor *logits, const sf_tensor *labels,
                                   int64_t ignore_index, float label_smoothing,
                                   sf_tensor *loss, sf_tensor *lse, sf_tensor *label_claim,
                                   sf_tensor *label_record, sf_stream stream);

/*
 * sf_cross_entropy_backward: dlogits = scale * d loss / d logits, row by row.
 *   grad_scale  fp32 with 1 element (all rows) or N (per row): the upstream
 *               gradient times the reduction's factor (1 / number of
 *               non-ignored rows for a mean), kept on the device
 *   dlogits     same dtype and shape as logits, unit stride along V; may be
 *               logits itself (same memory and strides: the gradient then
 *               overwrites the logits, saving a buffer)
 */
sf_status sf_cross_entropy_backward(const sf_tensor *logits, const sf_tensor *labels,
                                    const sf_tensor *lse, const sf_tensor *grad_scale,
                                    int64_t ignore_index, float label_smoothing,
                                    sf_tensor *dlogits, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_LOSS_H */
