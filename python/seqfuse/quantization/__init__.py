"""seqfuse.quantization: FP8 / FP4 quantized tensors, scaling state, autocast.

This docstring is the contract the GEMM modules (seqfuse.modules, branch
gemm) build on.

Ops (seqfuse.ops, torch tensors in and out, current CUDA stream, no host sync)
------------------------------------------------------------------------------
cast_fp8(x, scale, amax, fp8_dtype, *, out=None, scale_inv=None) -> fp8 tensor
    out = saturate(x * scale[0]), round-to-nearest-even, saturating at 448
    (E4M3) / 57344 (E5M2), NaN -> NaN.  ``fp8_dtype``: torch.float8_e4m3fn or
    torch.float8_e5m2.  ``amax`` (float32, one element, or None) ACCUMULATES:
    amax[0] = max(amax[0], max|x|).  ``scale_inv`` (optional) receives
    1/scale[0] on the device.
cast_transpose_fp8(x, scale, amax, fp8_dtype, *, out=None, out_t=None,
                   scale_inv=None, rowwise=True) -> (data [M,K], data_t [K,M])
    x viewed as [M, K] (K = last dim); one pass writes both copies and the
    amax.  Fast path: K % 8 == 0 and M % 16 == 0.
dequantize_fp8(data, scale_inv, out_dtype=torch.float32)
fp8_scale_update(amax_history, scale, scale_inv, fp8_max, algo, margin)
fp8_compute_scale(amax, scale, scale_inv, fp8_max, margin)
quantize_block_fp8 / dequantize_block_fp8 (1x128, 128x128, cuBLASLt layout),
quantize_mxfp8 / dequantize_mxfp8, quantize_nvfp4 / dequantize_nvfp4.

Quantized tensors (tensor.py)
-----------------------------
Float8Tensor: .data (fp8 [.., K] or None), .data_t (fp8 [K, M] or None),
    .scale_inv (float32 one-element tensor, the inverse of the scale the data
    was made with -- written by the cast kernel, so it stays right after the
    state's scale moves on), .fp8_dtype, .dtype (what it stands for), .shape,
    .dequantize(dtype=None).
Float8BlockTensor, MXFP8Tensor, NVFP4Tensor: the block formats, each with
    .dequantize().
quantize(x, scale, amax, fp8_dtype, transpose=False, rowwise=True),
quantize_with_state(x, state, index, transpose=False),
quantize_current(x, fp8_dtype, ...), quantize_block, quantize_mxfp8,
quantize_nvfp4: build them.

Scaling state (state.py)
------------------------
ScalingState(num_tensors, recipe=None, *, backward_indices=(), device=None)
    an nn.Module; buffers .amax_history [H, N], .scale [N], .scale_inv [N]
    (float32, in the module's state_dict), .amax = amax_history[0] (this
    step's amaxes, where casts accumulate), and one-element views
    .amax_of(i), .scale_of(i), .scale_inv_of(i); .fp8_dtype(i) under the
    recipe's Format (backward indices use the backward format).
    Attach it as a child module (``self.fp8_state = ScalingState(...)`` or
    ``register_scaling_state(module, "fp8_state", 3, recipe)``).
    Per-GEMM index convention: ONE state of 3 per GEMM module --
    INPUT = 0, WEIGHT = 1, GRAD_OUTPUT = 2 (ScalingState.for_linear(recipe),
    backward_indices=(2,)).  A module with several GEMMs uses 3 per GEMM
    (3g + 0/1/2) with backward_indices=(2, 5, ...).
    Do not cache the tensors across steps outside the state: re-read
    state.scale_of(i) etc. each forward (a device move or a recipe change
    re-homes them; within a step they never move, so autograd may keep them).
    The buffers are views of pooled per-device chunks, so the update of every
    state is one kernel launch per chunk and the amax all-reduce is one
    collective on a flat buffer.  state.set_recipe(recipe) adopts another
    history length / algorithm / margin / format (modules call it when the
    autocast recipe differs from the state's).

Autocast (autocast.py)
----------------------
autocast(enabled=True, recipe=None, amax_reduction_group=None) (alias
fp8_autocast(enabled, calibrating, fp8_recipe, fp8_group)); autocast_state(),
is_fp8_enabled(), get_recipe(), get_amax_reduction_group().
Update timing: when the outermost enabled region exits under DelayedScaling,
reduce_and_update() runs one all-reduce (MAX) of the amaxes per chunk over
amax_reduction_group (default: WORLD when torch.distributed runs with > 1
rank) and one fused update launch per chunk for every state made with the
same (history_len, algo, margin): roll the history, max or most_recent,
margin, keep the old scale where the amax is 0 or not finite.  Forward
amaxes of the step are in by then; the backward (GRAD_OUTPUT) amaxes of step
t are folded in at the exit of step t+1 -- the backward of step t+1 uses
scales from amaxes up to step t's backward, as in Transformer Engine, with
one launch and one collective per step and no autograd hook.  Every state
with matching settings is updated at each exit, including states of
modules that did not run that step (they record amax 0 for it).
Outside autocast, call reduce_and_update(recipe, group) yourself.
quantized_model_init(enabled, recipe, preserve_high_precision_init_val)
(alias fp8_model_init) + quantized_model_init_state(): TE's context, recorded;
the modules keep high-precision weights (a WARNING says so, once).

GEMM operands (gemm_quantizers.py)
----------------------------------
GemmQuantizers: one per FP8 GEMM module (Linear, LayerNormLinear,
LayerNormMLP): per GEMM an input, a weight and an output-gradient
quantizer (TE's FP8FwdTensors / FP8BwdTensors index names), the module's
ScalingState under delayed scaling, the weight cast once per weight
update, token rows padded to the FP8 GEMMs' multiple of 16 inside.
init_fp8_state(model, recipe) makes every module's state without a forward;
snapshot_scaling(model) / restore_scaling(snapshot) put the states' values
back after work that must not move them (validation, graph warm-up);
weight_casts(model) counts weight casts.

FP8 attention (attention.py)
----------------------------
fp8_attention(q, k, v, state, qkv_format, attn_mask_type, softmax_scale):
TE's fp8_dpa -- Q, K, V, O and their gradients in FP8 under a ScalingState
of nine tensors (attention_state(recipe)), cuDNN's FP8 attention on CUDA;
DotProductAttention takes it under a DelayedScaling recipe with
fp8_dpa=True.

CUDA graphs (graphs.py)
-----------------------
make_graphed_callables(modules, sample_args, ..., fp8_enabled, fp8_recipe):
TE's name; torch.cuda.make_graphed_callables captured under FP8 autocast.

Stats (stats.py)
----------------
enable_stats(every=N, path=None): per-layer amax, scale, underflow and
saturation fractions every N steps (JSON lines); name_states(model) names the
states after their module paths.  quantize_with_state feeds it.
"""
from ..common import recipe
from ..common.recipe import (DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format,
                             MXFP8BlockScaling, NVFP4BlockScaling, Recipe)
