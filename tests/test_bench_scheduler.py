"""Scheduler, block allocator and per-step engine arrays of the bench engine (pure CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.bench.cache import BlockAllocator, blocks_needed
from mlaprefill.bench.scheduler import Request, Scheduler, SchedulerConfig
from mlaprefill.bench.step import build_engine_arrays


def _simulate(prompt_lens, *, budget, concurrency, page_size, share, num_blocks, finish_delay):
    """Run the scheduler to completion, checking invariants every step; return step list."""
    alloc = BlockAllocator(num_blocks)
    sched = Scheduler(SchedulerConfig(token_budget=budget, max_concurrent=concurrency,
                                      page_size=page_size, share=share), alloc)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(i, int(n)))
    done_tokens = np.zeros(len(prompt_lens), dtype=np.int64)
    finished: set[int] = set()
    to_finish: list[tuple[int, int]] = []  # (step at which the engine observes it, req id)
    steps = []
    step_no = 0
    max_steps = int(sum(prompt_lens)) + len(prompt_lens) * (finish_delay + 2) + 10
    while sched.has_unfinished():
        assert step_no < max_steps, "scheduler stopped making progress (starvation/dead-lock)"
        for item in [t for t in to_finish if t[0] <= step_no]:
            sched.finish(item[1])
            finished.add(item[1])
            to_finish.remove(item)
        step = sched.schedule()
        step_no += 1
        if step is None:
            if not sched.has_unfinished():
                break
            assert to_finish, "nothing scheduled but nothing in flight either"
            continue
        steps.append(step)
        # budget and positivity
        assert step.num_tokens <= budget
        assert (step.query_lens >= 1).all()
        assert len(set(step.req_ids.tolist())) == step.num_reqs
        assert sched.num_running <= concurrency
        # context == tokens prefilled before: every prompt token exactly once, in order
        np.testing.assert_array_equal(step.context_lens, done_tokens[step.req_ids])
        done_tokens[step.req_ids] += step.query_lens
        assert (done_tokens <= np.asarray(prompt_lens)).all()
        np.testing.assert_array_equal(step.finishing,
                                      done_tokens[step.req_ids] == np.asarray(prompt_lens)[
                                          step.req_ids])
        # block tables: enough pages, and no page shared between two requests of the step
        used = []
        for i, rid in enumerate(step.req_ids.tolist()):
            nb = blocks_needed(prompt_lens[rid], page_size)
            row = step.block_table[i, :nb]
            np.testing.assert_array_equal(row, alloc.owned(rid))
            used.extend(row.tolist())
        assert len(used) == len(set(used))
        if share == "fcfs":
            # fcfs fills the budget whenever the running requests have tokens left
            left = sum(r.remaining for r in sched._running) + step.num_tokens
            assert step.num_tokens == min(budget, left)
        else:
            # fair: every running request with tokens left gets some when budget allows
            active = {r.req_id for r in sched._running
                      if r.remaining > 0 or r.req_id in step.req_ids}
            if budget >= len(active):
                assert set(step.req_ids.tolist()) == active
        for rid in step.req_ids[step.finishing].tolist():
            to_finish.append((step_no + finish_delay, rid))
    np.testing.assert_array_equal(done_tokens, prompt_lens)
    assert finished == set(range(len(prompt_lens)))
    assert alloc.num_free == num_blocks and alloc.num_used == 0
    return steps


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 300), min_size=1, max_size=9),
    budget=st.integers(1, 200),
    concurrency=st.integers(1, 5),
    page_size=st.sampled_from([1, 3, 16]),
    share=st.sampled_from(["fcfs", "fair"]),
    extra_blocks=st.integers(0, 40),
    finish_delay=st.integers(0, 2),
)
def test_scheduler_invariants(prompt_lens, budget, concurrency, page_size, share, extra_blocks,
                              finish_delay):
    need = max(blocks_needed(n, page_size) for n in prompt_lens)
    _simulate(prompt_lens, budget=budget, concurrency=concurrency, page_size=page_size,
              share=share, num_blocks=need + extra_blocks, finish_delay=finish_delay)


def test_fcfs_one_long_request_per_step_like_vllm():
    steps = _simulate([8192, 8192, 8192], budget=4096, concurrency=3, page_size=64,
                      share="fcfs", num_blocks=3 * 128, finish_delay=0)
    assert [s.req_ids.tolist() for s in steps] == [[0], [0], [1], [1], [2], [2]]
    assert [s.context_lens.tolist() for s in steps] == [[0], [4096], [0], [4096], [0], [4096]]


def test_fair_splits_budget_and_hands_out_the_rest_in_order():
    steps = _simulate([100, 5, 100], budget=30, concurrency=3, page_size=4, share="fair",
                      num_blocks=60, finish_delay=0)
    # 10 each, req 1 capped at its 5 tokens; the 5 left over go to the oldest (req 0).
    assert steps[0].query_lens.tolist() == [15, 5, 10]
    assert steps[1].query_lens.tolist() == [15, 15]


def test_admission_waits_for_free_blocks_and_frees_on_finish():
    # Only one 64-token prompt fits at a time: the second is admitted after the first finishes.
    steps = _simulate([64, 64], budget=16, concurrency=2, page_size=16, share="fair",
                      num_blocks=4, finish_delay=1)
    first_of_1 = next(i for i, s in enumerate(steps) if 1 in s.req_ids)
    assert all(s.req_ids.tolist() == [0] for s in steps[:first_of_1])
    assert first_of_1 == 4


def test_allocator_errors_and_reuse():
    a = BlockAllocator(4)
    ids = a.allocate(7, 3)
    assert ids.tolist() == [0, 1, 2] and a.num_free == 1
    assert not a.can_allocate(2)
    with pytest.raises(ValueError, match="free"):
        a.allocate(8, 2)
    with pytest.raises(ValueError, match="already holds"):
        a.allocate(7, 1)
    a.free(7)
    with pytest.raises(ValueError, match="double free"):
        a.free(7)
    assert a.allocate(9, 4).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_scheduler_rejects_bad_input():
    sched = Scheduler(SchedulerConfig(token_budget=8, max_concurrent=1, page_size=4),
                      BlockAllocator(2))
    with pytest.raises(ValueError, match="pages"):
        sched.add(Request(0, 9))  # needs 3 pages, cache has 2
    sched.add(Request(1, 8))
    with pytest.raises(ValueError, match="already"):
        sched.add(Request(1, 4))
    with pytest.raises(ValueError, match="share"):
        SchedulerConfig(share="lifo")
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(token_budget=0)
    sched.schedule()
    with pytest.raises(ValueError, match="not running"):
        sched.finish(5)


def test_engine_arrays_match_a_per_token_loop():
    rng = np.random.default_rng(3)
    page = 4
    prompt_lens = np.array([11, 3, 9])
    offsets = np.concatenate(([0], np.cumsum(prompt_lens)))
    tokens = rng.integers(0, 100, size=int(offsets[-1])).astype(np.int32)
    alloc = BlockAllocator(16)
    sched = Scheduler(SchedulerConfig(token_budget=7, max_concurrent=3, page_size=page,
                                      share="fair"), alloc)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(i, int(n)))
    for _ in range(3):
        step = sched.schedule()
        arrays = build_engine_arrays(step, prompt_tokens=tokens, prompt_offsets=offsets,
                                     page_size=page)
        exp = {k: [] for k in ("token_ids", "positions", "slot_mapping")}
        rows = []
        row = 0
        for i, rid in enumerate(step.req_ids.tolist()):
            for j in range(int(step.query_lens[i])):
                p = int(step.context_lens[i]) + j
                exp["positions"].append(p)
                exp["token_ids"].append(int(tokens[offsets[rid] + p]))
                exp["slot_mapping"].append(int(alloc.owned(rid)[p // page]) * page + p % page)
                row += 1
            if step.finishing[i]:
                rows.append(row - 1)
        for k, v in exp.items():
            assert arrays[k].dtype == np.int32
            assert arrays[k].tolist() == v, k
        assert arrays["sample_index"].tolist() == rows
        assert arrays["block_table"].shape == step.block_table.shape
