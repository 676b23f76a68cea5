/*
 * embed_py.c - binding of the embed family (an embedding table's gradient
 * added into an existing gradient, csrc/embed/): one SF_PY_OP line (py_call.h).
 */
#include "py_call.h"

SF_PY_OP(embedding_backward_add, sf_embedding_backward_add,
         "dweight[id] += the summed rows of dy whose index is id (sorted_ids, order: a stable sort of the ids).",
         (T, dy), (T, sorted_ids), (T, order), (INT64, padding_idx), (T, dweight));

const sf_py_binding *const sf_py_embed_bindings[] = {&embedding_backward_add_binding, NULL};
