// check-links: moe
/*
 * check_block.cu - standalone check and benchmark of the block-scaled
 * quantizers (block_cuda.cu): FP8 with fp32 scales per 1x128 and 128x128
 * block, one scale per row (row-wise), the row-and-column 1x128 pass (with
 * its block column sums), a weight's W and W^T 128x128 operands in one call
 * (and W^T's from W's alone), MXFP8 and NVFP4, quantize and dequantize.
 *
 * Correctness: fresh random x (float32 and bfloat16, values spread over
 * several binades, a few blocks all zero) at shapes with a partial last
 * row block and one row; every device output poisoned (0xff bytes) first.
 * The CUDA results must equal the CPU reference's (block_cpu.c) bit for bit:
 * codes, scales, padding, column sums and the dequantized values alike (the
 * backends share fp8.h's arithmetic, and the hardware FP8 conversion is the
 * same rounding: check_cast.cu).
 * Speed: the 1x128 and row-wise quantizers and the row-and-column pass on a
 * bf16 16384 x 4096 activation, against a device copy of the same bytes.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

static bool same_bytes(const CheckBuf &b)
{
    std::vector<uint8_t> got = b.down();
    return memcmp(got.data(), b.h.data(), b.n * sf_dtype_size(b.dtype)) == 0;
}

/* x: normal values times 2^(-8..8) per row, and every 5th 32-element block
 * of row 0 zero (an all-zero block takes the scale-1 path). */
static void fill_x(CheckBuf &x, int64_t m, int64_t k)
{
    for (int64_t r = 0; r < m; ++r) {
        const float row_scale = ldexpf(1.0f, (int)(rng_next() % 17) - 8);
        for (int64_t c = 0; c < k; ++c)
            x.set(r * k + c, r == 0 && (c / 32) % 5 == 0 ? 0.0f : rng_normal() * row_scale);
    }
    x.up();
}

static void report(const char *what, sf_dtype dt, int64_t m, int64_t k, bool ok)
{
    char line[200];
    snprintf(line, sizeof line, "%s %s M=%lld K=%lld: CUDA %s the CPU reference", what, sf_dtype_name(dt),
             (long long)m, (long long)k, ok ? "equals" : "DIFFERS FROM");
    check_report(ok, line);
}

static void fp8_blocks(sf_dtype dt, int64_t m, int64_t k, int block_rows, sf_dtype fp8)
{
    int64_t sx[2] = {m, k};
    int64_t ss[2] = {block_rows == 1 ? k / 128 : (m + 127) / 128,
                     block_rows == 1 ? round_up(m, 4) : round_up(k / 128, 4)};
    CheckBuf x(dt, m * k), q(fp8, m * k), si(SF_FLOAT32, ss[0] * ss[1]), y(dt, m * k);
    fill_x(x, m, k);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), qo = q.view(2, sx, cuda), so = si.view(2, ss, cuda);
        CHECK_SF(sf_quantize_block_fp8(&xi, &qo, &so, block_rows, NULL));
    }
    const bool quant_ok = same_bytes(q) && same_bytes(si);
    q.up(); /* dequantize the reference's codes on both sides */
    si.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor qi = q.view(2, sx, cuda), s = si.view(2, ss, cuda), yo = y.view(2, sx, cuda);
        CHECK_SF(sf_dequantize_block_fp8(&qi, &s, block_rows, &yo, NULL));
    }
    char what[64];
    snprintf(what, sizeof what, "fp8 %s %s blocks, quantize + dequantize", sf_dtype_name(fp8),
             block_rows == 1 ? "1x128" : "128x128");
    report(what, dt, m, k, quant_ok && same_bytes(y));
}

static void fp8_rows(sf_dtype dt, int64_t m, int64_t k, sf_dtype fp8)
{
    int64_t sx[2] = {m, k}, ss[1] = {m};
    CheckBuf x(dt, m * k), q(fp8, m * k), si(SF_FLOAT32, m);
    fill_x(x, m, k);
    if (m > 1) { /* an all-zero row takes the scale-1 path */
        for (int64_t c = 0; c < k; ++c)
            x.set(k + c, 0.0f);
        x.up();
    }
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), qo = q.view(2, sx, cuda), so = si.view(1, ss, cuda);
        CHECK_SF(sf_quantize_rowwise_fp8(&xi, &qo, &so, NULL));
    }
    char what[64];
    snprintf(what, sizeof what, "fp8 %s row-wise quantize", sf_dtype_name(fp8));
    report(what, dt, m, k, same_bytes(q) && same_bytes(si));
}

