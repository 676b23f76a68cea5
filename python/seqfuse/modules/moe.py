"""GroupedMLP: a Mixtral-style mixture-of-experts feed-forward block built
from seqfuse's router, token permutation and grouped GEMMs.

For tokens x [T, hidden] (any leading shape):

    logits          = x @ W_router^T                       [T, E]   (Linear)
    probs, map      = fused_topk_with_score_function(logits, topk)  (C router)
    xp, p, row_ids  = moe_permute_with_probs(x, probs, map)  [N, hidden], N = T * topk
    h               = fc1(xp, m_splits)                     [N, 2 * ffn]  (GroupedLinear)
    a               = swiglu(h) * p                         [N, ffn]  (gate = first half)
    y_e             = fc2(a, m_splits)                      [N, hidden]   (GroupedLinear, swiglu_probs:
                                                                           FP8 delayed: a made in fc2's cast)
    out             = moe_unpermute(y_e, row_ids)           [T, hidden]  (sum over a token's experts)

On CUDA in bfloat16, or under Float8CurrentScaling with E4M3 gradients
(no expert biases), the grouped GEMMs take m_splits (tokens per expert) on
the GPU (GroupedLinear's device-split route; its FP8 form casts each row
with its own scale) and the block never waits on the host.  Under
DelayedScaling (after the layer's first FP8 forward; compute capability
9.0 with seqfuse's sm_90a build, bfloat16, no bias, E4M3 inputs, FP8
statistics off, not inside an activation checkpoint:
GroupedLinear.device_split_refusal names what is missing) the forward
takes them on the GPU (each expert's delayed scale, seqfuse's sm90 grouped
kernel) and the backward reads one host copy of them, queued in the
forward for both layers.  Otherwise
m_splits are read to the host once per forward (seqfuse's cuBLASLt grouped
GEMMs take host row counts): the block's one host synchronization.
Its copy is queued as soon as the counts exist and waited for after the
work that does not need them (under FP8 the experts' weight casts), so the
GPU has work while the host waits.  Under FP8 autocast with host counts the permutation
writes each expert's rows in a block padded to a multiple of 16 rows (zero
rows between experts; pad_row_id_map), the granularity of the FP8 GEMMs,
which then take the buffer as it is: no padded copy before a GEMM and no
gather of the real rows after it.
The routing weight scales the SwiGLU output (Megatron's placement, which
keeps nothing between the two GEMMs but the activation).  Without expert
biases (Mixtral has none) that is the same as weighting the expert outputs
in the un-permutation, as transformers' MixtralSparseMoeBlock does; with
``bias=True`` fc2's bias is added unweighted, so the block computes
out = sum_e (p_e * fc2_e(swiglu(fc1_e(x))) - p_e * b2_e + b2_e), i.e.
sum_e p_e * W2_e a_e + b2_e, not sum_e p_e * (W2_e a_e + b2_e).

Kept for the backward between the two GEMMs: fc1's output h and the
permuted probabilities p, not the SwiGLU output a.  fc2's autograd Function
computes a from them and makes it again in the backward for its weight
gradient with the same kernel, the same bits (one elementwise pass instead
of [N, ffn] kept); under FP8 current and block scaling it makes a's
transposed FP8 copy again likewise, under delayed scaling it keeps that
copy (GroupedLinear's FP8 function says why).

Auxiliary losses: with aux_loss_coeff > 0 the load-balancing loss
(fused_compute_score_for_moe_aux_loss + fused_moe_aux_loss, Switch /
GShard form) and with z_loss_coeff > 0 the router z-loss are computed in
the forward and left in ``self.aux_loss`` (a float32 scalar with autograd
history, or None): add it to the training loss.

Expert weights: fc1.weight{e} is [2 * ffn, hidden], rows [0, ffn) the gate
projection (Mixtral's w1) and [ffn, 2 ffn) the up projection (w3);
fc2.weight{e} is [hidden, ffn] (w2).  Under an FP8 autocast with a
per-tensor recipe the two grouped GEMMs run in FP8 (GroupedLinear's FP8
path); the router stays in the activation dtype, and the SwiGLU is
computed inside fc2's input cast under delayed scaling (GroupedLinear's
swiglu_probs: one kernel reads fc1's output and writes fc2's FP8 operands,
row-wise and transposed, every expert with its own scale), so nothing
between the two GEMMs is written in bf16; current scaling writes the
SwiGLU output and casts it (its fused form reads fc1's output twice and
measured slower on an H200).
"""
import logging

