/*
 * check_attn_sm90.cu - standalone check of the Hopper (wgmma) attention
 * forward, in stages, so that a failure points at the layer that is wrong:
 *
 *  (a) gemm-ss: one block of two warpgroups computes C = A B^T with
 *      wgmma m64nNk16 (N = 64, 128), A (128 x 128) and B (N x 128) both
 *      K-major in 128-byte swizzled shared memory - the S = Q K^T step,
 *      with the kernel's own tile layout, descriptors and fences.
 *  (b) gemm-rs: C = A B with A from registers (accumulator layout) and B
 *      (128 x N) MN-major ("transpose B") - the O += P V step.
 *      (a) and (b) use small integers, so fp32 sums are exact: any mismatch
 *      is a layout/descriptor bug, and the per-quadrant mismatch counts say
 *      which part (column block >= 64: leading byte offset / second column
 *      block; rows >= 64: the second warpgroup's row offset; everything:
 *      swizzle or descriptor encoding).
 *  (c) the attention forward (sf_attn_forward with the sm90 kernel selected)
 *      against the CPU reference and the sm80 kernel: head dims 64/128,
 *      bf16/fp16, bshd/sbhd/thd, masks, windows, GQA, lengths that are and
 *      are not multiples of 128.  lse right but out wrong points at P V;
 *      lse wrong at S = Q K^T, the mask or the softmax.
 *  (d) speed: TFLOP/s of the sm90 forward (every schedule: v0 in order,
 *      v1 softmax overlapped with P V, v2 = v1 warp-specialized with a
 *      producer warpgroup and an mbarrier K/V pipeline, v3 = v2 with the
 *      two consumer warpgroups in ping-pong, v4 = v3 with three consumer
 *      warpgroups, 192 rows, at head dim 64: the library's) and the sm80
 *      forward at 16k tokens per batch, seqlens 1024/4096/8192, head dims
 *      64/128, causal and not; "best" names the fastest sm90 schedule.
 *  (c) runs every sm90 schedule too (lines "sm90v0" .. "sm90v4").
 * Schedules other than the library's exist only in this program's build:
 * csrc/build_checks.sh compiles the kernels with SF_WORKBENCH
 * (attn_forward_sm90_workbench.cuh, sf_attn_set_forward_sm90_schedule).
 *
 * The wgmma backward (attn_backward_sm90_cuda.cu):
 *  (a') gemm-tt: C = A B with A and B both MN-major in shared memory
 *      (A given as A^T), each of two warpgroups taking N = 32 or 64 of the
 *      columns - the dQ = dS K step with dS^T [key][query] and K [key][dim].
 *  (e) the backward (sf_attn_backward with the sm90 kernel selected) against the
 *      CPU reference and the sm80 backward, both given the reference's out
 *      and lse, outputs poisoned (NaN): dq, dk, dv relative errors, head
 *      dims 64/128, bf16/fp16, lengths 1..513 around the 64-row / 128-key
 *      tiles, every mask, windows, GQA 4:1 and MQA, bshd/sbhd/thd with
 *      uneven cu_seqlens; also that deterministic calls take sm80.
 *  (f) speed: TFLOP/s of the sm90 and sm80 backward (delta + main pass +
 *      dQ conversion, 2.5x the forward's flops) at the (d) shapes.
 *
 * Run: bash csrc/build_checks.sh && bin/check_attn_attn_sm90 [--forward | --backward] [--no-bench]
 * (--forward: forward parts only, --backward: backward parts only.)
 */
#ifndef SF_WORKBENCH
#error "check_attn_sm90 picks the forward's schedules: build it with -DSF_WORKBENCH=1 (csrc/build_checks.sh)"
#endif
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"
#include "attn/attn_sm90.cuh"

using namespace sf_attn;
using namespace sf_attn::sm90;

/* ---------- (a), (b): single wgmma GEMM tiles ---------- */

constexpr int GM = 128, GK = 128; /* two warpgroups x 64 rows, reduction 128 (two column blocks) */

/* The block copies a ROWS x COLS row-major matrix from global memory into a
 * 128-byte-swizzled shared-memory tile of ROWS rows (the wgmma operand
 * layout, sw128_at) starting at tile. */
template <typename T, int ROWS, int COLS> __device__ void stage_sw128(unsigned char *tile, const T *src)
{
    for (int i = threadIdx.x; i < ROWS * COLS; i += blockDim.x)
        *reinterpret_cast<T *>(tile + sw128_at<ROWS>(i / COLS, i % COLS)) = src[i];
}

/* Waits for the warpgroup's committed wgmma, then writes its m64nN float32
 * accumulator d into C (row stride ldc) at rows [row0, row0 + 64) and
 * columns [col0, col0 + N): thread t of the warpgroup holds rows
 * t/32*16 + (t%32)/4 and 8 below, columns 2(t%4) + 8j and the next; d[i] is
 * row +8 when bit 1 of i is set, column pair i/4, element i&1. */
template <int N> __device__ void wait_store_acc(float *C, int ldc, int row0, int col0, float (&d)[N / 2])
{
#ifdef SF_SM90A
    wg_wait<0>();
    wg_pin(d);
#endif
    const int t = threadIdx.x % 128;
    const int row = row0 + t / 32 * 16 + (t % 32) / 4, col = col0 + 2 * (t % 4);
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        C[(row + ((i >> 1) & 1) * 8) * ldc + (i >> 2) * 8 + col + (i & 1)] = d[i];
}

