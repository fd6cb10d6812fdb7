# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""H200 benchmark of the forward: backends, gather, merge, whole chunked forward, policies.

Usage::

    PYTHONPATH=src python benchmarks/attention.py --out benchmarks/results/attention_h200.json

    PYTHONPATH=src python benchmarks/attention.py --cpu-smoke --out /tmp/attention.json

Sections (each recorded in the JSON). A section that raises stops the run with its traceback
and a non-zero exit, after writing the sections done so far and ``"incomplete"`` to ``--out``:
an API error is never recorded as a row of a successful run. ``--cpu-smoke``: the attention,
forward, vs_ideal and policies sections on tiny CPU shapes with the math backend (gather and
merge sweep Triton configs: GPU only); times are host wall clock there.

Correctness (every backend against the float64 math reference, the forward against
:func:`mlaprefill.reference.mla_prefill_reference`, the Triton kernels against their torch
fallbacks, the no-sync proof) is in the ``gpu``-marked tests (``tests/test_attention_gpu.py``),
not here.

* ``attention`` — TFLOP/s per backend, non-causal context chunks of 4k-64k keys, 1-16 requests;
  FLOPs = 2 * sum_r(q_r * k_r) * H * (qk_head_dim + v_head_dim) (= 2·Tq·Tk·H·(192+128) for one
  request).
* ``gather`` — GB/s, bytes = rows * 576 * 2 (read) + same (written) + rows * 4 (block table),
  against a plain device-to-device copy of the same bytes measured in the same run.
* ``merge`` — GB/s, bytes = 3 * T * H * 128 * 2 + 3 * T * H * 4.
* ``forward`` — the whole chunked-context forward vs the sum of its parts each timed alone.
* ``policies`` — the whole forward per planner policy.
* ``vs_ideal`` — the whole forward per backend against the lower bound of issue #11 (one GEMM
  + one cuDNN SDPA over the whole context + one causal SDPA), 1-16 requests, 16 and 128 heads,
  4k-128k contexts; also the forward's host enqueue time and kernel builds after its first call.
  ``--repeats R``: R interleaved rounds per shape, the median ratio and its min / max (two runs
  20 minutes apart differed by up to 15 % on one shape).

Times: ``triton.testing.do_bench`` (CUDA events, warm-up excluded), median over its repetitions.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from _common import (
    add_cpu_smoke,
    apply_overrides,
    empty_cache,
    host_enqueue_ms,
    kernel_ms,
    sync,
    write_json,
)
from mlaprefill._env import machine_info, utc_now
from mlaprefill.backends import VarlenSeqs

GRAPHS = "+graphs"  # backend suffix: the forward as CUDA-graph replays (IterationGraphs)
DTYPE = torch.bfloat16

H = 128
RANK, NOPE, ROPE, VDIM = 512, 128, 64, 128
QK = NOPE + ROPE
PAGE = 64


def _bench(fn: Any, rep: int = 60) -> dict[str, float]:
    return kernel_ms(fn, warmup=10, rep=rep)


def _bench_graph(fn: Any, rep: int = 40) -> dict[str, float]:
    """Kernel time without host launch overhead: ``fn`` captured in a CUDA graph and replayed.

    Small memory-bound kernels (a 16k-row gather moves 38 MB in ~10 us) are otherwise timed as
    the host's launch cost, which in the forward hides behind milliseconds of attention.
    """
    return kernel_ms(fn, rep=rep, graph=True)


def _section(results: dict, name: str, fn: Any, dump: Any = None) -> None:
    """Run one section; an error raises (after writing the sections done so far, marked
    ``"incomplete"``), so a broken API call is never a row of a successful run."""
    t0 = time.time()
    try:
        results[name] = fn()
    except BaseException:
        results["incomplete"] = f"section {name!r} raised; see the traceback on stderr"
        raise
    finally:
        print(f"[{name}] {time.time() - t0:.1f} s", flush=True)
        if dump is not None:
            dump()  # partial results: a run stopped at its time limit keeps what it measured


def _varlen_inputs(q_lens: list[int], k_lens: list[int], heads: int, dtype: torch.dtype,
                   device: str, v_dim: int = VDIM) -> dict[str, Any]:
    def cu(lens: list[int]) -> torch.Tensor:
        c = [0]
        for n in lens:
            c.append(c[-1] + n)
        return torch.tensor(c, dtype=torch.int32, device=device)

    tq, tk = sum(q_lens), sum(k_lens)
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "q": torch.randn(tq, heads, QK, device=device, dtype=dtype, generator=g),
        "k": torch.randn(tk, heads, QK, device=device, dtype=dtype, generator=g),
        "v": torch.randn(tk, heads, v_dim, device=device, dtype=dtype, generator=g),
        "cu_q": cu(q_lens), "cu_k": cu(k_lens), "max_q": max(q_lens), "max_k": max(k_lens),
        "cu_q_host": cu(q_lens).cpu().numpy(), "cu_k_host": cu(k_lens).cpu().numpy(),
    }


