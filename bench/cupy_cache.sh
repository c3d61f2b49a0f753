#!/usr/bin/env bash
# CuPy's on-disk kernel cache carried between device calls (a cold cache compiles for minutes).
#   source .device/env.sh && source bench/cupy_cache.sh unpack .cupy_cache.txz   (sets CUPY_CACHE_DIR)
#   ... work ...
#   bash bench/cupy_cache.sh pack [used]  -> $OUT/cupy_cache.txz (xz: a fifth of gzip's size on cubins;
#                                             used: only the files this call read or wrote)
# A call returns files of at most 16 MiB: a bigger archive comes back as cupy_cache.txz.00, .01, ...
# (unpack joins the parts of "$2".NN when "$2" itself is not there).
# Every header edit changes every kernel's cache key (sources.py), so the cache would grow with
# stale entries: past 15 MB (a returned file may have 16 MiB) pack keeps only the files written or
# read in the call (unpacked files get an old access time; reads renew it where the mount allows).
D=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
case "$1" in
  unpack)
    export CUPY_CACHE_DIR=$D; mkdir -p "$D"
    # gzip or xz, whole or in parts (Python's tarfile reads both where xz(1) is missing)
    if [ -f "${2-}" ]; then cat "$2"; elif [ -n "${2-}" ] && ls "$2".[0-9][0-9] >/dev/null 2>&1; then cat "$2".[0-9][0-9]; fi |
      python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|*').extractall('$D')"
    find "$D" -type f -exec touch -a -d 2000-01-01 {} +
    touch "$D/.marker"
    echo "cupy cache: $(find "$D" -type f -name '*.cubin' | wc -l) kernels unpacked into $D" ;;
  pack)  # everything, or where that is over 15 MB only what this call read or wrote
    OUT=${OUT:-/tmp/out}
    (cd "$D" && find . -type f ! -name .marker > /tmp/cupy_all.txt &&
     find . -type f ! -name .marker \( -anewer .marker -o -newer .marker \) > /tmp/cupy_used.txt)
    A="$OUT/cupy_cache.txz"; export XZ_OPT="-3 -T0"  # (-9 took past 90 s on a full suite's kernels)
    txz() { if command -v xz >/dev/null; then tar -cJf "$A" -C "$D" -T "$1"; else python3 -c "import sys, tarfile
with tarfile.open(sys.argv[1], 'w:xz', preset=6) as t:
    for f in open(sys.argv[3]).read().split(): t.add(sys.argv[2] + '/' + f, arcname=f)" "$A" "$D" "$1"; fi; }
    if [ "${2-}" = used ]; then  # (a call that ran every kernel: one pass, without stale entries)
      txz /tmp/cupy_used.txt
    else
      txz /tmp/cupy_all.txt
      if [ "$(stat -c %s "$A")" -gt 15000000 ]; then txz /tmp/cupy_used.txt; echo "cupy cache: used files only"; fi
    fi
    if [ "$(stat -c %s "$A")" -gt 15000000 ]; then
      split -b 15000000 -d -a 2 "$A" "$A." && rm "$A"
      echo "cupy cache: in $(ls "$A".* | wc -l) parts"
    fi
    echo "cupy cache: $(wc -l < /tmp/cupy_all.txt) files, $(wc -l < /tmp/cupy_used.txt) read or written in this call," \
         "$(du -ch "$OUT"/cupy_cache.txz* | tail -1 | cut -f1)" ;;
esac
