"""ExpertParallelGroupedMLP: GroupedMLP with its experts sharded over an
expert-parallel (EP) process group.

Each of ep_size ranks holds L = num_experts / ep_size experts (experts
[ep_rank * L, (ep_rank + 1) * L)) and the whole router; every rank routes
its own tokens, seqfuse.distributed.dispatch_tokens sends each routed row to
the rank of its expert (all_to_all of the counts, then all_to_all_single
of the rows and their probabilities), the local experts run as in
GroupedMLP (gate-up GroupedLinear, SwiGLU scaled by the probability, down
GroupedLinear), and seqfuse.distributed.combine_tokens sends the results home
and sums each token's experts.  With one rank (ep_group None) it is
GroupedMLP.  Forward and backward: the exchanges are autograd Functions.

Parameters and checkpoints: the router (router_weight, expert_bias) is
replicated; fc1 / fc2 hold only the local experts, under their *global*
names (fc1.weight5 is expert 5 on whichever rank holds it).  A rank's
state_dict is therefore the part of a single-process GroupedMLP's
state_dict that it owns, with the same keys: the union of the ranks' state
dicts is a GroupedMLP checkpoint; torch.distributed.checkpoint, which
matches entries by key, saves at one EP size and loads at another; and
load_state_dict takes any dict holding this rank's experts (the entries of
other experts are skipped).  from_full / to_full / full_state_dict convert
from and to GroupedMLP (the last two gather over the EP group).

Initialisation does not depend on the EP size: the router from torch's RNG
(seed every rank alike, as for any replicated layer), expert e from
torch.manual_seed(base + e) with base one draw of torch's RNG.

Limits: every routed token is computed (no capacity factor or token
dropping); the auxiliary losses cover the rank's own tokens; under FP8 the
local GroupedLinear runs the active recipe as in GroupedMLP while the rows
travel in the compute dtype (not FP8).
"""
import re

import torch
import torch.distributed as dist

from ..common.recipe import DelayedScaling
from ..distributed.expert_parallel import combine_tokens, dispatch_tokens, group_size_rank
from ..quantization import get_amax_reduction_group, get_recipe, is_fp8_enabled
from ._base import default_device, init_weight
from ._input import check_input
from .grouped_linear import GroupedLinear
from .moe import GroupedMLP, RoutedExperts

__all__ = ["ExpertParallelGroupedMLP"]

_EXPERT_KEY = re.compile(r"^(fc[12]\.)(weight|bias)(\d+)$")


class _LocalExperts(GroupedLinear):
    """A GroupedLinear over experts [first, first + count) of a larger set,
    whose parameters carry the global expert numbers (weight{first + g})."""

    def __init__(self, first, count, in_features, out_features, bias, params_dtype, device, init_method):
        super().__init__(count, in_features, out_features, bias=bias, params_dtype=params_dtype,
                         device="meta", init_method=init_method)
        self.first_expert = int(first)
        dtype = params_dtype or torch.get_default_dtype()
        params = {}
        for g in range(count):
            e = self.first_expert + g
            params[f"weight{e}"] = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                                                  device=device))
            params[f"bias{e}"] = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
                                  if bias else None)
        self._parameters.clear()
        self._parameters.update(params)

    def weights(self):
        return [getattr(self, f"weight{self.first_expert + g}") for g in range(self.num_gemms)]

    def biases(self):
        if not self.use_bias:
            return []
        return [getattr(self, f"bias{self.first_expert + g}") for g in range(self.num_gemms)]

    def extra_repr(self):
        return (f"experts=[{self.first_expert}, {self.first_expert + self.num_gemms}), "
                f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}")


