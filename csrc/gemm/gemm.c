/*
 * gemm.c - sf_gemm, the public entry: checks every precondition once (dtypes,
 * shapes, layouts, the FP8 rules cuBLASLt imposes, epilogue operands), folds
 * the operands into row-major storage + transpose flags (sf_gemm_problem),
 * then dispatches to the CPU reference or cuBLASLt.  Both backends therefore
 * accept and reject exactly the same calls with the same messages.
 *
 * File shape (README, Layout): the family's, except that gemm has no
 * kernels of its own: gemm_cuda.cu is host code that plans and runs
 * cuBLASLt, and gemm.h's math is the epilogue cuBLASLt applies (tanh-GELU
 * and its derivative) and the FP8 decoders, there so that the CPU
 * reference (gemm_cpu.c) computes what cuBLASLt does.  The standalone check
 * is named after the library it exercises: check_cublaslt.cu.
 */
#include <string.h>

#include "../core/dispatch.h"
#include "gemm.h"
#include "gemm_backend.h"

static const char OP[] = "gemm";

void sf_gemm_args_init(sf_gemm_args *args)
{
    memset(args, 0, sizeof *args);
    args->epilogue = SF_GEMM_EPI_NONE;
    args->alpha = 1.0f;
    args->allow_tf32 = 1;
}

/* Fold a 2-D view into row-major storage.  A column-major view (unit stride
 * along dim 0) is the row-major storage of its transpose, so it flips the
 * transpose flag.  Size-1 dimensions may carry any stride. */
static sf_status fold_operand(const char *arg, const sf_tensor *t, int trans,
                              sf_gemm_operand *o)
{
    if (t->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 2-D, got %d dimension(s)",
                       OP, arg, t->ndim);
    int64_t r = t->shape[0], c = t->shape[1], s0 = t->strides[0], s1 = t->strides[1];
    o->data = t->data;
    o->dtype = t->dtype;
    if ((c == 1 || s1 == 1) && (r == 1 || s0 >= c)) {
        o->rows = r;
        o->cols = c;
        o->ld = r == 1 ? (c > 0 ? c : 1) : s0;
        o->trans = trans;
    } else if ((r == 1 || s0 == 1) && (c == 1 || s1 >= r)) {
        o->rows = c;
        o->cols = r;
        o->ld = c == 1 ? (r > 0 ? r : 1) : s1;
        o->trans = !trans;
    } else {
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be row- or column-major (a unit stride in "
                       "one dimension, the other at least the row length); got shape "
                       "[%lld, %lld] with strides (%lld, %lld): call .contiguous() first",
                       OP, arg, (long long)r, (long long)c, (long long)s0, (long long)s1);
    }
    if (o->ld < 1)
        o->ld = 1;
    return SF_OK;
}

/* out and aux: row-major [m, n], leading dimension returned in *ld. */
static sf_status check_matrix_out(const char *arg, const sf_tensor *t, int64_t m,
                                  int64_t n, int64_t *ld)
{
    if (t->ndim != 2 || t->shape[0] != m || t->shape[1] != n)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have shape [m, n] = [%lld, %lld]",
                       OP, arg, (long long)m, (long long)n);
    if (!(n == 1 || t->strides[1] == 1) || !(m == 1 || t->strides[0] >= n))
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be row-major (unit stride along n, row "
                       "stride >= n); got strides (%lld, %lld)",
                       OP, arg, (long long)t->strides[0], (long long)t->strides[1]);
    *ld = m == 1 ? n : t->strides[0];
    return SF_OK;
}

