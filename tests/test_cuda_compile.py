"""Every CUDA source compiles for sm_90 (or its sources.ARCH target) with this machine's nvcc (no GPU needed).

The kernels are templates instantiated at run time through NVRTC; GGUF_INSTANTIATE_ALL makes each
file instantiate every kernel for every quant type, so nvcc checks them all here, in CI.
"""

import glob
import os
import re
import shutil
import subprocess

import pytest

KERNELS = os.path.join(os.path.dirname(__file__), "..", "gguf_runtime", "quant_kernels")
SOURCES = sorted(glob.glob(os.path.join(KERNELS, "*.cu")))


def test_sources_found():
    assert {os.path.basename(p) for p in SOURCES} >= {"matvec.cu", "layers.cu", "attention.cu", "sampling.cu"}


_BUILT: dict[str, tuple[subprocess.CompletedProcess, str]] = {}


def _build(src: str, tmp_path_factory) -> tuple[subprocess.CompletedProcess, str]:
    """nvcc -c of one source (every instantiation), keeping its PTX; once per source."""
    if src not in _BUILT:
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            pytest.skip("nvcc is not installed on this machine")
        tmp = tmp_path_factory.mktemp("nvcc")
        from gguf_runtime.quant_kernels.sources import ARCH
        arch = ARCH.get(os.path.basename(src), "sm_90")  # (-arch=sm_90a would also build plain compute_90 PTX)
        gencode = f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}"
        out = subprocess.run([nvcc, gencode, "-std=c++17", "-DGGUF_INSTANTIATE_ALL", "-Werror", "all-warnings",
                              "--keep", "--keep-dir", str(tmp), "-c", src, "-o", str(tmp / "k.o")],
                             capture_output=True, text=True)
        ptx = "".join(open(p).read() for p in glob.glob(str(tmp / "*.ptx")))
        _BUILT[src] = (out, ptx)
    return _BUILT[src]


@pytest.mark.parametrize("src", SOURCES, ids=os.path.basename)
def test_compiles_for_sm90(src, tmp_path_factory):
    out, _ = _build(src, tmp_path_factory)
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.parametrize("src", SOURCES, ids=os.path.basename)
def test_every_kernel_waits_for_its_predecessor(src, tmp_path_factory):
    """Graphs launch every kernel with programmatic dependent launch (pdl.py): a kernel without
    griddepcontrol.wait would run while the kernel before it is still writing its inputs."""
    out, ptx = _build(src, tmp_path_factory)
    assert out.returncode == 0, out.stderr[-4000:]
    entries = re.split(r"\.entry\s+", ptx)[1:]
    assert entries, "no kernels in the PTX"
    missing = [e.split("(", 1)[0] for e in entries if "griddepcontrol.wait" not in e]
    assert not missing, f"kernels that never call pdl_enter(): {missing[:5]}"


def test_source_text_changes_with_any_header(tmp_path):
    """CuPy's kernel cache is keyed by the source text: an edited header must change it."""
    from gguf_runtime.quant_kernels.sources import source
    for name in ("matvec.cu", "common.cuh", "quant_types.cuh"):
        shutil.copy(os.path.join(KERNELS, name), tmp_path / name)
    before = source("matvec.cu", str(tmp_path))
    assert before.startswith(open(os.path.join(KERNELS, "matvec.cu")).read())
    with open(tmp_path / "common.cuh", "a") as fh:
        fh.write("\n// edited\n")
    source.cache_clear()
    assert source("matvec.cu", str(tmp_path)) != before


def _module_constants(path: str) -> dict:
    """The literal top-level assignments of a Python file (without importing it: it needs cupy)."""
    import ast

    tree = ast.parse(open(path).read())
    return {t.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, (ast.Dict, ast.Constant))}


def test_register_fragment_constants_match_the_launcher():
    """launch_mma sizes the shared memory of the register-fragment products from REG_A_LDX and
    REG_A_WROW; they must be mma_regs.cuh's LDX and WROW of each RegA specialization."""
    text = open(os.path.join(KERNELS, "mma_regs.cuh")).read()
    parts = re.split(r"template <> struct RegA<(\w+)>", text)[1:]
    cu = {}
    for name, body in zip(parts[::2], parts[1::2]):
        body = body[:body.find("\n};")]
        ldx, wrow = (re.search(rf"\b{c} = (\d+)", body) for c in ("LDX", "WROW"))
        cu[name] = (int(ldx.group(1)), int(wrow.group(1)))
    py = _module_constants(os.path.join(KERNELS, "launch_mma.py"))
    assert set(cu) == set(py["REG_A_LDX"]) and len(cu) >= 2
    for name, (ldx, wrow) in cu.items():
        assert py["REG_A_LDX"][name] == ldx, name
        assert py["REG_A_WROW"].get(name, 0) == wrow, name
