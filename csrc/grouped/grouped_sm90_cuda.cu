/*
 * grouped_sm90_cuda.cu - one persistent Hopper kernel for all groups of a
 * grouped GEMM (the experts' forward product, grouped_sm90.h).
 *
 * Why: issued one cuBLASLt call per expert, each expert's GEMM rounds up to
 * whole waves of its own.  Mixtral-small's down projection at 8 experts has
 * about 4,096 rows an expert, 32 x 4 = 128 tiles of 128 x 256 outputs: one
 * wave on a 132-SM H100 when the rows split evenly, two waves (the second
 * nearly empty) for an expert that draws 4,224 rows or more, which in
 * training's uneven splits some expert nearly always does.  Here the tiles of
 * all groups form one list that the CTAs walk in steps of the grid, so only
 * the last wave of the whole call is partial; and the call is one launch of
 * host work, not G cuBLASLt calls (64 experts: 64 x 9 us of host time).
 *
 * Shape of the kernel (the FlashAttention-3 / CUTLASS "warp-specialized
 * persistent" form):
 *  - 384 threads: warpgroup 0 is the producer, one thread of it issuing TMA
 *    copies of the A tile (128 rows x 64 bf16 / 128 e4m3 = 128 bytes a row)
 *    and the B tile (256 rows x the same) of each k-block into a ring of
 *    STAGES shared-memory stages; warpgroups 1 and 2 are the consumers, each
 *    computing 64 of the tile's 128 rows x 256 columns with wgmma
 *    m64n256 (128 float accumulators a thread).
 *  - Each stage has a "full" mbarrier (the producer arms it with the stage's
 *    byte count; TMA completes it) and an "empty" one (each consumer
 *    warpgroup arrives once its wgmma reading the stage has completed).  The
 *    producer runs up to STAGES k-blocks ahead, across tile boundaries, so
 *    the next tile's loads overlap this tile's epilogue.
 *  - TMA writes the tiles in the 128-byte swizzled layout wgmma reads
 *    (attn_sm90.cuh describes it); rows past the end of A or B and columns
 *    past k are filled with zeros by TMA, so ragged edges cost no code in the
 *    main loop.  A tile's rows past its group's end belong to the next group
 *    (or are zeros): they are computed and not stored.
 *  - Epilogue: accumulators (times the group's scale for FP8) to bf16.  A
 *    consumer warpgroup whose 64 rows all lie in its tile's group (or run
 *    past the end of the output, which TMA clips) writes them into its own
 *    shared-memory buffer in the 128-byte swizzled layout and has TMA store
 *    them (columns past n clipped by TMA), then goes straight on to its next
 *    tile's k-blocks while the store drains: the tensor cores wait for a
 *    shared-memory write of the tile, not for its global stores.  A
 *    warpgroup whose rows cross into the next group stores straight from
 *    registers, rows and columns masked (TMA would write the other group's
 *    rows).  The buffer holds EPI boxes of 64 rows x 64 columns (8 KiB) a
 *    warpgroup; with fewer boxes than the tile's columns need, the stores go
 *    out in rounds, each waiting for the previous round's reads.  EPI = 0
 *    stores every tile from registers (the check times it beside the rest).
 *
 * TMA descriptors: one for A, one for out, one per group for B (the experts'
 * weights need not be one buffer), encoded on the host at each call
 * (cuTensorMapEncodeTiled, through the runtime's driver entry point, so the
 * library does not link libcuda) and passed in the kernel's parameters.
 *
 * Element kinds (the kernel's KIND): bf16 x bf16 (wgmma k16), e4m3 x e4m3
 * (the forward, k32) and e5m2 x e4m3 (the input gradient under the HYBRID
 * format: the output gradient in e5m2 times the experts' transposed e4m3
 * weights; wgmma's mixed .e5m2.e4m3 form, k32).  A k-block is 128 bytes of
 * k in every kind (64 bf16 or 128 FP8 elements, 4 wgmma steps), so the
 * loads, the swizzle and the descriptors are one code; only the wgmma
 * instruction differs.
 *
 * FP8 accumulation.  Hopper's FP8 wgmma adds into its accumulator with
 * fewer bits than float32 (about 13 of mantissa); accumulating all of k
 * there is what cuBLASLt calls fast_accum=1, and the forward's products
 * take it.  Gradients take fast_accum=0 (Transformer Engine's split
 * accumulator), which the kernel does as CUTLASS's FP8 mainloop does: each
 * k-block's 4 wgmma steps accumulate into a temporary (its first step with
 * scale-d 0, so it starts from zero), and once that k-block's wgmma group
 * has completed the temporary is added into the float32 accumulator with
 * ordinary float32 adds ("promoted").  The reduced-precision sum then spans
 * 128 products instead of all of k.  Two 128-float accumulators a thread
 * do not fit beside the rest (255 registers at most, 232 given to a
 * consumer), so the promoted shapes use 128 x 128 tiles (wgmma m64n128: 64
 * floats for the accumulator, 64 for each temporary) and the epilogue's one
 * round of two 64-column boxes.  PROMOTE 2 (the library's) keeps two
 * temporaries and one wgmma group in flight: k-block kb is issued into one
 * temporary, then the group of k-block kb - 1 is waited for (wait_group 1),
 * its stage released and its temporary promoted while kb's wgmma runs.
 * PROMOTE 1 keeps one temporary and waits for each k-block's group
 * (wait_group 0) before promoting it, CUTLASS's form; the other consumer
 * warpgroup's wgmma keeps the tensor cores busy meanwhile.
 */
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <mutex>

