"""GroupedLinear: Transformer Engine's GroupedLinear over seqfuse's grouped GEMM.

G linear layers applied to consecutive row blocks of one input: rows
[offset_g, offset_g + m_splits[g]) of inp go through y_g = x_g W_g^T + b_g.
This is a mixture-of-experts layer's expert GEMM after the tokens have been
permuted into expert order (seqfuse.ops.moe.moe_permute).  A training step
is three grouped GEMMs (seqfuse.ops.moe.grouped_gemm), each one call over
all experts:

    forward  y_g  = x_g  @ W_g^T  (+ b_g in the epilogue)
    dgrad    dx_g = dy_g @ W_g
    wgrad    dW_g = dy_g^T @ x_g  (+ db_g in the epilogue; zero for an
                                   expert that received no tokens)

Parameters: one per expert, named weight0 .. weight{G-1} and bias0 ..
bias{G-1} as TE names them, so TE / Megatron checkpoints map one to one.
One parameter per expert rather than one stacked [G, out, in] parameter
because (1) FSDP2's fully_shard shards each parameter along dim 0, which
for a stacked tensor would cut across experts, while per-expert
parameters shard each expert's own rows; (2) expert parallelism assigns
whole experts to ranks, which is a choice of parameters, not a slice of
one; (3) optimizers and gradient clipping see each expert as its own
tensor, as with the dense Linear.  The grouped GEMM takes the list of
weights directly, so nothing is stacked (copied) per step.

Precision: the GEMMs run in torch.autocast's dtype where it is on, else the
parameters' dtype.  FP8 (fp8_autocast) is not built for GroupedLinear yet:
under an FP8 autocast the forward raises NotImplementedError (the grouped
GEMM itself takes per-tensor FP8 operands; the per-expert quantizers and
their scaling state are what is missing).

Weight-gradient accumulation: where every weight carries a float32
``main_grad``, dW_g is accumulated into it by the GEMM (beta = 1) and the
weight's .grad is left None (``grad_added_to_main_grad`` set where present).
"""
import torch

from .. import quantization as _q
from ..ops import moe as moe_ops
from ._base import default_device
from ._input import check_input

__all__ = ["GroupedLinear", "GroupedLinearFunction"]

#: TE arguments accepted with only their default value (parallelism, overlap).
_TE_DEFAULTS = {"sequence_parallel": False, "tp_group": None, "tp_size": 1, "parallel_mode": None,
                "ub_overlap_ag": False, "ub_overlap_rs": False, "ub_name": None,
                "delay_wgrad_compute": False, "save_original_input": False}
_TE_IGNORED = ("name", "get_rng_state_tracker", "rng_tracker_name")


def _compute_dtype(x, weight):
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


class GroupedLinearFunction(torch.autograd.Function):
    """Autograd of y_g = x_g W_g^T + b_g over host m_splits.

    forward(x [sum(m_splits), in], m_splits (tuple of ints), dtype, num_gemms,
    use_bias, *weights, *biases)."""

    @staticmethod
    def forward(ctx, x, m_splits, dtype, G, use_bias, *params):
        weights, biases = params[:G], params[G:] if use_bias else None
        xc = (x if x.dtype == dtype else x.to(dtype)).detach()
        wc = [(w if w.dtype == dtype else w.to(dtype)).detach() for w in weights]
        bc = None
        if use_bias:
            bc = [(b if b.dtype == dtype else b.to(dtype)).detach() for b in biases]
        y = moe_ops.grouped_gemm(xc, wc, m_splits, transb=True, bias=bc)
        ctx.save_for_backward(xc, *wc)
        ctx.weights = weights  # the parameter objects, for main_grad
        ctx.m_splits, ctx.dtype, ctx.G, ctx.use_bias = m_splits, dtype, G, use_bias
        ctx.bias_dtypes = [b.dtype for b in biases] if use_bias else None
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, *wc = ctx.saved_tensors
        G, dtype, splits = ctx.G, ctx.dtype, ctx.m_splits
        dy = (dy if dy.dtype == dtype else dy.to(dtype)).contiguous()
        need_dx = ctx.needs_input_grad[0]
        need_dw = any(ctx.needs_input_grad[5:5 + G])
        need_db = ctx.use_bias and any(ctx.needs_input_grad[5 + G:])
        dx = moe_ops.grouped_gemm(dy, wc, splits) if need_dx else None
        dws = [None] * G
        dbs = [None] * G if ctx.use_bias else []
        if need_dw or need_db:
            weights = ctx.weights
            mains = [getattr(w, "main_grad", None) for w in weights] if need_dw else [None]
            use_main = need_dw and all(m is not None for m in mains)
            if use_main:
                res = moe_ops.grouped_gemm(dy, xc, splits, transa=True, out=mains, accumulate=True,
                                           bgrad=need_db)
            else:
                res = moe_ops.grouped_gemm(dy, xc, splits, transa=True, bgrad=need_db)
            if need_db:
                res, db = res
                dbs = [db[g].to(ctx.bias_dtypes[g]) for g in range(G)]
            if use_main:
                for w in weights:
                    if hasattr(w, "grad_added_to_main_grad"):
                        w.grad_added_to_main_grad = True
            elif need_dw:
                dws = [res[g] if res.dtype == weights[g].dtype else res[g].to(weights[g].dtype)
                       for g in range(G)]
        return (dx, None, None, None, None, *dws, *dbs)