static void fp8_rowcol(sf_dtype dt, int64_t m, int64_t k)
{
    const int64_t mt = round_up(m, 128);
    int64_t sx[2] = {m, k}, ss[2] = {k / 128, round_up(m, 4)}, st[2] = {k, mt}, sst[2] = {mt / 128, round_up(k, 4)},
            sc[2] = {mt / 128, k};
    CheckBuf x(dt, m * k), q(SF_FLOAT8_E4M3, m * k), si(SF_FLOAT32, ss[0] * ss[1]), qt(SF_FLOAT8_E4M3, k * mt),
        sit(SF_FLOAT32, sst[0] * sst[1]), sums(SF_FLOAT32, sc[0] * sc[1]);
    fill_x(x, m, k);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), qo = q.view(2, sx, cuda), so = si.view(2, ss, cuda),
                  qto = qt.view(2, st, cuda), sto = sit.view(2, sst, cuda), co = sums.view(2, sc, cuda);
        CHECK_SF(sf_quantize_block_fp8_rowcol(&xi, &qo, &so, &qto, &sto, &co, NULL, NULL));
    }
    report("fp8 e4m3 1x128 rows and columns (+ column sums)", dt, m, k,
           same_bytes(q) && same_bytes(si) && same_bytes(qt) && same_bytes(sit) && same_bytes(sums));
}

/* A weight's W and W^T 128x128 operands in one call (M, K multiples of 128). */
static void fp8_weight(sf_dtype dt, int64_t m, int64_t k, sf_dtype fp8)
{
    int64_t sx[2] = {m, k}, ss[2] = {m / 128, round_up(k / 128, 4)}, st[2] = {k, m},
            sst[2] = {k / 128, round_up(m / 128, 4)};
    CheckBuf x(dt, m * k), q(fp8, m * k), si(SF_FLOAT32, ss[0] * ss[1]), qt(fp8, k * m),
        sit(SF_FLOAT32, sst[0] * sst[1]);
    fill_x(x, m, k);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), qo = q.view(2, sx, cuda), so = si.view(2, ss, cuda),
                  qto = qt.view(2, st, cuda), sto = sit.view(2, sst, cuda);
        CHECK_SF(sf_quantize_block_fp8_weight(&xi, &qo, &so, &qto, &sto, NULL));
    }
    char what[80];
    snprintf(what, sizeof what, "fp8 %s 128x128 weight and its transpose", sf_dtype_name(fp8));
    report(what, dt, m, k, same_bytes(q) && same_bytes(si) && same_bytes(qt) && same_bytes(sit));
    /* the transposed operand alone, from the CPU's forward operand, into fresh buffers */
    q.up();
    si.up();
    CheckBuf qt2(fp8, k * m), sit2(SF_FLOAT32, sst[0] * sst[1]);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor qi = q.view(2, sx, cuda), s = si.view(2, ss, cuda), qto = qt2.view(2, st, cuda),
                  sto = sit2.view(2, sst, cuda);
        CHECK_SF(sf_block_transpose_fp8(&qi, &s, &qto, &sto, NULL));
    }
    snprintf(what, sizeof what, "fp8 %s 128x128 weight operand transposed", sf_dtype_name(fp8));
    report(what, dt, m, k, same_bytes(qt2) && same_bytes(sit2) && memcmp(qt2.h.data(), qt.h.data(), k * m) == 0 &&
                               memcmp(sit2.h.data(), sit.h.data(), sst[0] * sst[1] * 4) == 0);
}

