#!/usr/bin/env bash
# Issue 7 on the GPU machine: load test and benchmark of `gguf-run serve` on the SmolLM2 and 8B twins.
# Run from the repo root after `source .device/env.sh` (carry .device with starlette/uvicorn wheels).
# Twins are made under /tmp/twins unless already there. Logs and JSON go to $OUT.
set -u -o pipefail
OUT=${OUT:-/tmp/out}; T=/tmp/twins; mkdir -p "$OUT" "$T"
py=python3
[ -f $T/smollm2.gguf ] || $py -m gguf_runtime synth --fill twins/smollm2.hdr.gguf -o $T/smollm2.gguf -q
[ -f $T/llama3-8b.gguf ] || $py -m gguf_runtime synth --preset llama3-8b-q4_k_m -o $T/llama3-8b.gguf -q
rc=0
if [ -z "${SKIP_LOAD:-}" ]; then
  echo "== load test, SmolLM2 twin, --max-batch 64"
  $py bench/serve_load.py load --spawn $T/smollm2.gguf --serve-arg=--max-batch=64 2>&1 | tee $OUT/serve_load_smollm2.log | tail -25 || rc=1
fi
echo "== bench, SmolLM2 twin"
$py bench/serve_load.py bench --spawn $T/smollm2.gguf --clients 1,8,32,64 --tokens 128 \
    --json $OUT/serve_bench_smollm2.json 2>&1 | tail -12 || rc=1
echo "== bench, Llama-3-8B twin, --ctx-size 2048"
$py bench/serve_load.py bench --spawn $T/llama3-8b.gguf --serve-arg=--ctx-size=2048 --clients 1,8,32,64 \
    --tokens 128 --json $OUT/serve_bench_8b.json 2>&1 | tail -12 || rc=1
exit $rc
