"""Bench report: the printed table, the JSON document and the PNG figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlaprefill._env import machine_info

__all__ = ["format_table", "machine_info", "noise_note", "plot_title", "within_noise",
           "write_json", "write_png"]


def _rel(value: float, base: float) -> str:
    if not base or base != base or value != value:
        return "n/a"
    return f"{(value / base - 1) * 100:+.1f}%"


# (header, unit, width, value of a variant's metrics m given the base metrics b); headers are
# unique and hold no double space, so columns split on runs of two spaces.
_Column = tuple[str, str, int, Any]
_COLUMNS: tuple[_Column, ...] = (
    ("tok/s", "", 9, lambda m, b: f"{m['throughput_tok_s']:.0f}"),
    ("tok/s vs 1st", "", 12, lambda m, b: _rel(m["throughput_tok_s"], b["throughput_tok_s"])),
    ("TTFT mean", "s", 9, lambda m, b: f"{m['ttft_ms_mean'] / 1e3:.2f}"),
    ("TTFT p50", "s", 8, lambda m, b: f"{m['ttft_ms_p50'] / 1e3:.2f}"),
    ("TTFT p99", "s", 8, lambda m, b: f"{m['ttft_ms_p99'] / 1e3:.2f}"),
    ("TTFT vs 1st", "", 11, lambda m, b: _rel(m["ttft_ms_mean"], b["ttft_ms_mean"])),
    ("plan+up p50", "ms", 11, lambda m, b: f"{m['host_plan_upload_ms_p50']:.3f}"),
    ("plan+up p99", "ms", 11, lambda m, b: f"{m['host_plan_upload_ms_p99']:.3f}"),
    ("blocked p50", "ms", 11, lambda m, b: f"{m['host_blocked_ms_p50']:.3f}"),
    ("blocked p99", "ms", 11, lambda m, b: f"{m['host_blocked_ms_p99']:.2f}"),
    ("blocked max", "ms", 11, lambda m, b: f"{m['host_blocked_ms_max']:.1f}"),
    ("fwd host p99", "ms", 12, lambda m, b: f"{m['host_forward_ms_per_layer_p99']:.3f}"),
    ("builds", "", 6, lambda m, b: _builds(m["kernel_builds_per_run"])),
    ("captures", "", 8, lambda m, b: _builds(m["graph_captures_per_run"], none="-")),
    ("GPU busy", "", 8, lambda m, b: f"{m['gpu_busy_fraction']:.3f}"),
    ("step p50", "ms", 8, lambda m, b: f"{m['step_time_ms_p50']:.2f}"),
    ("meta max", "MiB", 8, lambda m, b: f"{m['metadata_bytes_max'] / 2**20:.2f}"),
)


def _builds(per_run: list[int | None], none: str = "?") -> str:
    """Kernel builds (or graph captures) in the measured runs: the largest per run, ``none``
    when not counted."""
    known = [n for n in per_run if n is not None]
    return str(max(known)) if known else none


def _columns(doc: dict[str, Any]) -> tuple[_Column, ...]:
    # "GPU busy" means nothing on a CPU run (every step is synchronous there).
    if doc.get("ran_on") == "cpu":
        return tuple(c for c in _COLUMNS if c[0] != "GPU busy")
    return _COLUMNS


def within_noise(doc: dict[str, Any]) -> list[str] | None:
    """Variants whose throughput range (min-max over repeats) overlaps the first variant's.

    Their difference to the first variant is within the run-to-run spread: noise. None when a
    variant has fewer than 2 repeats (no spread measured).
    """
    rows = doc["variants"]
    if not rows or any(v["metrics"].get("repeats", 1) < 2 for v in rows):
        return None
    b = rows[0]["metrics"]
    return [v["name"] for v in rows[1:]
            if v["metrics"]["throughput_tok_s_min"] <= b["throughput_tok_s_max"]
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


def format_table(doc: dict[str, Any]) -> str:
    """The result table (one row per variant; "vs 1st" columns relative to the first variant).

    Column headers are unique; "GPU busy" only for GPU runs.
    """
    rows = doc["variants"]
    base = rows[0]["metrics"] if rows else {}
    cols = _columns(doc)
    sep = "  "
    head = sep.join([f"{'variant':<20}", *(f"{h:>{w}}" for h, _, w, _ in cols)])
    units = sep.join([f"{'':<20}", *(f"{u:>{w}}" for _, u, w, _ in cols)])
    lines = [head, units, "-" * len(head)]
    for v in rows:
        m = v["metrics"]
        lines.append(sep.join([f"{v['name']:<20}", *(f"{f(m, base):>{w}}" for _, _, w, f in cols)]))
    trunc = [v["name"] for v in rows if v["metrics"].get("truncated_runs")]
    if trunc:
        lines.append(f"note: runs of {', '.join(trunc)} hit --max-seconds and were truncated "
                     f"(metrics cover the steps that ran)")
    note = noise_note(doc)
    if note:
        lines.append(note)
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
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    tput = [v["metrics"]["throughput_tok_s"] for v in rows]
    lo = [t - v["metrics"]["throughput_tok_s_min"] for t, v in zip(tput, rows, strict=True)]
    hi = [v["metrics"]["throughput_tok_s_max"] - t for t, v in zip(tput, rows, strict=True)]
    ax.bar(x, tput, color=colors, yerr=[lo, hi], capsize=4)
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("prompt tokens / s (median, min-max over repeats)")
    noise = within_noise(doc)
    ax.set_title("throughput (% vs first variant" + ("; ~ = within noise)" if noise else ")"))
    for i, t in enumerate(tput):
        mark = " ~" if noise and names[i] in noise else ""
        ax.annotate(f"{t:.0f}\n{(t / tput[0] - 1) * 100:+.1f}%{mark}", (i, t + hi[i]),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom",
                    fontsize=8)
    if tput:
        ax.set_ylim(0, max(hi_ + t for hi_, t in zip(hi, tput, strict=True)) * 1.2)
    ax = axes[1]
    w = 0.38
    mean = [v["metrics"]["ttft_ms_mean"] / 1e3 for v in rows]
    p99 = [v["metrics"]["ttft_ms_p99"] / 1e3 for v in rows]
    ax.bar([i - w / 2 for i in x], mean, w, color=colors, label="mean")
    ax.bar([i + w / 2 for i in x], p99, w, color=colors, alpha=0.5, hatch="//", label="p99")
    ax.set_xticks(x, names, rotation=20)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("time to first token")
    ax.legend()
    ax = axes[2]
    for i, v in enumerate(rows):
        series = v.get("step_series", {}).get("host_blocked_ms", [])
        ax.plot(range(len(series)), series, color=colors[i], lw=0.9, label=v["name"])
    ax.set_yscale("log")
    ax.set_xlabel("step (first repeat)")
    ax.set_ylabel("upload wall time = host blocked (ms)")
    ax.set_title("host blocked per step")
    ax.legend(fontsize=8)
    fig.suptitle(plot_title(doc), fontsize=10)
    note = noise_note(doc)
    if note:
        fig.text(0.5, 0.005, note.removeprefix("note: "), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
