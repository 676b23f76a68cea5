/*
 * check_moe.cu - standalone check and benchmark of the moe family's CUDA
 * kernels (router, auxiliary losses, token permutation, probability-scaled
 * SwiGLU), no Python.
 *
 * Correctness: fresh random inputs (float32 and bfloat16) at 8, 64 and 128
 * experts and top-k from 1 to 8, every score function, through the public
 * sf_moe_* calls on host tensors (the CPU reference) and device tensors;
 * device outputs are poisoned (0xff bytes) first, so an unwritten element
 * shows as NaN or as a wrong id.  The routing map must equal the
 * reference's except on rows whose k-th and (k+1)-th selection values tie
 * within 1e-5 (the backends' expf may differ in the last bit, which can
 * swap such a pair; those rows are counted and left out of the value
 * comparisons).  Row ids, tokens per expert, permuted rows and permuted
 * probabilities must match bit for bit; probabilities, scores, losses and
 * gradients within check_tol of their dtype (relative norm error, the
 * tolerance table the other checks use).  Each backward takes the
 * reference's forward outputs on both sides, so every op is checked on its
 * own inputs.
 * Speed: permute, unpermute and its backward at a Mixtral layer's shape
 * (16384 tokens, hidden 4096, 8 experts, top-2, bf16) and the scaled
 * SwiGLU and its backward at Mixtral-small's (32768 rows of 3584) against
 * a device copy of the same bytes, and the top-k router at 16384 tokens.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

/* Normal values of standard deviation `scale` on the host, copied to the device. */
static void fill_normal_up(CheckBuf &b, float scale)
{
    for (int64_t i = 0; i < b.n; ++i)
        b.set(i, rng_normal() * scale);
    b.up();
}

/* Zero the rows marked in skip (rows of `width` elements of dtype d). */
static void zero_rows(sf_dtype d, std::vector<uint8_t> &h, const std::vector<int> &skip, int64_t width)
{
    for (size_t r = 0; r < skip.size(); ++r)
        if (skip[r])
            for (int64_t j = 0; j < width; ++j)
                check_store(d, h.data(), (int64_t)r * width + j, 0.0f);
}

/* Relative norm error of the device result of b against its host (CPU)
 * result, the rows marked in skip left out. */
static double err_rows(const CheckBuf &b, const std::vector<int> &skip, int64_t width)
{
    std::vector<uint8_t> got = b.down(), ref = b.h;
    zero_rows(b.dtype, got, skip, width);
    zero_rows(b.dtype, ref, skip, width);
    return check_rel_err(b.dtype, got, ref, b.n);
}

static double err_all(const CheckBuf &b) { return check_rel_err(b.dtype, b.down(), b.h, b.n); }

/* Device bytes equal to host bytes (the n elements)? */
static bool same_bytes(const CheckBuf &b)
{
    std::vector<uint8_t> got = b.down();
    return memcmp(got.data(), b.h.data(), b.n * sf_dtype_size(b.dtype)) == 0;
}

/* Is token t's top-k selection a near tie: the k-th and (k+1)-th largest of
 * the values the router selects on (the logits for softmax, in the same
 * order as their softmax; sigmoid(logit) + bias for sigmoid) within 1e-5? */
static bool near_tie(const CheckBuf &logits, const CheckBuf *bias, int64_t t, int64_t E, int topk,
                     sf_moe_score score)
{
    if (topk >= E)
        return false;
    std::vector<double> v(E);
    for (int64_t e = 0; e < E; ++e) {
        double x = check_load(logits.dtype, logits.h.data(), t * E + e);
        if (score == SF_MOE_SIGMOID)
            x = 1.0 / (1.0 + exp(-x)) + (bias ? check_load(SF_FLOAT32, bias->h.data(), e) : 0.0);
        v[e] = x;
    }
    std::sort(v.begin(), v.end(), [](double a, double b) { return a > b; });
    return v[topk - 1] - v[topk] <= 1e-5 * fmax(1.0, fabs(v[topk - 1]));
}

/* Compare the routing maps row by row: *bad rows that differ without a
 * tie, *ties rows that differ at a tie (marked in skip). */
