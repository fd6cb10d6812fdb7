"""mlaprefill.graphs on the CPU: static buffers, their growth, the per-layer graph cache, the
replay counter. The captured graphs themselves are tested on the GPU (tests/test_attention_gpu.py)
and their padded arithmetic in the Triton interpreter (tests/test_triton_attention.py)."""

from __future__ import annotations

import types

import pytest
import torch

from mlaprefill.graphs import (
    MIN_ROW_BUCKET,
    IterationGraphs,
    LayerGraphs,
    pow2_at_least,
    row_bucket,
)
from mlaprefill.kvcache import KVCacheSpec
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.replay import _ArenaReplay

PLAIN8 = KVCacheSpec("plain", None, None, 12)  # how the tests' caches (rank 8 + rope 4) read

CPU = torch.device("cpu")
DIMS = dict(device=CPU, dtype=torch.float16, kv_dtype=torch.float16, heads=2, qk=24, v=16,
            latent=24)


def _need(**over):
    need = {"tokens": 40, "seqs": 4, "iters": 3, "blocks": 9, "rows": 96, "kv": 96 * 80}
    need.update(over)
    return need


def test_pow2_at_least():
    assert [pow2_at_least(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [1, 1, 2, 4, 4, 8, 1024]
    assert pow2_at_least(3, 64) == 64 and pow2_at_least(65, 64) == 128


def test_row_bucket_pads_at_most_a_32nd_to_multiples_of_16():
    assert [row_bucket(n) for n in (0, 1, 512, 513, 1024, 1025, 61441, 65536, 65537)] == [
        512, 512, 512, 544, 1024, 1088, 63488, 65536, 69632]
    last = 0
    for n in range(1, 300_000, 997):
        b = row_bucket(n)
        assert b >= n and b % 16 == 0 and b >= last, n
        assert b == MIN_ROW_BUCKET or b - n < pow2_at_least(n) / 32, n
        last = b


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8", None])
def test_max_graphs_per_layer_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_graphs_per_layer must be an int >= 1"):
        IterationGraphs(max_graphs_per_layer=bad)


def test_iteration_graphs_argument():
    w = torch.zeros(2 * 32, 16)
    shared = IterationGraphs()
    a = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, graphs=shared)
    b = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, graphs=shared)
    own = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, graphs=IterationGraphs())
    off = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16)
    assert a.graphs is shared and b.graphs is shared
    assert isinstance(own.graphs, IterationGraphs) and own.graphs is not shared
    assert off.graphs is None and off.layer_graphs is None
    assert a.layer_graphs is not b.layer_graphs  # graphs record each layer's weights: never shared
    for bad in (1, "yes", True, [shared]):
        with pytest.raises(TypeError, match="graphs must be an IterationGraphs or None"):
            MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, graphs=bad)


def test_arena_reused_while_it_fits_and_grown_to_new_buffers():
    shared = IterationGraphs()
    key = ("k",)
    a = shared.arena(key, _need(), **DIMS)
    assert a.q.shape == (64, 2, 24) and a.out.shape == (64, 2, 16) and a.lse.shape == (64, 2)
    assert a.lse.dtype == torch.float32 and a.cu_q.dtype == a.cu_k.dtype == torch.int32
    assert a.cu_q.shape == (5,) and a.cu_k.shape == (4, 5) and a.starts.shape == (4, 4)
    assert a.block_table.shape == (4, 64) and a.workspace.shape == (96, 24)
    assert a.kv_buf.shape == (96 * 80,) and a.counter.dtype == torch.int64
    assert shared.arena(key, _need(tokens=64, seqs=2, iters=1, rows=50), **DIMS) is a
    grown = shared.arena(key, _need(tokens=65, seqs=8), **DIMS)
    assert grown is not a and grown.generation > a.generation
    assert grown.q.shape[0] == 128 and grown.cu_q.shape == (9,)  # what ran out at least doubled
    assert grown.workspace.shape == (96, 24) and grown.cu_k.shape[0] == 4  # the rest kept
    # buffers whose size did not change are the old ones (a static query stays valid while
    # the token capacity holds), what ran out is new; never the counter (``next`` restarts)
    assert grown.workspace is a.workspace and grown.kv_buf is a.kv_buf
    assert grown.q is not a.q and grown.cu_k is not a.cu_k and grown.counter is not a.counter
    more_rows = shared.arena(key, _need(tokens=65, seqs=8, rows=200), **DIMS)
    assert more_rows.q is grown.q and more_rows.out is grown.out and more_rows.lse is grown.lse
    assert more_rows.workspace is not grown.workspace and more_rows.workspace.shape[0] == 200
    assert more_rows.generation > grown.generation
    grown = more_rows
    assert shared.arena(key, _need(), **DIMS) is grown  # smaller needs fit the grown one
    other = shared.arena(("other",), _need(), **DIMS)
    assert other.generation > grown.generation and len(shared._arenas) == 2
    assert shared.memory_bytes() > 0
    shared.release()
    assert shared.memory_bytes() == 0


