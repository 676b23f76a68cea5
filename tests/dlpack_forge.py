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
