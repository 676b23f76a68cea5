/*
 * gemm_cuda.cu - sf_gemm on the GPU through cuBLASLt.
 *
 * Row-major -> cuBLASLt (column-major): out[m, n] row-major is out^T [n, m]
 * column-major, and out^T = op(b)^T op(a)^T, so cuBLASLt's "A" is our b and
 * its "B" is our a, with m and n swapped; our transpose flags become its
 * op flags unchanged (a row-major [r, c] buffer is a column-major [c, r] one).
 * Consequences worth knowing when reading cuBLASLt's documentation:
 *   our a_scale_inv -> its B_SCALE_POINTER, our b_scale_inv -> A_SCALE_POINTER;
 *   bias of length n (per output column) = its bias over the rows of D;
 *   our BGRAD (sum over k of op(a)) = its BGRADB; the "TN" FP8 layout = our
 *   transa=0, transb=1.
 *
 * Plans: the matmul descriptor, the three layouts and the algorithm chosen by
 * cublasLtMatmulAlgoGetHeuristic are built once per problem and kept in a
 * small open-addressing hash table keyed by everything the heuristic sees
 * (device, dtypes, n, leading dimensions, op flags, epilogue, scaling modes,
 * fast accumulation, compute type, pointer alignments, workspace size, SM
 * count target), with a token-count dimension keyed by its size class
 * (exact up to 128, else
 * the next eighth of an octave: 2^j (1 + i/8) for i = 1..8, so 4,097 to
 * 4,608 are one class): m when a is not transposed (forward, input
 * gradient), k when a is transposed and b is not (weight gradient) -- the
 * dimensions that are never an operand's contiguous one, so the layouts'
 * leading dimensions stay valid at any size in the class.  Token counts
 * change every step in MoE experts (each expert's share of the batch) and
 * packed batches; keyed exactly, each new count cost a heuristic query and
 * filled the table (cublaslt_resize_probe's queries waited for the GPU's
 * queued work before returning: 2.6 ms each on average behind a 1 s
 * kernel).
 *
 * A plan's class algorithm is chosen by the heuristic for the class's upper
 * bound (a function of the key alone, so the same for every call order: a
 * run and its resume pick the same kernels), unless sf_gemm_tune timed the
 * plan's candidates: then the fastest (a function of that timing, so a run
 * and its resume may differ in the algorithm and the last bits).  Classes are an eighth of an
 * octave wide because an algorithm chosen for one size can run a much
 * smaller one at its own cost: on an H100, the algorithm cuBLASLt picks for
 * [8,192, 3,584] x [3,584, 1,024] (a Mixtral-small expert's down
 * projection) takes 73-82 us at every m from 4,112 to 8,192, where the
 * heuristic's choice for m = 4,112 takes 40 us and the choice for its
 * eighth-octave bound 4,608 46 us (benchmarks/gemm/cublaslt_resize_probe.cu);
 * with power-of-two classes a grouped GEMM's down projections, whose row
 * counts change every call, ran at 0.69x torch's grouped kernel (0.90x
 * with these classes).  A call of an exact size in the
 * class describes that size in the plan's layouts and runs the class
 * algorithm; cublasLtMatmul validates the algorithm against the problem it
 * is given and refuses one that cannot run it (INVALID_VALUE for an
 * impossible configuration, a workspace too small included; NOT_SUPPORTED),
 * and on that refusal the call takes the heuristic's choice for the exact
 * size (also a function of the problem alone, counted like any query) and
 * runs again.  cublasLtMatmulAlgoCheck before each new size would confirm
 * the same thing for 1-15 us more host time a call (the probe's logs).  Per
 * call the data pointers of the descriptor (scales, bias, aux) are
 * rewritten, then the matmul is enqueued.  cuBLASLt reads the
 * descriptor during cublasLtMatmul, so one mutex around "set pointers +
 * enqueue" makes the cache safe for any number of host threads.  Nothing
 * in sf_gemm synchronizes the host or allocates device memory, so the call
 * is capturable in a CUDA graph (given a workspace, cuBLASLt allocates
 * nothing); sf_gemm_tune waits for the stream and its timed runs.
 */
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string.h>