static void mxfp8(sf_dtype dt, int64_t m, int64_t k)
{
    int64_t sx[2] = {m, k}, ss[2] = {m, k / 32};
    CheckBuf x(dt, m * k), q(SF_FLOAT8_E4M3, m * k), sc(SF_UINT8, m * k / 32), y(dt, m * k);
    fill_x(x, m, k);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), qo = q.view(2, sx, cuda), so = sc.view(2, ss, cuda);
        CHECK_SF(sf_quantize_mxfp8(&xi, &qo, &so, NULL));
    }
    const bool quant_ok = same_bytes(q) && same_bytes(sc);
    q.up();
    sc.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor qi = q.view(2, sx, cuda), s = sc.view(2, ss, cuda), yo = y.view(2, sx, cuda);
        CHECK_SF(sf_dequantize_mxfp8(&qi, &s, &yo, NULL));
    }
    report("mxfp8 (e4m3, e8m0 per 32), quantize + dequantize", dt, m, k, quant_ok && same_bytes(y));
}

static void nvfp4(sf_dtype dt, int64_t m, int64_t k)
{
    int64_t sx[2] = {m, k}, sq[2] = {m, k / 2}, ss[2] = {m, k / 16}, one[1] = {1};
    CheckBuf x(dt, m * k), amax(SF_FLOAT32, 1), q(SF_UINT8, m * k / 2), bs(SF_UINT8, m * k / 16),
        g(SF_FLOAT32, 1), y(dt, m * k);
    fill_x(x, m, k);
    float a = 0.0f;
    for (int64_t i = 0; i < m * k; ++i)
        a = fmaxf(a, fabsf(check_load(dt, x.h.data(), i)));
    amax.set(0, a);
    amax.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), am = amax.view(1, one, cuda), qo = q.view(2, sq, cuda),
                  so = bs.view(2, ss, cuda), go = g.view(1, one, cuda);
        CHECK_SF(sf_quantize_nvfp4(&xi, &am, &qo, &so, &go, NULL));
    }
    const bool quant_ok = same_bytes(q) && same_bytes(bs) && same_bytes(g);
    q.up();
    bs.up();
    g.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor qi = q.view(2, sq, cuda), s = bs.view(2, ss, cuda), gi = g.view(1, one, cuda),
                  yo = y.view(2, sx, cuda);
        CHECK_SF(sf_dequantize_nvfp4(&qi, &s, &gi, &yo, NULL));
    }
    report("nvfp4 (e2m1, e4m3 per 16, fp32 per tensor), quantize + dequantize", dt, m, k,
           quant_ok && same_bytes(y));
}

