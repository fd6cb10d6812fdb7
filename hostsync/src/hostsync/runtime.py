"""Runtime host-sync audit: ``with no_host_sync() as audit:``.

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op issued in the block
and records the ones that make the host wait for the device (or stall behind queued work):

==========================  ===================================================================
kind                        what
==========================  ===================================================================
``pageable_h2d``            ``non_blocking=True`` host->device copy from unpinned memory (any
                            size: whether it stalls depends on size, platform and driver)
``strided_pinned_h2d``      ``non_blocking=True`` copy from pinned memory laid out differently
                            from the destination: torch stages it through a pageable temporary
``sync_h2d``                blocking host->device copy (``non_blocking=False``; ``torch.tensor``
                            or ``torch.as_tensor`` of host data with a device)
``d2h``                     device->host copy (``.cpu()``, ``.tolist()``, ``.to("cpu")``, ...)
``item``                    ``.item()`` / ``bool()`` / ``int()`` of a device tensor,
                            ``torch.equal``, ``torch.allclose``
``data_dependent_shape``    output size depends on device data (``nonzero``, ``masked_select``,
                            boolean-mask indexing, ``unique``, ``repeat_interleave`` without
                            ``output_size``, ``bincount``, ``histc`` without a range)
``synchronize``             ``torch.cuda.synchronize``, ``Event.synchronize``,
                            ``Stream.synchronize`` (wrapped while an audit is active)
``profiler_pageable_memcpy``  with ``profile=True``: pageable memcpy events the profiler saw
                            beyond the copies the dispatcher attributed (e.g. from extensions)
==========================  ===================================================================

The "device side" is a predicate over :class:`torch.device` (default: any non-CPU device), so
the logic runs on CPU-only torch with ``meta`` standing in for CUDA; pinnedness is a predicate
too (default ``Tensor.is_pinned()`` plus storages registered with
:meth:`HostSyncAudit.treat_as_pinned`), because CPU-only torch cannot allocate pinned memory.

Mechanism notes. :class:`HostSyncAudit` is the dispatch mode and owns the findings; it composes
the parts that decide what a finding is:

- :mod:`~hostsync.runtime_ops`: which aten calls sync (copies, scalar reads,
  data-dependent shapes), plus a small :class:`~torch.overrides.TorchFunctionMode` that sees the
  copies ``torch.tensor``/``torch.as_tensor`` make inside C++ (invisible to the dispatch mode)
  and names the Python-level call (``Tensor.item``, ``Tensor.tolist`` ...) behind each aten op;
- :mod:`~hostsync.runtime_where`: the user frame a finding is attributed to, and the
  allow-list;
- :mod:`~hostsync.runtime_cuda`: the ``synchronize`` functions, wrapped on enter and
  restored when the last active audit exits (reference-counted on the wrapper itself, so no
  module holds mutable state), and the profiler's count of pageable memcpys.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from hostsync.findings import (
    KINDS,
    Finding,
    HostSyncError,
    audit_limits,
    format_report,
    group_by_frame,
    group_findings,
)
from hostsync.runtime_cuda import (
    PageableMemcpyCounter,
    unwrap_synchronize,
    wrap_synchronize,
)
from hostsync.runtime_ops import OpClassifier
from hostsync.runtime_where import AllowList, FrameLocator, Where, finding_at

__all__ = ["KINDS", "Finding", "HostSyncAudit", "HostSyncError", "no_host_sync"]


def _on_synchronize(name: str) -> None:
    """Called by the wrapped synchronize functions: every active audit records the call."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, HostSyncAudit):
            mode._record_synchronize(name)


