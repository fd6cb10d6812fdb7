"""The FP8 context attention (kernels/fp8_attention.py) in Triton's interpreter on CPU tensors
(run by tests/test_fp8_attention.py in a subprocess with ``TRITON_INTERPRET=1``; skipped
otherwise).

Exactness where there is an exact answer: the quantized values and scales equal torch's own
e4m3 rounding of ``x * 448 / amax`` bit for bit; the LSE equals the float64 LSE of the
*dequantized* queries and keys (the probabilities' rounding to e4m3 does not enter it). The
output carries that rounding too: it is checked against the float64 result of the dequantized
inputs within e4m3's relative step (2^-4) of the values' magnitude.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see "
                "tests/test_fp8_attention.py)", allow_module_level=True)

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import split_key_reference
from mlaprefill.kernels.fp8_attention import (
    FP8AttentionConfig,
    fp8_context_attention,
    quantize_context,
    quantize_rows,
)

CFG = FP8AttentionConfig(16, 16, 4, 1)


def _torch_quantize(x, amax=None):
    """torch's e4m3 rounding of ``x * 448 / amax`` (amax per row, or the given one)."""
    if amax is None:
        amax = x.double().abs().amax(-1).float()
        inv = (448.0 / torch.where(amax > 0, amax, 1.0))[..., None]
    else:
        inv = 448.0 / amax if amax > 0 else 1.0
    y = (x.float() * inv).clamp(-448, 448)
    return y.to(torch.float8_e4m3fn), torch.where(torch.as_tensor(amax) > 0,
                                                  torch.as_tensor(amax) / 448, 1.0)


def test_quantize_rows_is_torchs_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 24, generator=g) * torch.logspace(-3, 3, 37)[:, None, None]
    x[4] = 0.0  # all-zero rows: scale 1, values 0
    x[5, 1, 3] = float("nan")
    x[6, 0, 0] = float("inf")
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        y, s = quantize_rows(xd)
        ref_y, ref_s = _torch_quantize(xd)
        ok = ~s.isnan()
        assert bool(s[5, 1].isnan()) and bool(s[6, 0].isnan()) and int(ok.sum()) == 37 * 3 - 2
        assert torch.equal(s[ok], ref_s[ok]), dtype
        assert torch.equal(y.view(torch.uint8)[ok], ref_y.view(torch.uint8)[ok]), dtype
        assert bool((s[4] == 1).all()) and bool((y[4].float() == 0).all())
    # a strided view (the up-projection's split layout) quantizes like its contiguous copy
    kv = torch.randn(9, 2, 40, generator=g)
    a, sa = quantize_rows(kv[..., 8:])
    b, sb = quantize_rows(kv[..., 8:].contiguous())
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)


def test_quantize_context_one_scale_per_chunk():
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(41, 3, 32, generator=g) * 5
    kr = torch.randn(41, 16, generator=g)
    kr[3, 2] = 70.0                       # K's amax comes from the rope key here
    kv[7, 1, 20] = float("nan")           # non-finite values are left out of the amaxes
    kv[8, 0, 2] = float("-inf")
    ctx = quantize_context(kv[..., :16], kr, kv[..., 16:])
    finite = torch.where(kv.isfinite(), kv, 0)
    amax_k = max(float(finite[..., :16].abs().max()), float(kr.abs().max()))
    amax_v = float(finite[..., 16:].abs().max())
    assert ctx.bound.tolist() == [amax_k, amax_v] and amax_k == 70.0
    want_k, _ = _torch_quantize(kv[..., :16], amax_k)
    want_p, _ = _torch_quantize(kr, amax_k)
    want_v, _ = _torch_quantize(kv[..., 16:], amax_v)
    fin_k, fin_v = kv[..., :16].isfinite(), kv[..., 16:].isfinite()
    assert torch.equal(ctx.k8.view(torch.uint8)[fin_k], want_k.view(torch.uint8)[fin_k])
    assert torch.equal(ctx.p8.view(torch.uint8), want_p.view(torch.uint8))
    vt = ctx.vt8[:, :, :41].permute(2, 0, 1)
    assert ctx.vt8.shape == (3, 16, 48)
    assert torch.equal(vt.view(torch.uint8)[fin_v], want_v.view(torch.uint8)[fin_v])
    # zero keys: amax 0 (scale 1), empty tensors
    empty = quantize_context(kv[:0, :, :16], kr[:0], kv[:0, :, 16:])
    assert empty.bound.tolist() == [0.0, 0.0] and empty.k8.shape == (0, 3, 16)


