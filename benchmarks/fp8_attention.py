# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""Context attention kernels side by side: bf16 (ours), FP8 (ours, opt-in) and cuDNN (issue #31).

Usage::

    cd benchmarks && PYTHONPATH=../src python fp8_attention.py --out results/fp8_attention_h200.json

    PYTHONPATH=src python benchmarks/fp8_attention.py --cpu-smoke --out /tmp/fp8_attention.json

Sections:

* ``kernel`` — one non-causal context call (``num_seqs`` sequences of ``q_len`` queries over
  ``k_len`` keys each, MLA's qk 192 = 128 + 64 with the rope key shared by every head, v 128),
  timed per kernel in the same run: ``bf16`` :func:`mlaprefill.kernels.varlen_attention` (on an
  sm_90 GPU its warp-specialized Gluon kernel), ``fp8`` :func:`fp8_context_attention` on inputs
  quantized beforehand as the library runs it (on an sm_90 GPU the Gluon FP8 kernel), each
  tile config of the Triton FP8 kernel (``--configs``; the best is ``fp8_triton``) and of the
  Gluon one (``fp8_gluon:nN_sS``), ``fp8+quant`` the default with the quantizing passes of q, k
  and v in the timed region, and ``cudnn`` PyTorch's
  cuDNN SDPA on the equal-length batch with whole keys ``[B, H, L, 192]`` (the rope key copied
  into every head beforehand, not timed). TFLOP/s = ``4 * num_seqs * q_len * k_len * H * (192 +
  128) / 2 / time`` (two matrix products, 2 FLOP per multiply-add; ``flop_formula`` in the JSON).
  Eager timings (``kernels``) hold the host's launch cost of each API call; ``bf16``, ``fp8`` and
  ``cudnn`` are also replayed from a CUDA graph (``graph``, device time only), and the
  ``*_graph_throughput`` ratios compare those.
* ``chunk`` — one context step from latent rows, as the forward runs it (``num_seqs`` x
  ``q_len`` queries over ``k_len`` latent rows ``[kv_c 512 | k_pe 64]`` each, the weight
  ``[H * 256, 512]``), timed whole per path in the same run: ``bf16`` (``torch.mm`` up-projection
  to bf16 K/V, then the bf16 kernel), ``fp8_quantize`` (the same GEMM, then
  :func:`quantize_context` and :func:`quantize_rows`, then the FP8 kernel: no fused epilogue),
  ``fp8_fused`` (:func:`upproject_fp8`: e4m3 K/V from the GEMM's epilogue, then
  :func:`quantize_rows` and the FP8 kernel), and the up-projections alone (``upproj_bf16``,
  ``upproj_quantize``, ``upproj_fused`` for each config of ``--upproj-configs``).
* ``ideal`` — the bf16 kernel against cuDNN on the two attention parts of each shape of
  ``attention.py``'s ``vs_ideal`` set (``heads, requests, queries, context``): the context part
  (each request's queries over its whole context, non-causal) and the causal part (its queries
  over themselves); FLOPs = ``2 * pairs * H * (192 + 128)`` with ``q * k`` pairs non-causal and
  ``q (q + 1) / 2`` causal per request. Each timed twice: eager (``kernels``: L2 flushed, the
  host's launch cost counts where it exceeds the device's) and replayed from a CUDA graph
  (``graph``: device time only, as the forward runs under graphs), with the host's enqueue time
  of one call (``host_enqueue_ms``, median of 20).
* ``accuracy`` — out and LSE of the bf16 and the FP8 kernel against float64 attention of the same
  bf16 inputs: RMSE and max |error|, on N(0, 1) inputs and on inputs with outlier channels (4
  channels of q, k and v x 30 with random signs; 4 key channels offset by +30); and, on K/V
  up-projected from random latent rows, the FP8 kernel with the amax scales
  (``quantize_context``) beside the fused up-projection's Cauchy-Schwarz bounds.

Times: ``triton.testing.do_bench`` medians (CUDA events, L2 flushed); CPU smoke: tiny shapes in
Triton's interpreter (float16; the bf16 kernel's stand-in), host wall clock, meaningless.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--cpu-smoke" in sys.argv:  # before triton is imported: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from _common import add_cpu_smoke, empty_cache, host_enqueue_ms, kernel_ms, write_json
from attention import IDEAL_SHAPES
from mlaprefill._env import machine_info, utc_now
from mlaprefill.backends import BACKENDS, VarlenSeqs
from mlaprefill.kernels import hopper_fp8_attention as hopper_fp8
from mlaprefill.kernels.attention import varlen_attention
from mlaprefill.kernels.fp8_attention import (
    FP8AttentionConfig,
    fp8_context_attention,
    quantize_context,
    quantize_rows,
)
from mlaprefill.kernels.fp8_upproj import FP8UpProjConfig, upproject_fp8, weight_row_norms

