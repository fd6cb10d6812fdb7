"""Generate docs/RESULTS.md (and the README's results block) from benchmarks/results/*.json.

``python benchmarks/results.py`` writes the document; ``--check`` exits 1 when the committed
document differs from what the JSON gives. Standard library only: no torch import. Every number
printed is computed from the JSON files; a file whose schema has no extractor is listed with its
top-level keys.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAX_CELL = 300

# Topic of a file: the first prefix that its name starts with (longest prefixes first).
TOPICS: list[tuple[str, str]] = [
    ("stallmap", "Pageable-copy stall map"),
    ("plan_upload", "Plan + upload cost"),
    ("attention_vs_ideal", "Whole forward vs ideal"),
    ("attention_variants", "Attention variants"),
    ("attention_h200", "Attention micro-benchmarks"),
    ("bench_stall", "End-to-end bench: stall"),
    ("bench_uneven", "End-to-end bench: uneven"),
    ("bench_vllm-default", "End-to-end bench: vllm-default"),
    ("bench_shared-prefix", "End-to-end bench: shared-prefix"),
    ("prefix_sharing", "Prefix sharing"),
    ("triton_attention", "Triton attention kernel"),
    ("gluon_attention", "Gluon attention kernel"),
    ("dcp", "Context parallelism (DCP)"),
    ("gpu_tests", "GPU test suite"),
    ("determinism", "Determinism"),
    ("cudnn_", "cuDNN probes"),
    ("forward_host_profile", "Forward host profile"),
    ("forward_profile", "Forward profile"),
    ("upproj", "Up-projection"),
    ("gather_gemm", "Gather fused into the up-projection (probe)"),
    ("audit_gpu", "Host-sync audit on the GPU"),
    ("joined_keys", "Joined keys"),
    ("fp8_attention", "FP8 context attention"),
    ("sustained_clocks", "Sustained load and clocks"),
    ("ncu_attention", "Kernel profiles (Nsight Compute)"),
    ("tile_", "Kernel variant probes"),
    ("fp8_", "FP8 latent cache"),
]


def topic_of(name: str) -> tuple[str, str]:
    for prefix, title in sorted(TOPICS, key=lambda t: -len(t[0])):
        if name.startswith(prefix):
            return prefix, title
    return "other", "Other"


def anchor(title: str) -> str:
    """GitHub's heading anchor for ``## title``."""
    slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    return slug


