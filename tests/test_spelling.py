"""One spelling for the two passes (issue 24, item 7): the project says
forward / backward, never fwd / bwd, in C, Python, file names and docs.

csrc/rename_forward_backward.py made the rename and its --check mode keeps
it made: the first test runs that check over the repository, so new code
that spells fwd or bwd fails here (with the places listed) unless the
script's ALLOWED list names the occurrence and why it stays.  The others run
the script on small throw-away trees, so the check and the rewrite are seen
to find, rewrite, leave alone and stop where they should."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "csrc", "rename_forward_backward.py")

spec = importlib.util.spec_from_file_location("rename_forward_backward", SCRIPT)
spelling = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spelling)

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def run(*args, root):
    return subprocess.run([sys.executable, SCRIPT, *args, "--root", str(root)],
                          capture_output=True, text=True, timeout=60)


def git_tree(tmp_path, files):
    """A git repository in tmp_path holding files {path: text}, committed."""
    for path, text in files.items():
        full = tmp_path / path
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(text)
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "tree"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, env=env, capture_output=True)
    return tmp_path


def test_repository_spells_forward_and_backward():
    r = run("--check", root=ROOT)
    assert r.returncode == 0, "fwd/bwd spelled in the sources:\n" + r.stdout + r.stderr


C_SOURCE = """\
#ifndef SF_ATTN_BWD_TILES_CUH
#define SF_ATTN_BWD_TILES_CUH
/* fwd+bwd of the sm90fwd schedule */
constexpr int kBwdThreads = 128;
struct FwdParams { int fwd_elems; };
sf_status sf_attn_fwd(const FwdParams *p);
static const char *xfwdy = "a word that only holds the letters";
#endif
"""
PY_SOURCE = """\
from seqfuse.common.recipe import Format


def attention_fwd_kernel(head_dim):
    # Transformer Engine's name stays: Format.HYBRID.value.max_fwd
    return Format.HYBRID.value.max_fwd, Format.HYBRID.value.max_bwd
"""


def test_rewrite_renames_words_and_files_and_is_idempotent(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = git_tree(tmp_path, {"csrc/attn/attn_bwd_tiles.cuh": C_SOURCE, "python/ops.py": PY_SOURCE,
                               "README.md": "The fwd pass, then the BWD pass.\n",
                               "benchmarks/results/old.md": "fwd 1.0 ms\n",
                               "data.json": '{"fwd_ms": 1}\n'})
    r = run(root=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (root / "csrc/attn/attn_bwd_tiles.cuh").exists()
    c = (root / "csrc/attn/attn_backward_tiles.cuh").read_text()
    for new in ("SF_ATTN_BACKWARD_TILES_CUH", "forward+backward of the sm90forward schedule",
                "kBackwardThreads", "struct ForwardParams { int forward_elems; }",
                "sf_attn_forward(const ForwardParams *p)"):
        assert new in c
    assert "xfwdy" in c  # inside a word: not a spelling of the pass
    py = (root / "python/ops.py").read_text()
    assert "def attention_forward_kernel" in py and py.count("max_fwd") == 2 and "max_bwd" in py
    assert (root / "README.md").read_text() == "The forward pass, then the BACKWARD pass.\n"
    # history and data are out of scope
    assert (root / "benchmarks/results/old.md").read_text() == "fwd 1.0 ms\n"
    assert (root / "data.json").read_text() == '{"fwd_ms": 1}\n'
    # the move went through git (the new name is tracked, the old one gone)
    tracked = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True).stdout.split()
    assert "csrc/attn/attn_backward_tiles.cuh" in tracked and "csrc/attn/attn_bwd_tiles.cuh" not in tracked

    before = {p: (root / p).read_text() for p in ("csrc/attn/attn_backward_tiles.cuh", "python/ops.py")}
    again = run(root=root)
    assert again.returncode == 0 and "0 file(s) rewritten, 0 moved" in again.stdout
    assert {p: (root / p).read_text() for p in before} == before

    # what the word-aware rewrite leaves, the check still reports
    check = run("--check", root=root)
    assert check.returncode == 1
    assert "csrc/attn/attn_backward_tiles.cuh:7:" in check.stdout and "xfwdy" in check.stdout
    assert "max_fwd" not in check.stdout and "python/ops.py" not in check.stdout


@needs_git
def test_check_reports_code_names_and_file_names(tmp_path):
    root = git_tree(tmp_path, {"csrc/norm/norm_bwd_16bit_cuda.cu": "int ok;\n",
                               "tests/test_x.py": "def test_fwd():\n    pass\n",
                               "python/fine.py": "def forward():\n    return 'backward'\n"})
    r = run("--check", root=root)
    assert r.returncode == 1
    assert "csrc/norm/norm_bwd_16bit_cuda.cu: the file name spells fwd/bwd" in r.stdout
    assert "tests/test_x.py:1: def test_fwd():" in r.stdout
    assert "fine.py" not in r.stdout and "2 place(s)" in r.stdout


@needs_git
def test_collision_stops_before_writing(tmp_path):
    """fwd next to an existing forward in one file's code would merge two names."""
    text = "def forward(x):\n    return x\n\n\ndef run(x):\n    fwd = forward(x)\n    return fwd\n"
    root = git_tree(tmp_path, {"python/m.py": text, "python/other.py": "attention_fwd = 1\n"})
    r = run(root=root)
    assert r.returncode == 2
    assert "python/m.py:6: renaming fwd would give forward" in r.stdout
    # nothing written anywhere, the file without a collision included
    assert (root / "python/m.py").read_text() == text
    assert (root / "python/other.py").read_text() == "attention_fwd = 1\n"


