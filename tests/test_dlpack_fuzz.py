"""Fuzz of the DLPack import (issue 23): random hand-made capsules fed to
seqfuse._C, each one either accepted and read exactly or refused with a
message that names the argument and the rule, never a crash.

Each case draws, from its own seed: a dtype (every one seqfuse takes, and
others: float64, int8, multi-lane, an unknown code), 0-4 dimensions (and
sometimes 9, or a negative count), sizes 0-5 (sometimes negative), strides
(NULL for row-major, or each in -7..7, 0 included), a byte offset, a data
pointer (into a buffer of random finite values placed so every element the
layout reaches lies inside it, or NULL), a device (CPU, pinned host, CUDA,
managed, or one seqfuse cannot use), a capsule kind (versioned 1.x, versioned
with another major, legacy from a producer that takes max_version, legacy
from one that does not) and a read-only flag.  The expected outcome follows
from the DLPack rules seqfuse states (py_call.c); for an accepted tensor
_C.describe must report the same dtype, shape, strides (NULL: row-major),
device and address (data + byte_offset) (strides: where the tensor has
elements), and on the CPU _C.amax must equal
max |x| computed by numpy over the same memory with the same strides.  The
producer's deleter must have run exactly once per export, accepted or not.

A layout whose extent overruns its memory is not drawn: DLPack carries no
size, so the import trusts non-torch producers there (torch tensors' storage
is checked; see tests/test_bad_input_corpus.py's shrunk_storage cases).

Cases run in worker subprocesses (this file is the worker: ``python
test_dlpack_fuzz.py <seed> <first> <last>``), so a crash is a failure naming
the case.  SEQFUSE_FUZZ_SEED picks another seed (printed), SEQFUSE_FUZZ_CASES
the count.
"""
import json
import os
import random
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = int(os.environ.get("SEQFUSE_FUZZ_SEED", "23"))
COUNT = int(os.environ.get("SEQFUSE_FUZZ_CASES", "600"))

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_OPENCL, KDL_VULKAN, KDL_METAL, KDL_ROCM, KDL_MANAGED = 1, 2, 3, 4, 7, 8, 10, 13
INT, UINT, FLOAT, BFLOAT, BOOL = 0, 1, 2, 4, 6
E4M3, E5M2, E8M0 = 10, 12, 14  # DLPack 1.1's float8 codes (kDLFloat8_e4m3fn, kDLFloat8_e5m2, kDLFloat8_e8m0fnu)

# (code, bits) -> seqfuse's dtype name, for the ones it takes
TAKEN = {(FLOAT, 32): "float32", (FLOAT, 16): "float16", (BFLOAT, 16): "bfloat16", (E4M3, 8): "float8_e4m3fn",
         (E5M2, 8): "float8_e5m2", (E8M0, 8): "float8_e8m0fnu", (INT, 32): "int32", (INT, 64): "int64",
         (UINT, 8): "uint8", (BOOL, 8): "bool"}
OTHER = [(FLOAT, 64), (INT, 8), (INT, 16), (UINT, 16), (FLOAT, 8), (99, 32), (BFLOAT, 32)]
BUF_BYTES = 8192


