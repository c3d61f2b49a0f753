#!/usr/bin/env bash
# One device call: twins, GPU tests, then tg128 of each twin under each environment variant, and
# optional pp rows / per-kernel profiles (under the first variant) and batched rows (under each).
# Usage on the GPU machine: source .device/env.sh && [TESTS="tests/..."] [TG="llama3-8b"]
#   [VARIANTS="GGUF_RUN_Q8=1 GGUF_RUN_Q8=0"] [MODE=graph|both] [PP="..."] [BATCHED="..."] [BATCH=64]
#   [PROFILE="..."] [PROFILE_BATCH=1] [PROFILE_PROMPT=64] [PYTEST_N=8] bash bench/variant_session.sh
# PYTEST_N runs the tests in N processes (pytest-xdist, carried in .device/wheels): a cold CuPy
# kernel cache compiles for minutes in one process.
# A variant is one or more NAME=VALUE pairs joined by commas ("GGUF_RUN_Q8=0,GGUF_RUN_PDL=0").
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the GPU machine's copy of the tree carries a .git of the session's start: bench JSON would name
# that commit; here, before the call: git describe --always --dirty > .device/commit
[ -f .device/commit ] && export GGUF_RUN_COMMIT=${GGUF_RUN_COMMIT:-$(cat .device/commit)}
python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
import gpu_session as g
print("twins:", g.make_twins(False, None), flush=True)
PY
if [ -n "${TESTS-}" ]; then
  GGUF_TWIN_DIR=/tmp/twins timeout ${TEST_TIMEOUT:-560} python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_N:+-n $PYTEST_N} $TESTS > $OUT/pytest.log 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|Error|assert" $OUT/pytest.log | head -12; tail -2 $OUT/pytest.log
fi
first=${VARIANTS-}; first=${first%% *}
for m in ${PROFILE-}; do
  env ${first//,/ } python3 bench/profile_step.py /tmp/twins/$m.gguf --batch ${PROFILE_BATCH:-1} \
      --prompt ${PROFILE_PROMPT:-64} --json $OUT/profile-$m.json > $OUT/profile-$m.log 2>&1 || echo "profile $m failed"
  tail -16 $OUT/profile-$m.log | cut -c1-110
done
for m in ${BATCHED-}; do  # under each variant (batched-MODEL-vI.json)
  i=0
  for v in ${VARIANTS:-NONE=0}; do
    env ${v//,/ } python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -r 3 --batch ${BATCH:-64} --mode graph \
        --json -q > $OUT/batched-$m-v$i.json 2>>$OUT/bench.log || { echo "batched $m $v failed"; tail -5 $OUT/bench.log; }
    i=$((i+1))
  done
done
for m in ${PP-}; do
  env ${first//,/ } python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 512 -n 0 -r 5 --json -q \
      > $OUT/pp-$m.json 2>>$OUT/bench.log || { echo "pp $m failed"; tail -5 $OUT/bench.log; }
done
round=0
for m in ${TG-llama3-8b}; do  # a model named twice runs its variants twice (tg-MODEL-rROUND-vI.json)
  i=0; round=$((round+1))
  for v in ${VARIANTS:-NONE=0}; do
    env ${v//,/ } python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -n 128 -r 5 --mode ${MODE:-graph} --json -q \
        > $OUT/tg-$m-r$round-v$i.json 2>>$OUT/bench.log || { echo "tg $m $v failed"; tail -5 $OUT/bench.log; }
    echo "v$i = $v"; i=$((i+1))
  done
done
python3 - <<'PY'
import glob, json, os
out = os.environ.get("OUT", "/tmp/out")
for f in sorted(glob.glob(f"{out}/tg-*.json")) + sorted(glob.glob(f"{out}/batched-*.json")) + sorted(glob.glob(f"{out}/pp-*.json")):
    try:
        r = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "no result", e); continue
    for x in r["rows"]:
        print(f"{os.path.basename(f)[:-5]:<22} {x['test']:<10} {x['mode']:<6} median {x['median']:>9,.0f}  "
              f"mean {x['mean']:>9,.0f} ± {x['stdev']:,.0f}")
PY