def test_a_prose_word_is_no_collision():
    """'forward' in a comment or string names nothing: only code names count."""
    text = "# the forward pass\ndef run(x):\n    fwd = x  # not the forward\n    return fwd, 'forward'\n"
    assert spelling._collisions("python/m.py", text) == []
    assert spelling._collisions("python/m.py", text + "forward = 1\n") == [("fwd", "forward", 3)]


def test_collision_settled_by_the_lists(monkeypatch):
    """OVERRIDES renames a file's code name its own way (comments and strings
    keep to the general rule); REVIEWED lets the plain rename through."""
    text = "def backward(ctx):\n    bwd = dict(a=1)  # the bwd keywords\n    return f(**bwd), 'bwd'\n"
    assert spelling._collisions("python/m.py", text) == [("bwd", "backward", 2)]
    monkeypatch.setattr(spelling, "OVERRIDES", [("python/m.py", "bwd", "backward_args", "test")])
    assert spelling._collisions("python/m.py", text) == []
    out = spelling.respell(spelling._overridden("python/m.py", text))
    assert out == ("def backward(ctx):\n    backward_args = dict(a=1)  # the backward keywords\n"
                   "    return f(**backward_args), 'backward'\n")
    monkeypatch.setattr(spelling, "OVERRIDES", [])
    monkeypatch.setattr(spelling, "REVIEWED", [("python/m.py", "bwd", "test")])
    assert spelling._collisions("python/m.py", text) == []


def test_member_and_plain_names():
    """In Python, self.fwd next to a plain forward is no collision; next to
    self.forward it is (an nn.Module's own forward would be overwritten).  C
    declares members as plain names, so there any use of the new name counts."""
    assert spelling._collisions("python/m.py", "def forward(self):\n    self.fwd = 1\n") == []
    assert spelling._collisions("python/m.py", "self.forward = 2\nself.fwd = 1\n") == [("fwd", "forward", 2)]
    c = "struct P { int fwd; };\n/* forward */ void f(P *p) { p->fwd = 1; }\n"
    assert spelling._collisions("csrc/a.c", c) == []
    assert spelling._collisions("csrc/a.c", c + "int forward;\n") == [("fwd", "forward", 1)]


def test_respell_forms():
    assert spelling.respell("attn_fwd_cuda sm90bwd kBwdThreads FP8FwdTensors SEQFUSE_ATTN_FWD_KERNEL") == \
        "attn_forward_cuda sm90backward kBackwardThreads FP8ForwardTensors SEQFUSE_ATTN_FORWARD_KERNEL"
    assert spelling.respell("fwd+bwd, fwd/bwd") == "forward+backward, forward/backward"
    # inside other words nothing changes
    assert spelling.respell("xfwdy FWDX Fwdx") == "xfwdy FWDX Fwdx"


def test_kernel_variables_under_their_former_names_are_refused(monkeypatch):
    """SEQFUSE_ATTN_FWD_KERNEL / _BWD_KERNEL became ..._FORWARD_KERNEL /
    ..._BACKWARD_KERNEL; a job that still sets the old name gets a ValueError
    naming the new one instead of the default kernel without a word."""
    from seqfuse.ops.attn import _routing
    for former, now, direction in (("SEQFUSE_ATTN_FWD_KERNEL", "SEQFUSE_ATTN_FORWARD_KERNEL", "forward"),
                                   ("SEQFUSE_ATTN_BWD_KERNEL", "SEQFUSE_ATTN_BACKWARD_KERNEL", "backward")):
        monkeypatch.setattr(_routing, "_kernel_env_pending", {"forward", "backward"})
        monkeypatch.delenv("SEQFUSE_ATTN_FWD_KERNEL", raising=False)
        monkeypatch.delenv("SEQFUSE_ATTN_BWD_KERNEL", raising=False)
        monkeypatch.delenv(now, raising=False)
        monkeypatch.setenv(former, "sm80")
        with pytest.raises(ValueError, match=f"{former} is now spelled {now}: set {now} instead"):
            _routing._apply_kernel_env(direction)
        assert direction in _routing._kernel_env_pending  # asked again until fixed
        # the other direction reads its own variable only (unset here: the default, no C call)
        other = "backward" if direction == "forward" else "forward"
        _routing._apply_kernel_env(other)
        assert other not in _routing._kernel_env_pending
