"""The ESM-2 recipe's train.cuda_graphs option (recipes/esm2/esm2_recipe/graphs.py)
and the fixed-length data it needs (data.fixed_length).

On the CPU: the keys parse with their defaults; every combination the option
cannot serve is refused with one line naming the keys and the rule (padded
real-length batches, activation checkpointing, the CPU, more than one
process, too few packed sequences), before anything is built; packed runs
capture for the packed bounds, fixed-length ones for the batch shape; fixed-length batches of the
real UniProt subset all have one shape and no padding; a batch without
padding runs without a mask and gives the masked call's loss exactly.

On CUDA: the recipe run with graphed layers gives the eager run's losses and
gradients over several steps (bf16 and FP8 delayed scaling, gradient
accumulation, a validation in between), the graphs are really replayed
(counted), and a graphed run stopped and resumed from its checkpoint gives
the uninterrupted graphed run's losses (the checkpoint is loaded into the
tensors the graphs read)."""
import json
import logging
import math
import os
import sys

import pytest
import torch

from helpers import REL_TOL, pair_tol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "esm2")
sys.path.insert(0, RECIPE)

pytest.importorskip("transformers")
pytest.importorskip("pyarrow")
pytest.importorskip("hydra")

from esm2_recipe.config import ConfigError, load_config  # noqa: E402
from esm2_recipe import trainer  # noqa: E402

# fixed-length batches of the committed subset: [8, 128] (L0_sanity's 2 layers, hidden 64, 4 heads)
FIXED = ["data.fixed_length=true", "data.packed=false", "data.max_length=128", "data.micro_batch_tokens=1024",
         "data.val_batches=2", "logging.progress_bar=false", "train.log_interval=1"]
GRAPHED = FIXED + ["train.cuda_graphs=true", "device=cuda"]
# packed batches of the committed subset: at most 1024 tokens, sequences of at most 128
PACKED = ["data.max_length=128", "data.micro_batch_tokens=1024", "data.val_batches=2", "logging.progress_bar=false",
          "train.log_interval=1"]


# ------------------------------------------------------------ config (CPU)
def test_keys_parse_with_their_defaults():
    cfg = load_config("L0_sanity")
    assert cfg.train.cuda_graphs is False and cfg.data.fixed_length is False
    assert cfg.train.cuda_graphs_max_sequences is None
    cfg = load_config("L0_sanity", GRAPHED)
    assert cfg.train.cuda_graphs is True and cfg.data.fixed_length is True and cfg.data.packed is False
    cfg = load_config("650M", ["train.cuda_graphs=true", "data.fixed_length=true", "data.packed=false",
                               "precision.recipe=fp8_delayed"])
    assert cfg.train.cuda_graphs is True
    with pytest.raises(ConfigError, match=r"train.cuda_graphs='yes': must be true or false"):
        load_config("L0_sanity", ["train.cuda_graphs=yes"])


def test_refusals_name_the_keys_and_the_rule():
    with pytest.raises(ConfigError) as e:
        load_config("L0_sanity", ["train.cuda_graphs=true", "train.activation_checkpointing=true", "device=cpu"])
    msg = str(e.value)
    assert msg.splitlines()[0] == "config L0_sanity: 2 bad keys", msg
    assert "train.cuda_graphs=true: needs train.activation_checkpointing=false" in msg
    assert "train.cuda_graphs=true: needs a CUDA device, got device='cpu'" in msg
    # padded real-length batches: a new shape every step
    with pytest.raises(ConfigError, match=r"1 bad key\n  train.cuda_graphs=true: needs data.packed=true or "
                                          r"data.fixed_length=true \(padded real-length batches"):
        load_config("L0_sanity", ["train.cuda_graphs=true", "data.packed=false"])
    # packed batches, real-length or fixed-length, and fixed-length padded ones are served
    for extra in ([], ["data.fixed_length=true"], ["data.fixed_length=true", "data.packed=false"]):
        load_config("L0_sanity", ["train.cuda_graphs=true", "device=cuda"] + extra)
    # fixed length under FP8 needs whole 16-token multiples, else every batch would be padded
    with pytest.raises(ConfigError, match=r"data.max_length=120: must be a multiple of 16 with "
                                          r"data.fixed_length=true"):
        load_config("L0_sanity", ["data.fixed_length=true", "data.max_length=120", "precision.recipe=fp8_delayed"])
    load_config("L0_sanity", ["data.fixed_length=true", "data.max_length=120"])  # bf16: no multiple


