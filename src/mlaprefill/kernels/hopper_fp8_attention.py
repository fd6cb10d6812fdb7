"""Warp-specialized FP8 context attention for Hopper (sm_90), written in Gluon: the default kernel
of :func:`mlaprefill.kernels.fp8_attention.fp8_context_attention` where it applies.

The bf16 Gluon kernel's design (:mod:`mlaprefill.kernels.hopper_attention`: one TMA producer
warp filling a ``STAGES``-deep ring of key blocks, two consumer warpgroups of 64 query rows each
that nothing keeps in step, so one's softmax runs while the other's wgmma do) with both matrix
products in ``float8_e4m3fn`` (wgmma ``k = 32``, float32 accumulators) and the FP8 contract of
:mod:`~mlaprefill.kernels.fp8_attention`: one scale per query row, per chunk for K and for V
(:class:`~mlaprefill.kernels.fp8_attention.FP8Context`), probabilities rounded as ``448 * p``
(the offset ``log2(448)`` folded into the exponent, divided out by the row sum), natural-log LSE
in float32. Non-causal only (the context part of MLA prefill); MLA's head dims only: nope 128,
rope 64, v 128.

Operands as FP8 wgmma wants them (both K-major): Q and K rows with the head dim contiguous; V
read transposed (``vt8 [H, v, Tk_pad]``, keys contiguous) and given to the PV product as the
permuted view of a ``[v, BLOCK_N]`` tile; P converted from the score accumulator's registers to
the A operand's (8-bit: four values per register).

Where a sequence's keys start and end: a V^T tile's first column must be 16-byte aligned (TMA
faults otherwise), so a sequence's key blocks start at its first key rounded down to 16, as in the
Triton kernel. The K, rope and V^T descriptors end at the sequence's last key, so a tile past it
reads zeros; the up to 15 keys of the previous sequence that the first block holds get ``-inf``
scores by ``where``, and their V^T columns are zeroed in shared memory before the PV product, so
no other sequence's value reaches a row (a NaN stays in its sequence); the last block's scores
past the end are ``-inf`` by ``where``. Finish: the FP8 Triton kernel's rules
(NaN where the sum is 0 or the LSE would be ``+inf``; ``out = 0, lse = -inf`` without keys; with
``accumulate``, the merge of :mod:`mlaprefill.kernels.merge`, rows without keys untouched).

Persistent, as the bf16 kernel on a context part: one program per SM walks the (query block,
sequence, head) tiles, the ring's iteration count running on across them. Measured on the H200
against the FP8 Triton kernel and the bf16 kernels:
benchmarks/results/fp8_attention_h200.json (docs/RESULTS.md). Compiles once per (out dtype,
accumulate, block_n, stages). ``MLAPREFILL_DISABLE_HOPPER_KERNEL=1`` (the one debug override,
:data:`mlaprefill.kernels.hopper_attention.DISABLE_ENV`) runs the Triton kernel instead.
"""

from __future__ import annotations

import os

import torch

from mlaprefill.kernels import hopper_attention as _bf16
from mlaprefill.kernels._triton import cdiv, ensure_allocator

__all__ = ["BLOCK_N", "STAGES", "hopper_fp8_attention", "unsupported_reason"]

#: Keys per block and ring depth (the defaults; ``hopper_fp8_attention`` takes others): 256 x 2
#: measured fastest of 64 x 3, 128 x 2, 128 x 3 and 256 x 2 on 8 shapes of 16 and 128 heads
#: (benchmarks/results/fp8_attention_h200.json).
BLOCK_N, STAGES = 256, 2
_D1, _D2, _DV = 128, 64, 128
_LOG2_448 = 8.807354922057604
# (out dtype, accumulate, block_n, stages) whose compile failed here: the Triton kernel instead
_FAILED: dict[tuple, str] = {}

