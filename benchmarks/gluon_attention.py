"""Probe: a Gluon (Triton 3.6 ``triton.experimental.gluon``) forward attention kernel for Hopper
with FA3-style overlap inside each warpgroup, timed against the library's Triton kernel and
cuDNN on the same inputs, before any of it goes into the library.

    PYTHONPATH=src python benchmarks/gluon_attention.py --out /tmp/gluon_attention.json

The library's kernel (:func:`mlaprefill.kernels.attention.varlen_attention`) runs FA2-style on
Hopper: every wgmma group is followed by ``wgmma.wait_group 0``, so a warpgroup's softmax never
runs while its tensor cores work, and plain Triton cannot express anything else. Gluon exposes
``warpgroup_mma(..., is_async=True)`` and ``warpgroup_mma_wait(num_outstanding=N)``, so the key
loop here is scheduled by hand. Per warpgroup (64 query rows; two warpgroups per 128-row tile),
schedule "ahead" (the default), key block ``j``::

    issue S[j+1] = Q K[j+1]^T              (two wgmma groups: 128 nope dims + 64 rope dims)
    softmax(S[j]) -> P[j], alpha[j]        (runs while S[j+1] computes)
    O *= alpha[j]; issue O += P[j] V[j]    (one group, P from registers)
    wait for everything                    (S[j+1] and P[j] V[j])

Schedule "fa3" (FlashAttention-3's order) issues S[j] and P[j-1] V[j-1] back to back, waits for
S[j] only (one group left in flight), runs the softmax of block j, then waits for the PV. Found
while writing it (ptxas 12.x bundled with Triton 3.6, sm_90a): (1) leaving a PV group in flight
across the loop's back edge while waiting for S with ``num_outstanding >= 1`` (both overlaps at
once) makes ptxas serialize every wgmma of the kernel (C7514), so "ahead" drains at the end of
each iteration; (2) in "fa3" ptxas hoists the final ``wait_group 0`` up to the ``wait_group 1``
in SASS, so its softmax does not overlap the PV MMA after all. "ahead" keeps its overlap: the
SASS of its key loop has the exp2 (MUFU.EX2) of block j between the HGMMA issues of S[j+1] and
their wait.

K, the shared rope key row and V of each block arrive by TMA (one mbarrier per stage, device-side
descriptors over exactly the sequence's key rows, so rows past it read zeros) into a ring of
``STAGES`` buffers; a stage is refilled once both warpgroups have finished the PV MMA that read
it. The query tile is loaded once into shared memory (wgmma reads A from there). Maths as the
library's kernel: exp2 domain, scale on the fp32 scores, safe max, masked keys set to ``-inf``
with ``where``; NaN for rows whose sum is 0 or whose LSE is ``+inf``; a query block with no keys
gets ``out = 0, lse = -inf``. Only the last key block is masked (non-causal); causal calls also
mask the diagonal blocks.

Schedules "ws" and "ws_ahead" (``_gluon_attn_ws_kernel``) use Gluon's warp specialization
(``gl.warp_specialize``), FlashAttention-3 style, for the lockstep the schedules above have: their
two warpgroups share one instruction stream, so Triton puts CTA-wide ``bar.sync`` around every
TMA refill and both warpgroups wait for each other. Here a 128-row query tile is split into three
partitions: the default one (``num_warps = 4``) is consumer warpgroup 0 (rows 0-63), a 4-warp
worker is consumer warpgroup 1 (rows 64-127), and a 1-warp worker is the TMA producer (12 warps
in all: the producer warp is padded to a warpgroup). The producer fills a ``STAGES``-deep ring of
K / rope / V buffers, waiting on an "empty" mbarrier per stage (count 2) and arming a "ready"
mbarrier per stage with the expected bytes (it also makes the device-side descriptors, so the
tensormap fences run in the warp that issues the copies); each consumer loads its own 64 query
rows into its own shared buffer, waits on "ready", runs the MMAs and the softmax with its own m /
l / O, and arrives once on "empty" after the P V MMA that read the stage. The consumers never
wait for each other except through "empty" (the producer needs both releases to refill a stage),
so one warpgroup's softmax can run while the other's wgmma compute (ping-pong left to the warp
scheduler: no named-barrier ordering as in FA3). "ws" runs each block serially inside a
warpgroup (S, wait, softmax, P V, wait, release); "ws_ahead" uses the "ahead" order inside each
warpgroup as well. The kernel is launched with ``maxnreg = 168`` and ``setmaxnreg`` gives the
producer warpgroup 24 registers and each consumer warpgroup 240. Every CTA enters the
warp-specialized region (no early return); a query block past its sequence or without keys has
``n_blocks = 0``, so the producer issues nothing and the consumers only store ``out = 0,
lse = -inf`` (masked). The maths is the code above (``_softmax``, the same masked blocks, the same
finish), causal included. Checked without a GPU only (``--compile-only``, Triton 3.6, ptxas
sm_90a): all four configs compile, causal and non-causal, with no spills and no wgmma
serialization; the SASS has ``USETMAXREG`` (24 / 240), CTA-wide ``BAR.SYNC 0x1`` only at the
entry and exit of the warp-specialized region, and in each consumer's key loop only
warpgroup-local named barriers (``BAR.SYNC 0x0, 0x80`` / ``0x2, 0x80``: Triton puts one before
each mbarrier wait and one before each single-thread arrive), ``SYNCS`` mbarrier waits and
arrives, and ``HGMMA`` issues each followed by ``WARPGROUP.DEPBAR``; in "ws_ahead" the
``MUFU.EX2`` of block j sit between the ``HGMMA`` issues of S[j+1] and their ``DEPBAR``. Neither
correctness nor speed of the "ws" schedules had been measured then. On the H200 afterwards
(benchmarks/results/gluon_attention_ws_h200.json) every "ws" config was bitwise equal to the
library's Triton kernel on the ragged edge cases (128 x 128 tiles: within 4e-3), and
``ws_m128_n128_s2`` ran 0.76-0.88x its time, 0.90-1.08x cuDNN's, on the 7 shapes: that config,
with the library kernel's dense rectangles and epilogue merge added, is now
:mod:`mlaprefill.kernels.hopper_attention`, the library's default on Hopper. The schedules above
("ahead", "fa3") were no faster than the Triton kernel (gluon_attention_h200.json).

Each config is checked against the library's output and LSE on the same inputs (max abs
difference) and timed with ``triton.testing.do_bench`` (median, :func:`_common.kernel_ms`);
cuDNN (one batched dense call) is timed on the same keys joined into ``[Tk, H, 192]``. No library
code changes with it. ``--compile-only`` compiles every config for sm_90a without a GPU and
reports ptxas registers, spills and whether ptxas serialized the wgmma pipeline.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from _common import write_json
from mlaprefill.kernels.hopper_attention import (
    _CONSUMER_REGS,
    _MAXNREG,
    _PRODUCER_REGS,
    _key_blocks,
    _producer,
)

QK, VD, ROPE = 192, 128, 64
D1 = QK - ROPE
SCALE = QK ** -0.5
_LOG2E = 1.4426950408889634

#: name -> (schedule, block_m, block_n, stages, num_warps). 64 query rows per warpgroup.
#: Schedule 0, "ahead": S[j+1] = Q K[j+1]^T is issued before the softmax of block j, which runs
#: while it computes; then P[j] V[j] is issued and both are waited for. Schedule 1, "fa3" (the
#: FlashAttention-3 intra-warpgroup order): S[j] and P[j-1] V[j-1] are issued back to back, S[j]
#: alone is waited for, and the softmax of block j is meant to run while P[j-1] V[j-1] computes
#: (ptxas moves the PV wait up, see the module docstring). All compile for sm_90a without
#: spills or wgmma serialization (--compile-only); 128 x 128 tiles with "ahead" spill (left out).
#: Schedules 2 "ws" and 3 "ws_ahead": warp-specialized (module docstring); num_warps is the
#: default partition's (one consumer warpgroup), 12 warps run in all.
SCHEDULES = ("ahead", "fa3", "ws", "ws_ahead")
CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    "ahead_m128_n64_s4": (0, 128, 64, 4, 8),
    "ahead_m128_n64_s3": (0, 128, 64, 3, 8),
    "fa3_m128_n64_s4": (1, 128, 64, 4, 8),
    "fa3_m128_n64_s3": (1, 128, 64, 3, 8),
    "fa3_m128_n128_s2": (1, 128, 128, 2, 8),
    "ahead_m64_n64_s2": (0, 64, 64, 2, 4),
    "fa3_m64_n64_s2": (1, 64, 64, 2, 4),
    "ws_m128_n64_s4": (2, 128, 64, 4, 4),
    "ws_m128_n64_s3": (2, 128, 64, 3, 4),
    "ws_ahead_m128_n64_s4": (3, 128, 64, 4, 4),
    "ws_m128_n128_s2": (2, 128, 128, 2, 4),
}
DEFAULT_CONFIG = "ahead_m128_n64_s4"


@gluon.jit
def _issue_load(k_desc, r_desc, v_desc, k_s, r_s, v_s, ready, blk, n_blocks,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    # TMA of key block `blk` (K, rope, V) into stage blk % STAGES; nothing past the last block.
    st = blk % STAGES
    bar = ready.index(st)
    ok = blk < n_blocks
    mbarrier.expect(bar, k_desc.block_type.nbytes + r_desc.block_type.nbytes
                    + v_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(k_desc, [blk * BLOCK_N, 0], bar, k_s.index(st), pred=ok)
    tma.async_copy_global_to_shared(r_desc, [blk * BLOCK_N, 0], bar, r_s.index(st), pred=ok)
    tma.async_copy_global_to_shared(v_desc, [blk * BLOCK_N, 0], bar, v_s.index(st), pred=ok)


@gluon.jit
def _issue_qk(q1_s, q2_s, k_s, r_s, ready, blk, s_zero, STAGES: gl.constexpr):
    # S[blk] = Q1 K^T + Q2 R^T, asynchronous: two wgmma groups, returns the accumulator token.
    st = blk % STAGES
    mbarrier.wait(ready.index(st), (blk // STAGES) & 1)
    t = warpgroup_mma(q1_s, k_s.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q2_s, r_s.index(st).permute((1, 0)), t, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, blk, offs_m, offs_n, kv_len, MASKED: gl.constexpr,
             CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    # Online softmax of one score tile (exp2 domain); the library kernel's rules.
    if MASKED:
        cols = blk * BLOCK_N + offs_n
        visible = gl.expand_dims(cols < kv_len, 0)
        if CAUSAL:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m, 1))
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _loop_ahead(s, acc, m_i, l_i, lo, hi, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready, k_desc,
                r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_len, MASKED: gl.constexpr,
                CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                o_layout: gl.constexpr, p_layout: gl.constexpr):
    # Schedule "ahead", blocks j in [lo, hi), hi < n_blocks. On entry S[j] is complete in
    # registers and nothing is in flight; the same holds on exit for j = hi.
    for j in range(lo, hi):
        t_tok = _issue_qk(q1_s, q2_s, k_s, r_s, ready, j + 1, s_zero, STAGES)
        # the softmax of block j runs while the tensor cores compute S[j+1]
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, j, offs_m, offs_n, kv_len, MASKED,
                                      CAUSAL, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc_tok = warpgroup_mma(p, v_s.index(j % STAGES), acc, is_async=True)
        # in flight: S[j+1] (two groups), then P[j] V[j]. Waiting for S[j+1] alone (1 group
        # left) would leave P[j] V[j] in flight across the back edge, and ptxas then serializes
        # every wgmma of the kernel (C7514), so this waits for both.
        s, acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[t_tok, acc_tok, p])
        # stage j % STAGES is free in this warpgroup; once the other one is done too, refill it
        gl.thread_barrier()
        _issue_load(k_desc, r_desc, v_desc, k_s, r_s, v_s, ready, j + STAGES, n_blocks, BLOCK_N,
                    STAGES)
    return s, acc, m_i, l_i


@gluon.jit
def _loop_fa3(p, acc, m_i, l_i, lo, hi, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready, k_desc,
              r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_len, MASKED: gl.constexpr,
              CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr):
    # Schedule "fa3", blocks j in [lo, hi), lo >= 1. On entry P[j-1] (bf16, operand layout) is
    # in registers, the output holds blocks < j - 1 rescaled to block j - 1's max, and nothing is
    # in flight; the same holds on exit for j = hi.
    for j in range(lo, hi):
        t_tok = _issue_qk(q1_s, q2_s, k_s, r_s, ready, j, s_zero, STAGES)
        acc_tok = warpgroup_mma(p, v_s.index((j - 1) % STAGES), acc, is_async=True)
        # in flight: S[j] (two groups), then P[j-1] V[j-1]: wait for S[j] only
        s = warpgroup_mma_wait(num_outstanding=1, deps=[t_tok])
        # the softmax of block j runs while the tensor cores compute P[j-1] V[j-1]
        pf, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, j, offs_m, offs_n, kv_len, MASKED,
                                       CAUSAL, BLOCK_N)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(pf.to(gl.bfloat16), p_layout)
        # stage (j - 1) % STAGES is free in this warpgroup; once the other one is done, refill
        gl.thread_barrier()
        _issue_load(k_desc, r_desc, v_desc, k_s, r_s, v_s, ready, j - 1 + STAGES, n_blocks,
                    BLOCK_N, STAGES)
    return p, acc, m_i, l_i


@gluon.jit
def _gluon_attn_kernel(q_ptr, k_ptr, r_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_vt,
                       stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
                       CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                       STAGES: gl.constexpr, SCHEDULE: gl.constexpr,
                       num_warps: gl.constexpr):
    # one warpgroup per 64 query rows: wgmma M = 64 per warpgroup
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                       warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    q1_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D1], gl.bfloat16)
    q2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D2], gl.bfloat16)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], gl.bfloat16)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.bfloat16)

    # causal: heaviest query blocks first
    m_block = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    seqlen_q = gl.load(cu_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= seqlen_q:
        return
    k_start = gl.load(cu_k_ptr + seq)
    seqlen_k = gl.load(cu_k_ptr + seq + 1) - k_start
    if CAUSAL:
        kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M)
        n_free = gl.minimum(seqlen_k, m0 + 1) // BLOCK_N  # blocks every row sees whole
    else:
        kv_end = seqlen_k
        n_free = seqlen_k // BLOCK_N
    head64 = head.to(gl.int64)

    io_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io_layout))
    io_ok = gl.expand_dims(m0 + io_rows < seqlen_q, 1)
    o_ptrs = (out_ptr + (q_start + m0).to(gl.int64) * stride_ot + head64 * stride_oh
              + gl.expand_dims(io_rows, 1) * stride_ot
              + gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, io_layout)), 0))
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_rows = gl.arange(0, BLOCK_M, layout=row_o)
    l_ptrs = (lse_ptr + (q_start + m0).to(gl.int64) * stride_lt + head64 * stride_lh
              + o_rows * stride_lt)
    l_ok = m0 + o_rows < seqlen_q
    if kv_end <= 0:  # no keys: out = 0, lse = -inf
        gl.store(o_ptrs, gl.zeros([BLOCK_M, DV], gl.bfloat16, io_layout), mask=io_ok)
        gl.store(l_ptrs, gl.full([BLOCK_M], float("-inf"), gl.float32, row_o), mask=l_ok)
        return
    n_blocks = gl.cdiv(kv_end, BLOCK_N)

    # The query tile, once, into shared memory (rows past the sequence read 0, never stored).
    q_base = q_ptr + (q_start + m0).to(gl.int64) * stride_qt + head64 * stride_qh
    q_rows = gl.expand_dims(io_rows, 1) * stride_qt
    q1 = gl.load(q_base + q_rows + gl.expand_dims(
        gl.arange(0, D1, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok, other=0.0)
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D1], q1_sl, q1)
    q2 = gl.load(q_base + q_rows + D1 + gl.expand_dims(
        gl.arange(0, D2, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok, other=0.0)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D2], q2_sl, q2)

    # Descriptors over exactly this sequence's key rows (this head): tiles past them read 0.
    k_desc = tma.make_tensor_descriptor(k_ptr + k_start.to(gl.int64) * stride_kt
                                        + head64 * stride_kh, shape=[seqlen_k, D1],
                                        strides=[stride_kt, 1], block_shape=[BLOCK_N, D1],
                                        layout=k_sl)
    r_desc = tma.make_tensor_descriptor(r_ptr + k_start.to(gl.int64) * stride_rt,
                                        shape=[seqlen_k, D2], strides=[stride_rt, 1],
                                        block_shape=[BLOCK_N, D2], layout=r_sl)
    v_desc = tma.make_tensor_descriptor(v_ptr + k_start.to(gl.int64) * stride_vt
                                        + head64 * stride_vh, shape=[seqlen_k, DV],
                                        strides=[stride_vt, 1], block_shape=[BLOCK_N, DV],
                                        layout=v_sl)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D1], k_sl)
    r_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D2], r_sl)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DV], v_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()  # query stores and barrier inits before the async proxy reads them
    gl.thread_barrier()
    for i in gl.static_range(STAGES):
        _issue_load(k_desc, r_desc, v_desc, k_s, r_s, v_s, ready, i, n_blocks, BLOCK_N, STAGES)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)

    t_tok = _issue_qk(q1_s, q2_s, k_s, r_s, ready, 0, s_zero, STAGES)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[t_tok])
    last = n_blocks - 1
    if SCHEDULE == 0:  # "ahead"
        free_hi = gl.minimum(n_free, last)
        s, acc, m_i, l_i = _loop_ahead(
            s, acc, m_i, l_i, 0, free_hi, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready, k_desc,
            r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_end, False, CAUSAL, BLOCK_N,
            STAGES, o_layout, p_layout)
        if CAUSAL:  # the diagonal blocks but the last
            s, acc, m_i, l_i = _loop_ahead(
                s, acc, m_i, l_i, free_hi, last, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready,
                k_desc, r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_end, True, CAUSAL,
                BLOCK_N, STAGES, o_layout, p_layout)
        # the last block, always masked
        pf, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, last, offs_m, offs_n, kv_end, True,
                                       CAUSAL, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    else:  # "fa3"
        # block 0 (masked: it may be the last or a diagonal one); the output is still 0
        pf, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, 0, offs_m, offs_n, kv_end, True,
                                       CAUSAL, BLOCK_N)
        p = gl.convert_layout(pf.to(gl.bfloat16), p_layout)
        free_hi = gl.maximum(gl.minimum(n_free, n_blocks), 1)  # blocks [1, free_hi) unmasked
        p, acc, m_i, l_i = _loop_fa3(
            p, acc, m_i, l_i, 1, free_hi, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready, k_desc,
            r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_end, False, CAUSAL, BLOCK_N,
            STAGES, o_layout, p_layout)
        p, acc, m_i, l_i = _loop_fa3(
            p, acc, m_i, l_i, free_hi, n_blocks, n_blocks, q1_s, q2_s, k_s, r_s, v_s, ready,
            k_desc, r_desc, v_desc, s_zero, qk_scale, offs_m, offs_n, kv_end, True, CAUSAL,
            BLOCK_N, STAGES, o_layout, p_layout)
        pf = p  # P of the last block, already in the operand layout
    p = gl.convert_layout(pf.to(gl.bfloat16), p_layout)
    acc_tok = warpgroup_mma(p, v_s.index(last % STAGES), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    # Finish: NaN for a zero sum or an LSE of +inf (the library kernel's rule).
    l_o = gl.convert_layout(l_i, row_o)
    lse2 = gl.convert_layout(m_i, row_o) + gl.log2(l_o)
    bad = (l_o == 0.0) | (lse2 == float("inf"))
    o = acc * gl.expand_dims(1.0 / l_o, 1)
    o = gl.where(gl.expand_dims(bad, 1), float("nan"), o)
    lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)
    gl.store(o_ptrs, gl.convert_layout(o.to(gl.bfloat16), io_layout), mask=io_ok)
    gl.store(l_ptrs, lse, mask=l_ok)


# ---------------------------------------------------------------------------------------------
# Warp-specialized schedules ("ws", "ws_ahead"): a 1-warp TMA producer partition and two
# independent 4-warp consumer partitions (64 query rows each). See the module docstring.

# The producer, the serial key loop and the register split (launched with _MAXNREG, setmaxnreg
# giving the producer warpgroup _PRODUCER_REGS and each consumer _CONSUMER_REGS) are the
# library kernel's (mlaprefill.kernels.hopper_attention), which grew out of this probe.


@gluon.jit
def _ws_pv(p, acc, alpha, v_s, empty, blk, STAGES: gl.constexpr, o_layout: gl.constexpr,
           p_layout: gl.constexpr):
    # O = O * alpha + P V[blk], waited for; then stage blk % STAGES is released (this warpgroup's
    # one arrive on empty: the wgmma that read K, rope and V of the stage are all complete).
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    st = blk % STAGES
    acc_tok = warpgroup_mma(p, v_s.index(st), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_tok, p])
    mbarrier.arrive(empty.index(st), count=1)
    return acc


@gluon.jit
def _ws_loop_ahead(s, acc, m_i, l_i, lo, hi, q1_s, q2_s, k_s, r_s, v_s, ready, empty, s_zero,
                   qk_scale, offs_m, offs_n, kv_len, MASKED: gl.constexpr,
                   CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   o_layout: gl.constexpr, p_layout: gl.constexpr):
    # "ws_ahead": schedule "ahead" inside each consumer warpgroup, blocks j in [lo, hi),
    # hi < n_blocks. On entry S[j] is complete in registers; S[j+1] is issued before the
    # softmax of block j, then P[j] V[j], and both are waited for before block j's release.
    for j in range(lo, hi):
        t_tok = _issue_qk(q1_s, q2_s, k_s, r_s, ready, j + 1, s_zero, STAGES)
        p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, j, offs_m, offs_n, kv_len, MASKED,
                                      CAUSAL, BLOCK_N)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc_tok = warpgroup_mma(p, v_s.index(j % STAGES), acc, is_async=True)
        s, acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[t_tok, acc_tok, p])
        mbarrier.arrive(empty.index(j % STAGES), count=1)
    return s, acc, m_i, l_i


@gluon.jit
def _ws_consumer(q_ptr, out_ptr, lse_ptr, q_start, seqlen_q, m0, head, stride_qt, stride_qh,
                 stride_ot, stride_oh, stride_lt, stride_lh, kv_end, n_free, n_blocks, qk_scale,
                 q1_s, q2_s, k_s, r_s, v_s, ready, empty, WG: gl.constexpr,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D1: gl.constexpr,
                 D2: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                 INNER: gl.constexpr):
    # One consumer warpgroup (4 warps): query rows m0 + 64 * WG + [0, 64) of the tile, its own
    # Q buffer, m, l and O; it meets the other warpgroup only through the empty barriers.
    WM: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    r0 = m0 + WG * WM
    head64 = head.to(gl.int64)
    io_rows = gl.arange(0, WM, layout=gl.SliceLayout(1, io_layout))
    io_ok = gl.expand_dims(r0 + io_rows < seqlen_q, 1)
    o_ptrs = (out_ptr + (q_start + r0).to(gl.int64) * stride_ot + head64 * stride_oh
              + gl.expand_dims(io_rows, 1) * stride_ot
              + gl.expand_dims(gl.arange(0, DV, layout=gl.SliceLayout(0, io_layout)), 0))
    o_rows = gl.arange(0, WM, layout=row_o)
    l_ptrs = (lse_ptr + (q_start + r0).to(gl.int64) * stride_lt + head64 * stride_lh
              + o_rows * stride_lt)
    l_ok = r0 + o_rows < seqlen_q
    if n_blocks > 0:
        # this warpgroup's query rows into its Q buffer (rows past the sequence read 0)
        q_base = q_ptr + (q_start + r0).to(gl.int64) * stride_qt + head64 * stride_qh
        q_rows = gl.expand_dims(io_rows, 1) * stride_qt
        q1 = gl.load(q_base + q_rows + gl.expand_dims(
            gl.arange(0, D1, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok, other=0.0)
        q2 = gl.load(q_base + q_rows + D1 + gl.expand_dims(
            gl.arange(0, D2, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok, other=0.0)
        q1w = q1_s.index(WG)
        q2w = q2_s.index(WG)
        q1w.store(q1)
        q2w.store(q2)
        fence_async_shared()  # generic-proxy stores before wgmma reads them
        gl.thread_barrier()  # this partition's warps only (once, before the key loop)

        offs_m = r0 + gl.arange(0, WM, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([WM, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([WM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([WM], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([WM, DV], gl.float32, o_layout)
        last = n_blocks - 1
        if INNER == 0:  # "ws"
            free_hi = gl.minimum(n_free, n_blocks)  # blocks [0, free_hi) need no mask
            # the library kernel's key loop (mlaprefill.kernels.hopper_attention), from block 0
            acc, m_i, l_i = _key_blocks(
                acc, m_i, l_i, 0, free_hi, 0, q1w, q2w, k_s, r_s, v_s, ready, empty, s_zero,
                qk_scale, offs_m, offs_n, kv_end, False, CAUSAL, BLOCK_N, STAGES, o_layout,
                p_layout)
            acc, m_i, l_i = _key_blocks(
                acc, m_i, l_i, free_hi, n_blocks, 0, q1w, q2w, k_s, r_s, v_s, ready, empty,
                s_zero, qk_scale, offs_m, offs_n, kv_end, True, CAUSAL, BLOCK_N, STAGES,
                o_layout, p_layout)
        else:  # "ws_ahead"
            t_tok = _issue_qk(q1w, q2w, k_s, r_s, ready, 0, s_zero, STAGES)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[t_tok])
            free_hi = gl.minimum(n_free, last)
            s, acc, m_i, l_i = _ws_loop_ahead(
                s, acc, m_i, l_i, 0, free_hi, q1w, q2w, k_s, r_s, v_s, ready, empty, s_zero,
                qk_scale, offs_m, offs_n, kv_end, False, CAUSAL, BLOCK_N, STAGES, o_layout,
                p_layout)
            if CAUSAL:  # the diagonal blocks but the last
                s, acc, m_i, l_i = _ws_loop_ahead(
                    s, acc, m_i, l_i, free_hi, last, q1w, q2w, k_s, r_s, v_s, ready, empty,
                    s_zero, qk_scale, offs_m, offs_n, kv_end, True, CAUSAL, BLOCK_N, STAGES,
                    o_layout, p_layout)
            # the last block, always masked
            p, alpha, l_i, m_i = _softmax(s, m_i, l_i, qk_scale, last, offs_m, offs_n, kv_end,
                                          True, CAUSAL, BLOCK_N)
            acc = _ws_pv(p, acc, alpha, v_s, empty, last, STAGES, o_layout, p_layout)

        # Finish: NaN for a zero sum or an LSE of +inf (the library kernel's rule).
        l_o = gl.convert_layout(l_i, row_o)
        lse2 = gl.convert_layout(m_i, row_o) + gl.log2(l_o)
        bad = (l_o == 0.0) | (lse2 == float("inf"))
        o = acc * gl.expand_dims(1.0 / l_o, 1)
        o = gl.where(gl.expand_dims(bad, 1), float("nan"), o)
        lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)
        gl.store(o_ptrs, gl.convert_layout(o.to(gl.bfloat16), io_layout), mask=io_ok)
        gl.store(l_ptrs, lse, mask=l_ok)
    else:  # no keys (or a query block past the sequence: every store masked off)
        gl.store(o_ptrs, gl.zeros([WM, DV], gl.bfloat16, io_layout), mask=io_ok)
        gl.store(l_ptrs, gl.full([WM], float("-inf"), gl.float32, row_o), mask=l_ok)


@gluon.jit
def _gluon_attn_ws_kernel(q_ptr, k_ptr, r_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                          qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_rt,
                          stride_vt, stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
                          CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                          STAGES: gl.constexpr, SCHEDULE: gl.constexpr,
                          num_warps: gl.constexpr):
    # num_warps = 4: the default partition is consumer warpgroup 0; workers: consumer warpgroup
    # 1 (4 warps) and the TMA producer (1 warp). No early return: every CTA enters the
    # warp-specialized region with n_blocks (0 for a query block past the sequence or without
    # keys), and all three partitions loop over exactly n_blocks key blocks.
    gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 query rows")
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    WM: gl.constexpr = 64
    q1_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D1], gl.bfloat16)
    q2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D2], gl.bfloat16)
    k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], gl.bfloat16)
    v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], gl.bfloat16)

    m_block = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    seqlen_q = gl.load(cu_q_ptr + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    k_start = gl.load(cu_k_ptr + seq)
    seqlen_k = gl.load(cu_k_ptr + seq + 1) - k_start
    if CAUSAL:
        kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M)
        n_free = gl.minimum(seqlen_k, m0 + 1) // BLOCK_N  # blocks every row sees whole
    else:
        kv_end = seqlen_k
        n_free = seqlen_k // BLOCK_N
    n_blocks = gl.cdiv(kv_end, BLOCK_N) * (m0 < seqlen_q).to(gl.int32)
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [2, WM, D1], q1_sl)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [2, WM, D2], q2_sl)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D1], k_sl)
    r_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D2], r_sl)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, DV], v_sl)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect; TMA bytes complete it
        mbarrier.init(empty.index(i), count=2)  # one arrive per consumer warpgroup
    fence_async_shared()

    INNER: gl.constexpr = SCHEDULE - 2  # 0: "ws", 1: "ws_ahead"
    gl.warp_specialize([
        (_ws_consumer, (q_ptr, out_ptr, lse_ptr, q_start, seqlen_q, m0, head, stride_qt,
                        stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, kv_end, n_free,
                        n_blocks, qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready, empty, 0, CAUSAL,
                        BLOCK_N, D1, D2, DV, STAGES, INNER)),
        (_ws_consumer, (q_ptr, out_ptr, lse_ptr, q_start, seqlen_q, m0, head, stride_qt,
                        stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, kv_end, n_free,
                        n_blocks, qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready, empty, 1, CAUSAL,
                        BLOCK_N, D1, D2, DV, STAGES, INNER)),
        # the library kernel's producer: rope head stride 0 (shared rows), from block 0
        (_producer, (k_ptr, r_ptr, v_ptr, k_start, seqlen_k, head, stride_kt, stride_kh,
                     stride_rt, 0, stride_vt, stride_vh, k_s, r_s, v_s, ready, empty, 0,
                     n_blocks, BLOCK_N, D1, D2, DV, STAGES)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def _kernel_for(schedule: int) -> tuple[Any, dict[str, int]]:
    """The kernel of a schedule and its extra launch / compile options."""
    if schedule >= 2:  # warp-specialized: 12 warps in all, registers reallocated per partition
        return _gluon_attn_ws_kernel, {"maxnreg": _MAXNREG}
    return _gluon_attn_kernel, {}


def gluon_attention(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor, v: torch.Tensor,
                    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, causal: bool = False,
                    config: str = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [Tq, H, 192], k [Tk, H, 128], rope [Tk, 64] (shared by the heads), v [Tk, H, 128],
    cu_q / cu_k int32 [num_seqs + 1] on the device, max_q a host int. Returns out bf16
    [Tq, H, 128] and lse float32 [Tq, H] (natural log), softmax scale 192 ** -0.5."""
    schedule, bm, bn, stages, warps = CONFIGS[config]
    tq, h = q.shape[:2]
    if (q.shape[2], k.shape[2], rope.shape[-1], v.shape[2]) != (QK, D1, ROPE, VD):
        raise ValueError(f"need q [Tq, H, {QK}], k [Tk, H, {D1}], rope [Tk, {ROPE}], "
                         f"v [Tk, H, {VD}]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(rope.shape)}, {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("rope", rope), ("v", v)):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be bf16 with a contiguous last dim")
        if t.data_ptr() % 16 or any(st * 2 % 16 for st in t.stride()[:-1]):
            raise ValueError(f"{name}: TMA needs 16-byte aligned base and strides")
    out = torch.empty(tq, h, VD, dtype=q.dtype, device=q.device)
    lse = torch.empty(tq, h, dtype=torch.float32, device=q.device)
    num_seqs = cu_q.shape[0] - 1
    if tq == 0 or h == 0 or num_seqs == 0 or max_q == 0:
        return out, lse
    if k.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    from mlaprefill.kernels._triton import ensure_allocator

    ensure_allocator()  # device-side tensor descriptors need global scratch
    grid = (triton.cdiv(max_q, bm), num_seqs, h)
    kernel, extra = _kernel_for(schedule)
    kernel[grid](
        q, k, rope, v, out, lse, cu_q, cu_k, SCALE * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), rope.stride(0), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        CAUSAL=bool(causal), BLOCK_M=bm, BLOCK_N=bn, D1=D1, D2=ROPE, DV=VD, STAGES=stages,
        SCHEDULE=schedule, num_warps=warps, **extra)
    return out, lse


