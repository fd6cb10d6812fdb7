"""The DCP forward: local gather -> one all-gather -> reorder, then the single-rank forward.

Each iteration of the single-rank forward asks its ``context_source`` for that iteration's
latent rows in workspace order. :class:`DCPContextSource` answers on every rank with

1. the paged gather of this rank's share of cache *records* from its *local* cache into a local
   buffer (``gather_context_records`` with the plan's ``local_*`` rows: an FP8 cache's records
   stay FP8, so the all-gather moves their bytes — half of bf16's for e4m3, 656 of 1152 for
   ``fp8_ds_mla``),
2. one ``all_gather_into_tensor`` of the local buffers, each padded to ``rank_capacity[i]`` rows
   (equal sizes on every rank; rank-major result),
3. one ``index_select`` into the workspace (a cache in the compute dtype) or into a record
   buffer that is then dequantized into the workspace (:func:`~mlaprefill.kvcache.
   dequantize_rows`), with the gathered row of every workspace row computed on the device from
   the plan's compact ``reorder_base`` (:func:`reorder_rows_index`).

Attention and the LSE merge then run exactly as on one rank, so every rank returns the output
of the single-rank forward on the unsharded cache. Shapes come from host ints of the plan; the
collectives are enqueued on the current stream's order (no host synchronization), except the
optional cross-rank consistency check (``debug=True``), which reads one small tensor back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlaprefill.dcp.plan import DCPChunkPlan
from mlaprefill.kernels.gather import gather_context_records
from mlaprefill.kvcache import KVCacheSpec, dequantize_rows, resolve_kv_cache
from mlaprefill.staging import rows_to_requests

__all__ = [
    "DCPContextSource",
    "check_dcp_consistency",
    "dcp_world",
    "reorder_rows_index",
]

_DIGEST_FIELDS = ("query_lens", "context_lens", "config (world/interleave/workspace/page/policy)")


def _all_gather_into_tensor(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    # torch >= 2.13 renames it all_gather_single (same semantics); the GPU runs torch 2.11.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, local, group=group)


def dcp_world(process_group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of ``process_group``; ``(0, 1)`` for ``None`` (single rank).

    Every DCP entry point reads the group here, so a wrong one is one ``TypeError`` naming
    ``process_group`` (not torch's ``AttributeError`` from inside ``get_rank``).
    """
    if process_group is None:
        return 0, 1
    group_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if group_type is None or not isinstance(process_group, group_type):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup (e.g. from "
            f"dist.new_group(ranks)) or None for one rank, got {type(process_group).__name__}")
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group; call it only on the "
                         "group's ranks")
    return rank, world


