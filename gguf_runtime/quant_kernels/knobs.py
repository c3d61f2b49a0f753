"""The launch choices these kernels take from outside (no CuPy here: the tuning table imports it)."""

from __future__ import annotations

from typing import NamedTuple

ATTN_MAX_SPLITS = 32  # attention.cu merges a row's splits in one warp: lane k holds split k


class KernelKnobs(NamedTuple):
    """Launch choices the backend's tuning table makes for these kernels (backends/cuda/tuning.py).
    The defaults are neutral (no split floor, double buffering, the tile rule of tiles_config),
    for kernel tests and tools that launch without a backend."""

    mma_reg_a: bool = True  # Q4_K / Q6_K tensor-core tiles build A fragments in registers
    mma_split_min_steps: int = 0  # k steps a K-split block keeps where token tiles can halve (0: none)
    mma_split_blocks: int = 264  # blocks K splits aim at (launch_mma.mma_config; two an H100 SM)
    mma_max_split: int = 4  # K splits of a product at most (the workspace's partials are sized for them)
    mma_stages: tuple[int, int] = (2, 2)  # staged tiles' depth: single products, GLU
    mma_wgmma: bool = False  # Q4_K GLUs of 64-token tiles on Hopper's warpgroup MMA (glu_wgmma.cu; CC 9.0 only)
    glu_split: int = 0  # tensor-core GLUs split K this many ways where the scratch holds their partials (0: none)
    glu_shape: tuple[int, int] | None = None  # (warps along rows, 8-token MMA columns a warp) of the GLU; None: rule
    mma_min_blocks: int = 0  # tensor-core products (mma_group) compiled for at least this many blocks an SM (0: free)
    glu_min_blocks: int = 0  # ... and the GLU (mma_glu): registers capped to fit them
    tiles: tuple[int, int] | None = None  # attention_tiles (keys per tile, stages); None: tiles_config
    flash: tuple[int, int] | None = None  # flash_attn (rows per block, keys per tile); None: flash_config
    decode: tuple[int, int, int] = (0, 0, 0)  # flash_decode (warps, keys per tile, stages); 0: decode_config's rule
    decode_min_keys: int = 0  # flash_decode: keys a split at least (0: one tile a warp)
    decode_fit: int = 1024  # flash_decode, rows split alone: the fewest splits for their warps' tile rounds where
    # a KV head's partials (query heads x head dim) hold at least this many floats (0: never)
    decode_bulk: bool = False  # flash_decode: f16 tiles by cp.async.bulk, a row a request (not cp.async pieces)
    decode_packed: bool = True  # flash_decode of several rows: its (row, split) blocks numbered row by row in grid.y
    sm_count: int = 0  # flash_decode splits by the step's work for this many SMs (0: by n_split alone)
    mmv_token_grid: int = 0  # matvecs of 2..this many tokens as token grids (launchers.token_grid); 0: never
    gpu_sms: int = 0  # the GPU's SMs: a token grid stays within grid_waves waves (0: not bounded)
    grid_waves: tuple[int, int] = (1, 1)  # ... of GRID_WARPS_PER_SM warps on each SM: under 8 tokens, 8
    grid_groups: bool = False  # where one-token blocks do not fit, token grids of 2- or 4-token blocks
    grid_tokens: int = 0  # measuring and tests: token grids of this many tokens a block wherever it divides b
    mmv_wide_rows: bool = False  # matvecs of several tokens: wider row groups, one token's WG (launchers.mmv_config)
    mma_shape: tuple[int, int] | None = None  # (warps along rows, 8-token MMA columns a warp) of every
    # tensor-core product and GLU, no split, no tall blocks (measuring); None: mma_config's rule
