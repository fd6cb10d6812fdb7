"""Static host-sync lint: corpus (exact findings, precision, recall), flow, noqa, the CLI and its
output formats, user errors, the flake8 plugin and the pre-commit hook definition."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostsync.lint import CODES, NOT_CHECKED, OPT_IN, is_selected, lint_source, lint_tree
from hostsync.lint_report import EXPLANATIONS, to_github, to_sarif
from hostsync.lint_where import (
    ACC_DEV,
    CPU_DEV,
    DEVICE,
    HOST,
    NONE,
    PAGEABLE,
    PINNED,
    UNKNOWN,
    join,
)
from mlaprefill.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = pathlib.Path(__file__).parent / "lint_corpus"
CORPUS_FILES = sorted(CORPUS.glob("*.py"))
_MARK = re.compile(r"#\s*(expect|fp|missed):\s*([A-Z0-9, ]+)$")
_SELECT = re.compile(r"^#\s*lint-select:\s*(\S+)", re.MULTILINE)


def _markers(path: pathlib.Path) -> dict[str, set[tuple[int, str]]]:
    out: dict[str, set[tuple[int, str]]] = {"expect": set(), "fp": set(), "missed": set()}
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        m = _MARK.search(line)
        if m:
            out[m.group(1)] |= {(i, c.strip()) for c in m.group(2).split(",") if c.strip()}
    return out


def _select(path: pathlib.Path) -> list[str] | None:
    m = _SELECT.search(path.read_text())
    return m.group(1).split(",") if m else None


def _found(path: pathlib.Path) -> set[tuple[int, str]]:
    return {(f.line, f.code)
            for f in lint_source(path.read_text(), str(path), select=_select(path))}


# ------------------------------------------------------------------------------ corpus


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_corpus_findings_match_markers(path: pathlib.Path) -> None:
    marks = _markers(path)
    assert _found(path) == marks["expect"] | marks["fp"]


def test_corpus_has_positives_of_every_code() -> None:
    codes = {c for p in CORPUS_FILES for _, c in _markers(p)["expect"]}
    assert codes == set(CODES) - {NOT_CHECKED}  # HS000: tested on broken files below


def _scores(code: str) -> tuple[int, int, int]:
    tp = fp = fn = 0
    for p in CORPUS_FILES:
        marks = _markers(p)
        tp += sum(c == code for _, c in marks["expect"])
        fp += sum(c == code for _, c in marks["fp"])
        fn += sum(c == code for _, c in marks["missed"])
    return tp, fp, fn


@pytest.mark.parametrize(("code", "min_precision", "min_recall"),
                         [("HS101", 0.9, 0.9), ("HS201", 0.9, 0.5)])
def test_corpus_precision_and_recall(code: str, min_precision: float,
                                     min_recall: float) -> None:
    """Precision and recall over every marked line of the corpus (engine-style files
    included); the exact-match test above makes the markers the truth of what is reported."""
    tp, fp, fn = _scores(code)
    assert tp >= 10, f"{code}: too few true positives in the corpus to measure ({tp})"
    assert tp / (tp + fp) >= min_precision, (code, tp, fp)
    assert tp / (tp + fn) >= min_recall, (code, tp, fn)


def test_missed_uploads_from_other_modules_are_opt_in_findings() -> None:
    """The default stays precise; HS103 reports the uploads the lint cannot place."""
    path = CORPUS / "engine_forward_batch.py"
    missed = {line for line, code in _markers(path)["missed"] if code == "HS101"}
    opt_in = {f.line for f in lint_source(path.read_text(), str(path),
                                          select=["HS", "HS103"]) if f.code == "HS103"}
    assert missed and missed <= opt_in


# ------------------------------------------------------------------------------ the model


KINDS = [PINNED, PAGEABLE, HOST, DEVICE, NONE, UNKNOWN, CPU_DEV, ACC_DEV, None]


@given(st.sampled_from(KINDS), st.sampled_from(KINDS), st.sampled_from(KINDS))
def test_join_is_a_commutative_idempotent_merge(a, b, c) -> None:
    assert join(a, b) == join(b, a)
    assert join(a, a) == a
    assert join(NONE, a) == (a if a is not None else NONE)
    if {a, b, c} <= {PINNED, PAGEABLE, HOST}:
        assert join(join(a, b), c) == join(a, join(b, c))


def test_join_keeps_a_known_path_and_drops_disagreement() -> None:
    assert join(PAGEABLE, UNKNOWN) == PAGEABLE  # one path pageable, none pinned: report
    assert join(DEVICE, UNKNOWN) == DEVICE
    assert join(PAGEABLE, PINNED) == HOST  # pinned on one path: pinnedness unknown
    assert join(DEVICE, PAGEABLE) == UNKNOWN
    assert join(PINNED, UNKNOWN) == UNKNOWN


def _codes(src: str, select: list[str] | None = None) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint_source(src, "t.py", select=select)]


def test_branches_are_merged_not_overwritten() -> None:
    src = (
        "import torch\n"
        "def f(lens, device, a):\n"
        "    if a:\n"
        "        x = torch.tensor(lens)\n"
        "        y = x.to(device, non_blocking=True)\n"
        "    else:\n"
        "        x = torch.tensor(lens, pin_memory=True)\n"
        "        y = x.to(device, non_blocking=True)\n"
        "    return x.to(device, non_blocking=True), y\n"
    )
    # the pageable branch is reported; after the merge pinnedness is unknown (opt-in only)
    assert _codes(src) == [(5, "HS101")]
    assert _codes(src, ["HS", "HS103"]) == [(5, "HS101"), (9, "HS103")]


def test_device_sources_and_sibling_names() -> None:
    src = (
        "import torch\n"
        "class B:\n"
        "    def build(self, meta, n):\n"
        "        qsl = meta.query_start_loc\n"
        "        bt = meta.block_table[:n]\n"
        "        self.buf.copy_(bt, non_blocking=True)\n"  # device to device: clean
        "        lens = qsl[1:] - qsl[:-1]\n"
        "        k = (lens == 1).sum().item()\n"
        "        h = meta.query_start_loc_cpu[1:].sum().item()\n"  # host: clean
        "        return k, h, bt.to(self.device, non_blocking=True)\n"
    )
    assert _codes(src) == [(8, "HS201")]


def test_free_function_device_parameter_is_the_callers_choice() -> None:
    src = (
        "import torch\n"
        "def check(values, device):\n"
        "    t = torch.tensor(values, device=device)\n"
        "    return t.cpu().tolist()\n"
        "class Comp:\n"
        "    def __init__(self, device):\n"
        "        self.buf = torch.zeros(4, device=device)\n"
        "    def total(self):\n"
        "        return self.buf.sum().item()\n"
    )
    assert _codes(src) == [(9, "HS201")]


def test_opt_in_codes_need_their_full_code() -> None:
    assert {"HS103"} == OPT_IN
    assert not is_selected("HS103") and not is_selected("HS103", ["HS1"])
    assert is_selected("HS103", ["HS", "HS103"]) and is_selected("HS101", ["hs1"])
    assert not is_selected("HS201", ["HS1"])


def test_noqa_suppresses_only_its_line_and_codes() -> None:
    path = CORPUS / "noqa_cases.py"
    source = path.read_text()
    raw = lint_tree(ast.parse(source), str(path))
    noqa_lines = {i for i, line in enumerate(source.splitlines(), 1) if "# noqa" in line}
    assert {f.line for f in raw} == noqa_lines  # each noqa line really is a finding
    assert lint_source(source, str(path)) == []
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


def test_our_own_source_is_clean() -> None:
    assert main(["lint", str(ROOT / "src")]) == 0


# ------------------------------------------------------------------------------ CLI


def test_cli_text_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(CORPUS / "hs101_fixed_patterns.py")]) == 0
    capsys.readouterr()
    assert main(["lint", str(CORPUS / "hs102_pin_in_loop.py")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(":" in line and " HS102 " in line for line in out)
    assert main(["lint", "--format", "json", "--exclude", "*/real/*", str(CORPUS)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["num_files"] == len(CORPUS_FILES)
    default = [p for p in CORPUS_FILES if _select(p) is None]
    assert data["num_findings"] == sum(len(_found(p)) for p in default) + sum(
        1 for p in CORPUS_FILES if _select(p) for _, c in _found(p) if c not in OPT_IN)
    assert {"path", "line", "col", "code", "message"} <= set(data["findings"][0])


def test_cli_sarif_is_a_code_scanning_log(capsys: pytest.CaptureFixture[str]) -> None:
    path = CORPUS / "engine_spec_decode.py"
    assert main(["lint", "--format", "sarif", str(path)]) == 1
    log = json.loads(capsys.readouterr().out)
    assert log["version"] == "2.1.0" and "sarif" in log["$schema"]
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == sorted(CODES)
    assert all(r["help"]["text"] == EXPLANATIONS[r["id"]] for r in rules)
    got = {(r["locations"][0]["physicalLocation"]["region"]["startLine"], r["ruleId"])
           for r in run["results"]}
    assert got == _markers(path)["expect"]
    for r in run["results"]:
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"]
        uri = r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        assert not uri.startswith("/") and uri.endswith("engine_spec_decode.py")


def test_github_annotations_escape_their_fields() -> None:
    src = "import torch\ndef f(l, d):\n    return torch.tensor(l).to(d, non_blocking=True)\n"
    finding = lint_source(src, "dir,x/a:b.py")[0]
    (line,) = to_github([finding])
    assert line.startswith("::warning file=dir%2Cx/a%3Ab.py,line=3,col=12,title=HS101::")
    assert "\n" not in line
    assert to_sarif([])["runs"][0]["results"] == []


def test_cli_github_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", "--format", "github", str(CORPUS / "hs102_pin_in_loop.py")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(ln.startswith("::warning file=") for ln in lines)


def test_cli_explain(capsys: pytest.CaptureFixture[str]) -> None:
    for code in CODES:
        assert main(["lint", "--explain", code.lower()]) == 0
        text = capsys.readouterr().out
        assert text.startswith(code) and "Fix:" in text


def _one_line_error(err: str, *fields: str, prog: str = "mlaprefill lint") -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in err
    assert all(f in lines[0] for f in fields), (fields, err)


@pytest.mark.parametrize(("argv", "fields"), [
    (["lint"], ("PATH",)),
    (["lint", "missing_dir/x.py"], ("PATH", "does not exist")),
    (["lint", "--format", "xml", "src"], ("--format", "xml")),
    (["lint", "--select", "XY1", "src"], ("--select", "XY1")),
    (["lint", "--explain", "HS999"], ("--explain", "HS101")),
    (["lint", "--bogus", "src"], ("--bogus",)),
])
def test_cli_usage_errors_are_one_line(argv: list[str], fields: tuple[str, ...],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors
        status = e.code
    assert status == 2
    _one_line_error(capsys.readouterr().err, *fields)


def _not_checked(out: str, name: str, *words: str) -> None:
    lines = [line for line in out.splitlines() if " HS000 " in line
             and line.split(":")[0].endswith(name)]
    assert len(lines) == 1, (name, out)
    assert all(w in lines[0] for w in words), (words, out)


def test_files_that_cannot_be_checked_are_one_finding_each(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each broken file is one HS000 finding (exit 1), the run goes on with the others, and
    nothing is a traceback."""
    good = tmp_path / "good.py"
    good.write_text((CORPUS / "hs102_pin_in_loop.py").read_text())
    broken = {
        "bad.py": (b"def (:\n", ("does not parse", "line 1")),
        "latin.py": (b"x = '\xe9'\n", ("UTF-8",)),
        "nul.py": (b"x = 1\x00\n", ("cannot be parsed",)),
        "deep.py": (b"x = " + b"a+" * 100_000 + b"a\n", ("nested too deeply",)),
        "neg.py": (b"x = " + b"-" * 100_000 + b"1\n", ("nested too deeply",)),
    }
    for name, (data, _) in broken.items():
        (tmp_path / name).write_bytes(data)
    declared = tmp_path / "declared.py"
    declared.write_bytes(b"# -*- coding: latin-1 -*-\nx = '\xe9'\n")
    assert main(["lint", str(declared)]) == 0  # a coding cookie is honoured, like Python
    capsys.readouterr()
    assert main(["lint", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    for name, (_, words) in broken.items():
        _not_checked(captured.out, name, *words)
    assert captured.out.count(" HS102 ") == 2  # good.py's findings are still there
    assert main(["lint", "--select", "HS201", "/dev/zero", str(good)]) == 1  # always reported
    captured = capsys.readouterr()
    _not_checked(captured.out, "/dev/zero", "not a regular file")
    assert " HS102 " not in captured.out
    big = tmp_path / "big.py"
    big.write_bytes(b"#" * (17 * 2**20))
    assert main(["lint", str(big)]) == 1
    _not_checked(capsys.readouterr().out, "big.py", "larger than 16 MiB")


def test_audit_of_a_device_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "/dev/zero"]) == 2
    _one_line_error(capsys.readouterr().err, "/dev/zero", "not a regular file",
                    prog="mlaprefill audit")


