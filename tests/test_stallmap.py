"""Stall map logic on CPU: the sweep, threshold search and refinement, table, plot, CLI."""

from __future__ import annotations

import json
import pathlib
from collections import Counter

import pytest
import torch

from mlaprefill.cli import main
from mlaprefill.stallmap import (
    DEFAULT_SIZES,
    MiB,
    find_threshold,
    format_table,
    plot_stallmap,
    run_sweep,
)

QUEUE_MS = 50.0


def _platform(threshold: float, *, pinned_stalls: bool = False):
    """A fake device: pageable copies from `threshold` bytes block for the queued time."""
    calls: Counter[tuple[int, str]] = Counter()

    def measure(size: int, mode: str) -> tuple[float, float]:
        calls[(size, mode)] += 1
        stalls = size >= threshold and (mode == "pageable" or pinned_stalls)
        # one slow outlier per point: the median must ignore it
        outlier = 30.0 if calls[(size, mode)] == 2 else 0.0
        return (0.9 * QUEUE_MS if stalls else 0.15 + outlier), QUEUE_MS

    return measure, calls


def test_default_sizes_cover_4kib_to_64mib_with_fine_sweep() -> None:
    assert DEFAULT_SIZES[0] == 4096 and DEFAULT_SIZES[-1] == 64 * MiB
    assert {int(m * MiB) for m in (1, 1.5, 2, 2.5, 3, 3.5, 4)} <= set(DEFAULT_SIZES)
    assert list(DEFAULT_SIZES) == sorted(set(DEFAULT_SIZES))


def test_threshold_found_and_refined_between_grid_points() -> None:
    true_threshold = int(2.8 * MiB)
    measure, calls = _platform(true_threshold)
    result = run_sweep(measure, repeats=3)
    th, lo = result["threshold_bytes"], result["largest_clean_below_bytes"]
    assert lo < true_threshold <= th
    assert th - lo < 0.5 * MiB / 4  # refined well inside the 2.5..3 MiB grid step
    assert result["threshold_human"] and result["pinned_stall_sizes"] == []
    assert result["non_monotonic_sizes"] == []
    assert all(n == 3 for n in calls.values())
    sizes = {r["size"] for r in result["rows"]}
    assert set(DEFAULT_SIZES) < sizes  # refinement added sizes
    for r in result["rows"]:
        assert r["median_ms"] < 1.0 or r["stalls"]  # the 30 ms outlier never decides
        assert r["queued_ms"] == QUEUE_MS and len(r["blocked_ms"]) == 3


def test_no_stall_and_pinned_stall_reporting() -> None:
    measure, _ = _platform(float("inf"))
    result = run_sweep(measure, repeats=1, sizes=[4096, MiB])
    assert result["threshold_bytes"] is None
    assert format_table(result).splitlines()[-1] == "threshold: no pageable size stalled"
    measure, _ = _platform(MiB, pinned_stalls=True)
    result = run_sweep(measure, repeats=1, sizes=[4096, MiB, 2 * MiB], refine_points=0)
    assert result["threshold_bytes"] == MiB
    assert result["pinned_stall_sizes"] == [MiB, 2 * MiB]


def test_non_monotonic_sizes_are_reported() -> None:
    def measure(size: int, mode: str) -> tuple[float, float]:
        stalls = mode == "pageable" and size in (2 * MiB, 8 * MiB)
        return (QUEUE_MS if stalls else 0.1), QUEUE_MS

    result = run_sweep(measure, repeats=1, sizes=[MiB, 2 * MiB, 4 * MiB, 8 * MiB],
                       refine_points=0)
    assert result["threshold_bytes"] == 2 * MiB
    assert result["non_monotonic_sizes"] == [4 * MiB]
    assert find_threshold(result["rows"], mode="pinned") is None


def test_table_json_and_plot(tmp_path: pathlib.Path) -> None:
    measure, _ = _platform(3 * MiB)
    result = run_sweep(measure, repeats=1, sizes=[4096, 2 * MiB, 3 * MiB, 4 * MiB])
    table = format_table(result)
    assert "threshold: pageable non_blocking copies stall from" in table
    assert table.count("\n") >= 5
    json.loads(json.dumps(result))
    png = tmp_path / "map.png"
    plot_stallmap(result, str(png), title="fake")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_sweep_validates_repeats() -> None:
    with pytest.raises(ValueError, match="repeats"):
        run_sweep(lambda s, m: (0.0, 1.0), repeats=0)


def test_cli_usage_errors_and_no_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stallmap", "--queue-ms", "0"]) == 2
    assert main(["stallmap", "--repeats", "0"]) == 2
    if not torch.cuda.is_available():
        assert main(["stallmap"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