def test_io_buffers_without_graphs_and_bad_arguments():
    w = torch.zeros(2 * 32, 16)
    off = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=8)
    io = off.io_buffers(5)
    assert io.q.shape == (5, 2, 24) and io.q.dtype == w.dtype  # new tensors: nothing to share
    assert io.out.shape == (5, 2, 16) and io.lse.shape == (5, 2) and io.lse.dtype == torch.float32
    assert off.io_buffers(5).q.data_ptr() != io.q.data_ptr()
    on = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, graphs=IterationGraphs())
    a, b = on.io_buffers(5, dtype=torch.float16), on.io_buffers(7, dtype=torch.float16)
    assert a.q.shape == (5, 2, 80) and b.q.shape == (7, 2, 80)  # rope 64 by default
    assert a.q.data_ptr() == b.q.data_ptr()  # one buffer
    assert a.out.data_ptr() == b.out.data_ptr() and a.lse.data_ptr() == b.lse.data_ptr()
    assert on.io_buffers(3, dtype=torch.float32).q.data_ptr() != a.q.data_ptr()  # per dtype
    wide = on.io_buffers(4, dtype=torch.float64)  # float64 LSE: never the arena's float32 one
    assert wide.lse.dtype == torch.float64
    for bad, match in (({"num_tokens": -1}, "num_tokens"), ({"num_tokens": 2**31}, "num_tokens"),
                       ({"num_tokens": 4.0}, "num_tokens"), ({"num_tokens": True}, "num_tokens"),
                       ({"num_tokens": 4, "dtype": torch.int8}, "dtype"),
                       ({"num_tokens": 4, "qk_rope_head_dim": -2}, "qk_rope_head_dim")):
        with pytest.raises(ValueError, match=match):
            on.io_buffers(**bad)


def test_layer_graphs_lru_and_stale_generation():
    shared = IterationGraphs(max_graphs_per_layer=2)
    layer = LayerGraphs(shared)
    assert layer.lookup("a", 1) == (False, None)
    layer.store("a", None)
    assert layer.lookup("a", 1) == (True, None)  # seen once, not captured
    layer.store("a", "graph-a")
    layer.store("b", "graph-b")
    assert layer.lookup("a", 1) == (True, "graph-a")  # a is now the most recent
    layer.store("c", "graph-c")  # evicts b, the least recently used
    assert layer.lookup("b", 1) == (False, None)
    assert layer.lookup("a", 1) == (True, "graph-a")
    assert layer.lookup("a", 2) == (False, None)  # the arena moved: every graph dropped
    assert not layer.graphs


