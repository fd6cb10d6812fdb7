"""mlaprefill: MLA chunked-context prefill whose host side never stalls the GPU.

Three stages (see docs/DESIGN.md)::

    PrefillBatch --ChunkPlanner.plan()--> ChunkPlan --StagingRing.upload()--> DevicePlan
                 (pure CPU)                          (one H2D copy from pinned memory)
    DevicePlan --MLAChunkedPrefill.forward()--> out [T, H, v_head_dim], lse [T, H] (natural log)
               (device only, never syncs)

``mla_chunked_prefill`` does all three in one call. ``hostsync`` finds hidden host syncs
in any PyTorch code; ``mlaprefill.dcp`` shards the context over ranks.
"""

from typing import TYPE_CHECKING

# Lazy exports: `mlaprefill lint`, `mlaprefill plan` and the flake8/pytest plugins must not pay
# for importing torch and Triton.
_LAZY = {
    "MLAChunkedPrefill": "mlaprefill.prefill",
    "IOBuffers": "mlaprefill.prefill",
    "IterationGraphs": "mlaprefill.graphs",
    "mla_chunked_prefill": "mlaprefill.api",
    "PrefillBatch": "mlaprefill.batch",
    "ChunkPlan": "mlaprefill.plan",
    "ChunkPlanner": "mlaprefill.plan",
    "mla_prefill_reference": "mlaprefill.reference",
    "DevicePlan": "mlaprefill.staging",
    "StagingRing": "mlaprefill.staging",
    "StagingStats": "mlaprefill.staging",
    "write_kv_cache": "mlaprefill.kvcache",
    "no_host_sync": "hostsync",
    "HostSyncError": "hostsync",
}

if TYPE_CHECKING:
    from hostsync import HostSyncError, no_host_sync
    from mlaprefill.api import mla_chunked_prefill
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.kvcache import write_kv_cache
    from mlaprefill.plan import ChunkPlan, ChunkPlanner
    from mlaprefill.prefill import IOBuffers, MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import DevicePlan, StagingRing, StagingStats


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlaprefill' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "ChunkPlan",
    "ChunkPlanner",
    "DevicePlan",
    "HostSyncError",
    "IOBuffers",
    "IterationGraphs",
    "MLAChunkedPrefill",
    "PrefillBatch",
    "StagingRing",
    "StagingStats",
    "mla_chunked_prefill",
    "mla_prefill_reference",
    "no_host_sync",
    "write_kv_cache",
]
__version__ = "0.1.0"
