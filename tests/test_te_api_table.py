"""The Transformer Engine compatibility table stays true.

- README.md's generated section is what benchmarks/te_compat/compat_table.py
  makes now from the committed TE snapshot (te_snapshot.json) and seqfuse's
  classes: a name or argument added, refused or dropped without re-running
  the generator fails here.
- Every argument the table calls "refused" (seqfuse.modules.te_compat.REFUSED)
  raises NotImplementedError naming it when switched on, and is taken at
  its "off" value.
- No constructor argument of TE's eight core modules is left "lacking".
- Every argument the table calls "taken" names (COVERAGE) a test that
  builds the module with it and checks the result against torch or the
  argument's documented meaning; the named test exists and passes the
  argument by name (required positional arguments excepted).
- Every name the table says seqfuse has (transformer_engine.pytorch, te.ops,
  te.optimizers) names (NAME_COVERAGE) a test that checks it against torch
  or its documented result, and that test names it.
- Every forward argument of TE 2.20's eight core modules (te_snapshot.json;
  in the table too) is either taken, naming a test that passes it by keyword
  and checks the result against torch (FORWARD_COVERAGE), or refused
  (seqfuse.pytorch.refused.REFUSED_FORWARD, probed by FORWARD_REFUSED):
  NotImplementedError naming it when switched on, the plain result at TE's
  default.
"""
import ast
import inspect
import os
import re
import sys
import textwrap

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.modules.te_compat import REFUSED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "te_compat"))
import compat_table  # noqa: E402
from seqfuse.pytorch.refused import REFUSED_FORWARD, REFUSED_NAMES  # noqa: E402

SNAPSHOT = compat_table.load_snapshot()
RESULT = compat_table.classify(SNAPSHOT)

#: the required arguments of each core module, small
REQUIRED = {"Linear": (16, 16), "LayerNormLinear": (16, 16), "LayerNormMLP": (16, 32), "LayerNorm": (16,),
            "RMSNorm": (16,), "DotProductAttention": (2, 8), "MultiheadAttention": (16, 2),
            "TransformerLayer": (16, 32, 2)}


#: argument -> "file::test" exercising it, for every argument the table calls taken
# LayerNorm and RMSNorm take the same constructor arguments, checked by one test for both classes
_NORM_TEST = 'test_te_api_args.py::test_norm_arguments_of_both_classes_against_torch'
_NORM_ARGUMENTS = {name: _NORM_TEST for name in ('normalized_shape', 'eps', 'sequence_parallel', 'params_dtype',
                                                 'zero_centered_gamma', 'hidden_size', 'device', 'dtype')}
