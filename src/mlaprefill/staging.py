"""Staging: the one host-to-device crossing of a prefill step.

``StagingRing.upload(plan)`` packs every int32 array of ``plan.device_arrays()`` into one region of
a pinned host arena (one layout function sizes and writes it, 64-byte aligned offsets), issues
**one** ``copy_(non_blocking=True)`` into a device arena on the current stream, and returns a
:class:`DevicePlan` whose tensors are views of that device arena.

Why a ring: a non_blocking copy from *pageable* memory may block the host until every queued kernel
has finished; pinning fixes that, but reusing one pinned buffer races with the previous step's
still-pending DMA. So ring mode keeps several (host arena, device arena, event) slots and reuses a
slot only when the CUDA event recorded after its last copy has completed (``event.query()``, never
a wait). If every reusable slot is busy it adds a slot (``stats.arenas_grown``).

Synchronization
    ``upload`` never synchronizes, with one documented exception: in ring mode, when every reusable
    slot is busy *and* adding pinned memory would exceed ``max_pinned_bytes``, it waits on the
    event of the **oldest** slot only (``event.synchronize()``), counted in ``stats.stalls``. It
    never overwrites a busy arena. Modes ``pin``/``pageable`` exist for comparison (they allocate
    per upload; ``pageable`` is the pre-fix behaviour that can block the host for the whole queue).

Validity
    A ring-mode DevicePlan's device memory is not overwritten by the next ``valid_uploads``
    uploads of the same ring (the ``valid_uploads`` most recently used slots are never reused).
    Work reading it must be enqueued on the upload stream before then; after that, stream order
    protects it. DevicePlans of modes ``pin``/``pageable`` own their memory.

CUDA graphs
    ``upload`` itself is not capturable (host writes + an H2D copy). The DevicePlan views have a
    fixed device address per (slot, layout), and views are cached per slot, so a graph captured
    over a DevicePlan can be replayed after uploading a plan with the same array shapes into the
    same slot.

Without CUDA (device ``cpu``) every mode is a plain CPU copy: DevicePlan tensors never alias the
plan's numpy arrays.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import torch

from mlaprefill.plan import ChunkPlan, StagedPlan, check_token_table_size

__all__ = ["ALIGN_BYTES", "MAX_VALID_UPLOADS", "MODES", "DevicePlan", "HostEvent", "StagingRing",
           "StagingStats", "layout", "rows_to_requests"]

ALIGN_BYTES = 64
#: Most later uploads a ring-mode DevicePlan can be asked to survive: the ring makes one slot and
#: one event per upload it must keep, at construction (10**9 took 90 s, then a MemoryError).
MAX_VALID_UPLOADS = 1024
_ALIGN = ALIGN_BYTES // 4  # in int32 elements
_MIN_ARENA_BYTES = 64 * 1024
MODES = ("ring", "pin", "pageable")


class EventLike(Protocol):
    """What ring mode needs from a CUDA event (injectable for tests)."""

    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class HostEvent:
    """CPU stand-in for a CUDA event: work on the CPU is synchronous, so an event is complete
    when recorded and its record time is the completion time (``elapsed_time`` in ms, like
    ``torch.cuda.Event``). The ring's event without CUDA, and the bench engine's timer."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = float("nan")

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


