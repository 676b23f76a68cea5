/*
 * seqfuse_attn.h - public C API of the attn family: fused (flash) attention forward and backward (csrc/attn/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_ATTN_H
#define SEQFUSE_ATTN_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ATTN_H */