#include "../core/cuda_util.h"
#include "grouped_sm90.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SF_GROUPED_SM90A 1
#endif

namespace {

constexpr int kBM = 128, kRowBytes = 128; /* a k-block is 128 bytes of each row */
constexpr int kThreads = 384;
constexpr int kABytes = kBM * kRowBytes; /* 16 KiB */
constexpr int kMaxGroups = SF_GROUPED_SM90_MAX_GROUPS;

constexpr int kBoxBytes = 64 * 128; /* an epilogue box: 64 rows x 64 bf16 columns */

/* The element kinds (a x b -> bf16 out). */
enum Kind { kBf16 = 0, kE4m3 = 1 /* e4m3 x e4m3 */, kE5m2 = 2 /* e5m2 x e4m3 */ };

/* A tile shape: BN output columns (256: each consumer m64n256, 128
 * accumulators a thread; 128: m64n128), STAGES k-blocks in flight, the
 * order of a group's tiles (MFAST: down the rows first, so the CTAs at work
 * share B's column tile; else along the columns first, sharing A's rows),
 * EPI epilogue boxes a consumer warpgroup (0: stores from registers), and
 * PROMOTE, how FP8 products accumulate (0: in the wgmma accumulator for all
 * of k, fast_accum=1; 1 and 2: each k-block's in a temporary promoted into
 * float32, fast_accum=0, with one temporary and wait_group 0 or two and one
 * group in flight; FP8 kinds and BN = 128 only). */
template <int BN_, int STAGES_, bool MFAST_, int EPI_, int PROMOTE_ = 0> struct Cfg {
    static constexpr int BN = BN_, STAGES = STAGES_, ACC = BN_ / 2, EPI = EPI_, PROMOTE = PROMOTE_;
    static constexpr bool MFAST = MFAST_;
    static constexpr int B_BYTES = BN * kRowBytes, STAGE_BYTES = kABytes + B_BYTES;
    static constexpr int EPI_BYTES = 2 * EPI * kBoxBytes; /* both consumer warpgroups' buffers */
    static constexpr int SMEM = STAGES * STAGE_BYTES + EPI_BYTES + 1024 /* alignment */ + 1024 /* barriers, tables */;
    static_assert(EPI == 0 || (BN / 64) % (EPI > 0 ? EPI : 1) == 0, "the epilogue's rounds must cover the tile's columns");
    static_assert(SMEM <= 227 * 1024, "more shared memory than a Hopper CTA has");
    static_assert(PROMOTE == 0 || BN == 128,
                  "a promoted shape's temporaries fit the registers beside m64n128's accumulator only");
};
/* The library's shape; the check times three others beside it.  Measured
 * on an H100 (s46, bin/check_grouped_sm90 at ff083f8 and f18693a,
 * Mixtral-small's experts, 32,768 routed rows): the TMA-stored epilogue ran
 * 8 experts' up projection at 789-800 TFLOP/s bf16 against 498-503 storing
 * from registers, the down projection 854-880 against 702-724; 3 stages
 * with one round of 4 boxes ran 772-787 / 688-703 (a stage fewer costs more
 * than a second store round); along the columns first the down projection
 * ran within 2 % either way (867-881 bf16) and the up projection 15 % lower
 * (673-676).  s45: rows first beat columns first in 15 of 16 rows with the
 * register epilogue, and 128 x 128 tiles with 6 stages lost everywhere. */
using Library = Cfg<256, 4, true, 2>;
/* The library's shape for FP8 calls with fast_accum=0: 128 x 128 tiles,
 * two temporaries with one wgmma group in flight, 6 stages of 32 KiB (the
 * most that fit beside the epilogue's 32 KiB), rows first, the TMA-stored
 * epilogue in one round of 2 boxes.  Not measured when chosen: the check
 * times it beside PROMOTE 1 and 4 stages (sf_grouped_sm90_run_variant 4
 * and 5) and the cuBLASLt route at Mixtral-small's input-gradient shapes.
 * ptxas (CUDA 13.0): no spills, registers up to R225 of the consumers' 232
 * (accumulator and two temporaries: 192 floats), and no serialized wgmma
 * (C7515 / C7518) once the two-temporary loop keeps the same group in
 * flight wherever its paths meet (the loop below). */
using Promoted = Cfg<128, 6, true, 2, 2>;

struct Params {
    CUtensorMap a_map;
    CUtensorMap out_map; /* boxes of 64 rows x 64 columns (the epilogue's TMA stores) */
    CUtensorMap b_map[kMaxGroups];
    __nv_bfloat16 *out;
    int64_t ldo;
    int n, kblocks, groups, n_tiles, total_tiles, fp8, rows;
    int row_start[kMaxGroups + 1];
    int tile_start[kMaxGroups + 1];
    const int32_t *device_row_end; /* non-NULL: the tables above are made in the kernel from these */
    const float *a_scale_inv[kMaxGroups];
    const float *b_scale_inv[kMaxGroups];
};

#ifdef SF_GROUPED_SM90A
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity)
{
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
/* 2-D TMA copy of box (c0 = column, c1 = row) into shared memory, completing
 * `bytes` on bar. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1, uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

/* 2-D TMA store of the 64 x 64 box at dst (128-byte swizzled) to columns
 * c0.., rows c1.. of the map's tensor (parts past its edges are dropped);
 * committed by bulk_commit as one of this thread's bulk groups. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, int c0, int c1, uint32_t src)
{
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
                 ::"l"((uint64_t)map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* this thread's committed stores have read their shared memory */
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* ... and written global memory */
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
/* this thread's shared-memory writes visible to TMA (the async proxy) */
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/* the 128 threads of one consumer warpgroup (barrier id = its warpgroup, 1 or 2) */
__device__ __forceinline__ void wg_sync(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(wg) : "memory"); }

