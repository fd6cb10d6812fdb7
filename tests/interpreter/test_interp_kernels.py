"""The Triton gather and merge kernels in Triton's interpreter on CPU tensors, against their
torch versions (run by tests/test_kernels.py in a subprocess with ``TRITON_INTERPRET=1``)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_kernels.py)",
                allow_module_level=True)


import torch

from mlaprefill.kernels import (
    gather_context_rows,
    gather_context_rows_torch,
    merge_attention_states,
    merge_attention_states_torch,
)


def test_gather_and_merge_kernels_match_torch():
    g = torch.Generator().manual_seed(0)
    # gather: 5 requests (two without a piece: 3 search steps), page 4, latent 40 (BLOCK_D 8:
    # five column tiles), 13 rows
    cache = torch.randn(16, 4, 40, generator=g).bfloat16()
    table = torch.randperm(16, generator=g)[:15].view(5, 3).to(torch.int32)
    cu = torch.tensor([0, 0, 6, 6, 7, 13], dtype=torch.int32)
    starts = torch.tensor([0, 3, 0, 2, 4], dtype=torch.int32)
    a = torch.zeros(16, 40).bfloat16()
    b = a.clone()
    gather_context_rows(cache, table, cu, starts, a, 13, use_kernel=True)
    gather_context_rows_torch(cache, table, cu, starts, b, 13)
    assert torch.equal(a, b), "gather differs"
    assert (a[13:] == 0).all(), "gather wrote past num_rows"
    # padded: num_rows past the iteration's total (13) leaves those rows as they are
    ap = torch.full((16, 40), 7.0).bfloat16()
    bp = ap.clone()
    gather_context_rows(cache, table, cu, starts, ap, 16, use_kernel=True)
    gather_context_rows_torch(cache, table, cu, starts, bp, 16)
    assert torch.equal(ap[:13], a[:13]) and torch.equal(bp[:13], a[:13]), "padded gather rows"
    assert (ap[13:] == 7).all() and (bp[13:] == 7).all(), "padded gather wrote past the total"
    # one request: no search at all
    a1 = torch.zeros(16, 40).bfloat16()
    b1 = a1.clone()
    one = (table[2:3], torch.tensor([0, 9], dtype=torch.int32),
           torch.tensor([1], dtype=torch.int32))
    gather_context_rows(cache, *one, a1, 9, use_kernel=True)
    gather_context_rows_torch(cache, *one, b1, 9)
    assert torch.equal(a1, b1), "one-request gather differs"
    # a block id outside the cache gives NaN rows for that page only (no read elsewhere)
    bad = table.clone()
    bad[4, 1] = -1
    bad[1, 0] = 16
    c = torch.zeros(16, 40).bfloat16()
    gather_context_rows(cache, bad, cu, starts, c, 13, use_kernel=True)
    nan_rows = torch.isnan(c.float()).all(dim=1)
    # request 1 rows 0..5 are its tokens 3..8: page 0 (token 3) is bad; request 4 rows 7..12
    # are its tokens 4..9: page 1 (tokens 4..7) is bad
    expect_nan = torch.zeros(16, dtype=torch.bool)
    expect_nan[0] = True
    expect_nan[7:11] = True
    assert torch.equal(nan_rows, expect_nan), nan_rows
    assert torch.equal(c[~expect_nan], b[~expect_nan]), "good rows changed"
    # merge with -inf rules, strided partial, head dim 24 (BLOCK_D 32 masked)
    t, h, v = 7, 3, 24
    o = torch.randn(t, h, v, generator=g)
    lse = torch.randn(t, h, generator=g)
    po = torch.randn(t, h, 32, generator=g)[..., :v]
    pl = torch.randn(h, t, generator=g).t()
    lse[0] = float("-inf")
    pl[0] = float("-inf")
    pl[1] = float("-inf")
    po[1] = float("nan")
    o1, l1, o2, l2 = o.clone(), lse.clone(), o.clone(), lse.clone()
    merge_attention_states(o1, l1, po, pl, use_kernel=True)
    merge_attention_states_torch(o2, l2, po, pl)
    assert not torch.isnan(o1).any(), "NaN leaked"
    assert (o1[0] == 0).all() and torch.isneginf(l1[0]).all(), "-inf rule"
    assert torch.allclose(o1, o2, atol=1e-5), (o1 - o2).abs().max()
    assert torch.allclose(l1[1:], l2[1:], atol=1e-5)
