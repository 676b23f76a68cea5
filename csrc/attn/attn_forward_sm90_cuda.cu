/*
 * attn_forward_sm90_cuda.cu - the flash-attention forward on Hopper's wgmma
 * (sm_90a), head dims 64 and 128, everything the mma.sync forward
 * (attn_forward_cuda.cu) supports: layouts through the problem's strides and
 * cu_seqlens, every mask and window, GQA/MQA, the same lse for the backward.
 *
 * One block owns the query rows of one (sequence, head): a producer
 * warpgroup copies Q once and K and V tiles of BN = 128 keys through three
 * shared-memory stages (cp.async completing on mbarriers), and NC consumer
 * warpgroups of 64 rows each take them.  Per tile a consumer computes
 * S = Q K^T (wgmma m64n128k16, A and B K-major from the 128-byte swizzled
 * tiles, attn_sm90.cuh), masks only tiles that cross a boundary, runs the
 * online softmax in base 2 on the accumulator registers, packs P to 16-bit
 * pairs in registers and accumulates O += P V (wgmma m64nDk16, A from
 * registers, V MN-major); S of the next tile is issued together with P V
 * of this one, and the consumers take turns on the tensor cores
 * (ping-pong), so one's softmax runs under the other's products.
 * Epilogue: O / l and lse = ln(sum exp(scale * s)) (float32, natural log),
 * exactly as the sm80 forward writes them.
 *
 * The schedule is forward_schedule(head dim): three consumers (192 rows) at
 * head dim 64, where the exponentials weigh as much as the products, two
 * (128 rows) at 128, where three would not hold S, P and O in registers.
 * The other schedules measured against it live in
 * attn_forward_sm90_workbench.cuh and build into the check programs only
 * (SF_WORKBENCH).  Whether a call takes this kernel or the sm80 one is
 * forward_sm90_selected (the kernel choice 90 or 80, sf_attn_set_forward_kernel,
 * default 90; the device; the head dim; dropout).
 */
#include <mutex> /* std::call_once: device_ok */

#include "../core/cuda_util.h"
#include "attn_sm90.cuh"

