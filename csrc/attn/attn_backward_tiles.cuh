/*
 * attn_backward_tiles.cuh - the sm80 (mma.sync) backward's main pass: the dK / dV
 * kernel (dQ added with atomics, or not in deterministic mode) and the
 * deterministic dQ kernel, with launch_backward_tiles, which runs them for one
 * (dtype, tile width, dropout).  attn_backward_cuda.cu (the entry, delta and the
 * dQ conversion) calls launch_backward_tiles and compiles it for every tile
 * width.  The scheme:
 * attn_backward_cuda.cu's top comment.
 */
#ifndef SF_ATTN_BACKWARD_TILES_CUH
#define SF_ATTN_BACKWARD_TILES_CUH

#include "../core/cuda_util.h"
#include "attn_sm90.cuh"

namespace sf_attn {

/* kBackwardStepM query rows per step of a dK/dV block; kBackwardBN keys and kBackwardBM
 * query rows per deterministic dQ block. */
constexpr int kBackwardWarps = 4, kBackwardThreads = 32 * kBackwardWarps, kBackwardBN = 16 * kBackwardWarps, kBackwardBM = 64;
constexpr int kBackwardStepM = 32;

/* Keys of a dK/dV block: each warp owns KT m16 tiles of keys (16*KT keys).
 * Two tiles (head dims up to 64) use every Q and dO fragment read from
 * shared memory twice, which is what shared-memory bandwidth asks for, and
 * halve the dQ atomics and the Q/dO re-reads (there are half as many key
 * blocks); head dim 128's dK and dV would not fit the registers twice. */
template <int D> struct DkdvCfg {
    static constexpr int KT = D <= 64 ? 2 : 1, BN = 16 * KT * kBackwardWarps;
};

template <int D> constexpr int dq_smem_bytes()
{
    return (2 * kBackwardBN + 2 * kBackwardBM) * (D + 8) * 2;
}

/* dK and dV of BN keys (DkdvCfg): 32 query rows per step, the next step's
 * Q, dO, lse and delta fetched (cp.async, double buffered) while the current
 * one is computed, so the loads do not stall the block; the 32-row step keeps S^T
 * and dP^T in few registers (no spills at head dim 128).  dQ of a step: warp
 * w adds query rows 16*(w%2).. and head-dim columns (w/2)*DH.. of dS K
 * (head dims of 32 and more: two column halves; 16: warps 0 and 1 only). */
template <int D> constexpr int dkdv_smem_bytes()
{
    constexpr int BN = DkdvCfg<D>::BN;
    return (2 * BN + 4 * kBackwardStepM) * (D + 8) * 2 + BN * (kBackwardStepM + 8) * 2 + 4 * kBackwardStepM * 4;
}

template <typename T, int D, bool kAtomicDq, bool kDropout>
__global__ void __launch_bounds__(kBackwardThreads) dkdv_kernel(const sf_attn_problem p)
{
    constexpr int KT = DkdvCfg<D>::KT, BN = DkdvCfg<D>::BN;
    constexpr int SD = D + 8, BM = kBackwardStepM, NT = kBackwardThreads, SS = BM + 8;
    constexpr int KD = D / 16, NO = D / 8, NS = BM / 8;
    constexpr int DSPLIT = D >= 32 ? 2 : 1, DH = D / DSPLIT; /* dQ columns per warp */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sK = reinterpret_cast<T *>(smem_raw);
    T *sV = sK + BN * SD;
    T *sQ0 = sV + BN * SD;      /* [2][BM][SD] */
    T *sdO0 = sQ0 + 2 * BM * SD; /* [2][BM][SD] */
    T *sdS = sdO0 + 2 * BM * SD; /* dS^T [key][query] */
    float *sLse0 = reinterpret_cast<float *>(sdS + BN * SS); /* [2][BM], lse * log2(e) */
    float *sDelta0 = sLse0 + 2 * BM;                         /* [2][BM] */

    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int G = p.heads / p.heads_kv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;

    const int kw = warp * 16 * KT; /* first key of this warp in the block */
    KeyBlock kb; /* sequence, mask and the query tiles this block walks (attn_cuda.cuh) */
    if (!enter_key_block<BN>(p, b, n_block, kb))
        return;
    find_query_tiles<D, BN, BM>(p, G, kb);
    const int64_t qs = kb.qs, ks = kb.ks;
    const int sq = kb.sq, sk = kb.sk, n0 = kb.n0, rows_total = kb.rows_total;
    const int off = kb.off, left = kb.left, right = kb.right, dr = kb.dr;
    const int mb_lo = kb.mb_lo, nmb = kb.nmb, steps = kb.steps; /* steps: (head of the group, query tile) pairs */
    const float sl2 = kb.sl2;

    float dk[KT][NO][4], dv[KT][NO][4];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
        zero_frags(dk[kt]);
        zero_frags(dv[kt]);
    }

