/*
 * attn_forward_sm90_workbench.cuh - the wgmma forward's other schedules, for the
 * check programs only.  attn_forward_sm90_cuda.cu includes this file where
 * SF_WORKBENCH is defined (csrc/build_checks.sh compiles the kernels that
 * way); the library (setup.py) never defines it, so it compiles only the
 * schedule forward_schedule() picks.
 *
 * Schedules, each a complete forward (same masks, layouts, lse):
 *  0  two K/V stages, in order (forward_sm90_kernel, PIPE = 0);
 *  1  three K/V stages, the softmax of tile n + 1 issued beside
 *     O += P(n) V(n) (PIPE = 1);
 *  2  1 warp-specialized: a producer warpgroup feeds the consumers through
 *     an mbarrier K/V pipeline (forward_sm90_ws_kernel, no ping-pong);
 *  3  2 with the two consumer warpgroups in ping-pong;
 *  4  3 with three consumer warpgroups (192 rows) at head dim 64, 3 itself
 *     at 128: the library's schedule (forward_schedule).
 * check_attn_sm90 runs every schedule against the CPU reference and times
 * them (its part (d)); sf_attn_set_forward_sm90_schedule (attn_sm90.h, checks
 * only) picks one for the process, -1 going back to the library's.
 */
#ifndef SF_ATTN_FORWARD_SM90_WORKBENCH_CUH
#define SF_ATTN_FORWARD_SM90_WORKBENCH_CUH

#ifndef SF_WORKBENCH
#error "attn_forward_sm90_workbench.cuh is for the check programs: build with -DSF_WORKBENCH=1 (csrc/build_checks.sh)"
#endif

namespace sf_attn {
namespace sm90 {

/* Schedules 0 and 1: a block of two warpgroups, 64 query rows each. */
constexpr int kWarpgroups = 2, kBM = 64 * kWarpgroups, kThreads = 128 * kWarpgroups;

/* Schedule 0 and 1's copy of K and V tile nb, by all of the block's threads. */
template <typename T, int D>
__device__ __forceinline__ void load_kv(const sf_attn_problem &p, const BlockPlan &bp, const T *kbase,
                                        const T *vbase, uint32_t kt, uint32_t vt, int nb, int tid)
{
    const int n0 = nb * kBN, valid = min(kBN, bp.sk - n0);
    load_tile_sw128<T, kBN, D, kThreads>(kt, kbase + (int64_t)n0 * p.k.ss, p.k.ss, valid, tid);
    load_tile_sw128<T, kBN, D, kThreads>(vt, vbase + (int64_t)n0 * p.v.ss, p.v.ss, valid, tid);
}

/* Schedules 0 and 1 (PIPE), two warpgroups of 64 rows, no producer:
 *  0  two K/V stages; per tile: S = Q K^T, wait, softmax, O += P V, wait.
 *  1  three K/V stages, tile n+2 loading while tile n is consumed; per tile
 *     S(n+1) = Q K(n+1)^T and O += P(n) V(n) are issued together and the
 *     softmax of tile n+1 is meant to run while O += P(n) V(n) is still on
 *     the tensor cores (FlashAttention-3's intra-warpgroup overlap); O is
 *     rescaled once that product has landed.  ptxas 13.0 keeps only the
 *     masking and row max ahead of the wait for P(n) V(n) (it moves the
 *     wait above the in-place exponentials); writing P to separate
 *     registers instead made it serialize every wgmma (C7513). */
template <int PIPE> constexpr int kStages = PIPE ? 3 : 2;

template <int D, int PIPE> constexpr int smem_bytes()
{
    /* + 1024: the tiles are placed at the next 1024-byte boundary */
    return 1024 + (kBM + 2 * kStages<PIPE> * kBN) * D * 2;
}

template <typename T, int D, int PIPE>
__global__ void __launch_bounds__(kThreads, 1) forward_sm90_kernel(const sf_attn_problem p)
{
#ifdef SF_SM90A
    constexpr int NO = D / 2, ST = kStages<PIPE>;
    constexpr int QBYTES = kBM * D * 2, KVBYTES = kBN * D * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t sK = sQ + QBYTES;         /* stage s at sK + s * KVBYTES */
    const uint32_t sV = sK + ST * KVBYTES;   /* stage s at sV + s * KVBYTES */

    const int h = blockIdx.y, b = blockIdx.z;
    BlockPlan bp;
    if (!plan_block<kBM>(p, b, gridDim.x - 1 - blockIdx.x, bp)) /* heavy causal blocks first */
        return;
    const int hk = h / (p.heads / p.heads_kv);
    const int left = p.window_left, right = p.window_right;
    const float sl2 = p.scale * kLog2e;
    const int tid = threadIdx.x, wg = tid / 128;
    const int q4 = tid % 4;
    const int wrow = wg * 64 + (tid % 128) / 32 * 16 + (tid % 32) / 4; /* first row in the block; +8 the second */
    const int r0 = bp.m0 + wrow;

    const T *qbase = view_ptr<const T>(p.q, b, bp.qs + bp.m0, h);
    const T *kbase = view_ptr<const T>(p.k, b, bp.ks, hk);
    const T *vbase = view_ptr<const T>(p.v, b, bp.ks, hk);

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i)
        o[i] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f}, corr[2];
    const int lo = bp.nb_lo, hi = bp.nb_hi;