/* K-major operand in the 128-byte swizzled layout: row0's 128-byte row,
 * k step kk (32 bytes: 16 bf16 or 32 e4m3); 8-row groups 1024 bytes apart. */
__device__ __forceinline__ uint64_t desc_k(uint32_t tile, int row0, int kk)
{
    const uint32_t addr = tile + row0 * kRowBytes + kk * 32;
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

#define SF_D128                                                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
    "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, " \
    "%67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, " \
    "%89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, "  \
    "%109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "   \
    "%127}"
#define SF_D64                                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, " \
    "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SF_A8(i)                                                                                                    \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),    \
        "+f"(d[i + 7])
#define SF_A32(i) SF_A8(i), SF_A8(i + 8), SF_A8(i + 16), SF_A8(i + 24)
#define SF_A128 SF_A32(0), SF_A32(32), SF_A32(64), SF_A32(96)

/* d (+)= A B^T for one k step: m64 nN, A and B K-major in shared memory,
 * of element kind KIND (bf16 k16, FP8 k32: 32 bytes of k either way). */
#define SF_WG_FP8(SHAPE, TYPES, D, AB, SCALE)                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                              \
    "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPES " " D ", " AB ", p, 1, 1;\n}\n"
#define SF_WG_BF16(SHAPE, D, AB, SCALE)                                                                           \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                              \
    "wgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 " D ", " AB ", p, 1, 1, 0, 0;\n}\n"
