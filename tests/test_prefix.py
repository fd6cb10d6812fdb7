"""Prefix sharing (mlaprefill.prefix and the planner's sharing path): the shared tree, the plan's
invariants on shared trees (every cached row of every request attended exactly once), and the
forward against the float64 reference (output and LSE). The Triton kernel path, the iteration
graphs' padded launches and the static I/O run in tests/interpreter/test_interp_prefix.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import paged_mla_inputs, run_interpreter_tests
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import POLICIES, ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.prefix import host_block_table, neighbour_shared_tokens, shared_tree
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing


def shared_table(context_lens, copy_from, page_size):
    """int32 [R, max_blocks]: request r's first ``copy_from[r] = (src, pages)`` pages are request
    ``src``'s (``src < r``; pages 0 = nothing shared), its other pages fresh ids."""
    pages = [-(-c // page_size) for c in context_lens]
    width = max(max(pages), 1) + 1
    table = np.zeros((len(pages), width), dtype=np.int32)
    nxt = 0
    for r, need in enumerate(pages):
        src, n = copy_from[r]
        n = min(n, need, pages[src]) if r else 0
        table[r, :n] = table[src, :n]
        table[r, n:need] = np.arange(nxt, nxt + need - n)
        nxt += need - n
    return table, nxt


@st.composite
def shared_batches(draw, max_reqs=7):
    page_size = draw(st.sampled_from([1, 4, 16]))
    r = draw(st.integers(1, max_reqs))
    ctx = draw(st.lists(st.integers(0, 8 * page_size + 3), min_size=r, max_size=r))
    query = draw(st.lists(st.integers(1, 5), min_size=r, max_size=r))
    copy_from = [(0, 0)] + [
        (draw(st.integers(max(0, i - 2), i - 1)), draw(st.integers(0, 9))) for i in range(1, r)]
    table, _ = shared_table(ctx, copy_from, page_size)
    workspace = draw(st.integers(page_size, 12 * page_size))
    return query, ctx, page_size, table, workspace


def physical_rows(table, r, tokens, page_size):
    tokens = np.asarray(tokens, dtype=np.int64)
    return table[r, tokens // page_size].astype(np.int64) * page_size + tokens % page_size


def workspace_rows(plan, i, table, page_size):
    """int64 [iteration_tokens[i]]: the physical cache row the gather puts in each workspace row
    of iteration i (slot s reads request s's block table from chunk_starts[i, s])."""
    out = []
    for s in range(plan.num_reqs):
        start, n = int(plan.chunk_starts[i, s]), int(plan.chunk_lens[i, s])
        assert plan.cu_seq_lens[i, s + 1] - plan.cu_seq_lens[i, s] == n
        out.append(physical_rows(table, s, np.arange(start, start + n), page_size))
    return np.concatenate(out)


def check_plan_covers_every_row_once(plan, table, query, ctx, page_size, workspace):
    """What each request's queries attend, over all iterations (the attention's sequences over
    the gathered workspace rows), is exactly its context's physical cache rows, each once; per
    iteration the rows fit, every sequence's query range is whole requests, every query is in
    exactly one sequence, and no row is gathered that no query attends."""
    r = len(ctx)
    cu = np.concatenate([[0], np.cumsum(query)])
    attended = [[] for _ in range(r)]
    for i in range(plan.num_iterations):
        assert plan.iteration_tokens[i] <= workspace
        rows = workspace_rows(plan, i, table, page_size)
        seq_q, seq_k, n, max_q = plan.iteration_sequences(i)
        assert seq_q.shape == seq_k.shape == (n + 1,) and 1 <= n <= r
        assert seq_q[0] == 0 and seq_q[-1] == cu[-1] and np.all(np.diff(seq_q) >= 0)
        assert seq_k[0] == 0 and seq_k[-1] == rows.shape[0] and np.all(np.diff(seq_k) >= 0)
        assert max_q == int(np.diff(seq_q).max())
        if plan.shares_prefixes:  # the padding past n: empty sequences
            assert (plan.iteration_cu_query_lens[i, n:] == cu[-1]).all()
            assert (plan.iteration_cu_seq_lens[i, n:] == rows.shape[0]).all()
        for j in range(n):
            lo, hi = int(seq_q[j]), int(seq_q[j + 1])
            keys = rows[seq_k[j]:seq_k[j + 1]]
            if hi == lo:
                assert keys.size == 0, (i, j)  # rows with no queries would be wasted
                continue
            members = np.flatnonzero((cu[:-1] >= lo) & (cu[1:] <= hi))
            assert cu[members[0]] == lo and cu[members[-1] + 1] == hi  # whole requests
            for m in members:
                attended[m].append(keys)
    for m in range(r):
        got = np.sort(np.concatenate(attended[m])) if attended[m] else np.zeros(0, np.int64)
        want = np.sort(physical_rows(table, m, np.arange(ctx[m]), page_size))
        np.testing.assert_array_equal(got, want, err_msg=f"request {m}")


@settings(max_examples=150, deadline=None)
@given(shared_batches(), st.sampled_from(POLICIES), st.sampled_from([0, 0, 0, 4, 16, 64]))
def test_shared_plans_attend_every_row_of_every_request_once(case, policy, min_saved):
    query, ctx, page_size, table, workspace = case
    batch = PrefillBatch(query, ctx, page_size=page_size, block_table=table)
    try:
        plan = ChunkPlanner(workspace, page_size, policy=policy,
                            min_saved_rows=min_saved).plan(batch)
    except ValueError as exc:  # equal's chunk: a depth of the tree has too many requests
        assert policy == "equal" and workspace < np.count_nonzero(ctx) * page_size, exc
        assert "smaller than one page per request" in str(exc)
        return
    check_plan_covers_every_row_once(plan, table, query, ctx, page_size, workspace)
    if policy == "equal" and workspace < np.count_nonzero(ctx) * page_size:
        return  # the plain plan is infeasible (sharing put fewer requests in each depth)
    alone = ChunkPlanner(workspace, page_size, policy=policy, share_prefixes=False).plan(batch)
    assert not alone.shares_prefixes and alone.num_gathered_rows == sum(ctx)
    assert plan.num_context_tokens == sum(ctx)
    shared = neighbour_shared_tokens(table, np.asarray(ctx), page_size)
    tree = shared_tree(shared, ctx, min_saved_rows=min_saved)
    # the rows gathered: each node's once
    assert plan.num_gathered_rows == int((tree.hi - tree.lo).sum())
    saved = (tree.end - tree.first - 1) * (tree.hi - tree.lo)
    assert (saved[tree.end - tree.first > 1] >= min_saved).all()
    if not tree.shares:  # nothing shared: the plan is the plain one, array for array
        assert not plan.shares_prefixes and plan.to_json() == alone.to_json()
    else:
        assert plan.num_gathered_rows == sum(ctx) - int(
            (tree.hi - tree.lo)[tree.end - tree.first > 1].dot(
                (tree.end - tree.first - 1)[tree.end - tree.first > 1]))
        assert set(plan.device_arrays()) == {*alone.device_arrays(), "iteration_cu_query_lens",
                                             "iteration_cu_seq_lens"}


def test_small_runs_are_not_planned_apart():
    # 0-3 share 64 tokens (saves 192 rows), 0-1 another 256 (saves 256), 2-3 nothing more
    table = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 6, 7, 8, 9], [1, 10, 11, 12, 13]],
                     np.int32)
    ctx = np.array([320, 300, 200, 64])
    shared = neighbour_shared_tokens(table, ctx, 64)
    assert shared.tolist() == [300, 64, 64]

    def nodes(tree):
        return sorted(zip(tree.first.tolist(), tree.end.tolist(), tree.lo.tolist(),
                          tree.hi.tolist(), strict=True))

    assert nodes(shared_tree(shared, ctx)) == [
        (0, 1, 300, 320), (0, 2, 64, 300), (0, 4, 0, 64), (2, 3, 64, 200)]
    # the root saves 192 < 200: its 64 tokens go to [0, 2) and to request 2's leaf; request 3
    # (all of its context in the root) gets a leaf of its own
    assert nodes(shared_tree(shared, ctx, min_saved_rows=200)) == [
        (0, 1, 300, 320), (0, 2, 0, 300), (2, 3, 0, 200), (3, 4, 0, 64)]
    assert nodes(shared_tree(shared, ctx, min_saved_rows=1000)) == [
        (0, 1, 0, 320), (1, 2, 0, 300), (2, 3, 0, 200), (3, 4, 0, 64)]
    assert not shared_tree(shared, ctx, min_saved_rows=1000).shares


