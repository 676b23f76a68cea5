/*
 * check_embed.cu - standalone check and benchmark of the embedding-gradient
 * add (sf_embedding_backward_add).
 *
 * Fresh random inputs (fp32, bf16, fp16; a 128k vocabulary where most
 * indices occur once, a DNA-sized one of 16 where every index is a run of
 * hundreds, a padding index, widths that take the vector and the scalar
 * path, a strided dy): the CUDA result must equal the CPU reference to the
 * bit (both sum a run's rows in float32 in sorted order and round once), and
 * rows of dweight no index names must keep their bytes.  Then the time of
 * the Llama 3.2 1B case (4,096 and 8,192 tokens, H 2,048, V 128,256, bf16)
 * and of 8,192 tokens over a vocabulary of 16 against a copy of the bytes
 * it must move (dy read, the touched rows of dweight read and written).
 */
#include <algorithm>
#include <numeric>

#include "core/check_util.h"
#include "seqfuse.h"

static void init_strided(sf_tensor *t, void *data, sf_dtype dtype, const int64_t *shape, const int64_t *strides,
                         sf_device_type device)
{
    sf_tensor_init(t, data, dtype, 2, shape, device, 0);
    t->strides[0] = strides[0];
    t->strides[1] = strides[1];
}

/* ids [n] drawn from [0, v); sorted / order as a stable argsort gives them. */
static void make_ids(int64_t n, int64_t v, std::vector<int64_t> &sorted, std::vector<int64_t> &order)
{
    std::vector<int64_t> ids(n);
    for (auto &x : ids) x = (int64_t)(rng_next() % (uint64_t)v);
    order.resize(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    sorted.resize(n);
    for (int64_t j = 0; j < n; ++j) sorted[j] = ids[order[j]];
}

static void run_case(sf_dtype dtype, int64_t n, int64_t h, int64_t v, int64_t dy_stride, int64_t padding_idx)
{
    if (!check_take_case())
        return;
    size_t es = sf_dtype_size(dtype);
    std::vector<int64_t> sorted, order;
    make_ids(n, v, sorted, order);
    std::vector<uint8_t> dy(n * dy_stride * es), w(v * h * es), ref, got(v * h * es);
    for (int64_t i = 0; i < n * dy_stride; ++i) check_store(dtype, dy.data(), i, rng_normal());
    for (int64_t i = 0; i < v * h; ++i) check_store(dtype, w.data(), i, rng_normal());
    ref = w;
    void *ddy, *dw, *dids, *dord;
    CHECK_CUDA(cudaMalloc(&ddy, dy.size()));
    CHECK_CUDA(cudaMalloc(&dw, w.size()));
    CHECK_CUDA(cudaMalloc(&dids, n * 8 + 8));
    CHECK_CUDA(cudaMalloc(&dord, n * 8 + 8));
    CHECK_CUDA(cudaMemcpy(ddy, dy.data(), dy.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dw, w.data(), w.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dids, sorted.data(), n * 8, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dord, order.data(), n * 8, cudaMemcpyHostToDevice));
    int64_t yshape[2] = {n, h}, wshape[2] = {v, h}, ishape[1] = {n};
    int64_t ystrides[2] = {dy_stride, 1};
    sf_tensor ty, tw, ti, to, hy, hw, hi, ho;
    init_strided(&ty, ddy, dtype, yshape, ystrides, SF_CUDA);
    sf_tensor_init(&tw, dw, dtype, 2, wshape, SF_CUDA, 0);
    sf_tensor_init(&ti, dids, SF_INT64, 1, ishape, SF_CUDA, 0);
    sf_tensor_init(&to, dord, SF_INT64, 1, ishape, SF_CUDA, 0);
    init_strided(&hy, dy.data(), dtype, yshape, ystrides, SF_CPU);
    sf_tensor_init(&hw, ref.data(), dtype, 2, wshape, SF_CPU, 0);
    sf_tensor_init(&hi, sorted.data(), SF_INT64, 1, ishape, SF_CPU, 0);
    sf_tensor_init(&ho, order.data(), SF_INT64, 1, ishape, SF_CPU, 0);
    CHECK_SF(sf_embedding_backward_add(&ty, &ti, &to, padding_idx, &tw, NULL));
    CHECK_SF(sf_embedding_backward_add(&hy, &hi, &ho, padding_idx, &hw, NULL));
    CHECK_CUDA(cudaMemcpy(got.data(), dw, got.size(), cudaMemcpyDeviceToHost));
    int64_t differ = 0, untouched_moved = 0, touched = 0;
    std::vector<char> seen(v, 0);
    for (int64_t j = 0; j < n; ++j) seen[sorted[j]] = 1;
    for (int64_t r = 0; r < v; ++r) {
        bool same_row = memcmp(&got[r * h * es], &ref[r * h * es], h * es) == 0;
        differ += !same_row;
        bool named = seen[r] && r != padding_idx;
        touched += named;
        if (!named && memcmp(&got[r * h * es], &w[r * h * es], h * es) != 0) untouched_moved++;
    }
    char what[240];
    snprintf(what, sizeof what, "embedding_backward_add %s n=%lld h=%lld v=%lld dy_stride=%lld padding_idx=%lld: "
             "%lld of %lld rows differ from the CPU's bits, %lld rows no index names changed (%lld named)",
             sf_dtype_name(dtype), (long long)n, (long long)h, (long long)v, (long long)dy_stride,
             (long long)padding_idx, (long long)differ, (long long)v, (long long)untouched_moved, (long long)touched);
    check_report(differ == 0 && untouched_moved == 0, what);
    cudaFree(ddy); cudaFree(dw); cudaFree(dids); cudaFree(dord);
}

int main(void)
{
    rng_seed();
    const sf_dtype dtypes[3] = {SF_FLOAT32, SF_BFLOAT16, SF_FLOAT16};
    for (sf_dtype dt : dtypes) {
        run_case(dt, 4096, 512, 128256, 512, -1);    /* a 128k vocabulary: indices mostly once */
        run_case(dt, 4096, 256, 16, 256, -1);        /* DNA: runs of ~256 rows */
        run_case(dt, 3000, 96, 16, 96, 3);           /* a padding index */
        run_case(dt, 777, 100, 50, 100, 0);          /* width off the vector path */
        run_case(dt, 500, 64, 1000, 80, -1);         /* strided dy */
        run_case(dt, 1, 8, 5, 8, -1);
        run_case(dt, 0, 8, 5, 8, -1);
    }

    /* time: bf16, Llama 1B's head (indices mostly once), then a DNA-sized vocabulary of 16 (each index a run of
     * hundreds, summed by one block per run and column slice); bytes = dy read + the touched rows read and
     * written */
    const int64_t cases[3][2] = {{4096, 128256}, {8192, 128256}, {8192, 16}};
    for (const auto &c : cases) {
        const int64_t n = c[0], h = 2048, v = c[1];
        std::vector<int64_t> sorted, order;
        make_ids(n, v, sorted, order);
        int64_t uniq = 1;
        for (int64_t j = 1; j < n; ++j) uniq += sorted[j] != sorted[j - 1];
        void *ddy, *dw, *dids, *dord;
        CHECK_CUDA(cudaMalloc(&ddy, n * h * 2));
        CHECK_CUDA(cudaMalloc(&dw, v * h * 2));
        CHECK_CUDA(cudaMalloc(&dids, n * 8));
        CHECK_CUDA(cudaMalloc(&dord, n * 8));
        CHECK_CUDA(cudaMemset(ddy, 0, n * h * 2));
        CHECK_CUDA(cudaMemset(dw, 0, v * h * 2));
        CHECK_CUDA(cudaMemcpy(dids, sorted.data(), n * 8, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(dord, order.data(), n * 8, cudaMemcpyHostToDevice));
        int64_t yshape[2] = {n, h}, wshape[2] = {v, h}, ishape[1] = {n};
        sf_tensor ty, tw, ti, to;
        sf_tensor_init(&ty, ddy, SF_BFLOAT16, 2, yshape, SF_CUDA, 0);
        sf_tensor_init(&tw, dw, SF_BFLOAT16, 2, wshape, SF_CUDA, 0);
        sf_tensor_init(&ti, dids, SF_INT64, 1, ishape, SF_CUDA, 0);
        sf_tensor_init(&to, dord, SF_INT64, 1, ishape, SF_CUDA, 0);
        const size_t bytes = (size_t)(n + 2 * uniq) * h * 2;
        const double copy = check_copy_tbs(bytes);
        float ms = time_ms([&] { CHECK_SF(sf_embedding_backward_add(&ty, &ti, &to, -1, &tw, NULL)); });
        printf("embedding_backward_add bf16 n=%lld h=%lld v=%lld (%lld distinct): %.1f us = %.2f TB/s, %.0f%% of "
               "copy %.2f TB/s\n", (long long)n, (long long)h, (long long)v, (long long)uniq, ms * 1e3,
               bytes / ms / 1e9, 100 * bytes / ms / 1e9 / copy, copy);
        cudaFree(ddy); cudaFree(dw); cudaFree(dids); cudaFree(dord);
    }
    return check_finish("check_embed");
}
