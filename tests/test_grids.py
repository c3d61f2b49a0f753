"""Grids whose blocks find their own work (quant_kernels/grids.py), checked against the kernels'
arithmetic written out here (no GPU needed): flash_decode's packed batch grid must hold every
(row, split) block of any step, as flash_decode.cu's dec_splits counts them."""

from __future__ import annotations

import numpy as np

from gguf_runtime.quant_kernels.grids import dec_grid_y


def test_flash_decode_grid_bound():
    """dec_grid_y holds every (row, split) block the kernel's dec_splits gives a step (no window):
    random steps of 2-64 rows, depths 0-20000, the 8B's 8 KV heads and 132 SMs' target."""
    rng = np.random.default_rng(5)
    kt, n_split, min_keys, hkv, target = 16, 16, 128, 8, 132
    for _ in range(2000):
        rows = int(rng.integers(2, 65))
        pos = rng.integers(0, 20000, rows) if rng.random() < 0.5 else np.full(rows, int(rng.integers(0, 20000)))
        pos[rng.integers(0, rows)] = int(rng.integers(0, 131072))  # one long row among them
        total = int((pos + 1).sum())
        kps = max(min_keys, -(-total * hkv // target))
        blocks = 0
        for p in pos:
            n = int(p) + 1
            ns = max(1, min(n_split, n // kps))
            chunk = (-(-n // kt) + ns - 1) // ns * kt
            blocks += -(-n // chunk)
        assert blocks <= dec_grid_y(rows, n_split, target, hkv, 0), (rows, blocks)
        assert dec_grid_y(rows, n_split, 0, hkv, 0) == rows * n_split  # per_row: n_split a row
        assert dec_grid_y(rows, n_split, target, hkv, 0, False) == n_split  # grid.z the rows
