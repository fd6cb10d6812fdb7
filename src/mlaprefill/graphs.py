"""The forward's launches as CUDA graphs, captured once and replayed across forwards and layers.

With ``MLAChunkedPrefill(..., graphs=IterationGraphs())`` a forward is a few device copies and a
few graph replays: the new tokens' stage (their up-projection and causal attention, the running
``(out, lse)``), then each run of consecutive context iterations of one launch shape (a gather from
the paged cache, the up-projection GEMM and the backend's attention merged into ``(out, lse)``, per
iteration) as one graph of a power-of-two count of iterations. A graph records device addresses,
launch grids and host arguments, so for one graph to serve many forwards (every step in which a
layer meets that launch shape) the tensors it touches live at fixed addresses: an
:class:`IterationGraphs` owns, per device and model shape, one set of static buffers (an *arena*)
for the step's queries and new latent rows, the running ``(out, lse)``, the plan's offsets, the
block table, the workspace and the key/value buffer. A forward copies its inputs in (the plan's
offsets only when its DevicePlan is not the one they came from: once per step, not per layer),
replays, and copies ``(out, lse)`` out; the layers that share an :class:`IterationGraphs` share one
arena, so its memory does not grow with the layer count. An engine skips the copies of the queries
and of ``(out, lse)`` by using the arena's own buffers (``MLAChunkedPrefill.io_buffers(T)``: it
writes q there and passes them as ``q``, ``out=`` and ``lse=``); they hold one layer's data until
the next forward through the arena.

Launch grids are bucketed so that few graphs serve many steps: the sequence count to a power of
two (the padded sequences have no queries and no keys, so their programs return at once) and
the longest query run to a power of two of at least 64, and the rows (the gather's and the
GEMM's size) to 32 buckets per octave (:func:`row_bucket`). A graph's key is those buckets, the
run length, the layer's cache address, and what the backend's launches depend on besides
(``AttentionBackend.launch_key``: the ``mlaprefill`` backend's cuDNN rectangles); each layer keeps
its own graphs (they record its weights).

A graph key's first sight replays a captured graph of bigger buckets when the layer has one
(:meth:`LayerGraphs.stand_in`), else runs its launches eagerly (that loads every kernel the
capture will record), and queues the key; :meth:`IterationGraphs.capture_pending` captures the
queued keys, meant for where the host would otherwise wait (an engine waiting for a step's
event). Until it is first called, a key seen again is captured inside the forward; after that,
forwards never capture.

Everything here runs in stream order on the current stream; forwards that share an
:class:`IterationGraphs` must not run concurrently on different streams.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["IterationGraphs"]

#: Least bucket of the longest query run (one or a few of the attention kernel's query blocks).
MIN_QUERY_BUCKET = 64
#: Row buckets per octave: an iteration's launches are sized to its row count rounded up to a
#: multiple of 1/32 of the power of two above it (at most 1/32 more GEMM rows, ~1.6 % on average
#: on the bench's ``uneven`` workload; at least :data:`MIN_ROW_BUCKET`). Dry runs of the bench
#: scenarios with balanced plans: 61 keys (row bucket x sequence bucket x query bucket) over 311
#: ``uneven`` steps, 80 over 320 ``stall`` steps, 18 over 320 ``vllm-default`` steps; 16 per
#: octave gave 39 / 48 / 16 keys but 3.0 / 4.4 / 1.1 % more rows.
ROWS_PER_OCTAVE = 32
#: Least row bucket (a multiple of 16 rows, whatever ROWS_PER_OCTAVE).
MIN_ROW_BUCKET = 512
#: First sights waiting for :meth:`IterationGraphs.capture_pending` (the oldest dropped first).
MAX_PENDING = 256
_GENERATIONS = itertools.count(1)  # arena generations, unique over the process
#: What a layer stores for a key whose capture failed: it runs eagerly from then on.
EAGER = "eager"
#: A graph stands in for a launch shape met for the first time only if it has at most this many
#: times its rows (the GEMM's extra work).
STAND_IN_ROWS = 2


def pow2_at_least(n: int, least: int = 1) -> int:
    """The least power of two that is ``>= max(n, least)``."""
    n = max(int(n), int(least), 1)
    return 1 << (n - 1).bit_length()


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``pow2_at_least(rows) / ROWS_PER_OCTAVE`` (at least
    :data:`MIN_ROW_BUCKET`): the row count of the launches that run an iteration of ``rows``."""
    rows = max(int(rows), MIN_ROW_BUCKET)
    step = pow2_at_least(rows) // ROWS_PER_OCTAVE
    return -(-rows // step) * step


@dataclass(eq=False)
class Arena:
    """Static device buffers of one (device, dtype, head count, head dims, latent dim).

    Attributes
    ----------
    generation : int
        Unique over the process; a graph captured against an arena is valid only while its
        generation is current (the buffers never move within one).
    q : [token_cap, H, qk]; out : [token_cap, H, v]; lse : float32 [token_cap, H]
    cu_q : int32 [seq_cap + 1]; cu_k : int32 [iter_cap, seq_cap + 1]
    seq_q, seq_k : int32 [iter_cap, seq_cap + 1], each iteration's attention sequences (a plan
        that shares prefixes: ``ChunkPlan.iteration_cu_query_lens`` / ``iteration_cu_seq_lens``)
    starts : int32 [iter_cap, seq_cap]; block_table : int32 [seq_cap, block_cap]
    workspace : [row_cap, latent] in the compute dtype (the new tokens' latent rows first, then
        each iteration's gathered rows, dequantized); kv_buf : [kv_cap] in q's dtype (flat)
    counter : int64 [1], the iteration a replay runs (it adds one to it)
    next : int, the host's view of ``counter``
    """

    generation: int
    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    seq_q: torch.Tensor
    seq_k: torch.Tensor
    starts: torch.Tensor
    block_table: torch.Tensor
    workspace: torch.Tensor
    kv_buf: torch.Tensor
    counter: torch.Tensor
    next: int = 0
    offsets_from: Any = None  # the DevicePlan cu_q/cu_k/starts were last copied from
    table_from: Any = None  # the DevicePlan block_table was, when it held the block table

    def fits(self, need: dict[str, int]) -> bool:
        return all(have >= need[k] for k, have in self.caps().items())

    def caps(self) -> dict[str, int]:
        return {"tokens": self.q.shape[0], "seqs": self.cu_q.shape[0] - 1,
                "iters": self.cu_k.shape[0], "blocks": self.block_table.shape[1],
                "rows": self.workspace.shape[0], "kv": self.kv_buf.shape[0]}


@dataclass
class _Side:
    stream: Any
    pool: Any
    keeper: Any = None  # the last graph captured: keeps the memory pool joinable


@dataclass
class IterationGraphs:
    """Captured context iterations and the static buffers they read, shared by forward objects.

    Pass one instance to every layer's ``MLAChunkedPrefill(..., graphs=graphs)`` so that the
    layers share one set of static buffers.
    Each forward object keeps its own graphs (they record its weights and its cache), at most
    ``max_graphs_per_layer``, the least recently used dropped first.

    Parameters
    ----------
    max_graphs_per_layer : int
        Graphs a forward object keeps (>= 1). The bench's scenarios meet 18-80 launch shapes
        per layer with balanced plans (dry runs); with a cap of 64, ``stall`` with ``equal``
        plans re-captured 256 graphs in every measured run (evicted before they came again).

    Attributes
    ----------
    captures : int
        CUDA graphs captured so far by the forward objects that share this instance.
    replays : int
        Graph launches so far.
    warm_runs : int
        Launches run eagerly through the static buffers the first time their graph key was
        seen (this loads every kernel the capture then records), or on devices without CUDA
        graphs (always).
    stand_ins : int
        First sights that replayed a graph of bigger buckets instead of running eagerly.
    capture_seconds : float
        Host time spent capturing, in forwards and in :meth:`capture_pending` together.
    capture_failures, last_capture_error
        Captures that raised (the key then runs eagerly) and the last such error.
    """

    max_graphs_per_layer: int = 256
    captures: int = 0
    replays: int = 0
    warm_runs: int = 0
    stand_ins: int = 0
    capture_seconds: float = 0.0
    capture_failures: int = 0
    last_capture_error: str | None = None
    # (id(layer), key) -> (layer, key, device, padded iteration), oldest first
    _pending: OrderedDict[tuple[int, Any], tuple[Any, ...]] = field(
        default_factory=OrderedDict, repr=False)
    _idle_captures: bool = field(default=False, repr=False)  # capture_pending() was called
    _arenas: dict[tuple[Any, ...], Arena] = field(default_factory=dict, repr=False)
    _side: dict[Any, _Side] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        m = self.max_graphs_per_layer
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_graphs_per_layer must be an int >= 1, got {m!r}")

    def arena(self, key: tuple[Any, ...], need: dict[str, int], *, device: torch.device,
              dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, qk: int, v: int,
              latent: int) -> Arena:
        """The arena for ``key`` with at least the capacities ``need`` (tokens, seqs, iters,
        blocks, rows, kv; a missing one: any), grown when it has less: a new generation, new
        buffers for what ran out, the old ones kept where they still fit (so a view of its
        buffers, ``MLAChunkedPrefill.io_buffers``', stay its buffers while the token
        capacity holds)."""
        old = self._arenas.get(key)
        need = {k: need.get(k, 0) for k in ("tokens", "seqs", "iters", "blocks", "rows", "kv")}
        if old is not None and old.fits(need):
            return old
        caps = dict(need)
        if old is not None:  # grow: at least double what ran out, keep the rest
            for k, have in old.caps().items():
                caps[k] = max(need[k], have) if have >= need[k] else max(need[k], 2 * have)
        tokens = pow2_at_least(caps["tokens"], 16)
        seqs, iters = caps["seqs"], pow2_at_least(caps["iters"], 4)
        blocks = -(-max(caps["blocks"], 1) // 64) * 64
        rows, kv = max(caps["rows"], 1), max(caps["kv"], 1)
        shapes = {"q": ((tokens, heads, qk), dtype), "out": ((tokens, heads, v), dtype),
                  "lse": ((tokens, heads), torch.float32), "cu_q": ((seqs + 1,), torch.int32),
                  "cu_k": ((iters, seqs + 1), torch.int32),
                  "seq_q": ((iters, seqs + 1), torch.int32),
                  "seq_k": ((iters, seqs + 1), torch.int32),
                  "starts": ((iters, seqs), torch.int32),
                  "block_table": ((seqs, blocks), torch.int32),
                  "workspace": ((rows, latent), kv_dtype), "kv_buf": ((kv,), dtype),
                  "counter": ((1,), torch.int64)}
        kept: dict[str, torch.Tensor] = {}
        if old is not None:
            self._arenas.pop(key)
            # Captures queued against it would never replay (the layers drop graphs of an old
            # generation) and would keep its buffers alive: what is not kept (sizes never
            # shrink, so a buffer of the same shape still fits) goes back to the allocator
            # before the new buffers are made.
            self._pending = OrderedDict((k, p) for k, p in self._pending.items()
                                        if p[3].arena is not old)
            # (Not the counter: a new arena's host view of it, ``next``, starts at 0.)
            kept = {name: getattr(old, name) for name, (shape, _) in shapes.items()
                    if name != "counter" and tuple(getattr(old, name).shape) == shape}
            del old
        made = {name: kept[name] if name in kept else
                (torch.empty if name == "kv_buf" else torch.zeros)(shape, dtype=dt, device=device)
                for name, (shape, dt) in shapes.items()}
        del kept
        arena = Arena(generation=next(_GENERATIONS), **made)
        self._arenas[key] = arena
        return arena

    def capture(self, device: torch.device, fn: Callable[[], None]) -> Any:
        """``fn``'s launches captured as a CUDA graph on a side stream (recorded, not run), or
        :data:`EAGER` when the capture failed (``capture_failures``, ``last_capture_error``):
        that key then runs eagerly."""
        t0 = time.perf_counter()
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = _Side(torch.cuda.Stream(device),
                                              torch.cuda.graph_pool_handle())
        current = torch.cuda.current_stream(device)
        side.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every graph here: torch lets a capture join a pool only while a
        # graph holds it, so the last graph is kept. Graphs replay one after another on one
        # stream, so the temporaries one frees at its end are free during the next.
        try:
            with torch.cuda.stream(side.stream):
                graph.capture_begin(pool=side.pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
        except RuntimeError as exc:  # an op that cannot be captured: leave this key eager
            self.capture_failures += 1
            self.last_capture_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            current.wait_stream(side.stream)
            return EAGER
        current.wait_stream(side.stream)
        side.keeper = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def defer(self, layer: LayerGraphs, key: tuple[Any, ...], device: torch.device,
              fn: Any) -> None:
        """Queue ``layer``'s key (seen once, its kernels loaded) for :meth:`capture_pending`;
        ``fn`` is its padded iteration, reading only static buffers (``fn.arena``)."""
        self._pending[(id(layer), key)] = (layer, key, device, fn)
        if len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    @property
    def captures_in_forward(self) -> bool:
        """Whether a forward captures a key at its second sight (until the first call of
        :meth:`capture_pending`) or runs it eagerly again and leaves it to the next call."""
        return not self._idle_captures

    def capture_pending(self, limit: int | None = None) -> int:
        """Capture the graphs of keys seen and not captured yet, here rather than inside a
        forward; at most ``limit`` (all by default). Returns how many. Once called, forwards
        stop capturing: a key seen again before the next call runs eagerly again (the cost of
        an eager iteration rather than of a capture, ~0.5 ms of host on the H200).

        Never synchronizes and runs nothing on the device (a capture only records): call it
        where the host would otherwise wait, e.g. before blocking on an earlier step's event.
        A key whose arena has since grown, or that was evicted or captured meanwhile, is
        skipped."""
        self._idle_captures = True
        done = 0
        live = {a.generation for a in self._arenas.values()}
        while self._pending and (limit is None or done < limit):
            layer, key, device, fn = self._pending.popitem(last=False)[1]
            if fn.arena.generation not in live or layer.generation != fn.arena.generation:
                continue
            if layer.graphs.get(key, "absent") is not None:
                continue  # evicted ("absent") or captured at its second sight
            graph = self.capture(device, fn)
            layer.store(key, graph)
            done += graph is not EAGER
        return done

    def release(self) -> None:
        """Drop the static buffers (the forward objects drop their graphs when they next see
        that the arena changed). Counters are kept."""
        self._arenas.clear()
        self._side.clear()
        self._pending.clear()

    def memory_bytes(self) -> int:
        """Bytes the static buffers hold (every arena)."""
        return sum(t.numel() * t.element_size() for a in self._arenas.values()
                   for t in (a.q, a.out, a.lse, a.cu_q, a.cu_k, a.seq_q, a.seq_k, a.starts,
                             a.block_table,
                             a.workspace, a.kv_buf, a.counter))


class LayerGraphs:
    """One forward object's graphs, keyed by (arena generation, launch shape, cache)."""

    def __init__(self, shared: IterationGraphs) -> None:
        self.shared = shared
        self.graphs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.generation = -1

    def lookup(self, key: tuple[Any, ...], generation: int) -> tuple[bool, Any]:
        """(seen before, its graph or None when seen once and not yet captured)."""
        if generation != self.generation:  # the arena moved: every graph here is stale
            self.graphs.clear()
            self.generation = generation
        if key not in self.graphs:
            return False, None
        self.graphs.move_to_end(key)
        return True, self.graphs[key]

    def stand_in(self, key: tuple[Any, ...]) -> Any:
        """A captured graph that can run ``key``'s launches, or None. Keys are ``(seqs bucket,
        query bucket, *same, rows, tail)``; a stand-in has the same ``same`` and ``tail``,
        sequence and query buckets at least ``key``'s, and at least ``key``'s rows but at most
        twice as many (:data:`STAND_IN_ROWS`); the one with the fewest rows, then the fewest
        sequences x queries, is chosen."""
        rows, tail, same = key[-2], key[-1], key[2:-2]
        best, found = None, None
        for other, graph in self.graphs.items():
            if (graph is None or graph is EAGER or len(other) != len(key) or other[-1] != tail
                    or other[2:-2] != same or not isinstance(other[-2], int)):
                continue
            if (other[0] >= key[0] and other[1] >= key[1]
                    and rows <= other[-2] <= STAND_IN_ROWS * rows and other != key):
                cost = (other[-2], other[0] * other[1])
                if best is None or cost < best:
                    best, found = cost, graph
        return found

    def store(self, key: tuple[Any, ...], graph: Any) -> None:
        self.graphs[key] = graph
        self.graphs.move_to_end(key)
        while len(self.graphs) > self.shared.max_graphs_per_layer:
            self.graphs.popitem(last=False)
