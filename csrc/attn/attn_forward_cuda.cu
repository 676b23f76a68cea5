/*
 * attn_forward_cuda.cu - the flash-attention forward on the GPU.
 *
 * One block of 4 warps owns 128 query rows of one (sequence, head); each warp
 * owns 32 rows (two m16 row tiles) and keeps their Q fragments (head dims up
 * to 64), the running max, the running sum and the output accumulator in
 * registers.  The block walks the key/value tiles (64 keys; 128 for head dims
 * up to 32, where a key row is cheap) its rows may see (the mask's range,
 * computed per block, so causal and windowed blocks skip whole tiles): S = Q K^T on tensor cores,
 * masking only on tiles that cross a boundary, online softmax in base 2
 * (exp2f of a pre-scaled score), O += P V with P straight from registers.
 * K of the next tile is fetched with cp.async while the current one is being
 * consumed, V of the current tile while S is computed.  At the end O / l is
 * written, and lse = max * scale + ln l (float32) for the backward.
 *
 * Lengths and offsets come from cu_seqlens on the device (sf_attn_seq_q/k in
 * attn.h, clamped), so one launch serves padded and packed batches; blocks
 * past a sequence's end exit early (THD) or write the zero padding (BSHD,
 * SBHD).  Causal blocks are issued heaviest first.
 *
 * Dropout (a separate instantiation, kDropout): after the online softmax of
 * a tile has summed every probability, the dropped ones are zeroed before
 * P V (keep bits from attn_philox.h, regenerated per tile, never stored) and
 * the epilogue scales O by 1 / (1 - p); lse stays the undropped one.  On
 * Hopper a dropout call runs here, not in the wgmma kernel (forward_sm90_selected
 * says so, and ops/attn.py logs it once).
 *
 * Head dims: kernels for tile widths 16, 32, 64 and 128; head dim 24 runs in
 * the 32-wide kernel with its last 8 columns zero-filled on load (zero
 * columns add nothing to Q K^T nor to P V) and not stored.
 */
#include "../core/cuda_util.h"
#include "attn_backend.h"
#include "attn_cuda.cuh"
#include "attn_sm90.cuh"

