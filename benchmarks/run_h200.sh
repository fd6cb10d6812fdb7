#!/usr/bin/env bash
# Every GPU check and benchmark of the project in one call on a 2 x H200 machine (the lent
# `nvidia-h200-x2` kind), writing JSON/PNG/logs under OUT_DIR:
#
#   benchmarks/run_h200.sh OUT_DIR
#
# 1. DCP over NCCL on both GPUs (benchmarks/dcp.py under torchrun, then tests/test_dcp_gpu.py).
# 2. Then, at the same time on separate GPUs:
#    GPU 0: the end-to-end prefill benchmark (benchmarks/bench_h200.sh: vllm-default + stall);
#    GPU 1: every `gpu`-marked test, then benchmarks/plan_upload.py and benchmarks/audit_gpu.py.
# The two halves share the host's 32 cores; neither is CPU-bound beyond a core or two.
# NVLink multicast stays off (the lent machine's rule).
set -uo pipefail
out=${1:?usage: benchmarks/run_h200.sh OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $(date -u +%FT%TZ) GPUs: $ngpu"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

if [ "$ngpu" -ge 2 ]; then
    timeout 180 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/dcp.py --out "$out/dcp_h200x2.json" >"$out/dcp.log" 2>&1
    echo "== dcp rc=$? ($(date -u +%T))"; tail -n 25 "$out/dcp.log"
    # needs both GPUs visible, so it runs here rather than with the other gpu tests
    timeout 120 python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin -o addopts="" \
        tests/test_dcp_gpu.py 2>&1 | tail -n 15
    other=1
else
    echo "== one GPU: DCP skipped; everything runs on GPU 0 in sequence"
    other=0
fi

micro() {
    python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin tests \
        -o addopts="" --junitxml="$out/gpu_tests.xml" 2>&1 | tail -n 30
    echo "== gpu tests rc=${PIPESTATUS[0]} ($(date -u +%T))"
    python3 benchmarks/plan_upload.py --out "$out/plan_upload_h200.json" 2>&1 | tail -n 40
    echo "== plan_upload rc=${PIPESTATUS[0]} ($(date -u +%T))"
    python3 benchmarks/audit_gpu.py --out "$out" 2>&1 | tail -n 30
    echo "== audit_gpu rc=${PIPESTATUS[0]} ($(date -u +%T))"
}

CUDA_VISIBLE_DEVICES=0 BENCH_MAX_SECONDS=${BENCH_MAX_SECONDS:-100} timeout 420 benchmarks/bench_h200.sh "$out/bench" >"$out/bench.log" 2>&1 &
bench_pid=$!
if [ "$other" = 1 ]; then
    CUDA_VISIBLE_DEVICES=1 micro >"$out/micro.log" 2>&1
else
    wait "$bench_pid"; CUDA_VISIBLE_DEVICES=0 micro >"$out/micro.log" 2>&1
fi
wait "$bench_pid"; echo "== bench rc=$? ($(date -u +%T))"
cat "$out/micro.log"
grep -v '^\[' "$out/bench.log" | tail -n 40