static void compare_maps(const CheckBuf &map, const CheckBuf &logits, const CheckBuf *bias, int64_t T,
                         int64_t E, int topk, sf_moe_score score, std::vector<int> &skip, int64_t *bad,
                         int64_t *ties)
{
    std::vector<uint8_t> got = map.down();
    *bad = *ties = 0;
    for (int64_t t = 0; t < T; ++t) {
        if (memcmp(&got[t * E], &map.h[t * E], E) == 0)
            continue;
        if (near_tie(logits, bias, t, E, topk, score)) {
            skip[t] = 1;
            ++*ties;
        } else {
            ++*bad;
        }
    }
}

static void router_case(sf_dtype dt, int64_t T, int64_t E, int topk, sf_moe_score score, int pre, int with_bias)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    const float scaling = 1.5f;
    int64_t s2[2] = {T, E}, s1[1] = {E}, one[1] = {1}, sT[1] = {T};
    CheckBuf logits(dt, T * E), bias(SF_FLOAT32, E), probs(dt, T * E), map(SF_BOOL, T * E),
        saved(SF_FLOAT32, T * E), dprobs(dt, T * E), dlogits(dt, T * E);
    fill_normal_up(logits, 2.0f);
    fill_normal_up(bias, 0.3f);
    fill_normal_up(dprobs, 1.0f);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor l = logits.view(2, s2, cuda), b = bias.view(1, s1, cuda), p = probs.view(2, s2, cuda),
                  m = map.view(2, s2, cuda), s = saved.view(2, s2, cuda);
        CHECK_SF(sf_moe_topk_forward(&l, topk, score, pre, scaling, with_bias ? &b : NULL, &p, &m, &s, NULL));
    }
    std::vector<int> skip(T, 0);
    int64_t bad, ties;
    compare_maps(map, logits, with_bias ? &bias : NULL, T, E, topk, score, skip, &bad, &ties);
    double ep = err_rows(probs, skip, E), es = err_rows(saved, skip, E);

    /* backward on the reference's map and saved scores, both sides */
    map.up();
    saved.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor m = map.view(2, s2, cuda), s = saved.view(2, s2, cuda), g = dprobs.view(2, s2, cuda),
                  d = dlogits.view(2, s2, cuda);
        CHECK_SF(sf_moe_topk_backward(&m, &s, &g, topk, score, pre, scaling, &d, NULL));
    }
    double eg = err_all(dlogits);
    const double tol = check_tol(dt);
    char what[300];
    snprintf(what, sizeof what,
             "moe topk %s T=%lld E=%lld k=%d %s%s%s: map rows %lld differ (+%lld ties), probs %.1e, saved %.1e, "
             "dlogits %.1e (tol %.1e)", sf_dtype_name(dt), (long long)T, (long long)E, topk,
             score == SF_MOE_SIGMOID ? "sigmoid" : "softmax", pre ? " pre_softmax" : "", with_bias ? " bias" : "",
             (long long)bad, (long long)ties, ep, es, eg, tol);
    check_report(bad == 0 && ties <= T / 100 && ep <= tol && es <= check_tol(SF_FLOAT32) && eg <= tol, what);

    /* the load-balancing scores and their gradient */
    CheckBuf scores(SF_FLOAT32, T * E), amap(SF_BOOL, T * E), asaved(SF_FLOAT32, T * E), dscores(SF_FLOAT32, T * E);
    fill_normal_up(dscores, 1.0f);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor l = logits.view(2, s2, cuda), sc = scores.view(2, s2, cuda), m = amap.view(2, s2, cuda),
                  s = asaved.view(2, s2, cuda);
        CHECK_SF(sf_moe_aux_scores_forward(&l, topk, score, &sc, &m, &s, NULL));
    }
    std::vector<int> askip(T, 0);
    compare_maps(amap, logits, NULL, T, E, topk, score, askip, &bad, &ties);
    double esc = err_rows(scores, askip, E);
    asaved.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor s = asaved.view(2, s2, cuda), g = dscores.view(2, s2, cuda), d = dlogits.view(2, s2, cuda);
        CHECK_SF(sf_moe_aux_scores_backward(&s, &g, score, &d, NULL));
    }
    eg = err_all(dlogits);
    snprintf(what, sizeof what, "moe aux scores %s T=%lld E=%lld k=%d %s: map rows %lld differ (+%lld ties), scores %.1e, "
             "dlogits %.1e (tol %.1e)", sf_dtype_name(dt), (long long)T, (long long)E, topk,
             score == SF_MOE_SIGMOID ? "sigmoid" : "softmax", (long long)bad, (long long)ties, esc, eg, tol);
    check_report(bad == 0 && ties <= T / 100 && esc <= check_tol(SF_FLOAT32) && eg <= tol, what);

    /* z-loss (a float32 scalar summed with one atomic per block on the GPU)
     * and its gradient */
    CheckBuf loss(SF_FLOAT32, 1), lse(SF_FLOAT32, T), dloss(SF_FLOAT32, 1);
    dloss.set(0, 0.7f);
    dloss.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor l = logits.view(2, s2, cuda), o = loss.view(1, one, cuda), s = lse.view(1, sT, cuda);
        CHECK_SF(sf_moe_z_loss_forward(&l, 1e-3f, &o, &s, NULL));
    }
    double ez = err_all(loss), el = err_all(lse);
    lse.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor l = logits.view(2, s2, cuda), s = lse.view(1, sT, cuda), g = dloss.view(1, one, cuda),
                  d = dlogits.view(2, s2, cuda);
        CHECK_SF(sf_moe_z_loss_backward(&l, &s, &g, 1e-3f, &d, NULL));
    }
    eg = err_all(dlogits);
    snprintf(what, sizeof what, "moe z-loss %s T=%lld E=%lld: loss %.1e, lse %.1e, dlogits %.1e", sf_dtype_name(dt),
             (long long)T, (long long)E, ez, el, eg);
    check_report(ez <= check_tol(SF_FLOAT32) && el <= check_tol(SF_FLOAT32) && eg <= tol, what);

    /* the load-balancing loss on the reference's probabilities and counts */
    CheckBuf tpe(SF_INT64, E), aux(SF_FLOAT32, 1), dp(dt, T * E);
    for (int64_t e = 0; e < E; ++e) {
        int64_t c = 0;
        for (int64_t t = 0; t < T; ++t)
            c += map.h[t * E + e] != 0;
        memcpy(&tpe.h[e * 8], &c, 8);
    }
    tpe.up();
    probs.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor p = probs.view(2, s2, cuda), c = tpe.view(1, s1, cuda), o = aux.view(1, one, cuda),
                  g = dloss.view(1, one, cuda), d = dp.view(2, s2, cuda);
        CHECK_SF(sf_moe_aux_loss_forward(&p, &c, T, topk, 1e-2f, &o, NULL));
        CHECK_SF(sf_moe_aux_loss_backward(&g, &c, T, topk, 1e-2f, &d, NULL));
    }
    double ea = err_all(aux), ed = err_all(dp);
    snprintf(what, sizeof what, "moe aux loss %s T=%lld E=%lld k=%d: loss %.1e, dprobs %.1e", sf_dtype_name(dt),
             (long long)T, (long long)E, topk, ea, ed);
    check_report(ea <= check_tol(SF_FLOAT32) && ed <= tol, what);
}

