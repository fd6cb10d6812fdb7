"""GPU checks of staging: no race between a reused pinned arena and its pending copy.

Run on a CUDA machine: ``python -m pytest -q -m gpu tests/test_staging_gpu.py``.
"""

import time

import numpy as np
import pytest
import torch

from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import StagingRing

pytestmark = pytest.mark.gpu


def _sleep_cycles_per_ms() -> float:
    torch.cuda._sleep(1_000_000)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _plans(n, seed=0):
    """Distinct plans of varying sizes (1-16 requests, 1-6 iterations, small workspace)."""
    rng = np.random.default_rng(seed)
    planner = ChunkPlanner(1024, 16)
    out = []
    for _ in range(n):
        r = int(rng.integers(1, 17))
        ctx = rng.integers(0, 400, size=r)
        q = rng.integers(1, 50, size=r)
        out.append(planner.plan(PrefillBatch(q, ctx, page_size=16)))
    return out


def _run_and_check(ring, plans, num_uploads, sleep_cycles, sleep_every, head_cycles=0):
    """Upload with slow kernels queued in between; clone each DevicePlan right after enqueue
    (stream order: the clone sees exactly what the copy wrote), compare on device at the end."""
    clones, expected = [], []
    if head_cycles:
        torch.cuda._sleep(head_cycles)  # a long head start: the host runs far ahead at once
    for i in range(num_uploads):
        if i % sleep_every == 0:
            torch.cuda._sleep(sleep_cycles)
        plan = plans[i % len(plans)]
        dp = ring.upload(plan)
        clones.extend(t.reshape(-1).clone() for t in dp.tensors.values())
        expected.extend(a.reshape(-1) for a in plan.device_arrays().values())
    got = torch.cat(clones)
    want = torch.from_numpy(np.concatenate(expected)).to(got.device)
    torch.cuda.synchronize()
    mismatches = int((got != want).sum())
    assert mismatches == 0, f"{mismatches} staged ints differ from their plans"


def test_ring_thousands_of_uploads_under_load_never_races_nor_stalls():
    ring = StagingRing("cuda")  # generous default cap (256 MiB)
    plans = _plans(97)
    per_ms = _sleep_cycles_per_ms()
    _run_and_check(ring, plans, num_uploads=3000, sleep_cycles=int(0.3 * per_ms), sleep_every=5,
                   head_cycles=int(20 * per_ms))
    assert ring.stats.uploads == 3000 and ring.stats.stalls == 0
    # The host ran ahead of the queued kernels, so the ring had to grow instead of waiting.
    assert ring.stats.arenas_grown > 0


def test_ring_at_small_cap_stalls_but_stays_correct():
    ring = StagingRing("cuda", max_pinned_bytes=6 * 64 * 1024)
    per_ms = _sleep_cycles_per_ms()
    # A 20 ms head start keeps every arena's copy pending while the host fills the cap.
    _run_and_check(ring, _plans(31, seed=1), num_uploads=600, sleep_cycles=int(0.5 * per_ms),
                   sleep_every=3, head_cycles=int(20 * per_ms))
    assert ring.stats.stalls > 0 and ring.stats.pinned_bytes <= 6 * 64 * 1024


@pytest.mark.parametrize("mode", ["pin", "pageable"])
def test_comparison_modes_correct(mode):
    ring = StagingRing("cuda", mode=mode)
    per_ms = _sleep_cycles_per_ms()
    _run_and_check(ring, _plans(17, seed=2), num_uploads=300, sleep_cycles=int(0.2 * per_ms),
                   sleep_every=10)


def test_ring_upload_does_not_block_behind_queued_kernels():
    ring = StagingRing("cuda")
    plan = ChunkPlanner(65536, 64).plan(PrefillBatch([4096, 512], [80000, 1000], page_size=64))
    for _ in range(8):
        ring.upload(plan)  # size the arenas
    torch.cuda.synchronize()
    per_ms = _sleep_cycles_per_ms()
    torch.cuda._sleep(int(100 * per_ms))
    marker = torch.cuda.Event()
    marker.record()
    worst = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        ring.upload(plan)
        worst = max(worst, time.perf_counter() - t0)
    assert not marker.query(), "the queued kernel finished early; the check measured nothing"
    torch.cuda.synchronize()
    assert worst < 0.02, f"ring upload blocked {worst * 1e3:.1f} ms behind queued kernels"
    assert ring.stats.stalls == 0


def test_ring_upload_has_no_host_sync_but_pageable_does():
    from hostsync import no_host_sync

    plan = ChunkPlanner(65536, 64).plan(PrefillBatch([4096, 512], [80000, 1000], page_size=64))
    rings = {mode: StagingRing("cuda", mode=mode) for mode in ("ring", "pageable")}
    for ring in rings.values():
        for _ in range(8):
            ring.upload(plan)  # size arenas outside the audited block
    torch.cuda.synchronize()
    with no_host_sync() as audit:
        for _ in range(20):
            rings["ring"].upload(plan)
    assert audit.findings == [], audit.findings
    with no_host_sync() as audit:
        rings["pageable"].upload(plan)
    assert audit.findings, "the pageable baseline should be reported by the audit"
