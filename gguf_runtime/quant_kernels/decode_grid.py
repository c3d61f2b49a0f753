"""flash_decode.cu's grid.y (no CuPy here: tests check it on any machine)."""

from __future__ import annotations


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