template <int KIND, int N> struct Wg;
template <int KIND> struct Wg<KIND, 256> {
static __device__ __forceinline__ void mma(float (&d)[128], uint64_t a, uint64_t b, int scale_d)
{
    if constexpr (KIND == kE4m3)
        asm volatile(SF_WG_FP8("m64n256k32", "e4m3.e4m3", SF_D128, "%128, %129", "%130")
                     : SF_A128
                     : "l"(a), "l"(b), "r"(scale_d));
    else if constexpr (KIND == kE5m2)
        asm volatile(SF_WG_FP8("m64n256k32", "e5m2.e4m3", SF_D128, "%128, %129", "%130")
                     : SF_A128
                     : "l"(a), "l"(b), "r"(scale_d));
    else
        asm volatile(SF_WG_BF16("m64n256k16", SF_D128, "%128, %129", "%130")
                     : SF_A128
                     : "l"(a), "l"(b), "r"(scale_d));
}
};
template <int KIND> struct Wg<KIND, 128> {
static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b, int scale_d)
{
    if constexpr (KIND == kE4m3)
        asm volatile(SF_WG_FP8("m64n128k32", "e4m3.e4m3", SF_D64, "%64, %65", "%66")
                     : SF_A32(0), SF_A32(32)
                     : "l"(a), "l"(b), "r"(scale_d));
    else if constexpr (KIND == kE5m2)
        asm volatile(SF_WG_FP8("m64n128k32", "e5m2.e4m3", SF_D64, "%64, %65", "%66")
                     : SF_A32(0), SF_A32(32)
                     : "l"(a), "l"(b), "r"(scale_d));
    else
        asm volatile(SF_WG_BF16("m64n128k16", SF_D64, "%64, %65", "%66")
                     : SF_A32(0), SF_A32(32)
                     : "l"(a), "l"(b), "r"(scale_d));
}
};
#undef SF_WG_FP8
#undef SF_WG_BF16
#undef SF_D64
#undef SF_D128
#undef SF_A8
#undef SF_A32
#undef SF_A128

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void pin(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* Tile t of the call: its group, first row, first column. */
struct Tile {
    int g, m0, row_end, n0;
};
template <class C>
__device__ __forceinline__ Tile tile_of(int t, const int *tile_start, const int *row_start, int groups, int n_tiles)
{
    int g = 0;
    while (g + 1 < groups && tile_start[g + 1] <= t)
        ++g;
    const int local = t - tile_start[g];
    Tile r;
    r.g = g;
    r.row_end = row_start[g + 1];
    if (C::MFAST) {
        const int m_tiles = (r.row_end - row_start[g] + kBM - 1) / kBM;
        r.m0 = row_start[g] + (local % m_tiles) * kBM;
        r.n0 = (local / m_tiles) * C::BN;
    } else {
        r.m0 = row_start[g] + (local / n_tiles) * kBM;
        r.n0 = (local % n_tiles) * C::BN;
    }
    return r;
}
#endif

template <int KIND, class C>
__global__ void __launch_bounds__(kThreads, 1) grouped_sm90_kernel(const __grid_constant__ Params p)
{
    static_assert(C::PROMOTE == 0 || KIND != kBf16, "bf16 products accumulate in float32: nothing to promote");
#ifdef SF_GROUPED_SM90A
    constexpr bool FP8 = KIND != kBf16;
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint8_t *epi_buf = smem + C::STAGES * C::STAGE_BYTES; /* 1024-aligned: stages are multiples of 1 KiB */
    uint64_t *full = (uint64_t *)(epi_buf + C::EPI_BYTES);
    uint64_t *empty = full + C::STAGES;
    int *tile_start = (int *)(empty + C::STAGES);
    int *row_start = tile_start + kMaxGroups + 1;
    int *total = row_start + kMaxGroups + 1; /* the call's tiles */
    const int tid = threadIdx.x, wg = tid / 128;

    if (p.device_row_end) {
        /* the groups' ends as the device holds them (no host wait): loaded side by side, then clamped
         * to [the previous end, the rows of a and out] and summed up by one thread */
        for (int i = tid; i < p.groups; i += kThreads)
            row_start[i + 1] = __ldg(p.device_row_end + i);
        __syncthreads();
        if (tid == 0) {
            int prev = 0, t = 0;
            row_start[0] = tile_start[0] = 0;
            for (int g = 0; g < p.groups; ++g) {
                const int end = min(max(row_start[g + 1], prev), p.rows);
                t += ((end - prev) / kBM + ((end - prev) % kBM != 0)) * p.n_tiles; /* (no overflow near 2^31) */
                row_start[g + 1] = end;
                tile_start[g + 1] = t;
                prev = end;
            }
            *total = t;
        }
    } else {
        for (int i = tid; i <= p.groups; i += kThreads) {
            tile_start[i] = p.tile_start[i];
            row_start[i] = p.row_start[i];
        }
        if (tid == 0)
            *total = p.total_tiles;
    }
    if (tid == 0) {
        for (int s = 0; s < C::STAGES; ++s) {
            mbar_init(smem_u32(&full[s]), 1);
            mbar_init(smem_u32(&empty[s]), 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int total_tiles = *total;

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            int stage = 0, phase = 0;
            for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
                const Tile tl = tile_of<C>(t, tile_start, row_start, p.groups, p.n_tiles);
                const CUtensorMap *bmap = &p.b_map[tl.g];
                for (int kb = 0; kb < p.kblocks; ++kb) {
                    mbar_wait(smem_u32(&empty[stage]), phase ^ 1);
                    const uint32_t bar = smem_u32(&full[stage]);
                    const uint32_t a_dst = smem_u32(smem + stage * C::STAGE_BYTES), b_dst = a_dst + kABytes;
                    mbar_expect_tx(bar, C::STAGE_BYTES);
                    const int col = kb * (FP8 ? 128 : 64); /* in elements */
                    tma_load_2d(a_dst, &p.a_map, col, tl.m0, bar);
                    tma_load_2d(b_dst, bmap, col, tl.n0, bar);
                    if (++stage == C::STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
        const int ct = tid - 128 * wg; /* thread in the consumer warpgroup */
        const int row0 = (wg - 1) * 64;
        int stage = 0, phase = 0;
        int released = 0; /* (promoted shapes: the stage the next promoted k-block frees) */
        float d[C::ACC];
        /* k-block kb's 4 wgmma steps into acc (from zero when fresh) as one committed group, the
         * stage advanced */
        auto issue = [&](float(&acc)[C::ACC], bool fresh) {
            mbar_wait(smem_u32(&full[stage]), phase);
            const uint32_t a_t = smem_u32(smem + stage * C::STAGE_BYTES), b_t = a_t + kABytes;
            pin(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Wg<KIND, C::BN>::mma(acc, desc_k(a_t, row0, kk), desc_k(b_t, 0, kk), !fresh || kk > 0);
            wg_commit();
            if (++stage == C::STAGES) {
                stage = 0;
                phase ^= 1;
            }
        };
        /* the oldest issued k-block's group has completed (the caller waited): its stage released,
         * its temporary added into d in float32 */
        auto promote = [&](float(&tmp)[C::ACC]) {
            pin(tmp);
            if (ct == 0)
                mbar_arrive(smem_u32(&empty[released]));
            released = released + 1 == C::STAGES ? 0 : released + 1;
#pragma unroll
            for (int i = 0; i < C::ACC; ++i)
                d[i] += tmp[i];
        };
        for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
            const Tile tl = tile_of<C>(t, tile_start, row_start, p.groups, p.n_tiles);
            if constexpr (C::PROMOTE == 0) {
                for (int kb = 0; kb < p.kblocks; ++kb) {
                    issue(d, kb == 0);
                    /* the previous k-block's wgmma has finished: release its stage (stage is the next
                     * k-block's now, so the previous one's is two back) */
                    wg_wait<1>();
                    pin(d);
                    if (kb > 0 && ct == 0)
                        mbar_arrive(smem_u32(&empty[(stage + 2 * C::STAGES - 2) % C::STAGES]));
                }
                wg_wait<0>();
                pin(d);
                if (ct == 0)
                    mbar_arrive(smem_u32(&empty[stage == 0 ? C::STAGES - 1 : stage - 1]));
            } else if constexpr (C::PROMOTE == 1) {
                /* one temporary: each k-block's group waited for before it is promoted */
                float tmp[C::ACC];
#pragma unroll
                for (int i = 0; i < C::ACC; ++i)
                    d[i] = 0.f;
                for (int kb = 0; kb < p.kblocks; ++kb) {
                    issue(tmp, true);
                    wg_wait<0>();
                    promote(tmp);
                }
            } else {
                /* two temporaries: k-block kb issued into one while kb - 1's (in the other) is waited
                 * for and promoted; wait_group 1 leaves kb's group running */
                float t0[C::ACC], t1[C::ACC];
#pragma unroll
                for (int i = 0; i < C::ACC; ++i)
                    d[i] = 0.f;
                const int kblocks = p.kblocks;
                /* (every path keeps the same groups in flight where paths meet: t0's at the loop's
                 * edges, none after the tail, so ptxas can follow the groups and does not wait for
                 * every wgmma before each read of a temporary) */
                issue(t0, true); /* k-block 0 */
                int kb = 1;
                for (; kb + 1 < kblocks; kb += 2) {
                    issue(t1, true); /* kb */
                    wg_wait<1>();
                    promote(t0); /* kb - 1 */
                    issue(t0, true); /* kb + 1 */
                    wg_wait<1>();
                    promote(t1); /* kb */
                }
                if (kb < kblocks) { /* the last k-block, kblocks - 1, in t1 */
                    issue(t1, true);
                    wg_wait<1>();
                    promote(t0);
                    wg_wait<0>();
                    promote(t1);
                } else {
                    wg_wait<0>();
                    promote(t0);
                }
            }

            /* epilogue: register 4j + e is row 16 w + r8 + 8 (e >> 1), column 8 j + 2 q + (e & 1) */
            float scale = 1.f;
            if (FP8)
                scale = __ldg(p.a_scale_inv[tl.g]) * __ldg(p.b_scale_inv[tl.g]);
            const int w = ct / 32, r8 = (ct % 32) / 4, q = ct % 4;
            const int wg_row = tl.m0 + row0; /* this warpgroup's first row */
            if (wg_row >= tl.row_end)
                continue; /* (its rows are all the next group's) */
            if (C::EPI > 0 && (wg_row + 64 <= tl.row_end || tl.row_end == p.rows)) {
                uint8_t *buf = epi_buf + (wg - 1) * C::EPI * kBoxBytes;
                constexpr int kRounds = C::EPI > 0 ? C::BN / 64 / C::EPI : 1;
#pragma unroll
                for (int r = 0; r < kRounds; ++r) {
                    if (ct == 0)
                        bulk_wait_read(); /* the buffer's previous stores have read it */
                    wg_sync(wg);
#pragma unroll
                    for (int bb = 0; bb < C::EPI; ++bb) {
                        uint8_t *box = buf + bb * kBoxBytes;
#pragma unroll
                        for (int jj = 0; jj < 8; ++jj) {
                            const int j = (r * C::EPI + bb) * 8 + jj;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int row = 16 * w + r8 + 8 * h; /* row % 8 == r8: the swizzle's key */
                                *(__nv_bfloat162 *)(box + row * 128 + ((jj ^ r8) << 4) + 4 * q) =
                                    __floats2bfloat162_rn(d[4 * j + 2 * h] * scale, d[4 * j + 2 * h + 1] * scale);
                            }
                        }
                    }
                    fence_async_smem();
                    wg_sync(wg);
                    if (ct == 0) {
#pragma unroll
                        for (int bb = 0; bb < C::EPI; ++bb) {
                            const int col = tl.n0 + (r * C::EPI + bb) * 64;
                            if (col < p.n)
                                tma_store_2d(&p.out_map, col, wg_row, smem_u32(buf + bb * kBoxBytes));
                        }
                        bulk_commit();
                    }
                }
                continue;
            }
            const int rbase = wg_row + 16 * w + r8;
            const int cbase = tl.n0 + 2 * q;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = rbase + 8 * h;
                if (row < tl.row_end) {
                    __nv_bfloat16 *orow = p.out + (int64_t)row * p.ldo;
#pragma unroll
                    for (int j = 0; j < C::BN / 8; ++j) {
                        const int col = cbase + 8 * j;
                        if (col < p.n)
                            *(__nv_bfloat162 *)(orow + col) =
                                __floats2bfloat162_rn(d[4 * j + 2 * h] * scale, d[4 * j + 2 * h + 1] * scale);
                    }
                }
            }
        }
        if (C::EPI > 0 && ct == 0)
            bulk_wait(); /* the stores are done before the CTA's shared memory goes */
    }
#else
    (void)C::ACC; /* (the shape's members the sm_90a body reads: referenced, so other targets do not warn) */
    (void)C::MFAST;
    SF_SM90_NOT_BUILT();
#endif
}

/* cuTensorMapEncodeTiled through the runtime's driver entry point. */
typedef CUresult (*EncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_fn(const char **why)
{
    static std::once_flag once;
    static EncodeTiled fn = nullptr;
    static const char *failure = nullptr;
    std::call_once(once, [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) !=
                cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !p)
            failure = "the CUDA driver does not provide cuTensorMapEncodeTiled";
        else
            fn = (EncodeTiled)p;
    });
    *why = failure;
    return fn;
}

/* A [rows, cols] row-major matrix (row stride ld elements of esize bytes) as
 * boxes of box_rows x 128 bytes, 128-byte swizzled, zeros past the edges. */
const char *encode(CUtensorMap *map, EncodeTiled fn, bool fp8, const void *ptr, int64_t rows, int64_t cols,
                   int64_t ld, int box_rows)
{
    const int esize = fp8 ? 1 : 2;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)(rows > 0 ? rows : 1)};
    cuuint64_t strides[1] = {(cuuint64_t)(ld * esize)};
    cuuint32_t box[2] = {(cuuint32_t)(kRowBytes / esize), (cuuint32_t)box_rows};
    cuuint32_t estr[2] = {1, 1};
    CUresult r = fn(map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)ptr, dims,
                    strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? nullptr : "cuTensorMapEncodeTiled refused an operand";
}

