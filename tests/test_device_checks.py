"""Index values in GPU memory are checked before a kernel runs (issue 23):
cu_seqlens of attention and RoPE, cross-entropy labels.  On the CPU the C
entries read them; on CUDA the kernels clamp a bad cu_seqlens or skip a bad
label, so the ops check the values with torch on the device
(seqfuse/ops/device_checks.py).  These CPU tests run that device path on
CPU tensors (``HOST_READ`` emptied) with the C call replaced by a tripwire:
the check must raise, with the C entry's own message, before any kernel
runs, and under CUDA graph capture it must step aside with a log line.  The
same calls on a GPU are in tests/test_device_checks_cuda.py."""
import logging

import pytest
import torch

from seqfuse import ops
from seqfuse.ops import device_checks as checks
from seqfuse.ops import loss as loss_ops
from seqfuse.ops import rope as rope_ops
from seqfuse.ops.attn import _entry as attn_entry


class Tripwire:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("the kernel ran on values that break the rule")


@pytest.fixture
def device_path(monkeypatch):
    """CPU tensors take the device path (as CUDA ones do)."""
    monkeypatch.setattr(checks, "HOST_READ", ())
    checks._cu_facts = None  # no facts remembered from another test


def _c_message(fn):
    """The C entry's message for a call (HOST_READ as shipped)."""
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def _thd_call(cu_q, cu_kv, max_q=5, q=None):
    q = torch.randn(8, 2, 16) if q is None else q
    return lambda: ops.attention_forward(q, q, q, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                                     max_seqlen_q=max_q, max_seqlen_kv=5)


GOOD = torch.tensor([0, 3, 8], dtype=torch.int32)
BAD_CU = {
    "past_end": torch.tensor([2, 5, 10], dtype=torch.int32),       # starts at 2 (the corpus's +2)
    "ends_past": torch.tensor([0, 5, 10], dtype=torch.int32),      # 10 > 8 tokens
    "unsorted": torch.tensor([0, 6, 3], dtype=torch.int32),
    "too_long": torch.tensor([0, 1, 8], dtype=torch.int32),        # 7 > max_seqlen 5
}


@pytest.mark.parametrize("what", sorted(BAD_CU))
@pytest.mark.parametrize("side", ["q", "kv"])
def test_attention_cu_seqlens_checked_before_the_kernel(what, side, device_path, monkeypatch):
    cu = BAD_CU[what]
    args = (cu, GOOD) if side == "q" else (GOOD, cu)
    monkeypatch.setattr(checks, "HOST_READ", ("cpu",))
    expected = _c_message(_thd_call(*args))
    monkeypatch.setattr(checks, "HOST_READ", ())
    wire = Tripwire()
    monkeypatch.setattr(attn_entry._C, "attn_forward", wire)
    with pytest.raises(ValueError) as e:
        _thd_call(*args)()
    assert wire.calls == 0
    assert str(e.value) == expected  # word for word the C entry's message
    assert f"cu_seqlens_{side}" in str(e.value)


def test_attention_good_cu_seqlens_pass_and_are_read_once_per_tensor(device_path, monkeypatch):
    reads = []
    real = checks._cu_problem
    monkeypatch.setattr(checks, "_cu_problem", lambda cu, n: reads.append(cu) or real(cu, n))
    checks._cu_facts = None
    cu, q = GOOD.clone(), torch.randn(8, 2, 16)
    out1 = _thd_call(cu, cu, q=q)()[0]
    out2 = _thd_call(cu, cu, q=q)()[0]  # the second layer of a model: same tensor, no second read
    assert len(reads) == 1
    monkeypatch.setattr(checks, "HOST_READ", ("cpu",))
    torch.testing.assert_close(out1, _thd_call(cu, cu, q=q)()[0])  # as without the check
    monkeypatch.setattr(checks, "HOST_READ", ())
    cu.add_(0)  # modified in place (version bump): read again
    _thd_call(cu, cu)()
    assert len(reads) == 2


def test_one_read_per_tensor_whatever_the_limit(device_path, monkeypatch):
    """The remembered read serves every max_len the tensor meets (packed
    ESM-2 checks without one, its layers against the longest sequence); a
    limit the tensor breaks reads it again for the C entry's message."""
    reads = []
    real = checks._cu_problem
    monkeypatch.setattr(checks, "_cu_problem", lambda cu, n: reads.append(n) or real(cu, n))
    cu = GOOD.clone()
    for limit in (None, 5, 8, 5):
        checks.check_cu_seqlens("op", "cu_seqlens", cu, extent=8, max_len=limit)
    assert reads == [None]
    assert checks.sequence_facts(cu, 5) == (8, 3, 5) and reads == [None]
    with pytest.raises(ValueError, match="holds a sequence of length 5, longer than the max_seqlen 4"):
        checks.check_cu_seqlens("op", "cu_seqlens", cu, extent=8, max_len=4)
    assert reads == [None, 4]


