#!/usr/bin/env bash
# One device call (third session): twins, GPU tests, the per-kernel profile of one B=64 decode step
# of SmolLM2 and the 8B (the batched targets), batched graph rows, pp512 of the three twins.
# Usage on the GPU machine: source .device/env.sh && [TESTS=...] [PROFILE=...] [BATCH=1,64]
#   [BATCHED="smollm2 llama3-8b"] [PP="smollm2 gemma3 llama3-8b"] bash bench/prefill_batch_session.sh [--no-tests]
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
import gpu_session as g
print("twins:", g.make_twins(False, None), flush=True)
PY
if [ "${1:-}" != "--no-tests" ]; then
  GGUF_TWIN_DIR=/tmp/twins python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/test_gpu_backend.py} \
      > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/pytest.log
fi
for m in ${PROFILE-smollm2 llama3-8b}; do
  python3 bench/profile_step.py /tmp/twins/$m.gguf --batch ${PROFILE_BATCH:-64} --json $OUT/profile-$m.json \
      > $OUT/profile-$m.log 2>&1 || echo "profile $m failed"
  tail -16 $OUT/profile-$m.log | cut -c1-110
done
for m in ${BATCHED-smollm2 llama3-8b}; do
  python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -r 3 --batch ${BATCH:-64} --mode graph --json -q \
      > $OUT/batched-$m.json 2>>$OUT/batched.log || { echo "batched $m failed"; tail -5 $OUT/batched.log; }
  python3 - "$m" "$OUT/batched-$m.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
print(sys.argv[1], "  ".join(f"{x['test']} {x['mode']}: {x['median']:,.0f}" for x in r["rows"]))
PY
done
for m in ${PP-smollm2 gemma3 llama3-8b}; do
  python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 512 -n 0 -r 5 --json -q > $OUT/pp-$m.json 2>>$OUT/pp.log \
      || { echo "pp $m failed"; tail -5 $OUT/pp.log; }
done
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp/out")
for m in os.environ.get("PP", "smollm2 gemma3 llama3-8b").split():
    try:
        r = json.load(open(f"{out}/pp-{m}.json"))
    except Exception as e:
        print(m, "no result", e); continue
    for x in r["rows"]:
        print(f"{m:<10} {x['test']:<8} median {x['median']:>10,.0f}  mean {x['mean']:>10,.0f} ± {x['stdev']:,.0f}")
PY
