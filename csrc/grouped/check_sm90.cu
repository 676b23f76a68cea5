// check-links: gemm
/*
 * check_sm90.cu - standalone check and benchmark of the grouped
 * GEMM's Hopper kernel (grouped_sm90_cuda.cu).
 *
 * Correctness: fresh random bf16 operands (and FP8 codes, e4m3 x e4m3 and
 * e5m2 x e4m3, with random per-group scale inverses) at group row counts
 * that are and are not multiples of the 128-row tile, empty groups among
 * them, k with and without a partial 128-byte block, n not a multiple of
 * the column tile, each group's B in its own allocation; out poisoned with
 * NaN, with padding columns (ldo > n) and rows past the last group that
 * must stay poisoned; some cases hand the groups' ends over in device
 * memory (device_row_end), with 40 more rows of a and out than the groups
 * take.  FP8 runs both accumulations: fast_accum=1 (the 128 x 256 shape,
 * "fast") and fast_accum=0 (the 128 x 128 shape that promotes each 128-k
 * block's sum into float32, "split").  Every output is held to a float64
 * reference of the same inputs:
 *   bf16          |out - ref| <= 2^-8 |ref| + 2^-12 sum_k |a b|
 *                 (bf16 output rounding plus float32 accumulation);
 *   FP8 fast      2^-8 |ref| + 2^-10 sum_k |a b|: Hopper's FP8 wgmma keeps
 *                 fewer accumulator bits than float32 (about 13 of
 *                 mantissa), measured on an H100 at up to 2^-11 sum_k |a b|
 *                 (s45);
 *   FP8 split     2^-8 |ref| + 2^-10 sum_k |a b|, the fast bound: the
 *                 reduced-precision sum spans one k-block (4 wgmma steps)
 *                 before float32 takes over, so its error is that of a
 *                 k <= 128 product summed over the blocks; with mixed
 *                 signs that is as large as the fast kernel's (s47: a
 *                 random k = 160 case reached 1.0 x 2^-11, half this
 *                 bound).  Where the split form differs is a long sum of
 *                 one sign, the "same sign" cases below, held to 2^-11
 *                 (s47: 0.76-0.85 of it; the fast kernel 31-32 times it).
 * The random FP8 codes mix signs and 2^-9 .. 15 magnitudes, where the
 * reduced-precision error is mostly each step's alignment of products of
 * different sizes; two "same sign" cases (every code positive, magnitudes
 * 0.5 .. 3.75, k = 7,168: the running sum grows with k, which is where
 * fast accumulation loses bits) hold the split kernel to its bound and
 * print what the fast kernel's error is on the same operands against that
 * bound (an "info" line, not a pass or fail: the promotion's effect, on
 * a GPU whose accumulator is what it is).
 * Speed: Mixtral-small's expert products (fc1 [rows, 1024] x [7168, 1024]^T,
 * fc2 [rows, 3584] x [1024, 3584]^T, 32,768 routed rows) at 8 and 64 experts,
 * balanced and random splits, against the library's per-group cuBLASLt
 * route (sf_grouped_gemm, one stream and its default lanes), TFLOP/s; the
 * kernel's other tile shapes (sf_grouped_sm90_run_variant) and the
 * library's shape with the groups' ends in device memory beside it; and
 * the host time of one call of each (10 issued back to back, no waiting).
 * Their input gradients ("bench dgrad": dy [rows, n_out] times the
 * transposed weights, as a [rows, N] x b_g [K, N]^T with out [rows, K]:
 * fc1's n = 1,024, k = 7,168, fc2's n = 3,584, k = 1,024) in e5m2 x e4m3
 * (the HYBRID format) and e4m3 x e4m3 with fast_accum=0, the promoted
 * kernel and its other shapes (one temporary; 4 stages), the fast kernel
 * on the same operands, against the cuBLASLt route with fast_accum=0.
 */
#include <chrono>
#include <initializer_list>

