/*
 * grouped.c - sf_grouped_gemm, the experts' GEMMs in one call.
 *
 * The entry checks what is the grouped call's own (the group count, the row
 * counts, which operands are split and that their rows add up, the per-group
 * scale inverses), computes the row offsets once, then runs one sf_gemm per
 * group on sub-views: a split operand's group g is its rows
 * [offset_g, offset_g + m_splits[g]) with the parent's strides, a listed
 * operand's group g is its g-th view.  sf_gemm validates each group's
 * product (dtypes, shapes, layouts, FP8 rules) and runs the CPU reference or
 * cuBLASLt, so the grouped GEMM is exactly the per-group GEMM, bit for bit
 * on the CPU.  A failing group's message is prefixed with its index.
 *
 * Groups with no rows: nothing to compute when the rows are out's rows; when
 * they are the inner dimension (the weight gradient dW_g = dy_g^T x_g of an
 * expert that received no tokens), out_g is zero (kept when accumulating)
 * and a bias gradient is zero.  sf_gemm takes no empty product, so these are
 * written here.  Each group's m, n and k come from its views, so this holds
 * as well when every operand is a list (the FP8 weight gradient, whose
 * operands are the per-expert transposed copies).
 *
 * The sm90 kernel (grouped_sm90_cuda.cu, its entry points declared in
 * grouped_sm90.h; args->kernel AUTO or SM90): on a
 * Hopper GPU the forward form (a and out split, b listed, transb) runs as
 * one persistent launch over every group's output tiles instead of a
 * cuBLASLt call per group; each group is first held to sf_gemm's rules
 * (sf_gemm_validate), so a bad group is refused with the same message on
 * either route.  try_sm90 below decides; under AUTO a call the kernel
 * cannot take goes on to cuBLASLt with the reason in args->kernel_note
 * (the binding returns it, and ops.moe logs it once).
 *
 * File shape (README, Layout): the grouped family has no math header and
 * no CPU reference file of its own: on the CPU each group's product is an
 * sf_gemm call (the gemm family's reference), and the empty groups are
 * cleared here with memset on the CPU and by grouped_cuda.cu
 * (cudaMemset2DAsync, declared in grouped_backend.h) on the GPU.  Its one
 * check program, check_sm90.cu, holds the sm90 kernel to a float64
 * reference and times it against the cuBLASLt route.  With
 * args->lanes >= 2, or 0 and the rule in grouped_cuda.cu, the CUDA groups
 * run on side streams (grouped_cuda.cu's lanes), each group on the lane
 * with the least work (m n k) issued so far, each lane with its own share
 * of the workspace and, when the groups fit side by side, of the SMs
 * (sf_gemm's sm_count_target).
 * tests/test_moe_grouped_gemm.py compares the two backends.
 *
 * sf_grouped_gemm_device_ends (at the end): the forward product with the
 * groups' ends in a tensor; on CUDA the sm90 kernel reads them on the
 * device (its only route there), on the CPU they are read here and the
 * groups go through sf_grouped_gemm.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/dispatch.h"
#include "../core/float_io.h"
#include "grouped_backend.h"
#include "grouped_sm90.h"

static const char OP[] = "grouped_gemm";

void sf_grouped_gemm_args_init(sf_grouped_gemm_args *args)
{
    memset(args, 0, sizeof *args);
    args->allow_tf32 = 1;
}

/* Exactly one of `split` and `list` is given; a split one is 2-D with
 * `total` rows. */
static sf_status check_form(const char *name, const sf_tensor *split, const sf_tensor *list,
                            int64_t total)
{
    if ((split != NULL) == (list != NULL))
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must be given either as one tensor split by m_splits "
                       "or as a list of num_groups tensors (exactly one of the two)",
                       OP, name);
    if (!split)
        return SF_OK;
    if (split->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' (split by m_splits) must be 2-D, got %d "
                       "dimension(s)", OP, name, split->ndim);
    if (split->shape[0] != total)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' is split by m_splits along dim 0, so it must have "
                       "sum(m_splits) = %lld rows, got %lld",
                       OP, name, (long long)total, (long long)split->shape[0]);
    return SF_OK;
}

static sf_status check_scale(const char *op, const char *name, const sf_tensor *s, int groups)
{
    if (!s)
        return SF_OK;
    SF_TRY(sf_check_dtype(op, name, s, SF_FLOAT32));
    int64_t n = sf_numel(s);
    if (n != groups && n != 1)
        return sf_fail(SF_ERR_VALUE,
                       "%s: argument '%s' must hold one scale inverse per group (%d) or one "
                       "shared by all groups, got %lld elements",
                       op, name, groups, (long long)n);
    /* per group: a 1-D vector of any positive element stride (each group's scale
     * reaches cuBLASLt through gemm.c, which refuses one not 16-byte aligned on CUDA;
     * the grouped FP8 cast writes them 64 floats apart) */
    if (n > 1 && (s->ndim != 1 || s->strides[0] < 1))
        return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must be a 1-D tensor of %d scale inverses "
                       "(any positive stride)", op, name, groups);
    return SF_OK;
}

