"""The opt-in FP8 context attention on CUDA (marked ``gpu``; skipped without CUDA): the quantizing
pass bit for bit against torch's e4m3 rounding, the kernel against float64 attention of the
dequantized inputs at MLA's head dims on awkward lengths, NaN kept in its sequence, the
up-projection's e4m3 epilogue against its float64 GEMM and bounds, and the ``mlaprefill-fp8``
forward (eager and graph replays, through that epilogue) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from conftest import paged_mla_inputs, split_key_reference
from mlaprefill import IterationGraphs, MLAChunkedPrefill
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import hopper_fp8_attention as hopper_fp8
from mlaprefill.kernels.fp8_attention import (
    FP8AttentionConfig,
    fp8_context_attention,
    quantize_context,
    quantize_rows,
)
from mlaprefill.plan import ChunkPlanner
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing

pytestmark = pytest.mark.gpu

NOPE, ROPE, V = 128, 64, 128


def _fp8_ok():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _div(a, b):
    """``a / b`` correctly rounded to float32 (torch's CUDA division by a scalar multiplies by
    the reciprocal, which can differ in the last bit from the kernel's IEEE division)."""
    return (torch.as_tensor(a, dtype=torch.float64) / b).float()


def _torch_quantize(x, amax=None):
    if amax is None:
        amax = x.double().abs().amax(-1).float()
        inv = torch.where(amax > 0, _div(448.0, amax.double()).to(amax.device), 1.0)[..., None]
    else:
        inv = float(_div(448.0, float(amax)))
    return (x.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn), amax


def test_quantize_bitwise_like_torch():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(300, 4, 192, generator=g, device="cuda")
         * torch.logspace(-3, 3, 300, device="cuda")[:, None, None]).bfloat16()
    x[7] = 0
    y, s = quantize_rows(x)
    ry, amax = _torch_quantize(x)
    assert torch.equal(s, torch.where(amax > 0, _div(amax.double(), 448.0).to(amax.device), 1.0))
    assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8))
    kv = x[:, :, :128 + 64]
    ctx = quantize_context(kv[..., :128], x[:, 0, 128:], kv[..., 64:])
    amax_k = max(float(kv[..., :128].abs().max()), float(x[:, 0, 128:].abs().max()))
    amax_v = float(kv[..., 64:].abs().max())
    assert ctx.bound.tolist() == [amax_k, amax_v]
    assert torch.equal(ctx.k8.view(torch.uint8),
                       _torch_quantize(kv[..., :128], amax_k)[0].view(torch.uint8))
    assert torch.equal(ctx.vt8[:, :, :300].permute(2, 0, 1).view(torch.uint8),
                       _torch_quantize(kv[..., 64:], amax_v)[0].view(torch.uint8))


