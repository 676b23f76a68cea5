"""FusedAdamW: torch.optim.AdamW's update on seqfuse's multi-tensor kernel.

- One update of a parameter group takes a few kernel launches in all (up to
  64 tensors per launch), not one per tensor.
- ``master_weights=True`` (default): each bf16/fp16 parameter gets an fp32
  master copy (state ``master_param``); the update runs on the master and
  the parameter receives its value rounded.  fp32 parameters are updated
  directly.
- Moments (``exp_avg``, ``exp_avg_sq``) are float32 by default.
  ``exp_avg_dtype=exp_avg_sq_dtype=torch.bfloat16`` keeps them in bf16 (TE's
  FusedAdam names): the kernel reads them, updates in fp32 and stores them
  rounded, the step using the unrounded values.  With bf16 parameters and
  ``master_weights=False`` that is the update and the state torch.optim.AdamW
  keeps for bf16 parameters (4 bytes of state per parameter, not 8); the
  two moment dtypes must be equal (one kernel reads both).
- Decoupled weight decay (p *= 1 - lr * wd) and bias correction, in fp32,
  following torch's operation order.
- The step count lives on the host: ``state['step']`` is a Python int per
  parameter, and parameters of a group that share a step share launches.  So
  an update is not meant to be captured in a CUDA graph across steps.
- ``state_dict()`` holds everything (moments, master copies, steps);
  ``load_state_dict`` restores them exactly (in the group's moment dtype and
  fp32 masters, not cast to the parameter's dtype as torch's default loader
  would), so training resumes bit for bit.  State saved in another moment
  dtype than the group's is converted to the group's, and a log line says
  so.
- ``lr`` must be a Python number (a tensor lr would need a host read).
- Each update bumps the parameters' version counters (the kernel writes
  them directly, which torch would not notice): caches keyed on a weight's
  version, such as Linear's FP8 weight cache, are refreshed.
- ``use_main_grad=True``: a parameter's gradient is its float32
  ``main_grad`` where it has one (seqfuse.pytorch.Linear accumulates the
  weight gradient there, Megatron style, leaving ``.grad`` None), else its
  ``.grad``.  16-bit parameters take float32 gradients directly.  zero_grad()
  does not clear main_grad: that stays the training loop's job, as in
  Megatron.
- DTensor parameters (FSDP2's fully_shard: Shard(0) on a device mesh): the
  kernels run on each rank's local shards (``to_local()``, the parameter's
  own storage) with the gradient's local shard, which must have the same
  placements.  The moments and the fp32 master copies are DTensors with the
  parameter's mesh and placements (sharded like it), so state_dict() and
  torch.distributed.checkpoint (get/set_optimizer_state_dict, dcp.save /
  dcp.load) save each rank's shard and reload it, resharded if the mesh
  changed.  No communication: AdamW is elementwise.
"""
import itertools
import logging

import torch

from ..ops import optim as _ops
from ._dtensor import as_state_of, check_layout, like, local

_log = logging.getLogger("seqfuse")
#: The moment dtypes the kernel keeps.
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def moment_dtype(op, exp_avg_dtype, exp_avg_sq_dtype):
    """The one moment dtype of ``exp_avg_dtype`` / ``exp_avg_sq_dtype``, or
    the exception naming the argument and the rule it broke: TypeError for
    what is not a torch.dtype, NotImplementedError for a dtype the kernel
    does not keep (TE's fp16 and FP8 moments) or two different ones."""
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{op}: argument '{name}' must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in MOMENT_DTYPES:
            raise NotImplementedError(f"{op}: argument '{name}'={dtype} is not supported: seqfuse's Adam kernel "
                                      "keeps moments in torch.float32 or torch.bfloat16")
    if exp_avg_dtype != exp_avg_sq_dtype:
        raise NotImplementedError(f"{op}: arguments 'exp_avg_dtype' ({exp_avg_dtype}) and 'exp_avg_sq_dtype' "
                                  f"({exp_avg_sq_dtype}) must be equal: seqfuse's Adam kernel reads both moments "
                                  "in one dtype")
    return exp_avg_dtype


