/*
 * attn_backward_sm90_cuda.cu - the flash-attention backward's main pass on
 * Hopper's wgmma (sm_90a), head dims 64 and 128, bf16 and fp16: dK and dV
 * of a key tile, and dQ added with atomics into the float32 workspace.
 * delta = rowsum(dO o O) before it and the dQ conversion after it are the
 * sm80 backward's kernels (attn_backward_cuda.cu launches all three), so the
 * semantics (masks, windows, GQA, layouts, lse) are the sm80 backward's.
 *
 * A block of two warpgroups owns BN = 128 keys of one key/value head, 64
 * per warpgroup, with K and V in 128-byte swizzled shared memory
 * (attn_sm90.cuh) and dK, dV in float32 registers.  It walks the 64-row
 * query tiles that may see its keys, for every query head of the GQA group
 * (dK, dV of a shared head summed in registers in a fixed order); Q, dO,
 * lse and delta of the next tile are fetched (cp.async) into the other of
 * two buffers while the current one is computed, issued right after the
 * step's first products so the loads run under them; one barrier at the top
 * of a step frees the previous step's buffers and dS^T, one in the middle
 * publishes dS^T.  Per query tile each warpgroup computes
 *   S^T = K Q^T, dP^T = V dO^T         (wgmma m64n64, both operands K-major)
 *   P^T = exp2(S^T scale log2e - lse log2e), masked only on edge tiles,
 *                                      while dP^T is still on the tensor cores
 *   dS^T = P^T o (dP^T - delta)
 *   dV += P^T dO, dK += dS^T Q         (P^T, dS^T from registers; dO, Q MN-major)
 * and stores dS^T [key][query] to shared memory; then both warpgroups
 * compute dQ = dS K for the tile (wgmma with A = dS^T and B = K both
 * MN-major; warpgroup w takes head-dim columns w D/2 ..) and add it to the
 * workspace (red.global.add.v2.f32).  The order of those additions varies
 * run to run, so deterministic calls take the sm80 kernels
 * (backward_sm90_selected says so).
 *
 * Registers (head dim 128): dK and dV 128, S^T and dP^T 64, their packed
 * 16-bit copies 32, under __launch_bounds__(256, 1)'s 255 (ptxas: 255, no
 * spills; 202 at head dim 64).
 *
 * The default backward on Hopper for head dims 64 and 128 (other dims,
 * deterministic and dropout calls take sm80, with the reason logged).  It was
 * confirmed on an H200 on 2026-11-29: check_attn_sm90 --backward (gemm-tt unit
 * checks, then every mask, layout, GQA and length case against the CPU
 * reference and sm80) and the 1570 sm90backward cases of tests/test_attn_sm90_cuda.py
 * passed, and bench_attn.py timed forward+backward at 1.00-1.06x the sm80
 * kernels at head dim 64 and 1.34-1.51x at 128 (16k tokens, seqlen 1k-8k).
 * SEQFUSE_ATTN_BACKWARD_KERNEL=sm80 or sf_attn_set_backward_kernel(80) selects sm80.
 */

#include "../core/cuda_util.h"
#include "attn_sm90.cuh"

