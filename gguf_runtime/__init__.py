"""gguf-run: a runtime for GGUF quantized LLMs with a numpy reference backend and a CUDA backend."""

__version__ = "0.1.0"