namespace sf_attn {
namespace sm90 {

constexpr int kBN = 128; /* keys per K/V tile */

/* Where one block stands: its sequence, rows and the key tiles they see. */
struct BlockPlan {
    int64_t qs, ks;         /* first token of the sequence in q / k views */
    int sq, sk, rows_total; /* lengths; rows the view owns for this sequence */
    int m0, off, nb_lo, nb_hi;
};

template <int BM>
__device__ __forceinline__ bool plan_block(const sf_attn_problem &p, int b, int m_block, BlockPlan &bp)
{
    sf_attn_seq_q(&p, b, &bp.qs, &bp.sq);
    sf_attn_seq_k(&p, b, &bp.ks, &bp.sk);
    bp.m0 = m_block * BM;
    bp.rows_total = p.thd ? bp.sq : p.max_sq;
    if (bp.m0 >= bp.rows_total)
        return false;
    bp.off = sf_attn_diag(&p, bp.sq, bp.sk);
    int lo = 0, hi = 0;
    if (bp.m0 < bp.sq)
        sf_attn_key_range(bp.m0, min(bp.m0 + BM, bp.sq) - 1, bp.off, p.window_left, p.window_right, bp.sk, &lo,
                          &hi);
    bp.nb_lo = lo / kBN;
    bp.nb_hi = (hi + kBN - 1) / kBN;
    return true;
}

/* Epilogue of a thread's two rows r0, r0 + 8: O / l and lse.  Rows past the
 * view's rows are not ours; padded rows and rows that saw no key get zeros
 * and lse = +inf.  Every schedule ends here. */
template <typename T, int NO>
__device__ __forceinline__ void store_rows(const sf_attn_problem &p, const BlockPlan &bp, int b, int h, int r0,
                                           int q4, const float (&o)[NO], const float mrow[2], const float lrow[2],
                                           float sl2)
{
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = r0 + hr * 8;
        const float l = quad_sum(lrow[hr]);
        if (r >= bp.rows_total)
            continue;
        const bool seen = r < bp.sq && !(l <= 0.f); /* a NaN l (NaN score) stays NaN */
        const float inv = seen ? 1.f / l : 0.f;
        T *dst = view_ptr<T>(p.o, b, bp.qs + r, h) + 2 * q4;
#pragma unroll
        for (int j = 0; j < NO / 4; ++j)
            *reinterpret_cast<uint32_t *>(dst + 8 * j) =
                Mma<T>::pack(o[4 * j + 2 * hr] * inv, o[4 * j + 2 * hr + 1] * inv);
        if (q4 == 0)
            p.lse[lse_at(p, b, h, bp.qs + r)] = seen ? (mrow[hr] * sl2 + log2f(l)) * kLn2 : INFINITY;
    }
}

/* ---- the steps of one key tile, shared by every schedule ---- */

/* Masks the scores of key tile n0 where the tile crosses the sequence end or
 * the window (other tiles are wholly inside).  r0: the thread's first row. */
template <int BM>
__device__ __forceinline__ void mask_tile(float (&s)[kBN / 2], const BlockPlan &bp, int n0, int r0, int q4, int left,
                                          int right)
{
    const bool edge = n0 + kBN > bp.sk || (right >= 0 && n0 + kBN - 1 > bp.m0 + bp.off + right) ||
                      (left >= 0 && n0 < bp.m0 + BM - 1 + bp.off - left);
    if (!edge)
        return;
#pragma unroll
    for (int i = 0; i < kBN / 2; ++i) {
        const int r = r0 + ((i >> 1) & 1) * 8;
        const int c = n0 + (i >> 2) * 8 + 2 * q4 + (i & 1);
        if (c >= bp.sk || !sf_attn_allowed(r, c, bp.off, left, right))
            s[i] = -INFINITY;
    }
}

/* Online softmax of one tile in base 2: s becomes exp2(s*sl2 - max*sl2),
 * the running max and sum move on, corr[hr] is the factor for O's row hr.
 * Registers 4j + 2hr + {0,1} hold row hr; a quad shares the rows. */
__device__ __forceinline__ void softmax_tile(float (&s)[kBN / 2], float (&mrow)[2], float (&lrow)[2], float sl2,
                                             float (&corr)[2])
{
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        float mx = mrow[hr];
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j)
            mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]));
        mx = quad_max(mx);
        const float shift = mx == -INFINITY ? 0.f : mx * sl2;
        corr[hr] = fast_exp2(mrow[hr] * sl2 - shift); /* 0 while the old max is -inf */
        mrow[hr] = mx;
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float &x = s[4 * j + 2 * hr + e];
                x = fast_exp2(fmaf(x, sl2, -shift));
                acc += x;
            }
        lrow[hr] = lrow[hr] * corr[hr] + acc;
    }
}

template <int NO> __device__ __forceinline__ void rescale_o(float (&o)[NO], const float (&corr)[2])
{
#pragma unroll
    for (int j = 0; j < NO / 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            o[4 * j + e] *= corr[e >> 1];
}

#ifdef SF_SM90A
/* S = Q K^T for this warpgroup's 64 rows, issued and committed (not waited). */
template <typename T, int D, int BM>
__device__ __forceinline__ void issue_qk(float (&s)[kBN / 2], uint32_t sQ, uint32_t kt, int wg)
{
    issue_ss<T, kBN, BM, D>(s, sQ, wg * 64, kt); /* scale_d = 0 on the first step: no register writes to zero s */
}

/* O += P V, issued and committed (not waited). */
template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[kBN / 16][4], uint32_t vt)
{
    issue_rs<T, D, kBN>(o, pa, vt);
}
#endif