def run(names: list[str], causal_too: bool) -> dict[str, Any]:
    from attention_variants import FLOPS_FORMULA, compare

    def attend(name: str, q: Any, k: Any, rope: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int,
               causal: bool) -> Any:
        return gluon_attention(q, k, rope, v, cu_q, cu_k, max_q, causal, name)

    return {"rows": compare(names, attend, key="configs", width=20, causal_too=causal_too),
            "flops_formula": FLOPS_FORMULA,
            "configs": {n: dict(zip(("schedule", "block_m", "block_n", "stages", "num_warps"),
                                    CONFIGS[n], strict=True)) for n in names}}


def edge_cases(name: str) -> dict[str, Any]:
    """Ragged sequences (a tail block, an empty key range, a one-row query) against the
    library's kernel: max abs differences over the rows both define, and whether the empty
    sequence's rows are out = 0, lse = -inf."""
    from mlaprefill.kernels.attention import varlen_attention

    h, lens_q, lens_k = 2, [130, 64, 1, 200], [200, 0, 70, 333]
    g = torch.Generator(device="cuda").manual_seed(1)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, QK, device="cuda", dtype=torch.bfloat16, generator=g)
    kn = torch.randn(tk, h, D1, device="cuda", dtype=torch.bfloat16, generator=g)
    rope = torch.randn(tk, ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(tk, h, VD, device="cuda", dtype=torch.bfloat16, generator=g)
    res: dict[str, Any] = {"lens_q": lens_q, "lens_k": lens_k}
    for causal in (False, True):
        ck = cu_q if causal else cu_k
        kk, rr, vv = (kn[:tq], rope[:tq], v[:tq]) if causal else (kn, rope, v)
        ref_out, ref_lse = varlen_attention(q, kk, vv, cu_q, ck, max_seqlen_q=max(lens_q),
                                            causal=causal, softmax_scale=SCALE, k_rope=rr)
        try:
            out, lse = gluon_attention(q, kk, rr, vv, cu_q, ck, max(lens_q), causal, name)
            torch.cuda.synchronize()
            fin = torch.isfinite(ref_lse)
            rec = {"out_max_abs_diff": (out.float() - ref_out.float()).abs().max().item(),
                   "lse_max_abs_diff_finite": (lse[fin] - ref_lse[fin]).abs().max().item(),
                   "nonfinite_lse_match": bool(torch.equal(lse[~fin], ref_lse[~fin]))}
        except Exception as exc:
            rec = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        res["causal" if causal else "non_causal"] = rec
    return res


def compile_only(names: list[str], dump_dir: str | None = None) -> dict[str, Any]:
    """Compile each config for sm_90a without a GPU (non-causal and causal) and run the bundled
    ptxas on the PTX: registers, spills, and whether ptxas serialized the wgmma pipeline
    (advisories C7514 / C7515). ``dump_dir``: also write each config's PTX and cubin there (for
    ``cuobjdump -sass``)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ptr_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "r_ptr": "*bf16", "v_ptr": "*bf16",
                 "out_ptr": "*bf16", "lse_ptr": "*fp32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    result: dict[str, Any] = {}
    for name in names:
        schedule, bm, bn, stages, warps = CONFIGS[name]
        fn, extra = _kernel_for(schedule)
        sig = {a: ptr_types.get(a, "i32" if a.startswith("stride") else "constexpr")
               for a in fn.arg_names}
        sig["qk_scale"] = "fp32"
        # what the JIT specializes on the device: 16-divisible pointers and strides (lse
        # strides left out: they are H and 1)
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if sig[a].startswith("*")
                 or (a.startswith("stride") and a[-2:] not in ("lt", "lh"))}
        for causal in (False, True):
            consts = {"CAUSAL": causal, "BLOCK_M": bm, "BLOCK_N": bn, "D1": D1, "D2": ROPE,
                      "DV": VD, "STAGES": stages, "SCHEDULE": schedule, "num_warps": warps}
            key = f"{name}{'_causal' if causal else ''}"
            try:
                kernel = triton.compile(GluonASTSource(fn, sig, consts, attrs),
                                        target=GPUTarget("cuda", 90, 32),
                                        options={"num_warps": warps, "num_stages": 1, **extra})
                with tempfile.TemporaryDirectory() as tmp:
                    ptx = os.path.join(tmp, "k.ptx")
                    with open(ptx, "w") as fh:
                        fh.write(kernel.asm["ptx"])
                    log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o",
                                          os.path.join(tmp, "k.cubin")],
                                         capture_output=True, text=True, check=True).stderr
                    if dump_dir:
                        os.makedirs(dump_dir, exist_ok=True)
                        for ext in ("ptx", "cubin"):
                            with open(os.path.join(tmp, f"k.{ext}"), "rb") as src_fh, \
                                    open(os.path.join(dump_dir, f"{key}.{ext}"), "wb") as dst:
                                dst.write(src_fh.read())
                regs = re.search(r"Used (\d+) registers", log)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
                rec = {"registers": int(regs.group(1)) if regs else None,
                       "spill_store_bytes": int(spill.group(1)) if spill else None,
                       "spill_load_bytes": int(spill.group(2)) if spill else None,
                       "shared_bytes": kernel.metadata.shared,
                       "wgmma_serialized": "C7514" in log or "C7515" in log}
                setmaxnreg = sorted({int(n) for n in re.findall(
                    r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])})
                if setmaxnreg:  # warp-specialized: the register counts partitions switch to
                    rec["setmaxnreg"] = setmaxnreg
            except Exception as exc:
                rec = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            result[key] = rec
            print(f"{key:<28} {rec}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configs")
    ap.add_argument("--no-causal", action="store_true", help="skip the causal shapes")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile for sm_90a and report ptxas (no GPU needed)")
    ap.add_argument("--dump-dir", help="with --compile-only: write each config's PTX and cubin")
    args = ap.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {sorted(CONFIGS)}")
    if args.compile_only:
        write_json(args.out, {"benchmark": "gluon_attention_compile", "argv": sys.argv,
                              "triton": triton.__version__,
                              "ptxas": compile_only(names, args.dump_dir)})
        return 0
    from mlaprefill._env import machine_info, utc_now

    edges = {name: edge_cases(name) for name in names}
    for name, rec in edges.items():
        print(f"edge cases {name}: {rec}", flush=True)
    result = {"benchmark": "gluon_attention", "argv": sys.argv,
              "date_utc": utc_now(offset=True), "machine": machine_info(torch.device("cuda")),
              "triton": triton.__version__, "edge_cases": edges,
              **run(names, not args.no_causal)}
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
