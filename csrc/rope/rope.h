/*
 * rope.h - what both RoPE backends share: the problem description the entry
 * (rope.c) fills after validation, and the per-pair rotation, written once as
 * static inline math for host C and CUDA device code.
 *
 * A pair is (first, second): (j, j + rot/2) in the half-split layout,
 * (2i, 2i + 1) in the interleaved one.  With c_k = cos(freqs[pos, k]) and
 * s_k = sin(freqs[pos, k]) for each member k of the pair:
 *   forward:  y1 = x1 c1 - x2 s1        y2 = x2 c2 + x1 s2
 *   backward: dx1 = dy1 c1 + dy2 s2     dx2 = dy2 c2 - dy1 s1
 * (the backward is the transpose of the forward's 2x2 map).  freqs[pos, k]
 * is read per element, so freqs need not repeat its halves.
 */
#ifndef SF_ROPE_H
#define SF_ROPE_H

#include <stdint.h>

#include "seqfuse.h"

#if defined(__CUDACC__)
#define SF_ROPE_HD static inline __host__ __device__
#else
#define SF_ROPE_HD static inline
#endif

#define SF_ROPE_MAX_PARTS 3 /* inputs of sf_rope_parts */

typedef struct sf_rope_problem {
    int format;           /* sf_rope_format */
    int interleaved;
    int backward;
    int64_t n0, n1;       /* token grid: bshd (b, s), sbhd (s, b), thd (T, 1) */
    int64_t heads, dim, rot; /* heads: out's, every part's together */
    int64_t rotate_heads; /* out's heads [0, rotate_heads) are turned, the rest copied */
    int64_t part_end[SF_ROPE_MAX_PARTS];  /* part i holds out's heads [part_end[i - 1], part_end[i]) */
    int64_t in_stride[SF_ROPE_MAX_PARTS][4]; /* each part's: token dim 0, token dim 1, head, element */
    int64_t out_stride[4];
    int64_t max_pos;      /* s2: rows of freqs */
    int64_t f_stride_pos, f_stride_dim;
    int64_t batch;        /* sequences: b for bshd/sbhd, len(cu_seqlens) - 1 for thd */
} sf_rope_problem;

/* The part holding out's head h (parts past the last given end at p->heads). */
SF_ROPE_HD int sf_rope_part_of(const sf_rope_problem *p, int64_t h)
{
    return h < p->part_end[0] ? 0 : h < p->part_end[1] ? 1 : 2;
}

/* Pair member offsets (in elements along the head dimension) of pair i. */
SF_ROPE_HD void sf_rope_pair_index(int interleaved, int64_t rot, int64_t i,
                                   int64_t *first, int64_t *second)
{
    if (interleaved) {
        *first = 2 * i;
        *second = 2 * i + 1;
    } else {
        *first = i;
        *second = i + rot / 2;
    }
}

SF_ROPE_HD void sf_rope_rotate(int backward, float x1, float x2, float c1, float s1,
                               float c2, float s2, float *y1, float *y2)
{
    if (!backward) {
        *y1 = x1 * c1 - x2 * s1;
        *y2 = x2 * c2 + x1 * s2;
    } else {
        *y1 = x1 * c1 + x2 * s2;
        *y2 = x2 * c2 - x1 * s1;
    }
}

#endif /* SF_ROPE_H */
