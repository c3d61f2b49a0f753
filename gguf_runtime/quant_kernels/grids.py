"""Grid shapes of kernels whose blocks find their work themselves (no CuPy here: tests check them on
any machine): flash_decode.cu's packed batch grid and matmul_mma.cu's stream-K products."""

from __future__ import annotations

MMA_TK = 128  # columns per k step (matmul_mma.cu TK)
# stream-K kernels' partial slots a tile at most (the workspace holds that many with the knobs on)
GLU_STREAM_SLOTS = 4  # mma_glu_sk (two W tiles a slot)
MMA_STREAM_SLOTS = 6  # mma_group_sk


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


def stream_plan(tiles: int, steps: int, blocks: int, max_slots: int = 4) -> tuple[int, int] | None:
    """A stream-K kernel's (blocks, partial slots a tile) for ``tiles`` tiles of ``steps`` k steps
    over ``blocks`` resident blocks (0: off): block b takes the steps [b total / blocks, (b + 1) total
    / blocks) of the tiles' steps in a row, so a tile's steps meet at most ceil(steps / per) + 1
    blocks (``per`` the fewest a block takes). None where that is over max_slots (more merges than
    the balance gains), a block would not take a step, or the tiles fill the blocks evenly anyway."""
    per = tiles * steps // blocks if blocks > 0 else 0
    if per < 1 or tiles % blocks == 0:
        return None
    slots = min(blocks, -(-steps // per) + 1)
    return (blocks, slots) if slots <= max_slots else None
