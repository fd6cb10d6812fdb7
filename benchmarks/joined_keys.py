"""What joined keys cost, and what cuDNN on them saves against our kernel on split keys (one GPU).

    PYTHONPATH=src python benchmarks/joined_keys.py --out benchmarks/results/joined_keys_h200.json

cuDNN reads each head's key whole (``[Tk, H, 192]``, nope and rope side by side), our kernel
reads split keys (``[Tk, H, 128]`` from the GEMM plus the one shared rope row per token). Per
shape (heads, rows ``n`` of latent rows from a workspace with row stride 576, bfloat16):

* ``gemm``: the up-projection of ``n`` rows, as the split layout runs it (one ``torch.mm`` with
  the Hugging Face weight, ``[n, H * 256]``: also the ideal's GEMM), as the joined layout ran it
  before (two ``torch.mm`` with 64 zero weight rows per head in the key's, then the rope copy),
  and as one strided-batched GEMM over heads (``torch.bmm`` of the shared ``kv_c`` against each
  head's ``[W_UV | W_UK]``, written into ``[n, H, 320]`` rows ``[v | nope | rope]``, then the
  rope copy): no zero columns. Each checked against the float32 product.
* ``attention``: one batched cuDNN call over ``B`` sequences of ``Lq x Lk`` against our Triton
  kernel (the default config) on split keys, the same inputs.

Median of ``triton.testing.do_bench`` (L2 flushed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from _common import kernel_ms, write_json

RANK, NOPE, ROPE, VD = 512, 128, 64, 128
GEMM_SHAPES = [(16, 4096), (16, 65536), (128, 4096), (128, 65536)]
# (heads, batch, q per sequence, k per sequence, causal)
ATTN_SHAPES = [(16, 1, 4096, 4096, True), (16, 1, 2048, 2048, True), (16, 4, 1024, 1024, True),
               (16, 1, 4096, 4096, False), (16, 16, 256, 4096, False),
               (16, 8, 256, 8192, False), (16, 4, 1024, 16384, False),
               (16, 1, 1024, 16384, False), (128, 4, 1024, 16384, False),
               (128, 1, 4096, 4096, True)]


def gemm_row(heads: int, n: int) -> dict[str, Any]:
    from mlaprefill.kernels.rope import broadcast_rope_

    dev = "cuda"
    latent = torch.randn(n, RANK + ROPE, device=dev, dtype=torch.bfloat16)
    kv_c, k_pe = latent[:, :RANK], latent[:, RANK:]
    w = torch.randn(heads, NOPE + VD, RANK, device=dev, dtype=torch.bfloat16) / 20  # HF layout
    w_hf = w.reshape(heads * (NOPE + VD), RANK)
    # before: W_K with zero rows in each head's rope slot, W_V apart
    w_k = torch.zeros(heads, NOPE + ROPE, RANK, device=dev, dtype=torch.bfloat16)
    w_k[:, :NOPE] = w[:, :NOPE]
    w_k = w_k.reshape(-1, RANK)
    w_v = w[:, NOPE:].reshape(-1, RANK).contiguous()
    # batched: per head [W_UV | W_UK]^T, [H, rank, 256]
    w_b = torch.cat([w[:, NOPE:], w[:, :NOPE]], dim=1).transpose(1, 2).contiguous()
    out_hf = torch.empty(n, heads * (NOPE + VD), device=dev, dtype=torch.bfloat16)
    k_old = torch.empty(n, heads, NOPE + ROPE, device=dev, dtype=torch.bfloat16)
    v_old = torch.empty(n, heads, VD, device=dev, dtype=torch.bfloat16)
    buf = torch.empty(n, heads, VD + NOPE + ROPE, device=dev, dtype=torch.bfloat16)
    c_view = buf[..., :VD + NOPE].transpose(0, 1)  # [H, n, 256], strides (320, H*320, 1)
    a_exp = kv_c.unsqueeze(0).expand(heads, n, RANK)

    def split() -> None:
        torch.mm(kv_c, w_hf.t(), out=out_hf)

    def joined_before() -> None:
        torch.mm(kv_c, w_k.t(), out=k_old.view(n, -1))
        broadcast_rope_(k_old, k_pe, NOPE)
        torch.mm(kv_c, w_v.t(), out=v_old.view(n, -1))

    def joined_bmm() -> None:
        torch.bmm(a_exp, w_b, out=c_view)
        broadcast_rope_(buf, k_pe, VD + NOPE)

    def bmm_only() -> None:
        torch.bmm(a_exp, w_b, out=c_view)

    ptr = buf.data_ptr()
    joined_bmm()
    ref = (kv_c.float() @ w.float().reshape(-1, RANK).t()).view(n, heads, NOPE + VD)
    err = max((buf[..., VD:VD + NOPE].float() - ref[..., :NOPE]).abs().max().item(),
              (buf[..., :VD].float() - ref[..., NOPE:]).abs().max().item())
    rope_ok = bool(torch.equal(buf[..., VD + NOPE:], k_pe[:, None].expand(n, heads, ROPE)))
    flop = 2 * n * heads * (NOPE + VD) * RANK
    row: dict[str, Any] = {"heads": heads, "n": n, "bmm_wrote_in_place": buf.data_ptr() == ptr,
                           "bmm_max_abs_err_vs_fp32": err, "rope_exact": rope_ok}
    for name, fn in (("split_mm_ms", split), ("joined_before_ms", joined_before),
                     ("joined_bmm_ms", joined_bmm), ("bmm_only_ms", bmm_only)):
        row[name] = kernel_ms(fn)["median_ms"]
    row["split_tflops"] = flop / row["split_mm_ms"] / 1e9
    row["bmm_tflops"] = flop / row["bmm_only_ms"] / 1e9
    row["joined_before_over_split"] = row["joined_before_ms"] / row["split_mm_ms"]
    row["joined_bmm_over_split"] = row["joined_bmm_ms"] / row["split_mm_ms"]
    return row


def attn_row(heads: int, batch: int, lq: int, lk: int, causal: bool) -> dict[str, Any]:
    from mlaprefill.backends.cudnn import dense_cudnn_attention
    from mlaprefill.kernels.attention import varlen_attention

    dev = "cuda"
    scale = (NOPE + ROPE) ** -0.5
    q = torch.randn(batch * lq, heads, NOPE + ROPE, device=dev, dtype=torch.bfloat16)
    buf = torch.randn(batch * lk, heads, VD + NOPE + ROPE, device=dev, dtype=torch.bfloat16)
    k_pe = torch.randn(batch * lk, ROPE, device=dev, dtype=torch.bfloat16)
    buf[..., VD + NOPE:] = k_pe[:, None]
    k, v = buf[..., VD:], buf[..., :VD]
    cu_q = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * lq
    cu_k = torch.arange(0, batch + 1, device=dev, dtype=torch.int32) * lk

    def cudnn() -> Any:
        return dense_cudnn_attention(q, k, v, 0, 0, batch, lq, lk, causal=causal,
                                     softmax_scale=scale)

    def ours() -> Any:
        return varlen_attention(q, buf[..., VD:VD + NOPE], v, cu_q, cu_k, max_seqlen_q=lq,
                                causal=causal, softmax_scale=scale, k_rope=k_pe)

    o1, l1 = cudnn()
    o2, l2 = ours()
    t_c, t_o = kernel_ms(cudnn)["median_ms"], kernel_ms(ours)["median_ms"]
    pairs = batch * lq * lk * (0.5 if causal else 1.0)
    flop = 2 * pairs * heads * (NOPE + ROPE + VD)
    return {"heads": heads, "batch": batch, "q": lq, "k": lk, "causal": causal,
            "cudnn_ms": t_c, "triton_split_ms": t_o, "cudnn_tflops": flop / t_c / 1e9,
            "triton_tflops": flop / t_o / 1e9, "triton_over_cudnn": t_o / t_c,
            "out_max_abs_diff": (o1.float() - o2.float()).abs().max().item(),
            "lse_max_abs_diff": (l1 - l2).abs().max().item()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    args = ap.parse_args()
    from mlaprefill._env import machine_info, utc_now

    gemm, attn = [], []
    for heads, n in GEMM_SHAPES:
        r = gemm_row(heads, n)
        gemm.append(r)
        print(f"gemm H={heads:>3} n={n:>6}: split {r['split_mm_ms']:.3f} ms "
              f"({r['split_tflops']:.0f} TF/s), joined before {r['joined_before_ms']:.3f} "
              f"(x{r['joined_before_over_split']:.2f}), joined bmm {r['joined_bmm_ms']:.3f} "
              f"(x{r['joined_bmm_over_split']:.2f}; bmm {r['bmm_tflops']:.0f} TF/s, in place "
              f"{r['bmm_wrote_in_place']}, err {r['bmm_max_abs_err_vs_fp32']:.3g})", flush=True)
        torch.cuda.empty_cache()
    for shape in ATTN_SHAPES:
        r = attn_row(*shape)
        attn.append(r)
        print(f"attn {shape}: cuDNN {r['cudnn_ms']:.3f} ms ({r['cudnn_tflops']:.0f}), ours split "
              f"{r['triton_split_ms']:.3f} ({r['triton_tflops']:.0f}) x{r['triton_over_cudnn']:.2f}"
              f"; diff out {r['out_max_abs_diff']:.3g} lse {r['lse_max_abs_diff']:.3g}",
              flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, {"benchmark": "joined_keys", "argv": sys.argv,
                          "date_utc": utc_now(offset=True),
                          "machine": machine_info(torch.device("cuda")), "gemm": gemm,
                          "attention": attn})
    return 0


if __name__ == "__main__":
    sys.exit(main())
