#!/usr/bin/env bash
# One device call: this tree's sampling.cu against another version, alternating in separate
# processes: tg128 with the default sampling (the "sampled" row) and the 8B's B=64 greedy. The other
# version is BASE_FILE (carry it, e.g. in .device/) or BASE's file in the machine's .git (which holds
# the session's starting commit only). Used for RESULTS row 69 (the phase-2 gather; reverted).
# Usage on the GPU machine: source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   BASE_FILE=.device/sampling.base.cu bash bench/sampler_gather_session.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .device/commit ] && export GGUF_RUN_COMMIT=${GGUF_RUN_COMMIT:-$(cat .device/commit)}
export GGUF_TWIN_DIR=/tmp/twins
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_session as g; print('twins:', g.make_twins(False, None))" > $OUT/twins.log 2>&1
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_batch.py \
    tests/test_gpu_backend.py -k "topk or argmax or sampled or unsupported or greedy" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log
S=gguf_runtime/quant_kernels/sampling.cu
cp $S /tmp/sampling.new.cu
for v in ${ORDER:-new base new base}; do
  if [ $v = base ]; then
    if [ -n "${BASE_FILE-}" ]; then cp "$BASE_FILE" $S; else git show ${BASE:-HEAD}:$S > $S || exit 1; fi
  else cp /tmp/sampling.new.cu $S; fi
  for m in ${MODELS:-smollm2 llama3-8b}; do
    python3 -m gguf_runtime bench /tmp/twins/$m.gguf -p 0 -n 128 -r 5 --mode graph --json -q > $OUT/tg-$m-$v.json 2>>$OUT/bench.log
    python3 -c "import json; r=json.load(open('$OUT/tg-$m-$v.json'))['rows']; print('$m $v', [(x['mode'], round(x['median'])) for x in r])"
  done
  python3 -m gguf_runtime bench /tmp/twins/llama3-8b.gguf -p 0 -n 128 -r 3 --batch 64 --mode graph --json -q > $OUT/b64-$v.json 2>>$OUT/bench.log
  python3 -c "import json; r=json.load(open('$OUT/b64-$v.json'))['rows']; print('8B $v', [(x['test'], round(x['median'])) for x in r if x['test'].startswith('B=')])"
done
cp /tmp/sampling.new.cu $S
