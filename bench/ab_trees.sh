#!/usr/bin/env bash
# tg128 (graph, median of 5) of the working tree against an older tree, alternating in one device
# call, so a kernel change is measured against its baseline on the same machine (rows 34 of
# bench/RESULTS.md: Gemma-3 1,900 -> 2,148). Here, before the call:
#   rm -rf .old_tree && mkdir .old_tree && git archive REV gguf_runtime | tar -x -C .old_tree
# then carry .old_tree, and on the GPU machine:
#   source .device/env.sh && [MODELS="gemma3 smollm2"] [ROUNDS=2] [TESTS="tests/..."] bash bench/ab_trees.sh
# Optional: CUPY_CACHE_TGZ=file.tgz unpacks a kernel cache first and writes the updated one to
# $OUT/cupy_cache.tgz (a cold cache compiles for minutes; carry it to the next call).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the GPU machine's copy of the tree carries a .git of the session's start: bench JSON would name
# that commit; here, before the call: git describe --always --dirty > .device/commit
[ -f .device/commit ] && export GGUF_RUN_COMMIT=${GGUF_RUN_COMMIT:-$(cat .device/commit)}
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_ab}; mkdir -p "$CUPY_CACHE_DIR"
[ -n "${CUPY_CACHE_TGZ-}" ] && tar -xzf "$CUPY_CACHE_TGZ" -C "$CUPY_CACHE_DIR" --skip-old-files
python3 -c "import sys; sys.path.insert(0, 'bench'); import gpu_session as g; print('twins:', g.make_twins(False, None))"
if [ -n "${TESTS-}" ]; then
  GGUF_TWIN_DIR=/tmp/twins timeout ${TEST_TIMEOUT:-560} python3 -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_N:+-n $PYTEST_N} $TESTS > $OUT/pytest.log 2>&1
  echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head; tail -1 $OUT/pytest.log
fi
tg() {  # tree model
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD python3 -m gguf_runtime bench /tmp/twins/$2.gguf -p 0 -n 128 -r 5 \
      --mode graph --json -q 2>>$OUT/bench.log) |
    python3 -c "import json, sys; r = json.load(sys.stdin); print('$1 $2', ' '.join(f\"{x['mode']}={x['median']:.0f}\" for x in r['rows']))" ||
    echo "$1 $2 failed (bench.log)"
}
for m in ${MODELS:-gemma3 smollm2 llama3-8b}; do
  for _ in $(seq ${ROUNDS:-2}); do tg . $m; tg .old_tree $m; done
done
[ -n "${CUPY_CACHE_TGZ-}" ] && tar -czf $OUT/cupy_cache.tgz -C "$CUPY_CACHE_DIR" .
exit 0
