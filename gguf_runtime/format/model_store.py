"""Models by name: the local Ollama store and a folder of .gguf files (issue 35 item 5).

Ollama keeps a model as a manifest and content-addressed blobs (read here, never written):

    $OLLAMA_MODELS or ~/.ollama/models
      manifests/<host>/<namespace>/<model>/<tag>   JSON: {"layers": [{"mediaType", "digest", "size"}, ...]}
      blobs/sha256-<64 hex>                        the layer of mediaType application/vnd.ollama.image.model
                                                   is the GGUF file itself

A name is ``[host/][namespace/]model[:tag]``, as Ollama parses it: host registry.ollama.ai,
namespace library and tag latest when left out, so ``qwen3:8b`` is
manifests/registry.ollama.ai/library/qwen3/8b. Names are listed the short way Ollama lists them.
A ``--models DIR`` folder names each ``*.gguf`` file by its stem.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFRunError

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")  # one path part of a name (no "..", no "/")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
MAX_MANIFEST_BYTES = 1 << 20


class ModelNotFoundError(GGUFRunError):
    """A name that is neither a file nor a model of the store or the models folder."""


@dataclass(frozen=True)
class StoredModel:
    name: str  # as listed: model:tag, namespace/model:tag or host/namespace/model:tag; a folder's file stem
    path: Path  # the GGUF file (an Ollama blob, or the folder's file)
    size: int
    modified: float  # seconds since the epoch (the manifest's, or the file's)


def ollama_dir() -> Path:
    """Ollama's store, where Ollama itself keeps it (its own OLLAMA_MODELS setting, else the default)."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def parse_name(name: str) -> tuple[str, str, str, str] | None:
    """(host, namespace, model, tag) of an Ollama name; None when it is not one."""
    base, tag = name, DEFAULT_TAG
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        base, tag = name[:-(len(last) - last.index(":"))], last[last.index(":") + 1:]
    parts = base.split("/")
    if not 1 <= len(parts) <= 3 or not all(_PART.match(p) for p in [*parts, tag]):
        return None
    if len(parts) == 1:
        parts = [DEFAULT_HOST, DEFAULT_NAMESPACE, *parts]
    elif len(parts) == 2:
        parts = [DEFAULT_HOST, *parts]
    return parts[0], parts[1], parts[2], tag


def short_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host != DEFAULT_HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == DEFAULT_NAMESPACE else f"{namespace}/{model}:{tag}"


def _blob(store: Path, manifest: Path) -> Path:
    """The model layer's blob of a manifest; one line naming the manifest when it is not usable."""
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            raise ValueError("too large")
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers")
        digests = [lay.get("digest") for lay in layers if isinstance(lay, dict) and lay.get("mediaType") == MODEL_LAYER]
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise GGUFRunError(f"Ollama manifest {manifest} is unreadable ({type(e).__name__}); re-pull the model") from None
    m = _DIGEST.match(digests[0]) if len(digests) == 1 and isinstance(digests[0], str) else None
    if m is None:
        raise GGUFRunError(f"Ollama manifest {manifest} names no single model layer; re-pull the model")
    blob = store / "blobs" / f"sha256-{m.group(1)}"
    if not blob.is_file():
        raise GGUFRunError(f"Ollama manifest {manifest} points to {blob}, which is missing; re-pull the model")
    return blob


def ollama_models(store: Path | None = None) -> list[StoredModel]:
    """Every model of the Ollama store (damaged manifests skipped), by name."""
    store = store or ollama_dir()
    root = store / "manifests"
    out = []
    for manifest in sorted(root.glob("*/*/*/*")) if root.is_dir() else []:
        host, namespace, model, tag = manifest.relative_to(root).parts
        if not manifest.is_file() or not all(_PART.match(p) for p in (host, namespace, model, tag)):
            continue
        try:
            blob = _blob(store, manifest)
        except GGUFRunError:
            continue
        out.append(StoredModel(short_name(host, namespace, model, tag), blob, blob.stat().st_size,
                               manifest.stat().st_mtime))
    return out


def folder_models(folder: Path) -> list[StoredModel]:
    """The .gguf files of a folder, named by their stems."""
    return [StoredModel(p.stem, p, p.stat().st_size, p.stat().st_mtime)
            for p in sorted(folder.glob("*.gguf")) if p.is_file()]


def list_models(models_dir: str | os.PathLike | None = None) -> list[StoredModel]:
    """The models folder's files, then the Ollama store's models."""
    return (folder_models(Path(models_dir)) if models_dir else []) + ollama_models()


def resolve(name: str, models_dir: str | os.PathLike | None = None) -> str:
    """A model argument as a file path: an existing file as it is; else a file of the models folder
    (by stem, with or without .gguf), else an Ollama name. Else one line with what is there."""
    if os.path.isfile(name):
        return name
    if models_dir:
        folder = Path(models_dir)
        for candidate in (folder / name, folder / f"{name}.gguf"):
            if candidate.is_file() and candidate.parent == folder:
                return str(candidate)
    parsed = parse_name(name)
    store = ollama_dir()
    if parsed is not None:
        manifest = store.joinpath("manifests", *parsed)
        if manifest.is_file():
            return str(_blob(store, manifest))
    if name.endswith(".gguf") or os.sep in name and parsed is None or os.path.exists(name):
        return name  # a path: the reader names what is wrong with it
    known = [m.name for m in list_models(models_dir)]
    where = f"{store}" + (f" or {models_dir}" if models_dir else "")
    have = f"; models there: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}" if known else \
        "; no models there (gguf-run list shows them)"
    raise ModelNotFoundError(f"model '{name}' is not a file, nor a model in {where}{have}")
