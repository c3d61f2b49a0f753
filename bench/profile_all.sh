#!/usr/bin/env bash
# On the GPU machine: twins, then the per-kernel profile of each (logs under $OUT).
set -u
source .device/env.sh
mkdir -p /tmp/twins "${OUT:-/tmp/out}"
[ -f /tmp/twins/smollm2.gguf ] || python -m gguf_runtime synth --fill twins/smollm2.hdr.gguf -o /tmp/twins/smollm2.gguf -q
[ -f /tmp/twins/gemma3.gguf ] || python -m gguf_runtime synth --fill twins/gemma3.hdr.gguf -o /tmp/twins/gemma3.gguf -q
[ -f /tmp/twins/llama3-8b.gguf ] || python -m gguf_runtime synth --preset llama3-8b-q4_k_m -o /tmp/twins/llama3-8b.gguf -q
for m in smollm2 gemma3 llama3-8b; do
  python bench/profile_step.py /tmp/twins/$m.gguf --batch 1 --batch 64 --json "${OUT:-/tmp/out}/profile_$m.json" 2>&1 | tee -a "${OUT:-/tmp/out}/profile.log"
done
