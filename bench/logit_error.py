"""How far each CUDA path's logits are from the numpy backend's (float32) and from the path model
(tests/path_model.py: numpy with the path's own rounding), on twins: the measured error behind the
bars of tests/test_gpu_backend.py. Per path and reference: max over rows of 1 - cos, of the relative
L2 error, and of max |diff| / max |ref|, and the argmax agreement.

Usage (GPU machine): python3 bench/logit_error.py [--prompts N] MODEL.gguf [...]
       (any machine):  python3 bench/logit_error.py --chaos MODEL.gguf [...]

--chaos measures why no numpy model of the rounding paths can be tight on deep models: the path
model's own logits move by as much as the rounding itself when the embeddings move by 1e-6.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from path_model import PathModel  # noqa: E402

from gguf_runtime.backends.numpy.backend import NumpyBackend  # noqa: E402
from gguf_runtime.format.gguf_file import open_gguf  # noqa: E402
from gguf_runtime.format.model_config import config_from_gguf  # noqa: E402


def errors(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    a, b = got.astype(np.float64), ref.astype(np.float64)
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    return {"1-cos": float((1 - cos).max()),
            "rel_l2": float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max()),
            "max_rel": float((np.abs(a - b).max(-1) / np.abs(b).max(-1)).max()),
            "argmax": float((a.argmax(-1) == b.argmax(-1)).mean())}


def run_path(be, ids: list[int], more: list[int]) -> np.ndarray:
    be.truncate(0)
    out = [be.eval(ids, all_logits=True)]
    out += [be.eval([t]).reshape(1, -1) for t in more]
    return np.concatenate(out)


class Perturbed(PathModel):
    """The path model with every embedding scaled by 1 + 1e-6 (float32 noise's size)."""

    def embed(self, tokens):
        return super().embed(tokens) * np.float32(1 + 1e-6)


def chaos(path: str, n_prompt: int = 7) -> None:
    f = open_gguf(path)
    cfg = config_from_gguf(f)
    ids = np.random.default_rng(1000).integers(0, cfg.n_vocab, n_prompt).tolist()
    f32 = NumpyBackend(f, cfg, 64).eval(ids, all_logits=True)
    for q8 in (True, False):
        a = PathModel(f, cfg, 64, q8=q8).eval(ids, all_logits=True)
        b = Perturbed(f, cfg, 64, q8=q8).eval(ids, all_logits=True)
        e, r = errors(b, a), errors(a, f32)
        print(f"{os.path.basename(path):16s} {'int8' if q8 else 'f32 '} model, embeddings x (1 + 1e-6): "
              f"rel_l2 {e['rel_l2']:.3g}  (the model against float32 numpy: {r['rel_l2']:.3g})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--chaos", action="store_true", help="the perturbation experiment (numpy only)")
    args = ap.parse_args()
    if args.chaos:
        for path in args.models:
            chaos(path)
        return
    from gguf_runtime.backends.cuda.backend import CudaBackend

    for path in args.models:
        f = open_gguf(path)
        cfg = config_from_gguf(f)
        name = os.path.basename(path)
        cub = CudaBackend(f, cfg, 256)
        cub16 = CudaBackend(f, cfg, 256, kv_type="f16")
        cuf = CudaBackend(f, cfg, 256, tune=dataclasses.replace(cub.tune, q8=False))
        f32 = NumpyBackend(f, cfg, 256)
        models = {"q8": PathModel(f, cfg, 256), "f32": PathModel(f, cfg, 256, q8=False),
                  "q8kv16": PathModel(f, cfg, 256, kv16=True)}
        paths = [("matvec q8, 7 + 3 tokens", cub, "q8", 7), ("prefill f16, 40 + 3 tokens", cub, "q8", 40),
                 ("matvec f32 (Q8=0), 7 + 3", cuf, "f32", 7), ("prefill f16 (Q8=0), 40 + 3", cuf, "f32", 40),
                 ("kv f16, 40 + 3", cub16, "q8kv16", 40), ("kv f16, 7 + 3", cub16, "q8kv16", 7)]
        for label, be, model, n in paths:
            rows = {"f32": [], "model": []}
            for s in range(args.prompts):
                rng = np.random.default_rng(1000 + s)
                ids = rng.integers(0, cfg.n_vocab, n).tolist()
                more = rng.integers(0, cfg.n_vocab, 3).tolist()
                got = run_path(be, ids, more)
                rows["f32"].append(errors(got, run_path(f32, ids, more)))
                rows["model"].append(errors(got, run_path(models[model], ids, more)))
            for ref, rs in rows.items():
                worst = {k: (min if k == "argmax" else max)(r[k] for r in rs) for k in rs[0]}
                print(f"{name:16s} {label:30s} vs {ref:5s}: " + "  ".join(f"{k} {v:.3g}" for k, v in worst.items()),
                      flush=True)


if __name__ == "__main__":
    main()