def test_shared_tree_of_a_small_example():
    # 0, 1, 2 share 2 pages; 0 and 1 a third; 3 shares nothing; 2 ends mid-page
    table = np.array([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [9, 8, 10, 11]], np.int32)
    ctx = np.array([256, 250, 200, 100])
    shared = neighbour_shared_tokens(table, ctx, 64)
    assert shared.tolist() == [192, 128, 0]
    tree = shared_tree(shared, ctx)
    nodes = sorted(zip(tree.first.tolist(), tree.end.tolist(), tree.lo.tolist(),
                       tree.hi.tolist(), tree.depth.tolist(), strict=True))
    assert nodes == [(0, 1, 192, 256, 2), (0, 2, 128, 192, 1), (0, 3, 0, 128, 0),
                     (1, 2, 192, 250, 2), (2, 3, 128, 200, 1), (3, 4, 0, 100, 0)]
    assert tree.num_levels == 3
    plan = ChunkPlanner(4096, 64, min_saved_rows=0).plan(
        PrefillBatch([1, 2, 3, 4], ctx, page_size=64, block_table=table))
    assert plan.num_gathered_rows == 128 + 64 + 64 + 58 + 72 + 100 < plan.num_context_tokens
    # one iteration per depth; its attention's sequences are request runs: [0, 3) and 3;
    # [0, 2), 2 and 3 (no rows); 0, 1 and 2-3 (no rows)
    assert plan.iteration_num_seqs == (2, 3, 3)
    assert plan.iteration_cu_query_lens.tolist() == [
        [0, 6, 10, 10, 10], [0, 3, 6, 10, 10], [0, 1, 3, 10, 10]]
    assert plan.iteration_cu_seq_lens.tolist() == [
        [0, 128, 228, 228, 228], [0, 64, 136, 136, 136], [0, 64, 122, 122, 122]]
    assert plan.iteration_max_query_lens == (6, 4, 7)  # keyless runs too
    # a shared run that is not contiguous in batch order (0 and 2 share, 1 between) is not
    # deduplicated; sharing with a neighbour that ends earlier stops at its context
    table2 = np.array([[1, 2], [3, 4], [1, 2]], np.int32)
    assert neighbour_shared_tokens(table2, np.array([128, 128, 128]), 64).tolist() == [0, 0]
    assert neighbour_shared_tokens(table, np.array([70, 250, 30, 0]), 64).tolist() == [70, 30, 0]