/* ---- the warp-specialized kernel ----
 *
 * NC + 1 warpgroups: warpgroup 0 is the producer, 1 .. NC the consumers
 * (64 query rows each).  The producer drops to few registers
 * (setmaxnreg.dec) and copies Q once and the K/V tiles through kWsStages
 * shared-memory stages with cp.async; each thread's copies complete on the
 * stage's "full" mbarrier (cp.async.mbarrier.arrive.noinc, 128 arrivals).
 * The consumers take the registers freed (setmaxnreg.inc), wait on "full",
 * issue S(n+1) = Q K(n+1)^T together with O += P(n) V(n), run the softmax
 * of tile n + 1 and, once P(n) V(n) has landed, arrive on the stage's
 * "empty" mbarrier (128 NC arrivals) so the producer refills it.  No
 * __syncthreads after the split: a consumer waits neither for the others
 * nor for the loads of a tile it does not need yet.
 * With PINGPONG, named barriers 1 .. NC hand the tensor cores from one
 * consumer to the next (round-robin): a consumer issues its two products
 * only after the previous one has issued its own, and its softmax runs while
 * the other's products are on the tensor cores (FlashAttention-3's
 * inter-warpgroup overlap).  The library runs PINGPONG with NC from
 * forward_schedule; the workbench (attn_forward_sm90_workbench.cuh) also runs it
 * without ping-pong.
 */
constexpr int kWsStages = 3;
/* NC consumer warpgroups of 64 rows: 2, or 3 at head dim 64 (forward_schedule) */
template <int NC> constexpr int ws_threads() { return 128 * (NC + 1); }
/* registers: 128 * 40 + 256 * 232 <= 65536; 128 * 32 + 384 * 160 = 65536 (at 3 consumers the producer
 * spills a few 64-bit addresses at 32; consumers at 152 made ptxas serialize the wgmma, C7512) */
template <int NC> constexpr int ws_producer_regs() { return NC == 2 ? 40 : 32; }
template <int NC> constexpr int ws_consumer_regs() { return NC == 2 ? 232 : 160; }

template <int D, int NC> constexpr int ws_smem_bytes()
{
    /* Q, kWsStages K and V tiles, then 2 * kWsStages + 1 mbarriers (8 bytes each) */
    return 1024 + (64 * NC + 2 * kWsStages * kBN) * D * 2 + (2 * kWsStages + 1) * 8;
}

#ifdef SF_SM90A
__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
/* Returns once the phase of parity `parity` has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n"
                 ".reg .pred P1;\n"
                 "LAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\n"
                 "bra LAB_WAIT;\n"
                 "DONE:\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* One arrival on `bar` once all of this thread's earlier cp.async have landed
 * (the barrier's count includes it: .noinc). */
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int count)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
#endif