def _case(lq, lk, heads, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tq, tk = int(cq[-1]), int(ck[-1])
    q = torch.randn(tq, heads, NOPE + ROPE, generator=g, device="cuda").bfloat16()
    kv = torch.randn(tk, heads, NOPE + V, generator=g, device="cuda").bfloat16()
    kr = torch.randn(tk, ROPE, generator=g, device="cuda").bfloat16()
    return q, kv[..., :NOPE], kr, kv[..., NOPE:], cq, ck


def _gluon_runs(q8, ctx):
    return hopper_fp8.unsupported_reason(q8, ctx.k8, ctx.p8, ctx.vt8, q8.new_empty(0,
                                         dtype=torch.bfloat16)) is None


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
@pytest.mark.parametrize("kernel", ["default", "triton"])
@pytest.mark.parametrize("lq,lk", [([1], [1]), ([3, 0, 130], [129, 7, 0]),
                                   ([128, 257], [128, 1000]), ([5, 64, 1], [4097, 33, 130])])
def test_kernel_against_float64_of_dequantized_inputs(lq, lk, kernel):
    """Both FP8 kernels: the default (on an sm_90 GPU the Gluon kernel, which must have run:
    no compile failure recorded) and the Triton kernel (given tiles)."""
    q, kn, kr, v, cq, ck = _case(lq, lk, heads=3, seed=sum(lk))
    q8, qs = quantize_rows(q)
    ctx = quantize_context(kn, kr, v)
    deq = (q8.double() * qs[..., None].double(), *ctx.dequantized())
    out, lse = fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=max(lq),
                                     softmax_scale=192 ** -0.5,
                                     config=FP8AttentionConfig() if kernel == "triton" else None)
    if kernel == "default" and _gluon_runs(q8, ctx):
        assert hopper_fp8.failures() == {}
    ref_out, ref_lse = split_key_reference(*deq, cq, ck, 192 ** -0.5)
    empty = ref_lse == float("-inf")
    assert torch.equal(lse.isinf() & (lse < 0), empty)
    assert bool((out[empty] == 0).all())
    # Hopper's FP8 MMA accumulates with fewer bits than float32 (about 2^-13 relative to the
    # products' magnitude), so the LSE is close, not equal; the output carries p's rounding.
    lse_err = (lse.double() - ref_lse)[~empty].abs()
    assert lse_err.amax() < 1e-3 * (1 + ref_lse[~empty].abs().amax()), float(lse_err.amax())
    assert (out.double() - ref_out)[~empty].abs().amax() < 2 ** -4 * v.abs().max()


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
def test_kernel_nan_stays_in_its_sequence():
    q, kn, kr, v, cq, ck = _case([40, 70, 9], [300, 129, 77], heads=2, seed=3)
    v = v.clone()
    v[310, 1, 5] = float("nan")   # sequence 1, head 1
    # sequence 0's last key: in sequence 1's first key block (its keys start at 300, not a
    # multiple of 16), whose V columns of sequence 0 must not reach sequence 1's rows
    v[299, 0, 7] = float("nan")
    kr = kr.clone()
    kr[12] = float("inf")         # sequence 0, every head
    q8, qs = quantize_rows(q)
    out, lse = fp8_context_attention(q8, qs, quantize_context(kn, kr, v), cq, ck,
                                     max_seqlen_q=70, softmax_scale=0.1)
    bad = out.isnan().any(-1) | lse.isnan()
    assert bool(bad[:40].all()) and bool(bad[40:110, 1].all())
    assert not bool(bad[40:110, 0].any()) and not bool(bad[110:].any())


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
def test_fp8_backend_forward_eager_and_graphs():
    query_lens, context_lens = [100, 1, 37], [5000, 64, 0]
    x = paged_mla_inputs(query_lens, context_lens, heads=16, rank=512, nope=NOPE, rope=ROPE, v=V,
                         page_size=64, dtype=torch.bfloat16, device="cuda", seed=1)
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V)
    plan = ChunkPlanner(2048, 64).plan(PrefillBatch(query_lens, context_lens, page_size=64))
    results = []
    for graphs in (None, IterationGraphs()):
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                               backend="mlaprefill-fp8", graphs=graphs)
        op.backend.min_queries = 0  # FP8 on every context call (the default needs 1024 queries)
        for _ in range(2 if graphs is None else 3):  # graphs: eager, capture, replay
            out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                  x["block_table"], StagingRing("cuda").upload(plan),
                                  return_lse=True)
            results.append((out.clone(), lse.clone()))
        ref_out, ref_lse = ref_out.to(out.device), ref_lse.to(out.device)
        err = (out.double() - ref_out).abs()
        assert err.max() < 0.05 * ref_out.abs().max(), graphs
        assert (lse.double() - ref_lse).abs().max() < 0.05, graphs
    # the same kernels in the same order: replays equal the eager forward bit for bit
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    # the arena holds no compute-dtype K/V for the FP8 context iterations (only the new
    # tokens'): less static memory than the bf16 backend's on the same plan
    fp8_graphs, bf16_graphs = graphs, IterationGraphs()
    bf16_op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                                backend="mlaprefill", graphs=bf16_graphs)
    for _ in range(3):
        bf16_op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                        StagingRing("cuda").upload(plan))
    assert fp8_graphs.memory_bytes() < bf16_graphs.memory_bytes()
    # the same graphs when the context calls leave FP8 (they then write that buffer): the
    # arena grows, and the forward is right
    op.backend.min_queries = 10 ** 9
    for _ in range(3):
        out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                              x["block_table"], StagingRing("cuda").upload(plan),
                              return_lse=True)
        err = (out.double() - ref_out).abs()
        assert err.max() < 0.05 * ref_out.abs().max()
        assert (lse.double() - ref_lse).abs().max() < 0.05
    assert fp8_graphs.memory_bytes() >= bf16_graphs.memory_bytes()


