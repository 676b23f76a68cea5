/*
 * norm_cuda.cu - the CUDA norm's entry points (norm_backend.h): the argument
 * blocks turned into the kernels' parameters, the launch of the dtype's
 * forward or backward, the column sums that finish dgamma / dbeta, and the
 * backward's workspace size.  This one unit compiles the forward and the
 * backward kernels of every dtype: split in two (the 16-bit backward apart),
 * the pair cost 10 % more CPU than the one unit, each half repeating the
 * front end (benchmarks/results/logs/build_units_s13.txt), and setup.py's
 * costliest-first order keeps the one unit from being the build's tail.
 * The kernels and their design: norm_kernels.cuh.
 */
#include "../core/visit.cuh"
#include "norm_kernels.cuh"

namespace sf_norm {

__global__ void write_scale_inv_kernel(const float *scale, float *scale_inv)
{
    *scale_inv = 1.0f / *scale;
}

/* An upper bound of any backward grid of split c over `rows`: blocks that
 * could be resident at once by thread count (2048 threads per SM on sm_80 /
 * sm_90), never more than the row groups.  The workspace is sized by it. */
sf_status backward_grid_bound(const char *op, int64_t rows, const Config &c, int device, int64_t *bound)
{
    int sms;
    SF_TRY(sf_vec::sm_count(op, device, &sms));
    const int threads = c.tx * c.ty;
    const int64_t per_sm = 2048 / threads > 1 ? 2048 / threads : 1;
    const int64_t groups = (rows + c.ty - 1) / c.ty;
    const int64_t cap = (int64_t)sms * per_sm;
    *bound = groups < cap ? groups : cap;
    return SF_OK;
}

template <typename G>
sf_status launch_reduce(const float *ws, int parts, int hidden, void *dgamma, void *dbeta,
                        cudaStream_t stream)
{
    dim3 block(32, 8);
    dim3 grid((hidden + 31) / 32, dbeta ? 2 : 1);
    column_sum_kernel<G><<<grid, block, 0, stream>>>(ws, parts, hidden, (G *)dgamma, (G *)dbeta);
    SF_CUDA_CHECK_LAUNCH("norm_backward");
    return SF_OK;
}

sf_status forward(const sf_norm_forward_args *a, cudaStream_t stream)
{
    const char *op = a->rms ? "rmsnorm_forward" : "layernorm_forward";
    ForwardParams p;
    p.x = a->x->data;
    p.gamma = a->gamma->data;
    p.beta = a->beta ? a->beta->data : NULL;
    p.y = a->y->data;
    p.mean = a->mean ? (float *)a->mean->data : NULL;
    p.rstd = a->rstd ? (float *)a->rstd->data : NULL;
    p.scale = a->scale ? (const float *)a->scale->data : NULL;
    p.amax = a->amax ? (unsigned *)a->amax->data : NULL;
    p.scale_inv = a->scale_inv ? (float *)a->scale_inv->data : NULL;
    p.rows = a->rows;
    p.hidden = (int)a->hidden;
    p.eps = a->eps;
    p.rms = a->rms;
    p.zc = a->zero_centered_gamma;
    p.gamma_f32 = a->gamma->dtype == SF_FLOAT32;
    p.out_kind = a->y->dtype == SF_FLOAT8_E4M3 ? kOutE4M3
                 : a->y->dtype == SF_FLOAT8_E5M2 ? kOutE5M2 : kOutSame;
    if (p.out_kind == kOutSame && a->y->dtype != a->x->dtype) /* kOutSame writes y as x's type */
        return sf_visit_refuse(op, "y", a->y->dtype, "y in x's dtype, float8_e4m3fn or float8_e5m2");

    if (a->rows == 0) {
        if (p.scale_inv) { /* nothing to normalize, but the contract still holds */
            write_scale_inv_kernel<<<1, 1, 0, stream>>>(p.scale, p.scale_inv);
            SF_CUDA_CHECK_LAUNCH(op);
        }
        return SF_OK;
    }
    /* y may be FP8 (1 byte per element): its vectors are VEC bytes, so its
     * row starts are VEC-aligned when x's are 16-byte aligned */
    const int ve = 16 / (int)sf_dtype_size(a->x->dtype);
    const int ysize = (int)sf_dtype_size(a->y->dtype);
    const bool vec = a->hidden % ve == 0 && aligned16(p.x) &&
                     ((uintptr_t)p.y % (uintptr_t)(ve * ysize)) == 0;
    const int device = a->x->device_id;
    return sf_visit_float(op, "x", a->x->dtype, [&](auto tag) {
        return launch_forward<typename decltype(tag)::type>(p, vec, device, stream);
    });
}

/* The vector path: rows of whole 16-byte vectors, every row tensor aligned. */
bool backward_vec(const sf_norm_backward_args *a)
{
    const int ve = 16 / (int)sf_dtype_size(a->x->dtype);
    return a->hidden % ve == 0 && aligned16(a->x->data) && aligned16(a->dy->data) &&
           aligned16(a->dx->data) && (!a->dres || aligned16(a->dres->data));
}

sf_status backward(const sf_norm_backward_args *a, cudaStream_t stream)
{
    const char *op = a->rms ? "rmsnorm_backward" : "layernorm_backward";
    const size_t gsize = sf_dtype_size(a->gamma->dtype);
    if (a->rows == 0) { /* empty sums */
        SF_CUDA_TRY(op, cudaMemsetAsync(a->dgamma->data, 0, a->hidden * gsize, stream));
        if (a->dbeta)
            SF_CUDA_TRY(op, cudaMemsetAsync(a->dbeta->data, 0, a->hidden * gsize, stream));
        return SF_OK;
    }
    /* the partial rows are written as float32 vectors of VEC, so the vector
     * path also wants the workspace 16-byte aligned (torch's allocations are) */
    const bool vec = backward_vec(a) && aligned16(a->workspace->data);
    const int ve = 16 / (int)sf_dtype_size(a->x->dtype);
    const int device = a->x->device_id;
    int64_t bound;
    const Config c = backward_config(a->hidden, vec ? ve : 1, a->rms); /* the split of both calls below */
    SF_TRY(backward_grid_bound(op, a->rows, c, device, &bound));
    BackwardParams p;
    p.dy = a->dy->data;
    p.x = a->x->data;
    p.gamma = a->gamma->data;
    p.mean = a->mean ? (const float *)a->mean->data : NULL;
    p.rstd = (const float *)a->rstd->data;
    p.dx = a->dx->data;
    p.dres = a->dres ? a->dres->data : NULL;
    p.ws = (float *)a->workspace->data;
    p.rows = a->rows;
    p.hidden = (int)a->hidden;
    p.rms = a->rms;
    p.zc = a->zero_centered_gamma;
    p.gamma_f32 = a->gamma->dtype == SF_FLOAT32;
    p.want_dbeta = a->dbeta != NULL;

    int64_t grid = 0;
    SF_TRY(sf_visit_float(op, "x", a->x->dtype, [&](auto tag) {
        return launch_backward<typename decltype(tag)::type>(p, c, vec, device, bound, stream, &grid);
    }));
    void *dbeta = a->dbeta ? a->dbeta->data : NULL;
    const int parts = (int)grid;
    return sf_visit_float(op, "gamma", a->gamma->dtype, [&](auto tag) {
        using G = typename decltype(tag)::type;
        return launch_reduce<G>(p.ws, parts, p.hidden, a->dgamma->data, dbeta, stream);
    });
}

} // namespace sf_norm