#include "../core/cuda_util.h"
#include "../core/visit.cuh"
#include "gemm.h"
#include "gemm_backend.h"

namespace {

constexpr int kMaxDevices = 64;
constexpr int kTableSize = 4096;      /* power of two */
constexpr int kTableMaxUsed = 3072;   /* then the table is emptied and refilled */

struct PlanKey {
    int32_t device;
    int32_t a_type, b_type, d_type, bias_type, aux_type; /* cudaDataType, or -1 */
    int32_t op_a, op_b;                                  /* cuBLASLt's A and B */
    int64_t m, n, k, lda, ldb, ldd, ld_aux;
    int32_t epilogue, scale_mode_a, scale_mode_b, has_scale;
    int32_t fast_accum, compute;
    uint32_t align_a, align_b, align_c, align_d;
    uint64_t workspace_bytes;
    int32_t sm_count_target;
    int32_t pad_;
};

struct Plan {
    int used;
    uint64_t hash;
    PlanKey key;
    int64_t m, k;                    /* our exact m and k the layouts describe now; -1: none */
    int algo_confirmed;              /* algo has run (or was chosen) for the exact m and k */
    cublasLtMatmulAlgo_t class_algo; /* the heuristic's choice at the class's upper bound, or sf_gemm_tune's */
    int tuned;                       /* sf_gemm_tune timed this plan's candidates (whatever it kept) */
    int64_t tuned_m, tuned_k;        /* the exact sizes it timed them at: where class_algo is confirmed */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
};

std::mutex g_lock;
cublasLtHandle_t g_handles[kMaxDevices];
Plan g_table[kTableSize];
int g_used = 0;
int64_t g_queries = 0;

const char *op_name = "gemm";

sf_status lt_fail(cublasStatus_t s, const char *what)
{
    return sf_fail(SF_ERR_RUNTIME, "%s: cuBLASLt %s failed: %s (%s)", op_name, what,
                   cublasLtGetStatusName(s), cublasLtGetStatusString(s));
}

#define LT_TRY(what, call)                       \
    do {                                         \
        cublasStatus_t lt_s_ = (call);           \
        if (lt_s_ != CUBLAS_STATUS_SUCCESS)      \
            return lt_fail(lt_s_, what);         \
    } while (0)

/* *t = cuBLASLt's type of argument `arg`'s dtype; any dtype without one is a
 * TypeError naming the argument (the entry admits none, but a plan keyed on
 * a wrong type would run a matmul on misread memory). */
sf_status cuda_type(const char *arg, sf_dtype d, int32_t *t)
{
    switch (d) {
    case SF_FLOAT32: *t = CUDA_R_32F; return SF_OK;
    case SF_FLOAT16: *t = CUDA_R_16F; return SF_OK;
    case SF_BFLOAT16: *t = CUDA_R_16BF; return SF_OK;
    case SF_FLOAT8_E4M3: *t = CUDA_R_8F_E4M3; return SF_OK;
    case SF_FLOAT8_E5M2: *t = CUDA_R_8F_E5M2; return SF_OK;
    default: return sf_visit_refuse(op_name, arg, d, "float32, float16, bfloat16, float8_e4m3fn or float8_e5m2");
    }
}

cublasLtEpilogue_t lt_epilogue(sf_gemm_epilogue e)
{
    switch (e) {
    case SF_GEMM_EPI_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case SF_GEMM_EPI_GELU: return CUBLASLT_EPILOGUE_GELU;
    case SF_GEMM_EPI_BIAS_GELU: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case SF_GEMM_EPI_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX;
    case SF_GEMM_EPI_BIAS_GELU_AUX: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case SF_GEMM_EPI_DGELU: return CUBLASLT_EPILOGUE_DGELU;
    case SF_GEMM_EPI_DGELU_BGRAD: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case SF_GEMM_EPI_BGRAD: return CUBLASLT_EPILOGUE_BGRADB;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
    }
}

int32_t lt_scale_mode(sf_gemm_scaling s)
{
    switch (s) {
    case SF_GEMM_SCALE_BLOCK_1X128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case SF_GEMM_SCALE_BLOCK_128X128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    default: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    }
}

/* Largest power of two (<= 256) dividing the address: cuBLASLt assumes 256
 * unless told, and would pick a kernel that faults on a less aligned view. */
uint32_t alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al != 0)
        al >>= 1;
    return al;
}