/* Group g's view of an operand: the listed view, or rows [off, off + rows)
 * of the split tensor. */
static void view_at(const sf_tensor *split, const sf_tensor *list, int g, int64_t off,
                    int64_t rows, sf_tensor *v)
{
    if (!split) {
        *v = list[g];
        return;
    }
    *v = *split;
    v->shape[0] = rows;
    if (rows > 0) /* (an empty group's view is never read: no address one past the extent is formed) */
        v->data = (char *)split->data + off * split->strides[0] * (int64_t)sf_dtype_size(split->dtype);
}

/* Group g's product sizes: op(a) [m, k] x op(b) [k, n]; 0 where a view is
 * not 2-D (the caller refuses it). */
static void group_dims(const sf_grouped_gemm_args *args, const sf_tensor *a, const sf_tensor *b,
                       int64_t *m, int64_t *n, int64_t *k)
{
    if (a->ndim != 2 || b->ndim != 2) {
        *m = *n = *k = 0;
        return;
    }
    *m = args->transa ? a->shape[1] : a->shape[0];
    *k = args->transa ? a->shape[0] : a->shape[1];
    *n = args->transb ? b->shape[0] : b->shape[1];
}

/* The output tiles of 128 x 128 per group with a product to compute (m, n
 * and k > 0), on average (what lanes = 0 sizes its lanes by), and the
 * number of those groups. */
static int64_t tiles_per_group(const sf_grouped_gemm_args *args, int *busy)
{
    int64_t tiles = 0, off = 0;
    *busy = 0;
    for (int g = 0; g < args->num_groups; off += args->m_splits[g], ++g) {
        sf_tensor a, b;
        int64_t m, n, k;
        view_at(args->a, args->a_list, g, off, args->m_splits[g], &a);
        view_at(args->b, args->b_list, g, off, args->m_splits[g], &b);
        group_dims(args, &a, &b, &m, &n, &k);
        if (m > 0 && n > 0 && k > 0) {
            tiles += ((m + 127) / 128) * ((n + 127) / 128);
            *busy += 1;
        }
    }
    return *busy ? tiles / *busy : 0;
}

/* Byte range [lo, hi) a 2-D view spans (its strides taken as they come). */
typedef struct {
    uintptr_t lo, hi;
} byte_range;

static int by_start(const void *x, const void *y)
{
    const byte_range *a = x, *b = y;
    return a->lo < b->lo ? -1 : a->lo > b->lo;
}

/* 1 when two groups' outputs (a list of views) share memory: their order
 * then matters (accumulate, or the last write wins), so they run on one
 * stream.  A split output's groups are disjoint row runs. */
static int outputs_overlap(const sf_grouped_gemm_args *args)
{
    if (!args->out_list || args->num_groups < 2)
        return 0;
    const int G = args->num_groups;
    byte_range *r = malloc((size_t)G * sizeof *r);
    if (!r)
        return 1; /* (one stream is always right) */
    int used = 0;
    for (int g = 0; g < G; ++g) {
        const sf_tensor *t = &args->out_list[g];
        if (sf_numel(t) == 0)
            continue;
        int64_t lo = 0, hi = 0;
        for (int d = 0; d < t->ndim; ++d) {
            const int64_t span = (t->shape[d] - 1) * t->strides[d];
            lo += span < 0 ? span : 0;
            hi += span > 0 ? span : 0;
        }
        const int64_t es = (int64_t)sf_dtype_size(t->dtype);
        r[used].lo = (uintptr_t)t->data + lo * es;
        r[used].hi = (uintptr_t)t->data + (hi + 1) * es;
        ++used;
    }
    qsort(r, (size_t)used, sizeof *r, by_start);
    int overlap = 0;
    for (int i = 1; i < used && !overlap; ++i)
        overlap = r[i].lo < r[i - 1].hi;
    free(r);
    return overlap;
}

static void scale_at(const sf_tensor *s, int g, sf_tensor *v)
{
    *v = *s;
    v->ndim = 1;
    v->shape[0] = 1;
    v->strides[0] = 1;
    if (sf_numel(s) > 1)
        v->data = (float *)s->data + (int64_t)g * s->strides[0];
}

/* Group g's scale of one operand, for its sf_gemm call: the g-th entry of the
 * per-group float32 tensor (per-tensor scaling), or the g-th tensor of the
 * list (under the list's scaling mode).  Nothing is set when the operand has
 * neither (not FP8). */
static void group_scale(const sf_tensor *per_group, const sf_tensor *list, sf_gemm_scaling list_mode,
                        int g, sf_tensor *slot, const sf_tensor **scale_inv,
                        sf_gemm_scaling *scaling)
{
    if (!per_group && !list)
        return;
    if (per_group)
        scale_at(per_group, g, slot);
    else
        *slot = list[g];
    *scale_inv = slot;
    *scaling = per_group ? SF_GEMM_SCALE_TENSOR : list_mode;
}