#include "core/check_util.h"
#include "core/float_bits.h"
#include "grouped/grouped_sm90.h"
#include "seqfuse.h"

/* The element kinds (a x b): bf16 x bf16, e4m3 x e4m3, e5m2 x e4m3. */
enum { BF16 = 0, E4M3 = 1, E5M2 = 2 };

static const char *kind_name(int kind) { return kind == BF16 ? "bf16" : kind == E4M3 ? "e4m3" : "e5m2xe4m3"; }

static float e4m3_to_f32(uint8_t c)
{
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    const float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.f + m / 8.f, e - 7);
    return s ? -v : v;
}

static float e5m2_to_f32(uint8_t c)
{
    const int s = c >> 7, e = (c >> 2) & 31, m = c & 3;
    const float v = e == 0 ? ldexpf((float)m, -16) : ldexpf(1.f + m / 4.f, e - 15);
    return s ? -v : v;
}

/* A random code of magnitude at most 15 (e4m3 exponent field <= 10, e5m2
 * <= 18), subnormals included; same_sign: positive, exponent 2^-1 .. 2^1
 * (0.5 .. 3.75 / 3.5), so products lie within a factor of 56 of each other. */
static uint8_t random_fp8(bool e5m2, bool same_sign)
{
    const uint64_t r = rng_next();
    if (same_sign) {
        const int e = (int)((r >> 8) % 3) - 1, m = (int)(r >> 16);
        return e5m2 ? (uint8_t)(((e + 15) << 2) | (m & 3)) : (uint8_t)(((e + 7) << 3) | (m & 7));
    }
    uint8_t code;
    do {
        code = (uint8_t)(rng_next() >> 56);
    } while (e5m2 ? ((code >> 2) & 31) > 18 : ((code & 0x7f) == 0x7f || ((code >> 3) & 0xf) > 10));
    return code;
}

struct Problem {
    int kind;  /* BF16, E4M3, E5M2 */
    bool fast; /* FP8: fast_accum=1 (the 128 x 256 shape), else 0 (the promoted 128 x 128 shape) */
    int groups;
    std::vector<int64_t> splits;
    int64_t n, k;
    bool same_sign = false; /* FP8: positive codes of one octave's neighbourhood (random_fp8) */
};

static const char *accum_name(const Problem &p) { return p.kind == BF16 ? "" : p.fast ? " fast" : " split"; }

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
    if (p.kind != BF16) {
        const bool e5m2 = p.kind == E5M2;
        h.a8.resize(rows * p.k);
        h.b8.assign(p.groups, std::vector<uint8_t>(p.n * p.k));
        for (int64_t i = 0; i < rows * p.k; ++i) {
            h.a8[i] = random_fp8(e5m2, p.same_sign);
            h.a[i] = e5m2 ? e5m2_to_f32(h.a8[i]) : e4m3_to_f32(h.a8[i]);
        }
        for (int g = 0; g < p.groups; ++g)
            for (int64_t i = 0; i < p.n * p.k; ++i)
                h.b[g][i] = e4m3_to_f32(h.b8[g][i] = random_fp8(false, p.same_sign));
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
    const bool fp8 = p.kind != BF16;
    const int64_t rows = total_rows(p), es = fp8 ? 1 : 2;
    CHECK_CUDA(cudaMalloc(&d.a, a_rows * p.k * es + 16));
    CHECK_CUDA(cudaMemset(d.a, 0x3C, a_rows * p.k * es)); /* bf16 0.0115, e4m3 1.5, e5m2 1.0 */
    CHECK_CUDA(cudaMemcpy(d.a, fp8 ? (const void *)h.a8.data() : (const void *)h.a16.data(), rows * p.k * es,
                          cudaMemcpyHostToDevice));
    d.b.resize(p.groups);
    for (int g = 0; g < p.groups; ++g) {
        CHECK_CUDA(cudaMalloc(&d.b[g], p.n * p.k * es));
        CHECK_CUDA(cudaMemcpy(d.b[g], fp8 ? (const void *)h.b8[g].data() : (const void *)h.b16[g].data(),
                              p.n * p.k * es, cudaMemcpyHostToDevice));
    }
    CHECK_CUDA(cudaMalloc(&d.out, out_rows * ldo * 2));
    if (fp8) {
        CHECK_CUDA(cudaMalloc(&d.scales, 2 * p.groups * sizeof(float)));
        CHECK_CUDA(cudaMemcpy(d.scales, h.sa.data(), p.groups * sizeof(float), cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(d.scales + p.groups, h.sb.data(), p.groups * sizeof(float), cudaMemcpyHostToDevice));
    }
}

/* the kernel's dtypes and accumulation for a problem */
static void set_kind(int kind, bool fast, sf_grouped_sm90_args &args)
{
    args.a_dtype = kind == BF16 ? SF_BFLOAT16 : kind == E4M3 ? SF_FLOAT8_E4M3 : SF_FLOAT8_E5M2;
    args.b_dtype = kind == BF16 ? SF_BFLOAT16 : SF_FLOAT8_E4M3;
    args.fast_accum = fast ? 1 : 0;
}

static void fill_args(const Problem &p, const DevOps &d, int64_t ldo, sf_grouped_sm90_args &args)
{
    memset(&args, 0, sizeof args);
    set_kind(p.kind, p.fast, args);
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
        if (p.kind != BF16) {
            args.a_scale_inv[g] = d.scales + g;
            args.b_scale_inv[g] = d.scales + p.groups + g;
        }
    }
    args.device_id = 0;
}

