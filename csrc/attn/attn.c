/*
 * attn.c - sf_attn_forward and sf_attn_backward, the public entries of fused
 * attention: every precondition is checked here, once, for both backends,
 * and the call is resolved into an sf_attn_problem (pointers, strides,
 * lengths, mask parameters) that the CPU reference (attn_cpu.c) and the CUDA
 * kernels read the same way.
 *
 * File shape (README, Layout): the family's, with the CUDA side in several
 * units.  attn_forward_cuda.cu and attn_backward_cuda.cu hold the mma.sync (sm80)
 * kernels and the CUDA entry points, which hand Hopper's calls to the wgmma
 * kernels of attn_forward_sm90_cuda.cu and attn_backward_sm90_cuda.cu.
 * The kernels' shared building blocks are
 * headers: attn_cuda.cuh (mma.sync, ldmatrix, cp.async), attn_sm90.cuh
 * (wgmma, swizzled tiles), attn_backward_tiles.cuh.  attn.h holds the problem and
 * the sequence and mask rules both backends apply, attn_philox.h the dropout
 * generator (bit for bit the CPU reference's), attn_sm90.h the C face of the
 * Hopper kernel choice, attn_backend.h the backend entry points.  Two check
 * programs: check_attn.cu (the CUDA kernels against the CPU reference,
 * through sf_attn_*) and check_attn_sm90.cu (the wgmma building blocks, then
 * the Hopper forward).
 */
#include <math.h>
#include <string.h>

#include "../core/dispatch.h"
#include "attn.h"
#include "attn_backend.h"

static const char *format_name(sf_attn_format f)
{
    return f == SF_ATTN_BSHD ? "bshd" : f == SF_ATTN_SBHD ? "sbhd" : "thd";
}

static int mask_has_padding(sf_attn_mask m)
{
    return m == SF_ATTN_PADDING || m == SF_ATTN_PADDING_CAUSAL ||
           m == SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT;
}

static int mask_is_causal(sf_attn_mask m)
{
    return m == SF_ATTN_CAUSAL || m == SF_ATTN_PADDING_CAUSAL ||
           m == SF_ATTN_CAUSAL_BOTTOM_RIGHT || m == SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT;
}

/* Read a q/k/v-like tensor of the layout into a view; returns its dims. */
static sf_status layout_view(const char *op, const char *arg, const sf_tensor *t,
                             sf_attn_format fmt, sf_attn_view *view, int64_t *batch,
                             int64_t *seq, int64_t *heads, int64_t *dim)
{
    int want = fmt == SF_ATTN_THD ? 3 : 4;
    if (t->ndim != want)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must have %d dimensions for qkv_format %s "
                       "(%s), got %d",
                       op, arg, want, format_name(fmt),
                       fmt == SF_ATTN_BSHD ? "[b, s, h, d]"
                       : fmt == SF_ATTN_SBHD ? "[s, b, h, d]" : "[t, h, d]",
                       t->ndim);
    if (t->shape[want - 1] > 1 && t->strides[want - 1] != 1)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be contiguous in its last (head) "
                       "dimension, got stride %lld",
                       op, arg, (long long)t->strides[want - 1]);
    view->ptr = t->data;
    if (fmt == SF_ATTN_BSHD) {
        *batch = t->shape[0]; *seq = t->shape[1]; *heads = t->shape[2]; *dim = t->shape[3];
        view->sb = t->strides[0]; view->ss = t->strides[1]; view->sh = t->strides[2];
    } else if (fmt == SF_ATTN_SBHD) {
        *seq = t->shape[0]; *batch = t->shape[1]; *heads = t->shape[2]; *dim = t->shape[3];
        view->sb = t->strides[1]; view->ss = t->strides[0]; view->sh = t->strides[2];
    } else {
        *batch = 1; *seq = t->shape[0]; *heads = t->shape[1]; *dim = t->shape[2];
        view->sb = 0; view->ss = t->strides[0]; view->sh = t->strides[1];
    }
    return SF_OK;
}

/* A tensor that must have exactly the shape of `ref` (same layout). */
static sf_status same_layout(const char *op, const char *arg, const sf_tensor *t,
                             const char *ref_arg, const sf_tensor *ref, sf_attn_format fmt,
                             sf_attn_view *view)
{
    SF_TRY(sf_check_same_shape(op, arg, t, ref_arg, ref));
    int64_t b, s, h, d;
    return layout_view(op, arg, t, fmt, view, &b, &s, &h, &d);
}

