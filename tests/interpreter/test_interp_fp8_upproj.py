"""The up-projection with an e4m3 epilogue (kernels/fp8_upproj.py) in Triton's interpreter on CPU
tensors (run by tests/test_fp8_attention.py in a subprocess with ``TRITON_INTERPRET=1``; skipped
otherwise). float16 stands in for bfloat16: the interpreter's ``tl.dot`` multiplies bfloat16's
raw bits.

Exact answers where there are: each bound equals its float64 formula (to float32 rounding) and is
at least the tensor's largest finite magnitude; each stored value is the e4m3 rounding of the
float64 product times ``448 / bound`` (within the GEMM's float32 rounding of a tie); a latent row
holding NaN changes no scale.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see "
                "tests/test_fp8_attention.py)", allow_module_level=True)

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.kernels.fp8_upproj import (
    BOUND_MARGIN,
    FP8UpProjConfig,
    upproject_fp8,
    weight_row_norms,
)

CFG = FP8UpProjConfig(block_m=16, block_k=16, num_warps=4, num_stages=1)


def _case(n, heads, rank=32, nope=16, v=16, rope=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, rank + rope, generator=g) * torch.logspace(-1, 1, max(n, 1))[:n, None]
    w = torch.randn(heads * (nope + v), rank, generator=g) / rank ** 0.5
    return latent.half(), w.half()


def _reference(latent, w, rank, nope, v, heads):
    """float64 K, V, the rope key and the bounds' formula."""
    c, pe = latent[:, :rank].double(), latent[:, rank:].double()
    kv = (c @ w.double().t()).view(-1, heads, nope + v)
    wn = torch.linalg.vector_norm(w.double().view(heads, nope + v, rank), dim=2)
    finite = torch.isfinite(c).all(1)
    cn = torch.linalg.vector_norm(c[finite], dim=1).max() if bool(finite.any()) else 0.0
    pe_max = pe[torch.isfinite(pe)].abs().max() if pe.numel() else 0.0
    bound_k = max(float(cn * wn[:, :nope].max() * BOUND_MARGIN), float(pe_max))
    bound_v = float(cn * wn[:, nope:].max() * BOUND_MARGIN)
    return kv[..., :nope], kv[..., nope:], pe, bound_k, bound_v


def _within_a_rounding(got, want, scale):
    """|got - want| <= half an e4m3 step of ``want / scale`` (plus float32 slack), times scale."""
    x = (want / scale).abs()
    e = torch.floor(torch.log2(torch.where(x > 0, x, 1.0))).clamp(min=-6.0)
    half_ulp = torch.exp2(e - 4.0)
    return bool(((got - want).abs() <= (half_ulp + 1e-5 * x + 1e-12) * scale).all())


def _check(latent, w, rank, nope, v, heads, config=CFG):
    w_norms = weight_row_norms(w, nope, v)
    ctx = upproject_fp8(latent[:, :rank], latent[:, rank:], w, w_norms, nope=nope, v=v,
                        config=config)
    k, vv, pe, bound_k, bound_v = _reference(latent, w, rank, nope, v, heads)
    n = latent.shape[0]
    assert ctx.k8.shape == (n, heads, nope) and ctx.p8.shape == (n, rope := latent.shape[1] - rank)
    assert ctx.vt8.shape == (heads, v, -(-n // 16) * 16) and rope > 0
    got_k, got_pe, got_v = ctx.dequantized()
    if n == 0:
        assert ctx.bound.tolist() == [0.0, 0.0]
        return ctx
    assert abs(float(ctx.bound[0]) - bound_k) <= 1e-5 * bound_k
    assert abs(float(ctx.bound[1]) - bound_v) <= 1e-5 * max(bound_v, 1e-30)
    # a bound: no value is clipped
    assert float(k.abs().max()) <= float(ctx.bound[0]) and float(vv.abs().max()) <= \
        float(ctx.bound[1])
    sk, sv = float(ctx.bound[0]) / 448, float(ctx.bound[1]) / 448
    assert _within_a_rounding(got_k, k, sk)
    assert _within_a_rounding(got_v, vv, sv)
    assert _within_a_rounding(got_pe, pe, sk)
    return ctx


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33])
@pytest.mark.parametrize("heads", [1, 3])
def test_values_are_the_e4m3_rounding_under_the_bounds(n, heads):
    latent, w = _case(n, heads, seed=n)
    _check(latent, w, 32, 16, 16, heads)


def test_split_latent_view_and_wider_tiles():
    """The workspace's own view (``kv_c`` with the row stride of ``[kv_c | k_pe]``), a rank that
    is not a multiple of the K tile, nope != v, and the default tiles."""
    latent, w = _case(40, 2, rank=48, nope=32, v=16, rope=32, seed=7)
    _check(latent, w, 48, 32, 16, 2, config=FP8UpProjConfig(block_m=32, block_k=32,
                                                            num_warps=4, num_stages=1))
    _check(latent, w, 48, 32, 16, 2, config=FP8UpProjConfig())


