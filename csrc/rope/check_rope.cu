/*
 * check_rope.cu - standalone check and benchmark of the RoPE kernel.
 *
 * Fresh random inputs (bf16 and fp32; bshd, sbhd and thd with ragged
 * sequences; half-split and interleaved; full and partial rotary width),
 * forward and backward; the CUDA output (poisoned with NaN bits first) must
 * match the CPU reference within a rounding of the output dtype (the two
 * backends' sin/cos differ in the last bit); sf_rope_parts likewise, its
 * copied heads bit for bit.  Then the bandwidth of a large
 * bf16 bshd forward against a device-to-device copy of the same bytes.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

static float to_float(sf_dtype d, const uint8_t *p)
{
    if (d == SF_FLOAT32) { float f; memcpy(&f, p, 4); return f; }
    uint16_t h; memcpy(&h, p, 2);
    return sf_bf16_to_f32(h);
}

static void run_case(sf_dtype dtype, sf_rope_format fmt, int interleaved, int backward, int64_t b, int64_t s,
                     int64_t h, int64_t d, int64_t rot)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    size_t es = sf_dtype_size(dtype);
    std::vector<int32_t> cu;
    int64_t shape[4];
    int ndim = 4;
    int64_t max_len = s;
    if (fmt == SF_ROPE_THD) {
        cu.push_back(0);
        for (int64_t i = 0; i < b; ++i) cu.push_back(cu.back() + (int32_t)(rng_next() % (uint64_t)(s + 1)));
        ndim = 3; shape[0] = cu.back() + 5; shape[1] = h; shape[2] = d; /* 5 padding tokens */
    } else if (fmt == SF_ROPE_BSHD) {
        shape[0] = b; shape[1] = s; shape[2] = h; shape[3] = d;
    } else {
        shape[0] = s; shape[1] = b; shape[2] = h; shape[3] = d;
    }
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    std::vector<uint8_t> x(n * es), ref(n * es), got(n * es);
    for (int64_t i = 0; i < n; ++i) {
        float v = rng_normal();
        if (dtype == SF_FLOAT32) memcpy(&x[i * 4], &v, 4);
        else { uint16_t u = sf_f32_to_bf16(v); memcpy(&x[i * 2], &u, 2); }
    }
    std::vector<float> freqs(max_len * rot);
    for (int64_t p = 0; p < max_len; ++p)
        for (int64_t j = 0; j < rot; ++j) {
            int64_t k = interleaved ? j / 2 : j % (rot / 2);
            freqs[p * rot + j] = (float)p * powf(10000.0f, -2.0f * k / rot);
        }
    void *dx, *dout, *dfreqs, *dcu = NULL;
    CHECK_CUDA(cudaMalloc(&dx, n * es));
    CHECK_CUDA(cudaMalloc(&dout, n * es));
    CHECK_CUDA(cudaMalloc(&dfreqs, freqs.size() * 4));
    CHECK_CUDA(cudaMemcpy(dx, x.data(), n * es, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dfreqs, freqs.data(), freqs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, n * es)); /* poison: NaN */
    int64_t fshape[4] = {max_len, 1, 1, rot}, cshape[1] = {(int64_t)cu.size()};
    sf_tensor tx, tout, tf, tcu, hx, hout, hf, hcu;
    sf_tensor_init(&tx, dx, dtype, ndim, shape, SF_CUDA, 0);
    sf_tensor_init(&tout, dout, dtype, ndim, shape, SF_CUDA, 0);
    sf_tensor_init(&tf, dfreqs, SF_FLOAT32, 4, fshape, SF_CUDA, 0);
    sf_tensor_init(&hx, x.data(), dtype, ndim, shape, SF_CPU, 0);
    sf_tensor_init(&hout, ref.data(), dtype, ndim, shape, SF_CPU, 0);
    sf_tensor_init(&hf, freqs.data(), SF_FLOAT32, 4, fshape, SF_CPU, 0);
    if (fmt == SF_ROPE_THD) {
        CHECK_CUDA(cudaMalloc(&dcu, cu.size() * 4));
        CHECK_CUDA(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
        sf_tensor_init(&tcu, dcu, SF_INT32, 1, cshape, SF_CUDA, 0);
        sf_tensor_init(&hcu, cu.data(), SF_INT32, 1, cshape, SF_CPU, 0);
    }
    const sf_tensor *gcu = fmt == SF_ROPE_THD ? &tcu : NULL, *ccu = fmt == SF_ROPE_THD ? &hcu : NULL;
    CHECK_SF(sf_rope(&tx, &tf, gcu, NULL, fmt, interleaved, backward, &tout, NULL));
    CHECK_SF(sf_rope(&hx, &hf, ccu, NULL, fmt, interleaved, backward, &hout, NULL));
    CHECK_CUDA(cudaMemcpy(got.data(), dout, n * es, cudaMemcpyDeviceToHost));
    double rtol = dtype == SF_FLOAT32 ? 2e-6 : 1.0 / 128, atol = dtype == SF_FLOAT32 ? 1e-5 : 1e-2;
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        float g = to_float(dtype, &got[i * es]), r = to_float(dtype, &ref[i * es]);
        if (!(fabs(g - r) <= atol + rtol * fabs(r))) bad++;
    }
    char what[200];
    snprintf(what, sizeof what, "rope %s fmt=%d interleaved=%d backward=%d b=%lld s=%lld h=%lld d=%lld rot=%lld: %lld mismatches",
             sf_dtype_name(dtype), (int)fmt, interleaved, backward, (long long)b, (long long)s, (long long)h,
             (long long)d, (long long)rot, (long long)bad);
    check_report(bad == 0, what);
    cudaFree(dx); cudaFree(dout); cudaFree(dfreqs); if (dcu) cudaFree(dcu);
}

