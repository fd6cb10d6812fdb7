"""FP8 latent caches on CUDA (marked ``gpu``; skipped without CUDA): the Triton gather's rows bit
for bit against the format's formula in bf16, every backend against the float64 reference on
the decoded cache, graph replays with a float and a device scale, NaN kept in its request."""

from __future__ import annotations

import pytest
import torch

from conftest import paged_mla_inputs
from mlaprefill import IterationGraphs, MLAChunkedPrefill, mla_chunked_prefill
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import gather_context_rows
from mlaprefill.plan import ChunkPlanner
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing
from test_fp8_cache import decode, fmt_kwargs, quantized_cache

pytestmark = pytest.mark.gpu

RANK, NOPE, ROPE, V, PAGE = 512, 128, 64, 128, 64
GPU_BACKENDS = ["mlaprefill", "cudnn", "flex", "fa2", "math"]
FORMATS = [("fp8", 0.03), ("fp8", "tensor"), ("fp8_ds_mla", None)]


def _scale(spec):
    return torch.tensor([0.025], device="cuda") if spec == "tensor" else spec


def _inputs(query_lens, context_lens, heads, fmt, scale, seed=0):
    x = paged_mla_inputs(query_lens, context_lens, heads=heads, rank=RANK, nope=NOPE, rope=ROPE,
                         v=V, page_size=PAGE, dtype=torch.bfloat16, device="cuda", seed=seed)
    rows = x["kv_cache"].float()
    if fmt == "fp8":  # values up to ~440 x scale: the top of e4m3's range
        s = float(scale) if not isinstance(scale, torch.Tensor) else float(scale.cpu()[0])
        rows = rows / rows.abs().amax() * 440 * s
    x["cache"] = quantized_cache_cuda(rows, fmt, scale)
    x["decoded"] = decode(x["cache"], fmt, scale)
    return x


def quantized_cache_cuda(rows, fmt, scale):
    from mlaprefill.kvcache import write_kv_cache

    nb, ps, latent = rows.shape
    shape = (nb, ps, 656 if fmt == "fp8_ds_mla" else latent)
    dtype = torch.uint8 if fmt == "fp8_ds_mla" else torch.float8_e4m3fn
    cache = torch.zeros(shape, dtype=dtype, device="cuda")
    write_kv_cache(cache, torch.arange(nb * ps, device="cuda"), rows.reshape(-1, latent),
                   **fmt_kwargs(fmt, scale))
    return cache


