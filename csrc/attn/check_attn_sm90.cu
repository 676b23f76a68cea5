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
 *  (c) the attention forward (sf_attn_fwd with the sm90 kernel selected)
 *      against the CPU reference and the sm80 kernel: head dims 64/128,
 *      bf16/fp16, bshd/sbhd/thd, masks, windows, GQA, lengths that are and
 *      are not multiples of 128.  lse right but out wrong points at P V;
 *      lse wrong at S = Q K^T, the mask or the softmax.
 *  (d) speed: TFLOP/s of the sm90 forward (every schedule: v0 in order,
 *      v1 softmax overlapped with P V, v2 = v1 warp-specialized with a
 *      producer warpgroup and an mbarrier K/V pipeline, v3 = v2 with the
 *      two consumer warpgroups in ping-pong, v4 = v3 with three consumer
 *      warpgroups, 192 rows, at head dim 64) and the sm80 forward at 16k
 *      tokens per batch, seqlens 1024/4096/8192, head dims 64/128, causal
 *      and not; "best" names the fastest sm90 schedule.
 *  (c) runs every sm90 schedule too (lines "sm90v0" .. "sm90v4").
 *
 * Run: bash csrc/build_checks.sh && bin/check_attn_attn_sm90 [--no-bench]
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"
#include "attn/attn_sm90.cuh"

using namespace sf_attn;
using namespace sf_attn::sm90;

/* ---------- (a), (b): single wgmma GEMM tiles ---------- */

constexpr int GM = 128, GK = 128; /* two warpgroups x 64 rows, reduction 128 (two column blocks) */

/* C[m][n] = sum_k A[m][k] B[n][k]: A [GM][GK], B [N][GK] row-major in global. */
template <typename T, int N> __global__ void gemm_ss_kernel(const T *A, const T *B, float *C)
{
#ifdef SF_SM90A
    extern __shared__ unsigned char smem_raw[];
    const uint32_t sA = (smem_addr(smem_raw) + 1023u) & ~1023u, sB = sA + GM * GK * 2;
    unsigned char *gen = smem_raw + (sA - smem_addr(smem_raw));
    for (int i = threadIdx.x; i < GM * GK; i += blockDim.x)
        *reinterpret_cast<T *>(gen + sw128_at<GM>(i / GK, i % GK)) = A[i];
    for (int i = threadIdx.x; i < N * GK; i += blockDim.x)
        *reinterpret_cast<T *>(gen + GM * GK * 2 + sw128_at<N>(i / GK, i % GK)) = B[i];
    fence_proxy_async();
    __syncthreads();
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        d[i] = -1.f; /* scale_d = 0 on the first step must discard this */
    wg_pin(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < GK / 16; ++kk)
        Wgmma<T, N>::ss(d, desc_kmajor<GM>(sA, wg * 64, kk), desc_kmajor<N>(sB, 0, kk), kk > 0);
    wg_commit();
    wg_wait<0>();
    wg_pin(d);
    const int row = wg * 64 + t / 32 * 16 + (t % 32) / 4, col = 2 * (t % 4);
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        C[(row + ((i >> 1) & 1) * 8) * N + (i >> 2) * 8 + col + (i & 1)] = d[i];
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
    for (int i = threadIdx.x; i < GK * N; i += blockDim.x)
        *reinterpret_cast<T *>(gen + sw128_at<GK>(i / N, i % N)) = B[i];
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
    wg_pin(d);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < GK / 16; ++kc)
        Wgmma<T, N>::rs(d, a[kc], desc_mnmajor<GK>(sB, kc), 1);
    wg_commit();
    wg_wait<0>();
    wg_pin(d);
#pragma unroll
    for (int i = 0; i < N / 2; ++i)
        C[(row + ((i >> 1) & 1) * 8) * N + (i >> 2) * 8 + col + (i & 1)] = d[i];
#endif
}

static uint16_t to16(sf_dtype dt, float x) { return dt == SF_BFLOAT16 ? sf_f32_to_bf16(x) : sf_f32_to_f16(x); }
static float from16(sf_dtype dt, uint16_t x) { return dt == SF_BFLOAT16 ? sf_bf16_to_f32(x) : sf_f16_to_f32(x); }

