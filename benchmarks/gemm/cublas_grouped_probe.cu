/*
 * cublas_grouped_probe.cu - does cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx)
 * beat a host loop of per-expert cuBLASLt matmuls for a mixture-of-experts
 * layer's grouped GEMMs?  G experts; expert g owns m_g consecutive rows of the
 * token matrix X [M, K] (bf16, M = sum m_g = 32,768: 2 x 8,192 tokens, top-2)
 * and its weight W_g [N, K] (G weights in one [G, N, K] buffer); Y_g = X_g W_g^T
 * goes to its rows of one [M, N] bf16 output, fp32 accumulation.  Shapes: a
 * Mixtral-small expert MLP (hidden 1,024, FFN 3,584): fc1 (gate|up, K = 1,024,
 * N = 7,168) and fc2 (down, K = 3,584, N = 1,024); G = 8, 16, 64; splits:
 * balanced (M/G each), skewed (one seeded draw, experts 1x..4x, one expert
 * empty) and fresh (20 seeded splits, the next one on every call); every m_g
 * is a multiple of 16.  Routes:
 *   loop     one cublasLtMatmul per non-empty expert, the heuristic's algorithm
 *            for the exact (m_g, N, K), plans cached by m_g (the cache is
 *            cleared at the start of each row and filled by the warm-up, which
 *            runs every split once; lt_queries counts the row's queries),
 *   grouped  one cublasGemmGroupedBatchedEx, one group per non-empty expert
 *            (group_size 1), its device pointer arrays copied from pinned host
 *            memory by one cudaMemcpyAsync inside every timed call,
 *   bysize   (balanced only) the same API with one group of G problems,
 *   whole    one cublasLtMatmul of [M, K] x [K, N] with one weight: the ceiling
 *            for the same FLOPs (one row per shape).
 * Column-major mapping (cuBLAS and cuBLASLt alike): row-major Y_g [m_g, N] is
 * column-major Y_g^T [N, m_g] (ld N) = W_g X_g^T, so the GEMM is m = N,
 * n = m_g, k = K; A = W_g read as column-major [K, N] (ld K) with op T, B = X_g
 * read as column-major [K, m_g] (ld K) with op N, C = Y_g with ldc = N.
 * GPU time: the median over 50 calls (20 with --quick) of the CUDA-event time
 * between back-to-back calls, all enqueued while a spin kernel holds the GPU,
 * so host gaps are not counted.  Host time: the enqueue time per call of a
 * batch enqueued while the spin kernel holds the GPU (a host flag releases it;
 * batch= calls a batch, few enough for the launch queue), so nothing waits on
 * the GPU; held=0 flags a row where the spin ran out first (something waited
 * on the GPU: that row's host time is not pure enqueue cost, its GPU time may
 * hold host gaps); waits=1: a single call already waited on the GPU (a
 * synchronous library call), so that route ran without the spin.
 * Checks, on the first split of every row: the loop's output against an fp32
 * reference at 2,048 sampled elements, the grouped routes' whole outputs
 * against the loop's (outputs pre-filled with NaN, so unwritten rows show).
 * rel = |a - b| / max(|a|, |b|, 0.01), inputs scaled so outputs are ~N(0, 1);
 * a FAIL line when rel > 2e-2 or anything is not finite.
 * Standalone (cuBLAS + cuBLASLt only, no seqfuse): build here, run on the GPU:
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *        benchmarks/gemm/cublas_grouped_probe.cu -lcublasLt -lcublas \
 *        -o .s43/bin/cublas_grouped_probe
 *   .s43/bin/cublas_grouped_probe            (G = 8, 16, 64: well under a minute)
 *   .s43/bin/cublas_grouped_probe --quick    (G = 8, 64; 20 timed calls)
 * Output (key=value): "dev" once; per shape a "check ... what=whole_vs_ref"
 * and a "row ... route=whole" line; per (shape, G, split) its "check" lines,
 * then a "row" per route; "FAIL ..." and "grouped route refused: status N"
 * lines when those happen; "summary" lines at the end.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "probe_check.cuh"
#define GRID_STRIDE(i, n) \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

typedef __nv_bfloat16 bf16;
static const int M = 32768, GMAX = 64, NSLOT = 64, NSAMPLE = 2048, NFRESH = 20;
static const size_t WSB = 32u << 20;
static const long long HOLD_MAX = 400000000LL; /* the spin gives up after ~0.2 s: a blocked host never hangs */

