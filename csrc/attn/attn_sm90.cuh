/*
 * attn_sm90.cuh - Hopper (sm_90a) building blocks of the wgmma attention
 * forward (attn_forward_sm90_cuda.cu) and its standalone check: shared-memory
 * tiles in the 128-byte swizzled layout the tensor cores read, the 64-bit
 * matrix descriptors that point wgmma at them, the wgmma instructions for
 * the two products of attention, and the warpgroup / async-proxy fences.
 *
 * Tile layout (16-bit elements): a ROWS x COLS tile (COLS a multiple of 64)
 * is stored as COLS/64 column blocks of ROWS rows x 128 bytes; in each
 * 1024-byte group of 8 rows, 16-byte chunk c of row r sits at chunk
 * c ^ (r % 8).  The hardware applies that XOR on address bits [4,7) from
 * bits [7,10), so each tile must start 1024-byte aligned.
 *
 * Descriptors (PTX ISA "Matrix Descriptor Format"; CUTLASS GmmaDescriptor):
 * bits [0,14) start address >> 4, [16,30) leading byte offset >> 4,
 * [32,46) stride byte offset >> 4, [62,64) swizzle mode (1 = 128 bytes).
 *   K-major (S = Q K^T: Q rows and K rows, head dim contiguous): a k16 slice
 *   is 32 bytes inside one 128-byte row, so the start address advances by
 *   32 bytes per k step within a column block; SBO = 1024 (next 8 rows),
 *   LBO unused (1).
 *   MN-major (O += P V: V rows are the reduction dim, head dim contiguous):
 *   the k16 slice is 16 rows = two 8-row groups, SBO = 1024 between them;
 *   LBO = the distance between 64-column blocks (ROWS * 128 bytes), which
 *   an N of 128 crosses.
 *
 * Accumulator layout of wgmma m64nN (f32), thread t of the warpgroup, warp
 * w = t / 32, g = (t % 32) / 4, q = t % 4: register 4j + e holds row
 * 16w + g + 8 (e >> 1), column 8j + 2q + (e & 1) - the mma.sync m16n8
 * layout repeated over N / 8.  The register-A operand of m64k16 (four
 * 16-bit pairs) has the same layout with k for the column, so two
 * neighbouring 8-column accumulator groups packed to pairs are the A
 * fragment of one k16 step: P = softmax(S) feeds P V without leaving
 * registers.
 */
#ifndef SF_ATTN_SM90_CUH
#define SF_ATTN_SM90_CUH

#include "attn_cuda.cuh"
#include "attn_sm90.h"

/* wgmma and setmaxnreg exist only in the sm_90a target; other targets get
 * the kernels' bodies compiled out (the host never launches them there). */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SF_SM90A 1
#endif