static sf_status check_cuda_alignment(const char *op, const char *arg, const sf_tensor *t)
{
    if (t->device != SF_CUDA)
        return SF_OK;
    if ((uintptr_t)t->data % 16 != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must start at a 16-byte aligned address on "
                       "CUDA (the kernel loads 16-byte vectors)",
                       op, arg);
    for (int i = 0; i < t->ndim - 1; ++i)
        if (t->shape[i] > 1 && t->strides[i] % 8 != 0)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' must have strides that are multiples of 8 "
                           "elements on CUDA, got stride %lld in dimension %d",
                           op, arg, (long long)t->strides[i], i);
    return SF_OK;
}

static sf_status check_cu_seqlens(const char *op, const char *arg, const sf_tensor *cu,
                                  const sf_tensor *q, int64_t batch, int64_t extent,
                                  int max_len, int thd)
{
    SF_TRY(sf_check_dtype(op, arg, cu, SF_INT32));
    if (cu->ndim != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 1-D [b+1], got %d dimensions",
                       op, arg, cu->ndim);
    if (!thd && cu->shape[0] != batch + 1)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must have b+1 = %lld elements, got %lld", op,
                       arg, (long long)(batch + 1), (long long)cu->shape[0]);
    if (cu->shape[0] < 2)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must have at least 2 elements (b+1), got %lld",
                       op, arg, (long long)cu->shape[0]);
    SF_TRY(sf_check_contiguous(op, arg, cu));
    SF_TRY(sf_check_same_device(op, arg, cu, "q", q));
    if (cu->device != SF_CPU)
        return SF_OK; /* reading device memory would synchronize; the kernel clamps */
    const int32_t *c = (const int32_t *)cu->data;
    if (c[0] != 0)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must start at 0, got %d", op, arg,
                       (int)c[0]);
    for (int64_t i = 0; i + 1 < cu->shape[0]; ++i) {
        int64_t n = (int64_t)c[i + 1] - c[i];
        if (n < 0)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' must be non-decreasing, but element %lld "
                           "(%d) < element %lld (%d)",
                           op, arg, (long long)(i + 1), (int)c[i + 1], (long long)i, (int)c[i]);
        if (n > max_len)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' holds a sequence of length %lld, longer than "
                           "the max_seqlen %d",
                           op, arg, (long long)n, max_len);
    }
    if (thd && c[cu->shape[0] - 1] > extent)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' ends at %d, beyond the %lld %s of the tensor",
                       op, arg, (int)c[cu->shape[0] - 1], (long long)extent,
                       thd ? "tokens" : "positions");
    return SF_OK;
}

