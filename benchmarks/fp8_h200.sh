#!/usr/bin/env bash
# FP8 latent caches on the lent H200 (issue #27), in two device calls:
#   bash benchmarks/fp8_h200.sh tests   # the gpu-marked FP8 tests + benchmarks/fp8_cache.py
#   bash benchmarks/fp8_h200.sh bench   # mlaprefill bench uneven with each cache format
# Writes under $OUT (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8-out}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
case "${1:-tests}" in
  tests)
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_fp8_cache_gpu.py \
      2>&1 | tail -25 | tee "$OUT/fp8_tests.txt"
    timeout 360 python benchmarks/fp8_cache.py --out "$OUT/fp8_cache_h200.json" \
      2>&1 | tail -30
    ;;
  bench)
    timeout 560 python -m mlaprefill bench --scenario uneven --no-progress \
      --variants "ring+balanced@mlaprefill+graphs,ring+balanced@mlaprefill+graphs:fp8,ring+balanced@mlaprefill+graphs:fp8_ds_mla,ring+balanced@fa2" \
      --max-seconds 420 --out "$OUT/bench_uneven_fp8" 2>&1 | tail -30
    ;;
esac
