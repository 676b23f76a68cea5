// check-links: moe
/*
 * check_amax.cu - standalone check and benchmark of the amax kernel.
 *
 * Fresh random bf16/fp16/fp32 inputs at several shapes (some unaligned and
 * strided); the CUDA result must equal the CPU reference bit for bit (a max
 * has no rounding).  Then the bandwidth of a 1 GiB bf16 amax against a
 * device-to-device copy of the same bytes.
 */
#include "core/check_util.h"
#include "core/float_bits.h"
#include "seqfuse.h"

static void run_case(sf_dtype dtype, int64_t n, int64_t offset, int64_t step)
{
    if (!check_take_case()) /* CHECK_EVERY (core/check_util.h) */
        return;
    size_t es = sf_dtype_size(dtype);
    int64_t total = offset + n * step;
    std::vector<uint8_t> host(total * es);
    for (int64_t i = 0; i < total; ++i) {
        float v = rng_normal() * 4.0f;
        if (dtype == SF_FLOAT32) memcpy(&host[i * 4], &v, 4);
        else {
            uint16_t h = dtype == SF_BFLOAT16 ? sf_f32_to_bf16(v) : sf_f32_to_f16(v);
            memcpy(&host[i * 2], &h, 2);
        }
    }
    void *dev;
    float *dout;
    CHECK_CUDA(cudaMalloc(&dev, host.size()));
    CHECK_CUDA(cudaMalloc(&dout, 4));
    CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(dout, 0xff, 4)); /* poison: NaN bits */

    int64_t shape[1] = {n};
    sf_tensor x, xc, out, outc;
    sf_tensor_init(&x, (char *)dev + offset * es, dtype, 1, shape, SF_CUDA, 0);
    x.strides[0] = step;
    sf_tensor_init(&xc, host.data() + offset * es, dtype, 1, shape, SF_CPU, 0);
    xc.strides[0] = step;
    int64_t one[1] = {1};
    float cpu_result = -1.0f, gpu_result = -1.0f;
    sf_tensor_init(&out, dout, SF_FLOAT32, 1, one, SF_CUDA, 0);
    sf_tensor_init(&outc, &cpu_result, SF_FLOAT32, 1, one, SF_CPU, 0);
    CHECK_SF(sf_amax(&x, &out, NULL));
    CHECK_SF(sf_amax(&xc, &outc, NULL));
    CHECK_CUDA(cudaMemcpy(&gpu_result, dout, 4, cudaMemcpyDeviceToHost));
    char what[160];
    snprintf(what, sizeof what, "amax %s n=%lld offset=%lld step=%lld: gpu %g cpu %g",
             sf_dtype_name(dtype), (long long)n, (long long)offset, (long long)step,
             gpu_result, cpu_result);
    check_report(memcmp(&gpu_result, &cpu_result, 4) == 0, what);
    cudaFree(dev);
    cudaFree(dout);
}

int main(void)
{
    rng_seed();
    sf_dtype dtypes[3] = {SF_FLOAT32, SF_FLOAT16, SF_BFLOAT16};
    int64_t sizes[] = {1, 7, 31, 4096, 100003, 1 << 22};
    for (sf_dtype d : dtypes)
        for (int64_t n : sizes) {
            run_case(d, n, 0, 1);
            run_case(d, n, 3, 1); /* unaligned start */
            run_case(d, n, 1, 5); /* strided */
        }

    /* bandwidth: 1 GiB of bf16 */
    int64_t n = (int64_t)1 << 29;
    void *buf, *copy;
    float *dout;
    CHECK_CUDA(cudaMalloc(&buf, n * 2));
    CHECK_CUDA(cudaMalloc(&copy, n * 2));
    CHECK_CUDA(cudaMalloc(&dout, 4));
    CHECK_CUDA(cudaMemset(buf, 0x3f, n * 2));
    sf_tensor x, out;
    int64_t shape[1] = {n}, one[1] = {1};
    sf_tensor_init(&x, buf, SF_BFLOAT16, 1, shape, SF_CUDA, 0);
    sf_tensor_init(&out, dout, SF_FLOAT32, 1, one, SF_CUDA, 0);
    float ms = time_ms([&] { CHECK_SF(sf_amax(&x, &out, NULL)); });
    float copy_ms = time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(copy, buf, n * 2, cudaMemcpyDeviceToDevice)); });
    printf("amax bf16 1 GiB: %.3f ms = %.2f TB/s read; copy of the same bytes %.3f ms = %.2f TB/s (read+write)\n",
           ms, n * 2 / ms / 1e9, copy_ms, 2.0 * n * 2 / copy_ms / 1e9);
    return check_finish("check_amax");
}