def _case(lq, lk, heads=2, nope=16, rope=16, dv=16, seed=0, scale_k=1.0):
    g = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cq[-1]), heads, nope + rope, generator=g).bfloat16()
    kn = (torch.randn(int(ck[-1]), heads, nope, generator=g) * scale_k).bfloat16()
    kp = torch.randn(int(ck[-1]), rope, generator=g).bfloat16()
    v = torch.randn(int(ck[-1]), heads, dv, generator=g).bfloat16()
    return q, kn, kp, v, cq, ck


def _dequantized(q, kn, kp, v):
    q8, qs = quantize_rows(q)
    ctx = quantize_context(kn, kp, v)
    return (q8, qs, ctx), (q8.double() * qs[..., None].double(), *ctx.dequantized())


@pytest.mark.parametrize("lq,lk", [
    ([1], [1]),                      # one query, one key
    ([3, 0, 17], [20, 5, 0]),        # a sequence without queries, one without keys
    ([16, 33], [16, 32]),            # lengths at the block boundaries (block 16)
    ([5, 2], [47, 17]),              # keys past one block, ragged tails
])
def test_against_float64_of_the_dequantized_inputs(lq, lk):
    q, kn, kp, v, cq, ck = _case(lq, lk, seed=len(lq) + sum(lk))
    (q8, qs, ctx), deq = _dequantized(q, kn, kp, v)
    out, lse = fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=max(lq),
                                     softmax_scale=0.3, out_dtype=torch.float32, config=CFG)
    ref_out, ref_lse = split_key_reference(*deq, cq, ck, 0.3)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse.isinf() & (lse < 0), empty)  # no keys: exactly -inf, out 0
    assert bool((out[empty] == 0).all())
    assert (lse.double() - ref_lse)[~empty].abs().amax() < 2e-5
    vmax = v.double().abs().max()
    assert (out.double() - ref_out)[~empty].abs().amax() < 2 ** -4 * vmax


def test_nan_query_stays_in_its_row_and_state_merges():
    # (K and V NaN are e4m3 NaNs, which Triton's interpreter does not have: it decodes 0x7F as
    # 480. tests/test_fp8_attention_gpu.py checks them on the GPU.)
    q, kn, kp, v, cq, ck = _case([4, 6, 3], [18, 9, 21], seed=5)
    q[5, 1, 3] = float("nan")
    q[11, 0, 0] = float("inf")
    (q8, qs, ctx), _ = _dequantized(q, kn, kp, v)
    out, lse = fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=6, softmax_scale=0.3,
                                     out_dtype=torch.float32, config=CFG)
    bad = out.isnan().any(-1) | lse.isnan()
    assert bad.nonzero().tolist() == [[5, 1], [11, 0]]
    # state: merged into a running (out, lse) in place, as merging two separate results would
    q, kn, kp, v, cq, ck = _case([4, 6], [18, 9], seed=6)
    (q8, qs, ctx), _ = _dequantized(q, kn, kp, v)
    run_out = torch.randn(10, 2, 16)
    run_lse = torch.randn(10, 2)
    run_lse[0, 0] = float("-inf")   # a row with no keys so far: takes this call's result
    part_out, part_lse = fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=6,
                                               softmax_scale=0.3, out_dtype=torch.float32,
                                               config=CFG)
    m = torch.maximum(run_lse, part_lse)
    w1, w2 = torch.exp(run_lse - m), torch.exp(part_lse - m)
    want_out = (run_out * w1[..., None] + part_out * w2[..., None]) / (w1 + w2)[..., None]
    want_lse = m + torch.log(w1 + w2)
    fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=6, softmax_scale=0.3,
                          state=(run_out, run_lse), config=CFG)
    assert torch.allclose(run_out, want_out, atol=1e-5) and torch.allclose(run_lse, want_lse,
                                                                           atol=1e-5)