/* The empty sum: out_g [m, n] = 0 (unless accumulating), bias gradient 0. */
static sf_status write_empty_product(const sf_grouped_gemm_args *args, sf_tensor *out,
                                     sf_tensor *bias, int64_t m, int64_t n, sf_stream stream)
{
    sf_tensor *zero[2] = {args->accumulate ? NULL : out, bias};
    for (int i = 0; i < 2; ++i) {
        sf_tensor *t = zero[i];
        if (!t)
            continue;
        int matrix = i == 0;
        int64_t rows = matrix ? m : 1, cols = matrix ? n : m;
        int64_t col_stride = matrix ? t->strides[1] : t->strides[0];
        if (cols > 1 && col_stride != 1)
            return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have unit stride along its last "
                           "dimension", OP, matrix ? "out" : "bias");
        SF_TRY(sf_check_writable(OP, matrix ? "out" : "bias", t));
        size_t es = sf_dtype_size(t->dtype);
        int64_t pitch = matrix && rows > 1 ? t->strides[0] : cols;
        if (t->device == SF_CPU) {
            for (int64_t r = 0; r < rows; ++r)
                memset((char *)t->data + r * pitch * (int64_t)es, 0, (size_t)cols * es);
            continue;
        }
        SF_TRY(SF_IF_CUDA(OP, matrix ? "out" : "bias",
                          sf_grouped_zero_cuda(t->data, rows, cols * (int64_t)es,
                                               pitch * (int64_t)es, t->device_id, stream)));
    }
    return SF_OK;
}

/* The sf_gemm arguments every group's product shares. */
static void gemm_args_of(const sf_grouped_gemm_args *args, sf_gemm_args *ga)
{
    sf_gemm_args_init(ga);
    ga->transa = args->transa;
    ga->transb = args->transb;
    ga->accumulate = args->accumulate;
    ga->fast_accum = args->fast_accum;
    ga->allow_tf32 = args->allow_tf32;
    ga->workspace = args->workspace;
}

/* Group g's operand views and scale inverses (held in *v), set in *ga. */
typedef struct {
    sf_tensor a, b, out, sa, sb;
} group_views;

static void group_operands(const sf_grouped_gemm_args *args, int g, int64_t off, group_views *v,
                           sf_gemm_args *ga)
{
    const int64_t rows = args->m_splits[g];
    view_at(args->a, args->a_list, g, off, rows, &v->a);
    view_at(args->b, args->b_list, g, off, rows, &v->b);
    view_at(args->out, args->out_list, g, off, rows, &v->out);
    ga->a = &v->a;
    ga->b = &v->b;
    ga->out = &v->out;
    group_scale(args->a_scale_inv, args->a_scale_list, args->a_scaling, g, &v->sa, &ga->a_scale_inv,
                &ga->a_scaling);
    group_scale(args->b_scale_inv, args->b_scale_list, args->b_scaling, g, &v->sb, &ga->b_scale_inv,
                &ga->b_scaling);
}

/* Group g's refusal `st` (sf_last_error's message) with the group named. */
static sf_status group_failed(sf_status st, int g, int64_t rows)
{
    char why[768];
    snprintf(why, sizeof why, "%s", sf_last_error());
    return sf_fail(st, "%s: group %d (m_splits[%d] = %lld): %s", OP, g, g, (long long)rows, why);
}

/* Why the sm90 kernel cannot take this call's form, or NULL (the kernel's
 * own numeric rules, sf_grouped_sm90_unfit, come after). */
static const char *sm90_form(const sf_grouped_gemm_args *args)
{
    if (!args->a || !args->out || !args->b_list)
        return "it takes a and out split by m_splits and b as a list of num_groups views";
    if (args->transa || !args->transb)
        return "it takes transa=0 and transb=1 only";
    if (args->bias_list || args->accumulate)
        return "it takes no bias and no accumulate";
    if (args->num_groups > SF_GROUPED_SM90_MAX_GROUPS)
        return "it takes at most 64 groups";
    /* a x b: the forward's bf16 x bf16 or e4m3 x e4m3, the FP8 input gradient's e5m2 x e4m3 (HYBRID);
     * FP8 accumulates as fast_accum asks (0: each 128-k block's sum promoted into float32) */
    const sf_dtype ta = args->a->dtype, tb = args->b_list[0].dtype;
    if (args->out->dtype != SF_BFLOAT16 ||
        !((ta == SF_BFLOAT16 && tb == SF_BFLOAT16) || (ta == SF_FLOAT8_E4M3 && tb == SF_FLOAT8_E4M3) ||
          (ta == SF_FLOAT8_E5M2 && tb == SF_FLOAT8_E4M3)))
        return "it takes bfloat16 x bfloat16, float8_e4m3fn x float8_e4m3fn or float8_e5m2 x float8_e4m3fn "
               "operands (a x b) and a bfloat16 out";
    if (ta != SF_BFLOAT16 && ((args->a_scale_list && args->a_scaling != SF_GEMM_SCALE_TENSOR) ||
                              (args->b_scale_list && args->b_scaling != SF_GEMM_SCALE_TENSOR)))
        return "it takes per-tensor FP8 scales only";
    return NULL;
}

