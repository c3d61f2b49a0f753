"""The prefill's one cuBLAS product (f16 weights and inputs, f32 accumulate and output), called
through ctypes on a cuBLAS handle of its own, so it can be captured into a CUDA graph.

CuPy's cuBLAS wrappers refuse to run while a stream is capturing; cuBLAS itself supports it. The
handle gets a workspace allocated here, once: cuBLAS would otherwise take workspace for a captured
product from the stream's allocator, and a graph must not allocate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import weakref

import cupy as cp

CUDA_R_16F, CUDA_R_32F = 2, 0
WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper


def _library() -> ctypes.CDLL:
    """The libcublas CuPy loaded (its path from /proc/self/maps), else the one the linker finds."""
    path = None
    try:
        with open("/proc/self/maps") as fh:
            path = next((ln.split()[-1] for ln in fh if "/libcublas.so" in ln), None)
    except OSError:
        pass
    path = path or ctypes.util.find_library("cublas")
    if not path:
        raise OSError("libcublas was not found (CuPy's CUDA libraries)")
    return ctypes.CDLL(path)


class CublasGemm:
    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        from cupy_backends.cuda.libs import cublas as cb  # loads libcublas; its constants

        self.cb = cb
        self.lib = lib = _library()
        vp, i = ctypes.c_void_p, ctypes.c_int
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasSetPointerMode_v2.argtypes = [vp, i]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        lib.cublasDestroy_v2.argtypes = [vp]
        self.handle = vp()
        self._check("cublasCreate", lib.cublasCreate_v2(ctypes.byref(self.handle)))
        weakref.finalize(self, lib.cublasDestroy_v2, self.handle)
        self._check("cublasSetPointerMode", lib.cublasSetPointerMode_v2(self.handle, cb.CUBLAS_POINTER_MODE_HOST))
        self.workspace = cp.empty(workspace_bytes, cp.uint8)
        self._stream: int | None = None
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(name: str, status: int) -> None:
        if status != 0:
            raise RuntimeError(f"{name} failed (cuBLAS status {status})")

    def _on(self, stream: int) -> None:
        if stream != self._stream:  # setting the stream resets the workspace: set both
            self._check("cublasSetStream", self.lib.cublasSetStream_v2(self.handle, stream))
            self._check("cublasSetWorkspace", self.lib.cublasSetWorkspace_v2(
                self.handle, self.workspace.data.ptr, self.workspace.nbytes))
            self._stream = stream

    def wt_x(self, rows: int, t: int, k: int, w: int, x: int, ldx: int, y: int, ldy: int, accumulate: bool) -> None:
        """y[:t, :rows] (+)= x[:t, :k] @ W.T on the current stream: W f16 [rows, k] row-major, x f16
        (row stride ldx elements), y f32 (row stride ldy)."""
        self._on(cp.cuda.get_current_stream().ptr)
        cb, one = self.cb, ctypes.addressof(self._one)
        beta = ctypes.addressof(self._one if accumulate else self._zero)
        self._check("cublasGemmEx", self.lib.cublasGemmEx(
            self.handle, cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, rows, t, k, one, w, CUDA_R_16F, k, x, CUDA_R_16F, ldx,
            beta, y, CUDA_R_32F, ldy, cb.CUBLAS_COMPUTE_32F, cb.CUBLAS_GEMM_DEFAULT))