# ---------------------------------------------------------------------------------------------
# inputs and timing
def _forward_inputs(query_lens: list[int], context_lens: list[int], heads: int,
                    dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(seed)
    num_reqs = len(query_lens)
    blocks_per_req = [max(1, -(-c // PAGE)) for c in context_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device=device)
    off = 0
    for r, nb in enumerate(blocks_per_req):
        table[r, :nb] = perm[off:off + nb]
        off += nb
    t = sum(query_lens)
    return {
        "q": torch.randn(t, heads, QK, device=device, dtype=dtype, generator=g),
        "kv_c_new": torch.randn(t, RANK, device=device, dtype=dtype, generator=g),
        "k_pe_new": torch.randn(t, ROPE, device=device, dtype=dtype, generator=g),
        "kv_cache": torch.randn(num_blocks, PAGE, RANK + ROPE, device=device, dtype=dtype,
                                generator=g),
        "block_table": table,
        "weight": torch.randn(heads * (NOPE + VDIM), RANK, device=device, dtype=dtype,
                              generator=g) * RANK ** -0.5,
        "query_lens": query_lens, "context_lens": context_lens,
    }


def _auto_forward(x: dict[str, Any], backend: str, workspace: int, device: str
                  ) -> tuple[Any, Any, Any]:
    """``(op, plan, fwd)``: the forward of ``x``'s requests on ``backend`` (``NAME+graphs``:
    with ``graphs=IterationGraphs()``, q written once into ``io_buffers(T).q`` as an engine's
    q projection would, and the output taken as ``out=io.out``) planned with the backend's
    auto policy, ``fwd()`` running it once (plan uploaded once)."""
    from mlaprefill import IterationGraphs, MLAChunkedPrefill
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.staging import StagingRing

    base = backend.removesuffix(GRAPHS)
    graphs = IterationGraphs() if backend.endswith(GRAPHS) else None
    op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=VDIM,
                           backend=base, qk_rope_head_dim=ROPE, graphs=graphs)
    plan = ChunkPlanner(workspace, PAGE, policy=op.resolve_policy("auto")).plan(
        PrefillBatch(x["query_lens"], x["context_lens"], page_size=PAGE))
    dplan = StagingRing(device).upload(plan)
    q, out, lse = x["q"], None, None
    if graphs is not None:
        q, out, lse = op.io_buffers(x["q"].shape[0])
        q.copy_(x["q"])

    def fwd() -> Any:
        return op.forward(q, x["kv_c_new"], x["k_pe_new"], x["kv_cache"], x["block_table"],
                          dplan, return_lse=True, out=out, lse=lse)

    return op, plan, fwd


def _label(op: Any, backend: str) -> str:
    """The backend an :func:`_auto_forward` op of ``backend`` runs, as results name it
    (``NAME+graphs``: ``auto`` resolved)."""
    return op.backend_name + (GRAPHS if op.graphs is not None else "")


ATTN_SHAPES = [  # (num_reqs, total queries, total keys)
    (1, 4096, 4096), (1, 4096, 16384), (1, 4096, 65536),
    (4, 4096, 16384), (16, 4096, 65536), (16, 4096, 16384),
]


def bench_attention(device: str, backends: list[str], quick: bool,
                    shapes: list[tuple[int, int, int]] | None = None) -> dict:
    from mlaprefill.backends import get_backend

    rows = []
    for nr, tq, tk in shapes or (ATTN_SHAPES[:3] if quick else ATTN_SHAPES):
        ql, kl = [tq // nr] * nr, [tk // nr] * nr
        flops = 2 * sum(a * b for a, b in zip(ql, kl, strict=True)) * H * (QK + VDIM)
        for name in backends:
            if name == "flex" and (nr, tq, tk) not in ((1, 4096, 16384), (16, 4096, 65536)):
                continue  # each new shape recompiles flex; two shapes keep the run short
            be = get_backend(name, device=device, dtype=torch.bfloat16, qk_head_dim=QK,
                             v_head_dim=VDIM)
            x = _varlen_inputs(ql, kl, H, torch.bfloat16, device,
                               v_dim=QK if be.needs_v_padded else VDIM)

            def run(be: Any = be, x: dict = x) -> Any:
                seqs = VarlenSeqs(x["cu_q"], x["cu_k"], x["max_q"], x["max_k"],
                                  cu_seqlens_q_host=x["cu_q_host"],
                                  cu_seqlens_k_host=x["cu_k_host"])
                return be.attend(x["q"], x["k"], x["v"], seqs, causal=False,
                                 softmax_scale=QK ** -0.5)

            sync()
            t0 = time.perf_counter()
            run()  # first call of this shape: includes compile / cuDNN graph build
            sync()
            first_ms = (time.perf_counter() - t0) * 1e3
            t = _bench(run)
            rows.append({"backend": name, "num_reqs": nr, "tq": tq, "tk": tk, **t,
                         "first_call_ms": first_ms,
                         "tflops": flops / (t["median_ms"] * 1e-3) / 1e12})
            empty_cache()
    return {"flops_formula": "2 * sum_r(q_r*k_r) * H * (192 + 128), H=128", "rows": rows}


def bench_gather(device: str) -> dict:
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.kernels import gather_context_rows
    from mlaprefill.plan import ChunkPlanner

    rows = []
    for nr, ctx in ((1, 16384), (4, 16384), (16, 4096), (1, 65536), (16, 8192)):
        x = _forward_inputs([1] * nr, [ctx] * nr, 1, torch.bfloat16, device)
        total = nr * ctx
        plan = ChunkPlanner(total, PAGE).plan(PrefillBatch([1] * nr, [ctx] * nr,
                                                           page_size=PAGE))
        cu = torch.from_numpy(plan.cu_seq_lens[0]).to(device)
        cs = torch.from_numpy(plan.chunk_starts[0]).to(device)
        n = plan.iteration_tokens[0]
        ws = torch.empty(n, RANK + ROPE, device=device, dtype=torch.bfloat16)
        nbytes = n * (RANK + ROPE) * 2 * 2 + n * 4
        src = torch.empty_like(ws)
        copy_t = _bench_graph(lambda ws=ws, src=src: ws.copy_(src))
        best = None
        sweep = {}
        for br in (8, 16, 32, 64):
            for nw in (2, 4, 8):
                def fn(br: int = br, nw: int = nw) -> Any:
                    return gather_context_rows(x["kv_cache"], x["block_table"], cu, cs, ws,
                                               n, block_rows=br, num_warps=nw)
                fn()
                t = _bench_graph(fn, rep=20)
                sweep[f"rows{br}_warps{nw}"] = nbytes / (t["median_ms"] * 1e-3) / 1e9
                if best is None or t["median_ms"] < best[1]["median_ms"]:
                    best = ((br, nw), t)

        def default(x: dict = x) -> Any:
            return gather_context_rows(x["kv_cache"], x["block_table"], cu, cs, ws, n)

        default_t = _bench_graph(default)
        eager_t = _bench(default)
        rows.append({
            "num_reqs": nr, "rows": n, "bytes": nbytes,
            "default_gbps": nbytes / (default_t["median_ms"] * 1e-3) / 1e9,
            "default_ms": default_t["median_ms"], "timing": "cuda graph replay",
            "default_gbps_eager_launch": nbytes / (eager_t["median_ms"] * 1e-3) / 1e9,
            "best_config": {"block_rows": best[0][0], "num_warps": best[0][1]},
            "best_gbps": nbytes / (best[1]["median_ms"] * 1e-3) / 1e9,
            "d2d_copy_gbps": 2 * n * (RANK + ROPE) * 2 / (copy_t["median_ms"] * 1e-3) / 1e9,
            "sweep_gbps": sweep,
        })
        empty_cache()
    big = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)
    t = _bench_graph(lambda: big2.copy_(big))
    return {"bytes_formula": "rows*576*2 read + rows*576*2 written + rows*4 block-table reads",
            "rows": rows, "d2d_copy_2GiB_gbps": 2 * big.numel() / (t["median_ms"] * 1e-3) / 1e9}


def bench_merge(device: str) -> dict:
    from mlaprefill.kernels import merge_attention_states

    rows = []
    for t_, strided in ((4096, False), (4096, True), (16384, False)):
        o = torch.randn(t_, H, VDIM, device=device).bfloat16()
        lse = torch.randn(t_, H, device=device)
        po = (torch.randn(t_, H, QK, device=device).bfloat16()[..., :VDIM] if strided
              else torch.randn(t_, H, VDIM, device=device).bfloat16())
        pl = torch.randn(t_, H, device=device)
        nbytes = 3 * t_ * H * VDIM * 2 + 3 * t_ * H * 4
        best = None
        for br in (4, 8, 16, 32):
            for nw in (2, 4, 8):
                tm = _bench_graph(lambda br=br, nw=nw: merge_attention_states(
                    o, lse, po, pl, block_rows=br, num_warps=nw), rep=20)
                if best is None or tm["median_ms"] < best[1]:
                    best = ((br, nw), tm["median_ms"])
        tm = _bench_graph(lambda: merge_attention_states(o, lse, po, pl))
        te = _bench(lambda: merge_attention_states(o, lse, po, pl))
        rows.append({"tokens": t_, "part_out_strided": strided, "bytes": nbytes,
                     "timing": "cuda graph replay",
                     "default_gbps": nbytes / (tm["median_ms"] * 1e-3) / 1e9,
                     "default_gbps_eager_launch": nbytes / (te["median_ms"] * 1e-3) / 1e9,
                     "best_config": {"block_rows": best[0][0], "num_warps": best[0][1]},
                     "best_gbps": nbytes / (best[1] * 1e-3) / 1e9})
    return {"bytes_formula": "3*T*H*128*2 + 3*T*H*4", "rows": rows}


FORWARD_SHAPES = [  # (query_lens, context_lens, workspace_tokens)
    ([4096], [65536], 32768),
    ([1024] * 4, [16384] * 4, 32768),
    ([256] * 16, [4096] * 16, 16384),
]


def bench_forward(device: str, backends: list[str],
                  shapes: list[tuple[list[int], list[int], int]] | None = None,
                  heads: int = H) -> dict:
    from mlaprefill import MLAChunkedPrefill
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.kernels import gather_context_rows, merge_attention_states
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.staging import StagingRing

    rows = []
    for ql, cl, ws in shapes or FORWARD_SHAPES:
        x = _forward_inputs(ql, cl, heads, torch.bfloat16, device)
        plan = ChunkPlanner(ws, PAGE).plan(PrefillBatch(ql, cl, page_size=PAGE))
        dplan = StagingRing(device).upload(plan)
        for name in backends:
            if name == "flex":
                continue
            op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=VDIM,
                                   backend=name)

            def fwd(op: Any = op) -> Any:
                return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"], x["kv_cache"],
                                  x["block_table"], dplan, return_lse=True)

            fwd()
            host_ms = []
            for _ in range(5):
                sync()
                t0 = time.perf_counter()
                fwd()  # host time to enqueue the whole forward (no sync inside)
                host_ms.append((time.perf_counter() - t0) * 1e3)
            sync()
            t_fwd = _bench(fwd, rep=100)
            # Parts, each alone on the same shapes.
            be = op.backend
            t = sum(ql)
            up, vpad = op.upproj, be.needs_v_padded
            w_hf = x["weight"]  # [H*(nope+v), rank]: the ideal up-projection (no zero rows)
            # joined keys [k_nope | k_pe] per head, as attend() takes them (k_rope=None)
            buf_new = torch.empty(up.kv_numel(t, QK, vpad), device=device, dtype=DTYPE)
            k_new, v_new = up.project(x["kv_c_new"], x["k_pe_new"], buf_new, ROPE,
                                      joined=True, v_padded=vpad)
            cu_q = dplan.tensors["cu_query_lens"]
            parts = {"up_new": _bench(lambda: x["kv_c_new"] @ w_hf.t())["median_ms"]}
            hq = plan.cu_query_lens
            new_seqs = VarlenSeqs(cu_q, cu_q, plan.max_query_len, plan.max_query_len,
                                  cu_seqlens_q_host=hq, cu_seqlens_k_host=hq)
            parts["attn_new"] = _bench(lambda: be.attend(
                x["q"], k_new, v_new, new_seqs, causal=True,
                softmax_scale=QK ** -0.5))["median_ms"]
            wsp = torch.empty(plan.max_iteration_tokens, RANK + ROPE, device=device,
                              dtype=torch.bfloat16)
            out = torch.zeros(t, heads, VDIM, device=device, dtype=torch.bfloat16)
            lse = torch.zeros(t, heads, device=device)
            for key in ("gather", "up_ctx", "attn_ctx", "merge"):
                parts[key] = 0.0
            for i in range(plan.num_iterations):
                n = plan.iteration_tokens[i]
                cu = dplan.tensors["cu_seq_lens"][i]
                cs = dplan.tensors["chunk_starts"][i]
                parts["gather"] += _bench(lambda n=n, cu=cu, cs=cs: (
                    gather_context_rows(x["kv_cache"], x["block_table"], cu, cs, wsp,
                                        n)))["median_ms"]
                kv_c = wsp[:n, :RANK]
                parts["up_ctx"] += _bench(lambda kv_c=kv_c: kv_c @ w_hf.t())["median_ms"]
                buf_i = torch.empty(up.kv_numel(n, QK, vpad), device=device, dtype=DTYPE)
                k_i, v_i = up.project(wsp[:n, :RANK], wsp[:n, RANK:], buf_i, ROPE,
                                      joined=True, v_padded=vpad)
                hk = plan.cu_seq_lens[i]
                parts["attn_ctx"] += _bench(lambda k_i=k_i, v_i=v_i, cu=cu, i=i, hk=hk: (
                    be.attend(x["q"], k_i, v_i, VarlenSeqs(
                        cu_q, cu, plan.max_query_len, plan.max_chunk_lens[i],
                        cu_seqlens_q_host=hq, cu_seqlens_k_host=hk), causal=False,
                        softmax_scale=QK ** -0.5)))["median_ms"]
                o_i, l_i = be.attend(x["q"], k_i, v_i, VarlenSeqs(
                    cu_q, cu, plan.max_query_len, plan.max_chunk_lens[i],
                    cu_seqlens_q_host=hq, cu_seqlens_k_host=hk), causal=False,
                    softmax_scale=QK ** -0.5)
                parts["merge"] += _bench(lambda o_i=o_i, l_i=l_i: merge_attention_states(
                    out, lse, o_i[..., :VDIM], l_i))["median_ms"]
                del k_i, v_i, o_i, l_i, buf_i
            ideal = sum(parts.values())
            flops_attn = 2 * heads * (QK + VDIM) * sum(
                q * (c + (q + 1) / 2) for q, c in zip(ql, cl, strict=True))
            rows.append({
                "backend": name, "heads": heads, "query_lens": f"{len(ql)}x{ql[0]}",
                "context_lens": f"{len(cl)}x{cl[0]}", "workspace_tokens": ws,
                "iterations": plan.num_iterations, "forward_ms": t_fwd["median_ms"],
                "forward_p20_ms": t_fwd["p20_ms"], "forward_p80_ms": t_fwd["p80_ms"],
                "host_enqueue_ms_median": sorted(host_ms)[2],
                "parts_ms": parts, "ideal_sum_ms": ideal,
                "ratio_forward_over_ideal": t_fwd["median_ms"] / ideal,
                "attention_tflops_effective": flops_attn / (t_fwd["median_ms"] * 1e-3) / 1e12,
            })
            del op
            empty_cache()
        empty_cache()
    return {"ideal": "sum of parts each timed alone: new-token up-projection (HF weight, no "
                     "zero rows) + causal attention, and per iteration gather + up-projection "
                     "+ attention + merge", "rows": rows}


# (heads, num_reqs, queries per request, context tokens per request)
IDEAL_SHAPES = [
    (128, 1, 4096, 4096), (128, 1, 4096, 32768), (128, 1, 4096, 131072),
    (128, 4, 1024, 32768), (128, 16, 256, 8192),
    (16, 1, 4096, 4096), (16, 1, 4096, 131072), (16, 4, 1024, 32768),
    (16, 16, 256, 8192), (16, 16, 256, 131072),
    # lengths off the mlaprefill backend's grid (no batched cuDNN call): the Triton fallback
    (128, 4, 1000, 30000), (16, 16, 250, 8000),
]
IDEAL_WORKSPACE = 65536  # vLLM's default chunked-context workspace


def _ideal_ms(heads: int, nr: int, q: int, c: int, device: str) -> dict[str, float]:
    """The lower bound of issue #11: one up-projection GEMM of every row (HF weight, no zero
    rows) + one batched cuDNN SDPA of every request over its whole unchunked context + one
    batched causal cuDNN SDPA over the new tokens (kernel times, each alone)."""
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(1)
    if device == "cpu":  # --cpu-smoke: torch's SDPA stands in for cuDNN's
        def op(q, k, v, _bias, _lse, _p, causal, _dbg, *, scale):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                    scale=scale)
    else:
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
    w = torch.randn(heads * (NOPE + VDIM), RANK, device=device, dtype=dt, generator=g)
    lat = torch.randn(nr * (c + q), RANK, device=device, dtype=dt, generator=g)
    gemm = _bench(lambda: lat @ w.t())["median_ms"]
    lat = None  # free before the attention inputs
    qq = torch.randn(nr, heads, q, QK, device=device, dtype=dt, generator=g)
    kk = torch.randn(nr, heads, c, QK, device=device, dtype=dt, generator=g)
    vv = torch.randn(nr, heads, c, VDIM, device=device, dtype=dt, generator=g)
    ctx = _bench(lambda: op(qq, kk, vv, None, True, 0.0, False, False, scale=QK ** -0.5))
    kk = vv = None
    kn = torch.randn(nr, heads, q, QK, device=device, dtype=dt, generator=g)
    vn = torch.randn(nr, heads, q, VDIM, device=device, dtype=dt, generator=g)
    new = _bench(lambda: op(qq, kn, vn, None, True, 0.0, True, False, scale=QK ** -0.5))
    return {"gemm_ms": gemm, "context_sdpa_ms": ctx["median_ms"], "causal_sdpa_ms":
            new["median_ms"], "ideal_ms": gemm + ctx["median_ms"] + new["median_ms"]}


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """``"128:4x1024:131072,16:1x4096:4096"`` -> [(heads, num_reqs, query_len, context_len)]."""
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            heads, reqs, ctx = item.split(":")
            nr, q = reqs.split("x")
            shapes.append((int(heads), int(nr), int(q), int(ctx)))
        except ValueError:
            raise ValueError(f"--ideal-shapes item {item!r} is not HEADS:NREQSxQUERIES:CONTEXT "
                             f"(e.g. 128:4x1024:131072)") from None
    return shapes