/* NULL when `device` runs the kernel (compute capability 9.0 and this
 * library's kernel built for sm_90a: SF_SM90_NOT_BUILT's marker absent),
 * else why not; asked once per device, on that device. */
const char *device_unfit(int device)
{
    static std::once_flag once[64];
    static const char *why[64];
    if (device < 0 || device >= 64)
        return "the kernel takes device ids 0 to 63";
    std::call_once(once[device], [device] {
        switch (sf_sm90_kernel_fit(device, (const void *)grouped_sm90_kernel<kBf16, Library>)) {
        case SF_SM90_RUNS: break;
        case SF_SM90_NO_DEVICE: why[device] = "the device could not be made current"; break;
        case SF_SM90_CC_UNREADABLE: why[device] = "the device's compute capability could not be read"; break;
        case SF_SM90_NOT_HOPPER: why[device] = "the kernel runs on compute capability 9.0 (Hopper) only"; break;
        case SF_SM90_NOT_BUILT_FOR:
            why[device] = "the library was not built for sm_90a (SEQFUSE_CUDA_ARCHS lacks 90a)";
            break;
        }
    });
    return why[device];
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* The call's element kind, or -1 for a pair of dtypes the kernel does not take. */
int kind_of(const sf_grouped_sm90_args *a)
{
    if (a->a_dtype == SF_BFLOAT16 && a->b_dtype == SF_BFLOAT16)
        return kBf16;
    if (a->a_dtype == SF_FLOAT8_E4M3 && a->b_dtype == SF_FLOAT8_E4M3)
        return kE4m3;
    if (a->a_dtype == SF_FLOAT8_E5M2 && a->b_dtype == SF_FLOAT8_E4M3)
        return kE5m2;
    return -1;
}

} // namespace

