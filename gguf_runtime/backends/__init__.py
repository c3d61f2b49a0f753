"""The backends: ``numpy/`` (the reference every other path is tested against) and ``cuda/``.

Each offers prefill / eval / truncate / sample_loop over one ``format.ModelConfig``; the CUDA one
adds slots for batched decoding. ``host_loop`` samples on the host for both.
"""