    /* issue the loads of step `it` into buffer `buf` */
    auto fetch = [&](int it, int buf) {
        const int h = hk * G + it / nmb, m0 = (mb_lo + it % nmb) * BM;
        const int valid_q = min(BM, sq - m0);
        load_tile<T, BM, D, NT>(sQ0 + buf * BM * SD, view_ptr<const T>(p.q, b, qs + m0, h), p.q.ss, valid_q, dr);
        load_tile<T, BM, D, NT>(sdO0 + buf * BM * SD, view_ptr<const T>(p.dout, b, qs + m0, h), p.dout.ss, valid_q,
                                dr);
        cp_async_commit();
        for (int i = threadIdx.x; i < BM; i += NT) {
            const bool ok = i < valid_q;
            sLse0[buf * BM + i] = ok ? p.lse[lse_at(p, b, h, qs + m0 + i)] * kLog2e : INFINITY;
            sDelta0[buf * BM + i] = ok ? p.delta[lse_at(p, b, h, qs + m0 + i)] : 0.f;
        }
    };

    if (steps > 0) {
        load_tile<T, BN, D, NT>(sK, view_ptr<const T>(p.k, b, ks + n0, hk), p.k.ss, min(BN, sk - n0), dr);
        load_tile<T, BN, D, NT>(sV, view_ptr<const T>(p.v, b, ks + n0, hk), p.v.ss, min(BN, sk - n0), dr);
        cp_async_commit();
        fetch(0, 0);
        const int c_lo = n0 + kw + g; /* this thread's keys: c_lo + 16*kt, + 8 */

        for (int it = 0; it < steps; ++it) {
            const int buf = it & 1;
            const int h = hk * G + it / nmb, m0 = (mb_lo + it % nmb) * BM;
            if (it + 1 < steps) {
                fetch(it + 1, buf ^ 1); /* buffer buf^1 was released by the barrier ending step it-1 */
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const T *sQ = sQ0 + buf * BM * SD, *sdO = sdO0 + buf * BM * SD;
            const float *sLse = sLse0 + buf * BM, *sDelta = sDelta0 + buf * BM;

            float st[KT][NS][4], dpt[KT][NS][4];
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                zero_frags(st[kt]);
                zero_frags(dpt[kt]);
            }
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                uint32_t ka[KT][4], va[KT][4];
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) {
                    const int row = kw + kt * 16 + lane % 16, col = kk * 16 + (lane / 16) * 8;
                    ldsm_x4(ka[kt], smem_addr(sK + row * SD + col));
                    ldsm_x4(va[kt], smem_addr(sV + row * SD + col));
                }
#pragma unroll
                for (int j = 0; j < NS / 2; ++j) {
                    uint32_t qb[4], ob[4];
                    const int row = j * 16 + mr + (mi >> 1) * 8, col = kk * 16 + (mi & 1) * 8;
                    ldsm_x4(qb, smem_addr(sQ + row * SD + col));
                    ldsm_x4(ob, smem_addr(sdO + row * SD + col));
#pragma unroll
                    for (int kt = 0; kt < KT; ++kt) {
                        Mma<T>::run(st[kt][2 * j], ka[kt], qb[0], qb[1]);
                        Mma<T>::run(st[kt][2 * j + 1], ka[kt], qb[2], qb[3]);
                        Mma<T>::run(dpt[kt][2 * j], va[kt], ob[0], ob[1]);
                        Mma<T>::run(dpt[kt][2 * j + 1], va[kt], ob[2], ob[3]);
                    }
                }
            }

