"""seqfuse.distributed.end_process_group: a no-op without a group; with one,
the group is gone afterwards (with and without the barrier)."""

import torch.distributed as dist

from seqfuse.distributed import end_process_group

from helpers import free_port


def test_end_process_group_without_a_group_is_a_no_op():
    assert not dist.is_initialized()
    end_process_group()
    end_process_group(ok=False)
    assert not dist.is_initialized()


def test_end_process_group_destroys_the_group(monkeypatch):
    """ok=True waits for the other ranks (a barrier), ok=False does not (a
    failed rank must not hang on ranks that will never arrive)."""
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: (barriers.append(1), real_barrier(*a, **k)))
    for ok in (True, False):
        barriers.clear()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        assert dist.is_initialized()
        end_process_group(ok)
        assert not dist.is_initialized()
        assert len(barriers) == (1 if ok else 0)
