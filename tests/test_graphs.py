"""mlaprefill.graphs on the CPU: static buffers, their growth, the per-layer graph cache, the
replay counter. The captured graphs themselves are tested on the GPU (tests/test_attention_gpu.py)
and their padded arithmetic in the Triton interpreter (tests/test_triton_attention.py)."""

from __future__ import annotations

import types

import pytest
import torch

from mlaprefill.attention import MLAChunkedPrefill, _ArenaReplay
from mlaprefill.graphs import IterationGraphs, LayerGraphs, pow2_at_least

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


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8", None])
def test_max_graphs_per_layer_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_graphs_per_layer must be an int >= 1"):
        IterationGraphs(max_graphs_per_layer=bad)


def test_iteration_graphs_argument():
    w = torch.zeros(2 * 32, 16)
    shared = IterationGraphs()
    a = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, iteration_graphs=shared)
    b = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, iteration_graphs=shared)
    own = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, iteration_graphs=True)
    off = MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16)
    assert a.iteration_graphs is shared and b.iteration_graphs is shared
    assert isinstance(own.iteration_graphs, IterationGraphs) and own.iteration_graphs is not shared
    assert off.iteration_graphs is None and off._graphs is None
    assert a._graphs is not b._graphs  # graphs record each layer's weights: never shared
    for bad in (1, "yes", None, [shared]):
        with pytest.raises(TypeError, match="iteration_graphs must be a bool or an "
                                            "IterationGraphs"):
            MLAChunkedPrefill(w, qk_nope_head_dim=16, v_head_dim=16, iteration_graphs=bad)


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
    assert shared.arena(key, _need(), **DIMS) is grown  # smaller needs fit the grown one
    other = shared.arena(("other",), _need(), **DIMS)
    assert other.generation > grown.generation and len(shared._arenas) == 2
    assert shared.memory_bytes() > 0
    shared.release()
    assert shared.memory_bytes() == 0


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


def test_replay_counter_set_by_the_host_only_after_a_skipped_iteration():
    """A run of consecutive iterations advances the device counter itself; after a skipped
    iteration (no rows, or joined keys run eagerly) the host sets it."""
    shared = IterationGraphs()
    arena = shared.arena(("k",), _need(), **DIMS)
    arena.counter.fill_(7)  # left by another forward
    arena.next = 7
    seen, fills = [], []
    replay = _ArenaReplay.__new__(_ArenaReplay)
    replay.arena, replay.shared, replay.device, replay.use_graphs = arena, shared, CPU, False
    replay.op = types.SimpleNamespace(_graphs=LayerGraphs(shared))
    replay.key = ("key",)
    replay._iteration = lambda: (seen.append(int(arena.counter)), arena.counter.add_(1))
    real_fill = arena.counter.fill_
    arena.counter.fill_ = lambda i: (fills.append(i), real_fill(i))
    order = [0, 1, 3, 4, 5]  # iteration 2 skipped
    for i in order:
        replay.run(i)
    assert seen == order and fills == [0, 3]
    assert int(arena.counter) == 6 and arena.next == 6
    assert shared.warm_runs == len(order) and shared.captures == shared.replays == 0
