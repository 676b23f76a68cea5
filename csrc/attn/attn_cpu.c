/*
 * attn_cpu.c - the reference attention: plain loops over (batch, head, query
 * row), the full row of scores per query, softmax and its gradient in double
 * precision.  It is the definition of correct that the CUDA kernels are
 * tested against, and the backend the modules use on the CPU.
 *
 * Forward, per query row r of sequence b, head h (key/value head h / group):
 *   s_c = scale * q_r . k_c over the keys c the mask allows,
 *   lse = log sum_c exp(s_c),  out_r = sum_c exp(s_c - lse) v_c.
 * Backward, with P recomputed from the saved lse (as the kernel does) and
 * delta_r = dout_r . out_r:
 *   dS_rc = P_rc (dout_r . v_c - delta_r),
 *   dq_r = scale sum_c dS_rc k_c,  dk_c = scale sum_r dS_rc q_r,
 *   dv_c = sum_r P_rc dout_r   (dk, dv summed over the heads of a group).
 * Rows that see no key: out 0, lse +inf.  Padded rows and the THD tail: 0.
 *
 * Dropout (p->dropout): each probability P_rc is multiplied by
 * m_rc = keep_rc / (1 - p), keep from attn_philox.h; lse stays the undropped
 * one.  out_r = sum_c P_rc m_rc v_c; backward: dv_c = sum_r P_rc m_rc dout_r
 * and dS_rc = P_rc (m_rc dout_r . v_c - delta_r) (delta = dout . out with the
 * dropped out is still rowsum(dP o P), as flash-attention 2 uses it).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "attn_backend.h"
#include "attn_philox.h"
#include "core/float_io.h"

static double load(sf_dtype dt, const sf_attn_view *v, int b, int64_t t, int h, int d)
{
    return sf_load_float(v->ptr, dt, (int64_t)b * v->sb + t * v->ss + (int64_t)h * v->sh + d);
}

static void store(sf_dtype dt, const sf_attn_view *v, int b, int64_t t, int h, int d, double x)
{
    sf_store_float(v->ptr, dt, (int64_t)b * v->sb + t * v->ss + (int64_t)h * v->sh + d, (float)x);
}

/* Zero `heads` rows of token t of a view (padded rows, the THD tail). */
static void zero_token(sf_dtype dt, const sf_attn_view *v, int b, int64_t t, int heads, int dim)
{
    for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d)
            store(dt, v, b, t, h, d, 0.0);
}

/* The dropout multiplier of element (b, h, r, c): 1 without dropout, else
 * 0 or 1 / (1 - p). */
static double drop_factor(const sf_attn_problem *p, int b, int h, int r, int c)
{
    if (!p->dropout)
        return 1.0;
    return sf_attn_drop_keep(p->seed_lo, p->seed_hi, p->offset, (int64_t)b * p->heads + h,
                             p->drop_threshold, r, c)
               ? 1.0 / (1.0 - p->drop_p)
               : 0.0;
}

static int64_t lse_index(const sf_attn_problem *p, int b, int h, int64_t t)
{
    return (int64_t)b * p->lse_sb + (int64_t)h * p->lse_sh + t;
}

/* First token of the THD tail: the end of the last sequence, clamped. */
static int64_t tail_start(const int32_t *cu, int batch, int64_t extent)
{
    int64_t e = cu[batch];
    return e < 0 ? 0 : (e > extent ? extent : e);
}

