"""CHECK_EVERY, the case sampling of the standalone check programs
(csrc/core/check_util.h), compiled into a small host program with the C++
compiler: one case in each block of N of a call site runs, the first always
(whatever ran before it), at a hashed offset so that kinds a case function
serves in turn are all reached; the closing line names the sampling, and a
bad value stops the program naming the variable and its rule."""
import os
import shutil
import subprocess

import pytest

from helpers import cuda_toolkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = r"""
#include "core/check_util.h"

static void few(int i)  { if (!check_take_case()) return; printf("few %d\n", i); }
static void many(int i) { if (!check_take_case()) return; printf("many %d\n", i); }
static void kind(const char *name, int i) { if (!check_take_case()) return; printf("%s %d\n", name, i); }

int main(void)
{
    for (int i = 0; i < 20; i++) many(i);
    for (int i = 0; i < 3; i++) few(i);
    for (int i = 0; i < 20; i++) { /* one case function, four kinds in turn (check_norm's shape) */
        kind("k0", i); kind("k1", i); kind("k2", i); kind("k3", i);
    }
    for (int i = 0; i < 5; i++) check_report(1, "x");
    return check_finish("check_sampling");
}
"""


def cuda_runtime():
    """(include dir, lib dir holding the static CUDA runtime) of the toolkit, or None
    (check_util.h's buffers and timers call the runtime; nothing here runs on a GPU)."""
    home = cuda_toolkit()
    if home is None or not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
        return None
    lib = next((os.path.join(home, d) for d in ("lib64", "lib")
                if os.path.exists(os.path.join(home, d, "libcudart_static.a"))), None)
    return (os.path.join(home, "include"), lib) if lib else None


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    rt, cxx = cuda_runtime(), shutil.which("g++") or shutil.which("c++")
    if rt is None or cxx is None:
        pytest.skip(f"needs a C++ compiler and the CUDA toolkit's static runtime (g++: {cxx}, toolkit: {cuda_toolkit()})")
    inc, lib = rt
    d = tmp_path_factory.mktemp("check_sampling")
    src, exe = d / "p.cpp", d / "p"
    src.write_text(PROGRAM)
    r = subprocess.run([cxx, "-std=c++17", "-O0", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/include", f"-I{inc}",
                        str(src), "-o", str(exe), f"-L{lib}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"], capture_output=True, text=True)
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


def kept(count, n):
    """The case indices of one call site that CHECK_EVERY=n keeps (check_util.h's
    check_take_nth, written again here: block 0's first case, then per block an
    offset from splitmix64's finalizer of the block number)."""
    m = (1 << 64) - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    return [k for k in range(count) if k % n == (0 if k // n == 0 else mix(k // n) % n)]


def test_unset_runs_every_case(program):
    r = run(program, None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert lines(r, "many") == list(range(20)) and lines(r, "few") == [0, 1, 2]
    assert all(lines(r, f"k{j}") == list(range(20)) for j in range(4))
    assert r.stdout.splitlines()[-1] == "check_sampling: 5 passed, 0 failed"


@pytest.mark.parametrize("n", [2, 3, 8])
def test_one_case_in_n_of_each_call_site(program, n):
    r = run(program, str(n))
    assert r.returncode == 0, r.stdout + r.stderr
    # counted per call site: 'few' runs its first case although 20 'many' cases came before
    assert lines(r, "many") == kept(20, n) and lines(r, "few")[:1] == [0]
    assert lines(r, "few") == kept(3, n)
    # four kinds from one call site in turn (80 cases): a fixed stride of 2 or 8 would run kind 0 alone
    got = sorted((i, j) for j in range(4) for i in lines(r, f"k{j}"))
    assert got == sorted((k // 4, k % 4) for k in kept(80, n))
    assert {j for _, j in got} == {0, 1, 2, 3}
    th = {2: "nd", 3: "rd", 8: "th"}[n]
    assert r.stdout.splitlines()[-1] == f"check_sampling: 5 passed, 0 failed (every {n}{th} case)"


@pytest.mark.parametrize("value", ["0", "-3", "x", "8x", "", "1000001"])
def test_bad_value_stops_naming_the_variable(program, value):
    r = run(program, value)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CHECK_EVERY must be a whole number from 1 to 1000000" in r.stderr and repr(value) in r.stderr.replace('"', "'")
    assert "many" not in r.stdout
