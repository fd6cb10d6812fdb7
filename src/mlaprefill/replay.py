"""The forward as replays of CUDA graphs (``MLAChunkedPrefill(..., graphs=IterationGraphs())``).

A forward here copies its inputs into the static buffers of :class:`~mlaprefill.graphs.
IterationGraphs` (the queries not when they are already there: ``MLAChunkedPrefill.io_buffers``),
runs the new tokens' stage and runs of context iterations, each one replay of a graph cached per
launch shape and layer (or, at a shape's first sight, the same launches eagerly), and copies
``(out, lse)`` out (not when the caller's buffers are the arena's own). :mod:`mlaprefill.graphs`
keeps the graphs and the buffers; this module decides the launches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mlaprefill.backends import VarlenSeqs
from mlaprefill.graphs import EAGER, MIN_QUERY_BUCKET, Arena, pow2_at_least, row_bucket
from mlaprefill.kernels.gather import gather_context_rows_with_spec
from mlaprefill.kvcache import KVCacheSpec
from mlaprefill.staging import DevicePlan

if TYPE_CHECKING:
    from mlaprefill.prefill import MLAChunkedPrefill

__all__ = ["forward_graphs", "layer_arena"]


def forward_graphs(op: MLAChunkedPrefill, q: torch.Tensor, kv_c_new: torch.Tensor,
                   k_pe_new: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   device_plan: DevicePlan, rope: int, scale: float, lse_dtype: torch.dtype,
                   return_lse: bool, out: torch.Tensor | None, lse: torch.Tensor | None,
                   cache_spec: KVCacheSpec,
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``op.forward`` through the static buffers of ``op.graphs``: the new tokens' stage, then
    runs of context iterations, each a replay of a cached CUDA graph (or, at a launch shape's
    first sight, the same launches run eagerly); see :class:`_ArenaReplay`. The result is
    written into ``out`` / ``lse`` (copied, unless they are the arena's own: ``io_buffers``)."""
    backend, h, plan = op.backend, op.num_heads, device_plan.chunk_plan
    cu_q_host = plan.cu_query_lens
    # (i, row bucket, host offsets of joined keys or None, (attention sequences bucket, query
    # bucket)) of every iteration with rows; the last differs per iteration only in a plan
    # that shares prefixes (its attention runs over request runs: ChunkPlan.iteration_sequences)
    units = []
    for i, num_rows in enumerate(plan.iteration_tokens):
        if num_rows:
            seq_q, seq_k, n, max_q_i = plan.iteration_sequences(i)
            host = VarlenSeqs(None, None, max_q_i, plan.max_chunk_lens[i],
                              cu_seqlens_q_host=seq_q, cu_seqlens_k_host=seq_k)
            joined = host if backend.wants_joined_keys(host, h, False) else None
            units.append((i, row_bucket(num_rows), joined,
                          (pow2_at_least(n), pow2_at_least(max_q_i, MIN_QUERY_BUCKET))))
    new = VarlenSeqs(None, None, plan.max_query_len, plan.max_query_len,
                     cu_seqlens_q_host=cu_q_host, cu_seqlens_k_host=cu_q_host)
    tokens = row_bucket(plan.num_query_tokens)
    # The compute-dtype key/value buffer: the new tokens' rows and those of every context
    # iteration whose projection writes it (not mlaprefill-fp8's FP8 ones), with the query
    # bucket each iteration's launch passes (_ArenaReplay.run)
    plan_q = pow2_at_least(plan.max_query_len, MIN_QUERY_BUCKET)
    kv_rows = max([tokens, *(rows for _, rows, joined, grid in units
                             if backend.context_writes_buffer(
                                 VarlenSeqs(None, None, grid[1] if plan.shares_prefixes
                                            else plan_q, rows), joined=joined is not None))])
    replay = _ArenaReplay(op, q, kv_c_new, k_pe_new, kv_cache, cache_spec, block_table,
                          device_plan, rope, scale, tokens,
                          max([tokens, *(unit[1] for unit in units)]), kv_rows)
    replay.new_tokens(tokens, new if backend.wants_joined_keys(new, h, True) else None)
    k = 0
    while k < len(units):  # a run of consecutive split-key iterations: one launch
        i, rows, joined, grid = units[k]
        if joined is not None:  # cuDNN rectangles: sized on the host, one iteration
            replay.run(i, rows, 1, joined, grid=grid)
            k += 1
            continue
        run = 1  # of one row bucket (and one query bucket)
        while (k + run < len(units) and units[k + run][0] == i + run
               and units[k + run][2] is None and units[k + run][1] == rows
               and units[k + run][3] == grid):
            run += 1
        run = 1 << (run.bit_length() - 1)  # a power of two: few keys
        replay.run(i, rows, run, grid=grid)
        k += run
    return replay.result(lse_dtype, return_lse, out, lse)