uint64_t hash_key(const PlanKey *k)
{
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < sizeof *k; ++i) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

void destroy_plan(Plan *p)
{
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    memset(p, 0, sizeof *p);
}

void clear_table_locked()
{
    for (int i = 0; i < kTableSize; ++i)
        if (g_table[i].used)
            destroy_plan(&g_table[i]);
    g_used = 0;
}

sf_status get_handle_locked(int device, cublasLtHandle_t *h)
{
    if (device < 0 || device >= kMaxDevices)
        return sf_fail(SF_ERR_VALUE, "%s: CUDA device %d is beyond the %d seqfuse supports",
                       op_name, device, kMaxDevices);
    if (!g_handles[device])
        LT_TRY("cublasLtCreate", cublasLtCreate(&g_handles[device]));
    *h = g_handles[device];
    return SF_OK;
}

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const T &v)
{
    return cublasLtMatmulDescSetAttribute(d, a, &v, sizeof v);
}

/* Write the per-call pointers into a plan's descriptor. */
sf_status set_pointers(Plan *plan, const sf_gemm_problem *p)
{
    cublasLtMatmulDesc_t d = plan->desc;
    if (plan->key.has_scale) {
        const void *sa = p->b_scale, *sb = p->a_scale; /* operands swapped */
        LT_TRY("setting A_SCALE_POINTER", set_attr(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa));
        LT_TRY("setting B_SCALE_POINTER", set_attr(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb));
    }
    if (p->bias) {
        const void *b = p->bias;
        LT_TRY("setting BIAS_POINTER", set_attr(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, b));
    }
    if (p->aux) {
        const void *x = p->aux;
        LT_TRY("setting EPILOGUE_AUX_POINTER",
               set_attr(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, x));
    }
    return SF_OK;
}

/* The key's value for a dimension a token count may land in: exact up to
 * 128, else the smallest 2^j (1 + i/8), i = 1..8, at least x (2^j < x). */
int64_t size_class(int64_t x)
{
    if (x <= 128)
        return x;
    int64_t octave = 128;
    while (octave * 2 < x)
        octave <<= 1;
    const int64_t step = octave / 8;
    return octave + (x - octave + step - 1) / step * step;
}

/* Which of our m and k take part in the key by size class (see the note). */
int class_m(const sf_gemm_problem *p) { return !p->a.trans; }
int class_k(const sf_gemm_problem *p) { return p->a.trans && !p->b.trans; }

/* The three layouts' (rows, cols) for our m = M and k = K: cuBLASLt's A is
 * our b, column-major [cols, rows] of its row-major storage; B is our a. */
void layout_dims(const sf_gemm_problem *p, int64_t M, int64_t K, uint64_t dims[3][2])
{
    const uint64_t n = (uint64_t)p->n;
    dims[0][0] = p->b.trans ? (uint64_t)K : n;
    dims[0][1] = p->b.trans ? n : (uint64_t)K;
    dims[1][0] = p->a.trans ? (uint64_t)M : (uint64_t)K;
    dims[1][1] = p->a.trans ? (uint64_t)K : (uint64_t)M;
    dims[2][0] = n;
    dims[2][1] = (uint64_t)M;
}