/* log2 of the bound's sum_k |a b| coefficient (the header's table) */
static int mag_exponent(const Problem &p) { return p.kind == BF16 ? -12 : !p.fast && p.same_sign ? -11 : -10; }

/* The outputs of the groups' rows against the float64 reference under p's
 * bound: how many are off and the worst err / tol. */
static void compare(const Problem &p, const HostOps &h, const std::vector<uint16_t> &out, int64_t ldo, int64_t *bad,
                    double *worst)
{
    *bad = 0;
    *worst = 0;
    int64_t r0 = 0;
    for (int g = 0; g < p.groups; ++g) {
        const double scale = p.kind != BF16 ? (double)h.sa[g] * h.sb[g] : 1.0;
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
                const double err = fabs(got - ref), tol = ldexp(fabs(ref), -8) + ldexp(mag, mag_exponent(p)) + 1e-30;
                if (!(err <= tol))
                    ++*bad;
                *worst = std::max(*worst, err / tol);
            }
        r0 += p.splits[g];
    }
}

/* device_ends: the groups' end rows handed over in device memory
 * (args.device_row_end), a and out 40 rows longer than the groups take
 * (rows past the last end: read by no group, left untouched in out); an
 * empty group's end is written 5 rows below the previous one, which the
 * kernel must clamp back.  with_fast (a split problem): the fast kernel
 * run on the same operands afterwards, its worst err / tol under the split
 * bound printed as information. */
