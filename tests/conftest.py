"""Shared test setup: the `cuda` marker skips where no GPU can be used, and
helpers for tolerances by dtype and poisoned outputs."""
import os

import pytest
import torch

import seqfuse


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: the count is of the tests that would run
def pytest_collection_modifyitems(config, items):
    """SEQFUSE_TEST_SAMPLE=N keeps every N-th test of each file that holds
    more than 100 (a GPU call that cannot afford the thousands of attention
    cases runs an even sample of them); the rest are reported as deselected.
    Then the `cuda` marker's skip where no GPU can be used."""
    sample(config, items)
    skip_cuda_without_gpu(items)


def sample(config, items):
    value = os.environ.get("SEQFUSE_TEST_SAMPLE", "1")
    try:
        n = int(value)
    except ValueError:
        raise pytest.UsageError(f"SEQFUSE_TEST_SAMPLE must be a positive integer, got {value!r}") from None
    if n < 1:
        raise pytest.UsageError(f"SEQFUSE_TEST_SAMPLE must be a positive integer, got {value!r}")
    if n == 1:
        return
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    dropped = {id(item) for group in by_file.values() if len(group) > 100
               for i, item in enumerate(group) if i % n}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
        items[:] = [item for item in items if id(item) not in dropped]


def skip_cuda_without_gpu(items):
    if seqfuse.cuda_available() and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of seqfuse")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run, printed so a failure can be replayed."""
    import random

    s = int(os.environ.get("SEQFUSE_TEST_SEED", random.randrange(2**31)))
    print(f"seed={s}")
    torch.manual_seed(s)
    return s


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's scaled_dot_product_attention during the test:
    a list of (args, kwargs, out)."""
    import torch.nn.functional as F

    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.fixture
def cudnn_calls(monkeypatch):
    """Every call of torch's cuDNN op by the cuDNN route
    (_routing._cudnn_attention, way "op") and every call of SDPA (way
    "sdpa": the cuDNN route's SDPA path, or the torch_fp32 route's) during
    the test: a list of ((q, k, v), kwargs, way), kwargs SDPA's for the
    call: dropout_p (0.0 where SDPA was given none), is_causal, scale, and
    enable_gqa where k has fewer heads than q."""
    import torch.nn.functional as F
    from seqfuse.ops.attn import _routing as routing

    calls = []
    real_op, real_sdpa = routing._cudnn_attention, F.scaled_dot_product_attention

    def op(*args, **kwargs):
        q, k, v, _, _, dropout_p, is_causal, _ = args
        sdpa_kwargs = dict(dropout_p=dropout_p, is_causal=is_causal, scale=kwargs.get("scale"))
        if q.shape[1] != k.shape[1]:
            sdpa_kwargs["enable_gqa"] = True
        calls.append(((q, k, v), sdpa_kwargs, "op"))
        return real_op(*args, **kwargs)

    def sdpa(*args, **kwargs):
        calls.append((args[:3], {"dropout_p": 0.0, **kwargs}, "sdpa"))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(routing, "_cudnn_attention", op)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls
