"""CPU tests of the forward against a float64 reference written plainly here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import paged_mla_inputs
from mlaprefill.api import mla_chunked_prefill
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import MLAChunkedPrefill
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing


def plain_reference(q, kv_c_new, k_pe_new, cache, table, query_lens, context_lens, weight,
                    nope, v):
    """Materialize K and V of the whole context + new tokens per request; causal mask; float64."""
    _, h, qk = q.shape
    rank, page = weight.shape[1], cache.shape[1]
    w = weight.double().reshape(h, nope + v, rank)
    outs, lses = [], []
    start = 0
    for r, (n_new, n_ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        ctx = torch.stack([cache[table[r, p // page], p % page] for p in range(n_ctx)]) \
            if n_ctx else cache.new_zeros(0, cache.shape[2])
        new = torch.cat([kv_c_new[start:start + n_new], k_pe_new[start:start + n_new]], 1)
        lat = torch.cat([ctx, new]).double()  # [S, rank + rope]
        keys = torch.cat([torch.einsum("sr,hdr->shd", lat[:, :rank], w[:, :nope]),
                          lat[:, None, rank:].expand(-1, h, -1)], -1)  # [S, H, qk]
        vals = torch.einsum("sr,hdr->shd", lat[:, :rank], w[:, nope:])  # [S, H, v]
        s = torch.einsum("ihd,shd->his", q[start:start + n_new].double(), keys) / math.sqrt(qk)
        allowed = torch.arange(n_ctx + n_new)[None, :] <= n_ctx + torch.arange(n_new)[:, None]
        s = s.masked_fill(~allowed, float("-inf"))
        lses.append(torch.logsumexp(s, -1).t())
        outs.append(torch.einsum("his,shd->ihd", torch.softmax(s, -1), vals))
        start += n_new
    return torch.cat(outs), torch.cat(lses)


def run_forward(x, query_lens, context_lens, workspace, policy, **kw):
    plan = ChunkPlanner(workspace, x["page_size"], policy=policy).plan(
        PrefillBatch(query_lens, context_lens, page_size=x["page_size"]))
    dplan = StagingRing("cpu").upload(plan)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                          x["block_table"], dplan, return_lse=True, **kw)
    return out, lse, plan, op


def check(out, lse, x, query_lens, context_lens, dtype):
    ref_out, ref_lse = plain_reference(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                       x["block_table"], query_lens, context_lens, x["weight"],
                                       x["nope"], x["v"])
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.isfinite(lse).all() and not torch.isnan(out).any()
    out_tol, lse_tol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    rel = (out.double() - ref_out).norm() / ref_out.norm()
    assert rel <= out_tol, f"relative error {rel:.2e}"
    assert (lse.double() - ref_lse).abs().max() <= lse_tol


page_sizes = st.sampled_from([1, 2, 4, 8])


@st.composite
def batches(draw):
    page = draw(page_sizes)
    n = draw(st.integers(1, 4))
    query_lens = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    # awkward contexts: none, one token, exactly on a page boundary, one past it, random
    ctx = st.one_of(st.just(0), st.just(1), st.integers(1, 4).map(lambda k: k * page),
                    st.integers(1, 4).map(lambda k: k * page + 1), st.integers(0, 40))
    context_lens = draw(st.lists(ctx, min_size=n, max_size=n))
    with_ctx = max(1, sum(c > 0 for c in context_lens))
    # from the smallest legal workspace (many iterations) to one that holds everything
    workspace = draw(st.sampled_from([page * with_ctx, page * with_ctx + page, 2 * page * with_ctx,
                                      max(sum(context_lens), page * with_ctx)]))
    return page, query_lens, context_lens, workspace


@settings(max_examples=40, deadline=None)
@given(batch=batches(), policy=st.sampled_from(["packed", "equal", "balanced"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 3))
def test_forward_matches_plain_reference(batch, policy, dtype, seed):
    page, query_lens, context_lens, workspace = batch
    x = paged_mla_inputs(query_lens, context_lens, page_size=page, dtype=dtype, seed=seed)
    out, lse, _, op = run_forward(x, query_lens, context_lens, workspace, policy)
    assert op.backend_name == "math"
    check(out, lse, x, query_lens, context_lens, dtype)


@pytest.mark.parametrize("policy", ["packed", "equal", "balanced"])
@pytest.mark.parametrize("query_lens,context_lens,workspace", [
    ([5], [0], 8),                          # zero context: no iterations at all
    ([1], [1], 4),                          # one new token, one context token
    ([1, 1, 1], [4, 8, 12], 12),            # contexts ending exactly on page boundaries
    ([3, 2, 1, 4], [0, 17, 4, 33], 12),     # smallest workspace: many iterations
    ([2, 6], [64, 3], 200),                 # workspace bigger than all context
])
def test_awkward_cases(policy, query_lens, context_lens, workspace):
    x = paged_mla_inputs(query_lens, context_lens, page_size=4)
    out, lse, plan, _ = run_forward(x, query_lens, context_lens, workspace, policy)
    if sum(context_lens) == 0:
        assert plan.num_iterations == 0
    check(out, lse, x, query_lens, context_lens, torch.float32)


def test_many_iterations_equal_one_iteration():
    query_lens, context_lens = [3, 4, 2], [37, 64, 9]
    x = paged_mla_inputs(query_lens, context_lens, page_size=4, heads=2, nope=5, rope=3, v=7)
    small, lse_small, plan_small, _ = run_forward(x, query_lens, context_lens, 12, "packed")
    big, lse_big, plan_big, _ = run_forward(x, query_lens, context_lens, 512, "packed")
    assert plan_small.num_iterations >= 9 and plan_big.num_iterations == 1
    assert torch.allclose(small, big, atol=1e-5) and torch.allclose(lse_small, lse_big, atol=1e-5)
    check(small, lse_small, x, query_lens, context_lens, torch.float32)


def test_one_call_matches_and_infers_dims():
    query_lens, context_lens = [2, 5], [9, 0]
    x = paged_mla_inputs(query_lens, context_lens, page_size=4, heads=2, nope=6, rope=2, v=10)
    out, lse = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                   x["block_table"], query_lens, context_lens, x["weight"],
                                   workspace_tokens=8, return_lse=True)
    check(out, lse, x, query_lens, context_lens, torch.float32)
    only_out = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                   x["block_table"], query_lens, context_lens, x["weight"],
                                   workspace_tokens=8, policy="equal", process_group=None)
    assert torch.allclose(only_out, out, atol=1e-6)


def test_softmax_scale_is_applied():
    # several iterations, zero context, one token: the scale must reach every part and the LSE
    query_lens, context_lens = [3, 1, 2], [6, 0, 8]
    x = paged_mla_inputs(query_lens, context_lens)
    args = (x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
            context_lens, x["weight"])
    a = mla_chunked_prefill(*args, workspace_tokens=8)
    b = mla_chunked_prefill(*args, workspace_tokens=8, softmax_scale=12 ** -0.5)
    c, lse_c = mla_chunked_prefill(*args, workspace_tokens=8, softmax_scale=0.7, return_lse=True)
    assert torch.allclose(a, b) and not torch.allclose(a, c)
    ref_c, ref_lse_c = mla_prefill_reference(*args, qk_nope_head_dim=x["nope"], v_head_dim=x["v"],
                                             softmax_scale=0.7)
    assert (c.double() - ref_c).norm() / ref_c.norm() <= 1e-5
    assert (lse_c.double() - ref_lse_c).abs().max() <= 1e-5


def test_context_source_hook_replaces_gather():
    query_lens, context_lens = [2, 3], [10, 7]
    x = paged_mla_inputs(query_lens, context_lens, page_size=2)
    plan = ChunkPlanner(6, 2).plan(PrefillBatch(query_lens, context_lens, page_size=2))
    dplan = StagingRing("cpu").upload(plan)
    calls = []

    def source(i, workspace):
        calls.append(i)
        rows = []
        for r in range(plan.num_reqs):
            start = int(plan.chunk_starts[i, r])
            for p in range(start, start + int(plan.chunk_lens[i, r])):
                rows.append(x["kv_cache"][x["block_table"][r, p // 2], p % 2])
        workspace[:len(rows)] = torch.stack(rows)
        return workspace[:len(rows)]

    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    args = (x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], dplan)
    out, lse = op.forward(*args, context_source=source, return_lse=True)
    assert calls == list(range(plan.num_iterations)) and plan.num_iterations >= 2
    check(out, lse, x, query_lens, context_lens, torch.float32)
    ref = op.forward(*args)
    assert torch.allclose(out, ref, atol=1e-6)
    with pytest.raises(ValueError, match=r"context_source\(0\) returned shape"):
        op.forward(*args, context_source=lambda i, ws: ws[:1])


def test_float64_inputs_give_float64_results():
    query_lens, context_lens = [2, 1], [5, 8]
    x = paged_mla_inputs(query_lens, context_lens, dtype=torch.float64)
    out, lse = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                   x["block_table"], query_lens, context_lens, x["weight"],
                                   workspace_tokens=4, return_lse=True)
    ref_out, ref_lse = plain_reference(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                       x["block_table"], query_lens, context_lens, x["weight"],
                                       x["nope"], x["v"])
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref_out, atol=1e-12) and torch.allclose(lse, ref_lse, atol=1e-12)


# -- validation ------------------------------------------------------------------------------
@pytest.fixture
def setup():
    query_lens, context_lens = [2, 3], [5, 4]
    x = paged_mla_inputs(query_lens, context_lens)
    plan = ChunkPlanner(8, 4).plan(PrefillBatch(query_lens, context_lens, page_size=4))
    dplan = StagingRing("cpu").upload(plan)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=x["nope"], v_head_dim=x["v"])
    return x, dplan, op, query_lens, context_lens


def _fwd(op, x, dplan, **replace):
    args = {k: x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table")}
    args.update(replace)
    return op.forward(args["q"], args["kv_c_new"], args["k_pe_new"], args["kv_cache"],
                      args["block_table"], dplan)


@pytest.mark.parametrize("field,make,match", [
    ("q", lambda x: x["q"][:-1], r"q has shape \(4, 3, 12\), expected \(5, 3, 12\)"),
    ("q", lambda x: x["q"][:, :2].contiguous(), r"expected \(5, 3, 12\)"),  # head count
    ("kv_c_new", lambda x: x["kv_c_new"][:, :-1], r"kv_c_new has shape \(5, 15\), expected"),
    ("k_pe_new", lambda x: x["k_pe_new"][:-1], r"k_pe_new has shape \(4, 4\), expected"),
    ("kv_cache", lambda x: x["kv_cache"][..., :-1], r"kv_cache has shape .* expected"),
    ("kv_cache", lambda x: x["kv_cache"].reshape(-1, 2, 20), r"page_size 2 != plan.page_size 4"),
    ("kv_cache", lambda x: x["kv_cache"].double(), r"kv_cache dtype torch.float64 != q dtype"),
    ("block_table", lambda x: x["block_table"].long(), r"block_table dtype is torch.int64"),
    ("block_table", lambda x: x["block_table"][:1],
     r"block_table has shape \(1, 3\), expected \[num_reqs=2"),
    ("block_table", lambda x: x["block_table"][:, :1], r"fewer than the longest context"),
    ("kv_c_new", lambda x: x["kv_c_new"].to("meta"), r"kv_c_new is on meta, q is on cpu"),
])
def test_bad_inputs_raise_value_error(setup, field, make, match):
    x, dplan, op, _, _ = setup
    with pytest.raises(ValueError, match=match):
        _fwd(op, x, dplan, **{field: make(x)})


def test_bad_weight_and_lengths(setup):
    x, _, _, query_lens, context_lens = setup
    with pytest.raises(ValueError, match="not a positive multiple of qk_nope_head_dim"):
        MLAChunkedPrefill(x["weight"][:-1], qk_nope_head_dim=8, v_head_dim=6)
    with pytest.raises(ValueError, match="must be a 2-D tensor"):
        MLAChunkedPrefill(x["weight"][0], qk_nope_head_dim=8, v_head_dim=6)
    with pytest.raises(ValueError, match="unknown backend"):
        MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=6, backend="nope")
    with pytest.raises(ValueError, match="backend 'cudnn' cannot run on cpu"):
        MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=6, backend="cudnn")
    args = [x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
            context_lens, x["weight"]]
    with pytest.raises(ValueError, match=r"sum\(query_lens\) = 4 but q has 5 tokens"):
        mla_chunked_prefill(*args[:5], [2, 2], context_lens, x["weight"], workspace_tokens=8)
    with pytest.raises(ValueError, match="kv_b_proj_weight has 41 rows"):
        mla_chunked_prefill(*args[:7], x["weight"][:-1], workspace_tokens=8)
    with pytest.raises(ValueError, match=r"kv_b_proj_weight has 42 rows, expected H \* "):
        mla_chunked_prefill(*args[:7], x["weight"], workspace_tokens=8, v_head_dim=5)


def test_backend_choice_is_visible():
    x = paged_mla_inputs([1], [0])
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=6, backend="auto")
    assert op.backend_name == "math"
    assert MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=6,
                             backend="math").backend_name == "math"


def test_policy_auto_follows_the_backend(monkeypatch):
    import mlaprefill.prefill as attention_mod
    from mlaprefill.backends import get_backend
    from mlaprefill.backends.fa2 import FA2Backend

    assert get_backend("math", device=torch.device("cpu"), dtype=torch.float32, qk_head_dim=8,
                       v_head_dim=6).preferred_policy == "packed"
    assert FA2Backend.preferred_policy == "balanced"
    query_lens, context_lens = [2, 1, 3], [40, 4, 0]
    x = paged_mla_inputs(query_lens, context_lens, page_size=4)
    seen = []
    real = attention_mod.MLAChunkedPrefill.forward

    def spy(self, q, kv_c, k_pe, cache, table, plan, **kw):
        seen.append(plan.plan.policy)
        return real(self, q, kv_c, k_pe, cache, table, plan, **kw)

    def run():
        return mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                   x["block_table"], query_lens, context_lens, x["weight"],
                                   workspace_tokens=16, return_lse=True)

    monkeypatch.setattr(attention_mod.MLAChunkedPrefill, "forward", spy)
    run()  # the math backend's choice
    monkeypatch.setattr(attention_mod.MLAChunkedPrefill, "preferred_policy", "balanced")
    out, lse = run()  # a backend that prefers balanced
    assert seen == ["packed", "balanced"]
    check(out, lse, x, query_lens, context_lens, torch.float32)
    with pytest.raises(ValueError, match=r"policy must be 'auto' or one of \['equal', 'packed', "
                                         r"'balanced'\], got 'fast'"):
        mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                            x["block_table"], query_lens, context_lens, x["weight"],
                            policy="fast")


@pytest.mark.parametrize("world_size", [1, 2])
def test_process_group_delegates_to_dcp_only_above_world_size_one(monkeypatch, world_size):
    import mlaprefill.api as api

    query_lens, context_lens = [2, 1], [5, 0]
    x = paged_mla_inputs(query_lens, context_lens)
    seen = {}

    def fake_dcp(*args, **kwargs):
        seen.update(kwargs, num_args=len(args))
        return "dcp"

    group = object()  # a stand-in group: dcp_world (the one reader of groups) is faked
    monkeypatch.setattr(api, "dcp_world", lambda g: (0, world_size) if g is group else (0, 0))
    monkeypatch.setattr(api, "mla_chunked_prefill_dcp", fake_dcp)
    result = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                 x["block_table"], query_lens, context_lens, x["weight"],
                                 workspace_tokens=8, process_group=group, dcp_interleave=4)
    if world_size == 1:
        assert isinstance(result, torch.Tensor) and not seen  # the single-rank path
        ref, _ = plain_reference(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                 x["block_table"], query_lens, context_lens, x["weight"],
                                 x["nope"], x["v"])
        assert (result.double() - ref).norm() / ref.norm() <= 1e-5
    else:
        assert result == "dcp"
        assert seen["process_group"] is group and seen["dcp_interleave"] == 4
        assert seen["workspace_tokens"] == 8 and seen["num_args"] == 8