static void check_case(const Problem &p, int variant = 0, bool device_ends = false, bool with_fast = false)
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
    compare(p, h, out, ldo, &bad, &worst);
    for (int64_t r = 0; r < out_rows; ++r)
        for (int64_t c = (r < rows ? p.n : 0); c < ldo; ++c)
            untouched_bad += out[r * ldo + c] != 0xFFFF;
    char what[320];
    cudaFree(ends);
    snprintf(what, sizeof what, "variant %d %s%s%s%s groups=%d rows=%lld n=%lld k=%lld: %lld outputs off (worst "
             "err/tol %.3g), %lld padding elements written", variant, kind_name(p.kind), accum_name(p),
             p.same_sign ? " same sign" : "", device_ends ? " device ends" : "", p.groups, (long long)rows,
             (long long)p.n, (long long)p.k, (long long)bad, worst, (long long)untouched_bad);
    check_report(bad == 0 && untouched_bad == 0, what);
    if (bad || untouched_bad || getenv("CHECK_VERBOSE"))
        printf("  %s\n", what);
    if (with_fast && p.kind != BF16 && !p.fast) {
        sf_grouped_sm90_args fast = args;
        fast.fast_accum = 1;
        CHECK_SF(sf_grouped_sm90_run(&fast, NULL));
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaMemcpy(out.data(), d.out, out.size() * 2, cudaMemcpyDeviceToHost));
        int64_t fast_bad;
        double fast_worst;
        compare(p, h, out, ldo, &fast_bad, &fast_worst);
        printf("info %s same sign k=%lld: the split kernel's worst err/tol %.3g; the fast kernel on the same "
               "operands %.3g under the split bound, %lld of %lld outputs over it\n", kind_name(p.kind),
               (long long)p.k, worst, fast_worst, (long long)fast_bad, (long long)(rows * p.n));
    }
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

/* A timed call's operands: random bits are enough for timing (finite
 * values); the experts' b in one stacked buffer, as the modules keep it;
 * per-group scale inverses of 1. */
struct BenchOps {
    DevOps d;
    void *wbuf = nullptr, *ws = nullptr;
    int32_t *ends = nullptr;
    sf_grouped_sm90_args args, dev_args; /* the host's row starts; the ends in device memory */
    ~BenchOps()
    {
        cudaFree(wbuf);
        cudaFree(ws);
        cudaFree(ends);
    }
};

