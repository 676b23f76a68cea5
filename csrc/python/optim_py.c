/*
 * optim_py.c - bindings of the optim family (multi-tensor AdamW and gradient
 * norms, csrc/optim/).  They take Python lists of tensors (the driver imports
 * them with sf_py_list_import, py_call.h: a list may be far longer than the
 * per-call borrow limit).
 */
#include "py_call.h"

/* multi_tensor_adamw: master is None or a list of fp32 copies; every list
 * as long as params. */
static const sf_py_arg adamw_args[] = {
    SF_TL(params),   SF_TL(grads),    SF_TL(exp_avg),   SF_TL(exp_avg_sq),
    SF_OTL(master),  SF_FLOAT(lr),    SF_FLOAT(beta1),  SF_FLOAT(beta2),
    SF_FLOAT(eps),   SF_FLOAT(weight_decay), SF_INT64(step), SF_STREAM};

static int adamw_prepare(sf_py_frame *f)
{
    const sf_py_tensor_list *p = f->v[0].list;
    for (int i = 1; i < 5; ++i)
        if (f->v[i].list != NULL && f->v[i].list->n != p->n) {
            PyErr_Format(PyExc_ValueError, "%s: arguments 'params' (%zd tensors) and '%s' (%zd "
                         "tensors) must have the same length", f->b->op, p->n, adamw_args[i].name,
                         f->v[i].list->n);
            return -1;
        }
    return 0;
}

static sf_status adamw(sf_py_value *v, sf_stream s)
{
    const sf_adamw_config cfg = {.lr = v[5].f, .beta1 = v[6].f, .beta2 = v[7].f, .eps = v[8].f,
                                 .weight_decay = v[9].f, .step = v[10].i64};
    return sf_multi_tensor_adamw(v[0].list->n, v[0].list->views, v[1].list->views,
                                 v[2].list->views, v[3].list->views,
                                 v[4].list != NULL ? v[4].list->views : NULL, &cfg, s);
}
SF_PY_BINDING_FULL(multi_tensor_adamw, "multi_tensor_adamw", adamw_args, adamw, adamw_prepare,
                   NULL, NULL, "One AdamW update of every tensor in the lists.");

SF_PY_OP(multi_tensor_l2norm, sf_multi_tensor_l2norm, "out[0] = sqrt(sum x^2) over all tensors.",
         (TL, tensors), (T, workspace), (T, out));
SF_PY_OP(multi_tensor_scale, sf_multi_tensor_scale, "x *= scale[0] for every tensor.",
         (TL, tensors), (T, scale));

const sf_py_binding *const sf_py_optim_bindings[] = {
    &multi_tensor_adamw_binding, &multi_tensor_l2norm_binding, &multi_tensor_scale_binding, NULL};

SF_PY_NOARGS(py_chunk_size, PyLong_FromLong(SF_MT_CHUNK))

PyMethodDef sf_py_optim_methods[] = {
    {"multi_tensor_chunk_size", py_chunk_size, METH_NOARGS,
     "Elements per chunk of the multi-tensor kernels (one workspace float per chunk for l2norm)."},
    {NULL, NULL, 0, NULL},
};
