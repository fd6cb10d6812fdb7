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


@pytest.mark.slow  # a whole benchmark run and a matplotlib figure: ~6 s
def test_cli_writes_json_with_every_metric_and_png(tmp_path, capsys):
    rc = main(["bench", "--out", str(tmp_path), *SMALL])
    assert rc == 0
    out = capsys.readouterr()
    assert "ring+packed" in out.out and "tok/s" in out.out
    assert "running on the CPU" in out.err
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["ran_on"] == "cpu" and doc["scenario"] == "cpu-tiny"
    # one warm-up run per (backend, policy) pair, a ring variant where the pair has one
    assert doc["warmup_run"] is True
    assert doc["warmup_run_variants"] == ["ring+equal", "ring+packed"]
    assert set(doc["warmup_kernel_builds"]) == set(doc["warmup_run_variants"])
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
            if k.startswith("graph_"):  # counted only for +graphs variants (none here)
                assert vals in ([None, None], [None]), (k, vals)
                continue
            assert all(isinstance(x, int | float) and math.isfinite(x) for x in vals), k
        assert m["repeats"] == 2 and len(v["per_repeat"]) == 2
        assert m["num_requests_per_run"] == 3 and m["prompt_tokens_per_run"] == 144
        assert 0 < m["gpu_busy_fraction"] <= 1.0
        assert v["first_tokens_agreement_with_first_variant"] == 1.0
        assert len(v["step_series"]["host_blocked_ms"]) == m["num_steps_per_run"]
    png = tmp_path / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors_exit_2_without_traceback(capsys, tmp_path):
    assert main(["bench", *SMALL, "--variants", "ring+fast"]) == 2
    assert "policy" in capsys.readouterr().err
    assert main(["bench", "--scenario", "stall", "--device", "cpu"]) == 2
    assert "cpu-tiny" in capsys.readouterr().err
    missing = tmp_path / "no" / "such" / "dir"  # was created, a whole tree of it
    assert main(["bench", *SMALL, "--out", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "no").exists()
    assert main(["bench", *SMALL, "--concurrency", "0"]) == 2
    err = capsys.readouterr().err  # the option typed, not the config field behind it
    assert "--concurrency must be a positive int, got 0" in err and "EngineConfig" not in err
    assert main(["bench", *SMALL, "--workspace", "-1"]) == 2
    assert "--workspace " in capsys.readouterr().err


def test_step_plan_beyond_the_planner_bound_is_refused_up_front(capsys):
    """Issue #30: the planner refuses a plan of more than MAX_PLAN_ENTRIES (and a +vllm token
    table beyond MAX_TOKEN_TABLE_ENTRIES); the bench refuses such a workload before it runs,
    naming its options, instead of failing mid-run."""
    big = ["--dry-run", "--device", "cpu", "--page-size", "64", "--num-requests", "16",
           "--concurrency", "16", "--token-budget", "1048576"]
    assert main(["bench", *big, "--workspace", "64", "--prompt-len", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "MAX" not in err and "--workspace" in err and len(err.strip().splitlines()) == 1
    table = [*big, "--workspace", "1048576", "--prompt-len", "130000000", "--page-size", "1024"]
    assert main(["bench", *table, "--variants", "ring+packed+vllm"]) == 2
    assert "'+vllm'" in capsys.readouterr().err  # ~2e9 entries: 8 GB per step


def test_dry_run_prints_metadata_per_policy(capsys):
    assert main(["bench", "--scenario", "vllm-default", "--dry-run", "--device", "cpu",
                 "--num-requests", "2"]) == 0
    out = capsys.readouterr().out
    assert "equal" in out and "packed" in out and "steps with a copy >= 2120 KiB" in out


@pytest.mark.parametrize("name,over", [("vllm-default", False), ("stall", True)])
def test_scenario_metadata_claims(name, over):
    """The documented sizes: vllm-default stays far below 2120 KiB, stall passes it with vLLM's
    per-token tables; compact plans stay under 64 KiB in both."""
    cfg = EngineConfig(**SCENARIOS[name].engine)
    prof = metadata_profile(cfg, "equal")
    assert prof["steps"] == 16 * 81920 // 4096
    assert prof["plan_bytes_max"] <= 64 * 1024
    assert prof["compact_steps_over_threshold_fraction"] == 0.0
    if over:
        assert prof["token_to_seq_bytes_max"] == 2 * 1048576 * 4  # [2, 1 Mi] int32 = 8 MiB
        assert 0.5 < prof["steps_over_threshold_fraction"] < 0.65  # 58 %: the dry run
    else:
        assert prof["token_to_seq_bytes_max"] <= 2 * 65536 * 4
        assert prof["metadata_bytes_max"] < 0.6 * 2**20 < STALL_THRESHOLD_BYTES
        assert prof["steps_over_threshold_fraction"] == 0.0


def test_max_seconds_truncates_evenly_and_skips_rounds(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), *SMALL, "--max-seconds", "0.001",
                 "--warmup-steps", "0", "--no-warmup-run"]) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["repeats"] == 1 and doc["repeats_requested"] == 2
    assert "1 of 2 repeats (--max-seconds)" in capsys.readouterr().out  # the header says so
    assert doc["stopped_early_for_max_seconds"] is True
    for v in doc["variants"]:
        assert v["metrics"]["truncated_runs"] == 1
        assert v["metrics"]["num_steps_per_run"] >= 1  # a run always makes one step


def test_uneven_scenario_packed_needs_fewer_iterations_and_smaller_tables():
    """With vLLM's per-token tables equal passes the stall threshold on 45 % of the steps, packed
    on 30 % (dry run); the compact plans never do."""
    cfg = EngineConfig(**SCENARIOS["uneven"].engine)
    equal, packed = metadata_profile(cfg, "equal"), metadata_profile(cfg, "packed")
    assert packed["iterations"].sum() < 0.85 * equal["iterations"].sum()
    assert equal["steps_over_threshold_fraction"] > 0.4
    assert packed["steps_over_threshold_fraction"] < equal["steps_over_threshold_fraction"] - 0.1
    assert equal["compact_steps_over_threshold_fraction"] == 0.0
    assert packed["compact_steps_over_threshold_fraction"] == 0.0


# -- issue 12: a table and plot that read well, errors before work, bounded dry runs --------
def _doc(ran_on="cpu", repeats=3, spread=(900.0, 1100.0)):
    def metrics(tput, lo, hi):
        m = {k: 1.0 for k in METRIC_KEYS}
        m.update(throughput_tok_s=tput, throughput_tok_s_min=lo, throughput_tok_s_max=hi,
                 repeats=repeats, ttft_ms_mean=1000.0, metadata_bytes_max=2**20,
                 kernel_builds_per_run=[0] * repeats, graph_captures_per_run=[None] * repeats,
                 graph_replays_per_run=[None] * repeats,
                 graph_capture_ms_per_run=[None] * repeats, num_steps_per_run=32.0,
                 num_requests_per_run=8.0, truncated_runs=0)
        return m
    return {"ran_on": ran_on, "scenario": "cpu-tiny",
            "machine": {"device_name": "AMD EPYC" if ran_on == "cpu" else "NVIDIA H200"},
            "config": {"preset": "tiny", "tp": 1},
            "variants": [{"name": "pageable+equal", "metrics": metrics(1000.0, *spread)},
                         {"name": "ring+equal", "metrics": metrics(1050.0, 1000.0, 1080.0)},
                         {"name": "ring+packed", "metrics": metrics(2000.0, 1950.0, 2050.0)}]}


@pytest.mark.parametrize("ran_on", ["cpu", "cuda"])
def test_table_headers_are_unique_and_gpu_busy_only_on_gpu(ran_on):
    """Was: two 'vs base' and three 'p99' columns, and 'GPU busy' on a CPU run."""
    import re

    from mlaprefill.bench.report import format_table

    lines = format_table(_doc(ran_on), wide=True).splitlines()
    headers = re.split(r"\s{2,}", lines[0].strip())
    assert len(headers) == len(set(headers)), headers
    row = re.split(r"\s{2,}", lines[3].strip())
    assert len(row) == len(headers) - 1  # every value under its own header; no flags here
    assert ("GPU busy" in headers) == (ran_on == "cuda")
    assert "tok/s vs 1st" in headers and "TTFT p99" in headers and "blocked p99" in headers


def test_noise_note_in_table_and_plot(tmp_path):
    from mlaprefill.bench.report import format_table, noise_note, plot_title, within_noise

    doc = _doc()
    assert within_noise(doc) == ["ring+equal"]  # overlaps the first; ring+packed does not
    assert "ring+equal is within the run-to-run spread of pageable+equal" in format_table(doc)
    assert noise_note(_doc(spread=(960.0, 999.0))) is None  # nothing overlaps: no note
    assert "one repeat" in noise_note(_doc(repeats=1))
    title = plot_title(doc)
    assert "on AMD EPYC (cpu)" in title and "CPU run" in title
    assert "on NVIDIA H200 (cuda)" in plot_title(_doc("cuda"))
    pytest.importorskip("matplotlib")
    from mlaprefill.bench.report import write_png

    assert write_png(doc, tmp_path / "b.png") is None and (tmp_path / "b.png").stat().st_size


def test_variants_help_lists_every_policy_and_vllm(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "equal|packed|balanced" in text and "'+vllm'" in text
    assert "pageable+equal+vllm, pin+equal+vllm, ring+equal, ring+packed" in text


def _no_run(monkeypatch):
    import mlaprefill.bench.runner as runner

    def boom(*a, **k):
        raise AssertionError("the run started although the input was invalid")
    monkeypatch.setattr(runner, "run_suite", boom)


@pytest.mark.parametrize("make_out", [
    lambda tmp: tmp / "file",                 # a file, not a directory
    lambda tmp: tmp / "file" / "sub",         # below a file: cannot be created
])
def test_unwritable_out_fails_before_the_run(tmp_path, capsys, monkeypatch, make_out):
    """Was: the whole benchmark ran, then a FileNotFoundError traceback."""
    (tmp_path / "file").write_text("x")
    _no_run(monkeypatch)
    assert main(["bench", *SMALL, "--out", str(make_out(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlaprefill bench: error: --out ") and len(err.splitlines()) == 1


def test_results_that_cannot_be_written_exit_2(tmp_path, capsys, monkeypatch):
    import mlaprefill.bench.report as report

    def fail(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(report, "write_json", fail)
    assert main(["bench", *SMALL, "--repeats", "1", "--out", str(tmp_path)]) == 2
    assert "cannot write the results (Permission denied)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    # Was: minutes of simulation (1e8) and a MemoryError (1e12)
    (["--dry-run", "--prompt-len", "100000000"], r"at least 6,250,000 steps .* --token-budget"),
    (["--dry-run", "--prompt-len", "1000000000000"], r"--prompt-len .* overflow int32"),
    (["--dry-run", "--num-requests", "100000000"], r"--num-requests 100000000 is more than"),
    (["--dry-run", "--num-blocks", "100000000000"], r"100,000,000,000 pages"),
    (["--device", "cpu", "--layers", "1000000"], r"needs about .* GiB on cpu .* lower --layers"),
    (["--device", "cpu", "--request-rate", "1e-300"], r"--request-rate 1e-300/s spreads"),
    (["--device", "xyz"], r"--device 'xyz' is not one of auto, cpu, cuda, cuda:N"),
    (["--max-seconds", "nan"], r"--max-seconds must be a finite number >= 0"),
    (["--seed", "-1"], r"--seed must be >= 0"),
    (["--preset", "nope"], r"--preset 'nope' is unknown"),
    (["--backend", "nope"], r"--backend 'nope' is unknown"),
    (["--backend", "nope+graphs"], r"--backend 'nope\+graphs' is unknown.*'\+graphs'"),
    (["--dry-run", "--workspace", "100000000000"], r"--workspace 100000000000 overflows int32"),
])
def test_bad_sizes_are_one_line_before_any_work(capsys, monkeypatch, argv, match):
    import re
    import time

    _no_run(monkeypatch)
    t0 = time.perf_counter()
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(match, err[-1]), err
    assert err[-1].startswith("mlaprefill bench: error: ")
    assert time.perf_counter() - t0 < 10


# -- bench output within 100 columns; a truncated run is never presented as a result ---------
def _lines_fit(text: str, width: int = 100) -> None:
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, too_long


def test_default_output_fits_100_columns_and_wide_has_every_column(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path), *SMALL, "--repeats", "1"]) == 0
    out = capsys.readouterr()
    _lines_fit(out.out)
    _lines_fit(out.err)
    assert "flags" in out.out and "vs 1st" in out.out
    from mlaprefill.bench.report import format_table
    doc = json.loads((tmp_path / "bench.json").read_text())
    wide = format_table(doc, wide=True)
    assert "plan+up p99" in wide and "TTFT p99" in wide and max(map(len, wide.splitlines())) > 100


@pytest.mark.parametrize("name", ["vllm-default", "stall", "uneven"])
def test_dry_run_fits_100_columns(name, capsys):
    assert main(["bench", "--scenario", name, "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    _lines_fit(out)
    assert "packed" in out or "equal" in out
    assert main(["bench", "--scenario", name, "--dry-run", "--device", "cpu", "--wide"]) == 0
    assert "+ vLLM token_to_seq max" in capsys.readouterr().out


def _truncated_doc():
    doc = _doc(repeats=1)
    for v in doc["variants"]:
        v["metrics"].update(num_steps_per_run=32.0, num_requests_per_run=8.0, truncated_runs=0)
    # ring+equal finished no request (one step, NaN TTFT); ring+packed measured one step
    doc["variants"][1]["metrics"].update(num_steps_per_run=1.0, num_requests_per_run=0.0,
                                         ttft_ms_mean=float("nan"), truncated_runs=1)
    doc["variants"][2]["metrics"].update(num_steps_per_run=1.0, num_requests_per_run=1.0,
                                         truncated_runs=1)
    return doc


def test_truncated_variants_are_marked_and_get_no_percentage(tmp_path):
    from mlaprefill.bench.report import MIN_MEASURED_STEPS, annotate, format_table

    assert MIN_MEASURED_STEPS > 1
    doc = _truncated_doc()
    for wide in (False, True):
        table = format_table(doc, wide=wide)
        rows = {line.split()[0]: line for line in table.splitlines()[3:6]}
        assert "truncated" not in rows["pageable+equal"]
        for name in ("ring+equal", "ring+packed"):
            assert rows[name].rstrip().endswith("truncated"), rows[name]
            assert "%" not in rows[name]  # was: ring+packed +100.0% from one step
        assert "nan" not in table.lower()
        assert "+0.0%" in rows["pageable+equal"]
        assert "truncated (no result, no percentage): ring+equal finished no request" in table
        assert f"fewer than {MIN_MEASURED_STEPS}" in table
    _lines_fit(format_table(doc))
    annotate(doc)
    by_name = {v["name"]: v for v in doc["variants"]}
    assert doc["min_measured_steps"] == MIN_MEASURED_STEPS
    assert by_name["pageable+equal"]["truncated"] is False
    assert by_name["pageable+equal"]["truncated_reason"] is None
    assert by_name["pageable+equal"]["throughput_vs_baseline_pct"] == 0.0
    for name, why in (("ring+equal", "finished no request"), ("ring+packed", "measured 1 steps")):
        v = by_name[name]
        assert v["truncated"] is True and why in v["truncated_reason"]
        assert v["throughput_vs_baseline_pct"] is None and v["ttft_vs_baseline_pct"] is None
    path = tmp_path / "doc.json"
    from mlaprefill.bench.report import write_json
    write_json(doc, path)
    assert json.loads(path.read_text())["variants"][2]["throughput_vs_baseline_pct"] is None


def test_truncated_baseline_gives_no_variant_a_percentage():
    from mlaprefill.bench.report import format_table

    doc = _truncated_doc()
    doc["variants"][0]["metrics"].update(num_requests_per_run=0.0)
    table = format_table(doc)
    assert "%" not in "\n".join(table.splitlines()[3:6])
    assert "The baseline pageable+equal has none" in table


def test_truncated_variants_are_marked_in_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    from mlaprefill.bench.report import plot_title, write_png

    doc = _truncated_doc()
    assert "TRUNCATED: ring+equal, ring+packed" in plot_title(doc)
    assert write_png(doc, tmp_path / "t.png") is None and (tmp_path / "t.png").stat().st_size


def test_warmup_counts_against_max_seconds(tmp_path, capsys):
    """Was: every warm-up run capped at half of --max-seconds on its own, so several of them
    could leave the measured runs a deadline in the past (one step each)."""
    from mlaprefill.bench.engine import PrefillEngine
    from mlaprefill.bench.runner import run_suite

    calls = []

    class Recording(PrefillEngine):
        def run(self, variant, **kw):
            calls.append((variant.name, kw.get("max_steps"), kw.get("deadline")))
            return super().run(variant, **kw)

    cfg = EngineConfig(preset="tiny", tp=1, num_layers=1, vocab_size=64, prompt_len=48,
                       num_requests=3, max_concurrent=2, token_budget=16, workspace_tokens=32,
                       page_size=8, device="cpu")
    from mlaprefill.bench.cli import _parse_variants
    engine = Recording(cfg)
    t0 = __import__("time").perf_counter()
    doc = run_suite(cfg, _parse_variants("ring+equal,ring+packed"), repeats=1, warmup_steps=0,
                    progress=False, max_seconds=60.0, engine=engine)
    warm = calls[:2]  # one warm-up run per policy, then the measured runs
    assert [c[0] for c in warm] == ["ring+equal", "ring+packed"]
    t1 = __import__("time").perf_counter()
    assert warm[0][2] == warm[1][2]  # one shared cap ...
    assert t0 + 30.0 <= warm[0][2] <= t1 + 30.0 - doc["total_seconds"]  # at run start + 60 / 2
    assert 0 <= doc["warmup_seconds"] <= doc["total_seconds"]
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse's wrap
    assert "of the whole run, the warm-up included" in text
    assert "MIN_MEASURED_STEPS" in text and "--wide" in text


@pytest.mark.slow  # three short benchmark runs of a 576-wide latent: ~6 s
def test_kv_cache_dtype_runs_each_format_side_by_side(tmp_path):
    assert main(["bench", "--out", str(tmp_path), *SMALL, "--repeats", "1", "--variants",
                 "ring+packed", "--preset", "deepseek-v2-lite", "--tp", "16",
                 "--kv-cache-dtype", "auto,fp8,fp8_ds_mla"]) == 0
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = {v["name"]: v for v in doc["variants"]}
    assert list(rows) == ["ring+packed", "ring+packed:fp8", "ring+packed:fp8_ds_mla"]
    assert [v["kv_cache_dtype"] for v in rows.values()] == ["auto", "fp8", "fp8_ds_mla"]
    # float32 on the CPU: 576 x 4 bytes a token, e4m3 576, fp8_ds_mla 656
    assert [v["kv_cache_bytes_per_token"] for v in rows.values()] == [2304, 576, 656]
    for v in rows.values():
        assert v["metrics"]["num_requests_per_run"] == 3
        assert 0 <= v["first_tokens_agreement_with_first_variant"] <= 1


@pytest.mark.parametrize(("argv", "match"), [
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype 'fp16' is unknown"),
    (["--kv-cache-dtype", "fp8,fp8"], "names a format twice"),
    (["--kv-cache-dtype", "fp8_ds_mla"], "--preset tiny has 40-wide latent rows"),
    (["--variants", "ring+packed:int4"], "Variant.kv_cache_dtype"),
    (["--variants", "ring+packed:"], "KV_CACHE_DTYPE"),
])
def test_kv_cache_dtype_errors_are_one_line(capsys, argv, match):
    assert main(["bench", *SMALL, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err


def test_shared_prefix_scenario_shares_its_prefix_blocks():
    """The scheduler hands every request the cached prefix pages first in its block table, so
    the planner gathers each shared prefix once per step: far fewer iterations (dry run)."""
    cfg = EngineConfig(**SCENARIOS["shared-prefix"].engine)
    share = metadata_profile(cfg, "balanced")
    alone = metadata_profile(cfg, "balanced", share_prefixes=False)
    assert share["steps"] == alone["steps"] >= 4
    assert share["iterations"].sum() < 0.4 * alone["iterations"].sum()
    assert share["iterations"].max() <= 3
