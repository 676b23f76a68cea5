"""benchmarks/gpu_peers.sh's plan, checked on the CPU before a GPU call spends
its minutes on it: DRY_RUN=1 prints every step and part with its limit and
exact command and runs nothing.  Checked here:

- the parts run in the order given, each with its limit, inside the deadline;
- every benchmark command it would run parses with that benchmark's own
  argument parser, and every row it names is a row the benchmark knows (a
  misspelt row would otherwise cost the run);
- where Transformer Engine is carried the TE rows and the TE module part are
  planned; where the attention probe says TE's attention is not fused, the
  ESM-2 TE rows on packed batches are left out and the run says why; without
  .te the TE module part is not run and says so;
- the ESM-2 rows include Hugging Face on torchao's float8 (hfao), after the
  compiled HF rows; without a torchao wheel in .whl the run says its torchao
  rows will be skipped;
- an unknown part stops the script before anything runs.

The script is copied into a scratch tree with stand-in .te and .whl files
(their names are all a dry run reads)."""
import argparse
import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
for sub in ("", "esm2", "llama3"):
    path = os.path.join(BENCH, sub) if sub else BENCH
    if path not in sys.path:
        sys.path.insert(0, path)

PARTS = "esm2,te_modules,torchao,liger_llama"


def dry_run(tmp_path, parts=PARTS, te=True, ao=True, **env):
    tree = tmp_path / "tree"
    (tree / "benchmarks").mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(BENCH, "gpu_peers.sh"), tree / "benchmarks" / "gpu_peers.sh")
    (tree / ".whl").mkdir(exist_ok=True)
    wheel = tree / ".whl" / "torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"
    if ao:
        wheel.write_bytes(b"")
    else:
        (tree / ".whl" / "hydra_core-1.3.2-py3-none-any.whl").write_bytes(b"")
        wheel.unlink(missing_ok=True)
    if te:
        (tree / ".te").mkdir(exist_ok=True)
        (tree / ".te" / "transformer_engine_torch-2.20.2.tar.gz").write_bytes(b"")
    run_env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "SEQFUSE_GIT_COMMIT": "abc123",
               **{k: str(v) for k, v in env.items()}}
    p = subprocess.run(["bash", str(tree / "benchmarks" / "gpu_peers.sh"), parts], capture_output=True, text=True,
                       env=run_env, timeout=60)
    return p.returncode, p.stdout + p.stderr


def planned(out):
    """{part: (limit, argv)} of the '===== PART (limit N s): CMD' lines, in order."""
    plan = {}
    for line in out.splitlines():
        if line.startswith("===== ") and "): " in line:
            head, cmd = line[len("===== "):].split("): ", 1)
            name, limit = head.split(" (limit ")
            plan[name] = (int(limit.split()[0]), shlex.split(cmd))
    return plan


class _Parsed(Exception):
    pass


def parsed_args(main, argv, monkeypatch):
    """The namespace ``main(argv)`` parses, stopping right after its parse_args (nothing runs)."""
    real = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", grab)
        with pytest.raises(_Parsed) as e:
            main(argv)
    return e.value.args[0]