HAS_GLUON = _bf16.HAS_GLUON
if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    _CONSUMER_REGS = gl.constexpr(240)
    _PRODUCER_REGS = gl.constexpr(24)

    @gluon.jit
    def _fp8_producer_tile(k_ptr, r_ptr, vt_ptr, a0, span, head, num_heads, keys_pad, k_s,
                           r_s, v_s, ready, empty, n_iter, it0, BLOCK_N: gl.constexpr,
                           D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                           STAGES: gl.constexpr):
        # One warp, one tile; the ring's protocol is the bf16 kernel's (_producer_tile there):
        # iteration i is the ring's iteration it0 + i, and the descriptors, rewritten per tile
        # in the same scratch, wait for the previous tile's copies to land. Blocks start at
        # a0, the sequence's first key rounded down to 16 (a V^T tile's first column must be
        # 16-byte aligned: TMA faults otherwise), and cover span = the keys from a0 to the
        # sequence's end; descriptors end there, so a tile past it reads zeros.
        for j in gl.static_range(STAGES):
            g = it0 - 1 - j
            if g >= 0:
                mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        head64 = head.to(gl.int64)
        rows = gl.maximum(span, 1)
        k_desc = tma.make_tensor_descriptor(
            k_ptr + a0.to(gl.int64) * (num_heads * D1) + head64 * D1, shape=[rows, D1],
            strides=[num_heads * D1, 1], block_shape=[BLOCK_N, D1], layout=k_s.type.layout)
        r_desc = tma.make_tensor_descriptor(
            r_ptr + a0.to(gl.int64) * D2, shape=[rows, D2], strides=[D2, 1],
            block_shape=[BLOCK_N, D2], layout=r_s.type.layout)
        v_desc = tma.make_tensor_descriptor(
            vt_ptr + head64 * DV * keys_pad, shape=[DV, a0 + rows], strides=[keys_pad, 1],
            block_shape=[DV, BLOCK_N], layout=v_s.type.layout)
        nbytes: gl.constexpr = (k_desc.block_type.nbytes + r_desc.block_type.nbytes
                                + v_desc.block_type.nbytes)
        for i in range(n_iter):
            st = (it0 + i) % STAGES
            mbarrier.wait(empty.index(st), (((it0 + i) // STAGES) & 1) ^ 1)
            bar = ready.index(st)
            mbarrier.expect(bar, nbytes)
            row = i * BLOCK_N
            tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_s.index(st))
            tma.async_copy_global_to_shared(r_desc, [row, 0], bar, r_s.index(st))
            tma.async_copy_global_to_shared(v_desc, [0, a0 + row], bar, v_s.index(st))

    @gluon.jit
    def _fp8_key_blocks(acc, m_i, l_i, lo, hi, it0, q1_s, q2_s, k_s, r_s, v_s, ready, empty,
                        s_zero, qf, offs_n, shift, span, MASKED: gl.constexpr,
                        FIRST: gl.constexpr,
                        BLOCK_N: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                        o_layout: gl.constexpr, p_layout: gl.constexpr):
        # Block i holds keys [i * BLOCK_N, (i + 1) * BLOCK_N) counted from a0; the sequence's
        # are [shift, span). FIRST (block 0 when shift > 0): its V^T columns below shift are the
        # previous sequence's values, zeroed in the stage before the PV product (a NaN there
        # times p = 0 would be NaN). Both consumer warpgroups write the same zeros, and a
        # stage is refilled only after both released it.
        for i in range(lo, hi):
            g = it0 + i  # the ring's iteration count (runs on across a program's tiles)
            st = g % STAGES
            mbarrier.wait(ready.index(st), (g // STAGES) & 1)
            if FIRST:
                v_io: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
                vt = v_s.index(st).load(v_io).to(gl.int8, bitcast=True)
                vcols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, v_io))
                vt = gl.where(gl.expand_dims(vcols >= shift, 0), vt, gl.zeros_like(vt))
                v_s.index(st).store(vt.to(gl.float8e4nv, bitcast=True))
                fence_async_shared()
                gl.thread_barrier()
            t = warpgroup_mma(q1_s, k_s.index(st).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            t = warpgroup_mma(q2_s, r_s.index(st).permute((1, 0)), t, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            if MASKED:  # where, not a multiply (0 * NaN)
                cols = i * BLOCK_N + offs_n
                s = gl.where(gl.expand_dims((cols >= shift) & (cols < span), 0), s,
                             float("-inf"))
            # qf > 0 per row (or NaN: a query holding one), so max(s) * qf == max(s * qf)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qf)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            # 448 * p: e4m3's whole range for the rounding below (log2(448) in the offset)
            p = gl.exp2(s * gl.expand_dims(qf, 1) - gl.expand_dims(m_safe - 8.807354922057604, 1))
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
            t = warpgroup_mma(p8, v_s.index(st).permute((1, 0)), acc, is_async=True)
            # (the wait takes no 8-bit register operand among its deps; nothing runs between
            # the issue and the wait that could reuse p8's registers)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            mbarrier.arrive(empty.index(st), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _fp8_consumer_tile(q_ptr, qs_ptr, bound_ptr, out_ptr, lse_ptr, q_start, seqlen_q, m0,
                           head, num_heads, stride_ot, stride_oh, stride_lt, stride_lh, shift,
                           span, n_iter, it0, qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready, empty,
                           WG: gl.constexpr, ACCUMULATE: gl.constexpr, BLOCK_N: gl.constexpr,
                           D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                           STAGES: gl.constexpr):
        # One consumer warpgroup (4 warps), one tile: query rows m0 + 64 * WG + [0, 64); its
        # ring iterations are it0 + [0, n_iter).
        WM: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=4)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        dtype: gl.constexpr = out_ptr.dtype.element_ty
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
        if n_iter > 0:
            # this warpgroup's e4m3 queries into its Q buffer (rows past the sequence read 0
            # and are never stored)
            q_rows_l = gl.arange(0, WM, layout=gl.SliceLayout(1, q_layout))
            q_ok = gl.expand_dims(r0 + q_rows_l < seqlen_q, 1)
            q_base = q_ptr + ((q_start + r0).to(gl.int64) * num_heads + head64) * (D1 + D2)
            q_rows = gl.expand_dims(q_rows_l, 1).to(gl.int64) * (num_heads * (D1 + D2))
            q1 = gl.load(q_base + q_rows + gl.expand_dims(
                gl.arange(0, D1, layout=gl.SliceLayout(0, q_layout)), 0), mask=q_ok, other=0.0)
            q2 = gl.load(q_base + q_rows + D1 + gl.expand_dims(
                gl.arange(0, D2, layout=gl.SliceLayout(0, q_layout)), 0), mask=q_ok, other=0.0)
            q1w = q1_s.index(WG)
            q2w = q2_s.index(WG)
            q1w.store(q1)
            q2w.store(q2)
            fence_async_shared()  # generic-proxy stores before the wgmma read them
            gl.thread_barrier()  # this partition's warps only

            # the query's scale, K's and the softmax scale in one per-row factor
            bound_k = gl.load(bound_ptr)
            sk = gl.where(bound_k > 0, bound_k / 448.0, 1.0)
            s_rows = gl.arange(0, WM, layout=row_s)
            qf = gl.load(qs_ptr + ((q_start + r0).to(gl.int64) + s_rows) * num_heads + head64,
                         mask=r0 + s_rows < seqlen_q, other=1.0) * (sk * qk_scale)
            offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s_zero = gl.zeros([WM, BLOCK_N], gl.float32, s_layout)
            m_i = gl.full([WM], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([WM], gl.float32, row_s)
            acc = gl.zeros([WM, DV], gl.float32, o_layout)
            # block 0 when the sequence starts past a0 (masked, V fixed); then the blocks
            # wholly inside the keys (no mask); then the last one where it passes their end
            first = gl.where(shift > 0, 1, 0)
            free = gl.maximum(gl.minimum(span // BLOCK_N, n_iter), first)
            acc, m_i, l_i = _fp8_key_blocks(acc, m_i, l_i, 0, first, it0, q1w, q2w, k_s, r_s, v_s,
                                            ready, empty, s_zero, qf, offs_n, shift, span, True,
                                            True, BLOCK_N, DV, STAGES, o_layout, p_layout)
            acc, m_i, l_i = _fp8_key_blocks(acc, m_i, l_i, first, free, it0, q1w, q2w, k_s, r_s,
                                            v_s, ready, empty, s_zero, qf, offs_n, shift, span,
                                            False, False, BLOCK_N, DV, STAGES, o_layout,
                                            p_layout)
            acc, m_i, l_i = _fp8_key_blocks(acc, m_i, l_i, free, n_iter, it0, q1w, q2w, k_s, r_s,
                                            v_s, ready, empty, s_zero, qf, offs_n, shift, span,
                                            True, False, BLOCK_N, DV, STAGES, o_layout,
                                            p_layout)
            # l_i and acc both hold 448 * p: the output divides it out, the LSE subtracts
            # log2(448)
            bound_v = gl.load(bound_ptr + 1)
            sv = gl.where(bound_v > 0, bound_v / 448.0, 1.0)
            l_o = gl.convert_layout(l_i, row_o)
            lse2 = gl.convert_layout(m_i, row_o) + gl.log2(l_o) - 8.807354922057604
            bad = (l_o == 0.0) | (lse2 == float("inf"))
            o = acc * gl.expand_dims(sv / l_o, 1)
            o = gl.where(gl.expand_dims(bad, 1), float("nan"), o)
            lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)  # natural log
            _bf16._store_rows(o, lse, o_ptrs, l_ptrs, io_ok, l_ok, ACCUMULATE, dtype, o_layout,
                              io_layout)
        elif not ACCUMULATE:  # no key here: out = 0, lse = -inf (merging nothing: no write)
            gl.store(o_ptrs, gl.zeros([WM, DV], dtype, io_layout), mask=io_ok)
            gl.store(l_ptrs, gl.full([WM], float("-inf"), gl.float32, row_o), mask=l_ok)

    @gluon.jit
    def _fp8_tile(t, n_m, num_seqs, cu_q_ptr, cu_k_ptr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):
        # Tile t = (query block, sequence, head), query blocks fastest (the programs running
        # at once share one head's keys in L2): where its rows and keys are, its block count.
        m0 = (t % n_m) * BLOCK_M
        seq = (t // n_m) % num_seqs
        head = t // (n_m * num_seqs)
        q_start = gl.load(cu_q_ptr + seq)
        seqlen_q = gl.load(cu_q_ptr + seq + 1) - q_start
        k_start = gl.load(cu_k_ptr + seq)
        seqlen_k = gl.load(cu_k_ptr + seq + 1) - k_start
        live = (m0 < seqlen_q) & (seqlen_k > 0)
        a0 = (k_start // 16) * 16
        shift = k_start - a0
        span = shift + seqlen_k
        n_iter = gl.where(live, gl.cdiv(span, BLOCK_N), 0)
        return q_start, seqlen_q, m0, head, a0, shift, span, n_iter

    @gluon.jit
    def _fp8_producer(k_ptr, r_ptr, vt_ptr, cu_q_ptr, cu_k_ptr, n_m, num_seqs, n_tiles,
                      num_heads, keys_pad, k_s, r_s, v_s, ready, empty, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr,
                      DV: gl.constexpr, STAGES: gl.constexpr):
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            _, _, _, head, a0, _, span, n_iter = _fp8_tile(t, n_m, num_seqs, cu_q_ptr,
                                                           cu_k_ptr, BLOCK_M, BLOCK_N)
            _fp8_producer_tile(k_ptr, r_ptr, vt_ptr, a0, span, head, num_heads, keys_pad, k_s,
                               r_s, v_s, ready, empty, n_iter, it, BLOCK_N, D1, D2, DV, STAGES)
            it += n_iter

    @gluon.jit
    def _fp8_consumer(q_ptr, qs_ptr, bound_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, n_m,
                      num_seqs, n_tiles, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
                      qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready, empty, WG: gl.constexpr,
                      ACCUMULATE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                      STAGES: gl.constexpr):
        it = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            q_start, seqlen_q, m0, head, _, shift, span, n_iter = _fp8_tile(
                t, n_m, num_seqs, cu_q_ptr, cu_k_ptr, BLOCK_M, BLOCK_N)
            _fp8_consumer_tile(q_ptr, qs_ptr, bound_ptr, out_ptr, lse_ptr, q_start, seqlen_q,
                               m0, head, num_heads, stride_ot, stride_oh, stride_lt, stride_lh,
                               shift, span, n_iter, it, qk_scale, q1_s, q2_s, k_s, r_s, v_s,
                               ready, empty, WG, ACCUMULATE, BLOCK_N, D1, D2, DV, STAGES)
            it += n_iter

    @gluon.jit(do_not_specialize=["n_m", "num_seqs", "n_tiles"])
    def _hopper_fp8_kernel(
            q_ptr, qs_ptr, k_ptr, r_ptr, vt_ptr, bound_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
            qk_scale, num_heads, keys_pad, n_m, num_seqs, n_tiles, stride_ot, stride_oh,
            stride_lt, stride_lh,
            ACCUMULATE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
            num_warps: gl.constexpr):
        # As the bf16 kernel on a context part: persistent, program p runs tiles p, p + P, ...
        # of the n_tiles (query block, sequence, head) tiles, P at most one per SM; the default
        # partition is consumer warpgroup 0; workers: consumer warpgroup 1 and the producer
        # warp; all three walk the same tiles with the same n_iter and run the ring's
        # iteration count on across them.
        gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 query rows")
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        WM: gl.constexpr = 64
        f8: gl.constexpr = gl.float8e4nv
        q1_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D1], f8)
        q2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D2], f8)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], f8)
        r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], f8)
        v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DV, BLOCK_N], f8)


        q1_s = gl.allocate_shared_memory(f8, [2, WM, D1], q1_sl)
        q2_s = gl.allocate_shared_memory(f8, [2, WM, D2], q2_sl)
        k_s = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, D1], k_sl)
        r_s = gl.allocate_shared_memory(f8, [STAGES, BLOCK_N, D2], r_sl)
        v_s = gl.allocate_shared_memory(f8, [STAGES, DV, BLOCK_N], v_sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()

        gl.warp_specialize([
            (_fp8_consumer, (q_ptr, qs_ptr, bound_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                             n_m, num_seqs, n_tiles, num_heads, stride_ot, stride_oh,
                             stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready,
                             empty, 0, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES)),
            (_fp8_consumer, (q_ptr, qs_ptr, bound_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
                             n_m, num_seqs, n_tiles, num_heads, stride_ot, stride_oh,
                             stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s, r_s, v_s, ready,
                             empty, 1, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES)),
            (_fp8_producer, (k_ptr, r_ptr, vt_ptr, cu_q_ptr, cu_k_ptr, n_m, num_seqs, n_tiles,
                             num_heads, keys_pad, k_s, r_s, v_s, ready, empty, BLOCK_M,
                             BLOCK_N, D1, D2, DV, STAGES)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def unsupported_reason(q8: torch.Tensor, k8: torch.Tensor, p8: torch.Tensor,
                       vt8: torch.Tensor, out: torch.Tensor) -> str | None:
    """None if :func:`hopper_fp8_attention` runs these (already validated) tensors, else why."""
    if not HAS_GLUON:
        return "needs Triton's Gluon (Triton >= 3.5)"
    if os.environ.get(_bf16.DISABLE_ENV) == "1":
        return f"disabled ({_bf16.DISABLE_ENV}=1)"
    if q8.device.type != "cuda" or not _bf16.available(q8.device):
        return "needs an sm_90 GPU (Hopper)"
    if (k8.shape[2], p8.shape[1], vt8.shape[1]) != (_D1, _D2, _DV):
        return (f"needs MLA's head dims (nope {_D1}, rope {_D2}, v {_DV}), got "
                f"({k8.shape[2]}, {p8.shape[1]}, {vt8.shape[1]})")
    if not (k8.is_contiguous() and p8.is_contiguous() and vt8.is_contiguous()):
        return "needs contiguous k8, p8 and vt8 (FP8Context's own layout)"
    if any(t.data_ptr() % 16 for t in (q8, k8, p8, vt8)) or out.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        return "needs 16-byte aligned tensors and a float output"
    return None


def hopper_fp8_attention(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor,
                         p8: torch.Tensor, vt8: torch.Tensor, bound: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                         max_seqlen_q: int, softmax_scale: float, out: torch.Tensor,
                         lse: torch.Tensor, accumulate: bool, block_n: int = BLOCK_N,
                         stages: int = STAGES) -> bool:
    """One launch of the Gluon FP8 kernel into ``out`` / ``lse`` (overwritten, or merged into
    with ``accumulate``); the caller (:func:`~mlaprefill.kernels.fp8_attention.
    fp8_context_attention`) has validated the arguments and checked
    :func:`unsupported_reason`. Returns False, launching nothing, when this (out dtype,
    accumulate, block_n, stages) failed to compile here before: the caller then runs the Triton
    kernel."""
    key = (out.dtype, accumulate, block_n, stages)
    if key in _FAILED:
        return False
    num_seqs = cu_seqlens_q.shape[0] - 1
    h = q8.shape[1]
    n_m = cdiv(max_seqlen_q, 128)
    n_tiles = n_m * num_seqs * h
    grid = (max(1, min(n_tiles, _bf16._num_sms(q8.device))),)  # persistent
    ensure_allocator()
    try:
        _hopper_fp8_kernel[grid](
            q8, q_scale, k8, p8, vt8, bound, out, lse, cu_seqlens_q, cu_seqlens_k,
            softmax_scale * 1.4426950408889634, h, vt8.shape[2], n_m, num_seqs, n_tiles,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), ACCUMULATE=accumulate,
            BLOCK_M=128, BLOCK_N=block_n, D1=_D1, D2=_D2, DV=_DV, STAGES=stages, num_warps=4,
            maxnreg=_bf16._MAXNREG)
    except torch.OutOfMemoryError:  # its descriptor scratch: the caller's problem, not a build's
        raise
    except Exception as exc:  # this Triton / toolchain cannot build it: the Triton kernel runs
        _FAILED[key] = f"{type(exc).__name__}: {exc}"[:500]
        return False
    return True


def failures() -> dict[tuple, str]:
    """The configurations whose compile failed in this process, and why (benchmarks print it)."""
    return dict(_FAILED)
