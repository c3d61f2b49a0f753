"""Grids whose blocks find their own work (quant_kernels/grids.py), checked against the kernels'
arithmetic written out here (no GPU needed): flash_decode's packed batch grid must hold every
(row, split) block of any step, as flash_decode.cu's dec_splits counts them; the stream-K GLU's
partial slots must hold every block a tile's k steps meet, as mma_glu_sk cuts them."""

from __future__ import annotations

import numpy as np

from gguf_runtime.quant_kernels.grids import GLU_STREAM_SLOTS, MMA_TK, dec_grid_y, stream_plan


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


def glu_stream_plan(rows, cols, wr, blocks):
    """mma_glu's stream-K plan as launch_mma asks for it (16 wr-row tiles of MMA_TK-column steps)."""
    return stream_plan(-(-rows // (16 * wr)), -(-cols // MMA_TK), blocks, GLU_STREAM_SLOTS)


def test_glu_stream_plan_slots():
    """Each block takes the k steps [b total / P, (b + 1) total / P) of the tiles' steps in a row;
    a tile's contributors are the blocks from owner(its first step) to owner(its last), in order,
    and they must fit the plan's slots (and so the workspace's 4 at most). Off: 0 blocks, tiles
    that fill the blocks evenly, or under half a tile a block."""
    assert glu_stream_plan(14336, 4096, 4, 0) is None
    assert glu_stream_plan(64 * 264, 4096, 4, 264) is None  # even: a tile a block
    assert glu_stream_plan(1536, 576, 4, 264) is None  # SmolLM2: 24 tiles of 5 steps for 264 blocks
    assert glu_stream_plan(14336, 4096, 4, 264) == (264, 3)  # the 8B's B=64 GLU on an H100 / H200
    rng = np.random.default_rng(3)
    shapes = [(14336, 4096), (11008, 4096), (28672, 8192), (8960, 1536), (300, 2304), (1000, 384), (64 * 7, 640)]
    shapes += [(int(rng.integers(16, 40000)), int(rng.integers(1, 80)) * 64) for _ in range(300)]
    for rows, cols in shapes:
        for blocks in (3, 4, 7, 132, 264, 396):
            plan = glu_stream_plan(rows, cols, 4, blocks)
            if plan is None:
                continue
            P, slots = plan
            assert slots <= 4
            steps, tiles = -(-cols // MMA_TK), -(-rows // 64)
            total = tiles * steps

            def owner(u):
                return ((u + 1) * P + total - 1) // total - 1
            cover: dict[int, list[int]] = {}
            done = np.zeros(tiles, int)
            for b in range(P):
                u, u1 = b * total // P, (b + 1) * total // P
                while u < u1:
                    t, s0 = divmod(u, steps)
                    s1 = min(steps, s0 + (u1 - u))
                    u += s1 - s0
                    cover.setdefault(t, []).append(b)
                    done[t] += s1 - s0
            assert (done == steps).all()
            for t, bs in cover.items():
                b0, b1 = owner(t * steps), owner(t * steps + steps - 1)
                assert bs == list(range(b0, b1 + 1)) and len(bs) <= slots, (rows, cols, blocks, t, bs, slots)


def test_stream_plan_slots():
    """stream_plan's slots for any tiles x steps over any blocks: every tile's contributors (blocks
    owner(first step) .. owner(last step), in order, as mma_group_sk and mma_glu_sk cut the steps)
    fit them, and plans over max_slots are refused."""
    rng = np.random.default_rng(4)
    for _ in range(3000):
        tiles, steps, blocks = int(rng.integers(1, 400)), int(rng.integers(1, 120)), int(rng.integers(1, 400))
        plan = stream_plan(tiles, steps, blocks, 6)
        if plan is None:
            continue
        P, slots = plan
        total = tiles * steps
        most = 0
        for t in range(tiles):
            b0 = ((t * steps + 1) * P + total - 1) // total - 1
            b1 = ((t * steps + steps) * P + total - 1) // total - 1
            assert b0 * total // P <= t * steps < (b0 + 1) * total // P  # owner: the block holding the step
            most = max(most, b1 - b0 + 1)
        assert most <= slots <= 6, (tiles, steps, blocks, most, slots)