NOPE, ROPE, VDIM = 128, 64, 128
# (heads, num_seqs, q_len, k_len): long contexts at 16 and 128 heads, then shorter chunks
SHAPES = [
    (16, 1, 4096, 16384), (16, 1, 4096, 65536), (16, 4, 1024, 32768), (16, 16, 256, 8192),
    (128, 1, 4096, 16384), (128, 1, 4096, 65536), (128, 4, 1024, 32768), (128, 16, 256, 8192),
]
SMOKE_SHAPES = [(2, 2, 20, 40)]
CONFIGS = "m128_n128_w8_s3,m128_n64_w8_s3,m128_n128_w8_s2,m64_n128_w4_s3,m128_n128_w4_s2"
GLUON_VARIANTS = [(128, 2), (128, 3), (64, 3), (256, 2)]  # (block_n, stages) of the Gluon kernel
# kernel-section entries also timed as CUDA-graph replays (``graph``): a kernel of about 1 ms
# timed eagerly holds the host's launch cost of its API call (about 0.1 ms through
# fp8_context_attention's checks), which would blur an FP8 / bf16 throughput ratio
GRAPHED = ("bf16", "fp8", "cudnn")
UPPROJ_CONFIGS = "m128_k64_w8_s3,m128_k64_w4_s3,m128_k64_w8_s4,m64_k64_w4_s3,m128_k128_w8_s2"
RANK = 512
# (heads, num_seqs, q_len, k_len) of the chunk section: the forward's context steps
CHUNK_SHAPES = [(16, 1, 4096, 16384), (16, 1, 4096, 65536), (16, 4, 1024, 32768),
                (128, 1, 4096, 16384), (128, 4, 1024, 16384), (128, 16, 256, 8192)]
SMOKE_CHUNK_SHAPES = [(2, 2, 20, 40)]
FLOP_FORMULA = "4 * num_seqs * q_len * k_len * heads * (qk_head_dim + v_head_dim) / 2"


def parse_config(name: str) -> FP8AttentionConfig:
    parts = dict((p[0], int(p[1:])) for p in name.split("_"))
    return FP8AttentionConfig(parts["m"], parts["n"], parts["w"], parts["s"])


def parse_upproj_config(name: str) -> FP8UpProjConfig:
    parts = dict((p[0], int(p[1:])) for p in name.split("_"))
    return FP8UpProjConfig(parts["m"], parts["k"], parts["w"], parts["s"])


def make_latent_inputs(heads: int, seqs: int, q_len: int, k_len: int, dtype: torch.dtype,
                       device: str, seed: int = 0) -> dict:
    """Latent rows ``[kv_c | k_pe]`` and a weight ``[H * (nope + v), rank]`` (N(0, 1 / rank)
    entries: K and V of unit scale), and the queries."""
    g = torch.Generator(device=device).manual_seed(seed)
    tq, tk = seqs * q_len, seqs * k_len
    latent = torch.randn(tk, RANK + ROPE, generator=g, device=device).to(dtype)
    w = (torch.randn(heads * (NOPE + VDIM), RANK, generator=g, device=device)
         / RANK ** 0.5).to(dtype)
    q = torch.randn(tq, heads, NOPE + ROPE, generator=g, device=device).to(dtype)
    cu_q = torch.arange(0, tq + 1, q_len, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, tk + 1, k_len, dtype=torch.int32, device=device)
    return {"q": q, "latent": latent, "w": w, "w_norms": weight_row_norms(w, NOPE, VDIM),
            "cu_q": cu_q, "cu_k": cu_k, "q_len": q_len, "k_len": k_len,
            "scale": (NOPE + ROPE) ** -0.5, "kv": torch.empty(tk, heads, NOPE + VDIM,
                                                             dtype=dtype, device=device)}


