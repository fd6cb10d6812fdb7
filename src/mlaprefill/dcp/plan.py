"""DCP chunk planning: the single-rank ChunkPlan plus each rank's local share (pure CPU).

Every rank plans from the *global* lengths with the normal :class:`~mlaprefill.plan.ChunkPlanner`
(deterministic, so every rank gets the same iterations), then derives, with array ops only:

* this rank's local share of every piece: the tokens a rank owns in a global range ``[s, e)``
  have contiguous local indices ``[count(s), count(e))`` (see
  :func:`~mlaprefill.dcp.layout.dcp_local_count`), so the share is again one contiguous piece
  per request, in local indices — the plain paged gather works on the local cache;
* ``rank_capacity[i]``: the largest share of iteration ``i`` over ranks; every rank pads its
  share to it so one ``all_gather_into_tensor`` with equal sizes brings all shares everywhere
  (rank-major: rank 0's rows, then rank 1's, ...);
* ``reorder_base[i, r, k]``: where rank ``k``'s share of piece ``(i, r)`` sits in the gathered
  buffer, shifted by its first local index. With it the device finds the gathered row of every
  workspace row (global order, as the single-rank plan lays it out) with a few integer ops
  (:func:`mlaprefill.dcp.forward.reorder_rows_index`), so what ships is O(world x iterations x
  requests), not one entry per context token. ``reorder_index`` (the per-token table) stays
  available on the host, on demand.

Memory bound: the gathered buffer (``world * rank_capacity[i]`` rows, padding included) must
fit ``max_gathered_tokens`` (default ``workspace_tokens``). Shares are not always balanced (a
page-aligned piece can start mid-cycle), so when the plan at ``workspace_tokens`` overflows, the
base plan is redone with a smaller workspace, by whole pages, until it fits; if even one page
does not fit, ``ValueError``.
(When no replanning is needed — balanced shares, e.g. one long request — the iterations are
exactly the single-rank ones and the DCP output is bitwise the single-rank output.)

Host cost: O(world * num_iterations * num_reqs), like the single-rank plan; nothing per token.
The on-demand host ``reorder_index`` is O(context tokens): about a dozen contiguous int32 numpy
passes for small ``I``, two passes plus per-run work for ``I >= 8``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlaprefill.batch import PrefillBatch
from mlaprefill.dcp.layout import check_dcp_config, dcp_local_context_lens, dcp_local_count
from mlaprefill.plan import ChunkPlan, ChunkPlanner, _token_to_seq
from mlaprefill.prefix import MIN_SAVED_ROWS

__all__ = ["DCPChunkPlan", "DCPChunkPlanner", "dcp_config_digest", "derive_dcp_arrays"]

_MAX_REPLANS = 64
# From this interleave on, the reorder index is built per run of I rows (see _reorder_by_runs).
_RUNS_MIN_INTERLEAVE = 8


def _local_shares(starts: np.ndarray, lens: np.ndarray, *, world: int,
                  interleave: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's share of every piece: O(world * num_iterations * num_reqs), no per-token work.

    Returns ``lo`` (local start), ``local_lens``, ``local_cu`` ([world, K, R(+1)], int64) and
    ``capacity`` [K] (largest share total of each iteration over ranks).
    """
    n_it, n_req = starts.shape
    ranks = np.arange(world, dtype=np.int64)[:, None, None]
    lo = dcp_local_count(starts[None], ranks, world=world, interleave=interleave)
    hi = dcp_local_count((starts + lens)[None], ranks, world=world, interleave=interleave)
    local_lens = hi - lo  # [world, K, R]
    local_cu = np.zeros((world, n_it, n_req + 1), dtype=np.int64)
    np.cumsum(local_lens, axis=2, out=local_cu[:, :, 1:])
    capacity = local_cu[:, :, -1].max(axis=0) if n_it else np.zeros(0, np.int64)
    return lo, local_lens, local_cu, capacity