def test_run_refusals_before_anything_is_built(monkeypatch):
    """What the config cannot know: the device device=auto resolves to, and
    the number of processes."""
    from esm2_recipe.graphs import check_graphs_run

    cfg = load_config("L0_sanity", FIXED + ["train.cuda_graphs=true"])
    with pytest.raises(ValueError, match=r"train.cuda_graphs=true: one process only, this job has 2"):
        check_graphs_run(cfg, torch.device("cuda", 0), 2)
    with pytest.raises(ValueError, match=r"train.cuda_graphs=true: needs a CUDA device, the run is on cpu "
                                         r"\(device='auto'\)"):
        check_graphs_run(cfg, torch.device("cpu"), 1)
    check_graphs_run(cfg, torch.device("cuda", 0), 1)
    check_graphs_run(load_config("L0_sanity"), torch.device("cpu"), 4)  # the option off: nothing to refuse
    # packed: every batch needs room for its padding (1024 tokens in sequences of at most 128: 8, and the
    # collator's padding sequence) besides one sequence of its own: 10
    packed = PACKED + ["train.cuda_graphs=true", "device=cuda"]
    check_graphs_run(load_config("L0_sanity", packed + ["train.cuda_graphs_max_sequences=10"]), torch.device("cuda"),
                     1)
    with pytest.raises(ValueError, match=r"data.pad_to_multiple_of=256 must be at most data.max_length=128 with "
                                         r"packed batches"):
        check_graphs_run(load_config("L0_sanity", packed + ["data.pad_to_multiple_of=256"]), torch.device("cuda"), 1)
    with pytest.raises(ValueError, match=r"train.cuda_graphs_max_sequences=9: must be at least 10 \(the graphs' "
                                         r"capture batch holds data.micro_batch_tokens=1024 tokens"):
        check_graphs_run(load_config("L0_sanity", packed + ["train.cuda_graphs_max_sequences=9"]),
                         torch.device("cuda"), 1)
    if torch.cuda.is_available():
        return  # device=auto would be CUDA here

    def no_build(*a, **k):
        raise AssertionError("the model was built for a run train.cuda_graphs cannot serve")

    monkeypatch.setattr(trainer, "build_model", no_build)
    with pytest.raises(ValueError, match=r"needs a CUDA device, the run is on cpu"):
        trainer.train(cfg, "fsdp2")


def test_the_trainer_captures_after_wrapping_for_the_batch_shape(monkeypatch):
    """The recipe's wrap_model captures the (unwrapped) model's layers under
    the run's FP8 recipe when train.cuda_graphs is on, and only then; the
    graphed shape is the fixed-length batch's."""
    from esm2_recipe import graphs

    from seqfuse.common.recipe import DelayedScaling

    seen = []
    monkeypatch.setattr(graphs, "capture_layers", lambda model, cfg, recipe: seen.append((model, recipe)))
    model = torch.nn.Linear(2, 2)
    log = logging.getLogger("esm2")
    cfg = load_config("L0_sanity", GRAPHED + ["precision.recipe=fp8_delayed", "precision.amax_history_len=8"])
    assert trainer.wrap_model(model, [], "ddp", 1, torch.device("cuda", 0), cfg, log) is model
    assert len(seen) == 1 and seen[0][0] is model
    assert seen[0][1] == DelayedScaling(amax_history_len=8)
    assert graphs.graphed_batch_shape(cfg) == (8, 128)
    trainer.wrap_model(model, [], "fsdp2", 1, torch.device("cpu"), load_config("L0_sanity", FIXED), log)
    assert len(seen) == 1
    layout = graphs.packed_layout(load_config("L0_sanity", PACKED + ["train.cuda_graphs=true", "device=cuda"]))
    # the default: 1.5 x an average batch's sequences (1024 tokens over the subset's mean of 122.3 with
    # the special tokens, cropped to 128) and the padding's room (1024 / 128, and the collator's)
    assert layout.key() == ("thd", 1024, 13 + 9, 128)