static sf_status check_vector(const char *arg, const sf_tensor *t, int64_t len)
{
    if (t->ndim != 1 || t->shape[0] != len)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be 1-D of length %lld", OP, arg,
                       (long long)len);
    if (len > 1 && t->strides[0] != 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be contiguous", OP, arg);
    return SF_OK;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The scale-inverse tensor of an FP8 operand stored K-major as [rows, k].
 * On CUDA 16-byte aligned like the operands: cuBLASLt (13.x, H200) answers a
 * scale pointer at a 4-byte offset with CUBLAS_STATUS_NOT_SUPPORTED.  The CPU
 * backend reads any float. */
static sf_status check_scale(const char *arg, const sf_tensor *s, sf_gemm_scaling mode,
                             int64_t rows, int64_t k)
{
    SF_TRY(sf_check_dtype(OP, arg, s, SF_FLOAT32));
    SF_TRY(sf_check_contiguous(OP, arg, s));
    if (s->device == SF_CUDA)
        SF_TRY(sf_check_aligned(OP, arg, s, 16));
    switch (mode) {
    case SF_GEMM_SCALE_TENSOR:
        return sf_check_numel(OP, arg, s, 1);
    case SF_GEMM_SCALE_BLOCK_1X128: {
        int64_t kb = ceil_div(k, 128);
        if (s->ndim != 2 || s->shape[0] != kb || s->shape[1] != rows)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' (1x128 block scales) must have shape "
                           "[ceil(k/128), rows] = [%lld, %lld]",
                           OP, arg, (long long)kb, (long long)rows);
        return SF_OK;
    }
    case SF_GEMM_SCALE_BLOCK_128X128: {
        int64_t rb = ceil_div(rows, 128), kb4 = ceil_div(ceil_div(k, 128), 4) * 4;
        if (s->ndim != 2 || s->shape[0] != rb || s->shape[1] != kb4)
            return sf_fail(SF_ERR_VALUE,
                           "%s: argument '%s' (128x128 block scales) must have shape "
                           "[ceil(rows/128), roundup(ceil(k/128), 4)] = [%lld, %lld]",
                           OP, arg, (long long)rb, (long long)kb4);
        return SF_OK;
    }
    default:
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s': unknown scaling mode %d", OP, arg,
                       (int)mode);
    }
}

static sf_status check_operand_dtypes(const sf_gemm_args *g)
{
    sf_dtype da = g->a->dtype, db = g->b->dtype;
    int fa = sf_gemm_is_fp8(da), fb = sf_gemm_is_fp8(db);
    if (!fa && da != SF_FLOAT32 && da != SF_FLOAT16 && da != SF_BFLOAT16)
        return sf_fail(SF_ERR_TYPE,
                       "%s: argument 'a' must have dtype float32, float16, bfloat16, "
                       "float8_e4m3fn or float8_e5m2, got %s",
                       OP, sf_dtype_name(da));
    if (!fb && db != SF_FLOAT32 && db != SF_FLOAT16 && db != SF_BFLOAT16)
        return sf_fail(SF_ERR_TYPE,
                       "%s: argument 'b' must have dtype float32, float16, bfloat16, "
                       "float8_e4m3fn or float8_e5m2, got %s",
                       OP, sf_dtype_name(db));
    if (fa != fb || (!fa && da != db))
        return sf_fail(SF_ERR_TYPE,
                       "%s: arguments 'a' (%s) and 'b' (%s) must have the same dtype, or "
                       "both be float8 (quantize the other operand first)",
                       OP, sf_dtype_name(da), sf_dtype_name(db));
    if (fa && da == SF_FLOAT8_E5M2 && db == SF_FLOAT8_E5M2)
        return sf_fail(SF_ERR_TYPE,
                       "%s: float8_e5m2 x float8_e5m2 is not supported (cuBLASLt has no "
                       "such kernel); keep one operand float8_e4m3fn",
                       OP);
    sf_dtype o = g->out->dtype;
    if (fa) {
        if (o != SF_BFLOAT16 && o != SF_FLOAT16 && o != SF_FLOAT32)
            return sf_fail(SF_ERR_TYPE,
                           "%s: argument 'out' must have dtype bfloat16, float16 or float32 "
                           "for float8 operands, got %s",
                           OP, sf_dtype_name(o));
    } else if (o != da && o != SF_FLOAT32) {
        return sf_fail(SF_ERR_TYPE,
                       "%s: argument 'out' must have dtype %s (the operands') or float32, got %s",
                       OP, sf_dtype_name(da), sf_dtype_name(o));
    }
    return SF_OK;
}