def test_replay_counter_set_by_the_host_only_after_a_skipped_iteration(monkeypatch):
    """A run of consecutive iterations advances the device counter itself (one launch of
    ``count`` iterations adds ``count``); after a skipped iteration (no rows, or joined keys run
    eagerly) the host sets it."""
    import mlaprefill.replay as attention_module

    shared = IterationGraphs()
    arena = shared.arena(("k",), _need(), **DIMS)
    arena.counter.fill_(7)  # left by another forward
    arena.next = 7
    seen, fills, launches = [], [], []
    fail = False

    class Padded:  # stands for _PaddedIteration: reads the counter, adds one per iteration
        def __init__(self, op, arena, kv_cache, cache_spec, seqs, max_q, rows, count,
                     scale, host):
            self.arena, self.count = arena, count
            launches.append((rows, count))

        def __call__(self):
            if fail:
                raise RuntimeError("launch failed")
            for _ in range(self.count):
                seen.append(int(self.arena.counter))
                self.arena.counter.add_(1)

    monkeypatch.setattr(attention_module, "_PaddedIteration", Padded)
    replay = _ArenaReplay.__new__(_ArenaReplay)
    replay.arena, replay.shared, replay.device, replay.use_graphs = arena, shared, CPU, False
    replay.op = types.SimpleNamespace(layer_graphs=LayerGraphs(shared))
    replay.key, replay.kv_cache, replay.launch = ("key",), None, (4, 64, 8, 1.0)
    replay.cache_spec = PLAIN8
    real_fill = arena.counter.fill_
    arena.counter.fill_ = lambda i: (fills.append(i), real_fill(i))
    order = [(0, 1), (1, 1), (3, 2), (5, 1), (6, 4)]  # iteration 2 skipped
    for i, count in order:
        replay.run(i, 512 + 32 * i, count)
    assert seen == [0, 1, 3, 4, 5, 6, 7, 8, 9] and fills == [0, 3]
    assert launches == [(512 + 32 * i, count) for i, count in order]
    assert int(arena.counter) == 10 and arena.next == 10
    assert shared.warm_runs == len(order) and shared.captures == shared.replays == 0
    fail = True  # iteration 10 raises before its counter + 1: the host no longer knows it
    with pytest.raises(RuntimeError, match="launch failed"):
        replay.run(10, 512)
    fail = False
    replay.run(11, 512)  # so the next run sets the counter, though 11 would follow 10
    assert seen[-1] == 11 and fills[-1] == 11


def test_first_sight_replays_a_graph_of_bigger_buckets_when_the_layer_has_one():
    """A launch shape met for the first time (captures left to capture_pending) replays a
    captured graph of the same launches over bigger buckets instead of running eagerly (rows up
    to twice as many, the fewest rows first, then the fewest sequences x queries), and is still
    queued for its own capture; without such a graph, or when the caller says the launch cannot
    be stood in for (joined keys), it runs eagerly. (CUDA graphs faked: the control flow.)"""
    shared = IterationGraphs()
    shared._idle_captures = True  # forwards leave captures to capture_pending
    arena = shared.arena(("k",), _need(), **DIMS)
    layer = LayerGraphs(shared)
    layer.lookup((1, 64, "c", 0, 1), arena.generation)  # this generation's graphs

    class Graph:
        def __init__(self, name):
            self.name, self.replays = name, 0

        def replay(self):
            self.replays += 1

        def __repr__(self):
            return f"Graph({self.name})"

    g = {name: Graph(name) for name in ("4x64 1024", "4x64 2048", "8x64 1024", "4x128 4096",
                                        "2x64 1536 two", "new 4x64 4096", "other cache")}
    layer.store((4, 64, "c", 1024, 1), g["4x64 1024"])
    layer.store((4, 64, "c", 2048, 1), g["4x64 2048"])
    layer.store((8, 64, "c", 1024, 1), g["8x64 1024"])
    layer.store((4, 128, "c", 4096, 1), g["4x128 4096"])
    layer.store((2, 64, "c", 1536, 2), g["2x64 1536 two"])  # another run length
    layer.store((4, 64, "c", 4096, "new"), g["new 4x64 4096"])  # the new tokens' stage
    layer.store((4, 64, "d", 1100, 1), g["other cache"])
    assert layer.stand_in((4, 64, "c", 1000, 1)) is g["4x64 1024"]
    assert layer.stand_in((2, 64, "c", 1000, 1)) is g["4x64 1024"]  # fewer sequences x queries
    assert layer.stand_in((8, 64, "c", 600, 1)) is g["8x64 1024"]
    assert layer.stand_in((4, 64, "c", 1100, 1)) is g["4x64 2048"]
    assert layer.stand_in((4, 100, "c", 2100, 1)) is g["4x128 4096"]
    assert layer.stand_in((4, 64, "c", 400, 1)) is None  # 1024 is more than twice the rows
    assert layer.stand_in((16, 64, "c", 1000, 1)) is None  # no graph of 16 sequences
    assert layer.stand_in((4, 64, "c", 1000, 2)) is None  # run length
    assert layer.stand_in((4, 64, "c", 3000, "new")) is g["new 4x64 4096"]
    assert layer.stand_in((4, 64, "c", 1024, 1)) is g["8x64 1024"]  # not itself

    eager = []

    class Padded:
        arena = None

        def __init__(self, key):
            self.key = key

        def __call__(self):
            eager.append(self.key)

    replay = _ArenaReplay.__new__(_ArenaReplay)
    replay.arena, replay.shared, replay.device, replay.use_graphs = arena, shared, CPU, True
    replay.op = types.SimpleNamespace(layer_graphs=layer)
    Padded.arena = arena
    for key, stand_in in (((4, 64, "c", 1100, 1), True), ((4, 64, "c", 400, 1), True),
                          ((4, 64, "c", 1000, 1, "joined", ()), False)):
        replay._launch(key, lambda key=key: Padded(key), stand_in=stand_in)
        assert layer.graphs[key] is None  # seen, queued for capture
        assert (id(layer), key) in shared._pending
    assert g["4x64 2048"].replays == 1 and shared.stand_ins == 1 and shared.replays == 1
    assert eager == [(4, 64, "c", 400, 1), (4, 64, "c", 1000, 1, "joined", ())]
    assert shared.warm_runs == 2