/* A routing map with `topk` distinct random experts per token (host side). */
static void random_map(CheckBuf &map, int64_t T, int64_t E, int topk)
{
    memset(map.h.data(), 0, T * E);
    for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < topk;) {
            int64_t e = (int64_t)(rng_next() % (uint64_t)E);
            if (!map.h[t * E + e]) {
                map.h[t * E + e] = 1;
                ++j;
            }
        }
    map.up();
}

/* A routing of T tokens to topk of E experts (random_map), its row ids and
 * per-expert counts made on both backends (the device side of later ops
 * reads the same ones), and a probability for each routed pair (zero
 * elsewhere).  ids_ok: the backends' ids and counts agree byte for byte. */
struct Routing {
    CheckBuf map, rid, tpe, probs;
    bool ids_ok;
    Routing(int64_t T, int64_t E, int topk)
        : map(SF_BOOL, T * E), rid(SF_INT32, T * E), tpe(SF_INT64, E), probs(SF_FLOAT32, T * E)
    {
        int64_t s2[2] = {T, E}, s1[1] = {E};
        random_map(map, T, E, topk);
        for (int cuda = 0; cuda < 2; ++cuda) {
            sf_tensor m = map.view(2, s2, cuda), r = rid.view(2, s2, cuda), c = tpe.view(1, s1, cuda);
            CHECK_SF(sf_moe_row_id_map(&m, &r, &c, NULL));
        }
        ids_ok = same_bytes(rid) && same_bytes(tpe);
        rid.up();
        for (int64_t i = 0; i < T * E; ++i)
            probs.set(i, map.h[i] ? rng_uniform() : 0.0f);
        probs.up();
    }
};

