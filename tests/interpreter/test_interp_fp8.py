"""FP8 caches through the Triton gather kernel and the graphs' padded launches, in Triton's
interpreter on CPU tensors (run by tests/test_fp8_cache.py in a subprocess with
``TRITON_INTERPRET=1``; skipped otherwise).

The interpreter rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest even, and the
GPU tests check bf16 rows bitwise), so rows are compared bitwise in float32 and float64 here,
and bf16 within one bf16 ulp.
"""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see "
                "tests/test_fp8_cache.py)", allow_module_level=True)

import torch

from test_fp8_cache import FORMATS, _scale, decode, fmt_kwargs, quantized_cache


def test_gather_kernel_dequantizes_like_torch():
    from mlaprefill.kernels.gather import gather_context_rows

    g = torch.Generator().manual_seed(2)
    rows = torch.randn(5, 16, 576, generator=g) * 3
    rows[2, 5, 7] = float("nan")
    table = torch.tensor([[4, 0, 2], [1, 3, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 33, 50], dtype=torch.int32)
    starts = torch.tensor([2, 15], dtype=torch.int32)
    bad_table = table.clone()
    bad_table[1, 1] = 9  # outside the cache: NaN rows from the kernel
    for fmt, scale in [*FORMATS, ("bf16", None)]:
        scale = _scale(scale)
        cache = rows.bfloat16() if fmt == "bf16" else quantized_cache(rows, fmt, scale)
        kw = {} if fmt == "bf16" else fmt_kwargs(fmt, scale)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            if fmt == "bf16" and dtype != torch.bfloat16:
                continue
            for tbl in (table, bad_table):
                a = gather_context_rows(cache, tbl, cu, starts, torch.full((56, 576), 3.0,
                                        dtype=dtype), 56, use_kernel=True, **kw)
                b = gather_context_rows(cache, tbl, cu, starts, torch.full((56, 576), 3.0,
                                        dtype=dtype), 56, use_kernel=False, **kw) \
                    if tbl is table else None
                if b is None:  # bad block: the torch path raises on CPU; rows 33+j.. NaN
                    bad_rows = a[33 + (16 - 15):50].isnan().all(dim=1)
                    assert bool(bad_rows.all()), fmt
                    continue
                assert torch.equal(a.isnan(), b.isnan()), (fmt, dtype)
                diff = (a.double() - b.double()).nan_to_num(0).abs()
                if dtype == torch.bfloat16:
                    assert bool((diff <= b.double().abs().nan_to_num(0) * 2 ** -7).all())
                else:
                    assert bool((diff == 0).all()), (fmt, dtype)


def test_graphs_padded_launches_read_fp8_caches():
    from conftest import paged_mla_inputs
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.graphs import IterationGraphs
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.prefill import MLAChunkedPrefill
    from mlaprefill.reference import mla_prefill_reference
    from mlaprefill.staging import StagingRing

    query_lens, context_lens = [3, 1], [33, 16]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=512, nope=16, rope=64, v=16,
                         page_size=16, seed=3)
    plan = ChunkPlanner(16, 16, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=16))
    shared = IterationGraphs()
    for fmt, scale in FORMATS:
        scale = _scale(scale)
        cache = quantized_cache(x["kv_cache"].float(), fmt, scale)
        ref_out, ref_lse = mla_prefill_reference(
            x["q"], x["kv_c_new"], x["k_pe_new"], decode(cache, fmt, scale), x["block_table"],
            query_lens, context_lens, x["weight"], qk_nope_head_dim=16, v_head_dim=16)
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=16, v_head_dim=16,
                               backend="mlaprefill", graphs=shared)
        runs = shared.warm_runs
        out, lse = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], cache, x["block_table"],
                              StagingRing("cpu").upload(plan), return_lse=True,
                              **fmt_kwargs(fmt, scale))
        assert shared.warm_runs > runs  # the padded launches ran
        assert (out.double() - ref_out).abs().max() < 1e-4, fmt
        assert (lse.double() - ref_lse).abs().max() < 1e-4, fmt


def test_gather_tile_widths_give_the_same_rows():
    from mlaprefill.kernels.gather import gather_context_rows

    g = torch.Generator().manual_seed(4)
    rows = torch.randn(4, 16, 576, generator=g) * 2
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    starts = torch.tensor([5, 0], dtype=torch.int32)
    for fmt, scale in [*FORMATS, ("bf16", None)]:
        scale = _scale(scale)
        cache = rows.half() if fmt == "bf16" else quantized_cache(rows, fmt, scale)
        kw = {} if fmt == "bf16" else fmt_kwargs(fmt, scale)
        dtype = torch.float16 if fmt == "bf16" else torch.float32
        widths = (64, 128) if fmt == "fp8_ds_mla" else (16, 64, 128, 256)
        got = [gather_context_rows(cache, table, cu, starts, torch.zeros(40, 576, dtype=dtype),
                                   37, use_kernel=True, block_d=w, **kw).clone() for w in widths]
        want = gather_context_rows(cache, table, cu, starts, torch.zeros(40, 576, dtype=dtype),
                                   37, use_kernel=False, **kw)
        for w, a in zip(widths, got, strict=True):
            assert torch.equal(a, want), (fmt, w)
    with pytest.raises(ValueError, match="block_d"):
        gather_context_rows(quantized_cache(rows, "fp8_ds_mla", None), table, cu, starts,
                            torch.zeros(40, 576), 37, use_kernel=True, block_d=256,
                            **fmt_kwargs("fp8_ds_mla", None))
