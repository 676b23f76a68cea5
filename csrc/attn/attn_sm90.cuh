/*
 * attn_sm90.cuh - Hopper (sm_90a) building blocks of the wgmma attention
 * forward (attn_fwd_sm90_cuda.cu) and its standalone check: shared-memory
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

/* B operand, MN-major: reduction rows [16 kk, 16 kk + 16) of a ROWS-row
 * tile, all its columns (N). */
template <int ROWS> __device__ __forceinline__ uint64_t desc_mnmajor(uint32_t tile, int kk)
{
    return desc_sw128(tile + kk * 16 * 128, ROWS * 128, 1024);
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

#define SF_WG_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SF_WG_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SF_WG_ACC8(i)                                                                                            \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define SF_WG_ACC32 SF_WG_ACC8(0), SF_WG_ACC8(8), SF_WG_ACC8(16), SF_WG_ACC8(24)
#define SF_WG_ACC64 SF_WG_ACC32, SF_WG_ACC8(32), SF_WG_ACC8(40), SF_WG_ACC8(48), SF_WG_ACC8(56)

/* One specialization per (type, N).  ss: A and B K-major from shared memory;
 * rs: A from registers, B MN-major ("transpose B" = 1) from shared memory.
 * scale_d = 0 ignores the accumulator's previous value.  Operand numbers
 * after the NR accumulators: ss a, b, scale; rs a0..a3, b, scale. */
#ifdef SF_SM90A
#define SF_WG_DEF(TYPE, PTXT, N, NR, DREGS, ACC, SS_OPS, RS_OPS)                                                \
    template <> struct Wgmma<TYPE, N> {                                                                          \
        static constexpr int kRegs = NR;                                                                         \
        static __device__ __forceinline__ void ss(float (&d)[NR], uint64_t a, uint64_t b, int scale_d)           \
        {                                                                                                        \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SS_OPS "}\n"                                     \
                         : ACC                                                                                   \
                         : "l"(a), "l"(b), "r"(scale_d));                                                        \
        }                                                                                                        \
        static __device__ __forceinline__ void rs(float (&d)[NR], const uint32_t (&a)[4], uint64_t b, int scale_d) \
        {                                                                                                        \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RS_OPS "}\n"                                     \
                         : ACC                                                                                   \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));                   \
        }                                                                                                        \
    };
/* the instruction text after "setp.ne.b32 p, %": scale operand, then the wgmma */
#define SF_WG_SS(PTXT, N, DREGS, A, B, S)                                                                        \
    S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXT "." PTXT " " DREGS ", %" A ", %" B           \
      ", p, 1, 1, 0, 0;\n"
#define SF_WG_RS(PTXT, N, DREGS, A0, B, S)                                                                       \
    S ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXT "." PTXT " " DREGS ", {%" A0 "}, %" B        \
      ", p, 1, 1, 1;\n"
SF_WG_DEF(__nv_bfloat16, "bf16", 64, 32, SF_WG_D32, SF_WG_ACC32, SF_WG_SS("bf16", 64, SF_WG_D32, "32", "33", "34"),
          SF_WG_RS("bf16", 64, SF_WG_D32, "32, %33, %34, %35", "36", "37"))
SF_WG_DEF(__half, "f16", 64, 32, SF_WG_D32, SF_WG_ACC32, SF_WG_SS("f16", 64, SF_WG_D32, "32", "33", "34"),
          SF_WG_RS("f16", 64, SF_WG_D32, "32, %33, %34, %35", "36", "37"))
SF_WG_DEF(__nv_bfloat16, "bf16", 128, 64, SF_WG_D64, SF_WG_ACC64, SF_WG_SS("bf16", 128, SF_WG_D64, "64", "65", "66"),
          SF_WG_RS("bf16", 128, SF_WG_D64, "64, %65, %66, %67", "68", "69"))
SF_WG_DEF(__half, "f16", 128, 64, SF_WG_D64, SF_WG_ACC64, SF_WG_SS("f16", 128, SF_WG_D64, "64", "65", "66"),
          SF_WG_RS("f16", 128, SF_WG_D64, "64, %65, %66, %67", "68", "69"))
#undef SF_WG_DEF
#undef SF_WG_SS
#undef SF_WG_RS
#endif /* SF_SM90A */

} // namespace sm90

/* Host side (attn_fwd_sm90_cuda.cu). */
/* 1 when this problem's forward runs on the wgmma kernel on `device`:
 * head dim 64 or 128, a compute capability 9.0 device, the kernel built for
 * sm_90a, and the sm90 kernel selected (SEQFUSE_ATTN_FWD_KERNEL=sm90|sm80 or
 * sf_attn_set_fwd_kernel; the default is sm80 until the kernel is confirmed
 * on a GPU).  *why (may be NULL) gets a short reason when it is 0 (see
 * sf_attn_fwd_kernel_for in attn_sm90.h). */
int fwd_sm90_selected(const sf_attn_problem &p, int device, const char **why);
sf_status launch_fwd_sm90(const sf_attn_problem &p, cudaStream_t stream);

} // namespace sf_attn

#endif /* SF_ATTN_SM90_CUH */
