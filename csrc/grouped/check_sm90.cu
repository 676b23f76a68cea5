// check-links: gemm
/*
 * check_sm90.cu - standalone check and benchmark of the grouped
 * GEMM's Hopper kernel (grouped_sm90_cuda.cu).
 *
 * Correctness: fresh random bf16 operands (and e4m3 codes with random
 * per-group scale inverses) at group row counts that are and are not
 * multiples of the 128-row tile, empty groups among them, k with and
 * without a partial 128-byte block, n not a multiple of the 256-column tile,
 * each group's B in its own allocation; out poisoned with NaN, with padding
 * columns (ldo > n) and rows past the last group that must stay poisoned;
 * some cases hand the groups' ends over in device memory (device_row_end),
 * with 40 more rows of a and out than the groups take.  Every output is held to a float64 reference of the same inputs:
 * |out - ref| <= 2^-8 |ref| + 2^-12 sum_k |a b| (bf16 output rounding plus
 * float32 accumulation); e4m3 2^-10 sum_k |a b|: Hopper's FP8 wgmma keeps
 * fewer accumulator bits than float32 (what cuBLASLt calls fast_accum),
 * measured on an H100 at up to 2^-11 sum_k |a b| (s45).
 * Speed: Mixtral-small's expert products (fc1 [rows, 1024] x [7168, 1024]^T,
 * fc2 [rows, 3584] x [1024, 3584]^T, 32,768 routed rows) at 8 and 64 experts,
 * balanced and random splits, against the library's per-group cuBLASLt
 * route (sf_grouped_gemm, one stream and its default lanes), TFLOP/s; the
 * kernel's other tile shapes (sf_grouped_sm90_run_variant) and the
 * library's shape with the groups' ends in device memory beside it; and
 * the host time of one call of each (10 issued back to back, no waiting).
 */
#include <chrono>
#include <initializer_list>

#include "core/check_util.h"
#include "core/float_bits.h"
#include "grouped/grouped_sm90.h"
#include "seqfuse.h"

static float e4m3_to_f32(uint8_t c)
{
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    const float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
    return s ? -v : v;
}

static uint8_t random_e4m3(void)
{
    uint8_t code;
    do {
        code = (uint8_t)(rng_next() >> 56);
    } while ((code & 0x7f) == 0x7f || ((code >> 3) & 0xf) > 10);
    return code;
}

struct Problem {
    bool fp8;
    int groups;
    std::vector<int64_t> splits;
    int64_t n, k;
};

/* host operands as floats (already rounded to the element type) and their codes */
struct HostOps {
    std::vector<float> a;                 /* [rows, k] */
    std::vector<std::vector<float>> b;    /* per group [n, k] */
    std::vector<uint16_t> a16;
    std::vector<std::vector<uint16_t>> b16;
    std::vector<uint8_t> a8;
    std::vector<std::vector<uint8_t>> b8;
    std::vector<float> sa, sb;            /* per group scale inverses (FP8) */
};

static int64_t total_rows(const Problem &p)
{
    int64_t r = 0;
    for (int64_t s : p.splits)
        r += s;
    return r;
}

static void make_ops(const Problem &p, HostOps &h)
{
    const int64_t rows = total_rows(p);
    h.a.resize(rows * p.k);
    h.b.assign(p.groups, std::vector<float>(p.n * p.k));
    if (p.fp8) {
        h.a8.resize(rows * p.k);
        h.b8.assign(p.groups, std::vector<uint8_t>(p.n * p.k));
        for (int64_t i = 0; i < rows * p.k; ++i)
            h.a[i] = e4m3_to_f32(h.a8[i] = random_e4m3());
        for (int g = 0; g < p.groups; ++g)
            for (int64_t i = 0; i < p.n * p.k; ++i)
                h.b[g][i] = e4m3_to_f32(h.b8[g][i] = random_e4m3());
        h.sa.resize(p.groups);
        h.sb.resize(p.groups);
        for (int g = 0; g < p.groups; ++g) {
            h.sa[g] = ldexpf(1.f + rng_uniform(), -(int)(rng_next() % 6));
            h.sb[g] = ldexpf(1.f + rng_uniform(), -(int)(rng_next() % 6));
        }
    } else {
        h.a16.resize(rows * p.k);
        h.b16.assign(p.groups, std::vector<uint16_t>(p.n * p.k));
        for (int64_t i = 0; i < rows * p.k; ++i)
            h.a[i] = sf_bf16_to_f32(h.a16[i] = sf_f32_to_bf16(rng_normal()));
        for (int g = 0; g < p.groups; ++g)
            for (int64_t i = 0; i < p.n * p.k; ++i)
                h.b[g][i] = sf_bf16_to_f32(h.b16[g][i] = sf_f32_to_bf16(rng_normal() * 0.05f));
    }
}

