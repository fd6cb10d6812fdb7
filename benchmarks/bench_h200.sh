#!/usr/bin/env bash
# End-to-end prefill engine benchmark on one H200: both scenarios of `mlaprefill bench`, each
# writing bench.json + bench.png into $1/<scenario>/ (progress on stderr, table on stdout).
#
#   benchmarks/bench_h200.sh OUT_DIR
#
# vllm-default: vLLM's defaults (FCFS 4096-token steps, 65,536-token workspace); metadata per step
#               <= ~0.6 MiB, below the ~3 MiB where a pageable copy blocked on the H200.
# stall:        budget shared by 16 running prefills, 1 Mi-token workspace; token_to_seq reaches
#               3-8 MiB in the last ~40 % of the steps (see `mlaprefill bench --dry-run`).
# Each scenario is capped by --max-seconds (a round of repeats that would not fit is skipped; a
# first round that is too slow is truncated evenly across variants), so the whole script stays
# under 7 minutes including start-up.
set -euo pipefail
out=${1:?usage: benchmarks/bench_h200.sh OUT_DIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
for scenario in vllm-default stall; do
    echo "== $scenario ($(date -u +%H:%M:%S) UTC)"
    python -m mlaprefill bench --scenario "$scenario" --dry-run
    python -m mlaprefill bench --scenario "$scenario" --max-seconds 165 --out "$out/$scenario" \
        2> >(tee "$out/$scenario.stderr.log" >&2)
done
echo "== done ($(date -u +%H:%M:%S) UTC); results in $out/{vllm-default,stall}/bench.{json,png}"
