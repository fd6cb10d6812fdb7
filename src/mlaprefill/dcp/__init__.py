"""Decode context parallelism (DCP): chunked-context prefill over a token-sharded cache.

* :mod:`~mlaprefill.dcp.layout` — the interleaved layout, token <-> (rank, local index) maps,
  shard/unshard helpers for a paged cache.
* :mod:`~mlaprefill.dcp.plan` — :class:`DCPChunkPlanner`: the single-rank plan of the global
  lengths plus each rank's local share and the all-gather reorder index (pure CPU).
* :mod:`~mlaprefill.dcp.forward` — :func:`mla_chunked_prefill_dcp` and
  :class:`DCPContextSource` (local gather -> all-gather -> reorder -> single-rank forward).

Check/benchmark entry point: ``torchrun --nproc-per-node N benchmarks/dcp.py --out X.json``.
"""

from __future__ import annotations

from mlaprefill.dcp.forward import (
    DCPContextSource,
    check_dcp_consistency,
    mla_chunked_prefill_dcp,
)
from mlaprefill.dcp.layout import (
    check_dcp_config,
    context_rows,
    dcp_global_token,
    dcp_local_context_lens,
    dcp_local_count,
    dcp_token_location,
    dcp_unshard_context,
    shard_paged_cache,
)
from mlaprefill.dcp.plan import DCPChunkPlan, DCPChunkPlanner, derive_dcp_arrays

__all__ = [
    "DCPChunkPlan",
    "DCPChunkPlanner",
    "DCPContextSource",
    "check_dcp_config",
    "check_dcp_consistency",
    "context_rows",
    "dcp_global_token",
    "dcp_local_context_lens",
    "dcp_local_count",
    "dcp_token_location",
    "dcp_unshard_context",
    "derive_dcp_arrays",
    "mla_chunked_prefill_dcp",
    "shard_paged_cache",
]
