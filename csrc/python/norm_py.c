/*
 * norm_py.c - bindings of the norm family (LayerNorm and RMSNorm, forward and
 * backward, csrc/norm/).  Optional tensors are passed as None.  Each binding
 * is an argument table and a thunk calling the C entry; the driver in
 * py_call.c does the parsing, importing and error mapping.
 */
#include "py_call.h"

static const sf_py_arg ln_fwd_args[] = {
    SF_T(x),     SF_T(gamma),  SF_OT(beta),  SF_FLOAT(eps),    SF_BOOL(zero_centered_gamma),
    SF_T(y),     SF_OT(mean),  SF_OT(rstd),  SF_OT(scale),     SF_OT(amax),
    SF_OT(scale_inv), SF_STREAM};
static sf_status ln_fwd(sf_py_value *v, sf_stream s)
{
    return sf_layernorm_fwd(v[0].t, v[1].t, v[2].t, (float)v[3].f, v[4].b, v[5].t, v[6].t, v[7].t,
                            v[8].t, v[9].t, v[10].t, s);
}
SF_PY_BINDING(layernorm_fwd, ln_fwd_args, ln_fwd, "LayerNorm forward, optionally cast to FP8.");

static const sf_py_arg rms_fwd_args[] = {
    SF_T(x),    SF_T(gamma), SF_FLOAT(eps), SF_BOOL(zero_centered_gamma), SF_T(y),
    SF_OT(rstd), SF_OT(scale), SF_OT(amax), SF_OT(scale_inv), SF_STREAM};
static sf_status rms_fwd(sf_py_value *v, sf_stream s)
{
    return sf_rmsnorm_fwd(v[0].t, v[1].t, (float)v[2].f, v[3].b, v[4].t, v[5].t, v[6].t, v[7].t,
                          v[8].t, s);
}
SF_PY_BINDING(rmsnorm_fwd, rms_fwd_args, rms_fwd, "RMSNorm forward, optionally cast to FP8.");

static const sf_py_arg ln_bwd_args[] = {
    SF_T(dy), SF_T(x),      SF_T(mean),   SF_T(rstd),       SF_T(gamma), SF_BOOL(zero_centered_gamma),
    SF_T(dx), SF_T(dgamma), SF_OT(dbeta), SF_OT(workspace), SF_STREAM};
static sf_status ln_bwd(sf_py_value *v, sf_stream s)
{
    return sf_layernorm_bwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].t, v[5].b, v[6].t, v[7].t, v[8].t,
                            v[9].t, s);
}
SF_PY_BINDING(layernorm_bwd, ln_bwd_args, ln_bwd, "LayerNorm backward.");

static const sf_py_arg rms_bwd_args[] = {
    SF_T(dy), SF_T(x),      SF_T(rstd),       SF_T(gamma), SF_BOOL(zero_centered_gamma),
    SF_T(dx), SF_T(dgamma), SF_OT(workspace), SF_STREAM};
static sf_status rms_bwd(sf_py_value *v, sf_stream s)
{
    return sf_rmsnorm_bwd(v[0].t, v[1].t, v[2].t, v[3].t, v[4].b, v[5].t, v[6].t, v[7].t, s);
}
SF_PY_BINDING(rmsnorm_bwd, rms_bwd_args, rms_bwd, "RMSNorm backward.");

static const sf_py_arg x_args[] = {SF_T(x), SF_STREAM};
static sf_status norm_ws(sf_py_value *v, sf_stream s)
{
    (void)s;
    return sf_norm_bwd_workspace_numel(v[0].t, &v[2].i64); /* the slot after the arguments */
}
SF_PY_BINDING_FULL(norm_bwd_workspace_numel, "norm_bwd_workspace_numel", x_args, norm_ws, NULL,
                   NULL, sf_py_result_i64, "-> int: float32 elements of backward workspace.");

const sf_py_binding *const sf_py_norm_bindings[] = {
    &layernorm_fwd_binding, &rmsnorm_fwd_binding, &layernorm_bwd_binding, &rmsnorm_bwd_binding,
    &norm_bwd_workspace_numel_binding, NULL};