def test_plan_orders_parts_and_every_command_parses(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import bench_esm2
    import bench_llama3
    from peers import bench_te_modules, bench_torchao

    rc, out = dry_run(tmp_path, DEADLINE=560, ESM2_LIMIT=150, TE_MODULES_LIMIT=90, TORCHAO_LIMIT=100,
                      LIGER_LLAMA_LIMIT=90, TE_PROBE="fused", TORCHAO_ARGS="--shapes llama_1b",
                      TE_MODULES_ARGS="--modules TransformerLayer,LayerNormMLP,Linear,LayerNormLinear")
    assert rc == 0, out
    assert "DRY RUN: nothing runs" in out and "would build Transformer Engine" in out and "would build seqfuse" in out
    assert "would point CUDNN_HOME at torch's cuDNN" in out and "WARNING" not in out
    plan = planned(out)
    assert list(plan) == PARTS.split(",")
    assert [plan[p][0] for p in plan] == [150, 90, 100, 90]
    mains = {"benchmarks/esm2/bench_esm2.py": bench_esm2.main, "benchmarks/peers/bench_te_modules.py":
             bench_te_modules.main, "benchmarks/peers/bench_torchao.py": bench_torchao.main,
             "benchmarks/llama3/bench_llama3.py": bench_llama3.main}
    spaces = {}
    for part, (_, argv) in plan.items():
        assert argv[0] == "python3" and argv[1] in mains, argv
        spaces[part] = parsed_args(mains[argv[1]], argv[2:], monkeypatch)
    esm_rows = spaces["esm2"].rows.split(",")
    for r in esm_rows:
        bench_esm2.parse_row(r)  # raises on a row the benchmark does not know
    assert {"te_bf16_packed", "te_fp8_delayed_packed", "hf_bf16_padded", "hfcompile_bf16_padded"} <= set(esm_rows)
    # HF on torchao's float8 (tensorwise, compiled) after the compiled HF rows, before the block-scaling rows
    ao = [r for r in esm_rows if bench_esm2.parse_row(r)[0] == "hfao"]
    assert ao == ["hfao_fp8_tensorwise_fixed", "hfao_fp8_tensorwise_padded"]
    at = esm_rows.index
    assert at("hfcompile_bf16_padded") < at(ao[0]) and at(ao[-1]) < min(at("te_fp8_block_fixed"),
                                                                        at("seqfuse_fp8_block_fixed"))
    assert "would install into" in out and "torchao-0.18.0" in out and "no torchao wheel" not in out
    assert spaces["esm2"].size == "650M" and spaces["esm2"].out == "esm2_peers"
    llama_rows = spaces["liger_llama"].rows.split(",")
    for r in llama_rows:
        bench_llama3.parse_train_row(r)
    assert "hf_bf16_liger" in llama_rows and spaces["liger_llama"].out == "llama3_liger"
    assert spaces["liger_llama"].parts == "train" and spaces["liger_llama"].size == "1B"
    assert spaces["te_modules"].modules.startswith("TransformerLayer,") and spaces["torchao"].shapes == "llama_1b"


def test_plan_without_fused_te_attention_leaves_out_the_packed_te_rows(tmp_path):
    rc, out = dry_run(tmp_path, parts="esm2", TE_PROBE="unfused")
    assert rc == 1, out  # the run is marked failed: its TE rows are against a handicapped TE
    assert "does NOT run cuDNN fused attention" in out and "packed batches are left out" in out
    rows = planned(out)["esm2"][1]
    rows = rows[rows.index("--rows") + 1].split(",")
    assert not [r for r in rows if r.startswith("te_") and r.endswith("_packed")]
    assert "te_bf16_fixed" in rows and "seqfuse_bf16_packed" in rows
    rc, out = dry_run(tmp_path, parts="esm2", TE_PROBE="unfused", TE_UNFUSED_PACKED=1)
    rows = planned(out)["esm2"][1]
    assert "te_bf16_packed" in rows[rows.index("--rows") + 1].split(",")


def test_plan_without_a_torchao_wheel_says_its_rows_will_be_skipped(tmp_path):
    rc, out = dry_run(tmp_path, parts="esm2,torchao", ao=False)
    assert rc == 0, out
    assert "no torchao wheel in .whl: the torchao part and the ESM-2 hfao rows will be skipped" in out
    assert list(planned(out)) == ["esm2", "torchao"]  # they still run: their torchao rows say why they skipped


def test_plan_without_te_carried_skips_the_te_module_part(tmp_path):
    rc, out = dry_run(tmp_path, parts="te_modules,torchao", te=False)
    assert rc == 1 and "no .te carried" in out and "te_modules: NOT RUN" in out, out
    assert list(planned(out)) == ["torchao"]


def test_plan_cuts_limits_to_the_deadline_and_refuses_unknown_parts(tmp_path):
    rc, out = dry_run(tmp_path, parts="torchao,liger_llama", DEADLINE=100, TORCHAO_LIMIT=240, LIGER_LLAMA_LIMIT=120)
    assert rc == 0, out
    assert all(limit <= 100 for limit, _ in planned(out).values())
    rc, out = dry_run(tmp_path, parts="esm2,bogus")
    assert rc == 2 and "unknown part 'bogus'" in out and "=====" not in out
