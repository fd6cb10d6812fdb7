"""Where a host sync came from, and whether it is allowed.

A finding is attributed to the first stack frame outside torch, ``hostsync`` and the
caller's ``internal`` globs (:class:`FrameLocator`), and then matched against the allow-list
(:class:`AllowList`: kind names and ``path_glob[:line]`` patterns). Part of
:mod:`hostsync.runtime`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import linecache
import os
import sys
from collections.abc import Iterable
from types import FrameType

import torch

from hostsync.findings import KINDS, Finding

__all__ = ["AllowList", "FrameLocator", "Where", "finding_at"]

_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

# (filename, lineno, function) of a frame
Where = tuple[str, int, str]


class FrameLocator:
    """Finds the user frame: the innermost one whose file is not internal (cached per file)."""

    def __init__(self, internal: Iterable[str] = ()) -> None:
        self._internal = tuple(internal)
        self._cache: dict[str, bool] = {}

    def _internal_file(self, filename: str) -> bool:
        cached = self._cache.get(filename)
        if cached is None:
            cached = (
                filename.startswith((_TORCH_DIR, _AUDIT_DIR, "<frozen "))
                or any(fnmatch.fnmatch(filename, p) for p in self._internal)
            )
            self._cache[filename] = cached
        return cached

    def user_frame(self) -> Where | None:
        """The user frame of the current stack; ``None`` when every frame is internal."""
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and self._internal_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            return None
        return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name


def finding_at(where: Where, kind: str, op: str, *, t: torch.Tensor | None = None,
               devices: str = "", count: int = 1) -> Finding:
    """A :class:`Finding` at ``where`` (with its source line) about tensor ``t``, if any."""
    filename, lineno, function = where
    code = linecache.getline(filename, lineno).strip()
    if t is None:
        return Finding(kind=kind, op=op, nbytes=0, shape=(), dtype="", filename=filename,
                       lineno=lineno, function=function, code=code, devices=devices,
                       count=count)
    return Finding(kind=kind, op=op, nbytes=t.numel() * t.element_size(), shape=tuple(t.shape),
                   dtype=str(t.dtype).removeprefix("torch."), filename=filename, lineno=lineno,
                   function=function, code=code, devices=devices, count=count)


class AllowList:
    """Accepted syncs: kind names from :data:`KINDS` and ``path_glob[:line]`` location globs.

    A glob is matched against the absolute, cwd-relative and base file name of the finding.
    """

    def __init__(self, patterns: Iterable[str]) -> None:
        if isinstance(patterns, str):
            raise TypeError(f"allow must be a list of patterns, got the string {patterns!r}; "
                            f"wrap it: allow=[{patterns!r}]")
        self._kinds: set[str] = set()
        self._locations: list[tuple[str, int | None]] = []
        for pattern in patterns:
            if pattern in KINDS:
                self._kinds.add(pattern)
                continue
            path, _, line = pattern.rpartition(":")
            if path and line.isdigit():
                self._locations.append((path, int(line)))
            else:
                self._locations.append((pattern, None))

    def allows(self, finding: Finding) -> bool:
        if finding.kind in self._kinds:
            return True
        if not self._locations:
            return False
        names = [finding.filename, os.path.basename(finding.filename)]
        with contextlib.suppress(ValueError):  # relpath across drives
            names.append(os.path.relpath(finding.filename))
        return any(
            (line is None or line == finding.lineno)
            and any(fnmatch.fnmatch(n, glob) for n in names)
            for glob, line in self._locations
        )
