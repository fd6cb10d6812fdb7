# ruff: noqa: B023  (timing closures capture loop variables on purpose; each runs in its iteration)
"""Probe: schedules of the key loop of our attention kernel, timed against the library's kernel
and cuDNN on the same inputs, before any of them goes into the library.

    PYTHONPATH=src python benchmarks/attention_variants.py --out /tmp/variants.json

The library's kernel (:func:`mlaprefill.kernels.attention.varlen_attention`) runs one 128-row query
tile per program through an FA2-style loop: QK dot, softmax, PV dot, in that order, so the
softmax of a key block waits for its QK dot and the next QK dot waits for the softmax. The
variants here keep its maths (exp2 domain, safe max, split keys: ``[Tk, H, 128]`` plus one rope
row per key shared by the heads) and change only the order of the work inside the loop:

* ``sub2``: the query tile as two halves with their own running state; both halves' QK dots are
  issued before either softmax, so on Hopper (asynchronous wgmma) the second half's QK dot can
  run while the first half's softmax does.
* ``pre``: the QK dot of the next key block is issued before the softmax of the current one
  (one score tile in flight ahead).

Each variant is checked against the library's output and LSE on the same inputs (max abs
difference) and timed with ``triton.testing.do_bench`` (median); cuDNN (one batched dense call,
graph built before timing) is timed on the same joined keys. No library code changes with it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl

from _common import kernel_ms, write_json

QK, VD, ROPE = 192, 128, 64
D1 = QK - ROPE
SCALE = QK ** -0.5
_LOG2E = 1.4426950408889634
# (heads, num_reqs, q per request, k per request, causal): one workspace iteration of the
# forward's shapes that miss the 1.15x target at 16 heads, and 128-head references
SHAPES = [
    (16, 8, 256, 8192, False), (16, 1, 4096, 4096, False), (16, 1, 4096, 4096, True),
    (16, 4, 1024, 16384, False), (16, 16, 256, 256, True), (128, 1, 4096, 4096, True),
    (128, 4, 1024, 16384, False),
]


@triton.jit
def _step(qk, acc, l_i, m_i, v, qk_scale, visible, MASKED: tl.constexpr):
    # one key block's online softmax and PV dot: the library kernel's rules
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk * qk_scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc=acc)
    return acc, l_i, m_new


@triton.jit
def _qk(q1, q2, k_base, p_base, start_n, stride_kt, stride_pt, n_ok, MASKED: tl.constexpr,
        BLOCK_N: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    kb = k_base + tl.cast(start_n, tl.int64) * stride_kt
    pb = p_base + tl.cast(start_n, tl.int64) * stride_pt
    k1p = kb + offs_n[:, None] * stride_kt + tl.arange(0, D1)[None, :]
    k2p = pb + offs_n[:, None] * stride_pt + tl.arange(0, D2)[None, :]
    if MASKED:
        k1 = tl.load(k1p, mask=n_ok[:, None], other=0.0)
        k2 = tl.load(k2p, mask=n_ok[:, None], other=0.0)
    else:
        k1 = tl.load(k1p)
        k2 = tl.load(k2p)
    qk = tl.dot(q1, tl.trans(k1))
    return tl.dot(q2, tl.trans(k2), acc=qk)


@triton.jit
def _load_v(v_base, start_n, stride_vt, n_ok, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
            DV: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    vp = (v_base + tl.cast(start_n, tl.int64) * stride_vt + offs_n[:, None] * stride_vt
          + tl.arange(0, DV)[None, :])
    if MASKED:
        return tl.load(vp, mask=n_ok[:, None], other=0.0)
    return tl.load(vp)


@triton.jit
def _visible(start_n, offs_m, seqlen_k, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    vis = (offs_n < seqlen_k)[None, :]
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= offs_m[:, None])
    return vis


@triton.jit
def _loop_plain(acc, l_i, m_i, q1, q2, k_base, p_base, v_base, stride_kt, stride_pt, stride_vt,
                offs_m, seqlen_k, qk_scale, lo, hi, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_N: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                WS: tl.constexpr):
    # masked blocks unpipelined: a second pipelined loop makes ptxas serialize every wgmma
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED else None,
                            warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        n_ok = (start_n + tl.arange(0, BLOCK_N)) < seqlen_k
        qk = _qk(q1, q2, k_base, p_base, start_n, stride_kt, stride_pt, n_ok, MASKED, BLOCK_N,
                 D1, D2)
        v = _load_v(v_base, start_n, stride_vt, n_ok, MASKED, BLOCK_N, DV)
        acc, l_i, m_i = _step(qk, acc, l_i, m_i, v, qk_scale,
                              _visible(start_n, offs_m, seqlen_k, CAUSAL, BLOCK_N), MASKED)
    return acc, l_i, m_i


@triton.jit
def _loop_sub2(acc_a, l_a, m_a, acc_b, l_b, m_b, q1a, q2a, q1b, q2b, k_base, p_base, v_base,
               stride_kt, stride_pt, stride_vt, offs_ma, offs_mb, seqlen_k, qk_scale, lo, hi,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED else None,
                            warp_specialize=WS):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        n_ok = (start_n + offs_n) < seqlen_k
        kb = k_base + tl.cast(start_n, tl.int64) * stride_kt
        pb = p_base + tl.cast(start_n, tl.int64) * stride_pt
        k1p = kb + offs_n[:, None] * stride_kt + tl.arange(0, D1)[None, :]
        k2p = pb + offs_n[:, None] * stride_pt + tl.arange(0, D2)[None, :]
        if MASKED:
            k1 = tl.load(k1p, mask=n_ok[:, None], other=0.0)
            k2 = tl.load(k2p, mask=n_ok[:, None], other=0.0)
        else:
            k1 = tl.load(k1p)
            k2 = tl.load(k2p)
        k1t = tl.trans(k1)
        k2t = tl.trans(k2)
        qk_a = tl.dot(q2a, k2t, acc=tl.dot(q1a, k1t))
        qk_b = tl.dot(q2b, k2t, acc=tl.dot(q1b, k1t))
        v = _load_v(v_base, start_n, stride_vt, n_ok, MASKED, BLOCK_N, DV)
        acc_a, l_a, m_a = _step(qk_a, acc_a, l_a, m_a, v, qk_scale,
                                _visible(start_n, offs_ma, seqlen_k, CAUSAL, BLOCK_N), MASKED)
        acc_b, l_b, m_b = _step(qk_b, acc_b, l_b, m_b, v, qk_scale,
                                _visible(start_n, offs_mb, seqlen_k, CAUSAL, BLOCK_N), MASKED)
    return acc_a, l_a, m_a, acc_b, l_b, m_b


@triton.jit
def _loop_pre(acc, l_i, m_i, q1, q2, k_base, p_base, v_base, stride_kt, stride_pt, stride_vt,
              offs_m, seqlen_k, qk_scale, lo, hi, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr):
    # unmasked blocks only, hi > lo: QK of block j + 1 issued before the softmax of block j
    ones = tl.full([BLOCK_N], 1, tl.int1)
    qk = _qk(q1, q2, k_base, p_base, lo, stride_kt, stride_pt, ones, False, BLOCK_N, D1, D2)
    for start_n in tl.range(lo, hi - BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        qk_next = _qk(q1, q2, k_base, p_base, start_n + BLOCK_N, stride_kt, stride_pt, ones,
                      False, BLOCK_N, D1, D2)
        v = _load_v(v_base, start_n, stride_vt, ones, False, BLOCK_N, DV)
        acc, l_i, m_i = _step(qk, acc, l_i, m_i, v, qk_scale, ones[None, :], False)
        qk = qk_next
    v = _load_v(v_base, hi - BLOCK_N, stride_vt, ones, False, BLOCK_N, DV)
    acc, l_i, m_i = _step(qk, acc, l_i, m_i, v, qk_scale, ones[None, :], False)
    return acc, l_i, m_i


@triton.jit
def _finish(acc, l_i, m_i, out_ptr, lse_ptr, row0, head, stride_ot, stride_oh, stride_lt,
            stride_lh, m_ok, ROWS: tl.constexpr, DV: tl.constexpr):
    lse2 = m_i + tl.log2(l_i)
    bad = (l_i == 0.0) | (lse2 == float("inf"))
    o = acc * (1.0 / l_i)[:, None]
    o = tl.where(bad[:, None], float("nan"), o)
    lse = tl.where(bad, float("nan"), lse2 * 0.6931471805599453)
    rows = tl.arange(0, ROWS)
    h64 = head.to(tl.int64)
    o_ptrs = (out_ptr + row0.to(tl.int64) * stride_ot + h64 * stride_oh + rows[:, None] * stride_ot
              + tl.arange(0, DV)[None, :])
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    tl.store(lse_ptr + row0.to(tl.int64) * stride_lt + h64 * stride_lh + rows * stride_lt, lse,
             mask=m_ok)


@triton.jit
def _variant_kernel(q_ptr, k_ptr, p_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh,
                    stride_ot, stride_oh, stride_lt, stride_lh,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                    SCHEDULE: tl.constexpr, WS: tl.constexpr):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    seqlen_q = tl.load(cu_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= seqlen_q:
        return
    k_start = tl.load(cu_k_ptr + seq)
    seqlen_k = tl.load(cu_k_ptr + seq + 1) - k_start
    if CAUSAL:
        kv_end = tl.minimum(seqlen_k, m0 + BLOCK_M)
        free_end = (tl.minimum(seqlen_k, m0 + 1) // BLOCK_N) * BLOCK_N
    else:
        kv_end = seqlen_k
        free_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if kv_end <= 0:  # no keys: out = 0, lse = -inf (the library kernel's rule)
        r0 = tl.arange(0, BLOCK_M)
        ok0 = m0 + r0 < seqlen_q
        row0 = (q_start + m0).to(tl.int64)
        tl.store(out_ptr + row0 * stride_ot + head.to(tl.int64) * stride_oh
                 + r0[:, None] * stride_ot + tl.arange(0, DV)[None, :],
                 tl.zeros([BLOCK_M, DV], dtype=out_ptr.dtype.element_ty), mask=ok0[:, None])
        tl.store(lse_ptr + row0 * stride_lt + head.to(tl.int64) * stride_lh + r0 * stride_lt,
                 tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=ok0)
        return
    h64 = head.to(tl.int64)
    q_base = q_ptr + (q_start + m0).to(tl.int64) * stride_qt + h64 * stride_qh
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + h64 * stride_kh
    p_base = p_ptr + k_start.to(tl.int64) * stride_pt
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + h64 * stride_vh
    d1 = tl.arange(0, D1)
    d2 = D1 + tl.arange(0, D2)
    if SCHEDULE == 2:
        HALF: tl.constexpr = BLOCK_M // 2
        ra = tl.arange(0, HALF)
        offs_ma = m0 + ra
        offs_mb = m0 + HALF + ra
        ok_a = offs_ma < seqlen_q
        ok_b = offs_mb < seqlen_q
        qa = q_base + ra[:, None] * stride_qt
        qb = q_base + (HALF + ra)[:, None] * stride_qt
        q1a = tl.load(qa + d1[None, :], mask=ok_a[:, None], other=0.0)
        q2a = tl.load(qa + d2[None, :], mask=ok_a[:, None], other=0.0)
        q1b = tl.load(qb + d1[None, :], mask=ok_b[:, None], other=0.0)
        q2b = tl.load(qb + d2[None, :], mask=ok_b[:, None], other=0.0)
        m_a = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l_a = tl.zeros([HALF], dtype=tl.float32)
        acc_a = tl.zeros([HALF, DV], dtype=tl.float32)
        m_b = tl.full([HALF], float("-inf"), dtype=tl.float32)
        l_b = tl.zeros([HALF], dtype=tl.float32)
        acc_b = tl.zeros([HALF, DV], dtype=tl.float32)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _loop_sub2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q1a, q2a, q1b, q2b, k_base, p_base, v_base,
            stride_kt, stride_pt, stride_vt, offs_ma, offs_mb, seqlen_k, qk_scale, 0, free_end,
            False, CAUSAL, BLOCK_N, D1, D2, DV, WS)
        acc_a, l_a, m_a, acc_b, l_b, m_b = _loop_sub2(
            acc_a, l_a, m_a, acc_b, l_b, m_b, q1a, q2a, q1b, q2b, k_base, p_base, v_base,
            stride_kt, stride_pt, stride_vt, offs_ma, offs_mb, seqlen_k, qk_scale, free_end,
            kv_end, True, CAUSAL, BLOCK_N, D1, D2, DV, WS)
        _finish(acc_a, l_a, m_a, out_ptr, lse_ptr, q_start + m0, head, stride_ot, stride_oh,
                stride_lt, stride_lh, ok_a, HALF, DV)
        _finish(acc_b, l_b, m_b, out_ptr, lse_ptr, q_start + m0 + HALF, head, stride_ot,
                stride_oh, stride_lt, stride_lh, ok_b, HALF, DV)
    else:
        r = tl.arange(0, BLOCK_M)
        offs_m = m0 + r
        m_ok = offs_m < seqlen_q
        qp = q_base + r[:, None] * stride_qt
        q1 = tl.load(qp + d1[None, :], mask=m_ok[:, None], other=0.0)
        q2 = tl.load(qp + d2[None, :], mask=m_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        if SCHEDULE == 1:
            if free_end > 0:
                acc, l_i, m_i = _loop_pre(acc, l_i, m_i, q1, q2, k_base, p_base, v_base,
                                          stride_kt, stride_pt, stride_vt, offs_m, seqlen_k,
                                          qk_scale, 0, free_end, CAUSAL, BLOCK_N, D1, D2, DV)
        else:
            acc, l_i, m_i = _loop_plain(acc, l_i, m_i, q1, q2, k_base, p_base, v_base,
                                        stride_kt, stride_pt, stride_vt, offs_m, seqlen_k,
                                        qk_scale, 0, free_end, False, CAUSAL, BLOCK_N, D1, D2,
                                        DV, WS)
        acc, l_i, m_i = _loop_plain(acc, l_i, m_i, q1, q2, k_base, p_base, v_base, stride_kt,
                                    stride_pt, stride_vt, offs_m, seqlen_k, qk_scale, free_end,
                                    kv_end, True, CAUSAL, BLOCK_N, D1, D2, DV, WS)
        _finish(acc, l_i, m_i, out_ptr, lse_ptr, q_start + m0, head, stride_ot, stride_oh,
                stride_lt, stride_lh, m_ok, BLOCK_M, DV)


#: name -> (schedule: 0 plain, 1 pre, 2 sub2; block_m, block_n, num_warps, num_stages, ws)
VARIANTS: dict[str, tuple[int, int, int, int, int, bool]] = {
    "plain_m128_n64_w8_s3": (0, 128, 64, 8, 3, False),
    "pre_m128_n64_w8_s2": (1, 128, 64, 8, 2, False),
    "pre_m128_n64_w8_s3": (1, 128, 64, 8, 3, False),
    "sub2_m128_n64_w8_s2": (2, 128, 64, 8, 2, False),
    "sub2_m128_n64_w8_s3": (2, 128, 64, 8, 3, False),
    "sub2_m128_n64_w8_s3_ws": (2, 128, 64, 8, 3, True),
    "sub2_m128_n128_w8_s2": (2, 128, 128, 8, 2, False),
    "sub2_m256_n64_w8_s2": (2, 256, 64, 8, 2, False),
    "sub2_m256_n64_w16_s2": (2, 256, 64, 16, 2, False),
}


def variant_attention(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor, v: torch.Tensor,
                      cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, causal: bool,
                      variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, H, 192], k [Tk, H, 128], rope [Tk, 64] (shared by the heads), v [Tk, H, 128]."""
    schedule, bm, bn, warps, stages, ws = VARIANTS[variant]
    tq, h = q.shape[:2]
    out = torch.empty(tq, h, VD, dtype=q.dtype, device=q.device)
    lse = torch.empty(tq, h, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(max_q, bm), cu_q.shape[0] - 1, h)
    _variant_kernel[grid](q, k, rope, v, out, lse, cu_q, cu_k, SCALE * _LOG2E,
                          q.stride(0), q.stride(1), k.stride(0), k.stride(1), rope.stride(0),
                          v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                          lse.stride(0), lse.stride(1), CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn,
                          D1=D1, D2=ROPE, DV=VD, SCHEDULE=schedule, WS=ws, num_warps=warps,
                          num_stages=stages)
    return out, lse