            const bool need_mask = SF_ATTN_TILE_CROSSES_MASK(m0, BM, n0, BN, sq, sk, off, left, right);
            /* dropout: dP = dropout(dO V^T) and dV takes dropout(P); dS keeps P (see the header) */
            uint32_t keep_bits = 0;
            if constexpr (kDropout)
                keep_bits = keep_cols<KT, NS>(p, (int64_t)b * p.heads + h, n0 + kw, m0, g, t4);
#pragma unroll
            for (int kt = 0; kt < KT; ++kt)
#pragma unroll
                for (int i = 0; i < NS; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int ql = i * 8 + 2 * t4 + (e & 1);
                        const int c = c_lo + kt * 16 + (e >> 1) * 8, r = m0 + ql;
                        const bool ok = !need_mask || SF_ATTN_PAIR_ALLOWED(r, c, sq, sk, off, left, right);
                        const float pv = ok ? fast_exp2(fmaf(st[kt][i][e], sl2, -sLse[ql])) : 0.f;
                        if constexpr (kDropout) {
                            const bool keep = (keep_bits >> ((kt * NS + i) * 4 + e)) & 1u;
                            st[kt][i][e] = keep ? pv * p.drop_scale : 0.f;
                            dpt[kt][i][e] = pv * ((keep ? dpt[kt][i][e] * p.drop_scale : 0.f) - sDelta[ql]);
                        } else {
                            st[kt][i][e] = pv;
                            dpt[kt][i][e] = pv * (dpt[kt][i][e] - sDelta[ql]);
                        }
                    }

#pragma unroll
            for (int kc = 0; kc < BM / 16; ++kc) {
                uint32_t ap[KT][4], as[KT][4];
#pragma unroll
                for (int kt = 0; kt < KT; ++kt) {
                    pack_a<T>(ap[kt], st[kt][2 * kc], st[kt][2 * kc + 1]);
                    pack_a<T>(as[kt], dpt[kt][2 * kc], dpt[kt][2 * kc + 1]);
                }
#pragma unroll
                for (int j = 0; j < D / 16; ++j) {
                    uint32_t ob[4], qb[4];
                    const int row = kc * 16 + mr + (mi & 1) * 8, col = j * 16 + (mi >> 1) * 8;
                    ldsm_x4_t(ob, smem_addr(sdO + row * SD + col));
                    ldsm_x4_t(qb, smem_addr(sQ + row * SD + col));
#pragma unroll
                    for (int kt = 0; kt < KT; ++kt) {
                        Mma<T>::run(dv[kt][2 * j], ap[kt], ob[0], ob[1]);
                        Mma<T>::run(dv[kt][2 * j + 1], ap[kt], ob[2], ob[3]);
                        Mma<T>::run(dk[kt][2 * j], as[kt], qb[0], qb[1]);
                        Mma<T>::run(dk[kt][2 * j + 1], as[kt], qb[2], qb[3]);
                    }
                }
            }

