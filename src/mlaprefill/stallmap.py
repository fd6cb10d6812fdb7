"""``mlaprefill stallmap``: where does a pageable ``non_blocking`` copy start to stall the host?

With about ``--queue-ms`` of GPU work queued (``torch.cuda._sleep``, calibrated to cycles), the
host times how long ``dst.copy_(src, non_blocking=True)`` blocks it, for host buffers from 4 KiB
to 64 MiB (powers of two plus a finer 1-4 MiB sweep, then a refinement between the largest size
that did not stall and the smallest that did), pageable vs pinned, ``--repeats`` times (median).
A size *stalls* when the median blocked time exceeds ``stall_fraction`` (0.5) of the measured
queued time. The smallest stalling pageable size is this platform's threshold: below it the bug
hides, above it every step waits for the previous step's kernels.

The measuring loop is separate from the device (:func:`run_sweep` takes a
``measure(size, mode) -> (blocked_ms, queued_ms)`` callable), so its logic is tested on CPU.
Without CUDA the command prints a message and exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mlaprefill._env import utc_now

__all__ = [
    "DEFAULT_SIZES",
    "CudaCopyTimer",
    "add_parser",
    "find_threshold",
    "format_table",
    "machine_info",
    "plot_stallmap",
    "run",
    "run_sweep",
]

KiB, MiB = 1024, 1024 * 1024
MODES = ("pageable", "pinned")
DEFAULT_SIZES: tuple[int, ...] = tuple(sorted(
    {(4 * KiB) << i for i in range(15)}  # 4 KiB .. 64 MiB
    | {int(m * MiB) for m in (1, 1.5, 2, 2.5, 3, 3.5, 4)}
))

Measure = Callable[[int, str], tuple[float, float]]


def _fmt_size(n: int) -> str:
    if n >= MiB and n % (MiB // 2) == 0:
        return f"{n / MiB:g} MiB"
    return f"{n / KiB:g} KiB"


# ---------------------------------------------------------------------------- sweep logic


def _measure_sizes(measure: Measure, sizes: Sequence[int], modes: Sequence[str], repeats: int,
                   samples: dict[tuple[int, str], list[tuple[float, float]]]) -> None:
    # Repeats outermost and modes interleaved, so clock/thermal drift hits every point alike.
    for _ in range(repeats):
        for size in sizes:
            for mode in modes:
                samples.setdefault((size, mode), []).append(measure(size, mode))


def _rows(samples: dict[tuple[int, str], list[tuple[float, float]]],
          stall_fraction: float) -> list[dict[str, Any]]:
    rows = []
    for (size, mode), vals in sorted(samples.items()):
        blocked = [b for b, _ in vals]
        queued = [q for _, q in vals]
        med, qmed = statistics.median(blocked), statistics.median(queued)
        rows.append({
            "size": size, "size_human": _fmt_size(size), "mode": mode,
            "blocked_ms": blocked, "median_ms": med, "min_ms": min(blocked),
            "max_ms": max(blocked), "queued_ms": qmed,
            "stalls": med > stall_fraction * qmed,
        })
    return rows


def find_threshold(rows: Sequence[dict[str, Any]], mode: str = "pageable") -> int | None:
    """Smallest size of ``mode`` whose median blocked time counts as a stall (None: never)."""
    stalling = [r["size"] for r in rows if r["mode"] == mode and r["stalls"]]
    return min(stalling) if stalling else None


def run_sweep(
    measure: Measure,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    stall_fraction: float = 0.5,
    refine_points: int = 6,
) -> dict[str, Any]:
    """Measure every (size, mode), find the pageable threshold and refine around it.

    Parameters
    ----------
    measure
        ``measure(size_bytes, mode) -> (blocked_ms, queued_ms)``: one timed copy with work
        queued; ``queued_ms`` is how much work was queued for that copy.
    sizes, modes, repeats
        The grid; each point is measured ``repeats`` times and summarized by its median.
    stall_fraction
        A point stalls when its median blocked time exceeds this fraction of the queued time.
    refine_points
        Extra sizes (4 KiB-aligned) measured between the largest non-stalling size below the
        threshold and the threshold; 0 disables refinement.

    Returns
    -------
    dict
        ``rows`` (one per size and mode: samples, median/min/max ms, queued ms, stalls),
        ``threshold_bytes`` (None when nothing stalled), ``threshold_human``,
        ``largest_clean_below_bytes``, ``non_monotonic_sizes`` (pageable sizes above the
        threshold that did not stall), ``pinned_stall_sizes``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
    _measure_sizes(measure, sorted(set(sizes)), modes, repeats, samples)
    rows = _rows(samples, stall_fraction)
    threshold = find_threshold(rows)
    if threshold is not None and refine_points > 0 and "pageable" in modes:
        below = [r["size"] for r in rows
                 if r["mode"] == "pageable" and r["size"] < threshold and not r["stalls"]]
        if below:
            lo = max(below)
            step = (threshold - lo) / (refine_points + 1)
            extra = {round((lo + step * (i + 1)) / (4 * KiB)) * 4 * KiB
                     for i in range(refine_points)} - {lo, threshold} - set(sizes)
            extra = {s for s in extra if lo < s < threshold}
            if extra:
                _measure_sizes(measure, sorted(extra), modes, repeats, samples)
                rows = _rows(samples, stall_fraction)
                threshold = find_threshold(rows)
    pageable = [r for r in rows if r["mode"] == "pageable"]
    below = [r["size"] for r in pageable
             if threshold is not None and r["size"] < threshold and not r["stalls"]]
    return {
        "rows": rows,
        "stall_fraction": stall_fraction,
        "threshold_bytes": threshold,
        "threshold_human": _fmt_size(threshold) if threshold is not None else None,
        "largest_clean_below_bytes": max(below) if below else None,
        "non_monotonic_sizes": [r["size"] for r in pageable
                                if threshold is not None and r["size"] > threshold
                                and not r["stalls"]],
        "pinned_stall_sizes": [r["size"] for r in rows if r["mode"] == "pinned" and r["stalls"]],
    }


