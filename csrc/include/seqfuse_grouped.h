/*
 * seqfuse_grouped.h - public C API of the grouped family (csrc/grouped/):
 * G matrix products of different row counts in one call, the GEMMs of a
 * mixture-of-experts layer (expert g multiplies the m_splits[g] tokens routed
 * to it by its own weight).  Included by seqfuse.h; include that, not this.
 *
 * Each of a, b and out is given one of two ways:
 *   split: one 2-D tensor whose dim 0 is divided, in order, into G runs of
 *          m_splits[0], ..., m_splits[G-1] rows (the tokens, expert-sorted);
 *   list:  an array of G 2-D views, one per group (the experts' weights).
 * m_splits gives G and the split operands' row runs; when every operand is
 * a list (allowed), each group's sizes come from its views alone.
 * Group g then computes, with sf_gemm's conventions (seqfuse_gemm.h),
 *
 *     out_g = op(a_g) @ op(b_g)  (+ bias_g, or + out_g when accumulate)
 *
 * The three products of a training step of y_g = x_g W_g^T + bias_g:
 *   forward  a = x  split, b = W list, transb=1, out = y  split (bias input)
 *   dgrad    a = dy split, b = W list, transb=0, out = dx split
 *   wgrad    a = dy split, transa=1, b = x split, out = dW list (bgrad=1:
 *            bias_list receives the bias gradients, sum over the rows of dy_g)
 *
 * An empty group (m_splits[g] = 0) is skipped when its rows are out's rows;
 * when they are the inner dimension (wgrad) its out_g is the empty sum: zero
 * (left as is when accumulate) and its bias gradient zero.
 *
 * FP8 (float8 operands), each operand's scale inverses given one of two ways:
 *   a_scale_inv: float32 with G elements (one per group: a 1-D vector of
 *                any positive element stride) or 1 (shared), per-tensor
 *                scaling;
 *   a_scale_list: G float32 tensors, group g's exactly as sf_gemm takes them
 *                for that group's operand under a_scaling (per tensor, or
 *                1x128 / 128x128 block scales: seqfuse_gemm.h's layouts).
 * read on the device.  Every group obeys sf_gemm's FP8 rules (K-major "TN"
 * operands, m, n, k multiples of 16, block scaling rules).
 *
 * Route: the row offsets are computed once from the host m_splits, then one
 * sf_gemm per non-empty group (CPU: the reference GEMM; CUDA: one cuBLASLt
 * call per group with its cached plan, on `stream`, or with lanes >= 2 on
 * that many side streams forked from and joined back into `stream` (lanes
 * = 0: as many as the SMs hold the average group's 128 x 128 output tiles
 * side by side, at most SF_GROUPED_AUTO_LANES = 4, and none when fewer
 * than two fit), each group given to the lane with the least work so far, a
 * 1/lanes share of the workspace (a multiple of 256 bytes) and, when the
 * lanes' groups fit side by side, GEMM algorithms chosen for 1/lanes of the
 * SMs; `stream` sees the call as one ordered step either way).  Listed
 * outputs that share memory run on `stream` alone (their order matters).
 * The CPU backend ignores lanes.  Row counts held in a device tensor are
 * not taken by this entry.
 */
#ifndef SEQFUSE_GROUPED_H
#define SEQFUSE_GROUPED_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sf_grouped_gemm_args {
    int num_groups;                /* G >= 1 */
    const int64_t *m_splits;       /* host array of G row counts >= 0 */
    /* Per operand exactly one of: the split tensor, or the list of G views. */
    const sf_tensor *a, *b, *out;
    const sf_tensor *a_list, *b_list, *out_list;
    int transa, transb;
    const sf_tensor *a_scale_inv;  /* fp8: float32, G or 1 elements; else NULL */
    const sf_tensor *b_scale_inv;
    const sf_tensor *a_scale_list; /* fp8: G scale tensors (instead of a_scale_inv) */
    const sf_tensor *b_scale_list;
    sf_gemm_scaling a_scaling, b_scaling; /* with the lists (per tensor or block) */
    const sf_tensor *bias_list;    /* G 1-D views or NULL: input [n] (forward),
                                      output [m] (bgrad) */
    int bgrad;                     /* bias_list is the wgrad's bias gradient */
    int accumulate;                /* beta = 1 */
    int fast_accum;                /* fp8 only */
    int allow_tf32;
    sf_tensor *workspace;          /* CUDA: cuBLASLt scratch, or NULL */
    int lanes;                     /* CUDA: 0 (chosen by the groups' sizes), 1 (the caller's
                                      stream alone) or 2 to SF_GROUPED_MAX_LANES concurrent
                                      streams (see Route) */
    int kernel;                    /* CUDA: an sf_grouped_kernel (see Kernel) */
    const char **kernel_note;      /* out, or NULL: under SF_GROUPED_KERNEL_AUTO, why a call of the sm90
                                      kernel's form (below) did not take it (a static string); NULL
                                      when it did, or when the call is not of that form */
} sf_grouped_gemm_args;