template <typename T, int D, bool PINGPONG, int NC>
__global__ void __launch_bounds__(ws_threads<NC>(), 1) forward_sm90_ws_kernel(const sf_attn_problem p)
{
#ifdef SF_SM90A
    constexpr int NO = D / 2, ST = kWsStages, BM = 64 * NC;
    constexpr int QBYTES = BM * D * 2, KVBYTES = kBN * D * 2;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sQ = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const uint32_t sK = sQ + QBYTES;       /* stage s at sK + s * KVBYTES */
    const uint32_t sV = sK + ST * KVBYTES; /* stage s at sV + s * KVBYTES */
    const uint32_t bFull = sV + ST * KVBYTES, bEmpty = bFull + ST * 8, bQ = bEmpty + ST * 8;

    const int h = blockIdx.y, b = blockIdx.z;
    BlockPlan bp;
    if (!plan_block<BM>(p, b, gridDim.x - 1 - blockIdx.x, bp)) /* heavy causal blocks first */
        return;
    const int lo = bp.nb_lo, hi = bp.nb_hi;
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < ST; ++s) {
            mbar_init(bFull + s * 8, 128);
            mbar_init(bEmpty + s * 8, 128 * NC);
        }
        mbar_init(bQ, 128);
    }
    __syncthreads(); /* the barriers are initialized; the last block-wide barrier */

    if (wg == 0) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(ws_producer_regs<NC>()));
        if (lo < hi) {
            const int hk = h / (p.heads / p.heads_kv);
            const T *kbase = view_ptr<const T>(p.k, b, bp.ks, hk);
            const T *vbase = view_ptr<const T>(p.v, b, bp.ks, hk);
            load_tile_sw128<T, BM, D, 128>(sQ, view_ptr<const T>(p.q, b, bp.qs + bp.m0, h), p.q.ss,
                                           min(BM, bp.sq - bp.m0), tid);
            cp_async_mbar_arrive(bQ);
            for (int nb = lo; nb < hi; ++nb) {
                const int i = nb - lo, s = i % ST;
                if (i >= ST) /* the consumers released this stage's previous tile, i - ST */
                    mbar_wait(bEmpty + s * 8, ((i / ST) & 1) ^ 1);
                const int n0 = nb * kBN, valid = min(kBN, bp.sk - n0);
                load_tile_sw128<T, kBN, D, 128>(sK + s * KVBYTES, kbase + (int64_t)n0 * p.k.ss, p.k.ss, valid, tid);
                load_tile_sw128<T, kBN, D, 128>(sV + s * KVBYTES, vbase + (int64_t)n0 * p.v.ss, p.v.ss, valid, tid);
                cp_async_mbar_arrive(bFull + s * 8);
            }
            cp_async_wait<0>(); /* leave no copy in flight behind an exited thread */
        }
    } else { /* consumers */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(ws_consumer_regs<NC>()));
        const int cw = wg - 1, ct = tid - 128; /* consumer index, thread in the consumers */
        const int left = p.window_left, right = p.window_right;
        const float sl2 = p.scale * kLog2e;
        const int q4 = tid % 4;
        const int wrow = cw * 64 + (ct % 128) / 32 * 16 + (ct % 32) / 4; /* first row in the block; +8 the second */
        const int r0 = bp.m0 + wrow;
        /* ping-pong: barrier 1 + c is "consumer c may issue", handed on round-robin
         * (0 -> 1 [-> 2] -> 0); the last consumer lets consumer 0 go first */
        const int my_turn = 1 + cw, their_turn = 1 + (cw + 1) % NC;

        float o[NO];
#pragma unroll
        for (int i = 0; i < NO; ++i)
            o[i] = 0.f;
        float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f}, corr[2];
        if (lo < hi) {
            float s[kBN / 2];
            uint32_t pa[kBN / 16][4];
            if (PINGPONG && cw == NC - 1)
                named_arrive(1, 256);
            mbar_wait(bQ, 0);
            mbar_wait(bFull, 0);
            fence_proxy_async(); /* cp.async wrote through the generic proxy; wgmma reads the async one */
            if (PINGPONG)
                named_sync(my_turn, 256);
            issue_qk<T, D, BM>(s, sQ, sK, cw);
            if (PINGPONG)
                named_arrive(their_turn, 256);
            wg_wait<0>();
            wg_pin(s);
            mask_tile<BM>(s, bp, lo * kBN, r0, q4, left, right);
            softmax_tile(s, mrow, lrow, sl2, corr); /* O is still zero: no rescale */
            pack_acc<T>(pa, s);
            for (int nb = lo; nb + 1 < hi; ++nb) { /* S(nb + 1) and P(nb) V(nb) together */
                const int i = nb - lo, sn = (i + 1) % ST, sc = i % ST;
                mbar_wait(bFull + sn * 8, ((i + 1) / ST) & 1);
                fence_proxy_async();
                if (PINGPONG)
                    named_sync(my_turn, 256);
                issue_qk<T, D, BM>(s, sQ, sK + sn * KVBYTES, cw);
                issue_pv<T, D>(o, pa, sV + sc * KVBYTES);
                if (PINGPONG)
                    named_arrive(their_turn, 256);
                wg_wait<1>(); /* S of tile nb + 1; P(nb) V(nb) may still run */
                wg_pin(s);
                mask_tile<BM>(s, bp, (nb + 1) * kBN, r0, q4, left, right);
                softmax_tile(s, mrow, lrow, sl2, corr);
                wg_pin(s);
                wg_wait<0>(); /* ptxas hoists this above the exponentials as in schedule 1 (forcing the
                               * order with a block boundary made it serialize every wgmma, C7512) */
                wg_pin(o);
                mbar_arrive(bEmpty + sc * 8); /* tile nb's stage is free */
                rescale_o(o, corr);
                pack_acc<T>(pa, s);
            }
            if (PINGPONG)
                named_sync(my_turn, 256);
            issue_pv<T, D>(o, pa, sV + ((hi - 1 - lo) % ST) * KVBYTES); /* the last tile */
            if (PINGPONG && cw != NC - 1) /* the last consumer issues last: nobody waits for its turn to end */
                named_arrive(their_turn, 256);
            wg_wait<0>();
            wg_pin(o);
        }

        store_rows<T>(p, bp, b, h, r0, q4, o, mrow, lrow, sl2);
    }
