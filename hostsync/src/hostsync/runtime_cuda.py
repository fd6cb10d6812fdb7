"""The host syncs the dispatcher cannot see: explicit ``synchronize`` calls and C++ copies.

:func:`wrap_synchronize` replaces ``torch.cuda.synchronize``, ``Event.synchronize``,
``Stream.synchronize`` (and ``torch.accelerator.synchronize`` where it exists) with wrappers that
report each call; :func:`unwrap_synchronize` restores them when the last user leaves. The count
of users lives on the wrapper itself, so this module holds no mutable state.
:class:`PageableMemcpyCounter` runs ``torch.profiler`` to count the pageable host->device memcpys
that really happened, copies inside extensions included. Part of :mod:`hostsync.runtime`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PageableMemcpyCounter", "is_pageable_memcpy", "unwrap_synchronize",
           "wrap_synchronize"]

_SYNC_ORIGINAL = "_mlaprefill_audit_original"
_SYNC_USERS = "_mlaprefill_audit_users"


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


def wrap_synchronize(on_call: Callable[[str], None]) -> None:
    """Make every synchronize function call ``on_call(display_name)`` first; one more user.

    Only the first user's wrapper is installed, so ``on_call`` must be the same function for
    all users (it dispatches to whichever audits are active).
    """
    for owner, attr, name in _sync_targets():
        current = getattr(owner, attr)
        if not hasattr(current, _SYNC_ORIGINAL):
            current = _make_wrapper(current, name, on_call)
            setattr(owner, attr, current)
        setattr(current, _SYNC_USERS, getattr(current, _SYNC_USERS) + 1)


def unwrap_synchronize() -> None:
    """One user fewer; the last one restores the original functions."""
    for owner, attr, _ in _sync_targets():
        current = getattr(owner, attr)
        users = getattr(current, _SYNC_USERS, None)
        if users is None:
            continue
        setattr(current, _SYNC_USERS, users - 1)
        if users <= 1:
            setattr(owner, attr, getattr(current, _SYNC_ORIGINAL))


def _make_wrapper(original: Callable[..., Any], name: str,
                  on_call: Callable[[str], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def synchronize_audited(*args: Any, **kwargs: Any) -> Any:
        on_call(name)
        return original(*args, **kwargs)

    setattr(synchronize_audited, _SYNC_ORIGINAL, original)
    setattr(synchronize_audited, _SYNC_USERS, 0)
    return synchronize_audited


def is_pageable_memcpy(name: str) -> bool:
    """``Memcpy HtoD (Pageable -> Device)``, as named by CUPTI/kineto."""
    return "HtoD" in name and "Pageable" in name


class PageableMemcpyCounter:
    """Counts ``Memcpy HtoD (Pageable -> Device)`` events between construction and :meth:`stop`.

    Raises ``ValueError`` without CUDA. :meth:`stop` synchronizes the device once.
    """

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise ValueError("no_host_sync(profile=True) needs CUDA (torch.cuda.is_available() "
                             "is False); use profile=False on this machine")
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profiler.__enter__()

    def stop(self) -> int:
        """Stop profiling and return the number of pageable host->device memcpys."""
        # the unwrapped function: an enclosing audit must not record the profiler's own sync
        getattr(torch.cuda.synchronize, _SYNC_ORIGINAL, torch.cuda.synchronize)()
        self._profiler.__exit__(None, None, None)
        return sum(1 for e in self._profiler.events() if is_pageable_memcpy(e.name))