import torch
from torch.nn.modules import module as _torch_module

from .. import quantization as _q
from ..common.notes import note_once
from ..common.recipe import DelayedScaling
from ..ops import moe as moe_ops
from ._base import default_device, init_weight
from ._input import check_input
from .grouped_linear import ACTIVE_RECIPE, GradHandoff, GroupedLinear, device_ends_mlp

__all__ = ["GroupedMLP", "RoutedExperts"]

_log = logging.getLogger("seqfuse")


class RoutedExperts(torch.nn.Module):
    """The router half of a mixture-of-experts block, shared by GroupedMLP
    and ExpertParallelGroupedMLP (moe_expert_parallel.py): the checks of the
    routing arguments (ValueError starting with the block's ``name``), the
    router weight [E, hidden] (drawn by ``reset_router``), the optional
    expert_bias buffer, ``route`` and ``aux_losses``.  The subclass adds its
    experts (fc1, fc2) and its forward.  Arguments as GroupedMLP's."""

    def __init__(self, name, hidden_size, ffn_hidden_size, num_experts, topk, score_function, use_pre_softmax,
                 scaling_factor, expert_bias, aux_loss_coeff, z_loss_coeff, params_dtype, device, init_method):
        super().__init__()
        if num_experts < 1 or not 1 <= topk <= num_experts:
            raise ValueError(f"{name}: need num_experts >= 1 and 1 <= topk <= num_experts, got "
                             f"num_experts={num_experts}, topk={topk}")
        if score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"{name}: score_function must be 'softmax' or 'sigmoid', got "
                             f"{score_function!r}")
        if expert_bias and score_function != "sigmoid":
            raise ValueError(f"{name}: expert_bias goes with score_function='sigmoid' only")
        self.hidden_size, self.ffn_hidden_size = int(hidden_size), int(ffn_hidden_size)
        self.num_experts, self.topk = int(num_experts), int(topk)
        self.score_function, self.use_pre_softmax = score_function, bool(use_pre_softmax)
        self.scaling_factor = scaling_factor
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        dtype = params_dtype or torch.get_default_dtype()
        device = default_device(device)
        self.router_weight = torch.nn.Parameter(torch.empty(self.num_experts, self.hidden_size,
                                                            dtype=dtype, device=device))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32,
                                                            device=device))
        else:
            self.expert_bias = None
        self.init_method = init_method
        self.aux_loss = None

    @torch.no_grad()
    def reset_router(self):
        """The router weight from init_method, else N(0, 0.023) (TE's default)."""
        init_weight(self.router_weight, self.init_method)

    def route(self, x):
        """(probs [T, E] float32, routing_map [T, E], logits [T, E] float32)."""
        logits = torch.nn.functional.linear(x, self.router_weight.to(x.dtype)).float()
        probs, routing_map = moe_ops.fused_topk_with_score_function(
            logits, self.topk, use_pre_softmax=self.use_pre_softmax, scaling_factor=self.scaling_factor,
            score_function=self.score_function, expert_bias=self.expert_bias)
        return probs, routing_map, logits

    def aux_losses(self, logits):
        """The load-balancing and z-losses of router ``logits`` [T, E] with
        this block's coefficients (None when both are 0)."""
        loss = None
        if self.aux_loss_coeff > 0:
            aux_map, scores = moe_ops.fused_compute_score_for_moe_aux_loss(logits, self.topk,
                                                                           self.score_function)
            tpe = aux_map.sum(0)
            loss = moe_ops.fused_moe_aux_loss(scores, tpe, logits.shape[0], self.num_experts, self.topk,
                                              self.aux_loss_coeff)
        if self.z_loss_coeff > 0:
            z = moe_ops.moe_z_loss(logits, self.z_loss_coeff)
            loss = z if loss is None else loss + z
        return loss


