/*
 * check_adamw.cu - standalone check and benchmark of the multi-tensor AdamW,
 * l2 norm and scale kernels.
 *
 * 150 tensors of assorted sizes (some larger than a chunk, some starting at
 * offsets of one and four elements, so the wide, four-wide and scalar paths
 * all run and the launches split), fp32 and bf16 with fp32 masters, with fp32 or bf16 moments:
 * the GPU update must match the CPU backend (the same fp32 formula; FMA
 * contraction may move the last bit, and a value that lands near a rounding
 * boundary of a bf16 moment may then round one ulp apart).  The l2 norm must
 * match the CPU's double sum.  Then one AdamW step
 * over 1B parameters (200 x 5M) against a device copy of the same bytes.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

struct HostSet {
    std::vector<std::vector<uint8_t>> p, g, m, v;
    std::vector<std::vector<float>> w;
};

/* element j of a float32 or bfloat16 buffer */
static void put(sf_dtype dt, uint8_t *buf, int64_t j, float f)
{
    if (dt == SF_FLOAT32) { memcpy(buf + j * 4, &f, 4); return; }
    uint16_t b = sf_f32_to_bf16(f);
    memcpy(buf + j * 2, &b, 2);
}

static float get(sf_dtype dt, const uint8_t *buf, int64_t j)
{
    if (dt == SF_FLOAT32) { float f; memcpy(&f, buf + j * 4, 4); return f; }
    uint16_t b;
    memcpy(&b, buf + j * 2, 2);
    return sf_bf16_to_f32(b);
}

static bool close(float a, float b, float rtol) { return fabsf(a - b) <= 1e-7f + rtol * fabsf(b); }