sf_status make_key(const sf_gemm_problem *p, PlanKey *k)
{
    memset(k, 0, sizeof *k); /* padding bytes take part in the hash */
    int fp8 = sf_gemm_is_fp8(p->a.dtype);
    k->device = p->device_id;
    SF_TRY(cuda_type("b", p->b.dtype, &k->a_type));
    SF_TRY(cuda_type("a", p->a.dtype, &k->b_type));
    SF_TRY(cuda_type("out", p->out_dtype, &k->d_type));
    k->bias_type = -1;
    if (p->bias)
        SF_TRY(cuda_type("bias", p->bias_dtype, &k->bias_type));
    k->aux_type = -1;
    if (p->aux)
        SF_TRY(cuda_type("aux", p->aux_dtype, &k->aux_type));
    k->op_a = p->b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    k->op_b = p->a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    k->m = p->n;
    k->n = class_m(p) ? size_class(p->m) : p->m;
    k->k = class_k(p) ? size_class(p->k) : p->k;
    k->lda = p->b.ld;
    k->ldb = p->a.ld;
    k->ldd = p->ld_out;
    k->ld_aux = p->aux ? p->ld_aux : 0;
    k->epilogue = lt_epilogue(p->epilogue);
    k->has_scale = fp8;
    k->scale_mode_a = fp8 ? lt_scale_mode(p->b_scaling) : -1;
    k->scale_mode_b = fp8 ? lt_scale_mode(p->a_scaling) : -1;
    k->fast_accum = fp8 ? p->fast_accum : 0;
    k->compute = (p->a.dtype == SF_FLOAT32 && p->allow_tf32) ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                              : CUBLAS_COMPUTE_32F;
    k->align_a = alignment(p->b.data);
    k->align_b = alignment(p->a.data);
    k->align_c = alignment(p->c);
    k->align_d = alignment(p->out);
    k->workspace_bytes = p->workspace_bytes;
    k->sm_count_target = p->sm_count_target;
    return SF_OK;
}

sf_status describe_no_algo(const sf_gemm_problem *p, cublasStatus_t s)
{
    int cap = 0;
    sf_cuda_capability(p->device_id, &cap);
    return sf_fail(SF_ERR_NOT_IMPLEMENTED,
                   "%s: cuBLASLt has no algorithm for this problem on sm_%d (%s): op(a) "
                   "[%lld, %lld] %s%s x op(b) [%lld, %lld] %s%s -> %s, epilogue '%s', "
                   "scaling a=%s b=%s, fast_accum=%d, workspace %zu bytes",
                   op_name, cap, s == CUBLAS_STATUS_SUCCESS ? "no results" : cublasLtGetStatusName(s),
                   (long long)p->m, (long long)p->k, sf_dtype_name(p->a.dtype),
                   p->a.trans ? " (transposed)" : "", (long long)p->k, (long long)p->n,
                   sf_dtype_name(p->b.dtype), p->b.trans ? " (transposed)" : "",
                   sf_dtype_name(p->out_dtype), sf_gemm_epi_name(p->epilogue),
                   sf_gemm_scaling_name(p->a_scaling), sf_gemm_scaling_name(p->b_scaling),
                   p->fast_accum, p->workspace_bytes);
}

sf_status choose_algo(cublasLtHandle_t h, const sf_gemm_problem *p, Plan *plan, cublasLtMatmulAlgo_t *algo);
sf_status resize_plan(const sf_gemm_problem *p, Plan *plan);

/* LT_TRY for a function that cleans up at `label` before it returns: on failure,
 * st takes the failure (named by `what`) and control goes to the cleanup.
 * The function declares `cublasStatus_t s` and `sf_status st`. */
#define LT_TRY_GOTO(what, call, label)      \
    do {                                    \
        s = (call);                         \
        if (s != CUBLAS_STATUS_SUCCESS) {   \
            st = lt_fail(s, what);          \
            goto label;                     \
        }                                   \
    } while (0)

