#!/usr/bin/env bash
# The whole `pytest -m gpu` suite inside one device call: the test files in parallel groups (16
# cores; the kernel tests split in two, they compile the most), each group stopped at a shared
# deadline, then CuPy's kernel cache packed into $OUT/cupy_cache.txz within the call's time.
#   source .device/env.sh
#   CACHE=.work/cupy_all.txz LIMIT=540 bash bench/gpu_suite.sh     (LIMIT: the call's seconds)
# A cold cache (any header edited) compiles every kernel: the groups then take 6-9 minutes, so the
# pack (of the kernels used) is given its own 90 s and runs whatever the tests did. One summary line
# a group is printed last; the groups' logs are joined in $OUT/suite.log (a call returns at most 8
# files). ONLY="q8_tiles moe_fd" runs only the groups named; PACK=0 packs no cache. On a machine
# of several GPUs the groups take turns over them (tp sees every GPU: its two-GPU tests).
set -u
OUT=${OUT:-/tmp/out}
LIMIT=${LIMIT:-540}
PACK_S=90
[ "${PACK:-1}" = 0 ] && PACK_S=0
mkdir -p "$OUT" build/twins
[ -n "${CACHE:-}" ] && source bench/cupy_cache.sh unpack "$CACHE" >/dev/null
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
mkdir -p "$CUPY_CACHE_DIR" && touch "$CUPY_CACHE_DIR/.marker"
for n in smollm2 gemma3; do
  [ -f build/twins/$n.gguf ] || python3 -m gguf_runtime synth --fill twins/$n.hdr.gguf -o build/twins/$n.gguf -q &
done
wait
export GGUF_TWIN_DIR=build/twins
left=$(( LIMIT - PACK_S - SECONDS ))
NAMES=""
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c ^GPU); [ "$NGPU" -ge 1 ] || NGPU=1
turn=0
group() {
  local name=$1; shift
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return
  NAMES="$NAMES $name"
  local dev=$(( turn++ % NGPU ))
  ( [ "$NGPU" -gt 1 ] && [ "$name" != tp ] && export CUDA_VISIBLE_DEVICES=$dev
    timeout $left python3 -m pytest -q -ra -m gpu -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
    rc=$?; printf '\nrc=%s%s\n' $rc "$([ $rc = 124 ] && echo ' (cut at the deadline)')" >> "$OUT/$name.log" ) &
}
group kern_mma tests/test_gpu_kernels.py -k "mma"
group kern_rest tests/test_gpu_kernels.py -k "not mma"
group q8_tiles tests/test_gpu_q8.py tests/test_gpu_attention_tiles.py tests/test_gpu_token_grid.py
group backend tests/test_gpu_backend.py tests/test_gpu_graphs.py tests/test_gpu_constraint.py tests/test_gpu_embed.py
group batch tests/test_gpu_batch.py tests/test_gpu_sampler.py tests/test_gpu_flash.py
group moe_fd tests/test_gpu_moe.py tests/test_gpu_flash_decode.py
group tp tests/test_gpu_allreduce.py tests/test_gpu_tensor_parallel.py
group micro_f32 tests/test_gpu_micro.py -k "test_f32_path"
group micro_int8 tests/test_gpu_micro.py -k "test_int8_path_most or test_int8_rest or test_int8_path_moe"
group micro_rest tests/test_gpu_micro.py -k "f16_prefill or non_finite or long_prompt"
wait
echo "tests: ${SECONDS}s"
[ "$PACK_S" -gt 0 ] && { timeout $(( PACK_S - 5 )) bash bench/cupy_cache.sh pack used >/dev/null 2>&1 || echo "cupy cache: pack cut at ${PACK_S}s"; }
for g in $NAMES; do
  f="$OUT/$g.log"
  echo "$g: $(grep -E '(passed|failed|error)' "$f" | tail -1) $(grep '^rc=' "$f")"
  grep -E "^(FAILED|ERROR)" "$f" | head -5
  { echo "===== $g"; cat "$f"; } >> "$OUT/suite.log" && rm "$f"
done