def test_forward_with_the_fp8_backend():
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing

    query_lens, context_lens = [3, 1, 5], [33, 16, 0]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=32, nope=16, rope=16, v=16,
                         page_size=16, seed=3, dtype=torch.float16)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
    plan = ChunkPlanner(16, 16, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=16))
    def run(backend, graphs, min_queries=None):
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend=backend, graphs=graphs)
        if min_queries is not None:
            op.backend.min_queries = min_queries
        return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          StagingRing("cpu").upload(plan), return_lse=True)

    bf16 = run("mlaprefill", None)
    for graphs in (None, IterationGraphs()):
        out, lse = run("mlaprefill-fp8", graphs, min_queries=0)
        # e4m3 rounding of q, k, v and p: a few percent of the output's scale
        assert (out.double() - ref_out).abs().max() < 0.1 * ref_out.abs().max(), graphs
        assert (lse.double() - ref_lse).abs().max() < 0.1, graphs
        assert not torch.equal(out, bf16[0])  # the FP8 kernel ran
        # below min_queries (the default, 1024 > 5 queries) every call is the bf16 backend's
        out, lse = run("mlaprefill-fp8", graphs)
        assert torch.equal(out, bf16[0]) and torch.equal(lse, bf16[1]), graphs


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), min_size=1, max_size=3),
       heads=st.integers(1, 2), seed=st.integers(0, 2**16), merge=st.booleans())
def test_property_random_lengths(lens, heads, seed, merge):
    """Every outcome of random lengths is one of: exact "no keys" rows (0 / -inf), or an LSE
    within float32 rounding of the float64 LSE of the dequantized inputs and an output within
    e4m3's step of its values; with ``state`` the merge of a running result by LSE."""
    lq, lk = [a for a, _ in lens], [b for _, b in lens]
    q, kn, kp, v, cq, ck = _case(lq, lk, heads=heads, seed=seed)
    q, kn, kp, v = q.half(), kn.half(), kp.half(), v.half()
    (q8, qs, ctx), deq = _dequantized(q, kn, kp, v)
    ref_out, ref_lse = split_key_reference(*deq, cq, ck, 0.3)
    tq = q.shape[0]
    if merge:
        g = torch.Generator().manual_seed(seed)
        run_out, run_lse = torch.randn(tq, heads, 16, generator=g), torch.randn(tq, heads,
                                                                                 generator=g)
        m = torch.maximum(run_lse.double(), ref_lse)
        w1 = torch.exp(run_lse.double() - m)
        w2 = torch.where(ref_lse == float("-inf"), 0.0, torch.exp(ref_lse - m))
        want_out = (run_out.double() * w1[..., None] + ref_out * w2[..., None]) \
            / (w1 + w2)[..., None]
        want_lse = m + torch.log(w1 + w2)
        fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=max(lq), softmax_scale=0.3,
                              state=(run_out, run_lse), config=CFG)
        if tq:
            assert (run_lse.double() - want_lse).abs().amax() < 2e-5
            assert (run_out.double() - want_out).abs().amax() < 2 ** -4 * max(
                float(v.abs().max()) if v.numel() else 1.0, 1.0) + 1e-5
        return
    out, lse = fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=max(lq),
                                     softmax_scale=0.3, out_dtype=torch.float32, config=CFG)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse.isinf() & (lse < 0), empty)
    assert bool((out[empty] == 0).all())
    if bool((~empty).any()):
        assert (lse.double() - ref_lse)[~empty].abs().amax() < 2e-5
        assert (out.double() - ref_out)[~empty].abs().amax() < 2 ** -4 * v.abs().max()