using namespace sf_norm;

extern "C" sf_status sf_norm_forward_cuda(const sf_norm_forward_args *a, sf_stream s)
{
    return sf_on_device(a->rms ? "rmsnorm_forward" : "layernorm_forward", a->x->device_id,
                        [&] { return forward(a, sf_cuda_stream(s)); });
}

extern "C" sf_status sf_norm_backward_cuda(const sf_norm_backward_args *a, sf_stream s)
{
    return sf_on_device(a->rms ? "rmsnorm_backward" : "layernorm_backward", a->x->device_id,
                        [&] { return backward(a, sf_cuda_stream(s)); });
}

#ifdef SF_WORKBENCH
/* The split's knobs, for check_norm --sweep (the check programs' build
 * only): what tuning() returns there. */
Tuning sf_norm::g_tuning = kDefaultTuning;

extern "C" sf_status sf_norm_cuda_tune(int forward_elems, int forward_block, int backward_elems, int backward_block)
{
    if (!forward_elems && !forward_block && !backward_elems && !backward_block) { /* back to the defaults */
        g_tuning = kDefaultTuning;
        return SF_OK;
    }
    /* at most 32 elements per thread: the kernels hold NV <= 4 vectors of
     * 16-bit rows, NV <= 8 of float32 ones */
    const int e[2] = {forward_elems, backward_elems}, b[2] = {forward_block, backward_block};
    for (int i = 0; i < 2; ++i) {
        if (e[i] != 8 && e[i] != 16 && e[i] != 32)
            return sf_fail(SF_ERR_VALUE, "sf_norm_cuda_tune: elements per thread must be 8, 16 or 32, got %d", e[i]);
        if (b[i] < 32 || b[i] > 1024 || b[i] % 32)
            return sf_fail(SF_ERR_VALUE, "sf_norm_cuda_tune: block must be a multiple of 32 in [32, 1024], got %d",
                           b[i]);
    }
    g_tuning.forward_elems = forward_elems;
    g_tuning.forward_block = forward_block;
    for (int rms = 0; rms < 2; ++rms) {
        g_tuning.backward_elems[rms] = backward_elems;
        g_tuning.backward_block[rms] = backward_block;
    }
    return SF_OK;
}
#endif /* SF_WORKBENCH */

extern "C" sf_status sf_norm_backward_workspace_numel_cuda(int64_t rows, int64_t hidden, sf_dtype dtype,
                                                      int device_id, int64_t *numel)
{
    /* the largest of the vector and element-wide paths' bounds, LayerNorm's
     * and RMSNorm's: which one runs depends on what the caller has not
     * handed in yet */
    int64_t most = 0;
    if (rows > 0) {
        const int ve = 16 / (int)sf_dtype_size(dtype);
        for (int rms = 0; rms < 2; ++rms)
            for (int vec : {1, ve}) {
                if (vec > 1 && hidden % vec)
                    continue; /* no vector path for this row length */
                int64_t b;
                SF_TRY(backward_grid_bound("norm_backward_workspace_numel", rows, backward_config(hidden, vec, rms), device_id,
                                      &b));
                most = b > most ? b : most;
            }
    }
    *numel = 2 * most * hidden;
    return SF_OK;
}

