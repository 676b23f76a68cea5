/*
 * seqfuse_embed.h - public C API of the embed family: an embedding table's
 * gradient added into a gradient that already holds another contribution
 * (csrc/embed/).  Included by seqfuse.h; include that, not this.
 *
 * Why: a language model whose input embedding and LM head share one weight
 * (tied embeddings) gets that weight's gradient from both.  The fused loss
 * makes the head's part, a dense [V, H] tensor, in its forward; the
 * embedding's part touches only the rows of the tokens seen.  Adding the
 * embedding's rows into the head's gradient in place costs a read and a
 * write of those rows, where a separate dense embedding gradient costs a
 * [V, H] zero fill, the scatter and a [V, H] add (at a 128k vocabulary and
 * H 2,048 in bf16: 0.5 GB written by the fill, 1.5 GB read and written by
 * the add).
 */
#ifndef SEQFUSE_EMBED_H
#define SEQFUSE_EMBED_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * sf_embedding_backward_add: dweight[id] += sum of dy[i] over the rows i whose
 * index ids[i] is id, for every id that occurs, in place.  The rows of one
 * index are summed in float32 in the order `order` gives them, added to the
 * stored value in float32 and rounded once (no atomics: the result is the
 * same on every run and on both backends).
 *   dy           float32 / float16 / bfloat16 [n, h], unit stride along h
 *   sorted_ids   int64 [n] contiguous, non-decreasing: the rows' indices, sorted
 *   order        int64 [n] contiguous: a permutation of [0, n) with
 *                sorted_ids[j] = ids[order[j]] (a stable argsort of ids)
 *   padding_idx  rows whose index is padding_idx add nothing (negative: none),
 *                as torch.nn.Embedding's padding_idx
 *   dweight      dy's dtype, [v, h], unit stride along h, apart from the inputs
 * On the CPU every index must be in [0, v) and sorted_ids non-decreasing, or
 * the call fails before writing.  The CUDA backend reads neither on the host
 * (no synchronization, capturable in a CUDA graph): there a row whose index is
 * outside [0, v) adds nothing; torch's embedding lookup refuses such an index
 * in the forward that made dy.
 */
sf_status sf_embedding_backward_add(const sf_tensor *dy, const sf_tensor *sorted_ids, const sf_tensor *order,
                                    int64_t padding_idx, sf_tensor *dweight, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_EMBED_H */
