"""CPU tests of the gather and merge kernels (torch fallbacks; Triton via TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import paged_cache, run_interpreter_tests
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import (
    gather_context_rows,
    gather_context_rows_torch,
    merge_attention_states,
    merge_attention_states_torch,
)
from mlaprefill.kernels.gather import rows_to_requests
from mlaprefill.plan import ChunkPlanner

NEG_INF = float("-inf")


@settings(max_examples=25, deadline=None)
@given(
    context_lens=st.lists(st.integers(0, 70), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4, 16]),
    workspace=st.integers(16, 80),
    policy=st.sampled_from(["packed", "equal"]),
)
# always run: zero context, one token, on / one past a page boundary, smallest legal workspace
@example(context_lens=[0, 1, 16, 17, 32], page_size=16, workspace=16, policy="equal")
@example(context_lens=[0, 1, 16, 17, 32], page_size=16, workspace=16, policy="packed")
@example(context_lens=[0], page_size=4, workspace=16, policy="packed")
@example(context_lens=[70], page_size=16, workspace=16, policy="packed")  # one request
@example(context_lens=[64, 0, 1, 0, 3], page_size=16, workspace=16, policy="equal")
def test_gather_matches_plain_indexing(context_lens, page_size, workspace, policy):
    """Every iteration's workspace rows are exactly the cache rows the plan names."""
    n_with_ctx = sum(c > 0 for c in context_lens)
    workspace = max(workspace, page_size * max(n_with_ctx, 1))
    cache, table = paged_cache(context_lens, page_size=page_size, latent_dim=24)
    plan = ChunkPlanner(workspace, page_size, policy=policy).plan(
        PrefillBatch([1] * len(context_lens), context_lens, page_size=page_size))
    covered = [[] for _ in context_lens]
    ws = torch.full((max(plan.max_iteration_tokens, 1), 24), float("nan"))
    for i in range(plan.num_iterations):
        n = plan.iteration_tokens[i]
        rows = gather_context_rows(
            cache, table, torch.from_numpy(plan.cu_seq_lens[i].copy()),
            torch.from_numpy(plan.chunk_starts[i].copy()), ws, n)
        # Plain per-request indexing, written independently of the kernel's row formula.
        expected = []
        for r in range(len(context_lens)):
            start, length = int(plan.chunk_starts[i, r]), int(plan.chunk_lens[i, r])
            for pos in range(start, start + length):
                expected.append(cache[table[r, pos // page_size], pos % page_size])
                covered[r].append(pos)
        assert rows.shape == (n, 24)
        assert torch.equal(rows, torch.stack(expected))
    assert covered == [list(range(c)) for c in context_lens]  # every token once, in order


def test_gather_validates_inputs():
    cache, table = paged_cache([8], page_size=4, latent_dim=8)
    cu, cs = torch.tensor([0, 4], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace has 2 rows"):
        gather_context_rows_torch(cache, table, cu, cs, torch.empty(2, 8), 4)
    with pytest.raises(ValueError, match="block_table must be int32"):
        gather_context_rows_torch(cache, table.long(), cu, cs, torch.empty(4, 8), 4)
    with pytest.raises(ValueError, match=r"kv_cache dtype torch\.float32 != workspace dtype"):
        gather_context_rows_torch(cache, table, cu, cs, torch.empty(4, 8).double(), 4)
    with pytest.raises(ValueError, match=r"cu_seq_lens must be \[num_reqs \+ 1\]"):
        gather_context_rows_torch(cache, table, cu[:1], cs, torch.empty(4, 8), 4)


@settings(max_examples=40, deadline=None)
@given(context_lens=st.lists(st.integers(0, 90), min_size=1, max_size=7),
       page_size=st.sampled_from([1, 8, 16]), workspace=st.integers(16, 100),
       policy=st.sampled_from(["packed", "equal", "balanced"]))
@example(context_lens=[0, 0, 5], page_size=8, workspace=16, policy="packed")
@example(context_lens=[1], page_size=1, workspace=16, policy="packed")
def test_rows_to_requests_is_vllm_token_to_seq(context_lens, page_size, workspace, policy):
    """The device row -> request mapping equals vLLM's host table, padding (0) included."""
    workspace = max(workspace, page_size * len(context_lens))
    plan = ChunkPlanner(workspace, page_size, policy=policy).plan(
        PrefillBatch([1] * len(context_lens), context_lens, page_size=page_size))
    cu = torch.from_numpy(plan.cu_seq_lens.copy())
    table = rows_to_requests(cu, plan.max_iteration_tokens)
    assert table.tolist() == plan.token_to_seq.tolist()
    for i in range(plan.num_iterations):  # one iteration's row, as the gather uses it
        n = plan.iteration_tokens[i]
        assert rows_to_requests(cu[i], n).tolist() == plan.token_to_seq[i, :n].tolist()


@pytest.mark.parametrize("bad_id", [-1, 10, 2**31 - 1])
def test_gather_rejects_block_ids_outside_the_cache(bad_id):
    """A block id outside [0, num_blocks) never reads another page: a clear error on CPU,
    raised before the workspace is touched."""
    cache, table = paged_cache([8, 8], page_size=4, latent_dim=8, spare_blocks=2)
    assert cache.shape[0] == 6
    bad_table = table.clone()
    bad_table[1, 1] = bad_id if bad_id != 10 else cache.shape[0]  # == num_blocks: one past
    cu, cs = torch.tensor([0, 8, 16], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    ws = torch.full((16, 8), 7.0)
    with pytest.raises(ValueError, match=r"block_table\[1\] holds block id .* outside \[0, "
                                         r"num_blocks=6\) for context token 4 of request 1"):
        gather_context_rows(cache, bad_table, cu, cs, ws, 16)
    assert (ws == 7.0).all()  # no state changed
    # the same table is fine when the bad entry is past what the plan reads
    gather_context_rows(cache, bad_table, torch.tensor([0, 8, 12], dtype=torch.int32), cs, ws, 12)


def _merge_ref(o1, l1, o2, l2):
    """float64 merge written from the definition: softmax-weighted average of the two parts."""
    o1, l1, o2, l2 = o1.double(), l1.double(), o2.double(), l2.double()
    lse = torch.logaddexp(l1, l2)
    w1 = torch.where(torch.isneginf(l1), 0.0, torch.exp(l1 - lse))
    w2 = torch.where(torch.isneginf(l2), 0.0, torch.exp(l2 - lse))
    w1 = torch.nan_to_num(w1)
    w2 = torch.nan_to_num(w2)
    out = (torch.where(w1[..., None] > 0, o1, 0.0) * w1[..., None]
           + torch.where(w2[..., None] > 0, o2, 0.0) * w2[..., None])
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_merge_matches_definition_and_inf_rules(dtype):
    g = torch.Generator().manual_seed(0)
    t, h, v = 9, 3, 16
    o1 = torch.randn(t, h, v, generator=g).to(dtype)
    o2 = torch.randn(t, h, v, generator=g).to(dtype)
    l1 = torch.randn(t, h, generator=g) * 3
    l2 = torch.randn(t, h, generator=g) * 3
    l1[0], l2[1] = NEG_INF, NEG_INF   # one side empty
    l1[2], l2[2] = NEG_INF, NEG_INF   # both empty
    o1[2] = float("nan")              # an empty side contributes nothing, even NaN
    o2[1] = float("nan")
    l1[3, 0], l2[3, 0] = 80.0, -80.0  # extreme, must not overflow
    ref_o, ref_l = _merge_ref(o1, l1, o2, l2)
    out, lse = o1.clone(), l1.clone()
    merge_attention_states(out, lse, o2, l2)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert torch.allclose(out.double(), ref_o, atol=tol, rtol=tol)
    finite = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], ref_l[finite], atol=1e-5)


def test_merge_accepts_strided_parts():
    """A V-padded partial output (slice) and a transposed [H, T] LSE merge like dense ones."""
    g = torch.Generator().manual_seed(1)
    t, h, v = 5, 4, 8
    out = torch.randn(t, h, v, generator=g)
    lse = torch.randn(t, h, generator=g)
    part = torch.randn(t, h, 12, generator=g)[..., :v]
    part_lse = torch.randn(h, t, generator=g).t()
    a_o, a_l = out.clone(), lse.clone()
    merge_attention_states(a_o, a_l, part, part_lse)
    b_o, b_l = out.clone(), lse.clone()
    merge_attention_states_torch(b_o, b_l, part.contiguous(), part_lse.contiguous())
    assert torch.equal(a_o, b_o) and torch.equal(a_l, b_l)
    ref_o, ref_l = _merge_ref(out, lse, part, part_lse)  # and both are the right answer
    assert torch.allclose(a_o.double(), ref_o, atol=1e-5, rtol=1e-5)
    assert torch.allclose(a_l.double(), ref_l, atol=1e-5)


def test_merge_validates_shapes():
    with pytest.raises(ValueError, match="part_out shape"):
        merge_attention_states(torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3, 5),
                               torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"must be \[T, H\]"):
        merge_attention_states(torch.zeros(2, 3, 4), torch.zeros(3, 2), torch.zeros(2, 3, 4),
                               torch.zeros(2, 3))


@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    """The Triton kernels' logic, run on CPU tensors by Triton's interpreter (own process:
    TRITON_INTERPRET must be set before triton is imported): tests/interpreter/
    test_interp_kernels.py."""
    run_interpreter_tests("test_interp_kernels.py", passed=1)


def test_plan_arrays_are_int32():
    # The kernels index with the plan's int32 tables; guard the contract they rely on.
    plan = ChunkPlanner(64, 4).plan(PrefillBatch([1, 2], [9, 30], page_size=4))
    for name, arr in plan.device_arrays().items():
        assert arr.dtype == np.int32, name


def test_host_launch_helpers(monkeypatch):
    """The grid helpers every launch uses, and which tensors take the Triton path."""
    import math

    from mlaprefill.kernels import _triton

    assert all(_triton.cdiv(a, b) == math.ceil(a / b) for a in range(200) for b in range(1, 30))
    assert [_triton.next_power_of_2(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    cpu = torch.zeros(1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not _triton.use_triton(cpu) and not _triton.use_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton.use_triton(cpu, cpu) == _triton.HAS_TRITON
    monkeypatch.setattr(_triton, "HAS_TRITON", False)
    assert not _triton.use_triton(cpu)
