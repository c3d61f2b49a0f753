"""One prefill and one decode step on a twin, for compute-sanitizer (bench/gpu_session.py)."""

import sys

from gguf_runtime.engine.decode_loop import sample_loop
from gguf_runtime.backends.cuda.backend import CudaBackend
from gguf_runtime.format.gguf_file import open_gguf
from gguf_runtime.format.model_config import config_from_gguf
from gguf_runtime.sampling import SamplingParams

f = open_gguf(sys.argv[1])
cfg = config_from_gguf(f)
be = CudaBackend(f, cfg, 64)
for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)):
    be.truncate(0)
    be.prefill([1, 2, 3, 4])
    print(list(sample_loop(be, 2, params, [1, 2, 3, 4], frozenset())))
be.truncate(0)
be.prefill(list(range(1, 20)))  # the cuBLAS prefill path
be.stream.synchronize()
print("ok")
