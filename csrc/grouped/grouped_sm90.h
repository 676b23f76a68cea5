/*
 * grouped_sm90.h - the grouped GEMM's own Hopper kernel (grouped_sm90_cuda.cu):
 * every group's output tiles in one persistent launch, so the tiles of all
 * experts share the GPU's waves instead of each expert's GEMM rounding up
 * to whole waves of its own (and paying a cuBLASLt call's host work).
 *
 * The one layout it serves is the experts' forward product (and, in FP8,
 * the input gradient's, whose b are the experts' transposed weights):
 *
 *     out[rows_g, 0:N] = A[rows_g, 0:K] @ B_g[0:N, 0:K]^T     (g = 0 .. G-1)
 *
 * A: one row-major [rows, K] matrix whose groups are consecutive row ranges
 * (rows_g = [row_start[g], row_start[g + 1])), B_g: G row-major [N, K]
 * matrices anywhere in memory, out: one row-major [rows, N] matrix.  Both
 * operands are K-major, which is what wgmma needs for FP8 as well.
 * Element types (a x b -> out): bf16 x bf16 -> bf16; e4m3 x e4m3 -> bf16
 * (the forward); e5m2 x e4m3 -> bf16 (the input gradient under the HYBRID
 * format: the output gradient in e5m2 times the transposed e4m3 weights);
 * FP8 with one scale per group (a_scale_inv[g] x b_scale_inv[g], float32
 * on the device).  FP8 accumulates either as cuBLASLt's fast_accum=1 does
 * (Hopper's FP8 wgmma accumulator, about 13 mantissa bits, over all of k:
 * the forward's 128 x 256 tiles) or as its fast_accum=0 does (each 128-k
 * block's partial sum promoted into a float32 accumulator: Transformer
 * Engine's split accumulator for gradients; 128 x 128 tiles).
 */
#ifndef SF_GROUPED_SM90_H
#define SF_GROUPED_SM90_H