#: how each benchmark's FLOP count is made (the "flops_formula" of their JSON)
FLOPS_FORMULA = "2 * sum_r(q_r * keys_r) * H * (192 + 128)"


def compare(names: list[str], attend: Any, *, key: str, width: int,
            causal_too: bool = True) -> list[dict[str, Any]]:
    """For each of :data:`SHAPES` (the causal ones only with ``causal_too``): the library's
    kernel and cuDNN (one batched dense call on the keys joined, graph built before timing) timed
    on the same inputs, then each candidate ``attend(name, q, k, rope, v, cu_q, cu_k, max_q,
    causal) -> (out, lse)``: its first-call time, max abs difference of out and LSE against the
    library's, median time (``kernel_ms``), TFLOP/s and the ratios to both. A candidate that
    does not compile, fit or run gets its error. One row per shape, candidates under ``key``."""
    from mlaprefill.backends.cudnn import dense_cudnn_attention
    from mlaprefill.kernels.attention import varlen_attention

    rows = []
    for h, nr, sq, sk, causal in SHAPES:
        if causal and not causal_too:
            continue
        if causal:
            sk = sq
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(nr * sq, h, QK, device="cuda", dtype=torch.bfloat16, generator=g)
        kn = torch.randn(nr * sk, h, D1, device="cuda", dtype=torch.bfloat16, generator=g)
        rope = torch.randn(nr * sk, ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(nr * sk, h, VD, device="cuda", dtype=torch.bfloat16, generator=g)
        joined = torch.cat([kn, rope[:, None].expand(-1, h, -1)], dim=-1)
        cu_q = torch.arange(nr + 1, device="cuda", dtype=torch.int32) * sq
        cu_k = torch.arange(nr + 1, device="cuda", dtype=torch.int32) * sk
        keys = sq * (sq + 1) / 2 if causal else sq * sk
        flops = 2 * nr * keys * h * (QK + VD)

        def lib() -> Any:
            return varlen_attention(q, kn, v, cu_q, cu_k, max_seqlen_q=sq, causal=causal,
                                    softmax_scale=SCALE, k_rope=rope)

        def cudnn() -> Any:
            return dense_cudnn_attention(q, joined, v, 0, 0, nr, sq, sk, causal=causal,
                                         softmax_scale=SCALE)

        ref_out, ref_lse = lib()
        entry: dict[str, Any] = {"heads": h, "num_reqs": nr, "q_len": sq, "k_len": sk,
                                 "causal": causal, key: {}}
        for name, fn in (("library", lib), ("cudnn", cudnn)):
            fn()
            torch.cuda.synchronize()
            ms = kernel_ms(fn, warmup=5, rep=60)["median_ms"]
            entry[f"{name}_ms"] = ms
            entry[f"{name}_tflops"] = flops / ms / 1e9
        c_out, c_lse = cudnn()
        entry["cudnn_out_max_abs_diff"] = (c_out.float() - ref_out.float()).abs().max().item()
        entry["cudnn_lse_max_abs_diff"] = (c_lse - ref_lse).abs().max().item()
        print(f"H={h:>3} {nr:>2}x q={sq:<5} k={sk:<6} causal={causal!s:<5} library "
              f"{entry['library_ms']:.3f} ms ({entry['library_tflops']:.0f} TFLOP/s)  cudnn "
              f"{entry['cudnn_ms']:.3f} ms ({entry['cudnn_tflops']:.0f})", flush=True)
        for name in names:
            rec: dict[str, Any] = {}

            def fn(name: str = name) -> Any:
                return attend(name, q, kn, rope, v, cu_q, cu_k, sq, causal)
            try:
                t0 = time.perf_counter()
                out, lse = fn()
                torch.cuda.synchronize()
                rec["first_call_s"] = time.perf_counter() - t0
                rec["out_max_abs_diff"] = (out.float() - ref_out.float()).abs().max().item()
                rec["lse_max_abs_diff"] = (lse - ref_lse).abs().max().item()
                rec["ms"] = kernel_ms(fn, warmup=5, rep=60)["median_ms"]
                rec["tflops"] = flops / rec["ms"] / 1e9
                rec["over_library"] = rec["ms"] / entry["library_ms"]
                rec["over_cudnn"] = rec["ms"] / entry["cudnn_ms"]
            except Exception as exc:  # a candidate that does not compile, fit or run
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            entry[key][name] = rec
            print(f"    {name:<{width}}" + (
                f" {rec['ms']:.3f} ms {rec['tflops']:.0f} TFLOP/s  x{rec['over_library']:.3f} "
                f"library  x{rec['over_cudnn']:.3f} cudnn  diff out {rec['out_max_abs_diff']:.1e} "
                f"lse {rec['lse_max_abs_diff']:.1e}" if "ms" in rec else f" {rec['error']}"),
                flush=True)
        rows.append(entry)
        q = kn = rope = v = joined = ref_out = ref_lse = c_out = c_lse = None  # free them
        torch.cuda.empty_cache()
    return rows


def run(names: list[str]) -> dict[str, Any]:
    def attend(name: str, q: Any, k: Any, rope: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int,
               causal: bool) -> Any:
        return variant_attention(q, k, rope, v, cu_q, cu_k, max_q, causal, name)

    return {"rows": compare(names, attend, key="variants", width=26),
            "flops_formula": FLOPS_FORMULA,
            "variants": {n: dict(zip(("schedule", "block_m", "block_n", "num_warps",
                                      "num_stages", "warp_specialize"), VARIANTS[n], strict=True))
                         for n in names}}


def warp_specialize_binaries() -> dict[str, Any]:
    """Whether ``AttentionConfig.warp_specialize`` changes the compiled binary of the library's
    kernel here: the context config with and without it, run once each on one shape, and the
    kernel cache's binaries compared (md5 of each cubin)."""
    import dataclasses
    import hashlib

    from mlaprefill.kernels.attention import (
        CONTEXT_ATTENTION_CONFIG,
        _varlen_attention_kernel,
        varlen_attention,
    )

    h, n = 16, 1024
    q = torch.randn(n, h, QK, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(n, h, D1, device="cuda", dtype=torch.bfloat16)
    rope = torch.randn(n, ROPE, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, h, VD, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    outs = []
    for ws in (True, False):
        cfg = dataclasses.replace(CONTEXT_ATTENTION_CONFIG, warp_specialize=ws)
        outs.append(varlen_attention(q, kn, v, cu, cu, max_seqlen_q=n, causal=False,
                                     softmax_scale=SCALE, k_rope=rope, config=cfg))
    torch.cuda.synchronize()
    hashes = sorted({hashlib.md5(kernel.asm["cubin"]).hexdigest()
                     for cache in _varlen_attention_kernel.device_caches.values()
                     for kernel in cache[0].values()})
    return {"config": str(CONTEXT_ATTENTION_CONFIG), "cached_kernels": sum(
                len(c[0]) for c in _varlen_attention_kernel.device_caches.values()),
            "distinct_cubins": len(hashes), "cubin_md5": hashes,
            "outputs_equal": bool(torch.equal(outs[0][0], outs[1][0])
                                  and torch.equal(outs[0][1], outs[1][1]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of variants")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    from mlaprefill._env import machine_info, utc_now

    ws = warp_specialize_binaries()  # first: the kernel cache holds only these two launches
    print(f"warp_specialize on/off: {ws['cached_kernels']} cached kernels, "
          f"{ws['distinct_cubins']} distinct binaries", flush=True)
    result = {"benchmark": "attention_variants", "argv": sys.argv,
              "date_utc": utc_now(offset=True), "machine": machine_info(torch.device("cuda")),
              "warp_specialize_binaries": ws, **run(names)}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
