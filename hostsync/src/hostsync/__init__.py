"""Find host syncs and host stalls in PyTorch code.

- Runtime: ``with no_host_sync() as audit:`` records every host-synchronizing or host-stalling
  tensor operation in the block (a TorchDispatchMode; see :mod:`hostsync.runtime`).
- pytest: the ``no_host_sync`` fixture and ``@pytest.mark.no_host_sync`` marker
  (:mod:`hostsync.pytest_plugin`, auto-loaded through the ``pytest11`` entry point).
- Static: ``hostsync lint`` and the flake8 ``HS`` codes (:mod:`hostsync.lint`).
- ``hostsync audit SCRIPT`` (also ``mlaprefill audit``).

Importing this package is cheap: torch is imported only when a runtime name is first used, so the
pytest plugin and the linter cost nothing for code that does not use them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["KINDS", "Finding", "HostSyncAudit", "HostSyncError", "no_host_sync"]

_RUNTIME_NAMES = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_NAMES:
        return getattr(importlib.import_module("hostsync.runtime"), name)
    raise AttributeError(f"module 'hostsync' has no attribute {name!r}")
