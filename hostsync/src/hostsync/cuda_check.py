"""Prove a CUDA step never waits on the GPU, with PyTorch's own tools (a second opinion).

:func:`check_step_async` runs ``step()`` once to warm up (JIT, graph builds), then ``steps`` times
under ``torch.cuda.set_sync_debug_mode("error")`` inside ``torch.profiler``, and counts the memcpy
events the profiler saw. A step passes when the sync debug mode raised nothing, no
``Memcpy HtoD (Pageable -> Device)`` and no ``Memcpy DtoH`` happened, and at least
``min_htod_per_step`` host-to-device copies per step did (the upload the step is meant to make).

It complements :func:`hostsync.no_host_sync`: the sync debug mode misses pageable
``non_blocking`` copies (the bug this project is about), and the profiler sees them only after
they ran; the dispatch-mode audit sees them before. Used by the GPU tests and
``benchmarks/attention.py``, so both prove the same thing the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StepSyncCheck", "check_step_async"]


@dataclass(slots=True)
class StepSyncCheck:
    """What :func:`check_step_async` saw over ``steps`` calls of the step."""

    steps: int
    sync_debug_error: str | None
    memcpy_events: dict[str, int] = field(default_factory=dict)
    pageable_htod: int = 0
    dtoh: int = 0
    htod: int = 0
    min_htod_per_step: int = 1

    @property
    def passed(self) -> bool:
        return (self.sync_debug_error is None and self.pageable_htod == 0 and self.dtoh == 0
                and self.htod >= self.min_htod_per_step * self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass": self.passed}


def check_step_async(step: Callable[[], Any], *, steps: int = 3,
                     min_htod_per_step: int = 1) -> StepSyncCheck:
    """Run ``step`` (warm-up + ``steps`` times) and report its copies; see the module docstring.

    ``step`` takes no arguments and only enqueues work on the current CUDA stream. Raises
    ``ValueError`` when CUDA is unavailable or ``steps < 1`` (before running anything).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hostsync.runtime_cuda import is_pageable_memcpy

    if not torch.cuda.is_available():
        raise ValueError("check_step_async needs CUDA (torch.cuda.is_available() is False); "
                         "use hostsync.no_host_sync on a CPU machine")
    if steps < 1:
        raise ValueError(f"steps = {steps}; pass steps >= 1")
    step()  # warm-up: Triton JIT, cuDNN graph build, allocator growth
    torch.cuda.synchronize()
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            try:
                for _ in range(steps):
                    step()
            except RuntimeError as exc:
                # the sync debug mode raises exactly this; anything else (OOM, a kernel error)
                # is the step's own failure, not a finding
                if "called a synchronizing CUDA operation" not in str(exc):
                    raise
                error = f"{type(exc).__name__}: {exc}"[:600]
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    names: dict[str, int] = {}
    for ev in prof.events():
        if "Memcpy" in ev.name:
            names[ev.name] = names.get(ev.name, 0) + 1
    return StepSyncCheck(
        steps=steps, sync_debug_error=error, memcpy_events=names,
        pageable_htod=sum(v for k, v in names.items() if is_pageable_memcpy(k)),
        dtoh=sum(v for k, v in names.items() if "DtoH" in k),
        htod=sum(v for k, v in names.items() if "HtoD" in k),
        min_htod_per_step=min_htod_per_step)