/* holds the GPU until the host sets *flag (or HOLD_MAX cycles pass) */
__global__ void spin(volatile int *flag, long long max_cycles)
{
    for (long long t0 = clock64(); *flag == 0 && clock64() - t0 < max_cycles;) {
    }
}

/* uniform in [-scale, scale), deterministic */
__global__ void fill(bf16 *p, size_t n, unsigned seed, float scale)
{
    GRID_STRIDE(i, n) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h = (h ^ (h >> 13)) * 0x5bd1e995u;
        h ^= h >> 15;
        p[i] = __float2bfloat16(((h >> 8) * (2.0f / 16777216.0f) - 1.0f) * scale);
    }
}

/* st[0] max abs diff, st[1] max rel diff (float bits: non-negative floats order as unsigned), st[2] non-finite */
__global__ void compare(const bf16 *a, const bf16 *b, size_t n, unsigned *st)
{
    float ma = 0.0f, mr = 0.0f;
    unsigned bad = 0;
    GRID_STRIDE(i, n) {
        float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]), d = fabsf(x - y);
        if (!isfinite(x) || !isfinite(y))
            bad++;
        else
            ma = fmaxf(ma, d), mr = fmaxf(mr, d / fmaxf(fmaxf(fabsf(x), fabsf(y)), 1e-2f));
    }
    for (int o = 16; o; o >>= 1) /* warp maxima, then one atomic per warp */
        ma = fmaxf(ma, __shfl_xor_sync(~0u, ma, o)), mr = fmaxf(mr, __shfl_xor_sync(~0u, mr, o)),
        bad += __shfl_xor_sync(~0u, bad, o);
    if ((threadIdx.x & 31) == 0)
        atomicMax(&st[0], __float_as_uint(ma)), atomicMax(&st[1], __float_as_uint(mr)), atomicAdd(&st[2], bad);
}

/* fp32 reference at sampled (row, col, expert) triples against Y; the same stats as compare() */
__global__ void spot(const bf16 *X, const bf16 *W, const bf16 *Y, const int *smp, int ns, int N, int K, unsigned *st)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ns)
        return;
    const int row = smp[3 * i], col = smp[3 * i + 1];
    const bf16 *x = X + (size_t)row * K, *w = W + ((size_t)smp[3 * i + 2] * N + col) * K;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k)
        acc += __bfloat162float(x[k]) * __bfloat162float(w[k]);
    float y = __bfloat162float(Y[(size_t)row * N + col]), d = fabsf(y - acc);
    if (!isfinite(y))
        atomicAdd(&st[2], 1u);
    else
        atomicMax(&st[0], __float_as_uint(d)),
            atomicMax(&st[1], __float_as_uint(d / fmaxf(fmaxf(fabsf(acc), fabsf(y)), 1e-2f)));
}