def upproj_bf16(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv, lat = x["kv"], x["latent"]
    torch.mm(lat[:, :RANK], x["w"].t(), out=kv.view(kv.shape[0], -1))
    return kv[..., :NOPE], lat[:, RANK:], kv[..., NOPE:]


def upproj_fused(x: dict, cfg: FP8UpProjConfig | None = None):
    lat = x["latent"]
    return upproject_fp8(lat[:, :RANK], lat[:, RANK:], x["w"], x["w_norms"], nope=NOPE, v=VDIM,
                         config=cfg)


def chunk_step(x: dict, path: str, cfg: FP8UpProjConfig | None = None):
    """One context step from latent rows (the ``chunk`` section's paths)."""
    if path == "bf16":
        k, kr, v = upproj_bf16(x)
        return varlen_attention(x["q"], k, v, x["cu_q"], x["cu_k"], max_seqlen_q=x["q_len"],
                                causal=False, softmax_scale=x["scale"], k_rope=kr)
    ctx = quantize_context(*upproj_bf16(x)) if path == "fp8_quantize" else upproj_fused(x, cfg)
    q8, qs = quantize_rows(x["q"])
    return fp8_context_attention(q8, qs, ctx, x["cu_q"], x["cu_k"], max_seqlen_q=x["q_len"],
                                 softmax_scale=x["scale"], out_dtype=x["q"].dtype)


def bench_chunks(shapes, upproj_configs: list[str], dtype: torch.dtype, device: str) -> list[dict]:
    rows = []
    for heads, seqs, q_len, k_len in shapes:
        empty_cache()
        x = make_latent_inputs(heads, seqs, q_len, k_len, dtype, device)
        row: dict = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                     "times": {}}

        def record(name: str, fn) -> None:
            try:
                t = kernel_ms(fn)
            except Exception as exc:  # a config that does not fit (shared memory, registers)
                row["times"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  chunk {name}: {type(exc).__name__}", flush=True)
                return
            row["times"][name] = t
            print(f"  chunk H={heads} {seqs}x{q_len} over {k_len}: {name:>24} "
                  f"{t['median_ms']:8.3f} ms", flush=True)

        record("upproj_bf16", lambda: upproj_bf16(x))
        record("upproj_quantize", lambda: quantize_context(*upproj_bf16(x)))
        fused = {}
        for name in upproj_configs:
            cfg = parse_upproj_config(name)
            record(f"upproj_fused:{name}", lambda: upproj_fused(x, cfg))
            if "median_ms" in row["times"][f"upproj_fused:{name}"]:
                fused[name] = row["times"][f"upproj_fused:{name}"]["median_ms"]
        best = min(fused, key=fused.get) if fused else None
        row["upproj_best_config"] = best
        cfg = parse_upproj_config(best) if best else None
        for path in ("bf16", "fp8_quantize", "fp8_fused"):
            if path == "fp8_fused" and cfg is None:
                continue
            record(path, lambda: chunk_step(x, path, cfg))
        ts = row["times"]
        for a, b in (("fp8_fused", "bf16"), ("fp8_quantize", "bf16"), ("fp8_fused",
                                                                      "fp8_quantize")):
            if "median_ms" in ts.get(a, {}) and "median_ms" in ts.get(b, {}):
                row[f"{a}_over_{b}_time"] = ts[a]["median_ms"] / ts[b]["median_ms"]
        if best:
            row["upproj_fused_over_bf16_time"] = fused[best] / ts["upproj_bf16"]["median_ms"]
        rows.append(row)
        x = None  # free it before the next shape
    return rows


def bench_latent_accuracy(shapes, dtype: torch.dtype, device: str) -> list[dict]:
    """FP8 on K/V up-projected from latent rows: amax scales against the fused bounds."""
    rows = []
    for heads, seqs, q_len, k_len in shapes:
        x = make_latent_inputs(heads, seqs, q_len, k_len, dtype, device, seed=2)
        k, kr, v = upproj_bf16(x)
        y = {"q": x["q"], "k": k, "v": v, "k_rope": kr, "cu_q": x["cu_q"], "cu_k": x["cu_k"],
             "q_len": q_len, "k_len": k_len, "scale": x["scale"]}
        ref = reference(y)
        fused = upproj_fused(x)
        kk = fused.dequantized()
        row = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
               "inputs": "K/V up-projected from N(0, 1) latent rows",
               "bf16": _errors(run_bf16(y), ref), "fp8": _errors(run_fp8(y), ref),
               "fp8_fused": _errors(chunk_step(x, "fp8_fused"), ref),
               "bound_over_amax": [float(fused.bound[0]) / max(float(k.abs().max()),
                                                               float(kr.abs().max())),
                                   float(fused.bound[1]) / float(v.abs().max())],
               "fused_k_rel_rmse": float((kk[0] - k.double()).pow(2).mean().sqrt()
                                         / k.double().pow(2).mean().sqrt())}
        print(f"  latent accuracy H={heads}: out rmse bf16 {row['bf16']['out_rmse']:.2e} fp8 "
              f"{row['fp8']['out_rmse']:.2e} fused {row['fp8_fused']['out_rmse']:.2e}; bound/amax "
              f"{row['bound_over_amax'][0]:.1f} {row['bound_over_amax'][1]:.1f}", flush=True)
        rows.append(row)
    return rows


