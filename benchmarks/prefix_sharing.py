# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""H200 benchmark of prefix sharing (issue #28): the forward with and without it, and a bound.

Usage::

    PYTHONPATH=src python benchmarks/prefix_sharing.py --out OUT/prefix_sharing_h200.json

    PYTHONPATH=src python benchmarks/prefix_sharing.py --cpu-smoke --out /tmp/prefix.json

Per shape (heads / requests / shared / unique each / new each, DeepSeek dims: kv_lora_rank 512,
rope 64, nope 128, v 128, page 64, bf16): every request's context is ``shared`` tokens in the
same cache blocks for all (a system prompt; optionally ``groups`` contiguous groups that also
share a ``group_len``-token document) then ``unique`` tokens of its own. Timed, per backend
(``mlaprefill`` eager, ``mlaprefill+graphs``: ``IterationGraphs`` with ``io_buffers``):

* ``share`` -- ``ChunkPlanner(share_prefixes=True)`` over the host block table (the default);
* ``noshare`` -- ``ChunkPlanner(share_prefixes=False)``: every request's rows gathered and
  up-projected on their own (the forward before issue #28);
* ``bound`` -- kernels alone: one up-projection GEMM of the distinct context rows and the new
  rows (HF weight), one cuDNN SDPA (with LSE) of every sharing query over the shared keys (and
  one per document group over its document), one batched SDPA of each request over its unique
  rest, one batched causal SDPA over the new tokens. No merges: a lower bound.

Printed and in the JSON: ``share / bound`` (target <= 1.3), ``noshare / share`` (the speed-up;
target >= 2.5 on the 16-head rows), the max abs difference of the two outputs (a sanity check;
the float64 tests are in tests/test_prefix.py), the plans' iterations and gathered rows.

``plan_host``: host time of ``ChunkPlanner.plan`` for 64 requests x 2,048 blocks (page 64:
131,072-token contexts) with a tree of sharing, with nothing shared, and without sharing
(median of repeated calls, ``time.perf_counter``).

Times: ``triton.testing.do_bench`` (CUDA events, warm-up excluded) median and 20/80th
percentiles. ``--cpu-smoke``: tiny shapes on CPU tensors with the ``math`` backend (eager only),
``torch.nn.functional.scaled_dot_product_attention`` standing in for cuDNN; times mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from _common import add_cpu_smoke, empty_cache, kernel_ms, sync, write_json
from mlaprefill import IterationGraphs, MLAChunkedPrefill
from mlaprefill._env import machine_info, utc_now
from mlaprefill.batch import PrefillBatch
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefix import MIN_SAVED_ROWS
from mlaprefill.staging import StagingRing

GRAPHS = "+graphs"
RANK, NOPE, ROPE, VDIM = 512, 128, 64, 128
QK = NOPE + ROPE
PAGE = 64
WORKSPACE = 32 * 1024  # mla_chunked_prefill's default (DEFAULT_WORKSPACE_TOKENS)

# (name, heads, requests, shared, unique each, new each, doc groups, doc tokens)
SHAPES = [
    ("issue-1", 16, 32, 16384, 512, 256, 0, 0),
    ("issue-2", 16, 64, 32768, 0, 128, 0, 0),
    ("issue-3", 128, 16, 8192, 1024, 512, 0, 0),
    ("issue-4", 64, 32, 16384, 2048, 256, 0, 0),
    # a tree: system prompt + 4 contiguous groups over a 4 Ki-token document
    ("tree-16", 16, 32, 8192, 1024, 256, 4, 4096),
    # nothing shared: the plan is the plain one (share must be within noise of noshare)
    ("none-16", 16, 16, 0, 8192, 256, 0, 0),
]
SMOKE_SHAPES = [("smoke", 2, 4, 128, 40, 8, 0, 0), ("smoke-tree", 2, 6, 64, 24, 4, 2, 64)]


def shared_block_table(reqs: int, shared: int, unique: int, groups: int,
                       doc: int) -> tuple[np.ndarray, int]:
    """int32 [reqs, pages] (host) and the pages used: every row starts with the same
    ``shared / PAGE`` pages, rows of group ``g = r * (groups + 1) // reqs >= 1`` continue with
    that group's ``doc / PAGE`` pages, then each row's own pages for ``unique`` tokens."""
    sp, dp, up = shared // PAGE, doc // PAGE, -(-unique // PAGE)
    group = np.arange(reqs) * (groups + 1) // reqs if groups else np.zeros(reqs, np.int64)
    width = max(sp + (dp if groups else 0) + up, 1)
    table = np.zeros((reqs, width), dtype=np.int32)
    table[:, :sp] = np.arange(sp)
    nxt = sp
    docs = {g: np.arange(nxt + (g - 1) * dp, nxt + g * dp) for g in range(1, groups + 1)}
    nxt += groups * dp
    for r in range(reqs):  # the benchmark's own input: a loop over requests
        at = sp
        if group[r]:
            table[r, at:at + dp] = docs[int(group[r])]
            at += dp
        table[r, at:at + up] = np.arange(nxt, nxt + up)
        nxt += up
    return table, nxt


def make_inputs(heads: int, reqs: int, shared: int, unique: int, new: int, groups: int,
                doc: int, device: str) -> dict[str, Any]:
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    table, pages = shared_block_table(reqs, shared, unique, groups, doc)
    group = np.arange(reqs) * (groups + 1) // reqs if groups else np.zeros(reqs, np.int64)
    ctx = (shared + unique + doc * (group > 0)).astype(np.int64)
    t = reqs * new

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dt, generator=g)

    return {"q": randn(t, heads, QK), "kv_c_new": randn(t, RANK), "k_pe_new": randn(t, ROPE),
            "kv_cache": randn(pages + 1, PAGE, RANK + ROPE),
            "weight": randn(heads * (NOPE + VDIM), RANK) * RANK ** -0.5,
            "table_host": table, "block_table": torch.from_numpy(table).to(device),
            "query_lens": [new] * reqs, "context_lens": ctx.tolist(), "group": group}


