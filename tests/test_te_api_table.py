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
"""
import ast
import inspect
import os
import sys

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.modules.te_compat import REFUSED

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "te_compat"))
import compat_table  # noqa: E402
from seqfuse.pytorch.refused import REFUSED_NAMES  # noqa: E402

SNAPSHOT = compat_table.load_snapshot()
RESULT = compat_table.classify(SNAPSHOT)

#: the required arguments of each core module, small
REQUIRED = {"Linear": (16, 16), "LayerNormLinear": (16, 16), "LayerNormMLP": (16, 32), "LayerNorm": (16,),
            "RMSNorm": (16,), "DotProductAttention": (2, 8), "MultiheadAttention": (16, 2),
            "TransformerLayer": (16, 32, 2)}


#: argument -> "file::test" exercising it, for every argument the table calls taken
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
        'name': 'test_te_api.py::test_rng_tracker_draws_the_initialisation',
    },
    'LayerNormLinear': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'in_features': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'out_features': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'eps': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'bias': 'test_te_api.py::test_layernorm_linear_return_bias',
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
        'bias': 'test_te_api.py::test_layernorm_mlp_return_layernorm_output_and_bias',
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
    'LayerNorm': {
        'normalized_shape': 'test_te_api.py::test_norm_argument_names',
        'eps': 'test_norm_modules.py::test_layernorm_module_cpu',
        'sequence_parallel': 'test_te_api.py::test_norm_argument_names',
        'params_dtype': 'test_te_api.py::test_norm_argument_names',
        'zero_centered_gamma': 'test_norm_modules.py::test_layernorm_module_cpu',
        'hidden_size': 'test_te_api.py::test_norm_argument_names',
        'device': 'test_te_api.py::test_norm_argument_names',
        'dtype': 'test_te_api.py::test_norm_argument_names',
    },
    'RMSNorm': {
        'normalized_shape': 'test_te_api.py::test_norm_argument_names',
        'eps': 'test_norm_modules.py::test_rmsnorm_module_cpu',
        'sequence_parallel': 'test_te_api.py::test_norm_argument_names',
        'params_dtype': 'test_te_api.py::test_norm_argument_names',
        'zero_centered_gamma': 'test_norm_modules.py::test_rmsnorm_module_cpu',
        'hidden_size': 'test_te_api.py::test_norm_argument_names',
        'device': 'test_te_api.py::test_norm_argument_names',
        'dtype': 'test_te_api.py::test_norm_argument_names',
    },
    'DotProductAttention': {
        'get_rng_state_tracker': 'test_te_api_args.py::test_rng_tracker_draws_attention_dropout',
        'num_attention_heads': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'kv_channels': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'num_gqa_groups': 'test_dot_product_attention.py::test_module_matches_reference',
        'attention_dropout': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'qkv_format': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'attn_mask_type': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'window_size': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'layer_number': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'attention_type': 'test_attn_masks.py::test_pair_masks_cross_attention',
        'cp_group': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_global_ranks': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_stream': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'cp_comm_type': 'test_te_api_args.py::test_dot_product_attention_context_parallel_arguments',
        'softmax_scale': 'test_te_api_args.py::test_dot_product_attention_window_and_scale',
        'name': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
    },
    'MultiheadAttention': {
        'fuse_wgrad_accumulation': 'test_te_api_args.py::test_fuse_wgrad_accumulation_into_main_grad',
        'hidden_size': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'num_attention_heads': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'kv_channels': 'test_te_api_args.py::test_multihead_attention_norm_arguments',
        'attention_dropout': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
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
        'bias': 'test_te_api.py::test_multihead_attention_return_bias',
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
        'hidden_dropout': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'attention_dropout': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'output_layer_init_method': 'test_te_api_args.py::test_init_methods_reach_every_weight',
        'layer_number': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'kv_channels': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'self_attn_mask_type': 'test_transformer_layer.py::test_sliding_window',
        'window_size': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'enc_dec_attn_mask_type': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
        'enc_dec_window_size': 'test_te_api_args.py::test_transformer_layer_decoder_arguments',
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
        'attn_input_format': 'test_te_api_args.py::test_bookkeeping_arguments_change_nothing',
        'name': 'test_te_api_args.py::test_rng_tracker_reaches_every_weight',
        'qk_norm_type': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
        'qk_norm_eps': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
        'qk_norm_before_rope': 'test_te_api.py::test_transformer_layer_passes_qk_norm',
    },
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
    here = os.path.dirname(os.path.abspath(__file__))
    sources = {}
    for cls_map in COVERAGE.values():
        for ref in cls_map.values():
            path, name = ref.split("::")
            if path not in sources:
                with open(os.path.join(here, path)) as f:
                    text = f.read()
                sources[path] = {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
                                 if isinstance(node, ast.FunctionDef)}
    return sources


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
                assert f"{arg}=" in sources[path][name], f"{cls}.{arg}: {ref} does not pass {arg}"