/* Everything the forward and backward share: q, k, v, cu_seqlens, config. */
static sf_status resolve(const char *op, const sf_tensor *q, const sf_tensor *k,
                         const sf_tensor *v, const sf_tensor *cu_q, const sf_tensor *cu_k,
                         const sf_attn_config *cfg, sf_attn_problem *p)
{
    memset(p, 0, sizeof *p);
    if (cfg->format != SF_ATTN_BSHD && cfg->format != SF_ATTN_SBHD && cfg->format != SF_ATTN_THD)
        return sf_fail(SF_ERR_VALUE, "%s: qkv_format must be bshd, sbhd or thd (0, 1, 2), got %d",
                       op, (int)cfg->format);
    if ((int)cfg->mask < 0 || (int)cfg->mask > SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT)
        return sf_fail(SF_ERR_VALUE, "%s: attn_mask_type code %d is not one of 0..5", op,
                       (int)cfg->mask);
    SF_TRY(sf_check_float_input(op, "q", q));
    SF_TRY(sf_check_dtype(op, "k", k, q->dtype));
    SF_TRY(sf_check_dtype(op, "v", v, q->dtype));
    SF_TRY(sf_check_same_device(op, "q", q, "k", k));
    SF_TRY(sf_check_same_device(op, "q", q, "v", v));
    int thd = cfg->format == SF_ATTN_THD;
    int64_t bq, sq, hq, dq, bk, sk, hk, dk, bv, sv, hv, dv;
    SF_TRY(layout_view(op, "q", q, cfg->format, &p->q, &bq, &sq, &hq, &dq));
    SF_TRY(layout_view(op, "k", k, cfg->format, &p->k, &bk, &sk, &hk, &dk));
    SF_TRY(layout_view(op, "v", v, cfg->format, &p->v, &bv, &sv, &hv, &dv));
    if (bk != bv || sk != sv || hk != hv || dk != dv)
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'k' and 'v' must have the same shape", op);
    if (dq != dk)
        return sf_fail(SF_ERR_VALUE,
                       "%s: arguments 'q' and 'k' must have the same head dim, got %lld and %lld",
                       op, (long long)dq, (long long)dk);
    if (!thd && bq != bk)
        return sf_fail(SF_ERR_VALUE,
                       "%s: arguments 'q' and 'k' must have the same batch size, got %lld and %lld",
                       op, (long long)bq, (long long)bk);
    if (hq < 1 || hk < 1 || hq % hk != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: the number of query heads (%lld) must be a positive multiple of "
                       "the number of key/value heads (%lld)",
                       op, (long long)hq, (long long)hk);
    if (dq < 1)
        return sf_fail(SF_ERR_VALUE, "%s: head dim must be at least 1, got %lld", op, (long long)dq);
    if (cfg->window_left < -1 || cfg->window_right < -1)
        return sf_fail(SF_ERR_VALUE,
                       "%s: window_size entries must be -1 (unbounded) or >= 0, got (%d, %d)",
                       op, cfg->window_left, cfg->window_right);
    if (!(cfg->dropout_p >= 0.0 && cfg->dropout_p < 1.0)) /* NaN fails too */
        return sf_fail(SF_ERR_VALUE, "%s: dropout_p must be in [0, 1), got %g", op,
                       cfg->dropout_p);
    if (!isfinite(cfg->softmax_scale) || cfg->softmax_scale <= 0.0f)
        return sf_fail(SF_ERR_VALUE, "%s: softmax_scale must be finite and positive, got %g", op,
                       (double)cfg->softmax_scale);

    int padding = mask_has_padding(cfg->mask);
    if (thd) {
        if (!cu_q || !cu_k)
            return sf_fail(SF_ERR_VALUE,
                           "%s: qkv_format thd needs cu_seqlens_q and cu_seqlens_kv", op);
        if (cfg->max_seqlen_q < 0 || cfg->max_seqlen_kv < 0 ||
            (cfg->max_seqlen_q == 0 && sq > 0) || (cfg->max_seqlen_kv == 0 && sk > 0))
            return sf_fail(SF_ERR_VALUE,
                           "%s: qkv_format thd needs max_seqlen_q and max_seqlen_kv >= 1, "
                           "got %d and %d",
                           op, cfg->max_seqlen_q, cfg->max_seqlen_kv);
        if (cu_q->ndim == 1 && cu_k->ndim == 1 && cu_q->shape[0] != cu_k->shape[0])
            return sf_fail(SF_ERR_VALUE,
                           "%s: arguments 'cu_seqlens_q' and 'cu_seqlens_kv' must have the "
                           "same number of elements (b+1), got %lld and %lld",
                           op, (long long)cu_q->shape[0], (long long)cu_k->shape[0]);
        p->max_sq = cfg->max_seqlen_q;
        p->max_sk = cfg->max_seqlen_kv;
    } else {
        if (padding && (!cu_q || !cu_k))
            return sf_fail(SF_ERR_VALUE,
                           "%s: padding masks in qkv_format %s need cu_seqlens_q and "
                           "cu_seqlens_kv (the real length of each batch row)",
                           op, format_name(cfg->format));
        if (!padding && (cu_q || cu_k))
            return sf_fail(SF_ERR_VALUE,
                           "%s: cu_seqlens are only taken with qkv_format thd or a padding "
                           "mask; attn_mask_type without padding means every row is full",
                           op);
        if ((cfg->max_seqlen_q != 0 && cfg->max_seqlen_q != sq) ||
            (cfg->max_seqlen_kv != 0 && cfg->max_seqlen_kv != sk))
            return sf_fail(SF_ERR_VALUE,
                           "%s: in qkv_format %s max_seqlen_q/kv must be 0 or the sequence "
                           "dimension (%lld, %lld), got %d and %d",
                           op, format_name(cfg->format), (long long)sq, (long long)sk,
                           cfg->max_seqlen_q, cfg->max_seqlen_kv);
        if (sq > 0x7fffffff || sk > 0x7fffffff)
            return sf_fail(SF_ERR_VALUE, "%s: sequence dimension too long", op);
        p->max_sq = (int)sq;
        p->max_sk = (int)sk;
    }
    int64_t batch = thd ? (cu_q->ndim == 1 ? cu_q->shape[0] - 1 : 0) : bq;
    if (cu_q)
        SF_TRY(check_cu_seqlens(op, "cu_seqlens_q", cu_q, q, batch, sq, p->max_sq, thd));
    if (cu_k)
        SF_TRY(check_cu_seqlens(op, "cu_seqlens_kv", cu_k, q, batch, sk, p->max_sk, thd));

    if (q->device == SF_CUDA) {
        if (q->dtype == SF_FLOAT32)
            return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                           "%s: the CUDA kernel takes float16 or bfloat16 inputs, got float32 "
                           "(cast q, k, v first; the CPU reference takes float32)",
                           op);
        /* 24 (ESM-2 35M) runs in the 32-wide kernels with zero columns */
        if (dq != 16 && dq != 24 && dq != 32 && dq != 64 && dq != 128)
            return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                           "%s: the CUDA kernel supports head dims 16, 24, 32, 64 and 128, "
                           "got %lld",
                           op, (long long)dq);
        SF_TRY(check_cuda_alignment(op, "q", q));
        SF_TRY(check_cuda_alignment(op, "k", k));
        SF_TRY(check_cuda_alignment(op, "v", v));
    }

    p->dtype = q->dtype;
    p->batch = (int)batch;
    p->heads = (int)hq;
    p->heads_kv = (int)hk;
    p->head_dim = (int)dq;
    p->thd = thd;
    p->extent_q = sq;
    p->extent_k = sk;
    p->cu_q = cu_q ? (const int32_t *)cu_q->data : NULL;
    p->cu_k = cu_k ? (const int32_t *)cu_k->data : NULL;
    p->window_left = cfg->window_left;
    p->window_right = mask_is_causal(cfg->mask) ? 0 : cfg->window_right;
    p->bottom_right = !(cfg->mask == SF_ATTN_CAUSAL || cfg->mask == SF_ATTN_PADDING_CAUSAL);
    p->scale = cfg->softmax_scale;
    p->deterministic = cfg->deterministic;
    if (cfg->dropout_p > 0.0) {
        /* keep iff u16 >= ceil(p * 65536) (attn_philox.h); exact in double */
        p->dropout = 1;
        p->drop_p = cfg->dropout_p;
        p->drop_threshold = (uint32_t)ceil(cfg->dropout_p * 65536.0);
        p->drop_scale = (float)(1.0 / (1.0 - cfg->dropout_p));
        p->seed_lo = (uint32_t)cfg->dropout_seed;
        p->seed_hi = (uint32_t)(cfg->dropout_seed >> 32);
        p->offset = cfg->dropout_offset;
    }
    return SF_OK;
}

