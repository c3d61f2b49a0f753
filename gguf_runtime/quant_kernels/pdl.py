"""Programmatic dependent launch: ``cuLaunchKernelEx`` with the programmatic-stream-serialization
attribute, through ctypes on the CUDA driver library (CuPy's RawKernel has no launch attributes).

A kernel launched this way may start while the kernel before it in the stream is still running;
it must call ``pdl_enter()`` (common.cuh) before touching anything that kernel writes. Every kernel
in this folder does (tests/test_cuda_compile.py checks). Captured into a graph, the attribute
becomes a programmatic edge, so a replayed step overlaps each kernel's launch and weight loads with
the end of the kernel before it. Needs compute capability 9.0 (Hopper) or newer.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("n_attrs", ctypes.c_uint)]


_driver = None


def _lib():
    global _driver
    if _driver is None:
        lib = ctypes.PyDLL("libcuda.so.1")  # (the launch keeps the GIL: graphs/held.py says why)
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p]
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def supported(device) -> bool:
    """Whether ``device`` (a cupy.cuda.Device) can overlap dependent launches (sm_90+)."""
    return int(device.compute_capability) >= 90


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    return tuple(int(v) for v in (*d, 1, 1, 1)[:3])


def _params(args: Sequence) -> tuple[ctypes.Array, ctypes.Array]:
    """The kernel's argument buffer (each value at its natural alignment) and the void* array
    pointing into it. Arguments must be numpy scalars (the launchers' i32/f32/ptr)."""
    vals = [np.asarray(a) for a in args]
    offs, size = [], 0
    for v in vals:
        if v.dtype.kind not in "iuf" or v.ndim:
            raise TypeError(f"kernel argument {v!r} is not a numpy scalar")
        size = -(-size // v.itemsize) * v.itemsize
        offs.append(size)
        size += v.itemsize
    buf = ctypes.create_string_buffer(max(size, 1))
    base = ctypes.addressof(buf)
    for v, o in zip(vals, offs):
        ctypes.memmove(base + o, v.tobytes(), v.itemsize)
    return buf, (ctypes.c_void_p * max(len(vals), 1))(*[base + o for o in offs])


def launch(function_ptr: int, grid, block, args: Sequence, shared_mem: int, stream_ptr: int) -> None:
    """Launch with the programmatic-stream-serialization attribute on ``stream_ptr``."""
    attr = _Attr()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    cfg = _Config()
    cfg.grid[:] = _dims(grid)
    cfg.block[:] = _dims(block)
    cfg.smem = shared_mem
    cfg.stream = stream_ptr
    cfg.attrs = ctypes.pointer(attr)
    cfg.n_attrs = 1
    buf, params = _params(args)  # buf holds the argument bytes params points into, through the call
    rc = _lib().cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
    if rc != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(msg.value or b'?').decode()} ({rc})")
