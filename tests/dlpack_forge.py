"""Hand-made DLPack producers (ctypes), to test what no real library will
export: a tensor that claims to be on a GPU, an unknown major version, a
read-only flag, a NULL data pointer, and a deleter that counts its calls."""
import ctypes
from ctypes import CFUNCTYPE, POINTER, Structure, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

import numpy as np


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    pass


VERSIONED_DELETER = CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", c_void_p),
    ("deleter", VERSIONED_DELETER),
    ("flags", c_uint64),
    ("dl_tensor", DLTensor),
]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, c_char_p, c_void_p]
_NAME = b"dltensor_versioned"

KDL_CPU, KDL_CUDA, KDL_VULKAN = 1, 2, 7
KDL_FLOAT = 2


class ForgedTensor:
    """Exports `array`'s memory with whatever device, version and flags the
    test asks for.  `deleted` counts deleter calls across all exports."""

    def __init__(self, array, device_type=KDL_CPU, device_id=0, major=1, flags=0, data=None):
        self.array = np.ascontiguousarray(array, dtype=np.float32)
        self.data = data  # the data pointer to export in place of the array's (0: NULL)
        self.device_type, self.device_id = device_type, device_id
        self.major, self.flags = major, flags
        self.exported = 0
        self.deleted = 0
        self._keep = []
        self._deleter = VERSIONED_DELETER(self._on_delete)

    def _on_delete(self, ptr):
        self.deleted += 1

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)

    def __dlpack__(self, stream=None, max_version=None):
        a = self.array
        shape = (c_int64 * a.ndim)(*a.shape)
        strides = (c_int64 * a.ndim)(*[s // a.itemsize for s in a.strides])
        m = DLManagedTensorVersioned()
        m.version = DLPackVersion(self.major, 0)
        m.deleter = self._deleter
        m.flags = self.flags
        data = a.ctypes.data if self.data is None else (self.data or None)
        m.dl_tensor = DLTensor(data, DLDevice(self.device_type, self.device_id), a.ndim,
                               DLDataType(KDL_FLOAT, 32, 1), shape, strides, 0)
        self._keep.append((m, shape, strides))
        self.exported += 1
        return _capsule_new(ctypes.addressof(m), _NAME, None)


# ---- any layout: the DLPack fuzz (tests/test_dlpack_fuzz.py) ----------------

class DLManagedTensor(Structure):  # the legacy (unversioned) capsule's struct
    pass


LEGACY_DELETER = CFUNCTYPE(None, POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", c_void_p),
    ("deleter", LEGACY_DELETER),
]


class ForgedLayout:
    """Exports whatever DLTensor fields it is given, over memory it keeps:
    ``data`` is an address (0: NULL), ``shape`` / ``strides`` lists (strides
    None: a NULL strides pointer), ``code``/``bits``/``lanes`` the dtype,
    ``device_type``/``device_id``, ``byte_offset``.  ``capsule`` is
    "versioned" (with ``major`` and ``flags``), "legacy" (an unversioned
    capsule even when max_version is offered) or "old" (an unversioned
    producer whose __dlpack__ takes no max_version).  ``deleted`` counts
    deleter calls; ``exported`` counts __dlpack__ calls that made a tensor."""

    def __init__(self, keep, data, shape, strides, code, bits, lanes=1, device_type=KDL_CPU, device_id=0,
                 byte_offset=0, capsule="versioned", major=1, flags=0, ndim=None):
        self.keep = keep  # the buffer data points into, alive as long as this object
        self.data, self.shape, self.strides = data, list(shape), strides
        self.ndim = len(self.shape) if ndim is None else ndim
        self.code, self.bits, self.lanes = code, bits, lanes
        self.device_type, self.device_id, self.byte_offset = device_type, device_id, byte_offset
        self.capsule, self.major, self.flags = capsule, major, flags
        self.exported = self.deleted = 0
        self._keep = []
        self._vdel = VERSIONED_DELETER(self._on_delete)
        self._ldel = LEGACY_DELETER(self._on_delete)
        if capsule == "old":
            self.__dlpack__ = self._old_dlpack

    def _on_delete(self, ptr):
        self.deleted += 1

    def __dlpack_device__(self):
        return (self.device_type, self.device_id)

    def _dltensor(self):
        n = len(self.shape)
        shape = (c_int64 * max(n, 1))(*self.shape)
        strides = None if self.strides is None else (c_int64 * max(n, 1))(*self.strides)
        t = DLTensor(self.data or None, DLDevice(self.device_type, self.device_id), self.ndim,
                     DLDataType(self.code, self.bits, self.lanes), shape,
                     strides if strides is not None else None, self.byte_offset)
        return t, shape, strides

    def __dlpack__(self, stream=None, max_version=None):
        t, shape, strides = self._dltensor()
        if self.capsule == "versioned":
            m = DLManagedTensorVersioned()
            m.version = DLPackVersion(self.major, 0)
            m.deleter = self._vdel
            m.flags = self.flags
            m.dl_tensor = t
            name = b"dltensor_versioned"
        else:
            m = DLManagedTensor()
            m.deleter = self._ldel
            m.dl_tensor = t
            name = b"dltensor"
        self._keep.append((m, shape, strides))
        self.exported += 1
        return _capsule_new(ctypes.addressof(m), name, None)

    def _old_dlpack(self, stream=None):
        return ForgedLayout.__dlpack__(self, stream)