COVERAGE = {
    'Linear': {
        'in_features': 'test_te_api_args.py::test_linear_fuse_wgrad_accumulation',
        'out_features': 'test_te_api_args.py::test_linear_fuse_wgrad_accumulation',
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_linear_fuse_wgrad_accumulation',
        'get_rng_state_tracker': 'test_te_api.py::test_rng_tracker_draws_the_initialisation',
        'rng_tracker_name': 'test_te_api.py::test_rng_tracker_draws_the_initialisation',
        'init_method': 'test_linear.py::test_init_and_meta_device',
        'bias': 'test_transformer_layer.py::test_linear_parameters_split',
        'return_bias': 'test_linear.py::test_cpu_return_bias_and_no_input_grad',
        'params_dtype': 'test_linear.py::test_cpu_float64_reference_is_tight',
        'parameters_split': 'test_transformer_layer.py::test_linear_parameters_split',
        'device': 'test_te_api_args.py::test_linear_fuse_wgrad_accumulation',
        'name': 'test_te_api_forward.py::test_gemm_and_norm_forward_keywords_against_torch',
        'save_original_input': 'test_linear_save_original_input.py::test_save_original_input_gives_the_same_bits',
    },
    'LayerNormLinear': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'in_features': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'out_features': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'eps': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'bias': 'test_layernorm_modules.py::test_layernorm_linear_cpu',
        'normalization': 'test_layernorm_modules.py::test_layernorm_linear_cpu',
        'return_bias': 'test_te_api.py::test_layernorm_linear_return_bias',
        'params_dtype': 'test_layernorm_modules.py::test_layernorm_linear_cuda_bf16',
        'return_layernorm_output': 'test_te_api.py::test_layernorm_linear_return_bias',
        'parameters_split': 'test_transformer_layer.py::test_linear_parameters_split',
        'zero_centered_gamma': 'test_layernorm_modules.py::test_layernorm_linear_cpu',
        'device': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'name': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
    },
    'LayerNormMLP': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'ffn_hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'eps': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'return_bias': 'test_te_api.py::test_layernorm_mlp_return_layernorm_output_and_bias',
        'get_rng_state_tracker': 'test_te_api.py::test_rng_tracker_draws_the_initialisation',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'bias': 'test_layernorm_modules.py::test_layernorm_mlp_cpu',
        'normalization': 'test_te_api.py::test_layernorm_mlp_checkpoint_recomputes',
        'activation': 'test_te_api.py::test_layernorm_mlp_checkpoint_recomputes',
        'output_layer_init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'params_dtype': 'test_layernorm_modules.py::test_layernorm_mlp_cuda_bf16',
        'return_layernorm_output': 'test_te_api.py::test_layernorm_mlp_return_layernorm_output_and_bias',
        'seq_length': 'test_te_api.py::test_layernorm_mlp_seq_length_changes_nothing',
        'micro_batch_size': 'test_te_api.py::test_layernorm_mlp_seq_length_changes_nothing',
        'zero_centered_gamma': 'test_te_api.py::test_layernorm_mlp_return_layernorm_output_and_bias',
        'device': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'name': 'test_te_api.py::test_layernorm_mlp_seq_length_changes_nothing',
        'checkpoint': 'test_te_api.py::test_layernorm_mlp_checkpoint_recomputes',
    },
    'LayerNorm': _NORM_ARGUMENTS,
    'RMSNorm': _NORM_ARGUMENTS,
    'DotProductAttention': {
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_draws_attention_dropout',
        'num_attention_heads': 'test_te_api_forward.py::test_dot_product_attention_forward_keywords_against_torch',
        'kv_channels': 'test_te_api_forward.py::test_dot_product_attention_forward_keywords_against_torch',
        'num_gqa_groups': 'test_dot_product_attention.py::test_module_matches_reference',
        'attention_dropout': 'test_dot_product_attention.py::test_attention_dropout_training_only',
        'qkv_format': 'test_te_api_forward.py::test_dot_product_attention_padding_and_packed_keywords_against_torch',
        'attn_mask_type': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'window_size': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'layer_number': 'test_te_api_forward.py::test_dot_product_attention_padding_and_packed_keywords_against_torch',
        'attention_type': 'test_attn_masks.py::test_pair_masks_cross_attention',
        'cp_group': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_global_ranks': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_stream': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_comm_type': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'softmax_scale': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'name': 'test_te_api_forward.py::test_dot_product_attention_padding_and_packed_keywords_against_torch',
    },
    'MultiheadAttention': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'num_attention_heads': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'kv_channels': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'attention_dropout': 'test_te_api_args.py::test_rng_tracker_draws_attention_dropout',
        'layernorm_epsilon': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'output_layer_init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'layer_number': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'attn_mask_type': 'test_te_api_args.py::test_multihead_attention_cross',
        'window_size': 'test_te_api_args.py::test_multihead_attention_window_size',
        'num_gqa_groups': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'params_dtype': 'test_te_api_args.py::test_multihead_attention_params_dtype',
        'return_bias': 'test_te_api.py::test_multihead_attention_return_bias',
        'return_layernorm_output': 'test_te_api.py::test_multihead_attention_return_bias',
        'input_layernorm': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'attention_type': 'test_te_api_args.py::test_multihead_attention_cross',
        'fuse_qkv_params': 'test_te_api_args.py::test_multihead_attention_cross',
        'zero_centered_gamma': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'qkv_weight_interleaved': 'test_transformer_layer.py::test_qkv_split_backward_writes_the_fused_gradient_once',
        'bias': 'test_te_api_args.py::test_multihead_attention_without_bias_against_torch',
        'normalization': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'device': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'qkv_format': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'name': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'qk_norm_type': 'test_te_api.py::test_qk_norm_against_torch',
        'qk_norm_eps': 'test_te_api.py::test_qk_norm_against_torch',
        'qk_norm_before_rope': 'test_te_api.py::test_qk_norm_against_torch',
        'seq_length': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'micro_batch_size': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
    },
    'TransformerLayer': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'ffn_hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'num_attention_heads': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'num_gqa_groups': 'test_transformer_layer.py::test_unfused_qkv_params_match_fused',
        'layernorm_epsilon': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'hidden_dropout': 'test_te_api_forward.py::test_transformer_layer_hidden_dropout_against_its_formula',
        'attention_dropout': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'output_layer_init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'layer_number': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'kv_channels': 'test_te_api_forward.py::test_transformer_layer_cross_attention_arguments_against_torch',
        'self_attn_mask_type': 'test_transformer_layer.py::test_sliding_window',
        'window_size': 'test_transformer_layer.py::test_sliding_window',
        'enc_dec_attn_mask_type': 'test_te_api_forward.py::test_transformer_layer_cross_attention_arguments_against_torch',
        'enc_dec_window_size': 'test_te_api_forward.py::test_transformer_layer_cross_attention_arguments_against_torch',
        'params_dtype': 'test_dot_product_attention.py::test_transformer_layer_default_attention_dropout_trains',
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'seq_length': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'micro_batch_size': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'apply_residual_connection_post_layernorm': 'test_te_api.py::test_post_layernorm_residual',
        'output_layernorm': 'test_te_api.py::test_output_layernorm_is_post_ln',
        'parallel_attention_mlp': 'test_te_api.py::test_parallel_attention_mlp',
        'layer_type': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'drop_path_rate': 'test_te_api.py::test_drop_path_is_te_droppath',
        'fuse_qkv_params': 'test_transformer_layer.py::test_sliding_window',
        'zero_centered_gamma': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'qkv_weight_interleaved': 'test_transformer_layer.py::test_unfused_qkv_params_match_fused',
        'ub_overlap_ag': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'ub_overlap_rs': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'ub_overlap_rs_dgrad': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'ub_bulk_dgrad': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'ub_bulk_wgrad': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'bias': 'test_te_api_args.py::test_transformer_layer_without_bias',
        'activation': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'normalization': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'device': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'attn_input_format': 'test_te_api_forward.py::test_transformer_layer_cross_attention_arguments_against_torch',
        'name': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'qk_norm_type': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
        'qk_norm_eps': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
        'qk_norm_before_rope': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
    },
}