def test_packed_graphs_cap_the_loaders_sequences_so_every_batch_fits(caplog):
    """Under packed train.cuda_graphs the loader holds at most the graphs'
    sequence bound less the padding's room (8 sequences of 128 for an
    empty budget of 1024 tokens, and the collator's padding sequence of its
    FP8 token multiple): every batch of the real subset then fits the
    graphs, with the default bound (22: 13 and that room) and with
    one too small for the proteins' count (12), where the cap splits
    batches instead of sending them eagerly; without the option no cap."""
    from esm2_recipe import graphs

    from seqfuse.common.recipe import DelayedScaling

    for n_max in (None, 12):
        over = [] if n_max is None else [f"train.cuda_graphs_max_sequences={n_max}"]
        cfg = load_config("L0_sanity", PACKED + over)
        cfg.train.cuda_graphs = True  # (the config rules refuse the CPU: the loaders do not care)
        layout = graphs.packed_layout(cfg)
        cap = graphs.loader_max_sequences(cfg)
        assert cap == layout.sequences - 9
        with caplog.at_level(logging.INFO, logger="esm2"):
            train_loader, val_loader, _, _ = trainer.build_loaders(cfg, 0, 1, DelayedScaling())
        assert f"packed training batches hold at most {cap} sequences" in caplog.text
        total, added = train_loader.batch_sampler.batches_added_by_cap(0)
        free = load_config("L0_sanity", PACKED + over)  # the same run without graphs: no cap
        uncapped = trainer.build_loaders(free, 0, 1, DelayedScaling())[0]
        assert total == len(train_loader) and added == total - len(uncapped)
        assert (added > 0) == (n_max == 12)  # the default bound splits none of the subset's epoch-0 batches
        assert (f"in epoch 0 that splits batches of more short proteins into {added} more batches ({total} in all)"
                if added else f"it splits none of epoch 0's {total} batches") in caplog.text
        caplog.clear()
        counts = []
        for i, batch in enumerate(train_loader):
            n = batch["cu_seqlens"].numel() - 1
            counts.append(batch["num_sequences"])
            assert batch["num_sequences"] <= cap
            assert layout.misfit(batch["input_ids"].numel(), n, int(batch["max_seqlen"])) is None, (i, n)
            if i == 40:
                break
        if n_max == 12:
            assert max(counts) == cap  # the cap cut batches; validation (eager) is not capped
            assert max(b["num_sequences"] for b in val_loader) > cap
        else:
            assert cap == 13 and max(counts) <= cap
    assert graphs.loader_max_sequences(load_config("L0_sanity", PACKED)) is None


