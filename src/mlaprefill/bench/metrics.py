"""Per-step and per-request measurements of a bench run, and their summary.

Definitions (all times in milliseconds unless the name says otherwise):

``host_prep_ms``
    Host CPU work of a step before the upload: building the engine arrays and ``planner.plan``.
``host_upload_ms`` (= ``host_blocked_ms``)
    Wall time of the ``StagingRing.upload`` call. Its CPU work is a few microseconds (ring) to
    ~0.1 ms (pin), so anything beyond that is the host blocked inside a copy (a pageable
    ``non_blocking`` copy waiting for the queued kernels).
``host_plan_upload_ms``
    ``host_prep_ms + host_upload_ms``.
``host_launch_ms``
    Wall time to enqueue the step's device work (all layers + sampling + the token copy).
``host_wait_ms``
    Time the engine waited on a step's event on purpose (back-pressure: it keeps at most one step
    queued ahead of the running one; or nothing left to schedule until a request finishes).
``device_step_ms``
    CUDA-event time from the start of a step's device work to its end (on the CPU: the wall time
    of the synchronous forward).
``step_time_ms``
    Interval between the ends of consecutive steps on the device timeline.
``gpu_busy_fraction``
    ``sum(device_step_ms) / (end of the last step - start of the run)``.
``ttft_ms``
    From a request's arrival to the device-timeline end of the step that sampled its first token.
``throughput_tok_s``
    Prompt tokens / (end of the last step - start of the run), seconds; the median over repeats
    (robust to one disturbed run on a shared machine), with mean, min and max beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["METRIC_KEYS", "RunResult", "StepRecord", "percentile", "summarize"]


@dataclass(slots=True)
class StepRecord:
    """Host-side measurements of one step (device times are filled in after the run)."""

    num_reqs: int
    num_tokens: int
    num_context_tokens: int
    num_iterations: int
    metadata_bytes: int  # everything the step shipped (plan + engine arrays)
    plan_bytes: int  # chunk-plan part of it (incl. token_to_seq when shipped)
    largest_array_bytes: int
    token_to_seq_bytes: int  # 0 unless the variant ships vLLM-shaped tables
    host_prep_ms: float
    host_upload_ms: float
    host_launch_ms: float
    host_wait_ms: float = 0.0
    host_forward_ms_per_layer: float = float("nan")  # attention forward enqueue, mean per layer
    host_forward_gc_ms: float = 0.0  # of the forwards' host time (all layers): the collector's
    # launches run eagerly at a graph key's first sight in this step (all layers; a stand-in
    # replay does not count); None without +graphs
    graph_first_sights: int | None = None
    # latent rows the step's plan gathers and up-projects (below num_context_tokens where prefix
    # sharing reads shared rows once); None where not recorded
    num_gathered_rows: int | None = None
    device_start_ms: float = float("nan")  # on the run's device timeline
    device_end_ms: float = float("nan")


@dataclass(slots=True)
class RunResult:
    """One variant's run of the workload."""

    variant: str
    repeat: int
    steps: list[StepRecord]
    ttft_ms: np.ndarray  # [num_requests], arrival -> first token on the device timeline
    first_tokens: dict[int, int]
    prompt_tokens: int
    duration_ms: float  # start of run -> end of the last step (device timeline)
    wall_ms: float  # host wall time of the whole run loop
    truncated: bool = False  # stopped at a deadline before every request finished
    kernel_builds: int | None = None  # attention graphs built / kernels compiled during the run
    # MLAChunkedPrefill graphs (+graphs variants): CUDA graphs captured / replayed during the run
    graph_captures: int | None = None
    graph_replays: int | None = None
    graph_capture_ms: float | None = None  # host time of those captures (in forwards or idle)
    staging: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput_tok_s(self) -> float:
        return self.prompt_tokens / (self.duration_ms / 1e3)


def percentile(values: np.ndarray | list, q: float) -> float:
    """``q``-th percentile (0-100) of ``values``; NaN when there are none."""
    values = np.asarray(values, dtype=np.float64)
    return float(np.percentile(values, q)) if values.size else float("nan")