/* The FP8 operands' layout rules (cuBLASLt's): K-major operands, dimensions and
 * row strides in multiples of 16, 16-byte alignment. */
static sf_status check_fp8_layout(const sf_gemm_args *g, const sf_gemm_problem *p)
{
    /* K-major: a stored [m, k] (not transposed), b stored [n, k] (transposed). */
    if (p->a.trans || !p->b.trans)
        return sf_fail(SF_ERR_VALUE,
                       "%s: float8 operands must both be K-major (cuBLASLt on Hopper takes "
                       "only the 'TN' layout): pass a as [m, k] with unit stride along k "
                       "(transa=False) and b as [n, k] with unit stride along k "
                       "(transb=True); got %s a and %s b (a Float8Tensor's data_t holds the "
                       "transposed copy)",
                       OP, p->a.trans ? "a k-strided" : "a K-major",
                       p->b.trans ? "a K-major" : "a n-major (k-strided)");
    const char *names[3] = {"m", "n", "k"};
    int64_t dims[3] = {p->m, p->n, p->k};
    const char *where[3] = {"rows of op(a)", "columns of op(b)", "the inner dimension"};
    for (int i = 0; i < 3; ++i)
        if (dims[i] % 16 != 0)
            return sf_fail(SF_ERR_VALUE,
                           "%s: float8 operands need m, n and k to be multiples of 16 "
                           "(cuBLASLt's FP8 kernels); got %s = %lld (%s); pad it to %lld",
                           OP, names[i], (long long)dims[i], where[i],
                           (long long)(ceil_div(dims[i], 16) * 16));
    if (p->a.ld % 16 != 0 || p->b.ld % 16 != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: float8 operands need row strides that are multiples of 16; got "
                       "%lld for 'a' and %lld for 'b'",
                       OP, (long long)p->a.ld, (long long)p->b.ld);
    if ((p->ld_out * (int64_t)sf_dtype_size(p->out_dtype)) % 16 != 0)
        return sf_fail(SF_ERR_VALUE,
                       "%s: with float8 operands the row stride of 'out' must be a multiple "
                       "of 16 bytes; got %lld elements",
                       OP, (long long)p->ld_out);
    SF_TRY(sf_check_aligned(OP, "a", g->a, 16));
    SF_TRY(sf_check_aligned(OP, "b", g->b, 16));
    SF_TRY(sf_check_aligned(OP, "out", g->out, 16));
    return SF_OK;
}

/* The FP8 GEMM's rules: the layout (check_fp8_layout; not for an empty
 * product, of which nothing is read), then the scales. */
static sf_status check_fp8_rules(const sf_gemm_args *g, const sf_gemm_problem *p, int empty)
{
    if (!empty)
        SF_TRY(check_fp8_layout(g, p));
    if (!g->a_scale_inv || !g->b_scale_inv)
        return sf_fail(SF_ERR_VALUE,
                       "%s: float8 operands need 'a_scale_inv' and 'b_scale_inv' (float32 "
                       "scale inverses on the device)",
                       OP);
    sf_gemm_scaling sa = g->a_scaling, sb = g->b_scaling;
    if (sa == SF_GEMM_SCALE_NONE || sb == SF_GEMM_SCALE_NONE)
        return sf_fail(SF_ERR_VALUE, "%s: float8 operands need a scaling mode for both a and b",
                       OP);
    int block_a = sa != SF_GEMM_SCALE_TENSOR, block_b = sb != SF_GEMM_SCALE_TENSOR;
    if (block_a != block_b)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                       "%s: a per-tensor scaled operand cannot meet a block scaled one "
                       "(a: %s, b: %s); quantize both the same way",
                       OP, sf_gemm_scaling_name(sa), sf_gemm_scaling_name(sb));
    if (sa == SF_GEMM_SCALE_BLOCK_128X128 && sb == SF_GEMM_SCALE_BLOCK_128X128)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                       "%s: 128x128 block scales on both operands are not supported by "
                       "cuBLASLt; quantize one of them (the activation or gradient) 1x128",
                       OP);
    if (block_a && g->fast_accum)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                       "%s: fast_accum is not available with block scales (cuBLASLt "
                       "promotes to fp32 at every 128-wide block); pass fast_accum=False",
                       OP);
    SF_TRY(check_scale("a_scale_inv", g->a_scale_inv, sa, p->m, p->k));
    SF_TRY(check_scale("b_scale_inv", g->b_scale_inv, sb, p->n, p->k));
    SF_TRY(sf_check_same_device(OP, "a", g->a, "a_scale_inv", g->a_scale_inv));
    SF_TRY(sf_check_same_device(OP, "a", g->a, "b_scale_inv", g->b_scale_inv));
    return SF_OK;
}