def forward_fn(x: dict[str, Any], backend: str, share: bool, device: str,
               min_saved_rows: int = MIN_SAVED_ROWS) -> tuple[Any, Any, Any]:
    """``(plan, fwd)``: the forward of ``x`` on ``backend`` (``NAME+graphs``: with
    ``IterationGraphs`` and its ``io_buffers``), planned with the backend's policy from the host
    block table, sharing prefixes or not; ``fwd()`` runs it (plan uploaded once),
    ``warm()`` runs it and captures the graphs it queued."""
    base = backend.removesuffix(GRAPHS)
    graphs = IterationGraphs() if backend.endswith(GRAPHS) else None
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=VDIM, backend=base,
                           qk_rope_head_dim=ROPE, graphs=graphs)
    plan = ChunkPlanner(WORKSPACE, PAGE, policy=op.preferred_policy, share_prefixes=share,
                        min_saved_rows=min_saved_rows).plan(
        PrefillBatch(x["query_lens"], x["context_lens"], page_size=PAGE,
                     block_table=x["table_host"]))
    dplan = StagingRing(device).upload(plan)
    q, out, lse = x["q"], None, None
    if graphs is not None:
        q, out, lse = op.io_buffers(x["q"].shape[0])
        q.copy_(x["q"])

    def fwd() -> Any:
        return op.forward(q, x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          dplan, return_lse=True, out=out, lse=lse)

    def run_and_capture() -> Any:
        result = fwd()
        if graphs is not None:
            graphs.capture_pending()
        return result

    return plan, fwd, run_and_capture


