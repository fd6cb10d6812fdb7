"""The float64 reference (used by benchmarks and DCP tests) against a per-query scalar loop."""

from __future__ import annotations

import math

import torch

from conftest import paged_mla_inputs
from mlaprefill.reference import mla_prefill_reference


def _per_query(q, kv_c_new, k_pe_new, cache, table, query_lens, context_lens, weight, nope, v,
               scale=None):
    """One query and one head at a time, keys built token by token: no batching at all."""
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    h = q.shape[1]
    rank = weight.shape[1]
    page = cache.shape[1]
    w = weight.double().view(h, nope + v, rank)
    out = torch.zeros(q.shape[0], h, v, dtype=torch.float64)
    lse = torch.zeros(q.shape[0], h, dtype=torch.float64)
    start = 0
    for r, (n_new, n_ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        latents = [cache[table[r, t // page], t % page].double() for t in range(n_ctx)]
        latents += [torch.cat([kv_c_new[start + j], k_pe_new[start + j]]).double()
                    for j in range(n_new)]
        for i in range(n_new):
            for head in range(h):
                qv = q[start + i, head].double()
                scores, values = [], []
                for lat in latents[:n_ctx + i + 1]:
                    k = torch.cat([w[head, :nope] @ lat[:rank], lat[rank:]])
                    scores.append(float(qv @ k) * scale)
                    values.append(w[head, nope:] @ lat[:rank])
                m = max(scores)
                z = sum(math.exp(s - m) for s in scores)
                lse[start + i, head] = m + math.log(z)
                out[start + i, head] = sum(math.exp(s - m) / z * val
                                           for s, val in zip(scores, values, strict=True))
        start += n_new
    return out, lse


def test_reference_matches_scalar_loop():
    h, nope, v = 2, 4, 3
    query_lens, context_lens = [2, 1, 3], [0, 5, 8]  # zero context, one token, page boundary
    t = sum(query_lens)
    x = paged_mla_inputs(query_lens, context_lens, heads=h, rank=8, nope=nope, rope=2, v=v,
                         page_size=4)
    q, kv_c_new, k_pe_new, cache, table, weight = (
        x[k] for k in ("q", "kv_c_new", "k_pe_new", "kv_cache", "block_table", "weight"))
    out, lse = mla_prefill_reference(q, kv_c_new, k_pe_new, cache, table, query_lens,
                                     context_lens, weight, qk_nope_head_dim=nope, v_head_dim=v)
    ref_out, ref_lse = _per_query(q, kv_c_new, k_pe_new, cache, table, query_lens,
                                  context_lens, weight, nope, v)
    assert out.dtype == torch.float64 and out.shape == (t, h, v)
    assert torch.allclose(out, ref_out, atol=1e-10)
    assert torch.allclose(lse, ref_lse, atol=1e-10)


def test_reference_softmax_scale_is_used():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 6, generator=g)
    args = (q, torch.randn(2, 8, generator=g), torch.randn(2, 2, generator=g),
            torch.randn(1, 4, 10, generator=g), torch.zeros(1, 1, dtype=torch.int32), [2], [0],
            torch.randn(7, 8, generator=g))
    out_a, lse_a = mla_prefill_reference(*args, qk_nope_head_dim=4, v_head_dim=3)
    out_b, lse_b = mla_prefill_reference(*args, qk_nope_head_dim=4, v_head_dim=3,
                                         softmax_scale=6 ** -0.5)
    out_c, lse_c = mla_prefill_reference(*args, qk_nope_head_dim=4, v_head_dim=3,
                                         softmax_scale=0.9)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert not torch.allclose(out_a, out_c)
    # a non-default scale gives what the scalar loop gives with that scale, output and LSE
    ref_c, ref_lse_c = _per_query(*args[:7], args[7], 4, 3, scale=0.9)
    assert torch.allclose(out_c, ref_c, atol=1e-10) and torch.allclose(lse_c, ref_lse_c, atol=1e-10)
    # first query sees only itself: its LSE is its one score, its output its own value row
    assert torch.allclose(lse_a[0, 0], torch.tensor(0.0, dtype=torch.float64) + (
        (q[0, 0].double() @ torch.cat([args[7][:4].double() @ args[1][0].double(),
                                       args[2][0].double()])) * 6 ** -0.5))
    assert torch.allclose(out_a[0, 0], args[7][4:].double() @ args[1][0].double(), atol=1e-12)