/* The sm90 kernel's route (see Kernel in seqfuse_grouped.h).  *taken = 1
 * when it ran the call (or refused it: the status says); 0 when the call
 * goes to cuBLASLt instead, with *form = 0 where the call is not of the
 * kernel's form (cuBLASLt is its only route) or 1 and *why where it is but
 * the kernel cannot take it. */
static sf_status try_sm90(const sf_grouped_gemm_args *args, sf_stream stream, int *taken, int *form,
                          const char **why)
{
    *taken = 0;
    *form = 0;
#ifdef SF_WITH_CUDA
    if ((*why = sm90_form(args)) != NULL)
        return SF_OK;
    *form = 1;
    if ((*why = sf_grouped_sm90_device_unfit(args->a->device_id)) != NULL)
        return SF_OK; /* (before any per-group work: a GPU that is not Hopper pays nothing here) */
    /* (the measured rule: sf_grouped_sm90_pays) */
    if (args->kernel == SF_GROUPED_KERNEL_AUTO &&
        !sf_grouped_sm90_pays(args->m_splits, args->num_groups, args->out->shape[1], args->a->shape[1],
                              args->a->dtype, args->fast_accum, args->a->device_id)) {
        *form = 0; /* (cuBLASLt is the faster route here, not a fallback: nothing to note) */
        return SF_OK;
    }
    sf_grouped_sm90_args local; /* ~2.6 KiB */
    memset(&local, 0, sizeof local);
    local.a_dtype = args->a->dtype;
    local.b_dtype = args->b_list[0].dtype; /* (each group's is held to it below) */
    local.fast_accum = args->fast_accum ? 1 : 0; /* (FP8: 0 takes the promoted shape; bf16 ignores it) */
    local.groups = args->num_groups;
    local.a = args->a->data;
    local.lda = args->a->strides[0];
    local.out = args->out->data;
    local.ldo = args->out->strides[0];
    local.device_id = args->a->device_id;
    local.k = args->a->shape[1];
    local.n = args->out->shape[1];
    if (args->a->strides[1] != 1 || args->out->strides[1] != 1) {
        *why = "it takes a and out with unit column stride";
        return SF_OK;
    }
    if (local.k == 0 || local.n == 0 || args->a->shape[0] == 0) {
        *why = "the product is empty (no rows, k or n of 0)";
        return SF_OK; /* (the per-group route writes or skips each group as it does every empty product) */
    }
    sf_gemm_args ga;
    gemm_args_of(args, &ga);
    int64_t off = 0;
    for (int g = 0; g < args->num_groups; off += args->m_splits[g], ++g) {
        const int64_t rows = args->m_splits[g];
        if (args->b_list[g].ndim != 2 || args->b_list[g].dtype != local.b_dtype) {
            *why = "its groups' b are not all 2-D of one dtype"; /* (the per-group route names the group) */
            return SF_OK;
        }
        local.row_start[g + 1] = off + rows;
        local.b[g] = args->b_list[g].data;
        local.ldb[g] = args->b_list[g].strides[0];
        if (rows == 0)
            continue;
        /* the group under sf_gemm's rules: a refusal is the call's error, as on cuBLASLt */
        group_views v;
        group_operands(args, g, off, &v, &ga);
        sf_status st = sf_gemm_validate(&ga);
        if (st != SF_OK) {
            *taken = 1;
            return group_failed(st, g, rows);
        }
        if (local.a_dtype != SF_BFLOAT16) {
            local.a_scale_inv[g] = (const float *)ga.a_scale_inv->data; /* (group_scale's view of group g) */
            local.b_scale_inv[g] = (const float *)ga.b_scale_inv->data;
        }
    }
    if ((*why = sf_grouped_sm90_unfit(&local)) != NULL)
        return SF_OK;
    *taken = 1;
    return sf_grouped_sm90_launch(&local, stream);
#else
    (void)args;
    (void)stream;
    *why = "the library was built without CUDA";
    return SF_OK;
#endif
}

