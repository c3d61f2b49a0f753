#!/usr/bin/env bash
# Each role's cost inside the decode graph (row 54's method: GGUF_RUN_BENCH_SKIP leaves the role's
# kernels out) for the working tree and an older tree, alternating: 8B tg128 medians of 5. Here:
#   rm -rf .old_tree && mkdir .old_tree && git archive REV gguf_runtime | tar -x -C .old_tree
# then carry .device, twins, .old_tree and .cupy_cache.tgz, and on the GPU machine:
#   source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   [SKIPS="none glu down"] [ROUNDS=2] [ENVS="GGUF_RUN_MMV_GLU=2:1"] bash bench/skip_ab.sh; bash bench/cupy_cache.sh pack
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_session as g; print('twins:', g.make_twins(False, 'llama3-8b'))" | tail -1
for r in $(seq ${ROUNDS:-2}); do
  for t in . .old_tree; do
    for s in ${SKIPS:-none glu down}; do
      v=$(cd $t && env ${ENVS:-} GGUF_RUN_BENCH_SKIP=$s PYTHONPATH=/tmp/site:$PWD python3 -m gguf_runtime bench \
            /tmp/twins/llama3-8b.gguf -p 0 -n 128 -r 5 --mode graph --json -q 2>>$OUT/bench.log |
          python3 -c "import json, sys; print(json.load(sys.stdin)['rows'][0]['median'])") || v=failed
      echo "round $r tree $t skip $s: $v"
    done
  done
done