/* Build a plan into `plan` (zeroed); on failure everything made is freed. */
sf_status build_plan(cublasLtHandle_t h, const sf_gemm_problem *p, const PlanKey *k,
                     Plan *plan)
{
    plan->key = *k;
    sf_status st = SF_OK;
    cublasStatus_t s;

#define BP_TRY(what, call) LT_TRY_GOTO(what, call, fail)

    BP_TRY("MatmulDescCreate", cublasLtMatmulDescCreate(&plan->desc, (cublasComputeType_t)k->compute,
                                                        CUDA_R_32F));
    {
        cublasOperation_t oa = (cublasOperation_t)k->op_a, ob = (cublasOperation_t)k->op_b;
        BP_TRY("setting TRANSA", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, oa));
        BP_TRY("setting TRANSB", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, ob));
        cublasLtEpilogue_t epi = (cublasLtEpilogue_t)k->epilogue;
        BP_TRY("setting EPILOGUE", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epi));
    }
    if (k->has_scale) {
        int8_t fast = (int8_t)k->fast_accum;
        BP_TRY("setting FAST_ACCUM", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast));
        if (k->scale_mode_a != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
            k->scale_mode_b != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F) {
            int32_t ma = k->scale_mode_a, mb = k->scale_mode_b;
            BP_TRY("setting A_SCALE_MODE", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, ma));
            BP_TRY("setting B_SCALE_MODE", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mb));
        }
    }
    if (k->sm_count_target > 0) {
        int32_t sms = k->sm_count_target;
        BP_TRY("setting SM_COUNT_TARGET", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, sms));
    }
    if (k->bias_type >= 0) {
        int32_t bt = k->bias_type;
        BP_TRY("setting BIAS_DATA_TYPE", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bt));
    }
    if (k->aux_type >= 0) {
        int64_t ld_aux = k->ld_aux;
        int32_t at = k->aux_type;
        BP_TRY("setting EPILOGUE_AUX_LD", set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld_aux));
        BP_TRY("setting EPILOGUE_AUX_DATA_TYPE",
               set_attr(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, at));
    }
    st = set_pointers(plan, p);
    if (st != SF_OK)
        goto fail;

    {
        /* the layouts at the class's upper bound, for the class algorithm; then p's own sizes */
        uint64_t d[3][2];
        layout_dims(p, k->n, k->k, d);
        BP_TRY("MatrixLayoutCreate(A)", cublasLtMatrixLayoutCreate(&plan->la, (cudaDataType_t)k->a_type,
                                                                   d[0][0], d[0][1], p->b.ld));
        BP_TRY("MatrixLayoutCreate(B)", cublasLtMatrixLayoutCreate(&plan->lb, (cudaDataType_t)k->b_type,
                                                                   d[1][0], d[1][1], p->a.ld));
        BP_TRY("MatrixLayoutCreate(D)", cublasLtMatrixLayoutCreate(&plan->ld, (cudaDataType_t)k->d_type,
                                                                   d[2][0], d[2][1], p->ld_out));
    }
    st = choose_algo(h, p, plan, &plan->class_algo);
    if (st == SF_OK) {
        plan->m = k->n; /* the layouts describe the class's upper bound now */
        plan->k = k->k;
        plan->algo = plan->class_algo;
        plan->algo_confirmed = 1; /* the heuristic chose it for exactly these sizes */
        st = resize_plan(p, plan);
    }
    if (st != SF_OK)
        goto fail;
    return SF_OK;
#undef BP_TRY
fail:
    destroy_plan(plan);
    return st;
}

/* Ask the heuristic for its best `want` algorithms (1..16), best first,
 * for the problem the plan's descriptor and layouts describe now (p for the
 * messages), into out[0 .. *got - 1]. */
sf_status query_algos(cublasLtHandle_t h, const sf_gemm_problem *p, Plan *plan, int want,
                      cublasLtMatmulHeuristicResult_t *out, int *got)
{
    const PlanKey *k = &plan->key;
    sf_status st = SF_OK;
    cublasLtMatmulPreference_t pref = NULL;
    cublasStatus_t s;
    *got = 0;
    memset(out, 0, sizeof *out * (size_t)want);

#define CA_TRY(what, call) LT_TRY_GOTO(what, call, done)

    CA_TRY("MatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&pref));
    {
        uint64_t ws = k->workspace_bytes;
        CA_TRY("setting MAX_WORKSPACE_BYTES",
               cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
        uint32_t al[4] = {k->align_a, k->align_b, k->align_c, k->align_d};
        cublasLtMatmulPreferenceAttributes_t which[4] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        for (int i = 0; i < 4; ++i)
            CA_TRY("setting MIN_ALIGNMENT",
                   cublasLtMatmulPreferenceSetAttribute(pref, which[i], &al[i], sizeof al[i]));
    }
    g_queries++;
    s = cublasLtMatmulAlgoGetHeuristic(h, plan->desc, plan->la, plan->lb, plan->ld, plan->ld, pref, want, out,
                                       got);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && *got == 0))
        st = describe_no_algo(p, s);
    else if (s != CUBLAS_STATUS_SUCCESS)
        st = lt_fail(s, "MatmulAlgoGetHeuristic");
#undef CA_TRY
#undef LT_TRY_GOTO
done:
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    return st;
}

