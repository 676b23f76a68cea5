/*
 * loss_py.c - bindings of the loss family (fused cross-entropy, csrc/loss/).
 * Each binding is its argument table and a thunk calling the C entry; the
 * driver in py_call.c does the parsing, importing and error mapping.
 */
#include "py_call.h"

static const sf_py_arg ce_fwd_args[] = {SF_T(logits), SF_T(labels), SF_INT64(ignore_index),
                                        SF_FLOAT(label_smoothing), SF_T(loss), SF_T(lse),
                                        SF_STREAM};
static sf_status ce_fwd(sf_py_value *v, sf_stream s)
{
    return sf_cross_entropy_forward(v[0].t, v[1].t, v[2].i64, (float)v[3].f, v[4].t, v[5].t, s);
}
SF_PY_BINDING(cross_entropy_forward, ce_fwd_args, ce_fwd,
              "Per-row loss and log-sum-exp (float32).");

static const sf_py_arg ce_bwd_args[] = {SF_T(logits), SF_T(labels), SF_T(lse), SF_T(grad_scale),
                                        SF_INT64(ignore_index), SF_FLOAT(label_smoothing),
                                        SF_T(dlogits), SF_STREAM};
static sf_status ce_bwd(sf_py_value *v, sf_stream s)
{
    return sf_cross_entropy_backward(v[0].t, v[1].t, v[2].t, v[3].t, v[4].i64, (float)v[5].f,
                                     v[6].t, s);
}
SF_PY_BINDING(cross_entropy_backward, ce_bwd_args, ce_bwd,
              "dlogits = grad_scale * d loss / d logits (dlogits may be logits).");

const sf_py_binding *const sf_py_loss_bindings[] = {
    &cross_entropy_forward_binding, &cross_entropy_backward_binding, NULL};