def draw(i, seed=SEED):
    """The spec of case i (plain data, the same in the runner and the worker)."""
    r = random.Random(seed * 1_000_003 + i)
    code, bits = r.choice(list(TAKEN)) if r.random() < 0.85 else r.choice(OTHER)
    lanes = 1 if r.random() < 0.95 else r.choice([2, 4])
    ndim = r.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])
    shape = [r.choice([0, 1, 2, 3, 4, 5]) if r.random() < 0.93 else r.randint(1, 3) for _ in range(ndim)]
    if r.random() < 0.04 and ndim:
        shape[r.randrange(ndim)] = -r.randint(1, 3)
    claimed_ndim = None
    if r.random() < 0.03:
        claimed_ndim = r.choice([9, -1])
        shape = shape if claimed_ndim == -1 else [1] * 9
    strides = None if r.random() < 0.3 else [r.randint(-7, 7) for _ in shape]
    item = max(1, bits // 8) * lanes
    return {
        "code": code, "bits": bits, "lanes": lanes, "shape": shape, "strides": strides,
        "ndim": claimed_ndim, "item": item,
        "offset_items": r.randint(0, 3), "null": r.random() < 0.06,
        "device": r.choice([KDL_CPU] * 6 + [KDL_CUDA_HOST, KDL_CUDA, KDL_MANAGED, KDL_OPENCL, KDL_VULKAN,
                                             KDL_METAL, KDL_ROCM]),
        "capsule": r.choice(["versioned"] * 4 + ["legacy", "old"]),
        "major": 1 if r.random() < 0.93 else r.choice([0, 2, 7]),
        "readonly": r.random() < 0.1,
        "slack": r.randint(0, 5), "fill": r.randrange(2**31),
    }


def _extent(shape, strides):
    """Lowest and highest element offsets the layout reaches."""
    lo = hi = 0
    for n, s in zip(shape, strides):
        if n <= 0:
            continue
        lo += min(0, (n - 1) * s)
        hi += max(0, (n - 1) * s)
    return lo, hi


def _row_major(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1) if n > 0 else 1
    return out[::-1]


def _buffer(spec):
    """Random finite elements of the spec's dtype, as bytes (numpy uint8)."""
    rng = np.random.default_rng(spec["fill"])
    n = BUF_BYTES // spec["item"] + 1
    code, bits = spec["code"], spec["bits"]
    if code == FLOAT and bits == 32:
        a = rng.standard_normal(n).astype(np.float32)
    elif code == FLOAT and bits == 16:
        a = rng.standard_normal(n).astype(np.float16)
    elif code == BFLOAT and bits == 16:
        a = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        a = rng.integers(0, 0x70, BUF_BYTES + 64, dtype=np.uint8)  # finite codes for every 8-bit float
    raw = np.frombuffer(a.tobytes(), dtype=np.uint8)
    buf = np.zeros(BUF_BYTES + 64, dtype=np.uint8)
    k = min(len(raw), len(buf))
    buf[:k] = raw[:k]
    return buf


def expected(spec):
    """('ok', None) or ('refuse', exception types, rule regex)."""
    ndim = spec["ndim"] if spec["ndim"] is not None else len(spec["shape"])
    if spec["capsule"] == "versioned" and spec["major"] != 1:
        return ("refuse", ("TypeError",), r"version")
    if ndim < 0 or ndim > 8:
        return ("refuse", ("ValueError",), r"dimension")
    if spec["device"] not in (KDL_CPU, KDL_CUDA_HOST, KDL_CUDA, KDL_MANAGED):
        return ("refuse", ("ValueError",), r"device")
    if spec["lanes"] != 1 or (spec["code"], spec["bits"]) not in TAKEN:
        return ("refuse", ("TypeError",), r"dtype")
    if any(n < 0 for n in spec["shape"]):
        return ("refuse", ("ValueError",), r"negative size")
    if spec["null"] and all(n > 0 for n in spec["shape"]):
        return ("refuse", ("ValueError",), r"NULL|no memory")
    return ("ok", None)


def make(spec):
    """The forged producer and what it exports: (producer, address of the
    first element or 0, element strides, element offset of data in buf)."""
    from dlpack_forge import ForgedLayout

    buf = _buffer(spec)
    shape, item = spec["shape"], spec["item"]
    strides = spec["strides"] if spec["strides"] is not None else _row_major(shape)
    lo, hi = _extent(shape if all(n >= 0 for n in shape) else [0], strides)
    if (hi - lo + 1 + spec["offset_items"] + spec["slack"]) * item > BUF_BYTES:
        spec["shape"] = shape = [min(n, 2) for n in shape]
        strides = spec["strides"] if spec["strides"] is not None else _row_major(shape)
        lo, hi = _extent(shape, strides)
    base = -lo + spec["slack"]  # element index of the first element in buf
    byte_offset = spec["offset_items"] * item
    start = buf.ctypes.data + base * item  # address of element 0
    data = 0 if spec["null"] else start - byte_offset
    flags = 1 if spec["readonly"] else 0
    prod = ForgedLayout(buf, data, shape, spec["strides"], spec["code"], spec["bits"], spec["lanes"],
                        device_type=spec["device"], byte_offset=0 if spec["null"] else byte_offset,
                        capsule=spec["capsule"], major=spec["major"], flags=flags, ndim=spec["ndim"])
    return prod, (0 if spec["null"] else start), strides, base, buf


def _reference_amax(spec, buf, base, strides):
    shape = spec["shape"]
    if any(n == 0 for n in shape):
        return 0.0
    code, bits = spec["code"], spec["bits"]
    if code == BFLOAT:
        vals = (buf[: (len(buf) // 2) * 2].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        vals = buf[: (len(buf) // (bits // 8)) * (bits // 8)].view(np.float32 if bits == 32 else np.float16)
    vals = vals.astype(np.float64)
    v = np.lib.stride_tricks.as_strided(vals[base:], shape=tuple(shape), strides=tuple(s * 8 for s in strides))
    return float(np.abs(v).max()) if v.size else 0.0


def run_one(i, seed):
    import re

    import torch

    from seqfuse import _C

    spec = draw(i, seed)
    exp = expected(spec)
    prod, start, strides, base, buf = make(spec)
    cuda = spec["device"] in (KDL_CUDA, KDL_MANAGED)
    stream = 0 if cuda else None
    try:
        d = _C.describe(prod, stream)
    except (TypeError, ValueError, NotImplementedError) as e:
        msg = str(e)
        if exp[0] == "ok":
            return False, f"refused a valid tensor: {type(e).__name__}: {msg}"
        if type(e).__name__ not in exp[1] or "'x'" not in msg or not re.search(exp[2], msg, re.I):
            return False, f"expected {exp[1]} naming 'x' and /{exp[2]}/, got {type(e).__name__}: {msg}"
        if prod.deleted != prod.exported:
            return False, f"deleter ran {prod.deleted} times for {prod.exported} exports"
        return True, f"refused: {msg[:120]}"
    except Exception as e:  # noqa: BLE001 - any other type is the failure
        return False, f"wrong exception type {type(e).__name__}: {e}"
    if exp[0] != "ok":
        return False, f"accepted a tensor it must refuse ({exp[2]}): {d}"
    want = {"dtype": TAKEN[(spec["code"], spec["bits"])], "shape": tuple(spec["shape"]),
            "strides": tuple(strides), "device": "cuda" if cuda else "cpu", "data": start,
            "readonly": spec["readonly"] and spec["capsule"] == "versioned"}
    got = {k: d[k] for k in want}
    if 0 in spec["shape"]:  # no element is addressed: a NULL-strides empty tensor's strides are moot
        got.pop("strides")
        want.pop("strides")
    if got != want:
        return False, f"describe: got {got}, expected {want}"
    if prod.deleted != prod.exported:
        return False, f"deleter ran {prod.deleted} times for {prod.exported} exports"
    if cuda or want["dtype"] not in ("float32", "float16", "bfloat16"):
        return True, "described exactly"
    out = torch.zeros((), dtype=torch.float32)
    _C.amax(prod, out, None)
    ref = _reference_amax(spec, buf, base, strides)
    if not abs(out.item() - ref) <= 1e-6 * max(1.0, ref):
        return False, f"amax {out.item()} != numpy's {ref} over the same memory"
    if prod.deleted != prod.exported:
        return False, f"deleter ran {prod.deleted} times for {prod.exported} exports"
    return True, "described exactly, amax equals numpy's"


def main(argv):
    seed, first, last = int(argv[0]), int(argv[1]), int(argv[2])
    import faulthandler

    import torch

    torch.set_num_threads(1)
    for i in range(first, last):
        name = case_name(i, seed)
        sys.stdout.write(f"S {name}\n")
        sys.stdout.flush()
        faulthandler.dump_traceback_later(30, exit=True)
        try:
            ok, what = run_one(i, seed)
        except Exception as e:  # noqa: BLE001 - reported as the case's failure
            ok, what = False, f"fuzz error: {type(e).__name__}: {e}"
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.write("R " + json.dumps({"name": name, "ok": ok, "what": what}) + "\n")
        sys.stdout.flush()


def case_name(i, seed=SEED):
    s = draw(i, seed)
    return (f"fuzz{seed}:{i}:{s['capsule']}:dev{s['device']}:{s['code']}x{s['bits']}x{s['lanes']}:"
            f"{'null' if s['null'] else 'data'}")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main(sys.argv[1:])
else:
    NAMES = [case_name(i) for i in range(COUNT)]
    _results = {}

    def _all():
        if not _results:
            from test_bad_input_corpus import _run_range

            half = COUNT // 2
            import threading
            ts = [threading.Thread(target=_run_range, args=(str(SEED), NAMES, a, b, _results, __file__))
                  for a, b in ((0, half), (half, COUNT))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            print(f"dlpack fuzz: seed {SEED}, {COUNT} cases")
        return _results

    def test_fuzz_draws_every_kind():
        """The draw covers what it claims: refusals of each rule and exact
        acceptances, every capsule kind, zero and negative strides."""
        specs = [draw(i) for i in range(COUNT)]
        outcomes = {expected(s)[0] if expected(s)[0] == "ok" else expected(s)[2] for s in specs}
        assert {"ok", "version", "dimension", "device", "dtype", "negative size", "NULL|no memory"} <= outcomes
        assert {s["capsule"] for s in specs} == {"versioned", "legacy", "old"}
        strides = [x for s in specs if s["strides"] for x in s["strides"]]
        assert 0 in strides and min(strides) < 0

    @pytest.mark.parametrize("name", NAMES)
    def test_fuzz_case(name):
        r = _all().get(name)
        assert r is not None, f"{name}: never ran"
        assert r["ok"], f"{name}: {r['what']}"
