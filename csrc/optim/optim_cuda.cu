/*
 * optim_cuda.cu - multi-tensor AdamW, l2 norm and scale on the GPU, on the
 * caller's stream.
 *
 * Launch plan (the multi_tensor_apply idea of apex / Transformer Engine):
 * the host walks the tensor lists and packs up to kTensors tensors per launch
 * into a metadata struct (pointers per list, sizes, and the prefix sum of
 * their chunk counts, a chunk being SF_MT_CHUNK elements).  The struct is
 * the kernel's __grid_constant__ parameter (read in place from the constant
 * bank, no copy, no device allocation, capturable in a CUDA graph).  Blocks
 * walk the launch's chunks grid-stride, find a chunk's tensor by binary
 * search over the prefix sum, and stream it four elements per access (16
 * bytes of fp32, 8 of 16-bit types; AdamW over 16-bit lists only: eight, 16
 * bytes) where its pointers allow.
 *
 * The l2 norm writes one partial sum per chunk into the workspace; a final
 * single-block kernel adds them in a fixed order (deterministic) and takes the
 * square root.  Nothing is read back to the host.
 */
#include <type_traits>

#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "../core/visit.cuh"
#include "optim_backend.h"

namespace {

constexpr int kBlock = 512;
constexpr int kIlp = 4;
constexpr int kAdamTensors = 64;  /* 5 lists: ~3.4 KB of parameters */
constexpr int kListTensors = 160; /* 1 list + dtype: ~3.4 KB */

template <int DEPTH, int T>
struct MTMeta {
    void *ptr[DEPTH][T];
    int64_t numel[T];
    int32_t chunk_start[T + 1];
    int8_t dtype[T];
    int32_t n;
    int64_t chunk_base; /* global index of this launch's first chunk */
};

template <int DEPTH, int T>
__device__ __forceinline__ int find_tensor(const MTMeta<DEPTH, T> &m, int c)
{
    int lo = 0, hi = m.n - 1; /* largest t with chunk_start[t] <= c */
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (m.chunk_start[mid] <= c) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Chunk c of a launch: its tensor, its first element in that tensor, and its
 * length (SF_MT_CHUNK, or what is left of the tensor). */
struct Chunk {
    int t;
    int64_t off;
    int64_t len;
};

template <int DEPTH, int T>
__device__ __forceinline__ Chunk chunk_at(const MTMeta<DEPTH, T> &m, int c)
{
    Chunk ch;
    ch.t = find_tensor(m, c);
    ch.off = (int64_t)(c - m.chunk_start[ch.t]) * SF_MT_CHUNK;
    const int64_t rest = m.numel[ch.t] - ch.off;
    ch.len = rest < SF_MT_CHUNK ? rest : SF_MT_CHUNK;
    return ch;
}

using sf_vec::from_f;
using sf_vec::to_f;

/* kIlp elements as one access (16 bytes of fp32, 8 of 16-bit types). */
template <typename T> using Vec = sf_vec::Pack<T, kIlp>;

/* AdamW's elements per access: 8 where every list it reads is 16-bit (no
 * fp32 master or gradient: bf16 params, grads and moments, torch AdamW's
 * state on bf16 params), so each access is 16 bytes; else kIlp (an fp32
 * master is read as a float4).  SF_ADAMW_WIDE=0 builds kIlp everywhere, to
 * time one against the other (bin/check_optim_adamw prints the bf16 state's
 * step). */
#ifndef SF_ADAMW_WIDE
#define SF_ADAMW_WIDE 1
#endif
template <typename T, typename TG, typename TM, bool MASTER>
constexpr int adamw_ilp()
{
    return SF_ADAMW_WIDE && !MASTER && sizeof(T) == 2 && sizeof(TG) == 2 && sizeof(TM) == 2 ? 2 * kIlp : kIlp;
}

__device__ __forceinline__ bool aligned(const void *p, size_t bytes) { return ((uintptr_t)p % bytes) == 0; }

/* ---- AdamW ----------------------------------------------------------- */

/* T: the params' dtype; TG: the grads' (T or float); TM: the moments' (float,
 * or bfloat16: torch.optim.AdamW's state on bf16 params, updated in fp32 and
 * stored rounded); MASTER: an fp32 master copy holds the true value. */
template <typename T, typename TG, typename TM, bool MASTER>
__device__ __forceinline__ void adamw_one(const sf_adamw_consts &k, T *p, const TG *g, TM *m, TM *v,
                                          float *w, int64_t i)
{
    float pv = MASTER ? w[i] : to_f(p[i]);
    float mv = to_f(m[i]), vv = to_f(v[i]);
    sf_adamw_update(&k, to_f(g[i]), &pv, &mv, &vv);
    m[i] = from_f<TM>(mv);
    v[i] = from_f<TM>(vv);
    if (MASTER)
        w[i] = pv;
    p[i] = from_f<T>(pv);
}

/* The chunk's elements [0, n) in ILP-wide accesses when every pointer
 * allows them (returns n rounded down to ILP), else none (returns 0). */
template <int ILP, typename T, typename TG, typename TM, bool MASTER>
__device__ __forceinline__ int64_t adamw_vectors(const sf_adamw_consts &k, T *p, const TG *g, TM *m, TM *v,
                                                 float *w, int64_t len)
{
    static_assert(!MASTER || ILP == 4, "an fp32 master is read as one float4");
    using VT = sf_vec::Pack<T, ILP>;
    using VG = sf_vec::Pack<TG, ILP>;
    using VM = sf_vec::Pack<TM, ILP>;
    if (!(aligned(p, sizeof(T) * ILP) && aligned(g, sizeof(TG) * ILP) && aligned(m, sizeof(TM) * ILP) &&
          aligned(v, sizeof(TM) * ILP) && (!MASTER || aligned(w, 16))))
        return 0;
    const int64_t nv = len / ILP;
    for (int64_t i = threadIdx.x; i < nv; i += kBlock) {
        VG gv = reinterpret_cast<const VG *>(g)[i];
        VM mv = reinterpret_cast<const VM *>(m)[i];
        VM vv = reinterpret_cast<const VM *>(v)[i];
        float pf[ILP];
        if (MASTER) {
            float4 wv = reinterpret_cast<const float4 *>(w)[i];
            pf[0] = wv.x; pf[1] = wv.y; pf[2] = wv.z; pf[3] = wv.w;
        } else {
            VT pv = reinterpret_cast<const VT *>(p)[i];
#pragma unroll
            for (int j = 0; j < ILP; ++j)
                pf[j] = to_f(pv.v[j]);
        }
        VT out;
#pragma unroll
        for (int j = 0; j < ILP; ++j) {
            float mf = to_f(mv.v[j]), vf = to_f(vv.v[j]);
            sf_adamw_update(&k, to_f(gv.v[j]), &pf[j], &mf, &vf);
            mv.v[j] = from_f<TM>(mf);
            vv.v[j] = from_f<TM>(vf);
            out.v[j] = from_f<T>(pf[j]);
        }
        reinterpret_cast<VM *>(m)[i] = mv;
        reinterpret_cast<VM *>(v)[i] = vv;
        if (MASTER)
            reinterpret_cast<float4 *>(w)[i] = make_float4(pf[0], pf[1], pf[2], pf[3]);
        reinterpret_cast<VT *>(p)[i] = out;
    }
    return nv * ILP;
}

template <typename T, typename TG, typename TM, bool MASTER>
__global__ void __launch_bounds__(kBlock) adamw_kernel(const __grid_constant__ MTMeta<5, kAdamTensors> meta,
                                                       const sf_adamw_consts k)
{
    constexpr int ILP = adamw_ilp<T, TG, TM, MASTER>();
    const int nchunks = meta.chunk_start[meta.n];
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const Chunk ch = chunk_at(meta, c);
        const int t = ch.t;
        const int64_t off = ch.off, len = ch.len;
        T *p = static_cast<T *>(meta.ptr[0][t]) + off;
        const TG *g = static_cast<const TG *>(meta.ptr[1][t]) + off;
        TM *m = static_cast<TM *>(meta.ptr[2][t]) + off;
        TM *v = static_cast<TM *>(meta.ptr[3][t]) + off;
        float *w = MASTER ? static_cast<float *>(meta.ptr[4][t]) + off : nullptr;
        /* the widest accesses the pointers allow (16-bit lists 8 bytes apart from 16-byte alignment
         * take kIlp), then the elements one by one */
        int64_t done = adamw_vectors<ILP, T, TG, TM, MASTER>(k, p, g, m, v, w, len);
        if (ILP != kIlp && done == 0)
            done = adamw_vectors<kIlp, T, TG, TM, MASTER>(k, p, g, m, v, w, len);
        for (int64_t i = done + threadIdx.x; i < len; i += kBlock)
            adamw_one<T, TG, TM, MASTER>(k, p, g, m, v, w, i);
    }
}

/* ---- l2 norm and scale over mixed dtypes -------------------------------- */

template <typename T>
__device__ __forceinline__ float sumsq(const T *x, int64_t len)
{
    float s = 0.0f;
    int64_t done = 0;
    if (aligned(x, sizeof(T) * kIlp)) {
        int64_t nv = len / kIlp;
        for (int64_t i = threadIdx.x; i < nv; i += kBlock) {
            Vec<T> r = reinterpret_cast<const Vec<T> *>(x)[i];
#pragma unroll
            for (int j = 0; j < kIlp; ++j) {
                float f = to_f(r.v[j]);
                s = fmaf(f, f, s);
            }
        }
        done = nv * kIlp;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += kBlock) {
        float f = to_f(x[i]);
        s = fmaf(f, f, s);
    }
    return s;
}

__device__ __forceinline__ float block_sum(float s)
{
    __shared__ float part[kBlock / 32];
    for (int off = 16; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0)
        part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < kBlock / 32 ? part[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, off);
    }
    __syncthreads(); /* part[] is reused by the next chunk */
    return s;
}

