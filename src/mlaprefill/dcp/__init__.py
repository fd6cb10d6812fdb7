"""Decode context parallelism (DCP): chunked-context prefill over a token-sharded cache.

* :mod:`~mlaprefill.dcp.layout` — the interleaved layout: token <-> (rank, local index) maps
  (numpy only).
* :mod:`~mlaprefill.dcp.plan` — :class:`DCPChunkPlanner`: the single-rank plan of the global
  lengths plus each rank's local share and the compact reorder table (pure CPU, no torch).
* :mod:`~mlaprefill.dcp.forward` — :class:`DCPContextSource` (local gather -> all-gather ->
  reorder, the forward's ``context_source``). The one call is
  ``mlaprefill.mla_chunked_prefill(..., process_group=group, dcp_interleave=I)``
  (:mod:`mlaprefill.api`, which sits above this package).
* :mod:`~mlaprefill.dcp.shard` — shard / unshard a paged cache (torch; tests and migration).

Exports are lazy, so ``import mlaprefill.dcp.plan`` (or this package) loads no torch until a
torch-side name is used. Check/benchmark: ``torchrun --nproc-per-node N benchmarks/dcp.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DCPContextSource": "forward",
    "check_dcp_consistency": "forward",
    "reorder_rows_index": "forward",
    "check_dcp_config": "layout",
    "dcp_global_token": "layout",
    "dcp_local_context_lens": "layout",
    "dcp_local_count": "layout",
    "dcp_token_location": "layout",
    "DCPChunkPlan": "plan",
    "DCPChunkPlanner": "plan",
    "derive_dcp_arrays": "plan",
    "context_rows": "shard",
    "dcp_unshard_context": "shard",
    "shard_paged_cache": "shard",
}

if TYPE_CHECKING:
    from mlaprefill.dcp.forward import (
        DCPContextSource,
        check_dcp_consistency,
        reorder_rows_index,
    )
    from mlaprefill.dcp.layout import (
        check_dcp_config,
        dcp_global_token,
        dcp_local_context_lens,
        dcp_local_count,
        dcp_token_location,
    )
    from mlaprefill.dcp.plan import DCPChunkPlan, DCPChunkPlanner, derive_dcp_arrays
    from mlaprefill.dcp.shard import context_rows, dcp_unshard_context, shard_paged_cache


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlaprefill.dcp' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mlaprefill.dcp.{module}"), name)


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
    "reorder_rows_index",
    "shard_paged_cache",
]
