#!/usr/bin/env bash
# Issue #32 on the 2-GPU kind (nvidia-h200-x2), one device call: the 2-GPU tests (NCCL DCP with
# bf16, e4m3 and fp8_ds_mla caches and a shared-prefix tree: tests/test_dcp_gpu.py runs
# test_dcp_dist's cases on cuda:0/1), then benchmarks/dcp.py per cache format (output vs one
# GPU, forward time, all-gather bytes and GB/s). Writes under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dcp-out}
mkdir -p "$OUT"
export PYTHONPATH=src:hostsync/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_dcp_gpu.py 2>&1 | tail -5 \
  | tee "$OUT/dcp_gpu_tests.txt"
timeout 300 torchrun --nproc-per-node 2 benchmarks/dcp.py --kv-cache-dtype auto,fp8,fp8_ds_mla \
  --out "$OUT/dcp_fp8_h200x2.json" 2>&1 | tail -40
