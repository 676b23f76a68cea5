"""accelerate()'s swap for transformers' mixture-of-experts experts.

transformers 5 stores the experts of Mixtral, Qwen2-MoE and Qwen3-MoE as one
module (MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts) holding two
stacked Parameters, gate_up_proj [E, 2F, H] and down_proj [E, H, F], called
by its sparse MoE block as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`` after the block's router.  Its eager forward loops
over the experts: per expert a gather, two GEMMs, SiLU-gate, a scale by the
routing weight and an index_add.

SeqfuseExperts computes the same with seqfuse's MoE kernels: the top-k
choice as a routing map, one permutation of the tokens into expert order
(moe_permute), the gate-up GEMMs of all experts as one grouped GEMM, the
SwiGLU scaled by each row's routing weight in one kernel (the weight
multiplies before the down GEMM instead of after: the same number, the
experts having no bias), the down grouped GEMM, and one un-permutation that
sums each token's experts.  The SwiGLU runs inside the down projection's
autograd Function, which keeps the gate-up output for the backward and
makes the SwiGLU output again there for the weight gradient (not kept).
Only the experts are replaced: the block's router (its ``gate``) stays
transformers', so router logits are still recorded for
output_router_logits and the load-balancing loss, and router jitter still
applies.

Row counts: in bfloat16 on CUDA the experts' GEMMs read the tokens per
expert on the GPU (the device-split route of seqfuse.modules.grouped_linear
over the stacked Parameters themselves): the block never waits on the host.
Otherwise they are read to the host once per block.

Weights: the replacement holds the very Parameter objects (same keys in
state_dict, tied or optimised as before); each GEMM takes per-expert views
of them.  Under an FP8 recipe the experts' GEMMs still run in the
activation dtype (seqfuse's FP8 grouped GEMM keeps scaling state per expert
Parameter, which the stacked layout does not have); the report and the log
say so.

A module is swapped only when it is such a collection (both Parameters,
these shapes, no other parameters, no biases) and a probe (random tokens
and routing in the module's dtype and device, without gradients) gives its
own result within the dtype's rounding; otherwise it is left with the
reason.
"""
import logging

import torch
from torch import nn

from ..common.notes import note_once
from ..modules.grouped_linear import DeviceSplitGroupedLinearFunction, GroupedLinearFunction, compute_dtype
from ..ops import moe as moe_ops

_log = logging.getLogger("seqfuse")

