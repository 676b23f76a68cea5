/*
 * check_attn.cu - standalone check and benchmark of the fused attention
 * kernels (no Python).
 *
 * Correctness: fresh random bf16/fp16 q, k, v, dout at small shapes covering
 * every layout (bshd, sbhd, thd), mask, window, GQA ratio and head dim (64
 * and 128 on the full grid; 16, 24 and 32, ESM-2's small models, on a few
 * shapes), with lengths that are and are not multiples of the tiles; device
 * outputs are poisoned (0xFF bytes = NaN) before each run.  The forward's
 * out and lse are compared with the CPU reference (sf_attn_forward on host
 * tensors); the backward gets the reference's out and lse on both sides and
 * dq, dk, dv are compared, in the default (atomic dQ) and deterministic
 * modes, the latter also checked bitwise reproducible.  Dropout cases
 * (dropout_p 0.1 / 0.3 / 0.5 with a seed and offset) run the same way: the CPU
 * reference draws the same Philox mask (attn_philox.h), so out and the
 * gradients must match it as closely as without dropout.
 *
 * Speed: 16k tokens per batch, seqlens 1024/4096/8192, head dims 64 (32
 * heads) and 128 (16 heads), causal and not: forward and forward+backward
 * TFLOP/s (forward 4*b*h*s*s*d, halved when causal; backward 2.5x the forward).
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

struct Case {
    sf_attn_format fmt;
    sf_attn_mask mask;
    int b, sq, sk, h, hk, d;
    sf_dtype dtype;
    int left, right;
    std::vector<int> lq, lk; /* real lengths (padding masks and thd) */
    double dropout = 0.0;
};

static uint16_t to16(sf_dtype dt, float x) { return dt == SF_BFLOAT16 ? sf_f32_to_bf16(x) : sf_f32_to_f16(x); }
static float from16(sf_dtype dt, uint16_t x) { return dt == SF_BFLOAT16 ? sf_bf16_to_f32(x) : sf_f16_to_f32(x); }

struct Buf {
    std::vector<uint8_t> host;
    void *dev = nullptr;
    size_t bytes = 0;
    void alloc(size_t n) {
        bytes = n;
        host.assign(n, 0);
        CHECK_CUDA(cudaMalloc(&dev, n ? n : 16));
    }
    void upload() { CHECK_CUDA(cudaMemcpy(dev, host.data(), bytes, cudaMemcpyHostToDevice)); }
    void poison() { CHECK_CUDA(cudaMemset(dev, 0xff, bytes)); }
    std::vector<uint8_t> download() {
        std::vector<uint8_t> out(bytes);
        CHECK_CUDA(cudaMemcpy(out.data(), dev, bytes, cudaMemcpyDeviceToHost));
        return out;
    }
    ~Buf() { if (dev) cudaFree(dev); }
};

static void shape_of(const Case &c, int seq, int heads, int64_t total, int *ndim, int64_t *shape)
{
    if (c.fmt == SF_ATTN_THD) {
        *ndim = 3; shape[0] = total; shape[1] = heads; shape[2] = c.d;
    } else if (c.fmt == SF_ATTN_BSHD) {
        *ndim = 4; shape[0] = c.b; shape[1] = seq; shape[2] = heads; shape[3] = c.d;
    } else {
        *ndim = 4; shape[0] = seq; shape[1] = c.b; shape[2] = heads; shape[3] = c.d;
    }
}

