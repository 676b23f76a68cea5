/*
 * seqfuse_optim.h - public C API of the optim family: multi-tensor AdamW and gradient norms (csrc/optim/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_OPTIM_H
#define SEQFUSE_OPTIM_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_OPTIM_H */
