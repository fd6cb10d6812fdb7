#!/usr/bin/env bash
# The opt-in FP8 context attention on the lent H200 (issue #31), in few device calls:
#   bash benchmarks/fp8_attention_h200.sh kernel   # gpu-marked FP8-attention tests + the kernel
#                                                  # and accuracy sections of fp8_attention.py
#   bash benchmarks/fp8_attention_h200.sh forward  # whole forwards vs the unchunked cuDNN bound:
#                                                  # mlaprefill+graphs and mlaprefill-fp8+graphs
#   bash benchmarks/fp8_attention_h200.sh check    # after a bf16 kernel change: the gpu-marked
#                                                  # attention tests (JUnit XML), the vs-ideal
#                                                  # kernel set beside cuDNN, and ncu of three parts
#   bash benchmarks/fp8_attention_h200.sh verify   # a bf16 kernel change in one short call, the
#                                                  # most telling first: its own gpu tests
#                                                  # (pytest -k VERIFY_K), the vs-ideal kernel
#                                                  # set, the whole forward (mlaprefill+graphs),
#                                                  # then all gpu tests in the time left
#                                                  # (CALL_S: the call's limit, default 570)
#   bash benchmarks/fp8_attention_h200.sh ab       # an A/B of the bf16 kernel's variants
#                                                  # (scripts/tile_cost_probe.py: AB_VARIANTS,
#                                                  # AB_PARTS, AB_ROUNDS), then the same tests
#                                                  # (AB_TESTS=0: none)
# Writes under $OUT (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8-attn-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/hostsync/src
CALL_S=${CALL_S:-570}  # the device call's limit, less a margin: what the steps may use
gpu_tests() {  # the gpu-marked attention tests in the time left of the call
  timeout "${TEST_TIMEOUT:-$((CALL_S - SECONDS))}" python -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention_gpu.py tests/test_nan.py tests/test_prefix.py \
    tests/test_fp8_attention_gpu.py tests/test_triton_attention.py \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
}
ideal_set() {  # the vs-ideal kernel set beside cuDNN, within $1 seconds
  (cd benchmarks && timeout "$1" python fp8_attention.py --sections ideal \
    --configs m128_n128_w8_s3 --out "$OUT/fp8_attention_ideal.json" 2>&1 | tail -40)
}
case "${1:-kernel}" in
  kernel)
    timeout 150 python -m pytest -q -p no:cacheprovider tests/test_fp8_attention_gpu.py \
      > "$OUT/fp8_attention_tests.txt" 2>&1
    grep -E "^E  |passed|failed" "$OUT/fp8_attention_tests.txt" | head -30
    (cd benchmarks && timeout 420 python fp8_attention.py ${FP8_ARGS:-} \
      --out "$OUT/fp8_attention_h200.json" 2>&1 | tail -60)
    ;;
  forward)
    (cd benchmarks && timeout "${FWD_TIMEOUT:-540}" python attention.py \
      --skip gather,merge,attention,forward,policies \
      --backends "${IDEAL_BACKENDS:-mlaprefill+graphs,mlaprefill-fp8+graphs}" \
      --repeats "${REPEATS:-2}" --out "$OUT/attention_vs_ideal_fp8_h200.json" 2>&1 | tail -40)
    ;;
  verify)
    # each step gets at most its own limit and what is left of CALL_S, so that a short call
    # ends between steps, with the JSON of every step that finished
    left() { local t=$((CALL_S - SECONDS)); echo $((t < $1 ? t : $1)); }
    [ "$(left 120)" -gt 20 ] && timeout "$(left 120)" python -m pytest -q -m gpu \
      -p no:cacheprovider tests/test_attention_gpu.py -k "${VERIFY_K:-split_last}" \
      --junitxml="$OUT/gpu_tests_verify.xml" 2>&1 | tail -3
    [ "$(left 150)" -gt 20 ] && ideal_set "$(left 150)"
    [ "$(left 150)" -gt 20 ] && (cd benchmarks && timeout "$(left 150)" python attention.py \
      --skip gather,merge,attention,forward,policies --backends mlaprefill+graphs \
      --repeats 3 --out "$OUT/attention_vs_ideal.json" 2>&1 | tail -20)
    if [ $((CALL_S - SECONDS)) -gt 60 ]; then gpu_tests; fi
    ;;
  ab)
    timeout "${AB_TIMEOUT:-330}" python scripts/tile_cost_probe.py \
      --variants "${AB_VARIANTS:-headslow}" --parts "${AB_PARTS:-causal}" \
      --rounds "${AB_ROUNDS:-4}" --out "$OUT/tile_ab.json" 2>&1 | tail -30
    if [ "${AB_TESTS:-1}" = 1 ]; then gpu_tests; fi
    ;;
  check)
    ideal_set 240
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    PARTS=128:1x4096x32768:context,128:1x4096x131072:context,128:16x256:causal
    timeout 120 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \
      python scripts/ncu_attention.py --parts "$PARTS" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    echo "ncu rc $? ($(wc -l < "$OUT/ncu.csv") lines)"
    gpu_tests
    ;;
esac