/* C[m][n] = sum_k A[m][k] B[n][k]: A [GM][GK], B [N][GK] row-major in global. */
template <typename T, int N> __global__ void gemm_ss_kernel(const T *A, const T *B, float *C)
{
#ifdef SF_SM90A
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sA = (smem_addr(smem_raw) + 1023u) & ~1023u, sB = sA + GM * GK * 2;
    unsigned char *gen = smem_raw + (sA - smem_addr(smem_raw));
    stage_sw128<T, GM, GK>(gen, A);
    stage_sw128<T, N, GK>(gen + GM * GK * 2, B);
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128;
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        d[i] = -1.f; /* scale_d = 0 on the first step must discard this */
    issue_ss<T, N, GM, GK>(d, sA, wg * 64, sB);
    wait_store_acc<N>(C, N, wg * 64, 0, d);
#endif
}

/* C[m][n] = sum_k A[m][k] B[k][n]: A [GM][GK] row-major (to registers),
 * B [GK][N] row-major = MN-major. */
template <typename T, int N> __global__ void gemm_rs_kernel(const T *A, const T *B, float *C)
{
#ifdef SF_SM90A
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sB = (smem_addr(smem_raw) + 1023u) & ~1023u;
    unsigned char *gen = smem_raw + (sB - smem_addr(smem_raw));
    stage_sw128<T, GK, N>(gen, B);
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const int row = wg * 64 + t / 32 * 16 + (t % 32) / 4, col = 2 * (t % 4);
    uint32_t a[GK / 16][4];
#pragma unroll
    for (int kc = 0; kc < GK / 16; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e) { /* e: (row +8 if e odd, k +8 if e >= 2) */
            const T *src = A + (row + (e & 1) * 8) * GK + kc * 16 + (e >> 1) * 8 + col;
            a[kc][e] = Mma<T>::pack(float(src[0]), float(src[1]));
        }
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        d[i] = 0.f;
    issue_rs<T, N, GK>(d, a, sB);
    wait_store_acc<N>(C, N, wg * 64, 0, d);
#endif
}

/* C[m][n] = sum_k A[m][k] B[k][n + wg N] for warpgroup wg's N columns, A
 * given as A^T [GK][64] and B as [GK][2N], both MN-major in shared memory:
 * the backward's dQ = dS K (dS^T [key][query], K [key][dim], the head dim
 * split between two warpgroups: N = 32 starts mid column block). */
template <typename T, int N> __global__ void gemm_tt_kernel(const T *At, const T *B, float *C)
{
#ifdef SF_SM90A
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sA = (smem_addr(smem_raw) + 1023u) & ~1023u, sB = sA + GK * 64 * 2;
    unsigned char *gen = smem_raw + (sA - smem_addr(smem_raw));
    stage_sw128<T, GK, 64>(gen, At);
    stage_sw128<T, GK, 2 * N>(gen + GK * 64 * 2, B);
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128;
    float d[N / 2];
    issue_tt<T, N, GK>(d, sA, sB, wg * N);
    wait_store_acc<N>(C, 2 * N, 0, wg * N, d);
#endif
}

static uint16_t to16(sf_dtype dt, float x) { return dt == SF_BFLOAT16 ? sf_f32_to_bf16(x) : sf_f32_to_f16(x); }
static float from16(sf_dtype dt, uint16_t x) { return dt == SF_BFLOAT16 ? sf_bf16_to_f32(x) : sf_f16_to_f32(x); }