#: every public name the table says seqfuse has -> "file::test" that checks it against a torch
#: reference (or, for a query or a context, against its documented result); the test's source
#: (decorators included) names it
NAME_COVERAGE = {
    "names": {
        "LayerNormLinear": "test_layernorm_modules.py::test_layernorm_linear_cpu",
        "Linear": "test_linear.py::test_cpu_float64_reference_is_tight",
        "LayerNormMLP": "test_layernorm_modules.py::test_layernorm_mlp_cpu",
        "LayerNorm": "test_norm_modules.py::test_layernorm_matches_torch_nn_layernorm",
        "RMSNorm": "test_norm_modules.py::test_rmsnorm_matches_torch_nn_rmsnorm",
        "GroupedLinear": "test_moe_modules.py::test_grouped_linear_matches_per_expert_linear",
        "Fp8Padding": "test_te_api_names.py::test_fp8_padding_round_trip_against_torch",
        "Fp8Unpadding": "test_te_api_names.py::test_fp8_padding_round_trip_against_torch",
        "DotProductAttention": "test_te_api_forward.py::test_dot_product_attention_forward_keywords_against_torch",
        "MultiheadAttention": "test_te_api.py::test_qk_norm_against_torch",
        "RotaryPositionEmbedding": "test_rope.py::test_rotary_position_embedding_table",
        "TransformerLayer": "test_transformer_layer.py::test_sliding_window",
        "moe_permute": "test_moe_permute.py::test_row_id_map_and_permute_bit_for_bit",
        "moe_permute_with_probs": "test_moe_permute.py::test_permute_backward_against_torch",
        "moe_permute_and_pad_with_probs": "test_te_api_names.py::test_permute_and_pad_with_probs_against_torch",
        "moe_unpermute": "test_te_api_names.py::test_permute_and_pad_with_probs_against_torch",
        "moe_sort_chunks_by_index": "test_te_api_names.py::test_sort_chunks_by_index_against_torch",
        "moe_sort_chunks_by_index_with_probs": "test_te_api_names.py::test_sort_chunks_by_index_against_torch",
        "fp8_autocast": "test_linear.py::test_cpu_fp8_weight_quantized_once_per_update",
        "fp8_model_init": "test_te_api_names_ref.py::test_quantized_model_init_builds_the_same_model",
        "autocast": "test_te_api_forward.py::test_is_first_microbatch_under_fp8",
        "quantized_model_init": "test_te_api_names_ref.py::test_quantized_model_init_under_fp8_matches_outside",
        "is_fp8_available": "test_te_api.py::test_capability_queries_follow_the_device",
        "is_mxfp8_available": "test_te_api.py::test_capability_queries_follow_the_device",
        "is_fp8_block_scaling_available": "test_te_api.py::test_capability_queries_follow_the_device",
        "is_nvfp4_available": "test_te_api.py::test_capability_queries_follow_the_device",
        "get_default_recipe": "test_te_api.py::test_cudnn_version_and_default_recipe",
        "get_cudnn_version": "test_te_api.py::test_cudnn_version_and_default_recipe",
        "get_device_compute_capability": "test_te_api.py::test_capability_queries_follow_the_device",
        "is_bf16_available": "test_te_api.py::test_capability_queries_follow_the_device",
        "deinterleave_glu_tensor": "test_te_api.py::test_glu_interleave_utilities_and_interleaved_swiglu",
        "interleave_glu_tensor": "test_te_api.py::test_glu_interleave_utilities_and_interleaved_swiglu",
        "make_graphed_callables": "test_fp8_any_rows.py::test_graphed_layer_equals_eager",
        "checkpoint": "test_te_api_names.py::test_checkpoint_legacy_positional_form",
        "CudaRNGStatesTracker": "test_te_api.py::test_rng_states_tracker",
        "ops": "test_te_api.py::test_ops_sequential_against_torch",
        "optimizers": "test_te_api.py::test_fused_adam_matches_torch",
        "parallel_cross_entropy": "test_cross_entropy.py::test_parallel_cross_entropy_te_signature",
        "Float8Tensor": "test_scaling.py::test_quantize_current_and_float8tensor",
    },
    "ops": {
        "AddExtraInput": "test_te_api_names.py::test_ops_sequential_routes_extra_inputs_and_outputs",
        "BasicLinear": "test_te_api.py::test_ops_sequential_against_torch",
        "BasicOperation": "test_te_api_names_ref.py::test_basic_operation_subclass_runs_in_sequential_against_torch",
        "FusibleOperation": "test_te_api_names_ref.py::test_basic_operation_subclass_runs_in_sequential_against_torch",
        "is_op_fuser_grouped_tensor_path_supported": "test_te_api_names_ref.py::test_grouped_tensor_path_query",
        "Bias": "test_te_api.py::test_ops_sequential_against_torch",
        "ClampedSwiGLU": "test_te_api_names.py::test_ops_clamped_swiglu_against_torch",
        "ConstantScale": "test_te_api.py::test_ops_torch_operations",
        "Dropout": "test_te_api.py::test_ops_torch_operations",
        "GEGLU": "test_te_api.py::test_ops_sequential_against_torch",
        "GELU": "test_te_api.py::test_ops_sequential_against_torch",
        "GLU": "test_te_api.py::test_ops_torch_activations_and_l2",
        "GroupedLinear": "test_te_ops_grouped_linear.py::test_grouped_linear_against_torch",
        "Identity": "test_te_api.py::test_ops_torch_operations",
        "L2Normalization": "test_te_api.py::test_ops_torch_activations_and_l2",
        "LayerNorm": "test_te_api.py::test_ops_sequential_against_torch",
        "Linear": "test_te_api.py::test_ops_sequential_against_torch",
        "MakeExtraOutput": "test_te_api_names.py::test_ops_sequential_routes_extra_inputs_and_outputs",
        "QGEGLU": "test_te_api.py::test_ops_torch_activations_and_l2",
        "QGELU": "test_te_api.py::test_ops_torch_activations_and_l2",
        "Quantize": "test_te_api.py::test_ops_sequential_against_torch",
        "RMSNorm": "test_te_api.py::test_ops_sequential_against_torch",
        "ReGLU": "test_te_api.py::test_ops_sequential_against_torch",
        "ReLU": "test_te_api.py::test_ops_sequential_against_torch",
        "Reshape": "test_te_api.py::test_ops_torch_operations",
        "SReGLU": "test_te_api.py::test_ops_torch_activations_and_l2",
        "SReLU": "test_te_api.py::test_ops_torch_activations_and_l2",
        "ScaledClampedQGeGLU": "test_te_api_names.py::test_ops_soft_capped_and_scaled_activations_against_torch",
        "ScaledSReLU": "test_te_api_names.py::test_ops_soft_capped_and_scaled_activations_against_torch",
        "ScaledSiTUGLU": "test_te_api_names.py::test_ops_soft_capped_and_scaled_activations_against_torch",
        "ScaledSwiGLU": "test_te_api_names.py::test_ops_scaled_swiglu_against_torch",
        "Sequential": "test_te_api.py::test_ops_sequential_against_torch",
        "SiLU": "test_te_api.py::test_ops_sequential_against_torch",
        "SiTUGLU": "test_te_api_names.py::test_ops_soft_capped_and_scaled_activations_against_torch",
        "SwiGLU": "test_te_api.py::test_ops_sequential_against_torch",
    },
    "optimizers": {
        "FusedAdam": "test_te_api.py::test_fused_adam_matches_torch",
        "FusedSGD": "test_te_api.py::test_fused_sgd_matches_torch",
        "MultiTensorApply": "test_te_api_names_ref.py::test_multi_tensor_apply_against_torch",
        "multi_tensor_adam": "test_te_api_names.py::test_multi_tensor_adam_against_torch",
        "multi_tensor_adam_capturable": "test_te_api_names_ref.py::test_multi_tensor_adam_capturable_against_torch",
        "multi_tensor_adam_capturable_master":
            "test_te_api_names_ref.py::test_multi_tensor_adam_capturable_against_torch",
        "multi_tensor_applier": "test_te_api_names.py::test_multi_tensor_l2norm_and_scale_against_torch",
        "multi_tensor_l2norm": "test_te_api_names.py::test_multi_tensor_l2norm_and_scale_against_torch",
        "multi_tensor_scale": "test_te_api_names.py::test_multi_tensor_l2norm_and_scale_against_torch",
        "multi_tensor_scale_tensor": "test_te_api_names.py::test_multi_tensor_l2norm_and_scale_against_torch",
        "multi_tensor_sgd": "test_te_api_names.py::test_multi_tensor_sgd_against_torch",
        "multi_tensor_unscale_l2norm": "test_te_api_names.py::test_multi_tensor_l2norm_and_scale_against_torch",
    },
}