/* Relative error ||a - b|| / ||b|| over 16-bit buffers; NaN in a fails. */
static double rel_err16(sf_dtype dt, const std::vector<uint8_t> &a, const std::vector<uint8_t> &b, bool *nan)
{
    const uint16_t *x = (const uint16_t *)a.data(), *y = (const uint16_t *)b.data();
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size() / 2; ++i) {
        float u = from16(dt, x[i]), v = from16(dt, y[i]);
        if (u != u) *nan = true;
        num += (double)(u - v) * (u - v);
        den += (double)v * v;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void run_case(const Case &c)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    const bool thd = c.fmt == SF_ATTN_THD;
    int64_t tq = 0, tk = 0;
    std::vector<int32_t> cuq(1, 0), cuk(1, 0);
    if (!c.lq.empty()) {
        for (int i = 0; i < c.b; ++i) {
            cuq.push_back(cuq.back() + c.lq[i]);
            cuk.push_back(cuk.back() + c.lk[i]);
        }
    }
    int maxq = c.sq, maxk = c.sk;
    if (thd) {
        tq = cuq.back() + 5; /* a tail past the last sequence */
        tk = cuk.back() + 3;
        maxq = *std::max_element(c.lq.begin(), c.lq.end());
        maxk = *std::max_element(c.lk.begin(), c.lk.end());
    }
    int nd;
    int64_t sh_q[4], sh_k[4], sh_l[3];
    shape_of(c, c.sq, c.h, tq, &nd, sh_q);
    shape_of(c, c.sk, c.hk, tk, &nd, sh_k);
    int64_t nq = 1, nk = 1;
    for (int i = 0; i < nd; ++i) { nq *= sh_q[i]; nk *= sh_k[i]; }
    int lse_nd = thd ? 2 : 3;
    if (thd) { sh_l[0] = c.h; sh_l[1] = tq; } else { sh_l[0] = c.b; sh_l[1] = c.h; sh_l[2] = c.sq; }
    int64_t nl = thd ? c.h * tq : (int64_t)c.b * c.h * c.sq;

    Buf q, k, v, dout, out, lse, dq, dk, dv, acc, delta, cq, ck;
    q.alloc(nq * 2); k.alloc(nk * 2); v.alloc(nk * 2); dout.alloc(nq * 2);
    out.alloc(nq * 2); lse.alloc(nl * 4); dq.alloc(nq * 2); dk.alloc(nk * 2); dv.alloc(nk * 2);
    acc.alloc(nq * 4); delta.alloc(nl * 4);
    cq.alloc(cuq.size() * 4); ck.alloc(cuk.size() * 4);
    memcpy(cq.host.data(), cuq.data(), cq.bytes);
    memcpy(ck.host.data(), cuk.data(), ck.bytes);
    cq.upload(); ck.upload();
    for (Buf *bf : {&q, &k, &v, &dout}) {
        uint16_t *p = (uint16_t *)bf->host.data();
        for (size_t i = 0; i < bf->bytes / 2; ++i)
            p[i] = to16(c.dtype, rng_normal());
        bf->upload();
    }

    sf_attn_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.format = c.fmt; cfg.mask = c.mask; cfg.window_left = c.left; cfg.window_right = c.right;
    cfg.softmax_scale = 1.0f / sqrtf((float)c.d);
    cfg.max_seqlen_q = thd ? maxq : 0; cfg.max_seqlen_kv = thd ? maxk : 0;
    cfg.dropout_p = c.dropout;
    cfg.dropout_seed = 0x0123456789abcdefull ^ rng_next();
    cfg.dropout_offset = 4 * (rng_next() % 1000);
    const bool with_cu = !c.lq.empty();

    /* every tensor of the case viewed on the host (the CPU reference) or on the device */
    const int64_t ncu = (int64_t)cuq.size();
    struct Views {
        sf_tensor q, k, v, out, lse, cq, ck, dout, dq, dk, dv, acc, delta;
    };
    auto views = [&](bool dev) {
        auto T = [&](sf_tensor *t, Buf &bf, sf_dtype dt, int n, const int64_t *shape) {
            sf_tensor_init(t, dev ? bf.dev : bf.host.data(), dt, n, shape, dev ? SF_CUDA : SF_CPU, 0);
        };
        Views w;
        T(&w.q, q, c.dtype, nd, sh_q); T(&w.k, k, c.dtype, nd, sh_k); T(&w.v, v, c.dtype, nd, sh_k);
        T(&w.out, out, c.dtype, nd, sh_q); T(&w.lse, lse, SF_FLOAT32, lse_nd, sh_l);
        T(&w.cq, cq, SF_INT32, 1, &ncu); T(&w.ck, ck, SF_INT32, 1, &ncu);
        T(&w.dout, dout, c.dtype, nd, sh_q);
        T(&w.dq, dq, c.dtype, nd, sh_q); T(&w.dk, dk, c.dtype, nd, sh_k); T(&w.dv, dv, c.dtype, nd, sh_k);
        T(&w.acc, acc, SF_FLOAT32, nd, sh_q); T(&w.delta, delta, SF_FLOAT32, lse_nd, sh_l);
        return w;
    };
    /* the two calls, on either side's views (the backend follows the tensors' device) */
    auto forward = [&](Views &w) {
        CHECK_SF(sf_attn_forward(&w.q, &w.k, &w.v, with_cu ? &w.cq : NULL, with_cu ? &w.ck : NULL, &cfg, &w.out, &w.lse,
                                 NULL));
    };
    auto backward = [&](Views &w) {
        CHECK_SF(sf_attn_backward(&w.q, &w.k, &w.v, &w.out, &w.dout, &w.lse, with_cu ? &w.cq : NULL,
                                  with_cu ? &w.ck : NULL, &cfg, &w.dq, &w.dk, &w.dv, &w.acc, &w.delta, NULL));
    };
    /* CPU reference */
    Views host = views(false);
    forward(host);
    backward(host);
    std::vector<uint8_t> ref_out = out.host, ref_lse = lse.host, ref_dq = dq.host, ref_dk = dk.host, ref_dv = dv.host;

    /* CUDA forward */
    Views gpu = views(true);
    const double tol = c.dtype == SF_BFLOAT16 ? 2e-2 : 4e-3;
    char what[320];
    int n = snprintf(what, sizeof what, "%s %s mask=%d b=%d sq=%d sk=%d h=%d hk=%d d=%d win=(%d,%d) drop=%.2f",
                     sf_dtype_name(c.dtype), c.fmt == SF_ATTN_BSHD ? "bshd" : c.fmt == SF_ATTN_SBHD ? "sbhd" : "thd",
                     (int)c.mask, c.b, c.sq, c.sk, c.h, c.hk, c.d, c.left, c.right, c.dropout);
    out.poison(); lse.poison();
    forward(gpu);
    CHECK_CUDA(cudaDeviceSynchronize());
    bool nan = false;
    double e_out = rel_err16(c.dtype, out.download(), ref_out, &nan);
    std::vector<uint8_t> g_lse = lse.download();
    double e_lse = 0;
    bool lse_bad = false;
    for (int64_t i = 0; i < nl; ++i) {
        float a = ((float *)g_lse.data())[i], r = ((float *)ref_lse.data())[i];
        if (isinf(r) || isinf(a)) { if (a != r) lse_bad = true; continue; }
        if (a != a) { lse_bad = true; continue; }
        e_lse = fmax(e_lse, fabs(a - r));
    }
    snprintf(what + n, sizeof what - n, " forward: out rel %.2e lse max abs %.2e%s%s", e_out, e_lse,
             nan ? " NaN" : "", lse_bad ? " lse-inf-mismatch" : "");
    check_report(!nan && !lse_bad && e_out <= tol && e_lse <= 2e-3, what);
    if (getenv("CHECK_VERBOSE"))
        printf("%s\n", what);

    /* CUDA backward from the reference out and lse */
    out.host = ref_out; out.upload();
    lse.host = ref_lse; lse.upload();
    std::vector<uint8_t> det_dq;
    for (int run = 0; run < 3; ++run) {
        /* run 0: atomic dQ, 1 and 2: deterministic (compared bitwise) */
        const int det = run;
        cfg.deterministic = det > 0;
        dq.poison(); dk.poison(); dv.poison(); acc.poison(); delta.poison();
        backward(gpu);
        CHECK_CUDA(cudaDeviceSynchronize());
        bool bnan = false;
        std::vector<uint8_t> gdq_h = dq.download();
        double e_dq = rel_err16(c.dtype, gdq_h, ref_dq, &bnan);
        double e_dk = rel_err16(c.dtype, dk.download(), ref_dk, &bnan);
        double e_dv = rel_err16(c.dtype, dv.download(), ref_dv, &bnan);
        bool repro = true;
        if (det == 1) det_dq = gdq_h;
        if (det == 2) repro = det_dq == gdq_h;
        snprintf(what + n, sizeof what - n, " backward%s: dq %.2e dk %.2e dv %.2e%s%s", det ? "(det)" : "", e_dq, e_dk, e_dv, bnan ? " NaN" : "", repro ? "" : " NOT-REPRODUCIBLE");
        check_report(!bnan && repro && e_dq <= 2 * tol && e_dk <= 2 * tol && e_dv <= 2 * tol, what);
    }
    if (getenv("CHECK_VERBOSE"))
        printf("%s\n", what);
}

