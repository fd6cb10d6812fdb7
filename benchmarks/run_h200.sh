#!/usr/bin/env bash
# The project's GPU checks and benchmarks in one call on the lent H200 machines, writing
# JSON/PNG/logs under OUT_DIR:
#
#   benchmarks/run_h200.sh OUT_DIR [JOB ...]
#
# Jobs (default: dcp bench tests plan_upload audit):
#   dcp          DCP over NCCL on 2 GPUs: benchmarks/dcp.py under torchrun, then tests/test_dcp_gpu.py
#   bench        the end-to-end prefill benchmark on GPU 0 (benchmarks/bench_h200.sh; scenarios
#                from BENCH_SCENARIOS, default "vllm-default stall"; BENCH_MAX_SECONDS per scenario)
#   tests        every `gpu`-marked test (JUnit XML in OUT_DIR/gpu_tests.xml)
#   plan_upload  benchmarks/plan_upload.py
#   audit        benchmarks/audit_gpu.py (audit overhead + stall map)
#   attention    benchmarks/attention.py (kernels, backends, whole forward, forward per
#                planner policy)
#   determinism  benchmarks/determinism.py --probe --runs 16
#   ideal        issue #11's whole-forward ratio to the ideal, 3 interleaved rounds per shape
#                (mlaprefill, mlaprefill+graphs, cudnn, fa2), 3 shapes of >= 3 iterations
#                (2 rounds), then the per-kernel profile (mlaprefill eager, and with the Hopper kernel off)
#   hostprof     where the forward's host time goes (forward_profile.py --host-only), eager and
#                with iteration graphs
# dcp runs first on both GPUs. Then bench runs on GPU 0 while the other jobs run in order on
# GPU 1 (on GPU 0 after the bench when there is one GPU); they share the host's cores, which every
# JSON's run_context should say. NVLink multicast stays off (the lent machine's rule).
set -uo pipefail
out=${1:?usage: benchmarks/run_h200.sh OUT_DIR [JOB ...]}
shift
jobs=("$@")
[ ${#jobs[@]} -gt 0 ] || jobs=(dcp bench tests plan_upload audit)
known=" dcp bench tests plan_upload audit attention determinism ideal hostprof "
for j in "${jobs[@]}"; do
    case "$known" in
        *" $j "*) ;;
        *) echo "run_h200.sh: unknown job '$j'; choose from:$known" >&2; exit 2 ;;
    esac
done
has() { local j; for j in "${jobs[@]}"; do [ "$j" = "$1" ] && return 0; done; return 1; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
mkdir -p "$out"
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "== $(date -u +%FT%TZ) GPUs: $ngpu; jobs: ${jobs[*]}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

if has dcp; then
    if [ "$ngpu" -ge 2 ]; then
        timeout 180 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
            benchmarks/dcp.py --out "$out/dcp_h200x2.json" >"$out/dcp.log" 2>&1
        echo "== dcp rc=$? ($(date -u +%T))"; tail -n 25 "$out/dcp.log"
        # needs both GPUs visible, so it runs here rather than with the other gpu tests
        timeout 120 python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin -o addopts="" \
            --junitxml="$out/gpu_tests_dcp.xml" tests/test_dcp_gpu.py 2>&1 | tail -n 15
    else
        echo "== one GPU: dcp skipped"
    fi
fi
other=$([ "$ngpu" -ge 2 ] && echo 1 || echo 0)

micro() {
    if has tests; then
        python3 -m pytest -q -m gpu -p mlaprefill.audit.pytest_plugin tests -o addopts="" \
            --ignore=tests/test_dcp_gpu.py --junitxml="$out/gpu_tests.xml" 2>&1 | tail -n 30
        echo "== gpu tests rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has determinism; then
        python3 benchmarks/determinism.py --probe --runs 16 --out "$out/determinism_h200.json" \
            2>&1 | tail -n 30
        echo "== determinism rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has plan_upload; then
        python3 benchmarks/plan_upload.py --out "$out/plan_upload_h200.json" 2>&1 | tail -n 40
        echo "== plan_upload rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has audit; then
        python3 benchmarks/audit_gpu.py --out "$out" 2>&1 | tail -n 30
        echo "== audit_gpu rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has attention; then
        python3 benchmarks/attention.py --out "$out/attention_h200.json" 2>&1 | tail -n 60
        echo "== attention rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has ideal; then
        python3 benchmarks/attention.py --skip gather,merge,attention,forward,policies \
            --backends mlaprefill,mlaprefill+graphs,cudnn,fa2 --repeats 3 \
            --out "$out/attention_vs_ideal_h200.json" 2>&1 | grep -v Warning | tail -n 60
        echo "== vs_ideal rc=${PIPESTATUS[0]} ($(date -u +%T))"
        # shapes of >= 3 workspace iterations, where iteration graphs replay
        python3 benchmarks/attention.py --skip gather,merge,attention,forward,policies \
            --backends mlaprefill,mlaprefill+graphs,fa2 --repeats 2 \
            --ideal-shapes 128:4x1024:131072,128:2x2048:131072,16:4x1024:131072 \
            --out "$out/attention_vs_ideal_graphs128_h200.json" 2>&1 | grep -v Warning | tail -n 12
        echo "== vs_ideal, many iterations rc=${PIPESTATUS[0]} ($(date -u +%T))"
        python3 benchmarks/forward_profile.py --backends mlaprefill,fa2 \
            --host-profile --out "$out/forward_profile_h200.json" 2>&1 | grep -v Warn | tail -n 50
        echo "== forward_profile rc=${PIPESTATUS[0]} ($(date -u +%T))"
        # the Hopper kernel's A/B: the same profile with our Triton kernel in its place
        MLAPREFILL_DISABLE_HOPPER_KERNEL=1 python3 benchmarks/forward_profile.py \
            --backends mlaprefill --out "$out/forward_profile_no_hopper_h200.json" 2>&1 \
            | grep -v Warn | tail -n 20
        echo "== forward_profile, Hopper kernel off rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
    if has hostprof; then
        python3 benchmarks/forward_profile.py --host-only \
            --backends mlaprefill,mlaprefill+graphs,fa2 \
            --out "$out/forward_host_profile_h200.json" 2>&1 | grep -v Warn | tail -n 80
        echo "== host profile rc=${PIPESTATUS[0]} ($(date -u +%T))"
    fi
}

bench_pid=
if has bench; then
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 BENCH_MAX_SECONDS=${BENCH_MAX_SECONDS:-100} timeout 420 \
        benchmarks/bench_h200.sh "$out/bench" ${BENCH_SCENARIOS:-vllm-default stall} \
        >"$out/bench.log" 2>&1 &
    bench_pid=$!
fi
if [ "$other" = 1 ]; then
    CUDA_VISIBLE_DEVICES=1 micro >"$out/micro.log" 2>&1
else
    [ -z "$bench_pid" ] || wait "$bench_pid"
    CUDA_VISIBLE_DEVICES=0 micro >"$out/micro.log" 2>&1
fi
if [ -n "$bench_pid" ]; then
    wait "$bench_pid"; echo "== bench rc=$? ($(date -u +%T))"
fi
cat "$out/micro.log"
[ -z "$bench_pid" ] || grep -v '^\[' "$out/bench.log" | tail -n 60