/* drop: rows cut from the end of the permuted buffer (capacity). */
static void permute_case(sf_dtype dt, int64_t T, int64_t E, int topk, int64_t H, int64_t drop)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    int64_t s2[2] = {T, E};
    Routing routing(T, E, topk);
    CheckBuf &rid = routing.rid, &probs = routing.probs;
    const bool ids_ok = routing.ids_ok;

    const int64_t N = T * topk - drop;
    int64_t sx[2] = {T, H}, sp[2] = {N, H}, sn[1] = {N};
    CheckBuf inp(dt, T * H), out(dt, N * H), out_probs(SF_FLOAT32, N);
    fill_normal_up(inp, 1.0f);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor x = inp.view(2, sx, cuda), r = rid.view(2, s2, cuda), p = probs.view(2, s2, cuda),
                  o = out.view(2, sp, cuda), op = out_probs.view(1, sn, cuda);
        CHECK_SF(sf_moe_permute(&x, &r, &p, &o, &op, NULL));
    }
    const bool permute_ok = same_bytes(out) && same_bytes(out_probs);

    /* unpermute (the expert outputs back to tokens, weighted) and its
     * backward; permute_probs_backward */
    CheckBuf y(dt, N * H), back(dt, T * H), dout(dt, T * H), dy(dt, N * H), dprobs(SF_FLOAT32, T * E),
        dout_probs(SF_FLOAT32, N), dprobs2(SF_FLOAT32, T * E);
    fill_normal_up(y, 1.0f);
    fill_normal_up(dout, 1.0f);
    fill_normal_up(dout_probs, 1.0f);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor yi = y.view(2, sp, cuda), r = rid.view(2, s2, cuda), p = probs.view(2, s2, cuda),
                  b = back.view(2, sx, cuda), g = dout.view(2, sx, cuda), d = dy.view(2, sp, cuda),
                  dpr = dprobs.view(2, s2, cuda), gp = dout_probs.view(1, sn, cuda),
                  dpr2 = dprobs2.view(2, s2, cuda);
        CHECK_SF(sf_moe_unpermute(&yi, &r, &p, &b, NULL));
        CHECK_SF(sf_moe_unpermute_backward(&g, &yi, &r, &p, &d, &dpr, NULL));
        CHECK_SF(sf_moe_permute_probs_backward(&r, &gp, &dpr2, NULL));
    }
    const double eb = err_all(back), ed = err_all(dy), ep = err_all(dprobs), tol = check_tol(dt);
    const bool probs_backward_ok = same_bytes(dprobs2);
    char what[300];
    snprintf(what, sizeof what,
             "moe permutation %s T=%lld E=%lld k=%d H=%lld dropped=%lld: row ids %s, permute %s, unpermute %.1e, "
             "dinp %.1e, dprobs %.1e (tol %.1e), permute_probs_backward %s", sf_dtype_name(dt), (long long)T,
             (long long)E, topk, (long long)H, (long long)drop, ids_ok ? "equal" : "DIFFER",
             permute_ok ? "equal" : "DIFFERS", eb, ed, ep, tol, probs_backward_ok ? "equal" : "DIFFERS");
    check_report(ids_ok && permute_ok && probs_backward_ok && eb <= tol && ed <= tol && ep <= check_tol(SF_FLOAT32) * 10,
                 what);
}

/* unpermute without probabilities, and its backward without probabilities
 * and without dprobs (inp then not given), with dout in dtype gdt and inp
 * in dt (unpermute's backward takes them apart). */