template <typename T, int N> static void check_gemm(sf_dtype dt, bool rs)
{
    std::vector<uint16_t> a(GM * GK), bm(N * GK);
    std::vector<float> af(a.size()), bf(bm.size());
    for (size_t i = 0; i < a.size(); ++i) { af[i] = (float)((int)(rng_next() % 9) - 4); a[i] = to16(dt, af[i]); }
    for (size_t i = 0; i < bm.size(); ++i) { bf[i] = (float)((int)(rng_next() % 9) - 4); bm[i] = to16(dt, bf[i]); }
    std::vector<float> ref(GM * N);
    for (int m = 0; m < GM; ++m)
        for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = 0; k < GK; ++k)
                s += (double)af[m * GK + k] * (rs ? bf[k * N + n] : bf[n * GK + k]);
            ref[m * N + n] = (float)s;
        }
    T *dA, *dB;
    float *dC;
    CHECK_CUDA(cudaMalloc(&dA, a.size() * 2));
    CHECK_CUDA(cudaMalloc(&dB, bm.size() * 2));
    CHECK_CUDA(cudaMalloc(&dC, ref.size() * 4));
    CHECK_CUDA(cudaMemcpy(dA, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dB, bm.data(), bm.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dC, 0xff, ref.size() * 4));
    const int smem = 1024 + (GM * GK + N * GK) * 2;
    if (rs) {
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

    int bad = 0, first = -1, quad[2][2] = {{0, 0}, {0, 0}};
    for (int i = 0; i < GM * N; ++i)
        if (!(got[i] == ref[i])) {
            if (first < 0) first = i;
            ++bad;
            quad[i / N >= 64][i % N >= 64]++;
        }
    char what[400];
    snprintf(what, sizeof what, "(%s) gemm-%s %s m128n%dk128 (%s A, %s B): %d of %d wrong", rs ? "b" : "a",
             rs ? "rs" : "ss", sf_dtype_name(dt), N, rs ? "register" : "K-major smem", rs ? "MN-major" : "K-major",
             bad, GM * N);
    printf("%s %s\n", bad ? "FAIL" : "PASS", what);
    g_checks++;
    if (bad) {
        g_failures++;
        printf("    first wrong C[%d][%d]: expected %g got %g\n", first / N, first % N, ref[first], got[first]);
        printf("    wrong by quadrant: rows<64 cols<64 %d, rows<64 cols>=64 %d, rows>=64 cols<64 %d, rows>=64 cols>=64 %d\n",
               quad[0][0], quad[0][1], quad[1][0], quad[1][1]);
        for (int r : {0, 1, 8, 64})
            for (int pass = 0; pass < 2; ++pass) {
                printf("    row %3d %s:", r, pass ? "got" : "exp");
                for (int c = 0; c < 12; ++c)
                    printf(" %6g", (pass ? got : ref)[r * N + c]);
                printf("\n");
            }
    }
}

/* ---------- (c): the attention forward ---------- */

constexpr int kCheckVariants = 5; /* sm90 schedules 0..4 (attn_fwd_sm90_cuda.cu) */

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

