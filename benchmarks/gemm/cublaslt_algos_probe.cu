/*
 * cublaslt_algos_probe.cu - how far cuBLASLt's first heuristic choice is from
 * the fastest of its top 8 for the GEMMs of a Llama 1B training step at
 * 4,096 tokens (bf16 and FP8 per-tensor, forward / input gradient / weight
 * gradient of QKV, attention projection, gate|up, down), gate|up as two
 * N = 8,192 halves writing a [M, 16,384] output, and the bf16 LM head's
 * three GEMMs per token chunk of the fused loss (vocabulary 128,256, chunks
 * of 1,024 and 2,048 rows; the weight gradient adds into its output after
 * the first chunk: beta 1).  Operands are random bits
 * (constant ones let the tensor cores run cooler and faster).  Standalone
 * (cuBLASLt only, no seqfuse): build here, run on the GPU machine:
 *   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *        benchmarks/gemm/cublaslt_algos_probe.cu -lcublasLt -o cublaslt_algos_probe
 *   ./cublaslt_algos_probe       (FP8ONLY=1: the FP8 cases only; HEADONLY=1: the LM head's only)
 * Results: benchmarks/results/logs/gemm_algos_probe_s30*.log (written when
 * the forward cases had an abbreviated name then); s63 on an H100:
 * logs/s63_call2_c729079/algos_probe.log (the layers),
 * logs/gemm_algos_probe_head_h100_s63.log (the LM head).
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cuda_fp8.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "probe_check.cuh"
__global__ void fill(uint8_t *p, size_t n, int fp8) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    if (fp8) { uint8_t c = h & 0xff; if ((c & 0x7f) > 0x5f) c &= 0xbf; p[i] = c; }   // |x| < ~32, never NaN
    else if (i % 2 == 1) { uint8_t hi = (h & 0x80) | (0x3c + ((h >> 8) & 1)); p[i] = hi; } else p[i] = h & 0xff; // bf16 ~ +-[0.0078, 0.03]
  }
}
struct Case { const char *name; long m, n, k; int ta, tb; int fp8; long ldd; int fast; float beta; };
static cublasLtHandle_t h; static void *ws; static size_t wsb = 32u << 20;
static void *A, *B, *D; static float *sc;
static void run(const Case &c) {
  // row-major out[m,n] = op(a)[m,k] op(b)[k,n]; cuBLASLt: A=b, B=a, m<->n
  cudaDataType_t ti = c.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatmulDesc_t d; CK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t oa = c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, ob = c.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa));
  CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob));
  if (c.fp8) {
    CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sc, sizeof sc));
    CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sc, sizeof sc));
    int8_t f = c.fast; CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &f, sizeof f));
  }
  // b row-major [k,n] (tb=0) or [n,k] (tb=1): column-major A rows/cols
  long lda = c.tb ? c.k : c.n, ldb = c.ta ? c.m : c.k, ldd = c.ldd ? c.ldd : c.n;
  cublasLtMatrixLayout_t la, lb, ld;
  CK(cublasLtMatrixLayoutCreate(&la, ti, c.tb ? c.k : c.n, c.tb ? c.n : c.k, lda));
  CK(cublasLtMatrixLayoutCreate(&lb, ti, c.ta ? c.m : c.k, c.ta ? c.k : c.m, ldb));
  CK(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, c.n, c.m, ldd));
  cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
  cublasLtMatmulHeuristicResult_t r[16]; int got = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, ld, ld, pref, 16, r, &got));
  float alpha = 1, beta = c.beta; cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  double flop = 2.0 * c.m * c.n * c.k; float best = 1e9; int bi = -1; float t0 = 0;
  printf("%-22s m=%6ld n=%6ld k=%6ld %s%s%s:", c.name, c.m, c.n, c.k, c.fp8 ? "fp8" : "bf16", c.ldd ? "(ldd)" : "",
         c.beta != 0 ? "(+D)" : "");
  for (int i = 0; i < got; ++i) {
    bool ok = true;
    for (int w = 0; w < 5 && ok; ++w) ok = cublasLtMatmul(h, d, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &r[i].algo, ws, wsb, 0) == 0;
    if (!ok) { printf(" [%d]fail", i); continue; }
    cudaEventRecord(e0);
    for (int w = 0; w < 50; ++w) cublasLtMatmul(h, d, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &r[i].algo, ws, wsb, 0);
    cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); ms /= 50;
    int tile = 0, stages = 0, sk = 0; size_t sz;
    cublasLtMatmulAlgoConfigGetAttribute(&r[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &sz);
    cublasLtMatmulAlgoConfigGetAttribute(&r[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk, sizeof sk, &sz);
    printf(" [%d]%.1fus(t%d,sk%d)", i, ms * 1e3, tile, sk);
    if (i == 0) t0 = ms; if (ms < best) { best = ms; bi = i; }
  }
  printf("\n   -> h0 %.1f us %.0f TF/s ; best [%d] %.1f us %.0f TF/s ; gain %.3fx\n", t0 * 1e3, flop / t0 / 1e9, bi, best * 1e3, flop / best / 1e9, t0 / best);
  cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(d);
}
int main() {
  CK(cublasLtCreate(&h)); CK(cudaMalloc(&ws, wsb));
  int fp8only = getenv("FP8ONLY") != nullptr, headonly = getenv("HEADONLY") != nullptr;
  size_t big = 4096L * 16384 * 2 + 4096;
  CK(cudaMalloc(&A, big)); CK(cudaMalloc(&B, big)); CK(cudaMalloc(&D, big * 2)); CK(cudaMalloc(&sc, 16));
  float one[4] = {1, 1, 1, 1}; cudaMemcpy(sc, one, 16, cudaMemcpyHostToDevice);
  void *A8, *B8, *A16 = A, *B16 = B; CK(cudaMalloc(&A8, big)); CK(cudaMalloc(&B8, big));
  fill<<<1024, 256>>>((uint8_t *)A16, big, 0); fill<<<1024, 256>>>((uint8_t *)B16, big, 0);
  fill<<<1024, 256>>>((uint8_t *)A8, big, 1); fill<<<1024, 256>>>((uint8_t *)B8, big, 1); CK(cudaDeviceSynchronize());
  const long M = 4096, H = 2048, Q = 3072, F = 8192;
  struct S { const char *n; long N, K; } L[] = {{"qkv", Q, H}, {"o", H, H}, {"gateup", 2 * F, H}, {"down", H, F}};
  for (int fp8 = fp8only; fp8 < 2 && !headonly; ++fp8)
    for (auto &s : L) {
      A = fp8 ? A8 : A16; B = fp8 ? B8 : B16;
      char b1[64], b2[64], b3[64];
      snprintf(b1, 64, "%s.forward", s.n); snprintf(b2, 64, "%s.dgrad", s.n); snprintf(b3, 64, "%s.wgrad", s.n);
      if (fp8) {
        run({b1, M, s.N, s.K, 0, 1, 1, 0, 1}); run({b2, M, s.K, s.N, 0, 1, 1, 0, 0}); run({b3, s.N, s.K, M, 0, 1, 1, 0, 0});
      } else {
        run({b1, M, s.N, s.K, 0, 1, 0, 0, 0}); run({b2, M, s.K, s.N, 0, 0, 0, 0, 0}); run({b3, s.N, s.K, M, 1, 0, 0, 0, 0});
      }
      if (s.N == 2 * F) { // the split: two N=F GEMMs into halves of the [M, 2F] output
        if (fp8) run({"gateup.forward.half", M, F, H, 0, 1, 1, 2 * F, 1}); else run({"gateup.forward.half", M, F, H, 0, 1, 0, 2 * F, 0});
        if (!fp8) run({"gateup.forward.N8192", M, F, H, 0, 1, 0, 0, 0});
      }
    }
  if (fp8only)
    return 0;
  // the LM head (bf16): per chunk of C token rows, logits [C, V] = h [C, H] W[V, H]^T, grad_h [C, H] =
  // dlogits [C, V] W [V, H], grad_W [V, H] (+)= dlogits^T h (beta 1 after the first chunk)
  const long V = 128256;
  CK(cudaFree(A16)); CK(cudaFree(B16)); CK(cudaFree(D)); CK(cudaFree(A8)); CK(cudaFree(B8));
  size_t head = (size_t)V * 4096 * 2 + 4096;  // the largest operand: a 4,096-row chunk of logits (H <= 4,096)
  CK(cudaMalloc(&A, head)); CK(cudaMalloc(&B, head)); CK(cudaMalloc(&D, head));
  fill<<<1024, 256>>>((uint8_t *)A, head, 0); fill<<<1024, 256>>>((uint8_t *)B, head, 0);
  fill<<<1024, 256>>>((uint8_t *)D, head, 0); CK(cudaDeviceSynchronize());
  for (long C : {1024L, 2048L, 4096L}) {
    char b1[64], b2[64], b3[64], b4[64];
    snprintf(b1, 64, "head%ld.logits", C); snprintf(b2, 64, "head%ld.dgrad", C);
    snprintf(b3, 64, "head%ld.wgrad", C); snprintf(b4, 64, "head%ld.wgrad_add", C);
    run({b1, C, V, H, 0, 1, 0, 0, 0, 0.f}); run({b2, C, H, V, 0, 0, 0, 0, 0, 0.f});
    run({b3, V, H, C, 1, 0, 0, 0, 0, 0.f}); run({b4, V, H, C, 1, 0, 0, 0, 0, 1.f});
  }
  return 0;
}
