"""A model split over N GPUs against the same model on one: logits over a prompt and through the
cache (issue 37: cosine >= 0.999 on the twins at TP=2).

    python bench/tp_logits.py MODEL.gguf [--tp 2] [--prompt 64] [--more 8] [--seed 0] [--scale]

Both backends live in this process (the whole model and rank 0 share GPU 0: the 70B twin needs
~40 + ~20 GiB there). Prints each row's cosine and whether the argmax agrees, then the worst row.
--scale also runs the whole model on the float32 path (q8=0, an f32 KV cache; first, then freed)
and prints the default path's own cosine against it beside each row: the distance the split's
should be read against.
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
    ap.add_argument("--scale", action="store_true", help="also the one-GPU int8 path against its float32 path")
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
    ref = None
    if args.scale:
        import os

        import cupy as cp

        saved = os.environ.get("GGUF_RUN_TUNE")
        os.environ["GGUF_RUN_TUNE"] = "q8=0;kv_type=f32"
        try:
            be = CudaBackend(f, cfg, n_ctx)
        finally:
            os.environ.pop("GGUF_RUN_TUNE")
            if saved is not None:
                os.environ["GGUF_RUN_TUNE"] = saved
        ref = rows(be, prompt, more)
        del be
        cp.get_default_memory_pool().free_all_blocks()
    whole = rows(CudaBackend(f, cfg, n_ctx), prompt, more)
    split_be = TensorParallelBackend(f, cfg, n_ctx, args.tp)
    try:
        split = rows(split_be, prompt, more)
    finally:
        split_be.close()
    cos = cosines(whole, split)
    same = whole.argmax(1) == split.argmax(1)
    own = cosines(whole, ref) if ref is not None else None
    extra = " one GPU: int8 vs f32 |" if own is not None else ""
    print(f"| row | cosine | argmax agrees |{extra}   ({cfg.name}, TP={args.tp} against one GPU)")
    print("| --: | --: | --- |" + (" --: |" if own is not None else ""))
    for i, (c, s) in enumerate(zip(cos, same)):
        tail = f" {own[i]:.6f} |" if own is not None else ""
        print(f"| {'prompt' if i == 0 else f'+{i}'} | {c:.6f} | {'yes' if s else 'no'} |{tail}")
    print(f"worst cosine {cos.min():.6f}, argmax agrees on {int(same.sum())} of {len(same)} rows"
          + (f"; one GPU's int8 path against its float32 path: worst {own.min():.6f}" if own is not None else ""))


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


if __name__ == "__main__":
    main()