def test_only_a_host_block_table_is_read():
    table = np.zeros((3, 2), np.int32)  # every request the same pages
    args = ([1, 1, 1], [100, 100, 128])
    host = ChunkPlanner(256, 64, min_saved_rows=0).plan(
        PrefillBatch(*args, page_size=64, block_table=table))
    assert host.shares_prefixes and host.num_gathered_rows == 128
    cpu = ChunkPlanner(256, 64, min_saved_rows=0).plan(
        PrefillBatch(*args, page_size=64, block_table=torch.from_numpy(table)))
    assert cpu.to_json() == host.to_json()
    # a table on a device (meta stands in for CUDA: it has no values to read) is never read
    dev = torch.zeros(3, 2, dtype=torch.int32, device="meta")
    assert host_block_table(dev) is None
    plan = ChunkPlanner(256, 64).plan(PrefillBatch(*args, page_size=64, block_table=dev))
    assert not plan.shares_prefixes and plan.num_gathered_rows == 328
    off = ChunkPlanner(256, 64, share_prefixes=False)
    assert not off.plan(PrefillBatch(*args, page_size=64, block_table=table)).shares_prefixes
    assert "share_prefixes=False" in repr(off)
    with pytest.raises(TypeError, match="share_prefixes must be a bool"):
        ChunkPlanner(256, 64, share_prefixes=1)
    with pytest.raises(ValueError, match="min_saved_rows must be an int >= 0"):
        ChunkPlanner(256, 64, min_saved_rows=-1)
    # the default: a run saving fewer than MIN_SAVED_ROWS rows is not planned apart
    assert not ChunkPlanner(256, 64).plan(
        PrefillBatch(*args, page_size=64, block_table=table)).shares_prefixes
    many = ([1] * 40, [128] * 40)  # 39 x 128 = 4992 rows saved
    assert ChunkPlanner(8192, 64).plan(PrefillBatch(*many, page_size=64, block_table=np.zeros(
        (40, 2), np.int32))).shares_prefixes


def _forward(x, query, ctx, page_size, workspace, policy, backend="math"):
    plan = ChunkPlanner(workspace, page_size, policy=policy, min_saved_rows=0).plan(
        PrefillBatch(query, ctx, page_size=page_size, block_table=x["block_table"]))
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"],
                           backend=backend)
    out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                          x["block_table"], StagingRing("cpu").upload(plan), return_lse=True)
    return plan, out, lse


def _with_table(query, ctx, copy_from, page_size, dtype, seed=0):
    table, used = shared_table(ctx, copy_from, page_size)
    x = paged_mla_inputs(query, [used * page_size], page_size=page_size, dtype=dtype, seed=seed)
    x["block_table"] = torch.from_numpy(table)
    return x


