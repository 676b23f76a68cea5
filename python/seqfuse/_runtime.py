"""What was built and what runs now."""
from . import _C


def build_info():
    """What this build of seqfuse._C compiled in: a dict with ``cuda`` (bool),
    ``cuda_archs``, ``cuda_runtime``, ``cublaslt`` and ``nccl`` versions (0 when
    not compiled in), the C compiler and the Python it was built for."""
    return _C.build_info()


def cuda_available():
    """True when the CUDA backend was compiled in and a CUDA device is usable now."""
    return bool(_C.build_info()["cuda"]) and _C.cuda_device_count() > 0


def device_info():
    """The CUDA devices seqfuse can use now, as a list of dicts."""
    devices = []
    for i in range(_C.cuda_device_count()):
        major, minor = _C.cuda_capability(i)
        devices.append({"index": i, "capability": f"{major}.{minor}"})
    return devices
