"""The base of the launchers in this folder: the C type of each argument, the matrix and int8
activation descriptors, and the compiled-kernel cache (NVRTC through ``cupy.RawModule``).

Every launcher takes device pointers as ints and sizes as ints, converts them to the exact C
types, and launches on CuPy's current stream, so launches can be recorded by stream capture.
Modules compile once per set of kernel names (CuPy caches the binaries on disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import cupy as cp
import numpy as np

from . import pdl
from .formats import FORMATS
from .knobs import KernelKnobs
from .sources import ARCH, SRC_DIR, source


def nvrtc_options(src_dir: str = SRC_DIR, filename: str = "") -> tuple[str, ...]:
    """NVRTC's options for a source; an arch-specific one's -arch (CuPy adds the device's plain
    one after it, and NVRTC builds for the arch-specific target)."""
    return ("-std=c++17", f"-I{src_dir}") + ((f"-arch={ARCH[filename]}",) if filename in ARCH else ())


OPTIONS = nvrtc_options()
TYPE_STRUCT = {"F32": "TF32", "F16": "TF16", "BF16": "TBF16", "Q4_0": "TQ4_0", "Q4_1": "TQ4_1",
               "Q5_0": "TQ5_0", "Q5_1": "TQ5_1", "Q8_0": "TQ8_0", "Q2_K": "TQ2_K", "Q3_K": "TQ3_K",
               "Q4_K": "TQ4_K", "Q5_K": "TQ5_K", "Q6_K": "TQ6_K", "MXFP4": "TMXFP4", "IQ4_NL": "TIQ4_NL",
               "IQ4_XS": "TIQ4_XS", "IQ2_XXS": "TIQ2_XXS", "IQ2_XS": "TIQ2_XS", "IQ2_S": "TIQ2_S",
               "IQ3_XXS": "TIQ3_XXS", "IQ3_S": "TIQ3_S", "IQ1_S": "TIQ1_S", "IQ1_M": "TIQ1_M"}
UNIT_ELEMS = {"TF32": 16, "TF16": 16, "TBF16": 16, "TQ4_0": 32, "TQ4_1": 32, "TQ5_0": 32, "TQ5_1": 32,
              "TQ8_0": 32, "TQ2_K": 64, "TQ3_K": 64, "TQ4_K": 32, "TQ5_K": 32, "TQ6_K": 64,
              "TMXFP4": 32, "TIQ4_NL": 32, "TIQ4_XS": 32, "TIQ2_XXS": 64, "TIQ2_XS": 64, "TIQ2_S": 64,
              "TIQ3_XXS": 64, "TIQ3_S": 64, "TIQ1_S": 64, "TIQ1_M": 64}
SMEM_DEFAULT_MAX = 48 * 1024  # dynamic shared memory per block beyond this needs the kernel's opt-in
ACT = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # 2: layers.cu's glu and moe.cu's moe_glu (not the others)
FUSED_ACTS = ("silu", "gelu_tanh")


def fused_act(act: str) -> int:
    """ACT of the GLU products that fuse only SiLU or GELU (matvec.cu's, matmul_mma.cu's, moe_mma.cu's)."""
    if act not in FUSED_ACTS:
        raise ValueError(f"these fused GLU kernels take {', '.join(FUSED_ACTS)}, not {act} (layers.cu's glu does)")
    return ACT[act]


def i32(v: int) -> np.int32:
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def ptr(v) -> np.uint64:
    """A device pointer argument from an int, a cupy array or None (null)."""
    if v is None:
        return np.uint64(0)
    if isinstance(v, cp.ndarray):
        return np.uint64(v.data.ptr)
    return np.uint64(int(v))


@dataclass(frozen=True)
class Mat:
    """A repacked matrix on the device: plane pointers (0 when absent), shape, type."""

    type_id: int
    rows: int
    cols: int
    qs: int
    qh: int = 0
    sc: int = 0
    d: int = 0

    @property
    def struct(self) -> str:
        return TYPE_STRUCT[FORMATS[self.type_id].name]

    @property
    def planes(self) -> tuple[np.uint64, ...]:
        return (ptr(self.qs), ptr(self.qh), ptr(self.sc), ptr(self.d))


class Kernels:
    """Compiled kernels; names are C++ name expressions, e.g. ``embed_rows<TQ8_0>``."""

    def __init__(self, knobs: KernelKnobs = KernelKnobs()) -> None:
        self.knobs = knobs
        self._modules: dict[tuple[str, tuple[str, ...]], cp.RawModule] = {}
        self._fns: dict[tuple[str, str], "_Counted"] = {}
        self.launches = 0  # kernel launches issued from the host so far
        self.timeline: list | None = None  # when a list: (name, start event, end event) per launch
        # launch with programmatic dependent launch (pdl.py), set around graph capture: True, or a
        # tuple of kernel-name prefixes (only those kernels)
        self.pdl: bool | tuple[str, ...] = False
        self.src_dir = SRC_DIR  # where the .cu sources and headers are read from (use_sources)
        self.recorded: set[tuple[str, str]] | None = None  # see record()

    def record(self) -> None:
        """From now on launches only note (source file, kernel name) in ``recorded``: a forward
        pass run this way lists the kernels it would launch (backends/cuda/precompile.py)."""
        self.recorded = set()

    def compile_recorded(self) -> None:
        """Stop recording; compile what was recorded, one NVRTC pass per source file."""
        rec, self.recorded = self.recorded or set(), None
        for filename in sorted({f for f, _ in rec}):
            self.prepare(filename, [n for f, n in rec if f == filename])

    def use_sources(self, src_dir: str) -> None:
        """Compile from another copy of this folder from now on, dropping every kernel compiled so
        far (measuring only: bench/inproc_variants.py compares two trees' kernels in one process)."""
        if src_dir != self.src_dir:
            self.src_dir = src_dir
            self._modules.clear()
            self._fns.clear()

    def prepare(self, filename: str, names: Sequence[str]) -> None:
        """Compile ``names`` of ``filename`` in one NVRTC pass (templates need their names)."""
        todo = tuple(sorted({n for n in names if (filename, n) not in self._fns}))
        if not todo:
            return
        templates = tuple(n for n in todo if "<" in n)
        mod = cp.RawModule(code=source(filename, self.src_dir), options=nvrtc_options(self.src_dir, filename),
                           name_expressions=templates or None)
        mod.compile()
        self._modules[(filename, todo)] = mod
        for n in todo:
            self._fns[(filename, n)] = _Counted(mod.get_function(n), self, n)

    def fn(self, filename: str, name: str) -> "_Counted":
        if self.recorded is not None:
            self.recorded.add((filename, name))
            return _RECORDED  # type: ignore[return-value]
        f = self._fns.get((filename, name))
        if f is None:
            self.prepare(filename, [name])
            f = self._fns[(filename, name)]
        return f


class _Counted:
    """A kernel that counts its launches on its Kernels (to prove graph replay launches none)."""

    __slots__ = ("kernel", "owner", "name", "smem_max")

    def __init__(self, kernel: cp.RawKernel, owner: Kernels, name: str) -> None:
        self.kernel, self.owner, self.name = kernel, owner, name
        # dynamic shared memory the kernel is allowed: by default 48 KiB with its static share
        self.smem_max = SMEM_DEFAULT_MAX - kernel.shared_size_bytes

    def allow_smem(self, size: int) -> None:
        """Opt in to ``size`` bytes of dynamic shared memory per block where the default is less."""
        if size > self.smem_max:
            self.kernel.max_dynamic_shared_size_bytes = size
            self.smem_max = size

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        self.owner.launches += 1
        tl = self.owner.timeline
        p = self.owner.pdl
        if p and tl is None and (p is True or self.name.startswith(p)):
            pdl.launch(self.kernel.kernel.ptr, grid, block, args, shared_mem, cp.cuda.get_current_stream().ptr)
            return
        if tl is None:
            self.kernel(grid, block, args, shared_mem=shared_mem)
            return
        start, end = cp.cuda.Event(), cp.cuda.Event()  # profiling only (bench/profile_step.py)
        start.record()
        self.kernel(grid, block, args, shared_mem=shared_mem)
        end.record()
        tl.append((self.name, start, end))


class _Recorded:
    """What ``Kernels.fn`` returns while recording: a kernel that launches nothing."""

    smem_max = 1 << 30

    def allow_smem(self, size: int) -> None:
        pass

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        pass


_RECORDED = _Recorded()


@dataclass(frozen=True)
class Q8Vec:
    """Int8 activations of up to MAX_MMV_TOKENS rows (quant_int8.cuh): q int8 [rows, ldq] and
    (d, s, sum of squares, d2) float quads [rows, lds] per 16 columns; pointers are of row 0.
    res > 0 (Tuning.q8_res): each value's rest as a second int8 at q + res (quant16_rest; res <=
    ldq - the columns). norm_eps (as an input): the pieces are of x * w, written by a q8 epilogue
    for the RMSNorm that the matvec then applies (matvec_block.cuh)."""

    q: int
    ldq: int
    s: int
    lds: int
    norm_eps: float | None = None
    res: int = 0

    def rows_from(self, row: int) -> "Q8Vec":
        return Q8Vec(self.q + row * self.ldq, self.ldq, self.s + 16 * row * self.lds, self.lds, self.norm_eps,
                     self.res)

    def io(self, out: bool = False) -> int:
        """The matvec template's IO bits for this buffer (matvec.cu): 8, rests in; out: 16, a q8
        epilogue writes them."""
        return (16 if out else 8) if self.res else 0

    def ptrs(self, row: int = 0) -> tuple:
        """(q, ldq, s, lds, res) from token ``row``: the buffer arguments of every kernel."""
        return (ptr(self.q + row * self.ldq), i32(self.ldq), ptr(self.s + 16 * row * self.lds), i32(self.lds),
                i32(self.res))

    def args(self, row: int = 0) -> tuple:
        """As a matvec's input: the buffer, whether to normalize, eps."""
        eps = self.norm_eps
        return (*self.ptrs(row), i32(eps is not None), f32(eps or 0.0))

    def out_args(self, row: int, w: int | None) -> tuple:
        """As a q8 epilogue's output: the buffer and the next norm's weight (or null)."""
        return (*self.ptrs(row), ptr(w))


NO_PTRS = (ptr(0), i32(0), ptr(0), i32(0), i32(0))  # no int8 buffer (Q8Vec.ptrs)
NO_QOUT = (*NO_PTRS, ptr(0))  # no q8 epilogue (Q8Vec.out_args)
Q8_OUT_ROWS = 16  # rows per block of a q8 epilogue (an int8 piece; matvecs: 16 * WG / R warps, block_warps)
