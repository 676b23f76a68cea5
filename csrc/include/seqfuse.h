/*
 * seqfuse.h - the C API of seqfuse.
 *
 * Everything seqfuse computes is reached through sf_* functions that take
 * sf_tensor views.  A view borrows memory owned by someone else (torch, numpy,
 * a test program): C never allocates or frees tensor memory.  Outputs and
 * workspaces are handed in by the caller ("destination passing").
 *
 * Every compute and check entry returns an sf_status (queries such as
 * sf_dtype_size or the version calls return their value).  On failure, sf_last_error() returns a
 * thread-local message that names the argument and the rule it broke, e.g.
 *   "amax: argument 'out' must have dtype float32, got bfloat16".
 * The Python extension maps statuses to exceptions (csrc/python/py_call.c).
 *
 * This header knows nothing of Python or torch.  Each kernel family adds its
 * public functions in its own header, included at the bottom.
 */
#ifndef SEQFUSE_H
#define SEQFUSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ------------------------------------------------------------ */

typedef enum sf_status {
    SF_OK = 0,
    SF_ERR_TYPE = 1,            /* wrong kind of object or dtype  -> TypeError */
    SF_ERR_VALUE = 2,           /* shape, stride, alignment, value -> ValueError */
    SF_ERR_NOT_IMPLEMENTED = 3, /* feature this build / GPU lacks -> NotImplementedError */
    SF_ERR_RUNTIME = 4,         /* CUDA / cuBLAS / NCCL failure   -> RuntimeError */
} sf_status;

/* The message of the last failure on this thread ("" if none). */
const char *sf_last_error(void);

/* Record a failure: formats the message, stores it thread-locally and
 * returns `status` so callers can write `return sf_fail(...)`. */