def test_capture_pending_captures_first_sights_only_while_they_are_current(monkeypatch):
    """What capture_pending skips: a key captured at its second sight meanwhile, a key evicted
    from its layer, a key whose arena has grown since; the rest is captured, once."""
    shared = IterationGraphs(max_graphs_per_layer=3)
    captured = []
    monkeypatch.setattr(shared, "capture", lambda device, fn: captured.append(fn) or f"g{fn}")
    arena = shared.arena(("k",), _need(), **DIMS)
    layer = LayerGraphs(shared)

    def first_sight(key, arena):
        seen, graph = layer.lookup(key, arena.generation)
        assert (seen, graph) == (False, None)
        layer.store(key, None)
        shared.defer(layer, key, CPU, types.SimpleNamespace(arena=arena, name=key))

    for key in ("a", "b", "c"):
        first_sight(key, arena)
    layer.store("b", "graph-b")  # b: captured at its second sight inside a forward
    assert shared.captures_in_forward
    assert shared.capture_pending() == 2  # a and c
    assert not shared.captures_in_forward  # from now on forwards leave captures to it
    assert [fn.name for fn in captured] == ["a", "c"]
    assert layer.graphs["a"] == f"g{captured[0]}" and layer.graphs["b"] == "graph-b"
    assert shared.capture_pending() == 0  # nothing left
    first_sight("d", arena)
    first_sight("e", arena)  # evicts the least recently used (a, then b)
    first_sight("f", arena)
    assert "a" not in layer.graphs and "b" not in layer.graphs
    assert shared.capture_pending(limit=1) == 1  # d
    grown = shared.arena(("k",), _need(tokens=10_000), **DIMS)
    assert grown is not arena
    assert not shared._pending  # e and f belonged to the old buffers: dropped with them
    assert shared.capture_pending() == 0
    assert [fn.name for fn in captured] == ["a", "c", "d"]


def test_arena_load_pads_sequences_over_stale_values():
    """What a forward copies into the static buffers: its queries and new latent rows at
    the front, the plan's offsets with the padded sequences empty (cu_q and each cu_k row repeat
    their last value), the block table's rows; a bigger step's values left behind in the
    buffers do not leak into a smaller one's offsets."""
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.staging import StagingRing

    shared = IterationGraphs()
    steps = [([3, 1, 4, 2, 5], [40, 0, 70, 16, 33]), ([2, 6, 1], [9, 64, 50])]
    for query_lens, context_lens in steps:
        x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=8, nope=4, rope=4, v=4,
                             page_size=4)
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=4, v_head_dim=4,
                               graphs=shared)
        plan = ChunkPlanner(32, 4).plan(PrefillBatch(query_lens, context_lens, page_size=4))
        dp = StagingRing("cpu").upload(plan)
        t, n, iters = plan.num_query_tokens, plan.num_reqs, plan.num_iterations
        replay = _ArenaReplay(op, x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], PLAIN8,
                              x["block_table"], dp, 4, 0.5, 512, 512)
        a, seqs = replay.arena, pow2_at_least(n)
        assert torch.equal(a.q[:t], x["q"])
        assert torch.equal(a.workspace[:t], torch.cat([x["kv_c_new"], x["k_pe_new"]], dim=1))
        cu_q = torch.tensor(plan.cu_query_lens, dtype=torch.int32)
        assert torch.equal(a.cu_q[:seqs + 1], torch.cat([cu_q, cu_q[-1:].repeat(seqs - n)]))
        cu_k = torch.tensor(plan.cu_seq_lens, dtype=torch.int32)
        padded_k = torch.cat([cu_k, cu_k[:, -1:].repeat(1, seqs - n)], dim=1)
        assert torch.equal(a.cu_k[:iters, :seqs + 1], padded_k)
        assert torch.equal(a.starts[:iters, :n], torch.tensor(plan.chunk_starts))
        w = x["block_table"].shape[1]
        assert torch.equal(a.block_table[:n, :w], x["block_table"])
        assert int(a.cu_q[seqs]) == t  # every padded sequence: no queries


