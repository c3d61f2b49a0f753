"""What `gguf-run info` shows: metadata, architecture summary, quant histogram, sizes."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import GGUFRunError
from .gguf_file import GGUFFile
from .model_config import config_from_gguf

ARRAY_PREVIEW = 6
STRING_PREVIEW = 160


@dataclass
class QuantRow:
    type_name: str
    tensors: int
    params: int
    bytes: int


def summarize_value(v: Any, depth: int = 0) -> str:
    """A one-line rendering of a metadata value; long arrays and strings are abbreviated, at every
    level (an array's items too), and arrays past three levels shown as [...]."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, str):
        s = v.replace("\n", "\\n")
        return repr(s if len(s) <= STRING_PREVIEW else s[:STRING_PREVIEW] + "...") + (
            f" ({len(v)} chars)" if len(s) > STRING_PREVIEW else "")
    if isinstance(v, (list, np.ndarray)):
        if depth >= 3:
            return "[...]"
        more = f", ... ({len(v)} items)" if len(v) > ARRAY_PREVIEW else ""
        return "[" + ", ".join(summarize_value(x, depth + 1) for x in list(v[:ARRAY_PREVIEW])) + more + "]"
    return repr(v)


def quant_histogram(f: GGUFFile) -> list[QuantRow]:
    rows: dict[str, QuantRow] = {}
    for t in f.tensors.values():
        r = rows.setdefault(t.type_name, QuantRow(t.type_name, 0, 0, 0))
        r.tensors += 1
        r.params += t.n_elems
        r.bytes += t.nbytes
    return sorted(rows.values(), key=lambda r: -r.bytes)


def model_info(f: GGUFFile) -> dict[str, Any]:
    """Everything `info` prints, as plain data (the architecture part may hold an error line)."""
    hist = quant_histogram(f)
    params = sum(r.params for r in hist)
    weight_bytes = sum(r.bytes for r in hist)
    try:
        arch: dict[str, Any] | str = asdict(config_from_gguf(f))
    except GGUFRunError as e:
        arch = str(e)
    return {
        "path": f.path,
        "file_bytes": f.size,
        "gguf_version": f.version,
        "n_tensors": len(f.tensors),
        "params": params,
        "weight_bytes": weight_bytes,
        "bits_per_weight": 8 * weight_bytes / params if params else 0.0,
        "quant": hist,
        "ftype_counts": Counter(t.type_name for t in f.tensors.values()),
        "architecture": arch,
        "metadata": {k: summarize_value(v) for k, v in f.metadata.items()},
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))