def bound_ms(heads: int, reqs: int, shared: int, unique: int, new: int, members: list[int],
             doc: int, device: str) -> dict[str, float]:
    """The lower bound's kernels, each timed alone (see the module docstring); ``members``:
    the requests of each document group."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)
    if device == "cuda":
        sdpa = torch.ops.aten._scaled_dot_product_cudnn_attention

        def attend(q: Any, k: Any, v: Any, causal: bool) -> Any:
            return sdpa(q, k, v, None, True, 0.0, causal, False, scale=QK ** -0.5)
    else:
        def attend(q: Any, k: Any, v: Any, causal: bool) -> Any:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=QK ** -0.5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dt, generator=g)

    rows = shared + len(members) * doc + reqs * unique + reqs * new
    w = randn(heads * (NOPE + VDIM), RANK)
    lat = randn(rows, RANK)
    parts = {"upproj_gemm_ms": kernel_ms(lambda: lat @ w.t())["median_ms"]}
    lat = None
    if shared:
        qs, ks, vs = randn(1, heads, reqs * new, QK), randn(1, heads, shared, QK), \
            randn(1, heads, shared, VDIM)
        parts["shared_sdpa_ms"] = kernel_ms(lambda: attend(qs, ks, vs, False))["median_ms"]
        qs = ks = vs = None
    for k, m in enumerate(members):
        qd, kd, vd = randn(1, heads, m * new, QK), randn(1, heads, doc, QK), \
            randn(1, heads, doc, VDIM)
        parts[f"doc{k + 1}_sdpa_ms"] = kernel_ms(lambda: attend(qd, kd, vd, False))["median_ms"]
    qq = randn(reqs, heads, new, QK)
    if unique:
        ku, vu = randn(reqs, heads, unique, QK), randn(reqs, heads, unique, VDIM)
        parts["unique_sdpa_ms"] = kernel_ms(lambda: attend(qq, ku, vu, False))["median_ms"]
        ku = vu = None
    kn, vn = randn(reqs, heads, new, QK), randn(reqs, heads, new, VDIM)
    parts["causal_sdpa_ms"] = kernel_ms(lambda: attend(qq, kn, vn, True))["median_ms"]
    return {**parts, "bound_ms": sum(parts.values())}


def bench_shapes(device: str, backends: list[str], shapes: list[tuple], rep: int,
                 min_saved_rows: int) -> dict:
    rows = []
    for name, heads, reqs, shared, unique, new, groups, doc in shapes:
        shape = {"shape": name, "heads": heads, "requests": reqs, "shared": shared,
                 "unique_each": unique, "new_each": new, "doc_groups": groups, "doc_len": doc,
                 "workspace_tokens": WORKSPACE}
        x = make_inputs(heads, reqs, shared, unique, new, groups, doc, device)
        members = np.bincount(x["group"], minlength=groups + 1)[1:].tolist()
        bound = bound_ms(heads, reqs, shared, unique, new, members, doc, device)
        empty_cache()
        for backend in backends:
            row: dict[str, Any] = {**shape, "backend": backend, **bound}
            outs = {}
            for share in (True, False):
                key = "share" if share else "noshare"
                plan, fwd, warm = forward_fn(x, backend, share, device, min_saved_rows)
                for _ in range(3):  # first sights, captures (graphs), compiles
                    warm()
                sync()
                outs[key] = fwd()[0].float()
                t = kernel_ms(fwd, rep=rep)
                row.update({f"{key}_ms": t["median_ms"], f"{key}_p20_ms": t["p20_ms"],
                            f"{key}_p80_ms": t["p80_ms"], f"{key}_iterations":
                            plan.num_iterations, f"{key}_gathered_rows": plan.num_gathered_rows,
                            f"{key}_policy": plan.policy})
                fwd = warm = plan = None
                empty_cache()
            row["context_tokens"] = int(sum(x["context_lens"]))
            row["share_over_bound"] = row["share_ms"] / bound["bound_ms"]
            row["noshare_over_bound"] = row["noshare_ms"] / bound["bound_ms"]
            row["speedup_share_vs_noshare"] = row["noshare_ms"] / row["share_ms"]
            row["max_abs_diff_share_vs_noshare"] = float(
                (outs["share"] - outs["noshare"]).abs().max())
            outs.clear()
            rows.append(row)
            print(f"  {name:<8} H={heads:>3} {reqs:>2} req {backend:<17} share "
                  f"{row['share_ms']:8.3f} ms ({row['share_iterations']} it) noshare "
                  f"{row['noshare_ms']:8.3f} ms ({row['noshare_iterations']} it) bound "
                  f"{bound['bound_ms']:7.3f} ms", flush=True)
        x = None
        empty_cache()
    return {"bound": "kernels alone: one up-projection GEMM of the distinct context rows and "
                     "the new rows + one cuDNN SDPA (LSE) of all sharing queries over the shared "
                     "keys (+ one per document group) + one batched SDPA over each request's "
                     "unique rest + one batched causal SDPA of the new tokens; no merges",
            "targets": "share_over_bound <= 1.3; speedup_share_vs_noshare >= 2.5 on the 16-head "
                       "issue rows; >= 1 (within noise) everywhere",
            "min_saved_rows": min_saved_rows, "rows": rows}


def plan_host(repeats: int) -> dict:
    """Host time of ChunkPlanner.plan, 64 requests x 2,048 blocks (131,072-token contexts)."""
    reqs, blocks = 64, 2048
    ctx = [blocks * PAGE] * reqs
    tree, _ = shared_block_table(reqs, 1024 * PAGE, 768 * PAGE, 4, 256 * PAGE)
    alone, _ = shared_block_table(reqs, 0, blocks * PAGE, 0, 0)
    out = {"requests": reqs, "blocks_per_request": blocks, "page_size": PAGE,
           "context_tokens_each": blocks * PAGE, "repeats": repeats, "rows": []}
    for policy in ("balanced", "packed", "equal"):
        for label, table, share in (("tree, share", tree, True), ("nothing shared, share",
                                                                  alone, True),
                                    ("tree, noshare", tree, False)):
            planner = ChunkPlanner(WORKSPACE * 2, PAGE, policy=policy, share_prefixes=share)
            batch = PrefillBatch([256] * reqs, ctx, page_size=PAGE, block_table=table)
            plan = planner.plan(batch)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                planner.plan(batch)
                times.append((time.perf_counter() - t0) * 1e3)
            out["rows"].append({"case": label, "policy": policy,
                                "plan_ms_median": statistics.median(times),
                                "plan_ms_min": min(times), "iterations": plan.num_iterations,
                                "gathered_rows": plan.num_gathered_rows,
                                "shares_prefixes": plan.shares_prefixes})
    out["workspace_tokens"] = WORKSPACE * 2
    return out


def table(results: dict) -> str:
    lines = ["prefix sharing: forward with (share) / without (noshare) vs the bound"]
    for r in results.get("shapes", {}).get("rows", []):
        lines.append(
            f"  {r['shape']:<8} H={r['heads']:>3} {r['requests']:>2}x(sh {r['shared']:>5} "
            f"+ {r['unique_each']:>4} | new {r['new_each']:>3}) {r['backend']:<17} "
            f"share {r['share_ms']:8.3f} noshare {r['noshare_ms']:8.3f} bound "
            f"{r['bound_ms']:7.3f} ms  share/bound {r['share_over_bound']:.2f}  "
            f"noshare/share {r['speedup_share_vs_noshare']:.2f}")
    ph = results.get("plan_host")
    if ph:
        lines.append(f"plan host time, {ph['requests']} requests x {ph['blocks_per_request']} "
                     f"blocks (W={ph['workspace_tokens']}):")
        for r in ph["rows"]:
            lines.append(f"  {r['policy']:<8} {r['case']:<22} {r['plan_ms_median']:.3f} ms "
                         f"(min {r['plan_ms_min']:.3f}) {r['iterations']} it, "
                         f"{r['gathered_rows']} rows")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--backends", default=f"mlaprefill,mlaprefill{GRAPHS}",
                        help="comma list; NAME+graphs: with IterationGraphs and io_buffers")
    parser.add_argument("--shapes", default="",
                        help="comma list of shape names to run (default: all of SHAPES)")
    parser.add_argument("--rep", type=int, default=60, help="do_bench time budget (ms)")
    parser.add_argument("--min-saved-rows", type=int, default=MIN_SAVED_ROWS,
                        help="ChunkPlanner(min_saved_rows=): least rows a shared run must save "
                             f"to be planned apart (default {MIN_SAVED_ROWS}; --cpu-smoke: 0)")
    parser.add_argument("--run-context", default="",
                        help="free text for the JSON's run_context (commit, machine, call)")
    add_cpu_smoke(parser)
    args = parser.parse_args()
    if args.cpu_smoke:
        device, backends, shapes, plan_repeats = "cpu", ["math"], SMOKE_SHAPES, 5
        args.min_saved_rows = 0  # the smoke shapes are tiny
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        device, backends = "cuda", [b for b in args.backends.split(",") if b]
        wanted = {s for s in args.shapes.split(",") if s}
        shapes = [s for s in SHAPES if not wanted or s[0] in wanted]
        plan_repeats = 50
    results: dict[str, Any] = {"command": " ".join(sys.argv), "argv": sys.argv,
                               "date_utc": utc_now(offset=True),
                               "machine": machine_info(torch.device(device))}
    if args.run_context:
        results["run_context"] = args.run_context
    results["plan_host"] = plan_host(plan_repeats)
    write_json(args.out, results)
    with torch.inference_mode():
        results["shapes"] = bench_shapes(device, backends, shapes, args.rep,
                                         args.min_saved_rows)
    write_json(args.out, results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