namespace sf_attn {

/* Tile shape: WARPS warps of MT m16 row tiles each (BM = 16*MT*WARPS query
 * rows per block), BN keys per step.  Two row tiles per warp reuse every K/V
 * fragment read from shared memory twice, which is what shared-memory
 * bandwidth asks for.  QREG keeps Q's fragments in registers for the whole
 * block; otherwise they are re-read from shared memory at each step (head dim
 * 128 with two row tiles would not fit the register file).  Small head dims
 * take twice the keys per step: the scores of a step then cost as many
 * registers as head dim 64's, and the block's loop runs half as often.
 * Dropout kernels hold the keep bits of a tile besides: they take 64 keys
 * per step at every head dim, and one row tile per warp at head dim 128, so
 * that nothing spills (ptxas -v). */
template <int D, bool kDropout = false> struct ForwardCfg {
    static constexpr int WARPS = 4, MT = kDropout && D == 128 ? 1 : 2, BN = D <= 32 && !kDropout ? 128 : 64;
    static constexpr bool QREG = D <= 64;
};

template <int D, bool kDropout> constexpr int forward_smem_bytes()
{
    using C = ForwardCfg<D, kDropout>;
    return (16 * C::MT * C::WARPS + 2 * C::BN) * (D + 8) * 2;
}

template <typename T, int D, bool kDropout>
__global__ void __launch_bounds__(32 * ForwardCfg<D>::WARPS, 1) forward_kernel(const sf_attn_problem p)
{
    using C = ForwardCfg<D, kDropout>;
    constexpr int WARPS = C::WARPS, MT = C::MT, BN = C::BN, NT = 32 * WARPS;
    constexpr int SD = D + 8, BM = 16 * MT * WARPS;
    constexpr int KD = D / 16;  /* 16-wide chunks of the head dim */
    constexpr int NS = BN / 8;  /* 8-wide score tiles per row tile */
    constexpr int NO = D / 8;   /* 8-wide output tiles */
    constexpr int QF = C::QREG ? KD : 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *sQ = reinterpret_cast<T *>(smem_raw);
    T *sK = sQ + BM * SD;
    T *sV = sK + BN * SD;

    const int m_block = gridDim.x - 1 - blockIdx.x; /* heavy (late) causal blocks first */
    const int h = blockIdx.y, b = blockIdx.z;
    const int hk = h / (p.heads / p.heads_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4;

    int64_t qs, ks;
    int sq, sk;
    sf_attn_seq_q(&p, b, &qs, &sq);
    sf_attn_seq_k(&p, b, &ks, &sk);
    const int m0 = m_block * BM;
    const int rows_total = p.thd ? sq : p.max_sq; /* rows this sequence owns in the view */
    if (m0 >= rows_total)
        return;
    const int off = sf_attn_diag(&p, sq, sk);
    const int left = p.window_left, right = p.window_right;
    const float sl2 = p.scale * kLog2e;
    const int dr = real_dim<D>(p);

    int n_lo = 0, n_hi = 0;
    if (m0 < sq)
        sf_attn_key_range(m0, min(m0 + BM, sq) - 1, off, left, right, sk, &n_lo, &n_hi);
    const int nb_lo = n_lo / BN, nb_hi = (n_hi + BN - 1) / BN;

    const T *qbase = view_ptr<const T>(p.q, b, qs + m0, h);
    const T *kbase = view_ptr<const T>(p.k, b, ks, hk);
    const T *vbase = view_ptr<const T>(p.v, b, ks, hk);
    const int wrow = warp * 16 * MT; /* first row of this warp in the block */

    float o[MT][NO][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        zero_frags(o[mt]);
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    if (nb_lo < nb_hi) {
        load_tile<T, BM, D, NT>(sQ, qbase, p.q.ss, min(BM, sq - m0), dr);
        load_tile<T, BN, D, NT>(sK, kbase + (int64_t)nb_lo * BN * p.k.ss, p.k.ss,
                                min(BN, sk - nb_lo * BN), dr);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        uint32_t qf[MT][QF][4];
        if constexpr (C::QREG) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < QF; ++kk)
                    ldsm_x4(qf[mt][kk], smem_addr(sQ + (wrow + mt * 16 + lane % 16) * SD + kk * 16 + (lane / 16) * 8));
        }

        const int mi = lane / 8, mr = lane % 8;

        for (int nb = nb_lo; nb < nb_hi; ++nb) {
            const int n0 = nb * BN;
            /* V of this tile streams in while S is computed */
            load_tile<T, BN, D, NT>(sV, vbase + (int64_t)n0 * p.v.ss, p.v.ss, min(BN, sk - n0), dr);
            cp_async_commit();

            /* dropout's keep bits of this tile, drawn before S is live (fewer registers held) */
            KeepMask<4 * NS> keep[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                keep[mt] = kDropout ? keep_rows<NS>(p, (int64_t)b * p.heads + h, m0 + wrow + mt * 16, n0, g, t4) : 0;

            float s[MT][NS][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                zero_frags(s[mt]);
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                uint32_t qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if constexpr (C::QREG) {
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            qa[mt][e] = qf[mt][kk][e];
                    } else {
                        ldsm_x4(qa[mt], smem_addr(sQ + (wrow + mt * 16 + lane % 16) * SD + kk * 16 + (lane / 16) * 8));
                    }
                }
#pragma unroll
                for (int j = 0; j < NS / 2; ++j) {
                    uint32_t kf[4];
                    ldsm_x4(kf, smem_addr(sK + (j * 16 + mr + (mi >> 1) * 8) * SD + kk * 16 + (mi & 1) * 8));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        Mma<T>::run(s[mt][2 * j], qa[mt], kf[0], kf[1]);
                        Mma<T>::run(s[mt][2 * j + 1], qa[mt], kf[2], kf[3]);
                    }
                }
            }
            __syncthreads(); /* every warp is done with sK */
            if (nb + 1 < nb_hi) {
                load_tile<T, BN, D, NT>(sK, kbase + (int64_t)(n0 + BN) * p.k.ss, p.k.ss,
                                        min(BN, sk - n0 - BN), dr);
                cp_async_commit();
            }

            /* mask only the tiles that cross the sequence end or the window */
            if (SF_ATTN_KEYS_CROSS_MASK(m0, BM, n0, BN, sk, off, left, right)) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < NS; ++i)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int r = m0 + wrow + mt * 16 + g + (e >> 1) * 8;
                            const int c = n0 + i * 8 + 2 * t4 + (e & 1);
                            if (c >= sk || !sf_attn_allowed(r, c, off, left, right))
                                s[mt][i][e] = -INFINITY;
                        }
            }

            /* online softmax: two rows per thread and row tile, a quad shares a row */
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hr = 0; hr < 2; ++hr) {
                    float mx = row_max[mt][hr];
#pragma unroll
                    for (int i = 0; i < NS; ++i)
                        mx = fmaxf(mx, fmaxf(s[mt][i][2 * hr], s[mt][i][2 * hr + 1]));
                    mx = quad_max(mx);
                    const float base = mx == -INFINITY ? 0.f : mx * sl2;
                    const float corr = fast_exp2(row_max[mt][hr] * sl2 - base); /* 0 when the old max was -inf */
                    row_max[mt][hr] = mx;
                    float sum = 0.f;
#pragma unroll
                    for (int i = 0; i < NS; ++i) {
                        s[mt][i][2 * hr] = fast_exp2(fmaf(s[mt][i][2 * hr], sl2, -base));
                        s[mt][i][2 * hr + 1] = fast_exp2(fmaf(s[mt][i][2 * hr + 1], sl2, -base));
                        sum += s[mt][i][2 * hr] + s[mt][i][2 * hr + 1];
                    }
                    row_sum[mt][hr] = row_sum[mt][hr] * corr + sum;
#pragma unroll
                    for (int i = 0; i < NO; ++i) {
                        o[mt][i][2 * hr] *= corr;
                        o[mt][i][2 * hr + 1] *= corr;
                    }
                }

            if constexpr (kDropout) { /* P V takes dropout(P); the sums above keep every P */
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int i = 0; i < NS; ++i)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            if (!((keep[mt] >> (4 * i + e)) & 1))
                                s[mt][i][e] = 0.f;
            }

            if (nb + 1 < nb_hi)
                cp_async_wait<1>(); /* V landed; K of the next tile may still fly */
            else
                cp_async_wait<0>();
            __syncthreads();