/* The heuristic's best algorithm for the problem the plan describes now, into *algo. */
sf_status choose_algo(cublasLtHandle_t h, const sf_gemm_problem *p, Plan *plan, cublasLtMatmulAlgo_t *algo)
{
    cublasLtMatmulHeuristicResult_t result;
    int returned = 0;
    SF_TRY(query_algos(h, p, plan, 1, &result, &returned));
    *algo = result.algo;
    return SF_OK;
}

/* Describe p's exact sizes in the plan's layouts and take the class
 * algorithm for them, confirmed at the class's upper bound (where the
 * heuristic chose it) and otherwise by the first matmul that runs it
 * (run_locked).  On failure the plan describes no size (the next call
 * redoes it). */
sf_status resize_plan(const sf_gemm_problem *p, Plan *plan)
{
    if (plan->m == p->m && plan->k == p->k)
        return SF_OK;
    uint64_t dims[3][2];
    layout_dims(p, p->m, p->k, dims);
    cublasLtMatrixLayout_t layouts[3] = {plan->la, plan->lb, plan->ld};
    plan->m = plan->k = -1;
    for (int i = 0; i < 3; ++i) {
        LT_TRY("setting layout ROWS", cublasLtMatrixLayoutSetAttribute(
                                          layouts[i], CUBLASLT_MATRIX_LAYOUT_ROWS, &dims[i][0], sizeof(uint64_t)));
        LT_TRY("setting layout COLS", cublasLtMatrixLayoutSetAttribute(
                                          layouts[i], CUBLASLT_MATRIX_LAYOUT_COLS, &dims[i][1], sizeof(uint64_t)));
    }
    plan->algo = plan->class_algo;
    /* where the algorithm was chosen: the class's upper bound (the heuristic's choice), or the size a tune
     * timed it at */
    plan->algo_confirmed = plan->tuned ? p->m == plan->tuned_m && p->k == plan->tuned_k
                                       : p->m == plan->key.n && p->k == plan->key.k;
    plan->m = p->m;
    plan->k = p->k;
    return SF_OK;
}

/* Find or build the plan for p; the caller holds g_lock. */
sf_status lookup_locked(cublasLtHandle_t h, const sf_gemm_problem *p, Plan **out)
{
    PlanKey key;
    SF_TRY(make_key(p, &key));
    uint64_t hash = hash_key(&key);
    unsigned slot = (unsigned)hash & (kTableSize - 1);
    for (int probe = 0; probe < kTableSize; ++probe, slot = (slot + 1) & (kTableSize - 1)) {
        Plan *e = &g_table[slot];
        if (!e->used)
            break;
        if (e->hash == hash && memcmp(&e->key, &key, sizeof key) == 0) {
            SF_TRY(resize_plan(p, e));
            *out = e;
            return set_pointers(e, p);
        }
    }
    if (g_used >= kTableMaxUsed)
        clear_table_locked(); /* a cache: emptying it only costs new queries */
    slot = (unsigned)hash & (kTableSize - 1);
    while (g_table[slot].used)
        slot = (slot + 1) & (kTableSize - 1);
    Plan *e = &g_table[slot];
    SF_TRY(build_plan(h, p, &key, e));
    e->used = 1;
    e->hash = hash;
    g_used++;
    *out = e;
    return SF_OK;
}

/* Enqueue p's matmul with the plan's descriptor, layouts and algorithm. */
cublasStatus_t enqueue(cublasLtHandle_t h, const sf_gemm_problem *p, const Plan *plan, cudaStream_t stream)
{
    const float alpha = p->alpha, beta = p->accumulate ? 1.0f : 0.0f;
    return cublasLtMatmul(h, plan->desc, &alpha, p->b.data, plan->la, p->a.data, plan->lb, &beta, p->c, plan->ld,
                          p->out, plan->ld, &plan->algo, p->workspace, p->workspace_bytes, stream);
}

