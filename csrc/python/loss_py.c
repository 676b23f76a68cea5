/*
 * loss_py.c - bindings of the loss family (fused cross-entropy, csrc/loss/),
 * one SF_PY_OP line each (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(cross_entropy_forward, sf_cross_entropy_forward, "Per-row loss and log-sum-exp (float32).",
         (T, logits), (T, labels), (INT64, ignore_index), (FLOAT, label_smoothing), (T, loss),
         (T, lse), (OT, label_claim), (OT, label_record));
SF_PY_OP(cross_entropy_backward, sf_cross_entropy_backward,
         "dlogits = grad_scale * d loss / d logits (dlogits may be logits).", (T, logits),
         (T, labels), (T, lse), (T, grad_scale), (INT64, ignore_index), (FLOAT, label_smoothing),
         (T, dlogits));

const sf_py_binding *const sf_py_loss_bindings[] = {
    &cross_entropy_forward_binding, &cross_entropy_backward_binding, NULL};