sf_status sf_grouped_gemm(const sf_grouped_gemm_args *args, sf_stream stream)
{
    if (!args)
        return sf_fail(SF_ERR_VALUE, "%s: arguments are required", OP);
    int G = args->num_groups;
    if (G < 1)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'num_groups' must be at least 1, got %d", OP, G);
    if (!args->m_splits)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' is required", OP);
    int64_t total = 0;
    for (int g = 0; g < G; ++g) {
        if (args->m_splits[g] < 0)
            return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' must hold row counts >= 0, got "
                           "m_splits[%d] = %lld", OP, g, (long long)args->m_splits[g]);
        if (__builtin_add_overflow(total, args->m_splits[g], &total))
            return sf_fail(SF_ERR_VALUE, "%s: argument 'm_splits' sums past 2**63 - 1 at m_splits[%d] = %lld",
                           OP, g, (long long)args->m_splits[g]);
    }
    SF_TRY(check_form("a", args->a, args->a_list, total));
    SF_TRY(check_form("b", args->b, args->b_list, total));
    SF_TRY(check_form("out", args->out, args->out_list, total));
    SF_TRY(check_scale(OP, "a_scale_inv", args->a_scale_inv, G));
    SF_TRY(check_scale(OP, "b_scale_inv", args->b_scale_inv, G));
    if ((args->a_scale_inv && args->a_scale_list) || (args->b_scale_inv && args->b_scale_list))
        return sf_fail(SF_ERR_VALUE, "%s: give an operand's scale inverses either as one tensor "
                       "(per-tensor scaling) or as a list of num_groups tensors, not both", OP);
    if ((args->a_scale_list && args->a_scaling == SF_GEMM_SCALE_NONE) ||
        (args->b_scale_list && args->b_scaling == SF_GEMM_SCALE_NONE))
        return sf_fail(SF_ERR_VALUE, "%s: a list of scale inverses needs its scaling mode (tensor, "
                       "block_1x128 or block_128x128)", OP);
    if (args->bgrad && !args->bias_list)
        return sf_fail(SF_ERR_VALUE, "%s: bgrad=1 needs 'bias' (the bias gradients' outputs)", OP);

    if (args->lanes < 0 || args->lanes > SF_GROUPED_MAX_LANES)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'lanes' must be 0 to %d (0: chosen here; else "
                       "concurrent streams), got %d", OP, SF_GROUPED_MAX_LANES, args->lanes);
    if (args->kernel < SF_GROUPED_KERNEL_AUTO || args->kernel > SF_GROUPED_KERNEL_SM90)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'kernel' must be 0 (auto), 1 (cuBLASLt) or 2 (sm90), "
                       "got %d", OP, args->kernel);

    /* The sm90 kernel: every group in one launch (Kernel in seqfuse_grouped.h). */
    const sf_tensor *first = args->a ? args->a : &args->a_list[0];
    const char *not_sm90 = "the tensors are on the CPU";
    int form = 0;
    if (args->kernel_note)
        *args->kernel_note = NULL;
    if (args->kernel != SF_GROUPED_KERNEL_CUBLASLT) {
        int taken = 0;
        sf_status st = SF_OK;
        if (first->device != SF_CPU)
            st = try_sm90(args, stream, &taken, &form, &not_sm90);
        if (taken)
            return st;
        if (args->kernel == SF_GROUPED_KERNEL_SM90)
            return sf_fail(SF_ERR_VALUE, "%s: kernel='sm90' cannot take this call: %s", OP, not_sm90);
        if (args->kernel_note && form)
            *args->kernel_note = not_sm90;
    }

    /* Lanes (CUDA, 2 or more non-empty groups): open here, closed on the one
     * way out below, error or not. */
    sf_grouped_lanes lanes = {0};
    double load[SF_GROUPED_MAX_LANES] = {0}; /* m n k issued to each lane (double: no overflow) */
    sf_tensor lane_ws[SF_GROUPED_MAX_LANES];
    int64_t share = 0; /* bytes of workspace a lane gets (a multiple of 256; 0: none) */
    if (first->device != SF_CPU && args->lanes != 1) {
        int busy = 0;
        const int64_t tiles = tiles_per_group(args, &busy);
        if (busy >= 2 && !outputs_overlap(args))
            SF_TRY(SF_IF_CUDA(OP, "lanes", sf_grouped_lanes_open(first->device_id, stream, args->lanes, tiles,
                                                                 busy, &lanes)));
        if (lanes.n && args->workspace)
            share = args->workspace->shape[0] / lanes.n / 256 * 256;
        for (int i = 0; i < lanes.n && share; ++i) {
            lane_ws[i] = *args->workspace;
            lane_ws[i].shape[0] = share;
            lane_ws[i].data = (char *)args->workspace->data + (int64_t)i * share;
        }
    }

    sf_status st = SF_OK;
    sf_gemm_args ga;
    gemm_args_of(args, &ga);
    int64_t off = 0; /* row offset of group g in the split operands */
    for (int g = 0; st == SF_OK && g < G; off += args->m_splits[g], ++g) {
        int64_t rows = args->m_splits[g];
        group_views v;
        sf_tensor bias;
        group_operands(args, g, off, &v, &ga);
        if (v.a.ndim != 2 || v.b.ndim != 2 || v.out.ndim != 2) {
            st = sf_fail(SF_ERR_VALUE, "%s: group %d: a, b and out must be 2-D (got %d, %d and %d "
                         "dimensions)", OP, g, v.a.ndim, v.b.ndim, v.out.ndim);
            break;
        }
        int64_t m, n, k;
        group_dims(args, &v.a, &v.b, &m, &n, &k);
        ga.bias = NULL;
        if (args->bias_list) {
            bias = args->bias_list[g];
            ga.bias = &bias;
        }
        if (m == 0 || n == 0) {
            /* an expert with no tokens: out_g has no rows (or no columns) */
            if (args->bgrad && m > 0)
                st = sf_fail(SF_ERR_VALUE, "%s: group %d: a bias gradient over an empty output "
                             "(n = 0) is not defined here", OP, g);
            continue;
        }
        /* this group's stream: the lane with the least work so far */
        sf_stream on = stream;
        if (lanes.n) {
            int best = 0;
            for (int i = 1; i < lanes.n; ++i)
                best = load[i] < load[best] ? i : best;
            load[best] += (double)m * (double)n * (double)(k > 0 ? k : 1);
            on = lanes.stream[best];
            ga.sm_count_target = lanes.sm_share;
            if (args->workspace) /* (shares of nothing: the lanes' GEMMs run without one) */
                ga.workspace = share ? &lane_ws[best] : NULL;
        }
        if (k == 0) { /* the empty sum: dW_g of an expert with no tokens */
            if (v.out.ndim != 2 || v.out.shape[0] != m || v.out.shape[1] != n)
                st = sf_fail(SF_ERR_VALUE, "%s: group %d: argument 'out' must have shape [%lld, %lld]",
                             OP, g, (long long)m, (long long)n);
            else if (ga.bias && (!args->bgrad || bias.ndim != 1 || bias.shape[0] != m))
                st = sf_fail(SF_ERR_VALUE, "%s: group %d has an empty inner dimension: only a bias "
                             "gradient (bgrad=1) of length %lld can go with it", OP, g, (long long)m);
            else
                st = write_empty_product(args, &v.out, args->bgrad ? &bias : NULL, m, n, on);
            continue;
        }
        ga.epilogue = !ga.bias ? SF_GEMM_EPI_NONE : args->bgrad ? SF_GEMM_EPI_BGRAD : SF_GEMM_EPI_BIAS;
        st = sf_gemm(&ga, on);
        if (st != SF_OK)
            st = group_failed(st, g, rows);
    }
    if (lanes.n) {
        /* join even after a failed group; the first error is the one reported */
        char why[768] = "";
        if (st != SF_OK)
            snprintf(why, sizeof why, "%s", sf_last_error());
        sf_status joined = SF_IF_CUDA(OP, "lanes", sf_grouped_lanes_close(&lanes));
        if (st != SF_OK)
            return sf_fail(st, "%s", why);
        return joined;
    }
    return st;
}