/* PASS/FAIL of one sm90 variant against the CPU reference, the sm80 kernel's error beside it. */
static void compare_attn(const AttnCase &c, int variant, int64_t nq, int64_t nl, const std::vector<uint16_t> &ref_o,
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
           ok ? "PASS" : "FAIL", variant, sf_dtype_name(c.dt), fmt_name(c.fmt), c.d, (int)c.mask, c.b, c.sq, c.sk, c.h, c.hk,
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

static void check_attn_case(const AttnCase &c)
{
    const bool thd = c.fmt == SF_ATTN_THD;
    const bool pad = thd || c.mask == SF_ATTN_PADDING || c.mask == SF_ATTN_PADDING_CAUSAL ||
                     c.mask == SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT;
    std::vector<int32_t> cuq(1, 0), cuk(1, 0);
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
    int nd, ndl = thd ? 2 : 3;
    int64_t shq[4], shk[4], shl[3];
    dims(c.fmt, c.b, c.sq, c.h, c.d, tq, &nd, shq);
    dims(c.fmt, c.b, c.sk, c.hk, c.d, tk, &nd, shk);
    if (thd) { shl[0] = c.h; shl[1] = tq; } else { shl[0] = c.b; shl[1] = c.h; shl[2] = c.sq; }
    int64_t nq = 1, nk = 1, nl = 1;
    for (int i = 0; i < nd; ++i) { nq *= shq[i]; nk *= shk[i]; }
    for (int i = 0; i < ndl; ++i) nl *= shl[i];

    std::vector<uint16_t> hq(nq), hk(nk), hv(nk), ref_o(nq), o80(nq), o90(nq);
    std::vector<float> ref_l(nl), l80(nl), l90(nl);
    for (auto *v : {&hq, &hk, &hv})
        for (auto &x : *v) x = to16(c.dt, rng_normal());
    sf_attn_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.format = c.fmt; cfg.mask = c.mask; cfg.window_left = c.left; cfg.window_right = c.right;
    cfg.softmax_scale = 1.0f / sqrtf((float)c.d);
    cfg.max_seqlen_q = thd ? maxq : 0;
    cfg.max_seqlen_kv = thd ? maxk : 0;
    const int64_t ncu = (int64_t)cuq.size();

    sf_tensor q, k, v, o, l, cq, ck;
    sf_tensor_init(&q, hq.data(), c.dt, nd, shq, SF_CPU, 0);
    sf_tensor_init(&k, hk.data(), c.dt, nd, shk, SF_CPU, 0);
    sf_tensor_init(&v, hv.data(), c.dt, nd, shk, SF_CPU, 0);
    sf_tensor_init(&o, ref_o.data(), c.dt, nd, shq, SF_CPU, 0);
    sf_tensor_init(&l, ref_l.data(), SF_FLOAT32, ndl, shl, SF_CPU, 0);
    sf_tensor_init(&cq, cuq.data(), SF_INT32, 1, &ncu, SF_CPU, 0);
    sf_tensor_init(&ck, cuk.data(), SF_INT32, 1, &ncu, SF_CPU, 0);
    CHECK_SF(sf_attn_fwd(&q, &k, &v, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &o, &l, NULL));

    Dev dq(nq * 2), dk(nk * 2), dv(nk * 2), dout(nq * 2), dl(nl * 4), dcq(ncu * 4), dck(ncu * 4);
    dq.put(hq.data()); dk.put(hk.data()); dv.put(hv.data()); dcq.put(cuq.data()); dck.put(cuk.data());
    sf_tensor_init(&q, dq.p, c.dt, nd, shq, SF_CUDA, 0);
    sf_tensor_init(&k, dk.p, c.dt, nd, shk, SF_CUDA, 0);
    sf_tensor_init(&v, dv.p, c.dt, nd, shk, SF_CUDA, 0);
    sf_tensor_init(&o, dout.p, c.dt, nd, shq, SF_CUDA, 0);
    sf_tensor_init(&l, dl.p, SF_FLOAT32, ndl, shl, SF_CUDA, 0);
    sf_tensor_init(&cq, dcq.p, SF_INT32, 1, &ncu, SF_CUDA, 0);
    sf_tensor_init(&ck, dck.p, SF_INT32, 1, &ncu, SF_CUDA, 0);
    auto run = [&](int arch, int variant, std::vector<uint16_t> &oh, std::vector<float> &lh) {
        CHECK_SF(sf_attn_set_fwd_kernel(arch));
        CHECK_SF(sf_attn_set_fwd_sm90_variant(variant));
        CHECK_CUDA(cudaMemset(dout.p, 0xff, dout.n));
        CHECK_CUDA(cudaMemset(dl.p, 0xff, dl.n));
        CHECK_SF(sf_attn_fwd(&q, &k, &v, pad ? &cq : NULL, pad ? &ck : NULL, &cfg, &o, &l, NULL));
        CHECK_CUDA(cudaDeviceSynchronize());
        dout.get(oh.data());
        dl.get(lh.data());
    };
    run(80, 0, o80, l80);
    for (int variant = 0; variant < kCheckVariants; ++variant) {
        run(90, variant, o90, l90);
        compare_attn(c, variant, nq, nl, ref_o, ref_l, o80, l80, o90, l90);
    }
    CHECK_SF(sf_attn_set_fwd_kernel(80));
    CHECK_SF(sf_attn_set_fwd_sm90_variant(0));
}

/* ---------- (d): speed ---------- */

static double fwd_tflops(int arch, int variant, int b, int s, int h, int d, bool causal)
{
    const int64_t shape[4] = {b, s, h, d}, lshape[3] = {b, h, s}, n = (int64_t)b * s * h * d;
    Dev q(n * 2), k(n * 2), v(n * 2), o(n * 2), l((int64_t)b * h * s * 4);
    std::vector<uint16_t> host(n);
    for (auto &x : host) x = sf_f32_to_bf16(rng_normal());
    q.put(host.data()); k.put(host.data()); v.put(host.data());
    sf_tensor tq, tk, tv, to, tl;
    sf_tensor_init(&tq, q.p, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tk, k.p, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tv, v.p, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&to, o.p, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tl, l.p, SF_FLOAT32, 3, lshape, SF_CUDA, 0);
    sf_attn_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.format = SF_ATTN_BSHD;
    cfg.mask = causal ? SF_ATTN_CAUSAL : SF_ATTN_NO_MASK;
    cfg.window_left = cfg.window_right = -1;
    cfg.softmax_scale = 1.0f / sqrtf((float)d);
    CHECK_SF(sf_attn_set_fwd_kernel(arch));
    CHECK_SF(sf_attn_set_fwd_sm90_variant(variant));
    const float ms = time_ms([&] { CHECK_SF(sf_attn_fwd(&tq, &tk, &tv, NULL, NULL, &cfg, &to, &tl, NULL)); });
    CHECK_SF(sf_attn_set_fwd_kernel(80));
    return 4.0 * b * h * (double)s * s * d * (causal ? 0.5 : 1.0) / (ms * 1e-3) / 1e12;
}

int main(int argc, char **argv)
{
    rng_seed();
    const char *why = "";
    CHECK_SF(sf_attn_set_fwd_kernel(90));
    const int path = sf_attn_fwd_kernel_for(128, 0, &why);
    CHECK_SF(sf_attn_set_fwd_kernel(80));
    printf("sm90 forward available on device 0: %s%s\n", path == 90 ? "yes" : "NO - ", path == 90 ? "" : why);
    g_checks++;
    if (path != 90) {
        g_failures++;
        printf("FAIL sm90 path not taken: %s\n", why);
        return check_finish("check_attn_sm90");
    }

    check_gemm<__nv_bfloat16, 64>(SF_BFLOAT16, false);
    check_gemm<__nv_bfloat16, 128>(SF_BFLOAT16, false);
    check_gemm<__half, 64>(SF_FLOAT16, false);
    check_gemm<__half, 128>(SF_FLOAT16, false);
    check_gemm<__nv_bfloat16, 64>(SF_BFLOAT16, true);
    check_gemm<__nv_bfloat16, 128>(SF_BFLOAT16, true);
    check_gemm<__half, 64>(SF_FLOAT16, true);
    check_gemm<__half, 128>(SF_FLOAT16, true);

    for (int d : {64, 128})
        for (sf_dtype dt : {SF_BFLOAT16, SF_FLOAT16}) {
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 128, 128, 1, 1, d, dt, -1, -1}); /* one tile */
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 256, 384, 2, 2, d, dt, -1, -1});
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL, 2, 256, 256, 2, 2, d, dt, -1, -1});
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 77, 150, 4, 2, d, dt, -1, -1});  /* not multiples, GQA */
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL, 2, 300, 300, 2, 1, d, dt, -1, -1});  /* MQA */
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_PADDING, 3, 200, 260, 2, 2, d, dt, -1, -1});
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL_BOTTOM_RIGHT, 2, 100, 230, 2, 2, d, dt, -1, -1});
            check_attn_case({SF_ATTN_SBHD, SF_ATTN_PADDING_CAUSAL, 3, 200, 65, 3, 1, d, dt, -1, -1});
            check_attn_case({SF_ATTN_THD, SF_ATTN_PADDING, 4, 300, 300, 4, 4, d, dt, -1, -1});
            check_attn_case({SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL, 5, 257, 257, 4, 2, d, dt, -1, -1});
            check_attn_case({SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT, 3, 190, 140, 2, 1, d, dt, -1, -1});
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_CAUSAL, 1, 300, 300, 2, 2, d, dt, 70, 0}); /* sliding window */
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 160, 230, 2, 1, d, dt, 33, 17});
            check_attn_case({SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 1000, 1000, 1, 1, d, dt, -1, -1}); /* 8 key tiles */
        }
    if (argc > 1 && !strcmp(argv[1], "--no-bench"))
        return check_finish("check_attn_sm90");

    printf("\n(d) forward speed: 16k tokens per batch, bf16, bshd (TFLOP/s, 4*b*h*s*s*d, halved when causal)\n");
    printf("%-6s %-4s %-6s %8s %8s %8s %8s %8s %8s %5s %10s\n", "seqlen", "hd", "causal", "sm90v0", "sm90v1",
           "sm90v2", "sm90v3", "sm90v4", "sm80", "best", "best/sm80");
    for (int d : {64, 128})
        for (int s : {1024, 4096, 8192})
            for (int causal = 0; causal < 2; ++causal) {
                const int b = 16384 / s, h = d == 64 ? 32 : 16;
                double v[kCheckVariants];
                int best = 0;
                for (int i = 0; i < kCheckVariants; ++i) {
                    v[i] = fwd_tflops(90, i, b, s, h, d, causal);
                    if (v[i] > v[best])
                        best = i;
                }
                const double t80 = fwd_tflops(80, 0, b, s, h, d, causal);
                printf("%-6d %-4d %-6s %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %4s%d %10.2f\n", s, d, causal ? "yes" : "no",
                       v[0], v[1], v[2], v[3], v[4], t80, "v", best, v[best] / t80);
            }
    CHECK_SF(sf_attn_set_fwd_sm90_variant(0));
    return check_finish("check_attn_sm90");
}
