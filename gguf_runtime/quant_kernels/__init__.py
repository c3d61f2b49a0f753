"""Quantized tensor formats: the block table, numpy reference dequantization, CUDA kernels.

A leaf package: it imports numpy (and cupy, in the CUDA launchers) and nothing else of ours.
"""
