/*
 * act_py.c - bindings of the act family (activations and their gradients,
 * bias + dropout + residual, csrc/act/).  Optional tensors are passed as
 * None; the activation is its sf_activation number (seqfuse.ops.act names
 * them).  Each binding is an argument table and a thunk calling the C entry;
 * the driver in py_call.c does the parsing, importing and error mapping.
 */
#include "py_call.h"

static const sf_py_arg act_fwd_args[] = {SF_INT(activation), SF_T(x),      SF_T(y),
                                         SF_OT(scale),       SF_OT(amax),  SF_OT(scale_inv),
                                         SF_STREAM};
static sf_status act_fwd(sf_py_value *v, sf_stream s)
{
    return sf_act_fwd((sf_activation)v[0].i, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, s);
}
SF_PY_BINDING(act_fwd, act_fwd_args, act_fwd, "y = activation(x), optionally cast to FP8.");

static const sf_py_arg act_bwd_args[] = {SF_INT(activation), SF_T(dy),    SF_T(x),
                                         SF_T(dx),           SF_OT(scale), SF_OT(amax),
                                         SF_OT(scale_inv),   SF_STREAM};
static sf_status act_bwd(sf_py_value *v, sf_stream s)
{
    return sf_act_bwd((sf_activation)v[0].i, v[1].t, v[2].t, v[3].t, v[4].t, v[5].t, v[6].t, s);
}
SF_PY_BINDING(act_bwd, act_bwd_args, act_bwd, "dx = dy * activation'(x), optionally cast to FP8.");

static const sf_py_arg bda_args[] = {SF_T(x),     SF_OT(bias),    SF_T(residual), SF_FLOAT(p),
                                     SF_U64(seed), SF_U64(offset), SF_T(out),      SF_STREAM};
static sf_status bda(sf_py_value *v, sf_stream s)
{
    return sf_bias_dropout_add_fwd(v[0].t, v[1].t, v[2].t, (float)v[3].f, v[4].u64, v[5].u64,
                                   v[6].t, s);
}
SF_PY_BINDING(bias_dropout_add, bda_args, bda, "out = residual + dropout(x + bias).");

static const sf_py_arg dropout_bwd_args[] = {SF_T(dy), SF_FLOAT(p),  SF_U64(seed),
                                             SF_U64(offset), SF_T(dx), SF_OT(dbias),
                                             SF_OT(workspace), SF_STREAM};
static sf_status dropout_bwd(sf_py_value *v, sf_stream s)
{
    return sf_dropout_bwd(v[0].t, (float)v[1].f, v[2].u64, v[3].u64, v[4].t, v[5].t, v[6].t, s);
}
SF_PY_BINDING(dropout_bwd, dropout_bwd_args, dropout_bwd,
              "dx = the dropout mask applied to dy; dbias = column sums of dx.");

static const sf_py_arg dy_args[] = {SF_T(dy), SF_STREAM};
static sf_status dropout_ws(sf_py_value *v, sf_stream s)
{
    (void)s;
    return sf_dropout_bwd_workspace_numel(v[0].t, &v[2].i64); /* the slot after the arguments */
}
SF_PY_BINDING_FULL(dropout_bwd_workspace_numel, "dropout_bwd_workspace_numel", dy_args, dropout_ws,
                   NULL, NULL, sf_py_result_i64, "-> int: float32 elements of dbias workspace.");

const sf_py_binding *const sf_py_act_bindings[] = {
    &act_fwd_binding,     &act_bwd_binding, &bias_dropout_add_binding,
    &dropout_bwd_binding, &dropout_bwd_workspace_numel_binding, NULL};
