"""Refusals that had no test: the one reader of real-number arguments
(seqfuse.ops.args.as_float) and its callers, the named random-number
streams (te.CudaRNGStatesTracker), pad_thd_sequences_for_cp's input_ids,
and generate's key/value cache on another device.  Each test fails if the
raise it names is removed."""
import fractions
import math
import re

import numpy as np
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.distributed import pad_thd_sequences_for_cp
from seqfuse.ops import moe
from seqfuse.ops.args import as_float, as_max_norm
from seqfuse.pytorch.multi_tensor import multi_tensor_adam


# ---- as_float: the one reader ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [2, 2.0, np.float32(2.0), np.int64(2), fractions.Fraction(2),
                                   torch.tensor(2.0), torch.tensor([2]), torch.tensor([[2.0]], dtype=torch.float64)])
def test_as_float_reads_real_numbers_of_every_kind(value):
    v = as_float("op", "x", value)
    assert v == 2.0 and type(v) is float


@pytest.mark.parametrize("value", [True, False, np.True_, torch.tensor(True), torch.tensor([False])])
def test_as_float_refuses_bools(value):
    """True was read as 1.0 (float(True), float of a bool tensor)."""
    with pytest.raises(TypeError, match="op: argument 'x' must be a real number, got the bool"):
        as_float("op", "x", value)


@pytest.mark.parametrize("value", [1 + 2j, complex(3, 0), np.complex128(1 + 2j), torch.tensor(1 + 0j)])
def test_as_float_refuses_complex_numbers(value):
    """numpy's complex was cast with a warning, its imaginary part dropped."""
    with pytest.raises(TypeError, match="op: argument 'x' must be a real number, got the complex number"):
        as_float("op", "x", value)


@pytest.mark.parametrize("value", ["1.5", b"1", None, [1.0], torch.ones(2), np.ones(2)])
def test_as_float_refuses_what_is_no_real_number(value):
    with pytest.raises(TypeError, match="op: argument 'x' must be a real number, got"):
        as_float("op", "x", value)


def test_as_float_refuses_an_int_past_the_double_range():
    """float(10 ** 400) is an OverflowError, which escaped unnamed."""
    with pytest.raises(ValueError, match="op: argument 'x' must fit a double, got 1000"):
        as_float("op", "x", 10 ** 400)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, torch.tensor(math.nan)])
def test_as_float_finite(bad):
    assert as_float("op", "x", bad) != 0  # (no rule: read as it is)
    with pytest.raises(ValueError, match="op: argument 'x' must be a finite number, got"):
        as_float("op", "x", bad, finite=True)


@pytest.mark.parametrize("kw,bad,rule", [
    (dict(minimum=1), 0.5, ">= 1"), (dict(minimum=1), math.nan, ">= 1"),
    (dict(above=0), 0, "> 0"), (dict(above=0), math.nan, "> 0"),
    (dict(maximum=1), 2, "<= 1"), (dict(maximum=1), math.nan, "<= 1"),
    (dict(above=0, maximum=1), 0, r"in \(0, 1\]"), (dict(above=0, maximum=1), 1.5, r"in \(0, 1\]"),
    (dict(minimum=0, maximum=1), -0.5, r"in \[0, 1\]"),
    (dict(finite=True, above=0), math.inf, "a finite number > 0"),
    (dict(minimum=0, why="(inf: none)"), -1, r">= 0 \(inf: none\)"),
])
def test_as_float_bounds(kw, bad, rule):
    """A bound refuses NaN too (it is in no range); the message says the rule and the value."""
    with pytest.raises(ValueError, match=rf"op: argument 'x' must be {rule}, got {float(bad)}"):
        as_float("op", "x", bad, **kw)


def test_as_float_bounds_are_inclusive_or_open_as_asked():
    assert as_float("op", "x", 1, minimum=1) == 1.0 and as_float("op", "x", 1, above=0, maximum=1) == 1.0
    assert as_float("op", "x", math.inf, above=0) == math.inf  # (finite not asked)
    with pytest.raises(ValueError):
        as_float("op", "x", 0, above=0)


def test_as_max_norm_is_as_float_at_least_zero():
    assert as_max_norm("clip", math.inf) == math.inf and as_max_norm("clip", torch.tensor(2)) == 2.0
    with pytest.raises(ValueError, match=r"clip: argument 'max_norm' must be >= 0 \(inf: no clipping\), got nan"):
        as_max_norm("clip", math.nan)
    with pytest.raises(TypeError, match="clip: argument 'max_norm' must be a real number, got the bool"):
        as_max_norm("clip", torch.tensor(True))