class HostSyncAudit(TorchDispatchMode):
    """Records host syncs of the tensor ops run while it is active. Use :func:`no_host_sync`.

    Attributes
    ----------
    findings : list[Finding]
        Host syncs not covered by the allow-list, in order.
    allowed : list[Finding]
        Host syncs matched by the allow-list (kept for reporting).
    profiler_pageable_memcpy : int | None
        With ``profile=True``: number of ``Memcpy HtoD (Pageable -> Device)`` events the
        profiler recorded in the block; ``None`` otherwise.
    devices_seen : set[str]
        The devices of the tensors the audit checked (empty: nothing could synchronize).
    """

    # Higher-order ops (flex_attention, cond, ...) pass through: func(*args) runs them with the
    # mode popped, and the aten ops they issue are audited as usual.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile traces and runs compiled code as if the audit were off.

        Compiled graphs cannot host-sync inside (dynamo graph-breaks at ``.item()`` and
        friends, and those run eagerly, where the audit sees them); without this, dynamo
        refuses to compile while a dispatch mode is active (``fullgraph=True`` fails).
        """
        return True

    def __init__(
        self,
        *,
        strict: bool = False,
        allow: Iterable[str] = (),
        is_pinned: Callable[[torch.Tensor], bool] | None = None,
        is_device: Callable[[torch.device], bool] | None = None,
        profile: bool = False,
        internal: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self._allow = AllowList(allow)
        self.strict = bool(strict)
        self.profile = bool(profile)
        self._frames = FrameLocator(internal)
        self._ops = OpClassifier(self._record, is_pinned=is_pinned, is_device=is_device)
        self._paused = 0
        self.findings: list[Finding] = []
        self.allowed: list[Finding] = []
        self.profiler_pageable_memcpy: int | None = None
        self._function_layer: TorchFunctionMode | None = None
        self._profiler: PageableMemcpyCounter | None = None
        # where findings with no user frame (all torch-internal, the profiler's) are attributed
        self._enter_frame: Where = ("<unknown>", 0, "<unknown>")

    # ------------------------------------------------------------------ public API

    @property
    def devices_seen(self) -> set[str]:
        return self._ops.devices_seen

    def treat_as_pinned(self, *tensors: torch.Tensor) -> None:
        """Treat the storages of ``tensors`` (and every view of them) as pinned.

        For CPU-only tests, where ``pin_memory()`` is unavailable; on CUDA real pinned memory
        is recognized by ``Tensor.is_pinned()`` without registration.
        """
        self._ops.treat_as_pinned(*tensors)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside this block (e.g. a test's own result checks); reentrant."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def groups(self) -> list[dict[str, Any]]:
        """Findings grouped by (location, kind, op), in order of first occurrence."""
        return group_findings(self.findings)

    def limits(self) -> list[dict[str, str]]:
        """What this audit could not see on this machine and in this run, and what it never
        sees (see :func:`~hostsync.findings.audit_limits`). A run with no device
        tensor at all (no CUDA here) saw no copy or read that could synchronize."""
        return audit_limits(cuda_available=torch.cuda.is_available(),
                            devices_seen=self.devices_seen,
                            profiled=self.profiler_pageable_memcpy is not None)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary: counts, groups (by location/kind/op and by frame), every
        finding, the fix per kind, allowed count, profiler count, and what was not seen
        (``complete`` is False when this machine or run hid a class of sync)."""
        limits = self.limits()
        return {
            "num_findings": sum(f.count for f in self.findings),
            "num_allowed": len(self.allowed),
            "profiler_pageable_memcpy": self.profiler_pageable_memcpy,
            "complete": all(x["scope"] == "always" for x in limits),
            "devices_seen": sorted(self.devices_seen),
            "not_seen": limits,
            "groups": self.groups(),
            "by_frame": group_by_frame(self.findings),
            "fixes": {f.kind: f.fix for f in self.findings},
            "findings": [f.to_dict() for f in self.findings],
        }

    def report(self, *, limits: bool = True) -> str:
        """Human-readable report grouped by the first frame outside torch, with counts, bytes,
        the fix per kind and (``limits``) what the audit could not see."""
        return format_report(self.findings, num_allowed=len(self.allowed),
                             profiler_pageable_memcpy=self.profiler_pageable_memcpy,
                             limits=self.limits() if limits else None)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> HostSyncAudit:
        if self._function_layer is not None:
            raise RuntimeError("this HostSyncAudit is already active; nest a new "
                               "no_host_sync() instead of re-entering the same one")
        caller = sys._getframe(1)
        self._enter_frame = (caller.f_code.co_filename, caller.f_lineno, caller.f_code.co_name)
        if self.profile:
            self._profiler = PageableMemcpyCounter()
        wrap_synchronize(_on_synchronize)
        super().__enter__()
        self._function_layer = self._ops.function_mode()
        self._function_layer.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._function_layer is not None:
                self._function_layer.__exit__(exc_type, exc, tb)
                self._function_layer = None
            super().__exit__(exc_type, exc, tb)
        finally:
            unwrap_synchronize()
            if self._profiler is not None:
                self._stop_profiler()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self._ops.observe(func, args, kwargs)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ recording

    def _where(self) -> Where:
        return self._frames.user_frame() or self._enter_frame

    def _record(self, kind: str, op: str, t: torch.Tensor, devices: str) -> None:
        self._add(finding_at(self._where(), kind, op, t=t, devices=devices))

    def _record_synchronize(self, name: str) -> None:
        self._add(finding_at(self._where(), "synchronize", name))

    def _add(self, finding: Finding) -> None:
        if self._paused:
            return
        if self._allow.allows(finding):
            self.allowed.append(finding)
            return
        self.findings.append(finding)
        if self.strict:
            raise HostSyncError(finding)

    def _stop_profiler(self) -> None:
        counter, self._profiler = self._profiler, None
        assert counter is not None
        count = counter.stop()
        self.profiler_pageable_memcpy = count
        extra = count - self._ops.pageable_h2d_seen
        if extra > 0:
            finding = finding_at(self._enter_frame, "profiler_pageable_memcpy",
                                 "Memcpy HtoD (Pageable -> Device)", count=extra)
            if not self._allow.allows(finding):
                self.findings.append(finding)  # reported, never raised: the block is over