static Case mk(sf_attn_format fmt, sf_attn_mask mask, int b, int sq, int sk, int h, int hk, int d, sf_dtype dt,
               int left = -1, int right = -1)
{
    Case c;
    c.fmt = fmt; c.mask = mask; c.b = b; c.sq = sq; c.sk = sk; c.h = h; c.hk = hk; c.d = d; c.dtype = dt;
    c.left = left; c.right = right;
    bool padding = mask == SF_ATTN_PADDING || mask == SF_ATTN_PADDING_CAUSAL || mask == SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT;
    if (padding || fmt == SF_ATTN_THD) {
        for (int i = 0; i < b; ++i) {
            c.lq.push_back(i == 0 ? sq : (int)(rng_next() % (sq + 1)));
            c.lk.push_back(i == 0 ? sk : 1 + (int)(rng_next() % sk));
        }
    }
    return c;
}

static double time_forward_backward(sf_attn_format fmt, sf_attn_mask mask, int b, int s, int h, int d, bool backward,
                           double dropout = 0.0)
{
    int64_t shape[4] = {b, s, h, d}, lshape[3] = {b, h, s};
    int64_t n = (int64_t)b * s * h * d;
    void *q, *k, *v, *o, *dout, *dq, *dk, *dv, *acc, *lse, *delta;
    for (void **p : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, n * 2));
    CHECK_CUDA(cudaMalloc(&acc, n * 4));
    CHECK_CUDA(cudaMalloc(&lse, (int64_t)b * h * s * 4));
    CHECK_CUDA(cudaMalloc(&delta, (int64_t)b * h * s * 4));
    std::vector<uint16_t> hbuf(n);
    for (int64_t i = 0; i < n; ++i) hbuf[i] = sf_f32_to_bf16(rng_normal());
    for (void *p : {q, k, v, dout}) CHECK_CUDA(cudaMemcpy(p, hbuf.data(), n * 2, cudaMemcpyHostToDevice));
    sf_tensor tq, tk, tv, to, tdo, tdq, tdk, tdv, tacc, tl, tdl;
    sf_tensor_init(&tq, q, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tk, k, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tv, v, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&to, o, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tdo, dout, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tdq, dq, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tdk, dk, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tdv, dv, SF_BFLOAT16, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tacc, acc, SF_FLOAT32, 4, shape, SF_CUDA, 0);
    sf_tensor_init(&tl, lse, SF_FLOAT32, 3, lshape, SF_CUDA, 0);
    sf_tensor_init(&tdl, delta, SF_FLOAT32, 3, lshape, SF_CUDA, 0);
    sf_attn_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.format = fmt; cfg.mask = mask; cfg.window_left = cfg.window_right = -1;
    cfg.softmax_scale = 1.0f / sqrtf((float)d);
    cfg.dropout_p = dropout;
    cfg.dropout_seed = 42;
    float ms = time_ms([&] {
        CHECK_SF(sf_attn_forward(&tq, &tk, &tv, NULL, NULL, &cfg, &to, &tl, NULL));
        if (backward)
            CHECK_SF(sf_attn_backward(&tq, &tk, &tv, &to, &tdo, &tl, NULL, NULL, &cfg, &tdq, &tdk, &tdv, &tacc, &tdl, NULL));
    });
    for (void *p : {q, k, v, o, dout, dq, dk, dv, acc, lse, delta}) cudaFree(p);
    double flops = 4.0 * b * h * (double)s * s * d * (mask == SF_ATTN_CAUSAL ? 0.5 : 1.0) * (backward ? 3.5 : 1.0);
    return flops / (ms * 1e-3) / 1e12;
}