class GroupedMLP(RoutedExperts):
    """A mixture-of-experts SwiGLU MLP: router, permutation, two grouped GEMMs.

    hidden_size, ffn_hidden_size: the sizes of each expert's MLP;
    num_experts, topk: experts and experts per token;
    score_function: "softmax" or "sigmoid"; use_pre_softmax: softmax over
    all experts before the top-k (else over the selected logits, Mixtral's
    choice renormalised); scaling_factor: times the probabilities;
    expert_bias: learnable-free selection bias [E] (sigmoid only; a buffer
    updated by the caller, as in DeepSeek-V3's aux-loss-free balancing);
    aux_loss_coeff, z_loss_coeff: the auxiliary losses (0: off);
    bias: biases in the experts' GEMMs; params_dtype, device, init_method
    as for GroupedLinear (the router is float32-initialised the same way);
    device_splits: on CUDA without bias, in bfloat16 or under
    Float8CurrentScaling(fp8_format=E4M3), the experts' GEMMs take the
    routing counts on the GPU (GroupedLinear's device-split route) and the
    block has no host synchronization; under DelayedScaling (on Hopper, as
    the module note says) the forward has none (the backward reads the
    counts' host copy); False (or
    another recipe, a bias, another dtype) reads them to the host once per
    forward.  An attribute,
    which may be changed on a built module.
    """

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, topk, *, score_function="softmax",
                 use_pre_softmax=False, scaling_factor=None, expert_bias=False, aux_loss_coeff=0.0,
                 z_loss_coeff=0.0, bias=False, params_dtype=None, device=None, init_method=None,
                 device_splits=True):
        super().__init__("GroupedMLP", hidden_size, ffn_hidden_size, num_experts, topk, score_function,
                         use_pre_softmax, scaling_factor, expert_bias, aux_loss_coeff, z_loss_coeff, params_dtype,
                         device, init_method)
        dtype = params_dtype or torch.get_default_dtype()
        device = default_device(device)
        self.fc1 = GroupedLinear(self.num_experts, self.hidden_size, 2 * self.ffn_hidden_size, bias=bias,
                                 params_dtype=dtype, device=device, init_method=init_method)
        self.fc2 = GroupedLinear(self.num_experts, self.ffn_hidden_size, self.hidden_size, bias=bias,
                                 params_dtype=dtype, device=device, init_method=init_method)
        self.device_splits = bool(device_splits)
        if device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        self.reset_router()
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def device_split_refusal(self, x, recipe=ACTIVE_RECIPE):
        """Why a forward of rows ``x`` reads the routing counts to the host
        (not the device-split route), or None where it does not; ``recipe``
        as GroupedLinear.device_split_refusal's."""
        if not self.device_splits:
            return "device_splits is off"
        return self.fc1.device_split_refusal(x, recipe) or self.fc2.device_split_refusal(x, recipe)

    def capture_refusal(self, x, recipe=ACTIVE_RECIPE):
        """Why the block's forward and backward for rows ``x`` under
        ``recipe`` (as device_split_refusal's) cannot be captured in a CUDA
        graph, or None: a host read of the routing counts in either.  Under
        DelayedScaling the device-ends route's backward reads their host
        copy; otherwise the device-split route has no host read and any
        refusal of it means the forward reads them."""
        if recipe is ACTIVE_RECIPE:
            recipe = _q.get_recipe() if _q.is_fp8_enabled() else None
        why = self.device_split_refusal(x, recipe)
        if isinstance(recipe, DelayedScaling):
            backward = "under DelayedScaling the experts' backward reads the routing counts on the host"
            return backward if why is None else f"{backward}; the forward also reads them: {why}"
        return why

    def _one_node_refusal(self):
        """Why the device-ends FP8 route cannot run both expert layers as one
        autograd node (DeviceEndsFp8GroupedMLPFunction), or None: the node
        calls neither GroupedLinear as a module, so hooks on them (a user's,
        FSDP2's per-module all-gathers) would not run."""
        for name in ("fc1", "fc2"):
            fc = getattr(self, name)
            if fc._forward_hooks or fc._forward_pre_hooks or fc._backward_hooks or fc._backward_pre_hooks:
                return f"{name} has module hooks, which run only where it is called as a module"
            if "forward" in fc.__dict__ or type(fc).forward is not GroupedLinear.forward:
                # (Hugging Face accelerate's add_hook_to_module replaces the instance's forward)
                return f"{name}'s forward is replaced, which runs only where it is called as a module"
        if any(getattr(_torch_module, g, None) for g in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                    "_global_backward_hooks", "_global_backward_pre_hooks")):
            return "global module hooks are registered, which run only where each layer is called as a module"
        return None

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, score_function={self.score_function}")

    def forward(self, hidden_states, is_first_microbatch=None):
        """The block's output for ``hidden_states`` [..., hidden_size];
        is_first_microbatch (Transformer Engine's gradient-accumulation
        argument) goes to both GroupedLinears: under FP8, True casts the
        experts' weights and keeps them for the next micro-batches, False
        reuses them, None in training casts them at every call and keeps
        none past it (GroupedLinear.forward: frozen experts, keep_fp8_weights
        and checkpoints excepted), and without gradients casts a weight when
        it changed."""
        check_input("GroupedMLP", hidden_states, self.hidden_size, "hidden_size")
        lead = hidden_states.shape[:-1]
        x = hidden_states.reshape(-1, self.hidden_size)
        probs, routing_map, logits = self.route(x)
        # no tokens (an idle rank): no auxiliary loss (its mean over tokens is undefined)
        self.aux_loss = self.aux_losses(logits) if self.training and x.shape[0] else None
        row_ids, tokens_per_expert = moe_ops.moe_row_id_map(routing_map)
        on_route = False
        if self.device_splits and x.is_cuda and x.shape[0]:
            why = self.device_split_refusal(x)
            on_route = why is None
            if not on_route:
                note_once(_log, "seqfuse GroupedMLP: the routing counts read to the host (one host "
                          "synchronization per forward): %s", why)
        if on_route:
            # the experts' GEMMs read the counts on the GPU: nothing in the block waits on the host
            # (every token goes to topk experts, so the permuted rows number T * topk)
            xp, pp = moe_ops.moe_permute_by_row_id_map(x, row_ids, x.shape[0] * self.topk, probs)
            # one set for both GEMMs; the router's top-k gives every token topk experts: the counts add up
            offsets = moe_ops.device_split_offsets(tokens_per_expert, xp.shape[0], routed=True)
            # the refusal asked above covers both layers (of the rows it reads only their device and
            # whether there are any, which xp and h share with x): neither layer asks again
            # under FP8 delayed scaling the backward reads the counts on the host: one copy for both layers,
            # queued now, long landed by then
            delayed = _q.is_fp8_enabled() and isinstance(_q.get_recipe(), DelayedScaling)
            wait = moe_ops.counts_to_host(tokens_per_expert) if delayed else None
            if delayed:
                why = self._one_node_refusal()
                if why is None:
                    # both layers in one autograd node: the gate-up layer's output gradient exists only as
                    # the FP8 copies its backward reads (made by the down projection's SwiGLU pass)
                    y = device_ends_mlp(self.fc1, self.fc2, xp, pp, offsets, wait, is_first_microbatch)
                    return moe_ops.moe_unpermute(y, row_ids).view(*lead, self.hidden_size)
                note_once(_log, "seqfuse GroupedMLP: the experts' two layers run as two autograd nodes (the "
                          "gate-up layer's output gradient written in bfloat16 between them, then its FP8 "
                          "copies taken from the down projection's pass): %s", why)
            # (and the down projection's backward casts the gate-up layer's output gradient for it)
            link = GradHandoff() if delayed else None
            h = self.fc1(xp, tokens_per_expert, is_first_microbatch, m_offsets=offsets, _refusal=None,
                         _counts_wait=wait, _grad_link=link)
            y = self.fc2(h, tokens_per_expert, is_first_microbatch, swiglu_probs=pp, m_offsets=offsets,
                         _refusal=None, _counts_wait=wait, _grad_link=link)
            return moe_ops.moe_unpermute(y, row_ids).view(*lead, self.hidden_size)
        # the block's one host synchronization, the per-expert counts: their copy is queued now and
        # waited for after the work that does not need them (below), which keeps the GPU busy meanwhile
        wait_counts = moe_ops.counts_to_host(tokens_per_expert)
        fp8 = _q.is_fp8_enabled()
        if fp8:
            # the FP8 GEMMs take each expert's rows in blocks of 16: the permutation writes them so
            # (zero rows between experts), and nothing is padded or gathered around each GEMM
            row_ids = moe_ops.pad_row_id_map(row_ids, tokens_per_expert)
            # the weight casts queued before the wait; a prefetch that cast under True leaves the forward
            # nothing to cast again (it reuses them: False)
            first = [False if fc.prefetch_fp8_weights(is_first_microbatch) and is_first_microbatch
                     else is_first_microbatch for fc in (self.fc1, self.fc2)]
        else:
            first = [is_first_microbatch] * 2
        m_splits = wait_counts()
        splits = list(moe_ops.padded_splits(m_splits)) if fp8 else m_splits
        xp, pp = moe_ops.moe_permute_by_row_id_map(x, row_ids, sum(splits), probs, zero_unrouted=fp8)
        h = self.fc1(xp, splits, first[0])
        # the SwiGLU scaled by the routing weight; under FP8 computed inside fc2's input cast
        y = self.fc2(h, splits, first[1], swiglu_probs=pp)
        out = moe_ops.moe_unpermute(y, row_ids)
        return out.view(*lead, self.hidden_size)
