/*
 * swiglu_onepass_probe.cu - what LayerNormMLP's one-pass FP8 SwiGLU costs at
 * Llama 1B's MLP (one group of M token rows, K = 8,192; bf16 in, E4M3
 * forward, E5M2 gradients, delayed scaling), against the activation kernels
 * it replaces, each alone on the GPU (CUDA events, L2 flushed, median):
 *
 *   forward   swiglu_cast_fp8_grouped, row-wise only (what the forward runs
 *             under recompute_activation)  vs  act_forward(swiglu) to FP8
 *   backward  swiglu_backward_cast_fp8_grouped: no probs, no dx, FC2's wgrad
 *             operand made again (transposed) and FC1's FP8 output gradient
 *             with its transposed copy  vs  act_forward to FP8 (the operand
 *             made again) + its byte transpose + act_backward to FP8 + its
 *             byte transpose
 *
 * Bytes counted: reads of h [M, 2K] and dout [M, K], writes of every FP8
 * copy.  Built against the check objects (csrc/build_checks.sh quant act),
 * so a build with other -D tunings of csrc/quant/cast_cuda.cu compares
 * those on the same machine:
 *   benchmarks/moe/build_swiglu_probe.sh [TAG "NVCC -D FLAGS"]...
 * Results: benchmarks/results/logs/s60_call*.
 */
#include <cuda_bf16.h>

#include "core/check_util.h"
#include "seqfuse.h"

__global__ void fill_normal_bf16(__nv_bfloat16 *p, int64_t n, float sd, uint32_t salt)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ salt;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        const float u1 = ((h & 0xffffu) + 0.5f) / 65536.0f, u2 = ((h >> 16) + 0.5f) / 65536.0f;
        p[i] = __float2bfloat16(sd * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
    }
}

static void *dev(size_t bytes)
{
    void *p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, bytes));
    CHECK_CUDA(cudaMemset(p, 0, bytes));
    return p;
}

