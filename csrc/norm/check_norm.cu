/*
 * check_norm.cu - standalone check and benchmark of the LayerNorm / RMSNorm
 * kernels.
 *
 * Fresh random inputs in each dtype at several shapes (short, odd, long rows;
 * float32 and same-dtype gamma; FP8 output): the CUDA outputs, poisoned
 * before each run, must match the CPU reference within a relative error by
 * dtype; FP8 codes may differ by one step on a small fraction of elements;
 * the software FP8 encoder must equal the hardware one bit for bit.  Then the
 * bandwidth (minimum bytes / time) of forward, forward with FP8 output and
 * amax, backward and forward + backward in bf16 at the hidden sizes that
 * matter (ESM-2 320 .. 5120, Llama 4096 / 8192, 16384), as a share of a
 * device-to-device copy of the same bytes measured in the same run.
 *
 * --sweep: only the bandwidth part, once per alternative split (elements
 * per thread 8 / 16 / 32, threads per block) of each direction, through
 * sf_norm_cuda_tune (a knob of the check programs' build only,
 * SF_WORKBENCH): the measurements the defaults in norm_cuda.cuh are chosen
 * from.  Every alternative's output is checked against the
 * defaults' on fresh random rows (outputs poisoned first; the split
 * changes the order of a row's sums, so within bf16 rounding).
 */
#ifndef SF_WORKBENCH
#error "check_norm --sweep tunes the split: build it with -DSF_WORKBENCH=1 (csrc/build_checks.sh)"
#endif
#include <cuda_fp8.h>

#include <string>

#include "core/check_util.h"
#include "core/float_bits.h"
#include "core/vec_io.cuh"
#include "norm/norm_backend.h"
#include "quant/fp8.h"
#include "seqfuse.h"

