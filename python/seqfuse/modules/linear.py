"""Linear: Transformer Engine's Linear layer over seqfuse.ops.gemm.

y = x W^T + b with the three GEMMs of a training step (forward, input
gradient, weight gradient) each one cuBLASLt call:

    forward  y  = x  @ W^T  (+ bias in the epilogue)
    dgrad    dx = dy @ W
    wgrad    dW = dy^T @ x  (+ the bias gradient in the epilogue, "bgrad")

Precision: the forward runs in the dtype of torch.autocast when it is on,
else in the parameters' dtype; bf16 and fp32 parameters are both fine.

Weight-gradient accumulation (TE's fuse_wgrad_accumulation): where the
weight parameter carries a float32 ``main_grad`` buffer, dW is accumulated
into it by the GEMM itself (beta = 1), and the weight's own gradient is
left None (``weight.grad_added_to_main_grad`` is set, as Megatron expects).

Works under torch.distributed.fsdp.fully_shard (parameters are read at
forward time, whatever FSDP put there) and under CUDA graph capture (no host
synchronization, workspaces cached per stream).
"""
import torch

from .. import ops

__all__ = ["Linear", "LinearFunction"]


def _default_device():
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _compute_dtype(x, weight):
    """The dtype the GEMMs run in: torch.autocast's where it is on for x's
    device type, else the weight's."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


class LinearFunction(torch.autograd.Function):
    """Autograd of y = x W^T + b in one compute dtype (bf16, fp16 or fp32).

    forward(x [tokens, in], weight [out, in], bias [out] or None, dtype)
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xc = x if x.dtype == dtype else x.to(dtype)
        wc = weight if weight.dtype == dtype else weight.to(dtype)
        bc = None if bias is None else (bias if bias.dtype == dtype else bias.to(dtype))
        y = ops.gemm(xc, wc, transb=True, bias=bc)
        ctx.save_for_backward(xc, wc)
        ctx.weight = weight  # for main_grad (the parameter object, not saved data)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dtype = ctx.dtype
        dy = (dy if dy.dtype == dtype else dy.to(dtype)).contiguous()
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dx = ops.gemm(dy, wc) if need_dx else None
        dw = db = None
        if need_dw or (ctx.has_bias and need_db):
            weight = ctx.weight
            main_grad = getattr(weight, "main_grad", None) if need_dw else None
            epilogue = "bgrad" if (ctx.has_bias and need_db) else "none"
            if main_grad is not None:
                res = ops.gemm(dy, xc, transa=True, out=main_grad, accumulate=True, epilogue=epilogue)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
            else:
                res = ops.gemm(dy, xc, transa=True, epilogue=epilogue)
            if epilogue == "bgrad":
                res, db = res
                db = db.to(ctx.bias_dtype)
            if need_dw and main_grad is None:
                dw = res if res.dtype == weight.dtype else res.to(weight.dtype)
        return dx, dw, db, None


class Linear(torch.nn.Module):
    """y = x W^T + b, TE's ``transformer_engine.pytorch.Linear``.

    in_features, out_features: sizes; bias: learn an additive bias;
    params_dtype: dtype of the parameters (default torch's default dtype);
    device: where to make them ("cuda" where available by default; "meta"
    defers initialization, e.g. for FSDP2 — call reset_parameters());
    init_method: callable(weight) that initializes the weight in place
    (default normal with std 0.023, TE's default); the bias starts at zero.
    return_bias: return (y, bias) and leave the bias add to the caller (TE).
    fuse_wgrad_accumulation: accepted for TE compatibility; accumulation into
    ``weight.main_grad`` happens whenever the weight carries one.
    """

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False, fuse_wgrad_accumulation=False, **unsupported):
        super().__init__()
        for name, value in unsupported.items():
            if value not in (None, False, 1, "", 0):
                raise NotImplementedError(f"Linear: argument '{name}'={value!r} is not supported "
                                          "(no tensor/sequence parallelism or comm overlap here)")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: in_features and out_features must be positive, got "
                             f"{in_features} and {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.init_method = init_method
        dtype = params_dtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else _default_device()
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features,
                                                     dtype=dtype, device=device))
        if self.use_bias:
            self.bias = torch.nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        if self.init_method is not None:
            self.init_method(self.weight)
        else:
            self.weight.normal_(0.0, 0.023)
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, params_dtype={self.weight.dtype}")

    def forward(self, inp, is_first_microbatch=None):
        """y for inp [..., in_features].  is_first_microbatch (TE): under
        FP8, True re-quantizes the weight, False reuses the quantized weight
        of the previous call (gradient-accumulation micro-batches), None
        re-quantizes only when the weight changed."""
        if inp.shape[-1] != self.in_features:
            raise ValueError(f"Linear: input's last dimension must be in_features = {self.in_features}, "
                             f"got shape {tuple(inp.shape)}")
        weight, bias = self.weight, self.bias
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        dtype = _compute_dtype(inp, weight)
        y = LinearFunction.apply(x, weight, None if self.return_bias else bias, dtype)
        if inp.dim() != 2:  # a 2-D input gets the Function's output itself, not a view of it
            y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, bias
        return y

