#!/usr/bin/env bash
# ncu on a few decode-step kernels of each twin (eager, so each kernel is profiled on its own):
# duration, launch shape, and where the warps stall. Usage on the GPU machine:
#   source .device/env.sh && [MODELS="smollm2 gemma3"] [KERNELS="mmv_group|mmv_glu|attn_split|rmsnorm|rope_kv"] bash bench/ncu_step.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for m in ${MODELS-smollm2 gemma3}; do
  ncu --target-processes all -k "regex:${KERNELS-mmv_group|mmv_glu|attn_split|rmsnorm|rope_kv}" --launch-skip ${SKIP:-600} \
      --launch-count ${COUNT:-12} --section LaunchStats --section WarpStateStats --section SpeedOfLight --section Occupancy \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_elapsed.avg \
      python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -n 48 -r 1 --mode eager -q > $OUT/ncu-$m.txt 2>&1
  echo "== $m (rc=$?)"
  python3 - "$OUT/ncu-$m.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
keep = ("gpu__time_duration.sum", "Grid Size", "Registers Per Thread", "Warp Cycles Per Issued Instruction",
        "Avg. Active Threads Per Warp", "Memory Throughput", "Compute (SM) Throughput", "smsp__inst_executed.sum",
        "Duration", "DRAM Throughput", "Achieved Occupancy", "Theoretical Occupancy")
for block in re.split(r"\n(?=  \S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))", text)[1:]:
    head = block.splitlines()[0].strip()
    vals = []
    for line in block.splitlines():
        s = line.strip()
        for k in keep:
            if s.startswith(k):
                vals.append(f"{k.split()[0][:14]}={s.split()[-1]}")
    stall = re.findall(r"(?:On average, each warp of this kernel spends|stalled)[^.]*\.", block)
    print(head[:90]); print("   ", " ".join(vals)); print("   ", (stall[0] if stall else "")[:260])
PY
done
