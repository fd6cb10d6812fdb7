#!/usr/bin/env bash
# Issue #11's host-side checks in one call on one H200, writing JSON/PNG/logs under OUT_DIR:
#
#   benchmarks/graphs_h200.sh OUT_DIR [JOB ...]  (default: tests uneven stall hostprof)
#
# alltests  every gpu-marked test but DCP's (JUnit XML in OUT_DIR/gpu_tests.xml)
# tests     the iteration-graph and no-sync GPU tests (tests/test_attention_gpu.py -k ...)
# uneven    `mlaprefill bench --scenario uneven`: fa2 (the old default), mlaprefill eager and
#           mlaprefill+graphs in one run (balanced plans, 2 repeats,
#           <= BENCH_MAX_SECONDS of measuring)
# stall     the same on the stall scenario (equal plans); BENCH_BACKENDS (space-separated, "-"
#           for the scenario's default) picks other variants
# hostprof  where one forward's host time goes (forward_profile.py --host-only), eager and graphs
# vllm      the vllm-default scenario (equal plans; VLLM_BACKENDS): its default (eager mlaprefill),
#           mlaprefill+graphs and fa2 in one run
# ideal     benchmarks/attention.py's whole forward vs issue #11's ideal on its 14 shapes, 3
#           interleaved rounds; IDEAL_BACKENDS (default mlaprefill,mlaprefill+graphs)
# profile   benchmarks/forward_profile.py on the shapes nearest the target (PROFILE_BACKENDS)
set -uo pipefail
out=${1:?usage: benchmarks/graphs_h200.sh OUT_DIR [JOB ...]}
shift
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(tests uneven stall hostprof)
has() { local j; for j in "${jobs[@]}"; do [ "$j" = "$1" ] && return 0; done; return 1; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) jobs: ${jobs[*]}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if has alltests; then
    timeout 420 python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin -o addopts="" \
        tests --ignore=tests/test_dcp_gpu.py --junitxml="$out/gpu_tests.xml" 2>&1 | tail -n 15
    echo "== all gpu tests rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
if has tests; then
    timeout 240 python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin -o addopts="" \
        tests/test_attention_gpu.py tests/test_bench_engine.py tests/test_upproj.py \
        -k "iteration_graphs or never_syncs or gpu_engine or gather or upproj" 2>&1 | tail -n 15
    echo "== tests rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
bench() {  # scenario policy; BENCH_BACKENDS: comma list, "-" = the scenario's default backend
    local variants="" b
    for b in ${BENCH_BACKENDS:-fa2 - mlaprefill+graphs}; do
        variants+="${variants:+,}ring+$2$([ "$b" = - ] || echo "@$b")"
    done
    timeout 400 python3 -m mlaprefill bench --scenario "$1" --variants "$variants" \
        --max-seconds "${BENCH_MAX_SECONDS:-100}" --out "$out/$1" --no-progress 2>&1 | tail -n 12
    echo "== bench $1 rc=${PIPESTATUS[0]} ($(date -u +%T))"
}
has uneven && bench uneven balanced
has stall && bench stall equal
if has vllm; then
    BENCH_BACKENDS=${VLLM_BACKENDS:-"- mlaprefill+graphs fa2"} bench vllm-default equal
fi
if has ideal; then
    shapes=128:1x4096:4096,128:1x4096:32768,128:1x4096:131072,128:4x1024:32768,128:16x256:8192
    shapes+=,16:1x4096:4096,16:1x4096:131072,16:4x1024:32768,16:16x256:8192,16:16x256:131072
    shapes+=,128:4x1000:30000,16:16x250:8000,128:4x1024:131072,16:4x1024:131072
    (cd benchmarks && timeout 400 python3 attention.py --skip gather,merge,attention,forward,policies \
        --backends "${IDEAL_BACKENDS:-mlaprefill,mlaprefill+graphs}" --repeats 3 \
        --ideal-shapes "$shapes" --out "$out/attention_vs_ideal_h200.json" 2>&1 \
        | grep -v Warn | tail -n 50)
    echo "== ideal rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
if has profile; then
    timeout 200 python3 benchmarks/forward_profile.py \
        --backends "${PROFILE_BACKENDS:-mlaprefill,mlaprefill+graphs}" \
        --shapes 16:1x4096:4096,16:16x256:8192,128:1x4096:4096 \
        --out "$out/forward_profile_h200.json" 2>&1 | grep -v Warn | tail -n 40
    echo "== profile rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
if has hostprof; then
    timeout 200 python3 benchmarks/forward_profile.py --host-only \
        --backends mlaprefill,mlaprefill+graphs,fa2 \
        --out "$out/forward_host_profile_h200.json" 2>&1 | grep -v Warn | tail -n 50
    echo "== host profile rc=${PIPESTATUS[0]} ($(date -u +%T))"
fi
