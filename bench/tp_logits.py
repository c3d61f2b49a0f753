"""A model split over N GPUs against the same model on one: logits over a prompt and through the
cache (issue 37: cosine >= 0.999 on the twins at TP=2).

    python bench/tp_logits.py MODEL.gguf [--tp 2] [--prompt 64] [--more 8] [--seed 0]

Both backends live in this process (the whole model and rank 0 share GPU 0: the 70B twin needs
~40 + ~20 GiB there). Prints each row's cosine and whether the argmax agrees, then the worst row.
"""

from __future__ import annotations

import argparse

import numpy as np


def rows(be, prompt: list[int], more: list[int]) -> np.ndarray:
    if be.kv.capacity(0) < len(prompt) + len(more):
        be.kv.reserve(0, len(prompt) + len(more), stream=be.stream)
    be.truncate(0)
    out = [be.eval(prompt).reshape(1, -1)] + [be.eval([t]).reshape(1, -1) for t in more]
    return np.concatenate(out).astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--more", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from gguf_runtime.backends.cuda.backend import CudaBackend
    from gguf_runtime.backends.cuda.tensor_parallel import TensorParallelBackend
    from gguf_runtime.format.gguf_file import open_gguf
    from gguf_runtime.format.model_config import config_from_gguf

    f = open_gguf(args.model)
    cfg = config_from_gguf(f)
    n_ctx = -(-(args.prompt + args.more + 16) // 16) * 16
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(10, cfg.n_vocab, args.prompt).tolist()
    more = rng.integers(10, cfg.n_vocab, args.more).tolist()
    whole = rows(CudaBackend(f, cfg, n_ctx), prompt, more)
    split_be = TensorParallelBackend(f, cfg, n_ctx, args.tp)
    try:
        split = rows(split_be, prompt, more)
    finally:
        split_be.close()
    cos = (whole * split).sum(1) / (np.linalg.norm(whole, axis=1) * np.linalg.norm(split, axis=1))
    same = whole.argmax(1) == split.argmax(1)
    print(f"| row | cosine | argmax agrees |   ({cfg.name}, TP={args.tp} against one GPU)")
    print("| --: | --: | --- |")
    for i, (c, s) in enumerate(zip(cos, same)):
        print(f"| {'prompt' if i == 0 else f'+{i}'} | {c:.6f} | {'yes' if s else 'no'} |")
    print(f"worst cosine {cos.min():.6f}, argmax agrees on {int(same.sum())} of {len(same)} rows")


if __name__ == "__main__":
    main()
