"""Is the chunked-context forward bitwise run-to-run deterministic on the GPU, and if not, which
stage is not? (The 2-GPU DCP check saw the single-GPU forward differ between two identical runs
on one long-context case.)

    PYTHONPATH=src python3 benchmarks/determinism.py --out determinism.json
    PYTHONPATH=src python3 benchmarks/determinism.py --cpu-smoke --out /tmp/determinism.json

One request, 2048 new tokens over a 131,072-token context, DeepSeek-V3 heads, bf16, workspace
32,768 (4 iterations): the whole forward ``--runs`` times per backend, then each stage of one
iteration 4 times on identical inputs (gather, up-projection, attention, merge), and a trace of
the backend's ``attend`` calls inside two forwards (first divergence). Public API only: the
trace and the probes wrap ``MLAChunkedPrefill.backend.attend`` on the instance. Prints a table
last. ``--cpu-smoke``: the same on a tiny case on CPU tensors (math backend).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _common import add_cpu_smoke, sync
from mlaprefill import MLAChunkedPrefill
from mlaprefill._env import machine_info, utc_now
from mlaprefill.backends import VarlenSeqs, get_backend
from mlaprefill.batch import PrefillBatch
from mlaprefill.kernels import gather_context_rows, merge_attention_states
from mlaprefill.plan import ChunkPlanner
from mlaprefill.staging import StagingRing

RUNS = 4
GPU_BACKENDS = ("mlaprefill", "cudnn", "fa2")


def _same(results: list) -> tuple[bool, float]:
    """(all bitwise equal to the first, max abs difference to the first)."""
    first = results[0]
    worst, equal = 0.0, True
    for r in results[1:]:
        for a, b in zip(first, r, strict=True):
            equal &= bool(torch.equal(a, b))
            fin = torch.isfinite(a) & torch.isfinite(b)
            if fin.any():
                worst = max(worst, float((a.double() - b.double())[fin].abs().max()))
    return equal, worst


def _probe(q, kv_c_new, k_pe_new, kv_cache, block_table, weight, plan, dev, nope, v_dim,
           backend, runs, rows_out) -> None:
    """The whole forward, ``runs`` times, with one change each: which change makes it stable?"""

    def run(mla, plan_obj):
        outs = [tuple(t.clone() for t in mla.forward(q, kv_c_new, k_pe_new, kv_cache,
                                                      block_table, plan_obj, return_lse=True))
                for _ in range(runs)]
        return _same(outs)

    def synced(fn):
        def wrapper(*a, **k):
            r = fn(*a, **k)
            sync()
            return r
        return wrapper

    dp = StagingRing(dev).upload(plan)
    for probe in ("baseline", "sync after attend", "fresh DevicePlan per run",
                  "contiguous q/k/v into attend"):
        mla = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v_dim, backend=backend)
        be = mla.backend
        if probe == "sync after attend":
            be.attend = synced(be.attend)
        elif probe == "contiguous q/k/v into attend":
            be.attend = lambda q_, k_, v_, *a, _o=be.attend, **k: _o(
                q_.contiguous(), k_.contiguous(), v_.contiguous(), *a, **k)
        if probe == "fresh DevicePlan per run":
            outs = [tuple(t.clone() for t in mla.forward(
                q, kv_c_new, k_pe_new, kv_cache, block_table, StagingRing(dev).upload(plan),
                return_lse=True)) for _ in range(runs)]
            eq, worst = _same(outs)
        else:
            eq, worst = run(mla, dp)
        rows_out.append({"stage": f"probe: {probe}", "backend": backend, "bitwise": eq,
                         "max_abs_diff": worst})
        print(f"probe {probe:<30} bitwise={eq} max|diff|={worst:.3g}", flush=True)


def _report(out: str, rows_out: list[dict], shape: dict) -> None:
    """Write the JSON (command, machine, date, rows) and print the table last."""
    sync()
    doc = {"benchmark": "determinism", "command": " ".join(sys.argv), "argv": sys.argv,
           "date_utc": utc_now(offset=True),
           "machine": machine_info(torch.device(shape["device"])),
           "shape": shape, "rows": rows_out}
    Path(out).write_text(json.dumps(doc, indent=1))
    print(f"{'stage':<15} {'backend':<8} {'bitwise':<8} max|diff|")
    for r in rows_out:
        print(f"{r['stage']:<15} {r['backend']:<8} {r['bitwise']!s:<8} {r['max_abs_diff']:.3g}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--whole-only", action="store_true",
                        help="only the whole-forward rows (e.g. under CUDA_LAUNCH_BLOCKING=1)")
    parser.add_argument("--runs", type=int, default=RUNS,
                        help=f"whole-forward repeats per backend (default {RUNS})")
    parser.add_argument("--probe", action="store_true",
                        help="also rerun the whole cuDNN forward with one stage changed at a time")
    add_cpu_smoke(parser)
    args = parser.parse_args()
    if args.runs < 2:
        parser.error(f"--runs {args.runs}: need at least 2 runs to compare")
    h, nope, rope, v_dim, rank, page = 128, 128, 64, 128, 512, 64
    if args.cpu_smoke:
        dev, backends, probe_backend = torch.device("cpu"), ("math",), "math"
        h, q_len, ctx, ws = 4, 16, 256, 128
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        dev, backends, probe_backend = torch.device("cuda"), GPU_BACKENDS, "cudnn"
        q_len, ctx, ws = 2048, 131072, 32768
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    nblocks = ctx // page
    kv_cache = torch.randn(nblocks, page, rank + rope, device=dev, dtype=dt, generator=g)
    block_table = torch.randperm(nblocks, device=dev, generator=g).to(torch.int32)[None]
    q = torch.randn(q_len, h, nope + rope, device=dev, dtype=dt, generator=g)
    kv_c_new = torch.randn(q_len, rank, device=dev, dtype=dt, generator=g)
    k_pe_new = torch.randn(q_len, rope, device=dev, dtype=dt, generator=g)
    weight = torch.randn(h * (nope + v_dim), rank, device=dev, dtype=dt, generator=g) * rank**-0.5
    plan = ChunkPlanner(ws, page).plan(PrefillBatch([q_len], [ctx], page_size=page))
    dp = StagingRing(dev).upload(plan)
    shape = {"heads": h, "q_len": q_len, "context": ctx, "workspace": ws,
             "iterations": plan.num_iterations, "runs": args.runs, "dtype": "bfloat16",
             "device": dev.type, "backends": list(backends)}
    rows_out: list[dict] = []

    for name in backends:
        mla = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v_dim, backend=name)
        fwd = [tuple(t.clone() for t in mla.forward(q, kv_c_new, k_pe_new, kv_cache, block_table,
                                                     dp, return_lse=True))
               for _ in range(args.runs)]
        eq, worst = _same(fwd)
        rows_out.append({"stage": "whole forward", "backend": name, "bitwise": eq,
                         "max_abs_diff": worst})
    if args.whole_only:
        _report(args.out, rows_out, shape)
        return 0
    if args.probe:
        _probe(q, kv_c_new, k_pe_new, kv_cache, block_table, weight, plan, dev, nope, v_dim,
               probe_backend, args.runs, rows_out)

    # Trace: record every attend call's keys and output inside the forward (a wrapper on the
    # backend instance), two runs, find the first divergence.
    for name in backends:
        mla = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v_dim, backend=name)
        be = mla.backend
        traces: list[list[tuple[str, tuple]]] = []
        for _ in range(2):
            trace: list[tuple[str, tuple]] = []

            def attend(*a, _o=be.attend, _t=trace, **k):
                r = _o(*a, **k)
                _t.append(("attend-k", (a[1].clone(), a[2].clone())))
                _t.append(("attend-out", tuple(x.clone() for x in r)))
                return r

            be.attend = attend
            try:
                mla.forward(q, kv_c_new, k_pe_new, kv_cache, block_table, dp, return_lse=True)
            finally:
                del be.attend
            traces.append(trace)
        first = None
        for j, ((tag, a), (_, b)) in enumerate(zip(traces[0], traces[1], strict=True)):
            eq, worst = _same([a, b])
            if not eq:
                first = f"#{j} {tag}: max|diff| {worst:.3g}"
                break
        rows_out.append({"stage": "trace first diff", "backend": name,
                         "bitwise": first is None, "max_abs_diff": 0.0,
                         "first_divergence": first,
                         "calls": [t for t, _ in traces[0]]})
        print(name, "first divergence:", first, [t for t, _ in traces[0]])

    # Stages of iteration 1 on identical inputs.
    t = dp.tensors
    n = plan.iteration_tokens[1]
    ws_buf = torch.empty(plan.max_iteration_tokens, rank + rope, device=dev, dtype=dt)
    gathers = [(gather_context_rows(kv_cache, block_table, t["cu_seq_lens"][1],
                                    t["chunk_starts"][1], ws_buf, n).clone(),)
               for _ in range(RUNS)]
    eq, worst = _same(gathers)
    rows_out.append({"stage": "gather", "backend": "-", "bitwise": eq, "max_abs_diff": worst})
    rows = gathers[0][0]
    for name in backends:
        mla = MLAChunkedPrefill(weight, qk_nope_head_dim=nope, v_head_dim=v_dim, backend=name)
        vpad = mla.backend.needs_v_padded
        ups = []
        for _ in range(RUNS):  # joined keys [k_nope | k_pe], as attend() takes them
            buf = torch.empty(mla.upproj.kv_numel(n, nope + rope, vpad), device=dev, dtype=dt)
            ups.append(mla.upproj.project(rows[:, :rank], rows[:, rank:], buf, rope,
                                          joined=True, v_padded=vpad))
        eq, worst = _same(ups)
        rows_out.append({"stage": "up-projection", "backend": name, "bitwise": eq,
                         "max_abs_diff": worst})
        k, v = ups[0]
        backend = get_backend(name, device=dev, dtype=dt, qk_head_dim=nope + rope,
                              v_head_dim=v_dim)
        cu_q = t["cu_query_lens"]
        seqs = VarlenSeqs(cu_q, t["cu_seq_lens"][1], plan.max_query_len, plan.max_chunk_lens[1],
                          cu_seqlens_q_host=plan.cu_query_lens,
                          cu_seqlens_k_host=plan.cu_seq_lens[1])
        att = [tuple(x.clone() for x in backend.attend(
            q, k, v, seqs, causal=False, softmax_scale=(nope + rope) ** -0.5))
            for _ in range(RUNS)]
        eq, worst = _same(att)
        rows_out.append({"stage": "attention", "backend": name, "bitwise": eq,
                         "max_abs_diff": worst})
        o, lse = att[0]
        o = o[..., :v_dim]
        merges = []
        for _ in range(RUNS):
            acc, acc_lse = o.clone().contiguous(), lse.clone().contiguous().float()
            merge_attention_states(acc, acc_lse, att[1][0][..., :v_dim], att[1][1] - 0.5)
            merges.append((acc, acc_lse))
        eq, worst = _same(merges)
        rows_out.append({"stage": "merge", "backend": name, "bitwise": eq,
                         "max_abs_diff": worst})
    _report(args.out, rows_out, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
