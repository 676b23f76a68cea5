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
        CHECK_SF(sf_cast_fp8_dbias(&x, &scale, &amax, &out, &out_t, &si, &sums, NULL));
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
        CHECK_SF(sf_cast_fp8_dbias(&hx, &hscale, &hamax, &hout, &hout_t, &hsi, &hsums, NULL));
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
    float fused = time_ms([&] { CHECK_SF(sf_cast_fp8_dbias(&x, &scale, &amax, &out, &out_t, &si, &sums, NULL)); });
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
    return check_finish("check_cast");
}
