"""Run variants side by side (interleaved repeats) and assemble the result document."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from mlaprefill._env import machine_info, utc_now
from mlaprefill.bench.engine import EngineConfig, PrefillEngine, ProgressFn, Variant
from mlaprefill.bench.metrics import METRIC_KEYS, RunResult, step_series, summarize
from mlaprefill.bench.report import annotate

__all__ = ["DEFAULT_VARIANTS", "ProgressLine", "run_suite"]

# The pre-fix engine (vLLM-shaped tables from pageable memory), the seed's fix (the same tables
# pinned per step), and ours (compact plans through the ring) with two planner policies.
DEFAULT_VARIANTS = ("pageable+equal+vllm", "pin+equal+vllm", "ring+equal", "ring+packed")


class ProgressLine:
    """A self-refreshing one-line progress display on a stream (stderr by default).

    On a terminal it rewrites one line (at most 10 times a second); otherwise it prints a line at
    most every 5 s so logs stay short.
    """

    def __init__(self, total_runs: int, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total_runs = total_runs
        self.run_index = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def start_run(self, label: str) -> None:
        self.run_index += 1
        self.label = label
        # A terminal shows the line at once; a log gets its first line after 5 s of a run.
        self._last = 0.0 if self.tty else time.perf_counter()

    def __call__(self, variant: str, repeat: int, steps: int, finished: int, total: int) -> None:
        now = time.perf_counter()
        if now - self._last < (0.1 if self.tty else 5.0):
            return
        self._last = now
        text = (f"[{self.run_index}/{self.total_runs}] {self.label}: step {steps}, "
                f"{finished}/{total} requests done, {now - self.t0:.0f} s elapsed")
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end_run(self, result: RunResult) -> None:
        text = (f"[{self.run_index}/{self.total_runs}] {self.label}: {len(result.steps)} steps, "
                f"{result.throughput_tok_s:.0f} tok/s, {time.perf_counter() - self.t0:.0f} s "
                f"elapsed")
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def run_suite(config: EngineConfig, variants: list[Variant], *, repeats: int = 2,
              warmup_steps: int = 3, scenario: str = "custom", scenario_note: str = "",
              progress: bool = True, engine: PrefillEngine | None = None,
              max_seconds: float | None = None, warmup_run: bool = True) -> dict[str, Any]:
    """Measure every variant ``repeats`` times, interleaved, and return the result document.

    Repeat ``k`` runs the variants in the order rotated by ``k`` (A B C D, B C D A, ...), so
    slow drift of a shared machine spreads over all variants instead of deciding the ranking.
    With ``warmup_run``, variants first run the whole workload unmeasured, so every step shape
    has been seen once (attention backends that build a graph or compile per shape would
    otherwise charge that host time to whichever variant meets the shape first): one run per
    (attention backend, planner policy) pair, since each pair meets its own shapes, all
    together capped at half of ``max_seconds``. It is the first ``ring`` variant of the pair
    when there is one: the engine keeps one staging ring per transfer mode, so that run also
    grows the ring's arenas to the largest plan, and no arena is re-allocated in a measured
    run. Then each variant runs ``warmup_steps`` unmeasured steps.

    ``max_seconds`` covers the warm-up too: the warm-up runs together stop scheduling steps at
    half of it, and the measured runs share what the warm-up left. With ``max_seconds``, no new
    round of repeats starts when it would likely end past that
    budget (every variant keeps the same number of repeats), and the first round gives each
    variant an equal share of the time left: a run that reaches its share stops early and is
    marked ``truncated`` (a fallback for a slower machine).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    if not variants:
        raise ValueError("no variants to run; pass e.g. --variants ring+packed.")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variants repeat: {names}; list each TRANSFER+POLICY once.")
    t_start = time.perf_counter()
    engine = engine if engine is not None else PrefillEngine(config)
    # One unmeasured warm-up run per (attention backend, planner policy) pair of the variants:
    # a policy gives its own piece shapes, a backend builds its own graphs / compiles (the
    # mlaprefill backend's cuDNN graphs per rectangle shape); prefer a ring variant (see above).
    warm_runs: dict[tuple[str, str], Variant] = {}
    for v in sorted(variants, key=lambda v: v.transfer != "ring"):
        warm_runs.setdefault((v.backend or config.backend, v.policy), v)
    line = ProgressLine(len(variants) * (repeats + (1 if warmup_steps else 0))
                        + (len(warm_runs) if warmup_run else 0))
    cb: ProgressFn | None = line if progress else None
    warmup_builds: dict[str, int | None] = {}
    warmup_captures: dict[str, int | None] = {}
    if warmup_run:
        # All of them together capped at half the budget (was: each, so several warm-up runs
        # could spend all of it and leave the measured runs a deadline in the past: one step
        # each), so that a slow machine still gets measured runs.
        cap = None if max_seconds is None else t_start + max_seconds / 2
        for warm in warm_runs.values():
            if progress:
                line.start_run(f"warm-up run {warm.name} (all step shapes)")
            res = engine.run(warm, deadline=cap, progress=cb)
            warmup_builds[warm.name] = res.kernel_builds
            warmup_captures[warm.name] = res.graph_captures
            if progress:
                line.end_run(res)
    if warmup_steps:
        for v in variants:
            if progress:
                line.start_run(f"warm-up {v.name}")
            res = engine.run(v, max_steps=warmup_steps, progress=cb)
            if progress:
                line.end_run(res)
    warmup_seconds = time.perf_counter() - t_start
    results: dict[str, list[RunResult]] = {n: [] for n in names}
    stopped_early = False
    t_first_round = t_start
    for k in range(repeats):
        t_round = time.perf_counter()
        if k and max_seconds is not None and (
                t_round - t_start + (t_round - t_first_round) / k > max_seconds):
            stopped_early = True
            break
        if k == 0:
            t_first_round = t_round  # warm-up excluded from the per-round estimate
        order = variants[k % len(variants):] + variants[:k % len(variants)]
        for j, v in enumerate(order):
            if progress:
                line.start_run(f"{v.name} repeat {k + 1}/{repeats}")
            deadline = None
            if k == 0 and max_seconds is not None:
                left = t_start + max_seconds - t_round
                deadline = t_round + left * (j + 1) / len(order)
            res = engine.run(v, repeat=k, deadline=deadline, progress=cb)
            results[v.name].append(res)
            if progress:
                line.end_run(res)
    reference = results[names[0]][0].first_tokens
    out_variants = []
    for v in variants:
        runs = results[v.name]
        metrics = summarize(runs)
        assert set(METRIC_KEYS) <= set(metrics), "summarize() lost a metric key"
        agree = [sum(r.first_tokens.get(i) == t for i, t in reference.items())
                 / max(1, len(reference)) for r in runs]
        out_variants.append({
            "name": v.name, "transfer": v.transfer, "policy": v.policy, "tables": v.tables,
            "attention_backend": engine.backend_name(v.backend),
            "kv_cache_dtype": v.kv_cache_dtype,
            "kv_cache_bytes_per_token": engine.latent_cache(v.kv_cache_dtype).bytes_per_token,
            "metrics": metrics,
            "first_tokens_agreement_with_first_variant": min(agree),
            "per_repeat": [{"repeat": r.repeat, "throughput_tok_s": r.throughput_tok_s,
                            "duration_ms": r.duration_ms, "wall_ms": r.wall_ms,
                            "num_steps": len(r.steps), "staging": r.staging} for r in runs],
            "step_series": step_series(runs[0]),
        })
    cfg = asdict(config)
    cfg["request_rate"] = None if cfg["request_rate"] == float("inf") else cfg["request_rate"]
    dims = engine.dims
    return annotate({
        "schema": "mlaprefill.bench/1",
        "scenario": scenario,
        "scenario_note": scenario_note,
        "date": utc_now(),
        "command": list(sys.argv),  # the command as run, program name first
        "machine": machine_info(engine.device),
        "ran_on": engine.device.type,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attention_backend": engine.backend_name(),
        "warmup_kernel_builds": warmup_builds,
        "warmup_graph_captures": warmup_captures,
        "config": cfg,
        "model": {"num_heads": dims.mla.num_heads, "kv_lora_rank": dims.mla.kv_lora_rank,
                  "qk_nope_head_dim": dims.mla.qk_nope_head_dim,
                  "qk_rope_head_dim": dims.mla.qk_rope_head_dim,
                  "v_head_dim": dims.mla.v_head_dim, "hidden_size": dims.hidden_size,
                  "q_lora_rank": dims.q_lora_rank, "intermediate_size": dims.intermediate_size,
                  "vocab_size": dims.vocab_size, "num_params": engine.model.num_params,
                  "num_cache_blocks": engine.num_blocks},
        "repeats": len(results[names[0]]),
        "repeats_requested": repeats,
        "stopped_early_for_max_seconds": stopped_early,
        "max_seconds": max_seconds,
        "warmup_steps": warmup_steps,
        "warmup_run": warmup_run,
        "warmup_run_variants": [w.name for w in warm_runs.values()] if warmup_run else [],
        "baseline": names[0],
        "variants": out_variants,
        "first_tokens": {str(k): v for k, v in sorted(reference.items())},
        "warmup_seconds": warmup_seconds,  # of total_seconds and of max_seconds
        "total_seconds": time.perf_counter() - t_start,
    })