#pragma unroll
            for (int kc = 0; kc < BN / 16; ++kc) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    pack_a<T>(a[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
                for (int j = 0; j < D / 16; ++j) {
                    uint32_t vf[4];
                    ldsm_x4_t(vf, smem_addr(sV + (kc * 16 + mr + (mi & 1) * 8) * SD + j * 16 + (mi >> 1) * 8));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        Mma<T>::run(o[mt][2 * j], a[mt], vf[0], vf[1]);
                        Mma<T>::run(o[mt][2 * j + 1], a[mt], vf[2], vf[3]);
                    }
                }
            }
            if (nb + 1 < nb_hi) {
                cp_async_wait<0>(); /* K of the next tile */
                __syncthreads();    /* ... visible, and every warp done with sV */
            }
        }
    }

    /* epilogue: O / l, lse; zero rows for padding and rows that saw nothing */
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            const int r = m0 + wrow + mt * 16 + g + hr * 8;
            const float l = quad_sum(row_sum[mt][hr]);
            if (r >= rows_total)
                continue;
            /* padded rows computed on zero Q and rows that see no key (l = 0): drop
             * them; a NaN l (a NaN or inf score) is kept, so the NaN reaches the
             * output as torch's would */
            const bool real = r < sq && !(l <= 0.f);
            const float inv = real ? (kDropout ? p.drop_scale : 1.f) / l : 0.f;
            T *orow = view_ptr<T>(p.o, b, qs + r, h);
#pragma unroll
            for (int i = 0; i < NO; ++i)
                if (i * 8 < dr) /* head dim 24: the zero columns stay unwritten */
                    *reinterpret_cast<uint32_t *>(orow + i * 8 + 2 * t4) =
                        Mma<T>::pack(o[mt][i][2 * hr] * inv, o[mt][i][2 * hr + 1] * inv);
            if (t4 == 0)
                p.lse[lse_at(p, b, h, qs + r)] =
                    real ? (row_max[mt][hr] * sl2 + log2f(l)) * kLn2 : INFINITY;
        }
}