            if (kAtomicDq) {
#pragma unroll
                for (int kt = 0; kt < KT; ++kt)
#pragma unroll
                    for (int i = 0; i < NS; ++i)
#pragma unroll
                        for (int hr = 0; hr < 2; ++hr)
                            *reinterpret_cast<uint32_t *>(sdS + (kw + kt * 16 + g + 8 * hr) * SS + i * 8 + 2 * t4) =
                                Mma<T>::pack(dpt[kt][i][2 * hr], dpt[kt][i][2 * hr + 1]);
                __syncthreads();
                const int qrow = (warp & 1) * 16, dcol = (warp >> 1) * DH;
                if (dcol < D) { /* head dim 16: warps 2 and 3 have no columns */
                    float acc[DH / 8][4];
                    zero_frags(acc);
#pragma unroll
                    for (int kc = 0; kc < BN / 16; ++kc) {
                        uint32_t a[4];
                        ldsm_x4_t(a, smem_addr(sdS + (kc * 16 + mr + (mi >> 1) * 8) * SS + qrow + (mi & 1) * 8));
#pragma unroll
                        for (int j = 0; j < DH / 16; ++j) {
                            uint32_t kb[4];
                            ldsm_x4_t(kb, smem_addr(sK + (kc * 16 + mr + (mi & 1) * 8) * SD + dcol + j * 16 + (mi >> 1) * 8));
                            Mma<T>::run(acc[2 * j], a, kb[0], kb[1]);
                            Mma<T>::run(acc[2 * j + 1], a, kb[2], kb[3]);
                        }
                    }
#pragma unroll
                    for (int hr = 0; hr < 2; ++hr) {
                        const int r = m0 + qrow + g + 8 * hr;
                        if (r >= sq)
                            continue;
                        float *dst = reinterpret_cast<float *>(p.dq_accum.ptr) + (int64_t)b * p.dq_accum.sb +
                                     (qs + r) * p.dq_accum.ss + (int64_t)h * p.dq_accum.sh + dcol + 2 * t4;
#pragma unroll
                        for (int i = 0; i < DH / 8; ++i) {
                            if (dcol + i * 8 >= dr) /* head dim 24: no zero columns */
                                break;
                            atomic_add2(dst + i * 8, acc[i][2 * hr] * p.scale, acc[i][2 * hr + 1] * p.scale);
                        }
                    }
                }
            }
            __syncthreads(); /* the step's buffers, sdS and the key tile reads are done */
        }
    }

#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int c = n0 + kw + kt * 16 + g + 8 * hr;
            if (c >= rows_total)
                continue;
            const bool real = c < sk;
            T *dkrow = view_ptr<T>(p.dk, b, ks + c, hk);
            T *dvrow = view_ptr<T>(p.dv, b, ks + c, hk);
#pragma unroll
            for (int i = 0; i < NO; ++i) {
                if (i * 8 >= dr) /* head dim 24: the zero columns stay unwritten */
                    break;
                *reinterpret_cast<uint32_t *>(dkrow + i * 8 + 2 * t4) = Mma<T>::pack(
                    real ? dk[kt][i][2 * hr] * p.scale : 0.f, real ? dk[kt][i][2 * hr + 1] * p.scale : 0.f);
                *reinterpret_cast<uint32_t *>(dvrow + i * 8 + 2 * t4) =
                    Mma<T>::pack(real ? dv[kt][i][2 * hr] : 0.f, real ? dv[kt][i][2 * hr + 1] : 0.f);
            }
        }
}