/* sf_rope_parts: three bshd parts, each a slice of its own wider buffer
 * (one extra head, and `pad` extra leading elements a head: pad 1 takes the
 * scalar path), the first `rotate` of out's heads turned; the CUDA result on
 * a poisoned out against the CPU reference. */
static void run_parts_case(sf_dtype dtype, int interleaved, int backward, const int64_t heads[3], int64_t rotate,
                           int64_t d, int64_t rot, int64_t pad)
{
    if (!check_take_case())
        return;
    const int64_t b = 2, s = 37, es = (int64_t)sf_dtype_size(dtype), wd = d + pad;
    int64_t total = 0;
    std::vector<std::vector<uint8_t>> host(3);
    std::vector<void *> dev(3);
    sf_tensor tp[3], hp[3];
    for (int i = 0; i < 3; ++i) {
        const int64_t n = b * s * (heads[i] + 1) * wd;
        host[i].resize(n * es);
        for (int64_t j = 0; j < n; ++j) {
            float v = rng_normal();
            if (dtype == SF_FLOAT32) memcpy(&host[i][j * 4], &v, 4);
            else { uint16_t u = sf_f32_to_bf16(v); memcpy(&host[i][j * 2], &u, 2); }
        }
        CHECK_CUDA(cudaMalloc(&dev[i], n * es));
        CHECK_CUDA(cudaMemcpy(dev[i], host[i].data(), n * es, cudaMemcpyHostToDevice));
        /* the view [b, s, heads[i], d] from head 1, element pad of each token's row */
        const int64_t shape[4] = {b, s, heads[i], d}, strides[4] = {s * (heads[i] + 1) * wd, (heads[i] + 1) * wd, wd, 1};
        const int64_t off = (wd + pad) * es;
        sf_tensor_init(&tp[i], (uint8_t *)dev[i] + off, dtype, 4, shape, SF_CUDA, 0);
        sf_tensor_init(&hp[i], host[i].data() + off, dtype, 4, shape, SF_CPU, 0);
        memcpy(tp[i].strides, strides, sizeof strides);
        memcpy(hp[i].strides, strides, sizeof strides);
        total += heads[i];
    }
    const int64_t oshape[4] = {b, s, total, d}, n = b * s * total * d;
    std::vector<uint8_t> ref(n * es), got(n * es);
    std::vector<float> freqs(s * rot);
    for (int64_t q = 0; q < s; ++q)
        for (int64_t j = 0; j < rot; ++j) {
            int64_t k = interleaved ? j / 2 : j % (rot / 2);
            freqs[q * rot + j] = (float)q * powf(10000.0f, -2.0f * k / rot);
        }
    void *dout, *dfreqs;
    CHECK_CUDA(cudaMalloc(&dout, n * es));
    CHECK_CUDA(cudaMalloc(&dfreqs, freqs.size() * 4));
    CHECK_CUDA(cudaMemcpy(dfreqs, freqs.data(), freqs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, n * es)); /* poison: NaN */
    const int64_t fshape[4] = {s, 1, 1, rot};
    sf_tensor tout, hout, tf, hf;
    sf_tensor_init(&tout, dout, dtype, 4, oshape, SF_CUDA, 0);
    sf_tensor_init(&hout, ref.data(), dtype, 4, oshape, SF_CPU, 0);
    sf_tensor_init(&tf, dfreqs, SF_FLOAT32, 4, fshape, SF_CUDA, 0);
    sf_tensor_init(&hf, freqs.data(), SF_FLOAT32, 4, fshape, SF_CPU, 0);
    CHECK_SF(sf_rope_parts(&tp[0], &tp[1], &tp[2], rotate, &tf, NULL, NULL, SF_ROPE_BSHD, interleaved, backward,
                           &tout, NULL));
    CHECK_SF(sf_rope_parts(&hp[0], &hp[1], &hp[2], rotate, &hf, NULL, NULL, SF_ROPE_BSHD, interleaved, backward,
                           &hout, NULL));
    CHECK_CUDA(cudaMemcpy(got.data(), dout, n * es, cudaMemcpyDeviceToHost));
    double rtol = dtype == SF_FLOAT32 ? 2e-6 : 1.0 / 128, atol = dtype == SF_FLOAT32 ? 1e-5 : 1e-2;
    int64_t bad = 0, copied_bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        float g = to_float(dtype, &got[i * es]), r = to_float(dtype, &ref[i * es]);
        if (!(fabs(g - r) <= atol + rtol * fabs(r))) bad++;
        if ((i / d) % total >= rotate && memcmp(&got[i * es], &ref[i * es], es)) copied_bad++; /* bit for bit */
    }
    char what[240];
    snprintf(what, sizeof what, "rope_parts %s interleaved=%d backward=%d heads=%lld+%lld+%lld rotate=%lld d=%lld "
             "rot=%lld pad=%lld: %lld mismatches, %lld copied elements not bit-equal", sf_dtype_name(dtype),
             interleaved, backward, (long long)heads[0], (long long)heads[1], (long long)heads[2],
             (long long)rotate, (long long)d, (long long)rot, (long long)pad, (long long)bad, (long long)copied_bad);
    check_report(bad == 0 && copied_bad == 0, what);
    for (void *p : dev) cudaFree(p);
    cudaFree(dout); cudaFree(dfreqs);
}