def make_inputs(heads: int, seqs: int, q_len: int, k_len: int, dtype: torch.dtype, device: str,
                seed: int = 0, outliers: str = "") -> dict:
    nope, rope, vdim = NOPE, ROPE, VDIM
    g = torch.Generator(device=device).manual_seed(seed)
    tq, tk = seqs * q_len, seqs * k_len
    q = torch.randn(tq, heads, nope + rope, generator=g, device=device)
    kv = torch.randn(tk, heads, nope + vdim, generator=g, device=device)  # split-key layout
    kr = torch.randn(tk, rope, generator=g, device=device)
    if outliers == "scaled":  # a few channels 30x larger in q, k and v, random signs
        q[..., :4] *= 30
        kv[..., :4] *= 30
        kv[..., nope:nope + 4] *= 30
        kr[:, :2] *= 30
    elif outliers == "bias":  # keys with a large per-channel offset (the common LLM pattern)
        kv[..., :4] += 30
        kr[:, :2] += 30
    q, kv, kr = q.to(dtype), kv.to(dtype), kr.to(dtype)
    cu_q = torch.arange(0, tq + 1, q_len, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, tk + 1, k_len, dtype=torch.int32, device=device)
    return {"q": q, "k": kv[..., :nope], "v": kv[..., nope:], "k_rope": kr, "cu_q": cu_q,
            "cu_k": cu_k, "q_len": q_len, "k_len": k_len, "scale": (nope + rope) ** -0.5}


def run_bf16(x: dict, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen_attention(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], max_seqlen_q=x["q_len"],
                            causal=causal, softmax_scale=x["scale"], k_rope=x["k_rope"])