static void unpermute_plain_case(sf_dtype dt, sf_dtype gdt, int64_t T, int64_t E, int topk, int64_t H)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    int64_t s2[2] = {T, E};
    Routing routing(T, E, topk);
    CheckBuf &rid = routing.rid, &probs = routing.probs;
    const bool ids_ok = routing.ids_ok;
    const int64_t N = T * topk;
    int64_t sx[2] = {T, H}, sp[2] = {N, H};
    CheckBuf y(dt, N * H), back(dt, T * H), dout(gdt, T * H), dy(gdt, N * H), dy_p(gdt, N * H),
        dprobs(SF_FLOAT32, T * E);
    fill_normal_up(y, 1.0f);
    fill_normal_up(dout, 1.0f);
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor yi = y.view(2, sp, cuda), r = rid.view(2, s2, cuda), b = back.view(2, sx, cuda),
                  g = dout.view(2, sx, cuda), d = dy.view(2, sp, cuda), p = probs.view(2, s2, cuda),
                  dp_ = dy_p.view(2, sp, cuda), dpr = dprobs.view(2, s2, cuda);
        CHECK_SF(sf_moe_unpermute(&yi, &r, NULL, &b, NULL));
        CHECK_SF(sf_moe_unpermute_backward(&g, NULL, &r, NULL, &d, NULL, NULL));
        CHECK_SF(sf_moe_unpermute_backward(&g, &yi, &r, &p, &dp_, &dpr, NULL)); /* dout and inp dtypes apart */
    }
    const double eb = err_all(back), ed = err_all(dy), edp = err_all(dy_p), ep = err_all(dprobs);
    const double tol = check_tol(dt) > check_tol(gdt) ? check_tol(dt) : check_tol(gdt);
    char what[240];
    snprintf(what, sizeof what, "moe unpermute plain %s (dout %s) T=%lld E=%lld k=%d H=%lld: out %.1e, dinp %.1e, "
             "with probs: dinp %.1e, dprobs %.1e", sf_dtype_name(dt), sf_dtype_name(gdt), (long long)T, (long long)E,
             topk, (long long)H, eb, ed, edp, ep);
    check_report(ids_ok && eb <= check_tol(dt) && ed <= check_tol(gdt) && edp <= check_tol(gdt) && ep <= 10 * tol,
                 what);
}

/* gdt: dout's dtype (x's when SF_BOOL is passed: the default). */
static void swiglu_case(sf_dtype dt, int64_t N, int64_t F, sf_dtype gdt = SF_BOOL)
{
    if (gdt == SF_BOOL)
        gdt = dt;
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    int64_t sx[2] = {N, 2 * F}, so[2] = {N, F}, sn[1] = {N};
    CheckBuf x(dt, N * 2 * F), probs(SF_FLOAT32, N), out(dt, N * F), dout(gdt, N * F), dx(dt, N * 2 * F),
        dprobs(SF_FLOAT32, N);
    fill_normal_up(x, 2.0f);
    fill_normal_up(dout, 1.0f);
    for (int64_t i = 0; i < N; ++i)
        probs.set(i, rng_uniform());
    probs.up();
    for (int cuda = 0; cuda < 2; ++cuda) {
        sf_tensor xi = x.view(2, sx, cuda), p = probs.view(1, sn, cuda), o = out.view(2, so, cuda),
                  g = dout.view(2, so, cuda), d = dx.view(2, sx, cuda), dp = dprobs.view(1, sn, cuda);
        CHECK_SF(sf_moe_swiglu_forward(&xi, &p, &o, NULL));
        CHECK_SF(sf_moe_swiglu_backward(&g, &xi, &p, &d, &dp, NULL));
    }
    const double eo = err_all(out), ed = err_all(dx), ep = err_all(dprobs), tol = check_tol(dt);
    char what[200];
    snprintf(what, sizeof what, "moe swiglu %s (dout %s) N=%lld F=%lld: out %.1e, dx %.1e, dprobs %.1e (tol %.1e)",
             sf_dtype_name(dt), sf_dtype_name(gdt), (long long)N, (long long)F, eo, ed, ep, tol);
    check_report(eo <= tol && ed <= tol && ep <= 10 * check_tol(SF_FLOAT32), what);
}

