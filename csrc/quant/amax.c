/*
 * amax.c - sf_amax, the public entry: checks every precondition once, then
 * dispatches to the CPU reference (amax_cpu.c) or the CUDA kernel
 * (amax_cuda.cu).  amax = max |x| is the statistic FP8 scaling is built on.
 * The quant family's file shape: cast.c's first comment.
 */
#include "../core/dispatch.h"
#include "amax_backend.h"

sf_status sf_amax(const sf_tensor *x, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "amax";
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_vector(op, "out", out, SF_FLOAT32, 1, "x", x, 1));

    return SF_DISPATCH(op, "x", x, sf_amax_cpu(x, out), sf_amax_cuda(x, out, stream));
}
