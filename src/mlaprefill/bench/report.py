"""Bench report: the printed table, the JSON document and the PNG figure."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

from mlaprefill._env import machine_info

__all__ = ["MIN_MEASURED_STEPS", "TABLE_WIDTH", "annotate", "format_table", "machine_info",
           "noise_note", "plot_title", "truncation_reason", "vs_baseline_pct", "within_noise",
           "wrap", "write_json", "write_png"]

#: A variant whose measured runs made fewer steps than this (on average per run), or finished no
#: request, has no result: the table flags it ``truncated`` and prints no percentage for it, the
#: JSON says ``truncated: true`` with the reason and stores null percentages, the PNG hatches it.
#: Fewer steps are mostly the ramp-up (the first steps hold no context) of a run cut short.
MIN_MEASURED_STEPS = 8

#: Columns the default table and the printed notes fit in (``--wide``: every column).
TABLE_WIDTH = 100


def wrap(text: str, width: int = TABLE_WIDTH, indent: str = "  ") -> str:
    """``text`` wrapped to ``width`` columns, continuation lines indented by ``indent``."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def truncation_reason(variant: dict[str, Any]) -> str | None:
    """Why ``variant`` (a document's ``variants`` entry) has no result, or None if it has one:
    its runs finished no request, or measured fewer than :data:`MIN_MEASURED_STEPS` steps."""
    m = variant["metrics"]
    steps, done = m.get("num_steps_per_run", 0), m.get("num_requests_per_run", 0)
    if not done:
        return f"finished no request ({steps:g} measured steps per run)"
    if steps < MIN_MEASURED_STEPS:
        return f"measured {steps:g} steps per run, fewer than {MIN_MEASURED_STEPS}"
    return None


def vs_baseline_pct(doc: dict[str, Any], variant: dict[str, Any], key: str) -> float | None:
    """``variant``'s metric ``key`` relative to the first (baseline) variant's, in percent; None
    when either has no result (:func:`truncation_reason`) or a value is missing or not finite."""
    rows = doc["variants"]
    if not rows or truncation_reason(rows[0]) or truncation_reason(variant):
        return None
    value, base = variant["metrics"].get(key), rows[0]["metrics"].get(key)
    if not (_finite(value) and _finite(base)) or not base:
        return None
    return (value / base - 1) * 100


def annotate(doc: dict[str, Any]) -> dict[str, Any]:
    """Add to every variant of ``doc`` (in place; returned) ``truncated`` (bool),
    ``truncated_reason`` (str or None), ``throughput_vs_baseline_pct`` and
    ``ttft_vs_baseline_pct`` (None without a result), and ``min_measured_steps`` to ``doc``."""
    doc["min_measured_steps"] = MIN_MEASURED_STEPS
    for v in doc["variants"]:
        why = truncation_reason(v)
        v["truncated"] = why is not None
        v["truncated_reason"] = why
        v["throughput_vs_baseline_pct"] = vs_baseline_pct(doc, v, "throughput_tok_s")
        v["ttft_vs_baseline_pct"] = vs_baseline_pct(doc, v, "ttft_ms_mean")
    return doc


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:+.1f}%"


def _num(x: Any, fmt: str, scale: float = 1.0) -> str:
    """``x / scale`` formatted, ``-`` for a missing or non-finite value (never ``nan``)."""
    return f"{x / scale:{fmt}}" if _finite(x) else "-"


def _si(x: Any) -> str:
    """Compact count: 5340, 228.3k, 1.25M."""
    if not _finite(x):
        return "-"
    a = abs(x)
    return f"{x:.0f}" if a < 1e4 else f"{x / 1e3:.1f}k" if a < 1e6 else f"{x / 1e6:.2f}M"


def _rel(doc: dict[str, Any], v: dict[str, Any], key: str) -> str:
    return _pct(vs_baseline_pct(doc, v, key))


