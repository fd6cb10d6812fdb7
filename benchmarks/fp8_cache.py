# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""FP8 latent caches on the GPU, beside the bf16 cache in the same run (issue #27).

Usage::

    PYTHONPATH=src python benchmarks/fp8_cache.py --out benchmarks/results/fp8_cache_h200.json

    PYTHONPATH=src python benchmarks/fp8_cache.py --cpu-smoke --out /tmp/fp8_cache.json

Sections:

* ``gather`` — the paged gather of the same rows from a bf16 cache (a copy), a
  ``float8_e4m3fn`` cache (x one scale) and an ``fp8_ds_mla`` cache (x four scales per row,
  rope copied), each into a bf16 workspace, timed as CUDA-graph replays. Bytes moved: bf16
  ``rows * 1152`` read + ``rows * 1152`` written; fp8 ``rows * 576`` read + the same written;
  ``fp8_ds_mla`` ``rows * 656`` read + ``rows * 1152`` written (+ ``rows * 4`` block-table reads
  each). Target: fp8 gather time <= 0.8x bf16's. Also whether the rows equal, bit for bit,
  ``(fp8.to(float32) * scale).to(bfloat16)`` computed here with torch on the device.
* ``forward`` — the whole forward (``mlaprefill`` backend with ``graphs=IterationGraphs()`` and
  its ``io_buffers``, the default fast path) on the vs-ideal shapes with each cache format;
  ratio to the bf16 cache's forward. Target: <= 1.0x.

Times: ``triton.testing.do_bench`` medians (CUDA events, warm-up excluded); CPU smoke: host wall
clock, meaningless.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from _common import add_cpu_smoke, empty_cache, kernel_ms, write_json
from mlaprefill import IterationGraphs, MLAChunkedPrefill
from mlaprefill._env import machine_info, utc_now
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import gather_context_rows
from mlaprefill.kvcache import FP8_DS_MLA_RECORD_BYTES, write_kv_cache
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import StagingRing

RANK, ROPE, NOPE, VDIM, PAGE = 512, 64, 128, 128, 64
LATENT = RANK + ROPE
SCALE = 0.02  # per-tensor scale of the e4m3 cache (values ~N(0, 1): |x / scale| < 448)
FORMATS = ("bf16", "fp8", "fp8_ds_mla")
# (heads, num_reqs, queries per request, context tokens per request): benchmarks/attention.py's
# vs-ideal set
SHAPES = [
    (128, 1, 4096, 4096), (128, 1, 4096, 32768), (128, 1, 4096, 131072),
    (128, 4, 1024, 32768), (128, 16, 256, 8192),
    (16, 1, 4096, 4096), (16, 1, 4096, 131072), (16, 4, 1024, 32768),
    (16, 16, 256, 8192), (16, 16, 256, 131072),
    (128, 4, 1000, 30000), (16, 16, 250, 8000),
]
GATHER_SHAPES = [(1, 16384), (4, 16384), (16, 4096), (1, 65536), (16, 8192)]  # (reqs, ctx)


