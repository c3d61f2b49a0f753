"""How far the CUDA backend's logits are from the numpy backend's on a twin (the correctness
margin behind tests/test_gpu_backend.py): cosine, relative error, argmax agreement, and the numpy
top-2 gap where the argmax differs. Usage: python3 bench/logit_error.py MODEL.gguf [...]"""

import sys

import numpy as np

from gguf_runtime.backend_cuda import CudaBackend
from gguf_runtime.backend_numpy import NumpyBackend
from gguf_runtime.gguf_file import open_gguf
from gguf_runtime.model_config import config_from_gguf


def main(paths: list[str]) -> None:
    for path in paths:
        f = open_gguf(path)
        cfg = config_from_gguf(f)
        npb, cub = NumpyBackend(f, cfg, 256), CudaBackend(f, cfg, 256)
        rng = np.random.default_rng(0)
        cos, err, agree, gaps = [], [], [], []
        for _ in range(6):
            ids = rng.integers(0, cfg.n_vocab, 7).tolist()
            npb.truncate(0)
            cub.truncate(0)
            ref = npb.eval(ids, all_logits=True).astype(np.float64)
            got = cub.eval(ids, all_logits=True).astype(np.float64)
            cos += list((got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1))
            err += list(np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1))
            same = got.argmax(-1) == ref.argmax(-1)
            agree += list(same)
            top2 = np.sort(ref, -1)[:, -2:]
            gaps += list((top2[:, 1] - top2[:, 0])[~same] / ref.std(-1)[~same])
        print(f"{path.split('/')[-1]}: cosine min {min(cos):.6f}, rel err mean {np.mean(err):.2e} max {max(err):.2e}, "
              f"argmax agree {np.mean(agree):.3f} of {len(agree)}, gaps where not (in std) {np.round(gaps, 4).tolist()}")


if __name__ == "__main__":
    main(sys.argv[1:])
