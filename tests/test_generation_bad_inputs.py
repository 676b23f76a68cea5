"""Bad inputs to seqfuse's key/value-cached generate (seqfuse.hf.generation)
on a tiny CPU Llama: each is a clear exception naming the argument and the
rule, not a crash deep inside (IndexError, a shape mismatch) nor a silently
wrong answer (an empty packed prompt answered from its neighbour's last
token, an eos id that can never stop a row, a truthy string taken for
do_sample=True)."""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from seqfuse.hf.generation import InferenceParams  # noqa: E402
from seqfuse.hf.llama_convert import from_hf_model  # noqa: E402
from test_hf_llama import VOCAB, batch, hf_model  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return from_hf_model(hf_model(seed=30, tie=True)).eval()


@pytest.fixture(scope="module")
def prompt():
    _, seqs = batch((12, 9, 5), seed=30)
    return seqs[0][None]


def test_input_ids_outside_the_vocabulary(model, prompt):
    for bad in (prompt + VOCAB, prompt - VOCAB):
        with pytest.raises(ValueError, match=r"input_ids must be token ids in \[0, vocab_size=16\)"):
            model.generate(bad, max_new_tokens=2)


def test_empty_batch(model, prompt):
    with pytest.raises(ValueError, match="input_ids must hold at least one prompt"):
        model.generate(prompt[:0], max_new_tokens=2)


@pytest.mark.parametrize("bounds", [[0, 5, 5, 12], [0, 5, 3, 12], [0, 5], [2, 12], [0, 12, 14]])
def test_packed_cu_seqlens_bounds(model, prompt, bounds):
    """An empty packed prompt ([0, 5, 5, 12]) was answered with tokens
    continuing the previous prompt's last token; cu_seqlens that fall or do
    not cover the tokens were torch errors (repeat counts, shape mismatch)."""
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, rise strictly"):
        model.generate(prompt[0], cu_seqlens=torch.tensor(bounds, dtype=torch.int32), max_new_tokens=2,
                       eos_token_id=[])


def test_do_sample_must_be_a_bool(model, prompt):
    with pytest.raises(TypeError, match="do_sample must be True or False"):
        model.generate(prompt, max_new_tokens=2, do_sample="no")
    # ints 0 / 1 are still the bools they equal
    assert torch.equal(model.generate(prompt, max_new_tokens=2, do_sample=0, eos_token_id=[]),
                       model.generate(prompt, max_new_tokens=2, eos_token_id=[]))


def test_sampling_numbers(model, prompt):
    kw = dict(max_new_tokens=2, do_sample=True)
    with pytest.raises(TypeError, match="generate: argument 'temperature' must be a real number, got '0.7'"):
        model.generate(prompt, temperature="0.7", **kw)
    with pytest.raises(ValueError, match=r"generate: argument 'temperature' must be > 0, got 0.0"):
        model.generate(prompt, temperature=0, **kw)
    with pytest.raises(TypeError, match="generate: argument 'top_p' must be a real number, got the bool True"):
        model.generate(prompt, top_p=True, **kw)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"generate: argument 'top_p' must be in \(0, 1\], got"):
            model.generate(prompt, top_p=bad, **kw)


@pytest.mark.parametrize("eos", [VOCAB, -1, [3, 1000]])
def test_eos_outside_the_vocabulary(model, prompt, eos):
    with pytest.raises(ValueError, match=r"eos_token_id must be token ids in \[0, vocab_size=16\)"):
        model.generate(prompt, max_new_tokens=2, eos_token_id=eos)


@pytest.mark.parametrize("eos", [2.0, "2", True, torch.tensor([2.0])])
def test_eos_of_the_wrong_kind(model, prompt, eos):
    with pytest.raises(TypeError, match="eos_token_id must be an int"):
        model.generate(prompt, max_new_tokens=2, eos_token_id=eos)


def test_eos_as_an_integer_tensor(model, prompt):
    free = model.generate(prompt, max_new_tokens=6, eos_token_id=[])
    eos = int(free[0, 1])
    want = model.generate(prompt, max_new_tokens=6, eos_token_id=eos, pad_token_id=15)
    for t in (torch.tensor(eos), torch.tensor([eos])):
        assert torch.equal(model.generate(prompt, max_new_tokens=6, eos_token_id=t, pad_token_id=15), want)


def test_pad_token_id_must_be_an_int(model, prompt):
    with pytest.raises(TypeError, match="pad_token_id must be an int"):
        model.generate(prompt, max_new_tokens=2, pad_token_id=2.5)


def test_counts_are_positive_integers_of_any_kind(model, prompt):
    """max_new_tokens and top_k are read as integers of any kind (numpy's, a
    one-element integer tensor: the same tokens as the int), and refused
    naming themselves when not whole numbers (a bool, a float) or below 1."""
    kw = dict(eos_token_id=[])
    want = model.generate(prompt, max_new_tokens=3, **kw)
    for n in (np.int64(3), torch.tensor(3)):
        assert torch.equal(model.generate(prompt, max_new_tokens=n, **kw), want)
    for bad in (3.0, True, "3", None):
        with pytest.raises(TypeError, match=r"generate: max_new_tokens must be an int, got"):
            model.generate(prompt, max_new_tokens=bad, **kw)
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"generate: max_new_tokens must be >= 1, got {bad}"):
            model.generate(prompt, max_new_tokens=bad, **kw)
    gen = dict(max_new_tokens=3, do_sample=True, **kw)
    torch.manual_seed(5)
    sampled = model.generate(prompt, top_k=4, generator=torch.Generator().manual_seed(7), **gen)
    assert torch.equal(model.generate(prompt, top_k=np.int32(4), generator=torch.Generator().manual_seed(7), **gen),
                       sampled)
    for bad in (1.5, False):
        with pytest.raises(TypeError, match=r"generate: top_k must be an int, got"):
            model.generate(prompt, top_k=bad, **gen)
    with pytest.raises(ValueError, match=r"generate: top_k must be >= 1, got 0"):
        model.generate(prompt, top_k=0, **gen)


def test_inference_params_must_match_the_model(model, prompt):
    kw = dict(max_new_tokens=2, eos_token_id=[])
    with pytest.raises(TypeError, match="inference_params must be an InferenceParams"):
        model.generate(prompt, inference_params={}, **kw)
    for heads, dim in ((3, 16), (2, 8)):
        with pytest.raises(ValueError, match="num_heads_kv and head_dim_k must match"):
            model.generate(prompt, inference_params=InferenceParams(1, 64, heads, dim, dtype=torch.float32), **kw)
    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(ValueError, match="inference_params' dtype"):
            model.generate(prompt, inference_params=InferenceParams(1, 64, 2, 16, dtype=dtype), **kw)
    # a matching cache reused across batch sizes gives a fresh cache's tokens
    cache = InferenceParams(4, 64, 2, 16, dtype=torch.float32)
    b, _ = batch((12, 9, 5), seed=30)
    model.generate(b["input_ids"], attention_mask=b["attention_mask"], inference_params=cache, **kw)
    assert torch.equal(model.generate(prompt, inference_params=cache, **kw), model.generate(prompt, **kw))