static void run_case(int rms, sf_dtype dt, sf_dtype wdt, int64_t rows, int64_t hidden, sf_dtype ydt)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    int64_t n = rows * hidden, xs[2] = {rows, hidden}, ws[1] = {hidden}, rs[1] = {rows}, one[1] = {1};
    CheckBuf x(dt, n), dy(dt, n), w(wdt, hidden), b(wdt, hidden), y(ydt, n), mean(SF_FLOAT32, rows),
        rstd(SF_FLOAT32, rows), dx(dt, n), dg(wdt, hidden), db(wdt, hidden), scale(SF_FLOAT32, 1),
        amax(SF_FLOAT32, 1);
    for (int64_t i = 0; i < n; ++i) {
        x.set(i, rng_normal() * 2.0f + 0.3f);
        dy.set(i, rng_normal());
    }
    for (int64_t i = 0; i < hidden; ++i) {
        w.set(i, 1.0f + 0.2f * rng_normal());
        b.set(i, 0.2f * rng_normal());
    }
    float sc = 5.5f;
    memcpy(scale.h.data(), &sc, 4);
    memset(amax.h.data(), 0, amax.h.size()); /* amax accumulates: start at 0 */
    x.up(); dy.up(); w.up(); b.up(); scale.up(); amax.up();
    const int fp8 = ydt == SF_FLOAT8_E4M3 || ydt == SF_FLOAT8_E5M2;
    int64_t wsn = 0;
    sf_tensor xv = x.view(2, xs, 1);
    CHECK_SF(sf_norm_backward_workspace_numel(&xv, &wsn));
    CheckBuf work(SF_FLOAT32, wsn > 0 ? wsn : 1);
    for (int cuda = 1; cuda >= 0; --cuda) {
        sf_tensor X = x.view(2, xs, cuda), DY = dy.view(2, xs, cuda), W = w.view(1, ws, cuda),
                  B = b.view(1, ws, cuda), Y = y.view(2, xs, cuda), M = mean.view(1, rs, cuda),
                  R = rstd.view(1, rs, cuda), DX = dx.view(2, xs, cuda), DG = dg.view(1, ws, cuda),
                  DB = db.view(1, ws, cuda), S = scale.view(1, one, cuda), A = amax.view(1, one, cuda);
        int64_t wshape[1] = {wsn};
        sf_tensor WS = work.view(1, wshape, cuda);
        const sf_tensor *sp = fp8 ? &S : NULL;
        if (rms) {
            CHECK_SF(sf_rmsnorm_forward(&X, &W, 1e-5f, 0, &Y, &R, sp, &A, NULL, NULL));
            if (!fp8) CHECK_SF(sf_rmsnorm_backward(&DY, &X, &R, &W, 0, &DX, &DG, cuda ? &WS : NULL, NULL, NULL));
        } else {
            CHECK_SF(sf_layernorm_forward(&X, &W, &B, 1e-5f, 0, &Y, &M, &R, sp, &A, NULL, NULL));
            if (!fp8) CHECK_SF(sf_layernorm_backward(&DY, &X, &M, &R, &W, 0, &DX, &DG, &DB, cuda ? &WS : NULL, NULL, NULL));
        }
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    char what[200];
    snprintf(what, sizeof what, "%s %s w=%s y=%s %lldx%lld", rms ? "rmsnorm" : "layernorm",
             sf_dtype_name(dt), sf_dtype_name(wdt), sf_dtype_name(ydt), (long long)rows, (long long)hidden);
    std::string w0(what);
    auto report = [&](const char *name, double e, double t) {
        char m[300];
        snprintf(m, sizeof m, "%s %s: rel err %.2e > %.1e", w0.c_str(), name, e, t);
        check_report(e <= t, m);
    };
    if (fp8) {
        int64_t off, big;
        const int ok = check_fp8_close(y.down(), y.h, n, &off, &big);
        char m[300];
        snprintf(m, sizeof m, "%s: %lld codes differ, %lld by more than one step", what, (long long)off, (long long)big);
        check_report(ok, m);
    } else {
        report("y", check_rel_err(ydt, y.down(), y.h, n), check_tol(dt));
        report("dx", check_rel_err(dt, dx.down(), dx.h, n), 2 * check_tol(dt));
        report("dgamma", check_rel_err(wdt, dg.down(), dg.h, hidden), 2 * check_tol(wdt == SF_FLOAT32 ? dt : wdt));
        if (!rms) report("dbeta", check_rel_err(wdt, db.down(), db.h, hidden), 2 * check_tol(wdt == SF_FLOAT32 ? dt : wdt));
    }
    report("rstd", check_rel_err(SF_FLOAT32, rstd.down(), rstd.h, rows), 1e-5);
    report("amax", check_rel_err(SF_FLOAT32, amax.down(), amax.h, 1), 1e-5);
}

__global__ void hw_encode(const float *in, uint8_t *e4, uint8_t *e5, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        e4[i] = sf_vec::enc_e4m3(in[i]); /* the encoders store_fp8 uses (norm, act) */
        e5[i] = sf_vec::enc_e5m2(in[i]);
    }
}

/* Every float whose top 20 bits vary (all exponents, signs, 11 mantissa
 * bits + rounding bits) through both encoders. */
