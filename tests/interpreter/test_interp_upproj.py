"""matmul_device_rows' Triton GEMM in Triton's interpreter on CPU tensors (run by
tests/test_upproj.py in a subprocess with ``TRITON_INTERPRET=1``)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (see tests/test_upproj.py)",
                allow_module_level=True)


import torch

from mlaprefill.kernels.upproj import matmul_device_rows


def test_matmul_device_rows_against_float64():
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        for cap, k, n, m in ((40, 32, 48, 0), (40, 32, 48, 1), (40, 32, 48, 17),
                             (40, 32, 48, 40), (40, 32, 48, 99), (33, 16, 20, 32)):
            # a: the kv_c part of latent rows (row stride wider than K), w: [N, K]
            latent = torch.randn(cap, k + 8, generator=g).to(dtype)
            a = latent[:, :k]
            w = torch.randn(n, k, generator=g).to(dtype)
            c = torch.full((cap, n), 7.0, dtype=dtype)
            got = matmul_device_rows(a, w, c, torch.tensor([m], dtype=torch.int32))
            assert got is c
            rows = min(m, cap)
            ref = a[:rows].double() @ w.double().t()
            err = (c[:rows].double() - ref).abs().max().item() if rows else 0.0
            scale = max(1.0, ref.abs().max().item()) if rows else 1.0
            assert err <= tol * scale, (dtype, cap, k, n, m, err)
            assert bool((c[rows:] == 7.0).all()), (dtype, cap, m)  # rows >= m untouched
    # non-finite values stay in their rows
    a = torch.randn(24, 16, generator=g)
    a[3, 5] = float("nan")
    c = torch.zeros(24, 16)
    matmul_device_rows(a, torch.randn(16, 16, generator=g), c,
                       torch.tensor([24], dtype=torch.int32))
    assert torch.isnan(c[3]).all() and not torch.isnan(c[torch.arange(24) != 3]).any()
