/*
 * embed.h - what both embed backends share: the problem description the
 * entry (embed.c) fills after validation.  The math is one rule, written in
 * both backends: a run of equal sorted indices sums its rows of dy in
 * float32 in sorted order, and the index's row of dweight becomes
 * round(float(dweight[id]) + sum) (seqfuse_embed.h).
 */
#ifndef SF_EMBED_H
#define SF_EMBED_H

#include <stdint.h>

#include "seqfuse.h"

typedef struct sf_embed_problem {
    int64_t n;           /* rows of dy (tokens) */
    int64_t h;           /* embedding width */
    int64_t v;           /* rows of dweight (vocabulary) */
    int64_t dy_stride;   /* elements between rows of dy */
    int64_t dw_stride;   /* elements between rows of dweight */
    int64_t padding_idx; /* < 0: none */
} sf_embed_problem;

#endif
