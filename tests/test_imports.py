"""Import direction: planning is pure CPU and loads no torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["mlaprefill", "mlaprefill.batch", "mlaprefill.plan",
                                    "mlaprefill.dcp", "mlaprefill.dcp.plan",
                                    "mlaprefill.dcp.layout"])
def test_planning_modules_load_no_torch(module):
    code = (f"import sys, {module}; "
            f"bad = sorted(m for m in ('torch', 'triton') if m in sys.modules); "
            f"print(','.join(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "", f"{module} imported {proc.stdout.strip()}"


def test_plans_implement_the_staged_plan_contract():
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.dcp.plan import DCPChunkPlanner
    from mlaprefill.plan import ChunkPlanner, StagedPlan

    batch = PrefillBatch([1, 2], [100, 40], page_size=16)
    plan = ChunkPlanner(64, 16).plan(batch)
    dcp = DCPChunkPlanner(64, 16, world=2, interleave=16).plan(batch, rank=0)
    for p, base in ((plan, plan), (dcp, dcp.base)):
        assert isinstance(p, StagedPlan)
        assert p.chunk_plan is base
        assert list(p.device_arrays())[:4] == list(base.device_arrays())

