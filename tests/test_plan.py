import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlan, ChunkPlanner

# ----------------------------------------------------------------------------- brute force


def brute_equal(ctx, w, ps):
    """vLLM's equal chunking written plainly. Returns (starts, lens) as lists or None."""
    n = sum(1 for c in ctx if c > 0)
    if n == 0:
        return [], []
    chunk = (w // n) // ps * ps
    if chunk == 0:
        return None
    num_chunks = -(-max(ctx) // chunk)
    starts, lens = [], []
    for c in range(num_chunks):
        starts.append([c * chunk for _ in ctx])
        lens.append([max(0, min((c + 1) * chunk, x) - c * chunk) for x in ctx])
    return starts, lens


def cut_points(ctx, ps):
    """Every valid cut in the stream: request boundaries and page-aligned offsets inside."""
    pts = {0}
    pos = 0
    for x in ctx:
        for off in range(0, x, ps):
            pts.add(pos + off)
        pos += x
        pts.add(pos)
    return sorted(pts)


def brute_min_stream_iterations(ctx, w, ps):
    """Exact optimum over stream plans by dynamic programming over all cut points."""
    pts = cut_points(ctx, ps)
    best = {pts[0]: 0}
    for j in pts[1:]:
        cands = [best[i] + 1 for i in pts if i < j and j - i <= w and i in best]
        if cands:
            best[j] = min(cands)
    return best[pts[-1]]


def brute_greedy_stream(ctx, w, ps):
    """Greedy furthest reach, token positions scanned plainly. Returns (starts, lens)."""
    pts = cut_points(ctx, ps)
    total = pts[-1]
    cuts = [0]
    while cuts[-1] < total:
        cuts.append(max(p for p in pts if p <= cuts[-1] + w))
    begins = [sum(ctx[:r]) for r in range(len(ctx))]
    starts, lens = [], []
    for a, b in itertools.pairwise(cuts):
        srow, lrow = [], []
        for r, x in enumerate(ctx):
            lo = min(max(a, begins[r]), begins[r] + x)
            hi = min(max(b, begins[r]), begins[r] + x)
            srow.append(lo - begins[r])
            lrow.append(hi - lo)
        starts.append(srow)
        lens.append(lrow)
    return starts, lens


def brute_token_to_seq(lens):
    width = max((sum(row) for row in lens), default=0)
    out = []
    for row in lens:
        ids = []
        for r, n in enumerate(row):
            ids += [r] * n
        out.append(ids + [0] * (width - len(ids)))
    return out


def check_invariants(plan: ChunkPlan, ctx, w):
    k, r = plan.num_iterations, len(ctx)
    assert plan.chunk_starts.shape == (k, r) and plan.chunk_lens.shape == (k, r)
    assert plan.cu_seq_lens.shape == (k, r + 1)
    assert plan.token_to_seq.shape == (k, plan.max_iteration_tokens)
    for a in plan.device_arrays().values():
        assert a.dtype == np.int32
    # every context token covered exactly once, in order
    for req in range(r):
        nxt = 0
        for i in range(k):
            n = int(plan.chunk_lens[i, req])
            if n:
                assert int(plan.chunk_starts[i, req]) == nxt
                nxt += n
        assert nxt == ctx[req]
    assert all(t <= w for t in plan.iteration_tokens)
    assert list(plan.iteration_tokens) == plan.cu_seq_lens[:, -1].tolist()
    assert list(plan.max_chunk_lens) == [int(row.max()) for row in plan.chunk_lens]
    assert np.array_equal(plan.cu_seq_lens[:, 1:], np.cumsum(plan.chunk_lens, axis=1))
    assert plan.token_to_seq.tolist() == brute_token_to_seq(plan.chunk_lens.tolist())
    assert plan.max_iteration_tokens == max(plan.iteration_tokens, default=0)


# ----------------------------------------------------------------------------- strategies

@st.composite
def batches(draw):
    ps = draw(st.sampled_from([1, 2, 4, 16, 64]))
    n = draw(st.integers(1, 7))
    aligned = draw(st.booleans())
    ctx = []
    for _ in range(n):
        if draw(st.integers(0, 4)) == 0:
            ctx.append(0)
        elif aligned:
            ctx.append(ps * draw(st.integers(0, 600 // ps + 1)))
        else:
            ctx.append(draw(st.integers(0, 700)))
    q = [draw(st.integers(1, 9)) for _ in range(n)]
    w = ps * draw(st.integers(1, 1000 // ps + 2)) if aligned else draw(st.integers(ps, 1000))
    return ctx, q, w, ps


@settings(max_examples=300, deadline=None)
@given(batches())
def test_equal_matches_brute_force(case):
    ctx, q, w, ps = case
    expected = brute_equal(ctx, w, ps)
    planner = ChunkPlanner(w, ps, "equal")
    batch = PrefillBatch(q, ctx, page_size=ps)
    if expected is None:
        with pytest.raises(ValueError, match="smaller than one page per request with context"):
            planner.plan(batch)
        return
    plan = planner.plan(batch)
    assert plan.chunk_starts.tolist() == expected[0]
    assert plan.chunk_lens.tolist() == expected[1]
    assert plan.policy == "equal"
    check_invariants(plan, ctx, w)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_packed_matches_brute_force_and_bounds(case):
    ctx, q, w, ps = case
    plan = ChunkPlanner(w, ps, "packed").plan(PrefillBatch(q, ctx, page_size=ps))
    check_invariants(plan, ctx, w)
    # the optimal stream plan (dynamic programming over every cut point) ...
    assert plan.num_iterations == brute_min_stream_iterations(ctx, w, ps)
    starts, lens = brute_greedy_stream(ctx, w, ps)
    assert plan.chunk_starts.tolist() == starts and plan.chunk_lens.tolist() == lens
    # ... is never worse than vLLM's equal chunking (proof in mlaprefill.plan's docstring)
    eq = brute_equal(ctx, w, ps)
    if eq is not None:
        assert plan.num_iterations <= len(eq[0])
    total = sum(ctx)
    lower = -(-total // w)
    assert plan.num_iterations >= lower
    if w % ps == 0 and all(x % ps == 0 for x in ctx):
        assert plan.num_iterations == lower
    assert plan.num_iterations <= -(-total // (w - ps + 1))


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([1, 4, 16, 64]), st.integers(1, 6), st.integers(1, 6), st.data())
def test_packed_never_worse_than_equal_tight_workspace(ps, n, k, data):
    # W just at n pages per request (equal's chunk is 1 page) with unaligned lengths: the
    # regime where page-aligned stream cuts lose the most.
    w = n * ps + data.draw(st.integers(0, ps - 1))
    ctx = data.draw(st.lists(st.integers(1, k * ps), min_size=n, max_size=n))
    batch = PrefillBatch([1] * n, ctx, page_size=ps)
    packed = ChunkPlanner(w, ps, "packed").plan(batch)
    equal = ChunkPlanner(w, ps, "equal").plan(batch)
    assert packed.num_iterations <= equal.num_iterations
    check_invariants(packed, ctx, w)


def brute_balanced(ctx, w, ps):
    """Smallest K whose first iteration (min(chunk, ctx) per request, chunks
    ceil_page(ceil(ctx/K))) fits W, scanning K upward.

    Returns (starts, lens) or None when even one page per request does not fit."""
    if not any(ctx):
        return [], []
    for k in range(1, max(ctx) + 1):
        chunks = [math.ceil(math.ceil(x / k) / ps) * ps for x in ctx]
        if sum(min(c, x) for c, x in zip(chunks, ctx, strict=True)) <= w:  # first iteration
            iters = max(math.ceil(x / c) for x, c in zip(ctx, chunks, strict=True) if x)
            starts = [[i * c for c in chunks] for i in range(iters)]
            lens = [[max(0, min(c, x - i * c)) for x, c in zip(ctx, chunks, strict=True)]
                    for i in range(iters)]
            return starts, lens
    return None


@settings(max_examples=300, deadline=None)
@given(batches())
def test_balanced_matches_brute_force_and_bounds(case):
    ctx, q, w, ps = case
    plan = ChunkPlanner(w, ps, "balanced").plan(PrefillBatch(q, ctx, page_size=ps))
    check_invariants(plan, ctx, w)
    assert plan.policy == "balanced"
    expected = brute_balanced(ctx, w, ps)
    if expected is None:  # no request-per-iteration plan fits: the packed plan
        packed = ChunkPlanner(w, ps, "packed").plan(PrefillBatch(q, ctx, page_size=ps))
        assert plan.chunk_lens.tolist() == packed.chunk_lens.tolist()
        assert plan.chunk_starts.tolist() == packed.chunk_starts.tolist()
        return
    assert plan.chunk_starts.tolist() == expected[0]
    assert plan.chunk_lens.tolist() == expected[1]
    eq = brute_equal(ctx, w, ps)
    if eq is not None:  # proof in mlaprefill.plan's docstring
        assert plan.num_iterations <= len(eq[0])
    assert plan.num_iterations >= -(-sum(ctx) // w)
    if 0 < sum(ctx) <= w:
        assert plan.num_iterations == 1
    # every request with context has a piece in every iteration until its last
    for r, x in enumerate(ctx):
        pieces = [int(n) for n in plan.chunk_lens[:, r]]
        nonzero = [i for i, n in enumerate(pieces) if n]
        assert nonzero == list(range(len(nonzero))) and (len(nonzero) > 0) == (x > 0)


@pytest.mark.parametrize("seed", range(6))
def test_balanced_matches_brute_force_for_many_requests(seed):
    """More than 64 requests take the planner's numpy search path: the same plans."""
    rng = np.random.default_rng(seed)
    r = int(rng.integers(65, 130))
    ctx = rng.integers(0, 3000, size=r).tolist()
    ps = int(rng.choice([1, 16, 64]))
    w = int(rng.integers(r * ps, 40 * r * ps + 1))
    plan = ChunkPlanner(w, ps, "balanced").plan(PrefillBatch([1] * r, ctx, page_size=ps))
    check_invariants(plan, ctx, w)
    expected = brute_balanced(ctx, w, ps)
    assert expected is not None
    assert plan.chunk_starts.tolist() == expected[0]
    assert plan.chunk_lens.tolist() == expected[1]


def test_balanced_fits_in_one_iteration_when_everything_fits():
    # 110 x 290 = 31,900 tokens <= W: chunk rounding (290 -> 320 per request) must not matter
    b = PrefillBatch([1] * 110, [290] * 110, page_size=64)
    assert ChunkPlanner(32768, 64, "balanced").plan(b).num_iterations == 1
    assert ChunkPlanner(100, 64, "balanced").plan(
        PrefillBatch([1], [100], page_size=64)).num_iterations == 1


def test_balanced_keeps_every_request_busy_where_packed_serializes():
    # one long and three short contexts: packed gives the long one whole iterations alone
    b = PrefillBatch([256] * 4, [163840, 8192, 4096, 100], page_size=64)
    packed = ChunkPlanner(65536, 64, "packed").plan(b)
    balanced = ChunkPlanner(65536, 64, "balanced").plan(b)
    equal = ChunkPlanner(65536, 64, "equal").plan(b)
    assert packed.num_iterations == balanced.num_iterations == 3 < equal.num_iterations == 10
    assert (packed.chunk_lens[0] > 0).tolist() == [True, False, False, False]
    assert (balanced.chunk_lens[0] > 0).all()
    assert balanced.chunk_lens.tolist() == [[54656, 2752, 1408, 64], [54656, 2752, 1408, 36],
                                            [54528, 2688, 1280, 0]]


def test_issue_example():
    b = PrefillBatch([4096, 512], [80000, 1000], page_size=64)
    p = ChunkPlanner(65536, 64).plan(b)
    assert p.num_iterations == 2
    assert p.chunk_starts.tolist() == [[0, 0], [65536, 0]]
    assert p.chunk_lens.tolist() == [[65536, 0], [14464, 1000]]
    assert p.cu_seq_lens.tolist() == [[0, 65536, 65536], [0, 14464, 15464]]
    assert p.iteration_tokens == (65536, 15464) and p.max_chunk_lens == (65536, 14464)
    assert p.cu_query_lens.tolist() == [0, 4096, 4608]
    assert p.num_query_tokens == 4608 and p.max_query_len == 4096
    e = ChunkPlanner(65536, 64, "equal").plan(b)
    assert e.chunk_lens.tolist() == [[32768, 1000], [32768, 0], [14464, 0]]
    assert e.chunk_starts.tolist() == [[0, 0], [32768, 32768], [65536, 65536]]


@pytest.mark.parametrize("policy", ["equal", "packed", "balanced"])
def test_zero_context_fast_path(policy):
    p = ChunkPlanner(128, 64, policy).plan(PrefillBatch([3, 5], [0, 0], page_size=64))
    assert p.num_iterations == 0 and p.iteration_tokens == () and p.max_iteration_tokens == 0
    assert p.chunk_starts.shape == (0, 2) and p.cu_seq_lens.shape == (0, 3)
    assert p.token_to_seq.shape == (0, 0)
    assert p.cu_query_lens.tolist() == [0, 3, 8]


def test_plan_is_read_only_and_deterministic():
    b = PrefillBatch([1, 2, 3], [100, 0, 700], page_size=16)
    p1 = ChunkPlanner(256, 16).plan(b)
    p2 = ChunkPlanner(256, 16).plan(b)
    for name, a in p1.device_arrays().items():
        assert not a.flags.writeable
        assert np.array_equal(a, p2.device_arrays()[name])
    assert list(p1.device_arrays()) == ["cu_query_lens", "chunk_starts", "chunk_lens",
                                        "cu_seq_lens"]
    assert list(p1.device_arrays(token_tables=True))[-1] == "token_to_seq"


def test_to_json_nested_lists():
    p = ChunkPlanner(128, 16).plan(PrefillBatch([1, 1], [100, 60], page_size=16))
    j = p.to_json()
    assert j["policy"] == "packed" and j["num_iterations"] == p.num_iterations
    assert j["chunk_lens"] == p.chunk_lens.tolist() and isinstance(j["chunk_lens"][0], list)
    assert "token_to_seq" not in j
    assert p.to_json(token_tables=True)["token_to_seq"] == p.token_to_seq.tolist()
    assert math.isclose(sum(j["iteration_tokens"]), 160)


@pytest.mark.parametrize("args, match", [
    ((0, 64), r"workspace_tokens must be a positive int, got 0"),
    ((1.5, 64), r"workspace_tokens must be a positive int"),
    ((True, 64), r"workspace_tokens must be a positive int"),
    ((2**31, 64), r"workspace_tokens = 2147483648 overflows int32"),
    ((128, 0), r"page_size must be a positive int"),
    ((128, 64, "fair"), r"policy must be one of \['equal', 'packed', 'balanced'\], got 'fair'"),
    ((32, 64), r"workspace_tokens=32 is smaller than one page \(page_size=64\)"),
])
def test_planner_arg_validation(args, match):
    with pytest.raises(ValueError, match=match):
        ChunkPlanner(*args)


def test_page_size_mismatch_and_type():
    planner = ChunkPlanner(128, 64)
    with pytest.raises(ValueError, match=r"batch.page_size=16 differs|page_size=16 differs"):
        planner.plan(PrefillBatch([1], [5], page_size=16))
    with pytest.raises(TypeError, match="expects a PrefillBatch"):
        planner.plan({"query_lens": [1]})


def test_equal_workspace_too_small_message():
    planner = ChunkPlanner(128, 64, "equal")
    with pytest.raises(ValueError, match=(
            r"workspace_tokens=128 is smaller than one page per request with context "
            r"\(n × page_size = 3 × 64 = 192\); raise workspace_tokens or lower concurrency")):
        planner.plan(PrefillBatch([1, 1, 1, 1], [10, 0, 10, 10], page_size=64))
    # packed still plans it (stream cuts need only W >= page_size)
    p = ChunkPlanner(128, 64).plan(PrefillBatch([1, 1, 1, 1], [10, 0, 10, 10], page_size=64))
    assert p.num_iterations == 1


def test_many_requests_large_plan_is_vectorized_and_correct():
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 5000, size=64)
    b = PrefillBatch(np.ones(64, np.int64), ctx, page_size=64)
    for policy in ("equal", "packed"):
        p = ChunkPlanner(16384, 64, policy).plan(b)
        assert p.chunk_lens.sum(axis=0).tolist() == ctx.tolist()
        rows = [np.bincount(p.token_to_seq[i, :t], minlength=64).tolist()
                for i, t in enumerate(p.iteration_tokens)]
        assert rows == p.chunk_lens.tolist()