static double now_us()
{
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/* cuBLASLt: B = X_g, col-major [K, m]; D = Y_g, col-major [N, m] */
struct Plan { cublasLtMatrixLayout_t lb, ld; cublasLtMatmulAlgo_t algo; };
/* la: A = W_g, col-major [K, N], op T; plans: the loop's plan cache, by m_g */
struct Shape {
    const char *name;
    int N, K;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la;
    std::map<int, Plan> plans;
};
/* each expert's rows and first row; ne: the non-empty experts */
struct Split { std::vector<int> m, off; int ne; };
/* call number ci uses splits[ci % size] */
struct Row { Shape *s; int G; const char *pattern; std::vector<Split> splits; bf16 *X, *W, *Y; };
/* held: the spin outlasted every batch's enqueue; waits: one call alone waited on the GPU (so no spin) */
struct Result { int status; float gpu_us; double host_us; bool held, waits; int batch; };
enum { LOOP, GROUPED, BYSIZE };
static const char *route_name[3] = {"loop", "grouped", "bysize"};

static cudaStream_t st;
static cublasLtHandle_t lt;
static cublasHandle_t hb;
static void *ws, *ws2, **dptr, **hptr; /* dptr: the grouped API's device pointer arrays; hptr: pinned staging slots */
static volatile int *hflag;            /* releases spin(); dflag: its device alias */
static int *dflag, *dsmp, n_fail;
static unsigned *dstats;
static cudaEvent_t evs[NSLOT + 1], ev_spin;
static long n_queries;
static double query_us;

/* the loop's plan for m rows: cached, else layouts + a heuristic query (counted and timed) */
static Plan &get_plan(Shape &s, int m)
{
    auto it = s.plans.find(m);
    if (it != s.plans.end())
        return it->second;
    const double t0 = now_us();
    Plan p;
    CK(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, s.K, m, s.K));
    CK(cublasLtMatrixLayoutCreate(&p.ld, CUDA_R_16BF, s.N, m, s.N));
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t w = WSB;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w));
    cublasLtMatmulHeuristicResult_t res;
    int got = 0;
    const cublasStatus_t q = cublasLtMatmulAlgoGetHeuristic(lt, s.desc, s.la, p.lb, p.ld, p.ld, pref, 1, &res, &got);
    cublasLtMatmulPreferenceDestroy(pref);
    if (q != CUBLAS_STATUS_SUCCESS || got == 0) {
        printf("ERR no cuBLASLt algorithm for %s m=%d (status %d)\n", s.name, m, (int)q);
        exit(1);
    }
    p.algo = res.algo;
    n_queries++, query_us += now_us() - t0;
    return s.plans[m] = p;
}

static void clear_plans(Shape &s)
{
    for (auto &kv : s.plans)
        cublasLtMatrixLayoutDestroy(kv.second.lb), cublasLtMatrixLayoutDestroy(kv.second.ld);
    s.plans.clear();
}

/* m_g in units of 16 rows, proportional to w, the remainder dealt round-robin to experts with w > 0 */
static Split make_split(const std::vector<double> &w)
{
    const int G = (int)w.size(), U = M / 16;
    double sum = 0;
    for (double x : w)
        sum += x;
    Split s{std::vector<int>(G), std::vector<int>(G), 0};
    int used = 0;
    for (int g = 0; g < G; ++g)
        used += s.m[g] = (int)(U * w[g] / sum);
    for (int g = 0; used < U; g = (g + 1) % G)
        if (w[g] > 0)
            s.m[g]++, used++;
    for (int g = 0, o = 0; g < G; o += s.m[g], ++g)
        s.m[g] *= 16, s.off[g] = o, s.ne += s.m[g] > 0;
    return s;
}

static std::vector<Split> splits_for(const char *pattern, int G)
{
    std::vector<Split> v;
    std::uniform_real_distribution<double> u(0.0, 1.0);
    std::vector<double> w(G, 1.0);
    if (!strcmp(pattern, "balanced"))
        return {make_split(w)};
    if (!strcmp(pattern, "skewed")) {
        std::mt19937 rng(1000 + G);
        for (double &x : w)
            x = 1.0 + 3.0 * u(rng);
        w[0] = 4.0, w[1] = 1.0, w[G / 2] = 0.0; /* a 4x spread and one empty expert */
        return {make_split(w)};
    }
    for (int j = 0; j < NFRESH; ++j) { /* fresh: 0.25..1.75 of the mean, a new draw per split */
        std::mt19937 rng(2000 + 100 * G + j);
        for (double &x : w)
            x = 0.25 + 1.5 * u(rng);
        v.push_back(make_split(w));
    }
    return v;
}

