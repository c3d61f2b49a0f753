"""The GPU tests collect without a GPU: every tests/test_gpu_*.py imports and parametrizes under a
stand-in CuPy (cupy_stub.py) and gives at least one test, so a module that no longer imports or a
parametrization naming an argument its test lacks fails here, in CI, and not first on the GPU
machine (where CPU-only runs skip these modules whole)."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_every_gpu_module_collects():
    files = sorted(TESTS.glob("test_gpu_*.py"))
    assert files
    env = {k: v for k, v in os.environ.items() if k != "GGUF_STRICT_SKIPS"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "cupy_stub", "-p", "no:cacheprovider",
                          "--collect-only", "-q", "-m", "gpu", *map(str, files)],
                         cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    collected = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    missing = [f.name for f in files if f"tests/{f.name}" not in collected]
    assert not missing, f"collected no test from {missing}:\n{run.stdout[-2000:]}"
