/*
 * visit.cuh - what a CUDA launcher does before it launches, written once:
 *
 *   sf_visit_float / sf_visit_half / sf_visit_fp8: the one switch from a
 *     runtime sf_dtype to a compile-time element type (flash-attention's
 *     static-switch idea): fn(sf_type_tag<T>{}) runs
 *     with T the element type of `dtype`.  A dtype outside the set is a
 *     TypeError naming the op and the argument, never a silent default (a
 *     `default:` that reads an unknown dtype as bfloat16 would compute on
 *     misread memory if an entry's check ever let one through).
 *   sf_on_device: fn() with `device` current, the caller's device restored
 *     on every path out of fn (cuda_util.h's guard, scoped).
 *
 *   return sf_on_device(op, x->device_id, [&] {
 *       return sf_visit_float(op, "x", x->dtype, [&](auto tag) {
 *           using T = typename decltype(tag)::type;
 *           return launch<T>(x, out, stream);
 *       });
 *   });
 *
 * Host code only: the kernels a launcher instantiates are the same template
 * instances a hand-written switch names, so their machine code is unchanged.
 * Only CUDA translation units include this header.
 */
#ifndef SF_VISIT_CUH
#define SF_VISIT_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda_util.h"

template <typename T> struct sf_type_tag {
    using type = T;
};

/* The failure of a dtype a visitor does not hold; `takes` lists the set. */
inline sf_status sf_visit_refuse(const char *op, const char *arg, sf_dtype dtype,
                                 const char *takes)
{
    return sf_fail(SF_ERR_TYPE, "%s: argument '%s' has dtype %s; the CUDA kernel takes %s", op,
                   arg, sf_dtype_name(dtype), takes);
}

/* float32, float16 or bfloat16: the float inputs of every family. */
template <typename Fn>
inline sf_status sf_visit_float(const char *op, const char *arg, sf_dtype dtype, Fn &&fn)
{
    switch (dtype) {
    case SF_FLOAT32: return fn(sf_type_tag<float>{});
    case SF_FLOAT16: return fn(sf_type_tag<__half>{});
    case SF_BFLOAT16: return fn(sf_type_tag<__nv_bfloat16>{});
    default: return sf_visit_refuse(op, arg, dtype, "float32, float16 or bfloat16");
    }
}

/* float16 or bfloat16: the tensor-core kernels (attention). */
template <typename Fn>
inline sf_status sf_visit_half(const char *op, const char *arg, sf_dtype dtype, Fn &&fn)
{
    switch (dtype) {
    case SF_FLOAT16: return fn(sf_type_tag<__half>{});
    case SF_BFLOAT16: return fn(sf_type_tag<__nv_bfloat16>{});
    default: return sf_visit_refuse(op, arg, dtype, "float16 or bfloat16");
    }
}

/* float8_e4m3fn or float8_e5m2: the FP8 outputs and operands. */
template <typename Fn>
inline sf_status sf_visit_fp8(const char *op, const char *arg, sf_dtype dtype, Fn &&fn)
{
    switch (dtype) {
    case SF_FLOAT8_E4M3: return fn(sf_type_tag<__nv_fp8_e4m3>{});
    case SF_FLOAT8_E5M2: return fn(sf_type_tag<__nv_fp8_e5m2>{});
    default: return sf_visit_refuse(op, arg, dtype, "float8_e4m3fn or float8_e5m2");
    }
}

template <typename Fn> inline sf_status sf_on_device(const char *op, int device, Fn &&fn)
{
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op, device, &guard));
    const sf_status st = fn();
    sf_cuda_device_restore(&guard);
    return st;
}

#endif /* SF_VISIT_CUH */