def run_fp8(x: dict, cfg: FP8AttentionConfig | None = None, quantized=None):
    q8, qs, ctx = quantized if quantized is not None else (*quantize_rows(x["q"]),
                                                           quantize_context(x["k"], x["k_rope"],
                                                                            x["v"]))
    return fp8_context_attention(q8, qs, ctx, x["cu_q"], x["cu_k"], max_seqlen_q=x["q_len"],
                                 softmax_scale=x["scale"], out_dtype=x["q"].dtype, config=cfg)


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of the inputs: the ``math`` backend on the joined key."""
    heads = x["q"].shape[1]
    k = torch.cat([x["k"].double(), x["k_rope"].double()[:, None].expand(-1, heads, -1)], -1)
    seqs = VarlenSeqs(x["cu_q"], x["cu_k"], x["q_len"], x["k_len"])
    return BACKENDS["math"]().attend(x["q"].double(), k, x["v"].double(), seqs, causal=False,
                                     softmax_scale=x["scale"])


def _errors(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]
            ) -> dict:
    res = {}
    for name, a, b in (("out", got[0], ref[0]), ("lse", got[1], ref[1])):
        d = a.double() - b
        res[f"{name}_rmse"] = float(d.pow(2).mean().sqrt())
        res[f"{name}_max_abs"] = float(d.abs().max())
        res[f"{name}_ref_rms"] = float(b.pow(2).mean().sqrt())
    return res


def cudnn_call(x: dict, causal: bool):
    """PyTorch's cuDNN SDPA on the equal-length batch of ``x`` with whole keys ``[B, H, L, 192]``
    (the rope key copied into every head here, outside the timed call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, b, q_len, k_len = x["q"].shape[1], x["cu_q"].numel() - 1, x["q_len"], x["k_len"]
    qd = x["q"].view(b, q_len, heads, -1).transpose(1, 2)
    kk = torch.cat([x["k"], x["k_rope"][:, None].expand(-1, heads, -1)], -1)
    kd = kk.view(b, k_len, heads, -1).transpose(1, 2)
    vd = x["v"].contiguous().view(b, k_len, heads, -1).transpose(1, 2)

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, scale=x["scale"], is_causal=causal)
    return call


