"""Command-line arguments of the GPU benchmarks that are checked before any GPU work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a fresh interpreter per case: ~3.5 s each
@pytest.mark.parametrize("shapes", ["128:4x1024", "16:1x4096:4k", "a:1x2:3", "16:4:1024:8"])
def test_ideal_shapes_bad_item_is_a_clear_usage_error(shapes, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "attention.py"), "--out",
         str(tmp_path / "x.json"), "--ideal-shapes", f"16:1x4096:4096,{shapes}"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--ideal-shapes item {shapes!r} is not HEADS:NREQSxQUERIES:CONTEXT" in proc.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # a fresh interpreter per case: ~3.5 s each
@pytest.mark.parametrize("item, message", [
    ("BIG_WORK=1", "is not MODULE.NAME=VALUE"),
    ("mlaprefill.backends.mlaprefill.BIG_WORK", "is not MODULE.NAME=VALUE"),
    ("mlaprefill.nowhere.BIG_WORK=1", "no module 'mlaprefill.nowhere'"),
    ("mlaprefill.backends.mlaprefill.NO_SUCH=1", "mlaprefill.backends.mlaprefill has no NO_SUCH"),
    ("mlaprefill.backends.mlaprefill.BIG_WORK=big", "VALUE must be an int or one of the presets"),
    ("mlaprefill.kernels.attention._MAX_GRID_YZ=1", "is private"),
])
def test_override_bad_item_is_a_clear_usage_error(item, message, tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "attention.py"), "--out",
         str(tmp_path / "x.json"), "--override", item],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--override {item!r}" in proc.stderr and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_ideal_shapes_parse() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from attention import parse_shapes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert parse_shapes("128:4x1024:131072,16:1x4096:4096,") == [(128, 4, 1024, 131072),
                                                                 (16, 1, 4096, 4096)]
    assert parse_shapes("") == []


def test_override_sets_a_bool_constant(monkeypatch) -> None:
    """``MODULE.NAME=false`` for a bool constant; an int constant takes an int."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from _common import apply_overrides
    from mlaprefill.backends import mlaprefill as backend_mod

    monkeypatch.setattr(backend_mod, "SOME_FLAG", True, raising=False)
    monkeypatch.setattr(backend_mod, "BIG_WORK", backend_mod.BIG_WORK)
    done = apply_overrides(["mlaprefill.backends.mlaprefill.SOME_FLAG=false",
                            "mlaprefill.backends.mlaprefill.BIG_WORK=7"])
    assert backend_mod.SOME_FLAG is False and backend_mod.BIG_WORK == 7
    assert done == {"mlaprefill.backends.mlaprefill.SOME_FLAG": "false",
                    "mlaprefill.backends.mlaprefill.BIG_WORK": "7"}