/* mode 0: gemm-ss, 1: gemm-rs, 2: gemm-tt (see the kernels). */
template <typename T, int N> static void check_gemm(sf_dtype dt, int mode)
{
    const bool rs = mode == 1, tt = mode == 2;
    const int M = tt ? 64 : GM, NC = tt ? 2 * N : N; /* C is M x NC */
    std::vector<uint16_t> a(M * GK), bm(NC * GK);
    std::vector<float> af(a.size()), bf(bm.size());
    for (size_t i = 0; i < a.size(); ++i) { af[i] = (float)((int)(rng_next() % 9) - 4); a[i] = to16(dt, af[i]); }
    for (size_t i = 0; i < bm.size(); ++i) { bf[i] = (float)((int)(rng_next() % 9) - 4); bm[i] = to16(dt, bf[i]); }
    std::vector<float> ref(M * NC);
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < NC; ++n) {
            double s = 0;
            for (int k = 0; k < GK; ++k)
                s += (double)(tt ? af[k * M + m] : af[m * GK + k]) * (rs || tt ? bf[k * NC + n] : bf[n * GK + k]);
            ref[m * NC + n] = (float)s;
        }
    T *dA, *dB;
    float *dC;
    CHECK_CUDA(cudaMalloc(&dA, a.size() * 2));
    CHECK_CUDA(cudaMalloc(&dB, bm.size() * 2));
    CHECK_CUDA(cudaMalloc(&dC, ref.size() * 4));
    CHECK_CUDA(cudaMemcpy(dA, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dB, bm.data(), bm.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dC, 0xff, ref.size() * 4));
    const int smem = 1024 + (GM * GK + 2 * N * GK) * 2;
    if (tt) {
        CHECK_CUDA(cudaFuncSetAttribute(gemm_tt_kernel<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        gemm_tt_kernel<T, N><<<1, 256, smem>>>(dA, dB, dC);
    } else if (rs) {
        CHECK_CUDA(cudaFuncSetAttribute(gemm_rs_kernel<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        gemm_rs_kernel<T, N><<<1, 256, smem>>>(dA, dB, dC);
    } else {
        CHECK_CUDA(cudaFuncSetAttribute(gemm_ss_kernel<T, N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        gemm_ss_kernel<T, N><<<1, 256, smem>>>(dA, dB, dC);
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<float> got(ref.size());
    CHECK_CUDA(cudaMemcpy(got.data(), dC, got.size() * 4, cudaMemcpyDeviceToHost));
    cudaFree(dA); cudaFree(dB); cudaFree(dC);

    /* quadrants: rows >= 64 (ss, rs: the second warpgroup) and columns >= 64
     * (ss, rs: the second column block; tt: the second warpgroup's columns) */
    const int half_c = tt ? N : 64;
    int bad = 0, first = -1, quad[2][2] = {{0, 0}, {0, 0}};
    for (int i = 0; i < M * NC; ++i)
        if (!(got[i] == ref[i])) {
            if (first < 0) first = i;
            ++bad;
            quad[i / NC >= 64][i % NC >= half_c]++;
        }
    char what[400];
    snprintf(what, sizeof what, "(%s) gemm-%s %s m%dn%dk128 (%s A, %s B): %d of %d wrong", tt ? "a'" : rs ? "b" : "a",
             tt ? "tt" : rs ? "rs" : "ss", sf_dtype_name(dt), tt ? 64 : GM, N,
             tt ? "MN-major smem" : rs ? "register" : "K-major smem", rs || tt ? "MN-major" : "K-major", bad, M * NC);
    printf("%s %s\n", bad ? "FAIL" : "PASS", what);
    g_checks++;
    if (bad) {
        g_failures++;
        printf("    first wrong C[%d][%d]: expected %g got %g\n", first / NC, first % NC, ref[first], got[first]);
        printf("    wrong by quadrant: rows<64 cols<%d %d, rows<64 cols>=%d %d, rows>=64 cols<%d %d, rows>=64 cols>=%d %d\n",
               half_c, quad[0][0], half_c, quad[0][1], half_c, quad[1][0], half_c, quad[1][1]);
        for (int r : {0, 1, 8, 64})
            for (int pass = 0; pass < 2 && r < M; ++pass) {
                printf("    row %3d %s:", r, pass ? "got" : "exp");
                for (int c = 0; c < 12; ++c)
                    printf(" %6g", (pass ? got : ref)[r * NC + c]);
                printf("\n");
            }
    }
}

/* ---------- (c): the attention forward ---------- */

constexpr int kCheckSchedules = 5; /* sm90 schedules 0..4 (attn_forward_sm90_workbench.cuh; 4 is the library's) */

struct Dev {
    void *p = nullptr;
    size_t n = 0;
    explicit Dev(size_t bytes) : n(bytes) { CHECK_CUDA(cudaMalloc(&p, bytes ? bytes : 16)); }
    ~Dev() { cudaFree(p); }
    void put(const void *h) { CHECK_CUDA(cudaMemcpy(p, h, n, cudaMemcpyHostToDevice)); }
    void get(void *h) { CHECK_CUDA(cudaMemcpy(h, p, n, cudaMemcpyDeviceToHost)); }
};

struct AttnCase {
    sf_attn_format fmt;
    sf_attn_mask mask;
    int b, sq, sk, h, hk, d;
    sf_dtype dt;
    int left, right;
};

static const char *fmt_name(sf_attn_format f) { return f == SF_ATTN_BSHD ? "bshd" : f == SF_ATTN_SBHD ? "sbhd" : "thd"; }

static void dims(sf_attn_format f, int b, int s, int h, int d, int64_t tokens, int *nd, int64_t *sh)
{
    if (f == SF_ATTN_THD) { *nd = 3; sh[0] = tokens; sh[1] = h; sh[2] = d; }
    else if (f == SF_ATTN_BSHD) { *nd = 4; sh[0] = b; sh[1] = s; sh[2] = h; sh[3] = d; }
    else { *nd = 4; sh[0] = s; sh[1] = b; sh[2] = h; sh[3] = d; }
}

/* PASS/FAIL of one sm90 schedule against the CPU reference, the sm80 kernel's error beside it. */
static void compare_attn(const AttnCase &c, int schedule, int64_t nq, int64_t nl, const std::vector<uint16_t> &ref_o,
                         const std::vector<float> &ref_l, const std::vector<uint16_t> &o80,
                         const std::vector<float> &l80, const std::vector<uint16_t> &o90,
                         const std::vector<float> &l90)
{
    /* out: relative L2 error and the first element off by more than 8 ulps-ish */
    const double tol = c.dt == SF_BFLOAT16 ? 2e-2 : 4e-3, elt = c.dt == SF_BFLOAT16 ? 3e-2 : 6e-3;
    double num = 0, den = 0, num80 = 0;
    int64_t first = -1, nan = 0;
    for (int64_t i = 0; i < nq; ++i) {
        const float x = from16(c.dt, o90[i]), r = from16(c.dt, ref_o[i]), y = from16(c.dt, o80[i]);
        if (x != x) { ++nan; if (first < 0) first = i; continue; }
        num += (double)(x - r) * (x - r); den += (double)r * r; num80 += (double)(y - r) * (y - r);
        if (first < 0 && fabs(x - r) > elt * (1 + fabs(r))) first = i;
    }
    const double e90 = den > 0 ? sqrt(num / den) : sqrt(num), e80 = den > 0 ? sqrt(num80 / den) : sqrt(num80);
    double el = 0;
    int64_t lfirst = -1;
    for (int64_t i = 0; i < nl; ++i) {
        const float a = l90[i], r = ref_l[i];
        const bool bad = (isinf(r) || isinf(a)) ? a != r : !(fabs(a - r) <= 2e-3);
        if (!isinf(r) && !isinf(a) && a == a) el = fmax(el, fabs(a - r));
        if (bad && lfirst < 0) lfirst = i;
    }
    const bool ok = nan == 0 && e90 <= tol && lfirst < 0;
    printf("%s (c) attn sm90v%d %s %s d=%d mask=%d b=%d sq=%d sk=%d h=%d hk=%d win=(%d,%d): out rel %.2e (sm80 %.2e)%s, "
           "lse max abs %.2e%s\n",
           ok ? "PASS" : "FAIL", schedule, sf_dtype_name(c.dt), fmt_name(c.fmt), c.d, (int)c.mask, c.b, c.sq, c.sk, c.h, c.hk,
           c.left, c.right, e90, e80, nan ? " NaN" : "", el, lfirst >= 0 ? " lse WRONG" : "");
    g_checks++;
    if (ok)
        return;
    g_failures++;
    printf("    hint: %s\n", lfirst >= 0 ? "lse wrong: S = Q K^T (gemm-ss / K tile), the mask or the online softmax"
                                         : "lse right, out wrong: O += P V (gemm-rs / V tile / P packing) or the epilogue");
    if (first >= 0) {
        /* element index -> (token-ish row, head, dim) in the q view's shape */
        const int64_t d = first % c.d, hh = (first / c.d) % c.h, rest = first / c.d / c.h;
        printf("    first wrong out element %lld (outer %lld, head %lld, dim %lld): expected %g got %g (sm80 %g)\n",
               (long long)first, (long long)rest, (long long)hh, (long long)d, from16(c.dt, ref_o[first]),
               from16(c.dt, o90[first]), from16(c.dt, o80[first]));
        const int64_t row0 = first - d;
        for (int pass = 0; pass < 3; ++pass) {
            printf("    that row %s:", pass == 0 ? "exp " : pass == 1 ? "sm90" : "sm80");
            for (int j = 0; j < 10 && j < c.d; ++j)
                printf(" %8.4f", from16(c.dt, (pass == 0 ? ref_o : pass == 1 ? o90 : o80)[row0 + j]));
            printf("\n");
        }
    }
    if (lfirst >= 0)
        printf("    first wrong lse %lld: expected %g got %g (sm80 %g)\n", (long long)lfirst, ref_l[lfirst],
               l90[lfirst], l80[lfirst]);
}

/* A case's host side: lengths (cu_seqlens for padding masks and thd, the
 * first sequence full, the others random), shapes, random q, k, v, the
 * config, and host tensor views; shared by the forward and backward checks. */
struct AttnSetup {
    bool thd, pad;
    std::vector<int32_t> cuq{0}, cuk{0};
    int nd = 4, ndl;
    int64_t shq[4], shk[4], shl[3], nq = 1, nk = 1, nl = 1, ncu;
    std::vector<uint16_t> hq, hk, hv;
    sf_attn_config cfg;

    explicit AttnSetup(const AttnCase &c)
    {
        thd = c.fmt == SF_ATTN_THD;
        pad = thd || c.mask == SF_ATTN_PADDING || c.mask == SF_ATTN_PADDING_CAUSAL ||
              c.mask == SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT;
        int maxq = c.sq, maxk = c.sk;
        if (pad) {
            maxq = maxk = 0;
            for (int i = 0; i < c.b; ++i) {
                const int lq = i == 0 ? c.sq : (int)(rng_next() % (c.sq + 1));
                const int lk = i == 0 ? c.sk : 1 + (int)(rng_next() % c.sk);
                cuq.push_back(cuq.back() + lq);
                cuk.push_back(cuk.back() + lk);
                maxq = std::max(maxq, lq);
                maxk = std::max(maxk, lk);
            }
        }
        const int64_t tq = thd ? cuq.back() + 5 : 0, tk = thd ? cuk.back() + 3 : 0; /* thd: a tail past the end */
        ndl = thd ? 2 : 3;
        dims(c.fmt, c.b, c.sq, c.h, c.d, tq, &nd, shq);
        dims(c.fmt, c.b, c.sk, c.hk, c.d, tk, &nd, shk);
        if (thd) { shl[0] = c.h; shl[1] = tq; } else { shl[0] = c.b; shl[1] = c.h; shl[2] = c.sq; }
        for (int i = 0; i < nd; ++i) { nq *= shq[i]; nk *= shk[i]; }
        for (int i = 0; i < ndl; ++i) nl *= shl[i];
        ncu = (int64_t)cuq.size();
        hq.resize(nq); hk.resize(nk); hv.resize(nk);
        for (auto *v : {&hq, &hk, &hv})
            for (auto &x : *v) x = to16(c.dt, rng_normal());
        memset(&cfg, 0, sizeof cfg);
        cfg.format = c.fmt; cfg.mask = c.mask; cfg.window_left = c.left; cfg.window_right = c.right;
        cfg.softmax_scale = 1.0f / sqrtf((float)c.d);
        cfg.max_seqlen_q = thd ? maxq : 0;
        cfg.max_seqlen_kv = thd ? maxk : 0;
    }
    /* a q-shaped (q = true) or k-shaped view, or the lse-shaped one (float32) */
    sf_tensor view(void *p, sf_dtype dt, int which, bool cuda) const
    {
        sf_tensor t;
        sf_tensor_init(&t, p, dt, which == 2 ? ndl : nd, which == 0 ? shq : which == 1 ? shk : shl,
                       cuda ? SF_CUDA : SF_CPU, 0);
        return t;
    }
    sf_tensor cu(const void *p, bool cuda) const
    {
        sf_tensor t;
        sf_tensor_init(&t, (void *)p, SF_INT32, 1, &ncu, cuda ? SF_CUDA : SF_CPU, 0);
        return t;
    }
};
enum { kQ = 0, kK = 1, kL = 2 }; /* AttnSetup::view's shapes */

static void check_attn_case(const AttnCase &c)
{
    const AttnSetup su(c);
    const bool pad = su.pad;
    const int64_t nq = su.nq, nk = su.nk, nl = su.nl, ncu = su.ncu;
    const sf_attn_config cfg = su.cfg;
    std::vector<uint16_t> ref_o(nq), o80(nq), o90(nq);
    std::vector<float> ref_l(nl), l80(nl), l90(nl);
    sf_tensor q = su.view((void *)su.hq.data(), c.dt, kQ, false), k = su.view((void *)su.hk.data(), c.dt, kK, false),
              v = su.view((void *)su.hv.data(), c.dt, kK, false), o = su.view(ref_o.data(), c.dt, kQ, false),
              l = su.view(ref_l.data(), SF_FLOAT32, kL, false), cq = su.cu(su.cuq.data(), false),
              ck = su.cu(su.cuk.data(), false);
    CHECK_SF(sf_attn_forward(&q, &k, &v, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &o, &l, NULL));

    Dev dq(nq * 2), dk(nk * 2), dv(nk * 2), dout(nq * 2), dl(nl * 4), dcq(ncu * 4), dck(ncu * 4);
    dq.put(su.hq.data()); dk.put(su.hk.data()); dv.put(su.hv.data()); dcq.put(su.cuq.data()); dck.put(su.cuk.data());
    q = su.view(dq.p, c.dt, kQ, true); k = su.view(dk.p, c.dt, kK, true); v = su.view(dv.p, c.dt, kK, true);
    o = su.view(dout.p, c.dt, kQ, true); l = su.view(dl.p, SF_FLOAT32, kL, true);
    cq = su.cu(dcq.p, true); ck = su.cu(dck.p, true);
    auto run = [&](int arch, int schedule, std::vector<uint16_t> &oh, std::vector<float> &lh) {
        CHECK_SF(sf_attn_set_forward_kernel(arch));
        CHECK_SF(sf_attn_set_forward_sm90_schedule(schedule));
        CHECK_CUDA(cudaMemset(dout.p, 0xff, dout.n));
        CHECK_CUDA(cudaMemset(dl.p, 0xff, dl.n));
        CHECK_SF(sf_attn_forward(&q, &k, &v, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &o, &l, NULL));
        CHECK_CUDA(cudaDeviceSynchronize());
        dout.get(oh.data());
        dl.get(lh.data());
    };
    run(80, 0, o80, l80);
    for (int schedule = 0; schedule < kCheckSchedules; ++schedule) {
        run(90, schedule, o90, l90);
        compare_attn(c, schedule, nq, nl, ref_o, ref_l, o80, l80, o90, l90);
    }
    CHECK_SF(sf_attn_set_forward_kernel(80));
    CHECK_SF(sf_attn_set_forward_sm90_schedule(-1));
}

/* The cases the forward (c) and backward (e) checks share, per head dim
 * and dtype: tile multiples and not, every mask, GQA, MQA, the three
 * layouts, windows, many tiles. */
static std::vector<AttnCase> common_cases(int d, sf_dtype dt)
{
    return {
        {SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 128, 128, 1, 1, d, dt, -1, -1}, /* one tile */
        {SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 256, 384, 2, 2, d, dt, -1, -1},
        {SF_ATTN_BSHD, SF_ATTN_CAUSAL, 2, 256, 256, 2, 2, d, dt, -1, -1},
        {SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 77, 150, 4, 2, d, dt, -1, -1},  /* not multiples, GQA */
        {SF_ATTN_BSHD, SF_ATTN_CAUSAL, 2, 300, 300, 2, 1, d, dt, -1, -1},  /* MQA */
        {SF_ATTN_BSHD, SF_ATTN_PADDING, 3, 200, 260, 2, 2, d, dt, -1, -1},
        {SF_ATTN_BSHD, SF_ATTN_CAUSAL_BOTTOM_RIGHT, 2, 100, 230, 2, 2, d, dt, -1, -1},
        {SF_ATTN_SBHD, SF_ATTN_PADDING_CAUSAL, 3, 200, 65, 3, 1, d, dt, -1, -1},
        {SF_ATTN_THD, SF_ATTN_PADDING, 4, 300, 300, 4, 4, d, dt, -1, -1},
        {SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL, 5, 257, 257, 4, 2, d, dt, -1, -1},
        {SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT, 3, 190, 140, 2, 1, d, dt, -1, -1},
        {SF_ATTN_BSHD, SF_ATTN_CAUSAL, 1, 300, 300, 2, 2, d, dt, 70, 0}, /* sliding window */
        {SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 160, 230, 2, 1, d, dt, 33, 17},
        {SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 1000, 1000, 1, 1, d, dt, -1, -1}, /* 8 key tiles */
    };
}

/* ---------- (e): the attention backward ---------- */

/* ||x - r|| / ||r|| over 16-bit arrays (NaN counted apart) and the first
 * element off by more than elt (1 + |r|). */
struct Err16 {
    double rel = 0;
    int64_t nan = 0, first = -1;
};
static Err16 err16(sf_dtype dt, const std::vector<uint16_t> &x, const std::vector<uint16_t> &r, double elt)
{
    Err16 e;
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        const float a = from16(dt, x[i]), b = from16(dt, r[i]);
        if (a != a) { ++e.nan; if (e.first < 0) e.first = (int64_t)i; continue; }
        num += (double)(a - b) * (a - b); den += (double)b * b;
        if (e.first < 0 && fabs(a - b) > elt * (1 + fabs(b))) e.first = (int64_t)i;
    }
    e.rel = den > 0 ? sqrt(num / den) : sqrt(num);
    return e;
}

/* The sm90 backward (dq, dk, dv) against the CPU reference and the sm80
 * backward, both from the reference's out and lse, outputs poisoned. */
static void check_backward_case(const AttnCase &c)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    const AttnSetup su(c);
    const bool pad = su.pad;
    const int64_t nq = su.nq, nk = su.nk, nl = su.nl, ncu = su.ncu;
    const sf_attn_config cfg = su.cfg;
    std::vector<uint16_t> hdo(nq), ref_o(nq), ref_dq(nq), ref_dk(nk), ref_dv(nk);
    std::vector<float> ref_l(nl), acc(nq), delta(nl);
    for (auto &x : hdo) x = to16(c.dt, rng_normal());
    {
        sf_tensor q = su.view((void *)su.hq.data(), c.dt, kQ, false), k = su.view((void *)su.hk.data(), c.dt, kK, false),
                  v = su.view((void *)su.hv.data(), c.dt, kK, false), o = su.view(ref_o.data(), c.dt, kQ, false),
                  l = su.view(ref_l.data(), SF_FLOAT32, kL, false), cq = su.cu(su.cuq.data(), false),
                  ck = su.cu(su.cuk.data(), false), dout = su.view(hdo.data(), c.dt, kQ, false),
                  dq = su.view(ref_dq.data(), c.dt, kQ, false), dk = su.view(ref_dk.data(), c.dt, kK, false),
                  dv = su.view(ref_dv.data(), c.dt, kK, false), ac = su.view(acc.data(), SF_FLOAT32, kQ, false),
                  de = su.view(delta.data(), SF_FLOAT32, kL, false);
        CHECK_SF(sf_attn_forward(&q, &k, &v, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &o, &l, NULL));
        CHECK_SF(sf_attn_backward(&q, &k, &v, &o, &dout, &l, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &dq, &dk, &dv, &ac,
                             &de, NULL));
    }
    Dev gq(nq * 2), gk(nk * 2), gv(nk * 2), go(nq * 2), gdo(nq * 2), gl(nl * 4), gcq(ncu * 4), gck(ncu * 4);
    Dev gdq(nq * 2), gdk(nk * 2), gdv(nk * 2), gacc(nq * 4), gdelta(nl * 4);
    gq.put(su.hq.data()); gk.put(su.hk.data()); gv.put(su.hv.data()); go.put(ref_o.data()); gdo.put(hdo.data());
    gl.put(ref_l.data()); gcq.put(su.cuq.data()); gck.put(su.cuk.data());
    sf_tensor q = su.view(gq.p, c.dt, kQ, true), k = su.view(gk.p, c.dt, kK, true), v = su.view(gv.p, c.dt, kK, true),
              o = su.view(go.p, c.dt, kQ, true), l = su.view(gl.p, SF_FLOAT32, kL, true), cq = su.cu(gcq.p, true),
              ck = su.cu(gck.p, true), dout = su.view(gdo.p, c.dt, kQ, true), dq = su.view(gdq.p, c.dt, kQ, true),
              dk = su.view(gdk.p, c.dt, kK, true), dv = su.view(gdv.p, c.dt, kK, true),
              ac = su.view(gacc.p, SF_FLOAT32, kQ, true), de = su.view(gdelta.p, SF_FLOAT32, kL, true);
    struct Grads { std::vector<uint16_t> dq, dk, dv; };
    auto run = [&](int arch, Grads &g) {
        CHECK_SF(sf_attn_set_backward_kernel(arch));
        for (Dev *d : {&gdq, &gdk, &gdv, &gacc, &gdelta})
            CHECK_CUDA(cudaMemset(d->p, 0xff, d->n));
        CHECK_SF(sf_attn_backward(&q, &k, &v, &o, &dout, &l, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &dq, &dk, &dv, &ac,
                             &de, NULL));
        CHECK_CUDA(cudaDeviceSynchronize());
        g.dq.resize(nq); g.dk.resize(nk); g.dv.resize(nk);
        gdq.get(g.dq.data()); gdk.get(g.dk.data()); gdv.get(g.dv.data());
    };
    Grads g80, g90;
    run(80, g80);
    run(90, g90);
    CHECK_SF(sf_attn_set_backward_kernel(80));

    /* as check_attn's backward: relative L2 error within twice the forward's tolerance */
    const double tol = 2 * (c.dt == SF_BFLOAT16 ? 2e-2 : 4e-3), elt = c.dt == SF_BFLOAT16 ? 1e-1 : 2e-2;
    const char *names[3] = {"dq", "dk", "dv"};
    const std::vector<uint16_t> *got[3] = {&g90.dq, &g90.dk, &g90.dv}, *s80[3] = {&g80.dq, &g80.dk, &g80.dv},
                                *ref[3] = {&ref_dq, &ref_dk, &ref_dv};
    Err16 e[3], e80[3];
    bool ok = true;
    for (int i = 0; i < 3; ++i) {
        e[i] = err16(c.dt, *got[i], *ref[i], elt);
        e80[i] = err16(c.dt, *s80[i], *ref[i], elt);
        ok = ok && e[i].nan == 0 && e[i].rel <= tol;
    }
    printf("%s (e) attn backward sm90 %s %s d=%d mask=%d b=%d sq=%d sk=%d h=%d hk=%d win=(%d,%d): dq %.2e dk %.2e dv %.2e "
           "(sm80 %.2e %.2e %.2e)%s\n",
           ok ? "PASS" : "FAIL", sf_dtype_name(c.dt), fmt_name(c.fmt), c.d, (int)c.mask, c.b, c.sq, c.sk, c.h, c.hk,
           c.left, c.right, e[0].rel, e[1].rel, e[2].rel, e80[0].rel, e80[1].rel, e80[2].rel,
           e[0].nan + e[1].nan + e[2].nan ? " NaN" : "");
    g_checks++;
    if (ok)
        return;
    g_failures++;
    printf("    hint: dv wrong: P^T (S^T = K Q^T, mask, lse) or dV += P^T dO; dk right-ish but dq wrong: the dS^T\n"
           "    store or dQ = dS K (gemm-tt) or its atomics; dk wrong, dv right: dP^T = V dO^T, delta or dK += dS^T Q\n");
    for (int i = 0; i < 3; ++i) {
        const int64_t f = e[i].first;
        if (f < 0)
            continue;
        const int hh = i == 0 ? c.h : c.hk;
        printf("    first wrong %s element %lld (outer %lld, head %lld, dim %lld): expected %g got %g (sm80 %g)%s\n",
               names[i], (long long)f, (long long)(f / c.d / hh), (long long)((f / c.d) % hh), (long long)(f % c.d),
               from16(c.dt, (*ref[i])[f]), from16(c.dt, (*got[i])[f]), from16(c.dt, (*s80[i])[f]),
               e[i].nan ? " (NaN present)" : "");
    }
}

/* ---------- (d), (f): speed ---------- */

/* A bshd bf16 problem of b x s tokens, h heads of d, random inputs, on the device. */
struct BenchProblem {
    int64_t shape[4], lshape[3], n;
    Dev q, k, v, o, l, dout, dq, dk, dv, acc, delta;
    sf_tensor tq, tk, tv, to, tl, tdo, tdq, tdk, tdv, tacc, tdelta;
    sf_attn_config cfg;
    BenchProblem(int b, int s, int h, int d, bool causal)
        : shape{b, s, h, d}, lshape{b, h, s}, n((int64_t)b * s * h * d), q(n * 2), k(n * 2), v(n * 2), o(n * 2),
          l((int64_t)b * h * s * 4), dout(n * 2), dq(n * 2), dk(n * 2), dv(n * 2), acc(n * 4),
          delta((int64_t)b * h * s * 4)
    {
        std::vector<uint16_t> host(n);
        for (Dev *x : {&q, &k, &v, &dout}) {
            for (auto &e : host) e = sf_f32_to_bf16(rng_normal());
            x->put(host.data());
        }
        for (auto [t, dev] : {std::pair{&tq, &q}, {&tk, &k}, {&tv, &v}, {&to, &o}, {&tdo, &dout}, {&tdq, &dq},
                              {&tdk, &dk}, {&tdv, &dv}})
            sf_tensor_init(t, dev->p, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
        sf_tensor_init(&tacc, acc.p, SF_FLOAT32, 4, shape, SF_CUDA, 0);
        sf_tensor_init(&tl, l.p, SF_FLOAT32, 3, lshape, SF_CUDA, 0);
        sf_tensor_init(&tdelta, delta.p, SF_FLOAT32, 3, lshape, SF_CUDA, 0);
        memset(&cfg, 0, sizeof cfg);
        cfg.format = SF_ATTN_BSHD;
        cfg.mask = causal ? SF_ATTN_CAUSAL : SF_ATTN_NO_MASK;
        cfg.window_left = cfg.window_right = -1;
        cfg.softmax_scale = 1.0f / sqrtf((float)d);
    }
    void forward() { CHECK_SF(sf_attn_forward(&tq, &tk, &tv, NULL, NULL, &cfg, &to, &tl, NULL)); }
    void backward()
    {
        CHECK_SF(sf_attn_backward(&tq, &tk, &tv, &to, &tdo, &tl, NULL, NULL, &cfg, &tdq, &tdk, &tdv, &tacc, &tdelta, NULL));
    }
    /* 4 b h s^2 d for the forward, halved when causal */
    double forward_flops() const
    {
        return 4.0 * shape[0] * shape[2] * (double)shape[1] * shape[1] * shape[3] *
               (cfg.mask == SF_ATTN_CAUSAL ? 0.5 : 1.0);
    }
};

static double forward_tflops(int arch, int schedule, int b, int s, int h, int d, bool causal)
{
    BenchProblem bp(b, s, h, d, causal);
    CHECK_SF(sf_attn_set_forward_kernel(arch));
    CHECK_SF(sf_attn_set_forward_sm90_schedule(schedule));
    const float ms = time_ms([&] { bp.forward(); });
    CHECK_SF(sf_attn_set_forward_kernel(80));
    return bp.forward_flops() / (ms * 1e-3) / 1e12;
}

/* Backward alone (delta, dK/dV/dQ, dQ conversion) after one forward; 2.5x the forward's flops. */
static double backward_tflops(int arch, BenchProblem &bp)
{
    CHECK_SF(sf_attn_set_backward_kernel(arch));
    const float ms = time_ms([&] { bp.backward(); });
    CHECK_SF(sf_attn_set_backward_kernel(80));
    return 2.5 * bp.forward_flops() / (ms * 1e-3) / 1e12;
}

static void bench_backward()
{
    printf("\n(f) backward speed: 16k tokens per batch, bf16, bshd (TFLOP/s, 10*b*h*s*s*d, halved when causal)\n");
    printf("%-6s %-4s %-5s %-6s %8s %8s %8s\n", "seqlen", "hd", "heads", "causal", "sm90", "sm80", "sm90/sm80");
    for (int d : {64, 128})
        for (int s : {1024, 4096, 8192})
            for (int causal = 0; causal < 2; ++causal) {
                const int b = 16384 / s, h = d == 64 ? 32 : 16;
                BenchProblem bp(b, s, h, d, causal);
                CHECK_SF(sf_attn_set_forward_kernel(90));
                bp.forward();
                const double t90 = backward_tflops(90, bp), t80 = backward_tflops(80, bp);
                printf("%-6d %-4d %-5d %-6s %8.1f %8.1f %8.2f\n", s, d, h, causal ? "yes" : "no", t90, t80, t90 / t80);
            }
}

static void check_backward_cases()
{
    const char *why = "";
    CHECK_SF(sf_attn_set_backward_kernel(90));
    const int path = sf_attn_backward_kernel_for(128, 0, 0, 0, &why), det = sf_attn_backward_kernel_for(128, 1, 0, 0, &why);
    printf("%s (e) sm90 backward taken when selected (%d), sm80 for deterministic calls (%d: %s)\n",
           path == 90 && det == 80 ? "PASS" : "FAIL", path, det, why);
    g_checks++;
    if (path != 90 || det != 80) {
        g_failures++;
        return;
    }
    CHECK_SF(sf_attn_set_forward_kernel(90));
    for (int d : {64, 128})
        for (sf_dtype dt : {SF_BFLOAT16, SF_FLOAT16}) {
            for (int s : {1, 63, 64, 65, 127, 200, 513}) /* lengths around the 64-row / 128-key tiles */
                check_backward_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, s, s, 2, 2, d, dt, -1, -1});
            for (const AttnCase &c : common_cases(d, dt))
                check_backward_case(c);
            check_backward_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL, 1, 513, 513, 2, 2, d, dt, -1, -1});
            check_backward_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 77, 150, 8, 2, d, dt, -1, -1}); /* GQA 4:1 */
            check_backward_case({SF_ATTN_BSHD, SF_ATTN_PADDING_CAUSAL, 3, 127, 127, 2, 2, d, dt, -1, -1});
            check_backward_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL_BOTTOM_RIGHT, 2, 230, 100, 2, 2, d, dt, -1, -1});
            check_backward_case({SF_ATTN_SBHD, SF_ATTN_NO_MASK, 2, 65, 63, 2, 2, d, dt, -1, -1});
            check_backward_case({SF_ATTN_THD, SF_ATTN_PADDING, 3, 400, 400, 2, 2, d, dt, 64, 64}); /* window in thd */
        }
    CHECK_SF(sf_attn_set_backward_kernel(80));
}

