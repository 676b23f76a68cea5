/*
 * seqfuse_attn.h - public C API of the attn family: fused (flash) attention
 * forward and backward (csrc/attn/).
 * Included by seqfuse.h; include that, not this.
 *
 * softmax(scale * Q K^T + mask) V per (batch, head), never materializing the
 * attention matrix on the GPU.  One description of a call, sf_attn_config,
 * covers every layout and mask; the tensors are views with any strides whose
 * last (head) dimension is contiguous.
 *
 * Layouts (h = query heads, hk = key/value heads, d = head dim):
 *   BSHD  q [b, s_q, h, d],  k/v [b, s_kv, hk, d]
 *   SBHD  q [s_q, b, h, d],  k/v [s_kv, b, hk, d]
 *   THD   q [t_q, h, d],     k/v [t_kv, hk, d]: sequences packed back to back,
 *         sequence i holds tokens cu_seqlens[i] .. cu_seqlens[i+1]-1.
 * cu_seqlens_q / cu_seqlens_kv: int32 [b+1], cumulative lengths starting at 0,
 * on the device of q.  Required for THD and for the padding masks; in BSHD and
 * SBHD they give each batch row's real length (its tokens are the first ones
 * of the row, the rest is padding).  Without padding masks in BSHD/SBHD they
 * must be NULL (every row is full length).
 *
 * Masks.  For sequence i with lengths sq (queries) and sk (keys), query r may
 * see key c when 0 <= c < sk and the window allows it:
 *     c <= r + off + right   (right >= 0; causal masks set right = 0)
 *     c >= r + off - left    (left >= 0)
 * with off = 0 for CAUSAL and PADDING_CAUSAL (top-left aligned, as Transformer
 * Engine's "causal" and torch's is_causal) and off = sk - sq for every other
 * mask (bottom-right aligned, as TE's "*_bottom_right" types and flash-attn
 * 2.1+; TE aligns sliding windows of non-causal masks the same way).  A query
 * row that sees no key gets out = 0 and lse = +inf.  In BSHD/SBHD the padded
 * query rows (r >= sq) get out = 0, lse = +inf, and all gradients of padded
 * rows are 0.  In THD, rows past cu_seqlens[b] (the tail of the buffer) get
 * out = 0 and zero gradients.
 *
 * lse (float32, natural log of the softmax denominator incl. the scale):
 *   BSHD/SBHD [b, h, max_seqlen_q] contiguous; THD [h, t_q] contiguous.
 *
 * Grouped-query attention: h must be a multiple of hk; query head j reads
 * key/value head j / (h / hk).
 *
 * Dropout (dropout_p in [0, 1)): the probabilities P = softmax(scale Q K^T)
 * are multiplied by keep / (1 - p) before P V, keep drawn from Philox4x32-10
 * keyed by (dropout_seed, dropout_offset) and the element's (sequence,
 * query head, query row, key) coordinates (csrc/attn/attn_philox.h gives the
 * exact bits): never stored, the backward regenerates the same mask from the
 * same config.  lse is the undropped one.  A call uses batch * heads values
 * of the offset space (b = sequences, THD included): the next call should
 * start at dropout_offset + batch * heads or later.  dropout_p = 0 costs
 * nothing (the kernels without dropout are separate instantiations).
 *
 * Backends: the CPU reference takes float32, float16 and bfloat16; the CUDA
 * kernel float16 and bfloat16 with d = 16, 24, 32, 64 or 128
 * (NotImplementedError else).
 * On CUDA, cu_seqlens are trusted (reading them would synchronize the host):
 * lengths are clamped to [0, max_seqlen] and tokens to the tensor's extent, so
 * bad offsets give wrong numbers, never out-of-bounds accesses.
 */
#ifndef SEQFUSE_ATTN_H
#define SEQFUSE_ATTN_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sf_attn_format {
    SF_ATTN_BSHD = 0,
    SF_ATTN_SBHD = 1,
    SF_ATTN_THD = 2,
} sf_attn_format;

typedef enum sf_attn_mask {
    SF_ATTN_NO_MASK = 0,
    SF_ATTN_PADDING = 1,
    SF_ATTN_CAUSAL = 2,                      /* top-left aligned */
    SF_ATTN_PADDING_CAUSAL = 3,              /* top-left aligned */
    SF_ATTN_CAUSAL_BOTTOM_RIGHT = 4,
    SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT = 5,
} sf_attn_mask;

typedef struct sf_attn_config {
    sf_attn_format format;
    sf_attn_mask mask;
    int window_left;        /* -1: unbounded */
    int window_right;       /* -1: unbounded (causal masks force 0) */
    float softmax_scale;    /* usually 1/sqrt(d) */
    int max_seqlen_q;       /* THD: longest sequence; BSHD/SBHD: 0 or s_q */
    int max_seqlen_kv;      /* THD: longest sequence; BSHD/SBHD: 0 or s_kv */
    int deterministic;      /* backward: dQ without atomics, fixed order */
    double dropout_p;       /* probability of dropping an attention probability, [0, 1) */
    uint64_t dropout_seed;  /* Philox key (with dropout_p > 0) */
    uint64_t dropout_offset;/* Philox counter offset (with dropout_p > 0) */
} sf_attn_config;

/* Forward: out (same shape as q, dtype of q) and lse (float32, see above).
 * cu_seqlens_q / cu_seqlens_kv may be NULL where the layout and mask allow. */
sf_status sf_attn_forward(const sf_tensor *q, const sf_tensor *k, const sf_tensor *v,
                      const sf_tensor *cu_seqlens_q, const sf_tensor *cu_seqlens_kv,
                      const sf_attn_config *cfg, sf_tensor *out, sf_tensor *lse,
                      sf_stream stream);

/* Backward: dq, dk, dv (shapes of q, k, v, dtype of q) from the forward's
 * inputs, out, lse and the output gradient dout (shape of q).
 * Workspaces (float32, contiguous, written by the call):
 *   dq_accum  the shape of q (the CUDA kernel accumulates dQ there; the CPU
 *             backend and the deterministic CUDA path use it as scratch too)
 *   delta     the shape of lse (rowsum(dout * out)). */
sf_status sf_attn_backward(const sf_tensor *q, const sf_tensor *k, const sf_tensor *v,
                      const sf_tensor *out, const sf_tensor *dout,
                      const sf_tensor *lse, const sf_tensor *cu_seqlens_q,
                      const sf_tensor *cu_seqlens_kv, const sf_attn_config *cfg,
                      sf_tensor *dq, sf_tensor *dk, sf_tensor *dv,
                      sf_tensor *dq_accum, sf_tensor *delta, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ATTN_H */
