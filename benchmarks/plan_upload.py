# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""Step metadata: what a plan costs the host and the device, compact against vLLM-shaped.

    PYTHONPATH=src python benchmarks/plan_upload.py --out benchmarks/results/plan_upload_h200.json

Section A (GPU idle): host time of plan + upload per step for 1, 4 and 16 *skewed* prefills
(contexts 1.5k-128k, vLLM's 65,536-token workspace), side by side in one run:

* ``ours``: ``ChunkPlanner.plan`` + ``StagingRing.upload`` (ring mode, compact plan: O(iterations
  x requests) int32, one pinned copy);
* ``vllm_style_pinned``: the chunked-context metadata built the usual way, written here for the
  comparison: torch CPU ops on the context lengths (chunk starts/ends, ``cu_seq_lens`` by
  ``cumsum``, ``token_to_seq`` by ``repeat_interleave``), every table in a freshly pinned tensor,
  one ``non_blocking`` copy per table (vLLM's fix of the pageable stall);
* ``ring_vllm_tables``: our planner and ring, but shipping vLLM's per-token table too.

Section B (GPU busy, ~50 ms of kernels queued by ``torch.cuda._sleep``): host time blocked in
one upload, at the real step shapes of each bench scenario (the step with the most context and
the median step, from the scheduler's dry run): ring with compact plans (the chunk plan alone
and the whole engine step), against pageable / per-step pinned copies of vLLM-shaped tables and
pageable compact plans.

Section C (device): the gather that maps rows to requests on the device (binary search over
``cu_seq_lens``) against the previous kernel that read a shipped ``token_to_seq`` (kept here,
for this comparison only), GB/s with ``bytes = rows * 576 * 2 * 2`` (read + write); and the whole
forward with each (the old kernel plugged in through ``context_source``), same inputs, one run.

Section D (device): the DCP reorder from the compact ``reorder_base`` (computed on the device)
against an ``index_select`` with a shipped per-token ``reorder_index``.

Runs on CPU too (sections A only, small repeat counts) and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from _common import add_cpu_smoke, kernel_ms
from mlaprefill._env import machine_info, utc_now
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import StagingRing

PAGE = 64
WORKSPACE = 65536
RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128
SKEWED = {1: [81920], 4: [131072, 32768, 8192, 1536],
          16: [int(131072 * 0.72 ** i) // 7 * 7 + 3 for i in range(16)]}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


# ------------------------------------------------------------------------------ section A

def vllm_style_metadata(context_lens: torch.Tensor, query_lens: torch.Tensor, device: str,
                        workspace: int, page_size: int) -> dict[str, torch.Tensor]:
    """Chunked-context metadata built the usual way (torch CPU ops, pinned, one copy each).

    The vLLM-compatible ``equal`` chunking; every table pinned fresh and copied separately with
    ``non_blocking=True``. A baseline for this benchmark only.
    """
    pin = device != "cpu"
    num_reqs = context_lens.shape[0]
    cu_q = torch.zeros(num_reqs + 1, dtype=torch.int32, pin_memory=pin)
    torch.cumsum(query_lens, dim=0, out=cu_q[1:])
    with_ctx = int((context_lens > 0).sum())
    chunk = workspace // with_ctx // page_size * page_size
    num_chunks = -(-int(context_lens.max()) // chunk)
    starts = (torch.arange(num_chunks, dtype=torch.int32)[:, None].expand(-1, num_reqs)
              * chunk)
    ends = torch.minimum(context_lens[None, :], starts + chunk)
    lens = (ends - starts).clamp(min=0).to(torch.int32)
    cu_seq = torch.zeros(num_chunks, num_reqs + 1, dtype=torch.int32, pin_memory=pin)
    torch.cumsum(lens, dim=1, out=cu_seq[:, 1:])
    width = int(cu_seq[:, -1].max())
    t2s = torch.zeros(num_chunks, width, dtype=torch.int32, pin_memory=pin)
    req = torch.arange(num_reqs, dtype=torch.int32)
    for c in range(num_chunks):  # one repeat_interleave per chunk, as engines write it
        row = torch.repeat_interleave(req, lens[c])
        t2s[c, :row.shape[0]] = row
    host = {"cu_query_lens": cu_q, "chunk_starts": starts.contiguous().pin_memory()
            if pin else starts.contiguous(), "cu_seq_lens": cu_seq, "token_to_seq": t2s}
    return {k: v.to(device, non_blocking=True) for k, v in host.items()}


def section_a(device: str, reps: int, block: int = 25) -> list[dict]:
    """Blocks of ``block`` steps per variant, round-robin (drift spreads over every variant);
    the first step of each block is dropped (it pays for what the other variant evicted)."""
    rows = []
    ring = StagingRing(device)
    ring_tables = StagingRing(device)
    planners = {p: ChunkPlanner(WORKSPACE, PAGE, p) for p in ("equal", "balanced")}
    for n, ctx in SKEWED.items():
        q = [max(16, 4096 // n)] * n

        def ours(policy: str = "equal", q: list = q, ctx: list = ctx) -> Any:
            return ring.upload(planners[policy].plan(PrefillBatch(q, ctx, page_size=PAGE)))

        def ours_tables(q: list = q, ctx: list = ctx) -> Any:
            plan = planners["equal"].plan(PrefillBatch(q, ctx, page_size=PAGE))
            return ring_tables.upload(plan, token_tables=True)

        def vllm_style(q: list = q, ctx: list = ctx) -> Any:
            return vllm_style_metadata(torch.tensor(ctx, dtype=torch.int32),
                                       torch.tensor(q, dtype=torch.int32), device, WORKSPACE,
                                       PAGE)

        variants = {"ours": ours, "ours_balanced": lambda: ours("balanced"),
                    "ring_vllm_tables": ours_tables, "vllm_style_pinned": vllm_style}
        plan = planners["equal"].plan(PrefillBatch(q, ctx, page_size=PAGE))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(max(1, reps // (block - 1))):
            for name, fn in variants.items():
                for j in range(block):
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    if j:
                        times[name].append(t1 - t0)
                if device != "cpu":
                    torch.cuda.synchronize()
        row: dict[str, Any] = {
            "num_prefills": n, "context_lens": ctx, "iterations": plan.num_iterations,
            "compact_bytes": sum(a.nbytes for a in plan.device_arrays().values()),
            "vllm_bytes": sum(a.nbytes for a in plan.device_arrays(token_tables=True).values()),
            "reps": len(times["ours"])}
        for name, ts in times.items():
            row[f"{name}_us_median"] = 1e6 * pct(ts, 50)
            row[f"{name}_us_p99"] = 1e6 * pct(ts, 99)
        row["speedup_vs_vllm_style_median"] = (row["vllm_style_pinned_us_median"]
                                               / row["ours_us_median"])
        rows.append(row)
    if device != "cpu":
        torch.cuda.synchronize()
    return rows


# ------------------------------------------------------------------------------ section B

def scenario_shapes() -> dict[str, list[tuple[str, PrefillBatch, dict]]]:
    """Per bench scenario: its step with the most context and its median step."""
    from mlaprefill.bench.cli import SCENARIOS
    from mlaprefill.bench.dryrun import scenario_steps
    from mlaprefill.bench.engine import EngineConfig

    out = {}
    for name in ("vllm-default", "stall", "uneven"):
        cfg = EngineConfig(**SCENARIOS[name].engine)
        steps = list(scenario_steps(cfg))
        ctx = np.array([b.num_context_tokens for b, _ in steps])
        order = np.argsort(ctx, kind="stable")
        picks = {"max_context": int(order[-1]), "median_context": int(order[len(order) // 2])}
        out[name] = [(label, *steps[i]) for label, i in picks.items()]
    return out


def calibrate_sleep() -> float:
    """``torch.cuda._sleep`` cycles per millisecond, measured with CUDA events."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def section_b(queue_ms: float, reps: int) -> list[dict]:
    from mlaprefill.bench.cli import SCENARIOS
    from mlaprefill.bench.step import StepPlan

    cycles = int(queue_ms * calibrate_sleep())
    rings = {m: StagingRing("cuda", mode=m) for m in ("ring", "pin", "pageable")}
    rows = []
    for scen, picks in scenario_shapes().items():
        workspace = SCENARIOS[scen].engine["workspace_tokens"]
        planner = ChunkPlanner(workspace, PAGE, "equal")
        for label, batch, arrays in picks:
            plan = planner.plan(batch)
            vllm_arrays = {**arrays, "token_to_seq": np.ascontiguousarray(plan.token_to_seq)}
            cases = {
                "ring_compact_plan": (rings["ring"], plan),
                "ring_compact_step": (rings["ring"], StepPlan(plan, arrays)),
                "pageable_compact_step": (rings["pageable"], StepPlan(plan, arrays)),
                "pageable_vllm_step": (rings["pageable"], StepPlan(plan, vllm_arrays)),
                "pin_vllm_step": (rings["pin"], StepPlan(plan, vllm_arrays)),
                "ring_vllm_step": (rings["ring"], StepPlan(plan, vllm_arrays)),
            }
            for case, (ring, what) in cases.items():
                for _ in range(6):  # size ring arenas / warm the caching host allocator
                    ring.upload(what)
                torch.cuda.synchronize()
                blocked, drained = [], 0
                n = reps if case.startswith("ring") else max(5, reps // 4)
                for _ in range(n):
                    torch.cuda._sleep(cycles)
                    marker = torch.cuda.Event()
                    marker.record()
                    t0 = time.perf_counter()
                    ring.upload(what)
                    t1 = time.perf_counter()
                    drained += bool(marker.query())
                    torch.cuda.synchronize()
                    blocked.append(t1 - t0)
                staged = sum(a.nbytes for a in what.device_arrays().values())
                rows.append({
                    "scenario": scen, "step": label, "case": case, "staged_bytes": staged,
                    "num_reqs": batch.num_reqs, "context_tokens": batch.num_context_tokens,
                    "iterations": plan.num_iterations,
                    "blocked_ms_p50": 1e3 * pct(blocked, 50),
                    "blocked_ms_p99": 1e3 * pct(blocked, 99),
                    "blocked_ms_max": 1e3 * max(blocked),
                    "upload_returned_after_queue_drained": drained, "reps": n})
    return rows


# ------------------------------------------------------------------------------ section C

def _old_gather():
    """The previous gather kernel: reads the request of each row from a shipped token_to_seq."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(kv_cache_ptr, workspace_ptr, block_table_ptr, token_to_seq_ptr, cu_seq_lens_ptr,
               chunk_starts_ptr, num_rows, stride_cache_block, stride_cache_page, stride_bt_req,
               stride_ws_row, PAGE_SIZE: tl.constexpr, LATENT_DIM: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        req = tl.load(token_to_seq_ptr + rows, mask=row_mask, other=0)
        start = tl.load(chunk_starts_ptr + req, mask=row_mask, other=0).to(tl.int64)
        first_row = tl.load(cu_seq_lens_ptr + req, mask=row_mask, other=0).to(tl.int64)
        pos = start + rows - first_row
        block = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt_req + pos // PAGE_SIZE,
                        mask=row_mask, other=0).to(tl.int64)
        src = block * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_page
        dst = rows * stride_ws_row
        cols = tl.arange(0, BLOCK_D)
        for d0 in tl.static_range(0, LATENT_DIM, BLOCK_D):
            x = tl.load(kv_cache_ptr + src[:, None] + (d0 + cols)[None, :], mask=row_mask[:, None])
            tl.store(workspace_ptr + dst[:, None] + (d0 + cols)[None, :], x,
                     mask=row_mask[:, None])

    def gather(kv_cache, block_table, token_to_seq, cu_seq_lens, chunk_starts, workspace,
               num_rows, block_rows=16, num_warps=4):
        if num_rows:
            kernel[(triton.cdiv(num_rows, block_rows),)](
                kv_cache, workspace, block_table, token_to_seq, cu_seq_lens, chunk_starts,
                num_rows, kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
                workspace.stride(0), PAGE_SIZE=kv_cache.shape[1], LATENT_DIM=kv_cache.shape[2],
                BLOCK_ROWS=block_rows, BLOCK_D=64, num_warps=num_warps)
        return workspace[:num_rows]

    return gather


def _inputs(query_lens: list[int], context_lens: list[int], heads: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [max(1, -(-c // PAGE)) for c in context_lens]
    nb = sum(blocks) + 1
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    off = 0
    for r, b in enumerate(blocks):
        table[r, :b] = perm[off:off + b]
        off += b
    t = sum(query_lens)
    bf = torch.bfloat16
    return dict(
        q=torch.randn(t, heads, NOPE + ROPE, device="cuda", dtype=bf, generator=g),
        kv_c_new=torch.randn(t, RANK, device="cuda", dtype=bf, generator=g),
        k_pe_new=torch.randn(t, ROPE, device="cuda", dtype=bf, generator=g),
        kv_cache=torch.randn(nb, PAGE, RANK + ROPE, device="cuda", dtype=bf, generator=g),
        block_table=table,
        weight=torch.randn(heads * (NOPE + VDIM), RANK, device="cuda", dtype=bf,
                           generator=g) * RANK ** -0.5)


def _time(fn: Any, graph: bool = False, rep: int = 60) -> float:
    return float(kernel_ms(fn, warmup=10, rep=rep, graph=graph)["median_ms"])


def section_c() -> dict:
    from mlaprefill import MLAChunkedPrefill
    from mlaprefill.kernels import gather_context_rows

    old = _old_gather()
    gather_rows = []
    for nr, ctx in ((1, 65536), (4, 16384), (16, 4096), (16, 8192), (64, 2048), (256, 512),
                    (256, 1024)):
        x = _inputs([1] * nr, [ctx] * nr, 1)
        plan = ChunkPlanner(nr * ctx, PAGE).plan(PrefillBatch([1] * nr, [ctx] * nr,
                                                              page_size=PAGE))
        n = plan.iteration_tokens[0]
        cu = torch.from_numpy(plan.cu_seq_lens[0].copy()).cuda()
        cs = torch.from_numpy(plan.chunk_starts[0].copy()).cuda()
        tts = torch.from_numpy(np.ascontiguousarray(plan.token_to_seq[0])).cuda()
        ws_new = torch.empty(n, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        ws_old = torch.empty_like(ws_new)
        gather_context_rows(x["kv_cache"], x["block_table"], cu, cs, ws_new, n)
        old(x["kv_cache"], x["block_table"], tts, cu, cs, ws_old, n)
        same = bool(torch.equal(ws_new, ws_old))
        nbytes = n * (RANK + ROPE) * 2 * 2
        kv, bt = x["kv_cache"], x["block_table"]
        t_new = _time(lambda: gather_context_rows(kv, bt, cu, cs, ws_new, n), graph=True)
        t_old = _time(lambda: old(kv, bt, tts, cu, cs, ws_old, n), graph=True)
        t_new2 = _time(lambda: gather_context_rows(kv, bt, cu, cs, ws_new, n), graph=True)
        src = torch.empty_like(ws_new)
        t_copy = _time(lambda: ws_new.copy_(src), graph=True)
        gather_rows.append({
            "num_reqs": nr, "rows": n, "bitwise_equal_to_old": same,
            "device_mapping_ms": t_new, "device_mapping_ms_repeat": t_new2,
            "shipped_table_ms": t_old, "ratio_new_over_old": t_new / t_old,
            "device_mapping_gbps": nbytes / (t_new * 1e-3) / 1e9,
            "shipped_table_gbps": nbytes / (t_old * 1e-3) / 1e9,
            "d2d_copy_gbps": nbytes / (t_copy * 1e-3) / 1e9})
        torch.cuda.empty_cache()

    forward_rows = []
    for heads, q_lens, ctx_lens, backend in (
            (128, [4096], [65536], "fa2"), (128, [4096], [65536], "cudnn"),
            (16, [256] * 16, [8192] * 16, "fa2"), (16, [512] * 8,
                                                      [4096 * (i + 1) for i in range(8)],
                                                      "fa2")):
        x = _inputs(q_lens, ctx_lens, heads)
        mla = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=VDIM,
                                backend=backend)
        plan = ChunkPlanner(WORKSPACE, PAGE, mla.preferred_policy).plan(
            PrefillBatch(q_lens, ctx_lens, page_size=PAGE))
        dplan = StagingRing("cuda").upload(plan, token_tables=True)
        t = dplan.tensors

        def old_source(i: int, workspace: torch.Tensor, t: dict = t, x: dict = x,
                       plan: Any = plan) -> torch.Tensor:
            return old(x["kv_cache"], x["block_table"], t["token_to_seq"][i],
                       t["cu_seq_lens"][i], t["chunk_starts"][i], workspace,
                       plan.iteration_tokens[i])

        args = (x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"], dplan)
        a = mla.forward(*args)
        b = mla.forward(*args, context_source=old_source)
        same = bool(torch.equal(a, b))
        t_new = _time(lambda: mla.forward(*args), rep=200)
        t_old = _time(lambda: mla.forward(*args, context_source=old_source), rep=200)
        t_new2 = _time(lambda: mla.forward(*args), rep=200)
        forward_rows.append({
            "heads": heads, "query_lens": q_lens, "context_lens": ctx_lens, "backend": backend,
            "policy": plan.policy, "iterations": plan.num_iterations, "bitwise_equal": same,
            "device_mapping_ms": t_new, "device_mapping_ms_repeat": t_new2,
            "shipped_table_ms": t_old, "ratio_new_over_old": t_new / t_old})
        del x, a, b
        torch.cuda.empty_cache()
    return {"bytes_formula": "rows * 576 * 2 (bf16) read + the same written",
            "timing": "gather: CUDA graph replay median (triton do_bench_cudagraph); forward: "
                      "do_bench median (eager, host launch included)",
            "gather": gather_rows, "forward": forward_rows}


# ------------------------------------------------------------------------------ section D

def section_d(device: str = "cuda", cases: tuple | None = None) -> list[dict]:
    from mlaprefill.dcp.forward import reorder_rows_index
    from mlaprefill.dcp.plan import DCPChunkPlanner

    rows = []
    for world, interleave, lens in cases or ((2, 1, [131072]), (2, 64, [131072]),
                                             (4, 64, [16384] * 8)):
        batch = PrefillBatch([1] * len(lens), lens, page_size=PAGE)
        plan = DCPChunkPlanner(sum(lens), PAGE, world=world, interleave=interleave,
                               max_gathered_tokens=2 * sum(lens)).plan(batch, rank=0)
        dp = StagingRing(device).upload(plan, token_tables=True)
        t = dp.tensors
        n = plan.base.iteration_tokens[0]
        gathered = torch.randn(plan.world * plan.rank_capacity[0], RANK + ROPE, device=device,
                               dtype=torch.bfloat16)
        out = torch.empty(n, RANK + ROPE, device=device, dtype=torch.bfloat16)

        def compact() -> None:
            idx = reorder_rows_index(t["cu_seq_lens"][0], t["chunk_starts"][0],
                                     t["reorder_base"][0], n, world=world,
                                     interleave=interleave)
            torch.index_select(gathered, 0, idx, out=out)

        def shipped() -> None:
            torch.index_select(gathered, 0, t["reorder_index"][0, :n], out=out)

        compact()
        a = out.clone()
        shipped()
        rows.append({
            "world": world, "interleave": interleave, "context_lens": lens, "rows": n,
            "equal": bool(torch.equal(a, out)),
            "compact_ms": _time(compact, graph=True), "shipped_index_ms": _time(shipped,
                                                                                graph=True),
            "compact_plan_bytes": sum(v.nbytes for v in plan.device_arrays().values()),
            "shipped_plan_bytes": sum(v.nbytes for v in
                                      plan.device_arrays(token_tables=True).values())})
        rows[-1]["ratio"] = rows[-1]["compact_ms"] / rows[-1]["shipped_index_ms"]
    return rows


# ------------------------------------------------------------------------------ main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--queue-ms", type=float, default=50.0,
                    help="GPU work queued before each timed upload in section B")
    ap.add_argument("--sections", default="ABCD", help="which sections to run (default ABCD)")
    add_cpu_smoke(ap)
    args = ap.parse_args()
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = "cuda" if cuda else "cpu"
    result: dict[str, Any] = {
        "benchmark": "plan_upload",
        "ran_on": "cuda" if cuda else ("cpu (no CUDA or --cpu-smoke: sections A and a tiny D, "
                                       "upload is a CPU copy)"),
        "machine": machine_info(torch.device(device)), "command": " ".join(sys.argv),
        "argv": sys.argv,
        "date_utc": utc_now(offset=True), "workspace_tokens": WORKSPACE, "page_size": PAGE}

    def dump() -> None:
        result["wall_seconds"] = time.perf_counter() - t_start
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    sections = {"A": ("section_a_plan_upload_gpu_idle",
                      lambda: section_a(
                          device, reps=480 if cuda else 24 if args.cpu_smoke else 48)),
                "D-smoke": ("section_d_dcp_reorder", lambda: section_d(
                    device, ((2, 1, [300]), (2, 16, [100, 60])))),
                "B": ("section_b_blocked_behind_queue", lambda: section_b(args.queue_ms, 30)),
                "C": ("section_c_device_row_mapping", section_c),
                "D": ("section_d_dcp_reorder", section_d)}
    for key, (name, fn) in sections.items():
        if cuda and (key not in args.sections or key == "D-smoke"):
            continue
        if not cuda and key not in ("A", "D-smoke"):  # B, C: CUDA streams / the Triton kernel
            continue
        t0 = time.perf_counter()
        result[name] = fn()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        dump()
    dump()
    print_tables(result)
    return 0


def print_tables(r: dict) -> None:
    print(f"# plan_upload on {r['ran_on']}: {r['machine'].get('device_name')} / "
          f"{r['machine'].get('cpu')}")
    a = r.get("section_a_plan_upload_gpu_idle", [])
    if a:
        print("\nA. plan + upload per step, GPU idle, us median (p99)")
        print(f"{'prefills':>8} {'iters':>5} {'compact B':>9} {'vLLM B':>9} {'ours':>15} "
              f"{'ours balanced':>15} {'ring+vLLM tables':>17} {'vLLM-style pinned':>18} "
              f"{'speedup':>7}")
        for x in a:
            def cell(k: str, x: dict = x) -> str:
                return f"{x[k + '_us_median']:.0f} ({x[k + '_us_p99']:.0f})"
            print(f"{x['num_prefills']:>8} {x['iterations']:>5} {x['compact_bytes']:>9} "
                  f"{x['vllm_bytes']:>9} {cell('ours'):>15} {cell('ours_balanced'):>15} "
                  f"{cell('ring_vllm_tables'):>17} {cell('vllm_style_pinned'):>18} "
                  f"{x['speedup_vs_vllm_style_median']:>6.2f}x")
    b = r.get("section_b_blocked_behind_queue", [])
    if b:
        print("\nB. host ms blocked in one upload with ~50 ms queued: p50 / p99 / max")
        for x in b:
            print(f"{x['scenario']:<13} {x['step']:<15} {x['case']:<22} "
                  f"{x['staged_bytes'] / 1024:>9.1f} KiB {x['blocked_ms_p50']:>7.3f} "
                  f"{x['blocked_ms_p99']:>7.3f} {x['blocked_ms_max']:>7.3f}")
    c = r.get("section_c_device_row_mapping")
    if c:
        print("\nC. gather: device row mapping vs shipped token_to_seq (GB/s, ratio of times)")
        for x in c["gather"]:
            print(f"reqs {x['num_reqs']:>4} rows {x['rows']:>7}: {x['device_mapping_gbps']:7.0f} "
                  f"vs {x['shipped_table_gbps']:7.0f} GB/s, ratio {x['ratio_new_over_old']:.3f}, "
                  f"copy {x['d2d_copy_gbps']:.0f}, equal {x['bitwise_equal_to_old']}")
        for x in c["forward"]:
            print(f"forward H={x['heads']} {x['backend']} reqs {len(x['query_lens'])}: "
                  f"{x['device_mapping_ms']:.3f} vs {x['shipped_table_ms']:.3f} ms, ratio "
                  f"{x['ratio_new_over_old']:.3f}, equal {x['bitwise_equal']}")
    d = r.get("section_d_dcp_reorder", [])
    for x in d:
        print(f"D. dcp world {x['world']} I={x['interleave']} rows {x['rows']}: compact "
              f"{x['compact_ms']:.4f} ms vs shipped {x['shipped_index_ms']:.4f} ms "
              f"(ratio {x['ratio']:.2f}); plan {x['compact_plan_bytes']} B vs "
              f"{x['shipped_plan_bytes']} B; equal {x['equal']}")
    print(f"\nwall {r.get('wall_seconds', 0):.1f} s")


if __name__ == "__main__":
    sys.exit(main())
