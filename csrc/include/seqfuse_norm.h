/*
 * seqfuse_norm.h - public C API of the norm family: LayerNorm and RMSNorm, forward and backward (csrc/norm/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_NORM_H
#define SEQFUSE_NORM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_NORM_H */