static sf_status check_epilogue(const sf_gemm_args *g, sf_gemm_problem *p, int fp8)
{
    sf_gemm_epilogue e = g->epilogue;
    if ((int)e < 0 || e >= SF_GEMM_EPI_COUNT)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'epilogue': unknown value %d", OP, (int)e);
    int bias_use = sf_gemm_epi_bias_use(e), aux_use = sf_gemm_epi_aux_use(e);
    if (!bias_use && g->bias)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'bias' given but epilogue '%s' takes none",
                       OP, sf_gemm_epi_name(e));
    if (!aux_use && g->aux)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'aux' given but epilogue '%s' takes none",
                       OP, sf_gemm_epi_name(e));
    if (bias_use) {
        if (!g->bias)
            return sf_fail(SF_ERR_VALUE, "%s: epilogue '%s' needs argument 'bias'%s", OP,
                           sf_gemm_epi_name(e), bias_use == 2 ? " (its output)" : "");
        int64_t len = e == SF_GEMM_EPI_BGRAD ? p->m : p->n;
        SF_TRY(check_vector("bias", g->bias, len));
        sf_dtype want = p->out_dtype;
        if (fp8)
            want = p->out_dtype == SF_FLOAT16 ? SF_FLOAT16 : SF_BFLOAT16;
        SF_TRY(sf_check_dtype(OP, "bias", g->bias, want));
        SF_TRY(sf_check_same_device(OP, "a", g->a, "bias", g->bias));
        if (bias_use == 2)
            SF_TRY(sf_check_writable(OP, "bias", g->bias));
        p->bias = g->bias->data;
        p->bias_dtype = g->bias->dtype;
    }
    if (aux_use) {
        if (!g->aux)
            return sf_fail(SF_ERR_VALUE, "%s: epilogue '%s' needs argument 'aux' (%s)", OP,
                           sf_gemm_epi_name(e),
                           aux_use == 1 ? "the pre-GELU output" : "the saved pre-GELU input");
        SF_TRY(check_matrix_out("aux", g->aux, p->m, p->n, &p->ld_aux));
        sf_dtype want = fp8 && p->out_dtype == SF_FLOAT32 ? SF_BFLOAT16 : p->out_dtype;
        SF_TRY(sf_check_dtype(OP, "aux", g->aux, want));
        SF_TRY(sf_check_same_device(OP, "a", g->a, "aux", g->aux));
        if (aux_use == 1)
            SF_TRY(sf_check_writable(OP, "aux", g->aux));
        if (g->a->device == SF_CUDA && p->ld_aux % 8 != 0)
            return sf_fail(SF_ERR_VALUE,
                           "%s: the row stride of 'aux' must be a multiple of 8 elements "
                           "(cuBLASLt's GELU epilogues), got %lld",
                           OP, (long long)p->ld_aux);
        p->aux = g->aux->data;
        p->aux_dtype = g->aux->dtype;
    }
    return SF_OK;
}

/* The addend c (out = ... + c): out's shape, dtype, device and row stride
 * (one layout for C and D in the plan), 16-byte aligned like out for FP8,
 * and none of out's memory (out's own values are `accumulate`'s). */
