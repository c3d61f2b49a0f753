#!/usr/bin/env bash
# One device call (fifteenth session): the top-1 sampler path's tests and its A/B on the 8B's B=64
# (this tree against BASE's sampling.cu, same call), then the tensor-core products timed in a
# captured graph per K split (bench/mma_shapes.py), to find what the split products' time is.
# Usage on the GPU machine: source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   BASE=fdce8b3 bash bench/sampler_split_session.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .device/commit ] && export GGUF_RUN_COMMIT=${GGUF_RUN_COMMIT:-$(cat .device/commit)}
python3 - <<'PY'
import sys; sys.path.insert(0, "bench")
import gpu_session as g
print("twins:", g.make_twins(False, None), flush=True)
PY
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_kernels.py -k "topk or argmax" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log
S=gguf_runtime/quant_kernels/sampling.cu
cp $S /tmp/sampling.new.cu
for v in new base new base; do
  if [ $v = base ]; then git show ${BASE:-HEAD}:$S > $S; else cp /tmp/sampling.new.cu $S; fi
  python3 -m gguf_runtime bench /tmp/twins/llama3-8b.gguf -p 0 -r 3 --batch 64 --mode graph --json -q \
      > $OUT/batched-$v.json 2>>$OUT/bench.log
  python3 -c "import json,sys; r=json.load(open('$OUT/batched-$v.json'))['rows'][0]; print('B=64 $v', round(r['median']), [round(x) for x in r['runs']])"
done
cp /tmp/sampling.new.cu $S
python3 bench/profile_step.py /tmp/twins/llama3-8b.gguf --batch 64 --prompt 192 > $OUT/profile.log 2>&1; tail -14 $OUT/profile.log | cut -c1-110
python3 bench/mma_shapes.py --ra 1 --configs "" 4:8:1:1 4:8:1:2 4:8:1:3 4:8:1:4 > $OUT/shapes.log 2>&1
python3 bench/mma_shapes.py --ra 1 --host > $OUT/shapes-host.log 2>&1
cat $OUT/shapes.log $OUT/shapes-host.log
