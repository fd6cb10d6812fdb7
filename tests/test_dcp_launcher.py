"""The DCP check/benchmark launcher under torchrun (gloo, world 2, tiny CPU shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a torchrun launch of two ranks: ~7 s
def test_torchrun_check_writes_json_and_table(tmp_path) -> None:
    out = tmp_path / "dcp.json"
    # --standalone: torchrun's local rendezvous picks a free port itself (no hard-coded port).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "benchmarks" / "dcp.py"), "--device", "cpu", "--scenarios", "mixed",
           "--interleaves", "1,16", "--reps", "2", "--warmup", "0", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("DCP check: ALL MATCH")
    doc = json.loads(out.read_text())
    assert doc["world"] == 2 and doc["all_match"] is True
    assert doc["command"].startswith("torchrun --nproc-per-node 2 ")
    assert doc["date_utc"].endswith("Z") and doc["machine"]["torch"]
    # mixed: I=1 packed, I=16 packed, I=16 equal
    assert [(c["interleave"], c["policy"]) for c in doc["cases"]] == [
        (1, "packed"), (16, "packed"), (16, "equal")]
    for case in doc["cases"]:
        assert case["check"]["match"] and case["check"]["ranks_agree"]
        assert case["cache_bytes_local"] < case["cache_bytes_full"]
        assert case["timings"]["forward_dcp"]["reps"] == 2
