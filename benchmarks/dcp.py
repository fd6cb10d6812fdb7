# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its case)
"""DCP check and benchmark, launched by torchrun (gloo on CPU, NCCL on GPUs).

Usage::

    torchrun --nproc-per-node 2 benchmarks/dcp.py --out benchmarks/results/dcp_h200x2.json
    torchrun --nproc-per-node 3 benchmarks/dcp.py --device cpu          # gloo, tiny shapes

Every rank builds the same full paged cache (seeded on the CPU), keeps its own shard
(:func:`~mlaprefill.dcp.shard.shard_paged_cache`) and also the full cache, then per case:

* **check** — the DCP forward (local gather -> all_gather_into_tensor -> reorder -> attention)
  against the single-rank forward on the full cache on the same GPU: max |diff| of output and
  LSE, bitwise equality, and that every rank got the same output;
* **time** (CUDA events, warm-up excluded, median and p10/p90 over ``--reps``) — the whole
  forward, DCP vs one GPU holding the whole cache; the per-iteration context fetch, DCP
  (gather of the local share + all-gather + reorder) vs the single-rank paged gather; and its
  parts alone (local gather, all-gather). All-gather bus bandwidth =
  ``world * rank_capacity * latent_dim * elt_bytes * (world - 1) / world / time``.

Rank 0 writes the JSON (``--out``: machine, versions, command, UTC date, cases) and prints the
table last, ending with ``DCP check: ALL MATCH`` or ``DCP check: MISMATCH``; exit status 1 on a
mismatch. NVLink multicast stays off: ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set (setdefault) before the process group starts.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's package first, so the code measured is the code in the tree.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import argparse
import datetime
import json
import os
import platform
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlaprefill._env import machine_info, utc_now
from mlaprefill.batch import PrefillBatch
from mlaprefill.config import MLAConfig
from mlaprefill.dcp.forward import (
    DCPContextSource,
    check_dcp_consistency,
)
from mlaprefill.dcp.plan import DCPChunkPlanner
from mlaprefill.dcp.shard import shard_paged_cache
from mlaprefill.kernels import gather_context_rows
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import DEFAULT_WORKSPACE_TOKENS, MLAChunkedPrefill
from mlaprefill.staging import StagingRing

# name -> (query_lens, context_lens); "gpu" sizes for CUDA, "cpu" sizes for gloo runs.
SCENARIOS: dict[str, dict[str, tuple[list[int], list[int]]]] = {
    "gpu": {
        "long-128k": ([2048], [131072]),
        "mixed-8": ([512] * 8, [0, 1, 4095, 4096, 12345, 30000, 65, 20000]),
    },
    "cpu": {
        "long": ([16], [1000]),
        "mixed": ([4, 1, 3, 2, 1], [0, 1, 63, 200, 16]),
    },
}
# A peer stuck for this long (e.g. it failed) ends the run instead of hanging it for NCCL's
# default 10 minutes; generous enough for a first call that compiles kernels.
_COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=180)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _all_gather_into_tensor(output: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    # torch >= 2.13 names it all_gather_single (same semantics); the GPU machine runs 2.11
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, local, group=group)


def _smoke_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    """One rank of ``--cpu-smoke`` (``torch.multiprocessing.spawn``): gloo on this host."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    status = main(argv)
    if status:
        raise SystemExit(status)


