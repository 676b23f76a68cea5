/*
 * seqfuse_act.h - public C API of the act family: activations and their gradients, bias+dropout+residual (csrc/act/).
 * Included by seqfuse.h; include that, not this.
 */
#ifndef SEQFUSE_ACT_H
#define SEQFUSE_ACT_H

#include "seqfuse.h"

#ifdef __cplusplus
extern "C" {
#endif


#ifdef __cplusplus
}
#endif

#endif /* SEQFUSE_ACT_H */