def test_moe_router_numbers_refuse_bools():
    """coeff=True was a coefficient of 1.0, scaling_factor=True a factor of 1."""
    logits = torch.randn(4, 3)
    with pytest.raises(TypeError, match="moe_z_loss: argument 'coeff' must be a real number, got the bool"):
        moe.moe_z_loss(logits, True)
    with pytest.raises(TypeError, match="argument 'scaling_factor' must be a real number, got the bool"):
        moe.fused_topk_with_score_function(logits, 2, score_function="softmax", scaling_factor=True)


def test_te_ops_activation_numbers():
    """ClampedSwiGLU took np.float32 limits as 'not a number'; SiTUGLU's
    beta1='2' was a ValueError although it is no number at all."""
    op = te.ops.ClampedSwiGLU(limit=np.float32(3.0), alpha=torch.tensor(1.5))
    assert (op.limit, op.alpha) == (3.0, 1.5) and type(op.limit) is float
    with pytest.raises(TypeError, match="te.ops.ClampedSwiGLU: argument 'limit' must be a real number, got the bool"):
        te.ops.ClampedSwiGLU(limit=True)
    with pytest.raises(TypeError, match="te.ops.SiTUGLU: argument 'beta1' must be a real number"):
        te.ops.SiTUGLU(beta1="2")
    with pytest.raises(ValueError, match="te.ops.SiTUGLU: argument 'beta2' must be a finite number > 0, got inf"):
        te.ops.SiTUGLU(beta2=math.inf)


def test_multi_tensor_adam_step():
    p = torch.zeros(3)
    lists = [[torch.ones(3)], [p], [torch.zeros(3)], [torch.zeros(3)]]
    args = (2048, torch.zeros(1, dtype=torch.int32), lists, 1e-3, 0.9, 0.999, 1e-8)
    with pytest.raises(TypeError, match="multi_tensor_adam: argument 'step' must be a real number, got the bool"):
        multi_tensor_adam(*args, torch.tensor(True), 1, 1, 0.0)
    with pytest.raises(ValueError, match=r"multi_tensor_adam: argument 'step' must be >= 1 \(the 1-based count"):
        multi_tensor_adam(*args, torch.tensor(0), 1, 1, 0.0)
    assert torch.equal(p, torch.zeros(3))
    multi_tensor_adam(*args, torch.tensor(0), 1, 0, 0.0)  # (no bias correction: step 0 is fine)
    assert bool((p < 0).all())


# ---- te.CudaRNGStatesTracker ----------------------------------------------------------------------------------

def _tracker():
    t = te.CudaRNGStatesTracker()
    t.add("a", 11)
    return t


def _same_states(x, y):
    assert x.keys() == y.keys()
    for name in x:
        for s, r in zip(x[name], y[name]):
            assert (s is None and r is None) or torch.equal(s, r)


def test_rng_tracker_add_refuses_a_seed_that_is_no_integer():
    t = _tracker()
    with pytest.raises(TypeError, match=r"CudaRNGStatesTracker.add: argument 'seed' must be an integer .* got float"):
        t.add("b", 2.0)
    assert list(t.get_states()) == ["a"] and t.seeds_ == {11}


def test_rng_tracker_add_refuses_a_seed_outside_torchs_range():
    t = _tracker()
    with pytest.raises(ValueError, match=r"CudaRNGStatesTracker.add: argument 'seed' must be in \[-2\*\*63, 2\*\*64\), "
                                         r"got -9223372036854775809"):
        t.add("b", -(2 ** 63) - 1)
    assert list(t.get_states()) == ["a"]


def test_rng_tracker_add_refuses_a_seed_used_twice():
    """Two streams of one seed would draw the same numbers."""
    t = _tracker()
    before = t.get_states()
    with pytest.raises(ValueError, match="CudaRNGStatesTracker.add: seed 11 is already used by another stream"):
        t.add("b", 11)
    _same_states(t.get_states(), before)


def test_rng_tracker_add_refuses_a_name_twice():
    """Adding 'a' again would restart its stream; the refused seed stays free."""
    t = _tracker()
    with t.fork("a"):
        torch.rand(3)
    before = t.get_states()
    with pytest.raises(ValueError, match="CudaRNGStatesTracker.add: a stream named 'a' already exists"):
        t.add("a", 12)
    _same_states(t.get_states(), before)
    t.add("b", 12)  # (the refused call took no seed)


