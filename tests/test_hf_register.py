"""seqfuse.hf's families are registered with transformers' Auto classes
(pretrained.register_auto), and registering again (a module reloaded) keeps
the registration instead of raising."""
import pytest

transformers = pytest.importorskip("transformers")

from seqfuse.hf import esm, llama, mixtral  # noqa: E402
from seqfuse.hf.pretrained import register_auto  # noqa: E402


@pytest.mark.parametrize("module,config,auto,cls", [
    (esm, "SeqfuseEsmConfig", transformers.AutoModelForMaskedLM, "SeqfuseEsmForMaskedLM"),
    (llama, "SeqfuseLlamaConfig", transformers.AutoModelForCausalLM, "SeqfuseLlamaForCausalLM"),
    (mixtral, "SeqfuseMixtralConfig", transformers.AutoModelForCausalLM, "SeqfuseMixtralForCausalLM"),
])
def test_families_resolve_through_auto_classes(module, config, auto, cls):
    config_cls, model_cls = getattr(module, config), getattr(module, cls)
    assert auto._model_mapping[config_cls] is model_cls
    register_auto(config_cls, (auto, model_cls))  # again (as a reloaded module does): no error, same class
    assert auto._model_mapping[config_cls] is model_cls