namespace sf_attn {
namespace sm90 {

/* Byte offset of element (r, c) in a swizzled ROWS-row tile (see above). */
template <int ROWS> __device__ __forceinline__ uint32_t sw128_at(int r, int c)
{
    return (uint32_t)((c >> 6) * ROWS * 128 + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2);
}

__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo_bytes, uint32_t sbo_bytes)
{
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

/* A or B operand, K-major: rows [row0, row0 + 64 or N) of a ROWS-row tile,
 * k step kk (16 columns). */
template <int ROWS> __device__ __forceinline__ uint64_t desc_kmajor(uint32_t tile, int row0, int kk)
{
    return desc_sw128(tile + (kk >> 2) * ROWS * 128 + row0 * 128 + (kk & 3) * 32, 16, 1024);
}

/* A or B operand, MN-major: reduction rows [16 kk, 16 kk + 16) of a
 * ROWS-row tile, its columns from col0 on (N, or M = 64 for A).  col0 a
 * multiple of 8: inside a 64-column block the start moves by 2 col0 bytes
 * and the hardware's XOR on the absolute address keeps the swizzle (as the
 * K-major k steps do); the backward's two warpgroups take the two halves of
 * the head dim this way. */
template <int ROWS> __device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int kk, int col0 = 0)
{
    return desc_sw128(tile + (col0 >> 6) * ROWS * 128 + (col0 & 63) * 2 + kk * 16 * 128, ROWS * 128, 1024);
}

/* Accumulator registers of an m64nN tile as the register A operand:
 * k step kc is columns 16kc..16kc+15 = registers 8kc..8kc+7, packed to
 * 16-bit pairs (see the layout note above). */
template <typename T, int NR> __device__ __forceinline__ void pack_acc(uint32_t (&pa)[NR / 8][4], const float (&s)[NR])
{
#pragma unroll
    for (int kc = 0; kc < NR / 8; ++kc)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            pa[kc][e] = Mma<T>::pack(s[8 * kc + 2 * e], s[8 * kc + 2 * e + 1]);
}

/* Copy rows [0, ROWS) x COLS of a [token, COLS] slab (row stride ld
 * elements) into a swizzled tile with cp.async; rows >= valid are zero
 * (0 * NaN would reach the math).  base must be valid when valid == 0. */
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile_sw128(uint32_t tile, const T *base, int64_t ld, int valid, int tid)
{
    constexpr int kChunks = COLS / 8;
    for (int i = tid; i < ROWS * kChunks; i += NT) {
        const int r = i / kChunks, c = (i % kChunks) * 8;
        const bool ok = r < valid;
        cp_async_16(tile + sw128_at<ROWS>(r, c), ok ? base + (int64_t)r * ld + c : base, ok ? 16 : 0);
    }
}

#ifdef SF_SM90A
/* Orders this thread's earlier register writes before the next wgmma
 * reads its accumulators / A registers. */
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Shared memory written through the generic proxy (st.shared, cp.async)
 * becomes visible to wgmma (async proxy) only after this, in each writer,
 * before the barrier. */
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* The accumulator registers must be pinned across the asynchronous wgmma:
 * the compiler may not move them between issue and wait. */
template <int N> __device__ __forceinline__ void wg_pin(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i])::"memory");
}
#endif

template <typename T, int N> struct Wgmma;

#define SF_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SF_WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SF_WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SF_WG_ACC8(i)                                                                                            \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define SF_WG_ACC16 SF_WG_ACC8(0), SF_WG_ACC8(8)
#define SF_WG_ACC32 SF_WG_ACC8(0), SF_WG_ACC8(8), SF_WG_ACC8(16), SF_WG_ACC8(24)
#define SF_WG_ACC64 SF_WG_ACC32, SF_WG_ACC8(32), SF_WG_ACC8(40), SF_WG_ACC8(48), SF_WG_ACC8(56)

/* One specialization per (type, N).  ss: A and B K-major from shared memory;
 * rs: A from registers, B MN-major ("transpose B" = 1) from shared memory;
 * tt: A and B both MN-major from shared memory (the backward's dQ = dS K,
 * with dS^T stored [key][query]).  scale_d = 0 ignores the accumulator's
 * previous value.  Operand numbers after the NR accumulators: ss/tt a, b,
 * scale; rs a0..a3, b, scale. */
#ifdef SF_SM90A
#define SF_WG_DEF(NR, SS_OPS, TT_OPS, RS_OPS, ...) /* ...: the accumulator operands */                         \
    static __device__ __forceinline__ void ss(float (&d)[NR], uint64_t a, uint64_t b, int scale_d)               \
    {                                                                                                            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_OPS "}\n" : __VA_ARGS__ : "l"(a), "l"(b), "r"(scale_d));  \
    }                                                                                                            \
    static __device__ __forceinline__ void tt(float (&d)[NR], uint64_t a, uint64_t b, int scale_d)               \
    {                                                                                                            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" TT_OPS "}\n" : __VA_ARGS__ : "l"(a), "l"(b), "r"(scale_d));  \
    }                                                                                                            \
    static __device__ __forceinline__ void rs(float (&d)[NR], const uint32_t (&a)[4], uint64_t b, int scale_d)   \
    {                                                                                                            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_OPS "}\n"                                       \
                     : __VA_ARGS__                                                                               \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));                       \
    }
