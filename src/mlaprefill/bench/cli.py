"""``mlaprefill bench``: prefill-only engine benchmark of the staging modes and planner policies.

Scenarios (``--scenario``; every option below overrides the scenario's value):

``vllm-default`` (default with CUDA)
    The seed's experiment as vLLM runs it by default: 16 prompts of 80 Ki tokens arrive at once,
    16 concurrent, 4096-token steps shared first-come-first-served (vLLM V1), a 65,536-token
    context workspace (vLLM's default), ``page_size`` 64, a DeepSeek-V3 tensor-parallel-8 shard
    (16 heads, hidden 7168), 4 layers. A step holds one or two requests, so the largest table,
    ``token_to_seq``, is at most ``[2, 65536]`` int32 = 512 KiB (256 KiB per chunk) and the whole
    step ships <= ~0.6 MiB: below the 2120 KiB from which a pageable copy was measured to block
    on the H200 (docs/RESULTS.md). Reported as measured, stall or not.
``stall``
    Same model (2 layers) and prompts, but the budget is split fairly over the 16 running prefills
    (256 tokens each per step) and the workspace holds 1 Mi tokens. Every step then carries the
    contexts of all 16 requests: ``token_to_seq`` is ``~4 bytes x sum(context_lens)`` rounded up to
    the iteration layout, passing 2120 KiB once each request has ~33 Ki tokens cached and 8 MiB
    (``[2, 1048576]`` int32) past 64 Ki tokens: 58 % of the steps pass the threshold (dry run),
    so ``pageable`` should block the host for about one step of GPU time per step there.
``uneven`` (the planner's case)
    16 prompts of 8-156 Ki tokens (``--prompt-len-spread 0.9``), 8 concurrent, the budget shared
    fairly, vLLM's 65,536-token workspace, 2 layers: requests are admitted as others finish, so
    a step mixes long and short contexts. ``equal`` gives every request ``W / n`` per chunk and
    needs ``ceil(max context / chunk)`` iterations; ``packed`` and ``balanced`` need about
    ``sum / W``. Dry run: 2375 vs 1843 (packed) and 1846 (balanced) iterations over the run;
    with vLLM's tables a step's largest copy passes 2120 KiB on 45 % of the steps with ``equal``,
    27-30 % with the others, and never with the compact plans.
    Variants: pageable+equal, and ring x equal, packed, balanced (measured on the H200: packed
    is slower than equal with this backend despite fewer iterations, balanced level with equal;
    see DESIGN.md section 4).
``cpu-tiny`` (default without CUDA)
    Preset ``tiny``, 2 layers, 8 prompts of 512 tokens, 4 concurrent, 128-token steps shared
    fairly, a 256-token workspace: runs in seconds on two cores. On the CPU every transfer mode is
    a plain copy, so the variants differ only in planner policy and host overhead.

GPU scenarios: bf16, the ``mlaprefill`` attention backend with CUDA graphs
(``mlaprefill+graphs``: our attention kernel, on the H200 the Gluon one, the forward's launches
replayed CUDA graphs, the model writing q into the forward's I/O buffers and reading its output
there; see ``_V3_TP8``; ``stall`` and ``uneven`` also run one variant on eager ``mlaprefill`` and
one on the FlashAttention-2 ``fa2`` backend, the default before, for the side-by-side ratios), 2
interleaved repeats after one unmeasured full warm-up run, capped at 165 s of measuring.
``fair`` sharing is close to vLLM V0's ``--max-num-partial-prefills`` (several long prefills
advancing together); a prefix-cache heavy workload gives steps the same shape (many long
contexts, few new tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["SCENARIOS", "Scenario", "add_parser", "run"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """Named defaults: engine settings plus repeats and warm-up steps."""

    note: str
    engine: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    repeats: int = 2
    warmup_steps: int = 3
    needs_cuda: bool = True
    variants: tuple[str, ...] | None = None  # None: runner.DEFAULT_VARIANTS
    # Wall-clock cap of the measuring part (see runner.run_suite); keeps the defaults within
    # 3 minutes on an H200 / 60 s on a CPU even on a slower machine.
    max_seconds: float | None = 165.0


# GPU scenarios use the mlaprefill backend (on the H200 our Gluon kernel): one kernel per call
# for the whole ragged batch, compiled once per (causal, dtype, head dims), never per shape.
# cuDNN builds a graph per new (q_len, k_len) and contexts grow every step. With graphs and
# their I/O buffers (+graphs) the forward's host time per layer was p99 0.30-0.65 ms instead of
# 0.85-3.0 ms eager, within 0.4-1.1 % of eager's tokens/s (docs/RESULTS.md); a real model has
# ~30x the bench's 2 layers, so its host time per step grows 30x while each layer's device time
# does not. Falls back to `auto` without Triton on CUDA.
_V3_TP8: Mapping[str, Any] = MappingProxyType({
    "preset": "deepseek-v3", "tp": 8, "prompt_len": 81920, "num_requests": 16,
    "max_concurrent": 16, "token_budget": 4096, "page_size": 64, "vocab_size": 4096,
    "backend": "mlaprefill+graphs"})

SCENARIOS: Mapping[str, Scenario] = MappingProxyType({
    "vllm-default": Scenario(
        note="vLLM defaults: FCFS 4096-token steps, 65,536-token workspace; metadata <= ~0.6 MiB "
             "per step (below the 2120 KiB pageable-stall threshold measured on the H200)",
        # with graphs and their I/O buffers: 219.1k tok/s against 218.3k eager in one run on
        # the H200 (bench_vllm-default_h200_static.json, 2 repeats), forward host p99 per layer
        # 0.39 against 1.43 ms
        engine=MappingProxyType({**_V3_TP8, "num_layers": 4, "workspace_tokens": 65536,
                                 "share": "fcfs"})),
    "stall": Scenario(
        note="budget shared by 16 running prefills + 1 Mi-token workspace: token_to_seq ~4 B x "
             "sum(context) reaches 3-8 MiB per step (past the measured pageable-stall threshold)",
        engine=MappingProxyType({**_V3_TP8, "num_layers": 2, "workspace_tokens": 1048576,
                                 "share": "fair"}),
        variants=("pageable+equal+vllm", "pin+equal+vllm", "pageable+equal", "ring+equal",
                  "ring+equal@mlaprefill", "ring+equal@fa2")),
    "uneven": Scenario(
        note="mixed 8-156 Ki prompts, 8 concurrent, fair share, 65,536-token workspace: steps "
             "mix long and short contexts, where packed needs fewer iterations and smaller "
             "tables than equal",
        engine=MappingProxyType({**_V3_TP8, "num_layers": 2, "workspace_tokens": 65536,
                                 "share": "fair", "max_concurrent": 8,
                                 "prompt_len_spread": 0.9}),
        variants=("pageable+equal+vllm", "ring+equal", "ring+packed", "ring+balanced",
                  "ring+balanced@mlaprefill", "ring+balanced@fa2")),
    "shared-prefix": Scenario(
        note="prefix caching: 64 requests over one 16 Ki-token system prompt, 4 contiguous "
             "groups also over a 4 Ki-token document, unique tails of 256-1792 tokens; 32 "
             "running, fair 8192-token steps: contexts share leading blocks, planned with and "
             "without prefix sharing (+noshare)",
        engine=MappingProxyType({**_V3_TP8, "num_layers": 2, "workspace_tokens": 65536,
                                 "share": "fair", "num_requests": 64, "max_concurrent": 32,
                                 "token_budget": 8192, "prompt_len": 1024,
                                 "prompt_len_spread": 0.75, "shared_prefix_len": 16384,
                                 "doc_groups": 4, "doc_len": 4096}),
        variants=("ring+balanced", "ring+balanced+noshare", "ring+balanced@mlaprefill",
                  "ring+balanced+noshare@mlaprefill")),
    "cpu-tiny": Scenario(
        note="tiny CPU configuration (every transfer mode is a plain CPU copy here)",
        engine=MappingProxyType({
            "preset": "tiny", "tp": 1, "num_layers": 2, "vocab_size": 64, "prompt_len": 512,
            "num_requests": 8, "max_concurrent": 4, "token_budget": 128,
            "workspace_tokens": 256, "page_size": 16, "share": "fair"}),
        repeats=3, warmup_steps=1, needs_cuda=False, max_seconds=45.0),
})

# CLI option dest -> EngineConfig field
_ENGINE_OPTS: Mapping[str, str] = MappingProxyType({
    "preset": "preset", "tp": "tp", "layers": "num_layers", "vocab": "vocab_size",
    "prompt_len": "prompt_len", "prompt_len_spread": "prompt_len_spread",
    "num_requests": "num_requests", "request_rate": "request_rate",
    "concurrency": "max_concurrent", "token_budget": "token_budget",
    "workspace": "workspace_tokens", "page_size": "page_size", "share": "share",
    "num_blocks": "num_blocks", "seed": "seed", "backend": "backend", "dtype": "dtype",
    "shared_prefix_len": "shared_prefix_len", "doc_groups": "doc_groups", "doc_len": "doc_len",
    "device": "device",
})


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``mlaprefill`` subparsers."""
    p = subparsers.add_parser(
        "bench", help="prefill-only engine benchmark: pageable vs pinned vs ring staging",
        description="Run a small prefill-only MLA engine (chunked prefill, paged latent cache, "
                    "random weights) with each staging mode / planner policy side by side and "
                    "report throughput, TTFT, host-blocked time and GPU busy fraction. Without "
                    "CUDA it runs the tiny CPU scenario.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="scenarios:\n" + "\n".join(f"  {k:<13} {v.note}" for k, v in SCENARIOS.items()),
    )
    p.add_argument("--scenario", choices=sorted(SCENARIOS),
                   help="named defaults (default: vllm-default with CUDA, cpu-tiny without)")
    p.add_argument("--preset", help="MLA preset (deepseek-v3, deepseek-v2-lite, kimi-k2, tiny)")
    p.add_argument("--tp", type=int, help="tensor-parallel size: heads and MLP width per GPU")
    p.add_argument("--layers", type=int, help="decoder layers")
    p.add_argument("--vocab", type=int, help="vocabulary of the small sampling head")
    p.add_argument("--prompt-len", type=int, help="tokens per prompt")
    p.add_argument("--prompt-len-spread", type=float,
                   help="prompt lengths uniform in prompt-len x [1-S, 1+S] (default 0: equal)")
    p.add_argument("--num-requests", type=int, help="requests in the workload")
    p.add_argument("--request-rate", type=float,
                   help="arrivals per second (Poisson); default: all at once")
    p.add_argument("--concurrency", type=int, help="max concurrent prefills")
    p.add_argument("--token-budget", type=int, help="max new tokens per step")
    p.add_argument("--workspace", type=int, help="context workspace tokens (planner W)")
    p.add_argument("--page-size", type=int, help="tokens per cache page")
    p.add_argument("--share", choices=("fcfs", "fair"),
                   help="how running prefills share the step budget")
    p.add_argument("--num-blocks", type=int, help="cache pages (default: concurrency prompts)")
    p.add_argument("--shared-prefix-len", type=int,
                   help="prefix caching: system-prompt tokens every prompt starts with, cached "
                        "before the run (a page multiple; --prompt-len is then the unique tail)")
    p.add_argument("--doc-groups", type=int,
                   help="prefix caching: contiguous groups of requests whose prompts continue "
                        "with a shared cached document of --doc-len tokens")
    p.add_argument("--doc-len", type=int, help="tokens of each group's document (page multiple)")
    from mlaprefill.bench.report import MIN_MEASURED_STEPS, TABLE_WIDTH
    from mlaprefill.bench.runner import DEFAULT_VARIANTS
    p.add_argument("--variants",
                   help="comma list of TRANSFER+POLICY[+vllm][+noshare][@BACKEND[+graphs]]: "
                        "TRANSFER pageable|pin|ring, POLICY equal|packed|balanced, '+vllm' "
                        "also ships vLLM's per-token token_to_seq (the pre-fix metadata layout), "
                        "'+noshare' plans without prefix sharing, "
                        "'@BACKEND' another attention backend than --backend (e.g. "
                        "ring+balanced@fa2), '+graphs' with CUDA graphs and their I/O buffers "
                        "(e.g. ring+balanced@mlaprefill+graphs); "
                        "or 'all' (every TRANSFER+POLICY). "
                        "Default: the scenario's, else "
                        + ", ".join(DEFAULT_VARIANTS))
    p.add_argument("--repeats", type=int, help="interleaved repeats per variant")
    p.add_argument("--warmup-steps", type=int, help="unmeasured steps per variant first")
    p.add_argument("--no-warmup-run", action="store_true",
                   help="skip the unmeasured full run that shows every step shape to the "
                        "attention backend before measuring")
    p.add_argument("--backend",
                   help="attention backend of MLAChunkedPrefill: auto, mlaprefill, cudnn, fa2, "
                        "flex, math, optionally +graphs (MLAChunkedPrefill(graphs=...) and "
                        "io_buffers; GPU scenarios: mlaprefill+graphs; cpu-tiny: auto); a "
                        "variant may name its own as TRANSFER+POLICY@BACKEND")
    p.add_argument("--dtype", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32, ...")
    p.add_argument("--kv-cache-dtype",
                   help="comma list of latent cache formats, each variant run once per format "
                        "and reported side by side: auto (the compute dtype), fp8 "
                        "(float8_e4m3fn, scale 1.0), fp8_ds_mla (DeepSeek's 656-byte records; "
                        "deepseek-v3/kimi-k2 dims only). A variant may name its own as "
                        "VARIANT:FORMAT. Default: auto")
    p.add_argument("--device", help="auto, cuda, cuda:N or cpu")
    p.add_argument("--seed", type=int, help="weights / prompts seed")
    p.add_argument("--max-seconds", type=float,
                   help="wall-clock cap in seconds of the whole run, the warm-up included "
                        "(the warm-up runs together stop at half of it): no new round of "
                        "repeats that would end past it, a too-slow first round is truncated "
                        "evenly (default: 165 on GPU scenarios, 45 on cpu-tiny; 0 = no cap). A "
                        "variant that finished no request or measured fewer than "
                        f"{MIN_MEASURED_STEPS} steps per run (MIN_MEASURED_STEPS) is flagged "
                        "'truncated' and gets no percentage")
    p.add_argument("--dry-run", action="store_true",
                   help="no model, no device: print the metadata bytes per step the scenario's "
                        "steps would upload (per planner policy) and exit")
    p.add_argument("--out", type=Path, default=Path("bench-out"),
                   help="directory for bench.json and bench.png (default: ./bench-out); "
                        "created and checked writable before the run starts")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument("--wide", action="store_true",
                   help=f"print every column of the table (default: the main ones, within "
                        f"{TABLE_WIDTH} columns; bench.json holds every metric either way)")
    return p


def _fail(msg: str) -> int:
    print(f"mlaprefill bench: error: {msg}", file=sys.stderr)
    return 2


#: Limits of one bench invocation, checked before any work (so that a typo such as
#: ``--prompt-len 100000000`` is one line of error, not minutes of simulation or a MemoryError).
#: Every shipped scenario is far below them (16 x 80 Ki tokens: 320 steps, 20,480 pages).
MAX_REQUESTS = 65_536
MAX_STEPS = 20_000
MAX_STEP_TOKENS = 2**20
MAX_PAGES = 2**22
MAX_TABLE_ENTRIES = 2**24  # block-table entries of one step (concurrency x pages per request)
MAX_ARRIVAL_SPAN_S = 3600.0

_FLAGS = {"prompt_len": "--prompt-len", "num_requests": "--num-requests",
          "token_budget": "--token-budget", "max_concurrent": "--concurrency",
          "page_size": "--page-size", "num_blocks": "--num-blocks", "num_layers": "--layers",
          "vocab_size": "--vocab", "workspace_tokens": "--workspace"}


def check_workload(config: Any, *, dry_run: bool, token_tables: bool = False) -> None:
    """``ValueError`` naming the options if ``config`` is beyond what one bench run handles.

    Checks (host arithmetic only, before anything is allocated): request count, int32 token and
    slot totals, simulated steps, cache pages, block-table size, a step's plan (and, with
    ``token_tables``: a ``+vllm`` variant, its token table) against the planner's bounds,
    arrival span; for a real run also the memory of weights + cache + the largest step against
    what the device has free.
    """
    from mlaprefill.batch import INT32_MAX
    from mlaprefill.bench.engine import default_num_blocks, workload
    from mlaprefill.bench.model import MODEL_PRESETS, model_dims

    cfg = config
    if cfg.preset not in MODEL_PRESETS:
        raise ValueError(f"--preset {cfg.preset!r} is unknown; choose one of "
                         f"{sorted(MODEL_PRESETS)}.")
    if cfg.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {cfg.seed}.")
    for name in ("workspace_tokens", "page_size"):
        if getattr(cfg, name) > INT32_MAX:
            raise ValueError(f"{_FLAGS[name]} {getattr(cfg, name)} overflows int32 (max "
                             f"{INT32_MAX}).")
    if cfg.num_requests > MAX_REQUESTS:
        raise ValueError(f"--num-requests {cfg.num_requests} is more than this benchmark runs "
                         f"({MAX_REQUESTS}); lower it.")
    longest = cfg.prompt_len * (1 + cfg.prompt_len_spread)
    if cfg.num_requests * longest > INT32_MAX:
        raise ValueError(f"--num-requests {cfg.num_requests} x --prompt-len {cfg.prompt_len} "
                         f"(x {1 + cfg.prompt_len_spread:g} spread) tokens overflow int32 (max "
                         f"{INT32_MAX}); lower them.")
    prompt_lens, arrivals = workload(cfg)
    total = int(prompt_lens.sum())
    steps = -(-total // cfg.token_budget)
    if steps > MAX_STEPS:
        raise ValueError(f"the workload needs at least {steps:,} steps ({total:,} prompt tokens / "
                         f"--token-budget {cfg.token_budget}), more than the {MAX_STEPS:,} this "
                         f"benchmark runs; lower --prompt-len or --num-requests, or raise "
                         f"--token-budget.")
    if min(cfg.token_budget, total) > MAX_STEP_TOKENS:
        raise ValueError(f"--token-budget {cfg.token_budget} lets one step hold up to "
                         f"{min(cfg.token_budget, total):,} tokens, more than the "
                         f"{MAX_STEP_TOKENS:,} this benchmark runs per step; lower it.")
    num_blocks = default_num_blocks(cfg, prompt_lens)
    if num_blocks > MAX_PAGES or num_blocks * cfg.page_size > INT32_MAX:
        raise ValueError(f"the cache would have {num_blocks:,} pages of {cfg.page_size} tokens "
                         f"(limits: {MAX_PAGES:,} pages, {INT32_MAX:,} slots); lower "
                         f"--num-blocks, --prompt-len or --concurrency, or raise --page-size.")
    pages = -(-int(prompt_lens.max()) // cfg.page_size)
    table = min(cfg.max_concurrent, cfg.num_requests) * pages
    if table > MAX_TABLE_ENTRIES:
        raise ValueError(f"a step's block table could hold {table:,} entries (--concurrency x "
                         f"pages per prompt), more than {MAX_TABLE_ENTRIES:,}; lower "
                         f"--concurrency or --prompt-len, or raise --page-size.")
    _check_step_plan(cfg, int(prompt_lens.max()), token_tables)
    if float(arrivals[-1]) > MAX_ARRIVAL_SPAN_S:
        raise ValueError(f"--request-rate {cfg.request_rate:g}/s spreads the arrivals over "
                         f"{float(arrivals[-1]):.3g} s (limit {MAX_ARRIVAL_SPAN_S:.0f} s); raise "
                         f"--request-rate or leave it out (all requests at once).")
    dims = model_dims(cfg.preset, tp=cfg.tp, vocab_size=cfg.vocab_size)  # ValueError on bad tp
    if not dry_run:
        _check_memory(cfg, dims, num_blocks, total)


def _check_step_plan(cfg: Any, longest: int, token_tables: bool) -> None:
    """A step's plan within ``MAX_PLAN_ENTRIES`` (and its token table within
    ``MAX_TOKEN_TABLE_ENTRIES``), from an upper bound on its iterations over every policy: the
    planner would refuse it mid-run. ``packed`` <= ceil(context / (W - page + 1)); ``equal`` and
    ``balanced`` <= ceil(longest / chunk), chunk = equal's (>= a page) at the most requests, else
    one page per iteration."""
    from mlaprefill.plan import MAX_PLAN_ENTRIES, MAX_TOKEN_TABLE_ENTRIES

    reqs = min(cfg.max_concurrent, cfg.num_requests)
    w, ps = cfg.workspace_tokens, cfg.page_size
    chunk = (w // reqs) // ps * ps or ps
    iterations = max(-(-reqs * longest // max(1, w - ps + 1)), -(-longest // chunk))
    if iterations * (reqs + 1) > MAX_PLAN_ENTRIES:
        raise ValueError(f"a step's plan could have {iterations:,} iterations x {reqs + 1} "
                         f"(--concurrency + 1) entries, more than the planner's "
                         f"{MAX_PLAN_ENTRIES:,}; raise --workspace or --page-size, or lower "
                         f"--concurrency or --prompt-len.")
    if token_tables and iterations * min(w, reqs * longest) > MAX_TOKEN_TABLE_ENTRIES:
        raise ValueError(f"a '+vllm' variant's token table could have {iterations:,} "
                         f"iterations x {min(w, reqs * longest):,} rows, more than the "
                         f"planner's {MAX_TOKEN_TABLE_ENTRIES:,}; drop '+vllm' from --variants, "
                         f"or lower --prompt-len or --concurrency.")


def _free_bytes(device: Any) -> int | None:
    """Free memory of ``device`` in bytes, or None when unknown."""
    import torch
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(cfg: Any, dims: Any, num_blocks: int, total_tokens: int) -> None:
    """Weights + cache + the largest step's buffers against the device's free memory."""
    import torch
    device = cfg.resolve_device()
    elt = torch.empty(0, dtype=cfg.resolve_dtype(device)).element_size()
    m, hd, inter = dims.mla, dims.hidden_size, dims.intermediate_size
    heads = m.num_heads
    q = (heads * m.qk_head_dim * hd if dims.q_lora_rank is None
         else dims.q_lora_rank * (hd + heads * m.qk_head_dim))
    layer = (q + m.latent_dim * hd + hd * heads * m.v_head_dim + 3 * inter * hd
             + heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank)
    weights = (cfg.num_layers * layer + 2 * dims.vocab_size * hd) * elt
    cache = cfg.num_layers * num_blocks * cfg.page_size * m.latent_dim * elt
    t, w = min(cfg.token_budget, total_tokens), min(cfg.workspace_tokens, total_tokens)
    step = (t * (4 * hd + 2 * inter) * 4                      # activations, float32 upper bound
            + w * (m.latent_dim + heads * (m.qk_head_dim + max(m.qk_head_dim, m.v_head_dim))) * elt)
    if device.type == "cpu":  # the math backend materializes [H, T, W] scores (a few copies)
        step += 3 * heads * t * (w + t) * 4
    need = weights + cache + step
    free = _free_bytes(device)
    if free is not None and need > free:
        gib = 2.0**30
        raise ValueError(
            f"this run needs about {need / gib:.1f} GiB on {device} (weights {weights / gib:.1f}, "
            f"cache {cache / gib:.1f}, largest step {step / gib:.1f}) but {free / gib:.1f} GiB "
            f"are free; lower --layers, --vocab, --prompt-len, --concurrency, --num-blocks, "
            f"--token-budget or --workspace.")


def _check_out_dir(out: Path) -> None:
    """Create ``out`` and prove it writable now, so a bad --out fails before the run."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a directory for bench.json and bench.png.")
    parent = out.absolute().parent
    if not parent.is_dir():  # a typo in a path should not become a tree of new directories
        raise ValueError(f"--out {out}: its parent {parent} does not exist; create it first or "
                         f"pass another --out (the bench makes only the last directory).")
    try:
        out.mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".mlaprefill-write-check-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc}); pass a "
                         f"writable directory.") from None
    for name in ("bench.json", "bench.png"):
        if (out / name).is_dir():
            raise ValueError(f"--out {out}: {out / name} is a directory; remove it or pass "
                             f"another --out.")


def _parse_variants(text: str | None, default: tuple[str, ...] | None = None) -> list:
    from mlaprefill.bench.engine import Variant
    from mlaprefill.bench.runner import DEFAULT_VARIANTS
    from mlaprefill.plan import POLICIES
    from mlaprefill.staging import MODES
    if text is None:
        items = list(default or DEFAULT_VARIANTS)
    elif text.strip() == "all":
        items = [f"{m}+{p}" for m in ("pageable", "pin", "ring") if m in MODES for p in POLICIES]
    else:
        items = [t for t in text.split(",") if t.strip()]
    return [Variant.parse(t) for t in items]


def _with_kv_cache_dtypes(variants: list, text: str | None, config: Any) -> list:
    """Each variant once per ``--kv-cache-dtype`` format (variants that name a format keep
    it); ``ValueError`` naming the option for an unknown format or one the model's dims cannot
    store."""
    from mlaprefill.bench.cache import KV_CACHE_DTYPES
    from mlaprefill.bench.model import MODEL_PRESETS, model_dims

    formats = ["auto"] if text is None else [t.strip() for t in text.split(",")]
    for f in formats:
        if f not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {f!r} is unknown; choose from "
                             f"{', '.join(KV_CACHE_DTYPES)} (a comma list runs each)")
    if len(set(formats)) != len(formats):
        raise ValueError(f"--kv-cache-dtype {text!r} names a format twice")
    out = []
    for v in variants:
        for f in ([v.kv_cache_dtype] if v.kv_cache_dtype != "auto" else formats):
            if v.with_kv_cache_dtype(f) not in out:
                out.append(v.with_kv_cache_dtype(f))
    if any(v.kv_cache_dtype == "fp8_ds_mla" for v in out) and config.preset in MODEL_PRESETS:
        latent = model_dims(config.preset, tp=config.tp,
                            vocab_size=config.vocab_size).mla.latent_dim
        if latent != 576:
            raise ValueError(f"--kv-cache-dtype fp8_ds_mla stores kv_lora_rank 512 + rope 64 = "
                             f"576 per token; --preset {config.preset} has {latent}-wide latent "
                             f"rows (use deepseek-v3 or kimi-k2)")
    return out


def build_config(args: argparse.Namespace) -> tuple[str, Scenario, Any]:
    """Resolve the scenario and option overrides into (name, scenario, EngineConfig)."""
    import torch

    from mlaprefill.bench.engine import EngineConfig
    has_cuda = torch.cuda.is_available() and (args.device or "auto") != "cpu"
    name = args.scenario or ("vllm-default" if has_cuda else "cpu-tiny")
    scenario = SCENARIOS[name]
    if scenario.needs_cuda and not has_cuda and not getattr(args, "dry_run", False):
        raise ValueError(f"scenario {name!r} needs a CUDA device (it is sized for an H200); "
                         f"use --scenario cpu-tiny on this machine.")
    if (args.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} requested but CUDA is not available; use "
                         f"--device cpu (or leave it out).")
    device = args.device or "auto"
    if device not in ("auto", "cpu", "cuda") and not (
            device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"--device {device!r} is not one of auto, cpu, cuda, cuda:N.")
    if device.startswith("cuda:") and torch.cuda.is_available() \
            and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1}).")
    if args.backend is not None:
        from mlaprefill.bench.engine import backend_error
        why = backend_error(args.backend, "--backend")
        if why is not None:
            raise ValueError(why)
    values = dict(scenario.engine)
    for opt, fld in _ENGINE_OPTS.items():
        v = getattr(args, opt, None)
        if v is not None:
            values[fld] = v
    if (args.backend is None and str(values.get("backend", "")).startswith("mlaprefill")
            and has_cuda):
        from mlaprefill.kernels._triton import HAS_TRITON
        if not HAS_TRITON:
            print(f"mlaprefill bench: Triton is not installed; using the attention backend "
                  f"'auto' instead of the scenario's {values['backend']!r}.", file=sys.stderr)
            values["backend"] = "auto"
    if values.get("request_rate") is None:
        values["request_rate"] = math.inf
    known = {f.name for f in fields(EngineConfig)}
    try:
        config = EngineConfig(**{k: v for k, v in values.items() if k in known})
    except ValueError as exc:
        # name the option the user typed, not the config field behind it
        message = str(exc)
        for opt, fld in _ENGINE_OPTS.items():
            if getattr(args, opt, None) is not None:
                message = message.replace(f"EngineConfig.{fld} ", f"--{opt.replace('_', '-')} ")
        raise ValueError(message) from None
    return name, scenario, config


def _dry_run(name: str, config: Any, variants: list, *, wide: bool = False) -> int:
    from mlaprefill.bench.dryrun import format_profiles, metadata_profile
    from mlaprefill.bench.report import wrap
    print(wrap(f"scenario {name} (dry run: scheduler + planner only): {config.num_requests} x "
               f"{config.prompt_len} tokens, budget {config.token_budget}, workspace "
               f"{config.workspace_tokens}, share {config.share}, page_size {config.page_size}",
               width=10**6 if wide else 100))
    profiles = {p: metadata_profile(config, p) for p in sorted({v.policy for v in variants})}
    print(format_profiles(profiles, wide=wide))
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the table; write ``--out``/bench.json and bench.png."""
    from mlaprefill.bench.report import format_table, wrap, write_json, write_png
    from mlaprefill.bench.runner import run_suite
    # Growing contexts ask for ever larger workspaces; expandable segments let the caching
    # allocator grow in place instead of cudaMalloc + (at the memory limit) a syncing cudaFree.
    # Must be set before the first CUDA allocation; an explicit setting is respected.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    try:
        name, scenario, config = build_config(args)
        variants = _with_kv_cache_dtypes(_parse_variants(args.variants, scenario.variants),
                                         args.kv_cache_dtype, config)
        repeats = args.repeats if args.repeats is not None else scenario.repeats
        warmup = args.warmup_steps if args.warmup_steps is not None else scenario.warmup_steps
        max_seconds = scenario.max_seconds if args.max_seconds is None else args.max_seconds
        if repeats < 1 or warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup-steps >= 0, got {repeats} "
                             f"and {warmup}.")
        if not (max_seconds is None or 0 <= max_seconds < math.inf):
            raise ValueError(f"--max-seconds must be a finite number >= 0 (0 = no cap), got "
                             f"{max_seconds}.")
        check_workload(config, dry_run=args.dry_run,
                       token_tables=any(v.tables == "vllm" for v in variants))
        if not args.dry_run and args.out is not None:
            _check_out_dir(Path(args.out))
        on_cpu = config.resolve_device().type == "cpu"
        if on_cpu and not args.dry_run:
            why = "no CUDA device" if not torch.cuda.is_available() else "--device cpu"
            print(wrap(f"mlaprefill bench: running on the CPU ({why}): scenario {name}, "
                       f"preset {config.preset}, {config.num_layers} layers, "
                       f"{config.num_requests} x {config.prompt_len}-token prompts. Transfer "
                       f"modes are plain CPU copies here; the pageable stall needs a GPU."),
                  file=sys.stderr)
        if args.dry_run:
            return _dry_run(name, config, variants, wide=args.wide)
        doc = run_suite(config, variants, repeats=repeats, warmup_steps=warmup, scenario=name,
                        scenario_note=scenario.note, progress=not args.no_progress,
                        max_seconds=max_seconds or None,  # 0 = no cap
                        warmup_run=not args.no_warmup_run)
    except ValueError as exc:
        return _fail(str(exc))
    except (MemoryError, torch.OutOfMemoryError) as exc:
        # The estimate above missed (other processes, fragmentation): still one line.
        return _fail(f"out of memory during the run ({type(exc).__name__}); lower --layers, "
                     f"--prompt-len, --concurrency, --token-budget or --workspace.")
    doc["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                      if k != "command" and not callable(v)}
    ran = doc.get("repeats", repeats)
    ran_text = f"{ran} repeats" if ran == repeats else \
        f"{ran} of {repeats} repeats (--max-seconds)"
    width = 10**6 if args.wide else 100
    print(wrap(f"scenario {name} on {doc['machine'].get('device_name')} ({doc['ran_on']}, "
               f"{doc['dtype']}, attention backend {doc['attention_backend']}): "
               f"{config.num_requests} x {config.prompt_len} tokens, {config.num_layers} "
               f"layers, budget {config.token_budget}, workspace {config.workspace_tokens}, "
               f"share {config.share}, {ran_text}, {doc['total_seconds']:.1f} s (warm-up "
               f"{doc['warmup_seconds']:.1f} s)", width=width))
    print(format_table(doc, wide=args.wide))
    if doc["ran_on"] == "cpu":
        print(wrap("ran on the CPU: every transfer mode is a plain CPU copy here, so this shows "
                   "the engine working, not the pageable stall (that needs a GPU).",
                   width=width))
    if args.out is not None:
        out = Path(args.out)
        try:
            write_json(doc, out / "bench.json")
            msg = write_png(doc, out / "bench.png")
        except OSError as exc:  # checked before the run; the directory changed since
            return _fail(f"--out {out}: cannot write the results ({exc.strerror or exc}).")
        print(wrap(f"wrote {out / 'bench.json'}"
                   + (f"; {msg}" if msg else f" and {out / 'bench.png'}"), width=width))
    return 0