__global__ void __launch_bounds__(kBlock) l2norm_kernel(const __grid_constant__ MTMeta<1, kListTensors> meta,
                                                        float *__restrict__ ws)
{
    const int nchunks = meta.chunk_start[meta.n];
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const Chunk ch = chunk_at(meta, c);
        const int t = ch.t;
        const int64_t off = ch.off, len = ch.len;
        float s;
        switch (meta.dtype[t]) {
        case SF_FLOAT32: s = sumsq(static_cast<const float *>(meta.ptr[0][t]) + off, len); break;
        case SF_FLOAT16: s = sumsq(static_cast<const __half *>(meta.ptr[0][t]) + off, len); break;
        default:         s = sumsq(static_cast<const __nv_bfloat16 *>(meta.ptr[0][t]) + off, len); break;
        }
        s = block_sum(s);
        if (threadIdx.x == 0)
            ws[meta.chunk_base + c] = s;
    }
}

/* One block: add the partials in a fixed order, in double. */
__global__ void __launch_bounds__(1024) l2norm_finish_kernel(const float *__restrict__ ws, int64_t count,
                                                             float *__restrict__ out)
{
    __shared__ double part[1024];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < count; i += 1024)
        s += ws[i];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int width = 512; width > 0; width >>= 1) {
        if (threadIdx.x < width)
            part[threadIdx.x] += part[threadIdx.x + width];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[0] = (float)sqrt(part[0]);
}

