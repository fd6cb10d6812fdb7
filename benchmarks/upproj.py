"""The up-projection GEMM with its row count on the device against ``torch.mm`` (one GPU).

    PYTHONPATH=src python benchmarks/upproj.py --out benchmarks/results/upproj_h200.json

``c[:m] = a[:m] @ W.T`` with ``a`` the workspace's ``kv_c`` columns (row stride 576),
``W = kv_b_proj.weight [H * 256, 512]``, bfloat16: ``matmul_device_rows`` (the Triton kernel,
and ``torch._grouped_mm``) over ``cap`` rows (what a replayed CUDA graph of a context iteration
runs, whatever its rows) against ``torch.mm`` of exactly ``m`` rows (the eager forward) and of
``m`` rounded up to its row bucket (what a graph keyed by rows runs). Median of
``triton.testing.do_bench`` (L2 flushed), TFLOP/s of the ``m`` useful rows.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from _common import kernel_ms, write_json

# (heads, m, cap): 16 heads = DeepSeek-V3 at TP 8 (the bench), 128 = TP 1; m from a short last
# iteration to a full 64 Ki workspace; cap the bench's arenas (uneven: 64 Ki rows, stall: 1 Mi)
SHAPES = [(16, 4096, 65536), (16, 30000, 65536), (16, 65536, 65536), (16, 65536, 1048576),
          (128, 4096, 65536), (128, 65536, 65536)]


def measure(heads: int, m: int, cap: int) -> dict[str, Any]:
    """One shape: the three timings, TFLOP/s and the error against a float32 product."""
    from mlaprefill.graphs import row_bucket
    from mlaprefill.kernels.upproj import matmul_device_rows

    n, k = heads * 256, 512
    latent = torch.randn(cap, 576, device="cuda", dtype=torch.bfloat16)
    a = latent[:, :k]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 20
    c = torch.empty(cap, n, device="cuda", dtype=torch.bfloat16)
    dm = torch.tensor([m], device="cuda", dtype=torch.int32)
    bucket = min(row_bucket(m), cap)
    ours = kernel_ms(lambda: matmul_device_rows(a, w, c, dm, method="triton"))["median_ms"]
    grouped = kernel_ms(lambda: matmul_device_rows(a, w, c, dm, method="grouped_mm"))["median_ms"]
    exact = kernel_ms(lambda: torch.mm(a[:m], w.t(), out=c[:m]))["median_ms"]
    padded = kernel_ms(lambda: torch.mm(a[:bucket], w.t(), out=c[:bucket]))["median_ms"]
    ref = a[:m].float() @ w.float().t()
    err = (matmul_device_rows(a, w, c, dm, method="triton")[:m].float() - ref).abs().max().item()
    err_g = (matmul_device_rows(a, w, c, dm, method="grouped_mm")[:m].float()
             - ref).abs().max().item()
    flop = 2 * m * n * k
    return {"heads": heads, "m": m, "cap": cap, "bucket": bucket, "device_rows_ms": ours,
            "grouped_mm_ms": grouped, "grouped_mm_ratio_vs_exact": grouped / exact,
            "grouped_mm_max_abs_err_vs_fp32": err_g,
            "torch_mm_exact_ms": exact, "torch_mm_bucket_ms": padded,
            "device_rows_tflops": flop / ours / 1e9, "torch_mm_exact_tflops": flop / exact / 1e9,
            "ratio_vs_exact": ours / exact, "ratio_vs_bucket": ours / padded,
            "max_abs_err_vs_fp32": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    args = ap.parse_args()
    from mlaprefill._env import machine_info, utc_now

    rows_out: list[dict[str, Any]] = []
    for heads, m, cap in SHAPES:
        row = measure(heads, m, cap)
        rows_out.append(row)
        print(f"H={heads:>3} m={m:>6} cap={cap:>7}: device rows {row['device_rows_ms']:.3f} ms "
              f"({row['device_rows_tflops']:.0f} TF/s), torch.mm exact "
              f"{row['torch_mm_exact_ms']:.3f} ms ({row['torch_mm_exact_tflops']:.0f}), bucket "
              f"{row['bucket']} {row['torch_mm_bucket_ms']:.3f} ms; "
              f"x{row['ratio_vs_exact']:.2f} exact, x{row['ratio_vs_bucket']:.2f} bucket, "
              f"err {row['max_abs_err_vs_fp32']:.3g}; grouped_mm {row['grouped_mm_ms']:.3f} ms "
              f"x{row['grouped_mm_ratio_vs_exact']:.2f} exact", flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, {"benchmark": "upproj", "argv": sys.argv,
                          "date_utc": utc_now(offset=True),
                          "machine": machine_info(torch.device("cuda")), "rows": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