static void check_encoder(void)
{
    const int n = 1 << 20;
    std::vector<float> in(n);
    for (int i = 0; i < n; ++i)
        in[i] = sf_bits_f32(((uint32_t)i << 12) | (uint32_t)(rng_next() & 0xfff));
    in[0] = INFINITY; /* both infinities, explicitly: they encode as NaN (fp8.h's rule) */
    in[1] = -INFINITY;
    float *din;
    uint8_t *d4, *d5;
    CHECK_CUDA(cudaMalloc(&din, n * 4));
    CHECK_CUDA(cudaMalloc(&d4, n));
    CHECK_CUDA(cudaMalloc(&d5, n));
    CHECK_CUDA(cudaMemcpy(din, in.data(), n * 4, cudaMemcpyHostToDevice));
    hw_encode<<<n / 256, 256>>>(din, d4, d5, n);
    std::vector<uint8_t> h4(n), h5(n);
    CHECK_CUDA(cudaMemcpy(h4.data(), d4, n, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(h5.data(), d5, n, cudaMemcpyDeviceToHost));
    int bad4 = 0, bad5 = 0;
    for (int i = 0; i < n; ++i) {
        if (isnan(in[i])) continue; /* NaN payload/sign encodings are not compared */
        bad4 += h4[i] != sf_f32_to_e4m3(in[i]);
        bad5 += h5[i] != sf_f32_to_e5m2(in[i]);
        if ((h4[i] != sf_f32_to_e4m3(in[i]) && bad4 < 4) || (h5[i] != sf_f32_to_e5m2(in[i]) && bad5 < 4))
            printf("  encoder mismatch %a: hw %02x/%02x sw %02x/%02x\n", in[i], h4[i], h5[i],
                   sf_f32_to_e4m3(in[i]), sf_f32_to_e5m2(in[i]));
    }
    char m[120];
    snprintf(m, sizeof m, "fp8 software encoder vs hardware: %d e4m3 and %d e5m2 mismatches", bad4, bad5);
    check_report(bad4 == 0 && bad5 == 0, m);
    cudaFree(din); cudaFree(d4); cudaFree(d5);
}

/* Forward (bf16 y, and FP8 y with amax), backward, and forward + backward of
 * one shape in bf16, against a copy of x's bytes.  Bytes are the minimum each
 * pass must move: forward reads x and writes y (4 bytes an element, 3 with
 * an FP8 y), backward reads x and dy and writes dx (6 bytes). */
static void bandwidth(int rms, int64_t rows, int64_t hidden)
{
    int64_t n = rows * hidden, xs[2] = {rows, hidden}, ws[1] = {hidden}, rs[1] = {rows}, one[1] = {1};
    void *x, *dy, *y, *y8, *dx, *w, *b, *dg, *db, *m, *r, *work, *sc, *am;
    int64_t wsn;
    CHECK_CUDA(cudaMalloc(&x, n * 2)); CHECK_CUDA(cudaMalloc(&dy, n * 2));
    CHECK_CUDA(cudaMalloc(&y, n * 2)); CHECK_CUDA(cudaMalloc(&dx, n * 2));
    CHECK_CUDA(cudaMalloc(&y8, n));
    CHECK_CUDA(cudaMalloc(&w, hidden * 2)); CHECK_CUDA(cudaMalloc(&b, hidden * 2));
    CHECK_CUDA(cudaMalloc(&dg, hidden * 2)); CHECK_CUDA(cudaMalloc(&db, hidden * 2));
    CHECK_CUDA(cudaMalloc(&m, rows * 4)); CHECK_CUDA(cudaMalloc(&r, rows * 4));
    CHECK_CUDA(cudaMalloc(&sc, 4)); CHECK_CUDA(cudaMalloc(&am, 4));
    CHECK_CUDA(cudaMemset(x, 0x3f, n * 2)); CHECK_CUDA(cudaMemset(dy, 0x3f, n * 2));
    CHECK_CUDA(cudaMemset(w, 0x3f, hidden * 2)); CHECK_CUDA(cudaMemset(b, 0, hidden * 2));
    CHECK_CUDA(cudaMemset(sc, 0, 4)); CHECK_CUDA(cudaMemset(am, 0, 4));
    sf_tensor X, DY, Y, Y8, DX, W, B, DG, DB, M, R, WS, S, A;
    sf_tensor_init(&X, x, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&DY, dy, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&Y, y, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&Y8, y8, SF_FLOAT8_E4M3, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&DX, dx, SF_BFLOAT16, 2, xs, SF_CUDA, 0);
    sf_tensor_init(&W, w, SF_BFLOAT16, 1, ws, SF_CUDA, 0);
    sf_tensor_init(&B, b, SF_BFLOAT16, 1, ws, SF_CUDA, 0);
    sf_tensor_init(&DG, dg, SF_BFLOAT16, 1, ws, SF_CUDA, 0);
    sf_tensor_init(&DB, db, SF_BFLOAT16, 1, ws, SF_CUDA, 0);
    sf_tensor_init(&M, m, SF_FLOAT32, 1, rs, SF_CUDA, 0);
    sf_tensor_init(&R, r, SF_FLOAT32, 1, rs, SF_CUDA, 0);
    sf_tensor_init(&S, sc, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&A, am, SF_FLOAT32, 1, one, SF_CUDA, 0);
    CHECK_SF(sf_norm_backward_workspace_numel(&X, &wsn));
    CHECK_CUDA(cudaMalloc(&work, wsn * 4));
    int64_t wshape[1] = {wsn};
    sf_tensor_init(&WS, work, SF_FLOAT32, 1, wshape, SF_CUDA, 0);
    auto forward = [&](sf_tensor *out, const sf_tensor *scale, sf_tensor *amax) {
        if (rms) CHECK_SF(sf_rmsnorm_forward(&X, &W, 1e-5f, 0, out, &R, scale, amax, NULL, NULL));
        else CHECK_SF(sf_layernorm_forward(&X, &W, &B, 1e-5f, 0, out, &M, &R, scale, amax, NULL, NULL));
    };
    auto backward = [&] {
        if (rms) CHECK_SF(sf_rmsnorm_backward(&DY, &X, &R, &W, 0, &DX, &DG, &WS, NULL, NULL));
        else CHECK_SF(sf_layernorm_backward(&DY, &X, &M, &R, &W, 0, &DX, &DG, &DB, &WS, NULL, NULL));
    };
    const float f = time_ms([&] { forward(&Y, NULL, NULL); });
    const float f8 = time_ms([&] { forward(&Y8, &S, &A); });
    const float bw = time_ms(backward);
    const float fb = time_ms([&] { forward(&Y, NULL, NULL); backward(); });
    const double copy = check_copy_tbs((size_t)n * 2), e = (double)n;
    auto tbs = [](double bytes, float ms) { return bytes / ms / 1e9; };
    printf("%-9s bf16 %5lldx%-5lld forward %.3f ms %.2f TB/s (%3.0f%%) | forward fp8+amax %.3f ms %.2f TB/s (%3.0f%%) | "
           "backward %.3f ms %.2f TB/s (%3.0f%%) | forward+backward %.3f ms %.2f TB/s (%3.0f%%) | copy %.2f TB/s\n",
           rms ? "rmsnorm" : "layernorm", (long long)rows, (long long)hidden,
           f, tbs(4 * e, f), 100 * tbs(4 * e, f) / copy, f8, tbs(3 * e, f8), 100 * tbs(3 * e, f8) / copy,
           bw, tbs(6 * e, bw), 100 * tbs(6 * e, bw) / copy, fb, tbs(10 * e, fb), 100 * tbs(10 * e, fb) / copy,
           copy);
    void *all[] = {x, dy, y, y8, dx, w, b, dg, db, m, r, work, sc, am};
    for (void *p : all) cudaFree(p);
}

/* One alternative split: relative errors of y, dx, dgamma (, dbeta) against
 * the defaults' results `ref`, then the times of forward and backward. */
struct SweepBufs {
    CheckBuf x, dy, w, b, y, m, r, dx, dg, db;
    SweepBufs(int64_t rows, int64_t hidden)
        : x(SF_BFLOAT16, rows * hidden), dy(SF_BFLOAT16, rows * hidden), w(SF_BFLOAT16, hidden),
          b(SF_BFLOAT16, hidden), y(SF_BFLOAT16, rows * hidden), m(SF_FLOAT32, rows), r(SF_FLOAT32, rows),
          dx(SF_BFLOAT16, rows * hidden), dg(SF_BFLOAT16, hidden), db(SF_BFLOAT16, hidden) {}
};

static void sweep_shape(int rms, int64_t rows, int64_t hidden)
{
    const int64_t n = rows * hidden;
    int64_t xs[2] = {rows, hidden}, ws[1] = {hidden}, rs[1] = {rows};
    SweepBufs B(rows, hidden);
    for (int64_t i = 0; i < n; ++i) {
        B.x.set(i, rng_normal() * 2.0f + 0.3f);
        B.dy.set(i, rng_normal());
    }
    for (int64_t i = 0; i < hidden; ++i) {
        B.w.set(i, 1.0f + 0.2f * rng_normal());
        B.b.set(i, 0.2f * rng_normal());
    }
    B.x.up(); B.dy.up(); B.w.up(); B.b.up();
    sf_tensor X = B.x.view(2, xs, 1), DY = B.dy.view(2, xs, 1), W = B.w.view(1, ws, 1), Bt = B.b.view(1, ws, 1),
              Y = B.y.view(2, xs, 1), M = B.m.view(1, rs, 1), R = B.r.view(1, rs, 1), DX = B.dx.view(2, xs, 1),
              DG = B.dg.view(1, ws, 1), DB = B.db.view(1, ws, 1);
    /* the largest workspace any alternative asks for */
    int64_t wsn = 1;
    for (int e : {8, 16, 32})
        for (int blk : {128, 256, 512, 1024}) {
            int64_t k;
            CHECK_SF(sf_norm_cuda_tune(16, 256, e, blk));
            CHECK_SF(sf_norm_backward_workspace_numel(&X, &k));
            wsn = std::max(wsn, k);
        }
    CheckBuf work(SF_FLOAT32, wsn);
    int64_t wshape[1] = {wsn};
    sf_tensor WS = work.view(1, wshape, 1);
    auto forward = [&] {
        if (rms) CHECK_SF(sf_rmsnorm_forward(&X, &W, 1e-5f, 0, &Y, &R, NULL, NULL, NULL, NULL));
        else CHECK_SF(sf_layernorm_forward(&X, &W, &Bt, 1e-5f, 0, &Y, &M, &R, NULL, NULL, NULL, NULL));
    };
    auto backward = [&] {
        if (rms) CHECK_SF(sf_rmsnorm_backward(&DY, &X, &R, &W, 0, &DX, &DG, &WS, NULL, NULL));
        else CHECK_SF(sf_layernorm_backward(&DY, &X, &M, &R, &W, 0, &DX, &DG, &DB, &WS, NULL, NULL));
    };
    CheckBuf *outs[4] = {&B.y, &B.dx, &B.dg, &B.db};
    /* y and dx compared over their first rows (every split treats all rows
     * alike, and 2^20 elements are at least 64 whole rows): the host loop
     * over all of them would cost more than the sweep */
    const int64_t head = std::min(n, (int64_t)1 << 20);
    const int64_t counts[4] = {head, head, hidden, hidden};
    auto run_checked = [&] {
        for (CheckBuf *o : outs)
            CHECK_CUDA(cudaMemset(o->d, 0xff, o->h.size()));
        forward();
        backward();
        CHECK_CUDA(cudaDeviceSynchronize());
    };
    CHECK_SF(sf_norm_cuda_tune(0, 0, 0, 0)); /* the defaults of norm_cuda.cuh */
    run_checked();
    std::vector<uint8_t> ref[4];
    for (int i = 0; i < 4; ++i)
        ref[i] = outs[i]->down();
    const double copy = check_copy_tbs((size_t)n * 2), e = (double)n;
    const char *name = rms ? "rmsnorm" : "layernorm";
    for (int dir = 0; dir < 2; ++dir)
        for (int elems : {8, 16, 32})
            for (int blk : {128, 256, 512, 1024}) {
                /* one direction's alternative, the other direction's default */
                if (dir == 0) CHECK_SF(sf_norm_cuda_tune(elems, blk, rms ? 32 : 16, 256));
                else CHECK_SF(sf_norm_cuda_tune(16, 256, elems, blk));
                run_checked();
                double worst = 0;
                for (int i = 0; i < (rms ? 3 : 4); ++i)
                    worst = std::max(worst, check_rel_err(SF_BFLOAT16, outs[i]->down(), ref[i], counts[i]));
                char what[160];
                snprintf(what, sizeof what, "sweep %s %lldx%lld %s elems %d block %d: rel err %.2e vs defaults",
                         name, (long long)rows, (long long)hidden, dir ? "backward" : "forward", elems, blk, worst);
                check_report(worst < 1e-2, what);
                const float ms = dir == 0 ? time_ms(forward) : time_ms(backward);
                const double bytes = (dir == 0 ? 4 : 6) * e;
                printf("sweep %-9s %5lldx%-5lld %s elems %2d block %4d: %.4f ms %.2f TB/s (%3.0f%% of copy)\n",
                       name, (long long)rows, (long long)hidden, dir ? "backward" : "forward", elems, blk, ms,
                       bytes / ms / 1e9, 100 * bytes / ms / 1e9 / copy);
            }
    CHECK_SF(sf_norm_cuda_tune(0, 0, 0, 0));
}

int main(int argc, char **argv)
{
    rng_seed();
    if (argc > 1 && strcmp(argv[1], "--sweep") == 0) {
        const int64_t sw[][2] = {{65536, 320}, {16384, 1280}, {16384, 4096}, {16384, 5120}, {8192, 8192},
                                 {4096, 16384}};
        for (auto &sh : sw)
            for (int rms = 0; rms < 2; ++rms)
                sweep_shape(rms, sh[0], sh[1]);
        return check_finish("check_norm --sweep");
    }
    check_encoder();
    /* the tuning knob refuses splits no kernel holds (and leaves the defaults) */
    check_report(sf_norm_cuda_tune(12, 256, 16, 256) == SF_ERR_VALUE, "sf_norm_cuda_tune accepted 12 elements");
    check_report(sf_norm_cuda_tune(16, 256, 64, 256) == SF_ERR_VALUE, "sf_norm_cuda_tune accepted 64 elements");
    check_report(sf_norm_cuda_tune(16, 100, 16, 256) == SF_ERR_VALUE, "sf_norm_cuda_tune accepted a 100-thread block");
    check_report(sf_norm_cuda_tune(16, 256, 16, 2048) == SF_ERR_VALUE, "sf_norm_cuda_tune accepted a 2048-thread block");
    const sf_dtype dts[3] = {SF_FLOAT32, SF_FLOAT16, SF_BFLOAT16};
    /* every launch shape of norm_kernels.cuh: a warp per row, several warps with
     * idle slots, exact splits, long rows, the element-wide path (37, 1001,
     * 16383), and more rows than the persistent grid walks at once */
    const int64_t shapes[][2] = {{1, 8}, {3, 37}, {64, 1280}, {300, 4096}, {17, 16384}, {129, 1000},
                                 {77, 320}, {40, 480}, {2000, 640}, {9, 1001}, {33, 2560}, {20, 5120},
                                 {5, 8192}, {3, 16383}, {20000, 256}};
    for (int rms = 0; rms < 2; ++rms)
        for (sf_dtype d : dts)
            for (auto &s : shapes) {
                run_case(rms, d, d, s[0], s[1], d);
                run_case(rms, d, SF_FLOAT32, s[0], s[1], d);
                run_case(rms, d, SF_FLOAT32, s[0], s[1], SF_FLOAT8_E4M3);
                run_case(rms, d, d, s[0], s[1], SF_FLOAT8_E5M2);
            }
    /* ESM-2 (320 .. 5120), Llama (4096, 8192), FFN-wide (16384) rows */
    const int64_t bw_shapes[][2] = {{65536, 320}, {65536, 640}, {16384, 1280}, {16384, 2560},
                                    {16384, 4096}, {16384, 5120}, {8192, 8192}, {4096, 16384}};
    for (auto &s : bw_shapes)
        for (int rms = 0; rms < 2; ++rms)
            bandwidth(rms, s[0], s[1]);
    return check_finish("check_norm");
}