# (header, unit, width, value of a variant entry v of the document d); headers are unique and
# hold no double space, so columns split on runs of two spaces.
_Column = tuple[str, str, int, Any]
_WIDE: tuple[_Column, ...] = (
    ("tok/s", "", 9, lambda v, d: _num(v["metrics"]["throughput_tok_s"], ".0f")),
    ("tok/s vs 1st", "", 12, lambda v, d: _rel(d, v, "throughput_tok_s")),
    ("TTFT mean", "s", 9, lambda v, d: _num(v["metrics"]["ttft_ms_mean"], ".2f", 1e3)),
    ("TTFT p50", "s", 8, lambda v, d: _num(v["metrics"]["ttft_ms_p50"], ".2f", 1e3)),
    ("TTFT p99", "s", 8, lambda v, d: _num(v["metrics"]["ttft_ms_p99"], ".2f", 1e3)),
    ("TTFT vs 1st", "", 11, lambda v, d: _rel(d, v, "ttft_ms_mean")),
    ("plan+up p50", "ms", 11, lambda v, d: _num(v["metrics"]["host_plan_upload_ms_p50"], ".3f")),
    ("plan+up p99", "ms", 11, lambda v, d: _num(v["metrics"]["host_plan_upload_ms_p99"], ".3f")),
    ("blocked p50", "ms", 11, lambda v, d: _num(v["metrics"]["host_blocked_ms_p50"], ".3f")),
    ("blocked p99", "ms", 11, lambda v, d: _num(v["metrics"]["host_blocked_ms_p99"], ".2f")),
    ("blocked max", "ms", 11, lambda v, d: _num(v["metrics"]["host_blocked_ms_max"], ".1f")),
    ("fwd host p99", "ms", 12,
     lambda v, d: _num(v["metrics"]["host_forward_ms_per_layer_p99"], ".3f")),
    ("builds", "", 6, lambda v, d: _builds(v["metrics"]["kernel_builds_per_run"])),
    ("captures", "", 8, lambda v, d: _builds(v["metrics"]["graph_captures_per_run"], none="-")),
    ("GPU busy", "", 8, lambda v, d: _num(v["metrics"]["gpu_busy_fraction"], ".3f")),
    ("step p50", "ms", 8, lambda v, d: _num(v["metrics"]["step_time_ms_p50"], ".2f")),
    ("meta max", "MiB", 8, lambda v, d: _num(v["metrics"]["metadata_bytes_max"], ".2f", 2**20)),
    ("steps", "/run", 5, lambda v, d: _num(v["metrics"]["num_steps_per_run"], ".0f")),
)
# The default table: what a reader compares first, within TABLE_WIDTH columns.
_COMPACT: tuple[_Column, ...] = (
    ("tok/s", "", 7, lambda v, d: _si(v["metrics"]["throughput_tok_s"])),
    ("vs 1st", "", 7, lambda v, d: _rel(d, v, "throughput_tok_s")),
    ("TTFT", "mean s", 6, lambda v, d: _num(v["metrics"]["ttft_ms_mean"], ".2f", 1e3)),
    ("blocked", "p99 ms", 7, lambda v, d: _num(v["metrics"]["host_blocked_ms_p99"], ".2f")),
    ("fwd host", "p99 ms", 8,
     lambda v, d: _num(v["metrics"]["host_forward_ms_per_layer_p99"], ".3f")),
    ("steps", "/run", 5, lambda v, d: _num(v["metrics"]["num_steps_per_run"], ".0f")),
)


def _builds(per_run: list[int | None], none: str = "?") -> str:
    """Kernel builds (or graph captures) in the measured runs: the largest per run, ``none``
    when not counted."""
    known = [n for n in per_run if n is not None]
    return str(max(known)) if known else none


def _columns(doc: dict[str, Any], *, wide: bool) -> tuple[_Column, ...]:
    # "GPU busy" means nothing on a CPU run (every step is synchronous there).
    cols = _WIDE if wide else _COMPACT
    if doc.get("ran_on") == "cpu":
        return tuple(c for c in cols if c[0] != "GPU busy")
    return cols


def within_noise(doc: dict[str, Any]) -> list[str] | None:
    """Variants whose throughput range (min-max over repeats) overlaps the first variant's.

    Their difference to the first variant is within the run-to-run spread: noise. None when a
    variant has fewer than 2 repeats (no spread measured). Variants without a result
    (:func:`truncation_reason`) are never listed.
    """
    rows = doc["variants"]
    if not rows or any(v["metrics"].get("repeats", 1) < 2 for v in rows):
        return None
    if truncation_reason(rows[0]):
        return []
    b = rows[0]["metrics"]
    return [v["name"] for v in rows[1:] if not truncation_reason(v)
            and v["metrics"]["throughput_tok_s_min"] <= b["throughput_tok_s_max"]
            and v["metrics"]["throughput_tok_s_max"] >= b["throughput_tok_s_min"]]


