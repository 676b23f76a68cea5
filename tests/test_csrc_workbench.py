"""The workbench apart from the library (issue 24, item 4), checked on the
sources: the C library reads no environment variable (the kernel choices
that stay are read in Python, ops/attn/_routing.py), and what only the check
programs use (alternative kernel schedules, tuning knobs) is compiled under
SF_WORKBENCH, which csrc/build_checks.sh defines and setup.py does not."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def library_sources():
    """Every C/CUDA source and header the library build compiles or includes:
    csrc/ less the check programs and their helper header."""
    out = []
    for folder, _, files in os.walk(CSRC):
        for name in files:
            if not name.endswith((".c", ".h", ".cu", ".cuh")):
                continue
            if name.startswith("check_"):
                continue
            out.append(os.path.join(folder, name))
    return sorted(out)


def test_library_reads_no_environment():
    readers = []
    for path in library_sources():
        text = open(path, encoding="utf-8").read()
        for m in re.finditer(r"\b(getenv|secure_getenv)\s*\(", text):
            line = text.count("\n", 0, m.start()) + 1
            readers.append(f"{os.path.relpath(path, ROOT)}:{line}")
    assert readers == [], f"the C library must read no environment variable (seqfuse.ops does): {readers}"


def test_workbench_define_only_in_the_checks_build():
    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    assert "SF_WORKBENCH" not in setup, "the library build must not compile the workbench"
    checks = open(os.path.join(CSRC, "build_checks.sh"), encoding="utf-8").read()
    # the kernels' objects and the check programs themselves
    assert checks.count("-DSF_WORKBENCH=1") >= 2


def test_workbench_code_is_guarded():
    """The attention forward's other schedules and the norm split's tuning
    knob exist only under SF_WORKBENCH."""
    forward = open(os.path.join(CSRC, "attn", "attn_forward_sm90_cuda.cu"), encoding="utf-8").read()
    assert re.search(r"#ifdef SF_WORKBENCH\s*\n#include \"attn_forward_sm90_workbench.cuh\"", forward)
    bench = open(os.path.join(CSRC, "attn", "attn_forward_sm90_workbench.cuh"), encoding="utf-8").read()
    assert "#ifndef SF_WORKBENCH\n#error" in bench
    norm = open(os.path.join(CSRC, "norm", "norm_cuda.cu"), encoding="utf-8").read()
    tune = norm.index('extern "C" sf_status sf_norm_cuda_tune(')
    assert norm.rfind("#ifdef SF_WORKBENCH", 0, tune) > norm.rfind("#endif", 0, tune)