def test_attention_routes_see_the_check_too(device_path, monkeypatch):
    """``ops.attention`` checks before choosing a route (torch's routes would
    clamp bad lengths as silently as the kernels)."""
    wire = Tripwire()
    monkeypatch.setattr(attn_entry, "routed_attention_or_none", wire)
    q = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens_kv' must be non-decreasing"):
        ops.attention(q, q, q, qkv_format="thd", cu_seqlens_q=GOOD, cu_seqlens_kv=BAD_CU["unsorted"])
    assert wire.calls == 0


@pytest.mark.parametrize("what", ["past_end", "unsorted", "ends_past"])
def test_rope_thd_cu_seqlens_checked_before_the_kernel(what, device_path, monkeypatch):
    t = torch.randn(8, 3, 8)
    freqs = torch.randn(16, 1, 1, 8)
    cu = BAD_CU[what]
    monkeypatch.setattr(checks, "HOST_READ", ("cpu",))
    with pytest.raises(ValueError) as e:
        ops.rope_forward(t, freqs, tensor_format="thd", cu_seqlens=cu)
    c_msg = str(e.value)
    monkeypatch.setattr(checks, "HOST_READ", ())
    wire = Tripwire()
    monkeypatch.setattr(rope_ops._C, "rope", wire)
    with pytest.raises(ValueError) as e:
        ops.rope_forward(t, freqs, tensor_format="thd", cu_seqlens=cu)
    assert wire.calls == 0
    assert "'cu_seqlens'" in str(e.value)
    # same rule as C's (its words differ only in how the token count is said)
    for word in ("start at 0", "non-decreasing", "ends at"):
        assert (word in c_msg) == (word in str(e.value)), (c_msg, str(e.value))


def test_rope_sequence_longer_than_freqs(device_path, monkeypatch):
    monkeypatch.setattr(rope_ops._C, "rope", Tripwire())
    with pytest.raises(ValueError, match="longer than the 4 positions 'freqs' covers"):
        ops.rope_forward(torch.randn(8, 3, 8), torch.randn(4, 1, 1, 8), tensor_format="thd",
                         cu_seqlens=torch.tensor([0, 2, 8], dtype=torch.int32))


LABELS = {"out_of_range": torch.tensor([1, 2, -100, 10]), "negative": torch.tensor([1, -7, -100, 9])}


@pytest.mark.parametrize("what", sorted(LABELS))
def test_cross_entropy_labels_checked_before_the_kernel(what, device_path, monkeypatch):
    logits = torch.randn(4, 10)
    labels = LABELS[what]
    monkeypatch.setattr(checks, "HOST_READ", ("cpu",))
    expected = _c_message(lambda: ops.cross_entropy_forward(logits, labels))
    monkeypatch.setattr(checks, "HOST_READ", ())
    for name in ("cross_entropy_forward", "cross_entropy_backward"):
        monkeypatch.setattr(loss_ops._C, name, Tripwire())
    with pytest.raises(ValueError) as e:
        ops.cross_entropy_forward(logits, labels)
    assert str(e.value) == expected
    lse = torch.zeros(4)
    with pytest.raises(ValueError, match="cross_entropy_backward: argument 'labels' holds"):
        ops.cross_entropy_backward(logits, labels, lse, torch.ones(1))
    # the module's loss and the chunked linear loss refuse them too
    import seqfuse.pytorch as te
    from seqfuse.modules.cross_entropy import linear_cross_entropy
    with pytest.raises(ValueError, match="argument 'labels' holds"):
        te.CrossEntropyLoss()(logits, labels)
    with pytest.raises(ValueError, match="linear_cross_entropy: argument 'labels' holds"):
        linear_cross_entropy(torch.randn(4, 6), torch.randn(10, 6), labels)


def test_cross_entropy_label_check_can_be_skipped(device_path, monkeypatch):
    """``check_labels=False`` (labels already checked) costs no host read."""
    monkeypatch.setattr(checks, "label_problem", Tripwire())
    loss, lse = ops.cross_entropy_forward(torch.randn(4, 10), torch.tensor([1, 2, -100, 9]), check_labels=False)
    assert torch.isfinite(loss).all()


def test_label_checks_switched_off_for_the_process(device_path, monkeypatch, caplog):
    """set_label_checks(False) = "off": no host read in any loss call, a
    WARNING once, the previous mode returned; anything but a mode name or a
    bool is refused."""
    monkeypatch.setattr(checks, "label_problem", Tripwire())
    monkeypatch.setattr(checks, "_label_checks_off_logged", False)
    previous = checks.set_label_checks(False)
    try:
        assert previous == "deferred" and checks.label_mode() == "off"
        with caplog.at_level(logging.WARNING, logger="seqfuse"):
            for _ in range(2):
                ops.cross_entropy_forward(torch.randn(4, 10), torch.tensor([1, 2, -100, 9]))
        assert sum("labels are not checked" in r.getMessage() for r in caplog.records) == 1
    finally:
        checks.set_label_checks(previous)
    assert checks.label_mode() == "deferred"
    with pytest.raises(TypeError, match="argument 'mode' must be one of"):
        checks.set_label_checks(0)
    with pytest.raises(ValueError, match="argument 'mode' must be one of .*got 'later'"):
        checks.set_label_checks("later")


