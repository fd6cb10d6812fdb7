"""Move paged-cache rows between the unsharded and the DCP layout (torch; tests, benchmarks and
migrating a cache, not the hot path). The index math is :mod:`mlaprefill.dcp.layout`."""

from __future__ import annotations

import numpy as np
import torch

from mlaprefill.dcp.layout import (
    check_dcp_config,
    dcp_global_token,
    dcp_local_context_lens,
    dcp_token_location,
)

__all__ = ["context_rows", "dcp_unshard_context", "shard_paged_cache"]


def _segment_arange(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For lengths ``[n]``: (segment id of each element, offset within its segment)."""
    lens = np.asarray(lens, dtype=np.int64)
    seg = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
    starts = np.cumsum(lens) - lens
    return seg, np.arange(seg.size, dtype=np.int64) - starts[seg]


def context_rows(kv_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: np.ndarray) -> torch.Tensor:
    """All context rows of an (unsharded) paged cache, packed in request order.

    Returns ``[sum(context_lens), latent_dim]`` on ``kv_cache``'s device.
    """
    page_size = kv_cache.shape[1]
    req, tok = _segment_arange(np.asarray(context_lens))
    req_t = torch.from_numpy(req).to(block_table.device)
    tok_t = torch.from_numpy(tok).to(block_table.device)
    blocks = block_table[req_t, tok_t // page_size].long().to(kv_cache.device)
    return kv_cache[blocks, (tok_t % page_size).to(kv_cache.device)]


def shard_paged_cache(kv_cache: torch.Tensor, block_table: torch.Tensor,
                      context_lens: np.ndarray, *, world: int, interleave: int,
                      page_size: int | None = None, seed: int | None = None,
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a full paged cache into per-rank caches and block tables.

    Parameters
    ----------
    kv_cache : [num_blocks, page_size, latent_dim]
        Unsharded cache; context token ``t`` of request ``r`` is at
        ``kv_cache[block_table[r, t // page_size], t % page_size]``.
    block_table : int32 [num_reqs, max_blocks]
    context_lens : ints [num_reqs]
        Global context lengths.
    world, interleave : int
        DCP layout (see module docstring).
    page_size : int, optional
        Page size of the local caches; default ``kv_cache.shape[1]``.
    seed : int, optional
        When given, local block ids are a random permutation (to exercise the block table);
        otherwise each request's local blocks are consecutive.

    Returns
    -------
    list of ``(local_kv_cache [local_num_blocks, page_size, latent_dim],
    local_block_table int32 [num_reqs, local_max_blocks])``, one per rank, on the input devices.
    Local blocks past a request's local length are zero-filled; unused table entries are 0.
    """
    check_dcp_config(world, interleave)
    page = kv_cache.shape[1] if page_size is None else int(page_size)
    if page <= 0:
        raise ValueError(f"page_size must be positive, got {page}")
    lens = np.asarray(context_lens, dtype=np.int64)
    local_lens = dcp_local_context_lens(lens, world=world, interleave=interleave)
    rows = context_rows(kv_cache, block_table, lens)  # [sum(lens), latent_dim]
    row_start = np.cumsum(lens) - lens
    rng = None if seed is None else np.random.default_rng(seed)
    out = []
    for rank in range(world):  # a loop over ranks: helper for tests/migration, not hot path
        nblocks = -(-local_lens[rank] // page)  # [num_reqs]
        num_blocks = max(int(nblocks.sum()), 1)
        block_ids = np.arange(num_blocks, dtype=np.int64)
        if rng is not None:
            block_ids = rng.permutation(num_blocks)
        max_blocks = max(int(nblocks.max(initial=0)), 1)
        table = np.zeros((lens.size, max_blocks), dtype=np.int32)
        breq, boff = _segment_arange(nblocks)
        table[breq, boff] = block_ids[np.cumsum(nblocks)[breq] - nblocks[breq] + boff]
        req, loc = _segment_arange(local_lens[rank])
        glob = dcp_global_token(rank, loc, world=world, interleave=interleave)
        src = torch.from_numpy(row_start[req] + glob).to(rows.device)
        cache = torch.zeros((num_blocks, page, kv_cache.shape[2]), dtype=kv_cache.dtype,
                            device=kv_cache.device)
        dst_block = torch.from_numpy(table[req, loc // page].astype(np.int64)).to(cache.device)
        dst_slot = torch.from_numpy(loc % page).to(cache.device)
        cache[dst_block, dst_slot] = rows[src]
        out.append((cache, torch.from_numpy(table).to(block_table.device)))
    return out


def dcp_unshard_context(shards: list[tuple[torch.Tensor, torch.Tensor]],
                        context_lens: np.ndarray, *, interleave: int) -> torch.Tensor:
    """Rebuild the packed context rows ``[sum(context_lens), latent_dim]`` from rank shards.

    Inverse of :func:`shard_paged_cache` up to paging: equals
    ``context_rows(kv_cache, block_table, context_lens)`` of the original cache.
    """
    world = len(shards)
    check_dcp_config(world, interleave)
    lens = np.asarray(context_lens, dtype=np.int64)
    req, tok = _segment_arange(lens)
    rank, local = dcp_token_location(tok, world=world, interleave=interleave)
    local_lens = dcp_local_context_lens(lens, world=world, interleave=interleave)
    first = shards[0][0]
    out = torch.empty((req.size, first.shape[2]), dtype=first.dtype, device=first.device)
    for r, (cache, table) in enumerate(shards):
        sel = np.flatnonzero(rank == r)
        rows = context_rows(cache, table, local_lens[r])  # local rows, request order
        local_start = np.cumsum(local_lens[r]) - local_lens[r]
        src = torch.from_numpy(local_start[req[sel]] + local[sel]).to(rows.device)
        out[torch.from_numpy(sel).to(out.device)] = rows[src]
    return out