_FORWARD = "test_te_api_forward.py::"
_DPA_BSHD = _FORWARD + "test_dot_product_attention_forward_keywords_against_torch"
_DPA_PACKED = _FORWARD + "test_dot_product_attention_padding_and_packed_keywords_against_torch"
_MHA = _FORWARD + "test_multihead_attention_forward_keywords_against_torch"
_MHA_PACKED = _FORWARD + "test_multihead_attention_padding_and_packed_keywords_against_torch"
_TL_DEC = _FORWARD + "test_transformer_layer_decoder_forward_keywords_against_torch"
_TL_PACKED = _FORWARD + "test_transformer_layer_packed_keywords_against_torch"
_FP8_MB = _FORWARD + "test_is_first_microbatch_under_fp8"
_PACKED_ARGS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
                "max_seqlen_kv")

#: every TE 2.20 forward argument of the core modules that seqfuse takes -> "file::test" passing it
#: by keyword and checking the result against torch (the *_padded cu_seqlens are taken equal to
#: cu_seqlens; different ones, padding between sequences, raise naming them)
FORWARD_COVERAGE = {
    "Linear": {"inp": _FORWARD + "test_gemm_and_norm_forward_keywords_against_torch", "is_first_microbatch": _FP8_MB},
    "LayerNormLinear": {"inp": _FORWARD + "test_gemm_and_norm_forward_keywords_against_torch",
                        "is_first_microbatch": _FP8_MB},
    "LayerNormMLP": {"inp": _FORWARD + "test_gemm_and_norm_forward_keywords_against_torch",
                     "is_first_microbatch": _FP8_MB},
    "LayerNorm": {"input": _FORWARD + "test_gemm_and_norm_forward_keywords_against_torch"},
    "RMSNorm": {"input": _FORWARD + "test_gemm_and_norm_forward_keywords_against_torch"},
    "DotProductAttention": {
        **{a: _DPA_BSHD for a in ("query_layer", "key_layer", "value_layer", "qkv_format", "attn_mask_type",
                                  "window_size", "checkpoint_core_attention", "fast_zero_fill")},
        **{a: _DPA_PACKED for a in ("attention_mask",) + _PACKED_ARGS},
    },
    "MultiheadAttention": {
        **{a: _MHA for a in ("hidden_states", "attn_mask_type", "window_size", "is_first_microbatch",
                             "checkpoint_core_attention", "rotary_pos_emb", "fast_zero_fill")},
        **{a: _MHA_PACKED for a in ("attention_mask",) + _PACKED_ARGS},
        "encoder_output": "test_te_api_args.py::test_multihead_attention_cross",
    },
    "TransformerLayer": {
        **{a: _TL_DEC for a in ("hidden_states", "attention_mask", "self_attn_mask_type", "window_size",
                                "encoder_output", "enc_dec_attn_mask", "is_first_microbatch",
                                "checkpoint_core_attention", "rotary_pos_emb", "fast_zero_fill")},
        **{a: _FORWARD + "test_transformer_layer_cross_attention_arguments_against_torch"
           for a in ("enc_dec_attn_mask_type", "enc_dec_window_size")},
        **{a: _TL_PACKED for a in _PACKED_ARGS},
    },
}