# Keys every variant's "metrics" dict has (the JSON contract; tests check all are present).
METRIC_KEYS = (
    "throughput_tok_s", "throughput_tok_s_mean", "throughput_tok_s_min", "throughput_tok_s_max",
    "throughput_tok_s_per_repeat",
    "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99",
    "host_plan_upload_ms_p50", "host_plan_upload_ms_p99",
    "host_prep_ms_p50", "host_prep_ms_p99",
    "host_blocked_ms_p50", "host_blocked_ms_p99", "host_blocked_ms_max", "host_blocked_ms_mean",
    "host_blocked_ms_total_per_run", "host_blocked_steps_over_1ms_fraction",
    "host_launch_ms_p50", "host_launch_ms_p99", "host_wait_ms_total_per_run",
    "host_forward_ms_per_layer_p50", "host_forward_ms_per_layer_p99",
    "host_forward_gc_ms_total_per_run", "host_forward_gc_steps_fraction", "kernel_builds_per_run",
    "graph_captures_per_run", "graph_replays_per_run", "graph_capture_ms_per_run",
    "graph_first_sight_steps_per_run", "graph_replay_only_host_forward_ms_per_layer_p99",
    "gpu_busy_fraction", "device_step_ms_p50", "step_time_ms_p50", "step_time_ms_p99",
    "metadata_bytes_p50", "metadata_bytes_max", "plan_bytes_p50", "plan_bytes_max",
    "token_to_seq_bytes_max",
    "steps_over_3mib_fraction", "iterations_p50", "iterations_max", "iterations_total_per_run",
    "gathered_rows_per_context_token",
    "num_steps_per_run", "num_requests_per_run", "prompt_tokens_per_run", "repeats",
    "staging_arenas_grown", "staging_stalls", "truncated_runs",
)


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    """Aggregate the repeats of one variant into the metrics dict (keys: :data:`METRIC_KEYS`).

    Percentiles pool the steps / requests of all repeats; throughput is the median over repeats
    with its mean, min and max.
    """
    if not runs:
        raise ValueError("summarize: no runs to summarize.")
    steps = [s for r in runs for s in r.steps]

    def col(name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in steps], dtype=np.float64)

    prep, upload, launch = col("host_prep_ms"), col("host_upload_ms"), col("host_launch_ms")
    dev = col("device_end_ms") - col("device_start_ms")
    meta, t2s = col("metadata_bytes"), col("token_to_seq_bytes")
    periods = np.concatenate([np.diff(np.array([s.device_end_ms for s in r.steps]))
                              for r in runs])
    busy = [sum(s.device_end_ms - s.device_start_ms for s in r.steps) / r.duration_ms
            for r in runs]
    tput = np.array([r.throughput_tok_s for r in runs])
    ttft = np.concatenate([r.ttft_ms for r in runs])
    ttft_mean = float(ttft.mean()) if ttft.size else float("nan")
    n = len(runs)
    first = (None if any(s.graph_first_sights is None for s in steps)
             else np.array([s.graph_first_sights for s in steps]))
    return {
        "throughput_tok_s": float(np.median(tput)),
        "throughput_tok_s_mean": float(tput.mean()),
        "throughput_tok_s_min": float(tput.min()),
        "throughput_tok_s_max": float(tput.max()),
        "throughput_tok_s_per_repeat": [float(t) for t in tput],
        "ttft_ms_mean": ttft_mean,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p99": percentile(ttft, 99),
        "host_plan_upload_ms_p50": percentile(prep + upload, 50),
        "host_plan_upload_ms_p99": percentile(prep + upload, 99),
        "host_prep_ms_p50": percentile(prep, 50),
        "host_prep_ms_p99": percentile(prep, 99),
        "host_blocked_ms_p50": percentile(upload, 50),
        "host_blocked_ms_p99": percentile(upload, 99),
        "host_blocked_ms_max": float(upload.max()),
        "host_blocked_ms_mean": float(upload.mean()),
        "host_blocked_ms_total_per_run": float(upload.sum() / n),
        "host_blocked_steps_over_1ms_fraction": float(np.mean(upload > 1.0)),
        "host_launch_ms_p50": percentile(launch, 50),
        "host_launch_ms_p99": percentile(launch, 99),
        "host_wait_ms_total_per_run": float(col("host_wait_ms").sum() / n),
        "host_forward_ms_per_layer_p50": percentile(col("host_forward_ms_per_layer"), 50),
        "host_forward_ms_per_layer_p99": percentile(col("host_forward_ms_per_layer"), 99),
        # Python's garbage collector inside the timed forwards (part of the times above)
        "host_forward_gc_ms_total_per_run": float(col("host_forward_gc_ms").sum() / n),
        "host_forward_gc_steps_fraction": float(np.mean(col("host_forward_gc_ms") > 0)),
        # None where the backend cannot count its builds
        "kernel_builds_per_run": [r.kernel_builds for r in runs],
        # None without iteration graphs (variants without +graphs)
        "graph_captures_per_run": [r.graph_captures for r in runs],
        "graph_replays_per_run": [r.graph_replays for r in runs],
        "graph_capture_ms_per_run": [r.graph_capture_ms for r in runs],
        # steps that ran some launch eagerly (a shape met for the first time that no graph of
        # bigger buckets could stand in for), and the forward's host p99 over the other steps
        # (every launch a replay); None without graphs
        "graph_first_sight_steps_per_run": [
            None if first is None else int(sum(1 for s in r.steps if s.graph_first_sights))
            for r in runs],
        "graph_replay_only_host_forward_ms_per_layer_p99": None if first is None else percentile(
            col("host_forward_ms_per_layer")[first == 0], 99),
        "gpu_busy_fraction": float(np.mean(busy)),
        "device_step_ms_p50": percentile(dev, 50),
        "step_time_ms_p50": percentile(periods, 50),
        "step_time_ms_p99": percentile(periods, 99),
        "metadata_bytes_p50": percentile(meta, 50),
        "metadata_bytes_max": float(meta.max()),
        "plan_bytes_p50": percentile(col("plan_bytes"), 50),
        "plan_bytes_max": float(col("plan_bytes").max()),
        "token_to_seq_bytes_max": float(t2s.max()),
        "steps_over_3mib_fraction": float(np.mean(col("largest_array_bytes") >= 3 * 2**20)),
        "iterations_p50": percentile(col("num_iterations"), 50),
        "iterations_max": float(col("num_iterations").max()),
        "iterations_total_per_run": float(col("num_iterations").sum() / n),
        # rows gathered + up-projected over the steps' context tokens (< 1: prefix sharing)
        "gathered_rows_per_context_token": float(
            col("num_gathered_rows").sum() / max(col("num_context_tokens").sum(), 1))
        if all(s.num_gathered_rows is not None for s in steps) else None,
        "num_steps_per_run": len(steps) / n,
        "num_requests_per_run": float(np.mean([r.ttft_ms.size for r in runs])),
        "prompt_tokens_per_run": float(np.mean([r.prompt_tokens for r in runs])),
        "repeats": n,
        "staging_arenas_grown": int(sum(r.staging.get("arenas_grown", 0) for r in runs)),
        "staging_stalls": int(sum(r.staging.get("stalls", 0) for r in runs)),
        "truncated_runs": int(sum(r.truncated for r in runs)),
    }


def step_series(run: RunResult) -> dict[str, list[float]]:
    """Per-step series of one run for plots/JSON: upload (blocked) ms, metadata bytes, device
    time, and the attention forward's host time per layer beside the step's context
    iterations (what that host time grows with)."""
    return {
        "host_blocked_ms": [s.host_upload_ms for s in run.steps],
        "metadata_bytes": [s.metadata_bytes for s in run.steps],
        "plan_bytes": [s.plan_bytes for s in run.steps],
        "device_step_ms": [s.device_end_ms - s.device_start_ms for s in run.steps],
        "host_forward_ms_per_layer": [s.host_forward_ms_per_layer for s in run.steps],
        "host_forward_gc_ms": [s.host_forward_gc_ms for s in run.steps],
        "iterations": [s.num_iterations for s in run.steps],
        "graph_first_sights": [s.graph_first_sights for s in run.steps],
    }
