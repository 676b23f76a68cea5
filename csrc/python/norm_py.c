/*
 * norm_py.c - bindings of the norm family (LayerNorm and RMSNorm, forward and
 * backward, csrc/norm/).  Optional tensors are passed as None.  One
 * SF_PY_OP line per binding (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(layernorm_forward, sf_layernorm_forward, "LayerNorm forward, optionally cast to FP8.", (T, x),
         (T, gamma), (OT, beta), (FLOAT, eps), (BOOL, zero_centered_gamma), (T, y), (OT, mean),
         (OT, rstd), (OT, scale), (OT, amax), (OT, scale_inv));
SF_PY_OP(rmsnorm_forward, sf_rmsnorm_forward, "RMSNorm forward, optionally cast to FP8.", (T, x),
         (T, gamma), (FLOAT, eps), (BOOL, zero_centered_gamma), (T, y), (OT, rstd), (OT, scale),
         (OT, amax), (OT, scale_inv));
SF_PY_OP(layernorm_backward, sf_layernorm_backward, "LayerNorm backward.", (T, dy), (T, x), (T, mean),
         (T, rstd), (T, gamma), (BOOL, zero_centered_gamma), (T, dx), (T, dgamma), (OT, dbeta),
         (OT, workspace), (OT_NONE, dres));
SF_PY_OP(rmsnorm_backward, sf_rmsnorm_backward, "RMSNorm backward.", (T, dy), (T, x), (T, rstd), (T, gamma),
         (BOOL, zero_centered_gamma), (T, dx), (T, dgamma), (OT, workspace), (OT_NONE, dres));

static const sf_py_arg x_args[] = {SF_T(x), SF_STREAM};
static sf_status norm_ws(sf_py_value *v, sf_stream s)
{
    return sf_norm_backward_workspace_numel(v[0].t, &v[2].i64); /* the slot after the arguments */
}
SF_PY_BINDING_FULL(norm_backward_workspace_numel, "norm_backward_workspace_numel", x_args, norm_ws, NULL,
                   NULL, sf_py_result_i64, "-> int: float32 elements of backward workspace.");

const sf_py_binding *const sf_py_norm_bindings[] = {
    &layernorm_forward_binding, &rmsnorm_forward_binding, &layernorm_backward_binding, &rmsnorm_backward_binding,
    &norm_backward_workspace_numel_binding, NULL};
