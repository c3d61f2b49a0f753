"""tg128 (graph) of one twin with the matvec row-group shapes forced, one process per setting:
which (R rows per group, WG warps per group) gives the shortest decode step once kernels overlap
(programmatic dependent launch), where isolated-kernel sweeps (matvec_variants.py) cannot tell.
Usage (GPU machine): python bench/mmv_configs.py TWIN.gguf "default" "qkv=2,2 mv=1,1 glu=2,2" ...
  qkv: the Q/K/V group (RoPE stays fused only at R = 2, WG = 1; other shapes add a rope_kv
  launch), mv: other single matrices (not the output head), glu: gate/up row pairs (R = 2 is
  one gate and one up row).
"""

from __future__ import annotations

import json
import subprocess
import sys

DRIVER = r"""
import sys
import gguf_runtime.quant_kernels.launchers as L
spec = dict(kv.split("=") for kv in sys.argv[1].split() if "=" in kv)
cfg = {k: tuple(int(x) for x in v.split(",")) for k, v in spec.items()}
mmv0, glu0 = L.mmv_config, L.glu_config
def mmv_config(structs, rows, cols, b, q8_out=False):
    r = mmv0(structs, rows, cols, b, q8_out)
    key = "qkv" if len(rows) == 3 else ("mv" if sum(rows) < 32768 else None)
    return cfg.get(key, r) if key else r
L.mmv_config = mmv_config
L.glu_config = lambda *a: cfg.get("glu", glu0(*a))
from gguf_runtime.cli.app import main
sys.argv = ["gguf-run", "bench", sys.argv[2], "-p", "0", "-n", "128", "-r", "5", "--mode", "graph", "--json", "-q"]
sys.exit(main())
"""


def main() -> None:
    model, settings = sys.argv[1], sys.argv[2:] or ["default"]
    for s in settings:
        out = subprocess.run([sys.executable, "-c", DRIVER, s, model], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{s:<32} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        rows = json.loads(out.stdout)["rows"]
        print(f"{s:<32}" + "  ".join(f"{r['mode']}: {r['median']:,.0f}" for r in rows), flush=True)


if __name__ == "__main__":
    main()
