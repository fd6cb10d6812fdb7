"""Can the context gather live inside the up-projection GEMM? A probe, timed under CUDA graphs in
one process: one iteration's paged-cache gather and up-projection, three ways.

* ``gather+mm`` (what the forward runs today): the Triton gather kernel copies the iteration's
  latent rows into the workspace, then cuBLAS ``kv = kv_c W^T`` (``UpProjection.project``,
  split keys: ``[n, 512] x [512, H * (128 + 128)]``);
* ``mm``: cuBLAS alone on rows already gathered (what the vs-ideal bound counts);
* ``fused <config>``: a Triton GEMM (written here) whose A tiles are read straight from the
  paged cache, each row's page found as the gather finds it (binary search over the
  iteration's ``cu_seq_lens``, then the block table); the programs of the first column block
  also copy their rows' 64 rope values to the workspace, which the attention reads.

The whole-forward bound of issue 31 counts the GEMM but not the gather: at 16 heads and 256
queries per request the gather is most of what the forward spends beyond it. A fused kernel pays
only if it runs the GEMM near cuBLAS's rate; this measures that before anything is wired in.
Outputs are checked against ``gather+mm`` (a tolerance: the sums run in another order) and on a
row sample against float64. Every block id is valid here (the kernels' NaN rule for bad ids is
not part of the probe).

    PYTHONPATH=src:hostsync/src python scripts/gather_gemm_probe.py --out probe.json   # a GPU
    python scripts/gather_gemm_probe.py --cpu-smoke    # the setup and the check, torch only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RANK, ROPE, NOPE, VD, PAGE = 512, 64, 128, 128, 64
# (heads, requests, context rows per request in this iteration): the workspace holds 65536
SHAPES = [(16, 16, 4096), (16, 1, 65536), (128, 16, 4096), (128, 2, 32768), (16, 64, 256)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
           (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
# the persistent TMA GEMM on the gathered workspace: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages,
# flatten the tile loop into the K loop (pipelined across tiles), store C in two halves)
TMA_CONFIGS = [(128, 256, 64, 8, 3, True, True), (128, 256, 64, 8, 4, True, True),
               (128, 256, 64, 8, 3, False, True), (128, 256, 64, 8, 3, True, False),
               (128, 128, 64, 4, 4, True, False), (256, 128, 64, 8, 3, True, True)]

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

if HAS_TRITON:
    from mlaprefill.kernels.gather import _row_requests

    @triton.jit
    def _fused_kernel(cache_ptr, w_ptr, out_ptr, rope_ptr, block_table_ptr, cu_ptr, starts_ptr,
                      num_rows, num_reqs, n_cols, stride_cb, stride_cp, stride_bt, stride_w,
                      stride_o, stride_r, LOG2_REQS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                      K: tl.constexpr, ROPE_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # grouped order: GROUP_M row blocks walk all column blocks together (A and W stay in L2)
        pid = tl.program_id(0)
        n_m = tl.cdiv(num_rows, BLOCK_M)
        n_n = tl.cdiv(n_cols, BLOCK_N)
        group = pid // (GROUP_M * n_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
        pid_n = (pid % (GROUP_M * n_n)) // size_m
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        req = _row_requests(cu_ptr, rows, row_ok, num_reqs, LOG2_REQS)  # the gather's search
        pos = (tl.load(starts_ptr + req, mask=row_ok, other=0).to(tl.int64) + rows
               - tl.load(cu_ptr + req, mask=row_ok, other=0).to(tl.int64))
        block = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt + pos // PAGE_SIZE,
                        mask=row_ok, other=0).to(tl.int64)
        src = block * stride_cb + (pos % PAGE_SIZE) * stride_cp
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            a = tl.load(cache_ptr + src[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None])
            b = tl.load(w_ptr + cols[None, :] * stride_w + (k0 + offs_k)[:, None])
            acc = tl.dot(a, b, acc)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if pid_n == 0:
            r = tl.arange(0, ROPE_D)
            x = tl.load(cache_ptr + src[:, None] + (K + r)[None, :], mask=row_ok[:, None])
            tl.store(rope_ptr + rows[:, None] * stride_r + r[None, :], x, mask=row_ok[:, None])


    @triton.jit
    def _tma_mm_kernel(a_desc, b_desc, c_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_PROGS: tl.constexpr, FLATTEN: tl.constexpr, SPLIT: tl.constexpr):
        # c = a @ b.T, persistent: program p takes tiles p, p + NUM_PROGS, ... in grouped order
        n_m = tl.cdiv(M, BLOCK_M)
        n_n = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGS, flatten=FLATTEN):
            first_m = (tile // (GROUP_M * n_n)) * GROUP_M
            size_m = tl.minimum(n_m - first_m, GROUP_M)
            pid_m = first_m + (tile % (GROUP_M * n_n)) % size_m
            pid_n = (tile % (GROUP_M * n_n)) // size_m
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k0])
                b = b_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(a, b.T, acc)
            if SPLIT:  # two half-width stores: half the staging buffer
                halves = tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1])
                c0, c1 = tl.split(halves)
                c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0.to(c_desc.dtype))
                c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2],
                             c1.to(c_desc.dtype))
            else:
                c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


def tma_mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
           config: tuple[int, int, int, int, int, bool, bool], num_progs: int) -> torch.Tensor:
    """``out = a @ w.T`` by the persistent TMA kernel; ``a [M, K]`` (rows 16-byte aligned),
    ``w [N, K]``, ``out [M, N]`` contiguous."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, warps, stages, flatten, split = config
    m, k = a.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn // 2 if split else bn])
    progs = min(num_progs, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _tma_mm_kernel[(progs,)](a_desc, b_desc, c_desc, m, n, K=k, BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=bk, GROUP_M=8, NUM_PROGS=progs, FLATTEN=flatten,
                             SPLIT=split, num_warps=warps, num_stages=stages)
    return out


def fused(cache: torch.Tensor, w: torch.Tensor, block_table: torch.Tensor, cu: torch.Tensor,
          starts: torch.Tensor, out: torch.Tensor, rope: torch.Tensor, num_rows: int,
          config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``out[:num_rows] = gathered kv_c @ w.T`` and ``rope[:num_rows] =`` the rows' rope values,
    read from ``cache [blocks, PAGE, 576]`` through ``block_table``; ``w [N, 512]``."""
    bm, bn, bk, warps, stages = config
    num_reqs = block_table.shape[0]
    n_cols = w.shape[0]
    grid = (triton.cdiv(num_rows, bm) * triton.cdiv(n_cols, bn),)
    _fused_kernel[grid](cache, w, out, rope, block_table, cu, starts, num_rows, num_reqs, n_cols,
                        cache.stride(0), cache.stride(1), block_table.stride(0), w.stride(0),
                        out.stride(0), rope.stride(0),
                        LOG2_REQS=max(1, (num_reqs - 1).bit_length()), PAGE_SIZE=PAGE, K=RANK,
                        ROPE_D=ROPE, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                        num_warps=warps, num_stages=stages)
    return out


def make_case(heads: int, reqs: int, rows_per_req: int, device: str, seed: int = 0) -> dict:
    """A paged cache with shuffled pages, each request's piece of this iteration starting at a
    context offset that is not page aligned, and the split up-projection weight."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    start = 3 * PAGE + 5  # each request's piece starts here in its context
    pages_per_req = (start + rows_per_req + PAGE - 1) // PAGE
    num_blocks = reqs * pages_per_req + 7
    perm = torch.randperm(num_blocks, generator=g)[:reqs * pages_per_req]
    cache = (torch.randn(num_blocks, PAGE, RANK + ROPE, generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(heads * (NOPE + VD), RANK, generator=g) / RANK ** 0.5).to(torch.bfloat16)
    n = reqs * rows_per_req
    return {
        "cache": cache.to(device), "w": w.to(device),
        "block_table": perm.view(reqs, pages_per_req).to(torch.int32).to(device),
        "cu": (torch.arange(reqs + 1) * rows_per_req).to(torch.int32).to(device),
        "starts": torch.full((reqs,), start, dtype=torch.int32).to(device),
        "num_rows": n, "heads": heads,
    }


def reference_rows(c: dict, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 kv and rope of the given workspace rows, gathered with plain indexing."""
    per = c["num_rows"] // c["block_table"].shape[0]
    req, j = rows // per, rows % per
    pos = c["starts"].cpu().long()[req] + j
    block = c["block_table"].cpu().long()[req, pos // PAGE]
    x = c["cache"].cpu()[block, pos % PAGE].double()
    return x[:, :RANK] @ c["w"].cpu().double().t(), x[:, RANK:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gather_gemm_probe.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="fused,tma",
                    help="comma list: fused (gather inside the GEMM), tma (persistent TMA GEMM "
                         "on the gathered rows, timed against cuBLAS's mm alone)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check the setup against float64 with torch only (no GPU, no timing)")
    args = ap.parse_args()
    if args.cpu_smoke:
        c = make_case(2, 3, 100, "cpu")
        rows = torch.arange(c["num_rows"])
        from mlaprefill.kernels.gather import gather_context_rows
        ws = torch.empty(c["num_rows"], RANK + ROPE, dtype=torch.bfloat16)
        gather_context_rows(c["cache"], c["block_table"], c["cu"], c["starts"], ws,
                            c["num_rows"], use_kernel=False)
        kv, rope = reference_rows(c, rows)
        err = (ws[:, :RANK].double() @ c["w"].double().t() - kv).abs().max().item()
        same_rope = torch.equal(ws[:, RANK:].double(), rope)
        print(f"cpu smoke: gather + mm vs float64 max err {err:.2e}, rope equal {same_rope}")
        return 0 if err < 1e-6 and same_rope else 1
    if not (torch.cuda.is_available() and HAS_TRITON):
        raise SystemExit("needs a CUDA GPU and Triton (--cpu-smoke runs anywhere)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import kernel_ms
    from mlaprefill.kernels.gather import gather_context_rows
    wanted = set(args.variants.split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_rows = []
    for heads, reqs, per in SHAPES:
        c = make_case(heads, reqs, per, "cuda")
        n, w = c["num_rows"], c["w"]
        ws = torch.empty(n, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(n, w.shape[0], dtype=torch.bfloat16, device="cuda")
        kv_f = torch.empty_like(kv)
        rope_f = torch.empty(n, ROPE, dtype=torch.bfloat16, device="cuda")

        def gather_mm(c=c, ws=ws, kv=kv, n=n, w=w):
            gather_context_rows(c["cache"], c["block_table"], c["cu"], c["starts"], ws, n)
            torch.mm(ws[:, :RANK], w.t(), out=kv)

        def mm(ws=ws, kv=kv, w=w):
            torch.mm(ws[:, :RANK], w.t(), out=kv)

        gather_mm()
        torch.cuda.synchronize()
        sample = torch.randperm(n)[:256]
        ref_kv, ref_rope = reference_rows(c, sample)
        base_err = (kv[sample.cuda()].double().cpu() - ref_kv).abs().max().item()
        if not torch.equal(ws[sample.cuda(), RANK:].double().cpu(), ref_rope):
            raise SystemExit(f"H={heads} {reqs}x{per}: the gather's rope values are wrong")
        flops = 2.0 * n * RANK * w.shape[0]
        row = {"heads": heads, "num_reqs": reqs, "rows_per_req": per, "rows": n,
               "gemm_shape": [n, RANK, w.shape[0]], "flops": flops,
               "max_err_vs_float64_sample": {"gather+mm": base_err}, "graph_ms": {},
               "max_abs_diff_vs_gather_mm": {}, "rope_equal": {}}
        variants = {"gather+mm": gather_mm, "mm": mm}

        def add(name, fn, row=row, kv=kv, kv_f=kv_f, sample=sample, ref_kv=ref_kv,
                variants=variants):
            # run once into a NaN-filled output, record its errors, keep it for timing
            try:
                kv_f.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not build (shared memory): recorded
                row.setdefault("failed", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
                return False
            row["max_abs_diff_vs_gather_mm"][name] = (kv_f.float() - kv.float()).abs().max().item()
            row["max_err_vs_float64_sample"][name] = (
                kv_f[sample.cuda()].double().cpu() - ref_kv).abs().max().item()
            variants[name] = fn
            return True

        for cfg in CONFIGS if "fused" in wanted else []:
            name = "fused " + "x".join(map(str, cfg))

            def run(c=c, w=w, kv_f=kv_f, rope_f=rope_f, n=n, cfg=cfg):
                fused(c["cache"], w, c["block_table"], c["cu"], c["starts"], kv_f, rope_f, n,
                      cfg)
            if add(name, run):
                row["rope_equal"][name] = bool(torch.equal(rope_f, ws[:, RANK:]))
        for cfg in TMA_CONFIGS if "tma" in wanted else []:

            def run_tma(ws=ws, w=w, kv_f=kv_f, cfg=cfg, sms=sms):
                tma_mm(ws[:, :RANK], w, kv_f, cfg, sms)
            add("tma " + "x".join(str(int(v)) for v in cfg), run_tma)
        for _ in range(args.rounds):
            for name, fn in variants.items():
                row["graph_ms"].setdefault(name, []).append(
                    kernel_ms(fn, graph=True)["median_ms"])
        best = {k: min(v) for k, v in row["graph_ms"].items()}
        row["tflops_best"] = {k: flops / (t * 1e9) for k, t in best.items()}
        row["over_gather_mm_best"] = {k: t / best["gather+mm"] for k, t in best.items()}
        row["over_mm_best"] = {k: t / best["mm"] for k, t in best.items()}
        print(f"H={heads} {reqs}x{per} rows: " + ", ".join(
            f"{k} {t:.3f} ms ({row['tflops_best'][k]:.0f} TF/s, "
            f"{row['over_gather_mm_best'][k]:.3f}x gather+mm, {row['over_mm_best'][k]:.3f}x mm)"
            for k, t in best.items()), flush=True)
        print(f"  errors vs float64 (sample): {row['max_err_vs_float64_sample']}; "
              f"rope equal {row['rope_equal']}; failed {list(row.get('failed', {}))}",
              flush=True)
        out_rows.append(row)
        del c, ws, kv, kv_f, rope_f
        torch.cuda.empty_cache()
    doc = {"benchmark": "gather_gemm_probe", "argv": sys.argv,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "variants": sorted(wanted),
           "configs": CONFIGS if "fused" in wanted else [],
           "tma_configs": TMA_CONFIGS if "tma" in wanted else [], "rows": out_rows}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