_BIAS = {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": torch.zeros(1, 2, 4, 4),
         "alibi_slopes": torch.ones(2)}
#: every TE 2.20 forward argument of the core modules that seqfuse refuses -> a value that switches
#: it on (the call raises NotImplementedError naming it); at TE's default it is taken
FORWARD_REFUSED = {
    "Linear": {"fp8_output": True, "fp8_grad": True},
    "LayerNormLinear": {"fp8_output": True, "fp8_grad": True},
    "LayerNormMLP": {},
    "LayerNorm": {},
    "RMSNorm": {},
    "DotProductAttention": {
        **_BIAS, "bottom_right_diagonal": True, "inference_params": object(), "pad_between_seqs": True,
        "fp8_output": True, "bf16_backward": True, "num_splits": 2, "score_mod": lambda s: s,
        "score_mod_bprop": lambda s: s, "score_mod_tensors": {"t": torch.ones(1)},
        "score_mod_bprop_tensors": {"t": torch.ones(1)}, "qkv_layer": torch.zeros(1, 4, 3, 2, 8),
        "kv_layer": torch.zeros(1, 4, 2, 2, 8), "qkv_interleave_dim": -2,
    },
    "MultiheadAttention": {**_BIAS, "bottom_right_diagonal": True, "inference_params": object(),
                           "pad_between_seqs": True},
    "TransformerLayer": {**_BIAS, "bottom_right_diagonal": True, "enc_dec_bottom_right_diagonal": True,
                         "inference_params": object(), "pad_between_seqs": True},
}

