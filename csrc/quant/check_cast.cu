// check-links: moe
/*
 * check_cast.cu - standalone check and benchmark of the FP8 cast kernels.
 *
 *   1. The GPU's cvt.rn.satfinite FP8 conversion against fp8.h's integer
 *      code over every one of the 2^32 float32 bit patterns, both formats
 *      (the fast kernels use the instruction; the CPU reference uses fp8.h).
 *   2. cast_transpose (and plain cast) on the GPU against the CPU backend,
 *      bit for bit, on fresh random inputs with poisoned outputs, several
 *      shapes (aligned fast path, odd shapes, partial tiles), every dtype.
 *   3. Bandwidth of cast+transpose+amax of bf16 matrices 4096^2..16384^2
 *      against a device-to-device copy, counting bytes read and written
 *      (2 read + 1 + 1 written per element; the copy moves 2 + 2).
 *   4. cast_fp8_dbias (cast_transpose plus per-128-row column sums) against
 *      the CPU backend bit for bit; its cost is printed beside 3's.
 *   5. transpose_fp8 (FP8 bytes [M, K] -> [K, M]) against the CPU backend
 *      byte for byte (fast tiled kernel, partial tiles, the generic kernel
 *      for odd shapes and unaligned pointers), and its bandwidth at ESM-2
 *      650M's shapes against a copy of the same bytes.
 *   6. cast_fp8_grouped (the per-expert casts of expert-sorted rows in one
 *      call) against the CPU backend bit for bit: delayed and current
 *      scaling, scale / amax / scale_inv as stride-3 vectors (a
 *      ScalingState's slots), empty, tiny, unbalanced and many (> 64, more
 *      than one launch) groups, poisoned outputs; and its time against one
 *      sf_cast_fp8 (delayed) / sf_cast_fp8_current call per group.
 *   7. cast_fp8_current_list (a grouped layer's weights, each with its own
 *      amax, in one call) against the CPU backend bit for bit, and its time
 *      against one sf_cast_fp8_current call per weight.
 *   8. swiglu_cast_fp8_grouped (6's cast of silu(gate) * up * prob, computed
 *      in the same pass) against the CPU backend: the SwiGLU's sigmoid is
 *      libm's on the host and the hardware approximations' on the device
 *      (moe.h), a few ulp apart, which can move a value across a bf16
 *      rounding boundary, so the check allows FP8
 *      codes one step apart in at most 1 in 1,000 elements and scales within
 *      a bf16 ulp (the Python tests compare the GPU's fused cast with its
 *      unfused kernels bit for bit); its time at Mixtral-small's shape.
 *   9. swiglu_backward_cast_fp8_grouped (the SwiGLU's backward with the down
 *      projection's transposed FP8 operand and dx's own FP8 copies in one
 *      pass) against the CPU backend: dx and dprobs within a few units of
 *      the dtype's rounding, FP8 codes one step apart in at most 1 in 1,000
 *      elements (8's expf rule), the scale inverses and amax within a bf16
 *      ulp; dout dense and in padded blocks, with and without dx and the
 *      gradient copies, poisoned outputs.  Its time at Mixtral-small's shape
 *      (what GroupedMLP's FP8 backward asks for: no dx, both gradient copies)
 *      and at Llama 1B's MLP (one group, no probs: K split among CTAs)
 *      against a device copy's rate.
 *  10. cast_fp8_grouped_ends (the groups' ends read on the device; plain and
 *      SwiGLU) against the CPU backend (8's rule where SwiGLU, else bit for
 *      bit), ends past M clamped, rows past the last end; its time at
 *      Mixtral-small's shapes.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "quant/fp8_cuda.cuh"
#include "seqfuse.h"

__global__ void exhaustive_kernel(int e5m2, unsigned long long *mismatches, unsigned *first)
{
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    unsigned long long bad = 0;
    for (uint64_t u = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; u < (1ull << 32); u += stride) {
        float f = sf_bits_f32((uint32_t)u);
        uint32_t hw = e5m2 ? sf_cvt2<true>(f, 0.0f) & 0xffu : sf_cvt2<false>(f, 0.0f) & 0xffu;
        uint32_t sw = sf_f32_to_fp8(f, e5m2);
        if (hw != sw) {
            bad++;
            atomicMin(first, (unsigned)u);
        }
    }
    if (bad)
        atomicAdd(mismatches, bad);
}

static void check_exhaustive(void)
{
#if !defined(SF_FP8_SOFTWARE_CVT)
    unsigned long long *d_bad;
    unsigned *d_first;
    CHECK_CUDA(cudaMalloc(&d_bad, 8));
    CHECK_CUDA(cudaMalloc(&d_first, 4));
    for (int e5m2 = 0; e5m2 < 2; ++e5m2) {
        unsigned long long bad = 0;
        unsigned first = 0xffffffffu;
        CHECK_CUDA(cudaMemcpy(d_bad, &bad, 8, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(d_first, &first, 4, cudaMemcpyHostToDevice));
        exhaustive_kernel<<<132 * 16, 256>>>(e5m2, d_bad, d_first);
        CHECK_CUDA(cudaMemcpy(&bad, d_bad, 8, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(&first, d_first, 4, cudaMemcpyDeviceToHost));
        char what[200];
        snprintf(what, sizeof what,
                 "hardware cvt vs fp8.h over all 2^32 floats (%s): %llu mismatches, first 0x%08x -> sw 0x%02x",
                 e5m2 ? "E5M2" : "E4M3", bad, first,
                 bad ? sf_f32_to_fp8(sf_bits_f32(first), e5m2) : 0);
        printf("%s\n", what);
        check_report(bad == 0, what);
    }
    cudaFree(d_bad);
    cudaFree(d_first);
#endif
}

/* dbias: the sf_cast_fp8_dbias variant (transpose on), its per-128-row column
 * sums compared bit for bit too. */