@pytest.mark.parametrize(("fmt", "scale"), FORMATS)
def test_triton_gather_rows_bitwise_in_bf16(fmt, scale):
    scale = _scale(scale)
    query_lens, context_lens = [3, 2, 4], [1000, 64, 4097]
    x = _inputs(query_lens, context_lens, 1, fmt, scale)
    plan = ChunkPlanner(1024, PAGE).plan(PrefillBatch(query_lens, context_lens, page_size=PAGE))
    dplan = StagingRing("cuda").upload(plan)
    want_all = x["decoded"].to(torch.bfloat16).reshape(-1, RANK + ROPE)
    table = x["block_table"]
    for i in range(plan.num_iterations):
        n = plan.iteration_tokens[i]
        ws = torch.empty(n, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
        got = gather_context_rows(x["cache"], table, dplan["cu_seq_lens"][i],
                                  dplan["chunk_starts"][i], ws, n, **fmt_kwargs(fmt, scale))
        slots = []
        for r in range(plan.num_reqs):
            s0, ln = int(plan.chunk_starts[i, r]), int(plan.chunk_lens[i, r])
            for pos in range(s0, s0 + ln):
                slots.append(int(table[r, pos // PAGE]) * PAGE + pos % PAGE)
        want = want_all[torch.tensor(slots, device="cuda")]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (fmt, i)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("fmt", "scale"), FORMATS)
def test_every_backend_matches_reference_on_the_decoded_cache(backend, fmt, scale):
    scale = _scale(scale)
    # zero context, one token, page-boundary contexts (64, 128), a one-token context
    query_lens, context_lens = [17, 1, 64, 5, 33], [0, 64, 200, 1, 128]
    x = _inputs(query_lens, context_lens, 16, fmt, scale)
    out, lse = mla_chunked_prefill(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["cache"], x["block_table"], query_lens,
        context_lens, x["weight"], workspace_tokens=128, backend=backend, return_lse=True,
        **fmt_kwargs(fmt, scale))
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], x["decoded"].to(torch.bfloat16),
        x["block_table"], query_lens, context_lens, x["weight"], qk_nope_head_dim=NOPE,
        v_head_dim=V)
    rel = (out.double().cpu() - ref_out).norm() / ref_out.norm()
    assert rel <= 1e-2, f"{backend} {fmt}: relative error {rel:.2e}"
    # bf16 q.k error grows with the logits: at values near e4m3's top the LSE is ~9
    lse_err = (lse.double().cpu() - ref_lse).abs().max()
    assert lse_err <= 1e-2 * max(1.0, float(ref_lse.abs().max())), f"{backend} {fmt}: {lse_err}"


@pytest.mark.parametrize(("fmt", "scale"), FORMATS)
def test_graph_replays_equal_the_eager_forward(fmt, scale):
    scale = _scale(scale)
    query_lens, context_lens = [64, 3, 100], [300, 1, 4100]
    x = _inputs(query_lens, context_lens, 16, fmt, scale, seed=2)
    plan = ChunkPlanner(1024, PAGE, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=PAGE))
    eager = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                              backend="mlaprefill")
    shared = IterationGraphs()
    graphed = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=V,
                                backend="mlaprefill", graphs=shared)
    dplan = StagingRing("cuda").upload(plan)
    args = (x["q"], x["kv_c_new"], x["k_pe_new"], x["cache"], x["block_table"], dplan)
    want = eager.forward(*args, **fmt_kwargs(fmt, scale))
    for _ in range(3):  # first sight eager, then captured, then replayed
        got = graphed.forward(*args, **fmt_kwargs(fmt, scale))
        shared.capture_pending()
    assert shared.replays > 0
    assert torch.equal(got, want)
    if isinstance(scale, torch.Tensor):  # a new scale value in the same tensor: replays read it
        scale.mul_(2)
        want = eager.forward(*args, **fmt_kwargs(fmt, scale))
        got = graphed.forward(*args, **fmt_kwargs(fmt, scale))
        assert torch.equal(got, want)


def test_nan_in_an_fp8_record_stays_in_its_request():
    query_lens, context_lens = [2, 3, 1], [200, 330, 160]
    for fmt, scale in (("fp8", 0.03), ("fp8_ds_mla", None)):
        x = _inputs(query_lens, context_lens, 16, fmt, scale, seed=4)
        kw = fmt_kwargs(fmt, scale)
        clean = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], x["cache"],
                                    x["block_table"], query_lens, context_lens, x["weight"],
                                    workspace_tokens=256, **kw)
        bad = x["cache"].clone()
        bad.view(torch.uint8)[int(x["block_table"][1, 2]), 5, 7] = 0x7F  # e4m3fn NaN
        out = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], bad, x["block_table"],
                                  query_lens, context_lens, x["weight"], workspace_tokens=256,
                                  **kw)
        assert bool(out[2:5].isnan().all()), fmt
        assert torch.equal(out[:2], clean[:2]) and torch.equal(out[5:], clean[5:]), fmt


def test_writer_quantizes_on_the_device_like_on_the_host():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(256, 576, generator=g) * 5
    for fmt, scale in (("fp8", 0.02), ("fp8_ds_mla", None)):
        host = quantized_cache(rows.view(4, 64, 576), fmt, scale)
        dev = quantized_cache_cuda(rows.view(4, 64, 576).cuda(), fmt, scale)
        assert torch.equal(host.view(torch.uint8), dev.cpu().view(torch.uint8)), fmt
