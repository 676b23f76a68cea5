"""Issue 23's held-in bad-input corpus: every case of tests/bad_input_cases.py
(about two thousand: every public op of seqfuse.ops and module of
seqfuse.pytorch, each argument broken one way at a time) must end in an
exception that names the argument and the rule, or in the reference result.

The cases run in worker subprocesses (bad_input_cases.py is the worker), so
a segfault, an abort or a hang (a per-case faulthandler deadline) is caught
and reported as the failure of the case that was running, and the next
worker starts after it.  Two workers share the cases.  Each case is a test
item of its own, named by device, op, argument and mutation, e.g.
``cpu:gemm:a:neg_bit``.  The cuda-marked test runs the same corpus on the
GPU (inputs on CUDA, plus an argument left on the CPU).

    OMP_NUM_THREADS=1 python3 -m pytest -q tests/test_bad_input_corpus.py -p no:cacheprovider
    # one case, in this process, for debugging:
    python3 tests/bad_input_cases.py cpu <index> <index+1>
"""
import os
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

import bad_input_cases as corpus
from seqfuse import _C, ops
from seqfuse.ops import loss as loss_ops
from test_label_record import FakeKernel, kernel  # noqa: F401 (kernel: the deferred path's fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "bad_input_cases.py")
WORKERS = 2
CASE_TIMEOUT_S = 30


def _names(device):
    return [c.name for c in corpus.build_cases(device)]


def _run_range(device, names, first, last, results, worker=None):
    """Run cases [first, last) in as many worker processes as crashes need
    (``worker``: the script, called as ``worker device first last``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SEQFUSE_CASE_TIMEOUT=str(CASE_TIMEOUT_S))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    start = first
    while start < last:
        try:
            proc = subprocess.run([sys.executable, worker or WORKER, device, str(start), str(last)],
                                  capture_output=True, text=True, env=env,
                                  timeout=CASE_TIMEOUT_S * 4 + (last - start) * 2)
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err, rc = "worker killed after its overall deadline", "timeout"
        running = None
        for line in out.splitlines():
            if line.startswith("S "):
                running = line[2:]
            elif line.startswith("R "):
                r = json.loads(line[2:])
                results[r["name"]] = r
                running = None
        if running is None:
            if rc != 0:
                raise RuntimeError(f"corpus worker failed outside a case (exit {rc}):\n{err[-3000:]}")
            return
        hung = "Timeout" in err or rc == "timeout"
        what = (f"hung (no answer within {CASE_TIMEOUT_S} s)" if hung else
                f"crashed the process (exit {rc}{', signal ' + str(-rc) if isinstance(rc, int) and rc < 0 else ''})")
        results[running] = {"ok": False, "name": running, "what": what + ": " + err[-1500:]}
        start = names.index(running) + 1


def run_corpus(device):
    names = _names(device)
    results = {}
    t0 = time.time()
    bounds = [len(names) * i // WORKERS for i in range(WORKERS + 1)]
    errors = []

    def one(i):
        try:
            _run_range(device, names, bounds[i], bounds[i + 1], results)
        except Exception as e:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    missing = [n for n in names if n not in results]
    for n in missing:
        results[n] = {"ok": False, "name": n, "what": "never ran (worker ended early)"}
    print(f"corpus[{device}]: {len(names)} cases in {time.time() - t0:.1f} s")
    return results


_cache = {}


def _result(device, name):
    if device not in _cache:
        _cache[device] = run_corpus(device)
    return _cache[device][name]


CPU_NAMES = _names("cpu")


def test_corpus_is_hundreds_of_cases():
    ops_covered = {n.split(":")[1] for n in CPU_NAMES}
    assert len(CPU_NAMES) >= 500, len(CPU_NAMES)
    assert len(ops_covered) >= 50, sorted(ops_covered)


@pytest.mark.parametrize("name", CPU_NAMES)
def test_case(name):
    r = _result("cpu", name)
    assert r["ok"], f"{name}: {r['what']}"


@pytest.mark.cuda
def test_cuda_corpus():
    """The whole corpus on the GPU, one test (its case names in the message)."""
    results = run_corpus("cuda")
    bad = {n: r["what"] for n, r in results.items() if not r["ok"]}
    assert not bad, f"{len(bad)} of {len(results)} cuda cases failed:\n" + "\n".join(
        f"{n}: {w[:300]}" for n, w in sorted(bad.items()))


def test_runner_reports_a_crash_by_name(tmp_path, monkeypatch):
    """The runner must turn a worker's death into the failure of the case
    that was running, and go on with the next ones."""
    names = CPU_NAMES[:3]
    victim = names[1]
    script = tmp_path / "crashing_worker.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {HERE!r})\n"
        "import bad_input_cases\n"
        "real = bad_input_cases.run_case\n"
        "def run_case(case):\n"
        f"    if case.name == {victim!r}:\n"
        "        os.abort()\n"
        "    return real(case)\n"
        "bad_input_cases.run_case = run_case\n"
        "bad_input_cases.main(sys.argv[1:])\n")
    monkeypatch.setattr(sys.modules[__name__], "WORKER", str(script))
    results = {}
    _run_range("cpu", names, 0, 3, results)
    assert set(results) == set(names)
    assert not results[victim]["ok"] and "crashed" in results[victim]["what"]
    for n in (names[0], names[2]):
        assert "crashed" not in results[n]["what"], results[n]


def test_a_wrong_result_fails_the_case():
    """The comparison must be able to fail: a result off by one ulp-scale
    step beyond the tolerance, a NaN where the reference has none."""
    exp = torch.tensor([1.0, 2.0, float("nan")])
    assert corpus._compare(torch.tensor([1.0, 2.0, float("nan")]), exp, 1e-6) is None
    assert corpus._compare(torch.tensor([1.0, 2.001, float("nan")]), exp, 1e-6) is not None
    assert corpus._compare(torch.tensor([1.0, 2.0, 0.0]), exp, 1e-6) is not None
    assert corpus._compare(torch.tensor([1.0, float("inf"), float("nan")]), exp, 1e-6) is not None


def test_on_cpu_expectation_follows_the_calls_devices():
    """On CUDA, moving an op's only tensor to the CPU makes a CPU call, which
    must give the CPU result; moving one of several (the rest on CUDA) must
    raise.  The single-tensor ops are exactly these."""
    sole = {s.name: corpus._sole_tensor(s, "cpu") for s in corpus.op_specs()}
    assert {n for n, p in sole.items() if p} == {
        "amax", "transpose_fp8", "quantize_block_fp8", "quantize_block_fp8_128", "quantize_block_fp8_rowcol",
        "quantize_block_fp8_weight", "quantize_mxfp8", "quantize_nvfp4", "act_forward_gelu", "act_forward_relu", "act_forward_silu", "act_forward_swiglu",
        "dropout_backward"}
    assert sole["amax_out"] is None and sole["act_backward_gelu"] is None  # an output / a second tensor


def test_masked_key_references_differ_only_where_the_rule_says():
    """The two exact answers a CUDA attention result with an inf in V may
    give (README, Numerics): they differ only at the queries the causal mask
    hides the inf from, and a result NaN everywhere matches neither."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    v[1, 4, 1, 15] = float("inf")
    a, b = corpus._attn_ref(q, k, v, True), corpus._attn_zero_weight_ref(q, k, v, True)
    differ = a.isnan() != b.isnan()
    assert differ.sum() == 4 and differ[1, :4, 1, 15].all()  # queries 0..3 cannot see key 4
    fin = a.isfinite() & b.isfinite()
    assert torch.allclose(a[fin], b[fin])
    everything_nan = torch.full_like(a, float("nan"))
    assert corpus._compare(everything_nan, a, 1e-4) is not None
    assert corpus._compare(everything_nan, b, 1e-4) is not None