def test_rng_tracker_fork_refuses_an_unknown_name():
    t = _tracker()
    outside = torch.get_rng_state()
    with pytest.raises(KeyError, match="CudaRNGStatesTracker.fork: no stream named 'b' \\(add it first\\)"):
        with t.fork("b"):
            pass
    assert torch.equal(torch.get_rng_state(), outside)


def test_rng_tracker_set_states_refuses_what_is_no_mapping():
    t = _tracker()
    with pytest.raises(TypeError, match="CudaRNGStatesTracker.set_states: argument 'states' must be a mapping"):
        t.set_states(list(t.get_states().items()))


def test_rng_tracker_set_states_refuses_what_is_no_pair():
    t = _tracker()
    state = t.get_states()["a"]
    with pytest.raises(ValueError, match=r"states\['b'\] must be a \(cpu state, cuda state or None\) pair .* "
                                         r"got tuple of 3 items"):
        t.set_states({"a": state, "b": (*state, None)})
    assert list(t.get_states()) == ["a"]  # nothing changed


def test_rng_tracker_set_states_refuses_a_pair_of_nones():
    """(None, None) was kept and a fork of it drew from the caller's stream."""
    t = _tracker()
    with pytest.raises(ValueError, match=r"set_states: states\['b'\] holds no generator state \(both are None\)"):
        t.set_states({"b": (None, None)})
    assert list(t.get_states()) == ["a"]


def test_rng_tracker_set_states_refuses_a_state_that_is_no_1d_uint8_tensor():
    t = _tracker()
    cpu, cuda = t.get_states()["a"]
    with pytest.raises(ValueError, match=r"states\['b'\]: the CPU generator state must be a 1-D torch.uint8 tensor "
                                         r"\(as get_rng_state returns it\), got torch.uint8 of shape \(1, "):
        t.set_states({"b": (cpu[None], cuda)})