#else
    SF_SM90_NOT_BUILT();
#endif
}

template <typename T, int D, bool PINGPONG, int NC = 2>
static sf_status launch_ws(const sf_attn_problem &p, cudaStream_t stream)
{
    constexpr int smem = ws_smem_bytes<D, NC>(), BM = 64 * NC;
    static_assert(smem <= 232448, "more shared memory than a Hopper block may have");
    SF_CUDA_TRY("attention_forward", allow_smem((const void *)forward_sm90_ws_kernel<T, D, PINGPONG, NC>, smem));
    dim3 grid((p.max_sq + BM - 1) / BM, p.heads, p.batch);
    forward_sm90_ws_kernel<T, D, PINGPONG, NC><<<grid, ws_threads<NC>(), smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("attention_forward");
    return SF_OK;
}

/* The library's schedule, a function of the head dim: the warp-specialized
 * kernel with ping-pong consumers, three of them (192 rows) at head dim 64,
 * two (128 rows) at 128.  It was the fastest of the five schedules
 * check_attn_sm90 times, or within 2 % of it, at every shape it measures
 * (benchmarks/results and the README hold the figures). */
struct ForwardSchedule {
    bool pingpong;
    int consumers;
};
constexpr ForwardSchedule forward_schedule(int head_dim) { return {true, head_dim == 64 ? 3 : 2}; }

template <typename T, int D> static sf_status launch_chosen(const sf_attn_problem &p, cudaStream_t stream)
{
    constexpr ForwardSchedule s = forward_schedule(D);
    return launch_ws<T, D, s.pingpong, s.consumers>(p, stream);
}

} // namespace sm90
} // namespace sf_attn

#ifdef SF_WORKBENCH
#include "attn_forward_sm90_workbench.cuh"
#endif

