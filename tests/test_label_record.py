"""The deferred cross-entropy label check on the CPU (pending_errors.py).

On CUDA the forward kernel records a bad label into pinned host memory and
the host raises it later without waiting.  Here the same Python path runs on
CPU tensors: device_checks.DEFERRED_DEVICES takes "cpu", the sink is built
from CPU tensors, and a stand-in for the kernel (``FakeKernel``) computes
the loss with the real C op and writes the record exactly as
csrc/loss/cross_entropy_cuda.cu does, but only when the test says the
"GPU" has finished (``finish()``), so every point where the host may or may
not see the error yet can be run in order.  Also: the modes and their
spellings, the messages, graph capture without a sink, and the C entry's
checks of the record arguments.  The kernel itself is tested on the GPU
(test_label_record_cuda.py).
"""
import logging

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse import _C, ops
from seqfuse.modules.cross_entropy import linear_cross_entropy
from seqfuse.ops import device_checks as checks
from seqfuse.ops import loss as loss_ops
from seqfuse.ops import pending_errors as pe


class FakeKernel:
    """Stands in for _C.cross_entropy_forward on CPU tensors: the loss from
    the real C op (bad labels read as ignored), NaN for bad rows, and the
    record protocol of the CUDA kernel (claim, fields, STATE), applied when
    ``finish()`` runs the calls queued so far."""

    def __init__(self):
        self.queued = []
        self.records_passed = []

    def cross_entropy_forward(self, logits, labels, ignore_index, smoothing, loss, lse, claim, record, stream):
        v = logits.shape[1]
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= v))
        _C.cross_entropy_forward(logits, torch.where(bad, ignore_index, labels), ignore_index, smoothing, loss,
                                 lse, None, None, stream)
        loss[bad] = float("nan")
        self.records_passed.append(record is not None)
        if claim is not None and bool(bad.any()):
            rows = bad.nonzero().flatten().tolist()
            self.queued.append((claim, record, [(r, int(labels[r]), v, ignore_index,
                                                 labels.data_ptr() + 8 * r) for r in rows]))

    def cross_entropy_backward(self, logits, labels, lse, scale, ignore_index, smoothing, out, stream):
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[1]))
        _C.cross_entropy_backward(logits, torch.where(bad, ignore_index, labels), lse, scale, ignore_index,
                                  smoothing, out, stream)
        out[bad] = float("nan")  # as the CUDA kernel: NaN gradients for a bad row

    def finish(self):
        for claim, record, rows in self.queued:
            for row, value, v, ii, address in rows:
                if int(claim[0]) != 0:
                    break
                claim[0] = 1
                record[1:6] = torch.tensor([row, value, v, ii, address])
                record[0] = 1
        self.queued.clear()

    def __getattr__(self, name):
        return getattr(_C, name)


@pytest.fixture
def kernel(monkeypatch):
    """The deferred path on CPU tensors, with a fresh sink and the stand-in kernel."""
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(checks, "HOST_READ", ("meta",))
    monkeypatch.setattr(checks, "_label_mode", "deferred")
    monkeypatch.setattr(checks, "_label_mode_error", None)
    monkeypatch.setattr(pe, "_sinks", {})
    monkeypatch.setattr(pe, "_origins", pe.collections.deque(maxlen=64))
    monkeypatch.setattr(pe, "_make_sink", lambda device: pe.Sink(
        device, torch.zeros(1, dtype=torch.int32), torch.zeros(pe.RECORD_LEN, dtype=torch.int64)))
    fake = FakeKernel()
    monkeypatch.setattr(loss_ops, "_C", fake)
    return fake


def _logits(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)


RULE = r"argument 'labels' holds 10 at row 3, outside \[0, 10\) and not ignore_index -100"


def test_bad_label_raises_at_the_backward_of_the_same_call(kernel):
    logits = _logits(2, 2, 10)
    labels = torch.tensor([[1, 2], [-100, 10]])
    loss = te.CrossEntropyLoss(reduction="sum")(logits, labels)  # no error, no wait at the call
    assert loss.isnan()
    kernel.finish()  # the forward kernel has run by the time the backward starts
    with pytest.raises(ValueError, match="cross_entropy_forward: " + RULE + r" \(found by the deferred label check"):
        loss.backward()
    ops.check_pending_errors(wait=False)  # raised once, then cleared
    good = te.CrossEntropyLoss()(logits, torch.tensor([[1, 2], [-100, 9]]))
    assert torch.isfinite(good)


