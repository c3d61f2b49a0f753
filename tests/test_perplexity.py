"""gguf-run perplexity (tools/perplexity.py): llama-perplexity's chunks and scoring, the prefill and
decode paths against each other and against log-softmax computed here, its errors."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from gguf_runtime.backends.numpy.backend import NumpyBackend
from gguf_runtime.cli.app import main
from gguf_runtime.errors import GGUFRunError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.tools.perplexity import chunks_of, perplexity
from micro_models import Micro, write_micro

WORDS = "the of and to in is was for on that with as by at from his her it an be are this which were".split()


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    path = write_micro(Micro(), tmp_path_factory.mktemp("ppl") / "micro.gguf")
    f = open_gguf(path)
    return path, f, config_from_gguf(f)


def text(n_words: int, seed: int = 0) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(n_words))


def test_chunks_replace_the_first_token_with_bos():
    ids = list(range(100, 170))
    assert chunks_of(ids, 32, bos=1) == [[1] + ids[1:32], [1] + ids[33:64]]
    assert chunks_of(ids, 32, bos=None, limit=1) == [ids[:32]]
    for bad in (15, 33):
        with pytest.raises(GGUFRunError, match="even number of at least 16"):
            chunks_of(ids, bad, 1)
    with pytest.raises(GGUFRunError, match="needs at least one chunk of 128"):
        chunks_of(ids, 128, 1)


def test_both_paths_equal_log_softmax_computed_here(micro, rng):
    """The second half of each chunk scored, from an empty cache: the prefill path equals
    float64 log-softmax of the numpy backend's logits; the decode path (one token per call)
    agrees to float32 rounding."""
    _, f, cfg = micro
    ids = rng.integers(3, cfg.n_vocab, 3 * 48).tolist()
    be = NumpyBackend(f, cfg, 48)
    pre = perplexity(be, ids, 48, bos=1, path="prefill")
    dec = perplexity(be, ids, 48, bos=1, path="decode")
    assert pre.chunks == dec.chunks == 3 and pre.scored == dec.scored == 3 * 24
    nll = []
    for c in range(3):
        chunk = [1] + ids[c * 48 + 1:(c + 1) * 48]
        be.truncate(0)
        logits = be.eval(chunk[:-1], all_logits=True).astype(np.float64)
        for i in range(23, 47):
            row = logits[i]
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[chunk[i + 1]])
    assert pre.value == pytest.approx(math.exp(np.mean(nll)), rel=1e-12)
    assert dec.value == pytest.approx(pre.value, rel=1e-5)
    assert 1 < pre.value < 10 * cfg.n_vocab and pre.error > 0


def test_cli_json_and_errors(micro, tmp_path, capsys):
    path, _, _ = micro
    src = tmp_path / "t.txt"
    src.write_text(text(400))
    rc = main(["perplexity", str(path), "-f", str(src), "-c", "32", "--chunks", "2", "--backend", "numpy",
               "--json", "-q", "--path", "both"])
    out, err = capsys.readouterr()
    assert rc in (0, None), err
    res = json.loads(out)
    a, b = res["results"]
    assert (a["path"], b["path"]) == ("prefill", "decode") and a["chunks"] == 2 and a["tokens_scored"] == 32
    assert b["ppl"] == pytest.approx(a["ppl"], rel=1e-5)
    rc = main(["perplexity", str(path), "-f", str(tmp_path / "missing.txt"), "--backend", "numpy", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "missing.txt" in err and "\n" not in err, err
    rc = main(["perplexity", str(path), "-f", str(src), "-c", "4096", "--backend", "numpy", "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "at least one chunk of 4,096" in err, err