def test_capture_says_which_layers_and_warns_of_packed_fixed_windows(monkeypatch, caplog):
    """capture_layers picks graph_packed_layers (packed bounds) or
    graph_layers (the fixed batch shape), and warns that packed fixed-length
    windows lose the cuDNN route they take eagerly (the model's capture
    stood in for: this runs on the CPU)."""
    from esm2_recipe import graphs

    from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM

    model = SeqfuseEsmForMaskedLM(SeqfuseEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128))
    seen = []
    monkeypatch.setattr(model.esm, "graph_packed_layers", lambda *a, **k: seen.append(("packed", a)))
    monkeypatch.setattr(model.esm, "graph_layers", lambda *a, **k: seen.append(("bshd", a)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with caplog.at_level(logging.INFO, logger="esm2"):
        graphs.capture_layers(model, load_config("L0_sanity", PACKED), None)
        assert "FlashAttention" not in caplog.text
        graphs.capture_layers(model, load_config("L0_sanity", PACKED + ["data.fixed_length=true"]), None)
        graphs.capture_layers(model, load_config("L0_sanity", FIXED), None)
    assert seen == [("packed", (1024, 22, 128)), ("packed", (1024, 12 + 9, 128)), ("bshd", (8, 128))]
    assert sum("graphed layers run every packed batch on FlashAttention" in r.getMessage()
               for r in caplog.records) == 1


# ------------------------------------------------------------ fixed-length data (CPU)
def test_fixed_length_batches_have_one_shape_and_no_padding():
    cfg = load_config("L0_sanity", FIXED + ["device=cpu"])
    train_loader, val_loader, n_train, n_val = trainer.build_loaders(cfg, 0, 1, None)
    assert n_train % 8 == 0 and n_val % 8 == 0 and n_train > 100
    for loader in (train_loader, val_loader):
        shapes = set()
        for batch in loader:
            shapes.add(tuple(batch["input_ids"].shape))
            assert batch["num_tokens"] == batch["input_ids"].numel()
            assert bool(batch["attention_mask"].all())
        assert shapes == {(8, 128)}, shapes
    # the windows are the concatenated proteins, cut in order, each 126 residues
    from esm2_recipe.trainer import fixed_length_windows
    w = fixed_length_windows(["ABCDE", "FGH", "IJ"], 5, 2, "train")
    assert w == ["ABC", "DEF"]  # ("GHI" would start a third batch of 2: cut)
    with pytest.raises(ValueError, match=r"data.fixed_length=true: the validation split gives 1 windows of 5 "
                                         r"tokens, fewer than one batch of 2"):
        fixed_length_windows(["ABCD"], 5, 2, "validation")


def test_a_batch_without_padding_runs_without_a_mask_exactly():
    """forward_loss passes no attention_mask when the real tokens fill every
    row (no host read of the mask in the model): the same loss, bit for bit,
    as the masked call; a padded batch keeps its mask."""
    from seqfuse.data import EsmTokenizer, build_mlm_loader, load_sequences
    from seqfuse.hf import SeqfuseEsmConfig, SeqfuseEsmForMaskedLM

    # the recipe's fixed-length samples of the first 40 proteins, collated as its loader does
    _, seqs = load_sequences(os.path.join(RECIPE, "data", "subset", "train.parquet"))
    windows = trainer.fixed_length_windows(seqs[:40], 128, 8, "train")
    tok = EsmTokenizer()
    batch = next(iter(build_mlm_loader(windows, tok, max_tokens=1024, max_length=128, packed=False)))
    assert tuple(batch["input_ids"].shape) == (8, 128)
    torch.manual_seed(0)
    model = SeqfuseEsmForMaskedLM(SeqfuseEsmConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=128)).train()
    seen = []
    model.esm.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("attention_mask")), with_kwargs=True)
    loss = trainer.forward_loss(model, batch)
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert seen[0] is None
    assert torch.equal(loss, ref), (loss, ref)
    padded = dict(batch, num_tokens=batch["num_tokens"] - 5)
    padded["attention_mask"] = batch["attention_mask"].clone()
    padded["attention_mask"][0, -5:] = 0
    trainer.forward_loss(model, padded)
    assert seen[-1] is padded["attention_mask"]


def test_fixed_length_trains_on_the_cpu(tmp_path):
    """data.fixed_length on its own (no graphs) is an ordinary run: the loss
    is finite and falls over a few steps."""
    out = trainer.train(load_config("L0_sanity", FIXED + ["device=cpu", "train.steps=6", "train.eval_interval=0",
                                                          "train.warmup_steps=2"]), "fsdp2")
    h = out["history"]["loss"]
    assert len(h) == 6 and all(math.isfinite(v) for v in h) and h[-1] < h[0], h


