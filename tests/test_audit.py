"""Runtime host-sync audit on CPU: ``meta`` stands in for the CUDA device.

Copies into/out of ``meta`` and ``.item()`` of ``meta`` tensors raise after the audit has seen
them (meta tensors have no data), so those ops run under ``_tolerate``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from hostsync import KINDS, Finding, HostSyncError, no_host_sync
from mlaprefill.cli import main

THIS = os.path.abspath(__file__)


def _next_line() -> int:
    """Line number of the caller's next line."""
    return sys._getframe(1).f_lineno + 1


@contextlib.contextmanager
def _tolerate() -> Iterator[None]:
    """meta tensors have no data: ops that read it fail after the audit has recorded them."""
    with contextlib.suppress(RuntimeError, NotImplementedError, AssertionError, AttributeError,
                             TypeError):
        yield


def _attempt(op) -> None:
    with _tolerate():
        op()


def _only(findings: list[Finding], kind: str, line: int) -> Finding:
    assert len(findings) == 1, [f.describe() for f in findings]
    f = findings[0]
    assert (f.kind, f.filename, f.lineno) == (kind, THIS, line), f.describe()
    return f


def test_pageable_non_blocking_copy_any_size() -> None:
    x = torch.arange(3, dtype=torch.int32)
    with no_host_sync() as audit:
        line = _next_line()
        x.to("meta", non_blocking=True)
    f = _only(audit.findings, "pageable_h2d", line)
    assert (f.nbytes, f.shape, f.dtype) == (12, (3,), "int32")
    assert f.op.startswith("Tensor.to") and "_to_copy" in f.op
    assert f.function == "test_pageable_non_blocking_copy_any_size"
    assert "non_blocking=True" in f.code and "pin_memory=True" in f.fix


def test_pageable_copy_into_device_tensor() -> None:
    dst = torch.empty(4, 5, device="meta")
    with no_host_sync() as audit:
        line = _next_line()
        dst.copy_(torch.ones(4, 5), non_blocking=True)
    f = _only(audit.findings, "pageable_h2d", line)
    assert f.nbytes == 80 and f.devices == "cpu->meta"


def test_copies_under_inference_mode_are_seen() -> None:
    """Inference engines run under torch.inference_mode(), where the copy reaches the audit as
    aten.to.* instead of _to_copy; it must be found all the same, once per copy."""
    x = torch.arange(6, dtype=torch.int32)
    pinned = torch.arange(6, dtype=torch.int32)
    like = torch.empty(6, dtype=torch.int32, device="meta")
    with torch.inference_mode(), no_host_sync() as audit:
        audit.treat_as_pinned(pinned)
        line = _next_line()
        x.to("meta", non_blocking=True)
        x.to(like, non_blocking=True)  # aten.to.other
        x.to(torch.float32)  # host cast: no copy to a device
        pinned.to("meta", non_blocking=True)  # pinned: clean
    found = [(f.kind, f.lineno, f.count) for f in audit.findings]
    assert found == [("pageable_h2d", line, 1), ("pageable_h2d", line + 1, 1)], found


def test_pinned_copies_are_clean_and_non_dense_pinned_is_found() -> None:
    host = torch.arange(64, dtype=torch.int64).reshape(8, 8)
    dst = torch.empty(8, 4, dtype=torch.int64, device="meta")
    with no_host_sync() as audit:
        audit.treat_as_pinned(host)
        host.to("meta", non_blocking=True)  # contiguous pinned: clean
        host[2:5].to("meta", non_blocking=True)  # row slice: still dense
        host.t().to("meta", non_blocking=True)  # dense, transposed: dst keeps its strides
        host.to("meta", dtype=torch.int32, non_blocking=True)  # converted on the device
        assert audit.findings == []
        line = _next_line()
        dst.copy_(host[:, :4], non_blocking=True)  # column slice: not dense
        line2 = _next_line()
        host[:, 1].to("meta", non_blocking=True)
        line3 = _next_line()
        torch.empty(4, 8, device="meta").copy_(host[0], non_blocking=True)  # broadcast
    kinds = [(f.kind, f.lineno) for f in audit.findings]
    assert kinds == [("strided_pinned_h2d", line), ("strided_pinned_h2d", line2),
                     ("strided_pinned_h2d", line3)]
    assert "contiguous pinned" in audit.findings[0].fix


