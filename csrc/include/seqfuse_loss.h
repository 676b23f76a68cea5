/*
 * seqfuse_loss.h - public C API of the loss family: fused cross-entropy (csrc/loss/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_LOSS_H
#define SEQFUSE_LOSS_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_LOSS_H */