extern "C" const char *sf_grouped_sm90_device_unfit(int device_id) { return device_unfit(device_id); }

extern "C" int sf_grouped_sm90_pays(const int64_t *m_splits, int groups, int64_t n, int64_t k, sf_dtype dtype,
                                    int fast_accum, int device_id)
{
    int64_t tiles = 0;
    int busy = 0;
    const int64_t n_tiles = (n + Library::BN - 1) / Library::BN;
    for (int g = 0; g < groups; ++g)
        if (m_splits[g] > 0) {
            tiles += (m_splits[g] + kBM - 1) / kBM * n_tiles;
            ++busy;
        }
    /* (no rows at all: nothing to run, so nothing to choose or note) */
    const bool fp8 = dtype == SF_FLOAT8_E4M3 || dtype == SF_FLOAT8_E5M2;
    if (busy == 0)
        return 0;
    if (fp8)
        return fast_accum || k <= 4096 || groups > 16;
    return tiles <= 2 * (int64_t)busy * sf_cuda_sm_count(device_id);
}

extern "C" const char *sf_grouped_sm90_unfit(const sf_grouped_sm90_args *a)
{
    const int kind = kind_of(a);
    if (kind < 0)
        return "the kernel takes bfloat16 x bfloat16, float8_e4m3fn x float8_e4m3fn or float8_e5m2 x "
               "float8_e4m3fn operands (a x b)";
    if (a->fast_accum != 0 && a->fast_accum != 1)
        return "the kernel takes fast_accum 0 (FP8 sums promoted into float32 every 128 k) or 1";
    if (a->groups < 1 || a->groups > kMaxGroups)
        return "the kernel takes 1 to 64 groups";
    const bool fp8 = kind != kBf16;
    const int64_t align = fp8 ? 16 : 8; /* (16 bytes of elements) */
    if (a->k <= 0 || a->k % align || a->n <= 0 || a->n % 8)
        return fp8 ? "the kernel needs k a positive multiple of 16 and n of 8"
                   : "the kernel needs k a positive multiple of 8 and n of 8";
    if (a->lda < a->k || a->lda % align || a->ldo < a->n || a->ldo % 8)
        return "the kernel needs row strides of a and out multiples of 16 bytes, at least a row";
    if (a->row_start[0] != 0 || a->row_start[a->groups] < 0 || a->row_start[a->groups] >= ((int64_t)1 << 31) ||
        a->n >= ((int64_t)1 << 31))
        return "the kernel needs fewer than 2^31 rows and columns";
    if (!aligned16(a->a) || !aligned16(a->out))
        return "the kernel needs a and out 16-byte aligned";
    const bool on_device = a->device_row_end != nullptr;
    if (on_device && ((uintptr_t)a->device_row_end & 3))
        return "the kernel needs device_row_end 4-byte aligned (int32)";
    for (int g = 0; g < a->groups; ++g) {
        if (!on_device && a->row_start[g + 1] < a->row_start[g])
            return "the groups' row counts must not be negative";
        if (!on_device && a->row_start[g + 1] == a->row_start[g])
            continue; /* (an empty group's b is never read; with device_row_end any group may have rows) */
        if (!aligned16(a->b[g]) || a->ldb[g] < a->k || a->ldb[g] % align)
            return "the kernel needs each b 16-byte aligned with a row stride of a multiple of 16 bytes";
        if (fp8 && (!a->a_scale_inv[g] || !a->b_scale_inv[g]))
            return "the FP8 kernel needs a scale inverse for a and b of every group";
    }
    return device_unfit(a->device_id);
}