def no_host_sync(
    *,
    strict: bool = False,
    allow: Iterable[str] = (),
    is_pinned: Callable[[torch.Tensor], bool] | None = None,
    is_device: Callable[[torch.device], bool] | None = None,
    profile: bool = False,
    internal: Iterable[str] = (),
) -> HostSyncAudit:
    """Audit a block for host syncs: ``with no_host_sync() as audit: ...``.

    Parameters
    ----------
    strict
        Raise :class:`HostSyncError` at the first finding (before the op runs), naming the
        location and the fix. Otherwise record and continue; read ``audit.findings``.
    allow
        Accepted syncs: a kind name from :data:`KINDS` (e.g. ``"synchronize"``) or a location
        glob ``"path_glob[:line]"`` matched against the absolute, cwd-relative and base file
        name of the user frame (``"*/warmup.py"``, ``"train.py:120"``). Allowed findings go to
        ``audit.allowed``.
    is_pinned
        Pinnedness predicate for host tensors (default ``Tensor.is_pinned()``); storages passed
        to :meth:`HostSyncAudit.treat_as_pinned` count as pinned either way.
    is_device
        Which devices are "the device" (default: any non-CPU device, so ``meta`` stands in for
        CUDA in CPU tests).
    profile
        CUDA only: also run ``torch.profiler`` and set ``audit.profiler_pageable_memcpy`` to the
        number of ``Memcpy HtoD (Pageable -> Device)`` events; any beyond those the dispatcher
        attributed become a ``profiler_pageable_memcpy`` finding.
    internal
        Extra file globs treated like torch internals when locating the user frame.

    Returns
    -------
    HostSyncAudit
        A context manager; reusable, findings accumulate.

    Notes
    -----
    Overhead is a Python call per aten op (about 10 us per op on a CPU core); the audit never
    synchronizes itself (except ``profile=True``, which synchronizes once at exit). Only the
    entering thread is audited (torch keeps the mode stack per thread). Code compiled with
    ``torch.compile`` runs unaudited inside its graphs (a graph cannot sync; graph breaks run
    eagerly and are audited).
    """
    return HostSyncAudit(strict=strict, allow=allow, is_pinned=is_pinned, is_device=is_device,
                         profile=profile, internal=internal)
