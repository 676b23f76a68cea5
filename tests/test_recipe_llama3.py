"""The Llama 3 DNA training recipe (recipes/llama3) on the CPU, on the
committed lambda-phage subset: configs and the layer-wise precision rule
(1-indexed fp8_layers / fp4_layers as BioNeMo's recipe resolves them),
refusals before anything is built (bad layer indices, FP4 / MXFP8 off
Blackwell, named), per-layer FP8 reaching the layers, L0_sanity training
(the loss falls), a stop at a checkpoint and a resume that continues exactly
as the uninterrupted run, the export that transformers' LlamaForCausalLM and
AutoTokenizer load (same logits as seqfuse, the checkpoint's weights), 32
generated tokens from the exported and the seqfuse model, and a two-process
gloo FSDP2 run under torchrun (sharded checkpoint, resume, export)."""
import math
import os
import subprocess
import sys

import pytest
import torch

from recipe_checks import CAUSAL_TINY as TINY  # noqa: E402
from recipe_checks import (LN10, PROMPTS, ROOT, check_export, check_l0_trains_and_resumes, check_named_configs,  # noqa: E402
                           fp8_seen_by_layer, recipe_path, torchrun)
from recipe_checks import losses as read_losses  # noqa: E402

RECIPE = recipe_path("llama3")

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from llama3_recipe import config as recipe_config  # noqa: E402
from llama3_recipe import trainer  # noqa: E402
from llama3_recipe.config import ConfigError, load_config, resolve_layer_precision  # noqa: E402
from llama3_recipe.trainer import train  # noqa: E402
from recipe_common import checkpoint as ckpt  # noqa: E402

# ------------------------------------------------------------ configs
def test_named_configs_and_base_match_the_schema():
    check_named_configs(recipe_config, {"base", "L0_sanity", "1B", "8B"})
    one = load_config("1B")
    assert one.model.size == "1B" and one.data.max_length == 8192
    mcfg = trainer.model_config(one)
    from seqfuse.hf import llama3_config
    ref = llama3_config("1B")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "tie_word_embeddings", "rope_parameters"):
        assert getattr(mcfg, k) == getattr(ref, k), k
    assert mcfg.vocab_size == 10 and (mcfg.bos_token_id, mcfg.eos_token_id, mcfg.pad_token_id) == (2, 3, 0)
    assert load_config("8B").model.size == "8B"
    cfg = load_config("L0_sanity", ["precision.recipe=fp8_block", "data.packed=false", "train.grad_accum=2"])
    assert cfg.precision.recipe == "fp8_block" and cfg.data.packed is False and cfg.train.grad_accum == 2


def test_layer_precision_rule():
    """BioNeMo's rule: 1-indexed lists in, one entry per layer out."""
    assert resolve_layer_precision(4, True, False, None, None) == ["fp8"] * 4
    assert resolve_layer_precision(4, False, False, None, None) == [None] * 4
    assert resolve_layer_precision(4, True, False, [2, 3], None) == [None, "fp8", "fp8", None]
    # both on, one list given: the other format takes the remaining layers
    assert resolve_layer_precision(4, True, True, [1, 2], None) == ["fp8", "fp8", "fp4", "fp4"]
    assert resolve_layer_precision(4, True, True, None, [4]) == ["fp8", "fp8", "fp8", "fp4"]
    assert resolve_layer_precision(5, True, True, [1], [5]) == ["fp8", None, None, None, "fp4"]
    with pytest.raises(ValueError, match="neither list is given"):
        resolve_layer_precision(4, True, True, None, None)
    with pytest.raises(ValueError, match=r"layer 2 is in both lists"):
        resolve_layer_precision(4, True, True, [1, 2], [2, 3])


