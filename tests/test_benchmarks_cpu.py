"""The benchmark scripts run in CI: each in its ``--cpu-smoke`` mode (a tiny case on CPU tensors
through the same library calls as its GPU run), and none reaches a private name of the library."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"

# script -> top-level keys its --cpu-smoke JSON must have (besides the common ones)
SMOKE = {
    "attention.py": ("attention", "forward", "vs_ideal", "policies"),
    "determinism.py": ("rows", "shape"),
    "fp8_cache.py": ("gather", "forward"),
    "fp8_attention.py": ("kernel", "ideal", "accuracy"),
    "dcp.py": ("cases", "all_match", "world"),
    "forward_profile.py": ("rows", "host_profile"),
    "audit_gpu.py": ("checks", "overhead", "command"),
    "triton_attention.py": ("rows", "flops_formula"),
    "plan_upload.py": ("section_a_plan_upload_gpu_idle", "section_d_dcp_reorder"),
    "prefix_sharing.py": ("shapes", "plan_host"),
    "sustained_clocks.py": ("rows", "sampling"),
}
COMMON_KEYS = ("date_utc", "machine")

# Private attributes of library objects the scripts once reached (``op._up_weights`` ...): the
# static check cannot know an object's type, so it bans these names on any object.
KNOWN_PRIVATE_ATTRS = frozenset({
    "_backend", "_graphs", "_up_weights", "_up_project", "_kv_numel", "_weights", "_rectangles",
    "_producer", "_varlen", "_local", "_cache", "_checked", "_rope", "_backend_request",
    "_make_backend", "_slots", "_arena",
})
ALLOWED_PRIVATE_MODULES = frozenset({"mlaprefill._env"})


def _error_rows(doc: object, where: str = "") -> list[str]:
    """Paths of every dict holding an ``error`` key, anywhere in ``doc``."""
    found = []
    if isinstance(doc, dict):
        if "error" in doc or "incomplete" in doc:
            found.append(where or "/")
        for k, v in doc.items():
            found += _error_rows(v, f"{where}/{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _error_rows(v, f"{where}[{i}]")
    return found


# > 10 s on a loaded 2-core runner (3-12 s alone)
SLOW = frozenset({"plan_upload.py", "forward_profile.py", "dcp.py"})


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                    for s in sorted(SMOKE)])
def test_cpu_smoke_runs_and_writes_its_json(script: str, tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--cpu-smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "src"), "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, f"{script} --cpu-smoke exited {proc.returncode}:\n" \
        f"{proc.stderr[-3000:]}"
    assert out.exists(), f"{script} --cpu-smoke wrote no JSON at --out"
    doc = json.loads(out.read_text())
    missing = [k for k in (*COMMON_KEYS, *SMOKE[script]) if k not in doc]
    assert not missing, f"{script}: JSON lacks top-level keys {missing}; has {sorted(doc)}"
    assert "command" in doc, f"{script}: JSON lacks 'command'"
    assert not _error_rows(doc), f"{script}: error rows at {_error_rows(doc)}"


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []

    def private_module(name: str) -> bool:
        return (name.split(".")[0] == "mlaprefill" and name not in ALLOWED_PRIVATE_MODULES
                and any(p.startswith("_") for p in name.split(".")))

    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "mlaprefill":
            if private_module(node.module):
                bad.append(f"{where}: from {node.module} import ... (private module)")
            for alias in node.names:
                if alias.name.startswith("_"):
                    bad.append(f"{where}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if private_module(alias.name):
                    bad.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                chain.append(base.id)
            dotted = ".".join(reversed(chain))
            if dotted.startswith("mlaprefill.") and dotted.rsplit(".", 1)[0] \
                    not in ALLOWED_PRIVATE_MODULES:
                bad.append(f"{where}: {dotted}")
            elif node.attr in KNOWN_PRIVATE_ATTRS:
                bad.append(f"{where}: .{node.attr} (a private attribute of a library object)")
    return bad


def test_benchmarks_use_only_the_public_api() -> None:
    bad = [b for p in sorted(BENCH.glob("*.py")) for b in _private_uses(p)]
    assert not bad, ("benchmarks/ reach private names of mlaprefill (use the public API: "
                     "mlaprefill.__all__ and the public names of its public modules; "
                     "mlaprefill._env is allowed):\n  " + "\n  ".join(bad))


def test_private_scan_catches_each_kind(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("from mlaprefill.kernels.attention import _cfg\nimport mlaprefill._x\n"
                   "from mlaprefill._env import utc_now\nimport mlaprefill.kernels\n"
                   "mlaprefill.kernels._triton.cdiv\nop._up_weights(1)\n")
    bad = _private_uses(src)
    assert len(bad) == 4, bad
    assert not any("_env" in b for b in bad)


def test_every_script_has_a_cpu_smoke_mode() -> None:
    # results.py writes docs/RESULTS.md and is no benchmark: test_results_doc.py runs its --check
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")} - {"results.py"}
    assert scripts == set(SMOKE), f"scripts without a --cpu-smoke test: {scripts - set(SMOKE)}"


def test_gather_gemm_probe_cpu_smoke_checks_its_setup_against_float64() -> None:
    """scripts/gather_gemm_probe.py --cpu-smoke: its paged cache, shuffled block table and
    unaligned piece starts, gathered by the library's torch path, against float64 indexing (exit
    0 only when they agree), so a stale call fails here rather than on the GPU."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gather_gemm_probe.py"),
                           "--cpu-smoke"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rope equal True" in proc.stdout