sf_status run_locked(const sf_gemm_problem *p, cudaStream_t stream)
{
    cublasLtHandle_t h = NULL;
    SF_TRY(get_handle_locked(p->device_id, &h));
    Plan *plan = NULL;
    SF_TRY(lookup_locked(h, p, &plan));
    cublasStatus_t s = enqueue(h, p, plan, stream);
    if (!plan->algo_confirmed && (s == CUBLAS_STATUS_INVALID_VALUE || s == CUBLAS_STATUS_NOT_SUPPORTED)) {
        /* the class algorithm refused this exact size: the heuristic's choice for it, and again */
        SF_TRY(choose_algo(h, p, plan, &plan->algo));
        s = enqueue(h, p, plan, stream);
    }
    if (s != CUBLAS_STATUS_SUCCESS)
        return lt_fail(s, "Matmul");
    plan->algo_confirmed = 1;
    return SF_OK;
}

/* sf_gemm_tune on the GPU (the caller holds g_lock; the stream was drained
 * before it was taken, so the waits below wait for the candidates' runs
 * alone): the heuristic's first `candidates` algorithms for p's exact
 * sizes, each run once and then timed over kRuns runs between two events on
 * the stream.  The fastest (the heuristic's first choice for these sizes
 * unless another beats it by 3 % or more) becomes the plan's class
 * algorithm, confirmed at the tuned sizes (another size of the class that
 * it cannot run takes the heuristic's choice for that size, as for any
 * class algorithm), and the plan counts as tuned (not timed again).  A
 * candidate cuBLASLt refuses to run is skipped. */
sf_status tune_locked(const sf_gemm_problem *p, int candidates, float *times, cudaStream_t stream)
{
    constexpr int kRuns = 3;
    cublasLtHandle_t h = NULL;
    SF_TRY(get_handle_locked(p->device_id, &h));
    Plan *plan = NULL;
    SF_TRY(lookup_locked(h, p, &plan));
    if (plan->tuned)
        return SF_OK;
    cublasLtMatmulHeuristicResult_t res[16];
    int got = 0;
    SF_TRY(query_algos(h, p, plan, candidates, res, &got));
    cudaEvent_t ev[2] = {NULL, NULL};
    float ms[16];
    int best = -1;
    sf_status st = SF_OK;
    cudaError_t e = cudaSuccess;
    const cublasLtMatmulAlgo_t before = plan->algo;
    const int before_confirmed = plan->algo_confirmed;
    for (int i = 0; i < 2 && e == cudaSuccess; ++i)
        e = cudaEventCreate(&ev[i]);
    if (e != cudaSuccess) {
        st = sf_fail(SF_ERR_RUNTIME, "gemm_tune: CUDA error %s: %s (creating its timing events)",
                     cudaGetErrorName(e), cudaGetErrorString(e));
        goto done;
    }
    for (int i = 0; i < got; ++i) {
        ms[i] = -1.0f;
        plan->algo = res[i].algo;
        if (enqueue(h, p, plan, stream) != CUBLAS_STATUS_SUCCESS)
            continue; /* (an algorithm this exact problem cannot run: skipped) */
        e = cudaEventRecord(ev[0], stream);
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < kRuns && e == cudaSuccess && s == CUBLAS_STATUS_SUCCESS; ++r)
            s = enqueue(h, p, plan, stream);
        if (s != CUBLAS_STATUS_SUCCESS) {
            st = lt_fail(s, "Matmul (a timed run of a candidate that had run once)");
            goto done;
        }
        if (e == cudaSuccess)
            e = cudaEventRecord(ev[1], stream);
        if (e == cudaSuccess)
            e = cudaEventSynchronize(ev[1]);
        if (e == cudaSuccess)
            e = cudaEventElapsedTime(&ms[i], ev[0], ev[1]);
        if (e != cudaSuccess) {
            st = sf_fail(SF_ERR_RUNTIME, "gemm_tune: CUDA error %s: %s (timing candidate %d of %d)",
                         cudaGetErrorName(e), cudaGetErrorString(e), i, got);
            goto done;
        }
        ms[i] /= kRuns;
        if (best < 0 || ms[i] < ms[best])
            best = i;
    }
    if (best < 0) {
        st = sf_fail(SF_ERR_RUNTIME, "gemm_tune: cuBLASLt ran none of the %d algorithms its heuristic offered", got);
        goto done;
    }
    if (ms[0] >= 0.0f && ms[best] > 0.97f * ms[0])
        best = 0;
    plan->class_algo = res[best].algo; /* (what was timed: also the first choice at these sizes, which the class's
                                        * upper-bound choice need not be) */
    plan->tuned_m = p->m;
    plan->tuned_k = p->k;
    plan->tuned = 1;
    times[0] = ms[0] >= 0.0f ? 1e3f * ms[0] : -1.0f;
    times[1] = 1e3f * ms[best];
    times[2] = (float)best;
