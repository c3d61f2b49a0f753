"""tests/mutations.py plants each bug by replacing a snippet that must occur once in its file: a
snippet the code no longer holds makes that mutation stop with an error instead of testing the
tests, so every snippet is checked here, where CI runs (no GPU needed to read the files)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("gguf_run_mutations", ROOT / "tests" / "mutations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gguf_run_mutations", mod)  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod.MUTATIONS


@pytest.mark.parametrize("m", _mutations(), ids=lambda m: m.name)
def test_mutation_snippet_occurs_once(m):
    text = (ROOT / m.path).read_text()
    assert text.count(m.old) == 1, f"{m.name}: {m.old!r} occurs {text.count(m.old)} times in {m.path}"
    assert m.new != m.old and text.replace(m.old, m.new) != text