/* Speed at a Mixtral layer's shape: permute reads and writes N = T * topk
 * rows of H bf16 values; unpermute reads N rows and writes T. */
static void bench(void)
{
    const int64_t T = 16384, E = 8, H = 4096, N = T * 2;
    const int topk = 2;
    int64_t s2[2] = {T, E}, s1[1] = {E}, sx[2] = {T, H}, sp[2] = {N, H};
    CheckBuf map(SF_BOOL, T * E), rid(SF_INT32, T * E), tpe(SF_INT64, E), inp(SF_BFLOAT16, T * H),
        out(SF_BFLOAT16, N * H), back(SF_BFLOAT16, T * H);
    random_map(map, T, E, topk);
    CHECK_CUDA(cudaMemset(inp.d, 0x3c, T * H * 2));
    CHECK_CUDA(cudaMemset(out.d, 0x3c, N * H * 2));
    sf_tensor m = map.view(2, s2, 1), r = rid.view(2, s2, 1), c = tpe.view(1, s1, 1), x = inp.view(2, sx, 1),
              o = out.view(2, sp, 1), b = back.view(2, sx, 1);
    CHECK_SF(sf_moe_row_id_map(&m, &r, &c, NULL));
    const double copy = check_copy_tbs((size_t)N * H * 2);
    const float tp = time_ms([&] { CHECK_SF(sf_moe_permute(&x, &r, NULL, &o, NULL, NULL)); });
    const float tu = time_ms([&] { CHECK_SF(sf_moe_unpermute(&o, &r, NULL, &b, NULL)); });
    const double bp = 2.0 * N * H * 2, bu = (double)(N + T) * H * 2;
    printf("moe permute bf16 T=%lld H=%lld E=%lld top-%d: %.3f ms = %.2f TB/s (%.0f%% of copy %.2f TB/s)\n",
           (long long)T, (long long)H, (long long)E, topk, tp, bp / tp / 1e9, 100 * bp / tp / 1e9 / copy, copy);
    printf("moe unpermute bf16 T=%lld H=%lld E=%lld top-%d: %.3f ms = %.2f TB/s (%.0f%% of copy)\n", (long long)T,
           (long long)H, (long long)E, topk, tu, bu / tu / 1e9, 100 * bu / tu / 1e9 / copy);
    {   /* unpermute's backward with dprobs: reads dout (T rows) and inp (N rows), writes dinp (N rows) */
        CheckBuf g(SF_BFLOAT16, T * H), probs(SF_FLOAT32, T * E), dprobs(SF_FLOAT32, T * E), dinp(SF_BFLOAT16, N * H);
        CHECK_CUDA(cudaMemset(g.d, 0x3c, T * H * 2));
        CHECK_CUDA(cudaMemset(probs.d, 0, T * E * 4));
        sf_tensor gi = g.view(2, sx, 1), p = probs.view(2, s2, 1), dp = dprobs.view(2, s2, 1), di = dinp.view(2, sp, 1);
        const float tb = time_ms([&] { CHECK_SF(sf_moe_unpermute_backward(&gi, &o, &r, &p, &di, &dp, NULL)); });
        const double bb = (double)(T + 2 * N) * H * 2;
        printf("moe unpermute_backward bf16 T=%lld H=%lld E=%lld top-%d (with dprobs): %.3f ms = %.2f TB/s "
               "(%.0f%% of copy)\n", (long long)T, (long long)H, (long long)E, topk, tb, bb / tb / 1e9,
               100 * bb / tb / 1e9 / copy);
    }
    {   /* the probability-scaled SwiGLU at Mixtral-small's expert shape: N = 32768 rows, F = 3584 */
        const int64_t NS = 32768, F = 3584;
        int64_t sxs[2] = {NS, 2 * F}, sos[2] = {NS, F}, sns[1] = {NS};
        CheckBuf x(SF_BFLOAT16, NS * 2 * F), a(SF_BFLOAT16, NS * F), dx(SF_BFLOAT16, NS * 2 * F),
            probs(SF_FLOAT32, NS), dprobs(SF_FLOAT32, NS);
        CHECK_CUDA(cudaMemset(x.d, 0x3c, NS * 2 * F * 2));
        CHECK_CUDA(cudaMemset(a.d, 0x3c, NS * F * 2));
        CHECK_CUDA(cudaMemset(probs.d, 0, NS * 4));
        sf_tensor xi = x.view(2, sxs, 1), ai = a.view(2, sos, 1), dxi = dx.view(2, sxs, 1), p = probs.view(1, sns, 1),
                  dp = dprobs.view(1, sns, 1);
        const float tf = time_ms([&] { CHECK_SF(sf_moe_swiglu_forward(&xi, &p, &ai, NULL)); });
        const float tb = time_ms([&] { CHECK_SF(sf_moe_swiglu_backward(&ai, &xi, &p, &dxi, &dp, NULL)); });
        const double bf = 3.0 * NS * F * 2, bb = 5.0 * NS * F * 2;
        printf("moe swiglu_forward bf16 N=%lld F=%lld: %.3f ms = %.2f TB/s (%.0f%% of copy)\n", (long long)NS,
               (long long)F, tf, bf / tf / 1e9, 100 * bf / tf / 1e9 / copy);
        printf("moe swiglu_backward bf16 N=%lld F=%lld (with dprobs): %.3f ms = %.2f TB/s (%.0f%% of copy)\n",
               (long long)NS, (long long)F, tb, bb / tb / 1e9, 100 * bb / tb / 1e9 / copy);
    }

    for (int64_t experts : {(int64_t)8, (int64_t)64}) {
        int64_t sl[2] = {T, experts};
        CheckBuf logits(SF_BFLOAT16, T * experts), probs(SF_BFLOAT16, T * experts), rmap(SF_BOOL, T * experts),
            saved(SF_FLOAT32, T * experts);
        fill_normal_up(logits, 2.0f);
        sf_tensor l = logits.view(2, sl, 1), p = probs.view(2, sl, 1), rm = rmap.view(2, sl, 1),
                  s = saved.view(2, sl, 1);
        const int k = experts == 8 ? 2 : 8;
        const float tr = time_ms([&] { CHECK_SF(sf_moe_topk_forward(&l, k, SF_MOE_SOFTMAX, 1, 1.0f, NULL, &p, &rm, &s, NULL)); });
        printf("moe topk_forward bf16 T=%lld E=%lld top-%d softmax: %.1f us\n", (long long)T, (long long)experts, k,
               1e3 * tr);
    }
}

