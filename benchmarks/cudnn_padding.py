"""Can cuDNN attention run on bucketed (padded) shapes exactly, and at what cost?

    PYTHONPATH=src python benchmarks/cudnn_padding.py \
        --out benchmarks/results/cudnn_padding_h200.json

A bounded graph cache needs a bounded set of shapes: pad the query and key lengths of each
per-sequence call up to a bucket and mask the padded keys. This measures, on the dense cuDNN call
the ``cudnn`` backend makes (``[1, H, n, D]`` views, D_qk 192, D_v 128, bf16), for each shape:

* ``exact``: the real lengths (what the backend does today, one graph per shape);
* ``bias_bcast``: lengths padded to the bucket, padded keys masked by an additive bias that is a
  stride-0 view ``[1, 1, Q, K]`` of one ``[K]`` row (``0`` for real keys, ``-inf`` for padding);
* ``bias_full``: the same bias materialized ``[1, 1, Q, K]``;
* ``slot``: no bias; one extra head-dim column (q: 1, real keys: 0, padded keys: -30000), D_qk
  192 -> 200.

Each: kernel time (``triton.testing.do_bench`` median), the host time of a repeated call, and the
real rows' output and LSE against the exact call (max abs differences).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _common import write_json

QK, VD = 192, 128
SCALE = QK ** -0.5
# (heads, q_len, k_len, causal)
SHAPES = [
    (128, 4000, 61000, False), (16, 4000, 125000, False), (128, 2000, 16000, False),
    (128, 500, 8000, False), (16, 250, 4000, False), (128, 4000, 4000, True),
    (16, 1000, 1000, True),
]


def bucket(n: int, per_octave: int = 16, minimum: int = 128) -> int:
    """Round ``n`` up to the next of ``per_octave`` geometric steps per power of two."""
    if n <= minimum:
        return minimum
    step = max(1 << (n.bit_length() - 1 - per_octave.bit_length() + 1), 1)
    return -(-n // step) * step


def run() -> dict[str, Any]:
    import torch
    import triton.testing

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    rows = [measure(torch, triton.testing, op, g, *shape) for shape in SHAPES]
    return {"rows": rows, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "device": torch.cuda.get_device_name()}


def measure(torch: Any, testing: Any, op: Any, g: Any, h: int, sq: int, sk: int,
            causal: bool) -> dict[str, Any]:
    """One shape, every variant (see the module docstring)."""
    dev = "cuda"
    bq, bk = bucket(sq), bucket(sk)
    q = torch.randn(bq, h, QK, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(bk, h, QK, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(bk, h, VD, device=dev, dtype=torch.bfloat16, generator=g)
    k[sk:] = 0
    v[sk:] = 0

    def view4(t: Any, n: int) -> Any:
        return t[:n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]

    neg = torch.full((2 * bk,), float("-inf"), device=dev, dtype=torch.bfloat16)
    neg[:bk] = 0
    row = neg[bk - sk: 2 * bk - sk]  # sk zeros then -inf
    bias_b = row.view(1, 1, 1, bk).expand(1, 1, bq, bk)
    bias_f = bias_b.contiguous()
    qs = torch.zeros(bq, h, QK + 8, device=dev, dtype=torch.bfloat16)
    qs[..., :QK] = q
    qs[..., QK] = 1
    ks = torch.zeros(bk, h, QK + 8, device=dev, dtype=torch.bfloat16)
    ks[..., :QK] = k
    ks[sk:, :, QK] = -30000
    variants = {
        "exact": lambda: op(view4(q, sq), view4(k, sk), view4(v, sk), None, True, 0.0,
                            causal, False, scale=SCALE),
        "bias_bcast": lambda: op(view4(q, bq), view4(k, bk), view4(v, bk), bias_b, True,
                                 0.0, causal, False, scale=SCALE),
        "bias_full": lambda: op(view4(q, bq), view4(k, bk), view4(v, bk), bias_f, True,
                                0.0, causal, False, scale=SCALE),
        "slot": lambda: op(view4(qs, bq), view4(ks, bk), view4(v, bk), None, True, 0.0,
                           causal, False, scale=SCALE),
    }
    if causal:  # padding past the end of a causal block needs no mask: rows < n never see it
        variants["causal_pad"] = lambda: op(view4(q, bq), view4(k, bq), view4(v, bq), None,
                                            True, 0.0, True, False, scale=SCALE)
        del variants["bias_bcast"], variants["bias_full"], variants["slot"]
    ref_out = ref_lse = None
    entry: dict[str, Any] = {"heads": h, "q_len": sq, "k_len": sk, "causal": causal,
                             "q_bucket": bq, "k_bucket": bk, "variants": {}}
    for name, fn in variants.items():
        rec: dict[str, Any] = {}
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = fn()
            rec["first_call_host_ms"] = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            rec["repeat_call_host_us"] = (time.perf_counter() - t0) * 1e5
            torch.cuda.synchronize()
            rec["kernel_ms"] = testing.do_bench(fn, warmup=5, rep=40,
                                                       return_mode="median")
            out = res[0][0, :, :sq].float()  # [H, sq, Dv]
            lse = res[1].reshape(h, -1)[:, :sq].float()
            if name == "exact":
                ref_out, ref_lse = out, lse
            else:
                rec["out_max_abs_diff"] = (out - ref_out).abs().max().item()
                rec["lse_max_abs_diff"] = (lse - ref_lse).abs().max().item()
                rec["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
        except Exception as exc:  # a probe: record what cuDNN refused
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        entry["variants"][name] = rec
        print(f"H={h:>3} q={sq:>5}->{bq:<5} k={sk:>6}->{bk:<6} {name:<10} "
              + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in rec.items()), flush=True)
    torch.cuda.empty_cache()
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    args = ap.parse_args()
    import torch

    from mlaprefill._env import machine_info, utc_now

    result = {"benchmark": "cudnn_padding", "argv": sys.argv, "date_utc": utc_now(offset=True),
              "machine": machine_info(torch.device("cuda")), **run()}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
