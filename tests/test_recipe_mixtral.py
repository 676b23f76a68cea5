"""The Mixtral DNA training recipe (recipes/mixtral) on the CPU, on the Llama
3 recipe's committed lambda-phage subset: the configs (base = the schema,
the named shapes), bad keys refused naming the key (unknown keys,
expert_parallel_size, formats the experts cannot run; the command line's
exit status 2), the load-balancing loss reaching the training loss and not
the validation loss, FLOPs of the active weights, per-layer FP8 reaching
the experts, and the L0 story: the loss falls on real DNA, a stop at a
checkpoint and the resume give the uninterrupted run's losses bit for bit,
and the export loads in transformers' MixtralForCausalLM and AutoTokenizer
with the checkpoint's weights and seqfuse's logits.  Expert parallelism:
refused in one process; two gloo processes (slow-marked) with the experts
spread over them train as two data-parallel ranks with every expert, and
stop, resume and export.  A cuda-marked test
runs L0_sanity on the GPU in bf16 and the three FP8 recipes."""
import math
import os

import pytest
import torch

from recipe_checks import CAUSAL_TINY as TINY  # noqa: E402
from recipe_checks import (LN10, check_export, check_l0_trains_and_resumes, check_named_configs,  # noqa: E402
                           fp8_seen_by_layer, recipe_path, torchrun)
from recipe_checks import losses as _losses  # noqa: E402

RECIPE = recipe_path("mixtral")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from mixtral_recipe import config as recipe_config  # noqa: E402
from mixtral_recipe import trainer  # noqa: E402
from mixtral_recipe.config import ConfigError, load_config  # noqa: E402
from mixtral_recipe.trainer import train  # noqa: E402
from recipe_common import checkpoint as ckpt  # noqa: E402

def _batch(cfg):
    """The first training batch of the recipe's loader (packed, real DNA)."""
    train_loader, _, _, _ = trainer.build_loaders(cfg, 0, 1, None)
    return next(iter(train_loader))


# ------------------------------------------------------------ configs
def test_named_configs_and_base_match_the_schema():
    check_named_configs(recipe_config, {"base", "L0_sanity", "mixtral_small", "8x1B"})
    small = trainer.model_config(load_config("mixtral_small"))
    assert (small.num_hidden_layers, small.hidden_size, small.num_local_experts, small.num_experts_per_tok) == \
        (8, 1024, 8, 2)
    big = trainer.model_config(load_config("8x1B"))
    from seqfuse.hf import llama3_config
    one_b = llama3_config("1B")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert getattr(big, k) == getattr(one_b, k), k
    assert (big.num_local_experts, big.num_experts_per_tok) == (8, 2)
    assert small.vocab_size == 10 and (small.bos_token_id, small.eos_token_id, small.pad_token_id) == (2, 3, 0)
    # the data are the Llama 3 recipe's
    assert load_config("L0_sanity").data.path == "recipes/llama3/data/subset"
    assert load_config("mixtral_small").data.path == "recipes/llama3/data/full"


