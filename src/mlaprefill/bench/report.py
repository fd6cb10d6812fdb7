"""Bench report: the printed table, the JSON document and the PNG figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlaprefill._env import machine_info

__all__ = ["format_table", "machine_info", "write_json", "write_png"]


def _rel(value: float, base: float) -> str:
    if not base or base != base or value != value:
        return "   n/a"
    return f"{(value / base - 1) * 100:+6.1f}%"


def format_table(doc: dict[str, Any]) -> str:
    """The result table (one row per variant; % columns relative to the first variant)."""
    rows = doc["variants"]
    base = rows[0]["metrics"] if rows else {}
    head = (f"{'variant':<20} {'tok/s':>9} {'vs base':>7} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
            f"{'vs base':>7} {'plan+up p50':>11} {'p99':>7} {'blocked p50':>11} {'p99':>7} "
            f"{'max':>7} {'GPU busy':>8} {'step p50':>8} {'meta max':>8}")
    units = (f"{'':<20} {'':>9} {'':>7} {'s':>9} {'s':>7} {'s':>7} {'':>7} {'ms':>11} {'ms':>7} "
             f"{'ms':>11} {'ms':>7} {'ms':>7} {'':>8} {'ms':>8} {'MiB':>8}")
    lines = [head, units, "-" * len(head)]
    for v in rows:
        m = v["metrics"]
        lines.append(
            f"{v['name']:<20} {m['throughput_tok_s']:>9.0f} "
            f"{_rel(m['throughput_tok_s'], base['throughput_tok_s']):>7} "
            f"{m['ttft_ms_mean'] / 1e3:>9.2f} {m['ttft_ms_p50'] / 1e3:>7.2f} "
            f"{m['ttft_ms_p99'] / 1e3:>7.2f} {_rel(m['ttft_ms_mean'], base['ttft_ms_mean']):>7} "
            f"{m['host_plan_upload_ms_p50']:>11.3f} {m['host_plan_upload_ms_p99']:>7.3f} "
            f"{m['host_blocked_ms_p50']:>11.3f} {m['host_blocked_ms_p99']:>7.2f} "
            f"{m['host_blocked_ms_max']:>7.1f} {m['gpu_busy_fraction']:>8.3f} "
            f"{m['step_time_ms_p50']:>8.2f} {m['metadata_bytes_max'] / 2**20:>8.2f}")
    trunc = [v["name"] for v in rows if v["metrics"].get("truncated_runs")]
    if trunc:
        lines.append(f"note: runs of {', '.join(trunc)} hit --max-seconds and were truncated "
                     f"(metrics cover the steps that ran)")
    return "\n".join(lines)


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
    ax.set_title("throughput (% vs first variant)")
    for i, t in enumerate(tput):
        ax.annotate(f"{t:.0f}\n{(t / tput[0] - 1) * 100:+.1f}%", (i, t + hi[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", va="bottom", fontsize=8)
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
    cfg = doc.get("config", {})
    mach = doc.get("machine", {})
    fig.suptitle(
        f"mlaprefill bench — scenario {doc.get('scenario')} on {mach.get('device_name')} | "
        f"{cfg.get('preset')} tp{cfg.get('tp')} x{cfg.get('num_layers')} layers, "
        f"{cfg.get('num_requests')} x {cfg.get('prompt_len')} tok, budget "
        f"{cfg.get('token_budget')}, W={cfg.get('workspace_tokens')}, share {cfg.get('share')}",
        fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