/* one grouped GEMM by a route; slot: the pinned staging slot (distinct within a batch, as the copy is async) */
static cublasStatus_t call(int route, Row &r, int ci, int slot)
{
    Shape &s = *r.s;
    const Split &sp = r.splits[ci % r.splits.size()];
    const size_t NK = (size_t)s.N * s.K;
    if (route == LOOP) {
        const float one = 1.0f, zero = 0.0f;
        for (int g = 0; g < r.G; ++g) {
            if (!sp.m[g])
                continue;
            Plan &p = get_plan(s, sp.m[g]);
            bf16 *y = r.Y + (size_t)sp.off[g] * s.N;
            cublasStatus_t e = cublasLtMatmul(lt, s.desc, &one, r.W + g * NK, s.la, r.X + (size_t)sp.off[g] * s.K,
                                              p.lb, &zero, y, p.ld, y, p.ld, &p.algo, ws, WSB, st);
            if (e != CUBLAS_STATUS_SUCCESS)
                return e;
        }
        return CUBLAS_STATUS_SUCCESS;
    }
    /* the grouped API's host arrays, one entry per group (kept across calls, as a caller would) */
    static std::vector<cublasOperation_t> ta, tb;
    static std::vector<int> gm, gn, gk, glda, gldb, gldc, gsz;
    static std::vector<float> al, be; /* scale type CUDA_R_32F for CUBLAS_COMPUTE_32F; host memory */
    const int gc = route == BYSIZE ? 1 : sp.ne, np = route == BYSIZE ? r.G : sp.ne;
    ta.assign(gc, CUBLAS_OP_T), tb.assign(gc, CUBLAS_OP_N), al.assign(gc, 1.0f), be.assign(gc, 0.0f);
    gm.assign(gc, s.N), gk.assign(gc, s.K), glda.assign(gc, s.K), gldb.assign(gc, s.K), gldc.assign(gc, s.N);
    gsz.assign(gc, route == BYSIZE ? r.G : 1), gn.clear();
    void **h = hptr + (size_t)slot * 3 * GMAX; /* [A pointers | B pointers | C pointers], np each */
    for (int g = 0, j = 0; g < r.G; ++g) {
        if (!sp.m[g])
            continue;
        if (route == GROUPED || gn.empty())
            gn.push_back(sp.m[g]);
        h[j] = r.W + g * NK, h[np + j] = r.X + (size_t)sp.off[g] * s.K, h[2 * np + j] = r.Y + (size_t)sp.off[g] * s.N;
        j++;
    }
    CK(cudaMemcpyAsync(dptr, h, 3 * np * sizeof(void *), cudaMemcpyHostToDevice, st));
    return cublasGemmGroupedBatchedEx(hb, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(), al.data(),
                                      (const void *const *)dptr, CUDA_R_16BF, glda.data(),
                                      (const void *const *)(dptr + np), CUDA_R_16BF, gldb.data(), be.data(),
                                      dptr + 2 * np, CUDA_R_16BF, gldc.data(), gc, gsz.data(), CUBLAS_COMPUTE_32F);
}

static void hold(long long cycles)
{
    *hflag = 0;
    spin<<<1, 1, 0, st>>>(dflag, cycles);
    CK(cudaGetLastError());
    CK(cudaEventRecord(ev_spin, st));
}

/* lets the spin go; true if it was still holding the GPU, i.e. nothing enqueued meanwhile waited on the GPU */
static bool release()
{
    bool held = cudaEventQuery(ev_spin) == cudaErrorNotReady;
    (void)cudaGetLastError(); /* clear the not-ready */
    *hflag = 1;
    CK(cudaStreamSynchronize(st));
    return held;
}

static Result time_route(int route, Row &r, int iters, int hiters)
{
    Result res = {0, 0.0f, 0.0, true, false, 0};
    int ci = 0;
    /* warm-up over every split: the kernels they pick get loaded (lazy loading could wait on the held GPU) */
    for (int i = 0; i < std::max(3, (int)r.splits.size()) && !res.status; ++i)
        res.status = call(route, r, ci++, i % NSLOT);
    CK(cudaStreamSynchronize(st));
    hold(HOLD_MAX); /* does one call wait on the GPU by itself (then holding it is pointless)? */
    res.status = res.status ? res.status : call(route, r, ci++, 0);
    res.waits = !release();
    res.held = !res.waits;
    /* calls per batch: the launch queue must take a whole batch while the GPU is held (~2 kernels a matmul);
       if a batch still outlasted the spin, both passes are redone once with batches 8x smaller */
    res.batch = std::max(1, std::min(NSLOT, 384 / (route == LOOP ? 2 * r.G + 1 : 4)));
    std::vector<float> t;
    double host = 0;
    bool redone = false;
    for (int pass = 0; pass < 2 && !res.status; ++pass) { /* pass 0: GPU time (events); 1: host time (none) */
        for (int done = 0, want = pass ? hiters : iters; done < want && !res.status;) {
            const int n = std::min(res.batch, want - done);
            hold(res.waits ? 0 : HOLD_MAX);
            if (!pass)
                CK(cudaEventRecord(evs[0], st));
            const double t0 = now_us();
            for (int i = 0; i < n && !res.status; ++i) {
                res.status = call(route, r, ci++, i);
                if (!pass)
                    CK(cudaEventRecord(evs[i + 1], st));
            }
            host += pass ? now_us() - t0 : 0.0;
            res.held = release() && res.held;
            for (int i = 0; i < n && !pass && !res.status; ++i) {
                float ms;
                CK(cudaEventElapsedTime(&ms, evs[i], evs[i + 1]));
                t.push_back(ms * 1000.0f);
            }
            done += n;
        }
        if (pass == 1 && !res.held && !res.waits && res.batch > 1 && !redone) /* redo both, smaller batches */
            pass = -1, redone = res.held = true, res.batch = std::max(1, res.batch / 8), t.clear(), host = 0;
    }
    if (!res.status) {
        std::sort(t.begin(), t.end());
        res.gpu_us = t[t.size() / 2], res.host_us = host / hiters;
    }
    return res;
}

