"""cuDNN attention under changing shapes: host cost of new shapes, kernel speed, correctness.

    PYTHONPATH=src python benchmarks/cudnn_shapes.py --out benchmarks/results/cudnn_shapes_h200.json

torch's dense cuDNN SDPA caches one graph per exact (q_len, k_len, strides, ...) and builds a new
one on the host for every new shape (51-97 ms measured on the H200). torch 2.11 has an opt-in,
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``: the graph key rounds the sequence lengths up to powers of
two and the real lengths go in as a padding mask at run time. This script measures, for each
setting in its own process (the variable is read by torch), on the dense per-sequence call the
``cudnn`` backend makes (``[1, H, n, D]`` views of packed ``[n, H, D]`` tensors, D_qk 192, D_v
128, bf16):

* the host time of the first call of every shape in a list of distinct, nearby shapes (a graph
  build shows as tens of milliseconds) and of a repeated call;
* the kernel time of each shape (CUDA events, ``triton.testing.do_bench`` median) and TFLOP/s,
  ``FLOPs = 2 * q * k * H * (192 + 128)`` (causal: about half, counted as ``q*(q+1)/2`` keys);
* output and LSE against a float32 reference on the same inputs (relative error, LSE max-abs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from _common import write_json

QK, VD = 192, 128
SCALE = QK ** -0.5
# (heads, q_len, k_len, causal): nearby distinct shapes, as a real engine's steps produce them
SHAPES = [
    (128, 4096, 65536, False), (128, 4000, 61000, False), (128, 3500, 50000, False),
    (128, 4096, 40000, False), (128, 2048, 16384, False), (128, 2000, 16000, False),
    (16, 256, 8192, False), (16, 250, 8000, False), (16, 256, 81920, False),
    (16, 255, 80000, False), (128, 4096, 4096, True), (128, 4000, 4000, True),
    (16, 256, 256, True), (16, 250, 250, True),
]


def child() -> dict[str, Any]:
    import torch
    import triton.testing

    dev = "cuda"
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for h, sq, sk, causal in SHAPES:
        q = torch.randn(sq, h, QK, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(sk, h, QK, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(sk, h, VD, device=dev, dtype=torch.bfloat16, generator=g)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D] views

        def call(q4: Any = q4, k4: Any = k4, v4: Any = v4, causal: bool = causal) -> Any:
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                q4, k4, v4, None, True, 0.0, causal, False, scale=SCALE)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = call()
        first_host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        again_host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(call, warmup=5, rep=40, return_mode="median")
        keys = sq * (sq + 1) / 2 if causal else sq * sk
        tflops = 2 * keys * h * (QK + VD) / (ms * 1e-3) / 1e12
        # float32 reference on a slice of heads (memory): out and LSE
        hs = 2
        qf, kf, vf = q[:, :hs].float(), k[:, :hs].float(), v[:, :hs].float()
        s = torch.einsum("qhd,khd->hqk", qf, kf) * SCALE
        if causal:
            s.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        lse_ref = torch.logsumexp(s, -1)  # [hs, q]
        out_ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vf)
        out = res[0][0].transpose(0, 1)[:, :hs].float()
        lse = res[1].reshape(h, sq)[:hs].float()
        rel = ((out - out_ref).norm() / out_ref.norm()).item()
        lse_err = (lse - lse_ref).abs().max().item()
        del s, out_ref
        rows.append({"heads": h, "q_len": sq, "k_len": sk, "causal": causal,
                     "first_call_host_ms": first_host_ms, "repeat_call_host_ms": again_host_ms,
                     "kernel_ms": ms, "tflops": tflops, "out_rel_err": rel,
                     "lse_max_abs_err": lse_err, "lse_shape": list(res[1].shape)})
        print(f"H={h:>3} q={sq:>5} k={sk:>6} causal={causal!s:<5} first {first_host_ms:7.1f} ms "
              f"again {again_host_ms:6.2f} ms kernel {ms:7.3f} ms {tflops:6.0f} TFLOP/s "
              f"rel {rel:.1e} lse {lse_err:.1e}", flush=True)
        torch.cuda.empty_cache()
    # host cost of one launch on a cached shape (what a per-sequence backend pays per request)
    h, sq, sk = 16, 256, 8192
    q = torch.randn(1, h, sq, QK, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, h, sk, QK, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, h, sk, VD, device=dev, dtype=torch.bfloat16)
    for _ in range(5):
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False,
                                                           False, scale=0.1)
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False,
                                                           False, scale=0.1)
    launch_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return {"rows": rows, "host_us_per_cached_launch": launch_us,
            "avoid_recompile": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("JSON " + json.dumps(child()))
        return 0
    from mlaprefill._env import utc_now

    result: dict[str, Any] = {"benchmark": "cudnn_shapes", "argv": sys.argv,
                              "date_utc": utc_now(offset=True), "settings": {}}
    for setting in ("0", "1"):
        env = dict(os.environ, TORCH_CUDNN_SDPA_AVOID_RECOMPILE=setting)
        print(f"== TORCH_CUDNN_SDPA_AVOID_RECOMPILE={setting}", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, text=True,
                              capture_output=True, timeout=280)
        lines = proc.stdout.splitlines()
        print("\n".join(x for x in lines if not x.startswith("JSON ")))
        if proc.returncode:
            print(proc.stderr[-3000:])
            result["settings"][setting] = {"error": proc.stderr[-3000:]}
            continue
        result["settings"][setting] = json.loads(next(x for x in lines
                                                      if x.startswith("JSON "))[5:])
        print(f"host us per cached launch: "
              f"{result['settings'][setting]['host_us_per_cached_launch']:.1f}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