def _spawn_smoke(argv: list[str]) -> int:
    """``--cpu-smoke`` without torchrun: 2 gloo ranks on CPU, on a free port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_smoke_worker, args=(2, port, argv), nprocs=2, join=True)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N benchmarks/dcp.py",
        description="Check DCP against the single-GPU forward and time both.")
    p.add_argument("--out", help="JSON result path (written by rank 0)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--preset", help="MLA preset (default deepseek-v3 on CUDA, tiny on CPU)")
    p.add_argument("--dtype", choices=sorted(_DTYPES),
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--page-size", type=int, help="default 64 on CUDA, 16 on CPU")
    p.add_argument("--interleaves", help="comma list, default '1,<page_size>'")
    p.add_argument("--workspace-tokens", type=int,
                   help=f"default {DEFAULT_WORKSPACE_TOKENS} on CUDA, 256 on CPU")
    p.add_argument("--scenarios", help=f"comma list of {sorted(SCENARIOS['gpu'])} (CUDA) or "
                                       f"{sorted(SCENARIOS['cpu'])} (CPU); default all")
    p.add_argument("--backend", default="auto")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-budget", type=float, default=90.0,
                   help="seconds; cases starting after this are skipped (and listed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma list of latent cache formats, each case run once per format: "
                        "auto (the compute dtype), fp8 (float8_e4m3fn, scale FP8_SCALE), "
                        "fp8_ds_mla (656-byte records; kv_lora_rank 512 + rope 64 only)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU, gloo, world 2 (spawned here when not under torchrun), one tiny "
                        "scenario, 2 reps: the same plan / shard / forward / check path")
    return p.parse_args(argv)


def _quantiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "reps": int(a.size)}


class _Timer:
    """Times ``fn`` on all ranks in lockstep: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, group: Any, reps: int, warmup: int) -> None:
        self.device, self.group, self.reps, self.warmup = device, group, reps, warmup

    def __call__(self, fn: Any) -> dict[str, float]:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        if cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        ms = []
        if cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.reps)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(self.device)
            ms = [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t0) * 1e3)
        return _quantiles(ms)


def _host_ms(fn: Any, reps: int = 20) -> float:
    """Median host time of ``fn`` in ms (planning: pure CPU)."""
    fn()
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ms))


def _inputs(cfg: MLAConfig, query_lens: list[int], context_lens: list[int], page_size: int,
            dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Identical on every rank: generated on the CPU from ``seed``, then moved."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    nblocks = [-(-n // page_size) for n in context_lens]
    num_blocks = sum(nblocks) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(context_lens), max(max(nblocks), 1), dtype=torch.int32)
    offsets = np.cumsum([0, *nblocks])
    for r, nb in enumerate(nblocks):  # setup only: one row per request
        table[r, :nb] = perm[offsets[r]:offsets[r] + nb]

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return {
        "q": randn(t, cfg.num_heads, cfg.qk_head_dim),
        "kv_c_new": randn(t, cfg.kv_lora_rank),
        "k_pe_new": randn(t, cfg.qk_rope_head_dim),
        "kv_cache": randn(num_blocks, page_size, cfg.latent_dim),
        "block_table": table.to(device),
        "weight": randn(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                        cfg.kv_lora_rank, scale=cfg.kv_lora_rank ** -0.5),
    }


FP8_SCALE = 0.05  # the e4m3 cache's scale (rows ~N(0, 1): |x / scale| stays below 448)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")


def _cache_kwargs(fmt: str) -> dict[str, Any]:
    return {"kv_cache_scale": FP8_SCALE if fmt == "fp8" else None,
            "kv_cache_format": "fp8_ds_mla" if fmt == "fp8_ds_mla" else None}