def test_cli_unreadable_file_is_one_finding(tmp_path: pathlib.Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from hostsync import cli_common

    secret = tmp_path / "secret.py"
    secret.write_text("x = 1\n")

    def denied(path, *args, **kwargs):  # root ignores file modes: deny like a read-only FS
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cli_common, "open", denied, raising=False)
    assert main(["lint", str(secret)]) == 1
    _not_checked(capsys.readouterr().out, "secret.py", "cannot be read", "Permission denied")


def test_a_multi_line_chained_call_is_one_span(capsys: pytest.CaptureFixture[str]) -> None:
    source = ("import torch\n"
              "def f(reqs, device):\n"
              "    temperatures = torch.tensor(\n"
              "        [r.sampling_params.temperature for r in reqs],\n"
              "        dtype=torch.float32,\n"
              "    ).to(device, non_blocking=True)\n")
    (finding,) = lint_source(source, "t.py")
    assert (finding.code, finding.line, finding.end_line) == ("HS101", 3, 6)
    assert "`torch.tensor(...)`" in finding.message  # the call, not a cut-off argument list
    region = to_sarif([finding])["runs"][0]["results"][0]["locations"][0]["physicalLocation"][
        "region"]
    assert (region["startLine"], region["endLine"]) == (3, 6)
    assert region["endColumn"] == len("    ).to(device, non_blocking=True)") + 1