def layer_arena(op: MLAChunkedPrefill, need: dict[str, int], device: torch.device,
                dtype: torch.dtype, rope: int) -> Arena:
    """The static buffers of ``op.graphs`` for ``op``'s shapes in ``dtype`` on ``device`` (its
    cache has q's dtype), with at least the capacities ``need``."""
    h, qk, rank, v = op.num_heads, op.qk_nope_head_dim + rope, op.kv_lora_rank, op.v_head_dim
    assert op.graphs is not None
    return op.graphs.arena((device, dtype, dtype, h, qk, v, rank + rope), need, device=device,
                           dtype=dtype, kv_dtype=dtype, heads=h, qk=qk, v=v, latent=rank + rope)



class _NewTokens:
    """The new tokens' stage, sized to a graph key and reading only static buffers: the
    up-projection of the arena's first ``tokens`` latent rows (the step's ``kv_c_new | k_pe_new``,
    then rows of no sequence) and the backend's causal attention of the arena's queries over
    them (``seqs`` sequences, grid of ``max_q`` queries), stored as the arena's running
    ``(out, lse)`` (``attend_and_store``: no result tensors, no copy). ``host``: the plan's host
    ``cu_query_lens`` when the backend wants joined keys (``mlaprefill``'s cuDNN rectangles are
    placed from them; part of the key), else None.
    """

    __slots__ = ("arena", "host", "launch", "op")

    def __init__(self, op: MLAChunkedPrefill, arena: Arena, seqs: int, max_q: int, tokens: int,
                 rope: int, scale: float, host: Any) -> None:
        self.op, self.arena, self.host = op, arena, host
        self.launch = (seqs, max_q, tokens, rope, scale)

    def __call__(self) -> None:
        arena, op = self.arena, self.op
        seqs, max_q, tokens, rope, scale = self.launch
        joined, rank = self.host is not None, op.kv_lora_rank
        latent = arena.workspace[:tokens]
        k, v = op.upproj.project(latent[:, :rank], latent[:, rank:], arena.kv_buf, rope,
                                  joined=joined, v_padded=op.backend.needs_v_padded)
        cu = arena.cu_q[:seqs + 1]
        op.backend.attend_and_store(
            arena.q[:tokens], k, v, VarlenSeqs(cu, cu, max_q, max_q, cu_seqlens_q_host=self.host,
                                               cu_seqlens_k_host=self.host),
            arena.out[:tokens], arena.lse[:tokens], causal=True, softmax_scale=scale,
            k_rope=None if joined else latent[:, rank:])