__global__ void zero_tail_kernel(sf_attn_view view, int heads, int dim, const int32_t *cu,
                                 int batch, int64_t extent, float *lse, int64_t lse_sh, int is_f32)
{
    int64_t start = cu[batch];
    start = start < 0 ? 0 : (start > extent ? extent : start);
    const int64_t rows = (extent - start) * heads;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; i < rows;
         i += (int64_t)gridDim.x * blockDim.y) {
        const int64_t t = start + i / heads;
        const int h = (int)(i % heads);
        if (is_f32) {
            float *row = reinterpret_cast<float *>(view.ptr) + t * view.ss + (int64_t)h * view.sh;
            for (int d = threadIdx.x; d < dim; d += blockDim.x)
                row[d] = 0.f;
        } else {
            uint16_t *row = reinterpret_cast<uint16_t *>(view.ptr) + t * view.ss + (int64_t)h * view.sh;
            for (int d = threadIdx.x; d < dim; d += blockDim.x)
                row[d] = 0;
        }
        if (lse && threadIdx.x == 0)
            lse[(int64_t)h * lse_sh + t] = INFINITY;
    }
}

void launch_zero_tail(const sf_attn_problem &p, const sf_attn_view &view, int heads,
                      const int32_t *cu, int64_t extent, float *lse, cudaStream_t stream)
{
    if (extent == 0)
        return;
    /* the tail length lives on the device: cover the whole buffer, rows
     * before the tail exit at once */
    const int64_t rows = extent * heads;
    const int grid = (int)((rows + 7) / 8 < 4096 ? (rows + 7) / 8 : 4096);
    zero_tail_kernel<<<grid, dim3(32, 8), 0, stream>>>(view, heads, p.head_dim, cu, p.batch, extent,
                                                        lse, p.lse_sh, 0);
}

/* The attribute is set once per (kernel, device), so launches inside a CUDA
 * graph capture make no such call; racing first calls set the same value. */
cudaError_t allow_smem(const void *kernel, int bytes)
{
    if (bytes <= 48 * 1024)
        return cudaSuccess;
    constexpr int kSlots = 128;
    static const void *done_kernel[kSlots];
    static int done_device[kSlots];
    static int n_done = 0;
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess)
        return e;
    for (int i = 0; i < n_done && i < kSlots; ++i)
        if (done_kernel[i] == kernel && done_device[i] == device)
            return cudaSuccess;
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess && n_done < kSlots) {
        done_kernel[n_done] = kernel;
        done_device[n_done] = device;
        ++n_done;
    }
    return e;
}

template <typename T, int D, bool kDropout>
static sf_status launch_forward_dim(const sf_attn_problem &p, cudaStream_t stream)
{
    using C = ForwardCfg<D, kDropout>;
    constexpr int smem = forward_smem_bytes<D, kDropout>();
    constexpr int BM = 16 * C::MT * C::WARPS;
    SF_CUDA_TRY("attention_forward", allow_smem((const void *)forward_kernel<T, D, kDropout>, smem));
    dim3 grid((p.max_sq + BM - 1) / BM, p.heads, p.batch);
    forward_kernel<T, D, kDropout><<<grid, 32 * C::WARPS, smem, stream>>>(p);
    SF_CUDA_CHECK_LAUNCH("attention_forward");
    return SF_OK;
}

/* The sm_80 (mma.sync) forward, every dtype and head dim attn.c admits. */
static sf_status launch_forward(const sf_attn_problem &p, cudaStream_t stream)
{
    return with_kernel_params("attention_forward", p, [&](auto t, auto w, auto drop) {
        return launch_forward_dim<typename decltype(t)::type, decltype(w)::value, decltype(drop)::value>(p, stream);
    });
}

} // namespace sf_attn

extern "C" sf_status sf_attn_forward_cuda(const sf_attn_problem *p, sf_stream s, int device)
{
    using namespace sf_attn;
    cudaStream_t stream = sf_cuda_stream(s);
    return run_on_device(
        "attention_forward", *p, device,
        [&]() -> sf_status {
            if (p->batch == 0 || p->max_sq == 0)
                return SF_OK;
            if (forward_sm90_selected(*p, device, NULL))
                return launch_forward_sm90(*p, stream); /* wgmma kernel, attn_forward_sm90_cuda.cu */
            return launch_forward(*p, stream);
        },
        [&] { launch_zero_tail(*p, p->o, p->heads, p->cu_q, p->extent_q, p->lse, stream); });
}
