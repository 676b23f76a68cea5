/*
 * moe_cpu.c - the reference router and token permutation: plain loops over
 * tokens, float32 arithmetic, the definition of correct for moe_cuda.cu.
 * The router rows are moe.h's shared functions; the permutation is written
 * out here: row ids by a running count per expert column, then gathers and
 * scatters of whole rows.
 */
#include <stdlib.h>
#include <string.h>

#include "moe.h"
#include "moe_backend.h"

sf_status sf_moe_topk_forward_cpu(const sf_moe_args *a)
{
    const float *bias = a->bias ? (const float *)a->bias->data : NULL;
    uint8_t *map = (uint8_t *)a->out2->data;
    float *saved = (float *)a->out3->data;
    for (int64_t t = 0; t < a->T; ++t)
        sf_moe_topk_forward_row(a->logits->data, a->logits->dtype, t * a->E, a->E, a->topk, a->score,
                            a->pre_softmax, a->scaling, bias, a->out->data, a->out->dtype,
                            map + t * a->E, saved + t * a->E);
    return SF_OK;
}

sf_status sf_moe_topk_backward_cpu(const sf_moe_args *a)
{
    const uint8_t *map = (const uint8_t *)a->map->data;
    const float *saved = (const float *)a->saved->data;
    for (int64_t t = 0; t < a->T; ++t)
        sf_moe_topk_backward_row(map + t * a->E, saved + t * a->E, a->grad->data, a->grad->dtype,
                            t * a->E, a->E, a->topk, a->score, a->pre_softmax, a->scaling,
                            a->out->data, a->out->dtype);
    return SF_OK;
}

sf_status sf_moe_aux_scores_forward_cpu(const sf_moe_args *a)
{
    uint8_t *map = (uint8_t *)a->out2->data;
    float *saved = (float *)a->out3->data;
    for (int64_t t = 0; t < a->T; ++t)
        sf_moe_aux_scores_forward_row(a->logits->data, a->logits->dtype, t * a->E, a->E, a->topk,
                                  a->score, a->out->data, a->out->dtype, map + t * a->E,
                                  saved + t * a->E);
    return SF_OK;
}

sf_status sf_moe_aux_scores_backward_cpu(const sf_moe_args *a)
{
    const float *saved = (const float *)a->saved->data;
    for (int64_t t = 0; t < a->T; ++t)
        sf_moe_aux_scores_backward_row(saved + t * a->E, a->grad->data, a->grad->dtype, t * a->E, a->E,
                                  a->score, a->out->data, a->out->dtype);
    return SF_OK;
}

sf_status sf_moe_aux_loss_forward_cpu(const sf_moe_args *a)
{
    /* column sums first (in float32, token order), then the weighted sum */
    double total = 0.0;
    for (int64_t e = 0; e < a->E; ++e) {
        float col = 0.0f;
        for (int64_t t = 0; t < a->T; ++t)
            col += sf_moe_ld(a->probs->data, a->probs->dtype, t * a->E + e);
        total += (double)col * sf_moe_ld_count(a->tpe->data, a->tpe->dtype, e);
    }
    float c = sf_moe_aux_factor(a->coeff, a->E, a->topk, a->total_tokens);
    ((float *)a->out->data)[0] = (float)(total * c);
    return SF_OK;
}

sf_status sf_moe_aux_loss_backward_cpu(const sf_moe_args *a)
{
    float g = ((const float *)a->dloss->data)[0] * sf_moe_aux_factor(a->coeff, a->E, a->topk, a->total_tokens);
    for (int64_t t = 0; t < a->T; ++t)
        for (int64_t e = 0; e < a->E; ++e)
            sf_moe_st(a->out->data, a->out->dtype, t * a->E + e,
                      g * sf_moe_ld_count(a->tpe->data, a->tpe->dtype, e));
    return SF_OK;
}

sf_status sf_moe_z_loss_forward_cpu(const sf_moe_args *a)
{
    float *lse = (float *)a->out2->data;
    double sum = 0.0;
    for (int64_t t = 0; t < a->T; ++t) {
        lse[t] = sf_moe_lse_row(a->logits->data, a->logits->dtype, t * a->E, a->E);
        sum += (double)lse[t] * lse[t];
    }
    ((float *)a->out->data)[0] = (float)(sum * a->coeff / (double)a->T);
    return SF_OK;
}

sf_status sf_moe_z_loss_backward_cpu(const sf_moe_args *a)
{
    const float *lse = (const float *)a->lse->data;
    float g = ((const float *)a->dloss->data)[0] * a->coeff * 2.0f / (float)a->T;
    for (int64_t t = 0; t < a->T; ++t)
        for (int64_t e = 0; e < a->E; ++e) {
            int64_t i = t * a->E + e;
            float p = expf(sf_moe_ld(a->logits->data, a->logits->dtype, i) - lse[t]);
            sf_moe_st(a->out->data, a->out->dtype, i, g * lse[t] * p);
        }
    return SF_OK;
}

sf_status sf_moe_row_id_map_cpu(const sf_moe_args *a)
{
    const uint8_t *map = (const uint8_t *)a->map->data;
    int32_t *ids = (int32_t *)a->out->data;
    int64_t *count = (int64_t *)a->out2->data;
    int64_t row = 0;
    for (int64_t e = 0; e < a->E; ++e) {
        int64_t start = row;
        for (int64_t t = 0; t < a->T; ++t) {
            int64_t i = t * a->E + e;
            ids[i] = map[i] ? (int32_t)row++ : -1;
        }
        count[e] = row - start;
    }
    return SF_OK;
}

