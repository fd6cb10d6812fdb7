"""DCP layout helpers and DCP planning (pure CPU, no process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import paged_cache, paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill_dcp
from mlaprefill.batch import PrefillBatch
from mlaprefill.dcp import (
    DCPChunkPlanner,
    context_rows,
    dcp_global_token,
    dcp_local_context_lens,
    dcp_token_location,
    dcp_unshard_context,
    shard_paged_cache,
)
from mlaprefill.dcp.forward import reorder_rows_index
from mlaprefill.plan import ChunkPlanner


def _loop_location(t: int, world: int, interleave: int) -> tuple[int, int]:
    # Plain restatement of the layout: deal the interleave units round-robin, one by one.
    counts = [0] * world
    for unit, start in enumerate(range(0, t + 1, interleave)):
        rank = unit % world
        if start + interleave > t:
            return rank, counts[rank] + (t - start)
        counts[rank] += interleave
    raise AssertionError("unreachable")


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 16), (4, 5), (2, 64)])
def test_token_location_matches_loop(world: int, interleave: int) -> None:
    tokens = np.arange(0, 700)
    rank, local = dcp_token_location(tokens, world=world, interleave=interleave)
    expect = np.array([_loop_location(int(t), world, interleave) for t in tokens])
    np.testing.assert_array_equal(rank, expect[:, 0])
    np.testing.assert_array_equal(local, expect[:, 1])
    np.testing.assert_array_equal(
        dcp_global_token(rank, local, world=world, interleave=interleave), tokens)
    # local lengths: how many of the first L tokens each rank holds
    lens = np.array([0, 1, interleave, interleave * world - 1, 699])
    got = dcp_local_context_lens(lens, world=world, interleave=interleave)
    for j, n in enumerate(lens):
        np.testing.assert_array_equal(got[:, j], np.bincount(rank[:n], minlength=world))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_interleave_raises(bad: object) -> None:
    with pytest.raises(ValueError, match="dcp_interleave"):
        dcp_token_location(np.arange(4), world=2, interleave=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dcp_interleave"):
        DCPChunkPlanner(64, 16, world=2, interleave=bad)  # type: ignore[arg-type]


def test_forward_bad_interleave_raises_before_collective() -> None:
    # process_group=None would be the single-rank path: the check must come first anyway.
    t = torch.zeros(1)
    with pytest.raises(ValueError, match="dcp_interleave"):
        mla_chunked_prefill_dcp(t, t, t, t, t, [1], [0], t, process_group=None,
                                dcp_interleave=0)


@pytest.mark.parametrize("world,interleave,page_size", [
    (2, 1, 16), (3, 16, 16), (4, 5, 8), (2, 64, 16), (4, 1, 4)])
def test_shard_roundtrip(world: int, interleave: int, page_size: int) -> None:
    lens = [0, 1, 15, 16, 17, world * interleave - 1, 200]
    cache, table = paged_cache(lens, page_size=page_size, latent_dim=6,
                               seed=world * 100 + interleave)
    shards = shard_paged_cache(cache, table, np.array(lens), world=world,
                               interleave=interleave, seed=7)
    assert len(shards) == world
    local_lens = dcp_local_context_lens(np.array(lens), world=world, interleave=interleave)
    for r, (c, t) in enumerate(shards):
        assert t.dtype == torch.int32 and t.shape[0] == len(lens)
        assert c.shape[1] == page_size
        assert t.shape[1] * page_size >= local_lens[r].max()
        # each local row is the global row the layout says it is
        rows = context_rows(c, t, local_lens[r])
        full = context_rows(cache, table, np.array(lens))
        starts = np.cumsum(lens) - np.array(lens)
        lstarts = np.cumsum(local_lens[r]) - local_lens[r]
        for q, n in enumerate(local_lens[r]):
            glob = dcp_global_token(r, np.arange(n), world=world, interleave=interleave)
            torch.testing.assert_close(rows[lstarts[q]:lstarts[q] + n],
                                       full[starts[q] + glob], rtol=0, atol=0)
    back = dcp_unshard_context(shards, np.array(lens), interleave=interleave)
    torch.testing.assert_close(back, context_rows(cache, table, np.array(lens)), rtol=0, atol=0)


def _simulate(plans, context_lens):
    """Gather every iteration through the plans' local arrays + reorder (numpy, by rank)."""
    world = plans[0].world
    interleave = plans[0].interleave
    # token ids as "rows": request r token t -> r * 10**6 + t
    tokens = [r * 10**6 + np.arange(n) for r, n in enumerate(context_lens)]
    local = [[tk[(np.arange(tk.size) // interleave) % world == k] for tk in tokens]
             for k in range(world)]
    p = plans[0]
    for i in range(p.base.num_iterations):
        cap = p.rank_capacity[i]
        gathered = np.full(world * cap, -1, dtype=np.int64)
        for k, pk in enumerate(plans):
            share = np.concatenate([local[k][r][s:s + n] for r, (s, n) in enumerate(
                zip(pk.local_chunk_starts[i], pk.local_chunk_lens[i], strict=True))])
            assert share.size == pk.local_iteration_tokens[i] <= cap
            assert pk.local_cu_seq_lens[i, -1] == share.size
            rows = np.arange(share.size)
            np.testing.assert_array_equal(
                pk.local_token_to_seq[i, :share.size],
                np.searchsorted(pk.local_cu_seq_lens[i], rows, side="right") - 1)
            gathered[k * cap:k * cap + share.size] = share
        n = p.base.iteration_tokens[i]
        expect = np.concatenate([tokens[r][s:s + m] for r, (s, m) in enumerate(
            zip(p.base.chunk_starts[i], p.base.chunk_lens[i], strict=True))])
        np.testing.assert_array_equal(gathered[p.reorder_index[i, :n]], expect)
        # what the forward does: the same rows from the compact reorder_base, on the "device"
        idx = reorder_rows_index(*(torch.from_numpy(a[i].copy()) for a in (
            p.base.cu_seq_lens, p.base.chunk_starts, p.reorder_base)), n, world=world,
            interleave=interleave).numpy()
        np.testing.assert_array_equal(idx, p.reorder_index[i, :n])
        np.testing.assert_array_equal(gathered[idx], expect)
        assert world * cap <= p.workspace_tokens


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    world=st.integers(1, 4),
    interleave=st.sampled_from([1, 3, 16, 64]),
    page_size=st.sampled_from([8, 16]),
    workspace_pages=st.integers(4, 24),
    policy=st.sampled_from(["packed", "equal", "balanced"]),
)
def test_plan_reorder_reproduces_single_rank_workspace(lens, world, interleave, page_size,
                                                       workspace_pages, policy) -> None:
    batch = PrefillBatch([1] * len(lens), lens, page_size=page_size)
    planner = DCPChunkPlanner(workspace_pages * page_size, page_size, world=world,
                              interleave=interleave, policy=policy)
    try:
        plans = [planner.plan(batch, rank=k) for k in range(world)]
    except ValueError as exc:
        assert "workspace_tokens" in str(exc)
        return
    base = plans[0].base
    for pk in plans[1:]:  # identical on every rank except the local arrays
        assert pk.base.to_json() == base.to_json()
        assert pk.rank_capacity == plans[0].rank_capacity
        np.testing.assert_array_equal(pk.reorder_index, plans[0].reorder_index)
        assert pk.digest == plans[0].digest
    if base.workspace_tokens == planner.workspace_tokens:  # no replanning: the normal plan
        normal = ChunkPlanner(planner.workspace_tokens, page_size, policy).plan(batch)
        np.testing.assert_array_equal(base.chunk_starts, normal.chunk_starts)
        np.testing.assert_array_equal(base.chunk_lens, normal.chunk_lens)
    _simulate(plans, lens)


def test_plan_device_arrays_and_forwarding() -> None:
    batch = PrefillBatch([2, 1, 3], [0, 40, 37], page_size=16)
    plan = DCPChunkPlanner(64, 16, world=2, interleave=16).plan(batch, rank=1)
    arrays = plan.device_arrays()
    assert list(arrays)[:4] == list(plan.base.device_arrays())
    assert list(arrays)[4:] == ["local_chunk_starts", "local_chunk_lens", "local_cu_seq_lens",
                                "reorder_base"]
    assert all(a.dtype == np.int32 for a in arrays.values())
    # O(world x iterations x requests): nothing per context token ships by default
    k, r, world = plan.base.num_iterations, plan.base.num_reqs, plan.world
    assert sum(a.size for a in arrays.values()) == (r + 1) + 2 * k * (3 * r + 1) + k * r * world
    tables = plan.device_arrays(token_tables=True)
    assert {"token_to_seq", "local_token_to_seq", "reorder_index"} <= set(tables)
    np.testing.assert_array_equal(tables["reorder_index"], plan.reorder_index)
    assert plan.chunk_plan is plan.base  # composition, no attribute forwarding
    assert not hasattr(plan, "iteration_tokens")
    # I=16, world 2: rank 1 holds tokens 16..31 of both contexts (40 and 37 tokens)
    np.testing.assert_array_equal(plan.local_context_lens, [0, 16, 16])
    assert plan.to_json()["dcp"]["world"] == 2


def test_zero_context_plan() -> None:
    batch = PrefillBatch([3, 1], [0, 0], page_size=16)
    plan = DCPChunkPlanner(64, 16, world=3, interleave=1).plan(batch, rank=2)
    assert plan.base.num_iterations == 0 and plan.rank_capacity == ()
    assert plan.reorder_index.shape == (0, 0)
    assert plan.local_token_to_seq.shape == (0, 0)


def test_unbalanced_shares_replan_to_fit() -> None:
    # I = page = 16, world 4: a 16-token piece lands on one rank, so shares are unbalanced and
    # the padded all-gather of the normal 64-token plan would need more than 64 rows.
    batch = PrefillBatch([1] * 4, [16, 16, 16, 16], page_size=16)
    plan = DCPChunkPlanner(64, 16, world=4, interleave=16).plan(batch, rank=0)
    assert plan.max_gathered_tokens <= 64
    assert plan.base.workspace_tokens < 64
    assert sum(plan.base.iteration_tokens) == 64


def test_workspace_too_small_for_gathered_rows() -> None:
    batch = PrefillBatch([1], [64], page_size=16)
    with pytest.raises(ValueError, match="cannot hold the all-gathered rows"):
        DCPChunkPlanner(16, 16, world=4, interleave=16).plan(batch, rank=0)
    with pytest.raises(ValueError, match="rank"):
        DCPChunkPlanner(64, 16, world=2, interleave=1).plan(batch, rank=2)


def test_single_rank_path_is_the_plain_forward() -> None:
    from mlaprefill.api import mla_chunked_prefill

    query_lens, context_lens = [2, 1], [20, 0]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=16, nope=8, rope=8, v=8,
                         page_size=16, seed=3)
    args = (*(x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")),
            query_lens, context_lens, x["weight"])
    got = mla_chunked_prefill_dcp(*args, process_group=None, dcp_interleave=16,
                                  workspace_tokens=16, return_lse=True)
    want = mla_chunked_prefill(*args, workspace_tokens=16, return_lse=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 500), min_size=1, max_size=6),
    world=st.integers(2, 4),
    interleave=st.sampled_from([8, 16, 24, 64]),
    page_size=st.sampled_from([8, 16, 64]),
    workspace_pages=st.integers(2, 30),
    policy=st.sampled_from(["packed", "equal", "balanced"]),
)
def test_reorder_runs_path_equals_per_token_path(lens, world, interleave, page_size,
                                                 workspace_pages, policy) -> None:
    from mlaprefill.dcp import plan as dcp_plan

    batch = PrefillBatch([1] * len(lens), lens, page_size=page_size)
    planner = DCPChunkPlanner(workspace_pages * page_size, page_size, world=world,
                              interleave=interleave, policy=policy)
    try:
        runs = planner.plan(batch, rank=0)
    except ValueError as exc:  # only a too-small workspace may refuse the batch
        assert "workspace_tokens" in str(exc)
        return
    saved = dcp_plan._RUNS_MIN_INTERLEAVE
    dcp_plan._RUNS_MIN_INTERLEAVE = 10**9  # force the per-token path
    try:
        per_token = planner.plan(batch, rank=0)
    finally:
        dcp_plan._RUNS_MIN_INTERLEAVE = saved
    assert runs.reorder_index.dtype == per_token.reorder_index.dtype == np.int32
    np.testing.assert_array_equal(runs.reorder_index, per_token.reorder_index)