def test_unfinished_kernel_raises_at_the_next_loss_call(kernel):
    logits = _logits(4, 10)
    loss, lse = ops.cross_entropy_forward(logits.detach(), torch.tensor([1, 2, -100, 10]))
    assert loss[3].isnan() and torch.isfinite(loss[:3]).all()
    ops.cross_entropy_forward(logits.detach(), torch.tensor([1, 2, 3, 4]))  # the first kernel has not run yet
    kernel.finish()
    with pytest.raises(ValueError, match="cross_entropy_forward: " + RULE):
        ops.cross_entropy_forward(logits.detach(), torch.tensor([1, 2, 3, 4]))
    loss, _ = ops.cross_entropy_forward(logits.detach(), torch.tensor([1, 2, 3, 4]))
    assert torch.isfinite(loss).all()


def test_check_pending_errors_is_the_last_point(kernel):
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, -7, -100, 12]))
    ops.check_pending_errors(wait=False)  # nothing has arrived yet
    kernel.finish()
    with pytest.raises(ValueError, match=r"argument 'labels' holds -7 at row 1, outside \[0, 10\)"):
        ops.check_pending_errors()  # the first bad row claimed the record; row 3 is NaN only
    ops.check_pending_errors()
    with pytest.raises(TypeError, match="argument 'wait' must be a bool"):
        ops.check_pending_errors(wait="yes")


def test_linear_cross_entropy_chunks_name_the_whole_label_tensor(kernel):
    hidden, weight = _logits(8, 6), _logits(10, 6)
    labels = torch.tensor([1, 2, 3, 4, 5, 99, 7, 8])
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=2)
    assert loss.isnan()
    kernel.finish()
    with pytest.raises(ValueError, match=r"linear_cross_entropy: argument 'labels' holds 99 at row 5, "
                                         r"outside \[0, 10\)"):
        loss.backward()


@pytest.mark.parametrize("mode", ["deferred", "sync"])
def test_parallel_cross_entropy_names_its_target(kernel, mode):
    """Transformer Engine's parallel_cross_entropy calls the labels
    ``target``: both modes name that argument and its row."""
    checks.set_label_checks(mode)
    inp = _logits(2, 3, 10)
    target = torch.tensor([1, 2, 3, 4, 12, 6])
    want = r"parallel_cross_entropy: argument 'target' holds 12 at row 4, outside \[0, 10\)"
    with pytest.raises(ValueError, match=want):
        te.parallel_cross_entropy(inp, target, reduce_loss=True)
        kernel.finish()
        ops.check_pending_errors()


def test_an_untracked_call_gives_its_own_row(kernel):
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    pe._origins.clear()
    kernel.finish()
    with pytest.raises(ValueError, match=r"argument 'labels' holds 10 at row 3 of its call, outside \[0, 10\)"):
        ops.check_pending_errors()


def test_sync_mode_raises_at_the_call(kernel):
    checks.set_label_checks("sync")
    with pytest.raises(ValueError, match="cross_entropy_forward: " + RULE + "$"):
        ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    assert kernel.records_passed == []  # checked before any kernel ran
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 9]))
    assert kernel.records_passed == [False]  # no record in sync mode


def test_off_mode_records_nothing_and_says_so_once(kernel, monkeypatch, caplog):
    checks.set_label_checks("off")
    monkeypatch.setattr(checks, "_label_checks_off_logged", False)
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        for _ in range(2):
            loss, _ = ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
            assert loss[3].isnan()
    kernel.finish()
    ops.check_pending_errors()
    assert kernel.records_passed == [False, False]
    assert sum("labels are not checked" in r.getMessage() for r in caplog.records) == 1


def test_backward_op_alone_checks_at_the_call(kernel):
    """The backward kernel records nothing: its op checks synchronously,
    after raising what earlier forwards recorded."""
    logits, lse = _logits(4, 10).detach(), torch.zeros(4)
    ops.cross_entropy_forward(logits, torch.tensor([1, 2, -100, 10]))
    kernel.finish()
    with pytest.raises(ValueError, match="cross_entropy_forward: " + RULE):
        ops.cross_entropy_backward(logits, torch.tensor([1, 2, 3, 4]), lse, torch.ones(1))
    with pytest.raises(ValueError, match=r"cross_entropy_backward: argument 'labels' holds 11 at row 0"):
        ops.cross_entropy_backward(logits, torch.tensor([11, 2, 3, 4]), lse, torch.ones(1))