static void bench_ops(BenchOps &o, int kind, bool fast, int groups, const std::vector<int64_t> &splits, int64_t n,
                      int64_t k)
{
    int64_t rows = 0;
    for (int64_t s : splits)
        rows += s;
    const int64_t es = kind == BF16 ? 2 : 1;
    CHECK_CUDA(cudaMalloc(&o.d.a, rows * k * es));
    CHECK_CUDA(cudaMemset(o.d.a, 0x22, rows * k * es));
    o.d.b.assign(groups, nullptr);
    CHECK_CUDA(cudaMalloc(&o.wbuf, groups * n * k * es));
    CHECK_CUDA(cudaMemset(o.wbuf, 0x11, groups * n * k * es));
    CHECK_CUDA(cudaMalloc(&o.d.out, rows * n * 2));
    CHECK_CUDA(cudaMalloc(&o.d.scales, 2 * groups * sizeof(float)));
    std::vector<float> ones(2 * groups, 1.f);
    CHECK_CUDA(cudaMemcpy(o.d.scales, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    sf_grouped_sm90_args &args = o.args;
    memset(&args, 0, sizeof args);
    set_kind(kind, fast, args);
    args.groups = groups;
    args.n = n;
    args.k = k;
    args.a = o.d.a;
    args.lda = k;
    args.out = o.d.out;
    args.ldo = n;
    for (int g = 0; g < groups; ++g) {
        args.b[g] = (char *)o.wbuf + (int64_t)g * n * k * es;
        args.ldb[g] = k;
        args.row_start[g + 1] = args.row_start[g] + splits[g];
        args.a_scale_inv[g] = o.d.scales;
        args.b_scale_inv[g] = o.d.scales + groups;
    }
    /* the same call with the ends in device memory (every SM launched, the tiles counted there) */
    o.dev_args = args;
    std::vector<int32_t> host_ends(groups);
    for (int g = 0; g < groups; ++g)
        host_ends[g] = (int32_t)args.row_start[g + 1];
    CHECK_CUDA(cudaMalloc(&o.ends, groups * sizeof(int32_t)));
    CHECK_CUDA(cudaMemcpy(o.ends, host_ends.data(), groups * sizeof(int32_t), cudaMemcpyHostToDevice));
    o.dev_args.device_row_end = o.ends;
    const int64_t ws_bytes = 32 << 20;
    CHECK_CUDA(cudaMalloc(&o.ws, ws_bytes));
}

/* The library's per-group cuBLASLt route on o's operands (fast_accum as
 * o.args asks for FP8): [0] one stream, [1] its default lanes; device ms
 * and host us a call. */
static void bench_cublaslt(BenchOps &o, const std::vector<int64_t> &splits, float t_lib[2], double h_lib[2])
{
    const sf_grouped_sm90_args &args = o.args;
    const int groups = args.groups;
    const int64_t rows = args.row_start[groups], n = args.n, k = args.k;
    sf_tensor ta = on_gpu(o.d.a, args.a_dtype, {rows, k}), tout = on_gpu(o.d.out, SF_BFLOAT16, {rows, n});
    std::vector<sf_tensor> tb(groups);
    for (int g = 0; g < groups; ++g)
        tb[g] = on_gpu(args.b[g], args.b_dtype, {n, k});
    sf_tensor sa = on_gpu(o.d.scales, SF_FLOAT32, {1}), sb = sa;
    sf_tensor tws = on_gpu(o.ws, SF_UINT8, {32 << 20});
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
        if (args.a_dtype != SF_BFLOAT16) {
            ga.a_scale_inv = &sa;
            ga.b_scale_inv = &sb;
            ga.fast_accum = args.fast_accum;
        }
        t_lib[li] = time_ms([&] { CHECK_SF(sf_grouped_gemm(&ga, NULL)); }, 5, 20);
        h_lib[li] = host_us([&] { CHECK_SF(sf_grouped_gemm(&ga, NULL)); });
    }
}

static void bench(const char *name, int kind, int groups, const std::vector<int64_t> &splits, int64_t n, int64_t k)
{
    BenchOps o;
    bench_ops(o, kind, true, groups, splits, n, k);
    const double flops = 2.0 * o.args.row_start[groups] * n * k;
    float t_var[4];
    for (int v = 0; v < 4; ++v)
        t_var[v] = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.args, v, NULL)); }, 5, 20);
    const float t_kernel = t_var[0];
    const float t_dev = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.dev_args, 0, NULL)); }, 5, 20);
    const double h_kernel = host_us([&] { CHECK_SF(sf_grouped_sm90_run(&o.args, NULL)); });
    const double h_dev = host_us([&] { CHECK_SF(sf_grouped_sm90_run(&o.dev_args, NULL)); });
    float t_lib[2];
    double h_lib[2];
    bench_cublaslt(o, splits, t_lib, h_lib);
    printf("bench %-14s %s G=%2d n=%5lld k=%5lld: kernel %.3f ms %.0f TFLOP/s (ends on the device %.0f; stores "
           "from registers, 3 stages + 4 boxes, columns first: %.0f %.0f %.0f) | "
           "cuBLASLt one stream %.3f ms %.0f (%.2fx) | default lanes %.3f ms %.0f (%.2fx)\n",
           name, kind_name(kind), groups, (long long)n, (long long)k, t_kernel, flops / t_kernel / 1e9,
           flops / t_dev / 1e9, flops / t_var[1] / 1e9, flops / t_var[2] / 1e9, flops / t_var[3] / 1e9, t_lib[0],
           flops / t_lib[0] / 1e9, t_lib[0] / t_kernel, t_lib[1], flops / t_lib[1] / 1e9, t_lib[1] / t_kernel);
    printf("host %-14s %s G=%2d: us a call: kernel %.1f (ends on the device %.1f) | cuBLASLt one stream %.1f | "
           "default lanes %.1f\n", name, kind_name(kind), groups, h_kernel, h_dev, h_lib[0], h_lib[1]);
}

/* An input gradient with fast_accum=0 (kind E4M3 or E5M2): the library's
 * promoted shape, its ends on the device, variants 4 (one temporary) and 5
 * (4 stages), the fast kernel on the same operands, and cuBLASLt with
 * fast_accum=0. */