def test_context_source_rejects_wrong_plan_or_group() -> None:
    from mlaprefill.dcp import DCPContextSource
    from mlaprefill.staging import StagingRing

    batch = PrefillBatch([1, 1], [40, 9], page_size=16)
    cache, table = paged_cache([40, 9], page_size=16, latent_dim=24, seed=1)
    ring = StagingRing("cpu")
    with pytest.raises(TypeError, match="DCPChunkPlan"):
        DCPContextSource(cache, table, ring.upload(ChunkPlanner(64, 16).plan(batch)), None)
    dcp_plan = DCPChunkPlanner(64, 16, world=2, interleave=16).plan(batch, rank=1)
    with pytest.raises(ValueError, match="rank 1 of 2"):
        DCPContextSource(cache, table, ring.upload(dcp_plan), None)  # None = rank 0 of 1


def test_larger_gather_bound_keeps_the_single_rank_iterations() -> None:
    batch = PrefillBatch([1] * 4, [16, 16, 16, 16], page_size=16)
    tight = DCPChunkPlanner(64, 16, world=4, interleave=16).plan(batch, rank=0)
    loose = DCPChunkPlanner(64, 16, world=4, interleave=16,
                            max_gathered_tokens=256).plan(batch, rank=0)
    normal = ChunkPlanner(64, 16).plan(batch)
    assert tight.base.num_iterations > normal.num_iterations
    assert loose.base.to_json() == normal.to_json()
    assert 64 < loose.max_gathered_tokens <= 256
    with pytest.raises(ValueError, match="max_gathered_tokens=16 cannot hold"):
        DCPChunkPlanner(64, 16, world=4, interleave=16, max_gathered_tokens=16).plan(batch,
                                                                                     rank=0)
    with pytest.raises(ValueError, match="max_gathered_tokens"):
        DCPChunkPlanner(64, 16, world=4, interleave=16, max_gathered_tokens=0)


@pytest.mark.parametrize("world, interleave, words", [
    (2**40, 16, "world = 1099511627776 is more than 4,096"),  # was: tried to allocate 8 TiB
    (10**6, 16, "world = 1000000 is more than 4,096"),  # was: 10.7 s before its error
    (2, 2**31, "dcp_interleave = 2147483648 is more than"),
])
def test_dcp_sizes_bounded_before_planning(world, interleave, words):
    with pytest.raises(ValueError, match=words):
        DCPChunkPlanner(64, 16, world=world, interleave=interleave)
    assert DCPChunkPlanner(64, 16, world=4096, interleave=16).world == 4096
