"""docs/RESULTS.md is what benchmarks/results.py generates from benchmarks/results/*.json."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "results.py"
RESULTS = ROOT / "benchmarks" / "results"


def _module():
    spec = importlib.util.spec_from_file_location("results_doc", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_committed_results_doc_is_current():
    proc = _run("--check")
    assert proc.returncode == 0, proc.stderr


def test_modified_doc_fails_the_check(tmp_path):
    doc = tmp_path / "RESULTS.md"
    shutil.copy(ROOT / "docs" / "RESULTS.md", doc)
    assert _run("--check", "--doc", str(doc), "--readme", str(tmp_path / "none.md")).returncode == 0
    doc.write_text(doc.read_text().replace("| 2120 KiB", "| 2000 KiB").replace("2120", "2000", 1))
    proc = _run("--check", "--doc", str(doc), "--readme", str(tmp_path / "none.md"))
    assert proc.returncode == 1
    assert "stale" in proc.stderr


def test_readme_block_is_rewritten_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nold\n<!-- results:end -->\nend\n")
    doc = tmp_path / "RESULTS.md"
    assert _run("--doc", str(doc), "--readme", str(readme)).returncode == 0
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("end\n")
    assert "docs/RESULTS.md#" in text
    assert _run("--check", "--doc", str(doc), "--readme", str(readme)).returncode == 0
    readme.write_text(text.replace("KiB", "MiB"))
    assert _run("--check", "--doc", str(doc), "--readme", str(readme)).returncode == 1


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_result_file_gives_a_row(path):
    mod = _module()
    row = mod.row(path.name, json.loads(path.read_text()))
    assert row["result"] and row["date"]
    assert all(len(mod._cell(row[k])) <= mod.MAX_CELL for k in ("what", "result", "command"))


def test_stall_threshold_matches_the_stallmap():
    mod = _module()
    data = json.loads((RESULTS / "stallmap_h200.json").read_text())
    assert mod.stall_threshold_kib() * 1024 == data["threshold_bytes"]


def test_summary_rows_are_few_and_link_into_the_doc():
    mod = _module()
    rows = mod.summary_rows()
    assert 1 <= len(rows) <= 7
    doc = (ROOT / "docs" / "RESULTS.md").read_text()
    for _, result, link in rows:
        assert result
        assert "## " in doc and link.startswith("docs/RESULTS.md#")
        heading = [
            line
            for line in doc.split("\n")
            if line.startswith("## ") and mod.anchor(line[3:]) == link.split("#")[1]
        ]
        assert heading, link


def test_summary_rows_take_no_h100_run(tmp_path):
    # the README heads its summary "one NVIDIA H200": a run on an H100 (RESULTS.md lists it)
    # gives no row there, newer or not
    mod = _module()
    run = json.loads((RESULTS / "plan_upload_h200.json").read_text())
    run["date_utc"] = "2099-01-01T00:00:00Z"
    run["run_context"] = "commit 1234567, lent nvidia-h100-x1 machine"
    run["machine"] = {"device_name": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "plan_upload_h100.json").write_text(json.dumps(run))

    def plan_rows():
        return [r for r in mod.summary_rows(tmp_path) if r[0].startswith("Plan + upload")]

    assert plan_rows() == []
    run["machine"] = {"device_name": "NVIDIA H200"}
    run["run_context"] = "commit 1234567, lent nvidia-h200 machine"
    (tmp_path / "plan_upload_h100.json").write_text(json.dumps(run))
    assert len(plan_rows()) == 1


def test_forward_profile_rows_split_device_time_by_kernel_kind():
    mod = _module()
    row = {"heads": 16, "num_reqs": 2, "query_len": 256, "context_len": 8192,
           "backend": "mlaprefill+graphs", "do_bench_ms": 1.5,
           "kernels": [{"name": "nvjet_sm90_tst_320x128", "ms_per_forward": 0.9},
                       {"name": "_hopper_attention_kernel", "ms_per_forward": 0.5},
                       {"name": "_gather_kernel", "ms_per_forward": 0.08},
                       {"name": "cudnn_generated_fort_native_sdpa_sm90", "ms_per_forward": 0.1},
                       {"name": "Memset (Device)", "ms_per_forward": 0.01}]}
    what, res = mod.EXTRACTORS["forward_profile"]({"rows": [row]})
    assert "kernel kind" in what
    assert res == ("H=16 2x256/8192 mlaprefill+graphs: 1.500 ms (GEMM 0.900, attention 0.600, "
                   "gather 0.080, other 0.010)")
    assert mod.extractor("forward_profile_narrow_h200.json") is mod.ex_forward_profile