/* lse and delta: [b, h, s_q] (padded layouts) or [h, t_q] (thd), float32. */
static sf_status check_rowstat(const char *op, const char *arg, const sf_tensor *t,
                               const sf_tensor *q, sf_attn_problem *p)
{
    SF_TRY(sf_check_dtype(op, arg, t, SF_FLOAT32));
    SF_TRY(sf_check_contiguous(op, arg, t));
    SF_TRY(sf_check_same_device(op, arg, t, "q", q));
    if (p->thd) {
        if (t->ndim != 2 || t->shape[0] != p->heads || t->shape[1] != p->extent_q)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' must have shape [h, t] = [%d, %lld] for thd", op,
                           arg, p->heads, (long long)p->extent_q);
        p->lse_sb = 0;
        p->lse_sh = p->extent_q;
    } else {
        if (t->ndim != 3 || t->shape[0] != p->batch || t->shape[1] != p->heads ||
            t->shape[2] != p->max_sq)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' must have shape [b, h, s_q] = [%d, %d, %d]", op,
                           arg, p->batch, p->heads, p->max_sq);
        p->lse_sb = (int64_t)p->heads * p->max_sq;
        p->lse_sh = p->max_sq;
    }
    return SF_OK;
}

/* A tensor laid out like `ref` (dtype, device, shape, layout, CUDA alignment). */
static sf_status check_like(const char *op, const char *arg, const sf_tensor *t,
                            const char *ref_arg, const sf_tensor *ref, sf_attn_format fmt,
                            sf_attn_view *view)
{
    SF_TRY(sf_check_dtype(op, arg, t, ref->dtype));
    SF_TRY(sf_check_same_device(op, arg, t, ref_arg, ref));
    SF_TRY(same_layout(op, arg, t, ref_arg, ref, fmt, view));
    return check_cuda_alignment(op, arg, t);
}

static sf_status check_output(const char *op, const char *arg, const sf_tensor *t,
                              const char *ref_arg, const sf_tensor *ref, sf_attn_format fmt,
                              sf_attn_view *view)
{
    SF_TRY(sf_check_writable(op, arg, t));
    return check_like(op, arg, t, ref_arg, ref, fmt, view);
}

