#!/usr/bin/env bash
# The 8B's batch-decode products (bench/mma_shapes.py) and its B=64 rate, working tree against an
# older tree, alternating in one device call; then optional prefill profiles. Here, before the call:
#   rm -rf .old_tree && mkdir .old_tree && git archive REV gguf_runtime | tar -x -C .old_tree
#   git describe --always --dirty > .device/commit
# carry .old_tree, and on the GPU machine:
#   source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.tgz &&
#   [TESTS="tests/..."] [ROUNDS=2] [SHAPES="--only glu"] [B64=ROUNDS_WITH_B64] [PREFILL="smollm2"] bash bench/ab_mma.sh;
#   bash bench/cupy_cache.sh pack
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f .device/commit ] && export GGUF_RUN_COMMIT=${GGUF_RUN_COMMIT:-$(cat .device/commit)}
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_session as g; print('twins:', g.make_twins(False, None))"
if [ -n "${TESTS-}" ]; then
  GGUF_TWIN_DIR=/tmp/twins timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider \
      ${PYTEST_N:+-n $PYTEST_N} $TESTS > $OUT/pytest.log 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log
fi
shapes() {  # tree label
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 "$OLDPWD/bench/mma_shapes.py" --ra 1 ${SHAPES-}) \
      2>>$OUT/shapes.log | tail -n +2 | sed "s|^|$2 |"
}
b64() {  # tree label
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m gguf_runtime bench /tmp/twins/llama3-8b.gguf -p 0 \
      -r 3 --batch 64 --mode graph --json -q 2>>$OUT/bench.log) |
    python3 -c "import json, sys; r = json.load(sys.stdin); print('$2', ' '.join(f\"{x['test']}={x['median']:.0f}\" for x in r['rows']))" ||
    echo "$2 B=64 failed (bench.log)"
}
for r in $(seq ${ROUNDS:-2}); do
  shapes . new; shapes .old_tree old
  [ -n "${B64-}" ] && [ "$r" -le "${B64}" ] && { b64 . new; b64 .old_tree old; }
done
for m in ${PREFILL-}; do
  for i in 1 2; do  # two processes: the rate swings between processes
    timeout 120 python3 bench/prefill_profile.py /tmp/twins/$m.gguf > $OUT/prefill-$m-$i.log 2>&1 || echo "prefill $m failed"
    tail -2 $OUT/prefill-$m-$i.log
  done
done
exit 0
