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

Mechanism notes. The dispatch mode does not see copies made inside C++ factory functions, so a
small :class:`~torch.overrides.TorchFunctionMode` also watches ``torch.tensor``/``torch.as_tensor``
and names the Python-level call (``Tensor.item``, ``Tensor.tolist`` ...) behind each aten op.
The ``synchronize`` functions are wrapped on enter and restored when the last active audit
exits (reference-counted on the wrapper itself, so this module holds no mutable state).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import linecache
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from mlaprefill.audit.findings import (
    KINDS,
    Finding,
    HostSyncError,
    audit_limits,
    format_report,
    group_by_frame,
    group_findings,
)

__all__ = ["KINDS", "Finding", "HostSyncAudit", "HostSyncError", "no_host_sync"]

_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SYNC_ORIGINAL = "_mlaprefill_audit_original"
_SYNC_USERS = "_mlaprefill_audit_users"


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one contiguous span in some dim order."""
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1))
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_strides(a: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if tuple(a.shape) != tuple(shape):
        return False
    return all(
        sz == 1 or sa == sb for sz, sa, sb in zip(shape, a.stride(), stride, strict=True)
    )


def _h2d_stages_through_pageable(
    src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> bool:
    """Would a non_blocking copy of pinned ``src`` into this destination use a pageable temp?

    Mirrors ``copy_kernel_cuda``: a same-dtype copy between identically strided dense tensors
    is one memcpy; otherwise it needs temporaries, and for a non_blocking H2D copy the source
    temporary is ``src.expand_as(dst).contiguous()`` -- a fresh pageable tensor unless ``src``
    already is contiguous in that shape.
    """
    if src.dtype == dtype and _is_dense(src) and _same_strides(src, shape, stride):
        return False
    try:
        return not src.expand(shape).is_contiguous()
    except RuntimeError:  # not broadcastable: the copy itself will raise
        return False


def _is_pageable_memcpy(name: str) -> bool:
    """``Memcpy HtoD (Pageable -> Device)``, as named by CUPTI/kineto."""
    return "HtoD" in name and "Pageable" in name


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _default_is_device(device: torch.device) -> bool:
    return device.type != "cpu"


def _active_audits() -> list[HostSyncAudit]:
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, HostSyncAudit)]


def _sync_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, display name) of the Python synchronize functions to wrap."""
    targets: list[tuple[Any, str, str]] = [
        (torch.cuda, "synchronize", "torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),
        (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
    ]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        targets.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return targets


def _make_sync_wrapper(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def synchronize_audited(*args: Any, **kwargs: Any) -> Any:
        for audit in _active_audits():
            audit._record_synchronize(name)
        return original(*args, **kwargs)

    setattr(synchronize_audited, _SYNC_ORIGINAL, original)
    setattr(synchronize_audited, _SYNC_USERS, 0)
    return synchronize_audited


class _FunctionLayer(TorchFunctionMode):
    """Python-level companion of the dispatch mode (names ops; sees ``torch.tensor`` copies)."""

    def __init__(self, audit: HostSyncAudit) -> None:
        super().__init__()
        self._audit = audit
        base = torch._C.TensorBase
        self._named: dict[Any, str] = {
            getattr(base, n): f"Tensor.{n}"
            for n in ("item", "tolist", "cpu", "numpy", "to", "cuda", "copy_", "nonzero",
                      "unique", "masked_select", "repeat_interleave", "__getitem__",
                      "__setitem__", "__bool__", "__int__", "__float__", "__index__")
            if hasattr(base, n)
        }
        self._factories = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = self._named.get(func)
        if name is not None:
            stack = self._audit._api_stack
            stack.append(name)
            try:
                return func(*args, **kwargs)
            finally:
                stack.pop()
        factory = self._factories.get(func)
        if factory is None:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        data = args[0] if args else kwargs.get("data")
        if (
            isinstance(out, torch.Tensor)
            and not isinstance(data, torch.Tensor)
            and self._audit._is_device(out.device)
            and out.numel() > 0
        ):
            self._audit._pageable_h2d_seen += 1  # built in a fresh pageable host tensor
            self._audit._record("sync_h2d", factory, out, f"cpu->{out.device}")
        return out


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
        if isinstance(allow, str):
            raise TypeError(f"allow must be a list of patterns, got the string {allow!r}; "
                            f"wrap it: allow=[{allow!r}]")
        self.strict = bool(strict)
        self.profile = bool(profile)
        self._allow_kinds: set[str] = set()
        self._allow_locs: list[tuple[str, int | None]] = []
        for pattern in allow:
            if pattern in KINDS:
                self._allow_kinds.add(pattern)
                continue
            path, _, line = pattern.rpartition(":")
            if path and line.isdigit():
                self._allow_locs.append((path, int(line)))
            else:
                self._allow_locs.append((pattern, None))
        self._is_pinned_fn = is_pinned
        self._device_predicate = is_device or _default_is_device
        self.devices_seen: set[str] = set()
        self._internal = tuple(internal)
        self._internal_cache: dict[str, bool] = {}
        self._pinned_storages: set[int] = set()
        self._api_stack: list[str] = []
        self._paused = 0
        self.findings: list[Finding] = []
        self.allowed: list[Finding] = []
        self.profiler_pageable_memcpy: int | None = None
        self._pageable_h2d_seen = 0
        self._function_layer: _FunctionLayer | None = None
        self._profiler: Any = None
        self._enter_frame: tuple[str, int, str] = ("<unknown>", 0, "<unknown>")
        aten = torch.ops.aten
        handlers: dict[Any, Callable[..., None]] = {
            aten._to_copy.default: self._on_to_copy,
            aten.copy_.default: self._on_copy,
            aten._local_scalar_dense.default: self._on_item,
            aten.index.Tensor: self._on_index,
            # Under torch.inference_mode() composite ops reach the mode undecomposed: the copy
            # shows up as aten.to.* and .item() as aten.item, not as _to_copy /
            # _local_scalar_dense (inference engines run there, so both spellings count).
            aten.item.default: self._on_item,
        }
        for overload in self._overloads("to"):
            handlers[overload] = self._on_to
        for packet in ("index_put_", "index_put", "_index_put_impl_"):
            for overload in self._overloads(packet):
                handlers[overload] = self._on_index_put
        for packet in ("nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique",
                       "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                       "bincount"):
            for overload in self._overloads(packet):
                handlers[overload] = self._on_data_dependent
        for packet in ("equal", "allclose"):  # return a host bool computed on the device
            for overload in self._overloads(packet):
                handlers[overload] = self._on_item
        for overload in self._overloads("histc"):
            handlers[overload] = self._on_histc
        for overload in self._overloads("repeat_interleave"):
            if overload.__name__.split(".")[-1] != "self_int":
                handlers[overload] = self._on_repeat_interleave
        self._handlers = handlers

    # ------------------------------------------------------------------ public API

    def treat_as_pinned(self, *tensors: torch.Tensor) -> None:
        """Treat the storages of ``tensors`` (and every view of them) as pinned.

        For CPU-only tests, where ``pin_memory()`` is unavailable; on CUDA real pinned memory
        is recognized by ``Tensor.is_pinned()`` without registration.
        """
        for t in tensors:
            self._pinned_storages.add(t.untyped_storage().data_ptr())

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
        sees (see :func:`~mlaprefill.audit.findings.audit_limits`). A run with no device
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
            self._start_profiler()
        for owner, attr, name in _sync_targets():
            current = getattr(owner, attr)
            if not hasattr(current, _SYNC_ORIGINAL):
                current = _make_sync_wrapper(current, name)
                setattr(owner, attr, current)
            setattr(current, _SYNC_USERS, getattr(current, _SYNC_USERS) + 1)
        super().__enter__()
        self._function_layer = _FunctionLayer(self)
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
            for owner, attr, _ in _sync_targets():
                current = getattr(owner, attr)
                users = getattr(current, _SYNC_USERS, None)
                if users is None:
                    continue
                setattr(current, _SYNC_USERS, users - 1)
                if users <= 1:
                    setattr(owner, attr, getattr(current, _SYNC_ORIGINAL))
            if self._profiler is not None:
                self._stop_profiler()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            handler(func, args, kwargs)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ op handlers

    def _is_device(self, device: torch.device) -> bool:
        on_device = bool(self._device_predicate(device))
        if on_device:
            self.devices_seen.add(str(device))
        return on_device

    def _pinned(self, t: torch.Tensor) -> bool:
        if self._pinned_storages and t.untyped_storage().data_ptr() in self._pinned_storages:
            return True
        if self._is_pinned_fn is not None:
            return bool(self._is_pinned_fn(t))
        try:
            return bool(t.is_pinned())
        except RuntimeError:
            return False

    def _h2d(self, func: Any, src: torch.Tensor, non_blocking: bool,
             shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
             devices: str) -> None:
        if src.numel() == 0:
            return
        pinned = self._pinned(src)
        if not pinned:
            self._pageable_h2d_seen += 1
        if not non_blocking:
            self._record("sync_h2d", func, src, devices)
        elif not pinned:
            self._record("pageable_h2d", func, src, devices)
        elif _h2d_stages_through_pageable(src, shape, stride, dtype):
            self._pageable_h2d_seen += 1
            self._record("strided_pinned_h2d", func, src, devices)

    def _on_to_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        src = args[0]
        dst_device = kwargs.get("device")
        if dst_device is None:
            return
        dst_device = torch.device(dst_device)
        src_on_device = self._is_device(src.device)
        dst_on_device = self._is_device(dst_device)
        devices = f"{src.device}->{dst_device}"
        non_blocking = bool(kwargs.get("non_blocking", False))
        if not src_on_device and dst_on_device:
            fmt = kwargs.get("memory_format")
            if fmt in (None, torch.preserve_format) and _is_dense(src):
                stride = tuple(src.stride())
            else:
                fmt = torch.contiguous_format if fmt in (None, torch.preserve_format) else fmt
                stride = tuple(torch.empty(tuple(src.shape), device="meta",
                                           memory_format=fmt).stride())
            dtype = kwargs.get("dtype") or src.dtype
            self._h2d(func, src, non_blocking, tuple(src.shape), stride, dtype, devices)
        elif src_on_device and not dst_on_device and src.numel() > 0 and not non_blocking:
            # non_blocking D2H through _to_copy allocates a pinned output: truly async.
            self._record("d2h", func, src, devices)

    def _on_to(self, func: Any, args: tuple, kwargs: dict) -> None:
        """aten.to.* (seen instead of _to_copy under inference mode): bind, then as _to_copy."""
        bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(func._schema.arguments)}
        other = bound.get("other")
        device = other.device if isinstance(other, torch.Tensor) else bound.get("device")
        dtype = other.dtype if isinstance(other, torch.Tensor) else bound.get("dtype")
        if device is None or torch.device(device) == args[0].device:
            return  # no device change: no copy, or a same-device dtype cast
        self._on_to_copy(func, (args[0],), {
            "device": device, "dtype": dtype if isinstance(dtype, torch.dtype) else None,
            "non_blocking": bool(bound.get("non_blocking") or False),
            "memory_format": bound.get("memory_format")})

    def _on_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        dst, src = args[0], args[1]
        if not isinstance(src, torch.Tensor):
            return
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        src_on_device = self._is_device(src.device)
        dst_on_device = self._is_device(dst.device)
        devices = f"{src.device}->{dst.device}"
        if not src_on_device and dst_on_device:
            self._h2d(func, src, non_blocking, tuple(dst.shape), tuple(dst.stride()),
                      dst.dtype, devices)
        elif (src_on_device and not dst_on_device and dst.numel() > 0
              and not (non_blocking and dst.is_contiguous() and self._pinned(dst))):
            self._record("d2h", func, src, devices)

    def _on_item(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._is_device(args[0].device):
            self._record("item", func, args[0], str(args[0].device))

    def _on_data_dependent(self, func: Any, args: tuple, kwargs: dict) -> None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if t is not None and self._is_device(t.device):
            self._record("data_dependent_shape", func, t, str(t.device))

    def _on_histc(self, func: Any, args: tuple, kwargs: dict) -> None:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if lo == hi:  # the range is then read back from the device (min/max)
            self._on_data_dependent(func, args, kwargs)

    def _on_repeat_interleave(self, func: Any, args: tuple, kwargs: dict) -> None:
        if kwargs.get("output_size") is None:
            self._on_data_dependent(func, args, kwargs)

    def _on_index(self, func: Any, args: tuple, kwargs: dict) -> None:
        self_, indices = args[0], args[1]
        if self._is_device(self_.device) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            self._record("data_dependent_shape", func, self_, str(self_.device))

    def _on_index_put(self, func: Any, args: tuple, kwargs: dict) -> None:
        self_, indices, value = args[0], args[1], args[2]
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        defined = [i for i in indices if i is not None]
        if (not accumulate and value.numel() == 1 and value.device.type == "cpu"
                and len(defined) == 1 and defined[0].dtype in (torch.bool, torch.uint8)
                and defined[0].device == self_.device):
            return  # torch dispatches this to masked_fill_ with a host scalar: no sync
        self._on_index(func, args, kwargs)

    # ------------------------------------------------------------------ recording

    @staticmethod
    def _overloads(packet_name: str) -> Iterator[Any]:
        packet = getattr(torch.ops.aten, packet_name, None)
        if packet is None:
            return
        for name in packet.overloads():
            yield getattr(packet, name)

    def _internal_file(self, filename: str) -> bool:
        cached = self._internal_cache.get(filename)
        if cached is None:
            cached = (
                filename.startswith((_TORCH_DIR, _AUDIT_DIR, "<frozen "))
                or any(fnmatch.fnmatch(filename, p) for p in self._internal)
            )
            self._internal_cache[filename] = cached
        return cached

    def _user_frame(self) -> FrameType | None:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and self._internal_file(frame.f_code.co_filename):
            frame = frame.f_back
        return frame

    def _is_allowed(self, finding: Finding) -> bool:
        if finding.kind in self._allow_kinds:
            return True
        if not self._allow_locs:
            return False
        names = [finding.filename, os.path.basename(finding.filename)]
        with contextlib.suppress(ValueError):  # relpath across drives
            names.append(os.path.relpath(finding.filename))
        return any(
            (line is None or line == finding.lineno)
            and any(fnmatch.fnmatch(n, glob) for n in names)
            for glob, line in self._allow_locs
        )

    def _record(self, kind: str, func: Any, t: torch.Tensor, devices: str) -> None:
        frame = self._user_frame()
        if frame is None:
            filename, lineno, function = self._enter_frame
        else:
            filename, lineno, function = (frame.f_code.co_filename, frame.f_lineno,
                                          frame.f_code.co_name)
        op = func if isinstance(func, str) else f"aten.{func.__name__}"
        if self._api_stack and not isinstance(func, str):
            op = f"{self._api_stack[-1]} ({op})"
        finding = Finding(
            kind=kind, op=op, nbytes=_nbytes(t), shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."), filename=filename, lineno=lineno,
            function=function, code=linecache.getline(filename, lineno).strip(),
            devices=devices,
        )
        self._add(finding)

    def _record_synchronize(self, name: str) -> None:
        frame = self._user_frame()
        filename, lineno, function = (
            (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
            if frame is not None else self._enter_frame
        )
        self._add(Finding(kind="synchronize", op=name, nbytes=0, shape=(), dtype="",
                          filename=filename, lineno=lineno, function=function,
                          code=linecache.getline(filename, lineno).strip()))

    def _add(self, finding: Finding) -> None:
        if self._paused:
            return
        if self._is_allowed(finding):
            self.allowed.append(finding)
            return
        self.findings.append(finding)
        if self.strict:
            raise HostSyncError(finding)

    # ------------------------------------------------------------------ profiler

    def _start_profiler(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("no_host_sync(profile=True) needs CUDA (torch.cuda.is_available() "
                             "is False); use profile=False on this machine")
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profiler.__enter__()

    def _stop_profiler(self) -> None:
        prof, self._profiler = self._profiler, None
        # the unwrapped function: an enclosing audit must not record the profiler's own sync
        getattr(torch.cuda.synchronize, _SYNC_ORIGINAL, torch.cuda.synchronize)()
        prof.__exit__(None, None, None)
        count = sum(1 for e in prof.events() if _is_pageable_memcpy(e.name))
        self.profiler_pageable_memcpy = count
        extra = count - self._pageable_h2d_seen
        if extra > 0:
            filename, lineno, function = self._enter_frame
            finding = Finding(kind="profiler_pageable_memcpy",
                              op="Memcpy HtoD (Pageable -> Device)", nbytes=0, shape=(),
                              dtype="", filename=filename, lineno=lineno, function=function,
                              code=linecache.getline(filename, lineno).strip(), count=extra)
            if not self._is_allowed(finding):
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
