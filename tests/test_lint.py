"""Static host-sync lint: corpus of true positives/negatives, noqa, CLI, flake8 plugin."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

from mlaprefill.audit.lint import lint_source, lint_tree
from mlaprefill.cli import main

CORPUS = pathlib.Path(__file__).parent / "lint_corpus"
CORPUS_FILES = sorted(CORPUS.glob("*.py"))
_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9, ]+)$")


def _expected(path: pathlib.Path) -> set[tuple[int, str]]:
    out = set()
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        m = _EXPECT.search(line)
        if m:
            out |= {(i, c.strip()) for c in m.group(1).split(",") if c.strip()}
    return out


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_corpus_findings_match_expect_comments(path: pathlib.Path) -> None:
    found = {(f.line, f.code) for f in lint_source(path.read_text(), str(path))}
    assert found == _expected(path)


def test_corpus_has_positives_of_every_code() -> None:
    codes = {c for p in CORPUS_FILES for _, c in _expected(p)}
    assert codes == {"HS101", "HS102", "HS201"}


def test_noqa_suppresses_only_its_line_and_codes() -> None:
    path = CORPUS / "noqa_cases.py"
    source = path.read_text()
    raw = lint_tree(ast.parse(source), str(path))
    noqa_lines = {i for i, line in enumerate(source.splitlines(), 1) if "# noqa" in line}
    assert {f.line for f in raw} == noqa_lines  # each noqa line really is a finding
    assert lint_source(source, str(path)) == []
    # a noqa for another code does not suppress
    other = source.replace("# noqa: HS101 - pageable", "# noqa: HS201 - pageable")
    assert [f.code for f in lint_source(other, str(path))] == ["HS101"]


def test_classic_prefix_flagged_and_fixed_pattern_clean() -> None:
    prefix = (
        "import torch\n"
        "def f(n, device):\n"
        "    t = torch.arange(n, dtype=torch.int32) * 4\n"
        "    return t.to(device, non_blocking=True)\n"
    )
    fixed = prefix.replace("* 4\n", "* 4\n    t = t.pin_memory()\n")
    found = lint_source(prefix, "p.py")
    assert [(f.line, f.code) for f in found] == [(4, "HS101")]
    assert found[0].format_text().startswith("p.py:4:12: HS101 ")
    assert lint_source(fixed, "p.py") == []


def test_select_filters_codes() -> None:
    src = (CORPUS / "hs201_device_reads.py").read_text()
    assert lint_source(src, "x.py", select=["HS1"]) == []
    assert lint_source(src, "x.py", select=["HS201"])


def test_cli_text_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(CORPUS / "hs101_fixed_patterns.py")]) == 0
    capsys.readouterr()
    assert main(["lint", str(CORPUS / "hs102_pin_in_loop.py")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(":" in line and " HS102 " in line for line in out)
    assert main(["lint", "--format", "json", str(CORPUS)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["num_files"] == len(CORPUS_FILES)
    assert data["num_findings"] == sum(len(_expected(p)) for p in CORPUS_FILES)
    assert {"path", "line", "col", "code", "message"} <= set(data["findings"][0])
    assert main(["lint", str(CORPUS / "does_not_exist.py")]) == 2


def test_cli_unparsable_file_is_usage_error(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    assert main(["lint", str(bad)]) == 2


@pytest.mark.skipif(importlib.util.find_spec("flake8") is None, reason="flake8 not installed")
def test_flake8_plugin_reports_hs_codes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "flake8", "--select", "HS",
         str(CORPUS / "hs101_prefix_patterns.py"), str(CORPUS / "noqa_cases.py")],
        capture_output=True, text=True, timeout=120,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stderr
    expected = _expected(CORPUS / "hs101_prefix_patterns.py")
    got = {(int(line.split(":")[1]), line.split()[1]) for line in lines}
    assert got == expected  # flake8 suppresses every line of the noqa corpus file too