/* device copies: a and out in one buffer each, every b in its own allocation */
struct DevOps {
    void *a = nullptr, *out = nullptr;
    std::vector<void *> b;
    float *scales = nullptr; /* [2, groups] */
    ~DevOps()
    {
        cudaFree(a);
        cudaFree(out);
        for (void *p : b)
            cudaFree(p);
        cudaFree(scales);
    }
};

/* a_rows >= the groups' rows: the rows past them hold finite filler (read by no group) */
static void upload(const Problem &p, const HostOps &h, DevOps &d, int64_t out_rows, int64_t ldo, int64_t a_rows)
{
    const int64_t rows = total_rows(p), es = p.fp8 ? 1 : 2;
    CHECK_CUDA(cudaMalloc(&d.a, a_rows * p.k * es + 16));
    CHECK_CUDA(cudaMemset(d.a, 0x3C, a_rows * p.k * es)); /* bf16 0.0115, e4m3 1.5 */
    CHECK_CUDA(cudaMemcpy(d.a, p.fp8 ? (const void *)h.a8.data() : (const void *)h.a16.data(), rows * p.k * es,
                          cudaMemcpyHostToDevice));
    d.b.resize(p.groups);
    for (int g = 0; g < p.groups; ++g) {
        CHECK_CUDA(cudaMalloc(&d.b[g], p.n * p.k * es));
        CHECK_CUDA(cudaMemcpy(d.b[g], p.fp8 ? (const void *)h.b8[g].data() : (const void *)h.b16[g].data(),
                              p.n * p.k * es, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&d.out, out_rows * ldo * 2));
    if (p.fp8) {
        CHECK_CUDA(cudaMalloc(&d.scales, 2 * p.groups * sizeof(float)));
        CHECK_CUDA(cudaMemcpy(d.scales, h.sa.data(), p.groups * sizeof(float), cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(d.scales + p.groups, h.sb.data(), p.groups * sizeof(float), cudaMemcpyHostToDevice));
    }
}

static void fill_args(const Problem &p, const DevOps &d, int64_t ldo, sf_grouped_sm90_args &args)
{
    memset(&args, 0, sizeof args);
    args.dtype = p.fp8 ? SF_FLOAT8_E4M3 : SF_BFLOAT16;
    args.groups = p.groups;
    args.n = p.n;
    args.k = p.k;
    args.a = d.a;
    args.lda = p.k;
    args.out = d.out;
    args.ldo = ldo;
    args.row_start[0] = 0;
    for (int g = 0; g < p.groups; ++g) {
        args.b[g] = d.b[g];
        args.ldb[g] = p.k;
        args.row_start[g + 1] = args.row_start[g] + p.splits[g];
        if (p.fp8) {
            args.a_scale_inv[g] = d.scales + g;
            args.b_scale_inv[g] = d.scales + p.groups + g;
        }
    }
    args.device_id = 0;
}

/* device_ends: the groups' end rows handed over in device memory
 * (args.device_row_end), a and out 40 rows longer than the groups take
 * (rows past the last end: read by no group, left untouched in out); an
 * empty group's end is written 5 rows below the previous one, which the
 * kernel must clamp back. */
static void check_case(const Problem &p, int variant = 0, bool device_ends = false)
{
    if (!check_take_case())
        return;
    HostOps h;
    make_ops(p, h);
    const int64_t rows = total_rows(p), cap = rows + (device_ends ? 40 : 0), ldo = p.n + 8, out_rows = cap + 3;
    DevOps d;
    upload(p, h, d, out_rows, ldo, cap);
    CHECK_CUDA(cudaMemset(d.out, 0xFF, out_rows * ldo * 2)); /* bf16 NaN */
    sf_grouped_sm90_args args;
    fill_args(p, d, ldo, args);
    int32_t *ends = nullptr;
    if (device_ends) {
        std::vector<int32_t> host_ends(p.groups);
        for (int g = 0; g < p.groups; ++g) {
            host_ends[g] = (int32_t)args.row_start[g + 1];
            if (p.splits[g] == 0 && host_ends[g] >= 5)
                host_ends[g] -= 5; /* below the previous end: the kernel clamps it back (an empty group) */
        }
        CHECK_CUDA(cudaMalloc(&ends, p.groups * sizeof(int32_t)));
        CHECK_CUDA(cudaMemcpy(ends, host_ends.data(), p.groups * sizeof(int32_t), cudaMemcpyHostToDevice));
        for (int g = 1; g < p.groups; ++g)
            args.row_start[g] = 0; /* (unread) */
        args.row_start[p.groups] = cap;
        args.device_row_end = ends;
    }
    CHECK_SF(sf_grouped_sm90_run_variant(&args, variant, NULL)); /* (variant 0: sf_grouped_sm90_run's shape) */
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> out(out_rows * ldo);
    CHECK_CUDA(cudaMemcpy(out.data(), d.out, out.size() * 2, cudaMemcpyDeviceToHost));
    int64_t bad = 0, untouched_bad = 0;
    double worst = 0;
    int64_t r0 = 0;
    for (int g = 0; g < p.groups; ++g) {
        const double scale = p.fp8 ? (double)h.sa[g] * h.sb[g] : 1.0;
        for (int64_t r = r0; r < r0 + p.splits[g]; ++r)
            for (int64_t c = 0; c < p.n; ++c) {
                double ref = 0, mag = 0;
                const float *ar = &h.a[r * p.k], *br = &h.b[g][c * p.k];
                for (int64_t kk = 0; kk < p.k; ++kk) {
                    ref += (double)ar[kk] * br[kk];
                    mag += fabs((double)ar[kk] * br[kk]);
                }
                ref *= scale;
                mag *= scale;
                const double got = sf_bf16_to_f32(out[r * ldo + c]);
                const double err = fabs(got - ref), tol = ldexp(fabs(ref), -8) + ldexp(mag, p.fp8 ? -10 : -12) + 1e-30;
                if (!(err <= tol))
                    ++bad;
                worst = std::max(worst, err / tol);
            }
        r0 += p.splits[g];
    }
    for (int64_t r = 0; r < out_rows; ++r)
        for (int64_t c = (r < rows ? p.n : 0); c < ldo; ++c)
            untouched_bad += out[r * ldo + c] != 0xFFFF;
    char what[256];
    cudaFree(ends);
    snprintf(what, sizeof what, "variant %d %s%s groups=%d rows=%lld n=%lld k=%lld: %lld outputs off (worst err/tol "
             "%.3g), %lld padding elements written", variant, p.fp8 ? "e4m3" : "bf16",
             device_ends ? " device ends" : "", p.groups, (long long)rows, (long long)p.n,
             (long long)p.k, (long long)bad, worst, (long long)untouched_bad);
    check_report(bad == 0 && untouched_bad == 0, what);
    if (bad || untouched_bad || getenv("CHECK_VERBOSE"))
        printf("  %s\n", what);
}

/* ---- speed --------------------------------------------------------------- */

/* A contiguous view of device 0's memory (sf_tensor_init's). */
static sf_tensor on_gpu(const void *data, sf_dtype dt, std::initializer_list<int64_t> shape)
{
    sf_tensor t;
    sf_tensor_init(&t, (void *)data, dt, (int)shape.size(), shape.begin(), SF_CUDA, 0);
    return t;
}

/* Host time of one call in microseconds: 10 calls issued back to back
 * without waiting (the GPU runs behind them, so the wall time is the host's
 * work), after 3 warm-up calls and a synchronization. */
template <class F> static double host_us(F fn)
{
    for (int i = 0; i < 3; ++i)
        fn();
    CHECK_CUDA(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) /* (64 experts on cuBLASLt: 640 launches, within the launch queue) */
        fn();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 10;
    CHECK_CUDA(cudaDeviceSynchronize());
    return us;
}

static void bench(const char *name, bool fp8, int groups, const std::vector<int64_t> &splits, int64_t n, int64_t k)
{
    Problem p{fp8, groups, splits, n, k};
    const int64_t rows = total_rows(p), es = fp8 ? 1 : 2;
    /* operands: random bits are enough for timing (finite values) */
    DevOps d;
    CHECK_CUDA(cudaMalloc(&d.a, rows * k * es));
    CHECK_CUDA(cudaMemset(d.a, 0x22, rows * k * es));
    d.b.resize(groups);
    void *wbuf;
    CHECK_CUDA(cudaMalloc(&wbuf, groups * n * k * es)); /* one stacked buffer, as the modules keep it */
    CHECK_CUDA(cudaMemset(wbuf, 0x11, groups * n * k * es));
    for (int g = 0; g < groups; ++g)
        d.b[g] = nullptr;
    CHECK_CUDA(cudaMalloc(&d.out, rows * n * 2));
    CHECK_CUDA(cudaMalloc(&d.scales, 2 * groups * sizeof(float)));
    std::vector<float> ones(2 * groups, 1.f);
    CHECK_CUDA(cudaMemcpy(d.scales, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    sf_grouped_sm90_args args;
    memset(&args, 0, sizeof args);
    args.dtype = fp8 ? SF_FLOAT8_E4M3 : SF_BFLOAT16;
    args.groups = groups;
    args.n = n;
    args.k = k;
    args.a = d.a;
    args.lda = k;
    args.out = d.out;
    args.ldo = n;
    for (int g = 0; g < groups; ++g) {
        args.b[g] = (char *)wbuf + (int64_t)g * n * k * es;
        args.ldb[g] = k;
        args.row_start[g + 1] = args.row_start[g] + splits[g];
        args.a_scale_inv[g] = d.scales;
        args.b_scale_inv[g] = d.scales + groups;
    }
    const double flops = 2.0 * rows * n * k;
    float t_var[4];
    for (int v = 0; v < 4; ++v)
        t_var[v] = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&args, v, NULL)); }, 5, 20);
    const float t_kernel = t_var[0];
    /* the same call with the ends in device memory (every SM launched, the tiles counted there) */
    sf_grouped_sm90_args dev_args = args;
    int32_t *ends;
    std::vector<int32_t> host_ends(groups);
    for (int g = 0; g < groups; ++g)
        host_ends[g] = (int32_t)args.row_start[g + 1];
    CHECK_CUDA(cudaMalloc(&ends, groups * sizeof(int32_t)));
    CHECK_CUDA(cudaMemcpy(ends, host_ends.data(), groups * sizeof(int32_t), cudaMemcpyHostToDevice));
    dev_args.device_row_end = ends;
    const float t_dev = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&dev_args, 0, NULL)); }, 5, 20);
    const double h_kernel = host_us([&] { CHECK_SF(sf_grouped_sm90_run(&args, NULL)); });
    const double h_dev = host_us([&] { CHECK_SF(sf_grouped_sm90_run(&dev_args, NULL)); });
    cudaFree(ends);

    /* the library's per-group cuBLASLt route */
    const sf_dtype dt = fp8 ? SF_FLOAT8_E4M3 : SF_BFLOAT16;
    sf_tensor ta = on_gpu(d.a, dt, {rows, k}), tout = on_gpu(d.out, SF_BFLOAT16, {rows, n});
    std::vector<sf_tensor> tb(groups);
    for (int g = 0; g < groups; ++g)
        tb[g] = on_gpu(args.b[g], dt, {n, k});
    sf_tensor sa = on_gpu(d.scales, SF_FLOAT32, {1}), sb = sa;
    void *ws;
    const int64_t ws_bytes = 32 << 20;
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    sf_tensor tws = on_gpu(ws, SF_UINT8, {ws_bytes});
    float t_lib[2];
    double h_lib[2];
    for (int li = 0; li < 2; ++li) {
        sf_grouped_gemm_args ga;
        sf_grouped_gemm_args_init(&ga);
        ga.num_groups = groups;
        ga.m_splits = splits.data();
        ga.a = &ta;
        ga.b_list = tb.data();
        ga.out = &tout;
        ga.transb = 1;
        ga.workspace = &tws;
        ga.lanes = li == 0 ? 1 : 0;
        ga.kernel = SF_GROUPED_KERNEL_CUBLASLT; /* (auto would take the sm90 kernel here) */
        if (fp8) {
            ga.a_scale_inv = &sa;
            ga.b_scale_inv = &sb;
            ga.fast_accum = 1;
        }
        t_lib[li] = time_ms([&] { CHECK_SF(sf_grouped_gemm(&ga, NULL)); }, 5, 20);
        h_lib[li] = host_us([&] { CHECK_SF(sf_grouped_gemm(&ga, NULL)); });
    }
    printf("bench %-14s %s G=%2d n=%5lld k=%5lld: kernel %.3f ms %.0f TFLOP/s (ends on the device %.0f; stores "
           "from registers, 3 stages + 4 boxes, columns first: %.0f %.0f %.0f) | "
           "cuBLASLt one stream %.3f ms %.0f (%.2fx) | default lanes %.3f ms %.0f (%.2fx)\n",
           name, fp8 ? "e4m3" : "bf16", groups, (long long)n, (long long)k, t_kernel, flops / t_kernel / 1e9,
           flops / t_dev / 1e9, flops / t_var[1] / 1e9, flops / t_var[2] / 1e9, flops / t_var[3] / 1e9, t_lib[0],
           flops / t_lib[0] / 1e9, t_lib[0] / t_kernel, t_lib[1], flops / t_lib[1] / 1e9, t_lib[1] / t_kernel);
    printf("host %-14s %s G=%2d: us a call: kernel %.1f (ends on the device %.1f) | cuBLASLt one stream %.1f | "
           "default lanes %.1f\n", name, fp8 ? "e4m3" : "bf16", groups, h_kernel, h_dev, h_lib[0], h_lib[1]);
    cudaFree(wbuf);
    cudaFree(ws);
}