def test_rng_tracker_set_states_refuses_a_state_of_another_size():
    t = _tracker()
    cpu, cuda = t.get_states()["a"]
    with pytest.raises(ValueError, match=rf"states\['b'\]: the CPU generator state has {cpu.numel() - 1} bytes, "
                                         rf"this machine's has {cpu.numel()}"):
        t.set_states({"b": (cpu[1:], cuda)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA state where there is no CUDA")
def test_rng_tracker_set_states_refuses_te_s_cuda_state_without_cuda():
    t = _tracker()
    with pytest.raises(ValueError, match=r"states\['b'\] is a single tensor, Transformer Engine's CUDA generator "
                                         r"state, but CUDA is not available here"):
        t.set_states({"b": torch.zeros(16, dtype=torch.uint8)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CUDA state where there is no CUDA")
def test_rng_tracker_set_states_refuses_a_cuda_state_without_cuda():
    t = _tracker()
    with pytest.raises(ValueError, match=r"states\['b'\] holds a CUDA generator state but CUDA is not available"):
        t.set_states({"b": (torch.get_rng_state(), torch.zeros(16, dtype=torch.uint8))})


@pytest.mark.cuda
def test_rng_tracker_set_states_refuses_a_stream_without_cuda_state_where_cuda_is():
    """A stream saved without CUDA would fork the CPU generator only: the
    modules' CUDA draws would come from the default stream."""
    t = _tracker()
    with pytest.raises(ValueError, match=r"states\['b'\] has no CUDA generator state \(saved where CUDA was not "
                                         r"available\) but this machine has CUDA"):
        t.set_states({"b": (torch.get_rng_state(), None)})


# ---- pad_thd_sequences_for_cp -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ids", [list(range(7)), np.arange(7)])
def test_pad_thd_refuses_input_ids_that_are_no_tensor(ids):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(TypeError, match="pad_thd_sequences_for_cp: input_ids must be a torch.Tensor, got"):
        pad_thd_sequences_for_cp(ids, None, cu, 2)


@pytest.mark.parametrize("shape", [(2, 6), (1, 2, 6), ()])
def test_pad_thd_refuses_input_ids_that_are_not_packed(shape):
    """[2, 6] tokens with cu_seqlens over the 12 came back [1, 16]: the rows
    merged into one, silently."""
    ids = torch.arange(12).reshape(shape) if shape else torch.tensor(5)
    cu = torch.tensor([0, 6, 12] if shape else [0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"pad_thd_sequences_for_cp: input_ids must be packed, \[t\] or \[1, t\], "
                                         + re.escape(f"got {tuple(ids.shape)}")):
        pad_thd_sequences_for_cp(ids, None, cu, 2)
    # the packed forms as before
    out, _, cu_p = pad_thd_sequences_for_cp(torch.arange(12)[None], None, torch.tensor([0, 6, 12]), 2)
    assert out.shape == (1, 16) and cu_p.tolist() == [0, 8, 16]


# ---- generate: the key/value cache on the model's device ---------------------------------------------------------

@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers")
    from seqfuse.hf.llama_convert import from_hf_model
    from test_hf_llama import batch, hf_model

    _, seqs = batch((12, 9, 5), seed=30)
    return from_hf_model(hf_model(seed=30, tie=True)).eval(), seqs[0][None]


def _cache(model, device):
    from seqfuse.hf.generation import InferenceParams

    cfg = model.config
    return InferenceParams(1, 64, cfg.num_key_value_heads, cfg.head_dim, dtype=model.model.embed_tokens.weight.dtype,
                           device=device)


def test_generate_refuses_a_cache_on_another_device(llama):
    """(A meta cache: another device on any machine.)"""
    model, prompt = llama
    with pytest.raises(ValueError, match="generate: inference_params is on meta, input_ids on cpu "
                                         r"\(they must be on one device\)"):
        model.generate(prompt, max_new_tokens=2, inference_params=_cache(model, "meta"))
    assert model.generate(prompt, max_new_tokens=2, inference_params=_cache(model, "cpu")).shape == (1, 2)


@pytest.mark.cuda
def test_generate_refuses_a_cuda_cache_for_a_cpu_model(llama):
    model, prompt = llama
    with pytest.raises(ValueError, match="generate: inference_params is on cuda:0, input_ids on cpu"):
        model.generate(prompt, max_new_tokens=2, inference_params=_cache(model, "cuda:0"))


def test_generate_reads_one_element_tensors_as_sampling_numbers(llama):
    model, prompt = llama
    kw = dict(max_new_tokens=3, do_sample=True)
    a = model.generate(prompt, temperature=torch.tensor(0.7), top_p=torch.tensor(0.9),
                       generator=torch.Generator().manual_seed(3), **kw)
    b = model.generate(prompt, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match="generate: argument 'temperature' must be a real number, got the bool"):
        model.generate(prompt, temperature=torch.tensor(True), **kw)


@pytest.mark.parametrize("kw, rule", [({"limit": float("nan")}, "> 0"), ({"limit": 0.0}, "> 0"),
                                      ({"limit": -7.0}, "> 0"), ({"alpha": float("nan")}, "finite"),
                                      ({"alpha": float("inf")}, "finite"),
                                      ({"glu_linear_offset": float("nan")}, "finite")])
def test_clamped_swiglu_refuses_numbers_that_make_nan_or_flip_the_clamp(kw, rule):
    # a NaN limit or alpha made every output NaN; a limit <= 0 clamped b into an empty range
    (name,) = kw
    with pytest.raises(ValueError, match=rf"ClampedSwiGLU: argument '{name}' must be .*{re.escape(rule)}"):
        te.ops.ClampedSwiGLU(**kw)


def test_clamped_swiglu_takes_an_infinite_limit_as_no_clamp():
    x = torch.randn(3, 8, dtype=torch.float64) * 20
    a, b = x.chunk(2, dim=-1)
    want = a * torch.sigmoid(1.702 * a) * (b + 1.0)
    torch.testing.assert_close(te.ops.ClampedSwiGLU(limit=float("inf"))(x), want)


@pytest.mark.parametrize("value", [2.5, np.float64(2.5), torch.tensor(2.5), fractions.Fraction(5, 2)])
def test_as_float_plain_float_path_equals_the_general_one(value):
    # a plain Python float skips the type questions (the hot path); every other kind is read alike
    got = as_float("op", "x", value)
    assert got == 2.5 and type(got) is float
    with pytest.raises(ValueError, match="argument 'x' must be a finite number"):
        as_float("op", "x", value * math.inf, finite=True)
    with pytest.raises(ValueError, match="argument 'x' must be >= 3"):
        as_float("op", "x", value, minimum=3)


def test_generate_refuses_input_ids_on_another_device_than_the_model(llama):
    """(Meta prompts: another device on any machine; torch's embedding error named neither side.)"""
    model, prompt = llama
    with pytest.raises(ValueError, match=r"generate: input_ids are on meta, the model on cpu \(move the prompts "
                                         r"with input_ids.to\('cpu'\)\)"):
        model.generate(prompt.to("meta"), max_new_tokens=2)