def _cell(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def _context(d: dict) -> str:
    rc = d.get("run_context", "")
    return rc if isinstance(rc, str) else json.dumps(rc, sort_keys=True)


def meta(d: dict) -> dict[str, str]:
    """command, machine, date, commit of one result file ('' where the file lacks it)."""
    rc = _context(d)
    cmd = d.get("command")
    if cmd is None and isinstance(d.get("argv"), list):
        cmd = d["argv"]
    if isinstance(cmd, list):
        cmd = " ".join(str(c) for c in cmd)
    if not cmd:
        m = re.search(r"`([^`]+)`", rc)
        cmd = m.group(1) if m else ""
    m = re.search(r"\bcommit ([0-9a-f]{7,40})\b", rc)
    commit = m.group(1) if m else ""
    mach = d.get("machine") if isinstance(d.get("machine"), dict) else {}
    m = re.search(r"lent (nvidia-h[12]00(?:-x\d)?)", rc)
    gpu = mach.get("device_name") or mach.get("gpu") or ""
    if not gpu and isinstance(d.get("device"), str):
        gpu = d["device"]
    machine = (m.group(1) + (f" ({gpu})" if gpu else "")) if m else gpu
    date = _date(d.get("date_utc") or d.get("date") or "")
    return {"command": cmd, "machine": machine, "date": date, "commit": commit}


# --- extractors: (data) -> (what, result) -----------------------------------------------------


def stall_threshold_kib(results_dir: Path = RESULTS_DIR) -> float:
    """Smallest pageable non_blocking copy (KiB) that blocked behind queued work.

    Measured in stallmap_h200.json; other docs and tests compare their stated figure to it.
    """
    d = json.loads((results_dir / "stallmap_h200.json").read_text())
    sizes = [r["size"] for r in d["rows"] if r["mode"] == "pageable" and r["stalls"]]
    return min(sizes) / 1024


def ex_stallmap(d: dict) -> tuple[str, str]:
    rows = d["rows"]
    stalled = [r for r in rows if r["mode"] == "pageable" and r["stalls"]]
    clean = [r for r in rows if r["mode"] == "pageable" and not r["stalls"]]
    pinned = [r for r in rows if r["mode"] == "pinned" and r["stalls"]]
    first = min(stalled, key=lambda r: r["size"])
    below = max((r for r in clean if r["size"] < first["size"]), key=lambda r: r["size"])
    res = (
        f"pageable non_blocking copies block from {first['size_human']} ({first['size']} B): "
        f"{_f(first['median_ms'], 1)} ms behind a {_f(d['queue_ms'], 0)} ms queue; "
        f"{below['size_human']} returns in {_f(below['median_ms'], 3)} ms; "
        f"pinned copies stalled at {len(pinned)} of {len(rows) - len(stalled) - len(clean)} sizes"
    )
    return "when a pageable H2D copy blocks the host", res


def _variant_label(v: dict) -> str:
    return f"{v['name']} [{v.get('attention_backend', '?')}]" if "@" not in v["name"] else v["name"]


def bench_numbers(d: dict) -> list[tuple[str, float, float]]:
    """(variant, tokens/s, ratio vs the run's baseline) per variant of one bench JSON."""
    tok = {v["name"]: v["metrics"]["throughput_tok_s"] for v in d["variants"]}
    base = tok.get(d.get("baseline", ""))
    return [
        (v["name"], tok[v["name"]], tok[v["name"]] / base if base else float("nan"))
        for v in d["variants"]
    ]


def ex_bench(d: dict) -> tuple[str, str]:
    labels = {v["name"]: _variant_label(v) for v in d["variants"]}
    parts = [f"{labels[n]}: {t / 1000:.1f}k tok/s ({r:.2f}x)" for n, t, r in bench_numbers(d)]
    what = f"{d['scenario']} scenario, tokens/s vs baseline {d.get('baseline')}"
    return what, "; ".join(parts)


def vs_ideal_numbers(d: dict) -> dict[str, tuple[float, float, int, int]]:
    """backend -> (min ratio, max ratio, shapes within 1.15x, shapes) of one vs-ideal JSON."""
    out: dict[str, list[float]] = {}
    for r in d["vs_ideal"]["rows"]:
        ratio = r.get("ratio_to_ideal")
        if ratio is None and r.get("ideal_ms"):
            ratio = r["forward_ms"] / r["ideal_ms"]
        if ratio is not None:
            out.setdefault(r["backend"], []).append(ratio)
    return {b: (min(v), max(v), sum(x <= 1.15 for x in v), len(v)) for b, v in sorted(out.items())}


def ex_vs_ideal(d: dict) -> tuple[str, str]:
    parts = [
        f"{b}: {lo:.2f}-{hi:.2f}x, {n}/{m} within 1.15x"
        for b, (lo, hi, n, m) in vs_ideal_numbers(d).items()
    ]
    return "forward_ms / ideal_ms per backend (ideal: one GEMM + cuDNN SDPA)", "; ".join(parts)


def ex_plan_upload(d: dict) -> tuple[str, str]:
    a = d["section_a_plan_upload_gpu_idle"]
    sp = [r["speedup_vs_vllm_style_median"] for r in a]
    ours = [r["ours_us_median"] for r in a]
    usual = [r["vllm_style_pinned_us_median"] for r in a]
    res = (
        f"plan+upload median {min(ours):.0f}-{max(ours):.0f} us vs the usual build "
        f"{min(usual):.0f}-{max(usual):.0f} us "
        f"({min(sp):.1f}-{max(sp):.1f}x faster, {len(a)} cases)"
    )
    return "host plan + metadata upload vs a vLLM-style pinned build", res


def ex_dcp(d: dict) -> tuple[str, str]:
    cases = d["cases"]
    bw = [c["all_gather_busbw_gbps"] for c in cases if "all_gather_busbw_gbps" in c]
    res = f"world {d['world']}, {len(cases)} cases, all match: {d['all_match']}"
    if bw:
        res += f"; all-gather bus bandwidth {min(bw):.0f}-{max(bw):.0f} GB/s"
    return "DCP forward vs single GPU", res


def _date(text: str) -> str:
    """'YYYY-MM-DD HH:MM' (UTC) from the date strings the files use ('~' and ranges dropped)."""
    m = re.search(r"(\d{4}-\d{2}-\d{2})[ T]~?(\d{2}:\d{2})", str(text))
    return f"{m.group(1)} {m.group(2)}" if m else str(text)


def _hash(text: str) -> str:
    m = re.match(r"\s*([0-9a-f]{7,40})\b", text)
    return m.group(1) if m else text


def ex_gpu_tests(d: dict) -> tuple[str, str]:
    last = d["runs"][-1]
    counts = ", ".join(f"{v} {k}" for k, v in sorted(last["counts"].items()) if v)
    res = f"{counts} at {_hash(last['commit'])}; {len(d['runs'])} runs recorded"
    return "pytest -m gpu (latest run)", res


def _kernel_kind(name: str) -> str:
    # what a profiled kernel's name says it is (forward_profile rows)
    low = name.lower()
    for kind, marks in (("attention", ("attention", "sdpa", "fmha", "flash")),
                        ("GEMM", ("nvjet", "gemm", "cutlass", "matmul")),
                        ("gather", ("gather",)), ("merge", ("merge",))):
        if any(m in low for m in marks):
            return kind
    return "other"


def ex_forward_profile(d: dict) -> tuple[str, str]:
    parts = []
    for r in d.get("rows", []):
        kinds: dict[str, float] = {}
        for k in r.get("kernels", []):
            kind = _kernel_kind(k["name"])
            kinds[kind] = kinds.get(kind, 0.0) + k["ms_per_forward"]
        split = ", ".join(f"{kind} {ms:.3f}" for kind, ms in
                          sorted(kinds.items(), key=lambda kv: -kv[1]))
        parts.append(f"H={r['heads']} {r['num_reqs']}x{r['query_len']}/{r['context_len']} "
                     f"{r['backend']}: {r['do_bench_ms']:.3f} ms ({split})")
    return "forward time per shape (do_bench) and device ms per kernel kind", "; ".join(parts)


def ex_generic(d: dict) -> tuple[str, str]:
    keys = [k for k in sorted(d) if k not in ("run_context", "machine", "argv", "command")]
    what = str(d.get("benchmark") or d.get("what") or "")
    return what[:120], "keys: " + ", ".join(keys)


def _range(xs: list[float], fmt: str = ".2f") -> str:
    return f"{min(xs):{fmt}}-{max(xs):{fmt}}"


def ex_kernel_configs(d: dict) -> tuple[str, str]:
    per: dict[str, list[float]] = {}
    for r in d["rows"]:
        for name, c in sorted((r.get("triton") or r.get("configs") or {}).items()):
            if isinstance(c, dict) and "tflops" in c:
                per.setdefault(name, []).append(c["tflops"])
    if not per:
        return ex_generic(d)
    best = max(per, key=lambda n: sum(per[n]) / len(per[n]))
    res = (
        f"{len(per)} configs over {len(d['rows'])} shapes; best mean {best}: "
        f"{_range(per[best], '.0f')} TFLOP/s"
    )
    return f"{d.get('benchmark')} configs, TFLOP/s per shape", res


def ex_upproj(d: dict) -> tuple[str, str]:
    rows = d["rows"]
    res = (
        f"device-rows GEMM {_range([r['ratio_vs_exact'] for r in rows])}x torch.mm; "
        f"torch._grouped_mm {_range([r['grouped_mm_ratio_vs_exact'] for r in rows])}x "
        f"({len(rows)} shapes)"
    )
    return "up-projection with the row count on the device vs torch.mm", res


def ex_joined_keys(d: dict) -> tuple[str, str]:
    g, a = d["gemm"], d["attention"]
    res = (
        f"joined-key GEMM (bmm) {_range([r['joined_bmm_over_split'] for r in g])}x the split GEMM "
        f"(layout before: {_range([r['joined_before_over_split'] for r in g])}x); "
        f"Triton attention {_range([r['triton_over_cudnn'] for r in a])}x cuDNN's time"
    )
    return "joined vs split keys: GEMM and attention", res


def ex_determinism(d: dict) -> tuple[str, str]:
    rows = d["rows"]
    res = f"{sum(r['bitwise'] for r in rows)}/{len(rows)} stages bitwise repeatable"
    before = d.get("before_fix", {}).get("rows")
    if before:
        res += f" (before the merge fix: {sum(r['bitwise'] for r in before)}/{len(before)})"
    return f"run-to-run repeatability, {d['shape']['runs']} runs", res


def ex_audit_gpu(d: dict) -> tuple[str, str]:
    checks = d["checks"]
    over = ", ".join(f"{o['device']} {o['overhead_us_per_op']:.1f} us/op" for o in d["overhead"])
    return "host-sync audit on real copies", (
        f"{sum(c['ok'] for c in checks)}/{len(checks)} checks as expected; overhead {over}"
    )


def ex_cudnn_padding(d: dict) -> tuple[str, str]:
    ratios: dict[str, list[float]] = {}
    for r in d["rows"]:
        exact = r["variants"]["exact"]["kernel_ms"]
        for name, v in sorted(r["variants"].items()):
            if name != "exact" and "kernel_ms" in v:
                ratios.setdefault(name, []).append(v["kernel_ms"] / exact)
    res = "; ".join(f"{n}: {_range(x)}x exact" for n, x in sorted(ratios.items()))
    return "cuDNN kernel time, padded/masked variants vs exact shapes", res


def ex_fp8_gather_sweep(d: dict) -> tuple[str, str]:
    g = d["gather"]["rows"]
    big = [r for r in g if r["bf16_ms"] >= 0.04]  # shapes past launch-bound sizes
    parts = []
    for fmt, key in (("fp8", "rows16_warps4_cols256"), ("fp8_ds_mla", "rows16_warps4_cols128"),
                     ("fp8", "rows16_warps4_cols64")):
        xs = [r[f"{fmt}_sweep_ms"][key] / r["bf16_ms"] for r in big]
        parts.append(f"{fmt} {key}: {_range(xs)}x")
    best = [r["fp8_sweep_best"][1] / r["bf16_ms"] for r in big]
    parts.append(f"fp8 best config {_range(best)}x ({len(big)} shapes >= 40 us)")
    return "gather + dequant tile sweep, time vs the bf16 gather in the same run", "; ".join(parts)


def ex_fp8_cache(d: dict) -> tuple[str, str]:
    g, f = d["gather"]["rows"], d["forward"]["rows"]
    parts = []
    for fmt in ("fp8", "fp8_ds_mla"):
        gr = [r[f"{fmt}_over_bf16"] for r in g]
        fr = [r[f"{fmt}_over_bf16"] for r in f]
        bit = all(r[f"{fmt}_bitwise"] for r in g)
        parts.append(f"{fmt}: gather {_range(gr)}x bf16's time (rows bitwise: {bit}), whole "
                     f"forward {_range(fr, '.3f')}x ({sum(x <= 1.0 for x in fr)}/{len(fr)} "
                     f"shapes <= 1.0)")
    return ("gather + dequant and the whole forward (graphs) per cache format, ratio to the "
            "bf16 cache in the same run"), "; ".join(parts)


def ex_sustained_clocks(d: dict) -> tuple[str, str]:
    parts = []
    for r in d.get("rows", []):
        k = r["kernels"]
        cells = []
        for name, res in k.items():
            clk = (res["sustained"].get("clocks") or {}).get("sm_mhz_min")
            cells.append(f"{name} {res['gapped']['ms']:.3f} -> {res['sustained']['ms']:.3f} ms"
                         + (f" (min {clk:.0f} MHz)" if clk else ""))
        ratio = "".join(f", ours/cudnn {r[f'ours_over_cudnn_{m}']:.3f} {m}"
                        for m in ("gapped", "sustained") if f"ours_over_cudnn_{m}" in r)
        parts.append(f"H={r['heads']} {r['num_seqs']}x{r['q_len']}/{r['k_len']}: "
                     + ", ".join(cells) + ratio)
    return ("context attention timed gapped (single replays, idle between) -> sustained "
            "(back-to-back replays), lowest SM clock sampled", "; ".join(parts))


def ex_fp8_attention(d: dict) -> tuple[str, str]:
    parts = []
    rows = d.get("kernel", [])
    fp8 = [r["fp8_over_bf16_throughput"] for r in rows if "fp8_over_bf16_throughput" in r]
    if fp8:
        tf = [r["kernels"]["fp8"]["tflops"] for r in rows if "fp8" in r["kernels"]]
        parts.append(f"fp8 kernel {_range(fp8)}x the bf16 kernel's throughput "
                     f"({_range(tf, '.0f')} TFLOP/s, {len(fp8)} shapes)")
    fp8g = [r["fp8_over_bf16_graph_throughput"] for r in rows
            if "fp8_over_bf16_graph_throughput" in r]
    if fp8g:
        tf = [r["graph"]["fp8"]["tflops"] for r in rows if "fp8_over_bf16_graph_throughput" in r]
        parts.append(f"graph replays: fp8 {_range(fp8g)}x bf16 ({_range(tf, '.0f')} TFLOP/s, "
                     f"{sum(x >= 1.4 for x in fp8g)}/{len(fp8g)} >= 1.4)")
    quant = [r["kernels"]["bf16"]["median_ms"] / r["kernels"]["fp8+quant"]["median_ms"]
             for r in rows if "median_ms" in r["kernels"].get("fp8+quant", {})]
    if quant:
        parts.append(f"with the quantizing pass {_range(quant)}x")
    cud = [r["kernels"]["bf16"]["median_ms"] / r["kernels"]["cudnn"]["median_ms"]
           for r in rows if "median_ms" in r["kernels"].get("cudnn", {})]
    if cud:
        parts.append(f"bf16 kernel time {_range(cud)}x cuDNN's")
    for part in ("context", "causal"):
        for key, how in (("bf16_over_cudnn_time", "eager"),
                         ("bf16_over_cudnn_graph_time", "graph replays")):
            ideal = [r[key] for r in d.get("ideal", []) if r["part"] == part and key in r]
            if ideal:
                parts.append(f"vs-ideal shapes, {part} part, {how}: bf16 kernel time "
                             f"{_range(ideal)}x cuDNN's ({sum(x <= 0.93 for x in ideal)}/"
                             f"{len(ideal)} <= 0.93)")
    chunk = [r["fp8_fused_over_bf16_time"] for r in d.get("chunk", [])
             if "fp8_fused_over_bf16_time" in r]
    if chunk:
        parts.append(f"a context step from latent rows (fused up-projection + FP8) "
                     f"{_range(chunk)}x the bf16 step's time ({len(chunk)} shapes)")
    acc = d.get("accuracy", [])
    if acc:
        for label in dict.fromkeys(r["inputs"] for r in acc):
            sel = [r for r in acc if r["inputs"] == label]
            parts.append(f"{label}: out RMSE bf16 {max(r['bf16']['out_rmse'] for r in sel):.1e} "
                         f"fp8 {max(r['fp8']['out_rmse'] for r in sel):.1e}")
    lat = d.get("accuracy_latent", [])
    if lat:
        parts.append(f"K/V from latent rows: out RMSE fp8 (amax scales) "
                     f"{max(r['fp8']['out_rmse'] for r in lat):.1e}, fused (bounds) "
                     f"{max(r['fp8_fused']['out_rmse'] for r in lat):.1e}")
    return "context attention per kernel (same run), FP8 accuracy vs float64", "; ".join(parts)


def _ncu_metric(k: dict, name: str) -> float:
    """One SpeedOfLight metric of a profiled launch: a percentage, or a duration in
    microseconds. Another unit is an error, not a number printed in the wrong one."""
    scale = {"%": 1.0, "ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    for key, v in k["metrics"].items():
        if key.startswith(f"GPU Speed Of Light Throughput: {name} ["):
            unit = key[key.rindex("[") + 1:-1]
            if unit not in scale:
                raise ValueError(f"ncu metric {key!r}: unit {unit!r} is not one of {sorted(scale)}")
            return v * scale[unit]
    raise KeyError(name)


def _l2_hit(k: dict) -> float | None:
    """A profiled launch's L2 hit rate (%), where its sections had it."""
    return k["metrics"].get("Memory Workload Analysis: L2 Hit Rate [%]")


def ex_ncu(d: dict) -> tuple[str, str]:
    cells = []
    for p in d["parts"]:
        ks = [("ours", p["ours"])] + [("cuDNN", k) for k in p["cudnn"]]
        part = "causal" if p["causal"] else f"ctx {p['k_len']}"
        cells.append(f"{p['heads']}h {p['num_seqs']}x{p['q_len']} {part}: " + ", ".join(
            f"{n} {_ncu_metric(k, 'Duration'):.0f} us "
            f"{_ncu_metric(k, 'Compute (SM) Throughput'):.0f}/"
            f"{_ncu_metric(k, 'DRAM Throughput'):.0f}"
            + (f" L2 hit {hit:.0f} %" if (hit := _l2_hit(k)) is not None else "") for n, k in ks))
    return ("one call per kernel under Nsight Compute: duration, SM / DRAM throughput (% of "
            "peak)"), "; ".join(cells)


def ex_tile_probe(d: dict) -> tuple[str, str]:
    cells = []
    for r in d["rows"]:
        part = "causal" if r["causal"] else f"ctx {r['k_len']}"
        ratios = ", ".join(f"{n} {_range(v)}" for n, v in r["over_cudnn"].items()
                           if n != "cudnn")
        cells.append(f"{r['heads']}h {r['num_seqs']}x{r['q_len']} {part}: {ratios}")
    return ("kernel variants (scripts/tile_cost_probe.py) under graphs: time / cuDNN's, per "
            "round"), "; ".join(cells)


def ex_gather_gemm(d: dict) -> tuple[str, str]:
    cells = []
    for r in d["rows"]:
        tf = r["tflops_best"]
        parts = []
        for prefix, base, ratios in (("fused", "gather+mm", r["over_gather_mm_best"]),
                                     ("tma", "mm", r.get("over_mm_best", {}))):
            got = [(v, k) for k, v in ratios.items() if k.startswith(prefix)]
            if got:
                best, name = min(got)
                parts.append(f"best {prefix} {_f(best)}x {base} ({tf[name]:.0f} against "
                             f"{tf[base]:.0f} TFLOP/s)")
        cells.append(f"{r['heads']}h {r['num_reqs']}x{r['rows_per_req']} rows: gather+mm "
                     f"{_f(r['over_gather_mm_best']['mm'] ** -1)}x mm; " + ", ".join(parts))
    return ("one iteration's gather + up-projection GEMM under graphs: a GEMM reading the paged "
            "cache (fused) against gather + cuBLAS, a persistent TMA GEMM (tma) against cuBLAS"
            ), "; ".join(cells)


def ex_prefix_sharing(d: dict) -> tuple[str, str]:
    rows = d["shapes"]["rows"]
    bound = [r["share_over_bound"] for r in rows]
    sixteen = [r["speedup_share_vs_noshare"] for r in rows
               if r["heads"] == 16 and r["shape"].startswith("issue")]
    none = [r["speedup_share_vs_noshare"] for r in rows if not r["shared"] and not r["doc_groups"]]
    plan = [r["plan_ms_median"] for r in d["plan_host"]["rows"] if r["shares_prefixes"]]
    parts = [f"forward {_range(bound)}x the bound ({len(rows)} rows, eager and graphs)",
             f"{_range(sixteen)}x faster than without sharing on the 16-head issue rows"]
    if none:
        parts.append(f"no sharing: {_range(none)}x")
    if plan:
        parts.append(f"plan of 64 requests x 2,048 blocks {_range(plan)} ms (median)")
    return "prefix sharing: forward vs a cuDNN lower bound and vs no sharing", "; ".join(parts)


EXTRACTORS: dict[str, Callable[[dict], tuple[str, str]]] = {
    "stallmap": ex_stallmap,
    "plan_upload": ex_plan_upload,
    "attention_vs_ideal": ex_vs_ideal,
    "bench_stall": ex_bench,
    "bench_uneven": ex_bench,
    "bench_vllm-default": ex_bench,
    "dcp": ex_dcp,
    "gpu_tests": ex_gpu_tests,
    "triton_attention": ex_kernel_configs,
    "gluon_attention": ex_kernel_configs,
    "upproj": ex_upproj,
    "gather_gemm": ex_gather_gemm,
    "joined_keys": ex_joined_keys,
    "determinism": ex_determinism,
    "audit_gpu": ex_audit_gpu,
    "cudnn_padding": ex_cudnn_padding,
    "fp8_cache": ex_fp8_cache,
    "fp8_attention": ex_fp8_attention,
    "sustained_clocks": ex_sustained_clocks,
    "ncu_attention": ex_ncu,
    "tile_": ex_tile_probe,
    "fp8_gather": ex_fp8_gather_sweep,
    "prefix_sharing": ex_prefix_sharing,
    "bench_shared-prefix": ex_bench,
    "fp8_bench": ex_bench,
    "forward_profile": ex_forward_profile,
}


def extractor(name: str) -> Callable[[dict], tuple[str, str]]:
    """The extractor of the longest EXTRACTORS prefix of a file name (ex_generic if none)."""
    hits = [k for k in EXTRACTORS if name.startswith(k)]
    return EXTRACTORS[max(hits, key=len)] if hits else ex_generic


def load(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(results_dir.glob("*.json"))}


def row(name: str, d: dict) -> dict[str, str]:
    prefix, _ = topic_of(name)
    what, result = extractor(name)(d)
    m = meta(d)
    if prefix == "gpu_tests":
        last = d["runs"][-1]
        m = {
            "command": last["command"],
            "machine": last["machine"],
            "date": last["when"],
            "commit": _hash(last["commit"]),
        }
    return {"file": name, "what": what, "result": result, **m}


def gpu_test_rows(name: str, d: dict) -> list[dict[str, str]]:
    """One row per recorded pytest -m gpu run of gpu_tests_h200.json."""
    out = []
    for i, run in enumerate(d["runs"], 1):
        counts = ", ".join(f"{v} {k}" for k, v in sorted(run["counts"].items()) if v)
        out.append(
            {
                "file": name,
                "what": f"pytest -m gpu, run {i} of {len(d['runs'])}",
                "result": counts,
                "command": run["command"],
                "machine": run["machine"],
                "date": _date(run["when"]),
                "commit": _hash(run["commit"]),
            }
        )
    return out


def rows_of(name: str, d: dict) -> list[dict[str, str]]:
    """The document's rows for one result file (one, except for the GPU test log)."""
    if topic_of(name)[0] == "gpu_tests":
        return gpu_test_rows(name, d)
    return [row(name, d)]


def _by_date(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: (r["date"], r["file"], r["what"]), reverse=True)


def hardware_line(data: dict[str, dict]) -> str:
    """The GPUs, lent machine kinds, drivers and software versions named in the files."""
    found: dict[str, set[str]] = {k: set() for k in ("gpu", "kind", "driver", "torch", "triton")}
    for d in data.values():
        mach = d.get("machine") if isinstance(d.get("machine"), dict) else {}
        for key, field in (
            ("gpu", "device_name"),
            ("gpu", "gpu"),
            ("driver", "driver"),
            ("torch", "torch"),
            ("triton", "triton"),
        ):
            if mach.get(field):
                found[key].add(str(mach[field]))
        found["kind"].update(re.findall(r"lent (nvidia-h200(?:-x\d)?)", _context(d)))
    return (
        f"{', '.join(sorted(found['gpu']))} (lent machines: {', '.join(sorted(found['kind']))}); "
        f"driver {', '.join(sorted(found['driver']))}; torch {', '.join(sorted(found['torch']))}; "
        f"Triton {', '.join(sorted(found['triton']))}"
    )


def render(results_dir: Path = RESULTS_DIR) -> str:
    data = load(results_dir)
    groups: dict[str, list[dict]] = {}
    for name, d in data.items():
        groups.setdefault(topic_of(name)[1], []).extend(rows_of(name, d))
    hardware = hardware_line(data)
    out = [
        "# mlaprefill — measured results",
        "",
        "Every measurement this project took on real GPUs: one row per result file (per",
        "recorded run for the GPU test log), newest first within a topic.",
        "Generated by `python benchmarks/results.py` from benchmarks/results/*.json; do not edit",
        "(`python benchmarks/results.py --check` fails when this file is stale).",
        "Rows from before the API's rename keep the names of their day: `hybrid` is today's",
        "`mlaprefill`, `varlen` today's `fa2`, `+graphs+static` today's `+graphs`.",
        "",
        "Hardware named in the files: " + hardware + ".",
        "",
    ]
    order = [t for _, t in TOPICS] + ["Other"]
    for title in [t for t in order if t in groups]:
        out += [
            f"## {title}",
            "",
            "| file | what | result | command | machine | date | commit |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in _by_date(groups[title]):
            cells = [
                f"[{r['file']}](../benchmarks/results/{r['file']})",
                r["what"],
                r["result"],
                f"`{_cell(r['command'])}`" if r["command"] else "",
                r["machine"],
                r["date"],
                r["commit"],
            ]
            out.append(
                "| " + " | ".join(_cell(c) if i != 3 else c for i, c in enumerate(cells)) + " |"
            )
        out.append("")
    return "\n".join(out)


def _latest(data: dict[str, dict], prefix: str, contains: str = "",
            section: str = "") -> tuple[str, dict] | None:
    """The newest result whose name starts with ``prefix`` and contains ``contains`` (and that
    holds ``section``, when given)."""
    hits = [
        (meta(d)["date"], n, d) for n, d in data.items()
        if n.startswith(prefix) and contains in n and (not section or section in d)
    ]
    if not hits:
        return None
    _, n, d = max(hits)
    return n, d


def summary_rows(results_dir: Path = RESULTS_DIR) -> list[tuple[str, str, str]]:
    """At most 7 (what, result, link) rows for the README's results summary (DCP and the GPU
    test log: docs/RESULTS.md). Only the H200's results: the README heads them "one NVIDIA H200",
    and a run on another card (an H100 the device tool lent instead) is listed in RESULTS.md."""
    data = {n: d for n, d in load(results_dir).items() if "H100" not in meta(d)["machine"]}
    rows: list[tuple[str, str, str]] = []

    def link(prefix: str) -> str:
        return "docs/RESULTS.md#" + anchor(topic_of(prefix)[1])

    if "stallmap_h200.json" in data:
        rows.append(
            (
                "Pageable non_blocking copy blocks the host from",
                f"{stall_threshold_kib(results_dir):.0f} KiB",
                link("stallmap"),
            )
        )
    hit = _latest(data, "plan_upload")
    if hit:
        rows.append(
            ("Plan + upload vs the usual build", ex_plan_upload(hit[1])[1], link("plan_upload"))
        )
    hit = _latest(data, "attention_vs_ideal")
    if hit:
        rows.append(
            ("Whole forward vs ideal", ex_vs_ideal(hit[1])[1], link("attention_vs_ideal"))
        )
    # ours: the scenario's default (a ring variant on --backend, no @); the baseline a user
    # would pick instead: FlashAttention-2 (named varlen before the rename, fa2 now)
    vs_fa2 = []
    for scen in ("bench_uneven", "bench_stall"):
        hit = _latest(data, scen)
        if hit:
            tok = {n: t for n, t, _ in bench_numbers(hit[1])}
            ours = next((n for n in tok if n.startswith("ring+") and "@" not in n), None)
            fa2 = next((n for n in tok if n.endswith(("@fa2", "@varlen"))), None)
            if ours is not None and fa2 is not None:
                vs_fa2.append((scen, f"{hit[1]['scenario']} {tok[ours] / 1000:.1f}k vs "
                                     f"{tok[fa2] / 1000:.1f}k ({tok[ours] / tok[fa2]:.2f}x)",
                               hit[1].get("attention_backend", "")))
    if vs_fa2:
        rows.append((f"Bench tokens/s, default ({vs_fa2[0][2]}) vs FlashAttention-2",
                     "; ".join(text for _, text, _ in vs_fa2), link(vs_fa2[0][0])))
    hit = _latest(data, "prefix_sharing")
    if hit:
        prows = hit[1]["shapes"]["rows"]
        fast = [r["speedup_share_vs_noshare"] for r in prows
                if r["heads"] == 16 and r["shape"].startswith("issue")]
        rows.append(("Prefix sharing: vs a cuDNN bound; vs none (16 heads)",
                     f"{_range([r['share_over_bound'] for r in prows])}x; "
                     f"{_range(fast)}x faster", link("prefix_sharing")))
    hit = _latest(data, "fp8_cache")
    if hit:
        fr = [r[f"{f}_over_bf16"] for r in hit[1]["forward"]["rows"] for f in ("fp8", "fp8_ds_mla")]
        rows.append(("FP8 caches (e4m3, ds_mla): forward vs bf16 cache",
                     f"{_range(fr, '.2f')}x ({len(fr)} pairs)", link("fp8_cache")))
    # the opt-in FP8 attention: its kernel against ours in bf16, and the bench's tokens/s
    # against the default backend in the same run
    kern = _latest(data, "fp8_attention", section="kernel")
    bench = _latest(data, "bench_vllm-default", "fp8_attention")
    if kern and bench:
        key = ("fp8_over_bf16_graph_throughput" if any(
            "fp8_over_bf16_graph_throughput" in r for r in kern[1].get("kernel", []))
            else "fp8_over_bf16_throughput")  # graph replays where the run has them
        ratio = [r[key] for r in kern[1].get("kernel", []) if key in r]
        tok = {n: t for n, t, _ in bench_numbers(bench[1])}
        fp8 = next((n for n in tok if n.endswith("@mlaprefill-fp8+graphs")), None)
        base = next((n for n in tok if n.endswith("@mlaprefill+graphs")), None)
        if ratio and fp8 and base:
            graphs = " (graphs)" if key == "fp8_over_bf16_graph_throughput" else ""
            rows.append((f"Opt-in FP8 attention: kernel vs bf16{graphs}; vllm-default tok/s",
                         f"{_range(ratio)}x; {tok[fp8] / 1000:.1f}k vs {tok[base] / 1000:.1f}k "
                         f"({tok[fp8] / tok[base]:.2f}x)", link("fp8_attention")))
    return rows[:7]


def readme_block(results_dir: Path = RESULTS_DIR) -> list[str]:
    lines = ["| what | result | details |", "|---|---|---|"]
    for what, result, href in summary_rows(results_dir):
        lines.append(f"| {_cell(what)} | {_cell(result)} | [RESULTS.md]({href}) |")
    return lines


def render_readme(text: str, results_dir: Path = RESULTS_DIR) -> str | None:
    """README text with the block between the markers regenerated; None without markers."""
    lines = text.split("\n")
    if BEGIN not in lines or END not in lines:
        return None
    i, j = lines.index(BEGIN), lines.index(END)
    return "\n".join(lines[: i + 1] + readme_block(results_dir) + lines[j:])


def _diff(old: str, new: str, label: str) -> list[str]:
    diff = list(
        difflib.unified_diff(old.split("\n"), new.split("\n"), label, "generated", lineterm="", n=0)
    )
    return diff[:20]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the document is stale")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--readme", type=Path, default=README)
    a = p.parse_args(argv)
    targets = [(a.doc, render(a.results_dir))]
    if a.readme.exists():
        new = render_readme(a.readme.read_text(), a.results_dir)
        if new is not None:
            targets.append((a.readme, new))
    if a.check:
        stale = False
        for path, new in targets:
            old = path.read_text() if path.exists() else ""
            if old != new:
                stale = True
                print(f"{path} is stale; run python benchmarks/results.py", file=sys.stderr)
                print("\n".join(_diff(old, new, str(path))), file=sys.stderr)
        return 1 if stale else 0
    for path, new in targets:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
