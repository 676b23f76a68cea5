/*
 * embed_cpu.c - the reference embedding-gradient add: for each run of equal
 * indices in sorted order, the rows summed in float32 in that order, added
 * to the stored value and rounded once (the definition of correct the CUDA
 * kernel is tested against; it sums in the same order, so the two agree to
 * the bit).
 */
#include "../core/float_io.h"
#include "embed_backend.h"

sf_status sf_embedding_backward_add_cpu(const sf_embed_problem *p, const sf_tensor *dy, const int64_t *ids,
                                        const int64_t *order, sf_tensor *dweight)
{
    for (int64_t j = 0; j < p->n;) {
        int64_t id = ids[j], end = j;
        while (end < p->n && ids[end] == id)
            ++end;
        if (id != p->padding_idx)
            for (int64_t c = 0; c < p->h; ++c) {
                float acc = 0.0f;
                for (int64_t k = j; k < end; ++k)
                    acc += sf_tensor_load(dy, order[k] * p->dy_stride + c);
                int64_t w = id * p->dw_stride + c;
                sf_tensor_store(dweight, w, sf_tensor_load(dweight, w) + acc);
            }
        j = end;
    }
    return SF_OK;
}