class _PaddedIteration:
    """``count`` consecutive context iterations' launches, sized to a graph key and reading only
    static buffers; per iteration: the arena's offsets row ``counter`` -> gather of its rows ->
    the up-projection of them -> the backend's attention over ``seqs`` sequences (grid of
    ``max_q`` queries) merging into the arena's ``(out, lse)`` -> counter + 1. What a graph of the
    key records; eager on first sight.

    ``rows``: the iterations' row bucket (the gather's and ``torch.mm``'s size). ``host``
    (joined keys, ``count`` 1): the iteration's host offsets ``(cu_q, cu_k)``,
    from which the backend places its cuDNN rectangles (part of the key: ``launch_key``).
    ``att_seqs`` (a plan that shares prefixes): the attention runs over ``att_seqs`` sequences
    (a bucket) whose offsets are the arena's per-iteration ``seq_q`` / ``seq_k`` rows
    ``counter`` (``ChunkPlan.iteration_sequences``), not ``cu_q`` and the gather's offsets.
    """

    __slots__ = ("arena", "cache_spec", "host", "kv_cache", "launch", "op")

    def __init__(self, op: MLAChunkedPrefill, arena: Arena, kv_cache: torch.Tensor,
                 cache_spec: KVCacheSpec, seqs: int, max_q: int, rows: int, count: int,
                 scale: float, host: tuple[Any, Any] | None, *,
                 att_seqs: int = 0) -> None:
        self.op, self.arena, self.kv_cache, self.host = op, arena, kv_cache, host
        self.cache_spec = cache_spec
        self.launch = (seqs, max_q, rows, count, scale, att_seqs)

    def __call__(self) -> None:
        arena, op, kv_cache = self.arena, self.op, self.kv_cache
        seqs, max_q, rows, count, scale, att_seqs = self.launch
        joined = self.host is not None
        rank, v_padded = op.kv_lora_rank, op.backend.needs_v_padded
        cq, ck = self.host if joined else (None, None)
        for _ in range(count):
            cu = arena.cu_k[:, :seqs + 1].index_select(0, arena.counter)[0]
            starts = arena.starts[:, :seqs].index_select(0, arena.counter)[0]
            if att_seqs:
                cu_q = arena.seq_q[:, :att_seqs + 1].index_select(0, arena.counter)[0]
                cu_att = arena.seq_k[:, :att_seqs + 1].index_select(0, arena.counter)[0]
            else:
                cu_q, cu_att = arena.cu_q[:seqs + 1], cu
            latent = gather_context_rows_with_spec(kv_cache, self.cache_spec,
                                                   arena.block_table[:seqs], cu, starts,
                                                   arena.workspace, rows, use_kernel=True)
            seqs_i = VarlenSeqs(cu_q, cu_att, max_q, rows, cu_seqlens_q_host=cq,
                                cu_seqlens_k_host=ck)
            k_i, v_i = op.backend.project_context(op.upproj, latent[:, :rank], latent[:, rank:],
                                                  arena.kv_buf, seqs_i, joined=joined,
                                                  v_padded=v_padded)
            op.backend.attend_and_merge(arena.q, k_i, v_i, seqs_i,
                                        arena.out, arena.lse, causal=False, softmax_scale=scale,
                                        k_rope=None if joined else latent[:, rank:])
            arena.counter.add_(1)