def format_table(result: dict[str, Any]) -> str:
    """Blocked-ms table (median per size, both modes) with the threshold line last."""
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in result["rows"]:
        by_size.setdefault(r["size"], {})[r["mode"]] = r
    lines = [f"{'size':>10}  {'pageable ms':>12}  {'pinned ms':>10}  {'queued ms':>9}  stall"]
    for size in sorted(by_size):
        cell = by_size[size]
        pg, pn = cell.get("pageable"), cell.get("pinned")
        q = (pg or pn or {}).get("queued_ms", float("nan"))
        lines.append(
            f"{_fmt_size(size):>10}  "
            f"{pg['median_ms'] if pg else float('nan'):12.3f}  "
            f"{pn['median_ms'] if pn else float('nan'):10.3f}  {q:9.1f}  "
            + ("pageable" if pg and pg["stalls"] else "")
            + (" pinned" if pn and pn["stalls"] else "")
        )
    th = result["threshold_human"]
    lo = result.get("largest_clean_below_bytes")
    lines.append(
        f"threshold: pageable non_blocking copies stall from {th}"
        + (f" (largest clean size below it: {_fmt_size(lo)})" if lo else "")
        if th else "threshold: no pageable size stalled"
    )
    return "\n".join(lines)


def plot_stallmap(result: dict[str, Any], path: str, *, title: str = "") -> None:
    """PNG: median blocked ms vs copy size (log-log), both modes, threshold marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    floor = 1e-3
    for mode, color in (("pageable", "tab:red"), ("pinned", "tab:blue")):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        if not rows:
            continue
        xs = [r["size"] for r in rows]
        med = [max(r["median_ms"], floor) for r in rows]
        lo = [m - max(r["min_ms"], floor) for m, r in zip(med, rows, strict=True)]
        hi = [max(r["max_ms"], floor) - m for m, r in zip(med, rows, strict=True)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", ms=4, capsize=2, color=color,
                    label=f"{mode} (median, min-max)")
    queued = statistics.median(r["queued_ms"] for r in result["rows"])
    ax.axhline(queued, color="gray", ls=":", lw=1, label=f"queued work {queued:.0f} ms")
    ax.axhline(queued * result["stall_fraction"], color="gray", ls="--", lw=1,
               label="stall criterion")
    if result["threshold_bytes"] is not None:
        ax.axvline(result["threshold_bytes"], color="black", lw=1.2,
                   label=f"threshold {result['threshold_human']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = [s for s in DEFAULT_SIZES if (s & (s - 1)) == 0][::2]
    ax.set_xticks(ticks, [_fmt_size(t) for t in ticks], rotation=30)
    ax.set_xlabel("host buffer size (non_blocking H2D copy)")
    ax.set_ylabel("host blocked in copy_ (ms)")
    ax.set_title(title or "Host time blocked by a non_blocking H2D copy with work queued")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- CUDA side


def machine_info() -> dict[str, Any]:
    """The machine of a stall map: :func:`mlaprefill._env.machine_info` of the current CUDA
    device (the CPU without CUDA); best effort, never raises."""
    import torch

    from mlaprefill._env import machine_info as env_machine_info

    cuda = torch.cuda.is_available()
    return env_machine_info(torch.device("cuda", torch.cuda.current_device()) if cuda
                            else torch.device("cpu"))


class CudaCopyTimer:
    """``measure(size, mode)`` on a CUDA device: queue ~``queue_ms`` of work, time one copy.

    Synchronizes before each measurement (so only the intended work is queued) and after it.
    The queued work is one ``torch.cuda._sleep`` kernel calibrated to clock cycles; its actual
    duration is measured with CUDA events and returned as ``queued_ms``.
    """

    def __init__(self, queue_ms: float, device: str | None = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device or "cuda")
        self.queue_ms = queue_ms
        self._buffers: dict[tuple[int, str], tuple[Any, Any]] = {}
        self.cycles_per_ms = self._calibrate()
        self.cycles = max(1, int(queue_ms * self.cycles_per_ms))

    def _sleep_ms(self, cycles: int) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def _calibrate(self) -> float:
        with self.torch.cuda.device(self.device):
            self._sleep_ms(1_000_000)  # warm-up (module load, clocks)
            probe = 10_000_000
            ms = statistics.median(self._sleep_ms(probe) for _ in range(3))
        return probe / ms

    def _pair(self, size: int, mode: str) -> tuple[Any, Any]:
        key = (size, mode)
        pair = self._buffers.get(key)
        if pair is None:
            torch = self.torch
            src = torch.empty(size, dtype=torch.uint8, pin_memory=(mode == "pinned"))
            src.fill_(1)  # touch every page: no first-touch faults inside the timed copy
            dst = torch.empty(size, dtype=torch.uint8, device=self.device)
            pair = self._buffers[key] = (src, dst)
        return pair

    def warmup(self, sizes: Sequence[int] = (4 * KiB, MiB)) -> None:
        for size in sizes:
            for mode in MODES:
                src, dst = self._pair(size, mode)
                dst.copy_(src, non_blocking=True)
        self.torch.cuda.synchronize(self.device)

    def __call__(self, size: int, mode: str) -> tuple[float, float]:
        torch = self.torch
        src, dst = self._pair(size, mode)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            start.record()
            torch.cuda._sleep(self.cycles)
            end.record()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
        return (t1 - t0) * 1e3, start.elapsed_time(end)


# ---------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stallmap", help="measure from which size a pageable non_blocking H2D copy stalls",
        description=re.sub(r":\w+:`([^`]*)`", r"\1", __doc__.split("\n\n")[1]).replace("``", ""))
    p.add_argument("--queue-ms", type=float, default=50.0,
                   help="GPU work queued before each copy, ms (default 50)")
    p.add_argument("--repeats", type=int, default=5, help="measurements per point (median)")
    p.add_argument("--stall-fraction", type=float, default=0.5,
                   help="stall = median blocked time > this fraction of the queued time")
    p.add_argument("--device", default="cuda", help="CUDA device (default cuda)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG plot")
    return p


def stallmap(*, queue_ms: float = 50.0, repeats: int = 5, stall_fraction: float = 0.5,
             device: str = "cuda", sizes: Sequence[int] = DEFAULT_SIZES) -> dict[str, Any]:
    """Measure the stall map on a CUDA device; returns the :func:`run_sweep` result plus
    ``machine``, ``command``, ``date_utc``, ``queue_ms``, ``repeats``, ``cycles_per_ms`` and
    ``wall_s``. Needs CUDA."""
    t0 = time.perf_counter()
    timer = CudaCopyTimer(queue_ms, device)
    timer.warmup()
    result = run_sweep(timer, sizes=sizes, repeats=repeats, stall_fraction=stall_fraction)
    return {
        "machine": machine_info(),
        "command": list(sys.argv),
        "date_utc": utc_now(),
        "queue_ms": queue_ms,
        "repeats": repeats,
        "cycles_per_ms": timer.cycles_per_ms,
        **result,
        "wall_s": time.perf_counter() - t0,
    }


def _validate(args: argparse.Namespace) -> str | None:
    if not (math.isfinite(args.queue_ms) and args.queue_ms > 0):
        return f"--queue-ms must be a positive number of milliseconds, got {args.queue_ms}"
    if args.repeats < 1:
        return f"--repeats must be >= 1, got {args.repeats}"
    if not 0 < args.stall_fraction < 1:
        return f"--stall-fraction must be in (0, 1), got {args.stall_fraction}"
    return None


def run(args: argparse.Namespace) -> int:
    error = _validate(args)
    if error:
        print(f"mlaprefill stallmap: error: {error}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("mlaprefill stallmap: needs a CUDA device (torch.cuda.is_available() is False); "
              "the stall threshold is a property of the GPU, driver and host, so run this "
              "on the machine you want to map.", file=sys.stderr)
        return 2
    result = stallmap(queue_ms=args.queue_ms, repeats=args.repeats,
                      stall_fraction=args.stall_fraction, device=args.device)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    if args.plot:
        m = result["machine"]
        plot_stallmap(result, args.plot,
                      title=f"{m.get('device_name', '')}, driver {m.get('driver')}, "
                            f"torch {m['torch']}: {args.queue_ms:g} ms queued")
    print(f"{result['machine'].get('device_name')}  queued {args.queue_ms:g} ms  repeats "
          f"{args.repeats}  ({result['wall_s']:.1f} s)")
    print(format_table(result))
    return 0