def test_a_nan_row_changes_no_scale():
    latent, w = _case(24, 2, seed=3)
    clean = _check(latent, w, 32, 16, 16, 2)
    bad = latent.clone()
    bad[5, 2] = float("nan")
    bad[9, 0] = float("inf")
    bad[11, 32 + 3] = float("nan")  # a rope value
    ctx = upproject_fp8(bad[:, :32], bad[:, 32:], w, weight_row_norms(w, 16, 16), nope=16, v=16,
                        config=CFG)
    # the non-finite rows are left out of max ||c_t|| and max |k_pe|; here none was the largest
    assert torch.equal(ctx.bound, clean.bound)
    keep = torch.ones(24, dtype=torch.bool)
    keep[[5, 9, 11]] = False
    assert torch.equal(ctx.k8.view(torch.uint8)[keep], clean.k8.view(torch.uint8)[keep])
    assert torch.equal(ctx.vt8.view(torch.uint8)[:, :, :24][:, :, keep],
                       clean.vt8.view(torch.uint8)[:, :, :24][:, :, keep])


def test_forward_runs_the_fused_up_projection(monkeypatch):
    """The FP8 backend's context iterations take their keys from upproject_fp8, eager and with
    graphs (bitwise equal), and not from quantize_context."""
    import mlaprefill.backends.fp8 as fp8_backend
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.staging import StagingRing

    calls = {"fused": 0}
    real = fp8_backend.upproject_fp8

    def counting(*args, **kwargs):
        calls["fused"] += 1
        return real(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("quantize_context ran: the fused up-projection was bypassed")

    monkeypatch.setattr(fp8_backend, "upproject_fp8", counting)
    monkeypatch.setattr(fp8_backend, "quantize_context", refuse)
    query_lens, context_lens = [3, 2], [33, 17]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=32, nope=16, rope=16, v=16,
                         page_size=16, seed=5, dtype=torch.float16)
    plan = ChunkPlanner(16, 16, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=16))
    results = []
    for graphs in (None, IterationGraphs()):
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend="mlaprefill-fp8", graphs=graphs)
        op.backend.min_queries = 0
        results.append(op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                  x["block_table"], StagingRing("cpu").upload(plan),
                                  return_lse=True))
    assert calls["fused"] >= 2  # at least one context iteration in each forward
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1],
                                                                     results[1][1])


@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 40), heads=st.integers(1, 3), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 1e3]))
def test_property_random_shapes_and_magnitudes(n, heads, seed, spread):
    latent, w = _case(n, heads, seed=seed)
    _check((latent.float() * spread).half(), w, 32, 16, 16, heads)


def test_padding_rows_past_valid_rows_change_no_scale():
    """A CUDA graph's row bucket: rows past ``valid_rows`` (stale workspace rows, here huge) are
    left out of the bounds and amaxes, so the valid rows round as if alone."""
    from mlaprefill.kernels.fp8_attention import quantize_context

    latent, w = _case(20, 2, seed=11)
    padded = torch.cat([latent, torch.full((13, latent.shape[1]), 3e4).half()])
    alone = _check(latent, w, 32, 16, 16, 2)
    valid = torch.tensor([20], dtype=torch.int32)
    wn = weight_row_norms(w, 16, 16)
    ctx = upproject_fp8(padded[:, :32], padded[:, 32:], w, wn, nope=16, v=16, valid_rows=valid,
                        config=CFG)
    assert torch.equal(ctx.bound, alone.bound)
    assert torch.equal(ctx.k8[:20].view(torch.uint8), alone.k8.view(torch.uint8))
    assert torch.equal(ctx.vt8[:, :, :20].view(torch.uint8), alone.vt8[:, :, :20].view(torch.uint8))
    # the same rule in quantize_context (bf16 keys given directly)
    kv = (padded[:, :32].float() @ w.float().t()).half().view(33, 2, 32)
    full = quantize_context(kv[..., :16], padded[:, 32:], kv[..., 16:])
    cut = quantize_context(kv[..., :16], padded[:, 32:], kv[..., 16:], valid_rows=valid)
    want = quantize_context(kv[:20, :, :16], padded[:20, 32:], kv[:20, :, 16:])
    assert torch.equal(cut.bound, want.bound) and not torch.equal(full.bound, want.bound)


def test_no_heads_still_scales_the_rope_key():
    latent, _ = _case(9, 1, seed=4)
    w = torch.zeros(0, 32, dtype=torch.float16)
    ctx = upproject_fp8(latent[:, :32], latent[:, 32:], w, weight_row_norms(w, 16, 16), nope=16,
                        v=16, config=CFG)
    pe = latent[:, 32:].double()
    assert ctx.k8.shape == (9, 0, 16) and ctx.vt8.shape == (0, 16, 16)
    assert float(ctx.bound[0]) == float(pe.abs().max()) and float(ctx.bound[1]) == 0.0
    assert _within_a_rounding(ctx.dequantized()[1], pe, float(ctx.bound[0]) / 448)