static void run_case(sf_dtype dtype, int64_t m, int64_t k, int e5m2, int transpose, int64_t offset,
                     int dbias = 0)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    size_t es = sf_dtype_size(dtype);
    int64_t n = m * k;
    std::vector<uint8_t> host((n + offset) * es);
    for (int64_t i = 0; i < n + offset; ++i) {
        float v = rng_normal() * 300.0f;
        if (i % 53 == 0) v *= 1e-7f;
        if (dtype == SF_FLOAT32) memcpy(&host[i * 4], &v, 4);
        else {
            uint16_t h = dtype == SF_BFLOAT16 ? sf_f32_to_bf16(v) : sf_f32_to_f16(v);
            memcpy(&host[i * 2], &h, 2);
        }
    }
    void *dx;
    uint8_t *dout, *dout_t;
    float *dscalars; /* scale, amax, scale_inv */
    CHECK_CUDA(cudaMalloc(&dx, host.size()));
    CHECK_CUDA(cudaMalloc(&dout, n + 1));
    CHECK_CUDA(cudaMalloc(&dout_t, n + 1));
    CHECK_CUDA(cudaMalloc(&dscalars, 12));
    CHECK_CUDA(cudaMemcpy(dx, host.data(), host.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, n + 1));
    CHECK_CUDA(cudaMemset(dout_t, 0xff, n + 1));
    float scalars[3] = {1.75f, 0.0f, -1.0f};
    CHECK_CUDA(cudaMemcpy(dscalars, scalars, 12, cudaMemcpyHostToDevice));

    int64_t shape[2] = {m, k}, tshape[2] = {k, m}, one[1] = {1};
    sf_dtype fp8 = e5m2 ? SF_FLOAT8_E5M2 : SF_FLOAT8_E4M3;
    sf_tensor x, out, out_t, scale, amax, si;
    sf_tensor_init(&x, (char *)dx + offset * es, dtype, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&out, dout, fp8, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&out_t, dout_t, fp8, 2, tshape, SF_CUDA, 0);
    sf_tensor_init(&scale, dscalars, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&amax, dscalars + 1, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&si, dscalars + 2, SF_FLOAT32, 1, one, SF_CUDA, 0);
    int64_t sshape[2] = {(m + 127) / 128, k};
    std::vector<float> csums(sshape[0] * k), gsums(sshape[0] * k);
    float *dsums = NULL;
    sf_tensor sums, hsums;
    if (dbias) {
        CHECK_CUDA(cudaMalloc(&dsums, gsums.size() * 4));
        CHECK_CUDA(cudaMemset(dsums, 0xff, gsums.size() * 4));
        sf_tensor_init(&sums, dsums, SF_FLOAT32, 2, sshape, SF_CUDA, 0);
        sf_tensor_init(&hsums, csums.data(), SF_FLOAT32, 2, sshape, SF_CPU, 0);
        CHECK_SF(sf_cast_fp8_dbias(&x, &scale, &amax, &out, &out_t, &si, &sums, NULL, NULL));
    } else {
        CHECK_SF(sf_cast_fp8(&x, &scale, &amax, &out, transpose ? &out_t : NULL, &si, NULL));
    }

    std::vector<uint8_t> cout(n), cout_t(n), gout(n), gout_t(n);
    float cs[3] = {1.75f, 0.0f, -1.0f}, gs[3];
    sf_tensor hx, hout, hout_t, hscale, hamax, hsi;
    sf_tensor_init(&hx, host.data() + offset * es, dtype, 2, shape, SF_CPU, 0);
    sf_tensor_init(&hout, cout.data(), fp8, 2, shape, SF_CPU, 0);
    sf_tensor_init(&hout_t, cout_t.data(), fp8, 2, tshape, SF_CPU, 0);
    sf_tensor_init(&hscale, cs, SF_FLOAT32, 1, one, SF_CPU, 0);
    sf_tensor_init(&hamax, cs + 1, SF_FLOAT32, 1, one, SF_CPU, 0);
    sf_tensor_init(&hsi, cs + 2, SF_FLOAT32, 1, one, SF_CPU, 0);
    if (dbias) {
        CHECK_SF(sf_cast_fp8_dbias(&hx, &hscale, &hamax, &hout, &hout_t, &hsi, &hsums, NULL, NULL));
        CHECK_CUDA(cudaMemcpy(gsums.data(), dsums, gsums.size() * 4, cudaMemcpyDeviceToHost));
        cudaFree(dsums);
    } else {
        CHECK_SF(sf_cast_fp8(&hx, &hscale, &hamax, &hout, transpose ? &hout_t : NULL, &hsi, NULL));
    }
    CHECK_CUDA(cudaMemcpy(gout.data(), dout, n, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gout_t.data(), dout_t, n, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gs, dscalars, 12, cudaMemcpyDeviceToHost));
    uint8_t guard[2];
    CHECK_CUDA(cudaMemcpy(&guard[0], dout + n, 1, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(&guard[1], dout_t + n, 1, cudaMemcpyDeviceToHost));
    int ok = memcmp(cout.data(), gout.data(), n) == 0 && memcmp(cs, gs, 12) == 0 &&
             guard[0] == 0xff && guard[1] == 0xff;
    if (transpose)
        ok = ok && memcmp(cout_t.data(), gout_t.data(), n) == 0;
    if (dbias)
        ok = ok && memcmp(csums.data(), gsums.data(), csums.size() * 4) == 0;
    char what[200];
    snprintf(what, sizeof what, "cast%s%s %s -> %s [%lld, %lld] offset %lld: amax gpu %g cpu %g",
             transpose ? "_transpose" : "", dbias ? "_dbias" : "", sf_dtype_name(dtype), sf_dtype_name(fp8),
             (long long)m, (long long)k, (long long)offset, gs[1], cs[1]);
    check_report(ok, what);
    cudaFree(dx);
    cudaFree(dout);
    cudaFree(dout_t);
    cudaFree(dscalars);
}

/* cast+transpose+amax of a bf16 [m, k] matrix to E4M3 against a copy of the
 * same bytes (2 read + 1 + 1 written per element; the copy moves 2 + 2), and
 * the dbias variant beside it (its extra work: the per-128-row column sums
 * and their [m/128, k] float32 write). */
static void bandwidth(int64_t m, int64_t k)
{
    int64_t n = m * k;
    void *dx, *copy;
    uint8_t *dout, *dout_t;
    float *ds, *dsums;
    CHECK_CUDA(cudaMalloc(&dx, n * 2));
    CHECK_CUDA(cudaMalloc(&copy, n * 2));
    CHECK_CUDA(cudaMalloc(&dout, n));
    CHECK_CUDA(cudaMalloc(&dout_t, n));
    CHECK_CUDA(cudaMalloc(&ds, 12));
    CHECK_CUDA(cudaMalloc(&dsums, (m + 127) / 128 * k * 4));
    CHECK_CUDA(cudaMemset(dx, 0x3f, n * 2));
    float one_f = 1.0f;
    CHECK_CUDA(cudaMemcpy(ds, &one_f, 4, cudaMemcpyHostToDevice));
    int64_t shape[2] = {m, k}, tshape[2] = {k, m}, sshape[2] = {(m + 127) / 128, k}, one[1] = {1};
    sf_tensor x, out, out_t, scale, amax, si, sums;
    sf_tensor_init(&x, dx, SF_BFLOAT16, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&out, dout, SF_FLOAT8_E4M3, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&out_t, dout_t, SF_FLOAT8_E4M3, 2, tshape, SF_CUDA, 0);
    sf_tensor_init(&scale, ds, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&amax, ds + 1, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&si, ds + 2, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&sums, dsums, SF_FLOAT32, 2, sshape, SF_CUDA, 0);
    float ms = time_ms([&] { CHECK_SF(sf_cast_fp8(&x, &scale, &amax, &out, &out_t, &si, NULL)); });
    float fused = time_ms([&] { CHECK_SF(sf_cast_fp8_dbias(&x, &scale, &amax, &out, &out_t, &si, &sums, NULL, NULL)); });
    float copy_ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(copy, dx, n * 2, cudaMemcpyDeviceToDevice)); });
    double tbs = 4.0 * n / ms / 1e9, copy_tbs = 4.0 * n / copy_ms / 1e9;
    printf("cast_transpose+amax bf16 [%lld, %lld]: %.4f ms = %.2f TB/s (read+write); copy %.4f ms = %.2f TB/s; "
           "%.0f%% of copy; with dbias sums %.4f ms (%.2fx)\n", (long long)m, (long long)k, ms, tbs, copy_ms,
           copy_tbs, 100.0 * tbs / copy_tbs, fused, fused / ms);
    cudaFree(dx);
    cudaFree(copy);
    cudaFree(dout);
    cudaFree(dout_t);
    cudaFree(ds);
    cudaFree(dsums);
}

/* transpose_fp8 of random bytes [m, k] (data offset by `offset` bytes) on the
 * GPU, poisoned output, against the CPU backend. */
static void run_transpose_case(int64_t m, int64_t k, int offset)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    int64_t n = m * k;
    std::vector<uint8_t> h(n), cpu_t(n), gpu_t(n);
    for (auto &b : h)
        b = (uint8_t)(rng_next() >> 24);
    uint8_t *din, *dout;
    CHECK_CUDA(cudaMalloc(&din, n + offset));
    CHECK_CUDA(cudaMalloc(&dout, n));
    CHECK_CUDA(cudaMemcpy(din + offset, h.data(), n, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, n));
    int64_t shape[2] = {m, k}, shape_t[2] = {k, m};
    sf_tensor c_in, c_out, g_in, g_out;
    sf_tensor_init(&c_in, h.data(), SF_FLOAT8_E4M3, 2, shape, SF_CPU, 0);
    sf_tensor_init(&c_out, cpu_t.data(), SF_FLOAT8_E4M3, 2, shape_t, SF_CPU, 0);
    sf_tensor_init(&g_in, din + offset, SF_FLOAT8_E4M3, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&g_out, dout, SF_FLOAT8_E4M3, 2, shape_t, SF_CUDA, 0);
    CHECK_SF(sf_transpose_fp8(&c_in, &c_out, NULL));
    CHECK_SF(sf_transpose_fp8(&g_in, &g_out, NULL));
    CHECK_CUDA(cudaMemcpy(gpu_t.data(), dout, n, cudaMemcpyDeviceToHost));
    char what[160];
    snprintf(what, sizeof what, "transpose_fp8 [%lld, %lld] offset %d", (long long)m, (long long)k, offset);
    check_report(memcmp(cpu_t.data(), gpu_t.data(), n) == 0, what);
    cudaFree(din);
    cudaFree(dout);
}