static void bench_dgrad(const char *name, int kind, int groups, const std::vector<int64_t> &splits, int64_t n,
                        int64_t k)
{
    BenchOps o;
    bench_ops(o, kind, false, groups, splits, n, k);
    const double flops = 2.0 * o.args.row_start[groups] * n * k;
    const float t_kernel = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.args, 0, NULL)); }, 5, 20);
    const float t_dev = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.dev_args, 0, NULL)); }, 5, 20);
    const float t_one = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.args, 4, NULL)); }, 5, 20);
    const float t_four = time_ms([&] { CHECK_SF(sf_grouped_sm90_run_variant(&o.args, 5, NULL)); }, 5, 20);
    sf_grouped_sm90_args fast = o.args;
    fast.fast_accum = 1;
    const float t_fast = time_ms([&] { CHECK_SF(sf_grouped_sm90_run(&fast, NULL)); }, 5, 20);
    const double h_kernel = host_us([&] { CHECK_SF(sf_grouped_sm90_run(&o.args, NULL)); });
    float t_lib[2];
    double h_lib[2];
    bench_cublaslt(o, splits, t_lib, h_lib);
    printf("bench dgrad %-14s %s G=%2d n=%5lld k=%5lld: split accumulation kernel %.3f ms %.0f TFLOP/s (ends on the "
           "device %.0f; one temporary, 4 stages: %.0f %.0f; fast accumulation %.0f) | cuBLASLt fast_accum=0 one "
           "stream %.3f ms %.0f (%.2fx) | default lanes %.3f ms %.0f (%.2fx)\n",
           name, kind_name(kind), groups, (long long)n, (long long)k, t_kernel, flops / t_kernel / 1e9,
           flops / t_dev / 1e9, flops / t_one / 1e9, flops / t_four / 1e9, flops / t_fast / 1e9, t_lib[0],
           flops / t_lib[0] / 1e9, t_lib[0] / t_kernel, t_lib[1], flops / t_lib[1] / 1e9, t_lib[1] / t_kernel);
    printf("host dgrad %-14s %s G=%2d: us a call: kernel %.1f | cuBLASLt one stream %.1f | default lanes %.1f\n",
           name, kind_name(kind), groups, h_kernel, h_lib[0], h_lib[1]);
}

static std::vector<int64_t> random_splits(int64_t rows, int groups, int multiple)
{
    std::vector<int64_t> s(groups, 0);
    for (int64_t u = 0; u < rows / multiple; ++u)
        s[rng_next() % groups] += multiple;
    return s;
}

