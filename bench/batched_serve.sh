#!/usr/bin/env bash
# Second half of a device session (after bench/gpu_session.py built /tmp/twins): batched graph
# rows of `gguf-run bench` for the three twins, then the serve benchmark (bench/serve_session.sh).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for m in smollm2 gemma3 llama3-8b; do
  python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -r 3 --batch 1,8,32,64 --mode graph --json -q \
      > $OUT/batched-$m.json 2>>$OUT/batched.log || { echo "bench $m failed"; tail -5 $OUT/batched.log; }
  python3 - "$m" "$OUT/batched-$m.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
print(sys.argv[1], "  ".join(f"{x['test']} {x['mode']}: {x['median']:,.0f}" for x in r["rows"]))
PY
done
SKIP_LOAD=1 bash bench/serve_session.sh