sf_status sf_moe_permute_cpu(const sf_moe_args *a)
{
    const int32_t *ids = (const int32_t *)a->map->data;
    size_t es = sf_dtype_size(a->inp->dtype), row_bytes = (size_t)a->H * es;
    for (int64_t t = 0; t < a->T; ++t)
        for (int64_t e = 0; e < a->E; ++e) {
            int64_t r = ids[t * a->E + e];
            if (r < 0 || r >= a->N)
                continue;
            memcpy((char *)a->out->data + r * (int64_t)row_bytes,
                   (const char *)a->inp->data + t * (int64_t)row_bytes, row_bytes);
            if (a->probs)
                sf_moe_st(a->out2->data, a->out2->dtype, r,
                          sf_moe_ld(a->probs->data, a->probs->dtype, t * a->E + e));
        }
    return SF_OK;
}

sf_status sf_moe_unpermute_cpu(const sf_moe_args *a)
{
    const int32_t *ids = (const int32_t *)a->map->data;
    float *acc = malloc((size_t)a->H * sizeof(float));
    if (!acc)
        return sf_fail(SF_ERR_RUNTIME, "moe_unpermute: out of host memory");
    for (int64_t t = 0; t < a->T; ++t) {
        for (int64_t h = 0; h < a->H; ++h)
            acc[h] = 0.0f;
        for (int64_t e = 0; e < a->E; ++e) {
            int64_t r = ids[t * a->E + e];
            if (r < 0 || r >= a->N)
                continue;
            float p = a->probs ? sf_moe_ld(a->probs->data, a->probs->dtype, t * a->E + e) : 1.0f;
            for (int64_t h = 0; h < a->H; ++h)
                acc[h] += p * sf_moe_ld(a->inp->data, a->inp->dtype, r * a->H + h);
        }
        for (int64_t h = 0; h < a->H; ++h)
            sf_moe_st(a->out->data, a->out->dtype, t * a->H + h, acc[h]);
    }
    free(acc);
    return SF_OK;
}

sf_status sf_moe_unpermute_backward_cpu(const sf_moe_args *a)
{
    const int32_t *ids = (const int32_t *)a->map->data;
    for (int64_t t = 0; t < a->T; ++t)
        for (int64_t e = 0; e < a->E; ++e) {
            int64_t i = t * a->E + e, r = ids[i];
            int routed = r >= 0 && r < a->N;
            float p = a->probs ? sf_moe_ld(a->probs->data, a->probs->dtype, i) : 1.0f;
            float dot = 0.0f;
            for (int64_t h = 0; routed && h < a->H; ++h) {
                float g = sf_moe_ld(a->grad->data, a->grad->dtype, t * a->H + h);
                sf_moe_st(a->out->data, a->out->dtype, r * a->H + h, p * g);
                if (a->out2)
                    dot += g * sf_moe_ld(a->inp->data, a->inp->dtype, r * a->H + h);
            }
            if (a->out2)
                sf_moe_st(a->out2->data, a->out2->dtype, i, dot);
        }
    return SF_OK;
}

sf_status sf_moe_permute_probs_backward_cpu(const sf_moe_args *a)
{
    const int32_t *ids = (const int32_t *)a->map->data;
    for (int64_t i = 0; i < a->T * a->E; ++i) {
        int64_t r = ids[i];
        float g = r >= 0 && r < a->N ? sf_moe_ld(a->grad->data, a->grad->dtype, r) : 0.0f;
        sf_moe_st(a->out->data, a->out->dtype, i, g);
    }
    return SF_OK;
}

sf_status sf_moe_swiglu_forward_cpu(const sf_moe_args *a)
{
    const int64_t F = a->H;
    for (int64_t r = 0; r < a->N; ++r) {
        float p = a->probs ? sf_moe_ld(a->probs->data, a->probs->dtype, r) : 1.0f;
        for (int64_t j = 0; j < F; ++j) {
            float g = sf_moe_ld(a->inp->data, a->inp->dtype, r * 2 * F + j);
            float u = sf_moe_ld(a->inp->data, a->inp->dtype, r * 2 * F + F + j);
            sf_moe_st(a->out->data, a->out->dtype, r * F + j, sf_moe_silu(g) * u * p);
        }
    }
    return SF_OK;
}

sf_status sf_moe_swiglu_backward_cpu(const sf_moe_args *a)
{
    const int64_t F = a->H;
    for (int64_t r = 0; r < a->N; ++r) {
        float p = a->probs ? sf_moe_ld(a->probs->data, a->probs->dtype, r) : 1.0f;
        float dp = 0.0f;
        for (int64_t j = 0; j < F; ++j) {
            float g = sf_moe_ld(a->inp->data, a->inp->dtype, r * 2 * F + j);
            float u = sf_moe_ld(a->inp->data, a->inp->dtype, r * 2 * F + F + j);
            float d = sf_moe_ld(a->grad->data, a->grad->dtype, r * F + j);
            float s = sf_moe_silu(g);
            sf_moe_st(a->out->data, a->out->dtype, r * 2 * F + j, d * p * u * sf_moe_dsilu(g));
            sf_moe_st(a->out->data, a->out->dtype, r * 2 * F + F + j, d * p * s);
            dp += d * s * u;
        }
        if (a->out2)
            sf_moe_st(a->out2->data, a->out2->dtype, r, dp);
    }
    return SF_OK;
}
