"""flash_decode's grid for batch steps split by the step's work (launch_attention.dec_grid_y): the
kernel numbers the step's (row, split) blocks in grid.y; the grid must hold all of them for any
step, computed here as flash_decode.cu's dec_splits computes them (no GPU needed)."""

from __future__ import annotations

import numpy as np

from gguf_runtime.quant_kernels.decode_grid import dec_grid_y


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
