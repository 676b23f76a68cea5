/*
 * cublaslt_resize_probe.cu - what a GEMM of a new row count costs the host
 * when its plan is reused (seqfuse's plans by size class, csrc/gemm/gemm_cuda.cu):
 * the layouts resized to the exact rows, then either
 *   (a) cublasLtMatmulAlgoCheck confirms the class algorithm, then the matmul, or
 *   (b) the matmul alone with the class algorithm (cublasLtMatmul validates it
 *       and refuses an algorithm that cannot run the problem),
 * and, for scale, (c) a heuristic query per new size.  Shapes: a Mixtral-small
 * expert's down projection (x_g [m, 3,584] x W^T [3,584, 1,024]) and its
 * gate|up projection (x_g [m, 1,024] x W^T [1,024, 7,168]), bf16, m fresh on
 * every call in the class (4,096, 8,192] (multiples of 16, as the experts'
 * row counts), class algorithm chosen at m = 8,192.  Then the GPU time of
 * the algorithm chosen at 8,192 (a power-of-two class's bound), of the
 * heuristic's choice for the exact m and of its choice at m's eighth-octave
 * bound (seqfuse's size classes), at sizes across (4,096, 8,192]
 * (back-to-back launches, CUDA events).  Host microseconds per
 * call are timed with the GPU held busy by a spin kernel in front, so
 * nothing waits on the GPU; (b)'s outputs are compared bit for bit with
 * (a)'s for every size (the same algorithm where AlgoCheck passes, so this
 * shows determinism; (a)'s heuristic fallback otherwise: counted), and
 * refusals by the matmul are counted.  Standalone (cuBLASLt
 * only, no seqfuse): build here, run on the GPU machine:
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *        benchmarks/gemm/cublaslt_resize_probe.cu -lcublasLt -o cublaslt_resize_probe
 *   ./cublaslt_resize_probe
 */
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_check.cuh"

__global__ void spin(long long cycles)
{
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

__global__ void fill(unsigned short *p, size_t n, unsigned seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13;
        h *= 0x5bd1e995u;
        h ^= h >> 15;
        p[i] = (unsigned short)((h & 0x807f) | 0x3c00); /* bf16 of magnitude ~[0.0078, 0.016) */
    }
}

