/*
 * attn_cuda.cuh - the tensor-core building blocks the attention kernels
 * share (sm_80 instructions, which Hopper runs too): mma.sync m16n8k16 with
 * float32 accumulation for bfloat16 and float16, ldmatrix (plain and
 * transposed), cp.async 16-byte copies with zero fill, and tile loads into
 * shared memory with a padded row stride (D + 8 elements, so the 8 rows an
 * ldmatrix reads fall in 8 different bank groups).
 *
 * Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
 *   A 16x16 row-major:  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
 *   B 16x8  "col":      b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
 *   C 16x8  float:      c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
 * so the C fragments of two neighbouring 16x8 tiles, packed to 16-bit pairs,
 * are exactly the A fragment of a 16x16 tile: P = softmax(S) feeds P V
 * without leaving registers.
 */
#ifndef SF_ATTN_CUDA_CUH
#define SF_ATTN_CUDA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attn.h"

namespace sf_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u)
    {
        __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162 *>(&u);
        return __bfloat1622float2(v);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u)
    {
        __half2 v = *reinterpret_cast<__half2 *>(&u);
        return __half22float2(v);
    }
};

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* 16 bytes global -> shared; src_bytes = 0 writes 16 zero bytes, reads nothing. */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Load rows [0, ROWS) x D of a [token, head dim] slab (row stride `ld`
 * elements) into a shared tile with row stride D + 8; rows >= valid and
 * columns >= dcols (a multiple of 8: the 32-wide tile also serves head dim
 * 24) are zero-filled, so padding never reaches the math (0 * NaN would) and
 * zero columns add nothing to Q K^T nor to P V.  `base` must point to a
 * valid address even when valid == 0. */
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(T *tile, const T *base, int64_t ld, int valid, int dcols)
{
    constexpr int kChunks = D / 8, SD = D + 8;
    const int ok_chunks = dcols / 8;
    for (int i = threadIdx.x; i < ROWS * kChunks; i += NT) {
        int r = i / kChunks, c = i % kChunks;
        bool ok = r < valid && c < ok_chunks;
        const T *src = ok ? base + (int64_t)r * ld + c * 8 : base;
        cp_async_16(smem_addr(tile + r * SD + c * 8), src, ok ? 16 : 0);
    }
}

/* The head dim a D-wide kernel really reads and writes: D itself (a
 * constant the compiler folds), except that the 32-wide kernels also run head
 * dim 24, as a 32-wide tile whose last 8 columns are zero. */
template <int D> __device__ __forceinline__ int real_dim(const sf_attn_problem &p)
{
    return D == 32 ? p.head_dim : D;
}

template <int D> struct TileWidth {
    static constexpr int value = D;
};

/* fn(TileWidth<D>{}) for the kernels' tile width D of every head dim attn.c
 * admits: 16, 24 (in the 32-wide kernels), 32, 64, 128. */
template <typename Fn>
inline sf_status with_tile_width(const char *op, int head_dim, Fn &&fn)
{
    switch (head_dim) {
    case 16: return fn(TileWidth<16>{});
    case 24:
    case 32: return fn(TileWidth<32>{});
    case 64: return fn(TileWidth<64>{});
    case 128: return fn(TileWidth<128>{});
    default: return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: no CUDA kernel for head dim %d", op, head_dim);
    }
}

/* dst[0] += a, dst[1] += b in global memory (dst 8-byte aligned): one
 * vector reduction on Hopper (half the atomic instructions of the backward's
 * dQ accumulation), two scalar ones before it. */
__device__ __forceinline__ void atomic_add2(float *dst, float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
#endif
}

/* Pointer to token `t` (0-based in the view) of head h, batch b. */
template <typename T>
__device__ __forceinline__ T *view_ptr(const sf_attn_view &v, int b, int64_t t, int h)
{
    return reinterpret_cast<T *>(v.ptr) + (int64_t)b * v.sb + t * v.ss + (int64_t)h * v.sh;
}

__device__ __forceinline__ int64_t lse_at(const sf_attn_problem &p, int b, int h, int64_t t)
{
    return (int64_t)b * p.lse_sb + (int64_t)h * p.lse_sh + t;
}

