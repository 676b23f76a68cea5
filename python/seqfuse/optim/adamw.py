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
  would), so training resumes bit for bit.  A checkpoint whose moment dtype
  is not the group's is refused (ValueError naming both and how to make them
  match), never silently re-rounded: see load_state_dict.
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
- What the kernel cannot honour is refused, naming the argument, group or
  parameter: amsgrad / maximize / decoupled_weight_decay=False with weight
  decay (torch.optim.Adam's L2) in the constructor, any group (added or
  changed later: checked at every step too) or a loaded checkpoint; betas
  that are not a pair; parameters other than float32 / bfloat16 / float16,
  gradients of another shape or dtype; loaded state of another shape.  A
  step checks every group and parameter before it updates any, so a
  refused step changes nothing (no parameter, moment or step count).
  Checked in full, those cost microseconds of Python per parameter, so a
  step compares each parameter, gradient and state with what the last
  fully checked step found, and checks in full only where something
  differs (the step plan: see the note above _Entry).
"""
import itertools
import logging
import numbers
import operator
from typing import NamedTuple

import torch

from ..ops import optim as _ops
from ._dtensor import as_state_of, check_layout, check_state_shape, is_dtensor, like, local

_log = logging.getLogger("seqfuse")
#: The moment dtypes the kernel keeps.
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
#: The parameter dtypes the kernel updates.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    """(the gradient FusedAdamW reads for p, its name) or (None, None)."""
    if use_main_grad:
        main_grad = getattr(p, "main_grad", None)
        if main_grad is not None:
            return main_grad, "main_grad"
    return (p.grad, "grad") if p.grad is not None else (None, None)


def _param_name(p, gi, pj):
    return f"parameter {pj} of param group {gi} (shape {tuple(p.shape)})"


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


# The step plan.  A step checks every parameter and gradient in full (_check_param) and sorts
# the parameters into launches by device, dtype, gradient dtype, moment dtype, master and step
# count: microseconds of Python per parameter.  From one step to the next nothing of that
# changes but the gradient tensors (and the counts, read at each step), so a step that went
# through the full path (FusedAdamW._checked) records what it found of each parameter (_Entry)
# and the next steps compare against that record instead (FusedAdamW._planned): a parameter,
# gradient and state equal to their entry are ones _check_param passes, and the parameter goes
# to the launch the full path would give it (same lists in the same order, same step counts; a
# parameter without a gradient is left out, as there).  The comparison only decides "as
# recorded": anything else -- a group added, a parameter list edited, a parameter's .data
# swapped (its address; memory on another device has another address), a gradient of another
# type / dtype / shape / device / layout or in the parameter's memory, a first gradient of a
# parameter the plan has no entry for, a state cleared, replaced or edited -- sends the whole
# step down the full path, which raises today's error or records a new plan.  add_param_group
# and load_state_dict drop the plan; a parameter listed in two groups gets none.  The plan
# holds the parameters (as their groups do) and plain values: no gradient, group or state (the
# state is looked up at each step).


class _Entry(NamedTuple):
    """One parameter as the full path last found it (``lp``: its local tensor,
    a DTensor's to_local(), else itself): what the next steps compare it,
    its gradient and its state with."""
    kind: int  # its launch kind: index of (device, dtype, grad dtype, moment dtype, master, empty) in the group's
    layout: tuple  # DTensor p: (mesh, placements, global shape) of p and its gradient; plain p: None
    ptr: int  # lp.data_ptr(): p.data not swapped (nor moved to another device), the gradient not there; 0 if empty
    shape: torch.Size  # lp's, and the local gradient's
    dtype: torch.dtype  # lp's
    device: torch.device  # lp's, and the local gradient's
    empty: bool  # lp has no element: the step is counted, nothing launched (no contiguity or memory check)
    grad_type: type
    grad_dtype: torch.dtype
    exp_avg_type: type
    exp_avg_sq_type: type
    master_type: type  # NoneType where the state has no master
    moment_dtype: torch.dtype  # exp_avg's
    local_state: bool  # a state tensor is a DTensor: the kernel gets its local tensor


class _GroupPlan(NamedTuple):
    params: tuple  # the group's params as recorded
    entries: tuple  # an _Entry's fields (a plain tuple: unpacked faster) per parameter, None where none yet
    kinds: tuple  # (has_master, launch) per launch kind


def _launches(buckets, kinds):
    """The launches of a group from its {(kind, step count): lists}: [(step,
    has_master, launch, (params, grads, exp_avgs, exp_avg_sqs, masters,
    states)), ...] in the order of the buckets' first parameters."""
    return [(count + 1, *kinds[kind], lists) for (kind, count), lists in buckets.items()]


class FusedAdamW(torch.optim.Optimizer):
    #: Group keys that say how this optimizer runs (where this model's gradients are, which
    #: kernel modes it was built for), not where the training was: load_state_dict keeps this
    #: optimizer's values over a checkpoint's (for moment_dtype only after checking that the
    #: checkpoint's moments are in it, or widen exactly to it: _check_saved_moments).  The rest
    #: (hyper-parameters, master_weights) come from the file where it has them, as torch's
    #: loader does.
    _CONSTRUCTOR_KEYS = ("use_main_grad", "moment_dtype", "adam_w_mode")

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 master_weights=True, amsgrad=False, maximize=False, use_main_grad=False, *,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32):
        moments = moment_dtype(type(self).__name__, exp_avg_dtype, exp_avg_sq_dtype)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights,
                        use_main_grad=use_main_grad, moment_dtype=moments)
        # keys a subclass adds to every group (te.optimizers.FusedAdam's adam_w_mode)
        defaults.update(getattr(self, "_extra_defaults", {}))
        self._check_group(dict(defaults, amsgrad=amsgrad, maximize=maximize), "argument '{}'")
        super().__init__(params, defaults)

    def _check_group(self, group, name, refuse=NotImplementedError, at_step=False):
        """Raise if ``group`` (a parameter group, or the constructor's
        arguments) holds a value FusedAdamW cannot honour.  ``name`` formats
        a key into the message ("argument '{}'", "param_groups[1]['{}']");
        ``refuse`` is the exception for a feature the kernel does not have
        (NotImplementedError, ValueError for a checkpoint's groups).  Run by
        the constructor, add_param_group (the constructor's groups included),
        load_state_dict (the saved groups, before anything changes) and every
        step (values changed since, e.g. by a scheduler: there a tensor lr
        is read as a number, as the kernel's entry does)."""
        op = type(self).__name__
        for key in ("lr", "eps", "weight_decay"):
            if key not in group:
                continue
            value = group[key]
            if isinstance(value, torch.Tensor):
                if not at_step or value.numel() != 1:
                    raise TypeError(f"{op}: {name.format(key)} must be a Python number, not a tensor")
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{op}: {name.format(key)} must be a number, got {type(value).__name__} {value!r}")
            if not 0.0 <= value:
                raise ValueError(f"{op}: {name.format(key)} must be >= 0, got {value}")
        if "betas" in group:
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise ValueError(f"{op}: {name.format('betas')} must be a pair (beta1, beta2), got {betas!r}")
            for b in betas:
                if isinstance(b, torch.Tensor) and b.numel() == 1:
                    b = b.item()
                if isinstance(b, bool) or not isinstance(b, numbers.Real):
                    raise TypeError(f"{op}: {name.format('betas')} must hold two numbers, got {betas!r}")
                if not 0.0 <= b < 1.0:
                    raise ValueError(f"{op}: {name.format('betas')} must lie in [0, 1), got {tuple(betas)}")
        for key, why in (("amsgrad", "AMSGrad is not implemented in seqfuse's Adam kernel"),
                         ("maximize", "seqfuse's Adam kernel always descends (maximize would be ignored)")):
            if group.get(key):
                raise refuse(f"{op}: {name.format(key)}={group[key]!r} is not supported: {why}")
        wd = group.get("weight_decay", 0.0)
        wd = wd.item() if isinstance(wd, torch.Tensor) else wd
        for key in ("decoupled_weight_decay", "adam_w_mode"):
            if key in group and not group[key] and wd > 0:
                raise refuse(f"{op}: {name.format(key)}={group[key]!r} with weight_decay={wd} > 0 is not "
                             "supported: that is Adam with L2 regularisation (torch.optim.Adam's weight_decay), "
                             "which seqfuse's kernel does not implement; it decays decoupled (AdamW) only")
        if "moment_dtype" in group:
            md = group["moment_dtype"]
            moment_dtype(op, md, md)

    def add_param_group(self, param_group):
        """torch's, with the group's values checked here (the constructor's
        groups too), not at the first step: hyper-parameters as the
        constructor checks them, betas a pair, ``moment_dtype`` (the key
        the constructor's exp_avg_dtype / exp_avg_sq_dtype set) one the
        kernel keeps, and no ``amsgrad`` / ``maximize`` /
        ``decoupled_weight_decay=False`` (with weight decay) the kernel
        would ignore."""
        if isinstance(param_group, dict):
            merged = {k: v for k, v in self.defaults.items() if k not in param_group}
            merged.update((k, v) for k, v in param_group.items() if k != "params")
            self._check_group(merged, f"param_groups[{len(self.param_groups)}]['{{}}']")
        super().add_param_group(param_group)
        self._plan = None  # (the next step takes the full path and records the new group too)

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
            if group.get("master_weights", True) and p.dtype != torch.float32:
                state["master_param"] = like(p, lp.detach().to(torch.float32, copy=True))
        return state

    def _check_param(self, p, grad, grad_name, gi, pj):
        """Everything the kernel would refuse about parameter ``pj`` of group
        ``gi`` and its gradient, checked before any update of a step runs (so
        a refused step changes nothing: no parameter, moment or step count).
        The common case costs a few attribute reads and allocates nothing;
        the messages are built only for a refusal."""
        op = type(self).__name__
        if grad.is_sparse:
            raise ValueError(f"{op}: sparse gradients are not supported ({_param_name(p, gi, pj)})")
        if is_dtensor(p) or is_dtensor(grad):
            check_layout(op, _param_name(p, gi, pj), p, grad)
            lp, lg = local(p), local(grad)
        else:
            lp, lg = p, grad
        pd, gd = p.dtype, grad.dtype
        if pd not in PARAM_DTYPES:
            raise TypeError(f"{op}: {_param_name(p, gi, pj)} has dtype {_dtype_name(pd)}; {op} takes float32, "
                            "bfloat16 or float16 parameters (torch.optim.AdamW takes others)")
        if gd != pd and not (gd == torch.float32 and pd != torch.float32):
            also = " or float32" if pd != torch.float32 else ""
            raise TypeError(f"{op}: the {grad_name} of {_param_name(p, gi, pj)} has dtype {_dtype_name(gd)}; it "
                            f"must have the parameter's dtype ({_dtype_name(pd)}){also}")
        if grad.shape != p.shape or (lg is not grad and lg.shape != lp.shape):
            raise ValueError(f"{op}: the {grad_name} of {_param_name(p, gi, pj)} has shape {tuple(grad.shape)}; it "
                             "must have the parameter's shape")
        if lg.device != lp.device:
            raise ValueError(f"{op}: the {grad_name} of {_param_name(p, gi, pj)} is on {lg.device}, the parameter "
                             f"on {lp.device}; they must be on one device")
        if lp.numel() == 0:
            return
        if not lp.is_contiguous() or not lg.is_contiguous():
            what = "" if not lp.is_contiguous() else f"the {grad_name} of "
            raise ValueError(f"{op}: {what}{_param_name(p, gi, pj)} must be contiguous (row-major); call "
                             ".contiguous() on it first")
        if lg.data_ptr() == lp.data_ptr():
            raise ValueError(f"{op}: the {grad_name} of {_param_name(p, gi, pj)} is the parameter's own memory; "
                             "it must be a tensor of its own")
        if pd == torch.float32:
            state = self.state.get(p)
            if state and state.get("master_param") is not None:
                raise ValueError(f"{op}: {_param_name(p, gi, pj)} is float32 but its state holds a 'master_param' "
                                 "(fp32 master copies are for bfloat16 / float16 parameters)")

    #: The step plan (see the note above _Entry): a _GroupPlan per group, or None (until a step
    #: has gone through the full path, and after add_param_group or load_state_dict).
    _plan = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launches = self._planned()
        if launches is None:
            launches = self._checked()
        for group, buckets in launches:
            self._launch(group, buckets)
        return loss

    def _checked(self):
        """The full path of a step: every group and parameter is checked
        before anything changes (a refused step updates no parameter and
        advances no step count); then, group by group, the state of a first
        update is made and the parameters are sorted into launches (see
        _built).  Returns an iterator of (group, launches)."""
        self._plan = None
        checked = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f"param_groups[{gi}]['{{}}']", at_step=True)
            params, grads, where = [], [], []  # (parallel lists: no tuple per parameter for the GC to track)
            for pj, p in enumerate(group["params"]):
                grad, grad_name = _grad_of(p, group.get("use_main_grad", False))
                if grad is None:
                    continue
                self._check_param(p, grad, grad_name, gi, pj)
                params.append(p)
                grads.append(grad)
                where.append(pj)
            checked.append((group, params, grads, where))
        return self._built(checked)

    def _built(self, checked):
        """Each checked group's (group, launches), built when the previous
        group's launches have run (so a parameter listed in two groups, which
        only changing param_groups by hand can make, has its count advanced
        by the first group's launch before the second reads it).  Once all
        are built, records the plan the next steps are compared with, unless
        a parameter is in two groups: the plan reads every count before the
        first launch."""
        plans = []
        for group, params, grads, where in checked:
            buckets = {}  # (launch kind, step count) -> lists, in the order of their first parameters
            kinds = {}  # (device, dtype, grad dtype, moment dtype, has master, empty) -> launch kind
            entries = [None] * len(group["params"])
            for p, grad, pj in zip(params, grads, where):
                state = self._state(p, group)
                m, v, w = state["exp_avg"], state["exp_avg_sq"], state.get("master_param")
                lp, lg, lm, lv, lw = local(p), local(grad), local(m), local(v), local(w)
                # an uneven FSDP2 split can leave a rank nothing of a small tensor: it only counts the step
                empty = lp.numel() == 0
                kind = kinds.setdefault((lp.device, lp.dtype, grad.dtype, m.dtype, w is not None, empty), len(kinds))
                ps, gs, ms, vs, ws, states = buckets.setdefault((kind, state["step"]), ([], [], [], [], [], []))
                if not empty:
                    ps.append(lp)
                    gs.append(lg)
                    ms.append(lm)
                    vs.append(lv)
                    if w is not None:
                        ws.append(lw)
                states.append(state)
                entries[pj] = tuple(_Entry(
                    kind, None if lp is p else (p.device_mesh, tuple(p.placements), p.shape),
                    0 if empty else lp.data_ptr(), lp.shape, lp.dtype, lp.device, empty, type(grad), grad.dtype,
                    type(m), type(v), type(w), m.dtype, lm is not m or lv is not v or lw is not w))
            kinds = tuple((has_master, not empty) for *_, has_master, empty in kinds)
            plans.append(_GroupPlan(tuple(group["params"]), tuple(entries), kinds))
            yield group, _launches(buckets, kinds)
        ids = [{id(p) for p in plan.params} for plan in plans]
        if sum(map(len, ids)) == len(set().union(*ids)):
            self._plan = tuple(plans)

    def _planned(self):
        """The launches of this step as _checked would return them, where every
        group, parameter, gradient and state is as the plan recorded it (each
        group's values are checked here as there, and raise the same), else
        None: the full path then decides."""
        plans = self._plan
        if plans is None or len(plans) != len(self.param_groups):
            return None
        launches = []
        for gi, (group, group_plan) in enumerate(zip(self.param_groups, plans)):
            self._check_group(group, f"param_groups[{gi}]['{{}}']", at_step=True)
            try:
                buckets = self._as_planned(group, group_plan)
            except (KeyError, TypeError, AttributeError, ValueError, IndexError):
                # (a state the plan did not see, e.g. one without 'step': the full path names it)
                return None
            if buckets is None:
                return None
            launches.append((group, _launches(buckets, group_plan.kinds)))
        return launches

    def _as_planned(self, group, group_plan):
        """The {(launch kind, step count): lists} of a group whose parameters,
        gradients and states are as ``group_plan`` recorded them, else None.
        Each test passes only a value equal to the recorded one, which passed
        _check_param: the full check is the one that refuses, so the two
        cannot disagree on what is refused.  Nothing is changed here."""
        params = group["params"]
        if len(params) != len(group_plan.params) or not all(map(operator.is_, params, group_plan.params)):
            return None
        use_main_grad = group.get("use_main_grad", False)
        state_of = self.state.get
        strided = torch.strided
        buckets = {}
        last_kind = last_count = None  # the bucket whose lists are at hand (neighbours mostly share one)
        for p, entry in zip(params, group_plan.entries):
            grad = getattr(p, "main_grad", None) if use_main_grad else None
            if grad is None:
                grad = p.grad
                if grad is None:  # not updated this step, as in the full path
                    continue
            if entry is None:  # its first gradient since the plan was recorded
                return None
            (kind, layout, ptr, shape, dtype, device, empty, grad_type, grad_dtype, m_type, v_type, w_type,
             moment_dtype, local_state) = entry
            if type(grad) is not grad_type:  # (also: a DTensor where it was a plain tensor, or the other way)
                return None
            if layout is None:
                lp, lg = p, grad
            else:
                if ((grad.device_mesh, tuple(grad.placements), grad.shape) != layout
                        or (p.device_mesh, tuple(p.placements), p.shape) != layout):
                    return None
                lp, lg = local(p), local(grad)
            if (grad.layout is not strided or lg.dtype is not grad_dtype or lg.shape != shape
                    or lg.device != device or lp.dtype is not dtype or lp.shape != shape):
                return None
            if empty:
                if lp.device != device:
                    return None
            elif (lp.data_ptr() != ptr or lg.data_ptr() == ptr or not lp.is_contiguous()
                    or not lg.is_contiguous()):
                return None
            state = state_of(p)  # (None, or a state without these keys, raises: the full path decides)
            count = state["step"]
            m, v, w = state["exp_avg"], state["exp_avg_sq"], state.get("master_param")
            if (type(m) is not m_type or type(v) is not v_type or type(w) is not w_type or m.dtype is not moment_dtype
                    or type(count) is not int):  # (a count set to a tensor: the full path keys its launch by it)
                return None
            if kind != last_kind or count != last_count:
                last_kind, last_count = kind, count
                ps, gs, ms, vs, ws, states = buckets.setdefault((kind, count), ([], [], [], [], [], []))
            if not empty:
                if local_state:
                    m, v, w = local(m), local(v), local(w)
                ps.append(lp)
                gs.append(lg)
                ms.append(m)
                vs.append(v)
                if w is not None:
                    ws.append(w)
            states.append(state)
        return buckets

    @staticmethod
    def _launch(group, launches):
        """Run a group's launches (see _launches) and count the steps of
        exactly the parameters they updated."""
        for step, _, launch, (_, _, _, _, _, states) in launches:
            if not launch:  # parameters without a local element: the step is counted, nothing runs
                for state in states:
                    state["step"] = step
        beta1, beta2 = group["betas"]
        for step, has_master, launch, (ps, gs, ms, vs, ws, states) in launches:
            if not launch:
                continue
            # (step() has checked every list: the op's own pass over them is skipped)
            _ops.multi_tensor_adamw_prechecked(ps, gs, ms, vs, ws if has_master else None, group["lr"], beta1,
                                               beta2, group["eps"], group["weight_decay"], step)
            for state in states:
                state["step"] = step
            # The kernel wrote the parameters behind torch's back: bump their
            # version counters as an in-place torch op would, so whatever is
            # keyed on them (autograd's saved-tensor checks, the FP8 weight
            # caches of seqfuse.pytorch.Linear) sees the update.
            torch.autograd.graph.increment_version(ps)

    def _check_saved(self, state_dict):
        """The checks load_state_dict makes before it changes anything: each
        saved group merged with the built group's keys it lacks passes
        _check_group (ValueError for a feature the kernel does not have:
        a torch AdamW checkpoint with maximize or amsgrad, a torch Adam one
        with L2 weight decay), and each saved state has the moments and a
        step count, its tensors shaped like their parameter."""
        op = f"{type(self).__name__}.load_state_dict"
        saved_groups = state_dict.get("param_groups")
        if (not isinstance(saved_groups, (list, tuple)) or len(saved_groups) != len(self.param_groups)
                or any(not isinstance(s, dict) or len(s.get("params", ())) != len(g["params"])
                       for s, g in zip(saved_groups, self.param_groups))):
            return  # torch's loader refuses these itself, before changing anything
        for gi, (saved, built) in enumerate(zip(saved_groups, self.param_groups)):
            merged = {k: v for k, v in built.items() if k not in ("params", "param_names")}
            merged.update((k, v) for k, v in saved.items() if k not in ("params", "param_names"))
            merged.update((k, built[k]) for k in self._CONSTRUCTOR_KEYS if k in built)  # the constructor's win
            self._check_group(merged, f"the state dict's param_groups[{gi}]['{{}}']", refuse=ValueError,
                              at_step=True)  # a one-element tensor lr (torch's fused AdamW) loads
        states = state_dict.get("state", {})
        for gi, (saved, built) in enumerate(zip(saved_groups, self.param_groups)):
            for pj, (saved_id, p) in enumerate(zip(saved["params"], built["params"])):
                st = states.get(saved_id)
                if not st:
                    continue
                where = f"the state of parameter {pj} of param group {gi}"
                for key in ("step", "exp_avg", "exp_avg_sq"):
                    if key not in st:
                        raise ValueError(f"{op}: {where} has no '{key}' (it has {sorted(st)})")
                step = st["step"]
                if isinstance(step, torch.Tensor) and step.numel() == 1:
                    step = step.item()
                if (isinstance(step, bool) or not isinstance(step, numbers.Real) or step < 0
                        or step != int(step)):
                    raise ValueError(f"{op}: {where} has 'step'={st['step']!r}; it must be a whole number >= 0")
                for key in ("exp_avg", "exp_avg_sq", "master_param"):
                    if key in st:
                        if not isinstance(st[key], torch.Tensor):
                            raise TypeError(f"{op}: {where} has '{key}' of type {type(st[key]).__name__}; it "
                                            "must be a tensor")
                        check_state_shape(op, p, st[key], f"{where}: '{key}'")
        for gi, (saved, built) in enumerate(zip(saved_groups, self.param_groups)):
            self._check_saved_moments(op, gi, saved, built, states)

    def _check_saved_moments(self, op, gi, saved, built, states):
        """Refuse (ValueError) loading saved group ``gi`` into ``built`` where
        that would change the precision of the saved moments: a group saved
        with another 'moment_dtype' (a FusedAdamW checkpoint: its setting is
        in the file), or, in a checkpoint without the key (torch.optim's,
        Transformer Engine's), moments that only a rounding conversion would
        bring to this group's dtype (16-bit moments widened to float32 are
        kept exactly, so they load).  Decided on group keys and tensor dtypes
        alone, which every rank of a sharded load sees the same: all ranks
        refuse or none does."""
        have = built.get("moment_dtype", torch.float32)
        rounds = have != torch.float32
        convert = (f"to change the moment dtype on purpose, set state_dict['param_groups'][{gi}]['moment_dtype'] "
                   f"= {have} before loading" + (f" (the saved moments are then rounded to {have})" if rounds
                                                 else ""))
        if "moment_dtype" in saved:
            was = saved["moment_dtype"]
            if was != have:
                raise ValueError(
                    f"{op}: the state dict's param_groups[{gi}] was saved with moment_dtype={was!r}, but this "
                    f"optimizer's param_groups[{gi}] keeps its moments in {have}: loading would change the "
                    f"precision of the saved moments.  To resume as saved, build the optimizer with "
                    f"exp_avg_dtype=exp_avg_sq_dtype={was!r}; {convert}")
            return
        for pj, saved_id in enumerate(saved["params"]):
            st = states.get(saved_id) or {}
            for key in ("exp_avg", "exp_avg_sq"):
                was = getattr(st.get(key), "dtype", have)
                if was != have and not (have == torch.float32 and was in (torch.bfloat16, torch.float16)):
                    if was in MOMENT_DTYPES:
                        keep = f"To resume as saved, build the optimizer with exp_avg_dtype=exp_avg_sq_dtype={was}; "
                    elif was == torch.float16:  # a torch checkpoint of fp16 parameters: no fp16 moments here
                        keep = ("To keep the saved values exactly, build the optimizer with "
                                "exp_avg_dtype=exp_avg_sq_dtype=torch.float32 (float16 widens exactly); ")
                    else:  # float64: no exact home here
                        keep = ""
                    fixes = keep + convert if keep else convert[0].upper() + convert[1:]
                    raise ValueError(
                        f"{op}: the state dict's param_groups[{gi}] has no 'moment_dtype' (a torch.optim or "
                        f"Transformer Engine checkpoint) and the state of its parameter {pj} holds '{key}' in "
                        f"{was}, but this optimizer's param_groups[{gi}] keeps its moments in {have}: converting "
                        f"would round the saved values.  {fixes}")

    def load_state_dict(self, state_dict):
        """torch's loader, then the state put back exactly: the moments in the
        group's moment dtype, the masters in fp32 (torch's loader casts
        floating-point state to each parameter's dtype, which would round the
        master copies and moments of bf16 parameters).  DTensor state (a
        sharded parameter's, as DCP loads it) stays a DTensor.

        The moment dtype is never changed silently, in either direction:
        loading must not round what was saved, and a run resumed from a
        checkpoint must keep the precision it was saved with.  So a group
        saved with another ``moment_dtype`` than this optimizer's group
        (a FusedAdamW or te.optimizers.FusedAdam checkpoint of float32
        moments loaded into one built with exp_avg_dtype=torch.bfloat16, or
        the other way round) is refused with a ValueError naming both dtypes
        and the two ways to make them match: build the optimizer with the
        saved dtype to resume as saved, or, to change the dtype on purpose,
        set ``state_dict['param_groups'][i]['moment_dtype']`` to this
        optimizer's before loading (the saved moments are then converted;
        float32 to bfloat16 rounds).  A checkpoint without the key
        (torch.optim's AdamW, Transformer Engine's FusedAdam) says its
        precision by its moments' dtype: bfloat16 / float16 moments widen
        exactly into a float32 group and load (a log line names the
        conversion); moments that would be rounded (float32 ones into a
        bfloat16 group) are refused the same way.  Moments already in the
        key's dtype, or saved widened to float32 under it (as
        te.optimizers.FusedAdam saves its bfloat16 moments, like TE), load
        exactly.  One path this check cannot see: torch.distributed.checkpoint
        loads into this optimizer's own state (its dtypes) before this loader
        runs, so a checkpoint without the key (torch's, TE's) whose float32
        moments DCP loads into a bfloat16 group arrives already rounded; a
        FusedAdamW checkpoint carries the key and is refused there too.

        torch's loader replaces each group by the saved one, hyper-parameters
        included.  Here the keys that say how this optimizer runs
        (use_main_grad, te.optimizers.FusedAdam's adam_w_mode, and
        moment_dtype once checked as above) keep this optimizer's values
        whatever the file says: use_main_grad says where this process's
        model leaves its gradients (in main_grad or .grad), which is not
        training state and is nothing the file could know better (a torch
        checkpoint has no such key; a FusedAdam one saved
        use_main_grad=False, which would leave main_grad unread); Transformer
        Engine keeps its equivalent (use_decoupled_grad) out of the state
        dict for the same reason.  Every other key a saved group lacks
        (master_weights in a torch or TE checkpoint) keeps this optimizer's
        value too.  A 16-bit parameter of a
        master_weights group whose saved state has no fp32 master (torch's
        AdamW keeps none) gets one from its value; saved masters are kept
        (they hold the exact values) even where master_weights is False.  Refused
        (ValueError naming the group and key, before anything changes): a
        saved group with amsgrad or maximize, or decoupled_weight_decay=False
        with weight decay (torch.optim.Adam's L2), which the kernel would
        ignore; a moment dtype that does not match (above); state without
        its moments or step, or whose tensors do not have their parameter's
        shape."""
        self._check_saved(state_dict)
        built = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in self.param_groups]
        self._plan = None  # (new groups and state: the next step takes the full path)
        super().load_state_dict(state_dict)
        for group, keys in zip(self.param_groups, built):
            for key, value in keys.items():
                if key in self._CONSTRUCTOR_KEYS or key not in group:
                    group[key] = value
            group.setdefault("moment_dtype", torch.float32)
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
                    self.state[p][key] = as_state_of(p, saved[key].to(device=p.device, dtype=dtype, copy=True,
                                                                      memory_format=torch.contiguous_format),
                                                     key)
            step = saved["step"]
            self.state[p]["step"] = int(step.item() if isinstance(step, torch.Tensor) else step)
            if (group.get("master_weights", True) and p.dtype != torch.float32
                    and self.state[p].get("master_param") is None):
                self.state[p]["master_param"] = like(p, local(p).detach().to(torch.float32, copy=True))
        for key, was, now in sorted(converted, key=str):
            _log.warning("FusedAdamW.load_state_dict: saved %s in %s converted to this optimizer's %s", key, was,
                         now)
