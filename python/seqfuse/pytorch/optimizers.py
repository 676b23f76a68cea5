"""te.optimizers: Transformer Engine's FusedAdam and FusedSGD, with TE's
arguments and defaults, mapped onto what seqfuse has.

FusedAdam is seqfuse.optim.FusedAdamW (seqfuse's multi-tensor Adam kernel,
fp32 or bf16 moments, optional fp32 master weights, FSDP2 DTensor parameters) with
TE's argument names and defaults (weight_decay=0, master_weights=False).
TE's arguments map as follows; every value seqfuse cannot honour raises
NotImplementedError naming the argument and what to use instead:

  lr, betas, eps, weight_decay   the same meaning (decoupled weight decay)
  adam_w_mode=False              Adam with L2 regularisation: the same as
                                 adam_w_mode=True when weight_decay is 0;
                                 refused with weight_decay > 0
  master_weights                 fp32 master copies of 16-bit parameters
  master_weight_dtype            torch.float32 only (the kernel keeps fp32
                                 masters)
  exp_avg_dtype,                 torch.float32 or torch.bfloat16, the two
  exp_avg_sq_dtype               equal (one kernel reads both moments);
                                 TE's fp16 and FP8 moments are refused;
                                 state_dict() holds them in float32, as
                                 TE's does (load_state_dict converts back)
  bias_correction=False          refused (the kernel always corrects)
  amsgrad, capturable,           refused
  use_decoupled_grad,
  store_param_remainders
  set_grad_none                  TE's deprecated flag: the default of
                                 zero_grad(set_to_none=...)

FusedSGD: seqfuse has no SGD kernel, so it is torch.optim.SGD on torch's
multi-tensor (foreach) kernels, which is what TE's fused SGD does too (one
launch per operation for many tensors); construction says so once in a log
line.  TE's wd_after_momentum=True and materialize_master_grads=False are
refused.

The multi-tensor entry points TE exports here (multi_tensor_applier,
multi_tensor_scale, multi_tensor_l2norm, ...) come from multi_tensor.py.
"""
import logging

import torch

from torch.optim.optimizer import required as _required

from ..optim import FusedAdamW, moment_dtype
from .multi_tensor import (MultiTensorApply, multi_tensor_adam, multi_tensor_adam_capturable,  # noqa: F401
                           multi_tensor_adam_capturable_master, multi_tensor_applier, multi_tensor_l2norm,
                           multi_tensor_scale, multi_tensor_scale_tensor, multi_tensor_sgd,
                           multi_tensor_unscale_l2norm)

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm",
           "multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_unscale_l2norm", "multi_tensor_adam",
           "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master", "multi_tensor_sgd"]

_log = logging.getLogger("seqfuse")
_sgd_logged = False


def _refuse(cls, name, value, why):
    raise NotImplementedError(f"{cls}: argument '{name}'={value!r} is not supported: {why}")


class FusedAdam(FusedAdamW):
    """TE's FusedAdam (arguments and defaults) on seqfuse's fused AdamW; see
    the module note for how each argument maps."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, use_decoupled_grad=False, store_param_remainders=False,
                 set_grad_none=None):
        cls = "FusedAdam"
        if amsgrad:
            _refuse(cls, "amsgrad", amsgrad, "AMSGrad is not implemented in seqfuse's Adam kernel")
        if not bias_correction:
            _refuse(cls, "bias_correction", bias_correction, "seqfuse's Adam kernel always applies bias "
                    "correction")
        if not adam_w_mode and weight_decay != 0:
            _refuse(cls, "adam_w_mode", adam_w_mode, "L2-regularised Adam with weight_decay > 0 is not "
                    "implemented; use adam_w_mode=True (decoupled weight decay) or weight_decay=0")
        # kept in every group, so a group's weight_decay > 0 (given, set later or loaded) with
        # adam_w_mode=False is refused by FusedAdamW's group check, not run as decoupled decay
        self._extra_defaults = {"adam_w_mode": bool(adam_w_mode)}
        if capturable:
            _refuse(cls, "capturable", capturable, "the step count lives on the host, so the update is not "
                    "CUDA-graph capturable; capture the forward/backward only")
        if master_weights and master_weight_dtype != torch.float32:
            _refuse(cls, "master_weight_dtype", master_weight_dtype, "seqfuse's Adam kernel keeps master "
                    "weights in torch.float32 only")
        moment_dtype(cls, exp_avg_dtype, exp_avg_sq_dtype)
        if use_decoupled_grad:
            _refuse(cls, "use_decoupled_grad", use_decoupled_grad, "reading p.decoupled_grad is not "
                    "implemented; seqfuse.optim.FusedAdamW(use_main_grad=True) reads p.main_grad")
        if store_param_remainders:
            _refuse(cls, "store_param_remainders", store_param_remainders, "the fp32 master copy is kept "
                    "whole (master_weights=True), not as 16-bit remainders")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         master_weights=bool(master_weights), exp_avg_dtype=exp_avg_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype)
        self.set_grad_none = set_grad_none

    def state_dict(self):
        """FusedAdamW's state dict with the moments in float32, as TE's
        FusedAdam saves them whatever their dtype in memory (a copy: the
        optimizer keeps its bf16 moments; loading converts them back, which
        is exact)."""
        sd = super().state_dict()
        sd["state"] = {i: {k: (v.float() if k in ("exp_avg", "exp_avg_sq") and isinstance(v, torch.Tensor)
                               and v.dtype != torch.float32 else v) for k, v in st.items()}
                       for i, st in sd["state"].items()}
        return sd

    def zero_grad(self, set_to_none=None):
        """torch's zero_grad; ``set_to_none`` defaults to TE's set_grad_none
        where it was given, else True (torch's default)."""
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        super().zero_grad(set_to_none=set_to_none)


class FusedSGD(torch.optim.SGD):
    """TE's FusedSGD (arguments) as torch.optim.SGD on torch's foreach
    kernels; see the module note."""

    def __init__(self, params, lr=_required, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, *, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=None):
        global _sgd_logged
        lr_required = lr is _required
        if lr_required:
            # TE's FusedSGD has no default lr (torch.optim.SGD's now has one): every group must name its own
            params = list(params)
            if params and not all(isinstance(g, dict) and "lr" in g for g in params):
                raise ValueError("FusedSGD: argument 'lr' is required (TE's FusedSGD has no default learning "
                                "rate): pass lr=..., or an 'lr' in every parameter group")
            lr = 0.0  # a placeholder for torch's checks; the default goes back to 'required' below
        if wd_after_momentum:
            _refuse("FusedSGD", "wd_after_momentum", wd_after_momentum, "weight decay is added to the "
                    "gradient before the momentum update (torch's order) only")
        if not materialize_master_grads:
            _refuse("FusedSGD", "materialize_master_grads", materialize_master_grads, "apex-style fp16 "
                    "master gradients are not used; gradients are read from p.grad")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, foreach=True)
        if lr_required:
            self.defaults["lr"] = _required  # a group added later without 'lr' is refused, as by torch
        self.set_grad_none = set_grad_none
        if not _sgd_logged:
            _log.info("FusedSGD: runs torch.optim.SGD on torch's foreach (multi-tensor) kernels; seqfuse has "
                      "no SGD kernel of its own")
            _sgd_logged = True

    def zero_grad(self, set_to_none=None):
        if set_to_none is None:
            set_to_none = True if self.set_grad_none is None else bool(self.set_grad_none)
        super().zero_grad(set_to_none=set_to_none)