def test_injectable_is_pinned_predicate() -> None:
    x = torch.zeros(16)
    with no_host_sync(is_pinned=lambda t: t.numel() == 16) as audit:
        x.to("meta", non_blocking=True)
        line = _next_line()
        torch.zeros(8).to("meta", non_blocking=True)
    _only(audit.findings, "pageable_h2d", line)


def test_blocking_h2d_and_tensor_factory_with_device() -> None:
    x = torch.zeros(2, 3)
    with no_host_sync() as audit:
        line = _next_line()
        x.to("meta")
        line2 = _next_line()
        torch.tensor([1, 2, 3], device="meta")
        torch.tensor([1, 2, 3])  # host only: clean
        torch.zeros(3, device="meta")  # allocated on the device: no copy
    assert [(f.kind, f.lineno) for f in audit.findings] == [("sync_h2d", line),
                                                           ("sync_h2d", line2)]
    assert audit.findings[1].op == "torch.tensor" and audit.findings[1].nbytes == 24


def test_device_to_host_reads() -> None:
    d = torch.zeros(4, 2, device="meta")
    with no_host_sync() as audit:
        lines = []
        for op in (lambda: d.cpu(), lambda: d.tolist(), lambda: d.numpy(force=True),
                   lambda: d.to("cpu"), lambda: torch.empty(4, 2).copy_(d)):
            lines.append(_next_line())
            with _tolerate():
                op()
    assert [f.kind for f in audit.findings] == ["d2h"] * 5
    assert all(f.filename == THIS and f.function == "<lambda>" for f in audit.findings)
    assert audit.findings[1].op.startswith("Tensor.tolist")
    assert all(f.nbytes == 32 for f in audit.findings)


def test_item_and_bool_of_device_tensor() -> None:
    d = torch.zeros(4, device="meta")
    with no_host_sync() as audit:
        line = _next_line()
        _attempt(lambda: d[0].item())
        line2 = _next_line()
        _attempt(lambda: bool(d[1]))
        torch.zeros(3)[0].item()  # host tensor: clean
    kinds = [(f.kind, f.lineno) for f in audit.findings]
    assert kinds == [("item", line), ("item", line2)]
    assert audit.findings[0].op.startswith("Tensor.item")


@pytest.mark.parametrize("name, op", [
    ("nonzero", lambda d: d.nonzero()),
    ("where1", lambda d: torch.where(d > 0)),
    ("masked_select", lambda d: d.masked_select(d > 0)),
    ("bool_index", lambda d: d[d > 0]),
    ("bool_index_put", lambda d: d.__setitem__(d > 0, torch.zeros(2, device="meta"))),
    ("unique", lambda d: torch.unique(d)),
    ("repeat_interleave", lambda d: torch.repeat_interleave(d.long())),
    ("repeat_interleave_self", lambda d: d.repeat_interleave(d.long())),
    ("bincount", lambda d: torch.bincount(d.long())),
    ("histc_no_range", lambda d: torch.histc(d)),
])
def test_data_dependent_shapes(name: str, op) -> None:
    d = torch.zeros(6, device="meta")
    with no_host_sync() as audit, _tolerate():
        op(d)
    # the first user frame is the lambda in the parameter list above
    kinds = {(f.kind, f.lineno, f.filename) for f in audit.findings}
    assert kinds == {("data_dependent_shape", op.__code__.co_firstlineno, THIS)}, name


def test_equal_and_allclose_are_host_reads() -> None:
    d = torch.zeros(3, device="meta")
    with no_host_sync() as audit:
        line = _next_line()
        _attempt(lambda: torch.equal(d, d))
        _attempt(lambda: torch.allclose(d, d))
    assert [(f.kind, f.lineno) for f in audit.findings] == [("item", line), ("item", line + 1)]