def _reorder_base(lo: np.ndarray, local_cu: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """int64 [K, R, world]: ``k * capacity[i] + local_cu[k, i, r] - lo[k, i, r]``.

    The gathered-buffer row of context token ``t`` of piece ``(i, r)`` is this value at its
    owner ``k = (t // I) % world`` plus its local index ``(t // (I*world))*I + t % I``.
    """
    world = lo.shape[0]
    n_req = lo.shape[2]
    return np.moveaxis(np.arange(world, dtype=np.int64)[:, None, None] * capacity[None, :, None]
                       + local_cu[:, :, :n_req] - lo, 0, -1)


def _reorder_index(starts: np.ndarray, lens: np.ndarray, cu: np.ndarray, lo: np.ndarray,
                   local_cu: np.ndarray, capacity: np.ndarray, *, world: int, interleave: int,
                   width: int) -> np.ndarray:
    """int32 [K, width]: gathered-buffer row of every workspace row (padding rows 0).

    Row ``j`` of piece ``(i, r)`` is context token ``t = starts[i, r] + j``, owned by rank
    ``k = (t // I) % world`` at local index ``l``; rank k's share of the piece sits in the
    gathered buffer from ``k * capacity[i] + local_cu[k, i, r]`` on and starts at local index
    ``lo[k, i, r]``, so the row is ``base[i, r, k] + l`` with a small per-(piece, rank) table.
    Per token: contiguous passes only (repeats of per-piece values, a few int64 ops, one
    gather from the small table) — no scatter, no per-token 2-D indexing.
    """
    n_it, n_req = starts.shape
    if n_it == 0 or width == 0:
        return np.zeros((n_it, width), dtype=np.int32)
    # Segments of the flat [K * width] output: the R pieces of each iteration, then its padding.
    counts = np.empty((n_it, n_req + 1), dtype=np.int64)
    counts[:, :n_req] = lens
    counts[:, n_req] = width - cu[:, -1]
    counts = counts.ravel()
    first_row = np.cumsum(counts) - counts  # flat output row where each segment starts
    # token of a row = row + (segment start token - segment first row); padding: anything >= 0
    tok_start = np.zeros((n_it, n_req + 1), dtype=np.int64)
    tok_start[:, :n_req] = starts
    tok_shift = tok_start.ravel() - first_row
    # table[seg] = _reorder_base of the piece; padding rows -> 0
    table = np.zeros((n_it, n_req + 1, world), dtype=np.int64)
    table[:, :n_req, :] = _reorder_base(lo, local_cu, capacity)
    table = table.reshape(-1, world)
    valid = np.ones((n_it, n_req + 1), dtype=np.int64)
    valid[:, n_req] = 0
    if interleave >= _RUNS_MIN_INTERLEAVE:
        return _reorder_by_runs(counts, first_row, tok_start.ravel(), valid.ravel(), table,
                                world=world, interleave=interleave).reshape(n_it, width)
    seg_rows = np.arange(counts.size, dtype=np.intp) * world  # table row offset per segment

    # int32 (PrefillBatch bounds lengths by INT32_MAX) and in-place ops: at 10^5..10^6 rows the
    # cost is allocation/page faults as much as arithmetic.
    n = n_it * width
    tok = np.repeat(tok_shift.astype(np.int32), counts)
    scratch = np.arange(n, dtype=np.int32)
    tok += scratch
    np.maximum(tok, 0, out=tok)  # padding rows may go negative; their result is zeroed below
    if interleave == 1:
        unit = tok
    else:
        unit = np.floor_divide(tok, interleave, out=scratch)
        tok -= unit * np.int32(interleave)  # tok = position inside the interleave unit
    cycle = np.floor_divide(unit, world)
    owner = np.remainder(unit, world, out=unit)
    np.multiply(cycle, interleave, out=cycle)
    local = cycle if interleave == 1 else np.add(cycle, tok, out=cycle)
    owner += np.repeat(seg_rows.astype(np.int32), counts)
    index = np.take(table.ravel().astype(np.int32), owner)
    index += local
    index *= np.repeat(valid.ravel().astype(np.int32), counts)
    return index.reshape(n_it, width)


def _reorder_by_runs(counts: np.ndarray, first_row: np.ndarray, tok_start: np.ndarray,
                     valid: np.ndarray, table: np.ndarray, *, world: int,
                     interleave: int) -> np.ndarray:
    """Flat reorder index built from *runs* (large ``I``): two passes per row instead of ~12.

    Inside one interleave unit of a piece the gathered rows are consecutive, so the output is
    piecewise ``value + (row - run start)``: per run (``~rows / I`` of them) compute the value at
    its start, then ``cumsum`` of a delta array that is the slope (1, or 0 on padding) with a
    jump at each run start. Segments are the pieces and padding of ``_reorder_index``.
    """
    i = interleave
    seg_end = tok_start + counts
    q0 = tok_start // i
    runs = np.where(valid == 1, (seg_end - 1) // i - q0 + 1, 1)  # a padding segment: one run
    runs[counts == 0] = 0
    run_seg = np.repeat(np.arange(counts.size, dtype=np.int64), runs)
    u = np.arange(run_seg.size, dtype=np.int64) - (np.cumsum(runs) - runs)[run_seg]
    q = q0[run_seg] + u  # interleave unit of the run
    seg_start = tok_start[run_seg]
    run_valid = valid[run_seg]
    t0 = np.maximum(seg_start, q * i)
    t1 = np.where(run_valid == 1, np.minimum(seg_end[run_seg], (q + 1) * i), seg_end[run_seg])
    run_len = t1 - t0
    # value at the run start; padding: q = 0, t0 = 0 and a zero table row give 0
    value0 = table[run_seg, q % world] + (q // world) * i + (t0 - q * i)
    end_value = value0 + (run_len - 1) * run_valid
    jump = value0.copy()
    jump[1:] -= end_value[:-1]
    delta = np.repeat(run_valid.astype(np.int32), run_len)
    delta[first_row[run_seg] + (t0 - seg_start)] = jump
    return np.cumsum(delta, dtype=np.int32, out=delta)


def derive_dcp_arrays(chunk_starts: np.ndarray, chunk_lens: np.ndarray,
                      cu_seq_lens: np.ndarray, *, world: int, interleave: int,
                      rank: int, max_iteration_tokens: int,
                      shares: tuple[np.ndarray, ...] | None = None,
                      token_tables: bool = False) -> dict[str, Any]:
    """Per-rank local arrays and the reorder table from a single-rank chunk layout.

    Parameters
    ----------
    chunk_starts, chunk_lens : int [num_iterations, num_reqs]
        Global pieces of the base plan.
    cu_seq_lens : int [num_iterations, num_reqs + 1]
        Workspace offsets of the pieces (global workspace order).
    world, interleave, rank : int
        DCP layout and the rank whose local arrays to return.
    max_iteration_tokens : int
        Width of the per-token reorder index (the base plan's ``max_iteration_tokens``).
    shares : tuple, optional
        ``_local_shares(...)`` of these pieces if already computed.
    token_tables : bool
        Also build the per-token tables (O(context tokens) host work).

    Returns
    -------
    dict with np.int32 arrays ``local_chunk_starts``/``local_chunk_lens`` [num_iterations,
    num_reqs], ``local_cu_seq_lens`` [num_iterations, num_reqs + 1], ``reorder_base``
    [num_iterations, num_reqs, world], np.int64 ``local_totals`` [world, num_iterations] and
    ``rank_capacity`` [num_iterations]; with ``token_tables`` also ``local_token_to_seq``
    [num_iterations, max_rank_capacity] and ``reorder_index`` [num_iterations,
    max_iteration_tokens] (int32, padding 0).
    """
    starts = np.asarray(chunk_starts, dtype=np.int64)
    lens = np.asarray(chunk_lens, dtype=np.int64)
    if shares is None:
        shares = _local_shares(starts, lens, world=world, interleave=interleave)
    lo, local_lens, local_cu, capacity = shares
    out = {
        "local_chunk_starts": lo[rank].astype(np.int32),
        "local_chunk_lens": local_lens[rank].astype(np.int32),
        "local_cu_seq_lens": local_cu[rank].astype(np.int32),
        "reorder_base": _reorder_base(lo, local_cu, capacity).astype(np.int32),
        "local_totals": local_cu[:, :, -1],
        "rank_capacity": capacity.astype(np.int64),
    }
    if token_tables:
        cu = np.asarray(cu_seq_lens, dtype=np.int64)
        out["local_token_to_seq"] = _token_to_seq(local_lens[rank], local_cu[rank, :, -1],
                                                  int(capacity.max(initial=0)))
        out["reorder_index"] = _reorder_index(starts, lens, cu, lo, local_cu, capacity,
                                              world=world, interleave=interleave,
                                              width=max_iteration_tokens)
    return out


def dcp_config_digest(batch: PrefillBatch, *, world: int, interleave: int,
                      workspace_tokens: int, policy: str,
                      max_gathered_tokens: int | None = None) -> tuple[int, int, int]:
    """Three 62-bit checksums (query_lens, context_lens, config) that must agree on all ranks."""

    def h(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2

    config = (f"{world}/{interleave}/{workspace_tokens}/{batch.page_size}/{policy}/"
              f"{max_gathered_tokens or workspace_tokens}").encode()
    return (h(np.ascontiguousarray(batch.query_lens, dtype=np.int64).tobytes()),
            h(np.ascontiguousarray(batch.context_lens, dtype=np.int64).tobytes()),
            h(config))


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare to_json() instead
class DCPChunkPlan:
    """A :class:`~mlaprefill.plan.ChunkPlan` plus one rank's DCP arrays (host data only).

    A :class:`~mlaprefill.plan.StagedPlan`: the forward reads its host ints from ``chunk_plan``
    (= ``base``). ``base.workspace_tokens`` may be smaller than ``workspace_tokens`` (see the
    module docstring).

    Attributes
    ----------
    base : ChunkPlan
        Single-rank plan of the global lengths (identical on every rank).
    world, rank, interleave : int
    workspace_tokens : int
        Requested workspace; bounds the base plan's iterations (and, by default, the
        gathered rows).
    local_chunk_starts, local_chunk_lens : np.int32 [num_iterations, num_reqs]
        This rank's share of each piece, in local token indices.
    local_cu_seq_lens : np.int32 [num_iterations, num_reqs + 1]
        Offsets of the shares in this rank's local buffer.
    reorder_base : np.int32 [num_iterations, num_reqs, world]
        Gathered-buffer row of rank ``k``'s share of piece ``(i, r)`` minus its first local
        index (see :func:`~mlaprefill.dcp.forward.reorder_rows_index`).
    local_token_to_seq : np.int32 [num_iterations, max_rank_capacity] (property, built on access)
        Request of each local buffer row (padding 0): O(context) host work, for inspection.
    reorder_index : np.int32 [num_iterations, max_iteration_tokens] (property, built on access)
        Row of the gathered buffer ``[world * rank_capacity[i], latent_dim]`` holding each
        workspace row (padding 0): O(context) host work; the device derives it from
        ``reorder_base``.
    rank_capacity : tuple[int, ...]
        Rows every rank contributes to the all-gather of iteration ``i`` (max share over ranks).
    local_iteration_tokens : tuple[int, ...]
        This rank's real rows per iteration (<= rank_capacity).
    local_context_lens : np.int64 [num_reqs]
        This rank's local context length per request (its block table must cover these).
    digest : tuple[int, int, int]
        Checksums of (query_lens, context_lens, config) for the cross-rank debug check.
    """

    base: ChunkPlan
    world: int
    rank: int
    interleave: int
    workspace_tokens: int
    local_chunk_starts: np.ndarray = field(repr=False)
    local_chunk_lens: np.ndarray = field(repr=False)
    local_cu_seq_lens: np.ndarray = field(repr=False)
    reorder_base: np.ndarray = field(repr=False)
    rank_capacity: tuple[int, ...]
    local_iteration_tokens: tuple[int, ...]
    local_context_lens: np.ndarray = field(repr=False)
    digest: tuple[int, int, int]

    @property
    def chunk_plan(self) -> ChunkPlan:
        """The single-rank plan of the global lengths (the StagedPlan contract)."""
        return self.base

    @property
    def max_rank_capacity(self) -> int:
        """Largest per-rank share of any iteration (size of the local buffer)."""
        return max(self.rank_capacity, default=0)

    @property
    def max_gathered_tokens(self) -> int:
        """Largest all-gather output in rows: ``world * max_rank_capacity`` (<= workspace)."""
        return self.world * self.max_rank_capacity

    def _token_tables(self) -> dict[str, Any]:
        return derive_dcp_arrays(
            self.base.chunk_starts, self.base.chunk_lens, self.base.cu_seq_lens,
            world=self.world, interleave=self.interleave, rank=self.rank,
            max_iteration_tokens=self.base.max_iteration_tokens, token_tables=True)

    @property
    def local_token_to_seq(self) -> np.ndarray:
        """int32 [num_iterations, max_rank_capacity], built now (see the class docstring)."""
        return self._token_tables()["local_token_to_seq"]

    @property
    def reorder_index(self) -> np.ndarray:
        """int32 [num_iterations, max_iteration_tokens], built now (see the class docstring)."""
        return self._token_tables()["reorder_index"]

    def device_arrays(self, *, token_tables: bool = False) -> dict[str, np.ndarray]:
        """The base plan's arrays followed by the DCP ones (all np.int32), in staging order.

        O(world x num_iterations x num_reqs) integers; with ``token_tables=True`` also the
        per-token tables (the base plan's ``token_to_seq``, ``local_token_to_seq`` and
        ``reorder_index``), which the forward does not need.
        """
        out = dict(self.base.device_arrays(token_tables=token_tables))
        for name in ("local_chunk_starts", "local_chunk_lens", "local_cu_seq_lens",
                     "reorder_base"):
            out[name] = getattr(self, name)
        if token_tables:
            tables = self._token_tables()
            out["local_token_to_seq"] = tables["local_token_to_seq"]
            out["reorder_index"] = tables["reorder_index"]
        return out

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary: the base plan's plus the DCP fields."""
        out = dict(self.base.to_json())
        out["dcp"] = {
            "world": self.world, "rank": self.rank, "interleave": self.interleave,
            "workspace_tokens": self.workspace_tokens,
            "base_workspace_tokens": int(self.base.workspace_tokens),
            "rank_capacity": list(self.rank_capacity),
            "local_iteration_tokens": list(self.local_iteration_tokens),
            "local_context_lens": self.local_context_lens.tolist(),
        }
        return out


class DCPChunkPlanner:
    """Plan chunked-context prefill for a token-sharded (DCP) cache.

    Parameters
    ----------
    workspace_tokens : int
        Rows of the context workspace; also bounds the all-gathered rows of an iteration.
    page_size : int
        Page size of the *local* caches (the base plan splits pieces at page boundaries).
    world : int
        Number of DCP ranks (>= 1).
    interleave : int
        Tokens per interleave unit ``I`` (>= 1).
    policy : {"packed", "equal", "balanced"}
        Base planner policy.
    max_gathered_tokens : int, optional
        Bound on the all-gathered rows of an iteration (``world * rank_capacity[i]``, padding
        included); default ``workspace_tokens``. A larger bound (e.g. ``2 * workspace_tokens``)
        trades a bigger gather buffer for never replanning: the iterations are then always the
        single-rank ones.
    share_prefixes : bool
        Default False. True: prefix sharing (:mod:`mlaprefill.prefix`) from the batch's host
        ``block_table``, which must then be **the same table on every rank** (the global one,
        or local tables whose ids the engine allocates alike on every rank): the ranks must plan
        the same iterations, and each sees only its own local table otherwise. Shared rows are
        then gathered (each rank its share), all-gathered and up-projected once. Not checked by
        ``validate`` (a table that differs across ranks hangs the all-gather).
    min_saved_rows : int
        As :class:`~mlaprefill.plan.ChunkPlanner`'s (with ``share_prefixes``).

    Raises
    ------
    ValueError
        For non-positive ``world``/``interleave`` (at construction) and, in :meth:`plan`, when
        no plan fits the gathered rows of an iteration into ``workspace_tokens``.
    """

    def __init__(self, workspace_tokens: int, page_size: int, *, world: int, interleave: int,
                 policy: str = "packed", max_gathered_tokens: int | None = None,
                 share_prefixes: bool = False, min_saved_rows: int = MIN_SAVED_ROWS) -> None:
        check_dcp_config(world, interleave)
        # (checks share_prefixes and min_saved_rows with the base planner's messages below)
        self.share_prefixes, self.min_saved_rows = share_prefixes, min_saved_rows
        # Validates workspace_tokens/page_size/policy with the base planner's own messages.
        ChunkPlanner(workspace_tokens, page_size, policy=policy, share_prefixes=share_prefixes,
                     min_saved_rows=min_saved_rows)
        limit = workspace_tokens if max_gathered_tokens is None else max_gathered_tokens
        if isinstance(limit, bool) or not isinstance(limit, int | np.integer) or limit <= 0:
            raise ValueError(f"max_gathered_tokens must be a positive int or None, got "
                             f"{max_gathered_tokens!r}")
        self.max_gathered_tokens = int(limit)
        self.workspace_tokens = int(workspace_tokens)
        self.page_size = int(page_size)
        self.world = int(world)
        self.interleave = int(interleave)
        self.policy = policy

    def plan(self, batch: PrefillBatch, *, rank: int) -> DCPChunkPlan:
        """Plan ``batch`` (global lengths) for ``rank``; pure CPU, deterministic.

        Never touches a device. Every rank computes the same base plan, capacities and reorder
        index; only the ``local_*`` arrays differ.
        """
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not (
                0 <= rank < self.world):
            raise ValueError(f"rank must be an int in [0, world={self.world}), got {rank!r}")
        if batch.page_size != self.page_size:
            raise ValueError(
                f"batch.page_size={batch.page_size} but the planner has page_size="
                f"{self.page_size}; build both with the local cache's page size."
            )
        w = self.workspace_tokens
        limit = self.max_gathered_tokens
        bound = f"workspace_tokens={w}" if limit == w else f"max_gathered_tokens={limit}"
        base_w = prev_w = w
        gathered = 0
        for _ in range(_MAX_REPLANS):
            try:
                # Prefix sharing only on request: each rank sees its own local block table, so
                # sharing found on one rank need not hold on another, and every rank must plan
                # the same iterations (a mismatch would hang the all-gather).
                base = ChunkPlanner(base_w, self.page_size, policy=self.policy,
                                    share_prefixes=self.share_prefixes,
                                    min_saved_rows=self.min_saved_rows).plan(batch)
            except ValueError as exc:
                if base_w == w:
                    raise
                raise ValueError(
                    f"{bound} cannot hold the all-gathered rows of one iteration "
                    f"(world={self.world}, dcp_interleave={self.interleave}: shares padded to "
                    f"the largest rank need {gathered} rows at base workspace {prev_w}, and a "
                    f"{base_w}-token base workspace fails: {exc}); increase {bound.split('=')[0]}, "
                    f"lower dcp_interleave, or use policy='packed'."
                ) from None
            # Capacities only (no per-token work) until the plan fits.
            shares = _local_shares(base.chunk_starts.astype(np.int64),
                                   base.chunk_lens.astype(np.int64), world=self.world,
                                   interleave=self.interleave)
            gathered = self.world * int(shares[3].max(initial=0))
            if gathered <= limit:
                break
            if base_w <= self.page_size:
                raise ValueError(
                    f"{bound} cannot hold the all-gathered rows of one iteration "
                    f"(world={self.world} x per-rank capacity, padding included, needs "
                    f"{gathered} rows even with a {self.page_size}-token base workspace); "
                    f"increase {bound.split('=')[0]} to at least world * page_size = "
                    f"{self.world * self.page_size}."
                )
            excess = gathered - limit
            prev_w = base_w
            base_w = max(self.page_size,
                         base_w - -(-excess // self.page_size) * self.page_size)
        else:  # pragma: no cover - replanning shrinks by >= one page each time
            raise ValueError(f"could not fit the DCP plan into workspace_tokens={w}")
        arrays = derive_dcp_arrays(
            base.chunk_starts, base.chunk_lens, base.cu_seq_lens, world=self.world,
            interleave=self.interleave, rank=int(rank),
            max_iteration_tokens=int(base.max_iteration_tokens), shares=shares)
        totals = arrays["local_totals"]
        return DCPChunkPlan(
            base=base, world=self.world, rank=int(rank), interleave=self.interleave,
            workspace_tokens=w,
            local_chunk_starts=arrays["local_chunk_starts"],
            local_chunk_lens=arrays["local_chunk_lens"],
            local_cu_seq_lens=arrays["local_cu_seq_lens"],
            reorder_base=arrays["reorder_base"],
            rank_capacity=tuple(int(c) for c in arrays["rank_capacity"]),
            local_iteration_tokens=tuple(int(c) for c in totals[int(rank)]),
            local_context_lens=dcp_local_context_lens(
                batch.context_lens, world=self.world, interleave=self.interleave)[int(rank)],
            digest=dcp_config_digest(batch, world=self.world, interleave=self.interleave,
                                     workspace_tokens=w, policy=self.policy,
                                     max_gathered_tokens=limit),
        )
