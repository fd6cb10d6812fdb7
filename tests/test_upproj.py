"""matmul_device_rows: the up-projection GEMM whose row count is a device int (Triton's
interpreter on CPU, in a subprocess; the torch fallback in process)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import run_interpreter_tests
from mlaprefill.kernels.upproj import matmul_device_rows


@pytest.mark.slow
def test_matmul_device_rows_in_interpreter():
    """Against a float64 reference: m = 0, 1, a partial tile, the capacity, past it (clamped);
    rows >= m keep their values; K of 16 and 32; a NaN stays in its row
    (tests/interpreter/test_interp_upproj.py, in its own process under Triton's interpreter)."""
    run_interpreter_tests("test_interp_upproj.py", passed=1)


def test_matmul_device_rows_torch_fallback_and_errors():
    """On CPU outside the interpreter every row is computed with torch.mm (the caller's
    padding rows included); bad shapes and dtypes are ValueErrors naming the arguments."""
    a = torch.randn(6, 8, dtype=torch.float64)
    w = torch.randn(4, 8, dtype=torch.float64)
    c = torch.zeros(6, 4, dtype=torch.float64)
    m = torch.tensor([3], dtype=torch.int32)
    if os.environ.get("TRITON_INTERPRET") != "1":
        matmul_device_rows(a, w, c, m)
        assert torch.allclose(c, a @ w.t())
    with pytest.raises(ValueError, match="expected a"):
        matmul_device_rows(a, w[:, :4], c, m)
    with pytest.raises(ValueError, match="int32"):
        matmul_device_rows(a, w, c, m.long())
    with pytest.raises(ValueError, match="contiguous"):
        matmul_device_rows(a, w.t().contiguous().t(), c, m)
    with pytest.raises(ValueError, match="method"):
        matmul_device_rows(a, w, c, m, method="cublas")
    with pytest.raises(ValueError, match="grouped_mm"):  # float64 on CPU: not its case
        matmul_device_rows(a, w, c, m, method="grouped_mm")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["triton", "auto"])
def test_matmul_device_rows_on_cuda_matches_torch(method):
    """On the GPU (triton: the 128 x 256 x 64 persistent config; auto: torch._grouped_mm on a
    Hopper GPU): rows 0, 1, a partial tile, the capacity; bfloat16 against a float32 product,
    rows >= m of c untouched by triton; one launch captured in a CUDA graph serves every m."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    cap, k, n = 1000, 512, 16 * 256
    latent = torch.randn(cap, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    a = latent[:, :k]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / 20
    c = torch.full((cap, n), 7.0, device="cuda", dtype=torch.bfloat16)
    m = torch.zeros(1, device="cuda", dtype=torch.int32)
    matmul_device_rows(a, w, c, m, method=method)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = matmul_device_rows(a, w, c, m, method=method)
    for rows in (0, 1, 300, 1000):
        c.fill_(7.0)
        m.fill_(rows)
        graph.replay()
        ref = a[:rows].float() @ w.float().t()
        assert (got[:rows].float() - ref).abs().max().item() <= 0.05 if rows else True
        if method == "triton":
            assert got is c and bool((c[rows:] == 7.0).all()), rows