# ------------------------------------------------------------ CUDA: graphed equals eager
def _run(overrides, monkeypatch=None, record_grads=None):
    """One recipe run on the GPU; the gradients of each optimizer step go
    to ``record_grads`` (a list) when given."""
    real_build = trainer.build_optimizer
    if record_grads is not None:
        def recording(model, cfg):
            opt = real_build(model, cfg)

            def keep(o, args, kwargs):
                record_grads.append({i: p.grad.detach().float().cpu().clone()
                                     for i, p in enumerate(q for g in o.param_groups for q in g["params"])
                                     if p.grad is not None})
            opt.register_step_pre_hook(keep)
            return opt
        monkeypatch.setattr(trainer, "build_optimizer", recording)
    try:
        return trainer.train(load_config("L0_sanity", overrides), "fsdp2")
    finally:
        if record_grads is not None:
            monkeypatch.setattr(trainer, "build_optimizer", real_build)


def _grad_error(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)) for k in a)


def _eager_and_graphed(base, monkeypatch, caplog):
    """The recipe run with ``base`` overrides, then with train.cuda_graphs
    (its log captured at INFO): (eager result, graphed result, each step's
    gradients of both, the graphed run's CUDA graph replays counted)."""
    eager_grads, graph_grads = [], []
    eager = _run(base, monkeypatch, eager_grads)
    replays = []
    real_replay = torch.cuda.CUDAGraph.replay

    def counting(self):
        replays.append(1)
        return real_replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    with caplog.at_level(logging.INFO):
        graphed = _run(base + ["train.cuda_graphs=true"], monkeypatch, graph_grads)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", real_replay)
    return eager, graphed, eager_grads, graph_grads, replays


PRECISIONS = {"bf16": ["precision.recipe=bf16"], "fp8_delayed": ["precision.recipe=fp8_delayed"],
              # per-layer precision: layer 0 runs without FP8 inside the FP8 region, in its graph too
              "fp8_delayed_bf16_layer0": ["precision.recipe=fp8_delayed", "precision.bf16_first_layers=1"]}


