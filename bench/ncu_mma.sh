#!/usr/bin/env bash
# ncu on one of the 8B's tensor-core products (bench/mma_shapes.py, register fragments): where its
# warps stall (every stall reason, per issued instruction), its instruction mix by opcode, and the
# SASS instructions that collect most stall samples. Usage on the GPU machine:
#   source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   [ONLY="glu"] [KERNEL="mma_glu"] [NCU_DIR=/tmp/ncu] bash bench/ncu_mma.sh
# (NCU_DIR: where the report and CSVs go; default $OUT)
set -u -o pipefail
OUT=${NCU_DIR:-${OUT:-/tmp/out}}; mkdir -p "$OUT"
tag=${ONLY:-glu}; tag=${tag// /_}
python3 bench/mma_shapes.py --ra 1 --reps 2 --only "${ONLY:-glu}" > /dev/null 2>&1  # compile outside ncu
ncu -k "regex:${KERNEL:-mma_glu}" --launch-skip 2 --launch-count 1 --set full --import-source yes \
    -o $OUT/ncu-$tag -f python3 bench/mma_shapes.py --ra 1 --reps 2 --only "${ONLY:-glu}" > $OUT/ncu-$tag.log 2>&1
echo "ncu rc=$?"
ncu -i $OUT/ncu-$tag.ncu-rep --page raw --csv > $OUT/ncu-$tag-raw.csv 2>&1
ncu -i $OUT/ncu-$tag.ncu-rep --page source --csv --print-source sass > $OUT/ncu-$tag-sass.csv 2>&1
python3 - "$OUT/ncu-$tag-raw.csv" "$OUT/ncu-$tag-sass.csv" <<'PY'
import csv, re, sys
from collections import Counter
rows = list(csv.reader(open(sys.argv[1])))
head, units, vals = rows[0], rows[1], rows[2]
get = dict(zip(head, vals))
for k in ("gpu__time_duration.sum", "smsp__inst_executed.sum", "launch__registers_per_thread",
          "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
          "smsp__average_warp_latency_per_inst_issued.ratio"):
    print(f"{k:<70} {get.get(k, '?')}")
st = {k: float(v) for k, v in get.items()
      if re.fullmatch(r"smsp__average_warps_issue_stalled_\w+_per_issue_active\.ratio", k) and v not in ("", "n/a")}
print("stalls per issued instruction:", ", ".join(f"{k[34:-23]} {v:.2f}" for k, v in sorted(st.items(), key=lambda x: -x[1])[:10]))
srows = list(csv.reader(open(sys.argv[2])))
hi = next(i for i, r in enumerate(srows) if "Source" in r)
h = srows[hi]
src = h.index("Source")
ex = next((i for i, c in enumerate(h) if c.startswith("Instructions Executed")), None)
samp = next((i for i, c in enumerate(h) if c.startswith("Warp Stall Sampling (All")), None)
lsb = next((i for i, c in enumerate(h) if c == "stall_long_sb"), None)
ops, stalls = Counter(), []
for r in srows[hi + 1:]:
    if len(r) <= src:
        continue
    op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0]
    n = float(r[ex] or 0) if ex is not None else 0.0
    ops[op.split(".")[0]] += n
    if samp is not None:
        stalls.append((float(r[samp] or 0), float(r[lsb] or 0) if lsb is not None else 0.0, r[src].strip()[:80]))
tot = sum(ops.values())
print("instructions executed by opcode (share):", ", ".join(f"{o} {100 * n / tot:.1f}%" for o, n in ops.most_common(14)))
print(f"stall samples {sum(x[0] for x in stalls):.0f} (long scoreboard {sum(x[1] for x in stalls):.0f}); "
      "the instructions with most (all, long scoreboard):")
for s, l, text in sorted(stalls, reverse=True)[:10]:
    print(f"  {s:6.0f} {l:6.0f}  {text}")
PY