#: a small module of each class and the positional inputs of its forward
FORWARD_CALLS = {
    "Linear": (lambda: te.Linear(16, 16, device="cpu"), lambda: (torch.randn(2, 16),)),
    "LayerNormLinear": (lambda: te.LayerNormLinear(16, 16, device="cpu"), lambda: (torch.randn(2, 16),)),
    "LayerNormMLP": (lambda: te.LayerNormMLP(16, 32, device="cpu"), lambda: (torch.randn(2, 16),)),
    "LayerNorm": (lambda: te.LayerNorm(16, device="cpu"), lambda: (torch.randn(2, 16),)),
    "RMSNorm": (lambda: te.RMSNorm(16, device="cpu"), lambda: (torch.randn(2, 16),)),
    "DotProductAttention": (lambda: te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal"),
                            lambda: tuple(torch.randn(1, 4, 2, 8) for _ in range(3))),
    "MultiheadAttention": (lambda: te.MultiheadAttention(16, 2, attention_dropout=0.0, qkv_format="bshd",
                                                         device="cpu"), lambda: (torch.randn(1, 4, 16),)),
    "TransformerLayer": (lambda: te.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                                     attn_input_format="bshd", device="cpu"),
                         lambda: (torch.randn(1, 4, 16),)),
}

def build(cls, **kwargs):
    if cls != "DotProductAttention":
        kwargs.setdefault("device", "cpu")
    return getattr(te, cls)(*REQUIRED[cls], **kwargs)


def test_snapshot_names_its_te_version():
    assert SNAPSHOT["te_version"].startswith("2.20")
    assert len(SNAPSHOT["commit"]) == 40
    assert set(SNAPSHOT["modules"]) == set(REQUIRED)
    assert "is_fp8_available" in SNAPSHOT["names"] and "Sequential" in SNAPSHOT["submodules"]["ops"]


def test_readme_table_is_current():
    with open(compat_table.README) as f:
        text = f.read()
    assert compat_table.BEGIN in text and compat_table.END in text, \
        "README.md has no generated TE table: run python3 benchmarks/te_compat/compat_table.py --write"
    table = compat_table.render(SNAPSHOT, RESULT)
    assert compat_table.readme_with(table, text) == text, \
        "README.md's TE table is stale: run python3 benchmarks/te_compat/compat_table.py --write"


def _positional(fn, owner=None, method=None):
    """The names a positional argument of ``fn`` can bind to, in order (no
    self for a method).  A method that passes ``*args`` on (DotProductAttention's
    forward) is read through to the first class in ``owner``'s MRO whose
    ``method`` names its parameters."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = list(inspect.signature(fn).parameters.values())
    if owner is not None and any(p.kind == p.VAR_POSITIONAL for p in params):
        base = next(b for b in owner.__mro__[1:] if method in vars(b))
        return _positional(vars(base)[method], base, method)
    names = [p.name for p in params if p.kind in kinds]
    return names[1:] if owner is not None else names


#: TE 2.20's leading positional arguments of the callables not in the snapshot's eight modules
TE_ORDERS = {
    "GroupedLinear": ["num_gemms", "in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation"],
    "autocast": ["enabled", "calibrating", "recipe", "amax_reduction_group", "_graph"],
    "fp8_autocast": ["enabled", "calibrating", "fp8_recipe", "fp8_group", "_graph"],
    "make_graphed_callables": ["modules", "sample_args", "num_warmup_iters", "allow_unused_input", "sample_kwargs",
                               "fp8_enabled", "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching",
                               "enabled", "calibrating", "recipe", "amax_reduction_group", "cache_quantized_params"],
    # TE's recipes' fields in order (dataclasses); seqfuse's are keyword-only where the orders differ
    "DelayedScaling": ["margin", "fp8_format", "amax_history_len", "amax_compute_algo", "scaling_factor_compute_algo",
                       "reduce_amax", "fp8_dpa", "fp8_mha", "backward_override"],
    "Float8CurrentScaling": ["use_power_2_scales", "fp8_format", "fp8_gemm_fprop", "fp8_gemm_dgrad",
                             "fp8_gemm_wgrad", "fp8_dpa", "fp8_mha", "backward_override"],
    "Float8BlockScaling": ["use_f32_scales", "fp8_format", "x_block_scaling_dim", "w_block_scaling_dim",
                           "grad_block_scaling_dim", "fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad", "fp8_dpa",
                           "fp8_mha", "backward_override"],
    "MXFP8BlockScaling": ["margin", "fp8_format", "fp8_dpa", "fp8_mha", "backward_override",
                          "enable_2d_quantization"],
    "NVFP4BlockScaling": ["disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"],
}


@pytest.mark.parametrize("cls", sorted(REQUIRED) + sorted(TE_ORDERS))
def test_a_positional_argument_binds_as_in_te(cls):
    """Every argument a caller can pass by position binds to the parameter of
    the same name as in Transformer Engine (constructors', forwards' and
    functions' orders are TE's as far as seqfuse takes arguments by position;
    the rest is keyword-only), so TE code that passes arguments by position
    either means the same here or fails with a TypeError: te.Linear(16, 16,
    False) is TE's sequence_parallel=False, never bias=False."""
    if cls in TE_ORDERS:
        obj = getattr(te, cls, None) or getattr(te.recipe, cls)
        fn = obj.__init__ if isinstance(obj, type) else getattr(obj, "__wrapped__", obj)
        orders = {"init": (TE_ORDERS[cls], _positional(fn, obj if isinstance(obj, type) else None, "__init__"))}
    else:
        klass = getattr(te, cls)
        orders = {w: ([a for a, _ in SNAPSHOT["modules"][cls][w]],
                      _positional(getattr(klass, "__init__" if w == "init" else "forward"), klass,
                                  "__init__" if w == "init" else "forward")) for w in ("init", "forward")}
    for which, (theirs, ours) in orders.items():
        n = min(len(ours), len(theirs))
        assert ours[:n] == theirs[:n], (cls, which, ours, theirs)