def _table(context_lens: list[int], device: str, g: torch.Generator) -> tuple[Any, int]:
    """A permuted block table for ``context_lens`` and the page count."""
    per = [max(1, -(-c // PAGE)) for c in context_lens]
    num_blocks = sum(per) + 3
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    table = torch.zeros(len(per), max(per), dtype=torch.int32, device=device)
    off = 0
    for r, nb in enumerate(per):
        table[r, :nb] = perm[off:off + nb]
        off += nb
    return table, num_blocks


def _caches(num_blocks: int, device: str, g: torch.Generator) -> dict[str, Any]:
    """The same random rows as a bf16, an e4m3 and an fp8_ds_mla cache (write_kv_cache)."""
    rows = torch.randn(num_blocks * PAGE, LATENT, device=device, generator=g)
    slots = torch.arange(num_blocks * PAGE, device=device)
    out: dict[str, Any] = {}
    for fmt in FORMATS:
        shape = (num_blocks, PAGE, FP8_DS_MLA_RECORD_BYTES if fmt == "fp8_ds_mla" else LATENT)
        dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}.get(fmt, torch.uint8)
        cache = torch.empty(shape, dtype=dtype, device=device)
        kw = _kwargs(fmt)
        write_kv_cache(cache, slots, rows.to(torch.bfloat16), **kw)
        out[fmt] = cache
    return out


def _kwargs(fmt: str) -> dict[str, Any]:
    return {"kv_cache_scale": SCALE if fmt == "fp8" else None,
            "kv_cache_format": "fp8_ds_mla" if fmt == "fp8_ds_mla" else None}


def _decoded(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[num_blocks * page, 576]`` bf16: the format's formula with torch ops, written here."""
    flat = cache.reshape(-1, cache.shape[2])
    if fmt == "bf16":
        return flat
    if fmt == "fp8":
        return (flat.to(torch.float32) * SCALE).to(torch.bfloat16)
    vals = flat[:, :512].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = flat[:, 512:528].contiguous().view(torch.float32).repeat_interleave(128, dim=1)
    rope = flat[:, 528:].contiguous().view(torch.bfloat16)
    return torch.cat([(vals * scales).to(torch.bfloat16), rope], dim=1)


def bench_gather(device: str, shapes: list[tuple[int, int]], sweep: bool = False
                 ) -> dict[str, Any]:
    rows_out = []
    for nr, ctx in shapes:
        g = torch.Generator(device=device).manual_seed(nr * 7 + ctx)
        table, num_blocks = _table([ctx] * nr, device, g)
        caches = _caches(num_blocks, device, g)
        plan = ChunkPlanner(nr * ctx, PAGE).plan(PrefillBatch([1] * nr, [ctx] * nr,
                                                              page_size=PAGE))
        cu = torch.tensor(plan.cu_seq_lens[0], device=device)
        starts = torch.tensor(plan.chunk_starts[0], device=device)
        n = plan.iteration_tokens[0]
        ws = torch.empty(n, LATENT, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"num_reqs": nr, "context_len": ctx, "rows": n}
        for fmt in FORMATS:
            cache, kw = caches[fmt], _kwargs(fmt)

            def fn() -> Any:
                return gather_context_rows(cache, table, cu, starts, ws, n, **kw)

            fn()
            # bitwise check: the workspace against the formula on the same rows
            pos = torch.arange(n, device=device)
            req = torch.repeat_interleave(torch.arange(nr, device=device), ctx)
            tok = pos - req * ctx
            slot = table[req, tok // PAGE].long() * PAGE + tok % PAGE
            want = _decoded(cache, fmt)[slot]
            row[f"{fmt}_bitwise"] = bool(torch.equal(ws[:n].view(torch.int16),
                                                     want.view(torch.int16)))
            t = kernel_ms(fn, graph=True)
            read = {"bf16": 2 * LATENT, "fp8": LATENT, "fp8_ds_mla": FP8_DS_MLA_RECORD_BYTES}
            nbytes = n * (read[fmt] + 2 * LATENT + 4)
            row[f"{fmt}_ms"] = t["median_ms"]
            row[f"{fmt}_gbps"] = nbytes / (t["median_ms"] * 1e-3) / 1e9
            if sweep:  # tile height x warps x width, for the defaults
                cfgs = {}
                widths = (64,) if fmt == "bf16" else (64, 128) if fmt == "fp8_ds_mla" \
                    else (64, 128, 256)
                for br in (16, 32, 64):
                    for nw in (2, 4, 8):
                        for bd in widths:
                            def tile(br: int = br, nw: int = nw, bd: int = bd) -> Any:
                                return gather_context_rows(cache, table, cu, starts, ws, n,
                                                           block_rows=br, num_warps=nw,
                                                           block_d=bd, **kw)
                            tile()
                            cfgs[f"rows{br}_warps{nw}_cols{bd}"] = kernel_ms(
                                tile, graph=True)["median_ms"]
                row[f"{fmt}_sweep_ms"] = cfgs
                best = min(cfgs, key=cfgs.get)
                row[f"{fmt}_sweep_best"] = [best, cfgs[best]]
        for fmt in FORMATS[1:]:
            row[f"{fmt}_over_bf16"] = row[f"{fmt}_ms"] / row["bf16_ms"]
        rows_out.append(row)
        print(f"  gather {nr:>2} x {ctx:>6}: bf16 {row['bf16_ms']:.4f} ms, fp8 "
              f"{row['fp8_ms']:.4f} ms ({row['fp8_over_bf16']:.2f}x), fp8_ds_mla "
              f"{row['fp8_ds_mla_ms']:.4f} ms ({row['fp8_ds_mla_over_bf16']:.2f}x), bitwise "
              f"{[row[f + '_bitwise'] for f in FORMATS]}", flush=True)
        del caches
        empty_cache()
    return {"bytes_formula": "rows * (read + 1152 written + 4 block-table): read 1152 (bf16), "
                             "576 (fp8), 656 (fp8_ds_mla)",
            "target": "fp8_ms / bf16_ms <= 0.8", "timing": "cuda graph replay", "rows": rows_out}


def bench_forward(device: str, shapes: list[tuple[int, int, int, int]],
                  backend: str, rounds: int = 3) -> dict[str, Any]:
    rows_out = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for heads, nr, q, c in shapes:
        g = torch.Generator(device=device).manual_seed(heads + nr + q + c)
        table, num_blocks = _table([c] * nr, device, g)
        caches = _caches(num_blocks, device, g)
        if dtype != torch.bfloat16:  # CPU smoke: float32 compute, a float32 plain cache
            caches["bf16"] = caches["bf16"].to(dtype)
        t = nr * q
        x = {"q": torch.randn(t, heads, NOPE + ROPE, device=device, generator=g).to(dtype),
             "kv_c_new": torch.randn(t, RANK, device=device, generator=g).to(dtype),
             "k_pe_new": torch.randn(t, ROPE, device=device, generator=g).to(dtype)}
        weight = (torch.randn(heads * (NOPE + VDIM), RANK, device=device, generator=g)
                  * RANK ** -0.5).to(dtype)
        op = MLAChunkedPrefill(weight, qk_nope_head_dim=NOPE, v_head_dim=VDIM,
                               backend=backend, graphs=IterationGraphs())
        plan = ChunkPlanner(65536, PAGE, policy=op.resolve_policy("auto")).plan(
            PrefillBatch([q] * nr, [c] * nr, page_size=PAGE))
        dplan = StagingRing(device).upload(plan)
        io = op.io_buffers(t)
        io.q.copy_(x["q"])
        row: dict[str, Any] = {"heads": heads, "num_reqs": nr, "query_len": q,
                               "context_len": c,
                               "backend": op.backend_name + ("+graphs" if device == "cuda"
                                                             else ""),
                               "iterations": plan.num_iterations}
        fwds = {}
        for fmt in FORMATS:
            cache, kw = caches[fmt], _kwargs(fmt)

            def fwd() -> Any:
                return op.forward(io.q, x["kv_c_new"], x["k_pe_new"], cache, table, dplan,
                                  out=io.out, lse=io.lse, **kw)

            for _ in range(3):  # first sight runs eagerly, the second captures
                fwd()
                op.graphs.capture_pending()
            fwds[fmt] = fwd
        # interleaved rounds: clock drift over a shape's timings hits every format alike
        times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
        for _ in range(rounds):
            for fmt in FORMATS:
                times[fmt].append(kernel_ms(fwds[fmt], rep=100)["median_ms"])
        for fmt in FORMATS:
            row[f"{fmt}_ms_per_round"] = times[fmt]
            row[f"{fmt}_ms"] = sorted(times[fmt])[len(times[fmt]) // 2]
        for fmt in FORMATS[1:]:
            ratios = sorted(a / b for a, b in zip(times[fmt], times["bf16"], strict=True))
            row[f"{fmt}_over_bf16"] = ratios[len(ratios) // 2]
            row[f"{fmt}_over_bf16_min_max"] = [ratios[0], ratios[-1]]
        rows_out.append(row)
        print(f"  forward H={heads:>3} {nr:>2}x{q:<5} ctx {c:>6}: bf16 {row['bf16_ms']:.3f} ms, "
              f"fp8 {row['fp8_over_bf16']:.3f}x {row['fp8_over_bf16_min_max']}, fp8_ds_mla "
              f"{row['fp8_ds_mla_over_bf16']:.3f}x {row['fp8_ds_mla_over_bf16_min_max']}",
              flush=True)
        caches = op = io = None  # free before the next shape
        empty_cache()
    return {"what": "whole forward, graphs + io_buffers, per cache format; ratio to the bf16 "
                    "cache's forward: median over interleaved rounds (and min / max)",
            "rounds": rounds, "target": "<= 1.0", "rows": rows_out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON path")
    p.add_argument("--quick", action="store_true", help="first shapes of each section only")
    p.add_argument("--sweep", action="store_true",
                   help="gather: also time every tile height x warps (block_rows, num_warps)")
    p.add_argument("--sections", default="gather,forward", help="comma list to run")
    add_cpu_smoke(p)
    args = p.parse_args()
    if args.cpu_smoke:
        device, backend = "cpu", "math"
        gather_shapes, shapes = [(2, 100)], [(2, 2, 5, 70)]
    else:
        if not torch.cuda.is_available():
            print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
            return 2
        device, backend = "cuda", "mlaprefill"
        gather_shapes = GATHER_SHAPES[:2] if args.quick else GATHER_SHAPES
        shapes = SHAPES[:3] if args.quick else SHAPES
    doc: dict[str, Any] = {"date_utc": utc_now(), "machine": machine_info(torch.device(device)),
                           "command": sys.argv, "scale": SCALE}
    sections = args.sections.split(",")
    with torch.inference_mode():
        if "gather" in sections:
            doc["gather"] = bench_gather(device, gather_shapes, args.sweep)
            write_json(args.out, doc)
        if "forward" in sections:
            doc["forward"] = bench_forward(device, shapes, backend, 1 if args.cpu_smoke else 3)
    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
