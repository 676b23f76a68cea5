/*
 * check_cross_entropy.cu - standalone check and benchmark of the fused
 * cross-entropy kernels.
 *
 * Fresh random logits (bf16 and fp32; vocabularies that take the 16-byte and
 * the scalar path), labels with ignored rows, with and without label
 * smoothing.  Loss and lse must match the CPU reference (double accumulation)
 * to fp32 accuracy; the gradient (outputs poisoned first; also computed in
 * place over the logits) within a rounding of its dtype.  Then the bandwidth
 * of forward and backward at N = 16384, V = 32000 and 128256, bf16.
 * Also the bad-label record (run_bad_label_case).
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

static float get(sf_dtype d, const std::vector<uint8_t> &b, int64_t i)
{
    if (d == SF_FLOAT32) { float f; memcpy(&f, &b[i * 4], 4); return f; }
    uint16_t h; memcpy(&h, &b[i * 2], 2);
    return sf_bf16_to_f32(h);
}

static void run_case(sf_dtype dtype, int64_t n, int64_t v, float smoothing, int in_place)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    size_t es = sf_dtype_size(dtype);
    std::vector<uint8_t> x(n * v * es), grad(n * v * es), ref(n * v * es);
    for (int64_t i = 0; i < n * v; ++i) {
        float f = rng_normal() * 3.0f;
        if (dtype == SF_FLOAT32) memcpy(&x[i * 4], &f, 4);
        else { uint16_t u = sf_f32_to_bf16(f); memcpy(&x[i * 2], &u, 2); }
    }
    std::vector<int64_t> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = (rng_next() % 4 == 0) ? -100 : (int64_t)(rng_next() % (uint64_t)v);
    std::vector<float> loss(n), lse(n), gloss(n), glse(n), scale(1, 0.37f);
    void *dx, *dg, *dy, *dloss, *dlse, *dscale;
    CHECK_CUDA(cudaMalloc(&dx, x.size()));
    CHECK_CUDA(cudaMalloc(&dg, x.size()));
    CHECK_CUDA(cudaMalloc(&dy, n * 8));
    CHECK_CUDA(cudaMalloc(&dloss, n * 4));
    CHECK_CUDA(cudaMalloc(&dlse, n * 4));
    CHECK_CUDA(cudaMalloc(&dscale, 4));
    CHECK_CUDA(cudaMemcpy(dx, x.data(), x.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dy, y.data(), n * 8, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dscale, scale.data(), 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dloss, 0xff, n * 4));
    CHECK_CUDA(cudaMemset(dlse, 0xff, n * 4));
    CHECK_CUDA(cudaMemset(dg, 0xff, x.size()));
    int64_t s2[2] = {n, v}, s1[1] = {n}, one[1] = {1};
    sf_tensor tx, tg, ty, tl, tlse, ts, hx, hg, hy, hl, hlse, hs;
    sf_tensor_init(&tx, dx, dtype, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&tg, in_place ? dx : dg, dtype, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&ty, dy, SF_INT64, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&tl, dloss, SF_FLOAT32, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&tlse, dlse, SF_FLOAT32, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&ts, dscale, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&hx, x.data(), dtype, 2, s2, SF_CPU, 0);
    sf_tensor_init(&hg, ref.data(), dtype, 2, s2, SF_CPU, 0);
    sf_tensor_init(&hy, y.data(), SF_INT64, 1, s1, SF_CPU, 0);
    sf_tensor_init(&hl, loss.data(), SF_FLOAT32, 1, s1, SF_CPU, 0);
    sf_tensor_init(&hlse, lse.data(), SF_FLOAT32, 1, s1, SF_CPU, 0);
    sf_tensor_init(&hs, scale.data(), SF_FLOAT32, 1, one, SF_CPU, 0);
    CHECK_SF(sf_cross_entropy_forward(&tx, &ty, -100, smoothing, &tl, &tlse, NULL, NULL, NULL));
    CHECK_SF(sf_cross_entropy_backward(&tx, &ty, &tlse, &ts, -100, smoothing, &tg, NULL));
    CHECK_SF(sf_cross_entropy_forward(&hx, &hy, -100, smoothing, &hl, &hlse, NULL, NULL, NULL));
    CHECK_SF(sf_cross_entropy_backward(&hx, &hy, &hlse, &hs, -100, smoothing, &hg, NULL));
    CHECK_CUDA(cudaMemcpy(gloss.data(), dloss, n * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(glse.data(), dlse, n * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(grad.data(), in_place ? dx : dg, x.size(), cudaMemcpyDeviceToHost));
    int64_t bad_loss = 0, bad_grad = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!(fabsf(gloss[i] - loss[i]) <= 2e-5f * fmaxf(1.0f, fabsf(loss[i])))) bad_loss++;
        if (!(fabsf(glse[i] - lse[i]) <= 2e-5f * fmaxf(1.0f, fabsf(lse[i])))) bad_loss++;
    }
    double rtol = dtype == SF_FLOAT32 ? 1e-4 : 1.0 / 64;
    for (int64_t i = 0; i < n * v; ++i) {
        float g = get(dtype, grad, i), r = get(dtype, ref, i);
        if (!(fabs(g - r) <= 1e-7 + rtol * fabs(r))) bad_grad++;
    }
    char what[200];
    snprintf(what, sizeof what, "cross_entropy %s N=%lld V=%lld smoothing=%g in_place=%d: %lld loss/lse and %lld grad mismatches",
             sf_dtype_name(dtype), (long long)n, (long long)v, (double)smoothing, in_place, (long long)bad_loss,
             (long long)bad_grad);
    check_report(bad_loss == 0 && bad_grad == 0, what);
    cudaFree(dx); cudaFree(dg); cudaFree(dy); cudaFree(dloss); cudaFree(dlse); cudaFree(dscale);
}

/* A bad label with a label record (seqfuse_loss.h): NaN loss for the bad
 * rows, finite elsewhere; the record written once (by one of the two bad
 * rows, with its own value and address), the claim taken; a record in
 * pageable memory refused with SF_ERR_VALUE. */
