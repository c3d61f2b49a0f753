"""What `gguf-run bench` prints: the result object (its --json), llama-bench's table, the plot.

The result is plain data (``result(...)``), so the table and the plot can be redrawn from a saved
--json file (bench/gpu_session.py does).
"""

from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any, Sequence

from .bench import Rate
from ..format.model_config import ModelConfig
from ..format.model_info import human_bytes


def model_label(f, cfg: ModelConfig, params: int) -> str:
    """llama-bench's model column: architecture, size class, file type ("llama 135M Q4_1")."""
    size = f.metadata.get("general.size_label") or (f"{params / 1e9:.0f}B" if params >= 1e9
                                                      else f"{params / 1e6:.0f}M")
    ftype = f.metadata.get("general.file_type")
    try:
        import gguf

        kind = gguf.LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
    except Exception:  # absent or unknown: the type holding most bytes
        by = {}
        for t in f.tensors.values():
            by[t.type_name] = by.get(t.type_name, 0) + t.nbytes
        kind = max(by, key=by.get) if by else "?"
    return f"{cfg.arch} {size} {kind}"


def git_commit() -> str | None:
    """Short hash of the checkout this package runs from ("-dirty" with local changes), if any;
    $GGUF_RUN_COMMIT names it where the tree is a copy without .git (the GPU machine)."""
    if os.environ.get("GGUF_RUN_COMMIT"):
        return os.environ["GGUF_RUN_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(root, ".git")):
        return None
    try:
        h = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD"], capture_output=True,
                               timeout=5).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return (h + ("-dirty" if dirty else "")) if h else None


def result(*, f, cfg: ModelConfig, path: str, backend: str, device: str, bandwidth: float | None,
           bandwidth_method: str, weights_read: int, rows: Sequence[Rate], settings: dict, load_s: float,
           skipped: Sequence[str] = (), ollama: dict | None = None) -> dict[str, Any]:
    from .. import __version__

    params = sum(t.n_elems for t in f.tensors.values())
    size = sum(t.nbytes for t in f.tensors.values())
    out = {
        "gguf_run": __version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"name": device, "backend": backend, "bandwidth_gbs": bandwidth,
                   "bandwidth_method": bandwidth_method},
        "model": {"path": path, "name": cfg.name, "arch": cfg.arch, "label": model_label(f, cfg, params),
                  "size_bytes": size, "params": params, "file_bytes": f.size, "weights_read_per_step": weights_read},
        "settings": settings,
        "load_s": load_s,
        "rows": [r.as_dict(bandwidth) for r in rows],
        "skipped": list(skipped),
    }
    if ollama is not None:
        out["ollama"] = ollama
    return out


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _table(header: Sequence[str], right: Sequence[bool], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table with aligned columns, as llama-bench prints."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    pad = lambda s, w, r: s.rjust(w) if r else s.ljust(w)  # noqa: E731
    lines = ["| " + " | ".join(pad(h, w, r) for h, w, r in zip(header, widths, right)) + " |",
             "| " + " | ".join(("-" * (w - 1) + ":") if r else "-" * w for w, r in zip(widths, right)) + " |"]
    lines += ["| " + " | ".join(pad(c, w, r) for c, w, r in zip(row, widths, right)) + " |" for row in rows]
    return "\n".join(lines)


def _rate(mean: float, stdev: float) -> str:
    return f"{mean:.2f} ± {stdev:.2f}"


def render_table(res: dict) -> str:
    """The device line, llama-bench's table with GB/s and share, a note on how GB/s is counted,
    and the Ollama comparison when there is one."""
    dev, m = res["device"], res["model"]
    bw = dev.get("bandwidth_gbs")
    lines = [f"device: {dev['name']}; backend: {dev['backend']}"
             + (f"; bandwidth: {bw:,.1f} GB/s ({dev['bandwidth_method']}, read + write)" if bw else ""), ""]
    head = ["model", "size", "params", "backend", "mode", "test", "t/s", "GB/s", "share"]
    right = [False, True, True, False, False, True, True, True, True]
    rows = []
    for r in res["rows"]:
        rows.append([m["label"], human_bytes(m["size_bytes"]), _params(m["params"]), dev["backend"], r["mode"],
                     r["test"], _rate(r["mean"], r["stdev"]), "" if r["gbs"] is None else f"{r['gbs']:.2f}",
                     "" if r["share"] is None else f"{100 * r['share']:.1f}%"])
    lines.append(_table(head, right, rows))
    if any(r["gbs"] is not None for r in res["rows"]):
        lines.append("")
        lines.append(f"GB/s: bytes a decode step reads (weights: {human_bytes(m['weights_read_per_step'])} as the "
                     f"{dev['backend']} backend holds them; KV cache: every sequence's at its mean context) x steps/s"
                     + ("; share: of the bandwidth above" if bw else ""))
    if res.get("ollama"):
        lines += ["", render_ollama(res["ollama"], dev["backend"])]
    return "\n".join(lines)


def render_ollama(o: dict, backend: str) -> str:
    ours, theirs = o["gguf_run"], o["ollama"]
    mode = ours[-1]["mode"] if backend.startswith("cuda") else ""
    col = f"gguf-run {backend}{' ' + mode if mode else ''} t/s"
    rows = []
    for a, b in zip(ours, theirs):
        rows.append([a["test"], _rate(a["mean"], a["stdev"]), _rate(b["mean"], b["stdev"]),
                     f"{a['mean'] / b['mean']:.2f}x" if b["mean"] else ""])
    s = (f"Ollama {o.get('version') or ''} at {o['url']}, model {o['model']}: the same {o['n_prompts']} "
         f"prompts of {o['prompt_tokens']} tokens, {o['n_gen']} generated, greedy, seed {o['seed']}\n")
    s += _table(["test", col, "Ollama t/s", "gguf-run / Ollama"], [True, True, True, True], rows)
    s += (f"\nload: gguf-run {o['load_s']['gguf_run']:.2f} s, Ollama {o['load_s']['ollama']:.2f} s "
          f"(load_duration of its first request); Ollama counted {o['ollama_prompt_tokens']} prompt tokens, "
          f"{o['ollama_eval_tokens']} generated")
    return s


def plot(res: dict, path: str) -> None:
    """Generated tokens per second against batch size, a line per mode (single-sequence tg rows
    at batch size 1 when no batched rows were measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = {}
    batched = [r for r in res["rows"] if r["batch"]]
    for r in batched or [r for r in res["rows"] if r["test"].startswith("tg")]:
        series.setdefault(r["mode"], []).append((r["batch"] or 1, r["mean"], r["stdev"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, pts in sorted(series.items()):
        pts.sort()
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                    label=mode)
    xs = sorted({p[0] for pts in series.values() for p in pts}) or [1]
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("batch size (sequences decoded together)")
    ax.set_ylabel("generated tokens / s")
    gen = res["settings"].get("n_gen")
    ax.set_title(f"{res['model']['label']}, {res['device']['backend']}: tg{gen} throughput\n{res['device']['name']}"
                 + ("" if batched else " (single sequence only)"), fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(title="mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