def bench_vs_ideal(device: str, backends: list[str], repeats: int = 1,
                   shapes: list[tuple[int, int, int, int]] | None = None) -> dict:
    """The whole forward per backend against the issue-#11 ideal on the same shape.

    ``repeats`` rounds per shape, each timing the ideal and then every backend's forward, so
    drift between the start and the end of a run hits all of them alike; the row gives the
    median ratio over rounds and its min / max (one round: the ratio of that round). A backend
    named ``NAME+graphs`` is ``NAME`` with ``graphs=IterationGraphs()`` and its ``io_buffers``.
    """
    rows = []
    for heads, nr, q, c in shapes or IDEAL_SHAPES:
        shape = {"heads": heads, "num_reqs": nr, "query_len": q, "context_len": c,
                 "workspace_tokens": IDEAL_WORKSPACE, "repeats": repeats}
        x = _forward_inputs([q] * nr, [c] * nr, heads, torch.bfloat16, device)
        setups: dict[str, dict[str, Any]] = {}
        for name in backends:  # build, first call, host enqueue: once per backend
            op, plan, fwd = _auto_forward(x, name, IDEAL_WORKSPACE, device)
            b0 = op.backend.builds()
            sync()
            t0 = time.perf_counter()
            fwd()
            first_host_ms = (time.perf_counter() - t0) * 1e3
            sync()
            b1 = op.backend.builds()
            host = host_enqueue_ms(fwd)
            setups[name] = {"op": op, "fwd": fwd, "b0": b0, "b1": b1, "rounds": [],
                            "row": {**shape, "backend": _label(op, name), "policy": plan.policy,
                                    "iterations": plan.num_iterations,
                                    "first_call_host_ms": first_host_ms,
                                    "host_enqueue_ms_p50": host[len(host) // 2],
                                    "host_enqueue_ms_max": host[-1]}}
        # builds() counts process-wide: what the rounds build, after every backend's first call
        # (a backend's own "after its first call" would count the later backends' first calls)
        for st in setups.values():
            st["b_rounds"] = st["op"].backend.builds()
        ideals = []
        for _ in range(repeats):
            ideals.append(_ideal_ms(heads, nr, q, c, device))
            empty_cache()
            for st in setups.values():
                st["rounds"].append(_bench(st["fwd"], rep=100))
        for st in setups.values():
            done = st["rounds"]
            if not done:
                continue
            ratios = [t["median_ms"] / i["ideal_ms"] for t, i in zip(done, ideals, strict=True)]
            mid = sorted(range(len(done)), key=lambda k: ratios[k])[len(done) // 2]
            b2 = st["op"].backend.builds()
            b0, b1 = st["b0"], st["b1"]
            rows.append({**st["row"], "forward_ms": done[mid]["median_ms"],
                         "forward_p20_ms": done[mid]["p20_ms"],
                         "forward_p80_ms": done[mid]["p80_ms"], **ideals[mid],
                         "ratio_to_ideal": ratios[mid], "ratio_min": min(ratios),
                         "ratio_max": max(ratios),
                         "forward_ms_per_round": [t["median_ms"] for t in done],
                         "ideal_ms_per_round": [i["ideal_ms"] for i in ideals[:len(done)]],
                         "builds_first_call": None if b0 is None else b1 - b0,
                         "builds_after_first_call": None if b0 is None
                         else b2 - st["b_rounds"]})
            r = rows[-1]
            spread = (f" [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]" if len(done) > 1
                      else "")
            print(f"  H={heads:>3} {nr:>2}x{q:<5} ctx {c:>6} {r['backend']:<7} "
                  f"{r['forward_ms']:8.3f} ms ideal {r['ideal_ms']:8.3f} ms "
                  f"ratio {r['ratio_to_ideal']:.3f}{spread} host p50 "
                  f"{r['host_enqueue_ms_p50']:.3f} ms", flush=True)
        setups.clear()
        x = None
        empty_cache()
    return {"ideal": "one up-projection GEMM of every context and new row (HF weight) + one "
                     "batched cuDNN SDPA over each request's whole context + one batched causal "
                     "cuDNN SDPA over the new tokens (kernel medians, each alone)",
            "target": "forward_ms / ideal_ms <= 1.15",
            "rounds": "per shape, `repeats` rounds of (ideal, every backend's forward); a row "
                      "gives the round with the median ratio and the min / max over rounds",
            "builds": "builds_first_call: kernel builds (cuDNN graphs, compiles) during the "
                      "backend's first call on the shape; builds_after_first_call: builds during "
                      "the shape's timed rounds, after every backend's first call (the counter "
                      "is process-wide)",
            "rows": rows}


# (name, query_lens, context_lens, workspace_tokens): steps that mix long and short contexts
POLICY_SHAPES = [
    ("uneven-8", [512] * 8, [155648, 98304, 61440, 32768, 16384, 8192, 8192, 4096], 65536),
    ("one-long", [256] * 4, [163840, 8192, 4096, 100], 65536),
]


def bench_policies(device: str, backends: list[str], shapes: list[Any] | None = None,
                   heads_list: tuple[int, ...] = (16, 128)) -> dict:
    """The whole forward per planner policy on steps that mix long and short contexts, with 16
    heads (DeepSeek-V3 at tensor parallel 8, the bench's model) and 128 heads (unsharded)."""
    from mlaprefill import MLAChunkedPrefill
    from mlaprefill.batch import PrefillBatch
    from mlaprefill.plan import ChunkPlanner
    from mlaprefill.staging import StagingRing

    rows = []
    shapes = shapes or POLICY_SHAPES
    for heads in heads_list:
        for shape, ql, cl, ws in shapes:
            x = _forward_inputs(ql, cl, heads, torch.bfloat16, device)
            batch = PrefillBatch(ql, cl, page_size=PAGE)
            for name in [b for b in backends if b != "flex"]:
                op = MLAChunkedPrefill(x["weight"], qk_nope_head_dim=NOPE, v_head_dim=VDIM,
                                       backend=name)
                for policy in ("equal", "packed", "balanced"):
                    row: dict[str, Any] = {"heads": heads, "shape": shape, "backend": name,
                                           "policy": policy, "workspace_tokens": ws}
                    plan = ChunkPlanner(ws, PAGE, policy=policy).plan(batch)
                    dplan = StagingRing(device).upload(plan)

                    def fwd(op: Any = op, dplan: Any = dplan, x: dict = x) -> Any:
                        return op.forward(x["q"], x["kv_c_new"], x["k_pe_new"],
                                          x["kv_cache"], x["block_table"], dplan)

                    fwd()  # warm-up (cuDNN builds a graph per new chunk shape)
                    t = _bench(fwd, rep=20)
                    row.update(iterations=plan.num_iterations,
                               requests_per_iteration=[int(n) for n in
                                                       (plan.chunk_lens > 0).sum(axis=1)],
                               forward_ms=t["median_ms"], forward_p20_ms=t["p20_ms"],
                               forward_p80_ms=t["p80_ms"])
                    rows.append(row)
                del op
            del x
            empty_cache()
    return {"query_lens_note": "shape -> (query_lens, context_lens, workspace)",
            "shapes": {n: {"query_lens": q, "context_lens": c, "workspace_tokens": w}
                       for n, q, c, w in shapes}, "rows": rows}


# ---------------------------------------------------------------------------------------------
def _table(results: dict) -> str:
    lines = []
    att = results.get("attention", {})
    if "rows" in att:
        lines.append("attention (non-causal context chunk, H=128, 192/128, bf16), TFLOP/s:")
        for r in att["rows"]:
            val = (f"{r['tflops']:7.1f}  (first call {r['first_call_ms']:7.1f} ms)"
                   if "tflops" in r else "  error")
            lines.append(f"  {r['backend']:7s} reqs={r['num_reqs']:2d} tq={r['tq']:5d} "
                         f"tk={r['tk']:6d}  {val}")
    ga = results.get("gather", {})
    if "rows" in ga:
        lines.append(f"gather GB/s, CUDA-graph replay (D2D copy 2 GiB: "
                     f"{ga['d2d_copy_2GiB_gbps']:.0f}):")
        for r in ga["rows"]:
            lines.append(f"  reqs={r['num_reqs']:2d} rows={r['rows']:6d} default "
                         f"{r['default_gbps']:6.0f} best {r['best_gbps']:6.0f} "
                         f"{r['best_config']}  same-bytes copy {r['d2d_copy_gbps']:6.0f}  "
                         f"eager {r['default_gbps_eager_launch']:6.0f}")
    me = results.get("merge", {})
    if "rows" in me:
        lines.append("merge GB/s, CUDA-graph replay:")
        for r in me["rows"]:
            lines.append(f"  T={r['tokens']:5d} strided={r['part_out_strided']!s:5s} default "
                         f"{r['default_gbps']:6.0f} best {r['best_gbps']:6.0f} "
                         f"{r['best_config']}  eager {r['default_gbps_eager_launch']:6.0f}")
    fw = results.get("forward", {})
    if "rows" in fw:
        lines.append("forward vs ideal sum of parts:")
        for r in fw["rows"]:
            if "error" in r:
                lines.append(f"  {r['backend']:7s} {r['query_lens']}: error")
                continue
            lines.append(f"  {r['backend']:7s} q={r['query_lens']:8s} ctx={r['context_lens']:8s}"
                         f" it={r['iterations']} fwd {r['forward_ms']:7.2f} ms ideal "
                         f"{r['ideal_sum_ms']:7.2f} ms ratio {r['ratio_forward_over_ideal']:.3f}"
                         f" ({r['attention_tflops_effective']:.0f} TFLOP/s eff, host "
                         f"{r['host_enqueue_ms_median']:.2f} ms)")
    po = results.get("policies", {})
    if "rows" in po:
        lines.append("forward per planner policy (ms, median):")
        for r in po["rows"]:
            if "error" in r:
                lines.append(f"  H={r['heads']:3d} {r['shape']:9s} {r['backend']:7s} "
                             f"{r['policy']:8s} error")
                continue
            lines.append(f"  H={r['heads']:3d} {r['shape']:9s} {r['backend']:7s} "
                         f"{r['policy']:8s} it={r['iterations']:3d} {r['forward_ms']:8.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--quick", action="store_true", help="fewer attention shapes")
    parser.add_argument("--skip", default="", help="comma list of sections to skip")
    parser.add_argument("--backends", default="mlaprefill,cudnn,flex,fa2",
                        help="comma list; NAME+graphs: the forward with IterationGraphs "
                             "(vs_ideal)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="vs_ideal: rounds per shape (ideal and every backend each round)")
    parser.add_argument("--ideal-shapes", default="",
                        help="vs_ideal: HEADS:NREQSxQUERIES:CONTEXT,... instead of IDEAL_SHAPES")
    add_cpu_smoke(parser)
    parser.add_argument("--override", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a module constant first (an A/B run; repeatable)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    try:
        ideal_shapes = parse_shapes(args.ideal_shapes)
        overrides = apply_overrides(args.override)
    except ValueError as exc:
        parser.error(str(exc))
    if args.cpu_smoke:
        # the same sections on CPU tensors, math backend, tiny shapes: the library calls run,
        # the times are host wall clock and mean nothing
        device, backends, skip = "cpu", ["math"], {"gather", "merge"}
        smoke = {"attention": [(2, 32, 96)], "forward": [([16, 8], [300, 64], 256)],
                 "ideal": [(4, 2, 16, 200)],
                 "policies": [("smoke", [8, 8], [400, 64], 256)]}
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        device, backends, skip = "cuda", [b for b in args.backends.split(",") if b], \
            set(args.skip.split(","))
        smoke = {}
    results: dict[str, Any] = {
        "command": " ".join(sys.argv), "argv": sys.argv,
        "date_utc": utc_now(offset=True),
        "machine": machine_info(torch.device(device)),
    }
    if overrides:
        results["overrides"] = overrides

    def dump() -> None:
        write_json(args.out, results)

    if "gather" not in skip:
        _section(results, "gather", lambda: bench_gather(device), dump)
    if "merge" not in skip:
        _section(results, "merge", lambda: bench_merge(device), dump)
    if "attention" not in skip:
        _section(results, "attention", lambda: bench_attention(device, backends, args.quick,
                                                                 smoke.get("attention")),
                 dump)
    if "forward" not in skip:
        _section(results, "forward", lambda: bench_forward(device, backends,
                                                             smoke.get("forward"),
                                                             4 if smoke else H), dump)
    if "vs_ideal" not in skip:
        _section(results, "vs_ideal", lambda: bench_vs_ideal(
            device, backends, args.repeats, smoke.get("ideal", ideal_shapes)),
                 dump)
    if "policies" not in skip:
        _section(results, "policies", lambda: bench_policies(
            device, backends, smoke.get("policies"), (4,) if smoke else (16, 128)), dump)
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