def noise_note(doc: dict[str, Any]) -> str | None:
    """One line on which differences are within run-to-run noise (None if there is nothing to
    say)."""
    rows = doc["variants"]
    if len(rows) < 2:
        return None
    same = within_noise(doc)
    if same is None:
        return ("note: one repeat per variant, so no run-to-run spread was measured; small "
                "differences may be noise (use --repeats 3 or more)")
    if not same:
        return None
    return (f"note: tok/s of {', '.join(same)} is within the run-to-run spread of "
            f"{rows[0]['name']} (min-max over repeats overlap): treat those differences as noise")


def truncation_note(doc: dict[str, Any]) -> str | None:
    """One line naming the variants without a result and why (None when every one has one)."""
    rows = doc["variants"]
    bad = [(v["name"], why) for v in rows if (why := truncation_reason(v))]
    if not bad:
        return None
    text = ("truncated (no result, no percentage): "
            + "; ".join(f"{n} {why}" for n, why in bad)
            + f". A result needs a finished request and >= {MIN_MEASURED_STEPS} measured steps "
              f"per run: raise --max-seconds (0 = no cap) or shrink the workload.")
    if truncation_reason(rows[0]):
        text += f" The baseline {rows[0]['name']} has none, so no variant gets a percentage."
    return text


def _flags(doc: dict[str, Any], v: dict[str, Any], noise: list[str] | None) -> str:
    if truncation_reason(v):
        return "truncated"
    flags = []
    if v["metrics"].get("truncated_runs"):
        flags.append("partial")
    if noise and v["name"] in noise:
        flags.append("~")
    return " ".join(flags)


def format_table(doc: dict[str, Any], *, wide: bool = False) -> str:
    """The result table (one row per variant; "vs 1st" columns relative to the first variant)
    and its notes.

    By default a few columns within :data:`TABLE_WIDTH` characters per line (longer variant
    names are cut with "…"); ``wide``: every column. Column headers are unique; "GPU busy" only
    for GPU runs (wide). The "flags" column: ``truncated`` (no result:
    :func:`truncation_reason`; no percentage), ``partial`` (a run hit --max-seconds; the metrics
    cover the steps that ran), ``~`` (tok/s within the run-to-run noise of the first variant).
    Missing or non-finite values print as ``-``.
    """
    rows = doc["variants"]
    cols = _columns(doc, wide=wide)
    noise = within_noise(doc)
    flags = [_flags(doc, v, noise) for v in rows]
    flag_w = max([5, *(len(f) for f in flags)])
    sep = "  "
    rest = sum(len(sep) + w for *_, w, _ in cols) + len(sep) + flag_w
    name_w = max([7, *(len(v["name"]) for v in rows)])
    if not wide:
        name_w = min(name_w, TABLE_WIDTH - rest)

    def name(n: str) -> str:
        return n if len(n) <= name_w else n[:name_w - 1] + "…"

    head = sep.join([f"{'variant':<{name_w}}", *(f"{h:>{w}}" for h, _, w, _ in cols),
                     f"{'flags':<{flag_w}}"])
    units = sep.join([f"{'':<{name_w}}", *(f"{u:>{w}}" for _, u, w, _ in cols)])
    lines = [head.rstrip(), units.rstrip(), "-" * len(head.rstrip())]
    for v, fl in zip(rows, flags, strict=True):
        cells = [f"{name(v['name']):<{name_w}}", *(f"{f(v, doc):>{w}}" for *_, w, f in cols),
                 fl]
        lines.append(sep.join(cells).rstrip())
    notes = [truncation_note(doc)]
    partial = [v["name"] for v in rows
               if v["metrics"].get("truncated_runs") and not truncation_reason(v)]
    if partial:
        notes.append(f"partial: runs of {', '.join(partial)} hit --max-seconds and were "
                     f"truncated (metrics cover the steps that ran)")
    notes.append(noise_note(doc))
    lines += [wrap(n, width=10**6 if wide else TABLE_WIDTH) for n in notes if n]
    return "\n".join(lines)