/* the instruction text after "setp.ne.b32 p, %": scale operand, then the
 * wgmma; TR = "0, 0" (both K-major) or "1, 1" (both MN-major) */
#define SF_WG_SS(PTXT, N, DREGS, A, B, S, TR)                                                                    \
    S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXT "." PTXT " " DREGS ", %" A ", %" B           \
      ", p, 1, 1, " TR ";\n"
#define SF_WG_RS(PTXT, N, DREGS, A0, B, S)                                                                       \
    S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXT "." PTXT " " DREGS ", {%" A0 "}, %" B        \
      ", p, 1, 1, 1;\n"
/* operand numbers of the NR-register forms: after d, a (or a0..a3), b, scale */
#define SF_WG_ALL(TYPE, PTXT, N, NR, DREGS, A, B, S, A0, RB, RSC, ...)                                           \
    template <> struct Wgmma<TYPE, N> {                                                                          \
        static constexpr int kRegs = NR;                                                                         \
        SF_WG_DEF(NR, SF_WG_SS(PTXT, N, DREGS, A, B, S, "0, 0"), SF_WG_SS(PTXT, N, DREGS, A, B, S, "1, 1"),      \
                  SF_WG_RS(PTXT, N, DREGS, A0, RB, RSC), __VA_ARGS__)                                            \
    };
#define SF_WG_N32(TYPE, PTXT) SF_WG_ALL(TYPE, PTXT, 32, 16, SF_WG_D16, "16", "17", "18", "16, %17, %18, %19", "20", "21", SF_WG_ACC16)
#define SF_WG_N64(TYPE, PTXT) SF_WG_ALL(TYPE, PTXT, 64, 32, SF_WG_D32, "32", "33", "34", "32, %33, %34, %35", "36", "37", SF_WG_ACC32)
#define SF_WG_N128(TYPE, PTXT) SF_WG_ALL(TYPE, PTXT, 128, 64, SF_WG_D64, "64", "65", "66", "64, %65, %66, %67", "68", "69", SF_WG_ACC64)
SF_WG_N32(__nv_bfloat16, "bf16")
SF_WG_N32(__half, "f16")
SF_WG_N64(__nv_bfloat16, "bf16")
SF_WG_N64(__half, "f16")
SF_WG_N128(__nv_bfloat16, "bf16")
SF_WG_N128(__half, "f16")
#undef SF_WG_N32
#undef SF_WG_N64
#undef SF_WG_N128
#undef SF_WG_ALL
#undef SF_WG_DEF
#undef SF_WG_SS
#undef SF_WG_RS

/* d = A B^T over K columns (the wgmma k steps only: the caller fences and
 * commits): A = rows [arow0, arow0 + 64) of an AROWS-row tile and B = rows
 * [0, N) of a BROWS-row tile, both K-major; the first step overwrites d. */
template <typename T, int N, int AROWS, int BROWS, int K>
__device__ __forceinline__ void mma_ss_kmajor(float (&d)[N / 2], uint32_t a, int arow0, uint32_t b)
{
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk)
        Wgmma<T, N>::ss(d, desc_kmajor<AROWS>(a, arow0, kk), desc_kmajor<BROWS>(b, 0, kk), kk > 0);
}

/* d = A B^T, A = rows [arow0, arow0 + 64) of an AROWS-row tile and B the N
 * rows of an N-row tile, both K-major over K columns: issued and committed,
 * not waited (the forward's S = Q K^T and its check); the first step
 * overwrites d. */
template <typename T, int N, int AROWS, int K>
__device__ __forceinline__ void issue_ss(float (&d)[N / 2], uint32_t a, int arow0, uint32_t b)
{
    wg_pin(d);
    wg_fence();
    mma_ss_kmajor<T, N, AROWS, N, K>(d, a, arow0, b);
    wg_commit();
}

/* d += A B, A from registers (K / 16 fragments in the accumulator layout
 * packed to T) and B a K-row MN-major tile of N columns: issued and
 * committed, not waited (the forward's O += P V and its check). */
