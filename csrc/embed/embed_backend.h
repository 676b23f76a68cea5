/*
 * embed_backend.h - the problem description and backend entry points behind
 * sf_embedding_backward_add.  embed.c has validated every argument and
 * filled the problem before either backend is called.
 */
#ifndef SF_EMBED_BACKEND_H
#define SF_EMBED_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sf_embed_problem {
    int64_t n;           /* rows of dy (tokens) */
    int64_t h;           /* embedding width */
    int64_t v;           /* rows of dweight (vocabulary) */
    int64_t dy_stride;   /* elements between rows of dy */
    int64_t dw_stride;   /* elements between rows of dweight */
    int64_t padding_idx; /* < 0: none */
} sf_embed_problem;

sf_status sf_embedding_backward_add_cpu(const sf_embed_problem *p, const sf_tensor *dy, const int64_t *sorted_ids,
                                        const int64_t *order, sf_tensor *dweight);
sf_status sf_embedding_backward_add_cuda(const sf_embed_problem *p, const sf_tensor *dy, const int64_t *sorted_ids,
                                         const int64_t *order, sf_tensor *dweight, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