template <typename T>
__device__ __forceinline__ void scale_chunk(T *x, int64_t len, float s)
{
    int64_t done = 0;
    if (aligned(x, sizeof(T) * kIlp)) {
        int64_t nv = len / kIlp;
        for (int64_t i = threadIdx.x; i < nv; i += kBlock) {
            Vec<T> r = reinterpret_cast<Vec<T> *>(x)[i];
#pragma unroll
            for (int j = 0; j < kIlp; ++j)
                r.v[j] = from_f<T>(to_f(r.v[j]) * s);
            reinterpret_cast<Vec<T> *>(x)[i] = r;
        }
        done = nv * kIlp;
    }
    for (int64_t i = done + threadIdx.x; i < len; i += kBlock)
        x[i] = from_f<T>(to_f(x[i]) * s);
}

__global__ void __launch_bounds__(kBlock) scale_kernel(const __grid_constant__ MTMeta<1, kListTensors> meta,
                                                       const float *__restrict__ scale)
{
    const float s = *scale;
    if (s == 1.0f) /* x * 1 is x: a scale only the device knows (a loss's gradient, */
        return;    /* usually 1) then costs a launch, not a pass over the tensors */
    const int nchunks = meta.chunk_start[meta.n];
    for (int c = blockIdx.x; c < nchunks; c += gridDim.x) {
        const Chunk ch = chunk_at(meta, c);
        const int t = ch.t;
        const int64_t off = ch.off, len = ch.len;
        switch (meta.dtype[t]) {
        case SF_FLOAT32: scale_chunk(static_cast<float *>(meta.ptr[0][t]) + off, len, s); break;
        case SF_FLOAT16: scale_chunk(static_cast<__half *>(meta.ptr[0][t]) + off, len, s); break;
        default:         scale_chunk(static_cast<__nv_bfloat16 *>(meta.ptr[0][t]) + off, len, s); break;
        }
    }
}

