/*
 * moe_py.c - bindings of the moe family (router and token permutation,
 * csrc/moe/).  seqfuse.ops.moe holds the Python-facing ops; these are their
 * thin positional METH_FASTCALL doors, one per sf_moe_* function, each
 * with the argument order of the C function and an optional stream last.
 */
#include "py_call.h"  /* Python.h first, as CPython asks */

#include <limits.h>

/* Read the int / float arguments named in `names` at args[idx[i]]. */
static int read_longs(const char *op, PyObject *const *args, int n, const int *idx,
                      const char *const *names, long *out)
{
    for (int i = 0; i < n; ++i)
        if (sf_py_arg_long(op, names[i], args[idx[i]], &out[i]) < 0)
            return -1;
    return 0;
}

/* The C entries take these as int: a value past INT_MAX / INT_MIN would wrap in the cast. */
static int check_int_range(const char *op, const char *const *names, const long *v, int n)
{
    for (int i = 0; i < n; ++i)
        if (v[i] > INT_MAX || v[i] < INT_MIN) {
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' must fit in a C int, got %ld", op, names[i], v[i]);
            return -1;
        }
    return 0;
}

/* moe_topk_fwd(logits, topk, score, pre_softmax, scaling, expert_bias, probs, routing_map,
 *              saved, stream=None) */
