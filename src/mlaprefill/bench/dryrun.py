"""Scheduler + planner only (no model, no device): the metadata each step of a workload ships.

Used by ``mlaprefill bench --dry-run`` to show, on any machine, how many bytes a scenario's steps
upload and how many of them pass the pageable-stall threshold (2120 KiB on the H200).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from mlaprefill.batch import PrefillBatch
from mlaprefill.bench.cache import BlockAllocator
from mlaprefill.bench.engine import (
    EngineConfig,
    allocate_prefix_pages,
    default_num_blocks,
    prefix_lens,
    workload,
)
from mlaprefill.bench.metrics import percentile
from mlaprefill.bench.scheduler import Request, Scheduler, SchedulerConfig
from mlaprefill.bench.step import StepPlan, build_engine_arrays
from mlaprefill.plan import ChunkPlanner

__all__ = ["STALL_THRESHOLD_BYTES", "metadata_profile", "scenario_steps"]

#: Pageable copies from this size up blocked the host for the whole queue on the H200 (50 ms of
#: kernels queued; benchmarks/results/stallmap_h200.json, ``threshold_bytes``: a test checks).
STALL_THRESHOLD_BYTES = 2120 * 2**10


def metadata_profile(config: EngineConfig, policy: str, *,
                     share_prefixes: bool = True) -> dict[str, Any]:
    """Schedule and plan the whole workload of ``config`` (all requests at once; each finishes
    as soon as its last token is scheduled), with prefix sharing or not (``ChunkPlanner``'s
    ``share_prefixes``).

    Returns
    -------
    dict with ``steps`` and per-step arrays (np int64 [steps]): ``metadata_bytes`` (everything
    a step ships with compact plan metadata), ``plan_bytes`` (the chunk plan's part of it),
    ``token_to_seq_bytes`` (what vLLM's per-token table would add), ``iterations``; and their
    summary: ``metadata_bytes_p50``, ``metadata_bytes_max``, ``plan_bytes_max``,
    ``token_to_seq_bytes_max``, ``vllm_metadata_bytes_max`` (compact + token_to_seq), and the
    fraction of steps whose largest single array reaches :data:`STALL_THRESHOLD_BYTES`, with
    vLLM-shaped tables (``steps_over_threshold_fraction``) and compact ones
    (``compact_steps_over_threshold_fraction``).
    """
    planner = ChunkPlanner(config.workspace_tokens, config.page_size, policy=policy,
                           share_prefixes=share_prefixes)
    meta, plan_b, t2s, iters, largest, largest_vllm = [], [], [], [], [], []
    for batch, arrays in scenario_steps(config):
        plan = planner.plan(batch)
        sp = StepPlan(plan, arrays)
        meta.append(sp.nbytes)
        plan_b.append(sp.plan_nbytes)
        largest.append(sp.largest_array_nbytes)
        # vLLM's table is [iterations, max_iteration_tokens] int32: its size needs no building
        t2s_bytes = 4 * plan.num_iterations * plan.max_iteration_tokens
        t2s.append(t2s_bytes)
        largest_vllm.append(max(sp.largest_array_nbytes, t2s_bytes))
        iters.append(plan.num_iterations)
    meta_a, t2s_a = np.array(meta, dtype=np.int64), np.array(t2s, dtype=np.int64)

    def over(sizes: list[int]) -> float:
        return float(np.mean(np.array(sizes) >= STALL_THRESHOLD_BYTES)) if sizes else 0.0

    return {
        "steps": len(meta),
        "metadata_bytes": meta_a,
        "plan_bytes": np.array(plan_b, dtype=np.int64),
        "token_to_seq_bytes": t2s_a,
        "iterations": np.array(iters, dtype=np.int64),
        "metadata_bytes_p50": percentile(meta_a, 50) if meta else 0.0,
        "metadata_bytes_max": int(meta_a.max()) if meta else 0,
        "plan_bytes_max": int(max(plan_b)) if plan_b else 0,
        "token_to_seq_bytes_max": int(t2s_a.max()) if t2s else 0,
        "vllm_metadata_bytes_max": int((meta_a + t2s_a).max()) if meta else 0,
        "steps_over_threshold_fraction": over(largest_vllm),
        "compact_steps_over_threshold_fraction": over(largest),
    }


def scenario_steps(config: EngineConfig) -> Iterator[tuple[PrefillBatch, dict[str, np.ndarray]]]:
    """Every step of ``config``'s workload as the engine would schedule it, all requests at
    once, each finishing as soon as its last token is scheduled: ``(batch, engine arrays)``
    (token ids are zeros: only the shapes matter here)."""
    cfg = config
    prompt_lens, _ = workload(cfg)
    allocator = BlockAllocator(default_num_blocks(cfg, prompt_lens))
    sched = Scheduler(SchedulerConfig(token_budget=cfg.token_budget,
                                      max_concurrent=cfg.max_concurrent,
                                      page_size=cfg.page_size, share=cfg.share), allocator)
    # prefix caching: the engine's cached prefix pages (prefilled before a run)
    pages = allocate_prefix_pages(cfg, allocator)
    group, cached = prefix_lens(cfg)
    for r in range(cfg.num_requests):
        prefix = pages[int(group[r])]
        sched.add(Request(r, int(prompt_lens[r]), num_scheduled=int(cached[r]),
                          prefix_blocks=prefix if prefix.size else None))
    offsets = np.zeros(cfg.num_requests + 1, dtype=np.int64)
    np.cumsum(prompt_lens, out=offsets[1:])
    # Token ids only fill the engine arrays (sizes are what is measured): a zero-stride view
    # of one 0 costs no memory however long the prompts are.
    tokens = np.broadcast_to(np.zeros(1, dtype=np.int32), (int(offsets[-1]),))
    while sched.has_unfinished():
        step = sched.schedule()
        if step is None:
            break
        arrays = build_engine_arrays(step, prompt_tokens=tokens, prompt_offsets=offsets,
                                     page_size=cfg.page_size)
        yield PrefillBatch(step.query_lens, step.context_lens, page_size=cfg.page_size,
                           block_table=step.block_table), arrays
        for rid in step.req_ids[step.finishing].tolist():
            sched.finish(rid)


def format_profiles(profiles: dict[str, dict[str, Any]], *, wide: bool = False) -> str:
    """The dry run's table, one row per planner policy (``metadata_profile`` results), and its
    footnote; within 100 columns unless ``wide`` (the long headers of before)."""
    mib = 2.0**20
    if wide:
        lines = [f"{'policy':<9} {'steps':>6} {'iters max':>9} {'iters sum':>9} "
                 f"{'plan max':>9} {'step p50':>9} {'step max':>9} "
                 f"{'+ vLLM token_to_seq max':>24} {'steps with a copy >= 2120 KiB':>30}"]
        for policy, p in profiles.items():
            lines.append(
                f"{policy:<9} {p['steps']:>6} {int(p['iterations'].max(initial=0)):>9} "
                f"{int(p['iterations'].sum()):>9} {p['plan_bytes_max']:>8}B "
                f"{p['metadata_bytes_p50'] / mib:>8.3f}M {p['metadata_bytes_max'] / mib:>8.3f}M "
                f"{p['token_to_seq_bytes_max'] / mib:>23.3f}M "
                f"{p['compact_steps_over_threshold_fraction'] * 100:>8.0f}% compact, "
                f"{p['steps_over_threshold_fraction'] * 100:>3.0f}% vLLM")
    else:
        lines = [f"{'policy':<9}{'steps':>6}{'iters':>7}{'iters':>7}{'plan':>7}{'step':>9}"
                 f"{'step':>9}{'+vLLM t2s':>10}{'>=2120K':>9}{'>=2120K':>9}",
                 f"{'':<9}{'':>6}{'max':>7}{'sum':>7}{'max B':>7}{'p50 MiB':>9}"
                 f"{'max MiB':>9}{'max MiB':>10}{'compact':>9}{'vLLM':>9}"]
        lines.append("-" * len(lines[0]))
        for policy, p in profiles.items():
            lines.append(
                f"{policy:<9}{p['steps']:>6}{int(p['iterations'].max(initial=0)):>7}"
                f"{int(p['iterations'].sum()):>7}{p['plan_bytes_max']:>7}"
                f"{p['metadata_bytes_p50'] / mib:>9.3f}{p['metadata_bytes_max'] / mib:>9.3f}"
                f"{p['token_to_seq_bytes_max'] / mib:>10.3f}"
                f"{p['compact_steps_over_threshold_fraction'] * 100:>8.0f}%"
                f"{p['steps_over_threshold_fraction'] * 100:>8.0f}%")
    note = ("plan = the chunk plan's arrays (O(iterations x requests)); step = plan + the "
            "engine's arrays (token ids, positions, slots, block table); "
            + ("" if wide else "+vLLM t2s = vLLM's per-token token_to_seq on top; >=2120K = ")
            + f"steps with a copy >= {STALL_THRESHOLD_BYTES >> 10} KiB (compact plans, vLLM's "
              f"tables): from that size a pageable copy blocked the host on the H200.")
    if wide:
        lines.append(note)
    else:
        import textwrap
        lines.append(textwrap.fill(note, 100, subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(lines)
