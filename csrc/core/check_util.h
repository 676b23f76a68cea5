/*
 * check_util.h - shared pieces of the standalone kernel checks
 * (csrc/<family>/check_*.cu): a seeded random generator, device buffers that
 * are poisoned before each run, CUDA-event timing with an L2 flush, the
 * PASS/FAIL bookkeeping and the case sampling rule (CHECK_EVERY, below).
 * Header-only, CUDA C++.
 *
 * The last part (CheckBuf and the check_* helpers) serves checks that run
 * the same sf_* call on both backends: a host array and its poisoned device
 * twin viewed as sf_tensor on either side, float32 / float16 / bfloat16
 * elements read and written as float, and the relative-error and FP8-code
 * comparisons the CUDA results are held to.
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

/* Case sampling.  CHECK_EVERY=N in the environment (a positive integer,
 * default 1) makes a program run only every Nth case of its case loops
 * (one of every N, the first always; counted per call site, at hashed
 * offsets, check_take_nth): a check that runs hundreds of cases then
 * finishes under compute-sanitizer's racecheck, which slows every kernel
 * by orders of magnitude.  A case function starts with
 *
 *   if (!check_take_case())
 *       return;
 *
 * and check_finish names the sampling in the closing line.  Unset, every
 * case runs and the output is unchanged.  Any other value stops the program
 * with a message naming the variable and its rule. */
static int g_cases_offered = 0;

static inline int check_every(void)
{
    static int every = 0;
    if (every == 0) {
        const char *s = getenv("CHECK_EVERY");
        every = 1;
        if (s) {
            char *end = NULL;
            const long n = strtol(s, &end, 10);
            if (end == s || *end != '\0' || n < 1 || n > 1000000) {
                fprintf(stderr, "CHECK_EVERY must be a whole number from 1 to 1000000 (run every Nth case), got '%s'\n", s);
                exit(2);
            }
            every = (int)n;
        }
    }
    return every;
}

/* splitmix64's finalizer: a fixed, well-mixed function of x. */
static inline uint64_t check_mix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Whether the case about to run is one CHECK_EVERY keeps; counts it in
 * ``*seen``, the count of its own call site.  One case of each block of N
 * consecutive cases is kept: the first of block 0 (a call site's first case
 * always runs), then an offset fixed by a hash of the block number.  A
 * fixed stride would lock onto one phase where a case function serves
 * several kinds in turn (main() calling it from p lines, or a table of p
 * cases): with p sharing a factor with N some kinds never ran.  The hashed
 * offset reaches every kind once it has a few times N cases (not a
 * guarantee for kinds with fewer). */
static inline bool check_take_nth(long *seen)
{
    g_cases_offered++;
    const long k = (*seen)++, n = check_every(), block = k / n;
    const long keep = block == 0 ? 0 : (long)(check_mix64((uint64_t)block) % (uint64_t)n);
    return k % n == keep;
}

/* Each call site keeps its own count (a lambda's static): a case kind with
 * fewer than N cases still runs its first, whatever the kinds before it. */
#define check_take_case() check_take_nth([]() -> long * { static long seen_ = 0; return &seen_; }())

/* Ends main(): prints the plain closing line and the exit code; where
 * CHECK_EVERY thinned the program's cases, the line says so:
 * "check_attn: 81 passed, 0 failed (every 8th case)". */
