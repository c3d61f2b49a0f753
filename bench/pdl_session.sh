#!/usr/bin/env bash
# The fourth session's call (bench/RESULTS.md): twins, GPU tests, tg128 (graph) of the three twins
# with programmatic dependent launch on and off, optional pp / batched rows / profiles. Now
# bench/variant_session.sh with GGUF_RUN_PDL variants (its tg files are tg-MODEL-vI.json, I = the
# variant's index, printed as it runs).
# Usage on the GPU machine: source .device/env.sh && [TESTS=...] [TG=...] [PDL="1 0"] [BATCH=64]
#   [BATCHED=...] [PROFILE=...] [PP=...] bash bench/pdl_session.sh
v=""
for p in ${PDL-1 0}; do v="$v GGUF_RUN_PDL=$p"; done
TESTS=${TESTS-tests/test_gpu_graphs.py tests/test_gpu_backend.py} TG=${TG-smollm2 gemma3 llama3-8b} \
    VARIANTS="${v# }" exec bash "$(dirname "$0")/variant_session.sh"