sf_status sf_attn_forward_cpu(const sf_attn_problem *p)
{
    const int D = p->head_dim, G = p->heads / p->heads_kv;
    double *s = (double *)malloc(sizeof(double) * (size_t)(p->max_sk > 0 ? p->max_sk : 1));
    double *acc = (double *)malloc(sizeof(double) * (size_t)D);
    if (!s || !acc) {
        free(s);
        free(acc);
        return sf_fail(SF_ERR_RUNTIME, "attention_forward: out of host memory");
    }
    for (int b = 0; b < p->batch; ++b) {
        const sf_attn_seqs sb = sf_attn_seqs_of(p, b);
        const int64_t qs = sb.qs, ks = sb.ks;
        const int sq = sb.sq, sk = sb.sk, off = sb.off;
        for (int h = 0; h < p->heads; ++h) {
            int hk = h / G;
            for (int r = 0; r < sq; ++r) {
                double m = -INFINITY;
                for (int c = 0; c < sk; ++c) {
                    if (!sf_attn_allowed(r, c, off, p->window_left, p->window_right)) {
                        s[c] = -INFINITY;
                        continue;
                    }
                    double dot = 0.0;
                    for (int d = 0; d < D; ++d)
                        dot += load(p->dtype, &p->q, b, qs + r, h, d) *
                               load(p->dtype, &p->k, b, ks + c, hk, d);
                    s[c] = dot * p->scale;
                    if (s[c] > m || s[c] != s[c]) /* a NaN score makes the row NaN, as in torch */
                        m = s[c];
                }
                memset(acc, 0, sizeof(double) * (size_t)D);
                double l = 0.0;
                if (m != -INFINITY) {
                    for (int c = 0; c < sk; ++c) {
                        if (s[c] == -INFINITY)
                            continue;
                        double e = exp(s[c] - m);
                        l += e; /* the softmax denominator counts dropped probabilities too */
                        double ed = e * drop_factor(p, b, h, r, c);
                        if (ed == 0.0)
                            continue;
                        for (int d = 0; d < D; ++d)
                            acc[d] += ed * load(p->dtype, &p->v, b, ks + c, hk, d);
                    }
                }
                for (int d = 0; d < D; ++d)
                    store(p->dtype, &p->o, b, qs + r, h, d, !(l <= 0.0) ? acc[d] / l : 0.0);
                p->lse[lse_index(p, b, h, qs + r)] = !(l <= 0.0) ? (float)(m + log(l)) : INFINITY;
            }
            if (!p->thd) /* padded rows of this batch row */
                for (int r = sq; r < p->max_sq; ++r) {
                    for (int d = 0; d < D; ++d)
                        store(p->dtype, &p->o, b, r, h, d, 0.0);
                    p->lse[lse_index(p, b, h, r)] = INFINITY;
                }
        }
    }
    if (p->thd)
        for (int64_t t = tail_start(p->cu_q, p->batch, p->extent_q); t < p->extent_q; ++t) {
            zero_token(p->dtype, &p->o, 0, t, p->heads, D);
            for (int h = 0; h < p->heads; ++h)
                p->lse[lse_index(p, 0, h, t)] = INFINITY;
        }
    free(s);
    free(acc);
    return SF_OK;
}