namespace {

/* Fills the launch's parameters and launches the kernel of tile shape C
 * (args as sf_grouped_sm90_unfit accepted them; a promoted shape, FP8 only). */
template <class C> sf_status run(const sf_grouped_sm90_args *a, sf_stream stream)
{
    const char *why;
    EncodeTiled fn = encode_fn(&why);
    if (!fn)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED, "grouped_gemm (sm90 kernel): %s", why);
    const int kind = kind_of(a);
    const bool fp8 = kind != kBf16;
    void (*kernel)(Params) = nullptr;
    if constexpr (C::PROMOTE == 0) {
        if (kind == kBf16)
            kernel = grouped_sm90_kernel<kBf16, C>;
    }
    if (kind == kE4m3)
        kernel = grouped_sm90_kernel<kE4m3, C>;
    else if (kind == kE5m2)
        kernel = grouped_sm90_kernel<kE5m2, C>;
    if (!kernel) /* (the routes below pick C by the call: not reached) */
        return sf_fail(SF_ERR_VALUE, "grouped_gemm (sm90 kernel): no shape of its for these operands and "
                       "fast_accum");
    static Params p; /* ~10 KiB: built here under the lock, copied into the launch */
    static std::mutex lock;
    std::lock_guard<std::mutex> hold(lock);
    const int64_t rows = a->row_start[a->groups];
    p.groups = a->groups;
    p.n = (int)a->n;
    p.ldo = a->ldo;
    p.out = (__nv_bfloat16 *)a->out;
    p.fp8 = fp8;
    p.kblocks = (int)((a->k * (fp8 ? 1 : 2) + kRowBytes - 1) / kRowBytes);
    p.n_tiles = (int)((a->n + C::BN - 1) / C::BN);
    p.tile_start[0] = 0;
    p.row_start[0] = 0;
    p.device_row_end = a->device_row_end;
    const bool on_device = a->device_row_end != nullptr;
    for (int g = 0; g < a->groups && !on_device; ++g) {
        const int64_t m = a->row_start[g + 1] - a->row_start[g];
        p.row_start[g + 1] = (int)a->row_start[g + 1];
        p.tile_start[g + 1] = p.tile_start[g] + (int)((m + kBM - 1) / kBM) * p.n_tiles;
    }
    /* (with device_row_end the kernel counts the tiles: every SM's CTA runs, the idle ones return) */
    p.total_tiles = on_device ? -1 : p.tile_start[a->groups];
    if (p.total_tiles == 0 || rows == 0) /* (no rows: nothing to encode or launch) */
        return SF_OK;
    p.rows = (int)rows;
    if ((why = encode(&p.a_map, fn, fp8, a->a, rows, a->k, a->lda, kBM)))
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm (sm90 kernel): %s (a)", why);
    if (C::EPI > 0 && (why = encode(&p.out_map, fn, false, a->out, rows, a->n, a->ldo, 64)))
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm (sm90 kernel): %s (out)", why);
    for (int g = 0; g < a->groups; ++g) {
        if ((on_device || p.row_start[g + 1] > p.row_start[g]) &&
            (why = encode(&p.b_map[g], fn, fp8, a->b[g], a->n, a->k, a->ldb[g], C::BN)))
            return sf_fail(SF_ERR_RUNTIME, "grouped_gemm (sm90 kernel): %s (b of group %d)", why, g);
        p.a_scale_inv[g] = fp8 ? a->a_scale_inv[g] : nullptr;
        p.b_scale_inv[g] = fp8 ? a->b_scale_inv[g] : nullptr;
    }
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("grouped_gemm", a->device_id, &guard));
    const int sms = sf_cuda_sm_count(a->device_id);
    const int grid = on_device || p.total_tiles > sms ? sms : p.total_tiles;
    cudaError_t e = cudaSuccess;
    static bool attr_set[3][64]; /* (device ids were checked below 64 by sf_grouped_sm90_unfit; set under the lock) */
    if (!attr_set[kind][a->device_id]) {
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
        attr_set[kind][a->device_id] = e == cudaSuccess;
    }
    if (e == cudaSuccess) {
        kernel<<<grid, kThreads, C::SMEM, sf_cuda_stream(stream)>>>(p);
        e = cudaGetLastError();
    }
    sf_cuda_device_restore(&guard);
    if (e != cudaSuccess)
        return sf_fail(SF_ERR_RUNTIME, "grouped_gemm (sm90 kernel): CUDA error %s: %s", cudaGetErrorName(e),
                       cudaGetErrorString(e));
    return SF_OK;
}

} // namespace

