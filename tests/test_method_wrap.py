"""seqfuse.hf.method_wrap: wrapped_with is the one test of "wrapped
already?" that every seqfuse.hf wrapper uses, and with it wrapping twice is
a no-op: wrap_method_once on a plain module (equal arguments keep the one
wrapper, other arguments wrap around it, a wrapper of ours under someone
else's is found, a deepcopy keeps the mark), wrap_function's mark, and each
of accelerate()'s wrappers after a second accelerate(): the autocast forward
(equal recipe; another recipe is refused), the labels forward, the checkpointing setter, the
derived-positions mark and transformers' packed-sequence shortcut."""
import copy
import functools

import pytest
import torch
from torch import nn

from seqfuse.hf.method_wrap import MethodWrapper, wrap_function, wrap_method_once, wrapped_with


def makers(fn):
    """The makers' names along a method's wrapper chain, outermost first."""
    out = []
    while isinstance(fn, MethodWrapper):
        out.append(fn.make.__name__)
        fn = fn.previous
    return out


def _plus(inner, k):
    def forward(self, x):
        return inner(self, x) + k

    return forward


def _times(inner):
    def forward(self, x):
        return inner(self, x) * 2

    return forward


class Net(nn.Module):
    def forward(self, x):
        return x


def test_wrap_method_once_wraps_once_per_maker_and_equal_arguments():
    net = Net()
    assert not wrapped_with(net.__dict__.get("forward"), _plus)
    assert wrap_method_once(net, "forward", _plus, 1)
    assert not wrap_method_once(net, "forward", _plus, 1)  # equal arguments: the one wrapper stays
    assert net(torch.tensor(0)).item() == 1
    assert wrap_method_once(net, "forward", _times)
    assert not wrap_method_once(net, "forward", _plus, 1)  # found below the other maker's wrapper
    assert not wrap_method_once(net, "forward", _times)
    assert makers(net.__dict__["forward"]) == ["_times", "_plus"]
    assert net(torch.tensor(0)).item() == 2
    assert wrap_method_once(net, "forward", _plus, 5)  # other arguments: wrapped around
    assert makers(net.__dict__["forward"]) == ["_plus", "_times", "_plus"]
    assert net(torch.tensor(0)).item() == 7
    assert wrapped_with(net.__dict__["forward"], _plus)  # no arguments given: any _plus wrapper


def test_a_deepcopy_and_a_foreign_wrapper_keep_the_mark():
    net = Net()
    wrap_method_once(net, "forward", _plus, 1)
    c = copy.deepcopy(net)
    assert not wrap_method_once(c, "forward", _plus, 1)
    assert c(torch.tensor(0)).item() == 1

    ours = net.__dict__["forward"]

    @functools.wraps(ours)
    def theirs(x):  # someone else's wrapper around ours, naming it as __wrapped__
        return ours(x) * 10

    net.forward = theirs
    assert not wrap_method_once(net, "forward", _plus, 1)
    assert net(torch.tensor(0)).item() == 10


def test_wrap_function_is_marked_once():
    def original(x):
        """the original's doc"""
        return x + 1

    def shout(inner):
        def f(x):
            return inner(x) * 3

        return f

    f = wrap_function(original, shout)
    assert f(1) == 6 and f.__wrapped__ is original and f.__doc__ == original.__doc__
    assert wrapped_with(f, shout) and not wrapped_with(original, shout)
    assert not wrapped_with(f, _plus)


# accelerate()'s wrappers, each after a second accelerate()

transformers = pytest.importorskip("transformers")
masking_utils = pytest.importorskip("transformers.masking_utils")

from seqfuse.common.recipe import DelayedScaling  # noqa: E402
from seqfuse.hf import accelerate  # noqa: E402
from seqfuse.quantization import get_recipe, is_fp8_enabled  # noqa: E402


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).train()


def _loss(model):
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids, labels=ids).loss


def test_accelerate_twice_keeps_one_of_each_wrapper():
    once, twice = _llama(), _llama()
    accelerate(once, recipe=DelayedScaling())
    accelerate(twice, recipe=DelayedScaling())
    chains = [makers(twice.__dict__["forward"]), makers(twice.__dict__["_set_gradient_checkpointing"]),
              makers(twice.model.__dict__["forward"])]
    assert chains == [["_autocast_forward", "_labels_forward"], ["_checkpointing_setter"], ["_positions_forward"]]
    shortcut = masking_utils.find_packed_sequence_indices
    accelerate(twice, recipe=DelayedScaling())  # an equal recipe
    assert [makers(twice.__dict__["forward"]), makers(twice.__dict__["_set_gradient_checkpointing"]),
            makers(twice.model.__dict__["forward"])] == chains
    assert masking_utils.find_packed_sequence_indices is shortcut
    twice.gradient_checkpointing_enable()  # through the one setter wrapper
    assert all(layer.gradient_checkpointing for layer in twice.model.layers)
    twice.gradient_checkpointing_disable()
    assert torch.equal(_loss(once), _loss(twice))


def test_a_second_accelerate_without_recipe_keeps_fp8_in_labels_calls():
    """The labels wrapper stays inside the first call's autocast wrapper (a
    second labels wrapper outside it would run the base model outside autocast)."""
    model = _llama()
    accelerate(model, recipe=DelayedScaling())
    accelerate(model)
    seen = []
    model.model.norm.register_forward_hook(lambda *_: seen.append(is_fp8_enabled()))
    _loss(model)
    assert seen == [True]


def test_another_recipe_is_refused_and_the_first_stays():
    """A second accelerate() with a different recipe is refused by name (the
    first call's wrappers and swaps were made for its recipe, and a second
    call undoes nothing); the model's calls, labels calls included, keep
    running under the first recipe."""
    model = _llama()
    first = DelayedScaling()
    accelerate(model, recipe=first)
    with pytest.raises(ValueError, match=r"accelerate: argument 'recipe' is DelayedScaling\(.*margin=1.*an earlier "
                                         r"accelerate\(\) of this model set DelayedScaling\("):
        accelerate(model, recipe=DelayedScaling(margin=1))
    assert makers(model.__dict__["forward"]) == ["_autocast_forward", "_labels_forward"]
    assert accelerate(model).recipe is first  # recipe=None keeps it
    seen = []
    model.model.norm.register_forward_hook(lambda *_: seen.append(get_recipe()))
    _loss(model)
    assert seen == [first]


def test_the_packed_sequence_shortcut_is_installed_once(monkeypatch):
    import seqfuse.hf.positions as positions

    accelerate(_llama())
    shortcut = masking_utils.find_packed_sequence_indices
    assert wrapped_with(shortcut, positions._mask_shortcut)
    monkeypatch.setattr(positions, "_said", set())  # as in a fresh process: the shortcut stays single
    positions.install_mask_shortcut()
    assert masking_utils.find_packed_sequence_indices is shortcut
    assert not wrapped_with(shortcut.__wrapped__, positions._mask_shortcut)