def _e4m3_close(got, want, scale):
    """Within half an e4m3 step of ``want / scale`` plus one subnormal step (2^-9: the GEMM's
    float32 sums), times ``scale``."""
    x = (want / scale).abs()
    e = torch.floor(torch.log2(torch.where(x > 0, x, 1.0))).clamp(min=-6.0)
    return bool(((got - want).abs() <= (torch.exp2(e - 4.0) + 2.0 ** -9) * scale).all())


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
@pytest.mark.parametrize("n,heads", [(1, 16), (1000, 16), (4097, 128)])
def test_upproject_fp8_against_float64(n, heads):
    from mlaprefill.kernels.fp8_upproj import BOUND_MARGIN, upproject_fp8, weight_row_norms

    rank = 512
    g = torch.Generator(device="cuda").manual_seed(n)
    lat = torch.randn(n, rank + ROPE, device="cuda", generator=g).bfloat16()
    w = (torch.randn(heads * (NOPE + V), rank, device="cuda", generator=g) / 23).bfloat16()
    ctx = upproject_fp8(lat[:, :rank], lat[:, rank:], w, weight_row_norms(w, NOPE, V), nope=NOPE,
                        v=V)
    kv = (lat[:, :rank].double() @ w.double().t()).view(n, heads, NOPE + V)
    wn = torch.linalg.vector_norm(w.double().view(heads, NOPE + V, rank), dim=2)
    cn = torch.linalg.vector_norm(lat[:, :rank].double(), dim=1).max()
    bound_k = max(float(cn * wn[:, :NOPE].max() * BOUND_MARGIN), float(lat[:, rank:].abs().max()))
    bound_v = float(cn * wn[:, NOPE:].max() * BOUND_MARGIN)
    assert abs(float(ctx.bound[0]) - bound_k) <= 1e-5 * bound_k
    assert abs(float(ctx.bound[1]) - bound_v) <= 1e-5 * bound_v
    got_k, got_pe, got_v = ctx.dequantized()
    assert _e4m3_close(got_k, kv[..., :NOPE], float(ctx.bound[0]) / 448)
    assert _e4m3_close(got_v, kv[..., NOPE:], float(ctx.bound[1]) / 448)
    assert _e4m3_close(got_pe, lat[:, rank:].double(), float(ctx.bound[0]) / 448)


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
def test_upproject_fp8_nan_row_stays_in_its_row():
    from mlaprefill.kernels.fp8_upproj import upproject_fp8, weight_row_norms

    rank, heads, n = 512, 16, 300
    g = torch.Generator(device="cuda").manual_seed(7)
    lat = torch.randn(n, rank + ROPE, device="cuda", generator=g).bfloat16()
    w = (torch.randn(heads * (NOPE + V), rank, device="cuda", generator=g) / 23).bfloat16()
    wn = weight_row_norms(w, NOPE, V)
    clean = upproject_fp8(lat[:, :rank], lat[:, rank:], w, wn, nope=NOPE, v=V)
    bad = lat.clone()
    bad[17, 3] = float("nan")
    bad[200, rank + 5] = float("inf")  # a rope value
    ctx = upproject_fp8(bad[:, :rank], bad[:, rank:], w, wn, nope=NOPE, v=V)
    assert torch.equal(ctx.bound, clean.bound)
    assert bool(ctx.k8[17].float().isnan().all()) and bool(ctx.vt8[:, :, 17].float().isnan().all())
    # row 17's rope values are finite: only its GEMM outputs (nope, v) are NaN
    assert bool(ctx.p8[200, 5].float().isnan()) and int(ctx.p8.float().isnan().sum()) == 1
    keep = torch.ones(n, dtype=torch.bool, device="cuda")
    keep[17] = False
    assert torch.equal(ctx.k8.view(torch.uint8)[keep], clean.k8.view(torch.uint8)[keep])
    assert torch.equal(ctx.vt8.view(torch.uint8)[:, :, :n][:, :, keep],
                       clean.vt8.view(torch.uint8)[:, :, :n][:, :, keep])


@pytest.mark.skipif(not _fp8_ok(), reason="needs FP8 matrix products (sm_89+)")
def test_gluon_fp8_kernel_merges_state_like_the_triton_kernel():
    """With ``state``: the Gluon kernel's merge against the Triton kernel's on the same inputs,
    rows without keys left as they were."""
    q, kn, kr, v, cq, ck = _case([130, 1, 64], [300, 0, 129], heads=2, seed=9)
    q8, qs = quantize_rows(q)
    ctx = quantize_context(kn, kr, v)
    if not _gluon_runs(q8, ctx):
        pytest.skip("the Gluon FP8 kernel needs an sm_90 GPU")
    g = torch.Generator(device="cuda").manual_seed(1)
    run_out = torch.randn(q.shape[0], 2, V, generator=g, device="cuda").bfloat16()
    run_lse = torch.randn(q.shape[0], 2, generator=g, device="cuda")
    results = []
    for config in (None, FP8AttentionConfig()):
        state = (run_out.clone(), run_lse.clone())
        fp8_context_attention(q8, qs, ctx, cq, ck, max_seqlen_q=130, softmax_scale=0.1,
                              state=state, config=config)
        results.append(state)
    assert hopper_fp8.failures() == {}
    (go, gl_), (to, tl_) = results
    assert torch.equal(go[130], run_out[130]) and torch.equal(gl_[130], run_lse[130])
    assert (gl_ - tl_).abs().max() < 1e-3
    assert (go.float() - to.float()).abs().max() < 2 ** -4 * float(v.abs().max())
