/*
 * seqfuse_rope.h - public C API of the rope family: rotary position embeddings on bshd, sbhd and packed thd (csrc/rope/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_ROPE_H
#define SEQFUSE_ROPE_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ROPE_H */
