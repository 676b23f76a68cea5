"""Shared test setup: the `cuda` marker skips where no GPU can be used, and
helpers for tolerances by dtype and poisoned outputs."""
import pytest
import torch

import seqfuse


def pytest_collection_modifyitems(config, items):
    if seqfuse.cuda_available() and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of seqfuse")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed per test run, printed so a failure can be replayed."""
    import os
    import random

    s = int(os.environ.get("SEQFUSE_TEST_SEED", random.randrange(2**31)))
    print(f"seed={s}")
    torch.manual_seed(s)
    return s
