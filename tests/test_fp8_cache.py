"""FP8 latent caches (float8_e4m3fn with one scale, DeepSeek's 656-byte ``fp8_ds_mla``): the
dequantizing gather, the forward against the float64 reference, the writer, and bad input.

Each format is decoded here independently of the library (the formula of
:mod:`mlaprefill.kvcache`, written out with torch views), and the reference runs on that decoded
cache, so the forward is held to "the same math as on the dequantized cache".
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import paged_mla_inputs
from mlaprefill import MLAChunkedPrefill, mla_chunked_prefill
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels.gather import gather_context_records, gather_context_rows
from mlaprefill.kvcache import FP8_DS_MLA_RECORD_BYTES, write_kv_cache
from mlaprefill.plan import ChunkPlanner
from mlaprefill.reference import mla_prefill_reference
from mlaprefill.staging import StagingRing

E4M3 = torch.float8_e4m3fn


def decode(cache: torch.Tensor, fmt: str, scale=None) -> torch.Tensor:
    """float32 rows ``[num_blocks, page_size, 576 or rank + rope]`` of a cache, written
    independently of the library."""
    if fmt == "bf16":
        return cache.float()
    if fmt == "fp8":
        s = scale if not isinstance(scale, torch.Tensor) else scale.reshape(())
        return cache.to(torch.float32) * s
    nb, ps, _ = cache.shape
    flat = cache.reshape(-1, FP8_DS_MLA_RECORD_BYTES)
    values = flat[:, :512].contiguous().view(E4M3).to(torch.float32)
    scales = flat[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    rope = flat[:, 528:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([values * scales, rope], dim=1).view(nb, ps, 576)


def quantized_cache(rows: torch.Tensor, fmt: str, scale=None) -> torch.Tensor:
    """A cache of ``fmt`` holding ``rows [num_blocks, page_size, latent]`` (write_kv_cache)."""
    nb, ps, latent = rows.shape
    shape = (nb, ps, FP8_DS_MLA_RECORD_BYTES if fmt == "fp8_ds_mla" else latent)
    dtype = {"fp8": E4M3, "fp8_ds_mla": torch.uint8}.get(fmt, rows.dtype)
    cache = torch.zeros(shape, dtype=dtype)
    write_kv_cache(cache, torch.arange(nb * ps), rows.reshape(nb * ps, latent),
                   kv_cache_scale=scale, kv_cache_format="fp8_ds_mla" if fmt == "fp8_ds_mla"
                   else None)
    return cache


def fmt_kwargs(fmt: str, scale=None) -> dict:
    return {"kv_cache_scale": scale, "kv_cache_format": "fp8_ds_mla" if fmt == "fp8_ds_mla"
            else None}


FORMATS = [("fp8", 0.037), ("fp8", "tensor"), ("fp8_ds_mla", None)]


def _scale(spec):
    return torch.tensor([0.021], dtype=torch.float32) if spec == "tensor" else spec


@pytest.mark.parametrize(("fmt", "scale"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_gathered_rows_are_fp8_times_scale_cast_bitwise(fmt, scale, dtype):
    scale = _scale(scale)
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 16, 576, generator=g) * 4
    rows[1, 3, 10] = math.nan  # a NaN record: its row is NaN there, no other row changes
    cache = quantized_cache(rows, fmt, scale)
    table = torch.tensor([[4, 0, 2], [1, 3, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 33, 50], dtype=torch.int32)
    starts = torch.tensor([2, 15], dtype=torch.int32)
    ws = torch.full((52, 576), 9.0, dtype=dtype)
    got = gather_context_rows(cache, table, cu, starts, ws, 52, **fmt_kwargs(fmt, scale))
    want_all = decode(cache, fmt, scale).to(dtype).view(-1, 576)
    expect = []
    for r, (a, b) in enumerate([(0, 33), (33, 50)]):
        for j in range(b - a):
            pos = int(starts[r]) + j
            expect.append(want_all[int(table[r, pos // 16]) * 16 + pos % 16])
    expect = torch.stack(expect)
    assert torch.equal(got[:50].isnan(), expect.isnan())
    assert torch.equal(got[:50].nan_to_num(0.5), expect.nan_to_num(0.5))  # bitwise
    assert bool((got[50:] == 9).all())  # padding rows kept
    assert int(got.isnan().any(dim=1).sum()) == int(expect.isnan().any(dim=1).sum())


def test_records_gather_copies_bytes_and_marks_bad_blocks():
    rows = torch.randn(3, 4, 576)
    cache = quantized_cache(rows, "fp8_ds_mla")
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    cu, starts = torch.tensor([0, 6], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    buf = torch.zeros(6, FP8_DS_MLA_RECORD_BYTES, dtype=torch.uint8)
    got = gather_context_records(cache, table, cu, starts, buf, 6)
    flat = cache.view(-1, FP8_DS_MLA_RECORD_BYTES)
    assert torch.equal(got, flat[torch.tensor([9, 10, 11, 0, 1, 2])])
    with pytest.raises(ValueError, match="outside"):  # on CPU a bad id is an error
        gather_context_records(cache, torch.tensor([[2, 7]], dtype=torch.int32), cu, starts,
                               buf, 6)


CASES = [  # (query_lens, context_lens, workspace): zero context, one token, page boundaries
    ([3], [0], 16),
    ([1], [1], 16),
    ([2, 1, 4], [16, 0, 17], 16),
    ([1, 5], [31, 32], 24),
    ([4, 2, 1], [48, 15, 1], 32),
]


@pytest.mark.parametrize(("fmt", "scale"), [("bf16", None), *FORMATS])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64_reference_on_the_dequantized_cache(fmt, scale, case):
    query_lens, context_lens, workspace = case
    scale = _scale(scale)
    rank, rope = (512, 64) if fmt == "fp8_ds_mla" else (32, 16)
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=rank, nope=8, rope=rope, v=8,
                         page_size=16, dtype=torch.float64, seed=len(context_lens))
    # near the top of e4m3's range: |rows / scale| reaches ~448
    rows = x["kv_cache"].float()
    if fmt == "fp8":
        s = float(scale) if not isinstance(scale, torch.Tensor) else float(scale[0])
        rows = rows / rows.abs().amax() * 440 * s
    cache = x["kv_cache"] if fmt == "bf16" else quantized_cache(rows, fmt, scale)
    decoded = decode(cache, fmt, scale).double()
    ref_out, ref_lse = mla_prefill_reference(
        x["q"], x["kv_c_new"], x["k_pe_new"], decoded, x["block_table"], query_lens,
        context_lens, x["weight"], qk_nope_head_dim=8, v_head_dim=8)
    kw = {} if fmt == "bf16" else fmt_kwargs(fmt, scale)
    out, lse = mla_chunked_prefill(
        x["q"], x["kv_c_new"], x["k_pe_new"], cache, x["block_table"], query_lens,
        context_lens, x["weight"], workspace_tokens=workspace, backend="math", return_lse=True,
        **kw)
    assert out.dtype == torch.float64
    assert (out - ref_out).abs().max() < 1e-10
    assert (lse - ref_lse).abs().max() < 1e-10


@pytest.mark.parametrize(("fmt", "scale"), FORMATS)
def test_float32_and_bf16_compute_close_to_reference(fmt, scale):
    scale = _scale(scale)
    query_lens, context_lens = [3, 1], [40, 17]
    rank, rope = (512, 64) if fmt == "fp8_ds_mla" else (32, 16)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 6e-2)):
        x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=rank, nope=8, rope=rope,
                             v=8, page_size=16, dtype=dtype, seed=4)
        cache = quantized_cache(x["kv_cache"].float(), fmt, scale)
        ref_out, ref_lse = mla_prefill_reference(
            x["q"], x["kv_c_new"], x["k_pe_new"], decode(cache, fmt, scale).to(dtype),
            x["block_table"], query_lens, context_lens, x["weight"], qk_nope_head_dim=8,
            v_head_dim=8)
        out, lse = mla_chunked_prefill(
            x["q"], x["kv_c_new"], x["k_pe_new"], cache, x["block_table"], query_lens,
            context_lens, x["weight"], workspace_tokens=16, return_lse=True,
            **fmt_kwargs(fmt, scale))
        assert (out.double() - ref_out).abs().max() < tol, dtype
        assert (lse.double() - ref_lse).abs().max() < tol, dtype


def test_nan_in_an_fp8_record_stays_in_its_request():
    query_lens, context_lens = [2, 3, 1], [20, 33, 16]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=512, nope=8, rope=64, v=8,
                         page_size=16, dtype=torch.float32, seed=5)
    for fmt, scale in (("fp8", 0.05), ("fp8_ds_mla", None)):
        cache = quantized_cache(x["kv_cache"].float(), fmt, scale)
        clean = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], cache,
                                    x["block_table"], query_lens, context_lens, x["weight"],
                                    workspace_tokens=32, **fmt_kwargs(fmt, scale))
        bad = cache.clone()
        block = int(x["block_table"][1, 1])  # request 1's second page
        bad.view(torch.uint8)[block, 3, 100] = 0x7F  # an e4m3fn NaN in a latent value
        out = mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], bad, x["block_table"],
                                  query_lens, context_lens, x["weight"], workspace_tokens=32,
                                  **fmt_kwargs(fmt, scale))
        assert bool(out[2:5].isnan().all()), fmt  # request 1's rows
        assert torch.equal(out[:2], clean[:2]) and torch.equal(out[5:], clean[5:]), fmt


def test_writer_saturates_finite_values_and_stores_inf_as_nan():
    rows = torch.tensor([[1.0, 500.0, -math.inf, math.nan]])
    cache = torch.zeros(1, 1, 4, dtype=E4M3)
    write_kv_cache(cache, torch.tensor([0]), rows, kv_cache_scale=1.0)
    got = cache.float().view(-1)
    assert got[0] == 1 and got[1] == 448 and got[2].isnan() and got[3].isnan()
    # fp8_ds_mla: power-of-two scales, error within e4m3's half-ulp (2**-4) of the group amax
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(64, 576, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    cache = torch.zeros(4, 16, FP8_DS_MLA_RECORD_BYTES, dtype=torch.uint8)
    write_kv_cache(cache, torch.arange(64), rows, kv_cache_format="fp8_ds_mla")
    back = decode(cache, "fp8_ds_mla").view(64, 576)
    scales = cache.view(64, -1)[:, 512:528].contiguous().view(torch.float32)
    assert bool((torch.log2(scales) == torch.log2(scales).round()).all())
    amax = rows[:, :512].abs().view(64, 4, 128).amax(dim=2).repeat_interleave(128, dim=1)
    assert bool(((back[:, :512] - rows[:, :512]).abs() <= amax * 2 ** -4).all())
    assert torch.equal(back[:, 512:], rows[:, 512:].bfloat16().float())


def test_io_buffers_take_fp8_caches():
    # (The graphs' replays of the mlaprefill backend: tests/interpreter/test_interp_fp8.py.)
    query_lens, context_lens = [3, 2], [40, 17]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=512, nope=8, rope=64, v=8,
                         page_size=16, dtype=torch.float32, seed=6)
    plan = ChunkPlanner(16, 16, policy="balanced").plan(
        PrefillBatch(query_lens, context_lens, page_size=16))
    from mlaprefill import IterationGraphs

    for fmt, scale in FORMATS:
        scale = _scale(scale)
        cache = quantized_cache(x["kv_cache"].float(), fmt, scale)
        ref_out, _ = mla_prefill_reference(
            x["q"], x["kv_c_new"], x["k_pe_new"], decode(cache, fmt, scale), x["block_table"],
            query_lens, context_lens, x["weight"], qk_nope_head_dim=8, v_head_dim=8)
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=8,
                               graphs=IterationGraphs())
        io = op.io_buffers(plan.num_query_tokens)
        io.q.copy_(x["q"])
        out, lse = op.forward(io.q, x["kv_c_new"], x["k_pe_new"], cache, x["block_table"],
                              StagingRing("cpu").upload(plan), out=io.out, lse=io.lse,
                              **fmt_kwargs(fmt, scale))
        assert out is io.out and lse is io.lse
        assert (out.double() - ref_out).abs().max() < 2e-5, fmt


BAD = [
    # (cache builder, kwargs, error type, message fragment)
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": 0.0}, ValueError,
     "kv_cache_scale must be a finite number > 0"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": -1.0}, ValueError,
     "kv_cache_scale"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": math.nan}, ValueError,
     "kv_cache_scale"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": math.inf}, ValueError,
     "kv_cache_scale"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": 1e39}, ValueError,
     "in float32"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": "1"}, TypeError,
     "kv_cache_scale must be a float"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_scale": torch.ones(2)},
     ValueError, "1-element float32"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3),
     {"kv_cache_scale": torch.ones(1, dtype=torch.float64)}, ValueError, "1-element float32"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3),
     {"kv_cache_scale": torch.ones(1, device="meta")}, ValueError, "cache's device"),
    (lambda: torch.zeros(4, 16, 656, dtype=torch.uint8), {}, ValueError,
     "kv_cache_format='fp8_ds_mla'"),
    (lambda: torch.zeros(4, 16, 576, dtype=torch.float8_e5m2), {}, ValueError, "e5m2"),
    (lambda: torch.zeros(4, 16, 600, dtype=torch.uint8), {"kv_cache_format": "fp8_ds_mla"},
     ValueError, "656"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_format": "fp8_ds_mla"},
     ValueError, "torch.uint8"),
    (lambda: torch.zeros(4, 16, 656, dtype=torch.uint8),
     {"kv_cache_format": "fp8_ds_mla", "kv_cache_scale": 1.0}, ValueError, "must be None"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_format": "fp8"}, ValueError,
     "kv_cache_format must be None"),
    (lambda: torch.zeros(4, 16, 576, dtype=E4M3), {"kv_cache_format": 1}, TypeError,
     "kv_cache_format"),
    (lambda: torch.zeros(4, 16, 576, dtype=torch.float32), {"kv_cache_scale": 2.0},
     ValueError, "kv_cache_scale is for a float8_e4m3fn cache"),
]


@pytest.mark.parametrize(("make", "kwargs", "error", "match"), BAD)
def test_bad_cache_format_is_a_clear_error_before_anything_runs(make, kwargs, error, match):
    query_lens, context_lens = [2], [20]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=512, nope=8, rope=64, v=8,
                         page_size=16, dtype=torch.float32)
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=8)
    plan = ChunkPlanner(16, 16).plan(PrefillBatch(query_lens, context_lens, page_size=16))
    ring = StagingRing("cpu")
    dp = ring.upload(plan)
    with pytest.raises(error, match=match):
        op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], make(), x["block_table"], dp,
                   **kwargs)
    # ... and nothing changed: the same objects then run a good forward
    good = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                      dp)
    assert good.shape == (2, 2, 8) and bool(good.isfinite().all())


def test_ds_mla_needs_deepseek_dims():
    x = paged_mla_inputs([1], [4], heads=2, rank=32, nope=8, rope=16, v=8, page_size=16)
    with pytest.raises(ValueError, match="kv_lora_rank 512 \\+ rope 64"):
        mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"],
                            torch.zeros(2, 16, 656, dtype=torch.uint8), x["block_table"], [1],
                            [4], x["weight"], kv_cache_format="fp8_ds_mla")


def test_validate_reads_a_device_scale_tensor():
    query_lens, context_lens = [2], [20]
    x = paged_mla_inputs(query_lens, context_lens, heads=2, rank=32, nope=8, rope=16, v=8,
                         page_size=16)
    cache = quantized_cache(x["kv_cache"].float(), "fp8", 0.5)
    for bad in (0.0, -2.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="kv_cache_scale holds"):
            mla_chunked_prefill(x["q"], x["kv_c_new"], x["k_pe_new"], cache, x["block_table"],
                                query_lens, context_lens, x["weight"], validate=True,
                                kv_cache_scale=torch.tensor([bad]))


@pytest.mark.slow
def test_triton_kernels_in_the_interpreter():
    from conftest import run_interpreter_tests

    run_interpreter_tests("test_interp_fp8.py", passed=3)


# -- fuzz: every combination of cache dtype, record width, format and scale is either a
#    result (finite, for a finite cache) or a ValueError/TypeError naming the cache field.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SCALES = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
    st.sampled_from([1e-50, 1e39, 2**1100, True, "1.0", [1.0]]),
    st.builds(lambda shape, dtype, v: torch.full(shape, v, dtype=dtype),
              st.sampled_from([(), (1,), (2,), (1, 1)]),
              st.sampled_from([torch.float32, torch.float64, torch.float16]),
              st.sampled_from([0.5, 2.0])))
_CACHES = st.tuples(st.sampled_from([torch.float32, torch.bfloat16, E4M3, torch.float8_e5m2,
                                     torch.uint8, torch.int8]),
                    st.sampled_from([576, 656, 600, 575]))
_FORMATS = st.sampled_from([None, "fp8_ds_mla", "fp8", "auto", "", 3, b"fp8_ds_mla"])
_FUZZ = None


def _fuzz_inputs():
    global _FUZZ
    if _FUZZ is None:
        x = paged_mla_inputs([2, 1], [20, 0], heads=2, rank=512, nope=8, rope=64, v=8,
                             page_size=16, dtype=torch.float32, seed=9)
        plan = ChunkPlanner(16, 16).plan(PrefillBatch([2, 1], [20, 0], page_size=16))
        op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=8, v_head_dim=8)
        _FUZZ = x, op, StagingRing("cpu").upload(plan)
    return _FUZZ


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache=_CACHES, fmt=_FORMATS, scale=_SCALES)
def test_fuzz_cache_format_and_scale_outcomes(cache, fmt, scale):
    x, op, dp = _fuzz_inputs()
    dtype, width = cache
    nb = x["kv_cache"].shape[0]
    raw = torch.randint(0, 120, (nb, 16, width), dtype=torch.uint8)  # finite e4m3 bytes
    kv = raw.view(dtype) if dtype in (E4M3, torch.float8_e5m2, torch.int8) else (
        raw if dtype == torch.uint8 else torch.randn(nb, 16, width).to(dtype))
    if dtype == torch.uint8 and width == 656:  # finite scales and rope in the records
        kv.view(-1, 656)[:, 512:528] = torch.full((1, 4), 0.5).view(torch.uint8)
        kv.view(-1, 656)[:, 528:] = torch.zeros(1, 64, dtype=torch.bfloat16).view(torch.uint8)
    try:
        out = op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], kv, x["block_table"], dp,
                         kv_cache_scale=scale, kv_cache_format=fmt)
    except (ValueError, TypeError) as exc:
        assert "kv_cache" in str(exc), exc
        return
    # only the valid combinations get here
    ok_fp8 = dtype == E4M3 and width == 576 and fmt is None
    ok_ds = dtype == torch.uint8 and width == 656 and fmt == "fp8_ds_mla" and scale is None
    ok_plain = dtype == torch.float32 and width == 576 and fmt is None and scale is None
    assert ok_fp8 or ok_ds or ok_plain, (dtype, width, fmt, scale)
    assert bool(out.isfinite().all())


@settings(max_examples=120, deadline=None)
@given(fmt=st.sampled_from(["bf16", "fp8", "fp8_ds_mla"]),
       slots=st.lists(st.integers(-3, 70), max_size=6),
       width=st.sampled_from([576, 575]),
       rows_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int32]),
       scale=st.sampled_from([None, 0.5, -1.0, float("nan")]))
def test_fuzz_write_kv_cache_outcomes(fmt, slots, width, rows_dtype, scale):
    last = 656 if fmt == "fp8_ds_mla" else 576
    dtype = {"bf16": torch.bfloat16, "fp8": E4M3, "fp8_ds_mla": torch.uint8}[fmt]
    cache = torch.zeros(4, 16, last, dtype=dtype)
    before = cache.clone()
    rows = (torch.randn(len(slots), width) * 3).to(rows_dtype)
    try:
        write_kv_cache(cache, torch.tensor(slots, dtype=torch.int64), rows,
                       kv_cache_scale=scale, **({"kv_cache_format": "fp8_ds_mla"}
                                                if fmt == "fp8_ds_mla" else {}))
    except (ValueError, TypeError) as exc:
        assert any(k in str(exc) for k in ("kv_cache", "slots", "rows")), exc
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # untouched
        return
    assert all(0 <= s < 64 for s in slots) and width == 576 and rows_dtype != torch.int32
    if len(set(slots)) == len(slots) and slots:  # read back what was written
        back = decode(cache, fmt, 1.0 if scale is None else scale).reshape(64, 576)
        err = (back[torch.tensor(slots)] - rows.float()).abs()
        assert bool((err <= rows.float().abs().amax() / 8 + 1e-2).all())