def test_arena_keeps_offsets_of_the_same_device_plan_and_copies_others():
    """A forward with the DevicePlan the arena's offsets came from skips copying them (a step's
    later layers), and its block table when the DevicePlan holds it; a new upload, or a block
    table the DevicePlan does not hold, is copied again."""
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.staging import StagingRing

    shared = IterationGraphs()
    query_lens, context_lens = [3, 1, 4], [40, 9, 70]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=8, nope=4, rope=4, v=4,
                         page_size=4)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=4, v_head_dim=4, graphs=shared)
    plan = ChunkPlanner(32, 4).plan(PrefillBatch(query_lens, context_lens, page_size=4))

    class WithTable:  # a StagedPlan that ships the block table too, like the bench's steps
        chunk_plan = plan

        def device_arrays(self, *, token_tables=False):
            return {**plan.device_arrays(), "block_table": x["block_table"].numpy()}

    ring = StagingRing("cpu")
    dp = ring.upload(WithTable())

    def load(dp, block_table):
        return _ArenaReplay(op, x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], PLAIN8,
                            block_table, dp, 4, 0.5, 512, 512).arena

    staged_table = dp["block_table"]
    arena = load(dp, staged_table)
    n, w, iters = plan.num_reqs, x["block_table"].shape[1], plan.num_iterations

    def used():  # what a forward copies: cu_q (padded to 4 sequences), cu_k, the table's rows
        return arena.cu_q[:5], arena.cu_k[:iters, :5], arena.block_table[:n, :w]

    good = [t.clone() for t in used()]

    def mark():
        for t in used():
            t.fill_(-7)

    def holds(*which):
        return [torch.equal(t, g) for t, g in zip(used(), good, strict=True)] == list(which)

    mark()
    load(dp, staged_table)  # the same DevicePlan tensors, unchanged: nothing copied
    assert holds(False, False, False)
    load(dp, x["block_table"])  # a caller's block table: always copied
    assert holds(False, False, True)
    mark()
    again = ring.upload(WithTable())  # a new upload of the same plan: copied again
    load(again, again["block_table"])
    assert holds(True, True, True)
    mark()
    load(again, again["block_table"])
    assert holds(False, False, False)
    load(again, staged_table)  # another DevicePlan's block table: not this one's, copied
    assert holds(False, False, True)


def test_a_capture_that_raises_leaves_the_key_eager(monkeypatch):
    """IterationGraphs.capture: an op that cannot be captured (RuntimeError inside the capture)
    returns EAGER, counts the failure, keeps the message, and the streams are joined again;
    a key stored as EAGER is never queued or captured again. (CUDA faked: the control flow.)"""
    import contextlib

    from mlaprefill.graphs import EAGER

    class Stream:
        def __init__(self, *a):
            self.waited = 0

        def wait_stream(self, other):
            self.waited += 1

    current = Stream()

    class Graph:
        def capture_begin(self, **kw):
            pass

        def capture_end(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    shared = IterationGraphs()

    def bad():
        raise RuntimeError("operation not permitted when stream is capturing")

    assert shared.capture(CPU, bad) is EAGER
    assert shared.capture_failures == 1 and shared.captures == 0
    assert "not permitted" in shared.last_capture_error
    assert current.waited == 1  # the current stream waits for the side stream again
    good = shared.capture(CPU, lambda: None)
    assert isinstance(good, Graph) and shared.captures == 1 and current.waited == 2
    layer = LayerGraphs(shared)
    arena = shared.arena(("k",), _need(), **DIMS)
    layer.lookup("k", arena.generation)
    layer.store("k", EAGER)
    shared.defer(layer, "k", CPU, types.SimpleNamespace(arena=arena))
    assert shared.capture_pending() == 0  # an EAGER key is not captured again
    assert layer.graphs["k"] is EAGER