def test_bad_keys_refused_naming_the_key():
    with pytest.raises(ConfigError) as e:
        load_config("L0_sanity", ["+model.num_expert=8"])
    assert "model.num_expert=8: not a key of the model group (did you mean model.num_local_experts" in str(e.value)
    with pytest.raises(ConfigError, match=r"distributed.expert_parallel_size=3: must divide "
                                          r"model.num_local_experts=4"):
        load_config("L0_sanity", ["distributed.expert_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"distributed.expert_parallel_size=0: must be an integer >= 1"):
        load_config("L0_sanity", ["distributed.expert_parallel_size=0"])
    with pytest.raises(ConfigError, match=r"expert_parallel_size=2 with precision.recipe=fp8_delayed: delayed "
                                          r"scaling's amax histories"):
        load_config("L0_sanity", ["distributed.expert_parallel_size=2", "precision.recipe=fp8_delayed"])
    load_config("L0_sanity", ["distributed.expert_parallel_size=2", "precision.recipe=fp8_current"])
    with pytest.raises(ConfigError, match=r"precision.recipe='mxfp8': must be one of 'bf16', 'fp32', 'fp8_delayed', "
                                          r"'fp8_current', 'fp8_block'"):
        load_config("L0_sanity", ["precision.recipe=mxfp8"])
    with pytest.raises(ConfigError, match=r"precision.fp4=true: the Mixtral recipe has no NVFP4 path"):
        load_config("L0_sanity", ["precision.fp4=true", "precision.fp4_layers=[1]"])
    # the FP8 GEMMs' sizes, before anything is built (the modules would refuse them at the first forward)
    with pytest.raises(ConfigError, match=r"model.hidden_size=64: must be a multiple of 128 under "
                                          r"precision.recipe=fp8_block"):
        load_config("L0_sanity", ["precision.recipe=fp8_block"])
    with pytest.raises(ConfigError, match=r"model.intermediate_size=100: must be a multiple of 16 under "
                                          r"precision.recipe=fp8_current"):
        load_config("L0_sanity", ["precision.recipe=fp8_current", "model.intermediate_size=100"])
    with pytest.raises(ConfigError, match=r"model.num_key_value_heads=1: the QKV GEMM's output, \(num_attention_heads "
                                          r"\+ 2 x num_key_value_heads\) x head_dim = 160, must be a multiple of 128"):
        load_config("L0_sanity", ["precision.recipe=fp8_block", "model.hidden_size=128", "model.num_attention_heads=8",
                                  "model.num_key_value_heads=1"])
    load_config("L0_sanity", ["precision.recipe=fp8_block", "model.hidden_size=128"])  # the cuda test's shape
    with pytest.raises(ConfigError, match=r"model.num_experts_per_tok=5: must be <= model.num_local_experts=4"):
        load_config("L0_sanity", ["model.num_experts_per_tok=5"])
    # the Llama 3 recipe's rules, on this recipe's keys
    with pytest.raises(ConfigError, match=r"layer 9 is not a layer of this 8-layer model"):
        load_config("mixtral_small", ["precision.recipe=fp8_delayed", "precision.fp8_layers=[1,9]"])
    with pytest.raises(ConfigError, match="model.num_key_value_heads=3: must divide model.num_attention_heads=4"):
        load_config("L0_sanity", ["model.num_key_value_heads=3"])
    with pytest.raises(ConfigError) as e:  # every bad key at once
        load_config("L0_sanity", ["train.steps=0", "model.router_aux_loss_coef=-1"])
    assert "train.steps=0" in str(e.value) and "model.router_aux_loss_coef=-1" in str(e.value)


def test_command_line_refuses_a_bad_key_with_exit_2(capsys):
    """train_fsdp2.py's entry (main_entry, in this process): a bad key ends
    with exit status 2 and the key's line on stderr, before anything is built."""
    def no_train(cfg, strategy):
        raise AssertionError("a bad config reached the trainer")

    for bad, line in (("model.hiden_size=8", "model.hiden_size=8: not a key of the model group (did you mean "
                                             "model.hidden_size?)"),
                      ("distributed.expert_parallel_size=3", "distributed.expert_parallel_size=3: must divide "
                                                             "model.num_local_experts=4")):
        with pytest.raises(SystemExit) as e:
            recipe_config.main_entry(no_train, "fsdp2", ["--config", "L0_sanity", "device=cpu", bad])
        assert e.value.code == 2
        assert line in capsys.readouterr().err


# ------------------------------------------------------------ the model in the loop
def test_aux_loss_in_training_loss_only():
    """forward_loss in training adds router_aux_loss_coef x the model's
    load-balancing loss to the cross-entropy; in evaluation it is the
    cross-entropy alone; coefficient 0 turns it off."""
    cfg = load_config("L0_sanity", TINY)
    torch.manual_seed(0)
    model, mcfg = trainer.build_model(cfg, torch.device("cpu"), torch.float32)
    batch = _batch(cfg)
    model.eval()
    ce = trainer.forward_loss(model, batch)
    model.train()
    total = trainer.forward_loss(model, batch)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], cu_seqlens=batch["cu_seqlens"],
                max_seqlen=int(batch["max_seqlen"]), output_router_logits=True)
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    want = ce + mcfg.router_aux_loss_coef * out.aux_loss
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-6)
    assert float((total - ce).detach()) > 1e-3  # 0.02 x about top-k: far above rounding
    model.config.router_aux_loss_coef = 0.0
    torch.testing.assert_close(trainer.forward_loss(model, batch), ce, rtol=1e-6, atol=1e-7)