#include <stdint.h>

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most groups one launch takes (the per-group TMA descriptors travel
 * in the kernel's parameters: 128 bytes each). */
#define SF_GROUPED_SM90_MAX_GROUPS 64

typedef struct {
    /* a x every b: SF_BFLOAT16 x SF_BFLOAT16, SF_FLOAT8_E4M3 x SF_FLOAT8_E4M3
     * or SF_FLOAT8_E5M2 x SF_FLOAT8_E4M3 */
    sf_dtype a_dtype, b_dtype;
    /* FP8 only (bf16 accumulates in float32 and ignores it): 1 the wgmma
     * accumulator over all of k (cuBLASLt's fast_accum=1), 0 each 128-k
     * block's sum promoted into float32 (fast_accum=0; 128 x 128 tiles) */
    int fast_accum;
    int groups;                     /* 1 .. SF_GROUPED_SM90_MAX_GROUPS */
    int64_t n, k;                   /* out columns, reduction length */
    const void *a;                  /* [row_start[groups], k], row stride lda elements */
    int64_t lda;
    const void *b[SF_GROUPED_SM90_MAX_GROUPS]; /* group g: [n, k], row stride ldb[g] */
    int64_t ldb[SF_GROUPED_SM90_MAX_GROUPS];
    void *out;                      /* bf16 [row_start[groups], n], row stride ldo */
    int64_t ldo;
    int64_t row_start[SF_GROUPED_SM90_MAX_GROUPS + 1]; /* non-decreasing, row_start[0] = 0 */
    /* FP8 only: float32 device pointers, one value per group (may repeat) */
    const float *a_scale_inv[SF_GROUPED_SM90_MAX_GROUPS];
    const float *b_scale_inv[SF_GROUPED_SM90_MAX_GROUPS];
    int device_id;
    /* Optional, NULL: the rows as row_start gives them.  Else the groups'
     * end rows as int32 [groups] in device memory (ops.moe.
     * device_split_offsets' layout), read by the kernel itself, so the
     * call waits on nothing the GPU computes (the router's counts): then
     * row_start[groups] is the rows a and out hold (row_start[0] = 0, the
     * others unread), every group's b must be valid, each end is clamped
     * to [the previous end, row_start[groups]], and the rows past the last
     * end are left untouched.  The launch then takes every SM (the tiles
     * are counted on the device). */
    const int32_t *device_row_end;
} sf_grouped_sm90_args;

/* NULL when device `device_id` runs the kernel (compute capability 9.0,
 * the library's kernel built for sm_90a), else why not (a static string);
 * asked of the device once. */
const char *sf_grouped_sm90_device_unfit(int device_id);

/* NULL when `args` fits the kernel on this build and device, else the rule
 * it breaks (a static string naming the argument): compute capability 9.0
 * with an sm_90a build; one of the three dtype pairs; fast_accum 0 or 1;
 * k and n multiples of 16 bytes of elements (8 bf16, 16 e4m3 or e5m2) and
 * k > 0; lda, ldb, ldo at least k / k / n and multiples of the same 16
 * bytes; every pointer 16-byte aligned; rows below 2^31. */
const char *sf_grouped_sm90_unfit(const sf_grouped_sm90_args *args);

/* 1 when the kernel is the faster route for groups of m_splits rows, n
 * output columns, reduction length k, a's element type dtype and
 * fast_accum on device_id, 0 when one cuBLASLt call per group is (or no
 * group has rows): FP8 (a e4m3 or e5m2) with fast accumulation always;
 * FP8 with split accumulation (fast_accum=0, the promoted 128 x 128 shape)
 * where k is at most 4,096 or there are more than 16 groups; bf16 where
 * the average group with rows has at most two waves of the device's SMs in
 * output tiles of 128 x 256 (so each group's own GEMM ends in a partial
 * wave, and its host work is paid G times).  Measured on an H100
 * (benchmarks/moe/bench_grouped_gemm.py and bin/check_grouped_sm90's
 * "bench dgrad" lines, Mixtral-small's experts, 32,768 routed rows, against
 * the per-expert cuBLASLt route in the same process): bf16 (s46) the
 * kernel won every down projection (n = 1,024: 8 experts 697-728 against
 * 650-716 TFLOP/s, 16 experts 714-726 against 546-629, 64 experts 574-638
 * against 353-407) and the up projection at 64 experts (112 tiles a group:
 * 533-548 against 500-530), and lost it at 8 and 16 experts (448+ tiles a
 * group: 597-718 against 672-725); e4m3 fast (s46) it won 10 of 12 rows (8
 * experts 1,157-1,210 against 1,004-1,135; it lost 16 experts' balanced up
 * projection, 993-1,031 against 1,120-1,201, in two runs); split (s47, two
 * runs, the input gradients, e5m2 x e4m3 and e4m3 x e4m3 alike, against
 * cuBLASLt with fast_accum=0 at its default lanes) it won at k = 1,024 (8
 * experts 1,008-1,068 against 930-1,011 TFLOP/s, 1.04-1.10x; 64 experts
 * 720-816 against 427-487, 1.65-1.72x) and at 64 experts with k = 7,168
 * (1,088-1,267 against 774-1,064, 1.18-1.42x), and lost 8 experts at
 * k = 7,168 (1,138-1,203 against 1,298-1,529, 0.78-0.90x: the promotion
 * every 128 of k costs the long reductions most).  16 experts are not
 * measured. */
int sf_grouped_sm90_pays(const int64_t *m_splits, int groups, int64_t n, int64_t k, sf_dtype dtype, int fast_accum,
                         int device_id);

/* Launches the kernel on `stream` (args checked by sf_grouped_sm90_unfit
 * first; a failure there is returned as SF_ERR_VALUE with that rule) in
 * the call's shape: 128 x 128 promoted tiles for FP8 with fast_accum=0,
 * else 128 x 256.
 * Groups with no rows are skipped; out rows of other groups are not
 * touched. */
sf_status sf_grouped_sm90_run(const sf_grouped_sm90_args *args, sf_stream stream);

/* sf_grouped_sm90_run for args that sf_grouped_sm90_unfit has just
 * accepted (the grouped entries ask it first, to choose their route): the
 * launch without asking again, so a call walks its groups' rules once. */
sf_status sf_grouped_sm90_launch(const sf_grouped_sm90_args *args, sf_stream stream);

#ifdef SF_WORKBENCH
/* The check's kernel shapes (grouped_sm90_cuda.cu): 0 the library's for the
 * call (bf16 and fast_accum=1: 128 x 256 tiles, 4 stages, down the rows
 * first, TMA-stored epilogue through 2 boxes a warpgroup; FP8 with
 * fast_accum=0: 128 x 128 tiles, 6 stages, two promoted temporaries with
 * one wgmma group in flight, 2 boxes), 1 the first storing from registers,
 * 2 with 3 stages and 4 boxes (one round), 3 the first along the columns
 * first; for fast_accum=0 only, 4 the promoted shape with one temporary
 * (each k-block's group waited for before it is promoted), 5 the library's
 * promoted shape with 4 stages.  A variant of the other accumulation than
 * the call's is refused. */
sf_status sf_grouped_sm90_run_variant(const sf_grouped_sm90_args *args, int variant, sf_stream stream);
#endif

#ifdef __cplusplus
}
#endif

#endif /* SF_GROUPED_SM90_H */