def layout(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[tuple[str, int, tuple[int, ...]], ...],
                                                       int]:
    """The one arena layout, used both to size and to write.

    Parameters
    ----------
    arrays : mapping name -> int32 np.ndarray
        In order (``plan.device_arrays()``).

    Returns
    -------
    entries : tuple of (name, offset, shape)
        ``offset`` in int32 elements, a multiple of ``ALIGN_BYTES / 4`` (64-byte aligned).
    total : int
        int32 elements needed (end of the last array).
    """
    entries = []
    off = 0
    for name, arr in arrays.items():
        if arr.dtype != np.int32:
            raise TypeError(
                f"device array {name!r} has dtype {arr.dtype}; staging ships int32 only. "
                f"Return it as np.int32 from device_arrays()."
            )
        off = -(-off // _ALIGN) * _ALIGN
        entries.append((name, off, arr.shape))
        off += arr.size
    return tuple(entries), off


def parse_device(device: Any, what: str) -> torch.device:
    """``torch.device(device)``, or a ValueError that starts with ``what`` for a value torch
    cannot parse (torch raises RuntimeError or TypeError)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {device!r} ({type(device).__name__}) is not a device torch "
                         f"knows here; pass 'cuda', 'cuda:N' or 'cpu'.") from None


@dataclass
class StagingStats:
    """Counters of one StagingRing (read by benchmarks).

    ``host_times`` keeps the host seconds of the last ``max_records`` uploads.
    """

    uploads: int = 0
    bytes: int = 0
    arenas_grown: int = 0
    arenas_resized: int = 0
    stalls: int = 0
    host_seconds: float = 0.0
    pinned_bytes: int = 0
    max_records: int = 4096
    host_times: deque = field(default_factory=deque, repr=False)

    def record(self, seconds: float, nbytes: int) -> None:
        self.uploads += 1
        self.bytes += nbytes
        self.host_seconds += seconds
        self.host_times.append(seconds)
        if len(self.host_times) > self.max_records:
            self.host_times.popleft()

    def percentile(self, q: float) -> float:
        """``q``-th percentile (0-100) of recorded per-upload host seconds (nan if none)."""
        if not self.host_times:
            return float("nan")
        return float(np.percentile(np.fromiter(self.host_times, float), q))

    def p50(self) -> float:
        return self.percentile(50)

    def p99(self) -> float:
        return self.percentile(99)

    def reset(self) -> None:
        """Zero the per-upload counters (arena counters and pinned_bytes are kept)."""
        self.uploads = 0
        self.bytes = 0
        self.host_seconds = 0.0
        self.host_times.clear()


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """A host plan plus its device int32 tensors.

    Attributes
    ----------
    plan : :class:`~mlaprefill.plan.StagedPlan`
        The uploaded host plan (a ``ChunkPlan`` or a plan built around one).
    tensors : Mapping[str, torch.Tensor]
        Device int32 tensors, same names and shapes as ``plan.device_arrays()``. In ring mode they
        are views of one device arena (see the module docstring for how long they stay valid).
        Read-only in an upload's DevicePlan.

    A hand-built ``DevicePlan(plan, tensors)`` is checked against its plan (each tensor's
    shape, dtype, layout and device, host metadata only) on every forward; an upload's
    (:attr:`staged`) matches by construction and skips that check (~20 us per forward).
    """

    plan: StagedPlan
    tensors: Mapping[str, torch.Tensor]
    # (plan, tensors) as the upload made them; a copy with either replaced is checked again
    _staged_of: tuple[Any, Any] | None = field(default=None, repr=False, compare=False)

    @property
    def staged(self) -> bool:
        """Whether :meth:`StagingRing.upload` made it as it is (its tensors match its plan)."""
        of = self._staged_of
        return of is not None and of[0] is self.plan and of[1] is self.tensors

    @property
    def chunk_plan(self) -> ChunkPlan:
        """The host :class:`~mlaprefill.plan.ChunkPlan`: every host int the forward reads."""
        return self.plan.chunk_plan

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def cu_query_lens(self) -> torch.Tensor:
        """int32 [num_reqs + 1]."""
        return self.tensors["cu_query_lens"]

    @property
    def chunk_starts(self) -> torch.Tensor:
        """int32 [num_iterations, num_reqs]."""
        return self.tensors["chunk_starts"]

    @property
    def chunk_lens(self) -> torch.Tensor:
        """int32 [num_iterations, num_reqs]."""
        return self.tensors["chunk_lens"]

    @property
    def cu_seq_lens(self) -> torch.Tensor:
        """int32 [num_iterations, num_reqs + 1]."""
        return self.tensors["cu_seq_lens"]

    @property
    def token_to_seq(self) -> torch.Tensor:
        """int32 [num_iterations, max_iteration_tokens]: vLLM's row -> request table.

        The shipped table when the plan was uploaded with it (``token_tables=True``), else built
        now on the device from ``cu_seq_lens`` (device work only, no sync; 4 bytes per row).
        """
        shipped = self.tensors.get("token_to_seq")
        if shipped is not None:
            return shipped
        plan = self.chunk_plan
        check_token_table_size(plan.num_iterations, plan.max_iteration_tokens)
        return rows_to_requests(self.cu_seq_lens,
                                self.chunk_plan.max_iteration_tokens).to(torch.int32)


class _Slot:
    """One (host arena, device arena, event) of the ring."""

    __slots__ = ("busy", "capacity", "copy_pair", "dev", "event", "host", "host_np", "views",
                 "zero_span")

    def __init__(self, event: EventLike) -> None:
        self.event = event
        self.capacity = 0  # int32 elements
        self.host: torch.Tensor | None = None
        self.host_np: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.copy_pair: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self.views: tuple[Any, Mapping[str, torch.Tensor]] | None = None
        self.busy = False  # set after a copy; the event is meaningful only then
        # [start, end) of host arena elements known to hold zeros (written by an earlier upload
        # from an all-zero broadcast array, e.g. a one-request token_to_seq); None if unknown.
        self.zero_span: tuple[int, int] | None = None


class StagingRing:
    """Uploads plans to one device with one H2D copy each (see the module docstring).

    Parameters
    ----------
    device : str | torch.device | int
        Target device (``"cuda"``, ``"cuda:1"``, ``"cpu"``).
    mode : {"ring", "pin", "pageable"}
        ``ring`` (default): persistent pinned arenas guarded by events. ``pin``: each array pinned
        fresh and copied separately per upload. ``pageable``: each array copied from pageable
        memory (the pre-fix behaviour; can block the host until queued kernels finish).
    max_pinned_bytes : int
        Cap on ring-mode pinned host memory (default 256 MiB). At the cap with every reusable slot
        busy, upload waits on the oldest slot's event (counted in ``stats.stalls``).
    valid_uploads : int
        How many later uploads a ring-mode DevicePlan survives (default 3).
    event_factory : callable returning an event, optional
        For tests; defaults to ``torch.cuda.Event`` on CUDA and an always-complete event on CPU.

    Notes
    -----
    Growing or resizing allocates pinned host memory (``cudaHostAlloc`` through torch's caching
    host allocator: slow, tens of microseconds or more), so warm the ring up with a few uploads
    of the largest expected plan; steady state allocates nothing (arenas grow in powers of two).
    ``max_pinned_bytes`` counts the ring's live arenas: an arena dropped for a larger one goes
    back to torch's caching host allocator, which keeps it pinned for reuse, so the process can
    hold more pinned memory than the cap while a ring is growing. Not thread-safe; use one ring
    per stream/thread. Can synchronize only as documented for the pinned cap. Not CUDA-graph
    capturable itself.
    """

    def __init__(self, device: str | torch.device | int, *, mode: str = "ring",
                 max_pinned_bytes: int = 256 * 1024 * 1024, valid_uploads: int = 3,
                 event_factory: Callable[[], EventLike] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"StagingRing.mode must be one of {list(MODES)}, got {mode!r}.")
        if (isinstance(max_pinned_bytes, bool) or not isinstance(max_pinned_bytes, int)
                or max_pinned_bytes < ALIGN_BYTES):
            raise ValueError(
                f"StagingRing.max_pinned_bytes must be an int >= {ALIGN_BYTES}, "
                f"got {max_pinned_bytes!r}."
            )
        if isinstance(valid_uploads, bool) or not isinstance(valid_uploads, int) \
                or not 0 <= valid_uploads <= MAX_VALID_UPLOADS:
            raise ValueError(
                f"StagingRing.valid_uploads must be an int in [0, {MAX_VALID_UPLOADS}] (one "
                f"slot and event each, made now), got {valid_uploads!r}; a DevicePlan needed "
                f"after more later uploads than that should be uploaded again."
            )
        dev = parse_device(device, "StagingRing device")
        if dev.type not in ("cpu", "cuda"):
            # Checked here: other devices (meta, ...) would only fail at the first upload.
            raise ValueError(f"StagingRing device {dev} is not supported; staging ships plans "
                             f"to 'cuda' or 'cuda:N' ('cpu' on a machine without a GPU).")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"StagingRing device {dev} requested but CUDA is not available; "
                    f"use device='cpu'."
                )
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.mode = mode
        self.max_pinned_bytes = max_pinned_bytes
        self.valid_uploads = valid_uploads
        self._cuda = dev.type == "cuda"
        if event_factory is None:
            event_factory = torch.cuda.Event if self._cuda else HostEvent
        self._event_factory = event_factory
        # LRU order: index 0 = least recently used.
        self._slots: list[_Slot] = [_Slot(event_factory()) for _ in range(valid_uploads + 1)]
        self.stats = StagingStats()

    def __repr__(self) -> str:
        return (f"StagingRing(device={str(self.device)!r}, mode={self.mode!r}, "
                f"slots={len(self._slots)}, max_pinned_bytes={self.max_pinned_bytes})")

    @property
    def num_slots(self) -> int:
        """Current number of ring slots."""
        return len(self._slots)

    # ------------------------------------------------------------------ upload

    def upload(self, plan: StagedPlan, *, token_tables: bool = False) -> DevicePlan:
        """Stage ``plan.device_arrays()`` on the device; returns a :class:`DevicePlan`.

        With ``token_tables=True`` the plan's per-token tables ship too
        (``plan.device_arrays(token_tables=True)``: vLLM's ``token_to_seq``, 4 bytes per context
        token); the forward never needs them, benchmarks use them as the vLLM-shaped baseline.

        Issued on ``torch.cuda.current_stream(device)``. Never synchronizes except the ring-mode
        pinned-cap stall documented on the class. Not CUDA-graph capturable.

        Raises
        ------
        ValueError
            Ring mode: the plan alone needs more than ``max_pinned_bytes``.
        TypeError
            ``plan`` is not a plan (no ``device_arrays`` and ``chunk_plan``), ``token_tables``
            not a bool, or an array of ``device_arrays()`` is not int32.
        """
        if not (callable(getattr(plan, "device_arrays", None))
                and hasattr(plan, "chunk_plan")):
            raise TypeError(f"plan must be a ChunkPlan (or another StagedPlan: device_arrays() "
                            f"and chunk_plan), got {type(plan).__name__}; pass "
                            f"ChunkPlanner(...).plan(batch)")
        if not isinstance(token_tables, bool):
            raise TypeError(f"token_tables must be a bool, got {type(token_tables).__name__}")
        t0 = time.perf_counter()
        arrays = plan.device_arrays(token_tables=token_tables)
        if self.mode == "ring":
            tensors, nbytes = self._upload_ring(arrays)
        else:
            tensors, nbytes = self._upload_each(arrays)
        view = MappingProxyType(tensors)
        out = DevicePlan(plan, view, _staged_of=(plan, view))
        self.stats.record(time.perf_counter() - t0, nbytes)
        return out

    def _upload_each(self, arrays: Mapping[str, np.ndarray]) -> tuple[dict, int]:
        tensors = {}
        nbytes = 0
        with warnings.catch_warnings():
            # The plan's arrays are read-only; torch warns about that, but never writes to them.
            warnings.simplefilter("ignore", UserWarning)
            for name, arr in arrays.items():
                if arr.dtype != np.int32:
                    raise TypeError(
                        f"device array {name!r} has dtype {arr.dtype}; staging ships int32 only."
                    )
                # Engines ship contiguous arrays; materialize views (e.g. broadcast) like they do.
                host = torch.from_numpy(np.ascontiguousarray(arr))
                nbytes += arr.nbytes
                if not self._cuda:
                    # never alias the plan's arrays; numpy copy avoids torch's CPU thread pool
                    tensors[name] = torch.from_numpy(arr.copy())
                    continue
                # These two baselines reproduce on purpose what `mlaprefill lint` flags: a fresh
                # pinned allocation per array per step (HS102, mode "pin") and a non_blocking copy
                # from pageable memory (HS101, mode "pageable", the pre-fix behaviour).
                if self.mode == "pin":
                    host = host.pin_memory()  # noqa: HS102
                tensors[name] = host.to(self.device, non_blocking=True)  # noqa: HS101
        return tensors, nbytes

    def _upload_ring(self, arrays: Mapping[str, np.ndarray]) -> tuple[dict, int]:
        entries, total = layout(arrays)
        nbytes = total * 4
        if nbytes > self.max_pinned_bytes:
            raise ValueError(
                f"plan needs {nbytes} staged bytes, more than max_pinned_bytes="
                f"{self.max_pinned_bytes}; raise StagingRing(max_pinned_bytes=...) or plan a "
                f"smaller step (fewer iterations / smaller workspace_tokens)."
            )
        slot = self._acquire(total)
        self._ensure_capacity(slot, total)
        host_np = slot.host_np
        known_zero = slot.zero_span
        new_zero = None
        for (_name, off, shape), arr in zip(entries, arrays.values(), strict=True):
            n = arr.size
            if arr.flags.c_contiguous:
                host_np[off:off + n] = arr.reshape(-1)
            elif n and not any(arr.strides) and arr.flat[0] == 0:
                # An all-zero broadcast (one-request token_to_seq: up to MiBs of zeros): skip
                # the fill when this slot's arena already holds zeros there.
                if known_zero is None or not (known_zero[0] <= off and off + n <= known_zero[1]):
                    host_np[off:off + n] = 0
                new_zero = (off, off + n)
                continue
            else:  # another view: fill through a shaped view, no temporary copy
                host_np[off:off + n].reshape(shape)[...] = arr
            if known_zero is not None and off < known_zero[1] and known_zero[0] < off + n:
                known_zero = None  # overwritten (regions of one upload never overlap each other)
        slot.zero_span = new_zero
        if self._cuda:
            pair = slot.copy_pair
            if pair is None or pair[0] != total:
                pair = (total, slot.dev[:total], slot.host[:total])
                slot.copy_pair = pair
            # copy_ runs on the current stream of the destination device; record the event on
            # that same stream (the current *device* may be another GPU).
            pair[1].copy_(pair[2], non_blocking=True)
            slot.event.record(torch.cuda.current_stream(self.device))
        else:
            # CPU "device": a plain copy through numpy (torch's CPU copy_ may spin up threads).
            slot.dev.numpy()[:total] = host_np[:total]
            slot.event.record()
        slot.busy = True
        cached = slot.views
        if cached is None or cached[0] != entries:
            dev = slot.dev
            views = MappingProxyType({
                name: dev[off:off + int(np.prod(shape, dtype=np.int64))].view(shape)
                for name, off, shape in entries})
            slot.views = cached = (entries, views)
        return cached[1], nbytes

    # ------------------------------------------------------------------ ring bookkeeping

    def _acquire(self, total: int) -> _Slot:
        """Least recently used free slot outside the protected recent ones; grow or stall."""
        slots = self._slots
        reusable = len(slots) - self.valid_uploads
        for i in range(reusable):
            s = slots[i]
            if not s.busy or s.event.query():
                s.busy = False
                del slots[i]
                slots.append(s)
                return s
        need = self._alloc_bytes(total)
        if self.stats.pinned_bytes + need <= self.max_pinned_bytes:
            s = _Slot(self._event_factory())
            self.stats.arenas_grown += 1
            slots.append(s)
            return s
        # At the cap with every reusable slot busy: wait for the oldest one only.
        s = slots.pop(0)
        s.event.synchronize()
        self.stats.stalls += 1
        s.busy = False
        slots.append(s)
        return s

    def _alloc_bytes(self, total: int) -> int:
        nbytes = max(_MIN_ARENA_BYTES, 1 << max(0, (total * 4 - 1).bit_length()))
        return max(min(nbytes, self.max_pinned_bytes), total * 4)

    def _ensure_capacity(self, slot: _Slot, total: int) -> None:
        if slot.capacity >= total:
            return
        need = self._alloc_bytes(total)
        resized = slot.capacity > 0
        self._release(slot)
        self._make_room(need, keep=slot)
        elems = need // 4
        pin = self._cuda
        slot.host = torch.empty(elems, dtype=torch.int32, pin_memory=pin)
        slot.host_np = slot.host.numpy()
        slot.dev = torch.empty(elems, dtype=torch.int32, device=self.device)
        slot.capacity = elems
        self.stats.pinned_bytes += elems * 4
        if resized:
            self.stats.arenas_resized += 1

    def _release(self, slot: _Slot) -> None:
        """Drop a slot's arenas (only for a slot whose last copy has completed)."""
        self.stats.pinned_bytes -= slot.capacity * 4
        slot.capacity = 0
        slot.host = slot.host_np = slot.dev = None
        slot.copy_pair = slot.views = slot.zero_span = None

    def _make_room(self, need: int, *, keep: _Slot) -> None:
        """Free other slots' arenas (idle first, then oldest busy after a counted wait)."""
        if self.stats.pinned_bytes + need <= self.max_pinned_bytes:
            return
        for s in self._slots:
            if s is not keep and s.capacity and (not s.busy or s.event.query()):
                s.busy = False
                self._release(s)
                if self.stats.pinned_bytes + need <= self.max_pinned_bytes:
                    return
        for s in self._slots:  # LRU order: oldest first
            if s is not keep and s.capacity:
                s.event.synchronize()
                self.stats.stalls += 1
                s.busy = False
                self._release(s)
                if self.stats.pinned_bytes + need <= self.max_pinned_bytes:
                    return
        raise AssertionError("unreachable: a single plan fits max_pinned_bytes")


def rows_to_requests(cu_seq_lens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 [..., num_rows]: request of each workspace row, from ``cu_seq_lens [..., R + 1]``.

    vLLM's ``token_to_seq`` (one iteration's row for 1-D input, the whole table for the plan's
    2-D ``[num_iterations, num_reqs + 1]``), built on ``cu_seq_lens``' device with one
    ``searchsorted``; rows at or past an iteration's total are padding, 0 as in vLLM.
    ``num_rows`` is a host int: never synchronizes.
    """
    cu = cu_seq_lens.long()
    j = torch.arange(num_rows, device=cu.device, dtype=torch.int64)
    j = j.expand(*cu.shape[:-1], num_rows).contiguous()
    # number of piece ends <= j = index of the piece holding row j
    req = torch.searchsorted(cu[..., 1:].contiguous(), j, right=True)
    return req.masked_fill_(j >= cu[..., -1:], 0)
