"""The opt-in FP8 context attention on CPU: the ``mlaprefill-fp8`` backend's selection and
errors, and its kernels in Triton's interpreter (tests/interpreter/test_interp_fp8_attention.py
and test_interp_fp8_upproj.py, in a subprocess with ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlaprefill.backends import AUTO_ORDER, BACKENDS, get_backend
from mlaprefill.kernels.fp8_attention import FP8AttentionConfig, FP8Context, fp8_context_attention


def test_auto_never_picks_fp8_and_reasons_name_the_dim():
    assert "mlaprefill-fp8" in BACKENDS and "mlaprefill-fp8" not in AUTO_ORDER
    be = BACKENDS["mlaprefill-fp8"]()
    assert be.name == "mlaprefill-fp8"
    assert "qk_rope_head_dim" in be.head_split_reason(128, 48)
    assert "qk_nope_head_dim" in be.head_split_reason(96, 64)
    assert be.head_split_reason(128, 64) is None
    why = be.unsupported_reason(torch.device("cpu"), torch.float64, 192, 128)
    assert why is not None
    with pytest.raises(ValueError, match="min_queries"):
        BACKENDS["mlaprefill-fp8"](min_queries=-1)
    with pytest.raises(ValueError, match="mlaprefill-fp8"):
        get_backend("mlaprefill-fp8", device="cpu", dtype=torch.float64, qk_head_dim=192,
                    v_head_dim=128)


def test_config_and_kernel_argument_errors():
    with pytest.raises(ValueError, match="block_n"):
        FP8AttentionConfig(block_n=48)
    with pytest.raises(ValueError, match="num_warps"):
        FP8AttentionConfig(num_warps=3)
    f8 = torch.float8_e4m3fn
    ctx = FP8Context(torch.zeros(4, 2, 16, dtype=f8), torch.zeros(4, 16, dtype=f8),
                     torch.zeros(2, 16, 16, dtype=f8), torch.ones(2))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="q8 must be"):
        fp8_context_attention(torch.zeros(4, 2, 32), torch.ones(4, 2), ctx, cu, cu,
                              max_seqlen_q=4, softmax_scale=1.0)
    with pytest.raises(ValueError, match="softmax_scale"):
        fp8_context_attention(torch.zeros(4, 2, 32, dtype=f8), torch.ones(4, 2), ctx, cu, cu,
                              max_seqlen_q=4, softmax_scale=float("nan"))
    bad = FP8Context(ctx.k8, torch.zeros(4, 24, dtype=f8), ctx.vt8, ctx.bound)
    with pytest.raises(ValueError, match="rope head dim"):
        fp8_context_attention(torch.zeros(4, 2, 40, dtype=f8), torch.ones(4, 2), bad, cu, cu,
                              max_seqlen_q=4, softmax_scale=1.0)


def test_fp8_kernels_in_the_interpreter():
    from conftest import run_interpreter_tests

    run_interpreter_tests("test_interp_fp8_attention.py", passed=9)
    run_interpreter_tests("test_interp_fp8_upproj.py", passed=18)


def test_upproject_fp8_argument_errors_name_the_field():
    from mlaprefill.kernels.fp8_upproj import FP8UpProjConfig, upproject_fp8, weight_row_norms

    lat = torch.zeros(8, 48, dtype=torch.float16)
    w = torch.zeros(2 * 32, 32, dtype=torch.float16)
    wn = weight_row_norms(w, 16, 16)
    assert wn.tolist() == [0.0, 0.0]
    cases = [
        ((lat[:, :32].float(), lat[:, 32:], w, wn), {}, "kv_c must be bfloat16 or float16"),
        ((lat[:, 1:33], lat[:, 32:], w, wn), {}, "16-byte aligned"),
        ((lat[:, :32], lat[:4, 32:], w, wn), {}, "k_pe must be"),
        ((lat[:, :32], lat[:, 32:], w[:, :16], wn), {}, "w_kv must be"),
        ((lat[:, :32], lat[:, 32:], w.float(), wn), {}, "w_kv must be"),
        ((lat[:, :32], lat[:, 32:], w, wn.double()), {}, "w_norms must be"),
        ((lat[:, :32], lat[:, 32:], w, wn), {"nope": 24}, "nope a power of two"),
        ((lat[:, :32], lat[:, 32:], w, wn), {"valid_rows": torch.tensor([8])},
         "valid_rows must be"),
        ((lat[:, :32], lat[:, 32:], w, wn), {}, "runs on CUDA"),
    ]
    for args, extra, match in cases:
        kwargs = {"nope": 16, "v": 16, **extra}
        with pytest.raises(ValueError, match=match):
            upproject_fp8(*args, **kwargs)
    with pytest.raises(ValueError, match="block_k"):
        FP8UpProjConfig(block_k=24)
    with pytest.raises(ValueError, match="w_kv must be"):
        weight_row_norms(torch.zeros(50, 8), 16, 16)
    empty = upproject_fp8(lat[:0, :32], lat[:0, 32:], w, wn, nope=16, v=16)
    assert empty.k8.shape == (0, 2, 16) and empty.bound.tolist() == [0.0, 0.0]


@settings(max_examples=80, deadline=None)
@given(dims=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32]),
       which=st.sampled_from(["rows", "context", "attention", "upproj"]))
def test_fuzz_entry_points_fail_with_a_clear_error_on_cpu(dims, dtype, which):
    """Outside the interpreter every call on CPU tensors is refused with a ValueError that names
    what to fix (shape, dtype, device), never another exception; empty inputs are a no-op."""
    from mlaprefill.kernels.fp8_attention import quantize_context, quantize_rows

    x = torch.zeros(dims, dtype=torch.float32).to(dtype)
    try:
        if which == "rows":
            y, _ = quantize_rows(x)
            assert x.dim() == 3 and x.numel() == 0 and y.shape == x.shape
            return
        if which == "context":
            ctx = quantize_context(x, x.flatten(1) if x.dim() == 3 else x, x)
            assert x.numel() == 0 or x.shape[0] == 0
            assert ctx.k8.shape == x.shape
            return
        if which == "upproj":
            from mlaprefill.kernels.fp8_upproj import upproject_fp8

            flat = x.flatten(1) if x.dim() > 1 else x
            w = torch.zeros(64, flat.shape[-1] if flat.dim() == 2 else 16, dtype=flat.dtype)
            ctx = upproject_fp8(flat, flat, w, torch.zeros(2), nope=16, v=16)
            assert flat.shape[0] == 0
            return
        cu = torch.tensor([0, dims[0]], dtype=torch.int32)
        f8 = torch.float8_e4m3fn
        ctx = FP8Context(torch.zeros(3, 2, 16, dtype=f8), torch.zeros(3, 16, dtype=f8),
                         torch.zeros(2, 16, 16, dtype=f8), torch.ones(2))
        fp8_context_attention(x, torch.ones(dims[0], 2), ctx, cu, cu, max_seqlen_q=dims[0],
                              softmax_scale=0.5)
        assert x.numel() == 0 or dims[0] == 0  # only an empty call returns without a kernel
    except ValueError as exc:
        assert any(w in str(exc) for w in ("must", "runs on CUDA", "needs")), exc
