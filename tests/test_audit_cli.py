"""``mlaprefill audit``: grouping by frame, the fix per kind, what a run could not see (no false
all-clear on a CPU machine), and user errors as one line (with a fuzz over argument lists)."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hostsync import KINDS, no_host_sync
from hostsync.findings import audit_limits, group_by_frame
from mlaprefill.cli import main

NO_CUDA = not torch.cuda.is_available()

# What the user ran: the copy and the read are there, but without CUDA they stay on
# the CPU, so nothing can synchronize.
CPU_STEP = """\
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.arange(1 << 16)
y = x.to(device, non_blocking=True)
print(int(y.sum().item()))
"""

META_STEP = """\
import torch
x = torch.arange(64)
for _ in range(2):
    x.to("meta", non_blocking=True)
d = torch.zeros(4, device="meta")
try:
    d.sum().item()
except Exception:
    pass
"""


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
    return int(status), out.getvalue(), err.getvalue()


def _one_line(err: str, *fields: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlaprefill audit: error: "), err
    assert "Traceback" not in err and all(f in lines[0] for f in fields), (fields, err)


# ------------------------------------------------------------------------------ limits


def test_limits_name_what_a_machine_without_devices_cannot_see() -> None:
    blind = audit_limits(cuda_available=False, devices_seen=[], profiled=False)
    assert blind[0]["scope"] == "this machine" and "item()" in blind[0]["what"]
    assert "torch.cuda.is_available() is False" in blind[0]["why"]
    assert "hostsync lint" in blind[0]["fix"]
    assert [x["scope"] for x in blind[1:]] == ["always"] * 3
    meta = audit_limits(cuda_available=False, devices_seen=["meta"], profiled=False)
    assert meta[0]["scope"] == "this machine" and "meta" in meta[0]["why"]
    cuda_idle = audit_limits(cuda_available=True, devices_seen=[], profiled=True)
    assert cuda_idle[0]["scope"] == "this run"
    assert all(x["scope"] == "always" for x in
               audit_limits(cuda_available=True, devices_seen=["cuda:0"], profiled=True))
    assert len(audit_limits(cuda_available=True, devices_seen=["cuda:0"], profiled=False)) == 3


def test_a_run_without_device_tensors_is_no_all_clear() -> None:
    x = torch.arange(8)
    with no_host_sync() as audit:
        x.to("cpu", non_blocking=True).sum().item()
    assert audit.findings == [] and audit.devices_seen == set()
    summary = audit.summary()
    assert summary["complete"] is False and summary["num_findings"] == 0
    head = audit.report().splitlines()[0]
    assert head.startswith("host syncs: 0") and "incomplete" in head
    assert "not seen on this" in audit.report()
    assert "incomplete" not in audit.report(limits=False)


def test_devices_seen_are_recorded() -> None:
    with no_host_sync() as audit, contextlib.suppress(RuntimeError, NotImplementedError):
        torch.zeros(3).to("meta", non_blocking=True)
    assert audit.devices_seen == {"meta"}
    assert audit.summary()["complete"] is (not NO_CUDA)


# ------------------------------------------------------------------------------ grouping


def test_report_groups_by_frame_with_one_fix_line_per_kind() -> None:
    x = torch.arange(4)
    d = torch.zeros(4, device="meta")

    def step() -> None:
        # meta tensors have no data: the read fails after the audit has recorded it
        with contextlib.suppress(RuntimeError, NotImplementedError):
            x.to("meta", non_blocking=True); d.tolist()  # noqa: E702 - one frame, two kinds

    with no_host_sync() as audit:
        step()
        step()
    frames = group_by_frame(audit.findings)
    assert len(frames) == 1
    assert frames[0]["kinds"] == {"pageable_h2d": 2, "d2h": 2} and frames[0]["count"] == 4
    text = audit.report()
    assert "host syncs: 4 in 1 location(s)" in text
    fixes = text.split("fix per kind:\n")[1].splitlines()
    assert fixes[:2] == [f"  pageable_h2d: {KINDS['pageable_h2d'][1]}",
                         f"  d2h: {KINDS['d2h'][1]}"]
    assert text.count(KINDS["d2h"][1]) == 1  # one line per kind, not per location
    summary = audit.summary()
    assert summary["by_frame"][0]["kinds"] == {"pageable_h2d": 2, "d2h": 2}
    assert summary["fixes"] == {"pageable_h2d": KINDS["pageable_h2d"][1],
                                "d2h": KINDS["d2h"][1]}


# ------------------------------------------------------------------------------ CLI


@pytest.mark.skipif(not NO_CUDA, reason="checks the CPU-machine report")
def test_cli_on_a_cpu_machine_says_what_it_could_not_see(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "step.py"
    script.write_text(CPU_STEP)
    status, out, _ = _run(["audit", str(script)])
    assert status == 0
    assert "host syncs: 0 in 0 location(s) -- incomplete" in out
    assert "not seen on this machine" in out and "torch.cuda.is_available() is False" in out
    status, out, _ = _run(["audit", "--format", "json", str(script)])
    data = json.loads(out)
    assert status == 0 and data["complete"] is False and data["num_findings"] == 0
    assert data["not_seen"][0]["scope"] == "this machine"


def test_cli_meta_run_reports_frames_and_fixes(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "step.py"
    script.write_text(META_STEP)
    status, out, _ = _run(["audit", "--json", str(script)])
    data = json.loads(out)
    assert status == 1 and data["devices_seen"] == ["meta"]
    assert [(g["lineno"], g["kinds"]) for g in data["by_frame"]] == [
        (4, {"pageable_h2d": 2}), (7, {"item": 1})]
    assert set(data["fixes"]) == {"pageable_h2d", "item"}


@pytest.mark.skipif(not NO_CUDA, reason="--profile works with CUDA")
def test_cli_profile_without_cuda_is_one_line(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "step.py"
    script.write_text(CPU_STEP)
    status, out, err = _run(["audit", "--profile", str(script)])
    assert status == 2 and out == ""
    _one_line(err, "--profile", "CUDA", "drop --profile")
    assert "profile=" not in err  # the CLI flag, not the Python argument


@pytest.mark.parametrize(("name", "content", "fields"), [
    ("missing.py", None, ("SCRIPT", "does not exist")),
    ("latin.py", b"x = '\xe9'\n", ("SCRIPT", "UTF-8")),
    ("broken.py", b"def (:\n", ("SCRIPT", "does not parse", "line 1")),
    ("nul.py", b"x = 1\x00\n", ("SCRIPT",)),
])
def test_cli_bad_scripts_are_one_line(tmp_path: pathlib.Path, name: str, content: bytes | None,
                                      fields: tuple[str, ...]) -> None:
    script = tmp_path / name
    if content is not None:
        script.write_bytes(content)
    status, out, err = _run(["audit", str(script)])
    assert status == 2 and out == ""
    _one_line(err, *fields)


def test_cli_directory_unreadable_script_and_bad_flags(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    status, _, err = _run(["audit", str(tmp_path)])
    assert status == 2
    _one_line(err, "SCRIPT", "directory")
    for argv, fields in ((["audit", "--format", "xml", "x.py"], ("--format", "xml")),
                         (["audit", "--bogus", "x.py"], ("--bogus",)),
                         (["audit"], ("SCRIPT",))):
        status, _, err = _run(argv)
        assert status == 2
        _one_line(err, *fields)
    from hostsync import cli_common

    script = tmp_path / "ok.py"
    script.write_text("x = 1\n")

    def denied(path, *args, **kwargs):  # root ignores file modes: deny like a read-only FS
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(cli_common, "open", denied, raising=False)
    status, _, err = _run(["audit", str(script)])
    assert status == 2
    _one_line(err, "SCRIPT", "cannot be read")


@pytest.fixture(scope="module")
def fuzz_scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fuzz")
    files = {"meta": META_STEP.encode(), "cpu": CPU_STEP.encode(), "latin": b"x = '\xe9'\n",
             "broken": b"def (:\n", "exits": b"import sys\nsys.exit(0)\n"}
    out = {}
    for name, data in files.items():
        (d / f"{name}.py").write_bytes(data)
        out[name] = str(d / f"{name}.py")
    out["dir"] = str(d)
    out["missing"] = str(d / "missing.py")
    return out


_FLAGS = ["--json", "--strict", "--allow", "item", "pageable_h2d", "--format", "json", "text",
          "xml", "--profile", "--bogus", "-q", "--", "arg"]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_cli_fuzz_outcome_classes(fuzz_scripts: dict[str, str], data: st.DataObject) -> None:
    """Any argument list: exit 0/1 with a report on stdout, or 2 with one line on stderr."""
    items = st.sampled_from(_FLAGS + list(fuzz_scripts.values()))
    argv = data.draw(st.lists(items, max_size=5))
    status, out, err = _run(["audit", *argv])
    assert "Traceback" not in out + err, (argv, err)
    if status == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], (argv, err)
    else:
        assert status in (0, 1), (argv, status, err)
        assert "host syncs:" in out or '"num_findings"' in out, (argv, out)


@pytest.mark.slow  # a fresh interpreter importing torch: ~10 s on a busy machine
def test_console_script_module_entry_point(tmp_path: pathlib.Path) -> None:
    import subprocess

    script = tmp_path / "step.py"
    script.write_text(META_STEP)
    proc = subprocess.run([sys.executable, "-m", "mlaprefill", "audit", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "fix per kind:" in proc.stdout, proc.stderr


def test_audit_takes_the_form_people_type(tmp_path: pathlib.Path) -> None:
    """Was: ``mlaprefill audit -- python s.py`` failed with "SCRIPT 'python' does not exist"."""
    script = tmp_path / "s.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    for argv in (["audit", "--json", "--", "python", str(script), "a", "-b"],
                 ["audit", "--json", "python3", str(script), "a", "-b"],
                 ["audit", "--json", sys.executable, str(script), "a", "-b"]):
        status, out, err = _run(argv)
        assert status == 0, err
        report = json.loads(out)
        assert report["script"] == str(script) and report["args"] == ["a", "-b"], report
    for argv, words in ((["audit", "python"], "is the Python interpreter"),
                        (["audit", "python", "-m", "pkg"], "not interpreter options")):
        status, _, err = _run(argv)
        assert status == 2 and words in err and err.count("\n") == 1, err