def test_flops_count_the_active_weights():
    """active_params: every 2-D weight a token meets (attention, router, the
    LM head) plus num_experts_per_tok of the num_local_experts experts."""
    from seqfuse.hf import SeqfuseMixtralForCausalLM

    mcfg = trainer.model_config(load_config("L0_sanity"))
    model = SeqfuseMixtralForCausalLM(mcfg)
    dense = experts = 0
    for name, p in model.named_parameters():
        if "embed" in name or p.dim() < 2:
            continue
        if ".mlp.fc1." in name or ".mlp.fc2." in name:  # the experts' grouped GEMMs (one weight per expert)
            experts += p.numel()
        else:
            dense += p.numel()
    if mcfg.tie_word_embeddings:
        dense += model.lm_head.weight.numel()
    h, f, L = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_hidden_layers
    assert experts == L * mcfg.num_local_experts * 3 * h * f
    assert trainer.active_params(mcfg) == dense + experts * mcfg.num_experts_per_tok // mcfg.num_local_experts
    s, d = 100, mcfg.num_attention_heads * mcfg.head_dim
    assert trainer.train_flops([s], mcfg) == 3 * (2 * trainer.active_params(mcfg) * s + 2 * d * s * s * L)


def test_fp8_layers_reach_the_experts():
    """precision.fp8_layers=[2] under fp8_delayed: layer 2's MoE block runs
    under FP8, layer 1's does not (seen from inside each layer's MLP), and
    the loss is finite."""
    from seqfuse.modules import GroupedMLP

    def moe_blocks(model):
        for i, layer in enumerate(trainer.model_layers(model)):
            moe = [m for m in layer.modules() if isinstance(m, GroupedMLP)]
            assert len(moe) == 1, type(layer)
            yield i + 1, moe[0]

    seen, out = fp8_seen_by_layer(trainer, moe_blocks, lambda: train(load_config(
        "L0_sanity", TINY + ["train.steps=2", "precision.recipe=fp8_delayed", "precision.fp8_layers=[2]"]), "fsdp2"))
    assert seen == {1: {False}, 2: {True}}, seen
    assert all(math.isfinite(v) for v in out["history"]["loss"])


# ------------------------------------------------------------ training, checkpoint, resume, export
def test_l0_sanity_trains_resumes_and_exports(tmp_path):
    """One story on the committed subset: (1) L0_sanity for 12 steps, the
    loss falls far below an untrained model's ln(10); (2) the same run
    stopped at a checkpoint at step 6 (train.stop_at) and resumed to 12
    gives the uninterrupted run's losses exactly; (3) its export loads in
    transformers (MixtralForCausalLM, AutoTokenizer), holds the checkpoint's
    weights, and gives seqfuse's logits."""
    from transformers import MixtralForCausalLM

    import torch.distributed.checkpoint as dcp

    from seqfuse.hf import SeqfuseMixtralForCausalLM

    base, d, exp = check_l0_trains_and_resumes(train, load_config, tmp_path, steps=12)

    def trained():
        """seqfuse's model of the final checkpoint (compared with transformers' of the export)."""
        sf = SeqfuseMixtralForCausalLM(trainer.model_config(load_config("L0_sanity", base)))
        own = sf.state_dict()
        state = {"model": {k: torch.empty_like(v) for k, v in own.items() if not k.endswith("_extra_state")}}
        dcp.load(state, checkpoint_id=ckpt.latest_checkpoint(str(d)))
        own.update(state["model"])
        sf.load_state_dict(own, strict=True)
        return sf

    hf, _, _ = check_export(MixtralForCausalLM, "mixtral", exp, d, trained)
    assert (hf.config.num_local_experts, hf.config.num_experts_per_tok) == (4, 2)