def test_static_shape_forms_are_clean() -> None:
    d = torch.zeros(6, device="meta")
    with no_host_sync() as audit:
        torch.histc(d, bins=4, min=0.0, max=1.0)
        torch.repeat_interleave(d.long(), output_size=12)
        d.repeat_interleave(2)
        torch.where(d > 0, d, 1.0)
        d.masked_fill(d > 0, 0.0)
        d.index_put_((d > 0,), torch.tensor(0.0))  # host scalar: torch uses masked_fill_
        c = torch.arange(10)
        c.nonzero(), c[c > 3], torch.unique(c), c.tolist(), c.cpu(), c[0].item()  # host data
    assert audit.findings == []


def test_explicit_synchronize_wrapped_only_while_active() -> None:
    original = torch.cuda.synchronize
    with no_host_sync() as audit:
        assert torch.cuda.synchronize is not original
        line = _next_line()
        _attempt(lambda: torch.cuda.synchronize())
        line2 = _next_line()
        _attempt(lambda: torch.cuda.Event.synchronize(object()))
        line3 = _next_line()
        _attempt(lambda: torch.cuda.Stream.synchronize(object()))
    assert torch.cuda.synchronize is original
    got = [(f.kind, f.op, f.lineno) for f in audit.findings]
    assert got == [("synchronize", "torch.cuda.synchronize", line),
                   ("synchronize", "torch.cuda.Event.synchronize", line2),
                   ("synchronize", "torch.cuda.Stream.synchronize", line3)]


def test_clean_host_code_reports_nothing() -> None:
    with no_host_sync(strict=True) as audit:
        x = torch.randn(32, 8)
        y = (x @ x.T).softmax(-1)
        y.sum().item()
        y.nonzero()
        torch.zeros(4, device="meta") + 1  # device-only work
    assert audit.findings == [] and audit.allowed == []
    assert "0 in 0 location" in audit.report()


def test_strict_raises_before_the_op_with_location_and_fix() -> None:
    x = torch.zeros(8)
    with pytest.raises(HostSyncError) as info, no_host_sync(strict=True):
        line = _next_line()
        x.to("meta", non_blocking=True)
    msg = str(info.value)
    assert f"{THIS}:{line}" in msg and "pin_memory=True" in msg and "pageable_h2d" in msg
    assert info.value.finding.lineno == line


def test_allow_list_by_kind_and_location() -> None:
    x = torch.zeros(8)
    d = torch.zeros(2, device="meta")
    with no_host_sync(allow=["item", f"*{os.path.basename(THIS)}:{_next_line() + 1}"]) as audit:
        _attempt(lambda: d[0].item())
        x.to("meta", non_blocking=True)  # allowed by line
        line = _next_line()
        x.to("meta", non_blocking=True)  # other line: reported
    _only(audit.findings, "pageable_h2d", line)
    assert [f.kind for f in audit.allowed] == ["item", "pageable_h2d"]
    with no_host_sync(allow=["*/test_audit.py"], strict=True) as audit2:
        x.to("meta", non_blocking=True)
    assert audit2.findings == [] and len(audit2.allowed) == 1
    with pytest.raises(TypeError, match="allow"):
        no_host_sync(allow="item")


def test_report_groups_by_location_with_counts_and_bytes() -> None:
    x = torch.zeros(256, dtype=torch.uint8)
    with no_host_sync() as audit:
        for _ in range(3):
            line = _next_line()
            x.to("meta", non_blocking=True)
        torch.tensor([1.0], device="meta")
    groups = audit.groups()
    assert [(g["lineno"], g["kind"], g["count"], g["nbytes"]) for g in groups] == [
        (line, "pageable_h2d", 3, 768), (line + 1, "sync_h2d", 1, 4)]
    text = audit.report()
    assert "4 in 2 location(s)" in text and f"test_audit.py:{line}" in text and "3x" in text
    summary = audit.summary()
    assert summary["num_findings"] == 4 and len(summary["findings"]) == 4
    assert set(summary["findings"][0]) >= {"kind", "op", "nbytes", "shape", "dtype",
                                           "location", "function", "fix"}