def test_capture_without_a_sink_is_logged_and_with_one_records(kernel, monkeypatch, caplog):
    monkeypatch.setattr(checks, "capturing", lambda where=None: True)  # what both modules ask
    monkeypatch.setattr(pe, "_no_sink_logged", set())
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        for _ in range(2):
            ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    lines = [r.getMessage() for r in caplog.records if "not recorded in this CUDA graph capture" in r.getMessage()]
    assert len(lines) == 1 and "run one loss call before capturing" in lines[0]
    assert kernel.records_passed == [False, False]
    pe._sinks[-1] = pe._make_sink(torch.device("cpu"))  # keyed by get_device(): -1 on the CPU
    checks.set_label_checks("sync")  # sync cannot read during a capture: the kernel records instead
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    assert kernel.records_passed[-1] is True
    kernel.finish()
    pe.raise_pending()  # nothing is read while capturing
    with pytest.raises(RuntimeError, match="check_pending_errors: the current stream is being captured"):
        ops.check_pending_errors()
    monkeypatch.setattr(checks, "capturing", lambda where=None: False)
    with pytest.raises(ValueError, match=RULE):
        ops.check_pending_errors()


@pytest.mark.parametrize("raw, mode", [("deferred", "deferred"), ("1", "deferred"), ("SYNC", "sync"),
                                       ("off", "off"), ("0", "off"), (" sync ", "sync")])
def test_environment_spellings(monkeypatch, raw, mode):
    monkeypatch.setenv("SEQFUSE_CHECK_LABELS", raw)
    assert checks._mode_from_env() == (mode, None)


def test_unset_environment_means_deferred(monkeypatch):
    monkeypatch.delenv("SEQFUSE_CHECK_LABELS", raising=False)
    assert checks._mode_from_env() == ("deferred", None)


def test_bad_environment_value_is_an_error_at_the_first_loss(monkeypatch):
    monkeypatch.setenv("SEQFUSE_CHECK_LABELS", "later")
    mode, error = checks._mode_from_env()
    monkeypatch.setattr(checks, "_label_mode", mode)
    monkeypatch.setattr(checks, "_label_mode_error", error)
    monkeypatch.setattr(checks, "DEFERRED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(checks, "HOST_READ", ("meta",))
    with pytest.raises(ValueError, match="SEQFUSE_CHECK_LABELS must be one of 'deferred' .* got 'later'"):
        ops.cross_entropy_forward(torch.randn(2, 4), torch.tensor([1, 2]))
    assert checks.set_label_checks("sync") == "deferred"  # an explicit mode replaces the bad value
    assert checks.label_mode() == "sync"


def test_c_entry_checks_the_record_arguments():
    logits, labels = torch.randn(2, 4), torch.tensor([1, 2])
    loss, lse = torch.empty(2), torch.empty(2)
    claim, record = torch.zeros(1, dtype=torch.int32), torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="'label_claim' and 'label_record' go together.*only 'label_claim'"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, None)
    with pytest.raises(ValueError, match="'label_claim' and 'label_record' go together.*only 'label_record'"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, None, record)
    with pytest.raises(TypeError, match="argument 'label_claim'"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim.long(), record)
    with pytest.raises(TypeError, match="argument 'label_record'"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, record.int())
    with pytest.raises(ValueError, match="argument 'label_record' must have 6 element"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, record[:5])
    with pytest.raises(ValueError, match="argument 'label_record'.*contiguous"):
        _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, torch.zeros(12, dtype=torch.int64)[::2])
    _C.cross_entropy_forward(logits, labels, -100, 0.0, loss, lse, claim, record)  # the CPU ignores a good pair
    assert torch.isfinite(loss).all() and int(record[0]) == 0


def test_an_error_unread_at_exit_is_logged(kernel, caplog):
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    kernel.finish()
    with caplog.at_level(logging.ERROR, logger="seqfuse"):
        pe._report_at_exit()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lines) == 1 and "pending at exit" in lines[0] and "holds 10 at row 3" in lines[0], lines
    pe._report_at_exit()  # read once: nothing more
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


def test_exit_handler_leaves_forked_children_alone(kernel, caplog):
    ops.cross_entropy_forward(_logits(4, 10).detach(), torch.tensor([1, 2, -100, 10]))
    kernel.finish()
    with caplog.at_level(logging.ERROR, logger="seqfuse"):
        pe._report_at_exit(pid=-1)  # registered by another process
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]
    with pytest.raises(ValueError, match="holds 10 at row 3"):
        ops.check_pending_errors()  # still there for its own process