class ExpertParallelGroupedMLP(RoutedExperts):
    """GroupedMLP with its experts sharded over ``ep_group``.

    Arguments as GroupedMLP's (hidden_size, ffn_hidden_size, num_experts,
    topk, score_function, use_pre_softmax, scaling_factor, expert_bias,
    aux_loss_coeff, z_loss_coeff, bias, params_dtype, device, init_method),
    plus ep_group: a ProcessGroup or 1-D DeviceMesh whose size divides
    num_experts (None: one rank, every expert local).  Each rank holds
    experts [ep_rank * L, (ep_rank + 1) * L), L = num_experts / ep_size.

    Initialisation is independent of the EP size: the router from torch's
    RNG (seed every rank alike, as for any replicated layer), expert e from
    a generator seeded by (one draw of torch's RNG) + e.  forward(x [..., H],
    is_first_microbatch=None) -> [..., H] on the rank's own tokens;
    is_first_microbatch and ``aux_loss`` as GroupedMLP's."""

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, ep_group=None, *,
                 score_function="softmax", use_pre_softmax=False, scaling_factor=None, expert_bias=False,
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, bias=False, params_dtype=None, device=None,
                 init_method=None):
        super().__init__("ExpertParallelGroupedMLP", hidden_size, ffn_hidden_size, num_experts, topk,
                         score_function, use_pre_softmax, scaling_factor, expert_bias, aux_loss_coeff,
                         z_loss_coeff, params_dtype, device, init_method)
        self.ep_group, self.ep_size, self.ep_rank = group_size_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"ExpertParallelGroupedMLP: num_experts ({num_experts}) must be a multiple of "
                             f"the EP group's size ({self.ep_size})")
        self.num_local_experts = self.num_experts // self.ep_size
        self.first_expert = self.ep_rank * self.num_local_experts
        self.use_bias = bool(bias)
        dtype = params_dtype or torch.get_default_dtype()
        device = default_device(device)
        L, first = self.num_local_experts, self.first_expert
        self.fc1 = _LocalExperts(first, L, self.hidden_size, 2 * self.ffn_hidden_size, bias, dtype, device,
                                 init_method)
        self.fc2 = _LocalExperts(first, L, self.ffn_hidden_size, self.hidden_size, bias, dtype, device,
                                 init_method)
        self.register_load_state_dict_pre_hook(_drop_other_experts)
        if device.type != "meta":
            self.reset_parameters()

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, ep_size={self.ep_size}, "
                f"local experts=[{self.first_expert}, {self.first_expert + self.num_local_experts})")

    def local_experts(self):
        """Global numbers of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    @torch.no_grad()
    def reset_parameters(self):
        self.reset_router()
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
        device = self.router_weight.device
        devices = [device] if device.type == "cuda" else []
        for g, e in enumerate(self.local_experts()):
            with torch.random.fork_rng(devices=devices, device_type=device.type if devices else None):
                torch.manual_seed(base + e)
                for fc in (self.fc1, self.fc2):
                    init_weight(fc.weights()[g], self.init_method)
                    if fc.use_bias:
                        fc.biases()[g].zero_()

    def _refuse_delayed_scaling(self):
        """Delayed scaling keeps amax histories per expert GEMM slot and
        reduces them at the end of the step over the amax reduction group
        (the world by default): a group holding two ranks of ep_group would
        join different experts' histories (slot g is expert r * L + g on EP
        rank r), so that combination is refused."""
        if self.ep_size == 1 or not is_fp8_enabled() or not isinstance(get_recipe(), DelayedScaling):
            return
        group = get_amax_reduction_group()
        amax_ranks = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        if len(amax_ranks & set(dist.get_process_group_ranks(self.ep_group))) > 1:
            raise NotImplementedError(
                "ExpertParallelGroupedMLP: DelayedScaling with expert parallelism (ep_size "
                f"{self.ep_size}): the amax reduction group spans several expert-parallel ranks, which hold "
                "different experts, so their amax histories would be joined; use Float8CurrentScaling or "
                "Float8BlockScaling")

    def forward(self, hidden_states, is_first_microbatch=None):
        """The block's output for this rank's ``hidden_states`` [..., hidden_size];
        is_first_microbatch (Transformer Engine's gradient-accumulation
        argument) goes to both local GroupedLinears: under FP8, True casts the
        local experts' weights and keeps them, False reuses them, None as
        GroupedMLP.forward (in training a cast per call, none kept)."""
        check_input("ExpertParallelGroupedMLP", hidden_states, self.hidden_size, "hidden_size")
        self._refuse_delayed_scaling()
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, self.hidden_size)
        probs, routing_map, logits = self.route(x)
        self.aux_loss = self.aux_losses(logits) if self.training and x.shape[0] else None
        xr, pr, m_splits, handle = dispatch_tokens(x, probs, routing_map, self.ep_group,
                                                   self.num_local_experts)
        h = self.fc1(xr, m_splits, is_first_microbatch)
        # under FP8 the SwiGLU runs in fc2's input cast
        y = self.fc2(h, m_splits, is_first_microbatch, swiglu_probs=pr)
        out = combine_tokens(y, handle)
        # [T, H] input: the result itself, not a view of it (FSDP2 warns about views it hooks)
        return out if hidden_states.dim() == 2 else out.view(*lead, self.hidden_size)

    def expert_parameters(self):
        """This rank's expert parameters (seqfuse.distributed's gradient
        reduction and clipping treat them as sharded over ep_group)."""
        return list(self.fc1.parameters()) + list(self.fc2.parameters())

    def expert_modules(self):
        """The submodules holding only this rank's experts (FSDP2 shards them
        over the data-parallel ranks: seqfuse.distributed.fully_shard_expert_parallel)."""
        return [self.fc1, self.fc2]

    # ---- conversion to and from the single-process layer -----------------------

    def _config(self):
        return dict(score_function=self.score_function, use_pre_softmax=self.use_pre_softmax,
                    scaling_factor=self.scaling_factor, expert_bias=self.expert_bias is not None,
                    aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff, bias=self.use_bias,
                    params_dtype=self.router_weight.dtype, init_method=self.init_method)

    @classmethod
    def from_full(cls, full, ep_group=None, device=None):
        """This rank's share of a single-process layer: ``full`` is a
        GroupedMLP (its configuration and weights are taken) or another
        ExpertParallelGroupedMLP's to_full()."""
        if not isinstance(full, GroupedMLP):
            raise TypeError(f"ExpertParallelGroupedMLP.from_full: argument 'full' must be a GroupedMLP, got "
                            f"{type(full).__name__}")
        device = full.router_weight.device if device is None else torch.device(device)
        layer = cls(full.hidden_size, full.ffn_hidden_size, full.num_experts, full.topk, ep_group,
                    score_function=full.score_function, use_pre_softmax=full.use_pre_softmax,
                    scaling_factor=full.scaling_factor, expert_bias=full.expert_bias is not None,
                    aux_loss_coeff=full.aux_loss_coeff, z_loss_coeff=full.z_loss_coeff,
                    bias=full.fc1.use_bias, params_dtype=full.router_weight.dtype, device="meta",
                    init_method=full.init_method)
        layer.to_empty(device=device)
        layer.load_state_dict(full.state_dict())
        return layer

    @torch.no_grad()
    def full_state_dict(self):
        """The single-process GroupedMLP's state dict (every expert), gathered
        over the EP group: a collective, every EP rank must call it; every
        rank gets the whole dict."""
        sd = {k: v.detach() for k, v in self.state_dict().items()}
        if self.ep_size == 1:
            return sd
        L = self.num_local_experts
        for fc_name in ("fc1", "fc2"):
            fc = getattr(self, fc_name)
            for kind, tensors in (("weight", fc.weights()), ("bias", fc.biases())):
                for g, t in enumerate(tensors):
                    parts = [torch.empty_like(t) for _ in range(self.ep_size)]
                    dist.all_gather(parts, t.detach().contiguous(), group=self.ep_group)
                    for r, part in enumerate(parts):
                        sd[f"{fc_name}.{kind}{r * L + g}"] = part
        order = ["router_weight"] + (["expert_bias"] if self.expert_bias is not None else [])
        for fc_name in ("fc1", "fc2"):
            for e in range(self.num_experts):
                order.append(f"{fc_name}.weight{e}")
                if self.use_bias:
                    order.append(f"{fc_name}.bias{e}")
        return {k: sd[k] for k in order}

    def to_full(self, device=None):
        """A GroupedMLP holding every expert (a collective over the EP group)."""
        sd = self.full_state_dict()
        device = self.router_weight.device if device is None else torch.device(device)
        full = GroupedMLP(self.hidden_size, self.ffn_hidden_size, self.num_experts, self.topk, device="meta",
                          **self._config())
        full.to_empty(device=device)
        full.load_state_dict(sd)
        return full


def _drop_other_experts(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs):
    """load_state_dict pre-hook: skip the entries of experts this rank does
    not hold, so a GroupedMLP checkpoint or a checkpoint saved at another EP
    size loads (this rank's experts must be there: strict loading still
    reports them missing)."""
    local = set(module.local_experts())
    for key in [k for k in state_dict if k.startswith(prefix)]:
        m = _EXPERT_KEY.match(key[len(prefix):])
        if m and int(m.group(3)) not in local:
            del state_dict[key]
