"""Chunk planning: which context tokens each workspace iteration gathers (pure CPU).

``ChunkPlanner.plan(batch)`` is a pure, deterministic function of the batch lengths and the
planner settings. It uses numpy only (no torch, no device), never synchronizes, and computes every
host integer the forward needs, so the device side never reads device memory to decide a shape.

Policies
--------
``equal`` (vLLM-compatible)
    With ``n`` = requests that have context, ``chunk = floor(W / n)`` rounded down to a multiple of
    ``page_size``; ``num_chunks = ceil(max(context_lens) / chunk)``; chunk ``c`` of request ``i``
    covers ``[c*chunk, min((c+1)*chunk, context_lens[i]))``. As in vLLM, ``chunk_starts[c, i] =
    c*chunk`` for every request (also past its end) and empty pieces have ``chunk_lens`` 0.

``packed`` (default, fewest iterations)
    The contexts form one stream ``[req0 ctx | req1 ctx | ...]``; each iteration is a contiguous
    segment of at most ``W`` tokens whose ends are *cut points*: request boundaries or page-aligned
    offsets inside a request. Greedy furthest-reach (from the current cut, jump to the last cut
    point ``<= cut + W``) is optimal among plans with this cut structure. Python loops over
    *iterations* (one ``bisect`` each), never over tokens or requests.

    Guarantees (the first is property-tested against ``equal`` and a brute-force optimum):

    * ``packed.num_iterations <= equal.num_iterations`` whenever ``equal`` is feasible. Proof:
      let ``c`` be equal's chunk, ``n`` the requests with context, ``K = ceil(max/c)``. Pad
      every such request to ``K*c`` tokens and cut the padded stream every ``n*c <= W`` tokens:
      each cut lands at offset ``c*(j*n - r*K)`` of some request ``r`` -- a multiple of ``c``,
      hence page-aligned -- or in padding, i.e. at a request boundary of the real stream. That
      is a stream plan with ``K`` segments of ``<= W`` real tokens each, and greedy
      furthest-reach is optimal among stream plans (its i-th cut is never behind any other
      plan's i-th cut), so it needs at most ``K``.
    * ``packed.num_iterations == ceil(sum(context_lens) / W)`` (the lower bound) when ``W`` and
      every ``context_lens[r]`` are multiples of ``page_size`` (no cut loses a token);
    * in general ``packed.num_iterations <= ceil(sum(context_lens) / (W - page_size + 1))``: every
      non-final iteration holds at least ``W - page_size + 1`` tokens (a cut inside a request
      loses fewer than ``page_size`` tokens of reach).

``balanced`` (few iterations, each request in every iteration until its last piece)
    Each request ``i`` advances by its own page-aligned chunk ``c_i = ceil_page(ceil(ctx_i / K))``
    per iteration from iteration 0, so it has a piece in every iteration until its context runs
    out (short contexts, whose chunk rounds up to a page, run out early). ``K`` is the
    smallest count whose first -- fullest -- iteration fits: ``sum(min(c_i, ctx_i)) <= W`` (found
    by bisection; that sum never grows with ``K``). Why: attention kernels without split-KV
    process a request's keys in one CTA per (query block, head); ``packed`` can put one long
    request alone into an iteration (few CTAs, long key loops), which with few heads (tensor
    parallelism) leaves most SMs idle. ``balanced`` keeps the most requests -- the most CTAs --
    in every iteration, and the longest request's chunk is about its context over ``K``.

    * ``balanced.num_iterations <= equal.num_iterations`` whenever ``equal`` is feasible: at
      ``K = equal``'s count every ``ctx_i / K <= c`` (equal's page-multiple chunk), so
      ``c_i <= c`` and ``sum(min(c_i, ctx_i)) <= n*c <= W``.
    * One iteration whenever ``sum(context_lens) <= W`` (at ``K = 1`` every ``min(c_i, ctx_i)``
      is ``ctx_i``).
    * When not even one page per request fits (``sum(min(page_size, ctx_i)) > W``), it returns
      ``packed``'s pieces (the plan's ``policy`` still says ``balanced``).

Prefix sharing (``share_prefixes=True``, the default, with a host block table in the batch):
rows that consecutive requests share are gathered and up-projected once and attended by all
their queries; each depth of the tree of shared runs (:mod:`mlaprefill.prefix`) is planned with
the policy as a batch of its own, and the attention of each iteration runs over request runs
(``ChunkPlan.iteration_sequences``). A batch without shared blocks gets the plain plan.

All policies: every context token is covered exactly once, a request's pieces appear in
increasing order over iterations, each request has at most one contiguous piece per iteration,
and no iteration exceeds ``W`` tokens. A batch without context has zero iterations (fast path).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mlaprefill.batch import INT32_MAX, PrefillBatch
from mlaprefill.prefix import (
    MIN_SAVED_ROWS,
    SharedTree,
    host_block_table,
    neighbour_shared_tokens,
    shared_tree,
)

__all__ = ["MAX_PLAN_ENTRIES", "MAX_TOKEN_TABLE_ENTRIES", "POLICIES", "ChunkPlan", "ChunkPlanner",
           "PlanTooLargeError", "StagedPlan", "check_token_table_size"]

POLICIES = ("equal", "packed", "balanced")

#: Most entries of a plan's [num_iterations, num_reqs + 1] arrays (64 MiB each as int32; the
#: planner's int64 temporaries are a few times that). Checked before they are allocated: a
#: step of 256 requests over a 2e9-token context in 64k-token iterations is ~7.8M entries.
MAX_PLAN_ENTRIES = 2**24
#: Most entries of one per-token table (``token_to_seq``: 1 GiB as int32), checked before it
#: is built on the host or on the device.
MAX_TOKEN_TABLE_ENTRIES = 2**28

# Names and order of the arrays staging ships to the device (see ChunkPlan.device_arrays):
# O(num_iterations x num_reqs) integers; the forward maps workspace rows to requests on the device.
_DEVICE_ARRAY_NAMES = ("cu_query_lens", "chunk_starts", "chunk_lens", "cu_seq_lens")


_INT32_ZERO = bytes(4)  # immutable: backs zero-stride all-zero int32 views


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@runtime_checkable
class StagedPlan(Protocol):
    """What staging uploads and the forward runs: a :class:`ChunkPlan`, or a plan built around one.

    ``chunk_plan`` holds every host integer the forward reads (iterations, lengths, offsets);
    ``device_arrays`` names the int32 arrays to ship, in order. :class:`ChunkPlan` itself,
    ``mlaprefill.dcp.DCPChunkPlan`` (plus one rank's DCP arrays) and the bench's ``StepPlan``
    (plus the engine's per-step arrays) implement it by composition.
    """

    @property
    def chunk_plan(self) -> ChunkPlan: ...

    def device_arrays(self, *, token_tables: bool = False) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """Host description of one prefill step's context chunks (all numpy int32, read-only).

    Attributes
    ----------
    policy : str
        ``"equal"``, ``"packed"`` or ``"balanced"`` (the planner's policy).
    workspace_tokens, page_size, num_reqs, num_iterations : int
    query_lens, context_lens : int32 [num_reqs]
    cu_query_lens : int32 [num_reqs + 1]
        Exclusive prefix sum of ``query_lens``.
    num_query_tokens, max_query_len : int
    chunk_starts : int32 [num_iterations, num_reqs]
        Context-token index where request r's piece of iteration i starts.
    chunk_lens : int32 [num_iterations, num_reqs]
        Length of that piece (0 = no piece).
    cu_seq_lens : int32 [num_iterations, num_reqs + 1]
        Workspace row offset of each piece (exclusive prefix sum of ``chunk_lens`` per row).
    token_to_seq : int32 [num_iterations, max_iteration_tokens] (a property, built on access)
        vLLM's per-token table: request of each workspace row; rows past ``iteration_tokens[i]``
        are padding = 0. Not part of the plan: it costs 4 bytes per context token, so it is
        computed on demand (O(context) host work each access) for callers that want
        vLLM-shaped metadata; the forward never needs it. For a single-request batch it is a
        read-only broadcast view of 0 (zero strides).
    iteration_tokens : tuple[int, ...]
        Workspace rows used in each iteration (``cu_seq_lens[i, -1]``).
    max_chunk_lens : tuple[int, ...]
        Longest piece of each iteration.
    max_iteration_tokens : int
        ``max(iteration_tokens)`` (0 without iterations).
    iteration_cu_query_lens, iteration_cu_seq_lens : int32 [num_iterations, num_reqs + 1] or None
        Only in a plan that shares prefixes (:mod:`mlaprefill.prefix`; None otherwise: every
        iteration's attention runs the requests as sequences, ``cu_query_lens`` over
        ``cu_seq_lens[i]``): the query and key (workspace row) offsets of iteration ``i``'s
        attention sequences, the first ``iteration_num_seqs[i] + 1`` entries (the rest repeat
        the totals: empty sequences). A sequence is a run of requests ``[a, b)``, queries
        ``[cu_query_lens[a], cu_query_lens[b])``: a shared run over its rows (gathered at slot
        ``a`` of ``chunk_starts`` / ``cu_seq_lens``, from request ``a``'s block table), or
        requests without rows in that iteration.
    iteration_num_seqs : tuple[int, ...]
        Attention sequences of each iteration (``()`` without prefix sharing).
    iteration_max_query_lens : tuple[int, ...]
        Longest query run of each iteration's sequences (``()`` without prefix sharing:
        ``max_query_len`` for every iteration).
    """

    policy: str
    workspace_tokens: int
    page_size: int
    num_reqs: int
    num_iterations: int
    query_lens: np.ndarray
    context_lens: np.ndarray
    cu_query_lens: np.ndarray
    num_query_tokens: int
    max_query_len: int
    chunk_starts: np.ndarray
    chunk_lens: np.ndarray
    cu_seq_lens: np.ndarray
    iteration_tokens: tuple[int, ...]
    max_chunk_lens: tuple[int, ...]
    max_iteration_tokens: int
    iteration_cu_query_lens: np.ndarray | None = None
    iteration_cu_seq_lens: np.ndarray | None = None
    iteration_num_seqs: tuple[int, ...] = ()
    iteration_max_query_lens: tuple[int, ...] = ()

    @property
    def chunk_plan(self) -> ChunkPlan:
        """The plan itself (the :class:`StagedPlan` contract)."""
        return self

    @property
    def num_context_tokens(self) -> int:
        """Total context tokens of the batch, ``sum(context_lens)``."""
        return int(self.context_lens.sum())

    @property
    def num_gathered_rows(self) -> int:
        """Latent rows the forward gathers and up-projects over all iterations
        (``sum(iteration_tokens)``): ``num_context_tokens`` less the rows that prefix sharing
        reads once for several requests."""
        return int(sum(self.iteration_tokens))

    @property
    def shares_prefixes(self) -> bool:
        """Whether some iteration attends shared rows with several requests' queries."""
        return self.iteration_cu_query_lens is not None

    def iteration_sequences(self, i: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Iteration ``i``'s attention sequences: ``(cu_q [n + 1], cu_k [n + 1], n, longest
        query run)`` (host int32 views; ``n = num_reqs`` without prefix sharing)."""
        if self.iteration_cu_query_lens is None:
            return (self.cu_query_lens, self.cu_seq_lens[i], self.num_reqs,
                    self.max_query_len)
        n = self.iteration_num_seqs[i]
        return (self.iteration_cu_query_lens[i, :n + 1], self.iteration_cu_seq_lens[i, :n + 1],
                n, self.iteration_max_query_lens[i])

    @property
    def token_to_seq(self) -> np.ndarray:
        """int32 [num_iterations, max_iteration_tokens]: vLLM's row -> request table, built now.

        O(context tokens) host work and memory on every access; see the class docstring.
        ``ValueError`` beyond :data:`MAX_TOKEN_TABLE_ENTRIES`, before anything is allocated.
        """
        return _token_to_seq(self.chunk_lens, self.cu_seq_lens[:, -1],
                             self.max_iteration_tokens)

    def device_arrays(self, *, token_tables: bool = False) -> dict[str, np.ndarray]:
        """Ordered ``name -> int32 array`` that staging ships to the device.

        Keys: ``cu_query_lens, chunk_starts, chunk_lens, cu_seq_lens`` (and
        ``iteration_cu_query_lens, iteration_cu_seq_lens`` in a plan that shares prefixes) --
        O(num_iterations x
        num_reqs) integers, independent of the context length. With ``token_tables=True`` also
        ``token_to_seq`` (vLLM-shaped, 4 bytes per context token: what engines that build it on
        the host ship; the benchmarks use it as the baseline). The arrays are the plan's own
        (read-only) arrays, not copies; staging copies them.
        """
        out = {name: getattr(self, name) for name in _DEVICE_ARRAY_NAMES}
        if self.iteration_cu_query_lens is not None:
            out["iteration_cu_query_lens"] = self.iteration_cu_query_lens
            out["iteration_cu_seq_lens"] = self.iteration_cu_seq_lens
        if token_tables:
            out["token_to_seq"] = self.token_to_seq
        return out

    def to_json(self, *, token_tables: bool = False) -> dict[str, Any]:
        """JSON-serializable dict; arrays as nested lists indexed ``[iteration][request]``.

        Per-token tables (``token_to_seq``, O(context) entries) only with ``token_tables=True``.
        """
        out = {
            "policy": self.policy,
            "workspace_tokens": self.workspace_tokens,
            "page_size": self.page_size,
            "num_reqs": self.num_reqs,
            "num_iterations": self.num_iterations,
            "query_lens": self.query_lens.tolist(),
            "context_lens": self.context_lens.tolist(),
            "cu_query_lens": self.cu_query_lens.tolist(),
            "num_query_tokens": self.num_query_tokens,
            "max_query_len": self.max_query_len,
            "chunk_starts": self.chunk_starts.tolist(),
            "chunk_lens": self.chunk_lens.tolist(),
            "cu_seq_lens": self.cu_seq_lens.tolist(),
            "iteration_tokens": list(self.iteration_tokens),
            "max_chunk_lens": list(self.max_chunk_lens),
            "max_iteration_tokens": self.max_iteration_tokens,
            "num_gathered_rows": self.num_gathered_rows,
        }
        if self.iteration_cu_query_lens is not None:
            out["iteration_cu_query_lens"] = self.iteration_cu_query_lens.tolist()
            out["iteration_cu_seq_lens"] = self.iteration_cu_seq_lens.tolist()
            out["iteration_num_seqs"] = list(self.iteration_num_seqs)
            out["iteration_max_query_lens"] = list(self.iteration_max_query_lens)
        if token_tables:
            out["token_to_seq"] = self.token_to_seq.tolist()
        return out


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"ChunkPlanner.{name} must be a positive int, got {value!r}.")
    if value > INT32_MAX:
        raise ValueError(
            f"ChunkPlanner.{name} = {value} overflows int32 (max {INT32_MAX}); lower it."
        )
    return int(value)


def equal_chunk_size(context_lens: np.ndarray, workspace_tokens: int, page_size: int) -> int:
    """vLLM's per-request chunk: ``floor(W / n)`` rounded down to a page multiple (0 = infeasible).

    ``n`` is the number of requests with ``context_lens > 0`` (must be >= 1).
    """
    n = int(np.count_nonzero(context_lens))
    return (workspace_tokens // n) // page_size * page_size


def check_token_table_size(num_iterations: int, width: int) -> None:
    """Raise ``ValueError`` if a [num_iterations, width] token table exceeds
    :data:`MAX_TOKEN_TABLE_ENTRIES` (checked before anything is allocated)."""
    entries = num_iterations * width
    if entries > MAX_TOKEN_TABLE_ENTRIES:
        raise ValueError(
            f"token_tables: the per-token table would have {num_iterations:,} iterations x "
            f"{width:,} rows = {entries:,} entries, more than MAX_TOKEN_TABLE_ENTRIES = "
            f"{MAX_TOKEN_TABLE_ENTRIES:,} (1 GiB); leave token_tables off (the forward never "
            f"needs it) or plan fewer context tokens per step.")


class PlanTooLargeError(ValueError):
    """The plan would exceed :data:`MAX_PLAN_ENTRIES` (``num_iterations``: at least this many;
    ``num_reqs``): a ``ValueError`` whose numbers a caller can phrase in its own terms."""

    def __init__(self, message: str, num_iterations: int, num_reqs: int) -> None:
        super().__init__(message)
        self.num_iterations = num_iterations
        self.num_reqs = num_reqs


def _check_plan_size(num_iterations: int, num_reqs: int) -> None:
    entries = num_iterations * (num_reqs + 1)
    if entries > MAX_PLAN_ENTRIES:
        raise PlanTooLargeError(
            f"the plan would have {num_iterations:,} iterations x {num_reqs + 1:,} (num_reqs + "
            f"1) = {entries:,} entries per array, more than MAX_PLAN_ENTRIES = "
            f"{MAX_PLAN_ENTRIES:,}; split the PrefillBatch into steps of fewer requests or "
            f"less context, or raise workspace_tokens.", num_iterations, num_reqs)


def _token_to_seq(lens: np.ndarray, tokens: np.ndarray, width: int) -> np.ndarray:
    """int32 [K, width]: request id of each workspace row, padding 0, from lens [K, R]."""
    k, r = lens.shape
    check_token_table_size(k, width)
    if r == 1:
        # One request: every row is request 0. A read-only zero-stride view costs no memory and
        # no page faults when staging copies it (a fresh np.zeros of 2 x 64k rows costs both).
        # (np.ndarray over immutable bytes: read-only, and ~10x cheaper than np.broadcast_to)
        return np.ndarray((k, width), dtype=np.int32, buffer=_INT32_ZERO, strides=(0, 0))
    # One repeat over [K, R+1] segments: the R pieces of each row, then its padding (value 0).
    ids = np.zeros((k, r + 1), dtype=np.int32)
    ids[:, :r] = np.arange(r, dtype=np.int32)
    counts = np.empty((k, r + 1), dtype=np.int64)
    counts[:, :r] = lens
    counts[:, r] = width - tokens
    return np.repeat(ids.ravel(), counts.ravel()).reshape(k, width)


class ChunkPlanner:
    """Split a batch's cached context into workspace iterations (pure CPU, deterministic).

    Parameters
    ----------
    workspace_tokens : int
        ``W``: most context tokens gathered per iteration (latent rows in the workspace);
        must be >= ``page_size``.
    page_size : int
        Tokens per cache page; splits inside a request are page-aligned. Must equal
        ``batch.page_size``.
    policy : {"packed", "equal", "balanced"}
        See the module docstring.
    share_prefixes : bool
        Default True: when the batch carries a **host** block table (numpy or a CPU tensor:
        the engine's CPU copy), rows that consecutive requests share (same leading block ids)
        are gathered and up-projected once and attended by all their queries
        (:mod:`mlaprefill.prefix`); ``plan.num_gathered_rows`` tells the saving. A block table on
        a device is never read (no sharing). False plans every request's context on its own.
    min_saved_rows : int
        A shared run is planned apart only if it saves at least this many gathered rows
        (``(requests - 1) * shared tokens``); default :data:`mlaprefill.prefix.MIN_SAVED_ROWS`.
    """

    __slots__ = ("min_saved_rows", "page_size", "policy", "share_prefixes", "workspace_tokens")

    def __init__(self, workspace_tokens: int, page_size: int, policy: str = "packed", *,
                 share_prefixes: bool = True, min_saved_rows: int = MIN_SAVED_ROWS) -> None:
        self.workspace_tokens = _check_positive_int("workspace_tokens", workspace_tokens)
        self.page_size = _check_positive_int("page_size", page_size)
        if policy not in POLICIES:
            raise ValueError(
                f"ChunkPlanner.policy must be one of {list(POLICIES)}, got {policy!r}."
            )
        self.policy = policy
        if not isinstance(share_prefixes, bool):
            raise TypeError(f"ChunkPlanner.share_prefixes must be a bool, got "
                            f"{type(share_prefixes).__name__}")
        self.share_prefixes = share_prefixes
        if (isinstance(min_saved_rows, bool) or not isinstance(min_saved_rows, int | np.integer)
                or min_saved_rows < 0):
            raise ValueError(f"ChunkPlanner.min_saved_rows must be an int >= 0, got "
                             f"{min_saved_rows!r}")
        self.min_saved_rows = int(min_saved_rows)
        if self.workspace_tokens < self.page_size:
            raise ValueError(
                f"ChunkPlanner.workspace_tokens={self.workspace_tokens} is smaller than one page "
                f"(page_size={self.page_size}); raise workspace_tokens to >= {self.page_size}."
            )

    def __repr__(self) -> str:
        return (f"ChunkPlanner(workspace_tokens={self.workspace_tokens}, "
                f"page_size={self.page_size}, policy={self.policy!r}, "
                f"share_prefixes={self.share_prefixes})")

    def plan(self, batch: PrefillBatch) -> ChunkPlan:
        """Plan ``batch``; returns a :class:`ChunkPlan` (host numpy only, never synchronizes).

        Raises
        ------
        TypeError
            If ``batch`` is not a :class:`PrefillBatch`.
        ValueError
            If ``batch.page_size`` differs from the planner's, (``equal``) the workspace is
            smaller than one page per request with context, or the plan would exceed
            :data:`MAX_PLAN_ENTRIES` (checked before its arrays are allocated).
        """
        if not isinstance(batch, PrefillBatch):
            raise TypeError(
                f"ChunkPlanner.plan expects a PrefillBatch, got {type(batch).__name__}; "
                f"wrap the lengths with PrefillBatch(query_lens, context_lens, page_size=...)."
            )
        if batch.page_size != self.page_size:
            raise ValueError(
                f"PrefillBatch.page_size={batch.page_size} differs from the planner's "
                f"page_size={self.page_size}; build the planner with the cache's page size."
            )
        ctx = batch.context_lens
        if self.share_prefixes and ctx.shape[0] > 1:
            table = host_block_table(batch.block_table)
            if table is not None:
                shared = neighbour_shared_tokens(table, ctx, self.page_size)
                if shared.any():
                    tree = shared_tree(shared, ctx, min_saved_rows=self.min_saved_rows)
                    if tree.shares:  # else every run saved too little: the plain plan
                        return self._plan_shared(batch, tree)
        return self._assemble(batch, *self._pieces(ctx))

    def _plan_shared(self, batch: PrefillBatch, tree: SharedTree) -> ChunkPlan:
        """Each depth of the shared tree planned as a batch of its own, iterations concatenated.

        A node's rows sit at slot ``tree.first`` of ``chunk_starts`` / ``chunk_lens`` (its
        pieces read that request's block table, offset by ``tree.lo``). The attention of each
        iteration runs over *sequences* that are request runs: a node with rows there is one
        sequence, the queries of requests ``[first, end)`` over its rows; the requests between
        such runs form keyless sequences (their queries must belong to some sequence); so an
        iteration of one shared run has 1-3 sequences, not ``num_reqs`` (an attention grid of
        ``num_reqs`` sequences would launch programs for every empty one). Loops over depths
        (a handful), never over requests.
        """
        r = batch.num_reqs
        cu_q = np.zeros(r + 1, dtype=np.int64)
        np.cumsum(batch.query_lens, out=cu_q[1:])
        total_q = int(cu_q[-1])
        col = np.arange(r + 1)
        parts: list[tuple[np.ndarray, ...]] = []
        total_k = 0
        for d in range(tree.num_levels):
            at = tree.depth == d
            first, end, lo = tree.first[at], tree.end[at], tree.lo[at]
            # The policy plans the depth's nodes alone (a batch of len(first) contexts), then
            # their pieces go to the nodes' slots.
            node_starts, node_lens = self._pieces(tree.hi[at] - lo)                # [K_d, N]
            k = node_lens.shape[0]
            total_k += k
            _check_plan_size(total_k, r)  # the depths' iterations add up: before [K_d, R]
            starts = np.zeros((k, r), dtype=np.int64)
            lens = np.zeros((k, r), dtype=np.int64)
            starts[:, first] = node_starts + lo
            lens[:, first] = node_lens
            # Sequence boundaries (request indices) of each iteration: 0, R, and both ends of
            # every run with rows in it.
            has = node_lens > 0
            mark = np.zeros((k, r + 1), dtype=bool)
            mark[:, [0, r]] = True
            mark[:, first] |= has
            mark[:, end] |= has
            parts.append((starts, lens, mark))
        starts, lens, mark = (np.concatenate(p) for p in zip(*parts, strict=True))
        # Every iteration at once: the boundaries in order (a stable argsort of the marks), the
        # sequences' query and workspace-row offsets, empty sequences past the last.
        order = np.argsort(~mark, axis=1, kind="stable")                            # [K, R+1]
        num_seqs = mark.sum(axis=1) - 1                                              # [K]
        past = col[None, :] > num_seqs[:, None]
        cu_k = np.zeros((lens.shape[0], r + 1), dtype=np.int64)
        np.cumsum(lens, axis=1, out=cu_k[:, 1:])
        seq_q = np.where(past, total_q, cu_q[order])
        seq_k = np.where(past, cu_k[:, -1:], np.take_along_axis(cu_k, order, axis=1))
        return self._assemble(batch, starts, lens, (seq_q, seq_k, num_seqs))

    def _pieces(self, ctx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The policy's pieces of contexts ``ctx`` int64 [R]: (starts, lens), int [K, R]."""
        w = self.workspace_tokens
        r = ctx.shape[0]
        max_ctx = int(ctx.max())
        if max_ctx == 0:
            _check_plan_size(0, r)
            empty = np.zeros((0, r), np.int32)
            return empty, empty
        if self.policy == "equal":
            chunk = equal_chunk_size(ctx, w, self.page_size)
            if chunk == 0:
                n = int(np.count_nonzero(ctx))
                raise ValueError(
                    f"workspace_tokens={w} is smaller than one page per request with context "
                    f"(n × page_size = {n} × {self.page_size} = {n * self.page_size}); raise "
                    f"workspace_tokens or lower concurrency."
                )
            num_chunks = -(-max_ctx // chunk)
            _check_plan_size(num_chunks, r)
            return self._strided(ctx, chunk, num_chunks)
        if self.policy == "balanced":
            chunks = self._balanced_chunks(ctx)
            if chunks is not None:
                num_chunks = int((-(-ctx // np.maximum(chunks, 1))).max())
                _check_plan_size(num_chunks, r)
                return self._strided(ctx, chunks, num_chunks)
        end = np.cumsum(ctx)
        total = int(end[-1])
        # ceil(total / W) is a lower bound on the iterations: refuse before cutting, and cap the
        # cut loop at the limit (with W = page_size = 1 it would otherwise run total times)
        _check_plan_size(-(-total // w), r)
        if total <= w:  # everything fits one iteration: each request is one whole piece
            return np.zeros((1, r), np.int64), ctx.reshape(1, r)
        cuts = self._stream_cuts(end, ctx, total, MAX_PLAN_ENTRIES // (r + 1))
        k = cuts.shape[0] - 1
        _check_plan_size(k, r)
        if r == 1:
            starts = cuts[:-1].reshape(k, 1)
            return starts, cuts[1:].reshape(k, 1) - starts
        # Piece of request r in iteration i: the stream segment [cuts[i], cuts[i+1]) clipped to
        # the request's stream range [begin_r, end_r).
        begin = end - ctx
        lo = np.clip(cuts[:-1, None], begin, end)  # [K, R]
        hi = np.clip(cuts[1:, None], begin, end)   # [K, R]
        return lo - begin, hi - lo

    def _stream_cuts(self, end: np.ndarray, ctx: np.ndarray, total: int,
                     max_iterations: int) -> np.ndarray:
        """Greedy furthest-reach cut positions in the context stream, int64 [K + 1].

        ``end`` = cumsum(ctx) [R]; ``total`` = end[-1] > workspace_tokens. Stops once ``K``
        exceeds ``max_iterations`` (the caller then refuses the plan).
        """
        w, ps = self.workspace_tokens, self.page_size
        # bisect on Python lists is cheaper than per-iteration numpy calls for small batches.
        ends = end.tolist()
        begins = (end - ctx).tolist()
        cuts = [0]
        pos = 0
        while pos + w < total and len(cuts) <= max_iterations:
            reach = pos + w
            # request containing stream position `reach` (begin_r <= reach < end_r)
            r = bisect_right(ends, reach)
            b = begins[r]
            cut = b + (reach - b) // ps * ps
            # w >= page_size guarantees progress: a page-aligned pos inside request r moves >= ps.
            assert cut > pos, (cut, pos)
            cuts.append(cut)
            pos = cut
        cuts.append(total)
        return np.array(cuts, dtype=np.int64)

    def _balanced_chunks(self, ctx: np.ndarray) -> np.ndarray | None:
        """Per-request chunk int64 [R] of the smallest feasible ``K``; None if none is feasible.

        ``ctx`` int64 [R] with ``max(ctx) > 0``. Chunks are 0 for requests without context.
        """
        w, ps = self.workspace_tokens, self.page_size
        lens = ctx.tolist()

        def first_iteration_tokens(k: int) -> int:
            # The first iteration is the fullest: request i contributes min(c_i, ctx_i), c_i =
            # ceil(ctx_i / k) rounded up to a page. Plain ints for the usual few requests (a
            # search step is then ~R integer ops instead of several numpy calls).
            if len(lens) > 64:
                return int(np.minimum(((ctx + k - 1) // k + ps - 1) // ps * ps, ctx).sum())
            return sum(min(((c + k - 1) // k + ps - 1) // ps * ps, c) for c in lens)

        hi = -(-max(lens) // ps)  # every chunk is one page: the most iterations ever needed
        if first_iteration_tokens(hi) > w:
            return None
        # The answer is usually at or just above the lower bound ceil(sum / W): gallop up from
        # it, then bisect the last step (the sum never grows with K, so this finds the least K).
        lo = min(hi, max(1, -(-sum(lens) // w)))
        step = 1
        if first_iteration_tokens(lo) > w:
            below = lo  # infeasible
            while True:
                cand = min(hi, lo + step)
                if first_iteration_tokens(cand) <= w:
                    break
                below, step = cand, step * 2
            lo, top = below + 1, cand
            while lo < top:
                mid = (lo + top) // 2
                if first_iteration_tokens(mid) <= w:
                    top = mid
                else:
                    lo = mid + 1
        per = -(-ctx // lo)  # ceil(ctx / K)
        return -(-per // ps) * ps  # rounded up to a page

    def _strided(self, ctx: np.ndarray, chunk: int | np.ndarray,
                 num_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """Request ``i`` advances by ``chunk`` (an int, or int64 [R] per request) each iteration."""
        starts = np.empty((num_chunks, ctx.shape[0]), dtype=np.int64)                # [K, R]
        # (np.clip / np.broadcast_to cost microseconds of Python wrapper each; a small plan is
        # a handful of ufunc calls, so they are avoided on this hot path)
        starts[:] = np.arange(num_chunks, dtype=np.int64)[:, None] * chunk
        lens = np.minimum(np.maximum(ctx - starts, 0), chunk)                       # [K, R]
        return starts, lens

    def _assemble(self, batch: PrefillBatch, starts: np.ndarray, lens: np.ndarray,
                  sequences: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                  ) -> ChunkPlan:
        k, r = lens.shape
        shared: dict[str, Any] = {}
        if sequences is not None:  # prefix sharing: the attention's sequences per iteration
            seq_q, seq_k, num_seqs = sequences
            shared = {
                "iteration_cu_query_lens": _readonly(seq_q.astype(np.int32)),
                "iteration_cu_seq_lens": _readonly(seq_k.astype(np.int32)),
                "iteration_num_seqs": tuple(num_seqs.tolist()),
                "iteration_max_query_lens": tuple(
                    np.maximum.reduce(np.diff(seq_q, axis=1), axis=1).tolist())}
        # np.add.accumulate, not np.cumsum: the same prefix sum without ~3 us of Python wrapper
        # per call (a small plan is a handful of microsecond-scale numpy calls)
        cu_seq = np.zeros((k, r + 1), dtype=np.int32)
        np.add.accumulate(lens, axis=1, out=cu_seq[:, 1:], dtype=np.int32)
        lens = lens.astype(np.int32)
        iteration_tokens = tuple(cu_seq[:, -1].tolist())
        max_tokens = max(iteration_tokens, default=0)
        assert max_tokens <= self.workspace_tokens
        q = batch.query_lens.astype(np.int32)
        cu_q = np.zeros(r + 1, dtype=np.int32)
        np.add.accumulate(q, out=cu_q[1:], dtype=np.int32)
        return ChunkPlan(
            policy=self.policy,
            workspace_tokens=self.workspace_tokens,
            page_size=self.page_size,
            num_reqs=r,
            num_iterations=k,
            query_lens=_readonly(q),
            context_lens=_readonly(batch.context_lens.astype(np.int32)),
            cu_query_lens=_readonly(cu_q),
            num_query_tokens=int(cu_q[-1]),
            max_query_len=int(np.maximum.reduce(q)),
            chunk_starts=_readonly(np.ascontiguousarray(starts, dtype=np.int32)),
            chunk_lens=_readonly(lens),
            cu_seq_lens=_readonly(cu_seq),
            iteration_tokens=iteration_tokens,
            max_chunk_lens=tuple(np.maximum.reduce(lens, axis=1).tolist()) if k else (),
            max_iteration_tokens=max_tokens,
            **shared,
        )