class _ArenaReplay:
    """One forward's launches, run as replays of cached CUDA graphs.

    The arena holds ``max_rows`` latent rows and compute-dtype keys and values for
    ``kv_rows`` (default ``max_rows``: the rows of the calls that write them, from
    :meth:`~mlaprefill.backends.AttentionBackend.context_writes_buffer`). On construction,
    copies the forward's queries (unless they are the arena's own:
    :meth:`MLAChunkedPrefill.io_buffers`) and new latent rows into the
    :class:`~mlaprefill.graphs.IterationGraphs` arena, and the plan's offsets (padded to the
    bucketed sequence count: padded sequences get no queries and no keys) and block table unless
    the arena holds them already: the previous forward through this arena (e.g. the previous
    layer of the step) ran the same DevicePlan object, whose tensors staging never changes (a
    new upload makes a new DevicePlan); the block table only when it is one of the DevicePlan's
    tensors too (a caller's own block table may have changed in place: always copied).
    ``new_tokens(tokens, host)`` runs the new tokens' stage (:class:`_NewTokens`),
    ``run(i, rows, count)`` iterations ``i .. i + count - 1`` as one
    :class:`_PaddedIteration` of ``rows`` rows each (their row bucket). The first time a forward
    object meets a graph key its launches run eagerly (that loads every kernel) and the key is
    queued for capture; it is captured at the next ``capture_pending`` (until that is first
    called: at its second sight), then replayed, in this forward and the next ones with the same
    key. ``result()`` copies the arena's ``(out, lse)`` out (into the caller's ``out`` /
    ``lse``, or new tensors), unless the caller's are the arena's own. On a device without CUDA
    graphs the padded launches always run eagerly.
    """

    #: The plan shares prefixes: iterations' attention reads its own sequences (``arena.seq_q``,
    #: ``arena.seq_k``).
    shared_plan = False

    def __init__(self, op: MLAChunkedPrefill, q: torch.Tensor, kv_c_new: torch.Tensor,
                 k_pe_new: torch.Tensor, kv_cache: torch.Tensor, cache_spec: KVCacheSpec,
                 block_table: torch.Tensor, device_plan: DevicePlan, rope: int, scale: float,
                 tokens: int, max_rows: int, kv_rows: int | None = None) -> None:
        assert op.graphs is not None
        shared, plan = op.graphs, device_plan.chunk_plan
        num_tokens, num_seqs, num_iters = plan.num_query_tokens, plan.num_reqs, plan.num_iterations
        seqs = pow2_at_least(num_seqs)
        max_q = pow2_at_least(plan.max_query_len, MIN_QUERY_BUCKET)
        qk, rank = op.qk_nope_head_dim + rope, op.kv_lora_rank
        device = q.device
        arena = self.arena = layer_arena(
            op, {"tokens": tokens, "seqs": seqs, "iters": num_iters,
                 "blocks": block_table.shape[1], "rows": max_rows,
                 "kv": op.upproj.kv_numel(max_rows if kv_rows is None else kv_rows, qk,
                                          op.backend.needs_v_padded)},
            device, q.dtype, rope)
        # Inputs in (device copies, stream ordered after the previous forward's replays); q
        # not when it is the arena's own (io_buffers): q is contiguous, of num_tokens rows.
        if q.data_ptr() != arena.q.data_ptr():
            arena.q[:num_tokens].copy_(q)
        arena.workspace[:num_tokens, :rank].copy_(kv_c_new)
        arena.workspace[:num_tokens, rank:].copy_(k_pe_new)
        staged = device_plan.tensors
        cu_q, cu_k, starts = staged["cu_query_lens"], staged["cu_seq_lens"], staged["chunk_starts"]
        if arena.offsets_from is not device_plan:
            arena.offsets_from = device_plan
            arena.cu_q[:num_seqs + 1].copy_(cu_q)
            arena.cu_k[:num_iters, :num_seqs + 1].copy_(cu_k)
            # Padded sequences, up to the arena's capacity (so a graph of a bigger sequence
            # bucket can stand in): empty, at the end of the queries and keys.
            cap = arena.cu_q.shape[0] - 1
            if cap > num_seqs:
                arena.cu_q[num_seqs + 1:].fill_(num_tokens)
                arena.cu_k[:num_iters, num_seqs + 1:].copy_(
                    cu_k[:, num_seqs:].expand(num_iters, cap - num_seqs))
            arena.starts[:num_iters, :num_seqs].copy_(starts)
            if plan.shares_prefixes:  # padded as cu_q / cu_k: empty sequences at the end
                seq_k = staged["iteration_cu_seq_lens"]
                arena.seq_q[:num_iters, :num_seqs + 1].copy_(staged["iteration_cu_query_lens"])
                arena.seq_k[:num_iters, :num_seqs + 1].copy_(seq_k)
                if cap > num_seqs:
                    arena.seq_q[:num_iters, num_seqs + 1:].fill_(num_tokens)
                    arena.seq_k[:num_iters, num_seqs + 1:].copy_(
                        seq_k[:, num_seqs:].expand(num_iters, cap - num_seqs))
        # A caller's block table may have changed since; a DevicePlan's tensors do not.
        staged_table = any(t is block_table for t in staged.values())
        if not staged_table or arena.table_from is not device_plan:
            arena.table_from = device_plan if staged_table else None
            arena.block_table[:block_table.shape[0], :block_table.shape[1]].copy_(block_table)
        self.op, self.shared, self.device = op, shared, device
        self.use_graphs = device.type == "cuda"
        self.num_tokens = num_tokens
        self.kv_cache, self.cache_spec = kv_cache, cache_spec
        self.launch = (seqs, max_q, rope, scale)
        self.shared_plan = plan.shares_prefixes
        self.key = (seqs, max_q, rope, scale, op.backend.name, kv_cache.data_ptr(),
                    tuple(kv_cache.shape), tuple(kv_cache.stride()), kv_cache.dtype,
                    cache_spec.key)

    def new_tokens(self, tokens: int, joined: VarlenSeqs | None) -> None:
        """The new tokens' stage over ``tokens`` rows (their bucket); ``joined``: their
        VarlenSeqs (the plan's host offsets) when the backend wants joined keys for it."""
        op = self.op
        seqs, max_q, rope, scale = self.launch
        host = None if joined is None else joined.cu_seqlens_q_host
        key = (*self.key, tokens, "new") if joined is None else (
            *self.key, tokens, "new", op.backend.launch_key(joined, op.num_heads, True))
        self._launch(key, lambda: _NewTokens(op, self.arena, seqs, max_q, tokens, rope, scale,
                                             host), stand_in=joined is None)

    def run(self, i: int, rows: int, count: int = 1, joined: VarlenSeqs | None = None, *,
            grid: tuple[int, int] | None = None) -> None:
        """Iterations ``i .. i + count - 1`` of split keys padded to ``rows`` rows each; or
        iteration ``i`` with ``joined``, its VarlenSeqs (with the plan's host offsets), when the
        backend wants joined keys for it. ``grid``: the iterations' attention (sequences,
        queries) buckets, in a plan that shares prefixes (default the new tokens')."""
        arena, op = self.arena, self.op
        seqs, max_q, _, scale = self.launch
        att_seqs = 0
        base = self.key
        if self.shared_plan and grid is not None:
            att_seqs, max_q = grid
            # the attention's buckets lead (stand-ins compare them); the gather's seqs stay
            base = (att_seqs, max_q, *self.key[2:], ("shared", seqs))
        key = (*base, rows, count) if joined is None else (
            *base, rows, count, "joined", op.backend.launch_key(joined, op.num_heads, False))
        host = None if joined is None else (joined.cu_seqlens_q_host, joined.cu_seqlens_k_host)
        if arena.next != i:
            arena.counter.fill_(i)
        arena.next = -1  # unknown, should the launches below raise
        extra = {"att_seqs": att_seqs} if att_seqs else {}  # (the plain launch as it was)
        self._launch(key, lambda: _PaddedIteration(op, arena, self.kv_cache, self.cache_spec,
                                                   seqs, max_q, rows, count, scale, host,
                                                   **extra),
                     stand_in=joined is None)
        arena.next = i + count  # each iteration added one to the counter

    def result(self, lse_dtype: torch.dtype, return_lse: bool, out: torch.Tensor | None,
               lse: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward's ``out`` (and ``lse``) from the arena: copied into the given tensors (or
        new ones), no copy where they are the arena's own (``io_buffers``: checked by address;
        the shapes were checked against the plan)."""
        t = self.num_tokens
        arena_out, arena_lse = self.arena.out[:t], self.arena.lse[:t]
        if out is None:
            out = arena_out.clone()
        elif out.data_ptr() != arena_out.data_ptr():
            out.copy_(arena_out)
        if not return_lse:
            return out
        if lse is None:
            lse = arena_lse.to(lse_dtype, copy=True)
        elif lse.data_ptr() != arena_lse.data_ptr():
            lse.copy_(arena_lse)
        return out, lse

    def _launch(self, key: tuple[Any, ...], make: Callable[[], Any], *,
                stand_in: bool = False) -> None:
        """Replay ``key``'s graph; at its first sight run ``make()``'s launches eagerly and
        queue the key (or capture it here, at its second sight, until capture_pending runs).
        ``stand_in`` (the new tokens' stage, or split-key iterations sized to a row bucket
        ``key[-2]``): instead of running eagerly, replay a captured graph of the same launches
        over bigger buckets (:meth:`~mlaprefill.graphs.LayerGraphs.stand_in`): the extra
        sequences are empty, the extra query blocks exit, the extra rows are never attended
        (the gather leaves them alone): the same result for a little more work, this once."""
        layer = self.op.layer_graphs
        seen, graph = layer.lookup(key, self.arena.generation)
        if graph is None or graph is EAGER:
            padded = make()
            if (not self.use_graphs or not seen or graph is EAGER
                    or not self.shared.captures_in_forward):
                # first sight of this key (real work, and loads every kernel), its capture left
                # to capture_pending, or a key that cannot be captured
                other = (layer.stand_in(key)
                         if stand_in and self.use_graphs and graph is not EAGER else None)
                if other is not None:
                    other.replay()
                    self.shared.replays += 1
                    self.shared.stand_ins += 1
                else:
                    padded()
                    self.shared.warm_runs += 1
                if self.use_graphs and graph is not EAGER:
                    layer.store(key, None)
                    self.shared.defer(layer, key, self.device, padded)
                return
            graph = self.shared.capture(self.device, padded)
            layer.store(key, graph)
            if graph is EAGER:
                padded()
                self.shared.warm_runs += 1
                return
        graph.replay()
        self.shared.replays += 1