from .autocast import (AutocastState, autocast, autocast_state, fp8_autocast, fp8_model_init,
                       get_amax_reduction_group, get_recipe, is_fp8_enabled, quantized_model_init,
                       quantized_model_init_state, reduce_and_update)
from .quantize import (quantize, quantize_block, quantize_current, quantize_mxfp8,
                       quantize_nvfp4, quantize_with_state)
from .state import (GRAD_OUTPUT, INPUT, WEIGHT, ScalingState, register_scaling_state, restore_scaling,
                    snapshot_scaling)
from .recompute import checkpoint
from .gemm_quantizers import (FP8BwdTensors, FP8FwdTensors, GemmQuantizers, init_fp8_state,
                              set_weight_rowwise_cache, set_weight_transpose_cache, weight_casts,
                              weight_rowwise_cache, weight_transpose_cache)
from .graphs import make_graphed_callables
from .attention import attention_state, fp8_attention
from .stats import disable_stats, enable_stats, name_states, stats_records
from .tensor import Float8BlockTensor, Float8Tensor, MXFP8Tensor, NVFP4Tensor

__all__ = [
    "recipe", "Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
    "MXFP8BlockScaling", "NVFP4BlockScaling",
    "AutocastState", "autocast", "fp8_autocast", "autocast_state", "is_fp8_enabled", "get_recipe",
    "get_amax_reduction_group", "reduce_and_update", "quantized_model_init", "fp8_model_init",
    "quantized_model_init_state", "checkpoint", "make_graphed_callables",
    "fp8_attention", "attention_state",
    "GemmQuantizers", "FP8FwdTensors", "FP8BwdTensors", "init_fp8_state", "weight_casts",
    "set_weight_transpose_cache", "weight_transpose_cache", "set_weight_rowwise_cache", "weight_rowwise_cache",
    "quantize", "quantize_with_state", "quantize_current", "quantize_block", "quantize_mxfp8",
    "quantize_nvfp4",
    "ScalingState", "register_scaling_state", "snapshot_scaling", "restore_scaling", "INPUT", "WEIGHT", "GRAD_OUTPUT",
    "enable_stats", "disable_stats", "name_states", "stats_records",
    "Float8Tensor", "Float8BlockTensor", "MXFP8Tensor", "NVFP4Tensor",
]