sf_status sf_fail(sf_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Propagate a failing status from a callee. */
#define SF_TRY(expr)                       \
    do {                                   \
        sf_status sf_try_status_ = (expr); \
        if (sf_try_status_ != SF_OK)       \
            return sf_try_status_;         \
    } while (0)

/* ---- dtypes ------------------------------------------------------------ */

typedef enum sf_dtype {
    SF_FLOAT32 = 0,
    SF_FLOAT16 = 1,
    SF_BFLOAT16 = 2,
    SF_FLOAT8_E4M3 = 3,  /* e4m3fn: no inf, max 448 */
    SF_FLOAT8_E5M2 = 4,  /* IEEE-like, max 57344 */
    SF_FLOAT8_E8M0 = 5,  /* exponent-only block scale (e8m0fnu) */
    SF_FLOAT4_E2M1X2 = 6, /* two e2m1 values packed per byte, low nibble first */
    SF_INT32 = 7,
    SF_INT64 = 8,
    SF_UINT8 = 9,
    SF_BOOL = 10,
    SF_NUM_DTYPES = 11,
} sf_dtype;

/* Size in bytes of one storage element (a packed fp4 byte holds two values). */
size_t sf_dtype_size(sf_dtype dtype);
/* The torch-style name ("bfloat16", "float8_e4m3fn", ...). */
const char *sf_dtype_name(sf_dtype dtype);
/* 1 for floating types (including fp8/fp4 and e8m0), 0 otherwise. */
int sf_dtype_is_float(sf_dtype dtype);

/* ---- devices and streams ----------------------------------------------- */

typedef enum sf_device_type {
    SF_CPU = 1,
    SF_CUDA = 2,
} sf_device_type;

/* A cudaStream_t, passed as an opaque pointer so this header needs no CUDA.
 * NULL is the legacy default stream. */
typedef void *sf_stream;

/* ---- tensor views ------------------------------------------------------ */

#define SF_MAX_DIMS 8

typedef struct sf_tensor {
    void *data;               /* first element (byte offset already applied) */
    sf_dtype dtype;
    int ndim;                 /* 0 .. SF_MAX_DIMS */
    int64_t shape[SF_MAX_DIMS];
    int64_t strides[SF_MAX_DIMS]; /* in elements, as DLPack and torch count */
    sf_device_type device;
    int device_id;
    int readonly;             /* the producer marked the memory read-only */
} sf_tensor;

/* Number of elements (1 for a 0-d tensor, 0 if any dimension is 0). */
int64_t sf_numel(const sf_tensor *t);
/* 1 if the view is row-major contiguous (size-1 dims may have any stride). */
int sf_is_contiguous(const sf_tensor *t);
/* Fill a contiguous view over caller memory (tests and benchmarks use this). */
void sf_tensor_init(sf_tensor *t, void *data, sf_dtype dtype, int ndim,
                    const int64_t *shape, sf_device_type device, int device_id);

/* The bytes t's elements lie in, [*first, *last) relative to t->data: 1;
 * 0 when t has no elements; -1 when they overflow 64 bits or the addresses
 * would leave the 64-bit address range (a layout whose rows wrap around onto
 * each other; no real tensor's). */
int sf_tensor_bytes(const sf_tensor *t, int64_t *first, int64_t *last);

/* Whether the memory a's elements occupy and the memory b's occupy meet
 * (their byte spans intersect; empty tensors meet nothing).  For callers
 * that refuse an input an output would overwrite while it is read; a span
 * whose bytes overflow 64 bits or wrap around the address range counts as
 * meeting. */
int sf_tensors_overlap(const sf_tensor *a, const sf_tensor *b);

/* One argument of sf_check_apart: its name and view (t NULL: not given).  An
 * output's `in_place_of` names the input it may be exactly -- the same
 * address, dtype, shape and strides: an elementwise op's in-place call, which
 * its kernels support -- or is NULL. */
typedef struct {
    const char *name;
    const sf_tensor *t;
    const char *in_place_of;
} sf_mem_arg;

/* Refuse an output whose memory meets another output's or an input's: the
 * kernels read the inputs while they write the outputs, in no promised order,
 * so a partial overlap gives wrong numbers.  The one exception is an output
 * that is exactly the input it names in `in_place_of`.  Views whose byte
 * spans meet but whose elements interleave without meeting (q, k and v
 * sliced from one packed tensor) are apart.  The message names both
 * arguments. */
sf_status sf_check_apart(const char *op, const sf_mem_arg *outs, int n_out,
                         const sf_mem_arg *ins, int n_in);

/* ---- shared argument checks ---------------------------------------------
 * `op` and `arg` name the function and the argument in the message. */
sf_status sf_check_dtype(const char *op, const char *arg, const sf_tensor *t,
                         sf_dtype expected);
sf_status sf_check_float_input(const char *op, const char *arg,
                               const sf_tensor *t); /* fp32, fp16 or bf16 */
sf_status sf_check_contiguous(const char *op, const char *arg,
                              const sf_tensor *t);
sf_status sf_check_writable(const char *op, const char *arg,
                            const sf_tensor *t);
sf_status sf_check_same_device(const char *op, const char *arg_a,
                               const sf_tensor *a, const char *arg_b,
                               const sf_tensor *b);
sf_status sf_check_numel(const char *op, const char *arg, const sf_tensor *t,
                         int64_t expected);
sf_status sf_check_aligned(const char *op, const char *arg, const sf_tensor *t,
                           size_t bytes);
sf_status sf_check_same_shape(const char *op, const char *arg_a,
                              const sf_tensor *a, const char *arg_b,
                              const sf_tensor *b);
/* A vector argument: dtype `dtype`, n elements in contiguous memory (any
 * shape holding them, e.g. [n], [1, n], or 0-d for n = 1), on the device of
 * `ref` (named ref_arg); `writable`: an output.  The checks above, in the
 * order dtype, numel, contiguous, device, writable, with their messages. */
sf_status sf_check_vector(const char *op, const char *arg, const sf_tensor *t,
                          sf_dtype dtype, int64_t n, const char *ref_arg,
                          const sf_tensor *ref, int writable);
/* A tensor shaped like `ref` (named ref_arg): ref's dtype, contiguous, ref's
 * shape, on ref's device, and, when `writable`, an output.  In that order. */
sf_status sf_check_like(const char *op, const char *arg, const sf_tensor *t,
                        const char *ref_arg, const sf_tensor *ref, int writable);
/* The optional scaling tensors of an FP8 output, each a float32 vector of
 * one element on the device of `ref` (named ref_arg): `scale` is read,
 * `amax` and `scale_inv` are written.  NULL ones are skipped. */
sf_status sf_check_fp8_scaling(const char *op, const sf_tensor *scale, const sf_tensor *amax,
                               const sf_tensor *scale_inv, const char *ref_arg,
                               const sf_tensor *ref);

/* ---- build and runtime information -------------------------------------- */

/* 1 if this library was compiled with the CUDA backend. */
int sf_built_with_cuda(void);
/* Number of usable CUDA devices now (0 without a driver or GPU; never fails). */
int sf_cuda_device_count(void);
/* Compute capability of a device as major*10+minor, or a failure. */
sf_status sf_cuda_capability(int device_id, int *capability);
/* Versions, 0 where not compiled in. */
int sf_cuda_runtime_version(void);   /* e.g. 13000 */
int sf_cuda_driver_version(void);    /* 0 without a driver */
size_t sf_cublaslt_version(void);
int sf_nccl_version(void);

#ifdef __cplusplus
}
#endif

/* ---- ops, one header per kernel family ---------------------------------- */
#include "seqfuse_quant.h"
#include "seqfuse_gemm.h"
#include "seqfuse_norm.h"
#include "seqfuse_act.h"
#include "seqfuse_rope.h"
#include "seqfuse_loss.h"
#include "seqfuse_embed.h"
#include "seqfuse_optim.h"
#include "seqfuse_attn.h"
#include "seqfuse_grouped.h"
#include "seqfuse_moe.h"

#endif /* SEQFUSE_H */