def test_user_frame_skips_torch_internals_and_nested_audits_both_record() -> None:
    d = torch.zeros(5, device="meta")
    with no_host_sync() as outer, no_host_sync() as inner:
        line = _next_line()
        _attempt(lambda: torch.unique(d))  # torch/functional.py calls torch._unique2
    for audit in (outer, inner):
        _only(audit.findings, "data_dependent_shape", line)


def test_is_device_predicate_and_profile_needs_cuda() -> None:
    with no_host_sync(is_device=lambda dev: dev.type == "cuda") as audit:
        torch.zeros(3).to("meta", non_blocking=True)
    assert audit.findings == []
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"profile=True\) needs CUDA"), \
                no_host_sync(profile=True):
            pass


def test_reentering_the_same_audit_is_an_error() -> None:
    audit = no_host_sync()
    with audit, pytest.raises(RuntimeError, match="already active"), audit:
        pass
    with audit:  # reusable once exited; findings accumulate
        torch.zeros(1).to("meta")
    with audit:
        torch.zeros(1).to("meta")
    assert len(audit.findings) == 2


def test_kinds_have_text_and_fix() -> None:
    assert set(KINDS) >= {"pageable_h2d", "strided_pinned_h2d", "sync_h2d", "d2h", "item",
                          "data_dependent_shape", "synchronize"}
    assert all(len(v) == 2 and v[0] and v[1] for v in KINDS.values())


# ------------------------------------------------------------------------------ CLI

SYNCING = """\
import sys
import torch
print("argv", sys.argv[1:])
x = torch.arange(64)
for _ in range(2):
    x.to("meta", non_blocking=True)
"""


def test_cli_exit_codes_and_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "step.py"
    script.write_text(SYNCING)
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\nprint(torch.arange(4).sum().item())\n")
    assert main(["audit", str(script), "a", "--b"]) == 1
    out = capsys.readouterr().out
    assert "argv ['a', '--b']" in out and "step.py:6" in out and "2x pageable_h2d" in out
    assert main(["audit", "--json", str(script)]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # the script's own print went to stderr
    assert "argv" in captured.err
    assert data["num_findings"] == 2 and data["groups"][0]["lineno"] == 6
    assert data["groups"][0]["nbytes"] == 2 * 64 * 8
    assert main(["audit", "--json", str(clean)]) == 0
    assert json.loads(capsys.readouterr().out)["num_findings"] == 0
    assert main(["audit", "--strict", str(script)]) == 1
    assert "HostSyncError" in capsys.readouterr().err
    assert main(["audit", "--allow", "pageable_h2d", str(script)]) == 0
    assert main(["audit", str(tmp_path / "missing.py")]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["audit"])
    assert exit_info.value.code == 2


def test_cli_keeps_the_scripts_own_failure_status(tmp_path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert main(["audit", str(script)]) == 3
    script.write_text("raise KeyError('boom')\n")
    assert main(["audit", str(script)]) == 1


@pytest.mark.slow  # a fresh interpreter importing torch: ~9 s on a busy machine
def test_console_script_exit_code(tmp_path) -> None:
    script = tmp_path / "step.py"
    script.write_text(SYNCING)
    proc = subprocess.run([sys.executable, "-m", "mlaprefill", "audit", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "pageable_h2d" in proc.stdout


def test_torch_compile_fullgraph_runs_under_the_audit() -> None:
    compiled = torch.compile(lambda t: (t * 2).sin() + 1, backend="eager", fullgraph=True)
    x = torch.ones(4)
    with no_host_sync() as audit:
        out = compiled(x)
        line = _next_line()
        x.to("meta", non_blocking=True)  # eager code around compiled code is still audited
    assert torch.allclose(out, torch.full((4,), 2.0).sin() + 1)
    _only(audit.findings, "pageable_h2d", line)
