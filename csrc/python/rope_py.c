/*
 * rope_py.c - binding of the rope family (rotary position embeddings on
 * bshd, sbhd and packed thd, csrc/rope/): an SF_PY_OP line per entry (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(rope, sf_rope, "Rotary position embedding (format 0 sbhd, 1 bshd, 2 thd).", (T, t),
         (T, freqs), (OT, cu_seqlens), (OT, start_positions), (INT, format), (BOOL, interleaved),
         (BOOL, backward), (T, out));

SF_PY_OP(rope_parts, sf_rope_parts, "RoPE of up to three parts along the heads into one out, the first "
         "rotate_heads heads turned, the rest copied.", (T, t), (OT, t1), (OT, t2), (INT64, rotate_heads),
         (T, freqs), (OT, cu_seqlens), (OT, start_positions), (INT, format), (BOOL, interleaved),
         (BOOL, backward), (T, out));

const sf_py_binding *const sf_py_rope_bindings[] = {&rope_binding, &rope_parts_binding, NULL};
