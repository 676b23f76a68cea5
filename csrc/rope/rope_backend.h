/*
 * rope_backend.h - the backend entry points behind sf_rope.  rope.c has
 * validated every argument and filled the problem before either is called.
 */
#ifndef SF_ROPE_BACKEND_H
#define SF_ROPE_BACKEND_H

#include "rope.h"

#ifdef __cplusplus
extern "C" {
#endif

/* parts: the problem's inputs, p->part_end's order (NULL past the last) */
sf_status sf_rope_cpu(const sf_rope_problem *p, const sf_tensor *const *parts, const sf_tensor *freqs,
                      const int32_t *cu_seqlens, const int32_t *start_positions,
                      sf_tensor *out);
sf_status sf_rope_cuda(const sf_rope_problem *p, const sf_tensor *const *parts, const sf_tensor *freqs,
                       const int32_t *cu_seqlens, const int32_t *start_positions,
                       sf_tensor *out, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