def test_bad_layer_settings_named():
    with pytest.raises(ConfigError) as e:
        load_config("L0_sanity", ["precision.recipe=fp8_delayed", "precision.fp8_layers=[0,3]"])
    msg = str(e.value)
    assert "precision.fp8_layers=[0, 3]: layer 0 is not a layer of this 2-layer model (1-indexed: 1..2)" in msg
    with pytest.raises(ConfigError, match=r"precision.fp8_layers=\[1\]: FP8 is off"):
        load_config("L0_sanity", ["precision.fp8_layers=[1]"])  # recipe bf16: the list would do nothing
    with pytest.raises(ConfigError, match=r"precision.fp4_layers=\[2\]: FP4 is off"):
        load_config("L0_sanity", ["precision.fp4_layers=[2]"])
    with pytest.raises(ConfigError, match="layer 1 is listed twice"):
        load_config("L0_sanity", ["precision.recipe=fp8_current", "precision.fp8_layers=[1,1]"])
    with pytest.raises(ConfigError, match="neither list is given"):
        load_config("L0_sanity", ["precision.recipe=fp8_delayed", "precision.fp4=true"])
    with pytest.raises(ConfigError, match=r"layer 17 is not a layer of this 16-layer model"):
        load_config("1B", ["precision.recipe=fp8_delayed", "precision.fp8_layers=[1,17]"])
    with pytest.raises(ConfigError, match="model.num_key_value_heads=3: must divide model.num_attention_heads=4"):
        load_config("L0_sanity", ["model.num_key_value_heads=3"])
    with pytest.raises(ConfigError, match="precision.recipe='fp4'"):
        load_config("L0_sanity", ["precision.recipe=fp4"])


def test_fp4_and_mxfp8_refused_before_building(monkeypatch):
    """On the CPU and on Hopper a config asking for NVFP4 or MXFP8 layers
    fails at the start, naming the first such layer and the hardware rule;
    nothing is built."""
    def no_build(*a, **k):
        raise AssertionError("the model was built for a precision the device cannot run")

    monkeypatch.setattr(trainer, "build_model", no_build)
    cfg = load_config("L0_sanity", TINY + ["precision.recipe=fp8_delayed", "precision.fp4=true",
                                           "precision.fp8_layers=[1]"])
    with pytest.raises(NotImplementedError) as e:
        train(cfg, "ddp")
    msg = str(e.value)
    assert "precision.fp4=true: layer 2 (1-indexed) would run NVFP4 GEMMs, which need compute " \
           "capability 10.x (Blackwell); this run is on the CPU" in msg
    assert isinstance(e.value, ConfigError)  # the command line reports it as a bad config (exit 2)
    cfg = load_config("L0_sanity", TINY + ["precision.recipe=mxfp8", "precision.fp8_layers=[2]"])
    with pytest.raises(NotImplementedError, match=r"precision.fp8_layers=\[2\]: layer 2 \(1-indexed\) would run "
                                                  r"MXFP8 GEMMs, which need compute capability 10.x"):
        train(cfg, "ddp")
    # a Hopper GPU, as torch would describe it
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    hopper = load_config("L0_sanity", ["precision.fp4=true", "precision.fp4_layers=[2]"])
    with pytest.raises(NotImplementedError, match=r"layer 2 \(1-indexed\) would run NVFP4 GEMMs, which need compute "
                                                  r"capability 10.x \(Blackwell\); this run is on cuda:0 \(NVIDIA "
                                                  r"H200, compute capability 9.0, Hopper\)"):
        trainer.check_run(hopper, torch.device("cuda", 0))
    trainer.check_run(load_config("L0_sanity", ["precision.recipe=fp8_block"]), torch.device("cuda", 0))  # fine


def test_command_line_refuses_fp4_on_cpu_with_exit_2():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, os.path.join(RECIPE, "train_ddp.py"), "--config", "L0_sanity", "device=cpu",
                        "precision.fp4=true"], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "precision.fp4=true: layer 1 (1-indexed) would run NVFP4 GEMMs, which need compute capability 10.x" \
        in r.stderr and "Traceback" not in r.stderr