static void run_bad_label_case(void)
{
    const int64_t n = 64, v = 1000;
    std::vector<float> x(n * v), loss(n);
    for (auto &f : x) f = rng_normal();
    std::vector<int64_t> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = (int64_t)(rng_next() % (uint64_t)v);
    y[10] = v;
    y[40] = -5;
    y[20] = -100;
    void *dx, *dy, *dloss, *dlse, *dclaim;
    long long *rec;
    CHECK_CUDA(cudaMalloc(&dx, n * v * 4));
    CHECK_CUDA(cudaMalloc(&dy, n * 8));
    CHECK_CUDA(cudaMalloc(&dloss, n * 4));
    CHECK_CUDA(cudaMalloc(&dlse, n * 4));
    CHECK_CUDA(cudaMalloc(&dclaim, 4));
    CHECK_CUDA(cudaHostAlloc((void **)&rec, SF_LABEL_RECORD_LEN * 8, cudaHostAllocDefault));
    memset(rec, 0, SF_LABEL_RECORD_LEN * 8);
    CHECK_CUDA(cudaMemset(dclaim, 0, 4));
    CHECK_CUDA(cudaMemcpy(dx, x.data(), n * v * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dy, y.data(), n * 8, cudaMemcpyHostToDevice));
    int64_t s2[2] = {n, v}, s1[1] = {n}, one[1] = {1}, len[1] = {SF_LABEL_RECORD_LEN};
    sf_tensor tx, ty, tl, tlse, tc, tr, tpage;
    sf_tensor_init(&tx, dx, SF_FLOAT32, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&ty, dy, SF_INT64, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&tl, dloss, SF_FLOAT32, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&tlse, dlse, SF_FLOAT32, 1, s1, SF_CUDA, 0);
    sf_tensor_init(&tc, dclaim, SF_INT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&tr, rec, SF_INT64, 1, len, SF_CPU, 0);
    CHECK_SF(sf_cross_entropy_forward(&tx, &ty, -100, 0.0f, &tl, &tlse, &tc, &tr, NULL));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(loss.data(), dloss, n * 4, cudaMemcpyDeviceToHost));
    int claim = 0;
    CHECK_CUDA(cudaMemcpy(&claim, dclaim, 4, cudaMemcpyDeviceToHost));
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i)
        wrong += (i == 10 || i == 40) ? !isnan(loss[i]) : !isfinite(loss[i]);
    long long row = rec[SF_LABEL_ROW];
    int record_ok = rec[SF_LABEL_STATE] == 1 && (row == 10 || row == 40) && rec[SF_LABEL_VALUE] == y[row] &&
                    rec[SF_LABEL_CLASSES] == v && rec[SF_LABEL_IGNORE] == -100 &&
                    rec[SF_LABEL_ADDRESS] == (long long)(uintptr_t)((int64_t *)dy + row) && claim == 1;
    std::vector<long long> pageable(SF_LABEL_RECORD_LEN, 0);
    sf_tensor_init(&tpage, pageable.data(), SF_INT64, 1, len, SF_CPU, 0);
    sf_status refused = sf_cross_entropy_forward(&tx, &ty, -100, 0.0f, &tl, &tlse, &tc, &tpage, NULL);
    char what[240];
    snprintf(what, sizeof what, "cross_entropy bad labels: %lld rows not NaN/finite as they should be; record %s "
             "(state %lld row %lld value %lld classes %lld claim %d); pageable record %s", (long long)wrong,
             record_ok ? "right" : "WRONG", rec[SF_LABEL_STATE], row, rec[SF_LABEL_VALUE], rec[SF_LABEL_CLASSES],
             claim, refused == SF_ERR_VALUE ? "refused" : "NOT refused");
    check_report(wrong == 0 && record_ok && refused == SF_ERR_VALUE, what);
    cudaFree(dx); cudaFree(dy); cudaFree(dloss); cudaFree(dlse); cudaFree(dclaim); cudaFreeHost(rec);
}