static void bench(void)
{
    const int64_t m = 16384, k = 4096, mt = m;
    int64_t sx[2] = {m, k}, ss[2] = {k / 128, m}, st[2] = {k, mt}, sst[2] = {mt / 128, k};
    void *x, *q, *si, *qt, *sit;
    CHECK_CUDA(cudaMalloc(&x, m * k * 2));
    CHECK_CUDA(cudaMalloc(&q, m * k));
    CHECK_CUDA(cudaMalloc(&qt, m * k));
    CHECK_CUDA(cudaMalloc(&si, ss[0] * ss[1] * 4));
    CHECK_CUDA(cudaMalloc(&sit, sst[0] * sst[1] * 4));
    CHECK_CUDA(cudaMemset(x, 0x3c, m * k * 2));
    sf_tensor tx, tq, tsi, tqt, tsit;
    sf_tensor_init(&tx, x, SF_BFLOAT16, 2, sx, SF_CUDA, 0);
    sf_tensor_init(&tq, q, SF_FLOAT8_E4M3, 2, sx, SF_CUDA, 0);
    sf_tensor_init(&tsi, si, SF_FLOAT32, 2, ss, SF_CUDA, 0);
    sf_tensor_init(&tqt, qt, SF_FLOAT8_E4M3, 2, st, SF_CUDA, 0);
    sf_tensor_init(&tsit, sit, SF_FLOAT32, 2, sst, SF_CUDA, 0);
    const double copy = check_copy_tbs((size_t)m * k * 2);
    const float t1 = time_ms([&] { CHECK_SF(sf_quantize_block_fp8(&tx, &tq, &tsi, 1, NULL)); });
    const float t2 = time_ms([&] { CHECK_SF(sf_quantize_block_fp8_rowcol(&tx, &tq, &tsi, &tqt, &tsit, NULL, NULL, NULL)); });
    int64_t sr[1] = {m};
    sf_tensor trs;
    sf_tensor_init(&trs, si, SF_FLOAT32, 1, sr, SF_CUDA, 0);
    const float t3 = time_ms([&] { CHECK_SF(sf_quantize_rowwise_fp8(&tx, &tq, &trs, NULL)); });
    const double b1 = (double)m * k * 3, b2 = (double)m * k * 4; /* bf16 read, one or two fp8 copies written */
    printf("block fp8 1x128 quantize bf16 %lldx%lld: %.3f ms = %.2f TB/s (%.0f%% of copy %.2f TB/s)\n", (long long)m,
           (long long)k, t1, b1 / t1 / 1e9, 100 * b1 / t1 / 1e9 / copy, copy);
    printf("block fp8 1x128 rows+columns bf16 %lldx%lld: %.3f ms = %.2f TB/s (%.0f%% of copy)\n", (long long)m,
           (long long)k, t2, b2 / t2 / 1e9, 100 * b2 / t2 / 1e9 / copy);
    printf("row-wise fp8 quantize bf16 %lldx%lld: %.3f ms = %.2f TB/s (%.0f%% of copy)\n", (long long)m,
           (long long)k, t3, b1 / t3 / 1e9, 100 * b1 / t3 / 1e9 / copy);
    for (int64_t kk : {1024, 3584, 7168}) { /* Mixtral-small's expert rows: x, the SwiGLU output, fc1's dgrad input */
        const int64_t mm = m * k / kk / 2; /* (32768 rows at 1,024; fewer at the wider rows: the same buffer) */
        int64_t sxk[2] = {mm, kk}, srk[1] = {mm};
        sf_tensor xk, qk, sk;
        sf_tensor_init(&xk, x, SF_BFLOAT16, 2, sxk, SF_CUDA, 0);
        sf_tensor_init(&qk, q, SF_FLOAT8_E4M3, 2, sxk, SF_CUDA, 0);
        sf_tensor_init(&sk, si, SF_FLOAT32, 1, srk, SF_CUDA, 0);
        const float tk = time_ms([&] { CHECK_SF(sf_quantize_rowwise_fp8(&xk, &qk, &sk, NULL)); });
        const double bk = (double)mm * kk * 3;
        printf("row-wise fp8 quantize bf16 %lldx%lld: %.3f ms = %.2f TB/s (%.0f%% of copy)\n", (long long)mm,
               (long long)kk, tk, bk / tk / 1e9, 100 * bk / tk / 1e9 / copy);
    }
    cudaFree(x); cudaFree(q); cudaFree(qt); cudaFree(si); cudaFree(sit);
}

int main(void)
{
    rng_seed();
    const sf_dtype dtypes[2] = {SF_FLOAT32, SF_BFLOAT16};
    const int64_t shapes[3][2] = {{300, 384}, {1, 128}, {129, 256}};
    for (sf_dtype dt : dtypes)
        for (auto &s : shapes) {
            for (int block_rows : {1, 128}) {
                fp8_blocks(dt, s[0], s[1], block_rows, SF_FLOAT8_E4M3);
                fp8_blocks(dt, s[0], s[1], block_rows, SF_FLOAT8_E5M2);
            }
            fp8_rowcol(dt, s[0], s[1]);
            fp8_rows(dt, s[0], s[1], SF_FLOAT8_E4M3);
            fp8_rows(dt, s[0], s[1], SF_FLOAT8_E5M2);
            mxfp8(dt, s[0], s[1]);
            nvfp4(dt, s[0], s[1]);
        }
    for (sf_dtype dt : dtypes) /* scale rows padded to 4 blocks (3, 5 blocks) and not (4, 8) */
        for (auto &s : {std::pair<int64_t, int64_t>{384, 640}, {512, 1024}, {640, 384}}) {
            fp8_weight(dt, s.first, s.second, SF_FLOAT8_E4M3);
            fp8_weight(dt, s.first, s.second, SF_FLOAT8_E5M2);
        }
    for (sf_dtype dt : dtypes) /* row lengths that are not whole 256-value warp steps */
        for (int64_t k : {16, 48, 1040, 2064, 7168, 8208, 12288}) /* CTA per row with 1/2/4 vectors, warp per row */
            fp8_rows(dt, 37, k, SF_FLOAT8_E4M3);
    bench();
    return check_finish("check_block");
}