/* ---- launch planning ------------------------------------------------- */

/* Packs tensors into metadata structs and calls launch(meta, nchunks) for each
 * full struct and for the last one.  lists[d][i] is tensor i of list d. */
template <int DEPTH, int T, typename Launch>
sf_status plan(int64_t n, const sf_tensor *const lists[DEPTH], Launch launch)
{
    MTMeta<DEPTH, T> meta = {};
    meta.n = 0;
    meta.chunk_start[0] = 0;
    meta.chunk_base = 0;
    for (int64_t i = 0; i < n; ++i) {
        int64_t numel = sf_numel(&lists[0][i]);
        if (numel == 0)
            continue;
        int64_t chunks = (numel + SF_MT_CHUNK - 1) / SF_MT_CHUNK;
        if (meta.n == T || (int64_t)meta.chunk_start[meta.n] + chunks > 0x7fffffff) {
            SF_TRY(launch(meta, meta.chunk_start[meta.n]));
            meta.chunk_base += meta.chunk_start[meta.n];
            meta.n = 0;
        }
        for (int d = 0; d < DEPTH; ++d)
            meta.ptr[d][meta.n] = lists[d][i].data;
        meta.numel[meta.n] = numel;
        meta.dtype[meta.n] = (int8_t)lists[0][i].dtype;
        meta.chunk_start[meta.n + 1] = meta.chunk_start[meta.n] + (int32_t)chunks;
        meta.n++;
    }
    if (meta.n > 0)
        SF_TRY(launch(meta, meta.chunk_start[meta.n]));
    return SF_OK;
}

int grid_for(int chunks, int device)
{
    int cap = sf_cuda_sm_count(device) * (2048 / kBlock);
    return chunks < cap ? chunks : cap;
}

struct DeviceScope {
    sf_cuda_device_guard guard;
    bool entered = false;
    sf_status enter(const char *op, int device)
    {
        SF_TRY(sf_cuda_device_enter(op, device, &guard));
        entered = true;
        return SF_OK;
    }
    ~DeviceScope()
    {
        if (entered)
            sf_cuda_device_restore(&guard);
    }
};

/* The l2 norm and scale kernels read each tensor's dtype on the device (one
 * launch holds tensors of mixed dtypes), where the branch after float32 and
 * float16 reads bfloat16.  The host visits every dtype first, so that branch
 * never sees another one. */
sf_status visit_list(const char *op, int64_t n, const sf_tensor *tensors)
{
    for (int64_t i = 0; i < n; ++i)
        SF_TRY(sf_visit_float(op, "tensors", tensors[i].dtype, [](auto) { return SF_OK; }));
    return SF_OK;
}

/* The one-list entries (l2norm, scale): every tensor's dtype visited, `scope`
 * entered on `device`, then `launch` over the chunks of the list.  The scope
 * is the caller's, so that work after the list still runs on the device. */
template <typename Launch>
sf_status run_one_list(const char *op, int64_t n, const sf_tensor *tensors, int device,
                       DeviceScope &scope, Launch launch)
{
    SF_TRY(visit_list(op, n, tensors));
    SF_TRY(scope.enter(op, device));
    const sf_tensor *lists[1] = {tensors};
    return plan<1, kListTensors>(n, lists, launch);
}

} // namespace