class _FinishedKernel(FakeKernel):
    """The label-record stand-in as the corpus meets the GPU: each tiny
    kernel has finished before the host's next step, and a negative-bit
    view is refused by the binding before any kernel runs (as both devices'
    C entry does)."""

    def cross_entropy_forward(self, logits, labels, ignore_index, smoothing, loss, lse, claim, record, stream):
        if labels.is_neg():
            return _C.cross_entropy_forward(logits, labels, ignore_index, smoothing, loss, lse, None, None, stream)
        super().cross_entropy_forward(logits, labels, ignore_index, smoothing, loss, lse, claim, record, stream)
        self.finish()
        return None


@pytest.mark.parametrize("name", [
    "cpu:cross_entropy_forward:labels:neg_bit", "cpu:CrossEntropyLoss:target:neg_bit",
    "cpu:cross_entropy_forward:label_out_of_range", "cpu:cross_entropy_forward:label_negative",
    "cpu:CrossEntropyLoss:target_out_of_range", "cpu:cross_entropy_forward:valid", "cpu:CrossEntropyLoss:valid"])
def test_deferred_label_cases(kernel, monkeypatch, name):  # noqa: F811 (kernel: the fixture)
    """The cross-entropy cases as they run on CUDA, where a bad label is
    reported after the call returns (the deferred label check, here on the
    CPU with the stand-in kernel).  A neg_bit case's reference call (its
    labels resolved: -1, -2, 100, -9) records a bad label: the reference
    must count as raising, and its record must not reach the case's own call,
    which must be refused for the negative bit, not for the reference's
    label.  A bad label of the case's own call must surface as its error."""
    monkeypatch.setattr(loss_ops, "_C", _FinishedKernel())
    case = next(c for c in corpus.build_cases("cpu") if c.name == name)
    mod, a = case.args()
    exp = corpus._expected(case, mod, a)
    assert (exp[0] == "raise") == (name.endswith(":neg_bit") or "range" in name or "negative" in name), exp
    ops.check_pending_errors(wait=False)  # nothing of the reference call is left pending
    r = corpus.run_case(case)
    assert r["ok"], f"{name}: {r['what']}"
    ops.check_pending_errors(wait=False)