def test_fp8_layers_reach_the_layers():
    """precision.fp8_layers=[2] under fp8_delayed: layer 2 runs FP8, layer 1
    does not (seen from inside each layer), FP8 batches are padded to 16
    tokens, and the loss is finite."""
    seen, out = fp8_seen_by_layer(
        trainer, lambda model: ((i + 1, layer.self_attention) for i, layer in enumerate(model.model.layers)),
        lambda: train(load_config("L0_sanity", TINY + ["train.steps=2", "precision.recipe=fp8_delayed",
                                                       "precision.fp8_layers=[2]", "data.packed=false"]), "ddp"))
    assert seen == {1: {False}, 2: {True}}, seen
    assert all(math.isfinite(v) for v in out["history"]["loss"])


def test_flops_count_the_gemm_weights():
    from seqfuse.hf import SeqfuseLlamaForCausalLM

    mcfg = trainer.model_config(load_config("L0_sanity"))
    model = SeqfuseLlamaForCausalLM(mcfg)
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    if mcfg.tie_word_embeddings:
        weights += model.lm_head.weight.numel()
    assert trainer.matmul_params(mcfg) == weights
    s, d = 100, mcfg.num_attention_heads * mcfg.head_dim
    assert trainer.train_flops([s], mcfg) == 3 * (2 * weights * s + 2 * d * s * s * mcfg.num_hidden_layers)


# ------------------------------------------------------------ training, checkpoint, resume, export, generate
def test_l0_sanity_trains_resumes_exports_and_generates(tmp_path):
    """One story on the committed subset: (1) L0_sanity for 16 steps, the
    loss falls far below an untrained model's ln(10); (2) the same run
    stopped at a checkpoint at step 8 (train.stop_at) and resumed to 16
    gives the uninterrupted run's losses exactly; (3) its export loads in
    transformers (LlamaForCausalLM, AutoTokenizer), holds the checkpoint's
    weights, and gives seqfuse's logits; (4) 32 greedy tokens generated by
    transformers from the export equal seqfuse's key/value-cached generate."""
    from transformers import LlamaForCausalLM

    from seqfuse.hf.llama_convert import from_hf_pretrained

    _, d, exp = check_l0_trains_and_resumes(train, load_config, tmp_path, steps=16)
    hf, tok, sf = check_export(LlamaForCausalLM, "llama", exp, d, lambda: from_hf_pretrained(str(exp)))

    # 32 new tokens after each prompt (without its <eos>), greedy: transformers on the export, seqfuse cached
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ids = [[tok.bos_token_id] + x for x in ids]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    with torch.no_grad():
        mine = sf.generate(input_ids, attention_mask=mask, max_new_tokens=32)
        theirs = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             pad_token_id=tok.pad_token_id)[:, width:]
    assert mine.shape == (2, 32)
    theirs = torch.nn.functional.pad(theirs, (0, 32 - theirs.shape[1]), value=tok.pad_token_id)  # all rows ended
    assert torch.equal(mine, theirs), (mine, theirs)
    text = tok.decode(mine[0], skip_special_tokens=True)
    assert set(text) <= set("ACGTN") and len(text) > 0, text


# ------------------------------------------------------------ two processes
def test_two_process_gloo_fsdp2(tmp_path):
    """torchrun --nproc_per_node 2 train_fsdp2.py on gloo: sharded training,
    a sharded DCP checkpoint where a 4-step run stops (train.stop_at=2; both
    ranks' RNG saved), the resume to step 4, and the HF export."""
    from transformers import LlamaForCausalLM

    jl, d, exp = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "hf"
    args = ["--config", "L0_sanity", *TINY, "train.steps=4", "train.warmup_steps=1", f"checkpoint.dir={d}",
            f"logging.metrics_jsonl={jl}"]
    torchrun(os.path.join(RECIPE, "train_fsdp2.py"), args + ["train.stop_at=2"])
    assert [s for s, _ in ckpt.list_checkpoints(str(d))] == [2]
    names = os.listdir(ckpt.latest_checkpoint(str(d)))
    assert {"rng_rank0.pt", "rng_rank1.pt", ".metadata", "manifest.json"} <= set(names)
    r = torchrun(os.path.join(RECIPE, "train_fsdp2.py"), args + [f"checkpoint.export_dir={exp}"])
    assert "resumed from" in r.stdout + r.stderr
    losses = read_losses(jl)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert LlamaForCausalLM.from_pretrained(str(exp)).config.num_hidden_layers == 2
    assert os.path.isfile(exp / "tokenizer.json")


