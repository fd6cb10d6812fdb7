"""pytest plugin (entry point ``pytest11``): fail a test that synchronizes the host.

Use either the fixture or the marker::

    def test_step(no_host_sync):          # the audit is active during the test call
        out = staging.upload(plan)
        with no_host_sync.paused():        # the test's own checks may read the device
            assert out.cu_seq_lens.tolist() == expected

    @pytest.mark.no_host_sync(allow=["*/setup_helpers.py"], strict=False)
    def test_forward():
        ...

The audit covers only the test call (not fixture setup/teardown), so device tensors built by
fixtures do not count. Marker keyword arguments are passed to
:func:`hostsync.no_host_sync`. Importing this module imports neither torch nor the
runtime audit; tests that use neither the fixture nor the marker run exactly as without it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

_MARKER = "no_host_sync"
_FIXTURE = "no_host_sync"
_STASH_KEY: pytest.StashKey[Any] = pytest.StashKey()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "no_host_sync(strict=False, allow=(), ...): fail the test if its call performs a host "
        "sync or host stall (pageable non_blocking H2D copy, D2H copy, .item(), nonzero, "
        "synchronize ...); keyword arguments go to hostsync.no_host_sync",
    )


def _make_audit(item: pytest.Item) -> Any:
    from hostsync.runtime import no_host_sync

    marker = item.get_closest_marker(_MARKER)
    kwargs = dict(marker.kwargs) if marker is not None else {}
    return no_host_sync(**kwargs)


@pytest.fixture(name=_FIXTURE)
def no_host_sync_fixture(request: pytest.FixtureRequest) -> Any:
    """The :class:`~hostsync.HostSyncAudit` active during this test's call.

    The test fails with the grouped findings if the call synchronized the host.
    """
    audit = request.node.stash.get(_STASH_KEY, None)
    if audit is None:
        audit = _make_audit(request.node)
        request.node.stash[_STASH_KEY] = audit
    return audit


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    uses_fixture = _FIXTURE in getattr(item, "fixturenames", ())
    if not uses_fixture and item.get_closest_marker(_MARKER) is None:
        return (yield)
    audit = item.stash.get(_STASH_KEY, None)
    if audit is None:
        audit = _make_audit(item)
        item.stash[_STASH_KEY] = audit
    failed = True
    try:
        with audit:
            result = yield
        failed = False
    finally:
        if failed and audit.findings:  # the test failed on its own: still show the syncs
            item.add_report_section("call", "host syncs", audit.report(limits=False))
    if audit.findings:
        pytest.fail(audit.report(limits=False), pytrace=False)
    return result
