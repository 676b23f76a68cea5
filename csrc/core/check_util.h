/*
 * check_util.h - shared pieces of the standalone kernel checks
 * (csrc/<family>/check_*.cu): a seeded random generator, device buffers that
 * are poisoned before each run, CUDA-event timing with an L2 flush, and the
 * PASS/FAIL bookkeeping.  Header-only, CUDA C++.
 */
#ifndef SF_CHECK_UTIL_H
#define SF_CHECK_UTIL_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include <algorithm>
#include <vector>

#define CHECK_CUDA(call)                                                           \
    do {                                                                           \
        cudaError_t e_ = (call);                                                   \
        if (e_ != cudaSuccess) {                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                    cudaGetErrorString(e_));                                       \
            exit(2);                                                               \
        }                                                                          \
    } while (0)

#define CHECK_SF(call)                                                             \
    do {                                                                           \
        sf_status s_ = (call);                                                     \
        if (s_ != SF_OK) {                                                         \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call,   \
                    sf_last_error());                                              \
            exit(2);                                                               \
        }                                                                          \
    } while (0)

static int g_failures = 0;
static int g_checks = 0;

static inline void check_report(int ok, const char *what)
{
    g_checks++;
    if (!ok) {
        g_failures++;
        printf("FAIL %s\n", what);
    }
}

/* Ends main(): prints the plain closing line and the exit code. */
static inline int check_finish(const char *name)
{
    printf("%s: %d passed, %d failed\n", name, g_checks - g_failures, g_failures);
    return g_failures ? 1 : 0;
}

/* xorshift64*: reproducible, seeded from time unless CHECK_SEED is set. */
static uint64_t g_rng = 0;

static inline void rng_seed(void)
{
    const char *s = getenv("CHECK_SEED");
    g_rng = s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL) * 2654435761ull + 1;
    if (g_rng == 0)
        g_rng = 1;
    printf("seed=%llu\n", (unsigned long long)g_rng);
}

static inline uint64_t rng_next(void)
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}

static inline float rng_uniform(void) { return (rng_next() >> 40) * (1.0f / 16777216.0f); }

static inline float rng_normal(void)
{
    float u1 = rng_uniform() + 1e-7f, u2 = rng_uniform();
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* Median time in ms of fn() over `repeats` runs, the L2 flushed before each. */
template <typename F>
static float time_ms(F fn, int warmup = 3, int repeats = 15)
{
    static void *flush = NULL;
    const size_t flush_bytes = 256u << 20;
    if (!flush)
        CHECK_CUDA(cudaMalloc(&flush, flush_bytes));
    for (int i = 0; i < warmup; ++i)
        fn();
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    std::vector<float> t;
    for (int i = 0; i < repeats; ++i) {
        CHECK_CUDA(cudaMemsetAsync(flush, i, flush_bytes));
        CHECK_CUDA(cudaEventRecord(a));
        fn();
        CHECK_CUDA(cudaEventRecord(b));
        CHECK_CUDA(cudaEventSynchronize(b));
        float ms;
        CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CHECK_CUDA(cudaGetLastError());
    std::sort(t.begin(), t.end());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return t[t.size() / 2];
}

#endif /* SF_CHECK_UTIL_H */