def _grad_of(p, use_main_grad):
    if use_main_grad:
        main_grad = getattr(p, "main_grad", None)
        if main_grad is not None:
            return main_grad
    return p.grad


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 master_weights=True, amsgrad=False, maximize=False, use_main_grad=False, *,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32):
        if amsgrad or maximize:
            raise NotImplementedError("FusedAdamW: amsgrad and maximize are not supported")
        if isinstance(lr, torch.Tensor):
            raise TypeError("FusedAdamW: argument 'lr' must be a Python number, not a tensor")
        if not 0.0 <= lr:
            raise ValueError(f"FusedAdamW: argument 'lr' must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdamW: argument 'betas' must lie in [0, 1), got {betas}")
        if not 0.0 <= eps:
            raise ValueError(f"FusedAdamW: argument 'eps' must be >= 0, got {eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"FusedAdamW: argument 'weight_decay' must be >= 0, got {weight_decay}")
        moments = moment_dtype("FusedAdamW", exp_avg_dtype, exp_avg_sq_dtype)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights,
                        use_main_grad=use_main_grad, moment_dtype=moments)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch's, with a group's own ``moment_dtype`` (the key the
        constructor's exp_avg_dtype / exp_avg_sq_dtype set) checked here,
        not at the first step."""
        if "moment_dtype" in param_group:
            md = param_group["moment_dtype"]
            moment_dtype("FusedAdamW", md, md)
        super().add_param_group(param_group)

    def _state(self, p, group):
        """The state of ``p``, created at its first update: tensors shaped like
        p, the moments in the group's moment dtype, the master in fp32 (for a
        DTensor p, DTensors sharded like it, built from local shards, so the
        state of a sharded parameter is sharded too)."""
        state = self.state[p]
        if not state:
            lp = local(p)
            md = group.get("moment_dtype", torch.float32)
            state["step"] = 0
            state["exp_avg"] = like(p, torch.zeros(lp.shape, dtype=md, device=lp.device))
            state["exp_avg_sq"] = like(p, torch.zeros(lp.shape, dtype=md, device=lp.device))
            if group["master_weights"] and p.dtype != torch.float32:
                state["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets = {}
            for p in group["params"]:
                grad = _grad_of(p, group.get("use_main_grad", False))
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ValueError("FusedAdamW: sparse gradients are not supported")
                check_layout("FusedAdamW", f"parameter of shape {tuple(p.shape)}", p, grad)
                state = self._state(p, group)
                state["step"] += 1
                master = state.get("master_param")
                lp = local(p)
                if lp.numel() == 0:  # an uneven FSDP2 split can leave a rank nothing of a small tensor
                    continue
                key = (lp.device, lp.dtype, grad.dtype, state["exp_avg"].dtype, master is not None, state["step"])
                lists = buckets.setdefault(key, ([], [], [], [], []))
                lists[0].append(lp)
                lists[1].append(local(grad))
                lists[2].append(local(state["exp_avg"]))
                lists[3].append(local(state["exp_avg_sq"]))
                if master is not None:
                    lists[4].append(local(master))
            for (_, _, _, _, has_master, step), (ps, gs, ms, vs, ws) in buckets.items():
                _ops.multi_tensor_adamw(ps, gs, ms, vs, ws if has_master else None, group["lr"], beta1, beta2,
                                        group["eps"], group["weight_decay"], step)
                # The kernel wrote the parameters behind torch's back: bump their
                # version counters as an in-place torch op would, so whatever is
                # keyed on them (autograd's saved-tensor checks, the FP8 weight
                # caches of seqfuse.pytorch.Linear) sees the update.
                torch.autograd.graph.increment_version(ps)
        return loss

    def load_state_dict(self, state_dict):
        """torch's loader, then the state put back exactly: the moments in the
        moment dtype this optimizer was built with (as Transformer Engine's
        FusedAdam: the constructor's choice wins over the file's; torch's
        loader would otherwise take the saved groups' key, or none from a
        torch AdamW or TE checkpoint), the masters in fp32 (torch's loader
        casts floating-point state to each parameter's dtype, which would
        round the master copies and moments of bf16 parameters).  Moments
        saved in another dtype are converted, with a warning (bf16 to fp32 is
        exact; fp32 to bf16 rounds).  DTensor state (a sharded parameter's,
        as DCP loads it) stays a DTensor."""
        built = [g.get("moment_dtype", torch.float32) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, md in zip(self.param_groups, built):
            group["moment_dtype"] = md
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        pairs = itertools.chain.from_iterable(((p, g) for p in g["params"]) for g in self.param_groups)
        converted = set()
        for saved_id, (p, group) in zip(saved_ids, pairs):
            saved = state_dict["state"].get(saved_id)
            if not saved:
                continue
            md = group["moment_dtype"]
            for key, dtype in (("exp_avg", md), ("exp_avg_sq", md), ("master_param", torch.float32)):
                if key in saved:
                    if saved[key].dtype != dtype:
                        converted.add((key, saved[key].dtype, dtype))
                    self.state[p][key] = as_state_of(p, saved[key].to(device=p.device, dtype=dtype, copy=True))
            self.state[p]["step"] = int(saved["step"])
        for key, was, now in sorted(converted, key=str):
            _log.warning("FusedAdamW.load_state_dict: saved %s in %s converted to this optimizer's %s", key, was,
                         now)