/* compare() when b is given, else spot() (fp32 reference at the uploaded samples); prints a check line */
static void check(const Row &r, const char *what, const bf16 *a, const bf16 *b)
{
    unsigned h[3];
    CK(cudaMemsetAsync(dstats, 0, sizeof h, st));
    if (b)
        compare<<<1024, 256, 0, st>>>(a, b, (size_t)M * r.s->N, dstats);
    else
        spot<<<(NSAMPLE + 127) / 128, 128, 0, st>>>(r.X, r.W, a, dsmp, NSAMPLE, r.s->N, r.s->K, dstats);
    CK(cudaGetLastError());
    CK(cudaMemcpyAsync(h, dstats, sizeof h, cudaMemcpyDeviceToHost, st));
    CK(cudaStreamSynchronize(st));
    float ma, mr;
    memcpy(&ma, &h[0], 4), memcpy(&mr, &h[1], 4);
    const bool ok = mr <= 2e-2f && h[2] == 0;
    printf("check shape=%s G=%d split=%s what=%s elems=%zu max_abs=%.3g max_rel=%.3g nonfinite=%u result=%s\n",
           r.s->name, r.G, r.pattern, what, b ? (size_t)M * r.s->N : (size_t)NSAMPLE, ma, mr, h[2], ok ? "ok" : "FAIL");
    n_fail += !ok;
    if (!ok)
        printf("FAIL shape=%s G=%d split=%s what=%s max_rel=%.3g nonfinite=%u\n", r.s->name, r.G, r.pattern, what, mr,
               h[2]);
}

/* NSAMPLE random (row, col, expert) triples of the row's first split, for spot() */
static void upload_samples(const Row &r)
{
    std::mt19937 rng(77);
    const Split &sp = r.splits[0];
    std::vector<int> smp(3 * NSAMPLE);
    for (int i = 0; i < NSAMPLE; ++i) {
        int row = (int)(rng() % M), g = 0;
        while (g + 1 < r.G && sp.off[g + 1] <= row) /* the last expert starting at or before row: never an empty one */
            g++;
        smp[3 * i] = row, smp[3 * i + 1] = (int)(rng() % r.s->N), smp[3 * i + 2] = g;
    }
    CK(cudaMemcpyAsync(dsmp, smp.data(), smp.size() * sizeof(int), cudaMemcpyHostToDevice, st)); /* st: ordered */
    CK(cudaStreamSynchronize(st));
}

static void refused(const Row &r, int route, int status)
{
    printf("grouped route refused: status %d\n", status);
    printf("row shape=%s N=%d K=%d G=%d split=%s route=%s refused=1 status=%d\n", r.s->name, r.s->N, r.s->K, r.G,
           r.pattern, route_name[route], status);
}

