"""Launchers of moe.cu: the router's top-k and the chosen experts' products (conventions in
launch_core.py). ``slots`` = tokens x experts a token; slot s is token s // k's rank s % k expert.
A stacked expert matrix is one ``Mat`` of n_expert * n rows; ``n`` is one expert's rows."""

from __future__ import annotations

from .launch_core import ACT, NO_PTRS, Kernels, Mat, Q8Vec, f32, i32, ptr

MAX_EXPERTS = 256  # moe.cu's MOE_MAX_EXPERTS
MAX_USED = 32  # experts a token: one lane each in moe_topk
WARPS = 4  # moe.cu's MOE_WARPS
NO_Q8 = (*NO_PTRS, i32(0), f32(0.0))


def _x_args(x: int, ldx: int, norm: tuple[int, float] | None, q8: Q8Vec | None, with_norm: bool = True) -> tuple:
    head = (ptr(x), i32(ldx))
    if with_norm:
        head += (ptr(norm[0]), f32(norm[1])) if norm else (ptr(0), f32(0.0))
    return (*head, *(q8.args() if q8 else NO_Q8))


def _io(q8: Q8Vec | None) -> int:
    return (1 | q8.io()) if q8 is not None else 0


def topk(k: Kernels, logits: int, ld: int, n_expert: int, used: int, renorm: bool, rows: int, ids: int,
         w: int) -> None:
    """ids[t, :used], w[t, :used] = the used most probable experts of token t and their router
    probabilities (renormalized over them with ``renorm``)."""
    assert 1 <= used <= min(n_expert, MAX_USED) and n_expert <= MAX_EXPERTS
    per_block = 4
    k.fn("moe.cu", "moe_topk")((-(-rows // per_block),), (32 * per_block,),
                               (ptr(logits), i32(ld), i32(n_expert), i32(used), i32(renorm), i32(rows), ptr(ids),
                                ptr(w)))


def mv(k: Kernels, m: Mat, n: int, ids: int | None, used: int, x: int, ldx: int, slots: int, y: int, ldy: int,
       norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, r: int = 2) -> None:
    """y[s, :n] = W_e x'[s // used] (e = ids[s]; ids None: the matrix itself, e.g. the router)."""
    fn = k.fn("moe.cu", f"moe_mv<{m.struct}, {r}, 1, {_io(q8)}>")
    fn(((-(-n // (r * WARPS))), slots), (32 * WARPS,),
       (*m.planes, i32(n), i32(m.cols), ptr(ids), i32(used), *_x_args(x, ldx, norm, q8), ptr(y), i32(ldy)))


def glu(k: Kernels, gate: Mat, up: Mat, n: int, ids: int, used: int, x: int, ldx: int, slots: int, act: str,
        y: int, ldy: int, norm: tuple[int, float] | None = None, q8: Q8Vec | None = None, r: int = 4) -> None:
    """y[s, :n] = act(G_e x'[s // used]) * (U_e x'[s // used]), e = ids[s] (gate and up of one type)."""
    assert gate.type_id == up.type_id and gate.cols == up.cols
    fn = k.fn("moe.cu", f"moe_glu<{gate.struct}, {r}, 1, {ACT[act]}, {_io(q8)}>")
    fn(((-(-n // (r // 2 * WARPS))), slots), (32 * WARPS,),
       (*gate.planes, *up.planes, i32(n), i32(gate.cols), ptr(ids), i32(used), *_x_args(x, ldx, norm, q8),
        ptr(y), i32(ldy)))


def down(k: Kernels, m: Mat, n: int, ids: int, w: int, used: int, x: int, ldx: int, rows: int, y: int, ldy: int,
         q8: Q8Vec | None = None, r: int = 2) -> None:
    """y[t, :n] += sum_j w[t, j] W_e x'[t * used + j] (e = ids[t, j]): the residual add of the experts."""
    fn = k.fn("moe.cu", f"moe_down<{m.struct}, {r}, 1, {_io(q8)}>")
    fn(((-(-n // (r * WARPS))), rows), (32 * WARPS,),
       (*m.planes, i32(n), i32(m.cols), ptr(ids), ptr(w), i32(used), *_x_args(x, ldx, None, q8, with_norm=False),
        ptr(y), i32(ldy)))