template <typename T, int N, int K>
__device__ __forceinline__ void issue_rs(float (&d)[N / 2], const uint32_t (&a)[K / 16][4], uint32_t b)
{
    wg_pin(d);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < K / 16; ++kc)
        Wgmma<T, N>::rs(d, a[kc], desc_mnmajor<K>(b, kc), 1);
    wg_commit();
}

/* d = A B, A (64 columns) and B (N columns from col0) both MN-major
 * ROWS-row tiles, the ROWS rows being the reduction: issued and committed,
 * not waited (the backward's dQ = dS K and its check). */
template <typename T, int N, int ROWS>
__device__ __forceinline__ void issue_tt(float (&d)[N / 2], uint32_t a, uint32_t b, int col0)
{
    wg_pin(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; ++kk)
        Wgmma<T, N>::tt(d, desc_mnmajor<ROWS>(a, kk), desc_mnmajor<ROWS>(b, kk, col0), kk > 0);
    wg_commit();
}
#endif /* SF_SM90A */

/* 1 when a call with this head dim may take a wgmma kernel on `device`:
 * the kernel `choice` is 90, the device has compute capability 9.0, the
 * library was built for sm_90a and the head dim is 64 or 128.  *why (may be
 * NULL) gets the reason when 0: "" where the device is not Hopper (80 is
 * its kernel), `not_chosen` where choice is 80, else the head dim or build
 * (attn_forward_sm90_cuda.cu; the forward and the backward choose through it). */
int pick_kernel(int choice, const char *not_chosen, int head_dim, int device, const char **why);
/* ok, or 0 with *why (may be NULL) naming attention dropout when dropout is
 * set: the wgmma kernels have none, dropout calls take the sm80 kernels. */
int pick_kernel_no_dropout(int ok, int dropout, const char **why);
/* *choice = arch where arch is 80 or 90, else an SF_ERR_VALUE naming op (the setters of attn_sm90.h). */
sf_status set_kernel_choice(const char *op, int arch, int *choice);
} // namespace sm90

/* fn(T{}, TileWidth<D>{}) for the wgmma kernels' element type (q's dtype:
 * k and v share it) and head dim (64 or 128; the callers have checked, any
 * other is refused here too): the launchers' one dispatch. */
template <typename Fn> inline sf_status with_sm90_shape(const char *op, const sf_attn_problem &p, Fn &&fn)
{
    return sf_visit_half(op, "q", p.dtype, [&](auto tag) -> sf_status {
        using T = typename decltype(tag)::type;
        switch (p.head_dim) {
        case 64: return fn(T{}, TileWidth<64>{});
        case 128: return fn(T{}, TileWidth<128>{});
        default:
            return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: no wgmma kernel for head dim %d", op, p.head_dim);
        }
    });
}

/* Host side (attn_forward_sm90_cuda.cu). */
/* 1 when this problem's forward runs on the wgmma kernel on `device`
 * (sm90::pick_kernel with the choice of sf_attn_set_forward_kernel, default
 * 90), never with dropout.  *why as pick_kernel's. */
int forward_sm90_selected(const sf_attn_problem &p, int device, const char **why);
sf_status launch_forward_sm90(const sf_attn_problem &p, cudaStream_t stream);

/* Host side (attn_backward_sm90_cuda.cu). */
/* 1 when this problem's backward runs its dK/dV/dQ pass on the wgmma kernel:
 * pick_kernel with the choice of sf_attn_set_backward_kernel (default 90), not
 * deterministic (the wgmma kernel adds dQ with atomics) and without dropout. */
int backward_sm90_selected(const sf_attn_problem &p, int device, const char **why);
/* The dK, dV and atomic dQ pass (into the zeroed p.dq_accum) of the wgmma
 * backward; delta before and the dQ conversion after are attn_backward_cuda.cu's. */
sf_status launch_backward_sm90(const sf_attn_problem &p, cudaStream_t stream);

} // namespace sf_attn

#endif /* SF_ATTN_SM90_CUH */
