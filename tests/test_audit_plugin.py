"""pytest plugin: the ``no_host_sync`` fixture and marker fail tests that sync the host."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

TESTS = """\
import pytest
import torch


def test_fixture_syncs(no_host_sync):
    torch.arange(4).to("meta", non_blocking=True)


def test_fixture_clean(no_host_sync):
    x = torch.arange(4) + 1
    assert x.sum().item() == 10
    with no_host_sync.paused():
        torch.zeros(2).to("meta")  # the test's own checks: not recorded
    assert no_host_sync.findings == []


@pytest.mark.no_host_sync
def test_marker_syncs():
    torch.zeros(3).to("meta")


@pytest.mark.no_host_sync(allow=["sync_h2d"])
def test_marker_allowed():
    torch.zeros(3).to("meta")


@pytest.mark.no_host_sync(strict=True)
def test_marker_strict():
    torch.zeros(3).to("meta", non_blocking=True)
    raise AssertionError("strict mode must stop at the copy")


@pytest.fixture
def device_tensor():
    return torch.tensor([1, 2], device="meta")  # fixture setup is not audited


def test_fixture_setup_not_audited(device_tensor, no_host_sync):
    assert device_tensor.shape == (2,)


def test_fails_on_its_own(no_host_sync):
    torch.zeros(2).to("meta")
    assert False, "its own failure"


def test_not_audited():
    torch.arange(4).to("meta", non_blocking=True)
"""


def _line(text: str, nth: int = 0) -> int:
    hits = [i for i, line in enumerate(TESTS.splitlines(), 1) if text in line]
    return hits[nth]


@pytest.mark.slow  # a nested pytest in a fresh interpreter: ~6 s
def test_fixture_and_marker_fail_syncing_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_sample=TESTS)
    # A subprocess, not in-process: pytester's in-process run restores sys.modules afterwards,
    # and torch's first dispatch mode imports triton, whose C extension cannot be re-imported.
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=4)
    result.stdout.fnmatch_lines([
        "*test_fixture_syncs*",
        f"*test_sample.py:{_line('arange(4).to')} in test_fixture_syncs: 1x pageable_h2d*",
        "*fix: allocate the source with pin_memory=True*",
    ])
    line = _line('torch.zeros(3).to("meta")')
    result.stdout.fnmatch_lines([f"*test_sample.py:{line} in test_marker_syncs: 1x sync_h2d*"])
    line = _line("non_blocking=True)", 1)
    result.stdout.fnmatch_lines([f"*HostSyncError*test_sample.py:{line} in test_marker_strict*"])
    assert "strict mode must stop" not in result.stdout.str()
    result.stdout.fnmatch_lines(["*its own failure*", "*Captured host syncs call*",
                                 "*1x sync_h2d*"])


def test_marker_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.no_host_sync(*"])


def test_plugin_import_is_cheap() -> None:
    code = ("import sys, hostsync.pytest_plugin, hostsync.flake8_plugin; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
