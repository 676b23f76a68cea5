/*
 * embed_backend.h - the backend entry points behind
 * sf_embedding_backward_add.  embed.c has validated every argument and
 * filled the problem before either backend is called.
 */
#ifndef SF_EMBED_BACKEND_H
#define SF_EMBED_BACKEND_H

#include "embed.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_embedding_backward_add_cpu(const sf_embed_problem *p, const sf_tensor *dy, const int64_t *sorted_ids,
                                        const int64_t *order, sf_tensor *dweight);
sf_status sf_embedding_backward_add_cuda(const sf_embed_problem *p, const sf_tensor *dy, const int64_t *sorted_ids,
                                         const int64_t *order, sf_tensor *dweight, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
