"""Short CUDA driver calls that keep the GIL: a graph's launch, an event's record and query, a copy
from pinned memory to the device.

CuPy lets the GIL go around every CUDA call. Beside another thread that runs Python (the server's
event loop beside its scheduler thread) a call of a few microseconds then costs its caller up to the
interpreter's switch interval before it has the GIL back: the scheduler's graph launch and event
record each waited about that long (bench/RESULTS.md row 216). Called through ctypes.PyDLL, these
keep the GIL and return in microseconds; none of them waits for the device. Where the driver library
cannot be loaded, or a call fails (no context current on this thread yet, an error to raise), CuPy's
own call runs instead: it makes the context current or raises its error.
"""

from __future__ import annotations

import ctypes

import cupy as cp

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

_lib: ctypes.PyDLL | None | bool = None


def driver():
    """libcuda through ctypes.PyDLL (calls keep the GIL), or None where it cannot be loaded."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.PyDLL("libcuda.so.1")
            vp = ctypes.c_void_p
            for name, args in (("cuGraphLaunch", [vp, vp]), ("cuEventRecord", [vp, vp]),
                               ("cuEventQuery", [vp]), ("cuMemcpyHtoDAsync_v2", [vp, vp, ctypes.c_size_t, vp])):
                f = getattr(lib, name)
                f.argtypes, f.restype = args, ctypes.c_int
            _lib = lib
        except (OSError, AttributeError):
            _lib = False
    return _lib or None


def launch_graph(graph: cp.cuda.Graph, stream: cp.cuda.Stream) -> None:
    """``graph.launch(stream)``, keeping the GIL."""
    lib, ex = driver(), getattr(graph, "graphExec", 0)
    if not (lib and ex and lib.cuGraphLaunch(ex, stream.ptr) == CUDA_SUCCESS):
        graph.launch(stream)


def copy_to_device(dst: int, src: int, nbytes: int, stream: cp.cuda.Stream) -> None:
    """An asynchronous copy of ``nbytes`` from pinned host memory at ``src`` to device memory at
    ``dst`` on ``stream``, keeping the GIL."""
    lib = driver()
    if not (lib and lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream.ptr) == CUDA_SUCCESS):
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)


class Event:
    """A CUDA event (no timing) whose ``record`` and ``done`` keep the GIL; ``synchronize`` waits
    for the device and lets the GIL go, as CuPy's does."""

    __slots__ = ("event", "ptr")

    def __init__(self) -> None:
        self.event = cp.cuda.Event(block=False, disable_timing=True)
        self.ptr = self.event.ptr

    def record(self, stream: cp.cuda.Stream) -> None:
        lib = driver()
        if not (lib and lib.cuEventRecord(self.ptr, stream.ptr) == CUDA_SUCCESS):
            self.event.record(stream)

    @property
    def done(self) -> bool:
        lib = driver()
        rc = lib.cuEventQuery(self.ptr) if lib else -1
        if rc == CUDA_SUCCESS:
            return True
        if rc == CUDA_ERROR_NOT_READY:
            return False
        return self.event.done

    def synchronize(self) -> None:
        self.event.synchronize()
