/*
 * seqfuse_rope.h - public C API of the rope family: rotary position embeddings on bshd, sbhd and packed thd (csrc/rope/).
 * Included by seqfuse.h; include that, not this.
 *
 * The rotation follows Transformer Engine's apply_rotary_pos_emb exactly:
 * out[j] = t[j] * cos(freqs[pos, j]) + rotate(t)[j] * sin(freqs[pos, j]) for
 * j < rot_dim (the last dimension of freqs), out[j] = t[j] beyond it, with
 * rotate pairing element j with j + rot_dim/2 (half-split: GPT-NeoX, Llama,
 * ESM) or with its neighbour 2i <-> 2i+1 (interleaved: GPT-J), the first of
 * each pair negated.  The backward pass applies the transposed rotation.
 */
#ifndef SEQFUSE_ROPE_H
#define SEQFUSE_ROPE_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where the sequence position of a token comes from. */
typedef enum sf_rope_format {
    SF_ROPE_SBHD = 0, /* t [s, b, h, d]: position = s index */
    SF_ROPE_BSHD = 1, /* t [b, s, h, d]: position = s index */
    SF_ROPE_THD = 2,  /* t [T, h, d] packed: position = token - cu_seqlens[seq];
                         tokens at or past cu_seqlens[last] pass through unchanged */
} sf_rope_format;

/*
 * sf_rope: out = RoPE(t) (backward = 0) or its gradient dt = RoPE^T(dout)
 * (backward = 1, t holds dout).
 *   t, out           fp32 / fp16 / bf16, same dtype and shape, any strides
 *                    (out may be t itself: every pair is read before written)
 *   freqs            fp32 [s2, 1, 1, rot_dim] (or [s2, rot_dim]), rot_dim even,
 *                    rot_dim <= d; angles in radians, as TE's
 *                    RotaryPositionEmbedding produces them
 *   cu_seqlens       int32 [batch + 1], non-decreasing from 0; thd only (NULL otherwise)
 *   start_positions  NULL or int32 [batch]: positions of sequence i are offset
 *                    by start_positions[i]
 * A position outside [0, s2) is an error on the CPU.  The CUDA backend does not
 * read cu_seqlens or start_positions on the host (no synchronization); there a
 * token whose position falls outside freqs gets NaN in its rotated part.
 */
sf_status sf_rope(const sf_tensor *t, const sf_tensor *freqs,
                  const sf_tensor *cu_seqlens, const sf_tensor *start_positions,
                  sf_rope_format format, int interleaved, int backward,
                  sf_tensor *out, sf_stream stream);

/*
 * sf_rope_parts: sf_rope of a tensor given in up to three parts along the
 * head dimension, written into one `out` whose heads are t's, then t1's,
 * then t2's; only out's first `rotate_heads` heads are turned (or their
 * gradient taken), the others copied unchanged.  One launch for a fused
 * QKV projection's RoPE: forward, the projection's output [b, s, h + 2 kv,
 * d] as t with rotate_heads h + kv (q and k turned, v copied); backward,
 * dq, dk and dv as t, t1 and t2 into the projection's output gradient.
 *   t, t1, t2        the parts (t1, t2 NULL or given in order): the dtype,
 *                    token dimensions and head dim of out, any strides, none
 *                    meeting out (out may be t itself where t is the only part)
 *   rotate_heads     0 <= rotate_heads <= out's heads
 *   out              out's heads = the parts' heads together
 * Every other argument as sf_rope's, which is sf_rope_parts(t, NULL, NULL,
 * t's heads, ...).
 */
sf_status sf_rope_parts(const sf_tensor *t, const sf_tensor *t1, const sf_tensor *t2, int64_t rotate_heads,
                        const sf_tensor *freqs, const sf_tensor *cu_seqlens,
                        const sf_tensor *start_positions, sf_rope_format format, int interleaved,
                        int backward, sf_tensor *out, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ROPE_H */