# ------------------------------------------------------------ profiler range, GPU
def test_profiler_capture_range(monkeypatch, caplog):
    """profiler.start_step..end_step: cudaProfilerStart before the first
    step of the range, an NVTX range per step and per phase inside, Stop
    after the last, nothing outside (CUDA calls recorded, not made); on the
    CPU it says it is off; end before start is a named config error."""
    import logging
    import types

    from recipe_common.trainer import CaptureRange

    calls = []
    fake_rt = types.SimpleNamespace(cudaProfilerStart=lambda: calls.append("start"),
                                    cudaProfilerStop=lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake_rt)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    cfg = load_config("L0_sanity", ["profiler.enabled=true", "profiler.start_step=2", "profiler.end_step=3"])
    log = logging.getLogger("llama3")
    cr = CaptureRange(cfg, 0, torch.device("cuda", 0), log)
    for step in range(1, 6):
        cr.begin_step(step)
        with cr.phase("forward"):
            pass
        cr.end_step(step)
    assert calls == ["start", "push step 2", "push forward", "pop", "pop", "push step 3", "push forward", "pop",
                     "pop", "stop"], calls
    calls.clear()
    CaptureRange(cfg, 1, torch.device("cuda", 1), log).begin_step(2)  # rank 1: nothing
    assert calls == []
    with caplog.at_level(logging.WARNING, logger="llama3"):
        CaptureRange(cfg, 0, torch.device("cpu"), log)
    assert "profiler: enabled, but the run is on cpu" in caplog.text
    with pytest.raises(ConfigError, match="profiler.end_step=2: must be >= profiler.start_step=5"):
        load_config("L0_sanity", ["profiler.enabled=true", "profiler.start_step=5", "profiler.end_step=2"])


@pytest.mark.cuda
@pytest.mark.parametrize("precision", [["precision.recipe=bf16"],
                                       ["precision.recipe=fp8_delayed", "precision.fp8_layers=[2]"],
                                       # block scaling needs hidden sizes in whole 128-element blocks
                                       ["precision.recipe=fp8_block", "model.hidden_size=128"]])
@pytest.mark.parametrize("packed", [True, False])
def test_l0_sanity_cuda(precision, packed):
    """L0_sanity on the GPU (bf16 parameters, FusedAdamW): bf16, layer-wise
    FP8 delayed (layer 2 only) and FP8 block (hidden 128: L0's 64 is not a
    whole block, which the layer refuses), packed and padded; the loss falls
    well below ln(10) and MFU and peak memory are logged."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = train(load_config("L0_sanity", ["device=cuda", f"data.packed={packed}", "logging.progress_bar=false",
                                          "train.eval_interval=0", *precision]), "fsdp2")
    h = out["history"]
    assert h["loss"][-1] < LN10 - 0.6, h["loss"]
    assert out["rates"][-1]["peak_mem_gib"] > 0 and out["rates"][-1]["mfu_measured"] > 0


def test_recompute_activation_option_reaches_the_model():
    """model.recompute_activation=true sets the config's mlp_recompute_activation
    (named shapes too), and every decoder layer's LayerNormMLP takes it."""
    assert trainer.model_config(load_config("L0_sanity")).mlp_recompute_activation is False
    cfg = load_config("L0_sanity", ["model.recompute_activation=true"])
    assert trainer.model_config(cfg).mlp_recompute_activation is True
    assert trainer.model_config(load_config("1B", ["model.recompute_activation=true"])).mlp_recompute_activation
    model, _ = trainer.build_model(cfg, torch.device("cpu"), torch.float32)
    mlps = [layer.layernorm_mlp for layer in trainer.model_layers(model)]
    assert mlps and all(m.recompute_activation for m in mlps)
    with pytest.raises(ConfigError, match="recompute_activation"):
        load_config("L0_sanity", ["model.recompute_activation=maybe"])