#: Relative error a probe may show, by parameter dtype (two GEMMs and a SwiGLU in that dtype).
_PROBE_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class SeqfuseExperts(nn.Module):
    """transformers' stacked experts on seqfuse's permutation, grouped GEMMs
    and scaled SwiGLU (see the module note); forward(hidden_states [T, H],
    top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def __init__(self, original):
        super().__init__()
        self.gate_up_proj = original.gate_up_proj
        self.down_proj = original.down_proj
        self.num_experts, two_f, self.hidden_dim = self.gate_up_proj.shape
        self.intermediate_dim = two_f // 2

    def extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}")

    def forward(self, hidden_states, top_k_index, top_k_weights):
        E = self.num_experts
        x = hidden_states.reshape(-1, self.hidden_dim)
        T = x.shape[0]
        idx = top_k_index.reshape(T, -1).long()
        # an index outside [0, E) picks no expert (transformers' experts skip it): it lands in column E, cut off
        idx = torch.where((idx >= 0) & (idx < E), idx, torch.full_like(idx, E))
        weights = top_k_weights.reshape(T, -1).float()
        probs = torch.zeros(T, E + 1, dtype=torch.float32, device=x.device).scatter(1, idx, weights)[:, :E]
        routing_map = torch.zeros(T, E + 1, dtype=torch.bool, device=x.device).scatter_(1, idx, True)[:, :E]
        row_ids, tokens_per_expert = moe_ops.moe_row_id_map(routing_map)
        dtype = compute_dtype(x, self.gate_up_proj)
        why = moe_ops.device_split_refusal(x, dtype, (self.hidden_dim, self.intermediate_dim, 2 * self.intermediate_dim))
        if why is None:
            # the counts stay on the GPU (the device-split route over the stacked Parameters):
            # nothing in the block waits on the host.  T * k rows hold the routed (token, expert)
            # pairs first; where an index was out of range fewer are routed, and the rows past them
            # belong to no expert (zero; the GEMMs leave their outputs unwritten and the
            # un-permutation reads none of them)
            xp, pp = moe_ops.moe_permute_by_row_id_map(x.to(dtype), row_ids, idx.shape[0] * idx.shape[1], probs,
                                                       zero_unrouted=True)
            offsets = moe_ops.device_split_offsets(tokens_per_expert, xp.shape[0], allow_fewer=True)
            h = DeviceSplitGroupedLinearFunction.apply(xp, None, offsets, None, self.gate_up_proj)
            # the scaled SwiGLU inside the down projection (pp: its row scales), made again for its backward
            y = DeviceSplitGroupedLinearFunction.apply(h, pp, offsets, None, self.down_proj)
            out = moe_ops.moe_unpermute(y, row_ids)
            return out.to(hidden_states.dtype).reshape(hidden_states.shape)
        if x.is_cuda:
            note_once(_log, "seqfuse SeqfuseExperts: the tokens per expert read to the host (one host "
                      "synchronization per block): %s", why)
        splits = tuple(tokens_per_expert.tolist())  # one host synchronization per block, as GroupedMLP
        xp, pp = moe_ops.moe_permute_by_row_id_map(x.to(dtype), row_ids, sum(splits), probs)
        # float32: TF32 as torch's switch says (None), as the replaced transformers module computed
        h = GroupedLinearFunction.apply(xp, None, splits, dtype, E, False, None, False,
                                        *self.gate_up_proj.unbind(0))
        y = GroupedLinearFunction.apply(h, pp, splits, dtype, E, False, None, False, *self.down_proj.unbind(0))
        out = moe_ops.moe_unpermute(y, row_ids)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)


def _is_silu(act):
    t = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        got = act(t)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a float64 probe is not SiLU here
        return False
    return isinstance(got, torch.Tensor) and torch.allclose(got, torch.nn.functional.silu(t), atol=1e-12)


def experts_refusal(module):
    """None when ``module`` is a stacked-experts collection SeqfuseExperts
    computes, else why not (the probe is separate: probe_refusal)."""
    gu, dp = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dp, nn.Parameter)):
        return "no gate_up_proj / down_proj Parameters"
    if gu.dim() != 3 or dp.dim() != 3:
        return f"gate_up_proj {tuple(gu.shape)} / down_proj {tuple(dp.shape)} are not 3-D stacks"
    E, two_f, H = gu.shape
    if two_f % 2 or tuple(dp.shape) != (E, H, two_f // 2):
        return (f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dp.shape)} are not [E, 2F, H] and "
                "[E, H, F]")
    own = {n for n, _ in module.named_parameters()}
    if own != {"gate_up_proj", "down_proj"}:
        return f"parameters beyond gate_up_proj / down_proj ({sorted(own - {'gate_up_proj', 'down_proj'})})"
    if getattr(module, "is_transposed", False):
        return "is_transposed=True (weights stored [E, H, 2F])"
    if gu.dtype not in _PROBE_TOL or dp.dtype != gu.dtype:
        return f"dtypes {gu.dtype} / {dp.dtype} (float32, float16 or bfloat16, the same for both)"
    if gu.device.type == "meta":
        return "meta weights (materialise the model first)"
    if module._forward_hooks or module._forward_pre_hooks:
        return "forward hooks"
    act = getattr(module, "act_fn", None)
    if act is None or not _is_silu(act):
        return f"activation {type(act).__name__} is not SiLU (the fused kernel is SwiGLU)"
    return None


@torch.no_grad()
def probe_refusal(module, tokens=24, seed=0):
    """None when SeqfuseExperts over ``module``'s weights gives the module's
    own result on random tokens and routing (within the dtype's rounding),
    else the difference found.  Runs on the module itself, without
    gradients: neither forward writes anything (a copy would duplicate the
    stacked weights, gigabytes per layer at Mixtral 8x7B's size)."""
    ref_mod = module
    E, _, H = module.gate_up_proj.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev, dtype = module.gate_up_proj.device, module.gate_up_proj.dtype
    topk = min(2, E)
    x = torch.randn(tokens, H, generator=gen).to(dev, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(tokens)]).to(dev)
    w = torch.rand(tokens, topk, generator=gen).to(dev)
    w = w / w.sum(-1, keepdim=True)
    try:
        want = ref_mod(x, idx, w).float()
        got = SeqfuseExperts(ref_mod)(x, idx, w).float()
    except Exception as e:  # noqa: BLE001 - any failure of the probe leaves the module, with the reason
        return f"probe failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not err <= _PROBE_TOL[dtype]:
        return f"probe: relative difference {err:.3g} from the module's own forward (allowed {_PROBE_TOL[dtype]})"
    return None


def swap_experts(model, report, recipe, slots, Swapped, Left):
    """Replace every stacked-experts module of ``model`` SeqfuseExperts
    computes (see the module note); the rest of such modules are reported
    in ``report.left`` with the reason.  ``slots`` maps id(module) to its
    (parent, attribute) slots.  Returns the swapped names."""
    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, SeqfuseExperts) or not type(module).__name__.endswith("Experts"):
            continue
        why = experts_refusal(module) or probe_refusal(module)
        if why is not None:
            report.left.append(Left(name, type(module).__name__, f"experts left: {why}"))
            _log.info("seqfuse.hf.accelerate: experts %s left: %s", name, why)
            continue
        new = SeqfuseExperts(module)
        new.train(module.training)
        for parent, child_name in slots[id(module)]:
            setattr(parent, child_name, new)
        replacement = "SeqfuseExperts"
        if recipe is not None:
            replacement += " (grouped GEMMs in the activation dtype: FP8 is not applied to stacked experts)"
        report.swapped.append(Swapped(name, type(module).__name__, replacement))
        done.append(name)
    if done and recipe is not None:
        _log.warning("seqfuse.hf.accelerate: %d experts module(s) swapped run their grouped GEMMs in the "
                     "activation dtype, not FP8 (the recipe applies to the other layers)", len(done))
    return done