static void run_case(sf_dtype dtype, int master, sf_dtype mdt)
{
    const int n = 150;
    size_t es = sf_dtype_size(dtype), ms = sf_dtype_size(mdt);
    HostSet h;
    std::vector<int64_t> sizes(n), offsets(n);
    for (int i = 0; i < n; ++i) {
        sizes[i] = i == 3 ? 3 * SF_MT_CHUNK + 5 : (int64_t)(rng_next() % 5000);
        /* one element off: the scalar path; four: 16-bit lists 8 bytes from 16-byte alignment (4-wide) */
        offsets[i] = i % 7 == 1 ? 1 : i % 7 == 4 ? 4 : 0;
    }
    std::vector<sf_tensor> dp(n), dg(n), dm(n), dv(n), dw(n), hp(n), hg(n), hm(n), hv(n), hw(n);
    std::vector<void *> allocs;
    for (int i = 0; i < n; ++i) {
        int64_t s = sizes[i], o = offsets[i];
        h.p.emplace_back(s * es); h.g.emplace_back(s * es);
        h.m.emplace_back(s * ms); h.v.emplace_back(s * ms); h.w.emplace_back(s);
        for (int64_t j = 0; j < s; ++j) {
            float pv = rng_normal(), gv = rng_normal() * 0.1f;
            put(dtype, h.p[i].data(), j, pv);
            put(dtype, h.g[i].data(), j, gv);
            pv = get(dtype, h.p[i].data(), j);
            put(mdt, h.m[i].data(), j, rng_normal() * 0.01f);
            put(mdt, h.v[i].data(), j, fabsf(rng_normal()) * 1e-3f);
            h.w[i][j] = pv + rng_normal() * 1e-4f;
        }
        void *bufs[5];
        size_t so = (size_t)(s + o), su = (size_t)s;
        size_t bytes[5] = {so * es, so * es, so * ms, so * ms, so * 4};
        const void *src[5] = {h.p[i].data(), h.g[i].data(), h.m[i].data(), h.v[i].data(), h.w[i].data()};
        size_t srcb[5] = {su * es, su * es, su * ms, su * ms, su * 4};
        size_t eb[5] = {es, es, ms, ms, 4};
        for (int k = 0; k < 5; ++k) {
            CHECK_CUDA(cudaMalloc(&bufs[k], bytes[k] + 16));
            allocs.push_back(bufs[k]);
            bufs[k] = (char *)bufs[k] + o * eb[k];
            if (srcb[k]) CHECK_CUDA(cudaMemcpy(bufs[k], src[k], srcb[k], cudaMemcpyHostToDevice));
        }
        int64_t sh[1] = {s};
        sf_tensor_init(&dp[i], bufs[0], dtype, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&dg[i], bufs[1], dtype, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&dm[i], bufs[2], mdt, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&dv[i], bufs[3], mdt, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&dw[i], bufs[4], SF_FLOAT32, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&hp[i], h.p[i].data(), dtype, 1, sh, SF_CPU, 0);
        sf_tensor_init(&hg[i], h.g[i].data(), dtype, 1, sh, SF_CPU, 0);
        sf_tensor_init(&hm[i], h.m[i].data(), mdt, 1, sh, SF_CPU, 0);
        sf_tensor_init(&hv[i], h.v[i].data(), mdt, 1, sh, SF_CPU, 0);
        sf_tensor_init(&hw[i], h.w[i].data(), SF_FLOAT32, 1, sh, SF_CPU, 0);
        if (master) CHECK_CUDA(cudaMemset(bufs[0], 0xff, s * es)); /* written only: poison */
    }
    sf_adamw_config cfg = {3e-3, 0.9, 0.95, 1e-8, 0.1, 7};
    CHECK_SF(sf_multi_tensor_adamw(n, dp.data(), dg.data(), dm.data(), dv.data(), master ? dw.data() : NULL, &cfg, NULL));
    CHECK_SF(sf_multi_tensor_adamw(n, hp.data(), hg.data(), hm.data(), hv.data(), master ? hw.data() : NULL, &cfg, NULL));
    int64_t bad = 0;
    float prt = dtype == SF_FLOAT32 ? 1e-6f : 1.0f / 128, mrt = mdt == SF_FLOAT32 ? 1e-6f : 1.0f / 128;
    for (int i = 0; i < n; ++i) {
        int64_t s = sizes[i];
        std::vector<uint8_t> p(s * es), m(s * ms), v(s * ms);
        std::vector<float> w(s);
        if (s == 0) continue;
        CHECK_CUDA(cudaMemcpy(p.data(), dp[i].data, s * es, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(m.data(), dm[i].data, s * ms, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(v.data(), dv[i].data, s * ms, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(w.data(), dw[i].data, s * 4, cudaMemcpyDeviceToHost));
        for (int64_t j = 0; j < s; ++j) {
            float gp = get(dtype, p.data(), j), rp = get(dtype, h.p[i].data(), j);
            bool ok = close(gp, rp, prt) && close(get(mdt, m.data(), j), get(mdt, h.m[i].data(), j), mrt) &&
                      close(get(mdt, v.data(), j), get(mdt, h.v[i].data(), j), mrt);
            if (master) ok = ok && close(w[j], h.w[i][j], 1e-6f);
            bad += !ok;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "adamw %s master=%d moments %s, %d tensors: %lld mismatching elements",
             sf_dtype_name(dtype), master, sf_dtype_name(mdt), n, (long long)bad);
    check_report(bad == 0, what);

    /* l2 norm of the gradients */
    int64_t chunks = sf_multi_tensor_l2norm_workspace(n, dg.data());
    void *ws, *dout;
    CHECK_CUDA(cudaMalloc(&ws, chunks * 4));
    CHECK_CUDA(cudaMalloc(&dout, 4));
    CHECK_CUDA(cudaMemset(dout, 0xff, 4));
    int64_t wsh[1] = {chunks}, one[1] = {1};
    sf_tensor tws, tout, hout;
    float gpu = 0.0f, cpu = 0.0f;
    sf_tensor_init(&tws, ws, SF_FLOAT32, 1, wsh, SF_CUDA, 0);
    sf_tensor_init(&tout, dout, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&hout, &cpu, SF_FLOAT32, 1, one, SF_CPU, 0);
    CHECK_SF(sf_multi_tensor_l2norm(n, dg.data(), &tws, &tout, NULL));
    CHECK_SF(sf_multi_tensor_l2norm(n, hg.data(), NULL, &hout, NULL));
    CHECK_CUDA(cudaMemcpy(&gpu, dout, 4, cudaMemcpyDeviceToHost));
    snprintf(what, sizeof what, "l2norm %s: gpu %.7g cpu %.7g", sf_dtype_name(dtype), gpu, cpu);
    check_report(close(gpu, cpu, 1e-5f), what);
    cudaFree(ws); cudaFree(dout);
    for (void *a : allocs) cudaFree(a);
}

int main(void)
{
    rng_seed();
    run_case(SF_FLOAT32, 0, SF_FLOAT32);
    run_case(SF_BFLOAT16, 1, SF_FLOAT32);
    run_case(SF_BFLOAT16, 0, SF_FLOAT32);
    run_case(SF_BFLOAT16, 0, SF_BFLOAT16);
    run_case(SF_BFLOAT16, 1, SF_BFLOAT16);
    run_case(SF_FLOAT32, 0, SF_BFLOAT16);

    /* bandwidth: 200 x 5M bf16 params with fp32 masters (28 bytes per parameter per step) */
    const int n = 200;
    const int64_t numel = 5000000;
    std::vector<sf_tensor> p(n), g(n), m(n), v(n), w(n);
    std::vector<void *> allocs;
    int64_t sh[1] = {numel};
    for (int i = 0; i < n; ++i) {
        void *b[5];
        size_t bytes[5] = {(size_t)numel * 2, (size_t)numel * 2, (size_t)numel * 4, (size_t)numel * 4, (size_t)numel * 4};
        for (int k = 0; k < 5; ++k) {
            CHECK_CUDA(cudaMalloc(&b[k], bytes[k]));
            CHECK_CUDA(cudaMemset(b[k], k < 2 ? 0x3c : 0, bytes[k]));
            allocs.push_back(b[k]);
        }
        sf_tensor_init(&p[i], b[0], SF_BFLOAT16, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&g[i], b[1], SF_BFLOAT16, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&m[i], b[2], SF_FLOAT32, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&v[i], b[3], SF_FLOAT32, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&w[i], b[4], SF_FLOAT32, 1, sh, SF_CUDA, 0);
    }
    sf_adamw_config cfg = {1e-4, 0.9, 0.95, 1e-8, 0.1, 1};
    float ms = time_ms([&] { CHECK_SF(sf_multi_tensor_adamw(n, p.data(), g.data(), m.data(), v.data(), w.data(), &cfg, NULL)); });
    size_t cb = (size_t)1 << 30;
    void *c1, *c2;
    CHECK_CUDA(cudaMalloc(&c1, cb));
    CHECK_CUDA(cudaMalloc(&c2, cb));
    float copy = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(c2, c1, cb, cudaMemcpyDeviceToDevice)); });
    double bytes = 28.0 * n * numel;
    printf("adamw bf16+master 1B params: %.3f ms = %.2f TB/s; copy of 1 GiB %.3f ms = %.2f TB/s (read+write)\n", ms,
           bytes / ms / 1e9, copy, 2.0 * cb / copy / 1e9);
    /* torch AdamW's state on bf16 params: no master, bf16 moments (14 bytes per parameter per step), the
     * moments' buffers reused as bf16 views */
    std::vector<sf_tensor> mb(n), vb(n);
    for (int i = 0; i < n; ++i) {
        sf_tensor_init(&mb[i], m[i].data, SF_BFLOAT16, 1, sh, SF_CUDA, 0);
        sf_tensor_init(&vb[i], v[i].data, SF_BFLOAT16, 1, sh, SF_CUDA, 0);
    }
    for (int i = 0; i < n; ++i) { /* zero moments: the timed update does real arithmetic */
        CHECK_CUDA(cudaMemset(mb[i].data, 0, (size_t)numel * 2));
        CHECK_CUDA(cudaMemset(vb[i].data, 0, (size_t)numel * 2));
    }
    float bms = time_ms([&] {
        CHECK_SF(sf_multi_tensor_adamw(n, p.data(), g.data(), mb.data(), vb.data(), NULL, &cfg, NULL));
    });
    printf("adamw bf16, bf16 moments, 1B params: %.3f ms = %.2f TB/s\n", bms, 14.0 * n * numel / bms / 1e9);
    int64_t chunks = sf_multi_tensor_l2norm_workspace(n, g.data());
    void *ws, *dout;
    CHECK_CUDA(cudaMalloc(&ws, chunks * 4));
    CHECK_CUDA(cudaMalloc(&dout, 4));
    int64_t wsh[1] = {chunks}, one[1] = {1};
    sf_tensor tws, tout;
    sf_tensor_init(&tws, ws, SF_FLOAT32, 1, wsh, SF_CUDA, 0);
    sf_tensor_init(&tout, dout, SF_FLOAT32, 1, one, SF_CUDA, 0);
    float nms = time_ms([&] { CHECK_SF(sf_multi_tensor_l2norm(n, g.data(), &tws, &tout, NULL)); });
    printf("l2norm bf16 1B grads: %.3f ms = %.2f TB/s (read)\n", nms, 2.0 * n * numel / nms / 1e9);
    for (void *a : allocs) cudaFree(a);
    return check_finish("check_adamw");
}
