"""Build seqfuse._C: plain C (the CPython extension and the CPU backend) and,
where nvcc is found, the CUDA backend, compiled in parallel and linked into one
shared object.  No libtorch, no pybind11: one build serves any PyTorch release.

Environment:
  SEQFUSE_CUDA=0           CPU-only build even where nvcc exists.
  SEQFUSE_CUDA_ARCHS=...   semicolon list of gencode targets, default
                           "90a;80;80-ptx" (sm_90a, sm_80 and PTX for newer GPUs).
  CUDA_HOME                toolkit root; otherwise nvcc is looked up on PATH.
  MAX_JOBS                 parallel compile jobs (default: CPU count).
"""
import copy
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def find_cuda_home():
    """The CUDA toolkit the library builds with, or None (SEQFUSE_CUDA=0: CPU only)."""
    return None if os.environ.get("SEQFUSE_CUDA", "1") == "0" else cuda_toolkit()


def cuda_toolkit():
    """The CUDA toolkit's root: CUDA_HOME / CUDA_PATH, else nvcc on PATH with
    its links resolved, else /usr/local/cuda; None if there is none."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


CUDA_HOME = find_cuda_home()
ARCHS = os.environ.get("SEQFUSE_CUDA_ARCHS", "90a;80;80-ptx").split(";")
JOBS = int(os.environ.get("MAX_JOBS", os.cpu_count() or 2))


def gencode_flags():
    flags = []
    for a in ARCHS:
        a = a.strip()
        if not a:
            continue
        if a.endswith("-ptx"):
            a = a[: -len("-ptx")]
            flags.append(f"-gencode=arch=compute_{a},code=compute_{a}")
        else:
            flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    return flags


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


# check_*.cu are standalone kernel checks with their own main() (csrc/build_checks.sh)
C_SOURCES = sources("csrc/*/*.c")
CU_SOURCES = [s for s in sources("csrc/*/*.cu") if not os.path.basename(s).startswith("check_")] if CUDA_HOME else []
INCLUDES = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
CC_DESC = f"{sysconfig.get_config_var('CC') or 'cc'}"

define_macros = [("SF_COMPILER_DESC", f'"{CC_DESC}"')]
libraries, library_dirs, rpaths = [], [], []
if CUDA_HOME:
    lib64 = os.path.join(CUDA_HOME, "lib64")
    if not os.path.isdir(lib64):
        lib64 = os.path.join(CUDA_HOME, "lib")
    INCLUDES.append(os.path.join(CUDA_HOME, "include"))
    define_macros += [("SF_WITH_CUDA", "1"), ("SF_CUDA_ARCHS", '"' + ";".join(ARCHS) + '"')]
    libraries += ["cudart_static", "cublasLt", "stdc++", "dl", "rt", "pthread"]
    library_dirs.append(lib64)
    rpaths.append(lib64)


# CPU seconds of each nvcc unit with the default archs (90a;80;80-ptx), from
# csrc/time_units.sh (benchmarks/results/logs/build_units_s13.txt).  Only their
# order matters: the pool below starts the costliest first, so that the build
# does not end with one core compiling a long unit while the other idles.
UNIT_CPU_S = {
    "csrc/attn/attn_backward_cuda.cu": 60.2,
    "csrc/norm/norm_cuda.cu": 56.2,
    "csrc/act/act_cuda.cu": 31.5,
    "csrc/attn/attn_forward_cuda.cu": 25.9,
    "csrc/quant/cast_cuda.cu": 25.1,
    "csrc/quant/block_cuda.cu": 17.2,
    "csrc/moe/moe_cuda.cu": 8.5,
    "csrc/optim/optim_cuda.cu": 6.9,
    "csrc/attn/attn_forward_sm90_cuda.cu": 6.6,
    "csrc/rope/rope_cuda.cu": 6.6,
    "csrc/loss/cross_entropy_cuda.cu": 6.6,
    "csrc/attn/attn_backward_sm90_cuda.cu": 6.6,
    "csrc/gemm/gemm_cuda.cu": 4.2,
    "csrc/quant/amax_cuda.cu": 3.2,
    "csrc/grouped/grouped_cuda.cu": 1.5,
}
C_UNIT_CPU_S = 0.22  # (8.5 s / 39 files, logs/build_units_s13.txt) a plain C file of the CPU backend or the bindings, -O2


def unit_cost(src):
    """Scheduling weight of one source file.  A .cu unit missing from
    UNIT_CPU_S (a new one) is scheduled first, as if it were the costliest,
    and named, so that the table gets its measurement."""
    if not src.endswith(".cu"):
        return C_UNIT_CPU_S
    if src not in UNIT_CPU_S:
        print(f"seqfuse: {src} has no measured cost in setup.py's UNIT_CPU_S; "
              f"scheduled first (measure it with csrc/time_units.sh)", flush=True)
        return float("inf")
    return UNIT_CPU_S[src]


class BuildExt(build_ext):
    """Compiles the .cu files (nvcc) and the .c files (the C compiler) on one
    pool of MAX_JOBS threads, costliest first, then hands every object to the
    normal link.  One pool for both, not the CUDA units and then the C files:
    distutils compiles an extension's C files one after another on one core."""

    def build_extension(self, ext):
        start = time.time()
        units = sorted(CU_SOURCES + list(ext.sources), key=unit_cost, reverse=True)
        with ThreadPoolExecutor(max_workers=JOBS) as pool:
            objects = list(pool.map(lambda src: self.compile_one(ext, src), units))
        # the link only: every object is built; the sources and the objects stay
        # in depends, so that an edited .c file or a rebuilt .cu object still
        # makes the extension out of date (distutils links only then)
        link = copy.copy(ext)
        link.sources = []
        link.depends = list(ext.sources) + list(ext.depends) + objects
        link.extra_objects = list(ext.extra_objects or []) + objects
        link.language = "c"
        # relink also when the objects are other ones than last time (another
        # settings folder, flags_dir), even if none is newer than the library
        target = self.get_ext_fullpath(ext.name)  # in place or under build/lib: one stamp each
        stamp = os.path.join(self.build_temp, "linked-" + hashlib.sha1(target.encode()).hexdigest()[:10] + ".txt")
        force = self.force
        self.force = force or objects_changed(stamp, objects)
        try:
            super().build_extension(link)
        finally:
            self.force = force
        with open(stamp, "w") as f:
            f.write("\n".join(objects))
        print(f"seqfuse: built {ext.name} in {time.time() - start:.1f} s "
              f"({'CUDA ' + ';'.join(ARCHS) if CUDA_HOME else 'CPU only'}, {JOBS} jobs)")

    def compile_one(self, ext, src):
        if src.endswith(".cu"):
            return self.compile_cuda(src)
        macros = ext.define_macros[:] + [(name,) for name in ext.undef_macros]
        out_dir = flags_dir(self.build_temp, "c", self.compiler.compiler_so, macros, ext.include_dirs,
                            ext.extra_compile_args, self.debug)
        (obj,) = self.compiler.object_filenames([src], output_dir=out_dir)
        if not self.force and up_to_date(obj, src):
            return obj
        (obj,) = self.compiler.compile([src], output_dir=out_dir, macros=macros,
                                       include_dirs=ext.include_dirs, debug=self.debug,
                                       extra_postargs=ext.extra_compile_args or [],
                                       depends=ext.depends)
        return obj

    def compile_cuda(self, src):
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler", "-fPIC",
                 "-DSF_WITH_CUDA=1", *[f"-I{i}" for i in INCLUDES], *gencode_flags()]
        out_dir = flags_dir(self.build_temp, "cuda", nvcc_identity(nvcc), flags,
                            [os.environ.get(v) for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")])
        os.makedirs(out_dir, exist_ok=True)
        obj = os.path.join(out_dir, src.replace(os.sep, "_") + ".o")
        if not self.force and up_to_date(obj, src):
            return obj
        cmd = [nvcc, "-c", src, "-o", obj, *flags]
        print(" ".join(cmd), flush=True)
        subprocess.check_call(cmd, cwd=ROOT)
        return obj


def up_to_date(obj, src):
    """``obj`` exists and is newer than ``src`` and every csrc header
    (distutils' own compile rebuilds every C file each time)."""
    return os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header())


def objects_changed(stamp, objects):
    """Whether ``objects`` differ from the ones the last link (recorded in
    ``stamp``) used: the link must then run even if no object is newer than
    the library (another settings folder, flags_dir)."""
    linked = open(stamp).read() if os.path.exists(stamp) else None
    return linked != "\n".join(objects)


@functools.lru_cache(maxsize=None)
def nvcc_identity(nvcc):
    """nvcc's resolved path and its --version text: a toolkit swapped behind
    the same path gets a new object folder."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return os.path.realpath(nvcc), version


def flags_dir(build_temp, kind, *settings):
    """The object folder of one set of compile settings: a build with another
    compiler, flags (CFLAGS, NVCC_*_FLAGS), macros or architectures
    (SEQFUSE_CUDA=0, SEQFUSE_CUDA_ARCHS) never reuses another's objects."""
    key = hashlib.sha1(repr(settings).encode()).hexdigest()[:10]
    return os.path.join(build_temp, f"{kind}-{key}")


@functools.lru_cache(maxsize=None)
def newest_header():
    """The newest mtime of csrc's headers, read once per build (every CUDA
    unit's staleness test compares against it)."""
    headers = glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)
    headers += glob.glob(os.path.join(ROOT, "csrc", "**", "*.cuh"), recursive=True)
    return max((os.path.getmtime(h) for h in headers), default=0)


ext = Extension(
    "seqfuse._C",
    sources=C_SOURCES,
    include_dirs=INCLUDES,
    define_macros=define_macros,
    libraries=libraries,
    library_dirs=library_dirs,
    runtime_library_dirs=rpaths,
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", "-fvisibility=hidden"],
    depends=sources("csrc/**/*.h"),
)

if __name__ == "__main__":  # (setuptools runs this file as __main__; tests import its rules)
    setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
