/*
 * amax.c - sf_amax, the public entry: checks every precondition once, then
 * dispatches to the CPU reference (amax_cpu.c) or the CUDA kernel
 * (amax_cuda.cu).  amax = max |x| is the statistic FP8 scaling is built on.
 */
#include "amax_backend.h"

sf_status sf_amax(const sf_tensor *x, sf_tensor *out, sf_stream stream)
{
    static const char op[] = "amax";
    SF_TRY(sf_check_float_input(op, "x", x));
    SF_TRY(sf_check_dtype(op, "out", out, SF_FLOAT32));
    SF_TRY(sf_check_numel(op, "out", out, 1));
    SF_TRY(sf_check_writable(op, "out", out));
    SF_TRY(sf_check_same_device(op, "x", x, "out", out));

    if (x->device == SF_CPU)
        return sf_amax_cpu(x, out);
#ifdef SF_WITH_CUDA
    return sf_amax_cuda(x, out, stream);
#else
    (void)stream;
    return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                   "amax: argument 'x' is a CUDA tensor but seqfuse was built "
                   "without CUDA (rebuild with nvcc on PATH and SEQFUSE_CUDA unset)");
#endif
}
