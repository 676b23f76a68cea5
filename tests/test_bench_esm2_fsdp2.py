"""The FSDP2 scaling tools of benchmarks/esm2 on the CPU: the profile
summary's arithmetic (idle gaps, exposed communication) on synthetic trace
events, the --configs parser, esm2_recipe.fsdp.shard_model's argument
checks, and a two-process gloo run of bench_esm2.py --fsdp2 with two FSDP2
settings (explicit prefetch; bf16 reduce, no reshard, two layers per unit)
and torch DDP on rank-balanced batches, with --profile, which must write its JSON and a profile
summary per rank."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "esm2")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))  # benchmarks/: profile_summary
sys.path.insert(0, os.path.join(ROOT, "recipes", "esm2"))

import profile_summary  # noqa: E402


def _k(name, ts, dur, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_summary_idle_and_exposed_communication():
    ev = [
        _k("gemm_a", 0, 100, 7), _k("gemm_b", 150, 100, 7), _k("gemm_a", 300, 100, 7),
        _k("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 80, 100, 20),
        _k("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 420, 30, 21),
        _k("Memcpy HtoD (Pageable -> Device)", 460, 10, 7, cat="gpu_memcpy"),
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward (esm.encoder.layers.3)", "ts": 0, "dur": 40},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::pre_forward (esm.encoder.layers.4)", "ts": 50, "dur": 60},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
    ]
    text, n = profile_summary.summarize(ev, 2, host_ms=[3.0, 5.0], cpu_ms=[1.0, 1.0], title="t")
    # window 0..470; busy [0,250] [300,400] [420,450] [460,470] -> idle 50 + 20 + 10 = 80 us
    assert n["gpu_window_ms_per_step"] == pytest.approx(0.470 / 2)
    assert n["gpu_idle_ms_per_step"] == pytest.approx(0.080 / 2)
    # all-gather 80..180 overlaps compute 80..100 and 150..180: 50 us exposed; reduce-scatter 30 us all exposed
    assert n["exposed_comm_ms_per_step"] == pytest.approx(0.080 / 2)
    assert n["nccl_kernel_ms_per_step"] == pytest.approx(0.130 / 2)
    assert n["compute_kernel_sum_ms_per_step"] == pytest.approx(0.310 / 2)
    assert n["host_issue_ms_per_step"] == pytest.approx(4.0)
    assert "all_gather 0.5/step" in text and "reduce_scatter" in text
    # gemm_a: 2 calls, 200 us in all, first in the kernel table
    table = text.split("top 25 GPU kernels")[1].splitlines()
    assert table[2].split()[:2] == ["0.10", "1.0"] and table[2].endswith("gemm_a")
    # the FSDP2 labels of the two layers add up to one line
    assert "FSDP::pre_forward 0.05" in text and "(esm.encoder" not in text


def test_summary_without_gpu_events():
    text, n = profile_summary.summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}],
                                        1, [2.0], [1.0])
    assert "no GPU kernels recorded" in text and "gpu_idle_ms_per_step" not in n


def test_interval_helpers():
    u = profile_summary.union([[5, 7], [0, 2], [1, 3], [7, 8], [9, 9]])
    assert u == [[0, 3], [5, 8]]
    assert profile_summary.intersect(u, profile_summary.union([[2, 6]])) == 2
    assert profile_summary.gaps(u) == [(2, 3)]


def test_fsdp2_config_parser():
    import argparse

    import bench_esm2

    args = argparse.Namespace(reshard_after_forward=1, reduce_dtype="float32", prefetch=0, layers_per_unit=1)
    c = bench_esm2.fsdp2_config("raf0+rbf16+pf2+g3", args)
    assert (c["reshard"], c["reduce"], c["prefetch"], c["layers_per_unit"], c["same"]) == (False, "bfloat16", 2, 3, False)
    c = bench_esm2.fsdp2_config("default", args)
    assert (c["reshard"], c["reduce"], c["prefetch"]) == (True, "float32", 0)
    assert bench_esm2.fsdp2_config("same", args)["same"]
    assert bench_esm2.fsdp2_config("ddp", args)["ddp"] and not c["ddp"]
    assert bench_esm2.fsdp2_config("bal+pf1", args)["bal"] and not c["bal"]
    assert c["amax"] == "world"
    assert bench_esm2.fsdp2_config("raf0+amaxown", args)["amax"] == "own"
    assert bench_esm2.fsdp2_config("amaxoff+g3", args)["amax"] == "off"
    for bad in ("fast", "g0", "pf"):
        with pytest.raises(ValueError, match=f"unknown token '{bad}'"):
            bench_esm2.fsdp2_config("raf0+" + bad, args)


def test_shard_model_rejects_bad_settings():
    from esm2_recipe.fsdp import shard_model

    with pytest.raises(ValueError, match="reduce_dtype"):
        shard_model(torch.nn.Linear(2, 2), reduce_dtype="float16")
    with pytest.raises(ValueError, match="prefetch"):
        shard_model(torch.nn.Linear(2, 2), prefetch=-1)
    with pytest.raises(ValueError, match="prefetch"):
        shard_model(torch.nn.Linear(2, 2), prefetch=True)
    with pytest.raises(ValueError, match="layers_per_unit"):
        shard_model(torch.nn.Linear(2, 2), layers_per_unit=0)


def test_bench_fsdp2_gloo_with_profile(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("pyarrow")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    out, prof = tmp_path / "b", tmp_path / "prof"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(BENCH, "bench_esm2.py"), "--fsdp2", "--device", "cpu", "--size", "tiny", "--tokens", "256",
           "--max-length", "64", "--steps", "1", "--warmup", "1", "--rows", "seqfuse_bf16_packed",
           "--configs", "pf1,raf0+rbf16+pf1+g2,ddp+bal", "--profile", str(prof), "--profile-configs", "pf1",
           "--profile-steps", "1", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    with open(f"{out}_fsdp2.json") as f:
        doc = json.load(f)
    rows = {(x["config"], x["gpus"]): x for x in doc["rows"]}
    assert set(rows) == {("one_gpu", 1), ("pf1", 2), ("raf0+rbf16+pf1+g2", 2), ("one_gpu_bal", 1), ("ddp+bal", 2)}
    assert all(x["unpadded_tokens_per_s"] > 0 for x in rows.values())
    assert rows[("raf0+rbf16+pf1+g2", 2)]["scaling"] > 0
    assert r.stdout.count("[fsdp2] seqfuse_bf16_packed") == 5
    names = sorted(os.listdir(prof))
    assert names == ["rank0_profile.txt", "rank0_seqfuse_bf16_packed_alone_profile.txt",
                     "rank1_profile.txt", "rank1_seqfuse_bf16_packed_alone_profile.txt"]
    for n in names:
        text = (prof / n).read_text()
        assert "host time to issue one step" in text and "FSDP::" in text or "alone" in n


def test_fsdp2_host_overhead_script(tmp_path):
    """fsdp2_host_overhead.py (fake process group, one process): one row per
    setting, plain first with ratio 1, FSDP2 settings timed on a wrapped model."""
    pytest.importorskip("transformers")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    out = tmp_path / "host"
    r = subprocess.run([sys.executable, os.path.join(BENCH, "fsdp2_host_overhead.py"), "--layers", "2", "--steps", "2",
                        "--warmup", "1", "--configs", "plain,default,raf0+g2", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    with open(f"{out}.json") as f:
        rows = json.load(f)["rows"]
    assert [x["config"] for x in rows] == ["plain", "default", "raf0+g2"]
    assert rows[0]["vs_plain"] == 1.0 and all(x["step_ms"] > 0 for x in rows)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "fsdp2_host_overhead.py"), "--layers", "2", "--steps", "1",
                        "--configs", "plain,ddp", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    assert r.returncode != 0 and "only FSDP2 wrapping settings" in r.stderr


def test_profile_summary_lists_runtime_calls():
    ev = [_k("gemm", 0, 10, 7), {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 400},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 9, "dur": 5}]
    text, _ = profile_summary.summarize(ev, 2)
    tail = text.split("CUDA runtime / driver calls")[1].splitlines()
    assert tail[2].split() == ["0.20", "0.5", "cudaStreamSynchronize"]
    assert tail[3].split() == ["0.01", "1.0", "cudaLaunchKernel"]


def test_profile_summary_idle_by_next_kernel():
    ev = [_k("a", 0, 10, 7), _k("b", 30, 10, 7), _k("c", 45, 5, 7), _k("b", 60, 10, 7)]
    busy = profile_summary.union([e["ts"], e["ts"] + e["dur"]] for e in ev)
    assert profile_summary.idle_before(ev, busy) == [("b", 30.0, 2), ("c", 5.0, 1)]
    text, _ = profile_summary.summarize(ev, 1)
    assert "GPU idle time by what ends it" in text


def test_profile_summary_names_the_host_ops_that_launched_the_waited_kernel():
    ev = [_k("a", 0, 10, 7), _k("b", 30, 10, 7),
          {"ph": "X", "cat": "cpu_op", "name": "outer", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "inner", "ts": 20, "dur": 5, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "later", "ts": 50, "dur": 5, "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 21, "dur": 2, "pid": 1, "tid": 1,
           "args": {"correlation": 2}},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 2, "pid": 1, "tid": 1,
           "args": {"correlation": 3}}]
    ev[1]["args"]["correlation"] = 2
    assert profile_summary.launchers(ev) == {2: ["inner", "outer"], 3: ["outer"]}
    text, _ = profile_summary.summarize(ev, 1)
    assert "inner < outer -> b" in text


def test_profile_summary_names_the_launchers_of_memsets():
    def op(cat, name, ts, dur, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    ev = [_k("gemm", 0, 10, 7),
          {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 12, "dur": 2, "args": {"correlation": 5}},
          {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 20, "dur": 2, "args": {"correlation": 6}},
          {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 30, "dur": 4, "args": {"correlation": 7}},
          op("cpu_op", "_LayerNormMLPFn", 0, 100),
          op("python_function", "/w/bench.py(10): step", 0, 100),
          op("python_function", "/w/python/seqfuse/ops/gemm.py(204): fp8_gemm_nt", 1, 20),
          op("cuda_runtime", "cudaMemsetAsync", 2, 1, 5),
          op("cuda_runtime", "cudaMemsetAsync", 8, 1, 6),
          op("cuda_runtime", "cudaMemsetAsync", 40, 1, 7)]
    assert profile_summary.launchers(ev, profile_summary.PY_CATS, keep=profile_summary._seqfuse_frame) == {
        5: ["/w/python/seqfuse/ops/gemm.py(204): fp8_gemm_nt"], 6: ["/w/python/seqfuse/ops/gemm.py(204): fp8_gemm_nt"],
        7: []}
    text, _ = profile_summary.summarize(ev, 1)
    tail = text.split("GPU memsets by launcher (per step: 3.0 memsets, 0.01 ms)")[1].splitlines()
    frame = "/w/python/seqfuse/ops/gemm.py(204): fp8_gemm_nt"
    assert tail[2].split(None, 2) == ["2.0", "0.004", f"_LayerNormMLPFn [{frame}]"]
    assert tail[3].split(None, 2) == ["1.0", "0.004", "_LayerNormMLPFn"]


def test_profile_summary_runtime_calls_inside_the_steps_only():
    ev = [_k("gemm", 0, 10, 7),
          {"ph": "X", "cat": "user_annotation", "name": profile_summary.STEP, "ts": 0, "dur": 50},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 2},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 60, "dur": 400}]
    text, _ = profile_summary.summarize(ev, 1)
    tail = text.split("CUDA runtime / driver calls")[1]
    assert "cudaLaunchKernel" in tail and "cudaDeviceSynchronize" not in tail


def test_profile_row_writes_the_profile_and_no_syncs_off_the_gpu(tmp_path):
    calls = []
    nums, syncs = profile_summary.profile_row(lambda b: calls.append(b), [1, 2], "cpu", str(tmp_path / "row"), "t")
    assert calls == [1, 2] and syncs is None and nums["steps"] == 2
    assert (tmp_path / "row_profile.txt").read_text().startswith("# t")
    assert not (tmp_path / "row_syncs.txt").exists()


def test_profile_summary_splits_the_heaviest_range_into_its_children():
    def op(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    ev = [_k("a", 0, 10, 7),
          op("autograd::engine::evaluate_function: FnBackward", 0, 1000), op("FnBackward", 1, 998),
          op("aten::empty", 10, 100), op("aten::mm", 200, 300), op("cudaLaunchKernel", 250, 20, "cuda_runtime"),
          op("cudaMemsetAsync", 600, 50, "cuda_runtime"),
          op("FnBackward", 2000, 500, tid=2), op("aten::mm", 2100, 100, tid=2),
          op("aten::mm", 5000, 40)]  # (not inside any FnBackward)
    par = profile_summary.parents(ev)
    assert par[2] == 1 and par[3] == 2 and par[5] == 4 and par[6] == 2 and par[8] == 7 and 9 not in par
    text, _ = profile_summary.summarize(ev, 1)
    part = text.split("heaviest host ranges")[1].splitlines()
    assert part[1].startswith("FnBackward: 2.0 calls/step, 0.749 ms a call, own 0.474 ms")
    assert part[2].split() == ["0.200", "ms", "1.0x", "aten::mm"]
    assert part[3].split() == ["0.050", "ms", "0.5x", "aten::empty"]
    assert part[4].split() == ["0.025", "ms", "0.5x", "cudaMemsetAsync"]
    assert "evaluate_function" not in "\n".join(part)