static PyObject *py_topk_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_topk_fwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "logits", 0}, {5, "expert_bias", 1}, {6, "probs", 0}, {7, "routing_map", 0}, {8, "saved", 0}};
    static const int idx[] = {1, 2, 3};
    static const char *const names[] = {"topk", "score_function", "pre_softmax"};
    long v[3];
    float scaling;
    if (sf_py_check_nargs(op, nargs, 9, 10) < 0 || read_longs(op, args, 3, idx, names, v) < 0 ||
        sf_py_arg_float(op, "scaling_factor", args[4], &scaling) < 0)
        return NULL;
    if (check_int_range(op, names, v, 3) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 9, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_topk_fwd(a.t[0], (int)v[0], (sf_moe_score)v[1], (int)v[2], scaling, a.t[1], a.t[2],
                         a.t[3], a.t[4], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_topk_bwd(routing_map, saved, dprobs, topk, score, pre_softmax, scaling, dlogits,
 *              stream=None) */
static PyObject *py_topk_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_topk_bwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "routing_map", 0}, {1, "saved", 0}, {2, "dprobs", 0}, {7, "dlogits", 0}};
    static const int idx[] = {3, 4, 5};
    static const char *const names[] = {"topk", "score_function", "pre_softmax"};
    long v[3];
    float scaling;
    if (sf_py_check_nargs(op, nargs, 8, 9) < 0 || read_longs(op, args, 3, idx, names, v) < 0 ||
        sf_py_arg_float(op, "scaling_factor", args[6], &scaling) < 0)
        return NULL;
    if (check_int_range(op, names, v, 3) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 8, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_topk_bwd(a.t[0], a.t[1], a.t[2], (int)v[0], (sf_moe_score)v[1], (int)v[2], scaling,
                         a.t[3], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_aux_scores_fwd(logits, topk, score, scores, routing_map, saved, stream=None) */
static PyObject *py_aux_scores_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_aux_scores_fwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "logits", 0}, {3, "scores", 0}, {4, "routing_map", 0}, {5, "saved", 0}};
    static const int idx[] = {1, 2};
    static const char *const names[] = {"topk", "score_function"};
    long v[2];
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0 || read_longs(op, args, 2, idx, names, v) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 6, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_aux_scores_fwd(a.t[0], (int)v[0], (sf_moe_score)v[1], a.t[1], a.t[2], a.t[3],
                               sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_aux_scores_bwd(saved, dscores, score, dlogits, stream=None) */
static PyObject *py_aux_scores_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_aux_scores_bwd";
    static const sf_py_tensor_arg spec[] = {{0, "saved", 0}, {1, "dscores", 0}, {3, "dlogits", 0}};
    long score;
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0 ||
        sf_py_arg_long(op, "score_function", args[2], &score) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 4, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_aux_scores_bwd(a.t[0], a.t[1], (sf_moe_score)score, a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_aux_loss_fwd(probs, tokens_per_expert, total_tokens, topk, coeff, loss, stream=None)
 * moe_aux_loss_bwd(dloss, tokens_per_expert, total_tokens, topk, coeff, dprobs, stream=None) */
static PyObject *aux_loss(PyObject *const *args, Py_ssize_t nargs, int backward)
{
    const char *op = backward ? "moe_aux_loss_bwd" : "moe_aux_loss_fwd";
    static const sf_py_tensor_arg spec_f[] = {{0, "probs", 0}, {1, "tokens_per_expert", 0}, {5, "loss", 0}};
    static const sf_py_tensor_arg spec_b[] = {{0, "dloss", 0}, {1, "tokens_per_expert", 0}, {5, "dprobs", 0}};
    long total, topk;
    float coeff;
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0 ||
        sf_py_arg_long(op, "total_num_tokens", args[2], &total) < 0 ||
        sf_py_arg_long(op, "topk", args[3], &topk) < 0 ||
        sf_py_arg_float(op, "coeff", args[4], &coeff) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 6, backward ? spec_b : spec_f, 3) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    if (backward)
        st = sf_moe_aux_loss_bwd(a.t[0], a.t[1], total, (int)topk, coeff, a.t[2], sf_py_call_stream(&a.call));
    else
        st = sf_moe_aux_loss_fwd(a.t[0], a.t[1], total, (int)topk, coeff, a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

static PyObject *py_aux_loss_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return aux_loss(args, nargs, 0);
}

static PyObject *py_aux_loss_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return aux_loss(args, nargs, 1);
}

/* moe_z_loss_fwd(logits, coeff, loss, lse, stream=None) */
static PyObject *py_z_loss_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_z_loss_fwd";
    static const sf_py_tensor_arg spec[] = {{0, "logits", 0}, {2, "loss", 0}, {3, "lse", 0}};
    float coeff;
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0 || sf_py_arg_float(op, "coeff", args[1], &coeff) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 4, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_z_loss_fwd(a.t[0], coeff, a.t[1], a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_z_loss_bwd(logits, lse, dloss, coeff, dlogits, stream=None) */
static PyObject *py_z_loss_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_z_loss_bwd";
    static const sf_py_tensor_arg spec[] = {{0, "logits", 0}, {1, "lse", 0}, {2, "dloss", 0}, {4, "dlogits", 0}};
    float coeff;
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0 || sf_py_arg_float(op, "coeff", args[3], &coeff) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 5, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_z_loss_bwd(a.t[0], a.t[1], a.t[2], coeff, a.t[3], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_row_id_map(routing_map, row_id_map, tokens_per_expert, stream=None) */
static PyObject *py_row_id_map(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_row_id_map";
    static const sf_py_tensor_arg spec[] = {{0, "routing_map", 0}, {1, "row_id_map", 0}, {2, "tokens_per_expert", 0}};
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 3, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_row_id_map(a.t[0], a.t[1], a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_permute(inp, row_id_map, probs, out, out_probs, stream=None) */
static PyObject *py_permute(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_permute";
    static const sf_py_tensor_arg spec[] = {
        {0, "inp", 0}, {1, "row_id_map", 0}, {2, "probs", 1}, {3, "out", 0}, {4, "out_probs", 1}};
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 5, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_permute(a.t[0], a.t[1], a.t[2], a.t[3], a.t[4], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_unpermute(inp, row_id_map, probs, out, stream=None) */
static PyObject *py_unpermute(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_unpermute";
    static const sf_py_tensor_arg spec[] = {{0, "inp", 0}, {1, "row_id_map", 0}, {2, "probs", 1}, {3, "out", 0}};
    if (sf_py_check_nargs(op, nargs, 4, 5) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 4, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_unpermute(a.t[0], a.t[1], a.t[2], a.t[3], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_unpermute_bwd(dout, inp, row_id_map, probs, dinp, dprobs, stream=None) */
static PyObject *py_unpermute_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_unpermute_bwd";
    static const sf_py_tensor_arg spec[] = {{0, "dout", 0}, {1, "inp", 1},  {2, "row_id_map", 0},
                                            {3, "probs", 1}, {4, "dinp", 0}, {5, "dprobs", 1}};
    if (sf_py_check_nargs(op, nargs, 6, 7) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 6, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_unpermute_bwd(a.t[0], a.t[1], a.t[2], a.t[3], a.t[4], a.t[5], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_permute_probs_bwd(row_id_map, dout_probs, dprobs, stream=None) */
static PyObject *py_permute_probs_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_permute_probs_bwd";
    static const sf_py_tensor_arg spec[] = {{0, "row_id_map", 0}, {1, "dout_probs", 0}, {2, "dprobs", 0}};
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 3, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_permute_probs_bwd(a.t[0], a.t[1], a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_swiglu_fwd(x, probs, out, stream=None) */
static PyObject *py_swiglu_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_swiglu_fwd";
    static const sf_py_tensor_arg spec[] = {{0, "x", 0}, {1, "probs", 1}, {2, "out", 0}};
    if (sf_py_check_nargs(op, nargs, 3, 4) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 3, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_swiglu_fwd(a.t[0], a.t[1], a.t[2], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

/* moe_swiglu_bwd(dout, x, probs, dx, dprobs, stream=None) */
static PyObject *py_swiglu_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    static const char op[] = "moe_swiglu_bwd";
    static const sf_py_tensor_arg spec[] = {
        {0, "dout", 0}, {1, "x", 0}, {2, "probs", 1}, {3, "dx", 0}, {4, "dprobs", 1}};
    if (sf_py_check_nargs(op, nargs, 5, 6) < 0)
        return NULL;
    sf_py_args a;
    if (sf_py_begin(&a, op, args, nargs, 5, spec, SF_PY_NARGS(spec)) < 0)
        return NULL;
    sf_status st;
    Py_BEGIN_ALLOW_THREADS
    st = sf_moe_swiglu_bwd(a.t[0], a.t[1], a.t[2], a.t[3], a.t[4], sf_py_call_stream(&a.call));
    Py_END_ALLOW_THREADS
    return sf_py_finish(&a.call, st);
}

PyMethodDef sf_py_moe_methods[] = {
    {"moe_swiglu_fwd", SF_PY_FASTCALL(py_swiglu_fwd), "SwiGLU scaled by routing probabilities."},
    {"moe_swiglu_bwd", SF_PY_FASTCALL(py_swiglu_bwd), "Backward of moe_swiglu_fwd."},
    {"moe_topk_fwd", SF_PY_FASTCALL(py_topk_fwd), "Router top-k forward. See seqfuse.ops.moe."},
    {"moe_topk_bwd", SF_PY_FASTCALL(py_topk_bwd), "Router top-k backward. See seqfuse.ops.moe."},
    {"moe_aux_scores_fwd", SF_PY_FASTCALL(py_aux_scores_fwd), "Aux-loss scores forward."},
    {"moe_aux_scores_bwd", SF_PY_FASTCALL(py_aux_scores_bwd), "Aux-loss scores backward."},
    {"moe_aux_loss_fwd", SF_PY_FASTCALL(py_aux_loss_fwd), "Load-balancing loss forward."},
    {"moe_aux_loss_bwd", SF_PY_FASTCALL(py_aux_loss_bwd), "Load-balancing loss backward."},
    {"moe_z_loss_fwd", SF_PY_FASTCALL(py_z_loss_fwd), "Router z-loss forward."},
    {"moe_z_loss_bwd", SF_PY_FASTCALL(py_z_loss_bwd), "Router z-loss backward."},
    {"moe_row_id_map", SF_PY_FASTCALL(py_row_id_map), "Rows of the expert-sorted buffer."},
    {"moe_permute", SF_PY_FASTCALL(py_permute), "Tokens into the expert-sorted buffer."},
    {"moe_unpermute", SF_PY_FASTCALL(py_unpermute), "Expert outputs back to tokens, weighted."},
    {"moe_unpermute_bwd", SF_PY_FASTCALL(py_unpermute_bwd), "Backward of moe_unpermute."},
    {"moe_permute_probs_bwd", SF_PY_FASTCALL(py_permute_probs_bwd), "Backward of the permuted probs."},
    {NULL, NULL, 0, NULL},
};