namespace sf_attn {
namespace sm90 {

constexpr int kBackwardWgs = 2, kBackwardBN = 64 * kBackwardWgs, kBackwardBM = 64, kBackwardThreads = 128 * kBackwardWgs;

/* K, V (BN x D), two buffers of Q and dO (BM x D), dS^T (BN x BM), then
 * lse and delta (two buffers of BM floats each); + 1024 for the alignment
 * of the tiles to the swizzle's 1024-byte period. */
template <int D> constexpr int backward_smem_bytes()
{
    return 1024 + (2 * kBackwardBN * D + 4 * kBackwardBM * D + kBackwardBN * kBackwardBM) * 2 + 4 * kBackwardBM * 4;
}

template <typename T, int D>
__global__ void __launch_bounds__(kBackwardThreads, 1) backward_sm90_kernel(const sf_attn_problem p)
{
#ifdef SF_SM90A
    constexpr int BN = kBackwardBN, BM = kBackwardBM, NT = kBackwardThreads;
    constexpr int NO = D / 2;       /* dK, dV registers: m64nD */
    constexpr int NS = BM / 2;      /* S^T, dP^T registers: m64n64 */
    constexpr int DQN = D / kBackwardWgs; /* dQ columns per warpgroup */
    constexpr int KVBYTES = BN * D * 2, QBYTES = BM * D * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw = smem_addr(smem_raw);
    const uint32_t sK = (raw + 1023u) & ~1023u;
    const uint32_t sV = sK + KVBYTES;
    const uint32_t sQ0 = sV + KVBYTES;       /* buffer i at sQ0 + i * QBYTES */
    const uint32_t sdO0 = sQ0 + 2 * QBYTES;  /* buffer i at sdO0 + i * QBYTES */
    const uint32_t sdS = sdO0 + 2 * QBYTES;  /* dS^T [BN keys][BM queries] */
    unsigned char *const gen = smem_raw + (sK - raw); /* generic pointer to sK */
    float *const sLse0 = reinterpret_cast<float *>(gen + (sdS + BN * BM * 2 - sK)); /* [2][BM], lse * log2(e) */
    float *const sDelta0 = sLse0 + 2 * BM;                                          /* [2][BM] */

    const int n_block = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int G = p.heads / p.heads_kv;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, g = (tid % 32) / 4, q4 = tid % 4;

    const int n0 = n_block * BN;
    KeyBlockPlan kp;
    if (!plan_key_block(p, b, n0, BN, BM, G, kp))
        return;
    const int64_t qs = kp.qs, ks = kp.ks;
    const int sq = kp.sq, sk = kp.sk, off = kp.off, left = p.window_left, right = p.window_right;
    const float sl2 = p.scale * kLog2e;

    /* this thread's keys in the block (accumulator rows): krow, krow + 8 */
    const int krow = wg * 64 + warp * 16 + g;
    float dk[NO], dv[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i)
        dk[i] = dv[i] = 0.f;

    /* issue the loads of step `it` into buffer `buf` */
    auto fetch = [&](int it, int buf) {
        const int h = hk * G + it / kp.nmb, m0 = (kp.mb_lo + it % kp.nmb) * BM;
        const int valid_q = min(BM, sq - m0);
        load_tile_sw128<T, BM, D, NT>(sQ0 + buf * QBYTES, view_ptr<const T>(p.q, b, qs + m0, h), p.q.ss, valid_q, tid);
        load_tile_sw128<T, BM, D, NT>(sdO0 + buf * QBYTES, view_ptr<const T>(p.dout, b, qs + m0, h), p.dout.ss,
                                      valid_q, tid);
        cp_async_commit();
        load_lse_delta(p, b, h, qs + m0, valid_q, BM, NT, sLse0 + buf * BM, sDelta0 + buf * BM);
    };

    if (kp.steps > 0) {
        const int valid_k = min(BN, sk - n0);
        load_tile_sw128<T, BN, D, NT>(sK, view_ptr<const T>(p.k, b, ks + n0, hk), p.k.ss, valid_k, tid);
        load_tile_sw128<T, BN, D, NT>(sV, view_ptr<const T>(p.v, b, ks + n0, hk), p.v.ss, valid_k, tid);
        cp_async_commit();
        fetch(0, 0);

        for (int it = 0; it < kp.steps; ++it) {
            const int buf = it & 1;
            const int h = hk * G + it / kp.nmb, m0 = (kp.mb_lo + it % kp.nmb) * BM;
            cp_async_wait<0>();  /* this step's Q and dO, issued during the previous step */
            fence_proxy_async(); /* cp.async wrote through the generic proxy; wgmma reads the async one */
            __syncthreads();     /* ... visible to all; and every thread is past step it-1, so its
                                  * buffers (refilled below) and dS^T (rewritten below) are free */
            const uint32_t sQ = sQ0 + buf * QBYTES, sdO = sdO0 + buf * QBYTES;
            /* K and V's addresses made opaque per step: otherwise their
             * loop-invariant descriptors are hoisted and held in registers
             * (head dim 128 then spills) */
            uint32_t sKs = sK, sVs = sV;
            asm volatile("" : "+r"(sKs), "+r"(sVs));
            const float *sLse = sLse0 + buf * BM, *sDelta = sDelta0 + buf * BM;

            /* S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys */
            float st[NS], dpt[NS];
            wg_pin(st);
            wg_pin(dpt);
            wg_fence();
            mma_ss_kmajor<T, BM, BN, BM, D>(st, sKs, wg * 64, sQ);
            wg_commit();
            mma_ss_kmajor<T, BM, BN, BM, D>(dpt, sVs, wg * 64, sdO);
            wg_commit();
            if (it + 1 < kp.steps) /* the next step's loads, under the products */
                fetch(it + 1, buf ^ 1);
            wg_wait<1>(); /* S^T; dP^T may still run while P^T is computed */
            wg_pin(st);

            /* P^T and dS^T in place; register 4j + e: key krow + 8 (e >> 1), query 8j + 2 q4 + (e & 1) */
            const bool need_mask = tile_crosses_mask(m0, BM, n0, BN, sq, sk, off, left, right);
#pragma unroll
            for (int i = 0; i < NS; ++i) {
                const int ql = (i >> 2) * 8 + 2 * q4 + (i & 1);
                const int c = n0 + krow + ((i >> 1) & 1) * 8, r = m0 + ql;
                const bool ok = !need_mask || SF_ATTN_PAIR_ALLOWED(r, c, sq, sk, off, left, right);
                st[i] = ok ? fast_exp2(fmaf(st[i], sl2, -sLse[ql])) : 0.f;
            }
            wg_pin(st);
            wg_wait<0>(); /* dP^T */
            wg_pin(dpt);
#pragma unroll
            for (int i = 0; i < NS; ++i)
                dpt[i] = st[i] * (dpt[i] - sDelta[(i >> 2) * 8 + 2 * q4 + (i & 1)]);
            uint32_t pa[NS / 8][4], da[NS / 8][4];
            pack_acc<T>(pa, st);
            pack_acc<T>(da, dpt);

            /* dS^T to shared memory for dQ: pair e of k step kc is key
             * krow + 8 (e & 1), queries 16 kc + 8 (e >> 1) + 2 q4 .. + 1 */
#pragma unroll
            for (int kc = 0; kc < NS / 8; ++kc)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    *reinterpret_cast<uint32_t *>(gen + (sdS - sK) +
                                                  sw128_at<BN>(krow + 8 * (e & 1), 16 * kc + 8 * (e >> 1) + 2 * q4)) =
                        da[kc][e];
            fence_proxy_async(); /* the st.shared above, before wgmma reads dS^T */

            /* dV += P^T dO, dK += dS^T Q */
            wg_pin(dv);
            wg_pin(dk);
            wg_fence();
#pragma unroll
            for (int kc = 0; kc < BM / 16; ++kc)
                Wgmma<T, D>::rs(dv, pa[kc], desc_mnmajor<BM>(sdO, kc), 1);
#pragma unroll
            for (int kc = 0; kc < BM / 16; ++kc)
                Wgmma<T, D>::rs(dk, da[kc], desc_mnmajor<BM>(sQ, kc), 1);
            wg_commit();
            __syncthreads(); /* dS^T of both warpgroups is in shared memory */

            /* dQ (BM x DQN columns from wg * DQN) = dS K: A = dS^T [key][query] and
             * B = K [key][dim] are both MN-major, the keys being the reduction */
            float dq[DQN / 2];
            issue_tt<T, DQN, BN>(dq, sdS, sKs, wg * DQN);
            wg_wait<0>(); /* dV, dK and dQ of the step */
            wg_pin(dv);
            wg_pin(dk);
            wg_pin(dq);
            /* register 4j + e: query 16 warp + g + 8 (e >> 1), column wg DQN + 8j + 2 q4 + (e & 1) */
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const int r = m0 + warp * 16 + g + 8 * hr;
                if (r >= sq)
                    continue;
                float *dst = reinterpret_cast<float *>(p.dq_accum.ptr) + (int64_t)b * p.dq_accum.sb +
                             (qs + r) * p.dq_accum.ss + (int64_t)h * p.dq_accum.sh + wg * DQN + 2 * q4;
#pragma unroll
                for (int j = 0; j < DQN / 8; ++j)
                    atomic_add2(dst + 8 * j, dq[4 * j + 2 * hr] * p.scale, dq[4 * j + 2 * hr + 1] * p.scale);
            }
        }
    }

