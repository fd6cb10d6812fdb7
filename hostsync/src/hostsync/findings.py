"""Findings of the runtime audit: kinds, the :class:`Finding` record, grouping, what the audit
cannot see (:func:`audit_limits`) and reports.

Pure Python (no torch import), shared by :mod:`hostsync.runtime` and the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = ["KINDS", "Finding", "HostSyncError", "audit_limits", "format_report", "group_by_frame",
           "group_findings"]

# kind -> (what happened, how to fix it). Keys are the public vocabulary of findings.
KINDS: dict[str, tuple[str, str]] = {
    "pageable_h2d": (
        "non_blocking host->device copy from pageable (unpinned) memory; the host can block "
        "until all queued GPU work is done (size/platform dependent)",
        "allocate the source with pin_memory=True or copy from a pinned staging buffer",
    ),
    "strided_pinned_h2d": (
        "non_blocking host->device copy from pinned memory that is not densely laid out like "
        "the destination; torch stages it through a pageable temporary, which stalls",
        "copy from a contiguous pinned tensor (pack the data into the pinned buffer first)",
    ),
    "sync_h2d": (
        "blocking host->device copy; the host waits for the copy and all work queued before it",
        "build the data in a pinned buffer and copy with non_blocking=True",
    ),
    "d2h": (
        "device->host copy; the host waits for the device",
        "keep the value on the device or in host-side bookkeeping; if it must come back, copy "
        "non_blocking into pinned memory and wait on an event only where it is read",
    ),
    "item": (
        "reading a device scalar (.item(), bool()/int()/float() of a tensor); the host waits",
        "keep host copies of the integers you need (compute them on the CPU, e.g. in the plan)",
    ),
    "data_dependent_shape": (
        "op whose output size depends on device data; the host must read it back",
        "use a static-size form (nonzero_static, repeat_interleave(output_size=...), "
        "torch.where(cond, a, b), masked_fill) or precompute the size on the host",
    ),
    "synchronize": (
        "explicit synchronize; the host waits for the device",
        "remove it from the hot path; order work with streams/events (Event.wait does not "
        "block the host) and synchronize only where a host read needs it",
    ),
    "profiler_pageable_memcpy": (
        "the profiler saw pageable host->device memcpys that the dispatcher did not attribute "
        "(copies inside C++ code or extensions)",
        "find the copy with the profiler trace; pin its source",
    ),
}

class HostSyncError(RuntimeError):
    """Raised by a strict audit at the first host sync; ``.finding`` holds the details."""

    def __init__(self, finding: Finding) -> None:
        self.finding = finding
        super().__init__(finding.describe())


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One host-synchronizing operation and where user code issued it.

    ``nbytes`` is the size of the data moved or inspected (the source of a copy, the input of a
    data-dependent op); ``shape``/``dtype`` describe that tensor. ``filename``/``lineno``/
    ``function`` are the first frame outside torch and ``hostsync``; ``code`` is that
    source line. ``count`` is 1 except for the aggregated profiler finding.
    """

    kind: str
    op: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    filename: str
    lineno: int
    function: str
    code: str = ""
    devices: str = ""
    count: int = 1

    @property
    def location(self) -> str:
        """``file:line`` of the user frame."""
        return f"{self.filename}:{self.lineno}"

    @property
    def fix(self) -> str:
        """How to remove this kind of sync."""
        return KINDS[self.kind][1]

    def describe(self) -> str:
        """One paragraph for an error message: what, where, and the fix."""
        what = KINDS[self.kind][0]
        size = f"{_fmt_bytes(self.nbytes)} {self.dtype}{list(self.shape)}" if self.dtype else ""
        dev = f" {self.devices}" if self.devices else ""
        code = f"\n    {self.code}" if self.code else ""
        return (
            f"{self.location} in {self.function}: {self.kind}: {self.op}{dev} {size}".rstrip()
            + f"{code}\n  {what}.\n  fix: {self.fix}"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``location`` and ``fix`` included)."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        out["location"] = self.location
        out["fix"] = self.fix
        return out


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def group_findings(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    """Findings grouped by (location, kind, op) in order of first occurrence, with the number
    of occurrences (``count``) and the bytes they moved or inspected (``nbytes``)."""
    grouped: dict[tuple[str, int, str, str], dict[str, Any]] = {}
    for f in findings:
        key = (f.filename, f.lineno, f.kind, f.op)
        g = grouped.get(key)
        if g is None:
            g = grouped[key] = {
                "location": f.location, "filename": f.filename, "lineno": f.lineno,
                "function": f.function, "kind": f.kind, "op": f.op, "code": f.code,
                "count": 0, "nbytes": 0, "fix": f.fix,
            }
        g["count"] += f.count
        g["nbytes"] += f.nbytes
    return list(grouped.values())


def group_by_frame(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    """Findings grouped by the first frame outside torch (and ``hostsync``), in order
    of first occurrence: ``count``, ``nbytes`` and ``kinds`` (kind -> count) per frame."""
    frames: dict[tuple[str, int], dict[str, Any]] = {}
    for f in findings:
        g = frames.get((f.filename, f.lineno))
        if g is None:
            g = frames[(f.filename, f.lineno)] = {
                "location": f.location, "filename": f.filename, "lineno": f.lineno,
                "function": f.function, "code": f.code, "count": 0, "nbytes": 0, "kinds": {},
            }
        g["count"] += f.count
        g["nbytes"] += f.nbytes
        g["kinds"][f.kind] = g["kinds"].get(f.kind, 0) + f.count
    return list(frames.values())


_DEVICE_CLASSES = ("host<->device copies (pageable_h2d, sync_h2d, d2h), reads of device tensors "
                   "(.item(), .tolist(), .cpu(), bool()) and data-dependent shapes")


def audit_limits(*, cuda_available: bool, devices_seen: Iterable[str],
                 profiled: bool) -> list[dict[str, str]]:
    """The classes of host sync an audit run could not see, and why.

    Each entry has ``scope`` (``"this machine"`` / ``"this run"``: the run is incomplete;
    ``"always"``: a limit of the method), ``what``, ``why`` and ``fix``.
    """
    seen = sorted(set(devices_seen))
    out: list[dict[str, str]] = []
    if not seen:
        if cuda_available:
            out.append({"scope": "this run", "what": _DEVICE_CLASSES,
                        "why": "no tensor was on a device in the audited code, so none of "
                               "them could synchronize",
                        "fix": "make sure the script runs on the GPU (device=...)"})
        else:
            out.append({"scope": "this machine", "what": _DEVICE_CLASSES,
                        "why": "there is no CUDA device here (torch.cuda.is_available() is "
                               "False), so no tensor lived on a device and none of them "
                               "could synchronize",
                        "fix": "run the audit on a CUDA machine, or check the code "
                               "statically: hostsync lint PATH"})
    elif not cuda_available:
        out.append({"scope": "this machine", "what": "whether a pageable copy really stalls",
                    "why": f"no CUDA device: the audit saw {', '.join(seen)} tensors, so it "
                           "checked which ops would synchronize, not their cost",
                    "fix": "run it on a CUDA machine (mlaprefill stallmap measures the stall)"})
    out.append({"scope": "always", "what": "syncs in other threads",
                "why": "torch keeps the dispatch mode per thread",
                "fix": "audit each thread's work in that thread"})
    out.append({"scope": "always", "what": "syncs inside torch.compile graphs",
                "why": "compiled graphs run unaudited (graph breaks run eagerly and are seen)",
                "fix": "audit the eager code, or check it statically: hostsync lint PATH"})
    if not profiled:
        out.append({"scope": "always", "what": "pageable copies made inside C++ extensions",
                    "why": "the dispatcher does not see copies that never reach an aten op",
                    "fix": "on CUDA, add --profile (torch.profiler counts pageable memcpys)"})
    return out


def format_report(findings: list[Finding], *, num_allowed: int = 0,
                  profiler_pageable_memcpy: int | None = None,
                  limits: list[dict[str, str]] | None = None) -> str:
    """Human-readable report: host syncs grouped by the first frame outside torch, with counts
    and bytes; then one line per kind with its fix; then what the audit could not see (an
    incomplete run says so on its first line: no unqualified all-clear)."""
    groups = group_findings(findings)
    total = sum(g["count"] for g in groups)
    frames = group_by_frame(findings)
    incomplete = [x for x in limits or () if x["scope"] != "always"]
    head = f"host syncs: {total} in {len(frames)} location(s)"
    if num_allowed:
        head += f", {num_allowed} allowed"
    if incomplete:
        head += f" -- incomplete: {incomplete[0]['scope']} hid some syncs (see 'not seen')"
    lines = [head]
    if profiler_pageable_memcpy is not None:
        lines.append(f"profiler: {profiler_pageable_memcpy} x Memcpy HtoD (Pageable -> Device)")
    for frame in frames:
        for g in groups:
            if (g["filename"], g["lineno"]) == (frame["filename"], frame["lineno"]):
                lines.append(f"{g['location']} in {g['function']}: {g['count']}x {g['kind']} "
                             f"{g['op']} ({_fmt_bytes(g['nbytes'])})")
        if frame["code"]:
            lines.append(f"    {frame['code']}")
    kinds = list(dict.fromkeys(f.kind for f in findings))
    if kinds:
        lines.append("fix per kind:")
        lines.extend(f"  {k}: {KINDS[k][1]}" for k in kinds)
    for x in incomplete:
        lines.append(f"not seen on {x['scope']}: {x['what']}: {x['why']}; {x['fix']}")
    always = [x["what"] for x in limits or () if x["scope"] == "always"]
    if always:
        lines.append(f"never seen by this audit: {'; '.join(always)}")
    return "\n".join(lines)