def plot_title(doc: dict[str, Any]) -> str:
    """The figure's title: scenario, device (name and type), configuration."""
    cfg = doc.get("config", {})
    mach = doc.get("machine", {})
    device = f"{mach.get('device_name') or 'unknown device'} ({doc.get('ran_on', '?')})"
    title = (f"mlaprefill bench — scenario {doc.get('scenario')} on {device} | "
             f"{cfg.get('preset')} tp{cfg.get('tp')} x{cfg.get('num_layers')} layers, "
             f"{cfg.get('num_requests')} x {cfg.get('prompt_len')} tok, budget "
             f"{cfg.get('token_budget')}, W={cfg.get('workspace_tokens')}, share "
             f"{cfg.get('share')}")
    cut = [v["name"] for v in doc.get("variants", []) if truncation_reason(v)]
    if cut:
        title += f"\nTRUNCATED: {', '.join(cut)} without a result (hatched; no percentage)"
    if doc.get("ran_on") == "cpu":
        title += "\nCPU run: every transfer mode is a plain copy here (no pageable stall)"
    return title


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=_json_default)
        f.write("\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_png(doc: dict[str, Any], path: Path) -> str | None:
    """Draw throughput, TTFT and per-step host-blocked time per variant.

    Returns None on success, else a message saying why no PNG was written (no matplotlib).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; skipped the PNG (pip install matplotlib)."
    rows = doc["variants"]
    names = [v["name"] for v in rows]
    x = list(range(len(rows)))
    colors = [f"C{i}" for i in x]
    cut = [truncation_reason(v) is not None for v in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    tput = [_or0(v["metrics"]["throughput_tok_s"]) for v in rows]
    pairs = list(zip(tput, rows, strict=True))
    lo = [t - _or0(v["metrics"]["throughput_tok_s_min"], t) for t, v in pairs]
    hi = [_or0(v["metrics"]["throughput_tok_s_max"], t) - t for t, v in pairs]
    bars = ax.bar(x, tput, color=colors, yerr=[lo, hi], capsize=4)
    _hatch_truncated(bars, cut)
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("prompt tokens / s (median, min-max over repeats)")
    noise = within_noise(doc)
    ax.set_title("throughput (% vs first variant" + ("; ~ = within noise)" if noise else ")"))
    for i, (t, v) in enumerate(zip(tput, rows, strict=True)):
        mark = " ~" if noise and names[i] in noise else ""
        label = ("TRUNCATED\nno result" if cut[i] else
                 f"{t:.0f}\n{_pct(vs_baseline_pct(doc, v, 'throughput_tok_s'))}{mark}")
        ax.annotate(label, (i, t + hi[i]), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8, color="red" if cut[i] else "black")
    if tput and max(tput) > 0:
        ax.set_ylim(0, max(hi_ + t for hi_, t in zip(hi, tput, strict=True)) * 1.2)
    ax = axes[1]
    w = 0.38
    mean = [_or0(v["metrics"]["ttft_ms_mean"]) / 1e3 for v in rows]
    p99 = [_or0(v["metrics"]["ttft_ms_p99"]) / 1e3 for v in rows]
    _hatch_truncated(ax.bar([i - w / 2 for i in x], mean, w, color=colors, label="mean"), cut)
    _hatch_truncated(ax.bar([i + w / 2 for i in x], p99, w, color=colors, alpha=0.5,
                            hatch="//", label="p99"), cut)
    for i, v in enumerate(rows):
        if not _finite(v["metrics"]["ttft_ms_mean"]):
            ax.annotate("no request\nfinished", (i, 0), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8,
                        color="red")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("time to first token")
    ax.legend()
    ax = axes[2]
    for i, v in enumerate(rows):
        series = v.get("step_series", {}).get("host_blocked_ms", [])
        ax.plot(range(len(series)), series, color=colors[i], lw=0.9,
                ls="--" if cut[i] else "-", marker="o" if len(series) < 2 else None,
                label=v["name"] + (" (truncated)" if cut[i] else ""))
    ax.set_yscale("log")
    ax.set_xlabel("step (first repeat)")
    ax.set_ylabel("upload wall time = host blocked (ms)")
    ax.set_title("host blocked per step")
    ax.legend(fontsize=8)
    fig.suptitle(plot_title(doc), fontsize=10)
    notes = [(n.removeprefix("note: "), color) for n, color in
             ((truncation_note(doc), "red"), (noise_note(doc), "black")) if n]
    for k, (text, color) in enumerate(notes):
        fig.text(0.5, 0.005 + 0.03 * (len(notes) - 1 - k), wrap(text, width=200, indent=""),
                 ha="center", va="bottom", fontsize=8, color=color)
    fig.tight_layout(rect=(0, 0.035 * len(notes), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _or0(x: Any, default: float = 0.0) -> float:
    """A plottable value: ``x``, or ``default`` where it is missing or not finite."""
    return float(x) if _finite(x) else default


def _hatch_truncated(bars: Any, cut: list[bool]) -> None:
    """Cross-hatch and fade the bars of variants without a result."""
    for bar, c in zip(bars, cut, strict=True):
        if c:
            bar.set_hatch("xx")
            bar.set_alpha(0.35)
            bar.set_edgecolor("red")