static void transpose_bandwidth(int64_t m, int64_t k)
{
    int64_t n = m * k;
    uint8_t *din, *dout;
    CHECK_CUDA(cudaMalloc(&din, n));
    CHECK_CUDA(cudaMalloc(&dout, n));
    CHECK_CUDA(cudaMemset(din, 0x3c, n));
    int64_t shape[2] = {m, k}, shape_t[2] = {k, m};
    sf_tensor in, out;
    sf_tensor_init(&in, din, SF_FLOAT8_E4M3, 2, shape, SF_CUDA, 0);
    sf_tensor_init(&out, dout, SF_FLOAT8_E4M3, 2, shape_t, SF_CUDA, 0);
    float ms = time_ms([&] { CHECK_SF(sf_transpose_fp8(&in, &out, NULL)); });
    float copy_ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dout, din, n, cudaMemcpyDeviceToDevice)); });
    double tbs = 2.0 * n / ms / 1e9, copy_tbs = 2.0 * n / copy_ms / 1e9;
    printf("transpose_fp8 [%lld, %lld]: %.4f ms = %.2f TB/s (read+write); copy %.4f ms = %.2f TB/s; %.0f%% of copy\n",
           (long long)m, (long long)k, ms, tbs, copy_ms, copy_tbs, 100.0 * tbs / copy_tbs);
    cudaFree(din);
    cudaFree(dout);
}

/* 6: the grouped cast, CPU against GPU (module note). */
/* The FP8 grouped GEMM's row blocks: each group's rows padded to a multiple of this. */
static const int64_t kRowMultiple = 16;

static int64_t padded_count(int64_t rows) { return (rows + kRowMultiple - 1) / kRowMultiple * kRowMultiple; }

struct GroupedBuffers {
    std::vector<int64_t> splits;
    int64_t m = 0, mp = 0, k = 0, G = 0;
};

static GroupedBuffers grouped_shape(const std::vector<int64_t> &splits, int64_t k)
{
    GroupedBuffers b;
    b.splits = splits;
    b.k = k;
    b.G = (int64_t)splits.size();
    for (int64_t s : splits) {
        b.m += s;
        b.mp += padded_count(s);
    }
    return b;
}

/* FP8 bytes a and b of n elements of one format (``e5m2``: E5M2, else E4M3):
 * 0 where equal, else the number of elements that differ, or -1 where one
 * is more than one code from the other on the number line, or where either
 * is a NaN or an infinity that the other is not exactly.  A finite code's
 * place on that line is its magnitude bits, negated for a negative sign: +0
 * and -0 share place 0 (a result that rounds to zero from either side is
 * the same value), and the codes either side of zero are one step from it,
 * so a value near zero computed with the other sign by the other backend is
 * one code away, not a sign error.  ``far``, where given, gets the index of
 * the element that returned -1. */
static int fp8_place(uint8_t c) { return c & 0x80 ? -(int)(c & 0x7f) : (int)(c & 0x7f); }

static bool fp8_special(uint8_t c, int e5m2) { return e5m2 ? (c & 0x7f) >= 0x7c : (c & 0x7f) == 0x7f; }

static int64_t fp8_differences(const uint8_t *a, const uint8_t *b, int64_t n, int e5m2, int64_t *far = NULL)
{
    int64_t d = 0;
    for (int64_t i = 0; i < n; ++i)
        if (a[i] != b[i]) {
            if (fp8_special(a[i], e5m2) || fp8_special(b[i], e5m2) || abs(fp8_place(a[i]) - fp8_place(b[i])) > 1) {
                if (far)
                    *far = i;
                return -1;
            }
            ++d;
        }
    return d;
}

/* 6 (swiglu 0) and 8 (swiglu 1: x holds [m, 2k] gate|up pairs, probs of
 * probs_dtype one per row, or none where probs_dtype is SF_BOOL). */
