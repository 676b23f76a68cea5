/*
 * seqfuse_gemm.h - public C API of the gemm family: matrix products over
 * cuBLASLt (csrc/gemm/), with a plain-loop CPU reference that defines what
 * "correct" means.  Included by seqfuse.h; include that, not this.
 *
 * Conventions (row-major, as torch sees tensors):
 *
 *     out[m, n] = epilogue(alpha * op(a) @ op(b) + beta * c)
 *
 *   op(a) = a   ([m, k]) when transa == 0, a^T when transa == 1 (a is [k, m]);
 *   op(b) = b   ([k, n]) when transb == 0, b^T when transb == 1 (b is [n, k]);
 *   beta = 1 when `accumulate` (c = out: its current values) or when an
 *   `addend` is given (c = addend, out then write-only: a residual added in
 *   the GEMM's epilogue instead of a pass of its own), else 0.
 *
 * An operand may be row-major or column-major (a transposed view): the entry
 * folds a column-major view into the transpose flag, so `w.t()` can be passed
 * as is.  `out` and `aux` must be row-major (unit stride along n).
 *
 * FP8 operands (float8_e4m3fn, float8_e5m2; not e5m2 x e5m2) carry scale
 * inverses in float32 device memory, read by pointer (no host sync):
 *   SF_GEMM_SCALE_TENSOR       one element: dequantized = fp8 * scale_inv[0]
 *   SF_GEMM_SCALE_BLOCK_1X128  one scale per 1 x 128 run along k
 *   SF_GEMM_SCALE_BLOCK_128X128 one scale per 128 x 128 block
 * cuBLASLt on Hopper takes FP8 only with both operands K-major ("TN"): op(a)
 * with unit stride along k (a is [m, k] row-major) and op(b) with unit stride
 * along k (b is [n, k] row-major, transb = 1).  m, n and k must be multiples
 * of 16.  Block-scale tensors, for an operand stored K-major as [rows, k]
 * (rows = m for a, n for b), are float32 and contiguous:
 *   1x128:   [ceil(k / 128), rows]                       (rows fastest)
 *   128x128: [ceil(rows / 128), roundup(ceil(k / 128), 4)] (k-blocks fastest,
 *            padded to a multiple of 4 = 16 bytes per row of blocks)
 * Block scales go with fast_accum = 0 only, and not 128x128 on both operands.
 */
#ifndef SEQFUSE_GEMM_H
#define SEQFUSE_GEMM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sf_gemm_epilogue {
    SF_GEMM_EPI_NONE = 0,          /* out = acc                                  */
    SF_GEMM_EPI_BIAS = 1,          /* out = acc + bias[n]                        */
    SF_GEMM_EPI_GELU = 2,          /* out = gelu(acc)                            */
    SF_GEMM_EPI_BIAS_GELU = 3,     /* out = gelu(acc + bias[n])                  */
    SF_GEMM_EPI_GELU_AUX = 4,      /* aux = acc, out = gelu(aux)                 */
    SF_GEMM_EPI_BIAS_GELU_AUX = 5, /* aux = acc + bias[n], out = gelu(aux)       */
    SF_GEMM_EPI_DGELU = 6,         /* out = acc * gelu'(aux)                     */
    SF_GEMM_EPI_DGELU_BGRAD = 7,   /* out = acc * gelu'(aux), bias[n] = sum_m out */
    SF_GEMM_EPI_BGRAD = 8,         /* out = acc, bias[m] = sum_k op(a)[m, k]     */
    SF_GEMM_EPI_COUNT = 9,
} sf_gemm_epilogue;
/* acc = alpha * op(a) @ op(b) + beta * c (c: addend, or out).  gelu is the tanh approximation
 * (what cuBLASLt computes).  aux has out's shape [m, n] and dtype; in the
 * bias-gradient epilogues `bias` is an output. */

typedef enum sf_gemm_scaling {
    SF_GEMM_SCALE_NONE = 0,          /* operand is not FP8 */
    SF_GEMM_SCALE_TENSOR = 1,
    SF_GEMM_SCALE_BLOCK_1X128 = 2,
    SF_GEMM_SCALE_BLOCK_128X128 = 3,
} sf_gemm_scaling;