/* Kernel: which CUDA code runs the groups.
 *   AUTO      the sm90 kernel where the call fits it and pays (FP8 with fast
 *             accumulation; FP8 with split accumulation where k <= 4,096 or
 *             more than 16 groups; bf16 where the average group's 128 x 256
 *             output tiles are at most two waves of the SMs:
 *             sf_grouped_sm90_pays), else cuBLASLt per group;
 *   CUBLASLT  one cuBLASLt call per group (lanes apply);
 *   SM90      the sm90 kernel, or SF_ERR_VALUE with the rule the call breaks.
 * The sm90 kernel (grouped_sm90.h) runs every group's output tiles in one
 * persistent launch on a Hopper GPU: the forward form only (a and out split
 * by m_splits, b a list of G [n, k] views, transa=0, transb=1, no bias, no
 * accumulate, at most 64 groups), bfloat16 operands and output, or e4m3
 * operands with per-tensor scales, fast_accum=1 and a bfloat16 output;
 * k and n multiples of 16 bytes, 16-byte aligned operands.  Every group is
 * checked by sf_gemm's rules (sf_gemm_validate) first, so a call is refused
 * the same way on either kernel. */
typedef enum {
    SF_GROUPED_KERNEL_AUTO = 0,
    SF_GROUPED_KERNEL_CUBLASLT = 1,
    SF_GROUPED_KERNEL_SM90 = 2,
} sf_grouped_kernel;

#define SF_GROUPED_MAX_LANES 8

void sf_grouped_gemm_args_init(sf_grouped_gemm_args *args);

sf_status sf_grouped_gemm(const sf_grouped_gemm_args *args, sf_stream stream);

/* The experts' forward product with the groups' end rows in a tensor,
 * row_end (int32 [G], ops.moe.device_split_offsets' layout): per group g,
 * out[rows of g] = a[rows of g] @ b[g]^T, the rows of g being [row_end[g-1],
 * row_end[g]) (row_end[-1] = 0), each end clamped to [the previous end, M].
 * a [M, K] and b [G, N, K] (K-major), out [M, N] bfloat16; a and b
 * bfloat16, or float8_e4m3fn with a_scale_inv and b_scale_inv (float32, G
 * or 1 elements) and the FP8 accumulation of fast_accum; 1 to 64 groups.
 * Rows of out past the last end are not written.  On the CPU the ends are
 * read on the host and each group runs sf_gemm's reference (the
 * definition); on CUDA the sm90 grouped kernel reads them on the device,
 * so nothing waits on the host for them (a router's counts): its rules
 * apply (compute capability 9.0 and an sm_90a build, else
 * SF_ERR_NOT_IMPLEMENTED; K and N multiples of 16 bytes, 16-byte aligned
 * operands, unit column strides), and a call it cannot take is refused
 * with the rule, not run another way (cuBLASLt needs the counts on the
 * host: sf_grouped_gemm). */
sf_status sf_grouped_gemm_device_ends(const sf_tensor *a, const sf_tensor *b, const sf_tensor *row_end,
                                      const sf_tensor *a_scale_inv, const sf_tensor *b_scale_inv, sf_tensor *out,
                                      sf_stream stream);

/* NULL when CUDA device `device_id` runs the sm90 kernel (compute
 * capability 9.0 and this build's sm_90a code, asked of the device once),
 * else why not, a static string (also for a build without CUDA). */
const char *sf_grouped_sm90_unfit_device(int device_id);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_GROUPED_H */
