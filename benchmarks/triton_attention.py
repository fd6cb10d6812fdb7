# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""Our Triton varlen attention against cuDNN and FlashAttention-2 on the same inputs, per config.

    PYTHONPATH=src python benchmarks/triton_attention.py \
        --out benchmarks/results/triton_attention_h200.json

For each shape (heads, requests, queries and keys per request, causal) and each of
:func:`mlaprefill.kernels.attention.attention_configs`: kernel time (``triton.testing.do_bench``
median), TFLOP/s with ``FLOPs = 2 * sum_r(q_r * k_r) * H * (192 + 128)`` (causal: ``q(q+1)/2``
keys per request), and the same inputs through cuDNN (one dense call per request, graphs built
before timing: its best case) and FA2 varlen (V padded to 192), measured in the same run.
Correctness against a float32 reference on two heads: output relative error and LSE max-abs.

``--split-keys``: our kernel gets the forward's layout for backends that read split keys, K as
``[Tk, H, 128]`` plus one shared rope row per key ``[Tk, 64]`` (head stride 0); the reference and
the baselines get the same keys joined. ``--heads 16`` keeps the shapes with that head count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from _common import add_cpu_smoke, empty_cache, kernel_ms, sync, write_json

QK, VD = 192, 128
SCALE = QK ** -0.5
# (heads, num_reqs, q per request, k per request, causal)
SHAPES = [
    (128, 1, 4096, 65536, False), (16, 1, 4096, 131072, False), (128, 1, 2048, 16384, False),
    (128, 4, 1024, 16384, False), (16, 16, 256, 8192, False), (128, 16, 256, 4096, False),
    (128, 1, 4096, 4096, True), (16, 1, 4096, 4096, True), (16, 16, 256, 256, True),
    # one workspace iteration of the forward at 16 heads: 16 x 256 over half of 8k, 1 x 4096 / 4k
    (16, 16, 256, 4096, False), (16, 1, 4096, 4096, False),
]
ROPE = 64


def _bench(fn: Any) -> float:
    return kernel_ms(fn, warmup=5, rep=50)["median_ms"]