def test_a_positional_argument_past_tes_order_is_a_type_error():
    with pytest.raises(TypeError, match="positional argument"):
        te.Linear(16, 16, False, device="cpu")  # TE: sequence_parallel=False
    with pytest.raises(TypeError, match="positional argument"):
        te.GroupedLinear(2, 16, 16, False, device="cpu")
    layer = te.TransformerLayer(16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd",
                                device="cpu")
    with pytest.raises(TypeError, match="positional argument"):
        layer(torch.randn(1, 4, 16), None, "causal", None, None)  # TE's fifth: bottom_right_diagonal
    dpa = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(TypeError, match="positional argument"):  # TE's 14th: bottom_right_diagonal
        dpa(q, q, q, None, "bshd", None, None, None, None, None, None, "no_mask", (2, 0), False)
    with pytest.raises(NotImplementedError, match="bottom_right_diagonal"):  # TE's top-left diagonal
        dpa(q, q, q, window_size=(2, 0), bottom_right_diagonal=False)
    with pytest.raises(TypeError, match="positional argument"):
        with te.autocast(True, None):  # TE's second: calibrating
            pass


def test_no_core_constructor_argument_lacks():
    lacking = {cls: [a for a, s, _ in rows if s == "lacks"] for cls, rows in RESULT["modules"].items()}
    assert not any(lacking.values()), lacking


def test_refused_entries_are_te_arguments():
    for cls, table in REFUSED.items():
        te_args = {a for a, _ in SNAPSHOT["modules"][cls]["init"]}
        assert set(table) <= te_args, (cls, set(table) - te_args)


@pytest.mark.parametrize("cls,arg", [(c, a) for c, t in REFUSED.items() for a in t])
def test_refused_argument_raises_naming_it(cls, arg):
    entry = REFUSED[cls][arg]
    with pytest.raises(NotImplementedError, match=rf"{cls}: argument '{arg}'=.* is not supported: "):
        build(cls, **{arg: entry["probe"]})
    build(cls, **{arg: entry["off"][0]})  # its "off" value (TE's default) is taken


@pytest.mark.parametrize("name", list(REFUSED_NAMES))
def test_refused_name_raises_naming_itself(name):
    """Every TE name the table calls refused is a TE name, exported, and
    raises NotImplementedError naming itself and its reason when called
    with its probe (its "on" setting, or any call)."""
    assert name in SNAPSHOT["names"] and RESULT["names"][name] == "refused"
    args, kwargs = REFUSED_NAMES[name]["probe"]
    fn = getattr(te, name)
    with pytest.raises(NotImplementedError, match=rf"^{name}: .* is not supported: "):
        result = fn(*args, **kwargs)
        if hasattr(result, "__enter__"):  # a context manager refuses on entry
            with result:
                pass
    assert REFUSED_NAMES[name]["why"] in compat_table.render(SNAPSHOT, RESULT)


@pytest.mark.parametrize("cls", list(REQUIRED))
def test_taken_arguments_are_accepted_at_te_defaults(cls):
    """Every argument the table calls taken is accepted at TE's default value
    (what TE code that spells out its defaults passes)."""
    taken = {a for a, s, _ in RESULT["modules"][cls] if s == "has"}
    defaults = {a: d for a, d in SNAPSHOT["modules"][cls]["init"] if a in taken and d is not None}
    defaults.pop("device", None)  # TE's default is 'cuda'
    for name in ("normalized_shape", "hidden_size"):  # the norms: one of the pair, not both
        if cls in ("LayerNorm", "RMSNorm"):
            defaults.pop(name, None)
    kwargs = {a: eval(d, {"torch": torch}) for a, d in defaults.items()}
    build(cls, **kwargs)


def _test_sources():
    """{file: {test name: its source, decorators included}} of every file the
    coverage maps name."""
    here = os.path.dirname(os.path.abspath(__file__))
    refs = [r for m in (COVERAGE, NAME_COVERAGE, FORWARD_COVERAGE) for sub in m.values() for r in sub.values()]
    sources = {}
    for ref in refs:
        path, name = ref.split("::")
        if path not in sources:
            with open(os.path.join(here, path)) as f:
                text = f.read()
            lines = text.splitlines()
            sources[path] = {}
            for node in ast.parse(text).body:
                if isinstance(node, ast.FunctionDef):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    sources[path][node.name] = "\n".join(lines[first - 1:node.end_lineno])
    return sources


