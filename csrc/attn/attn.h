/*
 * attn.h - what both attention backends share: the problem as the C entry
 * (attn.c) resolves it once (pointers, strides in elements, lengths, mask
 * parameters), and the static inline rules every backend must agree on:
 * where sequence b starts and how long it is, and which (query, key) pairs
 * the mask lets through.  Usable from host C and CUDA device code.  The
 * backend entry points are attn_backend.h's.
 */
#ifndef SF_ATTN_INTERNAL_H
#define SF_ATTN_INTERNAL_H

#include <stdint.h>

#include "seqfuse.h"

#if defined(__CUDACC__)
#define SF_ATTN_HD static inline __host__ __device__
#else
#define SF_ATTN_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* A [batch, token, head, dim] view: element (b, t, h, d) lives at
 * ptr + b*sb + t*ss + h*sh + d (elements of the tensor's dtype).  THD views
 * have sb = 0 and t counts from the start of the packed buffer. */
typedef struct sf_attn_view {
    void *ptr;
    int64_t sb, ss, sh;
} sf_attn_view;

typedef struct sf_attn_problem {
    sf_dtype dtype;            /* of q, k, v, out, dout, dq, dk, dv */
    int batch, heads, heads_kv, head_dim;
    int thd;
    int max_sq, max_sk;        /* rows the grid covers per sequence */
    int64_t extent_q, extent_k;/* THD: tokens in the buffers; else s_q, s_kv */
    const int32_t *cu_q, *cu_k;/* NULL: every sequence has max_sq / max_sk rows */
    int window_left, window_right; /* -1 unbounded; causal already folded in */
    int bottom_right;          /* diagonal offset sk - sq (1) or 0 (0) */
    float scale;
    int deterministic;
    sf_attn_view q, k, v, o, dout, dq, dk, dv;
    sf_attn_view dq_accum;     /* float32 */
    float *lse, *delta;        /* index lse_index() */
    int64_t lse_sb, lse_sh;
    /* attention dropout (attn_philox.h): on when dropout != 0; a probability
     * keeps an element iff its 16-bit uniform >= drop_threshold, and kept
     * probabilities are multiplied by drop_scale = 1 / (1 - p).  Last in the
     * struct, so the fields before keep the offsets the verified kernels read. */
    int dropout;
    uint32_t drop_threshold;
    float drop_scale;          /* kernels; the CPU reference uses 1 / (1 - drop_p) */
    double drop_p;
    uint32_t seed_lo, seed_hi;
    uint64_t offset;
} sf_attn_problem;

/* Start row (token index in the view) and length of sequence b on one side
 * (queries or keys): CU is that side's cu_seqlens (NULL: every sequence has
 * MAX_LEN rows), EXTENT the rows of a thd view; lengths are clamped to
 * [0, MAX_LEN] and thd starts to the view.  A macro over the problem's own
 * fields, not a function taking them as arguments: every attention kernel
 * runs it, and with arguments their machine code changed (16 of 17 sm80
 * forward kernels); expanded per side it is the code of two written bodies. */
#define SF_ATTN_SEQ_BODY(p, b, start, len, CU, EXTENT, MAX_LEN)                    \
    if ((p)->thd) {                                                                \
        int64_t s = (p)->CU[b], e = (p)->CU[(b) + 1];                              \
        s = s < 0 ? 0 : (s > (p)->EXTENT ? (p)->EXTENT : s);                       \
        e = e < s ? s : (e > (p)->EXTENT ? (p)->EXTENT : e);                       \
        *(start) = s;                                                              \
        *(len) = (int)(e - s < (p)->MAX_LEN ? e - s : (p)->MAX_LEN);               \
    } else {                                                                       \
        *(start) = 0;                                                              \
        if ((p)->CU) {                                                             \
            int64_t n = (int64_t)(p)->CU[(b) + 1] - (p)->CU[b];                    \
            *(len) = (int)(n < 0 ? 0 : (n > (p)->MAX_LEN ? (p)->MAX_LEN : n));     \
        } else {                                                                   \
            *(len) = (p)->MAX_LEN;                                                 \
        }                                                                          \
    }

SF_ATTN_HD void sf_attn_seq_q(const sf_attn_problem *p, int b, int64_t *start, int *len)
{
    SF_ATTN_SEQ_BODY(p, b, start, len, cu_q, extent_q, max_sq)
}

SF_ATTN_HD void sf_attn_seq_k(const sf_attn_problem *p, int b, int64_t *start, int *len)
{
    SF_ATTN_SEQ_BODY(p, b, start, len, cu_k, extent_k, max_sk)
}
#undef SF_ATTN_SEQ_BODY /* the two functions above are its only users */

/* Diagonal offset of sequence lengths sq, sk: query r sits on key r + off. */
SF_ATTN_HD int sf_attn_diag(const sf_attn_problem *p, int sq, int sk)
{
    return p->bottom_right ? sk - sq : 0;
}

/* Sequence b on both sides: first tokens, lengths and diagonal offset. */
typedef struct sf_attn_seqs {
    int64_t qs, ks;
    int sq, sk, off;
} sf_attn_seqs;

SF_ATTN_HD sf_attn_seqs sf_attn_seqs_of(const sf_attn_problem *p, int b)
{
    sf_attn_seqs s;
    sf_attn_seq_q(p, b, &s.qs, &s.sq);
    sf_attn_seq_k(p, b, &s.ks, &s.sk);
    s.off = sf_attn_diag(p, s.sq, s.sk);
    return s;
}

/* 1 if query row r may attend key c (both already within their lengths). */
SF_ATTN_HD int sf_attn_allowed(int r, int c, int off, int left, int right)
{
    if (right >= 0 && c > r + off + right)
        return 0;
    if (left >= 0 && c < r + off - left)
        return 0;
    return 1;
}

/* Keys [*lo, *hi) that rows [r0, r1] (inclusive) may see, within [0, sk). */
SF_ATTN_HD void sf_attn_key_range(int r0, int r1, int off, int left, int right, int sk,
                                  int *lo, int *hi)
{
    int a = 0, b = sk;
    if (left >= 0 && r0 + off - left > a)
        a = r0 + off - left;
    if (right >= 0 && r1 + off + right + 1 < b)
        b = r1 + off + right + 1;
    *lo = a;
    *hi = b > a ? b : a;
}

/* Query rows [*lo, *hi) that may see some key of [c0, c1] (inclusive), within [0, sq). */
SF_ATTN_HD void sf_attn_query_range(int c0, int c1, int off, int left, int right, int sq,
                                    int *lo, int *hi)
{
    int a = 0, b = sq;
    if (right >= 0 && c0 - off - right > a)
        a = c0 - off - right;
    if (left >= 0 && c1 - off + left + 1 < b)
        b = c1 - off + left + 1;
    *lo = a;
    *hi = b > a ? b : a;
}

#ifdef __cplusplus
}
#endif

#endif /* SF_ATTN_INTERNAL_H */
