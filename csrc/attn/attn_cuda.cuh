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

#include <type_traits>

#include "../core/cuda_util.h"
#include "../core/visit.cuh"
#include "attn.h"
#include "attn_philox.h"

namespace sf_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/* The 16-bit input types: T2 holds a pair, kPtx names the type in PTX. */
template <typename T> struct Half2;
template <> struct Half2<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static __device__ __forceinline__ T2 from(float lo, float hi) { return __floats2bfloat162_rn(lo, hi); }
    static __device__ __forceinline__ float2 to(T2 v) { return __bfloat1622float2(v); }
};
template <> struct Half2<__half> {
    using T2 = __half2;
    static __device__ __forceinline__ T2 from(float lo, float hi) { return __floats2half2_rn(lo, hi); }
    static __device__ __forceinline__ float2 to(T2 v) { return __half22float2(v); }
};

/* c += a b: one mma.sync m16n8k16, float32 accumulation; PTX_TYPE bf16 or f16. */
#define SF_ATTN_MMA_16816(PTX_TYPE, c, a, b0, b1)                                                   \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "             \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                          \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                   \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T> struct Mma {
    static __device__ __forceinline__ void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
    {
        if constexpr (std::is_same<T, __nv_bfloat16>::value)
            SF_ATTN_MMA_16816("bf16", c, a, b0, b1);
        else
            SF_ATTN_MMA_16816("f16", c, a, b0, b1);
    }
    /* two floats -> one register of two T (lo in the low half) and back */
    static __device__ __forceinline__ uint32_t pack(float lo, float hi)
    {
        typename Half2<T>::T2 v = Half2<T>::from(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ float2 unpack(uint32_t u)
    {
        return Half2<T>::to(*reinterpret_cast<typename Half2<T>::T2 *>(&u));
    }
};

/* c = 0 for N float C fragments (accumulators before their first product) */
template <int N> __device__ __forceinline__ void zero_frags(float (&c)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            c[i][e] = 0.f;
}

/* The A fragment of a 16x16 tile from the float C fragments of its two
 * 16x8 halves (columns 0-7 in c0, 8-15 in c1), rounded to T: how P and dS
 * feed the next product straight from registers (see the top of this file). */
template <typename T>
__device__ __forceinline__ void pack_a(uint32_t a[4], const float c0[4], const float c1[4])
{
    a[0] = Mma<T>::pack(c0[0], c0[1]);
    a[1] = Mma<T>::pack(c0[2], c0[3]);
    a[2] = Mma<T>::pack(c1[0], c1[1]);
    a[3] = Mma<T>::pack(c1[2], c1[3]);
}

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

/* fn(sf_type_tag<T>{}, TileWidth<D>{}, std::bool_constant<kDropout>{}) for
 * the problem's dtype (q's: k and v share it), head dim and dropout: the
 * instantiation an sm80 kernel family launches (dropout kernels are separate
 * instantiations, so the p = 0 ones carry none of it). */
template <typename Fn>
inline sf_status with_kernel_params(const char *op, const sf_attn_problem &p, Fn &&fn)
{
    return with_tile_width(op, p.head_dim, [&](auto w) -> sf_status {
        return sf_visit_half(op, "q", p.dtype, [&](auto t) {
            return p.dropout ? fn(t, w, std::true_type{}) : fn(t, w, std::false_type{});
        });
    });
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

/* ---- where a block stands: the prologue of the sm80 kernels ----
 * A block owns a tile of query rows (forward, deterministic dQ) or of keys
 * (dK/dV) of one sequence b.  It reads the sequence's bounds (sf_attn_seq_q/k:
 * from cu_seqlens on the device for THD, so one launch serves padded and
 * packed batches), exits when its tile starts past the rows the view owns
 * for that sequence (THD: the sequence's length; BSHD/SBHD: max_sq / max_sk,
 * whose padding rows the block still writes, as zeros), reads the mask and
 * the scale, and narrows its walk to the tiles the mask lets it see.
 *
 * Two steps: enter_* (bounds; false: exit) and find_* (mask, scale, tiles).
 * The exit test stays in the kernel's own body, between them: with the
 * early return inside a helper the compiler schedules the prologue
 * differently and the kernels' machine code, verified on the GPU, changes.
 * The kernels copy the fields into locals of the old names (qs, sq, off,
 * ...), so their bodies read as before.
 *
 * dkdv_kernel and dq_kernel use them; forward_kernel still spells its prologue
 * out (as QueryBlock its dropout kernels' code changes: the compiler orders
 * two thread-index values differently), as do the wgmma kernels, which
 * read the mask in another order (plan_key_block below, plan_block in
 * attn_forward_sm90_cuda.cu).  Checked by comparing cubins (cuobjdump -sass),
 * with no GPU at hand: switch them when they can be rechecked on one. */

/* What a block of either kind knows of its sequence and the mask. */
struct BlockSeq {
    int64_t qs, ks;         /* first token of the sequence in q / k views */
    int sq, sk, rows_total; /* lengths; rows of the block's kind the view owns for this sequence */
    int off, left, right;   /* diagonal offset and window, as sf_attn_allowed takes them */
    int dr;                 /* the head dim really read and written (real_dim) */
    float sl2;              /* softmax scale * log2(e): the scores feed exp2 */
};

/* Step 1: the sequence's bounds and the block's first row, row0 = block *
 * ROWS (a query row, or a key when kKeys); false when that row is past the
 * rows of its kind the view owns for sequence b (the block exits). */
template <bool kKeys, int ROWS>
__device__ __forceinline__ bool enter_block(const sf_attn_problem &p, int b, int block, BlockSeq &s, int &row0)
{
    sf_attn_seq_q(&p, b, &s.qs, &s.sq);
    sf_attn_seq_k(&p, b, &s.ks, &s.sk);
    row0 = block * ROWS;
    if constexpr (kKeys)
        s.rows_total = p.thd ? s.sk : p.max_sk;
    else
        s.rows_total = p.thd ? s.sq : p.max_sq;
    return row0 < s.rows_total;
}

/* the mask, the scale and the head dim of a D-wide kernel */
template <int D> __device__ __forceinline__ void read_mask(const sf_attn_problem &p, BlockSeq &s)
{
    s.off = sf_attn_diag(&p, s.sq, s.sk);
    s.left = p.window_left, s.right = p.window_right;
    s.sl2 = p.scale * kLog2e;
    s.dr = real_dim<D>(p);
}

/* Query rows [m0, m0 + BM) and the key tiles of BN keys they may see,
 * nb_lo .. nb_hi - 1 (none when nb_lo >= nb_hi). */
struct QueryBlock : BlockSeq {
    int m0, nb_lo, nb_hi;
};

template <int BM>
__device__ __forceinline__ bool enter_query_block(const sf_attn_problem &p, int b, int m_block, QueryBlock &qb)
{
    return enter_block<false, BM>(p, b, m_block, qb, qb.m0);
}

template <int D, int BM, int BN>
__device__ __forceinline__ void find_key_tiles(const sf_attn_problem &p, QueryBlock &qb)
{
    read_mask<D>(p, qb);
    int n_lo = 0, n_hi = 0;
    if (qb.m0 < qb.sq) /* padding rows (BSHD past sq) see no key */
        sf_attn_key_range(qb.m0, min(qb.m0 + BM, qb.sq) - 1, qb.off, qb.left, qb.right, qb.sk, &n_lo, &n_hi);
    qb.nb_lo = n_lo / BN, qb.nb_hi = (n_hi + BN - 1) / BN;
}

/* Keys [n0, n0 + BN) and the query tiles of BM rows that may see them,
 * walked for every query head of the GQA group: `steps` (head, tile)
 * pairs, step it = head it / nmb of the group, tile mb_lo + it % nmb. */
struct KeyBlock : BlockSeq {
    int n0, mb_lo, nmb, steps;
};

template <int BN>
__device__ __forceinline__ bool enter_key_block(const sf_attn_problem &p, int b, int n_block, KeyBlock &kb)
{
    return enter_block<true, BN>(p, b, n_block, kb, kb.n0);
}

/* G: query heads per key/value head */
template <int D, int BN, int BM>
__device__ __forceinline__ void find_query_tiles(const sf_attn_problem &p, int G, KeyBlock &kb)
{
    read_mask<D>(p, kb);
    int m_lo = 0, m_hi = 0;
    if (kb.n0 < kb.sk) /* padding keys (BSHD past sk) are seen by no query */
        sf_attn_query_range(kb.n0, min(kb.n0 + BN, kb.sk) - 1, kb.off, kb.left, kb.right, kb.sq, &m_lo, &m_hi);
    kb.mb_lo = m_lo / BM, kb.nmb = (m_hi + BM - 1) / BM - m_lo / BM;
    kb.steps = kb.nmb > 0 ? G * kb.nmb : 0;
}

/* Where a key block of the wgmma dK/dV kernel (attn_backward_sm90_cuda.cu)
 * stands: KeyBlock's plan in one step (bounds, exit, diagonal offset, query
 * tiles), the window and the scale read by the kernel after it, in the
 * order of that kernel's verified machine code (as enter_key_block +
 * find_query_tiles its code changes).  The sm80 dkdv_kernel still loads
 * lse and delta inline rather than through load_lse_delta, for the same
 * reason. */
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

/* ---- masking: decided per tile, applied per element only where needed ----
 * Most tiles lie wholly inside the sequences and the window; only those that
 * cross a boundary pay for the per-element test.  The tests are macros, so
 * that the sm80 kernels keep them as expressions in their own bodies: as
 * function calls the compiler turns the short-circuit tests into select
 * chains and those kernels' machine code, verified on the GPU, changes
 * (checked with cuobjdump).  The wgmma backward calls the function form,
 * tile_crosses_mask, as it always has.  dq_kernel spells its test out: it
 * runs the two sequence-end tests the other way round. */

/* 1 when some key of [n0, n0 + bn) is past the sequence end or outside the
 * window of some row of [m0, m0 + bm).  The forward's test: its rows past the
 * sequence end are dropped by the epilogue anyway. */
#define SF_ATTN_KEYS_CROSS_MASK(m0, bm, n0, bn, sk, off, left, right)                                      \
    ((n0) + (bn) > (sk) || ((right) >= 0 && (n0) + (bn) - 1 > (m0) + (off) + (right)) ||                   \
     ((left) >= 0 && (n0) < (m0) + (bm) - 1 + (off) - (left)))

/* 1 when some (query, key) pair of rows [m0, m0 + bm) x keys [n0, n0 + bn)
 * is outside the sequences or the window (the tile needs per-element
 * masking).  The backward's test: rows past the sequence end must get P = 0,
 * or they would add to dK and dV. */
#define SF_ATTN_TILE_CROSSES_MASK(m0, bm, n0, bn, sq, sk, off, left, right)                                \
    ((m0) + (bm) > (sq) || SF_ATTN_KEYS_CROSS_MASK(m0, bm, n0, bn, sk, off, left, right))

/* 1 when query r may see key c: both inside their sequences, the pair inside the mask. */
#define SF_ATTN_PAIR_ALLOWED(r, c, sq, sk, off, left, right)                                                \
    ((r) < (sq) && (c) < (sk) && sf_attn_allowed(r, c, off, left, right))

__device__ __forceinline__ bool tile_crosses_mask(int m0, int bm, int n0, int bn, int sq, int sk, int off, int left,
                                                  int right)
{
    return SF_ATTN_TILE_CROSSES_MASK(m0, bm, n0, bn, sq, sk, off, left, right);
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

/* ---- attention dropout: keep decisions of a thread's fragment ----------------
 * The bits come from attn_philox.h; one Philox call serves a group of 8
 * elements (rows r0, r0 + 8 x keys k0, k0 + 8, k0 + 16, k0 + 24), and the
 * mma layouts below hold whole groups, so no call is wasted (but at head dim
 * 128 in keep_cols, where a warp owns 16 keys: half of each call).  The calls
 * run in a loop that is not unrolled, one Philox in flight, into a bit mask
 * (bit = fragment index), so the score registers the kernel holds meanwhile
 * do not spill; the caller applies the mask with compile-time bit indices. */

template <int BITS> using KeepMask = typename std::conditional<(BITS > 32), uint64_t, uint32_t>::type;

/* Row-major score fragment (forward, deterministic dQ): rows row0 + g and
 * row0 + g + 8, keys n0 + 8 i + 2 t4 + (e & 1) for i < NS; bit 4 i + e of the
 * result (e = 2 * row half + key parity, as in the C fragment) is 1 where the
 * element is kept.  row0 a multiple of 16, n0 of 32, NS of 4. */
template <int NS>
__device__ __forceinline__ KeepMask<4 * NS> keep_rows(const sf_attn_problem &p, int64_t bh, int row0, int n0,
                                                       int g, int t4)
{
    static_assert(NS % 4 == 0 && 4 * NS <= 64, "a thread's keys must cover whole 32-key groups");
    using M = KeepMask<4 * NS>;
    const uint32_t rg = (uint32_t)((row0 >> 4) * 8 + g);
    M mask = 0;
#pragma unroll 1
    for (int call = 0; call < NS / 2; ++call) {
        const int cb = call >> 1, par = call & 1;
        const sf_philox4 bits =
            sf_attn_drop_bits(p.seed_lo, p.seed_hi, p.offset, bh, rg, (uint32_t)(((n0 >> 5) + cb) * 8 + 2 * t4 + par));
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int hr = 0; hr < 2; ++hr)
                if (((bits.v[j] >> (16 * hr)) & 0xffffu) >= p.drop_threshold)
                    mask |= (M)1 << (4 * (cb * 4 + j) + 2 * hr + par);
    }
    return mask;
}

/* Transposed fragment (the dK/dV kernel's S^T): keys key0 + 16 kt + g and
 * + 8 for kt < KT, queries m0 + 8 i + 2 t4 + (e & 1) for i < NS; bit
 * 4 (kt NS + i) + e (e = 2 * key half + query parity) is 1 where kept.  m0 a
 * multiple of 16, key0 of 16 (of 32 when KT == 2). */
template <int KT, int NS>
__device__ __forceinline__ uint32_t keep_cols(const sf_attn_problem &p, int64_t bh, int key0, int m0, int g, int t4)
{
    static_assert((KT == 1 || KT == 2) && NS % 2 == 0 && 4 * KT * NS <= 32, "16 or 32 keys, whole query groups");
    const uint32_t cg = (uint32_t)((key0 >> 5) * 8 + g);
    const int wbase = KT == 1 && (key0 & 16) ? 2 : 0; /* 16 keys: words 2, 3 of each call */
    uint32_t mask = 0;
#pragma unroll 1
    for (int call = 0; call < NS; ++call) {
        const int iq = call >> 1, par = call & 1;
        const sf_philox4 bits =
            sf_attn_drop_bits(p.seed_lo, p.seed_hi, p.offset, bh, (uint32_t)(((m0 >> 4) + iq) * 8 + 2 * t4 + par), cg);
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
            for (int eh = 0; eh < 2; ++eh) {
                const uint32_t w = wbase ? bits.v[2 + eh] : bits.v[2 * kt + eh];
#pragma unroll
                for (int ih = 0; ih < 2; ++ih)
                    if (((w >> (16 * ih)) & 0xffffu) >= p.drop_threshold)
                        mask |= 1u << (4 * (kt * NS + 2 * iq + ih) + 2 * eh + par);
            }
    }
    return mask;
}

/* THD: zero the rows of `view` (heads x head_dim) past the last sequence,
 * tokens cu[batch] .. extent-1, and set lse there to +inf when lse != NULL.
 * Defined in attn_forward_cuda.cu. */
void launch_zero_tail(const sf_attn_problem &p, const sf_attn_view &view, int heads,
                      const int32_t *cu, int64_t extent, float *lse, cudaStream_t stream);
/* Opt a kernel into more than 48 KiB of dynamic shared memory (once per device). */
cudaError_t allow_smem(const void *kernel, int bytes);

/* The entries' frame: launch() on `device` (the caller's device restored
 * after), then, for THD, zero_tails() and the status of those launches. */
template <typename Launch, typename Tails>
inline sf_status run_on_device(const char *op, const sf_attn_problem &p, int device, Launch &&launch,
                               Tails &&zero_tails)
{
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    sf_status st = launch();
    if (st == SF_OK && p.thd) {
        zero_tails();
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            st = sf_fail(SF_ERR_RUNTIME, "%s: CUDA error %s: %s (zero tail)", op, cudaGetErrorName(e),
                         cudaGetErrorString(e));
    }
    sf_cuda_device_restore(&guard);
    return st;
}

} // namespace sf_attn

#endif /* SF_ATTN_CUDA_CUH */
