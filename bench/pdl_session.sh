#!/usr/bin/env bash
# One device call (fourth session): twins, GPU tests, then tg128 (graph) of the three twins with
# programmatic dependent launch on and off (GGUF_RUN_PDL), and optional batched rows / profiles.
# Usage on the GPU machine: source .device/env.sh && [TESTS="tests/..."] [TG="smollm2 gemma3 llama3-8b"]
#   [PDL="1 0"] [BATCH=64] [BATCHED="smollm2 llama3-8b"] [PROFILE="..."] [PP="smollm2 ..."] bash bench/pdl_session.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
import gpu_session as g
print("twins:", g.make_twins(False, None), flush=True)
PY
if [ -n "${TESTS-tests/test_gpu_graphs.py tests/test_gpu_backend.py}" ]; then
  GGUF_TWIN_DIR=/tmp/twins python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS-tests/test_gpu_graphs.py tests/test_gpu_backend.py} \
      > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head -8; tail -2 $OUT/pytest.log
fi
for m in ${PROFILE-}; do
  python3 bench/profile_step.py /tmp/twins/$m.gguf --batch ${PROFILE_BATCH:-1} --json $OUT/profile-$m.json \
      > $OUT/profile-$m.log 2>&1 || echo "profile $m failed"
  tail -14 $OUT/profile-$m.log | cut -c1-110
done
for m in ${BATCHED-}; do
  python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -r 3 --batch ${BATCH:-64} --mode graph --json -q \
      > $OUT/batched-$m.json 2>>$OUT/batched.log || { echo "batched $m failed"; tail -5 $OUT/batched.log; }
done
for m in ${PP-}; do
  python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 512 -n 0 -r 5 --json -q > $OUT/pp-$m.json 2>>$OUT/tg.log \
      || { echo "pp $m failed"; tail -5 $OUT/tg.log; }
done
for m in ${TG-smollm2 gemma3 llama3-8b}; do
  for p in ${PDL-1 0}; do
    GGUF_RUN_PDL=$p python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -n 128 -r 5 --mode graph --json -q \
        > $OUT/tg-$m-pdl$p.json 2>>$OUT/tg.log || { echo "tg $m pdl=$p failed"; tail -5 $OUT/tg.log; }
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