static sf_status check_addend(const sf_gemm_args *g, sf_gemm_problem *p, int fp8)
{
    const sf_tensor *c = g->addend;
    if (g->accumulate)
        return sf_fail(SF_ERR_VALUE,
                       "%s: arguments 'accumulate' and 'addend' exclude each other (accumulate "
                       "adds out's own values; addend adds another tensor's)",
                       OP);
    int64_t ld = 0;
    SF_TRY(check_matrix_out("addend", c, p->m, p->n, &ld));
    SF_TRY(sf_check_dtype(OP, "addend", c, p->out_dtype));
    SF_TRY(sf_check_same_device(OP, "out", g->out, "addend", c));
    if (ld != p->ld_out) /* (both are n at m == 1: check_matrix_out) */
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument 'addend' must have out's row stride (%lld elements), got "
                       "%lld",
                       OP, (long long)p->ld_out, (long long)ld);
    if (fp8)
        SF_TRY(sf_check_aligned(OP, "addend", c, 16));
    if (sf_tensors_overlap(c, g->out))
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument 'addend' shares memory with 'out' (the GEMM reads the "
                       "addend while it writes out); to add out's own values pass "
                       "accumulate=True",
                       OP);
    /* nor memory the epilogue writes (gelu_aux's aux, a bias gradient) */
    const sf_tensor *written[2] = {sf_gemm_epi_aux_use(p->epilogue) == 1 ? g->aux : NULL,
                                   sf_gemm_epi_bias_use(p->epilogue) == 2 ? g->bias : NULL};
    for (int i = 0; i < 2; ++i)
        if (written[i] && sf_tensors_overlap(c, written[i]))
            return sf_fail(SF_ERR_VALUE, "%s: argument 'addend' shares memory with '%s', which the "
                           "epilogue writes", OP, i == 0 ? "aux" : "bias");
    p->c = c->data;
    p->accumulate = 1; /* beta = 1, read from c */
    return SF_OK;
}

/* Every rule of the call, folded into *pp; *empty when m, n or k is 0. */
static sf_status prepare(const sf_gemm_args *g, sf_gemm_problem *pp, int *empty_out)
{
    if (!g || !g->a || !g->b || !g->out)
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'a', 'b' and 'out' are required", OP);
    sf_gemm_problem p;
    memset(&p, 0, sizeof p);
    SF_TRY(check_operand_dtypes(g));
    SF_TRY(fold_operand("a", g->a, g->transa != 0, &p.a));
    SF_TRY(fold_operand("b", g->b, g->transb != 0, &p.b));
    p.m = p.a.trans ? p.a.cols : p.a.rows;
    p.k = p.a.trans ? p.a.rows : p.a.cols;
    int64_t kb = p.b.trans ? p.b.cols : p.b.rows;
    p.n = p.b.trans ? p.b.rows : p.b.cols;
    if (kb != p.k)
        return sf_fail(SF_ERR_VALUE,
                       "%s: inner dimensions differ: op(a) is [%lld, %lld] but op(b) is "
                       "[%lld, %lld] (check transa/transb)",
                       OP, (long long)p.m, (long long)p.k, (long long)kb, (long long)p.n);
    /* an empty product (m, n or k of 0) gets every check below, then returns without a launch:
     * cuBLASLt takes no such problem, and seqfuse.ops.gemm computes its answer (zeros through the
     * epilogue) itself */
    const int empty = p.m < 1 || p.n < 1 || p.k < 1;
    SF_TRY(sf_check_same_device(OP, "a", g->a, "b", g->b));
    SF_TRY(sf_check_same_device(OP, "a", g->a, "out", g->out));
    SF_TRY(sf_check_writable(OP, "out", g->out));
    SF_TRY(check_matrix_out("out", g->out, p.m, p.n, &p.ld_out));
    p.out = g->out->data;
    p.out_dtype = g->out->dtype;

    int fp8 = sf_gemm_is_fp8(g->a->dtype);
    if (fp8) {
        SF_TRY(check_fp8_rules(g, &p, empty));
        p.a_scale = (const float *)g->a_scale_inv->data;
        p.b_scale = (const float *)g->b_scale_inv->data;
        p.a_scaling = g->a_scaling;
        p.b_scaling = g->b_scaling;
    } else if (g->a_scale_inv || g->b_scale_inv || g->a_scaling || g->b_scaling) {
        return sf_fail(SF_ERR_VALUE,
                       "%s: scale inverses and scaling modes apply to float8 operands only "
                       "(a and b are %s)",
                       OP, sf_dtype_name(g->a->dtype));
    } else if (g->fast_accum) {
        return sf_fail(SF_ERR_VALUE, "%s: fast_accum applies to float8 operands only", OP);
    }
    SF_TRY(check_epilogue(g, &p, fp8));
    p.epilogue = g->epilogue;
    p.accumulate = g->accumulate != 0;
    p.c = p.out; /* beta's operand: out's own values, or check_addend's tensor */
    if (g->addend)
        SF_TRY(check_addend(g, &p, fp8));
    p.fast_accum = g->fast_accum != 0;
    p.allow_tf32 = g->allow_tf32 != 0;
    p.alpha = g->alpha;
    p.device_id = g->a->device_id;
    if (g->sm_count_target < 0)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'sm_count_target' must be >= 0 (0: the device's "
                       "SMs), got %d", OP, g->sm_count_target);
    p.sm_count_target = g->sm_count_target;

    if (g->workspace) {
        if (g->workspace->dtype != SF_UINT8 || g->workspace->ndim != 1 ||
            !sf_is_contiguous(g->workspace))
            return sf_fail(SF_ERR_TYPE,
                           "%s: argument 'workspace' must be a contiguous 1-D uint8 tensor",
                           OP);
        SF_TRY(sf_check_same_device(OP, "a", g->a, "workspace", g->workspace));
        SF_TRY(sf_check_writable(OP, "workspace", g->workspace));
        p.workspace = g->workspace->data;
        p.workspace_bytes = (size_t)g->workspace->shape[0];
    }

    *pp = p;
    *empty_out = empty;
    return SF_OK;
}