# (query_lens, context_lens, copy_from, page_size, workspace): what each case holds
CASES = [
    # a tree: 0-3 share 2 pages, 0-1 share 3, 2-3 a third page; 4 shares nothing
    ([3, 1, 5, 2, 4], [20, 18, 13, 16, 9], [(0, 0), (0, 9), (1, 2), (2, 3), (3, 0)], 4, 8),
    # one request (nothing to share) and page-unaligned tails ending inside the shared pages
    ([4], [13], [(0, 0)], 4, 8),
    ([2, 3, 1], [7, 5, 7], [(0, 0), (0, 2), (1, 2)], 4, 4),
    # everything shared (identical contexts); the shared run ends mid-iteration, one page
    # workspace: many iterations per depth
    ([1, 2, 3, 4], [33, 33, 33, 33], [(0, 0), (0, 9), (1, 9), (2, 9)], 4, 4),
    ([5, 1, 2, 6], [30, 41, 29, 35], [(0, 0), (0, 7), (1, 7), (2, 5)], 4, 12),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_on_shared_trees_matches_the_float64_reference(case, policy):
    query, ctx, copy_from, page_size, workspace = CASES[case]
    x = _with_table(query, ctx, copy_from, page_size, torch.float64, seed=case)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query, ctx,
        x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    if policy == "equal" and workspace < np.count_nonzero(ctx) * page_size:
        workspace = np.count_nonzero(ctx) * page_size
    plan, out, lse = _forward(x, query, ctx, page_size, workspace, policy)
    assert plan.shares_prefixes == (len(query) > 1)
    assert plan.num_gathered_rows < sum(ctx) or len(query) == 1
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(shared_batches(max_reqs=5), st.sampled_from(POLICIES))
def test_forward_on_random_shared_trees_float32(case, policy):
    query, ctx, page_size, table, workspace = case
    if policy == "equal":
        workspace = max(workspace, np.count_nonzero(ctx) * page_size)
    x = paged_mla_inputs(query, [int(table.max() + 1) * page_size], page_size=page_size)
    x["block_table"] = torch.from_numpy(table)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query, ctx,
        x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    _, out, lse = _forward(x, query, ctx, page_size, workspace, policy)
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5


@pytest.mark.slow
def test_prefix_sharing_in_interpreter():
    """The Triton path (gather, kernel, epilogue merge), the iteration graphs' padded launches
    and static I/O on shared trees: tests/interpreter/test_interp_prefix.py, in a process of its
    own under Triton's interpreter."""
    run_interpreter_tests("test_interp_prefix.py", passed=1)


def test_plan_cli_prints_gathered_rows_beside_the_context(capsys):
    from mlaprefill.cli import main

    rc = main(["plan", "--context-lens", "16384,16384,9000,700", "--query-lens",
               "256,256,256,100", "--shared-with-next", "16384,8192,0",
               "--workspace-tokens", "16384"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "context_tokens=42468 gathered_rows=17892 (42.1%: prefix sharing)" in out
    assert "0-2:[0,8192) 3:[0,700)" in out and "0-1:[8192,16384) 2:[8192,9000)" in out
    rc = main(["plan", "--context-lens", "64,64", "--query-lens", "1,1", "--shared-with-next",
               "64,0"])
    assert rc == 2 and "needs num_reqs - 1 = 1 entries" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mlaprefill", "mlaprefill+graphs", "cudnn", "flex", "fa2",
                                     "math"])
def test_gpu_forward_on_a_shared_tree_matches_the_reference(backend):
    """DeepSeek dims in bf16 on the GPU (the Hopper kernel where it runs), a shared tree with a
    run over several iterations, against the float64 reference; with graphs, the replays too."""
    from mlaprefill.graphs import IterationGraphs

    page, heads = 64, 16
    query, ctx = [17, 1, 64, 5, 33, 9], [700, 650, 300, 129, 64, 0]
    table, used = shared_table(ctx, [(0, 0), (0, 11), (1, 4), (2, 2), (3, 0), (4, 0)], page)
    x = paged_mla_inputs(query, [used * page], heads=heads, rank=512, nope=128, rope=64, v=128,
                         page_size=page, dtype=torch.bfloat16, device="cuda")
    x["block_table"] = torch.from_numpy(table).cuda()
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query, ctx,
        x["weight"], qk_nope_head_dim=128, v_head_dim=128)
    base = backend.removesuffix("+graphs")
    graphs = IterationGraphs() if backend.endswith("+graphs") else None
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=128, v_head_dim=128, backend=base,
                           graphs=graphs)
    plan = ChunkPlanner(512, page, policy=op.preferred_policy, min_saved_rows=0).plan(
        PrefillBatch(query, ctx, page_size=page, block_table=table))
    assert plan.shares_prefixes and plan.num_iterations >= 3
    dplan = StagingRing("cuda").upload(plan)
    for _ in range(3 if graphs else 1):  # with graphs: first sight, capture, replay
        out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                              x["block_table"], dplan, return_lse=True)
        if graphs is not None:
            graphs.capture_pending()
        rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
        assert rel <= 1e-2, f"{backend}: relative error {rel:.2e}"
        lse_err = (lse.double().cpu() - ref_lse).abs().max()
        assert lse_err <= 1e-2, f"{backend}: LSE max abs error {lse_err:.2e}"
    if graphs is not None:
        assert graphs.replays > 0