const char *sf_grouped_sm90_unfit_device(int device_id)
{
#ifdef SF_WITH_CUDA
    return sf_grouped_sm90_device_unfit(device_id);
#else
    (void)device_id;
    return "the library was built without CUDA";
#endif
}

/* ---- the groups' ends on the device (sf_grouped_gemm_device_ends) --------- */

static const char DEV_OP[] = "grouped_gemm_device_ends";

/* The checks the entry makes on either device: shapes, dtypes, devices. */
static sf_status device_ends_check(const sf_tensor *a, const sf_tensor *b, const sf_tensor *row_end,
                                   const sf_tensor *a_scale_inv, const sf_tensor *b_scale_inv,
                                   const sf_tensor *out)
{
    if (!a || !b || !row_end || !out)
        return sf_fail(SF_ERR_VALUE, "%s: arguments 'a', 'b', 'row_end' and 'out' are required", DEV_OP);
    if (a->ndim != 2 || b->ndim != 3 || out->ndim != 2)
        return sf_fail(SF_ERR_VALUE, "%s: takes a [M, K], b [G, N, K] and out [M, N], got %d-D, %d-D and "
                       "%d-D", DEV_OP, a->ndim, b->ndim, out->ndim);
    const int64_t G = b->shape[0], N = b->shape[1], K = b->shape[2];
    if (G < 1 || G > SF_GROUPED_SM90_MAX_GROUPS)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'b' must stack 1 to %d groups' [N, K] matrices, got %lld",
                       DEV_OP, SF_GROUPED_SM90_MAX_GROUPS, (long long)G);
    if (a->shape[1] != K || out->shape[0] != a->shape[0] || out->shape[1] != N)
        return sf_fail(SF_ERR_VALUE, "%s: a [M, K] = [%lld, %lld], b [G, N, K] = [%lld, %lld, %lld] and out "
                       "[M, N] = [%lld, %lld] do not agree", DEV_OP, (long long)a->shape[0],
                       (long long)a->shape[1], (long long)G, (long long)N, (long long)K,
                       (long long)out->shape[0], (long long)out->shape[1]);
    SF_TRY(sf_check_dtype(DEV_OP, "row_end", row_end, SF_INT32));
    if (row_end->ndim != 1 || row_end->shape[0] != G)
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_end' must be 1-D with one end row per group (%lld)",
                       DEV_OP, (long long)G);
    if (a->dtype != b->dtype || (a->dtype != SF_BFLOAT16 && a->dtype != SF_FLOAT8_E4M3))
        return sf_fail(SF_ERR_TYPE, "%s: a and b must both be bfloat16 or both float8_e4m3fn", DEV_OP);
    SF_TRY(sf_check_dtype(DEV_OP, "out", out, SF_BFLOAT16));
    const int fp8 = a->dtype == SF_FLOAT8_E4M3;
    if (fp8 != (a_scale_inv != NULL) || fp8 != (b_scale_inv != NULL))
        return sf_fail(SF_ERR_VALUE, "%s: float8 operands take a_scale_inv and b_scale_inv, bfloat16 ones "
                       "neither", DEV_OP);
    SF_TRY(check_scale(DEV_OP, "a_scale_inv", a_scale_inv, (int)G));
    SF_TRY(check_scale(DEV_OP, "b_scale_inv", b_scale_inv, (int)G));
    const sf_tensor *all[] = {b, row_end, out, a_scale_inv, b_scale_inv};
    static const char *const names[] = {"b", "row_end", "out", "a_scale_inv", "b_scale_inv"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        if (all[i])
            SF_TRY(sf_check_same_device(DEV_OP, "a", a, names[i], all[i]));
    if (row_end->device != SF_CPU && row_end->strides[0] != 1) /* (the kernel reads G consecutive ints) */
        return sf_fail(SF_ERR_VALUE, "%s: argument 'row_end' must be contiguous", DEV_OP);
    const sf_tensor *rowwise[] = {a, b, out};
    static const char *const rowwise_names[] = {"a", "b", "out"};
    for (int i = 0; i < 3; ++i)
        if (rowwise[i]->strides[rowwise[i]->ndim - 1] != 1)
            return sf_fail(SF_ERR_VALUE, "%s: argument '%s' must have unit stride along its last dimension "
                           "(K-major a and b rows, out rows)", DEV_OP, rowwise_names[i]);
    if (fp8 && K % 16)
        return sf_fail(SF_ERR_VALUE, "%s: float8 operands need K a multiple of 16, got %lld", DEV_OP, (long long)K);
    SF_TRY(sf_check_writable(DEV_OP, "out", out));
    const sf_mem_arg outs[] = {{"out", out, NULL}};
    const sf_mem_arg ins[] = {{"a", a, NULL}, {"b", b, NULL}, {"row_end", row_end, NULL},
                              {"a_scale_inv", a_scale_inv, NULL}, {"b_scale_inv", b_scale_inv, NULL}};
    SF_TRY(sf_check_apart(DEV_OP, outs, 1, ins, 5));
    return SF_OK;
}