static inline int check_finish(const char *name)
{
    const int every = g_cases_offered > 0 ? check_every() : 1; /* a program without case loops ignores it */
    if (every > 1) {
        const int tens = every % 100, ones = every % 10;
        const char *th = (tens >= 11 && tens <= 13) ? "th" : ones == 1 ? "st" : ones == 2 ? "nd" : ones == 3 ? "rd" : "th";
        printf("%s: %d passed, %d failed (every %d%s case)\n", name, g_checks - g_failures, g_failures, every, th);
    } else {
        printf("%s: %d passed, %d failed\n", name, g_checks - g_failures, g_failures);
    }
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

/* Median time in ms of fn() over `repeats` runs, the L2 flushed before each.
 * CHECK_TIMING=0 in the environment runs fn() once and returns NaN (printed
 * as "nan"): the mode for compute-sanitizer, under which every kernel is
 * still launched but times would mean nothing and repeats cost minutes. */
template <typename F>
static float time_ms(F fn, int warmup = 3, int repeats = 15)
{
    const char *timing = getenv("CHECK_TIMING");
    if (timing && !strcmp(timing, "0")) {
        fn();
        CHECK_CUDA(cudaDeviceSynchronize());
        CHECK_CUDA(cudaGetLastError());
        return NAN;
    }
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

/* ---- host / device tensor pairs (checks of an sf_* call on both backends) ---- */

#include "seqfuse.h"
#include "float_bits.h"

/* Element i of a float32 / float16 / bfloat16 host array, as float. */
static inline float check_load(sf_dtype d, const uint8_t *p, int64_t i)
{
    if (d == SF_FLOAT32) { float v; memcpy(&v, p + 4 * i, 4); return v; }
    uint16_t h; memcpy(&h, p + 2 * i, 2);
    return d == SF_BFLOAT16 ? sf_bf16_to_f32(h) : sf_f16_to_f32(h);
}

static inline void check_store(sf_dtype d, uint8_t *p, int64_t i, float v)
{
    if (d == SF_FLOAT32) { memcpy(p + 4 * i, &v, 4); return; }
    uint16_t h = d == SF_BFLOAT16 ? sf_f32_to_bf16(v) : sf_f32_to_f16(v);
    memcpy(p + 2 * i, &h, 2);
}

/* A host array and its device twin, the device side poisoned (0xff) at birth
 * so unwritten outputs show; 16 spare bytes for offset views. */
struct CheckBuf {
    sf_dtype dtype; int64_t n; std::vector<uint8_t> h; void *d;
    CheckBuf(sf_dtype t, int64_t count) : dtype(t), n(count), h(count * sf_dtype_size(t) + 16), d(NULL)
    {
        CHECK_CUDA(cudaMalloc(&d, h.size()));
        CHECK_CUDA(cudaMemset(d, 0xff, h.size()));
    }
    ~CheckBuf() { cudaFree(d); }
    CheckBuf(const CheckBuf &) = delete;
    CheckBuf &operator=(const CheckBuf &) = delete;
    void up() { CHECK_CUDA(cudaMemcpy(d, h.data(), h.size(), cudaMemcpyHostToDevice)); }
    std::vector<uint8_t> down() const
    {
        std::vector<uint8_t> r(h.size());
        CHECK_CUDA(cudaMemcpy(r.data(), d, h.size(), cudaMemcpyDeviceToHost));
        return r;
    }
    void set(int64_t i, float v) { check_store(dtype, h.data(), i, v); }
    sf_tensor view(int ndim, const int64_t *shape, int cuda)
    {
        sf_tensor t;
        sf_tensor_init(&t, cuda ? d : (void *)h.data(), dtype, ndim, shape, cuda ? SF_CUDA : SF_CPU, 0);
        return t;
    }
};

/* ||got - ref|| / ||ref|| over n elements of dtype d (infinite on a NaN). */
static inline double check_rel_err(sf_dtype d, const std::vector<uint8_t> &got,
                                   const std::vector<uint8_t> &ref, int64_t n)
{
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
        double a = check_load(d, got.data(), i), b = check_load(d, ref.data(), i);
        if (isnan(a)) return INFINITY;
        num += (a - b) * (a - b);
        den += b * b;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The relative error a CUDA result in dtype d may have against the CPU one. */
static inline double check_tol(sf_dtype d)
{
    return d == SF_FLOAT32 ? 2e-5 : d == SF_FLOAT16 ? 4e-3 : 2e-2;
}

/* FP8 codes: none more than one step apart, at most 2 % (+1) one step apart
 * (the float32 value before rounding may differ by an ulp between kernels). */
static inline int check_fp8_close(const std::vector<uint8_t> &g, const std::vector<uint8_t> &r, int64_t n,
                                  int64_t *off_out = NULL, int64_t *big_out = NULL)
{
    /* Distance in representable steps: sign-magnitude codes mapped to signed
     * ordinals, so +0 (0x00) and -0 (0x80) are the same value and the two
     * codes either side of zero are neighbours. */
    auto ordinal = [](uint8_t c) { return (c & 0x80) ? -(int)(c & 0x7f) : (int)(c & 0x7f); };
    int64_t off = 0, big = 0;
    for (int64_t i = 0; i < n; ++i) {
        int dd = abs(ordinal(g[i]) - ordinal(r[i]));
        off += dd != 0;
        big += dd > 1;
    }
    if (off_out) *off_out = off;
    if (big_out) *big_out = big;
    return big == 0 && off <= n / 50 + 1;
}

/* Device-to-device copy bandwidth of `bytes` (read + write, TB/s): the
 * ceiling the memory-bound kernels are reported against. */
static inline double check_copy_tbs(size_t bytes)
{
    void *a, *b;
    CHECK_CUDA(cudaMalloc(&a, bytes));
    CHECK_CUDA(cudaMalloc(&b, bytes));
    CHECK_CUDA(cudaMemset(a, 0, bytes));
    float ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / ms / 1e9;
}

#endif /* SF_CHECK_UTIL_H */