def _quantized(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """``cache`` (compute dtype) stored in ``fmt`` (write_kv_cache), same pages."""
    if fmt == "auto":
        return cache
    from mlaprefill.kvcache import FP8_DS_MLA_RECORD_BYTES, write_kv_cache

    nb, page, latent = cache.shape
    record = FP8_DS_MLA_RECORD_BYTES if fmt == "fp8_ds_mla" else latent
    out = torch.empty(nb, page, record, device=cache.device,
                      dtype=torch.uint8 if fmt == "fp8_ds_mla" else torch.float8_e4m3fn)
    write_kv_cache(out, torch.arange(nb * page, device=cache.device),
                   cache.reshape(-1, latent), **_cache_kwargs(fmt))
    return out


def _all_min_max(values: list[float], group: Any, device: torch.device) -> tuple[list, list]:
    t = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    v = t.cpu().tolist()  # host read: check/report only, outside the timed regions
    n = len(values)
    return v[:n], [-x for x in v[n:]]


def _run_case(name: str, query_lens: list[int], context_lens: list[int], interleave: int,
              policy: str, data: dict[str, torch.Tensor], shard: tuple, *, args: Any,
              cfg: MLAConfig, page_size: int, workspace: int, rank: int, world: int,
              group: Any, device: torch.device, dtype: torch.dtype,
              fmt: str = "auto") -> dict[str, Any]:
    local_cache, local_table = shard
    kw = _cache_kwargs(fmt)
    batch = PrefillBatch(query_lens, context_lens, page_size=page_size)
    single_plan = ChunkPlanner(workspace, page_size, policy).plan(batch)
    dcp_plan = DCPChunkPlanner(workspace, page_size, world=world, interleave=interleave,
                               policy=policy).plan(batch, rank=rank)
    check_dcp_consistency(dcp_plan.digest, group, device if device.type == "cuda" else "cpu")
    host_plan = {
        "single_ms": _host_ms(lambda: ChunkPlanner(workspace, page_size, policy).plan(batch)),
        "dcp_ms": _host_ms(lambda: DCPChunkPlanner(
            workspace, page_size, world=world, interleave=interleave,
            policy=policy).plan(batch, rank=rank)),
        "single_upload_bytes": int(sum(a.nbytes for a in single_plan.device_arrays().values())),
        "dcp_upload_bytes": int(sum(a.nbytes for a in dcp_plan.device_arrays().values())),
    }
    ring = StagingRing(device)
    single_dp = ring.upload(single_plan)
    dcp_dp = ring.upload(dcp_plan)
    mla = MLAChunkedPrefill(data["weight"], qk_nope_head_dim=cfg.qk_nope_head_dim,
                            v_head_dim=cfg.v_head_dim, backend=args.backend)
    source = DCPContextSource(local_cache, local_table, dcp_dp, group, **kw)
    q, kv_c_new, k_pe_new = data["q"], data["kv_c_new"], data["k_pe_new"]
    cache, table = data["kv_cache"], data["block_table"]

    def single() -> Any:
        return mla.forward(q, kv_c_new, k_pe_new, cache, table, single_dp, return_lse=True,
                           **kw)

    def dcp() -> Any:
        return mla.forward(q, kv_c_new, k_pe_new, local_cache, local_table, dcp_dp,
                           return_lse=True, context_source=source, **kw)

    # -- check ---------------------------------------------------------------------------------
    out_s, lse_s = single()
    out_s2, _ = single()
    single_deterministic = bool(torch.equal(out_s, out_s2))
    del out_s2
    out_d, lse_d = dcp()
    diff_out = (out_d.double() - out_s.double()).abs().max().item() if out_s.numel() else 0.0
    finite = torch.isfinite(lse_s)
    diff_lse = ((lse_d.double() - lse_s.double()).abs()[finite].max().item()
                if bool(finite.any()) else 0.0)
    same_inf = bool(torch.equal(torch.isinf(lse_d), torch.isinf(lse_s)))
    bitwise = bool(torch.equal(out_d, out_s) and torch.equal(lse_d, lse_s))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out_scale = out_s.double().abs().max().item() if out_s.numel() else 1.0
    lse_scale = lse_s.double().abs()[finite].max().item() if bool(finite.any()) else 1.0
    ok = (diff_out <= tol * max(1.0, out_scale) and diff_lse <= tol * max(1.0, lse_scale)
          and same_inf)
    checksum = out_d.double().sum().item()
    mins, maxs = _all_min_max([checksum, diff_out, diff_lse, 0.0 if ok else 1.0], group, device)
    ranks_agree = mins[0] == maxs[0]
    # The requirement: every rank's DCP output equals the single-GPU forward (within the
    # dtype's tolerance). Bitwise agreement between ranks is reported, not required: the
    # single-GPU forward itself is not always bitwise run-to-run deterministic in bf16.
    match = maxs[3] == 0.0
    del out_s, lse_s, out_d, lse_d
    # Host-sync audit of one DCP forward (plan already uploaded): ops that make the host wait
    # for a non-CPU device, recorded. An audit error raises: the rank exits and the launcher
    # stops the others.
    from hostsync import no_host_sync

    with no_host_sync() as audit:
        dcp()
    host_syncs: Any = [f"{f.kind} {f.op} at {f.filename}:{f.lineno}" for f in audit.findings]

    # -- time ----------------------------------------------------------------------------------
    timer = _Timer(device, group, args.reps, args.warmup)
    ws = torch.empty(max(single_plan.max_iteration_tokens, dcp_plan.base.max_iteration_tokens, 1),
                     cfg.latent_dim, dtype=dtype, device=device)
    iters = range(single_plan.num_iterations)

    def single_ctx() -> None:
        for i in iters:
            gather_context_rows(cache, table, single_dp["cu_seq_lens"][i],
                                single_dp["chunk_starts"][i], ws,
                                single_plan.iteration_tokens[i], **kw)

    dcp_iters = range(dcp_plan.base.num_iterations)

    def dcp_ctx() -> None:
        for i in dcp_iters:
            source(i, ws)

    def dcp_local() -> None:
        for i in dcp_iters:
            source.gather_local(i)

    # what travels: the cache's records (FP8 ones as bytes)
    record = local_cache.shape[2]
    rec_dtype = torch.uint8 if local_cache.element_size() == 1 else local_cache.dtype
    gathered = torch.empty(max(dcp_plan.max_gathered_tokens, 1), record, dtype=rec_dtype,
                           device=device)

    # the all-gather alone, on a buffer of the local rows' shape (its time does not depend on
    # their values)
    local = torch.zeros(max(dcp_plan.max_rank_capacity, 1), record, dtype=rec_dtype,
                        device=device)

    def dcp_allgather() -> None:
        for i in dcp_iters:
            cap = dcp_plan.rank_capacity[i]
            _all_gather_into_tensor(gathered[:world * cap], local[:cap], group)

    timings = {"forward_single": timer(single), "forward_dcp": timer(dcp)}
    if dcp_plan.base.num_iterations:
        timings.update({"context_single": timer(single_ctx), "context_dcp": timer(dcp_ctx),
                        "context_dcp_local_gather": timer(dcp_local),
                        "context_dcp_all_gather": timer(dcp_allgather)})
    # report the slowest rank's median (a collective step is as slow as its slowest rank)
    names = sorted(timings)
    _, slowest = _all_min_max([timings[k]["median_ms"] for k in names], group, device)
    for k, v in zip(names, slowest, strict=True):
        timings[k]["max_rank_median_ms"] = v

    n_it = dcp_plan.base.num_iterations
    per_iteration = {k.removeprefix("context_"): v["max_rank_median_ms"] / n_it
                     for k, v in timings.items() if k.startswith("context_dcp")}
    if "context_single" in timings:
        per_iteration["single"] = (timings["context_single"]["max_rank_median_ms"]
                                   / single_plan.num_iterations)
    elt = local_cache.element_size()
    gather_bytes = sum(world * c for c in dcp_plan.rank_capacity) * record * elt
    before = source.all_gather_bytes
    dcp_ctx()
    counted = source.all_gather_bytes - before  # what the source's own calls moved
    ag = timings.get("context_dcp_all_gather")
    busbw = (gather_bytes * (world - 1) / world / (ag["median_ms"] * 1e-3) / 1e9
             if ag and ag["median_ms"] > 0 else None)
    return {
        "name": name, "interleave": interleave, "policy": policy, "kv_cache_dtype": fmt,
        "all_gather_bytes_counted_by_source": int(counted),
        "query_lens": query_lens, "context_lens": context_lens,
        "num_iterations": dcp_plan.base.num_iterations,
        "single_num_iterations": single_plan.num_iterations,
        "base_workspace_tokens": int(dcp_plan.base.workspace_tokens),
        "rank_capacity": list(dcp_plan.rank_capacity),
        "local_context_tokens": int(dcp_plan.local_context_lens.sum()),
        "cache_bytes_full": int(cache.numel() * elt),
        "cache_bytes_local": int(local_cache.numel() * elt),
        "all_gather_bytes_per_forward": int(gather_bytes),
        "all_gather_busbw_gbps": busbw,
        "backend": mla.backend_name,
        "check": {"match": match, "bitwise_equal_rank0": bitwise,
                  "max_abs_diff_out": maxs[1], "max_abs_diff_lse": maxs[2],
                  "tolerance": tol, "ranks_agree": ranks_agree,
                  "single_gpu_bitwise_deterministic": single_deterministic},
        "host_syncs_in_dcp_forward": host_syncs,
        "host_plan": host_plan,
        "timings": timings,
        "context_fetch_per_iteration_ms": per_iteration,
    }


def _table(doc: dict[str, Any]) -> str:
    head = (f"{'case':<12} {'cache':<10} {'I':>4} {'policy':<6} {'it':>3} {'match':<5} "
            f"{'max|d|':>8} "
            f"{'fwd 1gpu':>9} {'fwd dcp':>9} {'ratio':>6} {'ctx/it 1':>9} {'ctx/it dcp':>10} "
            f"{'ag/it':>8} {'ag GB/s':>8} {'syncs':>5} {'plan 1/dcp':>11}")
    cfg = doc["config"]
    lines = [f"DCP world={doc['world']} on {doc['machine']['device_name']} ({cfg['dtype']}, "
             f"{cfg['preset']}, page {cfg['page_size']}, workspace {cfg['workspace_tokens']}); "
             f"times in ms, median, slowest rank", head, "-" * len(head)]
    for c in doc["cases"]:
        t = c["timings"]
        n = max(c["num_iterations"], 1)
        med = lambda k: t[k]["max_rank_median_ms"] if k in t else float("nan")
        ratio = med("forward_dcp") / med("forward_single")
        bw = c["all_gather_busbw_gbps"]
        hs = c["host_syncs_in_dcp_forward"]
        syncs = str(len(hs)) if isinstance(hs, list) else "err"
        lines.append(
            f"{c['name']:<12} {c.get('kv_cache_dtype', 'auto'):<10} {c['interleave']:>4} "
            f"{c['policy']:<6} {c['num_iterations']:>3} "
            f"{'yes' if c['check']['match'] else 'NO':<5} {c['check']['max_abs_diff_out']:>8.1e} "
            f"{med('forward_single'):>9.3f} {med('forward_dcp'):>9.3f} {ratio:>6.2f} "
            f"{med('context_single') / n:>9.3f} {med('context_dcp') / n:>10.3f} "
            f"{med('context_dcp_all_gather') / n:>8.3f} "
            f"{(f'{bw:.3g}' if bw else '-'):>8} {syncs:>5} "
            f"{c['host_plan']['single_ms']:>5.2f}/{c['host_plan']['dcp_ms']:<5.2f}")
    for s in doc["skipped"]:
        lines.append(f"{s['name']:<12} {s['interleave']:>4} {s['policy']:<6} skipped: {s['why']}")
    verdict = "ALL MATCH" if doc["all_match"] else "MISMATCH"
    lines.append(f"DCP check: {verdict} ({len(doc['cases'])} cases checked, "
                 f"{len(doc['skipped'])} skipped; DCP output vs single-GPU forward on the "
                 f"full cache)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point (every torchrun rank runs it); returns the exit status."""
    args = _parse(argv)
    if args.cpu_smoke:
        args.device, args.scenarios, args.interleaves = "cpu", "mixed", "16"
        args.kv_cache_dtype = "auto,fp8"
        args.reps, args.warmup = 2, 1
        if "WORLD_SIZE" not in os.environ:
            return _spawn_smoke(sys.argv[1:] if argv is None else argv)
    if "WORLD_SIZE" not in os.environ:
        print("launch with torchrun, e.g. `torchrun --nproc-per-node 2 benchmarks/dcp.py "
              "--out dcp.json` (rank/world come from the torchrun environment)", file=sys.stderr)
        return 2
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if use_cuda:
        # NVLink multicast must stay off on the lent machines; set before NCCL starts.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=_COLLECTIVE_TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=_COLLECTIVE_TIMEOUT)
    group = dist.group.WORLD
    size = "gpu" if use_cuda else "cpu"
    cfg = MLAConfig.from_preset(args.preset or ("deepseek-v3" if use_cuda else "tiny"))
    dtype = _DTYPES[args.dtype or ("bfloat16" if use_cuda else "float32")]
    page_size = args.page_size or (64 if use_cuda else 16)
    workspace = args.workspace_tokens or (DEFAULT_WORKSPACE_TOKENS if use_cuda else 256)
    interleaves = ([int(x) for x in args.interleaves.split(",")] if args.interleaves
                   else [1, page_size])
    names = args.scenarios.split(",") if args.scenarios else list(SCENARIOS[size])
    formats = [f.strip() for f in args.kv_cache_dtype.split(",")]
    bad = [f for f in formats if f not in KV_CACHE_DTYPES]
    if bad or ("fp8_ds_mla" in formats and cfg.latent_dim != 576):
        print(f"--kv-cache-dtype {args.kv_cache_dtype!r}: choose from {KV_CACHE_DTYPES} "
              f"(fp8_ds_mla needs the 576-wide latent of deepseek-v3 / kimi-k2)",
              file=sys.stderr)
        return 2
    t_start = time.time()
    cases, skipped = [], []
    # No try/finally around the collectives: a rank that raises just exits and torchrun stops
    # the others (a barrier in a finally could wait forever on peers inside another collective).
    for k, name in enumerate(names):
        query_lens, context_lens = SCENARIOS[size][name]
        policies = ["packed", "equal"] if name.startswith("mixed") else ["packed"]
        base = _inputs(cfg, query_lens, context_lens, page_size, dtype, device,
                       args.seed + k)
        for interleave, fmt in ((i, f) for i in interleaves for f in formats):
            data = {**base, "kv_cache": _quantized(base["kv_cache"], fmt)}
            shard = shard_paged_cache(data["kv_cache"], data["block_table"],
                                      np.array(context_lens), world=world,
                                      interleave=interleave)[rank]
            for policy in policies:
                if policy == "equal" and interleave != interleaves[-1]:
                    continue  # one equal-policy case per scenario keeps the run short
                # every rank must agree on skipping: take the slowest rank's clock
                _, (elapsed,) = _all_min_max([time.time() - t_start], group, device)
                if elapsed > args.time_budget:
                    skipped.append({"name": name, "interleave": interleave,
                                    "policy": policy,
                                    "why": f"time budget {args.time_budget:.0f} s spent"})
                    continue
                case = _run_case(name, query_lens, context_lens, interleave, policy, data,
                                 shard, args=args, cfg=cfg, page_size=page_size,
                                 workspace=workspace, rank=rank, world=world, group=group,
                                 device=device, dtype=dtype, fmt=fmt)
                cases.append(case)
                if rank == 0:
                    print(f"[dcp] {name} I={interleave} {policy} {fmt}: match="
                          f"{case['check']['match']} ({time.time() - t_start:.0f} s)",
                          flush=True)
            del shard, data
        del base
        if use_cuda:
            torch.cuda.empty_cache()
    dist.barrier(group=group)
    dist.destroy_process_group()
    machine = machine_info(device)
    machine.update({"world": world, "hostname": platform.node(),
                    "nccl": str(torch.cuda.nccl.version()) if use_cuda else None})
    doc = {
        "benchmark": "dcp",
        "command": (f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} "
                    + " ".join(sys.argv)),
        "command_note": "torchrun does not pass its own arguments to the workers: the launcher "
                        "part is rebuilt from LOCAL_WORLD_SIZE; argv is exact",
        "argv": sys.argv,
        "date_utc": utc_now(),
        "world": world,
        "machine": machine,
        "env": {k: os.environ.get(k) for k in (
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "WORLD_SIZE",
            "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
        "config": {"preset": args.preset or ("deepseek-v3" if use_cuda else "tiny"),
                   "dtype": str(dtype).removeprefix("torch."), "page_size": page_size,
                   "workspace_tokens": workspace, "interleaves": interleaves,
                   "reps": args.reps, "warmup": args.warmup, "backend": args.backend},
        "formulas": {
            "all_gather_busbw_gbps": "sum_i(world*rank_capacity[i]) * record_bytes "
                                     "* (world-1)/world / median(all_gather time); "
                                     "record_bytes: 1152 bf16, 576 fp8, 656 fp8_ds_mla",
            "ratio": "forward_dcp / forward_single (slowest-rank medians)",
        },
        "cases": cases,
        "skipped": skipped,
        "all_match": bool(cases) and all(c["check"]["match"] for c in cases),
        "wall_s": round(time.time() - t_start, 1),
    }
    if rank == 0:
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(doc, f, indent=1)
        print(_table(doc), flush=True)
    return 0 if doc["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
