/*
 * norm_cuda.cuh - what the CUDA norm's units share: the kernels' argument
 * blocks, the split of a row over threads (Config, pick_config and its
 * defaults) and the per-dtype launchers' declarations.
 *
 * The CUDA norm is one compilation unit, norm_cuda.cu: entry points,
 * workspace size, the dgamma / dbeta column sums, the checks-only tuning
 * knob, and the forward and backward of every dtype.  It includes the
 * kernels and their launch code, norm_kernels.cuh.
 */
#ifndef SF_NORM_CUDA_CUH
#define SF_NORM_CUDA_CUH

#include "../core/cuda_util.h"
#include "../core/vec_io.cuh"
#include "norm.h"
#include "norm_backend.h"

namespace sf_norm {

using namespace sf_vec;

constexpr int kRowThreads = 512;  /* a row's threads (tx) in the register-heavy kernels */
constexpr int kLightRowThreads = 1024; /* ... in the light ones (<= 64 registers) */
constexpr int kScalarNV = 32;     /* element-wide path: 32 x 512 = SF_NORM_MAX_HIDDEN */
/* Elements a thread owns before the kernel trades occupancy for registers:
 * up to these, the "light" kernels fit 64 registers (launch bound 1024
 * threads) with the next row prefetched; beyond them they get 128 (bound
 * 512) and no prefetch. */
constexpr int kForwardElems = 16;
constexpr int kBackwardElems = 8;
/* The default split per direction: elements per thread (the cap of NV *
 * VEC) and threads per block, chosen from check_norm --sweep on the H200
 * (bf16, 16384 rows of 1280 / 4096 / 5120, 8192 x 8192, 4096 x 16384,
 * 65536 x 320; % of a device copy):
 * - forward, 16 elements in 256-thread blocks: the best or within 1 point
 *   of it at every shape except 65536 x 320 (1024-thread blocks: +3);
 *   8 elements lose 20-30 points at 4096 and up, 32 lose 3-5;
 * - LayerNorm backward, 16 elements (the 128-register kernel, no prefetch)
 *   in 256-thread blocks: 60 / 62 / 65 / 47 / 58 / 55 % where the earlier
 *   8 elements in 1024-thread blocks ran 46 / 57 / 56 / 45 / 52 / 55 %
 *   (32 elements spill: its dgamma and dbeta accumulators do not fit);
 * - RMSNorm backward, 32 elements in 256-thread blocks: 62 / 65 / 80 / 77 /
 *   76 / 73 %, against 48 / 59 / 59 / 47 / 54 / 73 % before.
 * The smaller blocks write more float32 partial rows of dgamma / dbeta for
 * the second kernel to add (4 bytes x hidden per block), which the timings
 * include. */
constexpr int kForwardBlock = 256;
constexpr int kBackwardElemsDefault[2] = {16, 32}; /* [rms] */
constexpr int kBackwardBlockDefault[2] = {256, 256};

struct ForwardParams {
    const void *x, *gamma, *beta;
    void *y;
    float *mean, *rstd;
    const float *scale;
    unsigned *amax;
    float *scale_inv;
    int64_t rows;
    int hidden;
    float eps;
    int rms, zc, gamma_f32, out_kind;
};

struct BackwardParams {
    const void *dy, *x, *gamma;
    const float *mean, *rstd;
    void *dx;
    const void *dres; /* added to dx, or NULL */
    float *ws; /* [2][gridDim.x][hidden]: dgamma partials, then dbeta partials */
    int64_t rows;
    int hidden;
    int rms, zc, gamma_f32, want_dbeta;
};

/* A launch shape: NV vectors per thread, tx threads per row, ty rows per
 * block. */
struct Config {
    int nv, tx, ty;
};

inline int round32(int64_t v) { return (int)((v + 31) / 32 * 32); }

/* The split of a row of `hidden` elements in vectors of `vec`:
 * - element-wide path: 32 elements per thread, tx <= 512;
 * - a warp per row while each lane holds at most `elems` elements (the
 *   row's sums are then shuffles only);
 * - else tx threads x NV vectors with NV * vec <= elems, the split with the
 *   fewest idle slots (ties: more vectors per thread, fewer warps to reduce
 *   over); rows too long for that double NV until tx <= 512.
 * A split holding more than `light` elements per thread runs the
 * register-heavy kernel (bounded to 512 threads: tx <= 512, block <= 512);
 * the light ones take rows of up to 1024 threads.  ty rows share a block of
 * about `block` threads. */
inline Config pick_config(int64_t hidden, int vec, int elems, int block, int light)
{
    Config c;
    if (vec == 1) {
        c.nv = kScalarNV;
        c.tx = round32((hidden + kScalarNV - 1) / kScalarNV);
    } else {
        const int64_t nvec = hidden / vec;
        const int cap = elems / vec > 1 ? elems / vec : 1;
        if (nvec <= 32 * (int64_t)cap) {
            c.tx = 32;
            c.nv = 1;
            while (32 * (int64_t)c.nv < nvec)
                c.nv *= 2;
        } else {
            c.nv = 0;
            double best_idle = 2.0;
            for (int nv = cap; nv >= 1; nv /= 2) {
                const int tx = round32((nvec + nv - 1) / nv);
                const int limit = nv * vec <= light ? kLightRowThreads : kRowThreads;
                const double idle = 1.0 - (double)nvec / ((double)tx * nv);
                if (tx <= limit && idle < best_idle - 1e-9) {
                    best_idle = idle;
                    c.nv = nv;
                    c.tx = tx;
                }
            }
            for (int nv = cap * 2; c.nv == 0; nv *= 2) {
                const int tx = round32((nvec + nv - 1) / nv);
                if (tx <= kRowThreads) {
                    c.nv = nv;
                    c.tx = tx;
                }
            }
        }
    }
    if (c.nv * vec > light && block > 512)
        block = 512; /* the register-heavy kernels are bounded to 512 threads */
    c.ty = c.tx >= block ? 1 : block / c.tx;
    return c;
}

/* The knobs of the split (elements per thread, threads per block), per
 * direction and, backward, per norm ([rms]).  The library runs the
 * defaults, the constants above.  The check programs (SF_WORKBENCH) may
 * change them: check_norm --sweep times alternatives through
 * sf_norm_cuda_tune (norm_cuda.cu), a process-wide setting for that
 * benchmark. */
struct Tuning {
    int forward_elems, forward_block, backward_elems[2], backward_block[2];
};
constexpr Tuning kDefaultTuning = {kForwardElems, kForwardBlock, {kBackwardElemsDefault[0], kBackwardElemsDefault[1]},
                                   {kBackwardBlockDefault[0], kBackwardBlockDefault[1]}};
#ifdef SF_WORKBENCH
extern Tuning g_tuning; /* norm_cuda.cu */
inline Tuning tuning() { return g_tuning; }
#else
constexpr Tuning tuning() { return kDefaultTuning; }
#endif

inline Config forward_config(int64_t hidden, int vec)
{
    const Tuning t = tuning();
    return pick_config(hidden, vec, t.forward_elems, t.forward_block, kForwardElems);
}
inline Config backward_config(int64_t hidden, int vec, int rms)
{
    const int r = rms ? 1 : 0;
    const Tuning t = tuning();
    return pick_config(hidden, vec, t.backward_elems[r], t.backward_block[r], kBackwardElems);
}

/* The launchers of one dtype T (float, __half, __nv_bfloat16), defined in
 * norm_kernels.cuh.  vec: the 16-byte vector path (else one element per
 * "vector"). */
template <typename T> sf_status launch_forward(const ForwardParams &p, bool vec, int device, cudaStream_t stream);
/* Backward over split c; the grid is capped at `bound` (the workspace's
 * partial rows) and returned in *grid for the column sums. */
template <typename T>
sf_status launch_backward(const BackwardParams &p, const Config &c, bool vec, int device, int64_t bound,
                     cudaStream_t stream, int64_t *grid);

} // namespace sf_norm

#endif /* SF_NORM_CUDA_CUH */