int main(void)
{
    rng_seed();
    const sf_dtype dtypes[2] = {SF_FLOAT32, SF_BFLOAT16};
    for (sf_dtype dt : dtypes) {
        router_case(dt, 1000, 8, 2, SF_MOE_SOFTMAX, 0, 0);
        router_case(dt, 1000, 8, 2, SF_MOE_SOFTMAX, 1, 0);
        router_case(dt, 777, 64, 8, SF_MOE_SOFTMAX, 1, 0);
        router_case(dt, 777, 64, 8, SF_MOE_SIGMOID, 0, 1);
        router_case(dt, 300, 128, 4, SF_MOE_SIGMOID, 0, 0);
        router_case(dt, 300, 128, 1, SF_MOE_SOFTMAX, 0, 0);
        permute_case(dt, 1000, 8, 2, 256, 0);
        permute_case(dt, 517, 64, 8, 72, 100); /* H not a multiple of 16 bytes' elements, rows dropped */
        permute_case(dt, 200, 8, 2, 37, 0); /* odd hidden size: one element per access */
        swiglu_case(dt, 700, 344);
        swiglu_case(dt, 33, 7);
        swiglu_case(dt, 64, 3584); /* Mixtral-small's expert width: 224 threads a row */
    }
    swiglu_case(SF_BFLOAT16, 300, 344, SF_FLOAT32); /* dout in another dtype than x */
    unpermute_plain_case(SF_BFLOAT16, SF_BFLOAT16, 400, 8, 2, 256);
    unpermute_plain_case(SF_FLOAT32, SF_BFLOAT16, 300, 16, 4, 72);
    unpermute_plain_case(SF_BFLOAT16, SF_FLOAT32, 300, 8, 2, 37);
    swiglu_case(SF_FLOAT32, 300, 37, SF_BFLOAT16);
    bench();
    return check_finish("check_moe");
}
