"""Multi-tensor optimizer ops (csrc/optim/): one AdamW update over lists of
tensors, the l2 norm of a list of tensors, and an in-place scale of a list
of tensors by a device scalar, each in a few kernel launches however many
tensors there are.  seqfuse.optim builds FusedAdamW and clip_grad_norm_ on
them."""
import torch

from .. import _C
from ._call import as_float, as_int, detached, given_out, mark_written, stream_for

#: Elements per chunk of the multi-tensor kernels (one l2-norm workspace float each).
CHUNK = _C.multi_tensor_chunk_size()


def _check_list(op, name, ts):
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{op}: argument '{name}' must be a list of tensors, got {type(ts).__name__}")
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: argument '{name}' must hold only tensors, got {type(t).__name__} "
                            f"at index {i}")


def _detached(ts):
    return [detached(t) for t in ts]


def multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay, step):
    """One AdamW update (torch.optim.AdamW's definition, fp32 math) of every
    tensor in ``params`` (all one dtype), in place, with moments ``exp_avg``
    / ``exp_avg_sq`` (all float32 or all bfloat16: bf16 moments are read,
    updated in fp32 and stored rounded) and, when ``master`` is a list, fp32 master
    copies that hold the true value (params receive it rounded).  ``step`` is
    the 1-based count of this update, used for bias correction."""
    op = "multi_tensor_adamw"
    for name, ts in (("params", params), ("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_list(op, name, ts)
    if master is not None:
        _check_list(op, "master", master)
    multi_tensor_adamw_prechecked(_detached(params), _detached(grads), exp_avg, exp_avg_sq, master, lr, beta1,
                                  beta2, eps, weight_decay, step)


def multi_tensor_adamw_prechecked(params, grads, exp_avg, exp_avg_sq, master, lr, beta1, beta2, eps, weight_decay,
                                  step):
    """multi_tensor_adamw for a caller that has checked its lists itself
    (seqfuse.optim.FusedAdamW.step checks every parameter and gradient
    before any update): the lists go to C without multi_tensor_adamw's
    Python pass over them (that each is a list of tensors, and the detach
    of those that require grad, which C's export does itself), so a bad
    list is refused by C's checks alone.  The scalars are read as
    multi_tensor_adamw reads them."""
    if not params:
        return
    op = "multi_tensor_adamw"
    _C.multi_tensor_adamw(params, grads, exp_avg, exp_avg_sq, master,
                          *(as_float(op, n, v) for n, v in (("lr", lr), ("beta1", beta1), ("beta2", beta2),
                                                             ("eps", eps), ("weight_decay", weight_decay))),
                          as_int(op, "step", step),
                          stream_for(params[0]))


def multi_tensor_l2norm(tensors, out=None):
    """sqrt(sum of x^2 over every tensor), a 0-d float32 tensor on their
    device, computed without reading anything back to the host; the order of
    the additions is fixed, so the result is deterministic."""
    _check_list("multi_tensor_l2norm", "tensors", tensors)
    tensors = _detached(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    user_out = out
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=device)
    else:
        out = given_out("multi_tensor_l2norm", out)
    chunks = sum((t.numel() + CHUNK - 1) // CHUNK for t in tensors)
    ws = torch.empty(max(1, chunks), dtype=torch.float32, device=device) if device.type == "cuda" else out
    _C.multi_tensor_l2norm(tensors, ws, out, stream_for(out))
    if user_out is not None:
        mark_written(out)
        return user_out
    return out


def multi_tensor_scale(tensors, scale):
    """x *= scale for every tensor, in place; ``scale`` a float32 tensor with
    one element on the tensors' device (read by the kernel, not the host).  A
    scale of exactly 1 leaves the tensors as they are without a pass over
    them (x * 1 is x): one launch whose blocks return at once."""
    _check_list("multi_tensor_scale", "tensors", tensors)
    if not tensors:
        return
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(as_float("multi_tensor_scale", "scale", scale), dtype=torch.float32,
                             device=tensors[0].device)
    elif scale.numel() != 1:
        raise ValueError(f"multi_tensor_scale: argument 'scale' must have one element, got shape "
                         f"{tuple(scale.shape)}")
    _C.multi_tensor_scale(_detached(tensors), scale.detach().reshape(()), stream_for(tensors[0]))
