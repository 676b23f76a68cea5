/*
 * rope_cpu.c - the reference RoPE: plain loops over tokens, heads and pairs,
 * math in fp32 with cos/sin taken in double and rounded (the definition of
 * correct the CUDA kernel is tested against).  Elements past rot_dim are
 * copied through; so are thd tokens past the last sequence and the heads
 * past rotate_heads.  Head h of out is read from the part holding it.
 */
#include <math.h>

#include "../core/float_io.h"
#include "rope_backend.h"

/* Sequence index and position of token (i0, i1); pos < 0: pass through. */
static void token_position(const sf_rope_problem *p, const int32_t *cu, const int32_t *start,
                           int64_t i0, int64_t i1, int64_t *pos)
{
    int64_t seq, q;
    if (p->format == SF_ROPE_THD) {
        if (i0 >= cu[p->batch]) {
            *pos = -1;
            return;
        }
        seq = 0;
        while (cu[seq + 1] <= i0) /* linear search: the reference favours plainness */
            ++seq;
        q = i0 - cu[seq];
    } else if (p->format == SF_ROPE_BSHD) {
        seq = i0;
        q = i1;
    } else {
        seq = i1;
        q = i0;
    }
    *pos = q + (start ? start[seq] : 0);
}

sf_status sf_rope_cpu(const sf_rope_problem *p, const sf_tensor *const *parts, const sf_tensor *freqs,
                      const int32_t *cu, const int32_t *start, sf_tensor *out)
{
    const float *f = (const float *)freqs->data;
    for (int64_t i0 = 0; i0 < p->n0; ++i0)
        for (int64_t i1 = 0; i1 < p->n1; ++i1) {
            int64_t pos;
            token_position(p, cu, start, i0, i1, &pos);
            int64_t out_tok = i0 * p->out_stride[0] + i1 * p->out_stride[1];
            for (int64_t h = 0; h < p->heads; ++h) {
                const int part = sf_rope_part_of(p, h);
                const sf_tensor *t = parts[part];
                const int64_t *is = p->in_stride[part];
                int64_t in_h = i0 * is[0] + i1 * is[1] + (h - (part ? p->part_end[part - 1] : 0)) * is[2];
                int64_t out_h = out_tok + h * p->out_stride[2];
                const int turn = pos >= 0 && h < p->rotate_heads;
                if (turn) {
                    for (int64_t i = 0; i < p->rot / 2; ++i) {
                        int64_t j1, j2;
                        sf_rope_pair_index(p->interleaved, p->rot, i, &j1, &j2);
                        double a1 = f[pos * p->f_stride_pos + j1 * p->f_stride_dim];
                        double a2 = f[pos * p->f_stride_pos + j2 * p->f_stride_dim];
                        float x1 = sf_tensor_load(t, in_h + j1 * is[3]);
                        float x2 = sf_tensor_load(t, in_h + j2 * is[3]);
                        float y1, y2;
                        sf_rope_rotate(p->backward, x1, x2, (float)cos(a1), (float)sin(a1),
                                       (float)cos(a2), (float)sin(a2), &y1, &y2);
                        sf_tensor_store(out, out_h + j1 * p->out_stride[3], y1);
                        sf_tensor_store(out, out_h + j2 * p->out_stride[3], y2);
                    }
                }
                for (int64_t j = turn ? p->rot : 0; j < p->dim; ++j)
                    sf_tensor_store(out, out_h + j * p->out_stride[3], sf_tensor_load(t, in_h + j * is[3]));
            }
        }
    return SF_OK;
}
