"""transformer_engine's import paths served by seqfuse's TE-named modules, for
CPU tests of the peer benchmarks' Transformer Engine code (benchmarks/peers):
seqfuse.pytorch spells Transformer Engine's PyTorch API (module names,
arguments, parameter names, autocast and recipes), so code written against
transformer_engine.pytorch runs on it.  ``install(monkeypatch)`` puts the
modules into sys.modules for one test."""
import sys
import types


def install(monkeypatch):
    import seqfuse.pytorch as sfp
    from seqfuse.common import recipe as sfr
    from seqfuse.modules.rope import RotaryPositionEmbedding

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    common = mod("transformer_engine.common", recipe=sfr)
    mod("transformer_engine", pytorch=sfp, common=common)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", sfp)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", sfr)
    mod("transformer_engine.pytorch.attention")
    mod("transformer_engine.pytorch.attention.rope", RotaryPositionEmbedding=RotaryPositionEmbedding)