static void run_grouped_case(sf_dtype dtype, const std::vector<int64_t> &splits, int64_t k, int e5m2,
                             int current, int outs /* 1 out, 2 out_t, 3 both */, int swiglu = 0,
                             sf_dtype probs_dtype = SF_FLOAT32)
{
    if (!check_take_case())
        return;
    GroupedBuffers b = grouped_shape(splits, k);
    const size_t es = sf_dtype_size(dtype);
    const int64_t xk = swiglu ? 2 * k : k, n = b.m * xk, np = b.mp * k, G = b.G;
    std::vector<uint8_t> host(n * es + 16);
    for (int64_t i = 0; i < n; ++i) {
        float v = rng_normal() * (1.0f + (float)((i / xk) % 7) * (swiglu ? 3.0f : 40.0f)); /* groups of different ranges */
        if (i % 61 == 0) v *= 1e-7f;
        check_store(dtype, host.data(), i, v);
    }
    const int with_probs = swiglu && probs_dtype != SF_BOOL;
    std::vector<uint8_t> hprobs(with_probs ? b.m * 4 + 16 : 16);
    for (int64_t r = 0; with_probs && r < b.m; ++r)
        check_store(probs_dtype, hprobs.data(), r, r % 17 == 0 ? 0.0f : rng_uniform());
    /* the float32 slots: scale, amax, scale_inv for G groups, stride 3 (as a ScalingState's) */
    std::vector<float> slots(3 * G * 3, -7.0f);
    for (int64_t g = 0; g < G; ++g) {
        slots[3 * g] = 0.5f + 0.25f * (float)(g % 5);          /* scale */
        slots[3 * G + 3 * g] = g % 3 == 0 ? 2.0f : 0.0f;       /* amax (delayed folds into it) */
        slots[6 * G + 3 * g] = -1.0f;                          /* scale_inv (poisoned) */
    }
    void *dx, *dprobs;
    uint8_t *dout, *dout_t;
    float *dslots;
    CHECK_CUDA(cudaMalloc(&dx, host.size()));
    CHECK_CUDA(cudaMalloc(&dprobs, hprobs.size()));
    CHECK_CUDA(cudaMemcpy(dprobs, hprobs.data(), hprobs.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&dout, np + 1));
    CHECK_CUDA(cudaMalloc(&dout_t, np + 1));
    CHECK_CUDA(cudaMalloc(&dslots, slots.size() * 4));
    CHECK_CUDA(cudaMemcpy(dx, host.data(), host.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xa5, np + 1));
    CHECK_CUDA(cudaMemset(dout_t, 0xa5, np + 1));
    CHECK_CUDA(cudaMemcpy(dslots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
    std::vector<uint8_t> cout(np, 0xa5), cout_t(np, 0xa5), gout(np + 1), gout_t(np + 1);
    std::vector<float> cslots = slots, gslots(slots.size());

    int64_t xs[2] = {b.m, xk}, os[2] = {b.mp, k}, ts[2] = {k, b.mp}, gs[1] = {G}, ss[1] = {G}, ps[1] = {b.m};
    sf_dtype fp8 = e5m2 ? SF_FLOAT8_E5M2 : SF_FLOAT8_E4M3;
    sf_tensor splits_t;
    sf_tensor_init(&splits_t, b.splits.data(), SF_INT64, 1, gs, SF_CPU, 0);
    for (int dev = 0; dev < 2; ++dev) {
        sf_device_type where = dev ? SF_CUDA : SF_CPU;
        float *sl = dev ? dslots : cslots.data();
        sf_tensor x, probs, out, out_t, scale, amax, si;
        sf_tensor_init(&x, dev ? dx : (void *)host.data(), dtype, 2, xs, where, 0);
        sf_tensor_init(&probs, dev ? dprobs : (void *)hprobs.data(), probs_dtype == SF_BOOL ? SF_FLOAT32 : probs_dtype,
                       1, ps, where, 0);
        sf_tensor_init(&out, dev ? dout : cout.data(), fp8, 2, os, where, 0);
        sf_tensor_init(&out_t, dev ? dout_t : cout_t.data(), fp8, 2, ts, where, 0);
        sf_tensor_init(&scale, sl, SF_FLOAT32, 1, ss, where, 0);
        sf_tensor_init(&amax, sl + 3 * G, SF_FLOAT32, 1, ss, where, 0);
        sf_tensor_init(&si, sl + 6 * G, SF_FLOAT32, 1, ss, where, 0);
        scale.strides[0] = amax.strides[0] = si.strides[0] = 3;
        if (swiglu)
            CHECK_SF(sf_swiglu_cast_fp8_grouped(&x, with_probs ? &probs : NULL, &splits_t, kRowMultiple, &scale, &amax,
                                                outs & 1 ? &out : NULL, outs & 2 ? &out_t : NULL, &si, current, 0,
                                                NULL));
        else
            CHECK_SF(sf_cast_fp8_grouped(&x, &splits_t, kRowMultiple, &scale, &amax, outs & 1 ? &out : NULL,
                                         outs & 2 ? &out_t : NULL, &si, current, 0, NULL));
    }
    CHECK_CUDA(cudaMemcpy(gout.data(), dout, np + 1, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gout_t.data(), dout_t, np + 1, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gslots.data(), dslots, slots.size() * 4, cudaMemcpyDeviceToHost));
    int ok;
    int64_t differ = 0;
    if (!swiglu) {
        ok = memcmp(cslots.data(), gslots.data(), slots.size() * 4) == 0;
        if (outs & 1)
            ok = ok && memcmp(cout.data(), gout.data(), np) == 0;
        if (outs & 2)
            ok = ok && memcmp(cout_t.data(), gout_t.data(), np) == 0;
    } else { /* module note, 8 */
        ok = 1;
        for (size_t i = 0; i < slots.size(); ++i)
            ok = ok && fabsf(cslots[i] - gslots[i]) <= fabsf(cslots[i]) * 0x1p-7f;
        for (int o = 1; o <= 2; ++o) {
            if (!(outs & o))
                continue;
            const int64_t d = fp8_differences(o == 1 ? cout.data() : cout_t.data(),
                                              o == 1 ? gout.data() : gout_t.data(), np, e5m2);
            ok = ok && d >= 0 && d * 1000 <= np;
            differ += d > 0 ? d : 0;
        }
    }
    ok = ok && gout[np] == 0xa5 && gout_t[np] == 0xa5 && (outs & 1 || gout[0] == 0xa5) &&
         (outs & 2 || gout_t[0] == 0xa5);
    char what[240];
    snprintf(what, sizeof what, "cast_grouped%s %s %s -> %s G=%lld rows %lld (padded %lld) K=%lld outs %d%s",
             swiglu ? " swiglu" : "", current ? "current" : "delayed", sf_dtype_name(dtype), sf_dtype_name(fp8),
             (long long)G, (long long)b.m, (long long)b.mp, (long long)k, outs,
             swiglu ? (with_probs ? (differ ? " (FP8 codes one step apart: some)" : "") : " no probs") : "");
    check_report(ok, what);
    cudaFree(dprobs);
    cudaFree(dx);
    cudaFree(dout);
    cudaFree(dout_t);
    cudaFree(dslots);
}

/* The grouped cast (cast + transpose, bf16 -> E4M3) of G expert runs against
 * one per-tensor call per group (the path FP8 GroupedLinear takes where the
 * grouped cast declines). */
static void grouped_time(const std::vector<int64_t> &splits, int64_t k, int current)
{
    GroupedBuffers b = grouped_shape(splits, k);
    const int64_t G = b.G;
    void *dx;
    uint8_t *dout, *dout_t;
    float *dslots;
    CHECK_CUDA(cudaMalloc(&dx, b.m * k * 2));
    CHECK_CUDA(cudaMemset(dx, 0x3c, b.m * k * 2));
    CHECK_CUDA(cudaMalloc(&dout, b.mp * k));
    CHECK_CUDA(cudaMalloc(&dout_t, b.mp * k));
    CHECK_CUDA(cudaMalloc(&dslots, 3 * G * 4));
    std::vector<float> ones(3 * G, 1.0f);
    CHECK_CUDA(cudaMemcpy(dslots, ones.data(), 3 * G * 4, cudaMemcpyHostToDevice));
    int64_t xs[2] = {b.m, k}, os[2] = {b.mp, k}, ts[2] = {k, b.mp}, gs[1] = {G};
    sf_tensor splits_t, x, out, out_t, scale, amax, si;
    sf_tensor_init(&splits_t, b.splits.data(), SF_INT64, 1, gs, SF_CPU, 0);
    sf_tensor_init(&x, dx, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&out, dout, SF_FLOAT8_E4M3, 2, os, SF_CUDA, 0);
    sf_tensor_init(&out_t, dout_t, SF_FLOAT8_E4M3, 2, ts, SF_CUDA, 0);
    sf_tensor_init(&scale, dslots, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    sf_tensor_init(&amax, dslots + G, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    sf_tensor_init(&si, dslots + 2 * G, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    float one_call = time_ms([&] {
        CHECK_SF(sf_cast_fp8_grouped(&x, &splits_t, kRowMultiple, &scale, &amax, &out, &out_t, &si, current, 0, NULL));
    });
    /* per group: its rows and its padded blocks (separate buffers, as the per-expert path had) */
    std::vector<uint8_t *> gout(G), gout_t(G);
    for (int64_t g = 0; g < G; ++g) {
        int64_t mpg = (b.splits[g] + 15) / 16 * 16;
        CHECK_CUDA(cudaMalloc(&gout[g], mpg * k + 16));
        CHECK_CUDA(cudaMalloc(&gout_t[g], mpg * k + 16));
    }
    float per_group = time_ms([&] {
        int64_t row = 0;
        for (int64_t g = 0; g < G; ++g) {
            int64_t mg = b.splits[g], mpg = (mg + 15) / 16 * 16, one[1] = {1};
            int64_t xg[2] = {mg, k}, og[2] = {mpg, k}, tg[2] = {k, mpg};
            sf_tensor xv, ov, tv, sv, av, iv;
            sf_tensor_init(&xv, (char *)dx + row * k * 2, SF_BFLOAT16, 2, xg, SF_CUDA, 0);
            sf_tensor_init(&ov, gout[g], SF_FLOAT8_E4M3, 2, og, SF_CUDA, 0);
            sf_tensor_init(&tv, gout_t[g], SF_FLOAT8_E4M3, 2, tg, SF_CUDA, 0);
            sf_tensor_init(&sv, dslots + g, SF_FLOAT32, 1, one, SF_CUDA, 0);
            sf_tensor_init(&av, dslots + G + g, SF_FLOAT32, 1, one, SF_CUDA, 0);
            sf_tensor_init(&iv, dslots + 2 * G + g, SF_FLOAT32, 1, one, SF_CUDA, 0);
            if (mg == 0)
                continue;
            if (current)
                CHECK_SF(sf_cast_fp8_current(&xv, &av, &sv, &iv, &ov, &tv, NULL, NULL, 0, NULL));
            else
                CHECK_SF(sf_cast_fp8(&xv, &sv, &av, &ov, &tv, &iv, NULL));
            row += mg;
        }
    });
    double bytes = (double)b.m * k * 2 + 2.0 * b.mp * k;
    printf("cast_grouped %s bf16 G=%lld rows %lld K=%lld: one call %.1f us (%.2f TB/s), one call per group "
           "%.1f us (%.2f TB/s)\n", current ? "current" : "delayed", (long long)G, (long long)b.m, (long long)k,
           one_call * 1e3, bytes / (one_call * 1e-3) / 1e12, per_group * 1e3, bytes / (per_group * 1e-3) / 1e12);
    for (int64_t g = 0; g < G; ++g) {
        cudaFree(gout[g]);
        cudaFree(gout_t[g]);
    }
    cudaFree(dx);
    cudaFree(dout);
    cudaFree(dout_t);
    cudaFree(dslots);
}

/* 8's time: the fused SwiGLU cast of [M, 2K] gate|up rows against 6's cast
 * of an [M, K] input (what the unfused path casts after the SwiGLU kernel
 * wrote it), bf16 -> E4M3, cast + transpose. */
static void swiglu_grouped_time(const std::vector<int64_t> &splits, int64_t k, int current)
{
    GroupedBuffers b = grouped_shape(splits, k);
    const int64_t G = b.G;
    void *dh, *dprobs;
    uint8_t *dout, *dout_t;
    float *dslots;
    CHECK_CUDA(cudaMalloc(&dh, b.m * 2 * k * 2));
    CHECK_CUDA(cudaMemset(dh, 0x3c, b.m * 2 * k * 2));
    CHECK_CUDA(cudaMalloc(&dprobs, b.m * 4));
    CHECK_CUDA(cudaMemset(dprobs, 0, b.m * 4));
    CHECK_CUDA(cudaMalloc(&dout, b.mp * k));
    CHECK_CUDA(cudaMalloc(&dout_t, b.mp * k));
    CHECK_CUDA(cudaMalloc(&dslots, 3 * G * 4));
    std::vector<float> ones(3 * G, 1.0f);
    CHECK_CUDA(cudaMemcpy(dslots, ones.data(), 3 * G * 4, cudaMemcpyHostToDevice));
    int64_t hs[2] = {b.m, 2 * k}, xs[2] = {b.m, k}, os[2] = {b.mp, k}, ts[2] = {k, b.mp}, gs[1] = {G}, ps[1] = {b.m};
    sf_tensor splits_t, h, x, probs, out, out_t, scale, amax, si;
    sf_tensor_init(&splits_t, b.splits.data(), SF_INT64, 1, gs, SF_CPU, 0);
    sf_tensor_init(&h, dh, SF_BFLOAT16, 2, hs, SF_CUDA, 0);
    sf_tensor_init(&x, dh, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&probs, dprobs, SF_FLOAT32, 1, ps, SF_CUDA, 0);
    sf_tensor_init(&out, dout, SF_FLOAT8_E4M3, 2, os, SF_CUDA, 0);
    sf_tensor_init(&out_t, dout_t, SF_FLOAT8_E4M3, 2, ts, SF_CUDA, 0);
    sf_tensor_init(&scale, dslots, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    sf_tensor_init(&amax, dslots + G, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    sf_tensor_init(&si, dslots + 2 * G, SF_FLOAT32, 1, gs, SF_CUDA, 0);
    const float fused = time_ms([&] {
        CHECK_SF(sf_swiglu_cast_fp8_grouped(&h, &probs, &splits_t, kRowMultiple, &scale, &amax, &out, &out_t, &si,
                                            current, 0, NULL));
    });
    const float plain = time_ms([&] {
        CHECK_SF(sf_cast_fp8_grouped(&x, &splits_t, kRowMultiple, &scale, &amax, &out, &out_t, &si, current, 0, NULL));
    });
    const double fused_bytes = (double)b.m * (4.0 * k + 4) + 2.0 * b.mp * k, plain_bytes = (double)b.m * k * 2 + 2.0 * b.mp * k;
    printf("cast_grouped swiglu %s bf16 G=%lld rows %lld K=%lld: fused %.1f us (%.2f TB/s); the plain grouped cast "
           "of the [M, K] SwiGLU output alone %.1f us (%.2f TB/s), which the unfused path runs after a SwiGLU kernel "
           "that reads 4K and writes 2K bytes a row\n", current ? "current" : "delayed", (long long)G, (long long)b.m,
           (long long)k, fused * 1e3, fused_bytes / (fused * 1e-3) / 1e12, plain * 1e3,
           plain_bytes / (plain * 1e-3) / 1e12);
    cudaFree(dh);
    cudaFree(dprobs);
    cudaFree(dout);
    cudaFree(dout_t);
    cudaFree(dslots);
}

static std::vector<int64_t> random_splits(int64_t G, int64_t total)
{
    std::vector<int64_t> s(G, 0);
    for (int64_t i = 0; i < total; ++i) /* skewed: low experts get more */
        s[(int64_t)(rng_uniform() * rng_uniform() * G) % G]++;
    return s;
}

/* 10: the grouped cast with the groups' ends on the device (swiglu: of
 * [M, 2K] gate|up pairs with probs), CPU against GPU (timing 0: FP8 codes
 * one step apart in at most 1 in 1,000 elements where swiglu, else bit for
 * bit; amax and scale inverses within a bf16 ulp), or its time (timing 1). */
static void run_ends_case(sf_dtype dtype, const std::vector<int64_t> &splits, int64_t m, int64_t k, int swiglu,
                          int timing = 0)
{
    if (!timing && !check_take_case())
        return;
    const int64_t G = (int64_t)splits.size(), xk = swiglu ? 2 * k : k;
    CheckBuf x(dtype, m * xk), probs(SF_FLOAT32, m), ends(SF_INT32, G), out(SF_FLOAT8_E4M3, m * k),
        slots(SF_FLOAT32, 3 * G); /* scale, amax, scale_inv (poisoned) */
    int32_t e = 0;
    for (int64_t g = 0; g < G; ++g) {
        e += (int32_t)splits[g]; /* may pass m: the kernel clamps */
        memcpy(&ends.h[4 * g], &e, 4);
        slots.set(g, 0.5f + 0.5f * (float)(g % 3));
        slots.set(G + g, g % 2 ? 0.25f : 0.0f);
        slots.set(2 * G + g, -1.0f);
    }
    for (int64_t i = 0; i < m * xk; ++i)
        x.set(i, rng_normal() * (1.0f + (float)((i / xk) % 5)));
    for (int64_t r = 0; r < m; ++r)
        probs.set(r, r % 13 == 0 ? 0.0f : rng_uniform());
    for (CheckBuf *t : {&x, &probs, &ends, &slots})
        t->up();
    int64_t xs[2] = {m, xk}, ps[1] = {m}, os[2] = {m, k}, vs[1] = {G};
    auto call = [&](int dev) {
        sf_tensor xt = x.view(2, xs, dev), pt = probs.view(1, ps, dev), en = ends.view(1, vs, dev),
                  o = out.view(2, os, dev), sc = slots.view(1, vs, dev), am = sc, si = sc;
        am.data = (float *)sc.data + G;
        si.data = (float *)sc.data + 2 * G;
        CHECK_SF(sf_cast_fp8_grouped_ends(&xt, swiglu ? &pt : NULL, swiglu, &en, &sc, &am, &o, &si, NULL));
    };
    if (timing) {
        const float ms = time_ms([&] { call(1); });
        const double bytes = (double)(m * xk) * sf_dtype_size(dtype) + (double)(m * k) + (swiglu ? 4.0 * m : 0.0);
        printf("cast_grouped_ends%s %s G=%lld rows %lld K=%lld: %.1f us (%.2f TB/s; a device copy %.2f TB/s)\n",
               swiglu ? " swiglu" : "", sf_dtype_name(dtype), (long long)G, (long long)m, (long long)k, ms * 1e3,
               bytes / (ms * 1e-3) / 1e12, check_copy_tbs((size_t)(bytes / 2)));
        return;
    }
    call(0);
    call(1);
    const std::vector<uint8_t> g_o = out.down(), g_slots = slots.down();
    int ok = g_o[m * k] == 0xff; /* nothing written past the end */
    const int64_t d = fp8_differences(out.h.data(), g_o.data(), m * k, 0);
    ok = ok && (swiglu ? d >= 0 && d * 1000 <= m * k : d == 0);
    for (int64_t i = 0; i < 3 * G; ++i) {
        const float c = check_load(SF_FLOAT32, slots.h.data(), i), g = check_load(SF_FLOAT32, g_slots.data(), i);
        ok = ok && fabsf(c - g) <= fabsf(c) * (swiglu ? 0x1p-7f : 0.0f);
    }
    char what[200];
    snprintf(what, sizeof what, "cast_grouped_ends%s %s G=%lld rows %lld K=%lld%s", swiglu ? " swiglu" : "",
             sf_dtype_name(dtype), (long long)G, (long long)m, (long long)k,
             d > 0 ? " (FP8 codes one step apart: some)" : "");
    check_report(ok, what);
}

/* 9: the SwiGLU's backward with its FP8 copies, CPU against GPU (timing 0),
 * or its time (timing 1: the GPU alone).  dout is dense or in padded blocks;
 * want_dx 0: dx is not written; grad: dx's E5M2 copies (row-wise and
 * transposed) with delayed scaling; with_probs 0: no probs and no dprobs
 * (LayerNormMLP's SwiGLU: the kernel then also splits K among CTAs).  The GPU's outputs start as 0xff (NaN in
 * every float dtype): an unwritten element fails. */
static void run_swiglu_backward_case(sf_dtype dtype, const std::vector<int64_t> &splits, int64_t k, int want_dx,
                                     int grad, int dout_padded, int timing = 0, int with_probs = 1)
{
    if (!timing && !check_take_case())
        return;
    GroupedBuffers b = grouped_shape(splits, k);
    const int64_t G = b.G, m = b.m, mp = b.mp, drows = dout_padded ? mp : m, n_t = k * mp, n_g = mp * 2 * k;
    CheckBuf x(dtype, m * 2 * k), dout(dtype, drows * k), probs(SF_FLOAT32, m), dx(dtype, m * 2 * k),
        dprobs(SF_FLOAT32, m), out_t(SF_FLOAT8_E4M3, n_t), g_out(SF_FLOAT8_E5M2, n_g), g_out_t(SF_FLOAT8_E5M2, n_g),
        slots(SF_FLOAT32, 5 * G); /* scale, scale_inv (poisoned), grad scale, grad amax, grad scale_inv (poisoned) */
    for (int64_t i = 0; i < m * 2 * k; ++i)
        x.set(i, rng_normal() * (1.0f + (float)((i / (2 * k)) % 5)));
    for (int64_t i = 0; i < drows * k; ++i)
        dout.set(i, rng_normal() * 0.05f);
    for (int64_t r = 0; r < m; ++r)
        probs.set(r, !with_probs ? 1.0f : r % 13 == 0 ? 0.0f : rng_uniform());
    for (int64_t g = 0; g < G; ++g) {
        slots.set(g, 0.5f + 0.5f * (float)(g % 3));
        slots.set(G + g, -1.0f);
        slots.set(2 * G + g, 64.0f + 32.0f * (float)(g % 4));
        slots.set(3 * G + g, g % 2 ? 0.5f : 0.0f);
        slots.set(4 * G + g, -1.0f);
    }
    for (CheckBuf *t : {&x, &dout, &probs, &slots})
        t->up();
    int64_t xs[2] = {m, 2 * k}, ds[2] = {drows, k}, ps[1] = {m}, ts[2] = {k, mp}, gos[2] = {mp, 2 * k},
            gts[2] = {2 * k, mp}, vs[1] = {G};
    sf_tensor splits_t;
    sf_tensor_init(&splits_t, b.splits.data(), SF_INT64, 1, vs, SF_CPU, 0);
    auto call = [&](int dev) {
        sf_tensor xt = x.view(2, xs, dev), d = dout.view(2, ds, dev), p = probs.view(1, ps, dev),
                  dxt = dx.view(2, xs, dev), dp = dprobs.view(1, ps, dev), t = out_t.view(2, ts, dev),
                  go = g_out.view(2, gos, dev), gt = g_out_t.view(2, gts, dev), sl[5];
        for (int j = 0; j < 5; ++j) {
            sl[j] = slots.view(1, vs, dev);
            sl[j].data = (float *)sl[j].data + j * G;
        }
        CHECK_SF(sf_swiglu_backward_cast_fp8_grouped(&d, &xt, with_probs ? &p : NULL, &splits_t, kRowMultiple,
                                                     want_dx ? &dxt : NULL, with_probs ? &dp : NULL, &sl[0], &t,
                                                     &sl[1], grad ? &sl[2] : NULL, grad ? &sl[3] : NULL,
                                                     grad ? &go : NULL, grad ? &gt : NULL, grad ? &sl[4] : NULL,
                                                     NULL));
    };
    const size_t es = sf_dtype_size(dtype), dx_bytes = (size_t)(m * 2 * k) * es;
    if (timing) {
        const float ms = time_ms([&] { call(1); });
        /* read: gate|up, dout's real rows, probs; written: dprobs, dx, out_t, dx's two copies */
        const double bytes = (double)dx_bytes + (double)(m * k) * es + (with_probs ? 8.0 * m : 0.0) +
                             (want_dx ? (double)dx_bytes : 0.0) + (double)n_t + (grad ? 2.0 * n_g : 0.0);
        printf("swiglu_backward_grouped %s G=%lld rows %lld K=%lld%s%s%s: %.1f us (%.2f TB/s; a device copy "
               "%.2f TB/s)\n", sf_dtype_name(dtype), (long long)G, (long long)m, (long long)k,
               want_dx ? ", dx" : ", no dx", grad ? ", dx's FP8 copies" : "", with_probs ? "" : ", no probs",
               ms * 1e3, bytes / (ms * 1e-3) / 1e12,
               check_copy_tbs((size_t)(bytes / 2)));
        return;
    }
    call(0);
    call(1);
    const std::vector<uint8_t> g_dx = dx.down(), g_dp = dprobs.down(), g_t = out_t.down(), g_go = g_out.down(),
                               g_gt = g_out_t.down(), g_slots = slots.down();
    /* dx: one rounding of the dtype apart at most (the device's sigmoid is a few ulp from libm's, products
     * differ by their rounding), measured against the size of the terms the gate's gradient adds:
     * dout * p * up * s * (1 + gate * (1 - s)) cancels near gate = -1.28, where an ulp of its terms is many
     * ulps of the result.  The up's gradient, dout * p * silu(gate), is one product: measured against itself. */
    const double tol = dtype == SF_FLOAT32 ? 1e-5 : dtype == SF_FLOAT16 ? 2e-3 : 1.6e-2;
    /* below float16's smallest normal (2^-14) its spacing is fixed (2^-24): a result there is compared against
     * that floor, else an ulp of a subnormal result counts as a relative error */
    const double floor_abs = dtype == SF_FLOAT16 ? 0x1p-14 : 1e-6;
    int ok = g_dx[dx_bytes] == 0xff && g_dp[m * 4] == 0xff; /* nothing written past the ends */
    if (!with_probs)
        ok = ok && g_dp[0] == 0xff; /* not written */
    double worst = 0.0;
    if (want_dx)
        for (int64_t g = 0, r = 0, p = 0; g < G; p += padded_count(b.splits[g]), ++g)
            for (int64_t end = r + b.splits[g], pr = p; r < end; ++r, ++pr)
                for (int64_t j = 0; j < 2 * k; ++j) {
                    const int64_t i = r * 2 * k + j, jk = j % k;
                    const double c = check_load(dtype, dx.h.data(), i), got = check_load(dtype, g_dx.data(), i);
                    double terms = 0.0;
                    if (j < k) {
                        const double gate = check_load(dtype, x.h.data(), r * 2 * k + jk),
                                     up = check_load(dtype, x.h.data(), r * 2 * k + k + jk),
                                     dy = check_load(dtype, dout.h.data(), (dout_padded ? pr : r) * k + jk) *
                                          check_load(SF_FLOAT32, probs.h.data(), r),
                                     s = 1.0 / (1.0 + exp(-gate));
                        terms = fabs(dy * up) * s * (1.0 + fabs(gate) * (1.0 - s));
                    }
                    const double e = fabs(c - got) / (fabs(c) + terms + floor_abs);
                    worst = e > worst ? e : worst;
                    ok = ok && e <= tol;
                }
    else
        ok = ok && g_dx[0] == 0xff && g_dx[dx_bytes - 1] == 0xff; /* not written */
    for (int64_t r = 0; with_probs && r < m; ++r) { /* a sum over K products in another order */
        const float c = check_load(SF_FLOAT32, dprobs.h.data(), r), g = check_load(SF_FLOAT32, g_dp.data(), r);
        ok = ok && fabsf(c - g) <= 1e-4f * (float)k * (0.05f + fabsf(c));
    }
    const char *broke = ok ? "" : "; dx, dprobs or an end sentinel"; /* the first part that fails, named */
    /* the FP8 outputs: out_t [K, mp] (E4M3), then dx's row-wise [mp, 2K] and transposed [2K, mp] copies (E5M2) */
    static const char *const names[3] = {"out_t", "dx's row-wise copy", "dx's transposed copy"};
    char part[96];
    int64_t differ = 0, far = -1;
    int far_in = -1; /* which output's element ``far`` is: the first with a code more than one step off */
    for (int o = 0; o < (grad ? 3 : 1); ++o) {
        const uint8_t *cpu = o == 0 ? out_t.h.data() : (o == 1 ? g_out : g_out_t).h.data();
        const uint8_t *got = o == 0 ? g_t.data() : o == 1 ? g_go.data() : g_gt.data();
        const int64_t n = o == 0 ? n_t : n_g;
        const int64_t d = fp8_differences(cpu, got, n, o > 0, far_in < 0 ? &far : NULL);
        if (d < 0 && far_in < 0) {
            far_in = o;
            printf("swiglu_backward_grouped: %s, element %lld: CPU code 0x%02x, GPU code 0x%02x\n", names[o],
                   (long long)far, cpu[far], got[far]);
        }
        const bool good = d >= 0 && d * 1000 <= n && got[n] == 0xff;
        if (ok && !good) {
            snprintf(part, sizeof part, "; %s: %s", names[o],
                     d < 0 ? "a code more than one step off" : "over 1 in 1,000 codes one step off, or its end written");
            broke = part;
        }
        ok = ok && good;
        differ += d > 0 ? d : 0;
    }
    for (int64_t i = 0; i < 5 * G; ++i) {
        const float c = check_load(SF_FLOAT32, slots.h.data(), i), g = check_load(SF_FLOAT32, g_slots.data(), i);
        if (ok && !(fabsf(c - g) <= fabsf(c) * 0x1p-7f))
            broke = "; a scale, scale inverse or amax slot";
        ok = ok && fabsf(c - g) <= fabsf(c) * 0x1p-7f;
    }
    char what[320];
    snprintf(what, sizeof what, "swiglu_backward_grouped %s G=%lld rows %lld (padded %lld) K=%lld%s%s%s%s "
             "(dx's worst error against its terms %.1e%s%s)", sf_dtype_name(dtype), (long long)G, (long long)m,
             (long long)mp, (long long)k, want_dx ? " dx" : "", grad ? " grad copies" : "",
             dout_padded ? " dout padded" : "", with_probs ? "" : " no probs", worst,
             differ ? ", FP8 codes one step apart: some" : "", ok ? "" : broke);
    check_report(ok, what);
}

/* 7: the weights' list cast, CPU against GPU, and its time. */
static void run_list_case(sf_dtype dtype, int64_t G, int64_t n, int64_t k, int e5m2, int timing)
{
    if (!timing && !check_take_case())
        return;
    const size_t es = sf_dtype_size(dtype), bytes = (size_t)(n * k) * es;
    std::vector<uint8_t> host(G * bytes);
    for (int64_t i = 0; i < G * n * k; ++i)
        check_store(dtype, host.data(), i, rng_normal() * (1.0f + (float)(i / (n * k)) * 3.0f));
    char *dx;
    uint8_t *dq;
    float *dslots;
    CHECK_CUDA(cudaMalloc(&dx, G * bytes));
    CHECK_CUDA(cudaMalloc(&dq, 2 * G * n * k + 1));
    CHECK_CUDA(cudaMalloc(&dslots, 9 * G * 4));
    CHECK_CUDA(cudaMemcpy(dx, host.data(), G * bytes, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dq, 0xa5, 2 * G * n * k + 1));
    CHECK_CUDA(cudaMemset(dslots, 0xff, 9 * G * 4));
    std::vector<uint8_t> cq(2 * G * n * k, 0xa5), gq(2 * G * n * k + 1);
    std::vector<float> cslots(9 * G, -1.0f), gslots(9 * G);
    sf_dtype fp8 = e5m2 ? SF_FLOAT8_E5M2 : SF_FLOAT8_E4M3;
    int64_t xs[2] = {n, k}, ts[2] = {k, n}, vs[1] = {G};
    std::vector<sf_tensor> x(G), out(G), out_t(G);
    sf_tensor scale, amax, si;
    for (int dev = 0; dev < 2; ++dev) {
        sf_device_type where = dev ? SF_CUDA : SF_CPU;
        char *xb = dev ? dx : (char *)host.data();
        uint8_t *qb = dev ? dq : cq.data();
        float *sl = dev ? dslots : cslots.data();
        for (int64_t g = 0; g < G; ++g) {
            sf_tensor_init(&x[g], xb + g * bytes, dtype, 2, xs, where, 0);
            sf_tensor_init(&out[g], qb + g * n * k, fp8, 2, xs, where, 0);
            sf_tensor_init(&out_t[g], qb + (G + g) * n * k, fp8, 2, ts, where, 0);
        }
        sf_tensor_init(&scale, sl, SF_FLOAT32, 1, vs, where, 0);
        sf_tensor_init(&amax, sl + 3 * G, SF_FLOAT32, 1, vs, where, 0);
        sf_tensor_init(&si, sl + 6 * G, SF_FLOAT32, 1, vs, where, 0);
        scale.strides[0] = amax.strides[0] = si.strides[0] = 3;
        CHECK_SF(sf_cast_fp8_current_list(G, x.data(), G, out.data(), G, out_t.data(), &scale, &amax, &si, 0,
                                          NULL));
        if (!dev)
            continue;
        if (timing) {
            float one_call = time_ms([&] {
                CHECK_SF(sf_cast_fp8_current_list(G, x.data(), G, out.data(), G, out_t.data(), &scale, &amax,
                                                  &si, 0, NULL));
            });
            float per_tensor = time_ms([&] {
                for (int64_t g = 0; g < G; ++g) {
                    int64_t one[1] = {1};
                    sf_tensor s1, a1, i1;
                    sf_tensor_init(&s1, dslots + 3 * g, SF_FLOAT32, 1, one, SF_CUDA, 0);
                    sf_tensor_init(&a1, dslots + 3 * G + 3 * g, SF_FLOAT32, 1, one, SF_CUDA, 0);
                    sf_tensor_init(&i1, dslots + 6 * G + 3 * g, SF_FLOAT32, 1, one, SF_CUDA, 0);
                    CHECK_SF(sf_cast_fp8_current(&x[g], &a1, &s1, &i1, &out[g], &out_t[g], NULL, NULL, 0, NULL));
                }
            });
            double moved = (double)G * n * k * (es + 2);
            printf("cast_current_list %s G=%lld [%lld, %lld]: one call %.1f us (%.2f TB/s), one call per "
                   "tensor %.1f us (%.2f TB/s)\n", sf_dtype_name(dtype), (long long)G, (long long)n,
                   (long long)k, one_call * 1e3, moved / (one_call * 1e-3) / 1e12, per_tensor * 1e3,
                   moved / (per_tensor * 1e-3) / 1e12);
        }
    }
    if (!timing) {
        CHECK_CUDA(cudaMemcpy(gq.data(), dq, gq.size(), cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(gslots.data(), dslots, 9 * G * 4, cudaMemcpyDeviceToHost));
        /* the slots between the strided entries stay as each side left them: compare the entries */
        int ok = memcmp(cq.data(), gq.data(), cq.size()) == 0 && gq[cq.size()] == 0xa5;
        for (int64_t g = 0; g < G; ++g)
            for (int v = 0; v < 3; ++v)
                ok = ok && memcmp(&cslots[v * 3 * G + 3 * g], &gslots[v * 3 * G + 3 * g], 4) == 0;
        char what[200];
        snprintf(what, sizeof what, "cast_current_list %s -> %s G=%lld [%lld, %lld]", sf_dtype_name(dtype),
                 sf_dtype_name(fp8), (long long)G, (long long)n, (long long)k);
        check_report(ok, what);
    }
    cudaFree(dx);
    cudaFree(dq);
    cudaFree(dslots);
}

int main(void)
{
    rng_seed();
    check_exhaustive();
    sf_dtype dtypes[3] = {SF_FLOAT32, SF_FLOAT16, SF_BFLOAT16};
    int64_t shapes[][2] = {{16, 16}, {128, 128}, {256, 384}, {2048, 1024}, {4096, 4096},
                           {48, 1032}, {1000, 8}, {7, 13}, {33, 17}, {130, 264}};
    for (sf_dtype d : dtypes)
        for (auto &s : shapes)
            for (int e5m2 = 0; e5m2 < 2; ++e5m2) {
                run_case(d, s[0], s[1], e5m2, 1, 0);
                run_case(d, s[0], s[1], e5m2, 0, 0);
                run_case(d, s[0], s[1], e5m2, 1, 1); /* unaligned: generic kernel */
            }
    for (int64_t side : {4096, 8192, 16384})
        bandwidth(side, side);
    int64_t dshapes[][2] = {{16, 8}, {144, 24}, {4096, 1280}, {1040, 136}, {16384, 5120}};
    for (sf_dtype d : dtypes)
        for (auto &s : dshapes)
            for (int e5m2 = 0; e5m2 < 2; ++e5m2)
                run_case(d, s[0], s[1], e5m2, 1, 0, 1);
    int64_t tshapes[][2] = {{16, 16}, {128, 128}, {16384, 1280}, {4096, 5120}, {160, 48},
                            {32, 2064}, {1000, 8}, {7, 13}, {48, 1032}, {2, 64}};
    for (auto &s : tshapes)
        for (int offset : {0, 1})
            run_transpose_case(s[0], s[1], offset);
    transpose_bandwidth(16384, 1280);
    transpose_bandwidth(16384, 5120);
    bandwidth(16384, 1280); /* ESM-2 650M's gradients */
    bandwidth(16384, 5120);
    bandwidth(4096, 2048);  /* Llama 1B's at 4,096 tokens: attention projection and FC2, QKV, FC1 (gate|up) */
    bandwidth(4096, 3072);
    bandwidth(4096, 16384);
    std::vector<std::vector<int64_t>> gsplits = {
        {16}, {1}, {0}, {5, 0, 37, 16}, {0, 0, 130, 0}, {300, 1, 0, 129, 64, 7, 1000, 33},
        random_splits(8, 4096), random_splits(70, 3000) /* two launches */, random_splits(128, 777)};
    for (sf_dtype d : dtypes)
        for (auto &sp : gsplits)
            for (int64_t k : {16, 144, 1024})
                for (int current = 0; current < 2; ++current)
                    for (int e5m2 = 0; e5m2 < 2; ++e5m2)
                        run_grouped_case(d, sp, k, e5m2, current, 3);
    for (int outs : {1, 2})
        for (int current = 0; current < 2; ++current)
            run_grouped_case(SF_BFLOAT16, gsplits[5], 272, 0, current, outs);
    for (sf_dtype d : dtypes)
        for (int e5m2 = 0; e5m2 < 2; ++e5m2) {
            run_list_case(d, 1, 16, 16, e5m2, 0);
            run_list_case(d, 8, 144, 272, e5m2, 0);
            run_list_case(d, 70, 32, 48, e5m2, 0); /* two launches */
        }
    /* Mixtral-small's expert weights: 8 x [7168, 1024] (gate-up) and [1024, 3584] (down) */
    run_list_case(SF_BFLOAT16, 8, 7168, 1024, 0, 1);
    run_list_case(SF_BFLOAT16, 8, 1024, 3584, 0, 1);
    /* Mixtral-small's experts: 8 x 2,048 rows routed top-2 from 8,192 tokens, hidden 1,024 / 3,584 */
    for (int64_t k : {1024, 3584})
        for (int current = 0; current < 2; ++current)
            grouped_time(random_splits(8, 16384), k, current);
    /* 8: the fused SwiGLU cast */
    for (sf_dtype d : dtypes)
        for (auto &sp : gsplits)
            for (int64_t k : {16, 144})
                for (int current = 0; current < 2; ++current)
                    run_grouped_case(d, sp, k, current, current, 3, 1, SF_FLOAT32);
    for (int current = 0; current < 2; ++current) {
        run_grouped_case(SF_BFLOAT16, gsplits[5], 1024, 0, current, 3, 1, SF_BFLOAT16);
        run_grouped_case(SF_BFLOAT16, gsplits[6], 272, 0, current, 3, 1, SF_BOOL);
        for (int outs : {1, 2})
            run_grouped_case(SF_BFLOAT16, gsplits[3], 48, 0, current, outs, 1, SF_FLOAT32);
    }
    /* Mixtral-small's down projection input: 32,768 expert rows of 3,584 */
    for (int current = 0; current < 2; ++current)
        swiglu_grouped_time(random_splits(8, 32768), 3584, current);
    /* 9: the SwiGLU's backward with its FP8 copies */
    for (sf_dtype d : dtypes)
        for (int sp : {3, 5, 7})
            for (int64_t k : {16, 144, 272})
                for (int variant = 0; variant < 4; ++variant)
                    run_swiglu_backward_case(d, gsplits[sp], k, variant & 1, variant >> 1, sp == 5);
    run_swiglu_backward_case(SF_BFLOAT16, random_splits(8, 4096), 1024, 1, 1, 1);
    run_swiglu_backward_case(SF_BFLOAT16, random_splits(70, 3000), 400, 0, 1, 0); /* two launches */
    /* without probs the K tiles are split among CTAs: one group (LayerNormMLP's SwiGLU) and several */
    for (sf_dtype d : dtypes)
        for (int variant = 0; variant < 4; ++variant) {
            run_swiglu_backward_case(d, {1000}, 1040, variant & 1, variant >> 1, 0, 0, 0);
            run_swiglu_backward_case(d, gsplits[5], 400, variant & 1, variant >> 1, variant & 1, 0, 0);
        }
    /* runs of several K tiles whose last is shorter and ends in a partial tile (19 tiles); more than 64 groups */
    run_swiglu_backward_case(SF_BFLOAT16, {4096}, 2320, 0, 1, 0, 0, 0);
    run_swiglu_backward_case(SF_BFLOAT16, {300}, 2320, 1, 1, 0, 0, 0);
    run_swiglu_backward_case(SF_BFLOAT16, random_splits(70, 3000), 400, 0, 1, 1, 0, 0);
    run_swiglu_backward_case(SF_BFLOAT16, {4096}, 8192, 0, 1, 0, 0, 0);
    /* Mixtral-small's: 32,768 expert rows of 3,584 (the FP8 backward asks for no dx); 64 experts over 4,096 rows */
    for (int want_dx = 0; want_dx < 2; ++want_dx)
        run_swiglu_backward_case(SF_BFLOAT16, random_splits(8, 32768), 3584, want_dx, 1 - want_dx, 1, 1);
    run_swiglu_backward_case(SF_BFLOAT16, random_splits(64, 4096), 1408, 0, 1, 1, 1);
    /* LayerNormMLP's SwiGLU backward at Llama 1B's MLP: one group of 4,096 / 8,192 rows, K 8,192, no probs */
    for (int64_t rows : {4096, 8192})
        run_swiglu_backward_case(SF_BFLOAT16, {rows}, 8192, 0, 1, 0, 1, 0);
    /* 10: the grouped cast with the ends on the device */
    for (sf_dtype d : dtypes)
        for (int swiglu = 0; swiglu < 2; ++swiglu) {
            run_ends_case(d, {5, 0, 37, 16}, 50, 144, swiglu); /* the last ends clamped to M */
            run_ends_case(d, {300, 1, 0, 129, 64, 7, 1000, 33}, 1600, 272, swiglu); /* rows past the last end */
            run_ends_case(d, random_splits(64, 3000), 3000, 16, swiglu);
            run_ends_case(d, random_splits(8, 700), 700, 1040, swiglu);
            run_ends_case(d, random_splits(8, 300), 300, 2064, swiglu); /* more vectors a row than threads a CTA */
        }
    /* Mixtral-small's down projection input (swiglu) and gate-up input, 8 experts */
    run_ends_case(SF_BFLOAT16, random_splits(8, 32768), 32768, 3584, 1, 1);
    run_ends_case(SF_BFLOAT16, random_splits(8, 32768), 32768, 1024, 0, 1);
    return check_finish("check_cast");
}
