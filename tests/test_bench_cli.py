"""`mlaprefill bench` on the CPU: JSON with every metric, PNG, table, errors, dry run."""

from __future__ import annotations

import json
import math

import pytest

from mlaprefill.bench.cli import SCENARIOS
from mlaprefill.bench.dryrun import STALL_THRESHOLD_BYTES, metadata_profile
from mlaprefill.bench.engine import EngineConfig
from mlaprefill.bench.metrics import METRIC_KEYS
from mlaprefill.cli import main

SMALL = ["--prompt-len", "48", "--num-requests", "3", "--concurrency", "2", "--token-budget",
         "16", "--workspace", "32", "--page-size", "8", "--layers", "1", "--repeats", "2",
         "--warmup-steps", "1", "--no-progress", "--device", "cpu"]


def test_cli_writes_json_with_every_metric_and_png(tmp_path, capsys):
    rc = main(["bench", "--out", str(tmp_path), *SMALL])
    assert rc == 0
    out = capsys.readouterr()
    assert "ring+packed" in out.out and "tok/s" in out.out
    assert "running on the CPU" in out.err
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["ran_on"] == "cpu" and doc["scenario"] == "cpu-tiny"
    assert doc["warmup_run"] is True and doc["warmup_run_variant"] == "ring+equal"
    for key in ("machine", "command", "date", "config", "model", "attention_backend"):
        assert doc[key], key
    assert isinstance(doc["command"], list) and doc["options"]["prompt_len"] == 48
    assert doc["machine"]["torch"] and doc["date"].endswith("Z")
    assert doc["config"]["prompt_len"] == 48 and doc["config"]["num_layers"] == 1
    assert [v["name"] for v in doc["variants"]] == ["pageable+equal+vllm", "pin+equal+vllm",
                                                    "ring+equal", "ring+packed"]
    for v in doc["variants"]:
        assert v["transfer"] in ("pageable", "pin", "ring") and v["policy"] in ("equal", "packed")
        assert v["tables"] == ("vllm" if v["name"].endswith("+vllm") else "compact")
        m = v["metrics"]
        # compact plans ship no per-token table; the vLLM-shaped baseline does
        assert (m["token_to_seq_bytes_max"] > 0) == (v["tables"] == "vllm")
        m = v["metrics"]
        missing = set(METRIC_KEYS) - set(m)
        assert not missing, missing
        for k in METRIC_KEYS:
            vals = m[k] if isinstance(m[k], list) else [m[k]]
            assert all(isinstance(x, int | float) and math.isfinite(x) for x in vals), k
        assert m["repeats"] == 2 and len(v["per_repeat"]) == 2
        assert m["num_requests_per_run"] == 3 and m["prompt_tokens_per_run"] == 144
        assert 0 < m["gpu_busy_fraction"] <= 1.0
        assert v["first_tokens_agreement_with_first_variant"] == 1.0
        assert len(v["step_series"]["host_blocked_ms"]) == m["num_steps_per_run"]
    png = tmp_path / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_exit_2_without_traceback(capsys):
    assert main(["bench", *SMALL, "--variants", "ring+fast"]) == 2
    assert "policy" in capsys.readouterr().err
    assert main(["bench", "--scenario", "stall", "--device", "cpu"]) == 2
    assert "cpu-tiny" in capsys.readouterr().err
    assert main(["bench", *SMALL, "--concurrency", "0"]) == 2
    assert "max_concurrent" in capsys.readouterr().err


def test_dry_run_prints_metadata_per_policy(capsys):
    assert main(["bench", "--scenario", "vllm-default", "--dry-run", "--device", "cpu",
                 "--num-requests", "2"]) == 0
    out = capsys.readouterr().out
    assert "equal" in out and "packed" in out and "steps with a copy >= 3 MiB" in out


@pytest.mark.parametrize("name,over", [("vllm-default", False), ("stall", True)])
def test_scenario_metadata_claims(name, over):
    """The documented sizes: vllm-default stays far below 3 MiB, stall passes it with vLLM's
    per-token tables; compact plans stay under 64 KiB in both."""
    cfg = EngineConfig(**SCENARIOS[name].engine)
    prof = metadata_profile(cfg, "equal")
    assert prof["steps"] == 16 * 81920 // 4096
    assert prof["plan_bytes_max"] <= 64 * 1024
    assert prof["compact_steps_over_threshold_fraction"] == 0.0
    if over:
        assert prof["token_to_seq_bytes_max"] == 2 * 1048576 * 4  # [2, 1 Mi] int32 = 8 MiB
        assert 0.3 < prof["steps_over_threshold_fraction"] < 0.5
    else:
        assert prof["token_to_seq_bytes_max"] <= 2 * 65536 * 4
        assert prof["metadata_bytes_max"] < 0.6 * 2**20 < STALL_THRESHOLD_BYTES
        assert prof["steps_over_threshold_fraction"] == 0.0


def test_max_seconds_truncates_evenly_and_skips_rounds(tmp_path):
    assert main(["bench", "--out", str(tmp_path), *SMALL, "--max-seconds", "0.001",
                 "--warmup-steps", "0", "--no-warmup-run"]) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["repeats"] == 1 and doc["repeats_requested"] == 2
    assert doc["stopped_early_for_max_seconds"] is True
    for v in doc["variants"]:
        assert v["metrics"]["truncated_runs"] == 1
        assert v["metrics"]["num_steps_per_run"] >= 1  # a run always makes one step


def test_uneven_scenario_packed_needs_fewer_iterations_and_stays_below_threshold():
    cfg = EngineConfig(**SCENARIOS["uneven"].engine)
    equal, packed = metadata_profile(cfg, "equal"), metadata_profile(cfg, "packed")
    assert packed["iterations"].sum() < 0.85 * equal["iterations"].sum()
    assert equal["steps_over_threshold_fraction"] > 0.1
    assert packed["steps_over_threshold_fraction"] == 0.0