extern "C" sf_status sf_multi_tensor_adamw_cuda(int64_t n, sf_tensor *params, const sf_tensor *grads,
                                                sf_tensor *exp_avg, sf_tensor *exp_avg_sq, sf_tensor *master,
                                                const sf_adamw_consts *k, sf_stream s)
{
    static const char op[] = "multi_tensor_adamw";
    int device = params[0].device_id;
    DeviceScope scope;
    SF_TRY(scope.enter(op, device));
    cudaStream_t stream = sf_cuda_stream(s);
    const sf_tensor *lists[5] = {params, grads, exp_avg, exp_avg_sq, master ? master : exp_avg};
    const sf_adamw_consts kk = *k;
    sf_dtype dt = params[0].dtype;
    bool with_master = master != NULL;
    bool fp32_grads = grads[0].dtype == SF_FLOAT32 && dt != SF_FLOAT32;
    bool bf16_moments = exp_avg[0].dtype == SF_BFLOAT16;
    /* float32 params: float32 grads, no master copy (the entry refuses one);
     * 16-bit params P: grads in P or float32, with or without master; moments
     * float32 or bfloat16 for either */
    return sf_visit_float(op, "params", dt, [&](auto tag) {
        using P = typename decltype(tag)::type;
        auto launch = [&](const MTMeta<5, kAdamTensors> &meta, int chunks) -> sf_status {
            int grid = grid_for(chunks, device);
            auto go = [&](auto moment_tag) {
                using M = typename decltype(moment_tag)::type;
                if constexpr (std::is_same<P, float>::value)
                    adamw_kernel<float, float, M, false><<<grid, kBlock, 0, stream>>>(meta, kk);
                else if (fp32_grads && with_master)
                    adamw_kernel<P, float, M, true><<<grid, kBlock, 0, stream>>>(meta, kk);
                else if (fp32_grads)
                    adamw_kernel<P, float, M, false><<<grid, kBlock, 0, stream>>>(meta, kk);
                else if (with_master)
                    adamw_kernel<P, P, M, true><<<grid, kBlock, 0, stream>>>(meta, kk);
                else
                    adamw_kernel<P, P, M, false><<<grid, kBlock, 0, stream>>>(meta, kk);
            };
            if (bf16_moments)
                go(sf_type_tag<__nv_bfloat16>{});
            else
                go(sf_type_tag<float>{});
            SF_CUDA_CHECK_LAUNCH(op);
            return SF_OK;
        };
        return plan<5, kAdamTensors>(n, lists, launch);
    });
}

extern "C" sf_status sf_multi_tensor_l2norm_cuda(int64_t n, const sf_tensor *tensors, sf_tensor *workspace,
                                                 sf_tensor *out, sf_stream s)
{
    static const char op[] = "multi_tensor_l2norm";
    const int device = out->device_id;
    cudaStream_t stream = sf_cuda_stream(s);
    float *ws = (float *)workspace->data;
    int64_t total = 0;
    DeviceScope scope;
    SF_TRY(run_one_list(op, n, tensors, device, scope,
                        [&](const MTMeta<1, kListTensors> &meta, int chunks) -> sf_status {
                            l2norm_kernel<<<grid_for(chunks, device), kBlock, 0, stream>>>(meta, ws);
                            SF_CUDA_CHECK_LAUNCH(op);
                            total = meta.chunk_base + chunks;
                            return SF_OK;
                        }));
    /* total == 0 (no elements): the finish kernel writes sqrt(0) = 0 */
    l2norm_finish_kernel<<<1, 1024, 0, stream>>>(ws, total, (float *)out->data);
    SF_CUDA_CHECK_LAUNCH(op);
    return SF_OK;
}

extern "C" sf_status sf_multi_tensor_scale_cuda(int64_t n, sf_tensor *tensors, const sf_tensor *scale,
                                                sf_stream s)
{
    static const char op[] = "multi_tensor_scale";
    const int device = scale->device_id;
    cudaStream_t stream = sf_cuda_stream(s);
    const float *sc = (const float *)scale->data;
    DeviceScope scope;
    return run_one_list(op, n, tensors, device, scope,
                        [&](const MTMeta<1, kListTensors> &meta, int chunks) -> sf_status {
                            scale_kernel<<<grid_for(chunks, device), kBlock, 0, stream>>>(meta, sc);
                            SF_CUDA_CHECK_LAUNCH(op);
                            return SF_OK;
                        });
}