/* sf_grouped_sm90_unfit's rules, as the run's error */
static sf_status refuse_unfit(const sf_grouped_sm90_args *a)
{
    const char *why = sf_grouped_sm90_unfit(a);
    return why ? sf_fail(SF_ERR_VALUE, "grouped_gemm (sm90 kernel): %s", why) : SF_OK;
}

/* The library's shape for the call: the promoted one for FP8 with fast_accum=0. */
static sf_status route(const sf_grouped_sm90_args *a, sf_stream stream)
{
    const bool promoted = a->a_dtype != SF_BFLOAT16 && !a->fast_accum;
    return promoted ? run<Promoted>(a, stream) : run<Library>(a, stream);
}

extern "C" sf_status sf_grouped_sm90_run(const sf_grouped_sm90_args *a, sf_stream stream)
{
    SF_TRY(refuse_unfit(a));
    return route(a, stream);
}

extern "C" sf_status sf_grouped_sm90_launch(const sf_grouped_sm90_args *a, sf_stream stream)
{
    return route(a, stream);
}

#ifdef SF_WORKBENCH
extern "C" sf_status sf_grouped_sm90_run_variant(const sf_grouped_sm90_args *a, int variant, sf_stream stream)
{
    SF_TRY(refuse_unfit(a));
    const bool promoted = a->a_dtype != SF_BFLOAT16 && !a->fast_accum;
    if (variant >= 1 && variant <= 3 && promoted)
        return sf_fail(SF_ERR_VALUE, "grouped_gemm (sm90 kernel): variant %d accumulates as fast_accum=1 does; "
                       "the call asks for fast_accum=0 (variants 4 and 5)", variant);
    if ((variant == 4 || variant == 5) && !promoted)
        return sf_fail(SF_ERR_VALUE, "grouped_gemm (sm90 kernel): variant %d promotes FP8 sums (fast_accum=0); "
                       "the call is bf16 or fast_accum=1 (variants 1 to 3)", variant);
    switch (variant) {
    case 0: return route(a, stream);
    case 1: return run<Cfg<256, 4, true, 0>>(a, stream);
    case 2: return run<Cfg<256, 3, true, 4>>(a, stream);
    case 3: return run<Cfg<256, 4, false, 2>>(a, stream);
    case 4: return run<Cfg<128, 6, true, 2, 1>>(a, stream);
    case 5: return run<Cfg<128, 4, true, 2, 2>>(a, stream);
    default: return sf_fail(SF_ERR_VALUE, "grouped_gemm (sm90 kernel): no variant %d", variant);
    }
}
#endif
