#!/usr/bin/env bash
# End-to-end prefill engine benchmark on one H200: `mlaprefill bench` per scenario, each writing
# bench.json + bench.png into OUT_DIR/<scenario>/ (progress on stderr, table on stdout).
#
#   benchmarks/bench_h200.sh OUT_DIR               # vllm-default + stall, < 7 minutes in all
#   benchmarks/bench_h200.sh OUT_DIR uneven        # the planner scenario alone (~3 minutes)
#
# vllm-default: vLLM's defaults (FCFS 4096-token steps, 65,536-token workspace); metadata per step
#               <= ~0.6 MiB, below the ~3 MiB where a pageable copy blocked on the H200.
# stall:        budget shared by 16 running prefills, 1 Mi-token workspace; token_to_seq reaches
#               3-8 MiB in the last ~40 % of the steps.
# uneven:       mixed 8-156 Ki prompts, 8 concurrent: equal needs ~22 % more iterations than
#               packed and crosses 3 MiB on ~19 % of the steps, packed never.
# The dry run printed before each scenario shows those bytes (scheduler + planner only).
# Each scenario is capped at 165 s of measuring (--max-seconds: a round of repeats that would
# not fit is skipped; a first round that is too slow is truncated evenly across variants and
# flagged in the table and JSON).
set -euo pipefail
out=${1:?usage: benchmarks/bench_h200.sh OUT_DIR [SCENARIO ...]}
shift
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=(vllm-default stall)
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"
for scenario in "${scenarios[@]}"; do
    echo "== $scenario ($(date -u +%H:%M:%S) UTC)"
    python3 -m mlaprefill bench --scenario "$scenario" --dry-run
    python3 -m mlaprefill bench --scenario "$scenario" --max-seconds "${BENCH_MAX_SECONDS:-165}" --out "$out/$scenario" \
        2> >(tee "$out/$scenario.stderr.log" >&2)
done
echo "== done ($(date -u +%H:%M:%S) UTC); results in $out/<scenario>/bench.{json,png}"
