"""The L2 prefetch plan of a decode step's attention (l2_prefetch.py): the weights used next, in
order, inside their buffers, within the budget."""

from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest

from gguf_runtime.l2_prefetch import MAX_REGIONS, ROW_STEP, plan, row_bytes, table
from gguf_runtime.quant_kernels.formats import BY_NAME
from gguf_runtime.quant_kernels.reference import random_blocks
from gguf_runtime.quant_kernels.repack import packed_size, repack

SHAPES = {"attn_output": (256, 256), "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512),
          "attn_q": (256, 256), "attn_k": (64, 256), "attn_v": (64, 256)}
TYPES = {"attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "attn_q": "Q4_K",
         "attn_k": "Q4_K", "attn_v": "Q6_K"}
CFG = SimpleNamespace(n_layer=3)


class Mat(NamedTuple):  # launch_core.Mat's fields (that module needs CuPy)
    type_id: int
    rows: int
    cols: int
    qs: int
    qh: int
    sc: int
    d: int


def model(missing=()):
    """Matrices repacked on the host, each at its own address (1 MiB apart); name -> (Mat, end)."""
    rng = np.random.default_rng()
    mats, base = {}, 1 << 30
    for layer in range(CFG.n_layer):
        for role, (rows, cols) in SHAPES.items():
            if role in missing:
                continue
            t = BY_NAME[TYPES[role]]
            p = repack(random_blocks(t, rows * cols, rng, scale=0.5), t, rows, cols)
            off = {k: base + v for k, v in p.offsets.items()}
            m = Mat(t, rows, cols, off["qs"], off.get("qh", 0), off.get("sc", 0), off.get("d", 0))
            mats[f"blk.{layer}.{role}.weight"] = (m, base + packed_size(t, rows, cols))
            base += 1 << 20
    return mats


def owner(mats, addr):
    return next(n for n, (m, end) in mats.items() if m.qs <= addr < end)


def test_whole_layer_in_use_order():
    mats = model()
    get = lambda n: mats[n][0] if n in mats else None  # noqa: E731
    regions = plan(CFG, get, 0, 1 << 30)
    names = [owner(mats, a) for a, _ in regions]
    order = ["blk.0.attn_output", "blk.0.ffn_gate", "blk.0.ffn_up", "blk.0.ffn_down", "blk.1.attn_q",
             "blk.1.attn_k", "blk.1.attn_v"]
    assert list(dict.fromkeys(names)) == [n + ".weight" for n in order]
    for (a, n), name in zip(regions, names):
        m, end = mats[name]
        assert a % 16 == 0 and n % 16 == 0 and n > 0 and a + n <= end
    for name in set(names):  # every plane of every matrix, whole
        m, _ = mats[name]
        assert sum(n for (a, n), o in zip(regions, names) if o == name) >= m.rows * row_bytes(m)
    # the last layer has no next layer's Q, K, V
    last = [owner(mats, a) for a, _ in plan(CFG, get, CFG.n_layer - 1, 1 << 30)]
    assert not any(".attn_q" in n or ".attn_k" in n or ".attn_v" in n for n in last)


@pytest.mark.parametrize("extra_rows", [0, 37, 300])
def test_budget_cuts_gate_and_up_together(extra_rows):
    mats = model()
    get = lambda n: mats[n][0]  # noqa: E731
    o, gate, up = (mats[f"blk.0.{r}.weight"][0] for r in ("attn_output", "ffn_gate", "ffn_up"))
    budget = o.rows * row_bytes(o) + extra_rows * (row_bytes(gate) + row_bytes(up))
    regions = plan(CFG, get, 0, budget)
    names = [owner(mats, a) for a, _ in regions]
    assert names[0] == "blk.0.attn_output.weight"
    assert sum(n for _, n in regions) <= budget + 16 * len(regions)
    rows = {}  # bytes per matrix after the output projection
    for (a, n), name in zip(regions, names):
        if name != "blk.0.attn_output.weight":
            rows.setdefault(name, []).append(n)
    want = extra_rows - extra_rows % ROW_STEP
    if want == 0:
        assert set(names) == {"blk.0.attn_output.weight"}
    else:
        assert set(rows) == {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"}
        assert sum(rows["blk.0.ffn_gate.weight"]) == pytest.approx(want * row_bytes(gate), abs=64)
        assert sum(rows["blk.0.ffn_up.weight"]) == pytest.approx(want * row_bytes(up), abs=64)


def test_off_missing_and_table():
    mats = model(missing=("ffn_gate",))  # an architecture without a gate: the plan stops before the FFN
    get = lambda n: mats[n][0] if n in mats else None  # noqa: E731
    assert plan(CFG, get, 0, 0) == []
    assert {owner(mats, a) for a, _ in plan(CFG, get, 0, 1 << 30)} == {"blk.0.attn_output.weight"}
    t, n = table(CFG, get, 1 << 30)
    assert t.shape == (CFG.n_layer, MAX_REGIONS, 2) and t.dtype == np.int64
    assert (n > 0).all()
    for layer in range(CFG.n_layer):
        assert [tuple(r) for r in t[layer, :n[layer]]] == plan(CFG, get, layer, 1 << 30)
        assert not t[layer, n[layer]:].any()
