"""Grid shapes of kernels whose blocks find their work themselves (no CuPy here: tests check them on
any machine): flash_decode.cu's packed batch grid."""

from __future__ import annotations


def dec_grid_y(rows: int, n_split: int, target: int, n_head_kv: int, window: int, packed: bool = True) -> int:
    """flash_decode's grid.y: a block a split (grid.z the rows; one row, or ``packed`` off), or the
    call's (row, split) blocks numbered row by row in grid.y alone: n_split a row at most, and with
    ``target`` (splits by the step's work) at most a block a row plus the step's keys over the keys
    a split (>= total x n_head_kv / target: target / n_head_kv). With a window a row's first tile
    may start below its keys (more than the total counts): n_split a row."""
    if not packed or rows <= 1:
        return n_split
    if target and not window:
        return min(rows * n_split, rows + -(-target // n_head_kv))
    return rows * n_split