int main(void)
{
    rng_seed();
    sf_dtype dtypes[2] = {SF_FLOAT32, SF_BFLOAT16};
    int64_t vocabs[4] = {7, 1000, 32000, 50257};
    for (sf_dtype dt : dtypes)
        for (int64_t v : vocabs)
            for (int k = 0; k < 2; ++k)
                run_case(dt, v > 40000 ? 33 : 64, v, k ? 0.1f : 0.0f, k);
    run_bad_label_case();

    for (int64_t v : {(int64_t)32000, (int64_t)128256}) {
        int64_t n = 16384;
        void *dx, *dg, *dy, *dloss, *dlse, *dscale, *dcopy;
        CHECK_CUDA(cudaMalloc(&dx, n * v * 2));
        CHECK_CUDA(cudaMalloc(&dg, n * v * 2));
        CHECK_CUDA(cudaMalloc(&dcopy, n * v * 2));
        CHECK_CUDA(cudaMalloc(&dy, n * 8));
        CHECK_CUDA(cudaMalloc(&dloss, n * 4));
        CHECK_CUDA(cudaMalloc(&dlse, n * 4));
        CHECK_CUDA(cudaMalloc(&dscale, 4));
        CHECK_CUDA(cudaMemset(dx, 0x3c, n * v * 2));
        CHECK_CUDA(cudaMemset(dy, 0, n * 8));
        CHECK_CUDA(cudaMemset(dscale, 0, 4));
        int64_t s2[2] = {n, v}, s1[1] = {n}, one[1] = {1};
        sf_tensor tx, tg, ty, tl, tlse, ts;
        sf_tensor_init(&tx, dx, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
        sf_tensor_init(&tg, dg, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
        sf_tensor_init(&ty, dy, SF_INT64, 1, s1, SF_CUDA, 0);
        sf_tensor_init(&tl, dloss, SF_FLOAT32, 1, s1, SF_CUDA, 0);
        sf_tensor_init(&tlse, dlse, SF_FLOAT32, 1, s1, SF_CUDA, 0);
        sf_tensor_init(&ts, dscale, SF_FLOAT32, 1, one, SF_CUDA, 0);
        float forward = time_ms([&] { CHECK_SF(sf_cross_entropy_forward(&tx, &ty, -100, 0.0f, &tl, &tlse, NULL, NULL, NULL)); });
        float backward = time_ms([&] { CHECK_SF(sf_cross_entropy_backward(&tx, &ty, &tlse, &ts, -100, 0.0f, &tg, NULL)); });
        float copy = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dcopy, dx, n * v * 2, cudaMemcpyDeviceToDevice)); });
        double bytes = (double)n * v * 2;
        printf("cross_entropy bf16 N=%lld V=%lld: forward %.3f ms = %.2f TB/s (read), backward %.3f ms = %.2f TB/s "
               "(read+write); copy %.3f ms = %.2f TB/s (read+write)\n", (long long)n, (long long)v, forward,
               bytes / forward / 1e9, backward, 2 * bytes / backward / 1e9, copy, 2 * bytes / copy / 1e9);
        cudaFree(dx); cudaFree(dg); cudaFree(dcopy); cudaFree(dy); cudaFree(dloss); cudaFree(dlse); cudaFree(dscale);
    }
    return check_finish("check_cross_entropy");
}
