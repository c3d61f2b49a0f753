#!/usr/bin/env bash
# The twentieth session's device call: GPU tests, the new defaults against the nineteenth session's
# in one process (bench/inproc_variants.py), and gguf-run bench tg128 of the three twins.
# Here, before the call:
#   rm -rf .old_tree && mkdir -p .old_tree/s19 && git archive 5c72ab6 gguf_runtime/quant_kernels | tar -x -C /tmp &&
#   cp /tmp/gguf_runtime/quant_kernels/*.cu* .old_tree/s19/ && git describe --always --dirty > .device/commit
# carry .device twins .cupy_cache.tgz .old_tree; on the GPU machine: bash bench/session20.sh
# INPROC=0 leaves out the comparison; ARGS replaces the bench rows (the last call:
# ARGS="-p 512 -n 128 -r 5 --batch 64 --mode graph": pp512, tg128 and B=64 too)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz
export GGUF_RUN_COMMIT=$(cat .device/commit)
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_session as g; print('twins:', g.make_twins(False, None))" | tail -1
GGUF_TWIN_DIR=/tmp/twins timeout ${TEST_TIMEOUT:-330} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 tests > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log
# the nineteenth session's defaults: its kernels (5c72ab6) and the o-proj and down at 2 rows per 2 warps
OLD=KDIR=.old_tree/s19,GGUF_RUN_MMV_O=2:2,GGUF_RUN_MMV_DOWN=2:2
if [ "${INPROC:-1}" = 1 ]; then
  timeout 150 python3 bench/inproc_variants.py /tmp/twins/llama3-8b.gguf --rounds 3 --json $OUT/inproc.json NONE $OLD \
    > $OUT/inproc.log 2>&1
  echo "inproc rc=$?"; grep -v "^round" $OUT/inproc.log | tail -3
fi
for m in llama3-8b smollm2 gemma3; do
  timeout 150 python3 -m gguf_runtime bench /tmp/twins/$m.gguf ${ARGS:--p 0 -n 128 -r 5 --mode graph} --json -q \
      > $OUT/tg-$m.json 2>>$OUT/bench.log
  python3 -c "import json; r = json.load(open('$OUT/tg-$m.json')); print('$m', [(x['test'], x['mode'], round(x['median'])) for x in r['rows']])"
done
bash bench/cupy_cache.sh pack
