"""CHECK_EVERY, the case sampling of the standalone check programs
(csrc/core/check_util.h), compiled into a small host program with the C++
compiler: every Nth case of each call site runs (each kind of case at least
its first, whatever ran before it), the closing line names the sampling,
and a bad value stops the program naming the variable and its rule."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = r"""
#include "core/check_util.h"

static void few(int i)  { if (!check_take_case()) return; printf("few %d\n", i); }
static void many(int i) { if (!check_take_case()) return; printf("many %d\n", i); }

int main(void)
{
    for (int i = 0; i < 20; i++) many(i);
    for (int i = 0; i < 3; i++) few(i);
    for (int i = 0; i < 5; i++) check_report(1, "x");
    return check_finish("check_sampling");
}
"""


def cuda_home():
    """The CUDA toolkit holding cuda_runtime.h and the static runtime (check_util.h's
    buffers and timers call it; nothing here runs on a GPU), or None."""
    nvcc = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or (os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda")
    ok = (os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))
          and os.path.exists(os.path.join(home, "lib64", "libcudart_static.a")))
    return home if ok else None


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    home, cxx = cuda_home(), shutil.which("g++") or shutil.which("c++")
    if home is None or cxx is None:
        pytest.skip(f"needs a C++ compiler and the CUDA toolkit (g++: {cxx}, toolkit: {home})")
    d = tmp_path_factory.mktemp("check_sampling")
    src, exe = d / "p.cpp", d / "p"
    src.write_text(PROGRAM)
    r = subprocess.run([cxx, "-std=c++17", "-O0", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/include", f"-I{home}/include",
                        str(src), "-o", str(exe), f"-L{home}/lib64", "-lcudart_static", "-ldl", "-lrt", "-lpthread"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(exe)


def run(program, every):
    env = dict(os.environ)
    env.pop("CHECK_EVERY", None)
    if every is not None:
        env["CHECK_EVERY"] = every
    return subprocess.run([program], capture_output=True, text=True, env=env, timeout=60)


def lines(r, kind):
    return [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith(kind + " ")]


def test_unset_runs_every_case(program):
    r = run(program, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert lines(r, "many") == list(range(20)) and lines(r, "few") == [0, 1, 2]
    assert r.stdout.splitlines()[-1] == "check_sampling: 5 passed, 0 failed"


def test_every_nth_case_of_each_call_site(program):
    r = run(program, "8")
    assert r.returncode == 0, r.stdout + r.stderr
    # counted per call site: 'few' runs its first case although 20 'many' cases came before
    assert lines(r, "many") == [0, 8, 16] and lines(r, "few") == [0]
    assert r.stdout.splitlines()[-1] == "check_sampling: 5 passed, 0 failed (every 8th case)"
    assert run(program, "2").stdout.splitlines()[-1].endswith("(every 2nd case)")


@pytest.mark.parametrize("value", ["0", "-3", "x", "8x", "", "1000001"])
def test_bad_value_stops_naming_the_variable(program, value):
    r = run(program, value)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CHECK_EVERY must be a whole number from 1 to 1000000" in r.stderr and repr(value) in r.stderr.replace('"', "'")
    assert "many" not in r.stdout