    if (lo < hi) {
        load_tile_sw128<T, kBM, D, kThreads>(sQ, qbase, p.q.ss, min(kBM, bp.sq - bp.m0), tid);
        load_kv<T, D>(p, bp, kbase, vbase, sK, sV, lo, tid);
        cp_async_commit();
        float s[kBN / 2];
        uint32_t pa[kBN / 16][4];
        if constexpr (PIPE == 0) {
            for (int nb = lo; nb < hi; ++nb) {
                const uint32_t cur = ((nb - lo) & 1) * KVBYTES;
                if (nb + 1 < hi) { /* next tile into the other stage, freed by the last barrier */
                    load_kv<T, D>(p, bp, kbase, vbase, sK + (KVBYTES - cur), sV + (KVBYTES - cur), nb + 1, tid);
                    cp_async_commit();
                    cp_async_wait<1>();
                } else {
                    cp_async_wait<0>();
                }
                fence_proxy_async(); /* cp.async wrote through the generic proxy; wgmma reads the async one */
                __syncthreads();
                issue_qk<T, D, kBM>(s, sQ, sK + cur, wg);
                wg_wait<0>();
                wg_pin(s);
                mask_tile<kBM>(s, bp, nb * kBN, r0, q4, left, right);
                softmax_tile(s, mrow, lrow, sl2, corr);
                rescale_o(o, corr);
                pack_acc<T>(pa, s);
                issue_pv<T, D>(o, pa, sV + cur);
                wg_wait<0>();
                wg_pin(o);
                __syncthreads(); /* every warpgroup is done with this stage before it is refilled */
            }
        } else {
            if (lo + 1 < hi) {
                load_kv<T, D>(p, bp, kbase, vbase, sK + KVBYTES, sV + KVBYTES, lo + 1, tid);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            fence_proxy_async();
            __syncthreads();
            issue_qk<T, D, kBM>(s, sQ, sK, wg);
            wg_wait<0>();
            wg_pin(s);
            mask_tile<kBM>(s, bp, lo * kBN, r0, q4, left, right);
            softmax_tile(s, mrow, lrow, sl2, corr); /* O is still zero: no rescale */
            pack_acc<T>(pa, s);
            for (int nb = lo; nb + 1 < hi; ++nb) { /* every step but the last: S(nb + 1) and P(nb) V(nb) together */
                const int i = nb - lo;
                cp_async_wait<0>(); /* tile nb + 1 */
                fence_proxy_async();
                __syncthreads(); /* tile nb + 1 visible; everyone is past tile nb - 1, its stage is free */
                if (nb + 2 < hi) {
                    const uint32_t fr = ((i + 2) % ST) * KVBYTES;
                    load_kv<T, D>(p, bp, kbase, vbase, sK + fr, sV + fr, nb + 2, tid);
                    cp_async_commit();
                }
                issue_qk<T, D, kBM>(s, sQ, sK + ((i + 1) % ST) * KVBYTES, wg);
                issue_pv<T, D>(o, pa, sV + (i % ST) * KVBYTES);
                wg_wait<1>(); /* S of tile nb + 1; P(nb) V(nb) may still run */
                wg_pin(s);
                mask_tile<kBM>(s, bp, (nb + 1) * kBN, r0, q4, left, right);
                softmax_tile(s, mrow, lrow, sl2, corr);
                wg_pin(s);
                wg_wait<0>(); /* note: ptxas 13.0 hoists this above the exponentials (SASS), so only the
                               * max and the mask overlap P(nb) V(nb) so far; see the report */
                wg_pin(o);
                rescale_o(o, corr);
                pack_acc<T>(pa, s); /* the registers of P(nb) are free now */
            }
            issue_pv<T, D>(o, pa, sV + ((hi - 1 - lo) % ST) * KVBYTES); /* the last tile */
            wg_wait<0>();
            wg_pin(o);
        }
    }

    store_rows<T>(p, bp, b, h, r0, q4, o, mrow, lrow, sl2);
#else
    SF_SM90_NOT_BUILT();
#endif
}

template <typename T, int D, int PIPE> static sf_status launch(const sf_attn_problem &p, cudaStream_t stream)
{
    constexpr int smem = smem_bytes<D, PIPE>();
    SF_CUDA_TRY("attention_forward", allow_smem((const void *)forward_sm90_kernel<T, D, PIPE>, smem));
    dim3 grid((p.max_sq + kBM - 1) / kBM, p.heads, p.batch);
    forward_sm90_kernel<T, D, PIPE><<<grid, kThreads, smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("attention_forward");
    return SF_OK;
}

/* -1: the library's schedule (forward_schedule), else 0 to 4 (the list above). */
static int g_schedule = -1;
constexpr int kSchedules = 5;

template <typename T, int D> static sf_status launch_schedule(int schedule, const sf_attn_problem &p,
                                                              cudaStream_t stream)
{
    switch (schedule) {
    case 0: return launch<T, D, 0>(p, stream);
    case 1: return launch<T, D, 1>(p, stream);
    case 2: return launch_ws<T, D, false>(p, stream);
    case 3: return launch_ws<T, D, true>(p, stream);
    default: return launch_chosen<T, D>(p, stream); /* 4 (and -1): the library's */
    }
}

} // namespace sm90
} // namespace sf_attn

extern "C" sf_status sf_attn_set_forward_sm90_schedule(int schedule)
{
    if (schedule < -1 || schedule >= sf_attn::sm90::kSchedules)
        return sf_fail(SF_ERR_VALUE, "attention_forward: sm90 schedule must be -1 (the library's) or 0 to 4, got %d",
                       schedule);
    sf_attn::sm90::g_schedule = schedule;
    return SF_OK;
}

#endif /* SF_ATTN_FORWARD_SM90_WORKBENCH_CUH */