_FUZZ_ITEMS = st.sampled_from([
    "lint", "--format", "json", "sarif", "github", "text", "xml", "--select", "HS", "HS1",
    "HS103", "HS,HS103", "ZZ", "--exclude", "*engine*", "--explain", "HS201", "hs101", "HS7",
    "-q", "--", "", str(CORPUS / "hs102_pin_in_loop.py"), str(CORPUS / "flow_branches.py"),
    str(CORPUS), "no/such/path.py",
])


@settings(max_examples=120, deadline=None)
@given(st.lists(_FUZZ_ITEMS, max_size=6))
def test_cli_fuzz_outcome_classes(argv: list[str]) -> None:
    """Any argument list: exit 0/1 with findings on stdout, or 2 with one line on stderr."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["lint", *argv])
        except SystemExit as e:
            status = e.code
    assert "Traceback" not in out.getvalue() + err.getvalue()
    if status == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], err.getvalue()
    else:
        assert status in (0, 1), status
        if status == 1:
            assert out.getvalue().strip()


# ------------------------------------------------------------------------------ tools


def test_hostsync_command_lints_without_torch_or_numpy() -> None:
    """`hostsync lint` / `--version` import neither torch nor numpy (the install has neither);
    its errors are named for the command that was typed."""
    code = ("import sys, contextlib, io; from hostsync.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['--version'])\n"
            "    except SystemExit: pass\n"
            f"    status = main(['lint', {str(CORPUS / 'hs102_pin_in_loop.py')!r}])\n"
            "print(status, sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.split() == ["1", "[]"], proc.stderr
    proc = subprocess.run([sys.executable, "-m", "hostsync", "lint", "no/such.py"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("hostsync lint: error: PATH")


@pytest.mark.skipif(importlib.util.find_spec("flake8") is None, reason="flake8 not installed")
def test_flake8_plugin_reports_hs_codes_and_opt_in() -> None:
    files = [str(CORPUS / "hs101_prefix_patterns.py"), str(CORPUS / "noqa_cases.py")]
    proc = subprocess.run([sys.executable, "-m", "flake8", "--select", "HS", *files],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    got = {(int(line.split(":")[1]), line.split()[1]) for line in proc.stdout.splitlines()}
    assert got == _markers(CORPUS / "hs101_prefix_patterns.py")["expect"]
    optin = CORPUS / "optin_unknown_source.py"
    for extra, codes in (([], {"HS101"}), (["--hostsync-enable", "HS103"], {"HS101", "HS103"})):
        proc = subprocess.run([sys.executable, "-m", "flake8", "--select", "HS", *extra,
                               str(optin)], capture_output=True, text=True, timeout=120)
        assert {line.split()[1] for line in proc.stdout.splitlines()} == codes, proc.stderr


def _hooks() -> list[dict[str, str]]:
    """The hook list of ``.pre-commit-hooks.yaml`` (a flat list of flat maps)."""
    hooks: list[dict[str, str]] = []
    for line in (ROOT / ".pre-commit-hooks.yaml").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.lstrip("- ").partition(":")
        if line.startswith("- "):
            hooks.append({})
        hooks[-1][key.strip()] = value.strip()
    return hooks


def test_pre_commit_hooks_run_the_lint(tmp_path: pathlib.Path) -> None:
    hooks = _hooks()
    assert [h["id"] for h in hooks] == ["hostsync-lint", "hostsync-lint-system"]
    # pre-commit appends the staged file names to the entry
    bad = tmp_path / "stage.py"
    bad.write_text("import torch\ndef f(l, d):\n    return torch.tensor(l).to(d, "
                   "non_blocking=True)\n")
    script, system = hooks
    assert script["language"] == "script" and system["language"] == "system"
    assert all(h["types"] == "[python]" for h in hooks)
    # the script hook runs hostsync from the checkout, with nothing installed (no torch)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(ROOT / script["entry"]), str(bad)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 1 and " HS101 " in proc.stdout, proc.stderr
    entry = shlex.split(system["entry"])
    assert entry[:2] == ["hostsync", "lint"]
    proc = subprocess.run([sys.executable, "-m", "hostsync", *entry[1:], str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and " HS101 " in proc.stdout, proc.stderr