@pytest.mark.cuda
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_cuda_graphed_recipe_trains_as_eager(precision, monkeypatch, caplog):
    """Six optimizer steps of two micro-batches each, validation after step
    3: the graphed run's losses and gradients equal the eager run's (the
    same kernels in the same order; they may differ only by the order of
    atomic additions in the backward, whose rounding FP8 and several Adam
    steps can carry forward), every training micro-batch replays the graphs
    (2 graphs per layer: forward and backward) except, under delayed scaling,
    an FP8 layer's first two micro-batches (eager until its inputs' and then
    its gradients' casts have an amax history: make_graphed_callables' first
    step rule), and validation runs eagerly, saying so."""
    base = FIXED + PRECISIONS[precision] + ["device=cuda", "train.steps=6", "train.grad_accum=2",
                                            "train.eval_interval=3", "train.warmup_steps=2",
                                            "precision.amax_history_len=4"]
    eager, graphed, eager_grads, graph_grads, replays = _eager_and_graphed(base, monkeypatch, caplog)
    assert "2 encoder layers captured as CUDA graphs (forward and backward) for batches [8, 128]" in caplog.text
    # eager micro-batches x FP8 layers: the first step's two micro-batches of each delayed-scaling FP8 layer
    eager_layer_calls = {"bf16": 0, "fp8_delayed": 2 * 2, "fp8_delayed_bf16_layer0": 2 * 1}[precision]
    # steps x micro-batches x layers x (forward, backward)
    assert len(replays) == 6 * 2 * 2 * 2 - 2 * eager_layer_calls, len(replays)
    skipped = [r.getMessage() for r in caplog.records if "graphed layers not used" in r.getMessage()]
    assert skipped == ["SeqfuseEsmModel: graphed layers not used, layers run eagerly: not training (eval mode "
                       "or no grad)"], skipped
    le, lg = eager["history"]["loss"], graphed["history"]["loss"]
    assert len(le) == len(lg) == 6
    for a, b in zip(le, lg):
        assert abs(a - b) <= REL_TOL[torch.bfloat16] * abs(a), (le, lg)
    assert le[-1] < le[0] and lg[-1] < lg[0]  # the optimizer's updates were seen by the graphs
    ve, vg = eager["history"]["val_loss"], graphed["history"]["val_loss"]
    assert len(ve) == len(vg) == 2 and all(abs(a - b) <= REL_TOL[torch.bfloat16] * abs(a) for a, b in zip(ve, vg))
    assert len(eager_grads) == len(graph_grads) == 6
    # step 1: the same weights, so only the backward's atomics differ (two bf16 results: pair_tol)
    assert _grad_error(eager_grads[0], graph_grads[0]) <= pair_tol(torch.bfloat16)
    # step 6: after five Adam steps from those gradients; FP8 can round a carried difference to the next code
    assert _grad_error(eager_grads[-1], graph_grads[-1]) <= 5 * pair_tol(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8_delayed"])
def test_cuda_graphed_packed_recipe_trains_as_eager(precision, monkeypatch, caplog):
    """The recipe's default packed batches, graphed: every training batch
    of real UniProt proteins (its own token count, sequences and longest
    sequence) replays the graphs padded to their bounds, and the run's
    losses and gradients are the eager run's."""
    base = PACKED + PRECISIONS[precision] + ["device=cuda", "train.steps=6", "train.eval_interval=0",
                                             "train.warmup_steps=2", "precision.amax_history_len=4"]
    eager, graphed, eager_grads, graph_grads, replays = _eager_and_graphed(base, monkeypatch, caplog)
    assert ("2 encoder layers captured as CUDA graphs (forward and backward) for packed batches of at most 1024 "
            "tokens in 22 sequences") in caplog.text
    skipped = [r.getMessage() for r in caplog.records if "graphed layers not used" in r.getMessage()]
    # the closing validation runs eagerly; every training batch replays (counted below)
    assert skipped == ["SeqfuseEsmModel: graphed layers not used, layers run eagerly: not training (eval mode "
                       "or no grad)"], skipped
    # steps x layers x (forward, backward), less FP8 delayed's first two eager steps of each layer
    assert len(replays) == 6 * 2 * 2 - (2 * 2 * 2 if precision == "fp8_delayed" else 0), len(replays)
    le, lg = eager["history"]["loss"], graphed["history"]["loss"]
    assert len(le) == len(lg) == 6
    for a, b in zip(le, lg):
        assert abs(a - b) <= REL_TOL[torch.bfloat16] * abs(a), (le, lg)
    assert lg[-1] < lg[0]
    # the graphs' GEMMs run on the padded row count, and FP8's amaxes see the padding rows: rounding
    # differences only, which FP8's codes and five Adam steps carry to the last step's gradients
    assert _grad_error(eager_grads[0], graph_grads[0]) <= 2 * pair_tol(torch.bfloat16)
    assert _grad_error(eager_grads[-1], graph_grads[-1]) <= (5 * pair_tol(torch.bfloat16) if precision == "bf16"
                                                              else 0.15)


@pytest.mark.cuda
def test_cuda_graphed_recipe_resumes_exactly(tmp_path):
    """A graphed FP8 run stopped after step 3 (checkpoint) and resumed gives
    the uninterrupted graphed run's losses for steps 4-6: the checkpoint is
    loaded in place into the weights and scaling state the graphs read (a
    load into new tensors would leave the graphs on the initial weights)."""
    # a high learning rate moves the weights far each step, so layers left on stale weights would show
    base = GRAPHED + ["precision.recipe=fp8_delayed", "train.steps=6", "train.eval_interval=0", "train.lr=1e-2",
                      "train.warmup_steps=1", "precision.amax_history_len=4"]
    a, b, d = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "ck"
    trainer.train(load_config("L0_sanity", base + [f"logging.metrics_jsonl={a}"]), "fsdp2")
    run = base + [f"checkpoint.dir={d}", f"logging.metrics_jsonl={b}"]
    trainer.train(load_config("L0_sanity", run + ["train.stop_at=3"]), "fsdp2")
    out = trainer.train(load_config("L0_sanity", run), "fsdp2")
    assert out["final_step"] == 6

    def losses(path):
        return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}

    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(1, 7))
    for s in range(1, 7):
        assert abs(la[s] - lb[s]) <= REL_TOL[torch.bfloat16] * abs(la[s]), (s, la, lb)
    assert lb[6] < lb[1]