sf_status sf_attn_backward_cpu(const sf_attn_problem *p)
{
    const int D = p->head_dim, G = p->heads / p->heads_kv;
    const int64_t maxk = p->max_sk > 0 ? p->max_sk : 1;
    double *dk = (double *)calloc((size_t)(maxk * D), sizeof(double));
    double *dv = (double *)calloc((size_t)(maxk * D), sizeof(double));
    double *dq = (double *)malloc(sizeof(double) * (size_t)D);
    double *dov = (double *)malloc(sizeof(double) * (size_t)maxk); /* dout_r . v_c */
    double *pr = (double *)malloc(sizeof(double) * (size_t)maxk);  /* P_rc */
    if (!dk || !dv || !dq || !dov || !pr) {
        free(dk); free(dv); free(dq); free(dov); free(pr);
        return sf_fail(SF_ERR_RUNTIME, "attention_backward: out of host memory");
    }
    for (int b = 0; b < p->batch; ++b) {
        const sf_attn_seqs sb = sf_attn_seqs_of(p, b);
        const int64_t qs = sb.qs, ks = sb.ks;
        const int sq = sb.sq, sk = sb.sk, off = sb.off;
        for (int hk = 0; hk < p->heads_kv; ++hk) {
            memset(dk, 0, sizeof(double) * (size_t)(maxk * D));
            memset(dv, 0, sizeof(double) * (size_t)(maxk * D));
            for (int h = hk * G; h < (hk + 1) * G; ++h) {
                for (int r = 0; r < sq; ++r) {
                    double delta = 0.0;
                    for (int d = 0; d < D; ++d)
                        delta += load(p->dtype, &p->dout, b, qs + r, h, d) *
                                 load(p->dtype, &p->o, b, qs + r, h, d);
                    p->delta[lse_index(p, b, h, qs + r)] = (float)delta;
                    double lse = p->lse[lse_index(p, b, h, qs + r)];
                    memset(dq, 0, sizeof(double) * (size_t)D);
                    for (int c = 0; c < sk; ++c) {
                        pr[c] = 0.0;
                        if (!sf_attn_allowed(r, c, off, p->window_left, p->window_right) ||
                            lse == INFINITY)
                            continue;
                        double dot = 0.0, dpv = 0.0;
                        for (int d = 0; d < D; ++d) {
                            dot += load(p->dtype, &p->q, b, qs + r, h, d) *
                                   load(p->dtype, &p->k, b, ks + c, hk, d);
                            dpv += load(p->dtype, &p->dout, b, qs + r, h, d) *
                                   load(p->dtype, &p->v, b, ks + c, hk, d);
                        }
                        pr[c] = exp(dot * p->scale - lse);
                        dov[c] = dpv;
                    }
                    for (int c = 0; c < sk; ++c) {
                        if (pr[c] == 0.0)
                            continue;
                        const double m = drop_factor(p, b, h, r, c);
                        double ds = pr[c] * (m * dov[c] - delta) * p->scale;
                        for (int d = 0; d < D; ++d) {
                            dq[d] += ds * load(p->dtype, &p->k, b, ks + c, hk, d);
                            dk[(int64_t)c * D + d] += ds * load(p->dtype, &p->q, b, qs + r, h, d);
                            dv[(int64_t)c * D + d] +=
                                m * pr[c] * load(p->dtype, &p->dout, b, qs + r, h, d);
                        }
                    }
                    for (int d = 0; d < D; ++d) {
                        store(p->dtype, &p->dq, b, qs + r, h, d, dq[d]);
                        store(SF_FLOAT32, &p->dq_accum, b, qs + r, h, d, dq[d]);
                    }
                }
                if (!p->thd)
                    for (int r = sq; r < p->max_sq; ++r) {
                        for (int d = 0; d < D; ++d) {
                            store(p->dtype, &p->dq, b, r, h, d, 0.0);
                            store(SF_FLOAT32, &p->dq_accum, b, r, h, d, 0.0);
                        }
                        p->delta[lse_index(p, b, h, r)] = 0.0f;
                    }
            }
            for (int c = 0; c < sk; ++c)
                for (int d = 0; d < D; ++d) {
                    store(p->dtype, &p->dk, b, ks + c, hk, d, dk[(int64_t)c * D + d]);
                    store(p->dtype, &p->dv, b, ks + c, hk, d, dv[(int64_t)c * D + d]);
                }
            if (!p->thd)
                for (int c = sk; c < p->max_sk; ++c)
                    for (int d = 0; d < D; ++d) {
                        store(p->dtype, &p->dk, b, c, hk, d, 0.0);
                        store(p->dtype, &p->dv, b, c, hk, d, 0.0);
                    }
        }
    }
    if (p->thd) {
        for (int64_t t = tail_start(p->cu_q, p->batch, p->extent_q); t < p->extent_q; ++t) {
            zero_token(p->dtype, &p->dq, 0, t, p->heads, D);
            zero_token(SF_FLOAT32, &p->dq_accum, 0, t, p->heads, D);
            for (int h = 0; h < p->heads; ++h)
                p->delta[lse_index(p, 0, h, t)] = 0.0f;
        }
        for (int64_t t = tail_start(p->cu_k, p->batch, p->extent_k); t < p->extent_k; ++t) {
            zero_token(p->dtype, &p->dk, 0, t, p->heads_kv, D);
            zero_token(p->dtype, &p->dv, 0, t, p->heads_kv, D);
        }
    }
    free(dk); free(dv); free(dq); free(dov); free(pr);
    return SF_OK;
}