int main(void)
{
    rng_seed();
    sf_dtype dtypes[2] = {SF_FLOAT32, SF_BFLOAT16};
    sf_rope_format fmts[3] = {SF_ROPE_BSHD, SF_ROPE_SBHD, SF_ROPE_THD};
    for (sf_dtype dt : dtypes)
        for (sf_rope_format f : fmts)
            for (int il = 0; il < 2; ++il)
                for (int bw = 0; bw < 2; ++bw) {
                    run_case(dt, f, il, bw, 3, 97, 8, 128, 128);
                    run_case(dt, f, il, bw, 2, 33, 5, 64, 32);
                    run_case(dt, f, il, bw, 2, 17, 3, 10, 6); /* scalar path */
                }
    /* a fused QKV projection's q, k, v (Llama 1B: 32 + 8 + 8 heads of 64), smaller odd ones, the scalar path */
    const int64_t llama[3] = {32, 8, 8}, odd[3] = {3, 2, 2};
    for (sf_dtype dt : dtypes)
        for (int il = 0; il < 2; ++il)
            for (int bw = 0; bw < 2; ++bw) {
                run_parts_case(dt, il, bw, llama, 40, 64, 64, 0);
                run_parts_case(dt, il, bw, odd, 2, 16, 8, 0);
                run_parts_case(dt, il, bw, odd, 5, 16, 16, 1);
                run_parts_case(dt, il, bw, odd, 0, 16, 16, 0);
            }

    /* bandwidth, bf16 bshd, full rotary: Llama-like [8, 4096, 32, 128],
     * ESM-2 650M-like [8, 4096, 20, 64], and Llama 1B's q and k at 4,096
     * tokens; bytes = t read + out written */
    const int64_t shapes[4][4] = {{8, 4096, 32, 128}, {8, 4096, 20, 64}, {1, 4096, 32, 64}, {1, 4096, 8, 64}};
    for (auto &sh : shapes) {
        int64_t shape[4] = {sh[0], sh[1], sh[2], sh[3]}, rot = sh[3], fshape[4] = {sh[1], 1, 1, rot};
        int64_t n = shape[0] * shape[1] * shape[2] * shape[3];
        void *dx, *dout, *dfreqs;
        CHECK_CUDA(cudaMalloc(&dx, n * 2));
        CHECK_CUDA(cudaMalloc(&dout, n * 2));
        CHECK_CUDA(cudaMalloc(&dfreqs, sh[1] * rot * 4));
        CHECK_CUDA(cudaMemset(dx, 0x3c, n * 2));
        std::vector<float> freqs(sh[1] * rot);
        for (int64_t p = 0; p < sh[1]; ++p)
            for (int64_t j = 0; j < rot; ++j)
                freqs[p * rot + j] = p * powf(10000.0f, -2.0f * (j % (rot / 2)) / rot);
        CHECK_CUDA(cudaMemcpy(dfreqs, freqs.data(), freqs.size() * 4, cudaMemcpyHostToDevice));
        sf_tensor tx, tout, tf;
        sf_tensor_init(&tx, dx, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
        sf_tensor_init(&tout, dout, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
        sf_tensor_init(&tf, dfreqs, SF_FLOAT32, 4, fshape, SF_CUDA, 0);
        const double copy = check_copy_tbs((size_t)n * 2);
        for (int il = 0; il < 2; ++il)
            for (int bw = 0; bw < 2; ++bw) {
                float ms = time_ms([&] { CHECK_SF(sf_rope(&tx, &tf, NULL, NULL, SF_ROPE_BSHD, il, bw, &tout, NULL)); });
                const double tbs = 2.0 * n * 2 / ms / 1e9;
                printf("rope bf16 bshd %lldx%lldx%lldx%lld %s %s: %.3f ms = %.2f TB/s (read+write), %.0f%% of "
                       "copy %.2f TB/s\n", (long long)sh[0], (long long)sh[1], (long long)sh[2],
                       (long long)sh[3], il ? "interleaved" : "half-split", bw ? "backward" : "forward", ms, tbs,
                       100 * tbs / copy, copy);
            }
        cudaFree(dx);
        cudaFree(dout);
        cudaFree(dfreqs);
    }
    return check_finish("check_rope");
}