/* Group g's [N, K] matrix of a stacked [G, N, K] tensor. */
static void stacked_at(const sf_tensor *b, int g, sf_tensor *v)
{
    *v = *b;
    v->ndim = 2;
    v->shape[0] = b->shape[1];
    v->shape[1] = b->shape[2];
    v->strides[0] = b->strides[1];
    v->strides[1] = b->strides[2];
    v->data = (char *)b->data + (int64_t)g * b->strides[0] * (int64_t)sf_dtype_size(b->dtype);
}

/* FP8 group g on the CPU at any row count and n (the kernel's): its rows
 * and b_g zero-padded to multiples of 16 rows, sf_gemm's FP8 granularity
 * (a padded row or column changes no other entry), then the real part of
 * the product copied out. */
static sf_status device_ends_cpu_fp8_group(const sf_tensor *a, const sf_tensor *b_g, int64_t row0, int64_t m,
                                           const sf_tensor *a_scale_inv, const sf_tensor *b_scale_inv, int g,
                                           sf_tensor *out, sf_stream stream)
{
    const int64_t n = b_g->shape[0], k = b_g->shape[1], m16 = (m + 15) / 16 * 16, n16 = (n + 15) / 16 * 16;
    uint8_t *ap = calloc((size_t)(m16 * k), 1), *bp = calloc((size_t)(n16 * k), 1);
    uint16_t *op = calloc((size_t)(m16 * n16), sizeof(uint16_t));
    sf_status st = SF_OK;
    if (!ap || !bp || !op) {
        st = sf_fail(SF_ERR_RUNTIME, "%s: out of host memory for an FP8 group's padded copy", DEV_OP);
        goto done;
    }
    for (int64_t r = 0; r < m; ++r)
        memcpy(ap + r * k, (const uint8_t *)a->data + (row0 + r) * a->strides[0], (size_t)k);
    for (int64_t r = 0; r < n; ++r)
        memcpy(bp + r * k, (const uint8_t *)b_g->data + r * b_g->strides[0], (size_t)k);
    sf_tensor ta, tb, to, sa, sb;
    sf_tensor_init(&ta, ap, a->dtype, 2, (const int64_t[]){m16, k}, SF_CPU, 0);
    sf_tensor_init(&tb, bp, b_g->dtype, 2, (const int64_t[]){n16, k}, SF_CPU, 0);
    sf_tensor_init(&to, op, SF_BFLOAT16, 2, (const int64_t[]){m16, n16}, SF_CPU, 0);
    scale_at(a_scale_inv, g, &sa);
    scale_at(b_scale_inv, g, &sb);
    int64_t split = m16;
    sf_grouped_gemm_args ga;
    sf_grouped_gemm_args_init(&ga);
    ga.num_groups = 1;
    ga.m_splits = &split;
    ga.a = &ta;
    ga.b_list = &tb;
    ga.out = &to;
    ga.transb = 1;
    ga.a_scale_inv = &sa;
    ga.b_scale_inv = &sb;
    ga.fast_accum = 1;
    if ((st = sf_grouped_gemm(&ga, stream)) == SF_OK)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < n; ++c)
                ((uint16_t *)out->data)[(row0 + r) * out->strides[0] + c * out->strides[1]] = op[r * n16 + c];
