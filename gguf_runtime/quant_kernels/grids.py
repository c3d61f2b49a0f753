"""Grid shapes of kernels whose blocks find their work themselves (no CuPy here: tests check them on
any machine): flash_decode.cu's packed batch grid and matmul_mma.cu's stream-K GLU."""

from __future__ import annotations

MMA_TK = 128  # columns per k step (matmul_mma.cu TK)


def dec_grid_y(rows: int, n_split: int, target: int, n_head_kv: int, window: int) -> int:
    """flash_decode's grid.y: a block a split (grid.z the rows), or with ``target`` the step's (row,
    split) blocks numbered row by row in grid.y alone. Those are at most a block a row plus the
    step's keys over the keys a split (>= total x n_head_kv / target: target / n_head_kv); the rest
    of a grid sized for n_split splits a row were blocks that only exited (most of the grid at B=64
    and depth: one split a row). With a window a row's first tile may start below its keys (more
    than the total counts): the whole grid."""
    if not target:
        return n_split
    return rows * n_split if window > 0 else min(rows * n_split, rows + -(-target // n_head_kv))


def glu_stream_plan(rows: int, cols: int, wr: int, blocks: int) -> tuple[int, int] | None:
    """mma_glu_sk's (blocks, partial slots a tile) for a GLU of ``rows`` x ``cols`` in 16 wr-row
    tiles over ``blocks`` resident blocks (0: off); None where a block would take under half a
    tile's k steps (more merges than the balance gains) or the tiles fill the blocks evenly anyway.
    A tile's k steps meet at most ceil(steps / per) + 1 blocks, ``per`` the fewest a block takes."""
    steps, tiles = -(-cols // MMA_TK), -(-rows // (16 * wr))
    per = tiles * steps // blocks if blocks > 0 else 0
    if per < max(1, steps // 2) or tiles % blocks == 0:
        return None
    return blocks, min(tiles, -(-steps // per) + 1)
