"""CPU tests of the backend layer: math backend semantics, LSE layouts, backend selection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.backends import (
    AUTO_ORDER,
    BACKENDS,
    VarlenSeqs,
    fix_empty_rows,
    get_backend,
    seq_ids_from_cu,
)
from mlaprefill.backends.base import lse_to_tokens_heads, pad_v


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _dense(q, k, v, scale, causal):
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[0], k.shape[0]).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v), s.logsumexp(-1).t()


@pytest.mark.parametrize("causal", [False, True])
def test_math_backend_per_sequence_and_empty_keys(causal):
    g = torch.Generator().manual_seed(0)
    q_lens = [3, 1, 4]
    k_lens = q_lens if causal else [5, 0, 2]
    q = torch.randn(sum(q_lens), 2, 6, generator=g, dtype=torch.float64)
    k = torch.randn(sum(k_lens), 2, 6, generator=g, dtype=torch.float64)
    v = torch.randn(sum(k_lens), 2, 3, generator=g, dtype=torch.float64)
    seqs = VarlenSeqs(_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))
    out, lse = BACKENDS["math"]().attend(q, k, v, seqs, causal=causal, softmax_scale=0.4)
    assert out.shape == (8, 2, 3) and lse.shape == (8, 2) and lse.dtype == torch.float64
    qs, ks = 0, 0
    for nq, nk in zip(q_lens, k_lens, strict=True):
        if nk == 0:  # no keys: exactly "no contribution"
            assert (out[qs:qs + nq] == 0).all() and torch.isneginf(lse[qs:qs + nq]).all()
        else:
            ro, rl = _dense(q[qs:qs + nq], k[ks:ks + nk], v[ks:ks + nk], 0.4, causal)
            assert torch.allclose(out[qs:qs + nq], ro) and torch.allclose(lse[qs:qs + nq], rl)
        qs, ks = qs + nq, ks + nk
    assert not torch.isnan(out).any()


def test_lse_layouts_are_normalized():
    q_lens = [2, 3]
    cu = _cu(q_lens)
    ref = torch.arange(10, dtype=torch.float32).view(5, 2)  # [T=5, H=2]
    assert torch.equal(lse_to_tokens_heads(ref, 5, 2, None, cu), ref)
    assert torch.equal(lse_to_tokens_heads(ref[..., None], 5, 2, None, cu), ref)  # cuDNN
    assert torch.equal(lse_to_tokens_heads(ref.t().contiguous(), 5, 2, None, cu), ref)  # FA2
    padded = torch.full((2, 2, 3), float("nan"))  # [num_seqs, H, max_q] (padded FA2)
    padded[0, :, :2] = ref[:2].t()
    padded[1, :, :3] = ref[2:].t()
    assert torch.equal(lse_to_tokens_heads(padded, 5, 2, seq_ids_from_cu(cu, 5), cu), ref)
    with pytest.raises(RuntimeError, match="unexpected LSE shape"):
        lse_to_tokens_heads(torch.zeros(7), 5, 2, None, cu)


def test_fix_empty_rows_and_pad_v():
    out = torch.ones(4, 2, 3)
    lse = torch.full((2, 4), float("inf")).t()  # FA2 style +inf, strided view
    lse[3] = 0.5
    fix_empty_rows(out, lse, _cu([0, 2]), torch.tensor([0, 0, 1, 1]))
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()  # no keys: "no contribution"
    # +inf with keys is FA2's flag for a NaN (or 0) softmax sum: reported as NaN, not a weight
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()
    assert (out[3] == 1).all() and (lse[3] == 0.5).all()
    v = torch.randn(3, 2, 4)
    padded = pad_v(v, 6)
    assert padded.shape == (3, 2, 6) and torch.equal(padded[..., :4], v)
    assert (padded[..., 4:] == 0).all() and pad_v(v, 4) is v


def test_selection():
    assert AUTO_ORDER[-1] == "math"
    be = get_backend("auto", device="cpu", dtype=torch.float32, qk_head_dim=192, v_head_dim=128)
    assert be.name == "math"
    for name in ("cudnn", "flex", "fa2"):
        reason = BACKENDS[name]().unsupported_reason(torch.device("cpu"), torch.bfloat16, 192, 128)
        assert reason and "CUDA" in reason
    with pytest.raises(ValueError, match="unknown backend 'x'"):
        get_backend("x", device="cpu", dtype=torch.float32, qk_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="no attention backend supports"):
        get_backend("auto", device="cpu", dtype=torch.int32, qk_head_dim=8, v_head_dim=8)


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
                     min_size=1, max_size=5),
       heads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_attend_and_merge_equals_attention_over_both_key_parts(lens, heads, seed):
    """The default ``attend_and_merge`` (attend + merge): a running result from key part A merged
    with key part B is attention over A and B together, per sequence, in float64; a sequence
    with no keys in either part keeps ``out = 0, lse = -inf``."""
    g = torch.Generator().manual_seed(seed)
    q_lens = [a for a, _, _ in lens]
    a_lens, b_lens = [b for _, b, _ in lens], [c for _, _, c in lens]
    q = torch.randn(sum(q_lens), heads, 6, generator=g, dtype=torch.float64)
    ka, va = (torch.randn(sum(a_lens), heads, d, generator=g, dtype=torch.float64)
              for d in (6, 5))
    kb, vb = (torch.randn(sum(b_lens), heads, d, generator=g, dtype=torch.float64)
              for d in (6, 5))
    be = BACKENDS["math"]()
    seqs_a = VarlenSeqs(_cu(q_lens), _cu(a_lens), max(q_lens), max(a_lens))
    seqs_b = VarlenSeqs(_cu(q_lens), _cu(b_lens), max(q_lens), max(b_lens))
    out, lse = be.attend(q, ka, va, seqs_a, causal=False, softmax_scale=0.4)
    out, lse = out.clone(), lse.clone()
    assert be.attend_and_merge(q, kb, vb, seqs_b, out, lse, causal=False, softmax_scale=0.4) is None
    cq, ca, cb = (_cu(x_).tolist() for x_ in (q_lens, a_lens, b_lens))
    for s in range(len(lens)):
        rows = slice(cq[s], cq[s + 1])
        k = torch.cat([ka[ca[s]:ca[s + 1]], kb[cb[s]:cb[s + 1]]])
        v = torch.cat([va[ca[s]:ca[s + 1]], vb[cb[s]:cb[s + 1]]])
        if q_lens[s] == 0:
            continue
        if k.shape[0] == 0:
            assert torch.isneginf(lse[rows]).all() and (out[rows] == 0).all()
            continue
        want_o, want_l = _dense(q[rows], k, v, 0.4, False)
        assert torch.allclose(out[rows], want_o, atol=1e-10)
        assert torch.allclose(lse[rows], want_l, atol=1e-10)
    with pytest.raises(ValueError, match="needs joined keys"):
        be.attend_and_merge(q, kb, vb, seqs_b, out, lse, causal=False, softmax_scale=0.4,
                       k_rope=kb[..., :2])
    # The default attend_and_store: attend's result written over stale values (NaN here), in place.
    causal = q_lens == b_lens  # causal needs equal lengths per sequence
    fresh = be.attend(q, kb, vb, seqs_b, causal=causal, softmax_scale=0.4)
    into = (torch.full_like(fresh[0], float("nan")), torch.full_like(fresh[1], float("nan")))
    ptrs = [t.data_ptr() for t in into]
    assert be.attend_and_store(q, kb, vb, seqs_b, *into, causal=causal, softmax_scale=0.4) is None
    assert [t.data_ptr() for t in into] == ptrs
    assert torch.equal(into[0], fresh[0]) and torch.equal(into[1], fresh[1])
    with pytest.raises(ValueError, match="needs joined keys"):
        be.attend_and_store(q, kb, vb, seqs_b, *into, causal=False, softmax_scale=0.4,
                     k_rope=kb[..., :2])


def test_hybrid_thresholds_are_checked():
    from mlaprefill.backends.mlaprefill import MLAPrefillBackend

    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="min_queries_per_key must be an int >= 0"):
            MLAPrefillBackend(min_queries_per_key=bad)
        with pytest.raises(ValueError, match="big_work must be an int >= 0"):
            MLAPrefillBackend(big_work=bad)
    assert MLAPrefillBackend(big_work=0, min_queries_per_key=0).min_queries_per_key == 0
    assert MLAPrefillBackend().min_queries_per_key is None  # by heads and causality, per call


@settings(max_examples=150, deadline=None)
@given(q_lens=st.lists(st.integers(1, 5000), min_size=1, max_size=9),
       k_scale=st.integers(0, 40), heads=st.sampled_from([8, 16, 64, 128]),
       causal=st.booleans(), floor=st.sampled_from([None, 0, 1, 384, 2048, 10**6]),
       big_work=st.sampled_from([1, 1 << 20, 1 << 28]), slack=st.integers(0, 64))
def test_hybrid_rectangle_choice_is_the_rule_with_or_without_the_shortcut(
        q_lens, k_scale, heads, causal, floor, big_work, slack):
    """MLAPrefillBackend._rectangles skips the per-sequence search when max_seqlen_q is below the
    pairs-per-key floor; the result is still exactly the rule: dense_rectangles, then none
    unless their work reaches floor x heads x keys (computed here without the shortcut)."""
    import numpy as np

    from mlaprefill.backends.base import VarlenSeqs
    from mlaprefill.backends.mlaprefill import (
        MANY_HEADS,
        MIN_QUERIES_PER_KEY,
        MIN_QUERIES_PER_KEY_FEW_HEADS,
        MLAPrefillBackend,
        dense_rectangles,
    )

    k_lens = q_lens if causal else [q * k_scale + 7 * i for i, q in enumerate(q_lens)]
    cq = np.concatenate([[0], np.cumsum(q_lens)])
    ck = np.concatenate([[0], np.cumsum(k_lens)])
    # max_seqlen_q is an upper bound: exact or with slack
    seqs = VarlenSeqs(None, None, max(q_lens) + slack, max(k_lens), cu_seqlens_q_host=cq,
                      cu_seqlens_k_host=ck)
    got = MLAPrefillBackend(big_work=big_work, min_queries_per_key=floor)._rectangles(
        seqs, heads, causal)
    need = floor if floor is not None else (
        MIN_QUERIES_PER_KEY if heads >= MANY_HEADS or causal else MIN_QUERIES_PER_KEY_FEW_HEADS)
    want = dense_rectangles(cq, ck, num_heads=heads, causal=causal, big_work=big_work)
    if sum(r.work for r in want) < need * heads * int(ck[-1]):
        want = []
    assert got == want