sf_status sf_attn_forward(const sf_tensor *q, const sf_tensor *k, const sf_tensor *v,
                      const sf_tensor *cu_seqlens_q, const sf_tensor *cu_seqlens_kv,
                      const sf_attn_config *cfg, sf_tensor *out, sf_tensor *lse,
                      sf_stream stream)
{
    static const char op[] = "attention_forward";
    sf_attn_problem p;
    SF_TRY(resolve(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, cfg, &p));
    SF_TRY(check_output(op, "out", out, "q", q, cfg->format, &p.o));
    SF_TRY(check_rowstat(op, "lse", lse, q, &p));
    SF_TRY(sf_check_writable(op, "lse", lse));
    const sf_mem_arg outs[] = {{"out", out, NULL}, {"lse", lse, NULL}};
    const sf_mem_arg ins[] = {{"q", q, NULL}, {"k", k, NULL}, {"v", v, NULL}, {"cu_seqlens_q", cu_seqlens_q, NULL},
                              {"cu_seqlens_kv", cu_seqlens_kv, NULL}};
    SF_TRY(sf_check_apart(op, outs, 2, ins, 5));
    p.lse = (float *)lse->data;
    return SF_DISPATCH(op, "q", q, sf_attn_forward_cpu(&p), sf_attn_forward_cuda(&p, stream, q->device_id));
}

sf_status sf_attn_backward(const sf_tensor *q, const sf_tensor *k, const sf_tensor *v,
                      const sf_tensor *out, const sf_tensor *dout,
                      const sf_tensor *lse, const sf_tensor *cu_seqlens_q,
                      const sf_tensor *cu_seqlens_kv, const sf_attn_config *cfg,
                      sf_tensor *dq, sf_tensor *dk, sf_tensor *dv,
                      sf_tensor *dq_accum, sf_tensor *delta, sf_stream stream)
{
    static const char op[] = "attention_backward";
    sf_attn_problem p;
    SF_TRY(resolve(op, q, k, v, cu_seqlens_q, cu_seqlens_kv, cfg, &p));
    SF_TRY(check_like(op, "out", out, "q", q, cfg->format, &p.o));
    SF_TRY(check_like(op, "dout", dout, "q", q, cfg->format, &p.dout));
    SF_TRY(check_rowstat(op, "lse", lse, q, &p));
    p.lse = (float *)lse->data;
    SF_TRY(check_output(op, "dq", dq, "q", q, cfg->format, &p.dq));
    SF_TRY(check_output(op, "dk", dk, "k", k, cfg->format, &p.dk));
    SF_TRY(check_output(op, "dv", dv, "v", v, cfg->format, &p.dv));
    SF_TRY(sf_check_dtype(op, "dq_accum", dq_accum, SF_FLOAT32));
    SF_TRY(sf_check_same_device(op, "dq_accum", dq_accum, "q", q));
    SF_TRY(sf_check_writable(op, "dq_accum", dq_accum));
    SF_TRY(sf_check_contiguous(op, "dq_accum", dq_accum));
    SF_TRY(same_layout(op, "dq_accum", dq_accum, "q", q, cfg->format, &p.dq_accum));
    SF_TRY(check_cuda_alignment(op, "dq_accum", dq_accum)); /* read and added as float pairs */
    {
        sf_attn_problem tmp = p; /* delta has lse's shape; keep p's lse strides */
        SF_TRY(check_rowstat(op, "delta", delta, q, &tmp));
        SF_TRY(sf_check_writable(op, "delta", delta));
        p.delta = (float *)delta->data;
    }
    const sf_mem_arg outs[] = {{"dq", dq, NULL}, {"dk", dk, NULL}, {"dv", dv, NULL}, {"dq_accum", dq_accum, NULL},
                               {"delta", delta, NULL}};
    const sf_mem_arg ins[] = {{"q", q, NULL}, {"k", k, NULL}, {"v", v, NULL}, {"out", out, NULL},
                              {"dout", dout, NULL}, {"lse", lse, NULL}, {"cu_seqlens_q", cu_seqlens_q, NULL},
                              {"cu_seqlens_kv", cu_seqlens_kv, NULL}};
    SF_TRY(sf_check_apart(op, outs, 5, ins, 8));
    return SF_DISPATCH(op, "q", q, sf_attn_backward_cpu(&p), sf_attn_backward_cuda(&p, stream, q->device_id));
}