static void probe(int64_t m, int64_t k)
{
    const int64_t m_pad = (m + 15) / 16 * 16;
    __nv_bfloat16 *h = (__nv_bfloat16 *)dev(m * 2 * k * 2), *dout = (__nv_bfloat16 *)dev(m * k * 2);
    fill_normal_bf16<<<1024, 256>>>(h, m * 2 * k, 2.0f, 1u);
    fill_normal_bf16<<<1024, 256>>>(dout, m * k, 0.01f, 2u);
    uint8_t *a = (uint8_t *)dev(m_pad * k), *a_t = (uint8_t *)dev(m_pad * k), *g = (uint8_t *)dev(m_pad * 2 * k),
            *g_t = (uint8_t *)dev(m_pad * 2 * k);
    float *slots = (float *)dev(6 * 4); /* scale, amax, scale_inv; the gradient's */
    const float init[6] = {16.0f, 0.0f, 0.0f, 4096.0f, 0.0f, 0.0f};
    CHECK_CUDA(cudaMemcpy(slots, init, sizeof init, cudaMemcpyHostToDevice));
    int64_t hs[2] = {m, 2 * k}, ds[2] = {m, k}, as[2] = {m_pad, k}, ats[2] = {k, m_pad}, gs[2] = {m_pad, 2 * k},
            gts[2] = {2 * k, m_pad}, one[1] = {1}, splits_v[1] = {m};
    sf_tensor th, td, ta, tat, tg, tgt, sc, am, si, gsc, gam, gsi, splits, ta_m, tg_m;
    sf_tensor_init(&th, h, SF_BFLOAT16, 2, hs, SF_CUDA, 0);
    sf_tensor_init(&td, dout, SF_BFLOAT16, 2, ds, SF_CUDA, 0);
    sf_tensor_init(&ta, a, SF_FLOAT8_E4M3, 2, as, SF_CUDA, 0);
    sf_tensor_init(&ta_m, a, SF_FLOAT8_E4M3, 2, ds, SF_CUDA, 0); /* (the activation kernel's M rows) */
    sf_tensor_init(&tat, a_t, SF_FLOAT8_E4M3, 2, ats, SF_CUDA, 0);
    sf_tensor_init(&tg, g, SF_FLOAT8_E5M2, 2, gs, SF_CUDA, 0);
    sf_tensor_init(&tg_m, g, SF_FLOAT8_E5M2, 2, hs, SF_CUDA, 0);
    sf_tensor_init(&tgt, g_t, SF_FLOAT8_E5M2, 2, gts, SF_CUDA, 0);
    float *sl[6];
    for (int i = 0; i < 6; ++i)
        sl[i] = slots + i;
    sf_tensor_init(&sc, sl[0], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&am, sl[1], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&si, sl[2], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&gsc, sl[3], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&gam, sl[4], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&gsi, sl[5], SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&splits, splits_v, SF_INT64, 1, one, SF_CPU, 0);
    const double hb = 4.0 * m * k, db = 2.0 * m * k, ab = (double)m * k, gb = 2.0 * m * k;

    const float forward_ms = time_ms([&] {
        CHECK_SF(sf_swiglu_cast_fp8_grouped(&th, NULL, &splits, 16, &sc, &am, &ta, NULL, &si, 0, 0, NULL));
    });
    int32_t *end = (int32_t *)dev(4);
    const int32_t end_v = (int32_t)m;
    CHECK_CUDA(cudaMemcpy(end, &end_v, 4, cudaMemcpyHostToDevice));
    int64_t ones[1] = {1};
    sf_tensor tend;
    sf_tensor_init(&tend, end, SF_INT32, 1, ones, SF_CUDA, 0);
    const float ends = time_ms([&] {
        CHECK_SF(sf_cast_fp8_grouped_ends(&th, NULL, 1, &tend, &sc, &am, &ta_m, &si, NULL));
    });
    const float act_forward_ms = time_ms([&] {
        CHECK_SF(sf_act_forward(SF_ACT_SWIGLU, &th, &ta_m, &sc, &am, &si, NULL));
    });
    const double fb = hb + ab;
    printf("M %lld K %lld forward: swiglu_cast_fp8_grouped row-wise %.1f us (%.2f TB/s); cast_fp8_grouped_ends swiglu "
           "%.1f us (%.2f TB/s); act_forward to FP8 %.1f us (%.2f TB/s)\n", (long long)m, (long long)k,
           forward_ms * 1e3, fb / (forward_ms * 1e-3) / 1e12, ends * 1e3, fb / (ends * 1e-3) / 1e12,
           act_forward_ms * 1e3, fb / (act_forward_ms * 1e-3) / 1e12);
    cudaFree(end);

    const float backward_ms = time_ms([&] {
        CHECK_SF(sf_swiglu_backward_cast_fp8_grouped(&td, &th, NULL, &splits, 16, NULL, NULL, &sc, &tat, &si, &gsc,
                                                     &gam, &tg, &tgt, &gsi, NULL));
    });
    const float remake = act_forward_ms;
    const float tr_a = time_ms([&] { CHECK_SF(sf_transpose_fp8(&ta, &tat, NULL)); });
    const float act_backward_ms = time_ms([&] {
        CHECK_SF(sf_act_backward(SF_ACT_SWIGLU, &td, &th, &tg_m, &gsc, &gam, &gsi, NULL));
    });
    const float tr_g = time_ms([&] { CHECK_SF(sf_transpose_fp8(&tg, &tgt, NULL)); });
    const double backward_bytes = hb + db + ab + 2.0 * gb;
    const float kernels = remake + tr_a + act_backward_ms + tr_g;
    printf("M %lld K %lld backward: one pass %.1f us (%.2f TB/s); the activation kernels %.1f us (remake %.1f, "
           "its transpose %.1f, act_backward %.1f, its transpose %.1f)\n", (long long)m, (long long)k,
           backward_ms * 1e3, backward_bytes / (backward_ms * 1e-3) / 1e12, kernels * 1e3, remake * 1e3, tr_a * 1e3,
           act_backward_ms * 1e3, tr_g * 1e3);
    printf("M %lld K %lld both: one pass %.1f us, activation kernels %.1f us; a device copy %.2f TB/s\n",
           (long long)m, (long long)k, (forward_ms + backward_ms) * 1e3, (act_forward_ms + kernels) * 1e3,
           check_copy_tbs((size_t)(backward_bytes / 2)));
    for (void *p : {(void *)h, (void *)dout, (void *)a, (void *)a_t, (void *)g, (void *)g_t, (void *)slots})
        cudaFree(p);
}

int main(void)
{
    for (int64_t m : {4096, 8192})
        probe(m, 8192);
    return 0;
}