def test_checks_step_aside_under_graph_capture(device_path, monkeypatch, caplog):
    """No host read during capture: the check is skipped, and logged once."""
    monkeypatch.setattr(checks, "capturing", lambda where=None: True)
    checks._skips_logged.clear()
    with caplog.at_level(logging.WARNING, logger="seqfuse"):
        for _ in range(2):
            checks.check_labels("cross_entropy_forward", torch.tensor([1, 99]), 10, -100)
            checks.check_cu_seqlens("attention_forward", "cu_seqlens_q", BAD_CU["unsorted"], 8)
    lines = [r.getMessage() for r in caplog.records if "captured into a CUDA graph" in r.getMessage()]
    assert len(lines) == 2, lines  # one per op and argument, not one per call
    assert any("'labels'" in m for m in lines) and any("'cu_seqlens_q'" in m for m in lines)


@pytest.mark.parametrize("mutation", ["neg_bit", "shrunk", "freed"])
def test_unreadable_index_tensors_are_left_to_c(mutation, device_path):
    """A negative-bit view would be judged on other values than the caller's,
    and a shrunk or freed storage read out of bounds: the device check leaves
    them to the C entry, whose error names that rule."""
    labels = torch.tensor([1, 2, -100, 9])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    if mutation == "neg_bit":
        labels, cu = torch._neg_view(labels.clone()), torch._neg_view(cu.clone())
    else:
        for t in (labels, cu):
            t.untyped_storage().resize_(0 if mutation == "freed" else t.untyped_storage().nbytes() // 2)
    rule = "negative bit" if mutation == "neg_bit" else "storage"
    with pytest.raises(ValueError, match=rule):
        ops.cross_entropy_forward(torch.randn(4, 10), labels)
    q = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=rule):
        ops.attention_forward(q, q, q, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5,
                          max_seqlen_kv=5)
    with pytest.raises(ValueError, match=rule):
        ops.rope_forward(torch.randn(8, 3, 8), torch.randn(16, 1, 1, 8), tensor_format="thd", cu_seqlens=cu)


# the corpus cases of the index tensors the device path reads (cu_seqlens, labels, targets)
_INDEX_CASES = (":cu_seqlens", ":labels:", ":target:", ":cu_", ":label_", ":target_")


def test_corpus_index_cases_hold_on_the_device_path(tmp_path):
    """Issue 23's corpus cases of cu_seqlens and labels (every dtype, rank,
    layout, storage and value mutation), run with the device path on:
    each must still end in the C entry's error or the reference result, so
    the CUDA corpus gets the CPU's answers.  One subprocess (a crash is
    reported by the case that was running)."""
    import json
    import os
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    script = tmp_path / "device_path_worker.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {tests!r})\n"
        "import seqfuse.ops.device_checks as dc\n"
        "dc.HOST_READ = ()\n"
        "import bad_input_cases as c\n"
        "ops_, mods_ = c.op_specs, c.mod_specs\n"
        "c.op_specs = lambda: [s for s in ops_() if 'cross_entropy' in s.name or s.name.endswith('_thd')]\n"
        "c.mod_specs = lambda: [s for s in mods_() if s.name == 'CrossEntropyLoss']\n"
        f"keys = {_INDEX_CASES!r}\n"
        "for case in c.build_cases('cpu'):\n"
        "    if any(k in case.name for k in keys):\n"
        "        print('S ' + case.name, flush=True)\n"
        "        print('R ' + json.dumps(dict(c.run_case(case), name=case.name)), flush=True)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    lines = proc.stdout.splitlines()
    results = [json.loads(x[2:]) for x in lines if x.startswith("R ")]
    started = [x[2:] for x in lines if x.startswith("S ")]
    assert proc.returncode == 0, f"crashed in {started[-1] if started else '?'}: {proc.stderr[-2000:]}"
    assert len(results) >= 80, len(results)
    bad = [f"{r['name']}: {r['what'][:200]}" for r in results if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_capturing_needs_a_cuda_place_and_never_initialises_cuda():
    """The one capture test: False for CPU tensors and devices whatever the
    stream says, and no CUDA initialisation on a machine that has not used it."""
    real = checks.capturing
    assert real(torch.zeros(1)) is False and real(torch.device("cpu")) is False and real("cpu") is False
    if not torch.cuda.is_initialized():
        assert real() is False and real(torch.device("cuda")) is False
        assert not torch.cuda.is_initialized()
