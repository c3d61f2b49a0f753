#!/usr/bin/env bash
# One device call (fifteenth session): graph-timed sweeps (bench/mma_shapes.py's timed() now
# replays a captured graph, so calls of a few tens of us are no longer host-bound): the batch
# attention kernel's tile shapes (f16 cache, the 8B at B=64) and the 8B's products' tile configs.
# Usage on the GPU machine: source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   bash bench/attn_mma_sweep.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 bench/attn_bench.py --kv f16 --ctx 192 512 --reps 50 \
    --configs ${ATTN_CONFIGS:-32:2 32:3 32:4 16:2 16:4 16:6 24:3 48:2 64:2} > $OUT/attn.log 2>&1
cat $OUT/attn.log
python3 bench/mma_shapes.py --ra 1 --only "${ONLY:-}" --head-rows 128256 \
    --configs "" 4:4:1:1 4:4:1:2 2:4:1:1 4:8:1:0 > $OUT/shapes.log 2>&1
cat $OUT/shapes.log