typedef struct sf_gemm_args {
    const sf_tensor *a;            /* 2-D: fp32, fp16, bf16, or fp8 */
    const sf_tensor *b;            /* 2-D, a's dtype (or the other fp8 format) */
    int transa, transb;
    const sf_tensor *a_scale_inv;  /* fp8 a: float32 (see scaling); else NULL */
    const sf_tensor *b_scale_inv;
    sf_gemm_scaling a_scaling, b_scaling;
    sf_tensor *out;                /* [m, n]: see sf_gemm for dtypes */
    sf_tensor *bias;               /* BIAS*: input [n]; *BGRAD: output; else NULL */
    sf_tensor *aux;                /* *GELU_AUX: output [m, n]; DGELU*: input; else NULL */
    sf_gemm_epilogue epilogue;
    int accumulate;                /* beta = 1: add into out's current values */
    int fast_accum;                /* fp8 only: skip the periodic fp32 promotion */
    int allow_tf32;                /* fp32 operands: TF32 tensor cores */
    float alpha;
    sf_tensor *workspace;          /* CUDA: uint8 scratch for cuBLASLt, or NULL */
    const sf_tensor *addend;       /* [m, n], out's dtype and row stride, or NULL; not with
                                    * accumulate; no memory of out's */
    int sm_count_target;           /* CUDA: SMs the algorithm is chosen and sized for (0: the
                                    * device's); fewer when other streams run beside it */
} sf_gemm_args;

/* Fill args with the defaults: no scales, no epilogue, alpha 1, tf32 on. */
void sf_gemm_args_init(sf_gemm_args *args);

/* The product above.  Output dtypes:
 *   fp32 / fp16 / bf16 operands (both the same): out in the operand dtype or
 *   float32;  fp8 operands: out bfloat16, float16 or float32.
 * bias: out's dtype for non-FP8 operands; for FP8 operands bfloat16 (float16
 * when out is float16), as cuBLASLt's FP8 kernels take it.
 * CPU tensors run the reference (dequantized operands, fp32 accumulation);
 * CUDA tensors run cuBLASLt on `stream`.  The algorithm for a problem
 * (shapes, dtypes, layouts, alignments, epilogue, scaling, workspace size) is
 * chosen by cuBLASLt's heuristic once and cached.
 * Thread safety: callable from any host thread.  One cuBLASLt handle per
 * device is created on first use under a lock; the plan cache is guarded by
 * a mutex held while a plan's pointers are set and its matmul is enqueued. */
sf_status sf_gemm(const sf_gemm_args *args, sf_stream stream);

/* Time up to `candidates` (1..16) of cuBLASLt's algorithms for args's
 * product on `stream` and keep the fastest for every later sf_gemm of the
 * same plan (the problem as the plan cache keys it: the tokens' size class,
 * dtypes, layouts, alignments, epilogue, scaling, workspace; accumulate is
 * not part of the key).  The heuristic's own choice is kept unless another
 * runs at least 3 % faster (timing noise does not move the choice).  Each
 * candidate runs 1 + 3 times into args->out, so out holds none of the
 * caller's values afterwards (with accumulate it was added into over and
 * over): call it just before a product that writes out anew.  The host
 * waits for the timed runs; refused under CUDA graph capture.  timings:
 * float32 [3] in host memory, written: the heuristic's choice's time per
 * run and the kept one's (microseconds), and the kept one's rank in the
 * heuristic's order (0: the heuristic's own); all -1 where nothing was
 * timed (CPU tensors, an empty product, a plan tuned before). */
sf_status sf_gemm_tune(const sf_gemm_args *args, int candidates, sf_tensor *timings, sf_stream stream);

/* Every check sf_gemm makes of `args`, with the same errors, and nothing
 * launched: for callers that run the product another way (the grouped
 * family's own kernel) under sf_gemm's rules. */
sf_status sf_gemm_validate(const sf_gemm_args *args);

/* Number of cached cuBLASLt plans (all devices), and a way to drop them
 * (tests; after which the next call of each problem queries again). */
int sf_gemm_plan_cache_size(void);
void sf_gemm_plan_cache_clear(void);
/* How many times the cuBLASLt heuristic has been queried since start-up. */
int64_t sf_gemm_heuristic_queries(void);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_GEMM_H */
