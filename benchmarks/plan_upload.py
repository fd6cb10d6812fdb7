"""Host cost of plan + upload, and host time blocked in upload behind queued GPU work.

    python benchmarks/plan_upload.py --out benchmarks/results/plan_upload.json

Section A (GPU idle): host time of ``ChunkPlanner.plan`` + ``StagingRing.upload`` per step for
batch mixes of 1-64 prefills and 1-8 workspace iterations, in modes ring / pin / pageable
(median and p99 over repeated steps, time.perf_counter on the host).

Section B (GPU busy): with ~50 ms of kernels queued (``torch.cuda._sleep``, calibrated with CUDA
events), host time blocked inside one ``upload`` for staged plan sizes 4 KiB - 8 MiB per mode.
A pageable copy may block until the queue drains; ring must not (target <= 0.2 ms).

Runs on CPU too (small repeat counts, section B skipped) and says so. Finishes in well under 90 s
on an H200 host.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import numpy as np
import torch

from mlaprefill._env import cpu_name, triton_version, utc_now
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import StagingRing

MODES = ("ring", "pin", "pageable")
PAGE_SIZE = 64
WORKSPACE = 65536
NUM_PREFILLS = (1, 4, 16, 64)
ITERATIONS = (1, 2, 4, 8)
SIZES_KIB = (4, 16, 64, 256, 1024, 2048, 4096, 8192)


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu_name(),
        "triton": triton_version(),
    }


def batch_for(num_prefills: int, iterations: int) -> PrefillBatch:
    """A batch whose context fills ``iterations`` workspaces (packed), split over the prefills."""
    total = iterations * WORKSPACE - WORKSPACE // 4  # a bit under k full workspaces
    per_req = max(PAGE_SIZE, total // num_prefills // PAGE_SIZE * PAGE_SIZE)
    ctx = [per_req] * num_prefills
    ctx[0] += 7  # one unaligned length, as in real batches
    q = [max(16, 4096 // num_prefills)] * num_prefills
    return PrefillBatch(q, ctx, page_size=PAGE_SIZE)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def section_a(device: str, reps: int, warmup: int) -> list[dict]:
    planner = ChunkPlanner(WORKSPACE, PAGE_SIZE)
    rows = []
    for mode in MODES:
        ring = StagingRing(device, mode=mode)
        for n in NUM_PREFILLS:
            for k in ITERATIONS:
                batch = batch_for(n, k)
                plan_t, up_t, total_t = [], [], []
                for i in range(warmup + reps):
                    t0 = time.perf_counter()
                    plan = planner.plan(batch)
                    t1 = time.perf_counter()
                    ring.upload(plan)
                    t2 = time.perf_counter()
                    if i >= warmup:
                        plan_t.append(t1 - t0)
                        up_t.append(t2 - t1)
                        total_t.append(t2 - t0)
                if device != "cpu":
                    torch.cuda.synchronize()
                staged = sum(a.nbytes for a in plan.device_arrays().values())
                rows.append({
                    "mode": mode, "num_prefills": n, "iterations": plan.num_iterations,
                    "target_iterations": k, "staged_bytes": staged,
                    "plan_us_median": 1e6 * pct(plan_t, 50),
                    "upload_us_median": 1e6 * pct(up_t, 50),
                    "total_us_median": 1e6 * pct(total_t, 50),
                    "total_us_p99": 1e6 * pct(total_t, 99),
                    "reps": reps,
                })
        rows_stats = ring.stats
        rows.append({"mode": mode, "ring_stats": {
            "uploads": rows_stats.uploads, "arenas_grown": rows_stats.arenas_grown,
            "arenas_resized": rows_stats.arenas_resized, "stalls": rows_stats.stalls}})
    return rows


def plan_of_size(nbytes: int):
    """A plan whose staged arrays take about ``nbytes`` (token_to_seq dominates)."""
    rows = max(PAGE_SIZE, nbytes // 4)
    w = min(rows, 262144) // PAGE_SIZE * PAGE_SIZE
    k = max(1, math.ceil(rows / w))
    half = k * w // 2 // PAGE_SIZE * PAGE_SIZE
    ctx = [half, k * w - half]  # two requests: token_to_seq is real memory
    return ChunkPlanner(w, PAGE_SIZE).plan(PrefillBatch([128, 128], ctx, page_size=PAGE_SIZE))


def calibrate_sleep() -> float:
    """``torch.cuda._sleep`` cycles per millisecond, measured with CUDA events."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def section_b(queue_ms: float, reps: int) -> list[dict]:
    per_ms = calibrate_sleep()
    cycles = int(queue_ms * per_ms)
    rows = []
    for mode in MODES:
        ring = StagingRing("cuda", mode=mode)
        for kib in SIZES_KIB:
            plan = plan_of_size(kib * 1024)
            for _ in range(6):  # size ring arenas / warm the caching host allocator
                ring.upload(plan)
            torch.cuda.synchronize()
            blocked, queue_done_early = [], 0
            for _ in range(reps):
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
                torch.cuda._sleep(cycles)
                marker = torch.cuda.Event()
                marker.record()
                t0 = time.perf_counter()
                ring.upload(plan)
                t1 = time.perf_counter()
                queue_done_early += bool(marker.query())
                end.record()
                torch.cuda.synchronize()
                blocked.append(t1 - t0)
            rows.append({
                "mode": mode, "size_kib": kib,
                "staged_bytes": sum(a.nbytes for a in plan.device_arrays().values()),
                "blocked_ms_median": 1e3 * pct(blocked, 50),
                "blocked_ms_max": 1e3 * max(blocked),
                "queued_ms_measured": start.elapsed_time(end),
                "upload_returned_after_queue_drained": queue_done_early,
                "reps": reps, "stalls": ring.stats.stalls,
            })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--queue-ms", type=float, default=50.0,
                    help="GPU work queued before each timed upload in section B")
    args = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    a_rows = section_a(device, reps=300 if cuda else 30, warmup=30 if cuda else 5)
    b_rows = section_b(args.queue_ms, reps=5) if cuda else []
    result = {
        "benchmark": "plan_upload",
        "ran_on": "cuda" if cuda else "cpu (no CUDA: section B skipped, upload is a CPU copy)",
        "machine": machine(),
        "argv": sys.argv,
        "date_utc": utc_now(offset=True),
        "workspace_tokens": WORKSPACE, "page_size": PAGE_SIZE,
        "section_a_host_plan_upload": a_rows,
        "section_b_blocked_behind_queue": b_rows,
        "wall_seconds": time.perf_counter() - t_start,
    }
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)

    print(f"# plan_upload on {result['ran_on']}; machine: {result['machine']['gpu']} / "
          f"{result['machine']['cpu']}; torch {torch.__version__}")
    print("\nA. host time per step, plan + upload (GPU idle), microseconds: median / p99")
    print(f"{'prefills':>8} {'iters':>5} {'KiB':>7} " + " ".join(f"{m:>17}" for m in MODES))
    by_key = {(r["mode"], r["num_prefills"], r["target_iterations"]): r
              for r in a_rows if "num_prefills" in r}
    for n in NUM_PREFILLS:
        for k in ITERATIONS:
            cells = []
            for m in MODES:
                r = by_key[(m, n, k)]
                cells.append(f"{r['total_us_median']:8.1f}/{r['total_us_p99']:8.1f}")
            r = by_key[(MODES[0], n, k)]
            print(f"{n:>8} {r['iterations']:>5} {r['staged_bytes'] / 1024:>7.1f} "
                  + " ".join(f"{c:>17}" for c in cells))
    if b_rows:
        print(f"\nB. host ms blocked in one upload with ~{args.queue_ms:.0f} ms of kernels queued "
              f"(median / max of 5)")
        print(f"{'KiB':>6} " + " ".join(f"{m:>17}" for m in MODES))
        by = {(r["mode"], r["size_kib"]): r for r in b_rows}
        for kib in SIZES_KIB:
            cells = [f"{by[(m, kib)]['blocked_ms_median']:7.3f}/"
                     f"{by[(m, kib)]['blocked_ms_max']:7.3f}" for m in MODES]
            print(f"{kib:>6} " + " ".join(f"{c:>17}" for c in cells))
    else:
        print("\nB. skipped: no CUDA on this machine (ran on CPU)")
    print(f"\nwall {result['wall_seconds']:.1f} s; JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
