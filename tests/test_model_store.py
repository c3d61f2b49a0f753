"""Models by name (issue 35 item 5): the Ollama store as Ollama lays it out (manifests and
sha256 blobs, the model layer being the GGUF itself), a --models folder, `gguf-run list`, and
`gguf-run NAME` running the default model's blob."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_runtime.errors import GGUFRunError
from gguf_runtime.format.model_store import ModelNotFoundError, list_models, parse_name, resolve

EXE = shutil.which("gguf-run", path=os.path.dirname(sys.executable)) or "gguf-run"
VOCAB = Path(__file__).parent / "data" / "tokenizer" / "ggml-vocab-qwen2.gguf"


def add_model(store: Path, name: tuple[str, str, str, str], gguf: Path) -> Path:
    """Ollama's layout for one pulled model: the GGUF as a blob named by its sha256, a template
    layer beside it, and the manifest that lists both."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    blob = blobs / f"sha256-{digest}"
    if not blob.exists():
        os.symlink(gguf, blob)  # (Ollama's blobs are plain files; a link keeps the test light)
    tmpl = b"{{ .Prompt }}"
    tdigest = hashlib.sha256(tmpl).hexdigest()
    (blobs / f"sha256-{tdigest}").write_bytes(tmpl)
    manifest = store.joinpath("manifests", *name)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                    "size": gguf.stat().st_size},
                   {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{tdigest}",
                    "size": len(tmpl)}]}))
    return blob


@pytest.fixture
def store(tmp_path, monkeypatch):
    s = tmp_path / "ollama"
    add_model(s, ("registry.ollama.ai", "library", "qwen3", "8b"), VOCAB)
    add_model(s, ("registry.ollama.ai", "library", "qwen3", "latest"), VOCAB)
    add_model(s, ("registry.ollama.ai", "someone", "mix", "q4"), VOCAB)
    add_model(s, ("hf.example.com", "org", "model", "v1"), VOCAB)
    monkeypatch.setenv("OLLAMA_MODELS", str(s))
    return s


def test_names_parse_as_ollama_does():
    assert parse_name("qwen3") == ("registry.ollama.ai", "library", "qwen3", "latest")
    assert parse_name("qwen3:8b") == ("registry.ollama.ai", "library", "qwen3", "8b")
    assert parse_name("someone/mix:q4") == ("registry.ollama.ai", "someone", "mix", "q4")
    assert parse_name("hf.example.com/org/model:v1") == ("hf.example.com", "org", "model", "v1")
    for bad in ("", "a/b/c/d", "../x", "x:", "x:../y", "a//b", "-x"):
        assert parse_name(bad) is None, bad


def test_store_names_resolve_to_blobs(store):
    blob = next((store / "blobs").glob("sha256-*"))
    gguf_blob = [b for b in (store / "blobs").iterdir() if b.is_symlink()][0]
    for name in ("qwen3:8b", "qwen3", "qwen3:latest", "someone/mix:q4", "hf.example.com/org/model:v1"):
        assert resolve(name) == str(gguf_blob), name
    assert blob.exists()
    assert [m.name for m in list_models()] == ["hf.example.com/org/model:v1", "qwen3:8b", "qwen3:latest",
                                               "someone/mix:q4"]


def test_folder_then_store(store, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(VOCAB, folder / "tiny.gguf")
    assert resolve("tiny", folder) == str(folder / "tiny.gguf")
    assert resolve("tiny.gguf", folder) == str(folder / "tiny.gguf")
    assert [m.name for m in list_models(folder)][0] == "tiny"
    assert resolve(str(VOCAB)) == str(VOCAB)  # a file is itself
    assert resolve("missing/path.gguf") == "missing/path.gguf"  # a path: the reader names the problem


def test_unknown_and_damaged_are_one_line(store):
    with pytest.raises(ModelNotFoundError) as e:
        resolve("llama3.2")
    msg = str(e.value)
    assert "\n" not in msg and "'llama3.2'" in msg and "qwen3:8b" in msg and str(store) in msg
    bad = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    with pytest.raises(GGUFRunError, match="manifest .* is unreadable .* re-pull"):
        resolve("broken")
    bad.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                           "digest": "sha256:" + "1" * 64}]}))
    with pytest.raises(GGUFRunError, match="which is missing; re-pull"):
        resolve("broken")
    bad.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                           "digest": "sha256:../../etc/passwd"}]}))
    with pytest.raises(GGUFRunError, match="names no single model layer"):
        resolve("broken")
    assert "broken:latest" not in [m.name for m in list_models()]  # listing skips what cannot load


def test_cli_list_and_run_by_name(tmp_path, smollm2_path):
    s = tmp_path / "ollama"
    add_model(s, ("registry.ollama.ai", "library", "smollm2", "135m"), Path(smollm2_path))
    env = {**os.environ, "OLLAMA_MODELS": str(s), "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([EXE, "list"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "smollm2:135m" in p.stdout and "Q4_1" in p.stdout and "llama" in p.stdout
    p = subprocess.run([EXE, "smollm2:135m", "-p", "Hi", "-n", "3", "--temp", "0", "--backend", "numpy"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([EXE, "nosuch:model", "-p", "Hi"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "smollm2:135m" in p.stderr, p.stderr


@pytest.mark.parametrize("cmd", [["list"], ["serve", "--port", "1"]])
def test_a_models_folder_that_is_not_one_is_one_line(tmp_path, cmd):
    """--models naming no folder (a typo, a file) is exit 2 naming it, before any load or listen; it
    listed nothing of it or served without it."""
    f = tmp_path / "file.gguf"
    f.write_bytes(b"GGUF")
    for where, words in ((tmp_path / "nosuch", "does not exist"), (f, "is a file")):
        p = subprocess.run([EXE, *cmd, "--models", str(where)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OLLAMA_MODELS": str(tmp_path / "store"), "PYTHONWARNINGS": "ignore"})
        err = p.stderr.strip()
        assert p.returncode == 2 and len(err.splitlines()) == 1 and words in err and str(where) in err, p


def test_serve_by_name_answers_to_it(tmp_path, smollm2_path):
    """`gguf-run serve NAME` serves the store's blob under NAME (not the blob's file name)."""
    import urllib.request

    from test_server import spawn_serve
    s = tmp_path / "ollama"
    add_model(s, ("registry.ollama.ai", "library", "smollm2", "135m"), Path(smollm2_path))
    p, url, _ = spawn_serve(128, ("smollm2:135m",), {"OLLAMA_MODELS": str(s)})
    try:
        with urllib.request.urlopen(url + "/api/tags", timeout=30) as r:
            assert [m["name"] for m in json.load(r)["models"]] == ["smollm2:135m"]
    finally:
        p.kill()
        p.wait(timeout=30)