namespace sf_attn {
namespace sm90 {

/* The forward kernel chosen for Hopper: 90 (this file's, the default) or
 * 80 (sf_attn_set_forward_kernel; Python's set_attention_forward_kernel and
 * SEQFUSE_ATTN_FORWARD_KERNEL, which seqfuse.ops reads, end there). */
static int g_kernel = 90;

/* Per device, found once (std::call_once: any host thread may ask first):
 * 1 where the wgmma kernel runs there, else 0 with the reason (empty where
 * the device is not Hopper: the sm80 kernel is the one for it). */
constexpr int kMaxDevices = 64;
static int g_device_ok[kMaxDevices];
static const char *g_device_why[kMaxDevices];
static std::once_flag g_device_once[kMaxDevices];

static void find_device_ok(int device)
{
    constexpr ForwardSchedule s = forward_schedule(64);
    const void *kernel = (const void *)forward_sm90_ws_kernel<__nv_bfloat16, 64, s.pingpong, s.consumers>;
    const sf_sm90_fit fit = sf_sm90_kernel_fit(device, kernel);
    g_device_ok[device] = fit == SF_SM90_RUNS;
    switch (fit) {
    case SF_SM90_NO_DEVICE: g_device_why[device] = "the device could not be made current"; break;
    case SF_SM90_CC_UNREADABLE: g_device_why[device] = "compute capability unreadable"; break;
    case SF_SM90_NOT_BUILT_FOR:
        g_device_why[device] = "library not built for sm_90a (SEQFUSE_CUDA_ARCHS lacks 90a)";
        break;
    case SF_SM90_RUNS:
    case SF_SM90_NOT_HOPPER: /* (runs, or not Hopper: the sm80 kernel is its one, no reason to give) */
        g_device_why[device] = "";
        break;
    }
}

static int device_ok(int device, const char **why)
{
    if (device < 0 || device >= kMaxDevices) {
        *why = "device index beyond the kernel-choice table";
        return 0;
    }
    std::call_once(g_device_once[device], find_device_ok, device);
    *why = g_device_why[device];
    return g_device_ok[device];
}

int pick_kernel(int choice, const char *not_chosen, int head_dim, int device, const char **why)
{
    const char *w = "";
    int ok = device_ok(device, &w); /* "" where the device is not Hopper: 80 is its kernel, no reason to give */
    if (ok && choice != 90) {
        ok = 0;
        w = not_chosen;
    } else if (ok && head_dim != 64 && head_dim != 128) {
        ok = 0;
        w = "the wgmma kernel takes head dims 64 and 128 only";
    }
    if (why)
        *why = w;
    return ok;
}

int pick_kernel_no_dropout(int ok, int dropout, const char **why)
{
    if (ok && dropout) {
        if (why)
            *why = "attention dropout: the wgmma kernels have no dropout yet, the sm80 kernels apply it";
        return 0;
    }
    return ok;
}

static int selected(int head_dim, int dropout, int device, const char **why)
{
    const int ok = pick_kernel(g_kernel,
                               "sm80 kernel chosen (SEQFUSE_ATTN_FORWARD_KERNEL=sm80 or sf_attn_set_forward_kernel(80))",
                               head_dim, device, why);
    return pick_kernel_no_dropout(ok, dropout, why);
}

} // namespace sm90

int forward_sm90_selected(const sf_attn_problem &p, int device, const char **why)
{
    return sm90::selected(p.head_dim, p.dropout, device, why);
}

sf_status launch_forward_sm90(const sf_attn_problem &p, cudaStream_t stream)
{
#ifdef SF_WORKBENCH
    if (sm90::g_schedule >= 0)
        return with_sm90_shape("attention_forward", p, [&](auto t, auto w) {
            return sm90::launch_schedule<decltype(t), decltype(w)::value>(sm90::g_schedule, p, stream);
        });
#endif
    return with_sm90_shape("attention_forward", p, [&](auto t, auto w) {
        return sm90::launch_chosen<decltype(t), decltype(w)::value>(p, stream);
    });
}

} // namespace sf_attn

sf_status sf_attn::sm90::set_kernel_choice(const char *op, int arch, int *choice)
{
    if (arch != 80 && arch != 90)
        return sf_fail(SF_ERR_VALUE, "%s: kernel must be 80 or 90, got %d", op, arch);
    *choice = arch;
    return SF_OK;
}

extern "C" sf_status sf_attn_set_forward_kernel(int arch)
{
    return sf_attn::sm90::set_kernel_choice("attention_forward", arch, &sf_attn::sm90::g_kernel);
}

extern "C" int sf_attn_forward_kernel_for(int head_dim, int dropout, int device, const char **why)
{
    return sf_attn::sm90::selected(head_dim, dropout, device, why) ? 90 : 80;
}
