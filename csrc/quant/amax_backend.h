/*
 * amax_backend.h - the backend entry points behind sf_amax.  Arguments have
 * been validated by amax.c before either is called.
 */
#ifndef SF_AMAX_BACKEND_H
#define SF_AMAX_BACKEND_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif

sf_status sf_amax_cpu(const sf_tensor *x, sf_tensor *out);
sf_status sf_amax_cuda(const sf_tensor *x, sf_tensor *out, sf_stream stream);

#ifdef __cplusplus
}
#endif

#endif