class GroupedLinear(torch.nn.Module):
    """G linear layers over consecutive row blocks, TE's
    ``transformer_engine.pytorch.GroupedLinear``.

    num_gemms: G (experts); in_features, out_features: sizes of each;
    bias: learn a bias per expert; params_dtype (default torch's default
    dtype); device ("cuda" where usable by default; "meta" defers
    initialization: call reset_parameters()); init_method: callable(weight)
    applied to each expert's weight in place (default normal, std 0.023, as
    TE); return_bias: return (y, [bias0, ...]) and leave the add to the
    caller; fuse_wgrad_accumulation: accepted (accumulation into main_grad
    happens whenever every weight carries one).

    forward(inp [sum(m_splits), in_features] (or [..., in_features] whose
    rows add up), m_splits: G ints (host values; a CPU tensor is read)).
    """

    def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device=None,
                 init_method=None, return_bias=False, fuse_wgrad_accumulation=False, **unsupported):
        super().__init__()
        for name, value in unsupported.items():
            if name in _TE_IGNORED:
                continue
            if name not in _TE_DEFAULTS:
                raise TypeError(f"GroupedLinear: unexpected argument {name!r}")
            if value != _TE_DEFAULTS[name]:
                raise NotImplementedError(f"GroupedLinear: argument '{name}'={value!r} is not supported "
                                          "(no tensor/sequence parallelism or comm overlap here)")
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"GroupedLinear: num_gemms must be a positive int, got {num_gemms!r}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"GroupedLinear: in_features and out_features must be positive, got "
                             f"{in_features} and {out_features}")
        self.num_gemms = num_gemms
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.use_bias = bool(bias)
        self.return_bias = bool(return_bias)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.init_method = init_method
        dtype = params_dtype or torch.get_default_dtype()
        device = default_device(device)
        for g in range(num_gemms):
            self.register_parameter(f"weight{g}", torch.nn.Parameter(
                torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)))
            if self.use_bias:
                self.register_parameter(f"bias{g}", torch.nn.Parameter(
                    torch.empty(self.out_features, dtype=dtype, device=device)))
            else:
                self.register_parameter(f"bias{g}", None)
        if device.type != "meta":
            self.reset_parameters()

    def weights(self):
        return [getattr(self, f"weight{g}") for g in range(self.num_gemms)]

    def biases(self):
        return [getattr(self, f"bias{g}") for g in range(self.num_gemms)] if self.use_bias else []

    @torch.no_grad()
    def reset_parameters(self):
        for w in self.weights():
            if self.init_method is not None:
                self.init_method(w)
            else:
                w.normal_(0.0, 0.023)
        for b in self.biases():
            b.zero_()

    def extra_repr(self):
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}, "
                f"params_dtype={self.weight0.dtype}")

    def forward(self, inp, m_splits, is_first_microbatch=None):
        check_input("GroupedLinear", inp, self.in_features, "in_features")
        splits = tuple(moe_ops.host_splits("GroupedLinear", m_splits))
        if len(splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must hold num_gemms = {self.num_gemms} row "
                             f"counts, got {len(splits)}")
        if _q.is_fp8_enabled():
            raise NotImplementedError(
                "GroupedLinear: FP8 (fp8_autocast / autocast with an FP8 recipe) is not built for "
                "GroupedLinear yet (the per-expert quantizers and scaling state are missing); run "
                "it outside the FP8 autocast, in bf16")
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        if sum(splits) != x.shape[0]:
            raise ValueError(f"GroupedLinear: m_splits add up to {sum(splits)} rows but the input has "
                             f"{x.shape[0]}")
        weights, biases = self.weights(), self.biases()
        dtype = _compute_dtype(inp, weights[0])
        use_bias = self.use_bias and not self.return_bias
        params = weights + (biases if use_bias else [])
        y = GroupedLinearFunction.apply(x, splits, dtype, self.num_gemms, use_bias, *params)
        if inp.dim() != 2:
            y = y.view(*lead, self.out_features)
        if self.return_bias:
            return y, biases
        return y