def bench_ideal(shapes, dtype: torch.dtype, device: str) -> list[dict]:
    """The bf16 kernel and cuDNN on each vs-ideal shape's context part and causal part."""
    rows = []
    cudnn = device == "cuda" and hasattr(torch.nn.attention, "SDPBackend")
    for heads, seqs, q_len, ctx in shapes:
        for part in ("context", "causal"):
            causal = part == "causal"
            k_len = q_len if causal else ctx
            empty_cache()
            x = make_inputs(heads, seqs, q_len, k_len, dtype, device)
            pairs = seqs * (q_len * (q_len + 1) // 2 if causal else q_len * k_len)
            flop = 2 * pairs * heads * (NOPE + ROPE + VDIM)
            row: dict = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                         "part": part, "causal": causal, "flop": flop, "kernels": {}}
            for name, fn in (("bf16", lambda: run_bf16(x, causal)),
                             ("cudnn", cudnn_call(x, causal) if cudnn else None)):
                if fn is None:
                    continue
                for key, graph in (("kernels", False), ("graph", True)):
                    t = kernel_ms(fn, graph=graph)
                    t["tflops"] = flop / (t["median_ms"] * 1e-3) / 1e12
                    row.setdefault(key, {})[name] = t
                host = host_enqueue_ms(fn)  # sorted
                row.setdefault("host_enqueue_ms", {})[name] = host[len(host) // 2]
            for key, ratio in (("kernels", "bf16_over_cudnn_time"),
                               ("graph", "bf16_over_cudnn_graph_time")):
                ks = row[key]
                if "cudnn" in ks:
                    row[ratio] = ks["bf16"]["median_ms"] / ks["cudnn"]["median_ms"]
            ks, gs = row["kernels"], row["graph"]
            print(f"  ideal H={heads} {seqs}x{q_len} over {k_len} {part:>7}: " + ", ".join(
                f"{n} {t['median_ms']:.3f} ms {t['tflops']:.0f} TFLOP/s (graph "
                f"{gs[n]['median_ms']:.3f} ms, host {row['host_enqueue_ms'][n]:.3f} ms)"
                for n, t in ks.items())
                + (f", bf16/cudnn {row['bf16_over_cudnn_time']:.3f} (graph "
                   f"{row['bf16_over_cudnn_graph_time']:.3f})" if "cudnn" in ks else ""),
                flush=True)
            rows.append(row)
            x = None  # free it before the next shape
    return rows


def bench_kernels(shapes, configs: list[str], dtype: torch.dtype, device: str) -> list[dict]:
    rows = []
    cudnn = device == "cuda" and hasattr(torch.nn.attention, "SDPBackend")
    for heads, seqs, q_len, k_len in shapes:
        empty_cache()
        x = make_inputs(heads, seqs, q_len, k_len, dtype, device)
        flop = 4 * seqs * q_len * k_len * heads * (NOPE + ROPE + VDIM) / 2
        row: dict = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                     "flop": flop, "kernels": {}}

        def record(name: str, fn) -> None:
            t = kernel_ms(fn)
            t["tflops"] = flop / (t["median_ms"] * 1e-3) / 1e12
            row["kernels"][name] = t
            extra = ""
            if name in GRAPHED:  # eager timing holds the host's launch cost: replays too
                g = kernel_ms(fn, graph=True)
                g["tflops"] = flop / (g["median_ms"] * 1e-3) / 1e12
                row.setdefault("graph", {})[name] = g
                extra = f" (graph {g['median_ms']:.3f} ms {g['tflops']:.1f} TFLOP/s)"
            print(f"  H={heads} {seqs}x{q_len} over {k_len}: {name:>22} "
                  f"{t['median_ms']:8.3f} ms {t['tflops']:7.1f} TFLOP/s{extra}", flush=True)

        record("bf16", lambda: run_bf16(x))
        quantized = (*quantize_rows(x["q"]), quantize_context(x["k"], x["k_rope"], x["v"]))
        for name in configs:
            cfg = parse_config(name)
            try:
                record(f"fp8:{name}", lambda: run_fp8(x, cfg, quantized))
            except Exception as exc:  # a config that does not fit (shared memory, registers)
                row["kernels"][f"fp8:{name}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  fp8:{name}: {type(exc).__name__}", flush=True)
        timed = {k: v for k, v in row["kernels"].items() if k.startswith("fp8:") and "median_ms"
                 in v}
        if timed:
            best = min(timed, key=lambda k: timed[k]["median_ms"])
            row["fp8_triton_best_config"] = best.split(":", 1)[1]
            row["kernels"]["fp8_triton"] = dict(timed[best])
        if device == "cuda" and hopper_fp8.unsupported_reason(
                quantized[0], quantized[2].k8, quantized[2].p8, quantized[2].vt8,
                x["q"]) is None:
            out = torch.empty(x["q"].shape[0], heads, VDIM, dtype=dtype, device=device)
            lse = torch.empty(x["q"].shape[:2], dtype=torch.float32, device=device)
            for block_n, stages in GLUON_VARIANTS:
                name = f"fp8_gluon:n{block_n}_s{stages}"
                q8, qs, ctx = quantized

                def gluon_call():
                    if not hopper_fp8.hopper_fp8_attention(
                            q8, qs, ctx.k8, ctx.p8, ctx.vt8, ctx.bound, x["cu_q"], x["cu_k"],
                            max_seqlen_q=x["q_len"], softmax_scale=x["scale"], out=out,
                            lse=lse, accumulate=False, block_n=block_n, stages=stages):
                        raise RuntimeError(hopper_fp8.failures().get(
                            (dtype, False, block_n, stages), "did not run"))
                try:
                    record(name, gluon_call)
                except Exception as exc:
                    row["kernels"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(f"  {name}: {str(exc)[:200]}", flush=True)
            del out, lse
        # the default path (config None: the Gluon kernel where it applies, else Triton's)
        record("fp8", lambda: run_fp8(x, None, quantized))
        record("fp8+quant", lambda: run_fp8(x))
        quantized = None  # free it before cuDNN's copies
        if cudnn:
            try:
                record("cudnn", cudnn_call(x, causal=False))
            except Exception as exc:
                row["kernels"]["cudnn"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        ks, gs = row["kernels"], row.get("graph", {})
        for a, b in (("fp8", "bf16"), ("bf16", "cudnn"), ("fp8", "cudnn"),
                     ("fp8_triton", "bf16")):
            if "median_ms" in ks.get(a, {}) and "median_ms" in ks.get(b, {}):
                row[f"{a}_over_{b}_throughput"] = ks[b]["median_ms"] / ks[a]["median_ms"]
            if gs.get(a, {}).get("graph") and gs.get(b, {}).get("graph"):
                row[f"{a}_over_{b}_graph_throughput"] = gs[b]["median_ms"] / gs[a]["median_ms"]
        rows.append(row)
    return rows


def bench_accuracy(shapes, dtype: torch.dtype, device: str) -> list[dict]:
    rows = []
    for heads, seqs, q_len, k_len in shapes:
        for outliers, label in (("", "N(0, 1)"),
                                ("scaled", "4 channels of q, k, v x30 (random signs)"),
                                ("bias", "4 key channels +30 (an offset)")):
            x = make_inputs(heads, seqs, q_len, k_len, dtype, device, seed=1, outliers=outliers)
            ref = reference(x)
            row = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                   "inputs": label,
                   "bf16": _errors(run_bf16(x), ref), "fp8": _errors(run_fp8(x), ref)}
            print(f"  accuracy H={heads} {seqs}x{q_len} over {k_len} {row['inputs']}: out rmse "
                  f"bf16 {row['bf16']['out_rmse']:.2e} fp8 {row['fp8']['out_rmse']:.2e}; lse max "
                  f"bf16 {row['bf16']['lse_max_abs']:.2e} fp8 {row['fp8']['lse_max_abs']:.2e}",
                  flush=True)
            rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--sections", default="kernel,ideal,chunk,accuracy", help="comma list")
    p.add_argument("--configs", default=CONFIGS, help="FP8 configs mM_nN_wW_sS, comma list")
    p.add_argument("--upproj-configs", default=UPPROJ_CONFIGS,
                   help="fused up-projection configs mM_kK_wW_sS, comma list")
    p.add_argument("--shapes", default="", help="HEADS:SEQS:QLEN:KLEN comma list (kernel)")
    add_cpu_smoke(p)
    args = p.parse_args()
    if args.cpu_smoke:
        device, dtype, shapes = "cpu", torch.float16, SMOKE_SHAPES
        acc_shapes, configs = SMOKE_SHAPES, ["m16_n16_w4_s1"]
        chunk_shapes, upproj_configs = SMOKE_CHUNK_SHAPES, ["m16_k16_w4_s1"]
        ideal_shapes = SMOKE_SHAPES
        global NOPE, ROPE, VDIM, RANK
        NOPE, ROPE, VDIM, RANK = 16, 16, 16, 32
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] \
            if args.shapes else SHAPES
        acc_shapes = [(16, 1, 1024, 4096), (128, 1, 512, 4096)]
        configs = [c for c in args.configs.split(",") if c]
        chunk_shapes = CHUNK_SHAPES
        ideal_shapes = IDEAL_SHAPES
        upproj_configs = [c for c in args.upproj_configs.split(",") if c]
    sections = set(args.sections.split(","))
    machine = machine_info(torch.device(device))
    doc = {"benchmark": "fp8_attention", "date_utc": utc_now(), "machine": machine,
           "command": sys.argv,
           "settings": {"dtype": str(dtype), "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
                        "v_head_dim": VDIM, "kv_lora_rank": RANK, "flop_formula": FLOP_FORMULA,
                        "configs": configs, "upproj_configs": upproj_configs,
                        "cpu_smoke": args.cpu_smoke}}
    if "kernel" in sections:
        doc["kernel"] = bench_kernels(shapes, configs, dtype, device)
    if "ideal" in sections:
        doc["ideal"] = bench_ideal(ideal_shapes, dtype, device)
    if "chunk" in sections:
        doc["chunk"] = bench_chunks(chunk_shapes, upproj_configs, dtype, device)
    if "accuracy" in sections:
        doc["accuracy"] = bench_accuracy(acc_shapes, dtype, device)
        doc["accuracy_latent"] = bench_latent_accuracy(acc_shapes, dtype, device)
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