def _keywords(source):
    """The names a test's source passes as keyword arguments of a call, or as
    string keys of a dict literal (keyword dicts unpacked into a call): not
    a parameter default of a function it defines, nor a longer name that
    ends in the same letters."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call):
            names |= {k.arg for k in node.keywords if k.arg}
        elif isinstance(node, ast.Dict):
            names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


def test_every_taken_argument_names_a_test_that_exercises_it():
    sources = _test_sources()
    for cls, rows in RESULT["modules"].items():
        taken = [a for a, s, _ in rows if s == "has"]
        assert set(COVERAGE[cls]) == set(taken), (cls, set(taken) ^ set(COVERAGE[cls]))
        required = [n for n, p in inspect.signature(getattr(te, cls).__init__).parameters.items()
                    if p.default is p.empty and p.kind == p.POSITIONAL_OR_KEYWORD and n != "self"]
        for arg, ref in COVERAGE[cls].items():
            path, name = ref.split("::")
            assert name in sources[path], f"{cls}.{arg}: {ref} does not exist"
            if arg not in required and arg != "device":
                assert arg in _keywords(sources[path][name]), f"{cls}.{arg}: {ref} does not pass {arg}"


def test_every_present_name_names_a_test_that_checks_it():
    """The name audit: each name of transformer_engine.pytorch, te.ops and
    te.optimizers the table says seqfuse has maps to a test (NAME_COVERAGE)
    that exists and names it; a name added without such a test fails here."""
    sources = _test_sources()
    for key in ("names", "ops", "optimizers"):
        present = {n for n, s in RESULT[key].items() if s == "has"}
        assert set(NAME_COVERAGE[key]) == present, (key, sorted(present ^ set(NAME_COVERAGE[key])))
        for name, ref in NAME_COVERAGE[key].items():
            path, test = ref.split("::")
            assert test in sources[path], f"{key} {name}: {ref} does not exist"
            assert re.search(rf"\b{re.escape(name)}\b", sources[path][test]), f"{key} {name}: {ref} does not name it"


def _forward_parameters(cls):
    """The parameters of cls's forward, or of the first base class's forward
    where cls's passes *args / **kwargs on (te.DotProductAttention's)."""
    for klass in cls.__mro__:
        if "forward" in vars(klass):
            params = inspect.signature(vars(klass)["forward"]).parameters
            if not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
                return params
    raise AssertionError(f"{cls.__name__} has no forward with named parameters")


def test_every_forward_argument_is_taken_with_a_test_or_refused():
    """Each TE 2.20 forward argument of the eight core modules is either
    taken, with a test passing it by keyword (FORWARD_COVERAGE), or refused
    (FORWARD_REFUSED, checked below); seqfuse's forward takes each taken one
    by name."""
    sources = _test_sources()
    for cls, rows in RESULT["forward"].items():
        assert not [a for a, s, _ in rows if s == "lacks"], (cls, "lacking forward arguments")
        taken = {a for a, s, _ in rows if s == "has"}
        refused = {a for a, s, _ in rows if s == "refused"}
        assert set(FORWARD_COVERAGE[cls]) == taken, (cls, sorted(taken ^ set(FORWARD_COVERAGE[cls])))
        assert set(FORWARD_REFUSED[cls]) == refused == set(REFUSED_FORWARD[cls]), (cls, sorted(
            refused ^ set(FORWARD_REFUSED[cls])))
        assert taken | refused == {a for a, _ in SNAPSHOT["modules"][cls]["forward"]}
        params = _forward_parameters(getattr(te, cls))
        for arg, ref in FORWARD_COVERAGE[cls].items():
            assert arg in params, f"{cls}.forward does not take {arg!r}"
            path, test = ref.split("::")
            assert test in sources[path], f"{cls}.forward {arg}: {ref} does not exist"
            assert arg in _keywords(sources[path][test]), f"{cls}.forward {arg}: {ref} does not pass {arg}"


@pytest.mark.parametrize("cls,arg", [(c, a) for c, t in FORWARD_REFUSED.items() for a in t])
def test_refused_forward_argument_raises_naming_it(cls, arg):
    make, inputs = FORWARD_CALLS[cls]
    with pytest.raises(NotImplementedError, match=rf"\b{arg}\b"):
        make()(*inputs(), **{arg: FORWARD_REFUSED[cls][arg]})


@pytest.mark.parametrize("cls", list(FORWARD_CALLS))
def test_refused_forward_arguments_are_taken_at_te_defaults(cls):
    """All refused forward arguments at once at TE's defaults: the result is
    the plain call's."""
    make, inputs = FORWARD_CALLS[cls]
    torch.manual_seed(0)
    m, args = make(), inputs()
    defaults = {a: eval(d, {"torch": torch}) for a, d in SNAPSHOT["modules"][cls]["forward"]
                if a in FORWARD_REFUSED[cls]}
    assert torch.equal(m(*args, **defaults), m(*args))