static std::vector<int64_t> random_splits(int64_t rows, int groups, int multiple)
{
    std::vector<int64_t> s(groups, 0);
    for (int64_t u = 0; u < rows / multiple; ++u)
        s[rng_next() % groups] += multiple;
    return s;
}

int main(int argc, char **argv)
{
    rng_seed();
    int dev = 0;
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
    sf_grouped_sm90_args probe;
    memset(&probe, 0, sizeof probe);
    probe.dtype = SF_BFLOAT16;
    probe.groups = 1;
    probe.n = probe.k = probe.lda = probe.ldo = 8;
    probe.ldb[0] = 8;
    static char dummy[64] __attribute__((aligned(16)));
    probe.a = probe.b[0] = dummy;
    probe.out = dummy;
    const char *why = sf_grouped_sm90_unfit(&probe);
    if (why) {
        printf("the kernel cannot run here: %s\n", why);
        return 1;
    }

    /* correctness */
    for (int fp8 = 0; fp8 < 2; ++fp8) {
        const int64_t kal = fp8 ? 16 : 8;
        check_case({(bool)fp8, 1, {128}, 256, 64 * (fp8 ? 2 : 1)});
        check_case({(bool)fp8, 1, {1}, 8, kal});
        check_case({(bool)fp8, 3, {0, 200, 57}, 264, 5 * kal});
        check_case({(bool)fp8, 4, {129, 0, 0, 383}, 520, 24 * kal});
        check_case({(bool)fp8, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160});
        check_case({(bool)fp8, 2, {700, 300}, 72, 1024});
        check_case({(bool)fp8, 5, {0, 0, 0, 0, 33}, 512, 3584 / (fp8 ? 2 : 1)});
        for (int rep = 0; rep < 4; ++rep) {
            const int groups = 1 + (int)(rng_next() % 12);
            const int64_t n = 8 * (1 + (int64_t)(rng_next() % 80)), k = kal * (1 + (int64_t)(rng_next() % 40));
            check_case({(bool)fp8, groups, random_splits(64 + rng_next() % 1500, groups, 1), n, k});
        }
    }
    check_case({false, 64, random_splits(4096, 64, 1), 256, 256});
    /* the ends on the device (the router's counts, no host wait) */
    for (int fp8 = 0; fp8 < 2; ++fp8) {
        const int64_t kal = fp8 ? 16 : 8;
        check_case({(bool)fp8, 3, {0, 200, 57}, 264, 5 * kal}, 0, true);
        check_case({(bool)fp8, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160}, 0, true);
        check_case({(bool)fp8, 5, {0, 0, 0, 0, 0}, 512, 64 * (fp8 ? 2 : 1)}, 0, true);
    }
    check_case({false, 64, random_splits(4096, 64, 1), 256, 256}, 0, true);
    for (int v = 1; v < 4; ++v)
        for (int fp8 = 0; fp8 < 2; ++fp8) {
            check_case({(bool)fp8, 4, {129, 0, 0, 383}, 520, 24 * (fp8 ? 16 : 8)}, v);
            check_case({(bool)fp8, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160}, v);
        }

    if (argc > 1 && !strcmp(argv[1], "--no-bench"))
        return check_finish("check_grouped_sm90");
    const int64_t rows = 32768, hidden = 1024, ffn = 3584;
    for (int fp8 = 0; fp8 < 2; ++fp8)
        for (int groups : {8, 64}) {
            std::vector<int64_t> bal(groups, rows / groups);
            std::vector<int64_t> rnd = random_splits(rows, groups, 16);
            bench("fc1 balanced", fp8, groups, bal, 2 * ffn, hidden);
            bench("fc2 balanced", fp8, groups, bal, hidden, ffn);
            bench("fc1 random", fp8, groups, rnd, 2 * ffn, hidden);
            bench("fc2 random", fp8, groups, rnd, hidden, ffn);
        }
    return check_finish("check_grouped_sm90");
}