done:
    free(ap);
    free(bp);
    free(op);
    return st;
}

/* CPU: the ends read here, clamped as the kernel clamps them, and the
 * groups' products through sf_grouped_gemm (its per-group reference;
 * FP8 groups padded to its granularity one by one). */
static sf_status device_ends_cpu(const sf_tensor *a, const sf_tensor *b, const sf_tensor *row_end,
                                 const sf_tensor *a_scale_inv, const sf_tensor *b_scale_inv, sf_tensor *out,
                                 sf_stream stream)
{
    const int G = (int)b->shape[0];
    int64_t splits[SF_GROUPED_SM90_MAX_GROUPS];
    sf_tensor b_views[SF_GROUPED_SM90_MAX_GROUPS];
    int64_t prev = 0;
    for (int g = 0; g < G; ++g) {
        int64_t end = ((const int32_t *)row_end->data)[g * row_end->strides[0]];
        end = end < prev ? prev : end > a->shape[0] ? a->shape[0] : end;
        splits[g] = end - prev;
        prev = end;
        stacked_at(b, g, &b_views[g]);
    }
    if (a->dtype == SF_FLOAT8_E4M3) {
        int64_t row0 = 0;
        for (int g = 0; g < G; row0 += splits[g], ++g)
            if (splits[g] > 0)
                SF_TRY(device_ends_cpu_fp8_group(a, &b_views[g], row0, splits[g], a_scale_inv, b_scale_inv, g,
                                                 out, stream));
        return SF_OK;
    }
    sf_tensor a_rows = *a, out_rows = *out; /* the rows the groups take; those past them are not touched */
    a_rows.shape[0] = out_rows.shape[0] = prev;
    sf_grouped_gemm_args ga;
    sf_grouped_gemm_args_init(&ga);
    ga.num_groups = G;
    ga.m_splits = splits;
    ga.a = &a_rows;
    ga.b_list = b_views;
    ga.out = &out_rows;
    ga.transb = 1;
    return sf_grouped_gemm(&ga, stream);
}

sf_status sf_grouped_gemm_device_ends(const sf_tensor *a, const sf_tensor *b, const sf_tensor *row_end,
                                      const sf_tensor *a_scale_inv, const sf_tensor *b_scale_inv, sf_tensor *out,
                                      sf_stream stream)
{
    SF_TRY(device_ends_check(a, b, row_end, a_scale_inv, b_scale_inv, out));
    if (a->device == SF_CPU)
        return device_ends_cpu(a, b, row_end, a_scale_inv, b_scale_inv, out, stream);
#ifdef SF_WITH_CUDA
    const int G = (int)b->shape[0];
    sf_grouped_sm90_args k;
    memset(&k, 0, sizeof k);
    k.a_dtype = a->dtype;
    k.b_dtype = b->dtype; /* (device_ends_check: both bf16 or both e4m3) */
    k.fast_accum = 1; /* (the forward's accumulation, as the CPU path's fast_accum=1 groups) */
    k.groups = G;
    k.n = b->shape[1];
    k.k = b->shape[2];
    k.a = a->data;
    k.lda = a->strides[0];
    k.out = out->data;
    k.ldo = out->strides[0];
    k.row_start[G] = a->shape[0]; /* (the rows a and out hold: the ends are clamped to them) */
    k.device_row_end = (const int32_t *)row_end->data;
    k.device_id = a->device_id;
    for (int g = 0; g < G; ++g) {
        sf_tensor bg, sa, sb;
        stacked_at(b, g, &bg);
        k.b[g] = bg.data;
        k.ldb[g] = bg.strides[0];
        if (a->dtype == SF_FLOAT8_E4M3) {
            scale_at(a_scale_inv, g, &sa);
            scale_at(b_scale_inv, g, &sb);
            k.a_scale_inv[g] = sa.data;
            k.b_scale_inv[g] = sb.data;
        }
    }
    /* (no other route reads the ends on the device: refused with the rule, not run another way) */
    const char *why = sf_grouped_sm90_device_unfit(a->device_id);
    if (why)
        return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: the sm90 kernel, this op's only CUDA route, cannot run here: %s",
                       DEV_OP, why);
    if ((why = sf_grouped_sm90_unfit(&k)) != NULL)
        return sf_fail(SF_ERR_VALUE, "%s: the sm90 kernel, this op's only CUDA route, cannot take this call: %s",
                       DEV_OP, why);
    return sf_grouped_sm90_launch(&k, stream);
#else
    return sf_fail(SF_ERR_NOT_IMPLEMENTED, "%s: the library was built without CUDA", DEV_OP);
#endif
}
