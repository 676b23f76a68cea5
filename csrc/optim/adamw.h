/*
 * adamw.h - the AdamW element update, shared by the CPU reference and the
 * CUDA kernel, and the host-side derivation of its per-step constants.
 *
 * The update mirrors torch.optim.AdamW's single-tensor path operation by
 * operation (mul by 1 - lr wd; lerp for m; mul + addcmul for v; sqrt, divide,
 * add eps; addcdiv), with every constant derived in double and rounded to
 * float once, so fp32 results track torch's to within a rounding or two.
 */
#ifndef SF_ADAMW_H
#define SF_ADAMW_H

#include <math.h>

#include "seqfuse.h"

#if defined(__CUDACC__)
#define SF_ADAMW_HD static inline __host__ __device__
#else
#define SF_ADAMW_HD static inline
#endif

typedef struct sf_adamw_consts {
    float decay;          /* 1 - lr * weight_decay */
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float eps;
    float neg_step_size;  /* -lr / (1 - beta1^step) */
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
} sf_adamw_consts;

static inline sf_adamw_consts sf_adamw_derive(const sf_adamw_config *c)
{
    sf_adamw_consts k;
    double bc1 = 1.0 - pow(c->beta1, (double)c->step);
    double bc2 = 1.0 - pow(c->beta2, (double)c->step);
    k.decay = (float)(1.0 - c->lr * c->weight_decay);
    k.beta2 = (float)c->beta2;
    k.one_minus_beta1 = (float)(1.0 - c->beta1);
    k.one_minus_beta2 = (float)(1.0 - c->beta2);
    k.eps = (float)c->eps;
    k.neg_step_size = (float)(-(c->lr / bc1));
    k.bc2_sqrt = (float)sqrt(bc2);
    return k;
}

/* torch's lerp: exact at both ends, the branch on the weight as torch has it. */
SF_ADAMW_HD float sf_lerp(float a, float b, float w)
{
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

SF_ADAMW_HD void sf_adamw_update(const sf_adamw_consts *k, float g, float *p, float *m, float *v)
{
    float pv = *p * k->decay;
    float mv = sf_lerp(*m, g, k->one_minus_beta1);
    float vv = *v * k->beta2;
    vv = vv + k->one_minus_beta2 * g * g;
    float denom = sqrtf(vv) / k->bc2_sqrt + k->eps;
    pv = pv + k->neg_step_size * (mv / denom);
    *p = pv;
    *m = mv;
    *v = vv;
}

#endif /* SF_ADAMW_H */