static double now_us()
{
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Gemm {
    long n, k; /* out [m, n] = x [m, k] W^T, W [n, k] */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld; /* cuBLASLt's A = W (col-major [k, n], op T), B = x, D = out */
    cublasLtMatmulAlgo_t class_algo;
};

static cublasLtHandle_t h;
static void *ws;
static const size_t wsb = 32u << 20;

static void resize(Gemm &g, long m)
{
    uint64_t r = (uint64_t)g.k, c = (uint64_t)m;
    CK(cublasLtMatrixLayoutSetAttribute(g.lb, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
    CK(cublasLtMatrixLayoutSetAttribute(g.lb, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
    r = (uint64_t)g.n;
    CK(cublasLtMatrixLayoutSetAttribute(g.ld, CUBLASLT_MATRIX_LAYOUT_ROWS, &r, sizeof r));
    CK(cublasLtMatrixLayoutSetAttribute(g.ld, CUBLASLT_MATRIX_LAYOUT_COLS, &c, sizeof c));
}

static bool heuristic(Gemm &g, cublasLtMatmulAlgo_t *algo)
{
    cublasLtMatmulPreference_t pref;
    CK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t w = wsb;
    CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w));
    cublasLtMatmulHeuristicResult_t res;
    int got = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(h, g.desc, g.la, g.lb, g.ld, g.ld, pref, 1, &res, &got);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS || got == 0)
        return false;
    *algo = res.algo;
    return true;
}

static Gemm make(long n, long k, long m_class)
{
    Gemm g;
    g.n = n;
    g.k = k;
    CK(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
    CK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CK(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
    CK(cublasLtMatrixLayoutCreate(&g.la, CUDA_R_16BF, k, n, k));
    CK(cublasLtMatrixLayoutCreate(&g.lb, CUDA_R_16BF, k, m_class, k));
    CK(cublasLtMatrixLayoutCreate(&g.ld, CUDA_R_16BF, n, m_class, n));
    if (!heuristic(g, &g.class_algo)) {
        printf("no algorithm\n");
        exit(1);
    }
    return g;
}

static cublasStatus_t matmul(Gemm &g, const cublasLtMatmulAlgo_t *algo, const void *w, const void *x, void *out)
{
    float one = 1.0f, zero = 0.0f;
    return cublasLtMatmul(h, g.desc, &one, w, g.la, x, g.lb, &zero, out, g.ld, out, g.ld, algo, ws, wsb, 0);
}

int main()
{
    CK(cublasLtCreate(&h));
    CK(cudaMalloc(&ws, wsb));
    const long M = 8192, calls = 400;
    const long shapes[2][2] = {{1024, 3584}, {7168, 1024}}; /* down (fc2), gate|up (fc1): n, k */
    const char *names[2] = {"down [m, 3584] x [3584, 1024]", "gate|up [m, 1024] x [1024, 7168]"};
    srand(1234);
    std::vector<long> ms(calls);
    for (long &m : ms)
        m = 4096 + 16 * (1 + rand() % 256); /* (4096, 8192], multiples of 16 */
    for (int s = 0; s < 2; ++s) {
        Gemm g = make(shapes[s][0], shapes[s][1], M);
        unsigned short *w, *x, *oa, *ob;
        CK(cudaMalloc(&w, g.n * g.k * 2));
        CK(cudaMalloc(&x, M * g.k * 2));
        CK(cudaMalloc(&oa, M * g.n * 2));
        CK(cudaMalloc(&ob, M * g.n * 2));
        fill<<<1024, 256>>>(w, g.n * g.k, 1);
        fill<<<1024, 256>>>(x, M * g.k, 2);
        CK(cudaDeviceSynchronize());
        /* correctness: (b) against (a), every size */
        int check_refused = 0, matmul_refused = 0, differ = 0;
        std::vector<unsigned short> ha(M * g.n), hb(M * g.n);
        for (long i = 0; i < 64; ++i) {
            long m = ms[i];
            resize(g, m);
            cublasLtMatmulHeuristicResult_t chk;
            memset(&chk, 0, sizeof chk);
            cublasLtMatmulAlgo_t algo_a = g.class_algo;
            cublasStatus_t cs = cublasLtMatmulAlgoCheck(h, g.desc, g.la, g.lb, g.ld, g.ld, &g.class_algo, &chk);
            if (!(cs == CUBLAS_STATUS_SUCCESS && chk.state == CUBLAS_STATUS_SUCCESS && chk.workspaceSize <= wsb)) {
                check_refused++;
                if (!heuristic(g, &algo_a)) {
                    printf("no algorithm at m=%ld\n", m);
                    exit(1);
                }
            }
            CK(matmul(g, &algo_a, w, x, oa));
            cublasStatus_t ms_ = matmul(g, &g.class_algo, w, x, ob);
            if (ms_ != CUBLAS_STATUS_SUCCESS) {
                matmul_refused++;
                continue;
            }
            CK(cudaMemcpy(ha.data(), oa, m * g.n * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hb.data(), ob, m * g.n * 2, cudaMemcpyDeviceToHost));
            if (memcmp(ha.data(), hb.data(), m * g.n * 2) != 0)
                differ++;
        }
        printf("%s: 64 fresh sizes: AlgoCheck refused the class algorithm %d, the matmul refused it %d, "
               "outputs differing bitwise %d\n", names[s], check_refused, matmul_refused, differ);
        /* host time per call, the GPU busy in front */
        for (int mode = 0; mode < 3; ++mode) {
            CK(cudaDeviceSynchronize());
            spin<<<1, 1>>>(2000000000LL); /* ~1 s at 1.98 GHz: covers the host loop */
            double t0 = now_us();
            for (long i = 0; i < calls; ++i) {
                resize(g, ms[i]);
                cublasLtMatmulAlgo_t algo = g.class_algo;
                if (mode == 0) {
                    cublasLtMatmulHeuristicResult_t chk;
                    CK(cublasLtMatmulAlgoCheck(h, g.desc, g.la, g.lb, g.ld, g.ld, &g.class_algo, &chk));
                } else if (mode == 2) {
                    heuristic(g, &algo);
                }
                CK(matmul(g, &algo, w, x, oa));
            }
            double t1 = now_us();
            CK(cudaDeviceSynchronize());
            const char *what[3] = {"(a) resize + AlgoCheck + matmul", "(b) resize + matmul",
                                   "(c) resize + heuristic query + matmul"};
            printf("%s: %s: %.1f us a call (host)\n", names[s], what[mode], (t1 - t0) / calls);
        }
        /* the same size every call: what a plan hit costs */
        CK(cudaDeviceSynchronize());
        spin<<<1, 1>>>(2000000000LL);
        resize(g, 6144);
        double t0 = now_us();
        for (long i = 0; i < calls; ++i)
            CK(matmul(g, &g.class_algo, w, x, oa));
        double t1 = now_us();
        CK(cudaDeviceSynchronize());
        printf("%s: same size every call, matmul only: %.1f us a call (host)\n", names[s], (t1 - t0) / calls);
        /* GPU time: the class algorithm (chosen at m = 8,192) against the heuristic's choice for the exact m */
        {
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            const long sizes[] = {4112, 4352, 4608, 4624, 5120, 5632, 6144, 7168, 7200, 8192};
            for (long m : sizes) {
                long octave = 128; /* m's size class, as size_class() in csrc/gemm/gemm_cuda.cu */
                while (octave * 2 < m)
                    octave <<= 1;
                const long bound = octave + (m - octave + octave / 8 - 1) / (octave / 8) * (octave / 8);
                cublasLtMatmulAlgo_t exact, fine;
                resize(g, bound);
                if (!heuristic(g, &fine))
                    continue;
                resize(g, m);
                if (!heuristic(g, &exact))
                    continue;
                float t[3];
                for (int which = 0; which < 3; ++which) {
                    const cublasLtMatmulAlgo_t *al = which == 2 ? &fine : which ? &exact : &g.class_algo;
                    for (int i = 0; i < 5; ++i)
                        CK(matmul(g, al, w, x, oa));
                    CK(cudaEventRecord(e0));
                    for (int i = 0; i < 50; ++i)
                        CK(matmul(g, al, w, x, oa));
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&t[which], e0, e1));
                    t[which] *= 1000.0f / 50;
                }
                const double fl = 2.0 * m * g.n * g.k;
                printf("%s: m=%ld: algorithm chosen at 8,192 %.1f us (%.0f TFLOP/s), at m %.1f us (%.0f TFLOP/s), "
                       "at the eighth-octave bound %ld %.1f us (%.0f TFLOP/s)\n",
                       names[s], m, t[0], fl / t[0] / 1e6, t[1], fl / t[1] / 1e6, bound, t[2], fl / t[2] / 1e6);
            }
        }
        cudaFree(w);
        cudaFree(x);
        cudaFree(oa);
        cudaFree(ob);
    }
    printf("cublaslt_resize_probe done\n");
    return 0;
}
