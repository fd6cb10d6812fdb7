"""Prefill-only engine benchmark: does the host stall the GPU, per staging mode and planner policy?

Pieces (one concept per module): :mod:`~mlaprefill.bench.scheduler` (chunked-prefill scheduler,
pure CPU), :mod:`~mlaprefill.bench.cache` (block allocator + paged latent cache),
:mod:`~mlaprefill.bench.model` (random-weight MLA decoder stack), :mod:`~mlaprefill.bench.step`
(one staging upload per step), :mod:`~mlaprefill.bench.engine` (overlapped step loop),
:mod:`~mlaprefill.bench.metrics`, :mod:`~mlaprefill.bench.runner` (interleaved variants),
:mod:`~mlaprefill.bench.report` (table / JSON / PNG) and :mod:`~mlaprefill.bench.cli`.
Importing this package does not import the forward; :class:`PrefillEngine` does on construction.
"""

from mlaprefill.bench.engine import EngineConfig, PrefillEngine, Variant
from mlaprefill.bench.scheduler import Scheduler, SchedulerConfig

__all__ = ["EngineConfig", "PrefillEngine", "Scheduler", "SchedulerConfig", "Variant"]