int main(int argc, char **argv)
{
    const bool quick = argc > 1 && !strcmp(argv[1], "--quick");
    const int iters = quick ? 20 : 50, hiters = quick ? 10 : 30;
    const std::vector<int> Gs = quick ? std::vector<int>{8, 64} : std::vector<int>{8, 16, 64};
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, cublas_v = 0;
    CK(cudaRuntimeGetVersion(&rt));
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CK(cublasLtCreate(&lt));
    CK(cublasCreate(&hb));
    CK(cublasGetVersion(hb, &cublas_v));
    CK(cublasSetStream(hb, st));
    CK(cublasSetPointerMode(hb, CUBLAS_POINTER_MODE_HOST)); /* the grouped API refuses device pointer mode */
    CK(cudaMalloc(&ws, WSB));
    CK(cudaMalloc(&ws2, WSB));
    CK(cublasSetWorkspace(hb, ws2, WSB)); /* the same 32 MiB as the loop's cuBLASLt workspace */
    printf("dev name=\"%s\" sms=%d cuda_runtime=%d cublas=%d cublasLt=%zu quick=%d iters=%d host_iters=%d\n",
           prop.name, prop.multiProcessorCount, rt, cublas_v, cublasLtGetVersion(), quick, iters, hiters);
    CK(cudaHostAlloc((void **)&hflag, sizeof(int), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer((void **)&dflag, (void *)hflag, 0));
    CK(cudaHostAlloc((void **)&hptr, (size_t)NSLOT * 3 * GMAX * sizeof(void *), cudaHostAllocDefault));
    CK(cudaMalloc(&dptr, 3 * GMAX * sizeof(void *)));
    CK(cudaMalloc(&dstats, 3 * sizeof(unsigned)));
    CK(cudaMalloc(&dsmp, 3 * NSAMPLE * sizeof(int)));
    for (auto &e : evs)
        CK(cudaEventCreate(&e));
    CK(cudaEventCreateWithFlags(&ev_spin, cudaEventDisableTiming));
    bf16 *X, *W, *Ya, *Yb; /* sized for the larger of the shapes */
    CK(cudaMalloc(&X, (size_t)M * 3584 * 2));
    CK(cudaMalloc(&W, (size_t)GMAX * 7168 * 1024 * 2));
    CK(cudaMalloc(&Ya, (size_t)M * 7168 * 2));
    CK(cudaMalloc(&Yb, (size_t)M * 7168 * 2));

    Shape shapes[2] = {{"fc1", 7168, 1024, nullptr, nullptr, {}}, {"fc2", 1024, 3584, nullptr, nullptr, {}}};
    std::vector<std::string> summary;
    int rows = 0, g_faster = 0, g_cheaper = 0, c_rows = 0, c_faster = 0, unheld = 0, n_refused = 0;
    for (Shape &s : shapes) {
        CK(cublasLtMatmulDescCreate(&s.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
        CK(cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        CK(cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
        CK(cublasLtMatrixLayoutCreate(&s.la, CUDA_R_16BF, s.K, s.N, s.K));
        const float scale = sqrtf(3.0f) / powf((float)s.K, 0.25f); /* x, w ~ U(-a, a): y ~ N(0, K a^4 / 9) = N(0, 1) */
        fill<<<1024, 256, 0, st>>>(X, (size_t)M * s.K, 0x1234u, scale);
        fill<<<1024, 256, 0, st>>>(W, (size_t)GMAX * s.N * s.K, 0xabcdu, scale);
        CK(cudaGetLastError());
        const double flops = 2.0 * M * s.N * s.K;

        /* (d) whole: the loop route with one expert of all M rows */
        Row whole{&s, 1, "whole", {make_split({1.0})}, X, W, Ya};
        clear_plans(s);
        CK(cudaMemsetAsync(Ya, 0xff, (size_t)M * s.N * 2, st));
        CK(call(LOOP, whole, 0, 0));
        upload_samples(whole);
        check(whole, "whole_vs_ref", Ya, nullptr);
        const Result rw = time_route(LOOP, whole, iters, hiters);
        CK(rw.status);
        unheld += !rw.held;
        printf("row shape=%s N=%d K=%d G=1 split=whole route=whole gpu_us=%.1f tflops=%.0f host_us=%.1f held=%d "
               "waits=%d batch=%d lt_queries=%zu\n", s.name, s.N, s.K, rw.gpu_us, flops / rw.gpu_us / 1e6, rw.host_us,
               (int)rw.held, (int)rw.waits, rw.batch, s.plans.size());

        for (int G : Gs) {
            for (const char *pattern : {"balanced", "skewed", "fresh"}) {
                Row r{&s, G, pattern, splits_for(pattern, G), X, W, Ya};
                int mmin = M, mmax = 0, ne = 0;
                for (const Split &sp : r.splits)
                    for (int m : sp.m)
                        if (m)
                            mmin = std::min(mmin, m), mmax = std::max(mmax, m), ne = std::max(ne, sp.ne);
                clear_plans(s); /* the loop's plan cache lives for one row */
                const long q0 = n_queries;

                /* correctness, first split: the loop against the fp32 reference, grouped routes against the loop */
                upload_samples(r);
                CK(cudaMemsetAsync(Ya, 0xff, (size_t)M * s.N * 2, st));
                CK(call(LOOP, r, 0, 0));
                check(r, "loop_vs_ref", Ya, nullptr);
                bool skip[3] = {false, false, strcmp(pattern, "balanced") != 0}; /* bysize: balanced only */
                for (int route = GROUPED; route <= BYSIZE; ++route) {
                    if (skip[route])
                        continue;
                    Row rb = r;
                    rb.Y = Yb;
                    CK(cudaMemsetAsync(Yb, 0xff, (size_t)M * s.N * 2, st));
                    const int e = call(route, rb, 0, 0);
                    CK(cudaStreamSynchronize(st));
                    if (e)
                        refused(r, route, e), skip[route] = true, n_refused++;
                    else
                        check(r, route == GROUPED ? "grouped_vs_loop" : "bysize_vs_loop", Ya, Yb);
                }

                Result res[3] = {};
                for (int route = LOOP; route <= BYSIZE; ++route) {
                    if (skip[route])
                        continue;
                    res[route] = time_route(route, r, iters, hiters);
                    const Result &x = res[route], &a = res[LOOP];
                    if (x.status) { /* a later (fresh) split refused: report and go on */
                        CK(route == LOOP ? x.status : 0);
                        refused(r, route, x.status), skip[route] = true, n_refused++;
                        continue;
                    }
                    unheld += !x.held;
                    printf("row shape=%s N=%d K=%d G=%d split=%s route=%s experts=%d m_min=%d m_max=%d splits=%zu "
                           "gpu_us=%.1f tflops=%.0f vs_loop=%.3f vs_whole=%.3f host_us=%.1f host_vs_loop=%.3f "
                           "held=%d waits=%d batch=%d lt_queries=%ld bound=%s\n",
                           s.name, s.N, s.K, G, pattern, route_name[route], ne, mmin, mmax, r.splits.size(), x.gpu_us,
                           flops / x.gpu_us / 1e6, x.gpu_us / a.gpu_us, x.gpu_us / rw.gpu_us, x.host_us,
                           x.host_us / a.host_us, (int)x.held, (int)x.waits, x.batch,
                           route == LOOP ? n_queries - q0 : 0L,
                           x.host_us > x.gpu_us ? "host" : "gpu");
                }

                /* this (shape, G, split)'s summary line; nan where a route did not run */
                const double a = res[LOOP].gpu_us, b = skip[GROUPED] ? NAN : res[GROUPED].gpu_us;
                const double c = skip[BYSIZE] ? NAN : res[BYSIZE].gpu_us;
                const double bh = skip[GROUPED] ? NAN : res[GROUPED].host_us;
                char line[400];
                snprintf(line, sizeof line,
                         "summary shape=%s G=%d split=%s loop_us=%.1f grouped_us=%.1f bysize_us=%.1f "
                         "grouped_vs_loop=%.3f bysize_vs_loop=%.3f host_loop_us=%.1f host_grouped_us=%.1f",
                         s.name, G, pattern, a, b, c, b / a, c / a, res[LOOP].host_us, bh);
                summary.push_back(line);
                rows++, c_rows += !skip[BYSIZE];
                g_faster += b < a, c_faster += c < a, g_cheaper += bh < res[LOOP].host_us; /* false for nan */
            }
        }
        clear_plans(s);
    }
    for (const std::string &l : summary)
        printf("%s\n", l.c_str());
    printf("summary total rows=%d grouped_faster_gpu=%d grouped_cheaper_host=%d bysize_faster_gpu=%d/%d refused=%d "
           "unheld=%d check_fails=%d lt_queries=%ld lt_query_us_mean=%.1f\n",
           rows, g_faster, g_cheaper, c_faster, c_rows, n_refused, unheld, n_fail, n_queries,
           n_queries ? query_us / n_queries : 0.0);
    printf("cublas_grouped_probe done\n");
    return 0;
}