    /* dK (times the softmax scale) and dV; rows past the sequence end get zeros */
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int c = n0 + krow + 8 * hr;
        if (c >= kp.rows_total)
            continue;
        const bool real = c < sk;
        T *dkrow = view_ptr<T>(p.dk, b, ks + c, hk) + 2 * q4;
        T *dvrow = view_ptr<T>(p.dv, b, ks + c, hk) + 2 * q4;
#pragma unroll
        for (int j = 0; j < NO / 4; ++j) {
            *reinterpret_cast<uint32_t *>(dkrow + 8 * j) =
                Mma<T>::pack(real ? dk[4 * j + 2 * hr] * p.scale : 0.f, real ? dk[4 * j + 2 * hr + 1] * p.scale : 0.f);
            *reinterpret_cast<uint32_t *>(dvrow + 8 * j) =
                Mma<T>::pack(real ? dv[4 * j + 2 * hr] : 0.f, real ? dv[4 * j + 2 * hr + 1] : 0.f);
        }
    }
#else
    /* not an sm_90a build: the host never launches this (pick_kernel checks
     * the forward's build marker, which the same build flags set alike) */
    __trap();
#endif
}

template <typename T, int D> static sf_status launch(const sf_attn_problem &p, cudaStream_t stream)
{
    constexpr int smem = backward_smem_bytes<D>();
    static_assert(smem <= 232448, "more shared memory than a Hopper block may have");
    SF_CUDA_TRY("attention_backward", allow_smem((const void *)backward_sm90_kernel<T, D>, smem));
    const dim3 grid((p.max_sk + kBackwardBN - 1) / kBackwardBN, p.heads_kv, p.batch);
    if (grid.x == 0)
        return SF_OK;
    backward_sm90_kernel<T, D><<<grid, kBackwardThreads, smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("attention_backward");
    return SF_OK;
}