int main(int argc, char **argv)
{
    bool bench = true, forward = true, backward = true;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--no-bench"))
            bench = false;
        else if (!strcmp(argv[i], "--backward"))
            forward = false;
        else if (!strcmp(argv[i], "--forward"))
            backward = false;
        else {
            fprintf(stderr, "usage: %s [--forward | --backward] [--no-bench]\n", argv[0]);
            return 2;
        }
    }
    rng_seed();
    const char *why = "";
    CHECK_SF(sf_attn_set_forward_kernel(90));
    const int path = sf_attn_forward_kernel_for(128, 0, 0, &why);
    CHECK_SF(sf_attn_set_forward_kernel(80));
    printf("sm90 forward available on device 0: %s%s\n", path == 90 ? "yes" : "NO - ", path == 90 ? "" : why);
    g_checks++;
    if (path != 90) {
        g_failures++;
        printf("FAIL sm90 path not taken: %s\n", why);
        return check_finish("check_attn_sm90");
    }

    for (int mode = 0; mode < 2 && forward; ++mode) {
        check_gemm<__nv_bfloat16, 64>(SF_BFLOAT16, mode);
        check_gemm<__nv_bfloat16, 128>(SF_BFLOAT16, mode);
        check_gemm<__half, 64>(SF_FLOAT16, mode);
        check_gemm<__half, 128>(SF_FLOAT16, mode);
    }
    if (backward) { /* the backward's dQ product (and its m64n64 S^T, dP^T are gemm-ss above) */
        check_gemm<__nv_bfloat16, 32>(SF_BFLOAT16, 2);
        check_gemm<__nv_bfloat16, 64>(SF_BFLOAT16, 2);
        check_gemm<__half, 32>(SF_FLOAT16, 2);
        check_gemm<__half, 64>(SF_FLOAT16, 2);
    }

    for (int d : {64, 128})
        for (sf_dtype dt : {SF_BFLOAT16, SF_FLOAT16}) {
            if (!forward)
                break;
            for (const AttnCase &c : common_cases(d, dt))
                if (check_take_case()) /* CHECK_EVERY (core/check_util.h) */
                    check_attn_case(c);
        }
    if (backward)
        check_backward_cases();
    if (!bench)
        return check_finish("check_attn_sm90");

    if (backward)
        bench_backward();
    if (!forward)
        return check_finish("check_attn_sm90");
    printf("\n(d) forward speed: 16k tokens per batch, bf16, bshd (TFLOP/s, 4*b*h*s*s*d, halved when causal)\n");
    printf("%-6s %-4s %-6s %8s %8s %8s %8s %8s %8s %5s %10s\n", "seqlen", "hd", "causal", "sm90v0", "sm90v1",
           "sm90v2", "sm90v3", "sm90v4", "sm80", "best", "best/sm80");
    for (int d : {64, 128})
        for (int s : {1024, 4096, 8192})
            for (int causal = 0; causal < 2; ++causal) {
                const int b = 16384 / s, h = d == 64 ? 32 : 16;
                double v[kCheckSchedules];
                int best = 0;
                for (int i = 0; i < kCheckSchedules; ++i) {
                    v[i] = forward_tflops(90, i, b, s, h, d, causal);
                    if (v[i] > v[best])
                        best = i;
                }
                const double t80 = forward_tflops(80, 0, b, s, h, d, causal);
                printf("%-6d %-4d %-6s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %4s%d %10.2f\n", s, d, causal ? "yes" : "no",
                       v[0], v[1], v[2], v[3], v[4], t80, "v", best, v[best] / t80);
            }
    CHECK_SF(sf_attn_set_forward_sm90_schedule(-1));
    return check_finish("check_attn_sm90");
}