/* The correctness cases of one kind and accumulation (kal: k's alignment, 16 bytes of elements). */
static void check_kind(int kind, bool fast)
{
    const int64_t kal = kind == BF16 ? 8 : 16, kb = 64 * (kind == BF16 ? 1 : 2); /* (kb: one 128-byte block) */
    check_case({kind, fast, 1, {128}, 256, kb});
    check_case({kind, fast, 1, {1}, 8, kal});
    check_case({kind, fast, 3, {0, 200, 57}, 264, 5 * kal});
    check_case({kind, fast, 4, {129, 0, 0, 383}, 520, 24 * kal});
    check_case({kind, fast, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160});
    check_case({kind, fast, 2, {700, 300}, 72, 1024});
    check_case({kind, fast, 5, {0, 0, 0, 0, 33}, 512, 3584 / (kind == BF16 ? 1 : 2)});
    for (int rep = 0; rep < 4; ++rep) {
        const int groups = 1 + (int)(rng_next() % 12);
        const int64_t n = 8 * (1 + (int64_t)(rng_next() % 80)), k = kal * (1 + (int64_t)(rng_next() % 40));
        check_case({kind, fast, groups, random_splits(64 + rng_next() % 1500, groups, 1), n, k});
    }
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
    probe.a_dtype = probe.b_dtype = SF_BFLOAT16;
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

    /* correctness: bf16, e4m3 and e5m2 x e4m3 with fast accumulation, then both FP8 kinds promoted */
    check_kind(BF16, true);
    check_kind(E4M3, true);
    check_kind(E5M2, true);
    check_kind(E4M3, false);
    check_kind(E5M2, false);
    check_case({BF16, true, 64, random_splits(4096, 64, 1), 256, 256});
    check_case({E5M2, false, 64, random_splits(4096, 64, 16), 256, 512});
    /* same-sign operands over a long k: the promoted sum against the fast one (info lines) */
    for (int kind : {E4M3, E5M2}) {
        Problem p{kind, false, 3, {130, 0, 61}, 200, 7168};
        p.same_sign = true;
        check_case(p, 0, false, true);
    }
    /* the ends on the device (the router's counts, no host wait) */
    for (int ka = 0; ka < 5; ++ka) {
        const int kind = ka == 0 ? BF16 : ka == 1 || ka == 3 ? E4M3 : E5M2;
        const bool fast = ka < 3;
        const int64_t kal = kind == BF16 ? 8 : 16;
        check_case({kind, fast, 3, {0, 200, 57}, 264, 5 * kal}, 0, true);
        check_case({kind, fast, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160}, 0, true);
        check_case({kind, fast, 5, {0, 0, 0, 0, 0}, 512, 64 * (kind == BF16 ? 1 : 2)}, 0, true);
    }
    check_case({BF16, true, 64, random_splits(4096, 64, 1), 256, 256}, 0, true);
    /* the other shapes: 1-3 of the fast accumulation, 4-5 of the promoted one */
    for (int v = 1; v < 4; ++v)
        for (int kind : {BF16, E4M3, E5M2}) {
            check_case({kind, true, 4, {129, 0, 0, 383}, 520, 24 * (kind == BF16 ? 8 : 16)}, v);
            check_case({kind, true, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160}, v);
        }
    for (int v = 4; v < 6; ++v)
        for (int kind : {E4M3, E5M2}) {
            check_case({kind, false, 4, {129, 0, 0, 383}, 520, 24 * 16}, v);
            check_case({kind, false, 8, {16, 300, 128, 0, 1, 255, 640, 7}, 1024, 160}, v);
            check_case({kind, false, 2, {700, 300}, 72, 1024}, v);
        }

    if (argc > 1 && !strcmp(argv[1], "--no-bench"))
        return check_finish("check_grouped_sm90");
    const int64_t rows = 32768, hidden = 1024, ffn = 3584;
    for (int kind : {BF16, E4M3})
        for (int groups : {8, 64}) {
            std::vector<int64_t> bal(groups, rows / groups);
            std::vector<int64_t> rnd = random_splits(rows, groups, 16);
            bench("fc1 balanced", kind, groups, bal, 2 * ffn, hidden);
            bench("fc2 balanced", kind, groups, bal, hidden, ffn);
            bench("fc1 random", kind, groups, rnd, 2 * ffn, hidden);
            bench("fc2 random", kind, groups, rnd, hidden, ffn);
        }
    /* the input gradients with fast_accum=0: dy [rows, n_out] x W_g [n_out, n_in] as a x (W_g^T) [n_in, n_out]^T:
     * fc1's n = hidden, k = 2 ffn; fc2's n = ffn, k = hidden */
    for (int kind : {E5M2, E4M3})
        for (int groups : {8, 64}) {
            std::vector<int64_t> bal(groups, rows / groups);
            std::vector<int64_t> rnd = random_splits(rows, groups, 16);
            bench_dgrad("fc1 balanced", kind, groups, bal, hidden, 2 * ffn);
            bench_dgrad("fc2 balanced", kind, groups, bal, ffn, hidden);
            bench_dgrad("fc1 random", kind, groups, rnd, hidden, 2 * ffn);
            bench_dgrad("fc2 random", kind, groups, rnd, ffn, hidden);
        }
    return check_finish("check_grouped_sm90");
}
