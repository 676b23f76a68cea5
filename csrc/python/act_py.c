/*
 * act_py.c - bindings of the act family (activations and their gradients,
 * bias + dropout + residual, csrc/act/).  Optional tensors are passed as
 * None; the activation is its sf_activation number (seqfuse.ops.act names
 * them).  One SF_PY_OP line per binding (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(act_forward, sf_act_forward, "y = activation(x), optionally cast to FP8.", (INT, activation),
         (T, x), (T, y), (OT, scale), (OT, amax), (OT, scale_inv));
SF_PY_OP(act_backward, sf_act_backward, "dx = dy * activation'(x), optionally cast to FP8.",
         (INT, activation), (T, dy), (T, x), (T, dx), (OT, scale), (OT, amax), (OT, scale_inv));
SF_PY_OP(bias_dropout_add, sf_bias_dropout_add_forward, "out = residual + dropout(x + bias).", (T, x),
         (OT, bias), (T, residual), (FLOAT, p), (U64, seed), (U64, offset), (T, out));
SF_PY_OP(dropout_backward, sf_dropout_backward,
         "dx = the dropout mask applied to dy; dbias = column sums of dx.", (T, dy), (FLOAT, p), (U64, seed), (U64, offset), (T, dx), (OT, dbias), (OT, workspace));

static const sf_py_arg dy_args[] = {SF_T(dy), SF_STREAM};
static sf_status dropout_ws(sf_py_value *v, sf_stream s)
{
    return sf_dropout_backward_workspace_numel(v[0].t, &v[2].i64); /* the slot after the arguments */
}
SF_PY_BINDING_FULL(dropout_backward_workspace_numel, "dropout_backward_workspace_numel", dy_args, dropout_ws,
                   NULL, NULL, sf_py_result_i64, "-> int: float32 elements of dbias workspace.");

const sf_py_binding *const sf_py_act_bindings[] = {
    &act_forward_binding,     &act_backward_binding, &bias_dropout_add_binding,
    &dropout_backward_binding, &dropout_backward_workspace_numel_binding, NULL};