def reorder_rows_index(cu_seq_lens: torch.Tensor, chunk_starts: torch.Tensor,
                       reorder_base: torch.Tensor, num_rows: int, *, world: int,
                       interleave: int) -> torch.Tensor:
    """int64 [num_rows]: row of the gathered buffer holding each workspace row of one iteration.

    Parameters
    ----------
    cu_seq_lens : int32 [num_reqs + 1]; chunk_starts : int32 [num_reqs]
        The base plan's row of this iteration (global workspace order).
    reorder_base : int32 [num_reqs, world]
        The DCP plan's row of this iteration.
    num_rows : int
        Host int (``iteration_tokens[i]``).

    Workspace row ``j`` is context token ``t`` of its request ``r``; its owner rank is
    ``k = (t // I) % world`` and its local index ``(t // (I * world)) * I + t % I``, so its
    gathered row is ``reorder_base[r, k]`` plus that local index. Device work only (a
    ``searchsorted`` and a few elementwise ops), never synchronizes.
    """

    req = rows_to_requests(cu_seq_lens, num_rows)
    j = torch.arange(num_rows, device=cu_seq_lens.device, dtype=torch.int64)
    tok = chunk_starts.long()[req] + j - cu_seq_lens.long()[req]
    unit = tok // interleave
    local = (unit // world) * interleave + tok % interleave
    return reorder_base.long()[req, unit % world] + local


class DCPContextSource:
    """``context_source`` for :meth:`MLAChunkedPrefill.forward` over a token-sharded cache.

    Parameters
    ----------
    kv_cache : [local_num_blocks, page_size, record]
        This rank's local cache, in any format of :mod:`mlaprefill.kvcache`.
    block_table : int32 [num_reqs, local_max_blocks]
        This rank's block table (local token indices), same device.
    device_plan : DevicePlan
        ``StagingRing.upload`` of a :class:`~mlaprefill.dcp.plan.DCPChunkPlan` for this rank.
    process_group : ProcessGroup
        The DCP group (world size ``device_plan.plan.world``).
    kv_cache_scale, kv_cache_format
        The cache's format, as in :meth:`~mlaprefill.MLAChunkedPrefill.forward`.

    Attributes
    ----------
    all_gather_bytes : int
        Bytes of the all-gathered buffers so far (host count of what the calls enqueued).

    Notes
    -----
    Allocates its two buffers once (``max_rank_capacity`` and ``max_gathered_tokens`` rows).
    Each call is device work only (gather, all-gather, index_select) with shapes from host ints
    of the plan and never synchronizes; whether it can be captured in a CUDA graph is up to the
    process group's collectives (not tested here).
    """

    def __init__(self, kv_cache: torch.Tensor, block_table: torch.Tensor, device_plan: Any,
                 process_group: Any, *, kv_cache_scale: Any = None,
                 kv_cache_format: str | None = None) -> None:
        rank, world = dcp_world(process_group)
        plan = getattr(device_plan, "plan", None)
        if not isinstance(plan, DCPChunkPlan):
            raise TypeError(f"device_plan must be the upload of a DCPChunkPlan, got one of "
                            f"{type(plan).__name__}; plan with DCPChunkPlanner(...).plan(batch, "
                            f"rank=rank) and upload it with StagingRing.upload")
        if (rank, world) != (plan.rank, plan.world):
            raise ValueError(f"the plan is for rank {plan.rank} of {plan.world} but "
                             f"process_group is rank {rank} of {world}; plan with this "
                             f"group's rank and size")
        self.kv_cache = kv_cache
        self.block_table = block_table
        self.device_plan = device_plan
        self.process_group = process_group
        self.plan = plan
        self.kv_cache_scale, self.kv_cache_format = kv_cache_scale, kv_cache_format
        self.all_gather_bytes = 0
        # FP8 records travel as bytes (collectives and index_select need no float8 support).
        quantized = kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
        self._records = kv_cache.view(torch.uint8) if quantized else kv_cache
        record, kind = self._records.shape[2], self._records.dtype
        self._local = torch.empty((plan.max_rank_capacity, record), dtype=kind,
                                  device=kv_cache.device)
        self._gathered = torch.empty((plan.max_gathered_tokens, record), dtype=kind,
                                     device=kv_cache.device)
        self._ordered = torch.empty((plan.base.max_iteration_tokens, record), dtype=kind,
                                    device=kv_cache.device) if quantized else None
        self._spec: KVCacheSpec | None = None

    def gather_local(self, iteration: int) -> torch.Tensor:
        """This rank's share of ``iteration``, ``[rank_capacity[i], latent_dim]`` (padded)."""
        t = self.device_plan.tensors
        cap = self.plan.rank_capacity[iteration]
        local = self._local[:cap]
        gather_context_records(self._records, self.block_table,
                               t["local_cu_seq_lens"][iteration],
                               t["local_chunk_starts"][iteration], local,
                               self.plan.local_iteration_tokens[iteration])
        return local

    def __call__(self, iteration: int, workspace: torch.Tensor) -> torch.Tensor:
        """Rows of ``iteration`` in workspace order: ``workspace[:iteration_tokens[i]]``."""
        plan = self.plan
        cap = plan.rank_capacity[iteration]
        num_rows = plan.base.iteration_tokens[iteration]
        local = self.gather_local(iteration)
        gathered = self._gathered[: plan.world * cap]  # [world * cap, latent] rank-major
        _all_gather_into_tensor(gathered, local, self.process_group)
        self.all_gather_bytes += gathered.numel() * gathered.element_size()
        out = workspace[:num_rows]
        t = self.device_plan.tensors
        index = reorder_rows_index(t["cu_seq_lens"][iteration], t["chunk_starts"][iteration],
                                   t["reorder_base"][iteration], num_rows, world=plan.world,
                                   interleave=plan.interleave)
        if self._ordered is None:
            torch.index_select(gathered, 0, index, out=out)
            return out
        spec = self._spec
        if spec is None or spec.latent_dim != workspace.shape[1]:
            spec = self._spec = resolve_kv_cache(
                self.kv_cache, self.kv_cache_scale, self.kv_cache_format,
                latent_dim=workspace.shape[1], dtype=workspace.dtype, dtype_of="workspace")
        records = torch.index_select(gathered, 0, index, out=self._ordered[:num_rows])
        if self.kv_cache.dtype == torch.float8_e4m3fn:
            records = records.view(torch.float8_e4m3fn)
        out.copy_(dequantize_rows(records, spec, workspace.dtype))
        return out


def check_dcp_consistency(digest: tuple[int, int, int], process_group: Any,
                          device: torch.device | str, *,
                          local_error: BaseException | None = None) -> None:
    """Raise ``ValueError`` unless every rank has the same global lengths/config and no error.

    One ``all_reduce(MIN)`` of ``[digest, failed, -digest, -failed]`` (8 int64) gives the min
    and max of each checksum over ranks and whether any rank failed its local checks
    (``local_error``: raised again here, after the collective, so that no rank is left waiting
    in a collective its peers never join). **Synchronizes the host** (reads 64 bytes back):
    debug use only. Collective: every rank of the group must call it.

    Parameters
    ----------
    digest : (query_lens, context_lens, config) checksums, see
        :func:`~mlaprefill.dcp.plan.dcp_config_digest`
    """
    rank, world = dcp_world(process_group)  # a wrong group fails here, before the collective
    mine = np.asarray([*digest, 0 if local_error is None else 1], dtype=np.int64)
    both = torch.from_numpy(np.concatenate([mine, -mine])).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=process_group)
    values = both.cpu().numpy()  # noqa: HS201 -- a real sync, the one documented of debug mode
    lo, hi = values[:4], -values[4:]
    bad = [name for name, a, b in zip(_DIGEST_FIELDS, lo[:3], hi[:3], strict=True) if a != b]
    if bad:
        raise ValueError(
            f"DCP ranks disagree on {', '.join(bad)} (rank {rank} of {world}); every "
            f"rank must pass the same global query_lens/context_lens and the same "
            f"workspace_tokens/page_size/policy/dcp_interleave (only kv_cache and block_table "
            f"are rank-local)."
        )
    if local_error is not None:
        raise local_error
    if hi[3]:
        raise ValueError(
            f"another DCP rank failed its input checks (this is rank {rank} of {world}; see "
            f"that rank's error)."
        )


def check_local_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                       plan: DCPChunkPlan) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be this rank's [local_num_blocks, page_size, "
                         f"latent_dim] shard, got shape {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != plan.base.num_reqs:
        raise ValueError(
            f"block_table has shape {tuple(block_table.shape)}; expected this rank's local "
            f"table [num_reqs={plan.base.num_reqs}, local_max_blocks]")
    need = int(plan.local_context_lens.max(initial=0))
    have = block_table.shape[1] * kv_cache.shape[1]
    if need > have:
        raise ValueError(
            f"local block_table covers {have} tokens per request (max_blocks="
            f"{block_table.shape[1]} x page_size={kv_cache.shape[1]}) but rank {plan.rank} "
            f"holds up to {need} local context tokens of a request (world={plan.world}, "
            f"dcp_interleave={plan.interleave}); pass this rank's shard "
            f"(see mlaprefill.dcp.shard_paged_cache).")