int main(int argc, char **argv)
{
    rng_seed();
    const sf_dtype dts[2] = {SF_BFLOAT16, SF_FLOAT16};
    const sf_attn_mask masks[6] = {SF_ATTN_NO_MASK, SF_ATTN_PADDING, SF_ATTN_CAUSAL, SF_ATTN_PADDING_CAUSAL,
                                   SF_ATTN_CAUSAL_BOTTOM_RIGHT, SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT};
    for (int d : {64, 128})
        for (sf_dtype dt : dts) {
            for (sf_attn_mask m : masks) {
                run_case(mk(SF_ATTN_BSHD, m, 2, 128, 128, 2, 2, d, dt));   /* tile multiples */
                run_case(mk(SF_ATTN_BSHD, m, 2, 77, 150, 4, 2, d, dt));    /* not, sq < sk, GQA */
                run_case(mk(SF_ATTN_SBHD, m, 3, 200, 65, 3, 1, d, dt));    /* sq > sk, MQA */
            }
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING, 4, 300, 300, 4, 4, d, dt));
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL, 5, 257, 257, 4, 2, d, dt));
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT, 3, 190, 140, 2, 1, d, dt));
            run_case(mk(SF_ATTN_BSHD, SF_ATTN_CAUSAL, 1, 300, 300, 2, 2, d, dt, 70, 0));   /* sliding window */
            run_case(mk(SF_ATTN_BSHD, SF_ATTN_NO_MASK, 1, 160, 230, 2, 1, d, dt, 33, 17));
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING, 3, 200, 200, 2, 2, d, dt, 0, 64));
        }
    /* the small head dims (24 runs as a 32-wide tile with zero columns) */
    for (int d : {16, 24, 32})
        for (sf_dtype dt : dts) {
            for (sf_attn_mask m : {SF_ATTN_NO_MASK, SF_ATTN_PADDING, SF_ATTN_CAUSAL, SF_ATTN_PADDING_CAUSAL_BOTTOM_RIGHT})
                run_case(mk(SF_ATTN_BSHD, m, 2, 77, 150, 4, 2, d, dt));    /* ragged, sq < sk, GQA */
            run_case(mk(SF_ATTN_SBHD, SF_ATTN_CAUSAL, 3, 256, 256, 4, 1, d, dt)); /* tile multiples, MQA */
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING, 6, 300, 300, 4, 4, d, dt)); /* packed proteins */
            run_case(mk(SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL, 4, 190, 190, 4, 2, d, dt, 40, 0));
        }
    /* attention dropout against the CPU reference's identical mask */
    for (double pd : {0.1, 0.3, 0.5})
        for (sf_dtype dt : dts) {
            Case c = mk(SF_ATTN_BSHD, SF_ATTN_NO_MASK, 2, 77, 150, 4, 2, 64, dt);
            c.dropout = pd;
            run_case(c);
            c = mk(SF_ATTN_SBHD, SF_ATTN_CAUSAL, 2, 130, 130, 2, 1, 128, dt);
            c.dropout = pd;
            run_case(c);
            c = mk(SF_ATTN_THD, SF_ATTN_PADDING_CAUSAL, 4, 200, 200, 4, 2, pd == 0.3 ? 32 : 64, dt);
            c.dropout = pd;
            run_case(c);
            c = mk(SF_ATTN_BSHD, SF_ATTN_PADDING, 3, 100, 90, 2, 2, pd == 0.5 ? 24 : 16, dt);
            c.dropout = pd;
            run_case(c);
        }
    if (argc > 1 && !strcmp(argv[1], "--no-bench"))
        return check_finish("check_attn");
    printf("\nspeed: 16k tokens per batch, bf16, bshd (TFLOP/s)\n");
    printf("%-6s %-4s %-7s %10s %12s\n", "seqlen", "hd", "causal", "forward", "forward+backward");
    for (int d : {64, 128})
        for (int s : {1024, 4096, 8192})
            for (int causal = 0; causal < 2; ++causal) {
                int b = 16384 / s, h = d == 64 ? 32 : 16;
                sf_attn_mask m = causal ? SF_ATTN_CAUSAL : SF_ATTN_NO_MASK;
                double f = time_forward_backward(SF_ATTN_BSHD, m, b, s, h, d, false);
                double fb = time_forward_backward(SF_ATTN_BSHD, m, b, s, h, d, true);
                printf("%-6d %-4d %-7s %10.1f %12.1f TFLOP/s\n", s, d, causal ? "yes" : "no", f, fb);
            }
    printf("\ndropout p=0.1 (same shapes, head dim 64, not causal; sm80 kernels)\n");
    for (int s : {1024, 4096}) {
        const int b = 16384 / s, h = 32;
        double f = time_forward_backward(SF_ATTN_BSHD, SF_ATTN_NO_MASK, b, s, h, 64, false, 0.1);
        double fb = time_forward_backward(SF_ATTN_BSHD, SF_ATTN_NO_MASK, b, s, h, 64, true, 0.1);
        printf("%-6d %-4d %-7s %10.1f %12.1f TFLOP/s\n", s, 64, "no", f, fb);
    }
    return check_finish("check_attn");
}