sf_status sf_gemm_validate(const sf_gemm_args *g)
{
    sf_gemm_problem p;
    int empty;
    return prepare(g, &p, &empty);
}

sf_status sf_gemm(const sf_gemm_args *g, sf_stream stream)
{
    sf_gemm_problem p;
    int empty;
    SF_TRY(prepare(g, &p, &empty));
    if (empty)
        return SF_OK;
    return SF_DISPATCH(OP, "a", g->a, sf_gemm_cpu(&p), sf_gemm_cuda(&p, stream));
}

sf_status sf_gemm_tune(const sf_gemm_args *g, int candidates, sf_tensor *timings, sf_stream stream)
{
    static const char op[] = "gemm_tune";
    if (candidates < 1 || candidates > 16)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'candidates' must be within 1..16, got %d", op, candidates);
    if (!timings || timings->dtype != SF_FLOAT32)
        return sf_fail(SF_ERR_TYPE, "%s: argument 'timings' must be a float32 tensor", op);
    if (sf_numel(timings) != 3 || !sf_is_contiguous(timings) || timings->device != SF_CPU)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'timings' must be a contiguous tensor of 3 elements on the "
                       "CPU (host memory the call writes)", op);
    SF_TRY(sf_check_writable(op, "timings", timings));
    sf_gemm_problem p;
    int empty;
    SF_TRY(prepare(g, &p, &empty));
    float *t = (float *)timings->data;
    t[0] = t[1] = t[2] = -1.0f;
    if (empty)
        return SF_OK;
    return SF_DISPATCH(op, "a", g->a, SF_OK, sf_gemm_tune_cuda(&p, candidates, t, stream));
}

#ifndef SF_WITH_CUDA
/* CPU-only builds: the plan cache does not exist. */
int sf_gemm_plan_cache_size(void) { return 0; }
void sf_gemm_plan_cache_clear(void) {}
int64_t sf_gemm_heuristic_queries(void) { return 0; }
#endif
