"""Well-formed files with nonsense in their metadata (tests/hostile_models.py): every one is refused
by the model check with one line naming the field, before anything is sized from it (bounded
memory), through the API and through the CLI (exit 2)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from gguf import GGUFValueType as V

from gguf_runtime.format.chat_template import ChatTemplate
from gguf_runtime.cli.app import main
from gguf_runtime.errors import GGUFRunError
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.format.tokenizer import Tokenizer
from hostile_models import METADATA_CASES, base_file, rewrite
from micro_models import Micro, write_micro


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_file(tmp_path_factory.mktemp("hostile"))


def test_the_base_file_loads(base):
    f = open_gguf(base)
    assert config_from_gguf(f).n_layer == 2 and Tokenizer.from_metadata(f.metadata).encode("Hello")


@pytest.mark.parametrize("name,changes,words", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_nonsense_metadata_is_one_line(base, tmp_path, name, changes, words):
    path = rewrite(base, tmp_path / "bad.gguf", changes)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFRunError) as ei:
            f = open_gguf(path)
            config_from_gguf(f)
            Tokenizer.from_metadata(f.metadata)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 400, msg
    for w in words:
        assert w in msg, (w, msg)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB before the error"


def test_tensors_the_model_does_not_use_are_never_read(tmp_path):
    """A tensor of the file the model does not name (any type, any size: an unsupported one, a
    gigabyte of blocks) is not dequantized at load: it failed the load or took its memory."""
    from gguf_runtime.engine.engine import Engine
    path = write_micro(Micro(n_layer=1, extra=(("stray.weight", 64),)), tmp_path / "extra.gguf")
    eng = Engine(str(path), backend="numpy", n_ctx=32)
    assert "blk.0.attn_q.weight" in eng.backend._weights and "stray.weight" not in eng.backend._weights


def test_info_abbreviates_every_level():
    """`info`'s metadata lines stay one short line whatever an array holds: its strings abbreviated
    (a 20 MB token was printed whole), nested arrays on one line, three levels at most."""
    from gguf_runtime.format.model_info import summarize_value
    line = summarize_value(["z" * 20_000_000, np.arange(10, dtype=np.int32), [[[[1]]]], np.float32(0.5)])
    assert "\n" not in line and len(line) < 1000 and "(20000000 chars)" in line and "[...]" in line, line
    assert summarize_value(np.array([1, 2], np.int32)) == "[1, 2]" and summarize_value(["a"]) == "['a']"


def test_non_finite_metadata_shows_as_json(base, tmp_path):
    """/api/show's model_info of a file with NaN and infinite values is strict JSON (the values as
    text): it was a 500 (JSON has no NaN)."""
    import json

    from gguf_runtime.server.schemas import ModelCard
    path = rewrite(base, tmp_path / "nan.gguf", {"general.some_score": (V.FLOAT32, float("nan")),
                                                 "general.other": (V.FLOAT64, float("-inf"))})
    info = ModelCard.from_file(str(path), "m").show()["model_info"]
    json.dumps(info, allow_nan=False)
    assert info["general.some_score"] == "nan" and info["general.other"] == "-inf"


@pytest.mark.parametrize("pattern", [[np.array([1, 0], np.int32)] * 6, ["yes"] * 6, np.array([1, 0, 1], np.int32)])
def test_a_sliding_window_pattern_not_of_flags_is_one_line(tmp_path, pattern):
    """Gemma-3's per-layer sliding-window flags: nested arrays (a traceback before), strings (taken
    as flags) or the wrong count are one line naming the key; six flags load."""
    g = write_micro(Micro(arch="gemma3", vocab="llama-spm", n_layer=6, sliding_window=4, qk_norm=True,
                          post_norms=True, head_dim=32, n_head_kv=1), tmp_path / "g.gguf")
    key = "gemma3.attention.sliding_window_pattern"
    good = rewrite(g, tmp_path / "good.gguf", {key: (V.ARRAY, np.array([1, 1, 0, 1, 1, 0], np.int32))})
    assert config_from_gguf(open_gguf(good)).n_layer == 6
    bad = rewrite(g, tmp_path / "bad.gguf", {key: (V.ARRAY, pattern)})
    with pytest.raises(GGUFRunError, match="sliding_window_pattern") as ei:
        config_from_gguf(open_gguf(bad))
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("name,changes,words", METADATA_CASES[::4] + METADATA_CASES[-1:],
                         ids=[c[0] for c in METADATA_CASES[::4] + METADATA_CASES[-1:]])
def test_cli_info_and_run_say_one_line(base, tmp_path, capsys, name, changes, words):
    """`run` refuses in one line (exit 2); `info` shows what it can read, naming the problem, or
    refuses in one line; neither prints a control character from the file."""
    path = rewrite(base, tmp_path / "bad.gguf", changes)
    rc = main([str(path), "-p", "hi", "--backend", "numpy", "-n", "2"])
    out, err = capsys.readouterr()
    err = err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and not out.strip(), (rc, out, err)
    assert "\x1b" not in err
    rc = main(["info", str(path)])
    out, err = capsys.readouterr()
    assert rc in (0, 2) and "\x1b" not in out + err, (rc, out, err)
    if rc == 2:
        assert err.startswith("error: ") and "\n" not in err.strip()
    else:
        assert "\narchitecture\n" in out, out


WRONG = [("a string", V.STRING, "x\x1b[2J"), ("a negative int", V.INT32, -1), ("nan", V.FLOAT32, float("nan")),
         ("an int array", V.ARRAY, np.array([1, 2], np.int32)), ("a string array", V.ARRAY, ["a", "b"])]


def load_everything(path):
    """What `run` does before generating: config, tokenizer, chat template, a tokenized chat."""
    f = open_gguf(path)
    config_from_gguf(f)
    tok = Tokenizer.from_metadata(f.metadata)
    template = ChatTemplate.from_metadata(f.metadata, tok.token_to_piece)
    tok.encode(template.render([{"role": "user", "content": "Hello"}], add_generation_prompt=True))


def test_every_key_wrong_in_type_is_refused_or_harmless(base, tmp_path):
    """Each metadata key of the base file set to each wrong kind of value: the file loads, or the load
    ends in one GGUFRunError line; never another exception."""
    keys = list(open_gguf(base).metadata)
    assert len(keys) > 15
    outcomes = {"loads": 0, "refused": 0}
    for key in keys:
        for what, vtype, value in WRONG:
            path = rewrite(base, tmp_path / "bad.gguf", {key: (vtype, value)})
            try:
                load_everything(path)
                outcomes["loads"] += 1
            except GGUFRunError as e:
                assert "\n" not in str(e) and "\x1b" not in str(e), (key, what, str(e))
                outcomes["refused"] += 1
            except Exception as e:  # noqa: BLE001 - the point: no other kind
                raise AssertionError(f"{key} as {what}: {type(e).__name__}: {e}") from e
    assert outcomes["refused"] > len(keys), outcomes  # most keys matter


@pytest.mark.parametrize("temp,tensor,value", [("0", "output_norm.weight", np.nan),
                                               ("0.8", "output_norm.weight", np.nan),
                                               ("0", "blk.0.attn_q.weight", np.inf)])
def test_non_finite_weights_are_one_line(tmp_path, capsys, temp, tensor, value):
    """A NaN, an infinity or a value that overflows in a weight: not silence (greedy) nor a sampler
    traceback nor numpy's warnings, but one line saying the weights are damaged."""
    import warnings

    path = write_micro(Micro(), tmp_path / "nan.gguf")
    with open_gguf(path) as f:
        at = f.tensors[tensor].offset
    data = bytearray(path.read_bytes())
    data[at:at + 4] = np.float32(value).tobytes()
    path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main([str(path), "-p", "hi", "--backend", "numpy", "-n", "4", "--temp", temp])
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "damaged" in err and "\n" not in err, (rc, err)
