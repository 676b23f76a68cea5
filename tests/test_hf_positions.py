"""seqfuse.hf.positions: inside an accelerated decoder's forward called
without position_ids, the packed-sequence tests (transformers' and
seqfuse's attention's) answer "not packed" without reading the device,
and nowhere else: given positions, packed or not, and calls outside an
accelerated forward keep the original tests and their answers; the loss
is the same bits as with the same positions passed explicitly."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

import seqfuse.hf.attention as sf_attention  # noqa: E402
from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.hf.positions import derived_positions  # noqa: E402

V = 96


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    report = accelerate(model)
    assert len(report.fused) == 2
    return model


def _marks(model):
    """The derived-positions flag each layer saw in the last forward."""
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a: seen.append(derived_positions()))
    return seen


def _ids(n=24, seed=1):
    return torch.randint(1, V, (1, n), generator=torch.Generator().manual_seed(seed))


def test_derived_positions_skip_both_tests_and_give_the_same_loss(monkeypatch):
    model = _model()
    seen = _marks(model)
    ids = _ids()
    explicit = model(input_ids=ids, labels=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).loss
    assert seen == [False, False]

    def no_read(*a, **k):
        raise AssertionError("a packed-sequence test read the device")

    monkeypatch.setattr(sf_attention, "_is_packed_cached", no_read)
    shortcut, calls = masking_utils.find_packed_sequence_indices, []

    def spy(position_ids):  # transformers' call: the flag is up, the answer None
        calls.append((derived_positions(), shortcut(position_ids)))
        return calls[-1][1]

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    seen.clear()
    derived = model(input_ids=ids, labels=ids, use_cache=False).loss  # no cache: transformers runs its test
    assert seen == [True, True]
    assert calls == [(True, None)]
    assert torch.equal(derived, explicit)
    assert not derived_positions()  # reset after the call


def test_given_packed_positions_keep_the_tests():
    model = _model()
    seen = _marks(model)
    ids = _ids()
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    packed = model(input_ids=ids, labels=ids, position_ids=pos, use_cache=False).loss  # both tests run
    assert seen == [False, False]
    # the same two sequences run separately: packed attention must not cross them
    a = model(input_ids=ids[:, :10], position_ids=pos[:, :10]).logits
    b = model(input_ids=ids[:, 10:], position_ids=pos[:, 10:]).logits
    whole = model(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(whole, torch.cat([a, b], 1), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(packed)


def test_transformers_test_is_unchanged_outside_accelerated_forwards():
    _model()  # installs the shortcut
    f = masking_utils.find_packed_sequence_indices
    assert f.__wrapped__ is not None
    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert torch.equal(f(packed), torch.tensor([[0, 0, 0, 1, 1]]))
    assert f(torch.arange(5)[None]) is None


def test_packed_positions_built_above_the_decoder_keep_the_tests():
    class Packer(torch.nn.Module):  # takes no positions, passes packed ones down
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, position_ids=None):
            pos = torch.cat([torch.arange(10), torch.arange(input_ids.shape[1] - 10)])[None]
            return self.lm(input_ids=input_ids, position_ids=pos).logits

    wrapper = Packer(_model())  # the marked forward is the decoder's (LlamaModel), below the packer
    seen = _marks(wrapper.lm)
    ids = _ids()
    whole = wrapper(ids)
    assert seen == [False, False]
    a = wrapper.lm(input_ids=ids[:, :10]).logits
    b = wrapper.lm(input_ids=ids[:, 10:]).logits
    torch.testing.assert_close(whole, torch.cat([a, b], 1), rtol=1e-4, atol=1e-4)


def test_positions_passed_positionally_count_as_given():
    """The mark reads position_ids however it is passed: positionally given
    positions keep the tests (flag down), a positional None derives them."""
    model = _model()
    seen = _marks(model)
    ids = _ids()
    pos = torch.arange(ids.shape[1])[None]
    model.model(ids, None, pos)  # (input_ids, attention_mask, position_ids)
    assert seen == [False, False]
    seen.clear()
    model.model(ids, None, None)
    assert seen == [True, True]
    assert not derived_positions()


@pytest.mark.parametrize("given", [False, True])
def test_the_recompute_of_gradient_checkpointing_keeps_the_mark(monkeypatch, given):
    """Under transformers' gradient checkpointing the layers' recompute (in
    the backward) sees the flag their forward saw: derived positions run
    seqfuse's packed-sequence test in neither (given ones in both), and the
    loss and gradients equal those of the run without checkpointing."""
    seen, tests = [], []  # the flag each attention call saw; the packed-sequence tests run
    real_flag, real_test = sf_attention.derived_positions, sf_attention._is_packed_cached
    monkeypatch.setattr(sf_attention, "derived_positions", lambda: seen.append(real_flag()) or seen[-1])
    monkeypatch.setattr(sf_attention, "_is_packed_cached", lambda *a: tests.append(1) or real_test(*a))
    runs = []
    for ck in (False, True):
        model = _model().train()
        if ck:
            model.gradient_checkpointing_enable()
        seen.clear()
        tests.clear()
        ids = _ids()
        pos = {"position_ids": torch.arange(ids.shape[1])[None]} if given else {}
        loss = model(input_ids=ids, labels=ids, use_cache=False, **pos).loss
        assert seen == [not given] * 2 and len(tests) == (2 if given else 0)
        loss.backward()
        calls = 4 if ck else 2  # the recompute runs each layer's attention again
        assert seen == [not given] * calls and len(tests) == (calls if given else 0)
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_transformers_without_the_test_is_said_once_and_left_alone(monkeypatch, caplog):
    import logging

    import seqfuse.hf.positions as positions

    monkeypatch.setattr(positions, "_said", set())
    monkeypatch.delattr(masking_utils, "find_packed_sequence_indices")
    with caplog.at_level(logging.INFO, logger="seqfuse"):
        first = positions.install_mask_shortcut()
        again = positions.install_mask_shortcut()
    assert "no masking_utils.find_packed_sequence_indices" in first and again == first
    assert not hasattr(masking_utils, "find_packed_sequence_indices")
    assert sum("find_packed_sequence_indices" in r.getMessage() for r in caplog.records) == 1
