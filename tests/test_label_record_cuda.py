"""The deferred cross-entropy label check on the GPU (`cuda` marker): the
forward kernel's record in pinned host memory (csrc/loss/cross_entropy_cuda.cu,
python/seqfuse/ops/pending_errors.py).

- a bad label gives NaN loss rows and no error, and no host synchronization,
  at the call; the ValueError (argument, value, row, rule) comes at the
  backward when the kernel has finished, else at the next loss call or at
  check_pending_errors(), which waits;
- "sync" raises at the call; "off" records nothing;
- linear_cross_entropy's chunks name the whole label tensor's row;
- under CUDA graph capture the kernel records on every replay and the host
  raises after it;
- a record that is not pinned memory is refused by name.
"""
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse import _C, ops
from seqfuse.modules.cross_entropy import linear_cross_entropy
from seqfuse.ops import device_checks as checks
from seqfuse.ops import pending_errors as pe
from helpers import no_host_sync

pytestmark = pytest.mark.cuda

RULE = r"argument 'labels' holds {value} at row {row}, outside \[0, {v}\) and not ignore_index -100"


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts and ends with no pending error and the default mode."""
    previous = checks.set_label_checks("deferred")
    try:
        ops.check_pending_errors()
    except ValueError:
        pass
    yield
    checks.set_label_checks(previous)
    try:
        ops.check_pending_errors()
    except ValueError:
        pass


def _data(n, v, bad_rows, value, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, v, device="cuda", generator=g)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::5] = -100
    for r in bad_rows:
        labels[r] = value
    return logits, labels


@pytest.mark.parametrize("v", [10, 16, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bad_label_is_nan_at_the_call_and_raised_at_the_backward(v, dtype):
    logits, labels = _data(64, v, [37], v + 3)
    logits = logits.to(dtype).requires_grad_()
    te.CrossEntropyLoss()(logits.detach(), labels.clamp(0, v - 1))  # warm-up: the device's sink exists
    with no_host_sync():  # the call must not wait for the GPU
        loss = te.CrossEntropyLoss(reduction="none")(logits, labels)
    bad = torch.zeros(64, dtype=torch.bool, device="cuda")
    bad[37] = True
    assert loss[bad].isnan().all() and torch.isfinite(loss[~bad]).all()
    torch.cuda.synchronize()  # the forward kernel has finished: the backward sees its record
    with pytest.raises(ValueError, match=RULE.format(value=v + 3, row=37, v=v) + r" \(found by the deferred"):
        loss.sum().backward()


def test_negative_label_in_a_3d_batch_names_the_flat_row():
    logits, labels = _data(2 * 8, 100, [11], -7)
    torch.cuda.synchronize()
    loss = te.CrossEntropyLoss()(logits.view(2, 8, 100), labels.view(2, 8))
    with pytest.raises(ValueError, match=RULE.format(value=-7, row=11, v=100)):
        ops.check_pending_errors()
    assert loss.isnan()


def test_unfinished_kernel_is_raised_later_not_waited_for():
    logits, labels = _data(64, 1000, [5, 50], 5000)
    logits.requires_grad_()
    # warm-up: the first loss call in a process loads its kernel and makes the sink (pinned memory),
    # which may wait for the GPU; the claim is about the calls after it
    te.CrossEntropyLoss()(logits.detach(), labels.clamp(0, 999))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))  # keeps the GPU busy: the forward kernel runs well after the backward is queued
    loss = te.CrossEntropyLoss()(logits, labels)
    loss.backward()  # not finished yet: no error, no wait (the gradients of the bad rows are NaN)
    with pytest.raises(ValueError, match=r"cross_entropy_forward: argument 'labels' holds 5000 at row (5|50), "):
        ops.check_pending_errors()  # waits, then raises; one error for both rows
    assert logits.grad[[5, 50]].isnan().all()
    ops.check_pending_errors()  # cleared


def test_the_next_call_raises_and_the_one_after_runs():
    logits, labels = _data(32, 64, [3], 64)
    ops.cross_entropy_forward(logits, labels)
    torch.cuda.synchronize()
    good = labels.clamp(min=0, max=63)
    with pytest.raises(ValueError, match=RULE.format(value=64, row=3, v=64)):
        ops.cross_entropy_forward(logits, good)
    loss, _ = ops.cross_entropy_forward(logits, good)
    torch.cuda.synchronize()
    assert torch.isfinite(loss).all()
    ops.check_pending_errors()


def test_sync_mode_raises_at_the_call():
    checks.set_label_checks("sync")
    logits, labels = _data(32, 64, [9], 99)
    with pytest.raises(ValueError, match="cross_entropy_forward: " + RULE.format(value=99, row=9, v=64) + "$"):
        ops.cross_entropy_forward(logits, labels)


def test_off_mode_records_nothing():
    checks.set_label_checks("off")
    logits, labels = _data(32, 64, [9], 99)
    loss, _ = ops.cross_entropy_forward(logits, labels)
    ops.check_pending_errors()
    assert loss[9].isnan()


def test_linear_cross_entropy_names_the_row_of_the_whole_tensor():
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(1000, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(512, 64, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (1000,), device="cuda", generator=g)
    labels[777] = 100000
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=256)
    torch.cuda.synchronize()
    assert loss.isnan()
    with pytest.raises(ValueError, match=r"linear_cross_entropy: argument 'labels' holds 100000 at row 777, "
                                         r"outside \[0, 512\)"):
        loss.backward()


def test_graph_replays_record_and_the_host_raises_after():
    logits, labels = _data(64, 256, [], 0)
    static_labels = labels.clone()
    ops.cross_entropy_forward(logits, static_labels)  # eager warm-up: makes the device's sink
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, _ = ops.cross_entropy_forward(logits, static_labels)
    graph.replay()
    torch.cuda.synchronize()
    ops.check_pending_errors()
    assert torch.isfinite(loss).all()
    static_labels[20] = 300
    graph.replay()
    with pytest.raises(ValueError, match=RULE.format(value=300, row=20, v=256)):
        ops.check_pending_errors()
    assert loss[20].isnan()
    static_labels[20] = 7
    graph.replay()  # the claim was cleared outside the graph: a good replay is quiet, a bad one records again
    ops.check_pending_errors()
    static_labels[33] = -2
    graph.replay()
    with pytest.raises(ValueError, match=RULE.format(value=-2, row=33, v=256)):
        ops.check_pending_errors()


def test_sync_mode_under_capture_records_instead():
    logits, labels = _data(64, 256, [], 0)
    ops.cross_entropy_forward(logits, labels)  # deferred: makes the device's sink
    checks.set_label_checks("sync")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.cross_entropy_forward(logits, labels)
    labels[1] = 256
    graph.replay()
    with pytest.raises(ValueError, match=RULE.format(value=256, row=1, v=256)):
        ops.check_pending_errors()


def test_a_record_in_pageable_memory_is_refused():
    logits, labels = _data(4, 10, [], 0)
    loss, lse = torch.empty(4, device="cuda"), torch.empty(4, device="cuda")
    claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="argument 'label_record' must be page-locked host memory .* got "
                                         "pageable host memory"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="'label_claim' .* must be on the same device"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim.cpu(),
                                 torch.zeros(6, dtype=torch.int64, pin_memory=True))


def test_sink_record_is_pinned_and_claim_on_the_device():
    logits, labels = _data(4, 10, [], 0)
    ops.cross_entropy_forward(logits, labels)
    sink = pe._sinks[logits.get_device()]
    assert sink.record.is_pinned() and sink.claim.device == logits.device


def test_parallel_cross_entropy_names_its_target():
    inp = torch.randn(2, 8, 50, device="cuda", requires_grad=True)
    target = torch.randint(0, 50, (16,), device="cuda")
    target[9] = 50
    loss = te.parallel_cross_entropy(inp, target, reduce_loss=True)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"parallel_cross_entropy: argument 'target' holds 50 at row 9, "
                                         r"outside \[0, 50\)"):
        loss.backward()