/* The backward kernel chosen for Hopper: 90 (this file's, the default; see
 * the top of this file) or 80 (sf_attn_set_backward_kernel; Python's
 * set_attention_backward_kernel and SEQFUSE_ATTN_BACKWARD_KERNEL, which seqfuse.ops
 * reads, end there). */
static int g_backward_kernel = 90;

static int backward_selected(int head_dim, int deterministic, int dropout, int device, const char **why)
{
    const char *w = "";
    int ok = pick_kernel(g_backward_kernel,
                         "sm80 backward chosen (SEQFUSE_ATTN_BACKWARD_KERNEL=sm80 or sf_attn_set_backward_kernel(80))",
                         head_dim, device, &w);
    if (ok && deterministic) {
        ok = 0;
        w = "deterministic backward: the wgmma kernel adds dQ with atomics, so the sm80 kernels run";
    }
    if (why)
        *why = w;
    return pick_kernel_no_dropout(ok, dropout, why);
}

} // namespace sm90

int backward_sm90_selected(const sf_attn_problem &p, int device, const char **why)
{
    return sm90::backward_selected(p.head_dim, p.deterministic, p.dropout, device, why);
}

sf_status launch_backward_sm90(const sf_attn_problem &p, cudaStream_t stream)
{
    return with_sm90_shape("attention_backward", p, [&](auto t, auto w) {
        return sm90::launch<decltype(t), decltype(w)::value>(p, stream);
    });
}

} // namespace sf_attn

extern "C" sf_status sf_attn_set_backward_kernel(int arch)
{
    return sf_attn::sm90::set_kernel_choice("attention_backward", arch, &sf_attn::sm90::g_backward_kernel);
}

extern "C" int sf_attn_backward_kernel_for(int head_dim, int deterministic, int dropout, int device, const char **why)
{
    return sf_attn::sm90::backward_selected(head_dim, deterministic, dropout, device, why) ? 90 : 80;
}