/* Deterministic dQ: one block per 64 query rows, keys walked in order. */
template <typename T, int D, bool kDropout>
__global__ void __launch_bounds__(kBackwardThreads) dq_kernel(const sf_attn_problem p)
{
    constexpr int SD = D + 8, BM = kBackwardBM, BN = kBackwardBN, NT = kBackwardThreads;
    constexpr int KD = D / 16, NO = D / 8, NS = BN / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sQ = reinterpret_cast<T *>(smem_raw);
    T *sdO = sQ + BM * SD;
    T *sK = sdO + BM * SD;
    T *sV = sK + BN * SD;

    const int m_block = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.heads / p.heads_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4, mi = lane / 8, mr = lane % 8;

    QueryBlock qb; /* sequence, mask and the key tiles this block walks (attn_cuda.cuh) */
    if (!enter_query_block<BM>(p, b, m_block, qb))
        return;
    find_key_tiles<D, BM, BN>(p, qb);
    const int64_t qs = qb.qs, ks = qb.ks;
    const int sq = qb.sq, sk = qb.sk, m0 = qb.m0, rows_total = qb.rows_total;
    const int off = qb.off, left = qb.left, right = qb.right, dr = qb.dr, nb_lo = qb.nb_lo, nb_hi = qb.nb_hi;
    const float sl2 = qb.sl2;

    float dq[NO][4];
    zero_frags(dq);
    const int r_lo = m0 + warp * 16 + g;

    if (nb_lo < nb_hi) {
        const T *kbase = view_ptr<const T>(p.k, b, ks, hk);
        const T *vbase = view_ptr<const T>(p.v, b, ks, hk);
        load_tile<T, BM, D, NT>(sQ, view_ptr<const T>(p.q, b, qs + m0, h), p.q.ss, min(BM, sq - m0), dr);
        load_tile<T, BM, D, NT>(sdO, view_ptr<const T>(p.dout, b, qs + m0, h), p.dout.ss, min(BM, sq - m0), dr);
        cp_async_commit();
        float lse2[2], dlt[2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = r_lo + 8 * hr;
            lse2[hr] = r < sq ? p.lse[lse_at(p, b, h, qs + r)] * kLog2e : INFINITY;
            dlt[hr] = r < sq ? p.delta[lse_at(p, b, h, qs + r)] : 0.f;
        }
        uint32_t qf[KD][4], of[KD][4];
        for (int nb = nb_lo; nb < nb_hi; ++nb) {
            const int n0 = nb * BN;
            load_tile<T, BN, D, NT>(sK, kbase + (int64_t)n0 * p.k.ss, p.k.ss, min(BN, sk - n0), dr);
            load_tile<T, BN, D, NT>(sV, vbase + (int64_t)n0 * p.v.ss, p.v.ss, min(BN, sk - n0), dr);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            if (nb == nb_lo) {
#pragma unroll
                for (int kk = 0; kk < KD; ++kk) {
                    ldsm_x4(qf[kk], smem_addr(sQ + (warp * 16 + lane % 16) * SD + kk * 16 + (lane / 16) * 8));
                    ldsm_x4(of[kk], smem_addr(sdO + (warp * 16 + lane % 16) * SD + kk * 16 + (lane / 16) * 8));
                }
            }
            float s[NS][4], dp[NS][4];
            zero_frags(s);
            zero_frags(dp);
#pragma unroll
            for (int kk = 0; kk < KD; ++kk)
#pragma unroll
                for (int j = 0; j < NS / 2; ++j) {
                    uint32_t kb[4], vb[4];
                    const int row = j * 16 + mr + (mi >> 1) * 8, col = kk * 16 + (mi & 1) * 8;
                    ldsm_x4(kb, smem_addr(sK + row * SD + col));
                    ldsm_x4(vb, smem_addr(sV + row * SD + col));
                    Mma<T>::run(s[2 * j], qf[kk], kb[0], kb[1]);
                    Mma<T>::run(s[2 * j + 1], qf[kk], kb[2], kb[3]);
                    Mma<T>::run(dp[2 * j], of[kk], vb[0], vb[1]);
                    Mma<T>::run(dp[2 * j + 1], of[kk], vb[2], vb[3]);
                }
            /* SF_ATTN_TILE_CROSSES_MASK with the two sequence-end tests swapped (as the macro, the code changes) */
            const bool need_mask = n0 + BN > sk || m0 + BM > sq ||
                                   (right >= 0 && n0 + BN - 1 > m0 + off + right) ||
                                   (left >= 0 && n0 < m0 + BM - 1 + off - left);
            if constexpr (kDropout) { /* dP = dropout(dO V^T) */
                const auto keep = keep_rows<NS>(p, (int64_t)b * p.heads + h, m0 + warp * 16, n0, g, t4);
#pragma unroll
                for (int i = 0; i < NS; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dp[i][e] = ((keep >> (4 * i + e)) & 1) ? dp[i][e] * p.drop_scale : 0.f;
            }
#pragma unroll
            for (int i = 0; i < NS; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = r_lo + (e >> 1) * 8, c = n0 + i * 8 + 2 * t4 + (e & 1);
                    const bool ok = !need_mask || SF_ATTN_PAIR_ALLOWED(r, c, sq, sk, off, left, right);
                    const float pv = ok ? fast_exp2(fmaf(s[i][e], sl2, -lse2[e >> 1])) : 0.f;
                    s[i][e] = pv * (dp[i][e] - dlt[e >> 1]); /* dS */
                }
#pragma unroll
            for (int kc = 0; kc < BN / 16; ++kc) {
                uint32_t a[4];
                pack_a<T>(a, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
                for (int j = 0; j < D / 16; ++j) {
                    uint32_t kb[4];
                    ldsm_x4_t(kb, smem_addr(sK + (kc * 16 + mr + (mi & 1) * 8) * SD + j * 16 + (mi >> 1) * 8));
                    Mma<T>::run(dq[2 * j], a, kb[0], kb[1]);
                    Mma<T>::run(dq[2 * j + 1], a, kb[2], kb[3]);
                }
            }
            __syncthreads(); /* before the next tile overwrites sK, sV */
        }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = r_lo + 8 * hr;
        if (r >= rows_total)
            continue;
        const bool real = r < sq;
        T *row = view_ptr<T>(p.dq, b, qs + r, h);
#pragma unroll
        for (int i = 0; i < NO; ++i)
            if (i * 8 < dr) /* head dim 24: the zero columns stay unwritten */
                *reinterpret_cast<uint32_t *>(row + i * 8 + 2 * t4) =
                    Mma<T>::pack(real ? dq[i][2 * hr] * p.scale : 0.f, real ? dq[i][2 * hr + 1] * p.scale : 0.f);
    }
}

template <typename T, int D, bool kAtomicDq, bool kDropout>
static sf_status launch_dkdv(const sf_attn_problem &p, int n_blocks_k, cudaStream_t stream)
{
    static const char op[] = "attention_backward";
    constexpr int smem = dkdv_smem_bytes<D>();
    SF_CUDA_TRY(op, allow_smem((const void *)dkdv_kernel<T, D, kAtomicDq, kDropout>, smem));
    dkdv_kernel<T, D, kAtomicDq, kDropout><<<dim3(n_blocks_k, p.heads_kv, p.batch), kBackwardThreads, smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

/* Step 2 of the backward (attn_backward_cuda.cu's top comment) for one dtype T,
 * tile width D and dropout: deterministic, the dK / dV kernel without
 * atomics then the dQ kernel; otherwise the dK / dV kernel adding dQ into
 * the zeroed float32 workspace.  The wgmma pass (attn_backward_sm90_cuda.cu) is
 * the entry's choice, not this. */
template <typename T, int D, bool kDropout> sf_status launch_backward_tiles(const sf_attn_problem &p, cudaStream_t stream)
{
    static const char op[] = "attention_backward";
    const int n_blocks_k = (p.max_sk + DkdvCfg<D>::BN - 1) / DkdvCfg<D>::BN;
    if (!p.deterministic) {
        if (n_blocks_k > 0)
            SF_TRY((launch_dkdv<T, D, true, kDropout>(p, n_blocks_k, stream)));
        return SF_OK;
    }
    if (n_blocks_k > 0)
        SF_TRY((launch_dkdv<T, D, false, kDropout>(p, n_blocks_k, stream)));
    constexpr int smem = dq_smem_bytes<D>();
    SF_CUDA_TRY(op, allow_smem((const void *)dq_kernel<T, D, kDropout>, smem));
    dq_kernel<T, D, kDropout><<<dim3((p.max_sq + kBackwardBM - 1) / kBackwardBM, p.heads, p.batch), kBackwardThreads, smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

} // namespace sf_attn

#endif /* SF_ATTN_BACKWARD_TILES_CUH */