def run(quick: bool, names: list[str] | None = None,
        baselines: tuple[str, ...] = ("cudnn", "fa2"), split_keys: bool = False,
        heads: int | None = None, dev: str = "cuda",
        shapes: list[tuple[int, int, int, int, bool]] | None = None) -> dict[str, Any]:
    from triton.runtime.errors import OutOfResources

    from mlaprefill.backends import VarlenSeqs, get_backend
    from mlaprefill.kernels.attention import attention_configs, varlen_attention

    # CPU (the Triton interpreter): float16, since bfloat16 there returned garbage from our
    # kernel (out_rel_err ~1e9 on 16 x 48 keys, 2026-12-01) while float16 matched
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    rows = []
    configs = attention_configs()
    if names:
        configs = {n: configs[n] for n in names}
    elif quick:
        configs = dict(list(configs.items())[:3])
    for h, nr, sq, sk, causal in shapes or SHAPES:
        if heads is not None and h != heads:
            continue
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(nr * sq, h, QK, device=dev, dtype=dtype, generator=g)
        k = torch.randn(nr * sk, h, QK, device=dev, dtype=dtype, generator=g)
        v = torch.randn(nr * sk, h, VD, device=dev, dtype=dtype, generator=g)
        split: dict[str, Any] = {}
        if split_keys:  # one rope row per key, shared by the heads; the kernel reads it apart
            k[..., QK - ROPE:] = k[:, :1, QK - ROPE:]
            split = {"k_rope": k[:, 0, QK - ROPE:].contiguous()}
            k_kernel = k[..., :QK - ROPE].contiguous()
        else:
            k_kernel = k
        cu_q = torch.arange(nr + 1, device=dev, dtype=torch.int32) * sq
        cu_k = torch.arange(nr + 1, device=dev, dtype=torch.int32) * sk
        keys = sq * (sq + 1) / 2 if causal else sq * sk
        flops = 2 * nr * keys * h * (QK + VD)
        entry: dict[str, Any] = {"heads": h, "num_reqs": nr, "q_len": sq, "k_len": sk,
                                 "causal": causal, "split_keys": split_keys, "triton": {},
                                 "baselines": {}}
        # float32 reference on request 0, heads 0-1
        qf, kf, vf = q[:sq, :2].float(), k[:sk, :2].float(), v[:sk, :2].float()
        s = torch.einsum("qhd,khd->hqk", qf, kf) * SCALE
        if causal:
            s.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=dev).triu(1), -torch.inf)
        lse_ref = torch.logsumexp(s, -1).t()  # [sq, 2]
        out_ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vf)
        del s

        def err(out: torch.Tensor, lse: torch.Tensor) -> dict[str, float]:
            o = out[:sq, :2].float()
            return {"out_rel_err": ((o - out_ref).norm() / out_ref.norm()).item(),
                    "lse_max_abs_err": (lse[:sq, :2].float() - lse_ref).abs().max().item()}

        for name, cfg in configs.items():
            def fn(cfg: Any = cfg) -> Any:
                return varlen_attention(q, k_kernel, v, cu_q, cu_k, max_seqlen_q=sq,
                                        causal=causal, softmax_scale=SCALE, config=cfg, **split)
            rec: dict[str, Any] = {}
            try:
                t0 = time.perf_counter()
                out, lse = fn()
                sync()
                rec["first_call_s"] = time.perf_counter() - t0
                rec.update(err(out, lse))
                rec["ms"] = _bench(fn)
                rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
            except OutOfResources as exc:  # a config that does not fit (shared memory, registers)
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            entry["triton"][name] = rec
            print(f"H={h:>3} {nr:>2}x q={sq:<5} k={sk:<6} causal={causal!s:<5} triton {name:<16}"
                  + (f" {rec['ms']:8.3f} ms {rec['tflops']:5.0f} TFLOP/s "
                     f"rel {rec['out_rel_err']:.1e} lse {rec['lse_max_abs_err']:.1e}"
                     if "ms" in rec else f" {rec.get('error')}"), flush=True)
        host_q = cu_q.cpu().numpy()
        host_k = cu_k.cpu().numpy()
        for bname in baselines:
            rec = {}
            be = get_backend(bname, device=dev, dtype=dtype, qk_head_dim=QK,
                             v_head_dim=VD)
            vv = torch.nn.functional.pad(v, (0, QK - VD)) if be.needs_v_padded else v
            kc = k
            if causal:
                seqs = VarlenSeqs(cu_q, cu_q, sq, sq, cu_seqlens_q_host=host_q,
                                  cu_seqlens_k_host=host_q)
            else:
                seqs = VarlenSeqs(cu_q, cu_k, sq, sk, cu_seqlens_q_host=host_q,
                                  cu_seqlens_k_host=host_k)

            def bfn(be: Any = be, vv: Any = vv, kc: Any = kc, seqs: Any = seqs) -> Any:
                return be.attend(q, kc, vv, seqs, causal=causal, softmax_scale=SCALE)
            out, lse = bfn()
            sync()
            rec.update(err(out[..., :VD], lse))
            rec["ms"] = _bench(bfn)
            rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
            entry["baselines"][bname] = rec
            print(f"H={h:>3} {nr:>2}x q={sq:<5} k={sk:<6} causal={causal!s:<5} {bname:<23}"
                  + (f" {rec['ms']:8.3f} ms {rec['tflops']:5.0f} TFLOP/s"
                     if "ms" in rec else f" {rec.get('error')}"), flush=True)
        ok = {n: r["ms"] for n, r in entry["triton"].items() if "ms" in r}
        if ok:
            best = min(ok, key=ok.get)
            entry["best_config"] = best
            for bname, rec in entry["baselines"].items():
                if "ms" in rec:
                    entry[f"best_triton_over_{bname}"] = ok[best] / rec["ms"]
        rows.append(entry)
        q = k = v = k_kernel = None
        split.clear()
        empty_cache()
    return {"rows": rows, "flops_formula": "2 * sum_r(q_r * keys_r) * H * (192 + 128)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--quick", action="store_true", help="first three configs only")
    ap.add_argument("--configs", default="", help="comma list of preset names (default: all)")
    ap.add_argument("--baselines", default="cudnn,fa2", help="comma list of backends")
    ap.add_argument("--allow-errors", action="store_true",
                    help="exit 0 even when a config did not fit (an error row, OutOfResources)")
    ap.add_argument("--split-keys", action="store_true",
                    help="our kernel reads K as [Tk, H, 128] + a shared rope row [Tk, 64]")
    ap.add_argument("--heads", type=int, choices=(16, 128), help="only shapes with these heads")
    add_cpu_smoke(ap)
    args = ap.parse_args()
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":
        # our kernel runs on CPU tensors only under the Triton interpreter, which must be on
        # before Triton is imported: run this script again with it
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    from mlaprefill._env import machine_info, utc_now

    configs = [c for c in args.configs.split(",") if c]
    baselines = tuple(b for b in args.baselines.split(",") if b)
    dev, shapes = "cuda", None
    if args.cpu_smoke:  # the kernel's CPU path and the math backend on one tiny shape
        dev, shapes, baselines = "cpu", [(2, 2, 16, 48, False), (2, 1, 16, 16, True)], ("math",)
        configs = configs or ["m128_n64_w8_s4"]
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    result = {"benchmark": "triton_attention", "command": " ".join(sys.argv), "argv": sys.argv,
              "date_utc": utc_now(offset=True), "machine": machine_info(torch.device(dev)),
              **run(args.quick, configs, baselines, args.split_keys, args.heads, dev, shapes)}
    write_json(args.out, result)
    failed = [f"{r['heads']}:{r['num_reqs']}x{r['q_len']}:{r['k_len']} {n}"
              for r in result["rows"] for n, rec in r["triton"].items() if "error" in rec]
    if failed:
        print(f"configs that did not fit (error rows): {failed}", file=sys.stderr)
    return 1 if failed and not args.allow_errors else 0


if __name__ == "__main__":
    sys.exit(main())
