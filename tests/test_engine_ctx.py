"""-c / n_ctx: 0 means the model's trained context (llama.cpp's -c 0); below 8 one line."""

from __future__ import annotations

import pytest

from gguf_runtime.cli.app import main
from gguf_runtime.engine.engine import Engine
from gguf_runtime.errors import GGUFRunError
from micro_models import Micro, write_micro


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return write_micro(Micro(), tmp_path_factory.mktemp("ctx") / "micro.gguf")


def test_zero_is_the_trained_context(micro):
    eng = Engine(micro, backend="numpy", n_ctx=0)
    assert eng.n_ctx == eng.cfg.n_ctx_train > 0
    assert Engine(micro, backend="numpy").n_ctx == min(4096, eng.cfg.n_ctx_train)


def test_tiny_contexts_are_one_line(micro, capsys):
    with pytest.raises(GGUFRunError, match="context size 3 is too small"):
        Engine(micro, backend="numpy", n_ctx=3)
    rc = main([str(micro), "-p", "hi", "-c", "3", "--backend", "numpy", "-n", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "--ctx-size 8 or more" in err, err
