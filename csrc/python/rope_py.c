/*
 * rope_py.c - binding of the rope family (rotary position embeddings on
 * bshd, sbhd and packed thd, csrc/rope/): an argument table and a thunk; the
 * driver in py_call.c does the rest.
 */
#include "py_call.h"

static const sf_py_arg rope_args[] = {SF_T(t),          SF_T(freqs),          SF_OT(cu_seqlens),
                                      SF_OT(start_positions), SF_INT(format), SF_BOOL(interleaved),
                                      SF_BOOL(backward), SF_T(out),           SF_STREAM};
static sf_status rope_call(sf_py_value *v, sf_stream s)
{
    return sf_rope(v[0].t, v[1].t, v[2].t, v[3].t, (sf_rope_format)v[4].i, v[5].b, v[6].b, v[7].t,
                   s);
}
SF_PY_BINDING(rope, rope_args, rope_call,
              "Rotary position embedding (format 0 sbhd, 1 bshd, 2 thd).");

const sf_py_binding *const sf_py_rope_bindings[] = {&rope_binding, NULL};