# ------------------------------------------------------------ expert parallelism (two processes)
def test_expert_parallel_needs_as_many_processes():
    """distributed.expert_parallel_size=2 in one process: refused at the
    start, naming the key and the rule, before the model is built."""
    real = trainer.build_model

    def no_build(*a, **k):
        raise AssertionError("the model was built for an expert-parallel size the run cannot have")

    trainer.build_model = no_build
    try:
        with pytest.raises(ConfigError, match=r"distributed.expert_parallel_size=2: must divide the number of "
                                              r"processes \(1; run under torchrun"):
            train(load_config("L0_sanity", TINY + ["distributed.expert_parallel_size=2"]), "fsdp2")
    finally:
        trainer.build_model = real


def _torchrun(args, timeout=400):
    r = torchrun(os.path.join(RECIPE, "train_fsdp2.py"), ["--config", "L0_sanity", *TINY, "train.steps=3",
                                                          "train.warmup_steps=1", *args], timeout=timeout)
    return r.stdout + r.stderr


@pytest.mark.slow
def test_expert_parallel_two_processes_equal_data_parallel(tmp_path):
    """torchrun --nproc_per_node 2 on gloo: experts spread over the two
    ranks (distributed.expert_parallel_size=2: 2 of the 4 experts each,
    tokens exchanged all-to-all) train as the same two ranks with every
    expert each (FSDP2 over 2 data-parallel ranks): same losses to float32
    rounding (the weights are not compared: Adam's first steps turn
    rounding-level gradients into whole steps); the EP run stops at a
    checkpoint at step 2 and resumes, and its export (every expert gathered
    to rank 0) holds exactly the weights of its final sharded checkpoint."""
    from transformers import MixtralForCausalLM

    dp, ep, ck = tmp_path / "dp.jsonl", tmp_path / "ep.jsonl", tmp_path / "ck"
    _torchrun([f"logging.metrics_jsonl={dp}"])
    args = ["distributed.expert_parallel_size=2", f"logging.metrics_jsonl={ep}", f"checkpoint.dir={ck}"]
    out = _torchrun(args + ["train.stop_at=2"])
    assert "expert parallelism: 4 experts per layer over 2 ranks (2 on each)" in out
    assert [s for s, _ in ckpt.list_checkpoints(str(ck))] == [2]
    out = _torchrun(args + [f"checkpoint.export_dir={tmp_path / 'hf_ep'}"])
    assert "resumed from" in out
    want, got = _losses(dp), _losses(ep)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got[s], want[s])
    # the export holds every expert, each exactly as the final (sharded, EP) checkpoint has it
    import torch.distributed.checkpoint as dcp

    from seqfuse.hf.mixtral_convert import from_hf_pretrained

    assert MixtralForCausalLM.from_pretrained(str(tmp_path / "hf_ep")).config.num_local_experts == 4
    exported = from_hf_pretrained(str(tmp_path / "hf_ep")).state_dict()
    saved = {"model": {k: torch.empty_like(v) for k, v in exported.items() if not k.endswith("_extra_state")}}
    assert "model.layers.1.mlp.fc2.weight3" in saved["model"]
    dcp.load(saved, checkpoint_id=ckpt.latest_checkpoint(str(ck)))
    for k, v in saved["model"].items():
        assert torch.equal(exported[k], v), k


# ------------------------------------------------------------ GPU
@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8_delayed", "fp8_current", "fp8_block"])
def test_l0_sanity_cuda(precision):
    """L0_sanity on the GPU (bf16 parameters, FusedAdamW) in bf16 and the
    three FP8 recipes the experts run: the loss falls well below ln(10) and
    MFU and peak memory are logged.  Hidden 128 and SwiGLU width 128 so FP8
    block scaling's 128-wide blocks fit every GEMM."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = train(load_config("L0_sanity", ["device=cuda", "logging.progress_bar=false", "train.eval_interval=0",
                                          "model.hidden_size=128", f"precision.recipe={precision}"]), "fsdp2")
    h = out["history"]
    assert all(math.isfinite(v) for v in h["loss"]), h["loss"]
    assert h["loss"][-1] < LN10 - 0.6, h["loss"]
    assert out["rates"][-1]["peak_mem_gib"] > 0 and out["rates"][-1]["mfu_measured"] > 0
