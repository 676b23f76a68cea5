"""What every peer benchmark records beside its figures, and how it finds out
whether a peer library can run here.

``run_metadata()`` gives the git commit (the environment variable
SEQFUSE_GIT_COMMIT when set: the GPU machine's copy of the tree may carry a
.git that lags it; else ``git`` when the checkout has its .git), the versions of torch,
transformers, seqfuse and each peer (from the installed distributions, or the
__version__ of a package this process imported from a path: no
peer is imported for this), the exact command line and the SHA-256 of the
script that ran, so a figure can be traced to the code that made it.

``try_import(name)`` imports a peer once and says why it cannot be used
(the exception's type and text) instead of raising: a row whose peer is not
importable is kept in the table as skipped, with that reason.
"""
import hashlib
import importlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time

#: Distributions whose versions every result records ("not installed" when absent).
DISTRIBUTIONS = ("torch", "transformers", "seqfuse", "transformer_engine", "transformer_engine_cu13",
                 "transformer_engine_torch", "torchao", "liger_kernel", "triton")

_IMPORTS = {}


def _dist_version(name):
    """The installed distribution's version; else, for a package this process
    imported from a path (seqfuse from python/ on the GPU machine, its
    extension built elsewhere), its __version__ and where it came from; else
    "not installed"."""
    for candidate in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    if version is not None:
        return f"{version} (imported from {os.path.dirname(getattr(module, '__file__', '') or '')}, no distribution)"
    return "not installed"


def _git_head(root):
    """HEAD of the checkout's .git, or None (no .git, or git failed)."""
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(root):
    """(commit, dirty, source): $SEQFUSE_GIT_COMMIT when set (the GPU machine's
    copy of .git can lag the tree it is sent with, so the caller's word wins),
    else from git where ``root`` has a .git; dirty is None where it cannot be
    known."""
    env = os.environ.get("SEQFUSE_GIT_COMMIT")
    if env:
        seen = _git_head(root)
        note = "" if seen is None or seen.startswith(env) else f"; the checkout's .git says {seen}"
        return env, None, "SEQFUSE_GIT_COMMIT (set by the caller)" + note
    if os.path.exists(os.path.join(root, ".git")):
        try:
            sha = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                                 check=True, timeout=20).stdout.strip()
            status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=True, timeout=20).stdout
            return sha, bool(status.strip()), "git"
        except (OSError, subprocess.SubprocessError) as e:
            return f"unknown (git failed: {type(e).__name__}: {e})", None, "git"
    return "unknown (no .git here and SEQFUSE_GIT_COMMIT unset)", None, "none"


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_metadata(script=None, argv=None):
    """The record every result JSON carries (see the module note)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = list(sys.argv if argv is None else argv)
    script = os.path.abspath(script or argv[0])
    sha, dirty, source = git_commit(root)
    meta = {
        "git_commit": sha,
        "git_dirty": dirty,
        "git_commit_source": source,
        "command": shlex.join(["python3"] + argv),
        "cwd": os.getcwd(),
        "script": os.path.relpath(script, root) if script.startswith(root) else script,
        "script_sha256": file_sha256(script) if os.path.isfile(script) else None,
        "python": platform.python_version(),
        "versions": {d: _dist_version(d) for d in DISTRIBUTIONS},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # the switches seqfuse reads from the environment (SEQFUSE_GEMM_TUNE, SEQFUSE_ATTN_BACKEND, ...)
        "seqfuse_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SEQFUSE_")},
    }
    try:
        import torch

        meta["versions"]["torch_runtime"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return meta


def try_import(name):
    """(module, None) when ``name`` imports, else (None, reason).  Cached."""
    if name not in _IMPORTS:
        try:
            _IMPORTS[name] = (importlib.import_module(name), None)
        except Exception as e:  # noqa: BLE001 - any failure makes the peer unusable; the reason is kept
            _IMPORTS[name] = (None, f"{name} not importable here: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _IMPORTS[name]


def skip_reason(name, need_cuda=True):
    """None when the peer ``name`` can run here, else why not (no GPU, or not importable)."""
    if need_cuda:
        import torch

        if not torch.cuda.is_available():
            return f"{name}: needs a CUDA GPU (none here)"
    return try_import(name)[1]
