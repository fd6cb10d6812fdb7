"""CPU tests of the backend layer: math backend semantics, LSE layouts, backend selection."""

from __future__ import annotations

import pytest
import torch

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
    for name in ("cudnn", "flex", "varlen"):
        reason = BACKENDS[name]().unsupported_reason(torch.device("cpu"), torch.bfloat16, 192, 128)
        assert reason and "CUDA" in reason
    with pytest.raises(ValueError, match="unknown backend 'x'"):
        get_backend("x", device="cpu", dtype=torch.float32, qk_head_dim=8, v_head_dim=8)
    with pytest.raises(ValueError, match="no attention backend supports"):
        get_backend("auto", device="cpu", dtype=torch.int32, qk_head_dim=8, v_head_dim=8)