/* Where a backward key block stands (the wgmma dK/dV kernel,
 * attn_bwd_sm90_cuda.cu; the sm80 dkdv_kernel of attn_bwd_cuda.cu still
 * spells the same plan, the mask test and the lse/delta load out inline: it
 * is GPU-verified code, left byte-identical in a session without a GPU -
 * switch it to these helpers when it can be rechecked on one): its
 * sequence and the query tiles of bm rows
 * that may see keys [n0, n0 + bn), walked for every query head of the GQA
 * group (G heads): `steps` (head, tile) pairs, step it = head it / nmb of the group,
 * tile mb_lo + it % nmb. */
struct KeyBlockPlan {
    int64_t qs, ks;         /* first token of the sequence in q / k views */
    int sq, sk, rows_total; /* lengths; key rows the view owns for this sequence */
    int off, mb_lo, nmb, steps;
};

/* false when the block starts past the view's key rows of sequence b */
__device__ __forceinline__ bool plan_key_block(const sf_attn_problem &p, int b, int n0, int bn, int bm, int G,
                                               KeyBlockPlan &kp)
{
    sf_attn_seq_q(&p, b, &kp.qs, &kp.sq);
    sf_attn_seq_k(&p, b, &kp.ks, &kp.sk);
    kp.rows_total = p.thd ? kp.sk : p.max_sk;
    if (n0 >= kp.rows_total)
        return false;
    kp.off = sf_attn_diag(&p, kp.sq, kp.sk);
    int m_lo = 0, m_hi = 0;
    if (n0 < kp.sk)
        sf_attn_query_range(n0, min(n0 + bn, kp.sk) - 1, kp.off, p.window_left, p.window_right, kp.sq, &m_lo, &m_hi);
    kp.mb_lo = m_lo / bm;
    kp.nmb = (m_hi + bm - 1) / bm - m_lo / bm;
    kp.steps = kp.nmb > 0 ? G * kp.nmb : 0;
    return true;
}

/* 1 when some (query, key) pair of rows [m0, m0 + bm) x keys [n0, n0 + bn)
 * is outside the sequences or the window (the tile needs per-element masking). */
__device__ __forceinline__ bool tile_crosses_mask(int m0, int bm, int n0, int bn, int sq, int sk, int off, int left,
                                                  int right)
{
    return m0 + bm > sq || n0 + bn > sk || (right >= 0 && n0 + bn - 1 > m0 + off + right) ||
           (left >= 0 && n0 < m0 + bm - 1 + off - left);
}

/* lse * log2(e) and delta of query rows t0 .. t0 + bm - 1 of head h into
 * shared arrays, by nt threads; rows >= valid get +inf and 0 (P = 0). */
__device__ __forceinline__ void load_lse_delta(const sf_attn_problem &p, int b, int h, int64_t t0, int valid, int bm,
                                               int nt, float *s_lse, float *s_delta)
{
    for (int i = threadIdx.x; i < bm; i += nt) {
        const bool ok = i < valid;
        s_lse[i] = ok ? p.lse[lse_at(p, b, h, t0 + i)] * kLog2e : INFINITY;
        s_delta[i] = ok ? p.delta[lse_at(p, b, h, t0 + i)] : 0.f;
    }
}

/* 2^x on the special-function unit (ex2.approx: relative error < 2^-22,
 * 2^-inf = 0); exp2f without fast-math is several instructions more, and
 * the exponentials are a bottleneck of attention. */
__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Sum over the 4 lanes of a quad (they hold one row of a C fragment). */
__device__ __forceinline__ float quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

__device__ __forceinline__ float quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

} // namespace sf_attn

#endif /* SF_ATTN_CUDA_CUH */

#include <cuda_runtime.h>

namespace sf_attn {
/* THD: zero the rows of `view` (heads x head_dim) past the last sequence,
 * tokens cu[batch] .. extent-1, and set lse there to +inf when lse != NULL.
 * Defined in attn_fwd_cuda.cu. */
void launch_zero_tail(const sf_attn_problem &p, const sf_attn_view &view, int heads,
                      const int32_t *cu, int64_t extent, float *lse, cudaStream_t stream);
/* Opt a kernel into more than 48 KiB of dynamic shared memory (once per device). */
cudaError_t allow_smem(const void *kernel, int bytes);
} // namespace sf_attn
