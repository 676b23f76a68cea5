/*
 * check_act.cu - standalone check and benchmark of the act family.
 *
 * Philox-4x32-10 against the Random123 known answer; every activation,
 * forward and backward, in each dtype, at short, odd and long shapes (and
 * with FP8 output): CUDA outputs, poisoned before the run, against the CPU
 * reference within a relative error by dtype (FP8 codes at most one step
 * apart, on a small fraction); dropout keep decisions identical on both
 * backends.  Then bandwidth against a copy of the same bytes, at 16,384 x
 * 16,384 and at 4,096 x 16,384 (a gated MLP's [tokens, 2 x FFN]).
 */
#include <string>

#include "core/check_util.h"
#include "core/float_bits.h"
#include "act/act.h"
#include "seqfuse.h"

static void run_act(sf_activation act, sf_dtype dt, int64_t rows, int64_t cols, sf_dtype odt)
{
    const int gated = sf_activation_is_gated(act);
    const int64_t n_in = rows * cols, ocols = gated ? cols / 2 : cols, n_out = rows * ocols;
    int64_t xs[2] = {rows, cols}, ys[2] = {rows, ocols}, one[1] = {1};
    CheckBuf x(dt, n_in), dy(dt, n_out), y(odt, n_out), dx(odt, n_in), sc(SF_FLOAT32, 1);
    for (int64_t i = 0; i < n_in; ++i) check_store(dt, x.h.data(), i, 3.0f * rng_normal());
    for (int64_t i = 0; i < n_out; ++i) check_store(dt, dy.h.data(), i, rng_normal());
    float s = 9.0f;
    memcpy(sc.h.data(), &s, 4);
    x.up(); dy.up(); sc.up();
    const int fp8 = odt == SF_FLOAT8_E4M3 || odt == SF_FLOAT8_E5M2;
    for (int cuda = 1; cuda >= 0; --cuda) {
        sf_tensor X = x.view(2, xs, cuda), DY = dy.view(2, ys, cuda), Y = y.view(2, ys, cuda),
                  DX = dx.view(2, xs, cuda), S = sc.view(1, one, cuda);
        CHECK_SF(sf_act_forward(act, &X, &Y, fp8 ? &S : NULL, NULL, NULL, NULL));
        CHECK_SF(sf_act_backward(act, &DY, &X, &DX, fp8 ? &S : NULL, NULL, NULL, NULL));
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    char what[200];
    snprintf(what, sizeof what, "%s %s -> %s %lldx%lld", sf_activation_name(act), sf_dtype_name(dt),
             sf_dtype_name(odt), (long long)rows, (long long)cols);
    if (fp8) {
        check_report(check_fp8_close(y.down(), y.h, n_out), (std::string(what) + " y codes").c_str());
        check_report(check_fp8_close(dx.down(), dx.h, n_in), (std::string(what) + " dx codes").c_str());
    } else {
        double ey = check_rel_err(odt, y.down(), y.h, n_out), ed = check_rel_err(odt, dx.down(), dx.h, n_in);
        char m[300];
        snprintf(m, sizeof m, "%s: y rel err %.2e, dx rel err %.2e (tol %.1e)", what, ey, ed, check_tol(dt));
        check_report(ey <= check_tol(dt) && ed <= check_tol(dt), m);
    }
}

static void run_dropout(sf_dtype dt, int64_t rows, int64_t cols)
{
    const int64_t n = rows * cols;
    int64_t xs[2] = {rows, cols}, bs[1] = {cols};
    CheckBuf x(dt, n), r(dt, n), b(dt, cols), out(dt, n), dy(dt, n), dx(dt, n), db(dt, cols);
    for (int64_t i = 0; i < n; ++i) {
        check_store(dt, x.h.data(), i, rng_normal());
        check_store(dt, r.h.data(), i, rng_normal());
        check_store(dt, dy.h.data(), i, rng_normal());
    }
    for (int64_t i = 0; i < cols; ++i) check_store(dt, b.h.data(), i, rng_normal());
    x.up(); r.up(); b.up(); dy.up();
    sf_tensor D = dy.view(2, xs, 1);
    int64_t wsn = 0;
    CHECK_SF(sf_dropout_backward_workspace_numel(&D, &wsn));
    CheckBuf ws(SF_FLOAT32, wsn > 0 ? wsn : 1);
    int64_t wshape[1] = {wsn};
    const uint64_t seed = rng_next(), offset = rng_next() >> 40;
    for (int cuda = 1; cuda >= 0; --cuda) {
        sf_tensor X = x.view(2, xs, cuda), R = r.view(2, xs, cuda), B = b.view(1, bs, cuda),
                  O = out.view(2, xs, cuda), DY = dy.view(2, xs, cuda), DX = dx.view(2, xs, cuda),
                  DB = db.view(1, bs, cuda), W = ws.view(1, wshape, cuda);
        CHECK_SF(sf_bias_dropout_add_forward(&X, &B, &R, 0.3f, seed, offset, &O, NULL));
        CHECK_SF(sf_dropout_backward(&DY, 0.3f, seed, offset, &DX, &DB, cuda ? &W : NULL, NULL));
    }
    std::vector<uint8_t> gdx = dx.down();
    int64_t mismatched = 0;
    for (int64_t i = 0; i < n; ++i)
        mismatched += (check_load(dt, gdx.data(), i) == 0.0f) != (check_load(dt, dx.h.data(), i) == 0.0f);
    char m[300];
    double eo = check_rel_err(dt, out.down(), out.h, n), ed = check_rel_err(dt, gdx, dx.h, n),
           eb = check_rel_err(dt, db.down(), db.h, cols);
    snprintf(m, sizeof m, "dropout %s %lldx%lld: %lld keep decisions differ; out %.2e dx %.2e dbias %.2e",
             sf_dtype_name(dt), (long long)rows, (long long)cols, (long long)mismatched, eo, ed, eb);
    check_report(mismatched == 0 && eo <= check_tol(dt) && ed <= check_tol(dt) && eb <= 10 * check_tol(dt), m);
}

static void philox_kat(void)
{
    sf_philox4 w = sf_philox(0, 0);
    char m[120];
    snprintf(m, sizeof m, "philox(0,0) = %08x %08x %08x %08x (Random123: 6627e8d5 e169c58d bc57ac4c 9b00dbd8)",
             w.v[0], w.v[1], w.v[2], w.v[3]);
    check_report(w.v[0] == 0x6627e8d5u && w.v[1] == 0xe169c58du && w.v[2] == 0xbc57ac4cu &&
                 w.v[3] == 0x9b00dbd8u, m);
}

static void bandwidth(int64_t rows, int64_t cols)
{
    const int64_t n = rows * cols;
    int64_t s2[2] = {rows, cols}, s2h[2] = {rows, cols / 2}, bs[1] = {cols};
    void *x, *y, *dy, *dx, *r, *copy;
    CHECK_CUDA(cudaMalloc(&x, n * 2)); CHECK_CUDA(cudaMalloc(&y, n * 2));
    CHECK_CUDA(cudaMalloc(&dy, n * 2)); CHECK_CUDA(cudaMalloc(&dx, n * 2));
    CHECK_CUDA(cudaMalloc(&r, n * 2)); CHECK_CUDA(cudaMalloc(&copy, n * 2));
    CHECK_CUDA(cudaMemset(x, 0x3f, n * 2)); CHECK_CUDA(cudaMemset(dy, 0x3f, n * 2));
    CHECK_CUDA(cudaMemset(r, 0x3f, n * 2));
    float c = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(copy, x, n * 2, cudaMemcpyDeviceToDevice)); });
    const double copy_tbs = 2.0 * n * 2 / c / 1e9;
    printf("copy %.2f TB/s (read+write)\n", copy_tbs);
    sf_tensor X, Y, DY, DX, Yh, DYh, R, B;
    sf_tensor_init(&X, x, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&Y, y, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&DY, dy, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&DX, dx, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&Yh, y, SF_BFLOAT16, 2, s2h, SF_CUDA, 0);
    sf_tensor_init(&DYh, dy, SF_BFLOAT16, 2, s2h, SF_CUDA, 0);
    sf_tensor_init(&R, r, SF_BFLOAT16, 2, s2, SF_CUDA, 0);
    sf_tensor_init(&B, dy, SF_BFLOAT16, 1, bs, SF_CUDA, 0);
    const sf_activation acts[] = {SF_ACT_GELU, SF_ACT_GELU_ERF, SF_ACT_SILU, SF_ACT_RELU, SF_ACT_SWIGLU, SF_ACT_GEGLU};
    for (sf_activation a : acts) {
        const int g = sf_activation_is_gated(a);
        float f = time_ms([&] { CHECK_SF(sf_act_forward(a, &X, g ? &Yh : &Y, NULL, NULL, NULL, NULL)); });
        float b = time_ms([&] { CHECK_SF(sf_act_backward(a, g ? &DYh : &DY, &X, &DX, NULL, NULL, NULL, NULL)); });
        double fb = (g ? 1.5 : 2.0) * n * 2, bb = (g ? 2.5 : 3.0) * n * 2;
        printf("%-9s bf16 %lldx%lld: forward %.3f ms %.2f TB/s (%.0f%% of copy), backward %.3f ms %.2f TB/s "
               "(%.0f%%)\n", sf_activation_name(a), (long long)rows, (long long)cols, f, fb / f / 1e9,
               100 * fb / f / 1e9 / copy_tbs, b, bb / b / 1e9, 100 * bb / b / 1e9 / copy_tbs);
    }
    {   /* SwiGLU with FP8 E4M3 output, amax and scale inverse: what FP8 LayerNormMLP runs (output 1 byte) */
        CheckBuf sc(SF_FLOAT32, 1), am(SF_FLOAT32, 1), si(SF_FLOAT32, 1);
        sc.set(0, 1.0f);
        am.set(0, 0.0f);
        sc.up();
        am.up();
        int64_t o1[1] = {1};
        sf_tensor S = sc.view(1, o1, 1), A = am.view(1, o1, 1), SI = si.view(1, o1, 1), Y8, DX8;
        sf_tensor_init(&Y8, y, SF_FLOAT8_E4M3, 2, s2h, SF_CUDA, 0);
        sf_tensor_init(&DX8, dx, SF_FLOAT8_E4M3, 2, s2, SF_CUDA, 0);
        float f = time_ms([&] { CHECK_SF(sf_act_forward(SF_ACT_SWIGLU, &X, &Y8, &S, &A, &SI, NULL)); });
        float b = time_ms([&] { CHECK_SF(sf_act_backward(SF_ACT_SWIGLU, &DYh, &X, &DX8, &S, &A, &SI, NULL)); });
        const double fb = 1.25 * n * 2, bb = 2.0 * n * 2; /* bytes, n elements of x: forward reads 2n, writes n/2; backward reads 2n + n (dy), writes n */
        printf("swiglu    bf16 %lldx%lld -> e4m3 with amax: forward %.3f ms %.2f TB/s (%.0f%% of copy), backward "
               "%.3f ms %.2f TB/s (%.0f%%)\n", (long long)rows, (long long)cols, f, fb / f / 1e9,
               100 * fb / f / 1e9 / copy_tbs, b, bb / b / 1e9, 100 * bb / b / 1e9 / copy_tbs);
    }
    float d = time_ms([&] { CHECK_SF(sf_bias_dropout_add_forward(&X, &B, &R, 0.1f, 1, 0, &Y, NULL)); });
    printf("bias_dropout_add bf16 %lldx%lld: %.3f ms %.2f TB/s (%.0f%% of copy)\n", (long long)rows, (long long)cols,
           d, 3.0 * n * 2 / d / 1e9, 100 * 3.0 * n * 2 / d / 1e9 / copy_tbs);
    /* dropout backward with dbias: dy read, dx written (the float32 partials
     * of dbias are not counted) */
    int64_t wsn = 0;
    CHECK_SF(sf_dropout_backward_workspace_numel(&DY, &wsn));
    void *ws, *dbias;
    CHECK_CUDA(cudaMalloc(&ws, (wsn > 0 ? wsn : 1) * 4));
    CHECK_CUDA(cudaMalloc(&dbias, cols * 2));
    int64_t wshape[1] = {wsn};
    sf_tensor WS, DB;
    sf_tensor_init(&WS, ws, SF_FLOAT32, 1, wshape, SF_CUDA, 0);
    sf_tensor_init(&DB, dbias, SF_BFLOAT16, 1, bs, SF_CUDA, 0);
    float db = time_ms([&] { CHECK_SF(sf_dropout_backward(&DY, 0.1f, 1, 0, &DX, &DB, &WS, NULL)); });
    printf("dropout_backward+dbias bf16 %lldx%lld: %.3f ms %.2f TB/s (%.0f%% of copy)\n", (long long)rows,
           (long long)cols, db, 2.0 * n * 2 / db / 1e9, 100 * 2.0 * n * 2 / db / 1e9 / copy_tbs);
    cudaFree(ws);
    cudaFree(dbias);
    void *all[] = {x, y, dy, dx, r, copy};
    for (void *p : all) cudaFree(p);
}

int main(void)
{
    rng_seed();
    philox_kat();
    const sf_dtype dts[3] = {SF_FLOAT32, SF_FLOAT16, SF_BFLOAT16};
    const int64_t shapes[][2] = {{1, 2}, {3, 34}, {64, 1024}, {129, 1002}, {1000, 4096}};
    for (int a = 0; a < SF_NUM_ACTIVATIONS; ++a)
        for (sf_dtype d : dts)
            for (auto &s : shapes) {
                run_act((sf_activation)a, d, s[0], s[1], d);
                if (s[0] == 64)
                    run_act((sf_activation)a, d, s[0], s[1], a % 2 ? SF_FLOAT8_E5M2 : SF_FLOAT8_E4M3);
            }
    for (sf_dtype d : dts) {
        run_dropout(d, 64, 1024);
        run_dropout(d, 37, 1001);
        run_dropout(d, 4096, 4096);
    }
    bandwidth(16384, 16384); /* 512 MiB of bf16 */
    bandwidth(4096, 16384);  /* a Llama 1B MLP at 4,096 tokens: gate and up [4096, 2 x 8192] */
    bandwidth(8192, 16384);  /* the same at 8,192 tokens (the Transformer Engine module bench's shape) */
    return check_finish("check_act");
}
