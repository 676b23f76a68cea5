/*
 * status.c - the thread-local error message behind sf_last_error().
 *
 * Every failing sf_* function formats one message naming the op, the argument
 * and the rule it broke, then returns a status.  The message lives in a
 * thread-local buffer so concurrent callers (Python threads with the GIL
 * released, data-loader workers) never see each other's errors.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "dispatch.h"
#include "float_io.h"

#define SF_ERROR_CAPACITY 1024

static _Thread_local char sf_error_message[SF_ERROR_CAPACITY];

const char *sf_last_error(void) { return sf_error_message; }

sf_status sf_fail(sf_status status, const char *fmt, ...)
{
    va_list args;
    va_start(args, fmt);
    vsnprintf(sf_error_message, sizeof sf_error_message, fmt, args);
    va_end(args);
    return status;
}

sf_status sf_fail_no_cuda(const char *op, const char *arg)
{
    return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                   "%s: argument '%s' is a CUDA tensor but seqfuse was built without CUDA "
                   "(rebuild with nvcc on PATH and SEQFUSE_CUDA unset)",
                   op, arg);
}

void sf_float_io_abort(const char *what, sf_dtype dtype)
{
    fprintf(stderr,
            "seqfuse: float_io.h got %s of an element of dtype %s; it reads and writes only "
            "float32, float16 and bfloat16 (an entry let this dtype through unchecked)\n",
            what, sf_dtype_name(dtype));
    abort();
}