done:
    /* the algorithm for the exact sizes now described: the kept one, or (a failure) the one the plan had */
    if (st == SF_OK) {
        plan->algo = plan->class_algo;
        plan->algo_confirmed = 1; /* (it ran at these sizes) */
    } else {
        plan->algo = before;
        plan->algo_confirmed = before_confirmed;
    }
    for (int i = 0; i < 2; ++i)
        if (ev[i])
            cudaEventDestroy(ev[i]);
    return st;
}

/* Whether p's plan (found or built) was tuned already; the caller holds g_lock. */
sf_status tuned_locked(const sf_gemm_problem *p, int *tuned)
{
    cublasLtHandle_t h = NULL;
    SF_TRY(get_handle_locked(p->device_id, &h));
    Plan *plan = NULL;
    SF_TRY(lookup_locked(h, p, &plan));
    *tuned = plan->tuned;
    return SF_OK;
}

} // namespace

extern "C" sf_status sf_gemm_tune_cuda(const sf_gemm_problem *p, int candidates, float *times, sf_stream s)
{
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter("gemm_tune", p->device_id, &guard));
    cudaStream_t stream = sf_cuda_stream(s);
    sf_status st = SF_OK;
    int tuned = 0;
    {
        std::lock_guard<std::mutex> lock(g_lock);
        st = tuned_locked(p, &tuned);
    }
    if (st != SF_OK || tuned) { /* (nothing to time: no wait, no capture rule) */
        sf_cuda_device_restore(&guard);
        return st;
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(stream, &capture);
    if (e == cudaSuccess && capture != cudaStreamCaptureStatusNone)
        st = sf_fail(SF_ERR_VALUE, "gemm_tune: the stream is capturing a CUDA graph; tuning times its runs and "
                     "waits for them (tune before the capture)");
    else if (e == cudaSuccess)
        e = cudaStreamSynchronize(stream); /* (the queued work first, outside the plan cache's lock) */
    if (st == SF_OK && e != cudaSuccess)
        st = sf_fail(SF_ERR_RUNTIME, "gemm_tune: CUDA error %s: %s (before timing)", cudaGetErrorName(e),
                     cudaGetErrorString(e));
    if (st == SF_OK) {
        std::lock_guard<std::mutex> lock(g_lock);
        st = tune_locked(p, candidates, times, stream);
    }
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" sf_status sf_gemm_cuda(const sf_gemm_problem *p, sf_stream s)
{
    sf_cuda_device_guard guard;
    SF_TRY(sf_cuda_device_enter(op_name, p->device_id, &guard));
    sf_status st;
    {
        std::lock_guard<std::mutex> lock(g_lock);
        st = run_locked(p, sf_cuda_stream(s));
    }
    sf_cuda_device_restore(&guard);
    return st;
}

extern "C" int sf_gemm_plan_cache_size(void)
{
    std::lock_guard<std::mutex> lock(g_lock);
    return g_used;
}

extern "C" void sf_gemm_plan_cache_clear(void)
{
    std::lock_guard<std::mutex> lock(g_lock);
    clear_table_locked();
}

extern "C" int64_t sf_gemm_heuristic_queries(void)
{
    std::lock_guard<std::mutex> lock(g_lock);
    return g_queries;
}
