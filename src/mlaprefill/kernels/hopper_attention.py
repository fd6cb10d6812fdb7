"""Warp-specialized attention for Hopper (sm_90), written in Gluon: the default kernel of
:func:`mlaprefill.kernels.attention.varlen_attention` where it applies.

Same contract as the Triton kernel it stands in for (packed varlen sequences, natural-log LSE,
top-left causal, ``dense=`` rectangles left to another kernel, ``state=`` merged in the epilogue,
split keys with a rope row shared by the heads or joined keys), for MLA's head dims only: qk 192
read as 128 + 64, v 128, bf16 or fp16, every K / rope / V base and row / head stride 16-byte
aligned (TMA). :func:`unsupported_reason` says why a call does not qualify; ``varlen_attention``
then runs the Triton kernel.

Why a second kernel: Triton 3.6 compiles the Triton kernel FA2-style on Hopper. Each wgmma group
is waited for before the softmax, so a warpgroup never overlaps its softmax with its own MMAs,
and the CTA's two warpgroups run in lockstep. Reordering the source does not change that, and
``warp_specialize=True`` compiles the identical binary (attention_variants_h200.json). Here the
key loop is laid out by hand, FlashAttention-3 style:

* one producer warp (24 registers after ``setmaxnreg``) loads each key block by TMA, its K and
  rope into one ``STAGES``-deep ring of shared buffers and its V into another, arming a "ready"
  mbarrier per stage, and refills a stage only after an "empty" mbarrier says both consumers
  are done with it (K and rope after the block's scores, V after its PV product);
* two consumer warpgroups (240 registers each; one in the 64-row form below), 64 query rows
  apiece, each with its own Q buffer and running max, sum and output, waiting only on those
  mbarriers: nothing keeps them in step, so one's softmax runs while the other's wgmma do
  (ping-pong left to the scheduler);
* within a warpgroup the key loop is software-pipelined (FA3's intra-warpgroup overlap): block
  i's scores S = Q1 K^T + Q2 R^T are issued (two wgmma groups), then block i - 1's O += P V
  behind them, and the online softmax of block i (exp2 domain, the scale applied to fp32
  scores, safe max) runs as soon as the scores are done, while that PV product is still in
  flight; then O is rescaled and P kept in registers for the next iteration.

A tile's first key block runs its softmax masked (in the 128-row forms only where some of its
rows do not see that block whole), then come unmasked blocks, then the masked ones (the tail, the
causal diagonal), scores set to ``-inf`` with ``where``. Keys are read by TMA:
in the persistent form through descriptors over the whole K / rope / V tensors, made once per
program, so a sequence's last, partial block also reads rows of the next one; their scores are
masked, and the producer sets their V rows to 0 in shared memory before it marks the block
ready (0 * NaN would be NaN in the PV product), so a NaN stays in its sequence. One program per
tile makes descriptors over exactly its
sequence's rows instead (zeros past them). Finish: the Triton kernel's rules
(NaN where the sum is 0 or the LSE would be ``+inf``; ``out = 0, lse = -inf`` without keys; with
``state``, the merge of :mod:`mlaprefill.kernels.merge`, rows without keys untouched).

Every call runs persistent (one program per SM walks the tiles, the rings' iteration count running
on across them, so a tile's first loads overlap the previous one's epilogue); a causal part of more
than ``CAUSAL_PERSISTENT_MAX_BLOCKS`` query blocks per sequence (by default none) would run one
program per tile, heaviest first. In the persistent form each partition loads its next tile's
sequence bounds (``cu_seqlens`` entries) before running this one. A causal part walks its query
blocks in pairs of equal cost (the heaviest with the lightest), each program alternating between a
pair's halves, so every program gets the same work (a plain round robin gave half the programs only
heavy blocks), and its consumers load each tile's Q by TMA while the previous tile finishes
(context parts keep a plain load at each tile's start: the prefetch cost them 1-5 %). A/B under
graphs against the kernel before, cuDNN in the same run, outputs bitwise equal: 256-query causal
parts 1.39-1.44x -> 1.11-1.16x cuDNN's time, 250 queries 1.41x -> 1.16x, 128 queries at 64
sequences 1.11x -> 1.08x, the rest unchanged (fp8_attention_pairs_h200.json: the vs-ideal set at
this code). In the same probe every causal part run persistent (balanced now) was faster still:
1000-1024 queries 1.16x -> 1.00-1.12x, 4096 0.94-0.97x -> 0.85-0.92x, so every causal part runs
persistent now (``CAUSAL_PERSISTENT_MAX_BLOCKS``; one program per tile remains, for the tests'
comparison).

Measured on the H200 under CUDA graphs, cuDNN in the same run (benchmarks/results/
fp8_attention_ideal_h200.json, then fp8_attention_persistent_h200.json with this code; the
context kernel is the same binary in both, so their spread is run-to-run): 0.85-0.93x and
0.82-0.94x cuDNN's time on the context parts of the 12 vs-ideal shapes (562-667 TFLOP/s),
0.93-0.98x on 4096-query causal parts, but 1.16-1.60x on short causal ones (250-1024 queries
per request, 107-340 TFLOP/s). Whole-tensor descriptors in the persistent form (instead of three
made per tile, each after the previous tile's copies landed) then gave, in an A/B under graphs
with cuDNN in the same run: 256-query causal parts 1.49-1.58x -> 1.45-1.49x cuDNN's time (16 and
128 heads), 250 and 128 queries unchanged (1.45-1.47x, 1.23-1.24x), context parts unchanged.
The consumers zeroed those V rows at first; the branch before their last PV product cost them
44 bytes of register spills. The producer zeroes them now (it waits for that block's V itself,
then completes the "ready" barrier with a plain arrive), and in an A/B under graphs with cuDNN in
the same run: 256-query causal parts 1.47-1.52x -> 1.43-1.47x cuDNN's time, 250 queries 1.48x ->
1.42x, 200 queries at 128 heads 1.73x -> 1.59x, 77 and 128 queries at 64 sequences 1.23-1.25x
-> 1.09-1.19x, outputs bitwise equal, longer and context parts unchanged
(fp8_attention_vzero_h200.json: the vs-ideal set at this code).
Causal parts of at most ``CAUSAL_NARROW_MAX_BLOCKS`` query blocks per sequence (1024 queries) read
keys in blocks of 64, with a 4-deep ring in the same shared memory: the warpgroup running a query
block's lower 64 rows then sees none of the diagonal's second half, so it skips that block
(releasing its ring stage unread) and a quarter of the diagonal's products go (A/B in that
constant's comment: 1000-1024-query causal parts 1.12-1.14x -> 1.00-1.02x cuDNN's time at 128
heads). Longer causal parts keep 128-key blocks: at 4096 queries the narrow form was 2-5 % slower.
Warpgroup 0 ran the lower rows at first, fewer iterations than warpgroup 1 on every tile, so the two
swap halves on a pair's light tile (_half): 256-query causal parts 1.05x -> 1.03x cuDNN's time at
128 heads, 1.12x -> 1.09x at 16 (A/B under graphs, same run, outputs bitwise equal).
Causal parts of at most ``CAUSAL_SINGLE_MAX_BLOCKS`` 128-query blocks (256 queries) run 64-row
programs instead, one consumer warpgroup each (128 registers per thread), two to an SM: their few
iterations per tile left the loads' latencies exposed with one program per SM (256-query causal
parts 1.02-1.08x -> 0.89-0.98x cuDNN's time; the constant's comment). They run persistent only:
one 64-row program per tile left NaN in a few rows' outputs (H200, cause not found), so the
one-program-per-tile comparison form runs those parts with 128 rows and 64-key blocks.

A context part deals equal tiles to the persistent programs round by round, so a tile count
just past a multiple of the SM count leaves most SMs idle in the last round (4096 tiles on 132
SMs: 31 rounds and 4 tiles, 3.1 % over an even split). Where it pays (``_split_plan``), that
round's tiles run as parts of their keys spread over the programs (work units past the whole
tiles: ``_unit_tile``, ``_chunk``), each storing its rows' fp32 output and LSE in a workspace,
and one small Triton kernel merges them by LSE into ``out`` / ``lse`` (``_merge_tail_kernel``,
the rules of :mod:`mlaprefill.kernels.merge`; merged into the state with ``state=``).

Causal forms read Q from registers for the scores (``Q_REG`` in _consumer_tile: 128-head
1000-1024-query causal parts 1.00-1.02x -> 0.96-0.99x cuDNN's time on an H100); context parts,
slower so, keep it in shared memory.

It compiles once per (dtype, causal, accumulate) and form, every causal form a length can select
at the first causal call, a context part's form with and without the split last round at the
first call that needs each; lengths come from ``cu_seqlens``.
"""

from __future__ import annotations

import os

import torch

from mlaprefill.kernels._triton import HAS_TRITON, cdiv, ensure_allocator, tl, triton
from mlaprefill.kernels.merge import merge_rows

__all__ = ["BLOCK_M", "BLOCK_N", "DISABLE_ENV", "HAS_GLUON", "STAGES", "available",
           "hopper_attention", "layout_reason", "num_compiled_kernels", "unsupported_reason"]

#: The one debug override of the library (docs/DESIGN.md, "Debug override"): with this
#: environment variable set to ``1``, :func:`~mlaprefill.kernels.attention.varlen_attention` runs
#: the Triton kernel where this one would run (an A/B switch for benchmarks and bug reports; read
#: at each call, so it can be flipped between runs of one process).
DISABLE_ENV = "MLAPREFILL_DISABLE_HOPPER_KERNEL"
#: Query rows per program (two consumer warpgroups of 64) and keys per block: 128 x 128 tiles
#: with a 2-stage ring measured fastest of 128 x 64 (3 and 4 stages) and 128 x 128 (2).
BLOCK_M, BLOCK_N, STAGES = 128, 128, 2
_D1, _D2, _DV = 128, 64, 128  # the key's first part, its rope part, the value
_LOG2E = 1.4426950408889634
# registers per thread: launched with _MAXNREG over 12 warps (4 + 4 + the producer warp padded
# to a warpgroup: 12 * 32 * 168 <= 64 Ki); setmaxnreg then gives the producer warpgroup 24 and
# each consumer warpgroup 240 (24 + 2 * 240 = 3 * 168)
_MAXNREG = 168
# the one-consumer form (64-row programs, _SINGLE): 8 warps (4 + the producer's padded), two
# programs to an SM (2 * 8 * 32 * 128 = 64 Ki); the producer 24, the consumer 232 (2 * 128 - 24)
_MAXNREG_SINGLE = 128

try:  # Gluon (Triton >= 3.5); its Hopper API as of Triton 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    HAS_GLUON = HAS_TRITON
except (ImportError, AttributeError):  # no Triton, or a Triton without this Gluon API
    HAS_GLUON = False

# (dtype, causal, accumulate) whose compile failed here: the Triton kernel runs them instead
_FAILED: dict[tuple, str] = {}
# CUDA device index -> whether it is an sm_90 GPU (asked once: unsupported_reason runs per call)
_SM90: dict[int, bool] = {}
# CUDA device index -> its multiprocessor count (the persistent grid's size)
_SMS: dict[int, int] = {}
# (dtype, accumulate, device index) whose causal kernel was built in both forms (persistent and
# one program per tile), so that a causal call of another length compiles nothing later
_CAUSAL_BUILT: set[tuple] = set()
#: Causal parts with at most this many query blocks per sequence run persistent (every one, by
#: default); longer ones would run one program per tile, heaviest first (0: every causal part so,
#: which the GPU tests compare bit for bit). Persistent with a plain round robin, parts of more
#: than 2 blocks ran 2-12 % slower than one program per tile; with the balanced pairs of
#: _decode, faster at every length (A/B under graphs, cuDNN in the same run: 1000-1024 queries
#: 1.16x -> 1.00-1.12x cuDNN's time, 4096 0.94-0.97x -> 0.85-0.92x).
CAUSAL_PERSISTENT_MAX_BLOCKS = 1 << 30
#: Causal parts with at most this many query blocks per sequence (1024 queries) read keys in blocks
#: of 64 with a 4-deep ring (the same shared memory): the consumer warpgroup running a query block's
#: lower half (_half) then skips the diagonal's second half, masked whole for its rows
#: (_consumer_tile's n_mine), a quarter of the diagonal's products. Longer ones keep 128-key blocks
#: (BLOCK_N, STAGES), whose larger products the diagonal's share no longer outweighs. A/B under
#: graphs, cuDNN in the same run: 1000-1024-query causal parts 1.12-1.14x -> 1.00-1.02x cuDNN's time
#: at 128 heads and 1.01x -> 0.93x at 16, 256 queries 1.15x -> 1.09x (128 heads) and 1.13-1.15x ->
#: 1.11-1.13x (16), 128 queries at 64 sequences 1.09x -> 1.01x; but 4096 queries 0.96x -> 1.01x and
#: 0.85x -> 0.87x.
CAUSAL_NARROW_MAX_BLOCKS = 8
#: O stored by TMA from a staging buffer per consumer (room made by a 3-deep ring; commit 56485b4,
#: tile_ab_otma_h200.json, tile_ab_mask0_h100.json) measured 1-2 % faster at 1000-1024 queries
#: but 1.5-3.5 % slower at 512-600 (16 and 128 heads, H200 and H100), so it was taken out again.
_NARROW = (64, 4)  # (keys per block, ring stages) of the causal parts above
#: Causal parts with at most this many 128-query blocks per sequence (256 queries) run 64-row
#: programs (one consumer warpgroup, 64-key blocks, a 2-stage ring: 112 KiB of shared memory), two
#: to an SM, so that each SM has two tiles' loads in flight; a row's arithmetic is the 128-row
#: 64-key form's, outputs bitwise equal. A/B under graphs, cuDNN in the same run: 256-query causal
#: parts 1.02-1.05x -> 0.98x cuDNN's time at 128 heads, 1.07-1.08x -> 0.89-0.90x at 16, 250
#: queries 1.07-1.09x -> 0.87x (16 heads), longer parts unchanged; with the cut at 8 blocks,
#: 1000-1024 queries 1.06-1.11x instead of about 1.0x, at 32 blocks 4096 queries up to 1.09x.
CAUSAL_SINGLE_MAX_BLOCKS = 2
_SINGLE = (64, 64, 2)  # (query rows, keys per block, ring stages) of the causal parts above
# a query-block count no sequence reaches (cu_seqlens are int32): thresholds at or past it are
# never crossed, so the forms beyond them are not built ahead
_MAX_BLOCKS = 1 << 24

if HAS_GLUON:
    _CONSUMER_REGS = gl.constexpr(240)
    _PRODUCER_REGS = gl.constexpr(24)

    @gluon.jit
    def _producer_tile(m_block, seq, head, valid, w, split, it0, k_ptr, r_ptr, v_ptr, qa, qb,
                       ka, kb, dense, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt,
                       stride_vh, k_s, r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, kd, rd,
                       vd, v_land, n_land, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                       BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr,
                       DV: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr):
        # One warp, one tile (_decode's m_block, seq, head, valid; _tile), or with SPLIT its
        # part of work unit w's keys (_chunk); returns its
        # iteration count and n_land (below). Its
        # iteration i is the
        # ring's iteration g = it0 + i (the count runs on across the program's tiles) and
        # loads key block b_lo + i: its K and rope
        # into stage g % STAGES of one ring, its V into the same stage of another, round
        # g // STAGES. Two rings
        # because a consumer is done with a block's K and rope after its scores, and with its V
        # only after the next block's scores (the PV product is issued behind them).
        # mbarrier.wait(bar, parity) returns once the phase of that parity has completed (a
        # fresh barrier counts as having completed parity 1):
        #   *_empty[st] (count 2: one arrive per consumer warpgroup) completes phase r - 1 when
        #   both consumers are done with iteration i - STAGES; round 0 waits parity 1 and passes
        #   (the ring starts empty), round r waits parity (r - 1) & 1.
        #   *_ready[st] (count 1 + the TMA bytes) completes phase r when iteration i's copies
        #   land; the consumers wait parity r & 1.
        # Neither runs two phases ahead of a waiter: a stage is refilled only after both
        # consumers released it, and released only after it was filled. All three partitions
        # walk the same tiles with the same n_iter, so every wait has its arrivals.
        _qs, _nq, _m0, k_start, seqlen_k, kv_end, b_lo, n_iter = _tile(
            m_block, seq, valid, qa, qb, ka, kb, dense, CAUSAL, PERSISTENT, BLOCK_M, BLOCK_N)
        if SPLIT:
            b_lo, n_iter = _chunk(b_lo, n_iter, w, split)
        esize: gl.constexpr = k_s.dtype.primitive_bitwidth // 8
        kr_bytes: gl.constexpr = BLOCK_N * (D1 + D2) * esize
        v_bytes: gl.constexpr = BLOCK_N * DV * esize
        if PERSISTENT:
            # K, rope and V through the program's whole-tensor descriptors (kd, rd, vd: made
            # once, no per-tile descriptor). A block reaching past kv_end (a tile's last, when
            # kv_end is not a multiple of BLOCK_N) reads other rows there: the next sequence's
            # (zeros past the tensor). The mask sets their scores to -inf, but 0 * V is NaN
            # where V is not finite, so such a block's V lands on v_land instead: this warp
            # waits for it, sets those rows to 0 and then completes v_ready itself (a plain
            # arrive). n_land counts v_land's uses (its phase) across the program's tiles.
            # Zeroing here keeps the consumers' code free of a branch before their last PV
            # product, which cost them register spills (and ~8 % on short causal parts).
            for i in range(n_iter):
                st = (it0 + i) % STAGES
                phase = (((it0 + i) // STAGES) & 1) ^ 1
                row = k_start + (b_lo + i) * BLOCK_N
                mbarrier.wait(kr_empty.index(st), phase)
                bar = kr_ready.index(st)
                mbarrier.expect(bar, kr_bytes)
                tma.async_copy_global_to_shared(kd, [row, head * stride_kh], bar, k_s.index(st))
                tma.async_copy_global_to_shared(rd, [row, head * stride_rh], bar, r_s.index(st))
                mbarrier.wait(v_empty.index(st), phase)
                keep = kv_end - (b_lo + i) * BLOCK_N  # rows of this block to keep
                if keep < BLOCK_N:
                    mbarrier.expect(v_land, v_bytes)
                    tma.async_copy_global_to_shared(vd, [row, head * stride_vh], v_land,
                                                    v_s.index(st))
                    mbarrier.wait(v_land, n_land & 1)
                    n_land += 1
                    _zero_rows_from(v_s.index(st), keep, BLOCK_N, DV)
                    fence_async_shared()  # generic-proxy stores before the wgmma read them
                    mbarrier.arrive(v_ready.index(st), count=1)
                else:
                    bar = v_ready.index(st)
                    mbarrier.expect(bar, v_bytes)
                    tma.async_copy_global_to_shared(vd, [row, head * stride_vh], bar,
                                                    v_s.index(st))
        else:
            # one tile per program: descriptors over exactly the sequence's key rows (at least
            # one: a sequence without keys still gets a well-formed descriptor, and nothing is
            # loaded then), so a block past them reads zeros
            head64 = head.to(gl.int64)
            rows = gl.maximum(seqlen_k, 1)
            k_desc = tma.make_tensor_descriptor(
                k_ptr + k_start.to(gl.int64) * stride_kt + head64 * stride_kh, shape=[rows, D1],
                strides=[stride_kt, 1], block_shape=[BLOCK_N, D1], layout=k_s.type.layout)
            r_desc = tma.make_tensor_descriptor(
                r_ptr + k_start.to(gl.int64) * stride_rt + head64 * stride_rh, shape=[rows, D2],
                strides=[stride_rt, 1], block_shape=[BLOCK_N, D2], layout=r_s.type.layout)
            v_desc = tma.make_tensor_descriptor(
                v_ptr + k_start.to(gl.int64) * stride_vt + head64 * stride_vh, shape=[rows, DV],
                strides=[stride_vt, 1], block_shape=[BLOCK_N, DV], layout=v_s.type.layout)
            for i in range(n_iter):
                st = i % STAGES
                phase = ((i // STAGES) & 1) ^ 1
                row = (b_lo + i) * BLOCK_N
                mbarrier.wait(kr_empty.index(st), phase)
                bar = kr_ready.index(st)
                mbarrier.expect(bar, kr_bytes)
                tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_s.index(st))
                tma.async_copy_global_to_shared(r_desc, [row, 0], bar, r_s.index(st))
                mbarrier.wait(v_empty.index(st), phase)
                bar = v_ready.index(st)
                mbarrier.expect(bar, v_bytes)
                tma.async_copy_global_to_shared(v_desc, [row, 0], bar, v_s.index(st))
        return n_iter, n_land

    @gluon.jit
    def _zero_rows_from(v_blk, valid, BLOCK_N: gl.constexpr, DV: gl.constexpr):
        # Rows [valid, BLOCK_N) of a [BLOCK_N, DV] shared block set to 0 by one warp: whole
        # 8-row slices (the swizzle's period, the finest row slice) as stored zeros, the slice
        # holding row valid as a read, select and write of 64-column halves (few registers:
        # the producer has 24).
        ZR: gl.constexpr = 8
        ZC: gl.constexpr = 64
        z_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        for c in gl.static_range(BLOCK_N // ZR):
            if c * ZR >= valid:
                v_blk.slice(c * ZR, ZR, 0).store(gl.zeros([ZR, DV], v_blk.dtype, z_layout))
            elif (c + 1) * ZR > valid:
                rows = c * ZR + gl.arange(0, ZR, layout=gl.SliceLayout(1, z_layout))
                keep = gl.expand_dims(rows < valid, 1)
                for h in gl.static_range(DV // ZC):
                    part = v_blk.slice(c * ZR, ZR, 0).slice(h * ZC, ZC, 1)
                    part.store(gl.where(keep, part.load(z_layout), 0.0).to(v_blk.dtype))

    @gluon.jit
    def _scores(q1_s, q2_s, k_s, r_s, kr_ready, i, s_zero, STAGES: gl.constexpr):
        # S = Q1 K^T + Q2 R^T of iteration i, issued (two wgmma groups), not waited for
        st = i % STAGES
        mbarrier.wait(kr_ready.index(st), (i // STAGES) & 1)
        t = warpgroup_mma(q1_s, k_s.index(st).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        return warpgroup_mma(q2_s, r_s.index(st).permute((1, 0)), t, is_async=True)

    @gluon.jit
    def _values(p, acc, v_s, v_ready, i, STAGES: gl.constexpr):
        # acc + P V of iteration i, issued (one wgmma group), not waited for
        st = i % STAGES
        mbarrier.wait(v_ready.index(st), (i // STAGES) & 1)
        return warpgroup_mma(p, v_s.index(st), acc, is_async=True)

    @gluon.jit
    def _softmax(s, m_i, l_i, block, qk_scale, offs_m, offs_n, kv_end, MASKED: gl.constexpr,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        # The online softmax of one block's scores: (P, alpha, m, l), exp2 domain.
        if MASKED:  # where, not a multiply (0 * NaN)
            cols = block * BLOCK_N + offs_n
            visible = gl.expand_dims(cols < kv_end, 0)
            if CAUSAL:
                visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(offs_m, 1))
            s = gl.where(visible, s, float("-inf"))
        # qk_scale > 0, so max(s) * qk_scale == max(s * qk_scale); the safe max keeps a row
        # that has seen only -inf at m = -inf without exp2(-inf - -inf) = NaN
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _key_blocks(acc, m_i, l_i, p, lo, hi, it0, b_lo, q1_s, q2_s, k_s, r_s, v_s, kr_ready,
                    kr_empty, v_ready, v_empty, s_zero, qk_scale, offs_m, offs_n, kv_end,
                    MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        # Iterations i in [lo, hi) (key block b_lo + i), software-pipelined FA3-style within
        # this warpgroup: on entry p holds iteration i - 1's probabilities and acc is rescaled
        # for them; iteration i issues its scores, then i - 1's PV product behind them, and runs
        # its softmax while that product is in flight. Returns (acc, m, l, p) in the same form.
        for i in range(lo, hi):
            g = it0 + i  # the ring's iteration count: stages and phases run on across tiles
            t = _scores(q1_s, q2_s, k_s, r_s, kr_ready, g, s_zero, STAGES)
            o = _values(p, acc, v_s, v_ready, g - 1, STAGES)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[t])  # the scores, not the PV
            mbarrier.arrive(kr_empty.index(g % STAGES), count=1)
            p_new, alpha, m_i, l_i = _softmax(s, m_i, l_i, b_lo + i, qk_scale, offs_m, offs_n,
                                              kv_end, MASKED, CAUSAL, BLOCK_N)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[o, p])
            mbarrier.arrive(v_empty.index((g - 1) % STAGES), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            p = gl.convert_layout(p_new.to(v_s.dtype), p_layout)
        return acc, m_i, l_i, p

    @gluon.jit
    def _release(kr_empty, v_empty, g, STAGES: gl.constexpr):
        # A consumer's release of ring iteration g that it does not read. Its arrive must not
        # count toward the stage's previous round (g - STAGES), which the other consumer may
        # not have released yet: so it first waits for that round to complete, as the
        # producer does before refilling the stage.
        st = g % STAGES
        phase = ((g // STAGES) & 1) ^ 1
        mbarrier.wait(kr_empty.index(st), phase)
        mbarrier.arrive(kr_empty.index(st), count=1)
        mbarrier.wait(v_empty.index(st), phase)
        mbarrier.arrive(v_empty.index(st), count=1)

    @gluon.jit
    def _store_rows(o, lse, o_ptrs, l_ptrs, io_ok, l_ok, ACCUMULATE: gl.constexpr,
                    dtype: gl.constexpr, o_layout: gl.constexpr, io_layout: gl.constexpr):
        # A consumer's finished rows (o [64, DV] in o_layout, natural-log lse) into out / lse,
        # or with ACCUMULATE merged into what they hold, by kernels.merge's rules: "no keys" is
        # exactly -inf, NaN propagates, a +inf LSE merges to NaN; where(), not a multiply, for
        # a side without keys. Each thread stores only the elements it loaded (same layouts),
        # so no barrier is needed. Shared with the FP8 kernel (hopper_fp8_attention).
        if ACCUMULATE:
            l1 = gl.load(l_ptrs, mask=l_ok, other=float("-inf"))
            o1 = gl.convert_layout(gl.load(o_ptrs, mask=io_ok, other=0.0),
                                   o_layout).to(gl.float32)
            e1 = l1 == float("-inf")
            e2 = lse == float("-inf")
            empty_row = e1 & e2
            mx = gl.where(empty_row, 0.0, gl.maximum(l1, lse))
            w1 = gl.where(e1, 0.0, gl.exp(l1 - mx))
            w2 = gl.where(e2, 0.0, gl.exp(lse - mx))
            s_safe = gl.where(empty_row, 1.0, w1 + w2)
            c1 = gl.expand_dims(w1 / s_safe, 1)
            c2 = gl.expand_dims(w2 / s_safe, 1)
            o = (gl.where(gl.expand_dims(e1, 1), 0.0, o1 * c1)
                 + gl.where(gl.expand_dims(e2, 1), 0.0, o * c2))
            lse = gl.where(empty_row, float("-inf"), mx + gl.log(s_safe))
        gl.store(o_ptrs, gl.convert_layout(o.to(dtype), io_layout), mask=io_ok)
        gl.store(l_ptrs, lse, mask=l_ok)

    @gluon.jit
    def _store_partial(o, lse, slot, row0, split, BLOCK_M: gl.constexpr, DV: gl.constexpr,
                       o_layout: gl.constexpr):
        # A consumer's finished rows (o [64, DV] fp32 in o_layout, natural-log lse) of a work
        # unit's part of its tile's keys into workspace slot ``slot`` (split[2]: [slots,
        # BLOCK_M, DV] fp32 outputs, split[3]: [slots, BLOCK_M] LSEs) at rows row0 + [0, 64),
        # stored from the MMA layout (a few units per program: no layout conversion, whose
        # shared scratch the context form has no room for at fp32)
        rows = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
        base = slot.to(gl.int64) * BLOCK_M
        gl.store(split[2] + (base + gl.expand_dims(rows, 1)) * DV + gl.expand_dims(cols, 0), o)
        gl.store(split[3] + base + rows, lse)

    @gluon.jit
    def _unit_tile(w, split, SPLIT: gl.constexpr):
        # Work unit w's tile. Without SPLIT a unit is a tile. With it, split = (n_main, n_split,
        # workspace outputs, workspace LSEs): units [0, n_main) are tiles run whole, and each
        # later tile n_main + j comes as n_split units n_main + j * n_split + c, part c of its
        # keys (_chunk): the last, partial round of tiles spread over every program.
        t = w
        if SPLIT:
            t = gl.where(w < split[0], w, split[0] + (w - split[0]) // split[1])
        return t

    @gluon.jit
    def _chunk(b_lo, n_iter, w, split):
        # Work unit w's key blocks [b_lo, b_lo + n_iter) when its tile's are [b_lo, b_lo +
        # n_iter) (_unit_tile): all of them for a tile run whole, else part c of n_split,
        # blocks [n_iter * c // n_split, n_iter * (c + 1) // n_split) of them (none when the
        # tile has fewer blocks than parts).
        tail = w >= split[0]
        c = gl.where(tail, (w - split[0]) % split[1], 0)
        parts = gl.where(tail, split[1], 1)
        lo = n_iter * c // parts
        hi = n_iter * (c + 1) // parts
        return b_lo + lo, hi - lo

    @gluon.jit
    def _load_q(qd1, qd2, q_bar, q1w, q2w, t, qa, n_m, num_seqs, num_heads, n_tiles,
                stride_qh, WG: gl.constexpr, BLOCK_M: gl.constexpr, D1: gl.constexpr,
                D2: gl.constexpr):
        # Causal persistent form: this warpgroup's 64 query rows of tile t (qa: its sequence's
        # first query) into its Q buffer by TMA, arriving on q_bar, if t is a tile. Rows past
        # the sequence read the next one's (zeros past the tensor): their scores stay in their
        # rows, which are never stored. Returns t decoded (_decode).
        m_block, seq, head, valid = _decode(t, n_m, num_seqs, num_heads, True, True)
        if valid & (t < n_tiles):
            row = qa + m_block * BLOCK_M + _half(m_block, n_m, WG, True, True, BLOCK_M) * 64
            esize: gl.constexpr = q1w.dtype.primitive_bitwidth // 8
            mbarrier.expect(q_bar, 64 * (D1 + D2) * esize)
            tma.async_copy_global_to_shared(qd1, [row, head * stride_qh], q_bar, q1w)
            tma.async_copy_global_to_shared(qd2, [row, head * stride_qh + D1], q_bar, q2w)
        return m_block, seq, head, valid

    @gluon.jit
    def _consumer_tile(m_block, seq, head, valid, w, split, it0, nq, q_ptr, out_ptr, lse_ptr, qa,
                       qb, ka, kb, dense, t_next, n_m, num_seqs, num_heads, n_tiles, qa_next, qd1,
                       qd2, q_bar,
                       stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                       stride_lh, qk_scale, q1_s, q2_s, k_s, r_s, v_s, kr_ready, kr_empty,
                       v_ready, v_empty, WG: gl.constexpr, CAUSAL: gl.constexpr,
                       PERSISTENT: gl.constexpr, ACCUMULATE: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                       STAGES: gl.constexpr, SPLIT: gl.constexpr):
        # One consumer warpgroup (4 warps), one tile (_decode's m_block, seq, head, valid;
        # _tile): query rows r0 + [0, 64), r0 = m0 + 64 * _half; its ring iterations are
        # it0 + [0, n_iter). With SPLIT, work unit w past the tiles run whole runs its part of
        # its tile's keys (_chunk) and stores its rows' partial result (fp32 output, LSE) in
        # slot w - n_main of the workspace (split), for _merge_tail_kernel; t_next is then the
        # next work unit.
        # Causal persistent, its Q was loaded by _load_q (nq: the Q loads this warpgroup waited
        # for so far, q_bar's phase), and it loads the next tile's (t_next, whose sequence
        # starts at query qa_next) once its scores are done, so that load's latency hides
        # behind this tile's last PV product and epilogue. Returns (n_iter, nq) and t_next
        # decoded (_decode), for the next call: decoded after the key loop, not before, so that
        # those values are not live through it (they cost the loop register spills).
        q_start, seqlen_q, m0, _ks, seqlen_k, kv_end, b_lo, n_iter = _tile(
            m_block, seq, valid, qa, qb, ka, kb, dense, CAUSAL, PERSISTENT, BLOCK_M, BLOCK_N)
        if SPLIT:
            b_lo, n_iter = _chunk(b_lo, n_iter, w, split)
        WM: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = out_ptr.dtype.element_ty
        r0 = m0 + _half(m_block, n_m, WG, CAUSAL, PERSISTENT, BLOCK_M) * WM
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
        q1w = q1_s.index(WG)
        q2w = q2_s.index(WG)
        Q_TMA: gl.constexpr = CAUSAL and PERSISTENT
        # Causal forms hold Q in registers (48 per thread) as the scores' A operand, read once
        # per tile from its buffer: from shared memory, a wgmma with 64-key blocks reads as many
        # bytes of Q as of K, at the SM's shared-memory rate. A/B under graphs, cuDNN in the same
        # run, outputs bitwise equal (tile_ab_qreg_h100.json, H100): 128 heads 4 x 1024 causal
        # 1.00-1.02x -> 0.96-0.97x cuDNN's time, 4 x 1000 1.00-1.01x -> 0.97-0.99x, 8 x 512
        # 1.03x -> 1.00-1.01x, 16 x 256 1.06-1.08x -> 1.02-1.04x, 1 x 4096 (128-key blocks)
        # 0.92-0.94x -> 0.91x, 16 heads 4 x 1024 0.90-0.92x -> 0.88-0.90x, 8 x 600 1.06-1.08x
        # both; a context part (16 heads 4 x 1024 over 32768) 0.88-0.91x -> 1.01-1.04x, so
        # context parts keep Q in shared memory.
        Q_REG: gl.constexpr = CAUSAL
        if Q_TMA:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if valid:  # _load_q issued this tile's Q (before the loop or in the previous tile)
                mbarrier.wait(q_bar, nq & 1)
                nq += 1
        if n_iter > 0:
            if not Q_TMA:
                # this warpgroup's queries into its Q buffer (rows past the sequence read 0
                # and are never stored)
                q_base = q_ptr + (q_start + r0).to(gl.int64) * stride_qt + head64 * stride_qh
                q_rows = gl.expand_dims(io_rows, 1) * stride_qt
                q1 = gl.load(q_base + q_rows + gl.expand_dims(
                    gl.arange(0, D1, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok,
                    other=0.0)
                q2 = gl.load(q_base + q_rows + D1 + gl.expand_dims(
                    gl.arange(0, D2, layout=gl.SliceLayout(0, io_layout)), 0), mask=io_ok,
                    other=0.0)
                q1w.store(q1)
                q2w.store(q2)
                fence_async_shared()  # generic-proxy stores before the wgmma read them
                gl.thread_barrier()  # this partition's warps only

            if Q_REG:  # Q as the scores' A operand from registers (Q_REG above)
                qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout,
                                                              k_width=2)
                q1 = q1w.load(qa_layout)
                q2 = q2w.load(qa_layout)
            else:
                q1 = q1w
                q2 = q2w
            offs_m = r0 + gl.arange(0, WM, layout=gl.SliceLayout(1, s_layout))
            offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s_zero = gl.zeros([WM, BLOCK_N], gl.float32, s_layout)
            m_i = gl.full([WM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([WM], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([WM, DV], gl.float32, o_layout)
            if CAUSAL:
                # this warpgroup's rows end at r0 + 64: its last blocks past them (the lower
                # half's last when BLOCK_N = 64) are masked whole, so it runs n_mine < n_iter
                # iterations and only releases the rest (below); its first row r0 sees keys
                # [0, r0] whole
                n_mine = gl.maximum(gl.minimum(
                    gl.cdiv(gl.minimum(kv_end, r0 + WM), BLOCK_N) - b_lo, n_iter), 1)
                n_free = gl.minimum(seqlen_k, r0 + 1) // BLOCK_N  # blocks its rows see whole
            else:
                n_mine = n_iter
                n_free = seqlen_k // BLOCK_N
            # iteration 0 (masked, in the 128-row forms only where some row does not see its
            # block whole), then [1, free) without a mask (blocks below n_free, every row sees
            # them whole), then the masked rest; the last iteration's PV product after the loop.
            # (The 64-row form ran 1-1.5 % slower with its first block unmasked: H100 A/B.)
            t = _scores(q1, q2, k_s, r_s, kr_ready, it0, s_zero, STAGES)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            mbarrier.arrive(kr_empty.index(it0 % STAGES), count=1)
            if BLOCK_M == 128 and b_lo < n_free:
                p, _, m_i, l_i = _softmax(s, m_i, l_i, b_lo, qk_scale, offs_m, offs_n, kv_end,
                                          False, CAUSAL, BLOCK_N)
            else:
                p, _, m_i, l_i = _softmax(s, m_i, l_i, b_lo, qk_scale, offs_m, offs_n, kv_end,
                                          True, CAUSAL, BLOCK_N)
            p = gl.convert_layout(p.to(dtype), p_layout)
            free = gl.minimum(gl.maximum(n_free - b_lo, 1), n_mine)
            acc, m_i, l_i, p = _key_blocks(acc, m_i, l_i, p, 1, free, it0, b_lo, q1, q2, k_s,
                                           r_s, v_s, kr_ready, kr_empty, v_ready, v_empty,
                                           s_zero, qk_scale, offs_m, offs_n, kv_end, False,
                                           CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)
            acc, m_i, l_i, p = _key_blocks(acc, m_i, l_i, p, free, n_mine, it0, b_lo, q1, q2,
                                           k_s, r_s, v_s, kr_ready, kr_empty, v_ready, v_empty,
                                           s_zero, qk_scale, offs_m, offs_n, kv_end, True,
                                           CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)
            if Q_TMA:  # every warp's scores are done: the Q buffer takes the next tile's
                gl.thread_barrier()
                nmb, nseq, nhead, nvalid = _load_q(qd1, qd2, q_bar, q1w, q2w, t_next, qa_next,
                                                   n_m, num_seqs, num_heads, n_tiles, stride_qh,
                                                   WG, BLOCK_M, D1, D2)
            g_last = it0 + n_mine - 1
            o = _values(p, acc, v_s, v_ready, g_last, STAGES)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[o, p])
            mbarrier.arrive(v_empty.index(g_last % STAGES), count=1)
            if CAUSAL:  # the iterations this warpgroup skips: released without reading
                for i in range(n_mine, n_iter):
                    _release(kr_empty, v_empty, it0 + i, STAGES)
            # A row with keys has l >= 1 for finite inputs; l == 0 or an LSE of +inf only come
            # from non-finite ones: NaN (flag_inf_lse_as_nan's rule). A NaN l gives NaN anyway.
            l_o = gl.convert_layout(l_i, row_o)
            lse2 = gl.convert_layout(m_i, row_o) + gl.log2(l_o)
            bad = (l_o == 0.0) | (lse2 == float("inf"))
            o = acc * gl.expand_dims(1.0 / l_o, 1)
            o = gl.where(gl.expand_dims(bad, 1), float("nan"), o)
            lse = gl.where(bad, float("nan"), lse2 * 0.6931471805599453)  # natural log
            if SPLIT and w >= split[0]:  # a part of a split tile: into the workspace
                _store_partial(o, lse, w - split[0], r0 - m0, split, BLOCK_M, DV, o_layout)
            else:
                _store_rows(o, lse, o_ptrs, l_ptrs, io_ok, l_ok, ACCUMULATE, dtype, o_layout,
                            io_layout)
        else:
            if Q_TMA:  # this tile's Q (if any) went unused: the buffer is free
                nmb, nseq, nhead, nvalid = _load_q(qd1, qd2, q_bar, q1w, q2w, t_next, qa_next,
                                                   n_m, num_seqs, num_heads, n_tiles, stride_qh,
                                                   WG, BLOCK_M, D1, D2)
            if SPLIT and w >= split[0]:  # a part without keys: "no keys" for the merge
                gl.store(split[3] + (w - split[0]).to(gl.int64) * BLOCK_M + r0 - m0
                         + gl.arange(0, WM, layout=row_o),
                         gl.full([WM], float("-inf"), gl.float32, row_o))
            elif not ACCUMULATE and valid:  # no key: out = 0, lse = -inf (merging: no write)
                gl.store(o_ptrs, gl.zeros([WM, DV], dtype, io_layout), mask=io_ok)
                gl.store(l_ptrs, gl.full([WM], float("-inf"), gl.float32, row_o), mask=l_ok)
        if not Q_TMA:
            nmb, nseq, nhead, nvalid = _decode(_unit_tile(t_next, split, SPLIT), n_m, num_seqs,
                                               num_heads, CAUSAL, PERSISTENT)
        return n_iter, nq, nmb, nseq, nhead, nvalid

    @gluon.jit
    def _half(m_block, n_m, WG: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
              BLOCK_M: gl.constexpr):
        # Which 64-row half of query block m_block consumer warpgroup WG runs. Causal with
        # 64-key blocks, the lower half's rows skip the diagonal's second half: a warpgroup
        # always running the lower half would run fewer iterations per tile than the other
        # (4 + 2 against 3 + 1 for a 256-query pair, 18 against 16 per pair at 1024) and then
        # idle on the ring while the other ran alone. Persistent, a program runs a pair's heavy
        # and light halves in turn (_decode), so the warpgroups swap halves on the light one
        # (the block before the middle) and run the same count per pair.
        half = WG
        if CAUSAL and PERSISTENT and BLOCK_M == 128:
            half = WG ^ (2 * m_block < n_m - 1).to(gl.int32)
        return half

    @gluon.jit
    def _decode(t, n_m, num_seqs, num_heads, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
        # Tile t's (query block, sequence, head) and whether it is a tile at all.
        # Query blocks fastest (the programs running at once share one head's keys in L2), then
        # heads, the sequence slowest: the programs running at once read neighbouring heads of
        # the same key rows (a row holds every head's K and V), not one head of many sequences.
        # A/B under graphs, cuDNN in the same run, 4 rounds on an H100, outputs bitwise equal
        # (tile_ab_seqslow_h100.json): 128 heads 16 x 256 causal 1.01-1.02x -> 0.95-0.97x
        # cuDNN's time, the rest within their spread; and 4096 queries over 131072 keys (one
        # sequence: the same tiles in the same order, the binary differs) 0.95-0.97x ->
        # 0.90-0.91x, not explained (its L2 hit rate under ncu was 58 % before, against 91 % over
        # 32768 keys). A causal part: heaviest (last) query block first. Persistent, the blocks
        # come in pairs of equal total cost (block n_m - 1 - j then j: n_m + 1 key blocks) and
        # program p's rounds alternate between a pair's heavy and light half, round 2r + h
        # being half h of pair unit r * P + p (P programs), so a static round robin gives every
        # program the same work: plain round robin gave program p only block n_m - 1 - p % n_m
        # when P % n_m == 0, so half the programs did twice the work of the other half at 256
        # queries (A/B under graphs, cuDNN in the same run: 256-query causal parts 1.39-1.40x
        # -> 1.12-1.18x cuDNN's time, 250 queries 1.35x -> 1.15x). The odd middle block's
        # second half, and units past the last, are no tile. With one query block (n_m = 1)
        # every tile costs the same and rounds are not doubled: a unit per round. The modulo
        # keeps seq in bounds past the last tile (its cu_seqlens entries are loaded).
        if CAUSAL and PERSISTENT:
            progs = gl.num_programs(0)
            paired = (n_m > 1).to(gl.int32)  # rounds per unit: 1 << paired
            rnd = t // progs
            u = (rnd >> paired) * progs + t % progs
            n_pairs = (n_m + 1) // 2
            j = u % n_pairs
            head = (u // n_pairs) % num_heads
            seq = (u // (n_pairs * num_heads)) % num_seqs
            heavy = (rnd & paired) == 0
            m_block = gl.where(heavy, n_m - 1 - j, j)
            valid = (u < n_pairs * num_heads * num_seqs) & (heavy | (n_m - 1 - j != j))
        else:
            mi = t % n_m
            head = (t // n_m) % num_heads
            seq = (t // (n_m * num_heads)) % num_seqs
            m_block = n_m - 1 - mi if CAUSAL else mi
            valid = t < n_m * num_heads * num_seqs  # true for t < n_tiles: the loops stop there
        return m_block, seq, head, valid

    @gluon.jit
    def _tile_bounds(seq, cu_q_ptr, cu_k_ptr):
        # A tile's sequence's cu_seqlens entries (q start, q end, k start, k end), for _tile.
        # The persistent loops decode their next tile and load its bounds before running this
        # one, so the loads' latency hides behind a tile's work instead of starting each tile
        # (an A/B under graphs, same run: 250 and 128 queries per sequence 1.44x -> 1.36x and
        # 1.19x -> 1.11x cuDNN's time, 256 1.43-1.49x -> 1.41-1.49x, the rest unchanged; the
        # vs-ideal set run after, fp8_attention_bounds_h200.json, against the one before:
        # 256-query causal parts at 16 heads 1.44-1.45x -> 1.39-1.40x, 250 1.41x both times). The
        # decoded tile is passed on to the next iteration: the producer decodes each tile once,
        # a consumer twice (the next tile's sequence before its key loop, the whole tile after
        # it: _consumer_tile). _decode's modulo keeps a tile past n_tiles in bounds.
        return (gl.load(cu_q_ptr + seq), gl.load(cu_q_ptr + seq + 1), gl.load(cu_k_ptr + seq),
                gl.load(cu_k_ptr + seq + 1))

    @gluon.jit
    def _tile(m_block, seq, valid, qa, qb, ka, kb, dense, CAUSAL: gl.constexpr,
              PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        # A tile (_decode's m_block, seq, valid), its sequence's bounds qa, qb, ka, kb from
        # _tile_bounds. Returns where its rows and keys are and its key-block count (0 for no
        # tile).
        q_start = qa
        seqlen_q = qb - qa
        m0 = m_block * BLOCK_M
        k_start = ka
        seqlen_k = kb - ka
        kv_end = gl.minimum(seqlen_k, m0 + BLOCK_M) if CAUSAL else seqlen_k
        # keys [0, k_lo) of this block were left to another kernel (a dense rectangle)
        m_end = m0 + BLOCK_M
        k_lo = 0
        for r in gl.static_range(4):
            lo, hi, dq, dk = dense[4 * r], dense[4 * r + 1], dense[4 * r + 2], dense[4 * r + 3]
            k_lo = gl.where((seq >= lo) & (seq < hi) & (m_end <= dq), dk, k_lo)
        b_lo = k_lo // BLOCK_N
        live = (m0 < seqlen_q) & (k_lo < kv_end)
        if CAUSAL and PERSISTENT:
            live = live & valid
        n_iter = gl.where(live, gl.cdiv(kv_end, BLOCK_N) - b_lo, 0)
        return q_start, seqlen_q, m0, k_start, seqlen_k, kv_end, b_lo, n_iter

    @gluon.jit
    def _producer(k_ptr, r_ptr, v_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m, num_seqs, n_tiles,
                  num_keys, num_heads, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt,
                  stride_vh, k_s, r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, v_land,
                  CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                  STAGES: gl.constexpr, SPLIT: gl.constexpr):
        if not PERSISTENT:  # one tile per program; the ring starts at iteration 0 (constants fold)
            mb, seq, head, valid = _decode(gl.program_id(0), n_m, num_seqs, num_heads, CAUSAL,
                                           PERSISTENT)
            qa, qb, ka, kb = _tile_bounds(seq, cu_q_ptr, cu_k_ptr)
            _producer_tile(mb, seq, head, valid, 0, split, 0, k_ptr, r_ptr, v_ptr, qa, qb, ka,
                           kb, dense, stride_kt, stride_kh, stride_rt,
                           stride_rh, stride_vt, stride_vh, k_s, r_s, v_s, kr_ready, kr_empty,
                           v_ready, v_empty, 0, 0, 0, v_land, 0, CAUSAL, PERSISTENT, BLOCK_M,
                           BLOCK_N, D1, D2, DV, STAGES, False)
        else:
            # K, rope and V as [num_keys, every head's columns] matrices, a block at column
            # head * stride_h: made once per program (the one-tile form makes its own, per
            # sequence)
            kd = tma.make_tensor_descriptor(
                k_ptr, shape=[num_keys, (num_heads - 1) * stride_kh + D1],
                strides=[stride_kt, 1], block_shape=[BLOCK_N, D1], layout=k_s.type.layout)
            rd = tma.make_tensor_descriptor(
                r_ptr, shape=[num_keys, (num_heads - 1) * stride_rh + D2],
                strides=[stride_rt, 1], block_shape=[BLOCK_N, D2], layout=r_s.type.layout)
            vd = tma.make_tensor_descriptor(
                v_ptr, shape=[num_keys, (num_heads - 1) * stride_vh + DV],
                strides=[stride_vt, 1], block_shape=[BLOCK_N, DV], layout=v_s.type.layout)
            it = 0
            n_land = 0
            progs = gl.num_programs(0)
            mb, seq, head, valid = _decode(_unit_tile(gl.program_id(0), split, SPLIT), n_m,
                                           num_seqs, num_heads, CAUSAL, PERSISTENT)
            qa, qb, ka, kb = _tile_bounds(seq, cu_q_ptr, cu_k_ptr)
            # t: a work unit (_unit_tile), n_tiles: their count
            for t in range(gl.program_id(0), n_tiles, progs):
                nmb, nseq, nhead, nvalid = _decode(_unit_tile(t + progs, split, SPLIT), n_m,
                                                   num_seqs, num_heads, CAUSAL, PERSISTENT)
                na, nb, nka, nkb = _tile_bounds(nseq, cu_q_ptr, cu_k_ptr)
                n, n_land = _producer_tile(
                    mb, seq, head, valid, t, split, it, k_ptr, r_ptr, v_ptr, qa, qb, ka, kb,
                    dense, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt, stride_vh, k_s,
                    r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, kd, rd, vd, v_land, n_land,
                    CAUSAL, PERSISTENT, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES, SPLIT)
                it += n
                mb, seq, head, valid = nmb, nseq, nhead, nvalid
                qa, qb, ka, kb = na, nb, nka, nkb

    @gluon.jit
    def _consumer(q_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m, num_seqs,
                  n_tiles,
                  num_queries, num_heads, stride_qt, stride_qh, stride_ot, stride_oh,
                  stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s, r_s, v_s, kr_ready,
                  kr_empty, v_ready, v_empty, q_bars,
                  WG: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                  ACCUMULATE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  D1: gl.constexpr, D2: gl.constexpr, DV: gl.constexpr,
                  STAGES: gl.constexpr, SPLIT: gl.constexpr):
        if not PERSISTENT:  # one tile per program (as the producer)
            mb, seq, head, valid = _decode(gl.program_id(0), n_m, num_seqs, num_heads, CAUSAL,
                                           PERSISTENT)
            qa, qb, ka, kb = _tile_bounds(seq, cu_q_ptr, cu_k_ptr)
            _consumer_tile(mb, seq, head, valid, 0, split, 0, 0, q_ptr, out_ptr, lse_ptr, qa, qb,
                           ka, kb, dense, 0, n_m, num_seqs, num_heads, n_tiles, 0, 0, 0, 0,
                           stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                           qk_scale, q1_s, q2_s, k_s, r_s, v_s, kr_ready, kr_empty, v_ready,
                           v_empty, WG, CAUSAL, PERSISTENT, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2,
                           DV, STAGES, False)
        else:
            it = 0
            nq = 0
            progs = gl.num_programs(0)
            mb, seq, head, valid = _decode(_unit_tile(gl.program_id(0), split, SPLIT), n_m,
                                           num_seqs, num_heads, CAUSAL, PERSISTENT)
            qa, qb, ka, kb = _tile_bounds(seq, cu_q_ptr, cu_k_ptr)
            q_bar = q_bars.index(WG)
            if CAUSAL:
                # Q by TMA, each tile's loaded during the previous one (_load_q): Q as a
                # [num_queries, every head's columns] matrix (made once per program), its 128 +
                # 64 columns in two boxes. Context parts load it with gl.load at each tile's
                # start: the prefetch cost them 1-5 % (A/B under graphs, same run)
                q_cols = (num_heads - 1) * stride_qh + D1 + D2
                qd1 = tma.make_tensor_descriptor(
                    q_ptr, shape=[num_queries, q_cols], strides=[stride_qt, 1],
                    block_shape=[64, D1], layout=q1_s.type.layout)
                qd2 = tma.make_tensor_descriptor(
                    q_ptr, shape=[num_queries, q_cols], strides=[stride_qt, 1],
                    block_shape=[64, D2], layout=q2_s.type.layout)
                _load_q(qd1, qd2, q_bar, q1_s.index(WG), q2_s.index(WG), gl.program_id(0), qa,
                        n_m, num_seqs, num_heads, n_tiles, stride_qh, WG, BLOCK_M, D1, D2)
            else:
                qd1 = 0
                qd2 = 0
            for t in range(gl.program_id(0), n_tiles, progs):
                # the next tile's sequence bounds now (their loads' latency hides behind this
                # tile); the rest of its decode comes back from _consumer_tile
                _nmb, nseq, _nh, _nv = _decode(_unit_tile(t + progs, split, SPLIT), n_m,
                                               num_seqs, num_heads, CAUSAL, PERSISTENT)
                na, nb, nka, nkb = _tile_bounds(nseq, cu_q_ptr, cu_k_ptr)
                n, nq, mb, seq, head, valid = _consumer_tile(
                    mb, seq, head, valid, t, split, it, nq, q_ptr, out_ptr, lse_ptr, qa, qb, ka,
                    kb, dense, t + progs, n_m, num_seqs, num_heads, n_tiles, na, qd1, qd2, q_bar,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
                    q1_s, q2_s, k_s, r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, WG, CAUSAL,
                    PERSISTENT, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES, SPLIT)
                it += n
                qa, qb, ka, kb = na, nb, nka, nkb

    @gluon.jit(do_not_specialize=["dlo0", "dhi0", "dq0", "dk0", "dlo1", "dhi1", "dq1", "dk1",
                                  "dlo2", "dhi2", "dq2", "dk2", "dlo3", "dhi3", "dq3", "dk3",
                                  "n_m", "num_seqs", "n_tiles", "num_queries", "num_keys",
                                  "num_heads", "n_main", "n_split"])
    def _hopper_attention_kernel(
            q_ptr, k_ptr, r_ptr, v_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, qk_scale,
            dlo0, dhi0, dq0, dk0, dlo1, dhi1, dq1, dk1, dlo2, dhi2, dq2, dk2, dlo3, dhi3, dq3, dk3,
            n_m, num_seqs, n_tiles, num_queries, num_keys, num_heads,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt,
            stride_vh, stride_ot, stride_oh, stride_lt, stride_lh,
            n_main, n_split, ws_o_ptr, ws_l_ptr,
            CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, ACCUMULATE: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D1: gl.constexpr, D2: gl.constexpr,
            DV: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
            num_warps: gl.constexpr):
        # A context part is persistent: program p runs tiles p, p + P, p + 2P, ... of the
        # n_tiles (query block, sequence, head) tiles, P programs, at most one per SM; so is a
        # causal part with PERSISTENT (short sequences), else it runs one tile per program
        # (n_tiles programs). The default partition
        # (num_warps = 4) is consumer warpgroup 0; workers: consumer warpgroup 1 (4 warps) and
        # the producer (1 warp). All three walk the same tiles, each with its n_iter (0 for a
        # query block past its sequence, or with no key left to it), and run the shared rings'
        # iteration count on across tiles, so the next tile's loads overlap this one's
        # softmax and epilogue.
        gl.static_assert((BLOCK_M == 64) | (BLOCK_M == 128), "consumer warpgroups of 64 rows")
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        WM: gl.constexpr = 64
        NC: gl.constexpr = BLOCK_M // WM  # consumer warpgroups
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q1_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D1], dtype)
        q2_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WM, D2], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D1], dtype)
        r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D2], dtype)
        v_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, DV], dtype)
        dense = (dlo0, dhi0, dq0, dk0, dlo1, dhi1, dq1, dk1, dlo2, dhi2, dq2, dk2, dlo3, dhi3,
                 dq3, dk3)
        split = (n_main, n_split, ws_o_ptr, ws_l_ptr)  # _unit_tile; n_tiles counts work units

        q1_s = gl.allocate_shared_memory(dtype, [NC, WM, D1], q1_sl)
        q2_s = gl.allocate_shared_memory(dtype, [NC, WM, D2], q2_sl)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], k_sl)
        r_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], r_sl)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_sl)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        kr_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        kr_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        for i in gl.static_range(STAGES):
            # ready: the producer's expect, then the TMA bytes; empty: one arrive per consumer
            mbarrier.init(kr_ready.index(i), count=1)
            mbarrier.init(kr_empty.index(i), count=NC)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=NC)
        v_land = gl.allocate_shared_memory(gl.int64, [1], bar_layout)  # the producer's own
        mbarrier.init(v_land, count=1)
        q_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], bar_layout)  # a consumer's Q loads
        for i in gl.static_range(NC):
            mbarrier.init(q_bars.index(i), count=1)
        fence_async_shared()

        # The argument lists are written out in each branch: held in a variable and shared, the
        # tuple did not build with Triton 3.6 (the consumer's WG no longer a constexpr).
        if NC == 2:
            gl.warp_specialize([
                (_consumer, (q_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m,
                             num_seqs, n_tiles, num_queries, num_heads, stride_qt, stride_qh,
                             stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s,
                             r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, q_bars, 0, CAUSAL,
                             PERSISTENT, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES, SPLIT)),
                (_consumer, (q_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m,
                             num_seqs, n_tiles, num_queries, num_heads, stride_qt, stride_qh,
                             stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s,
                             r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, q_bars, 1, CAUSAL,
                             PERSISTENT, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES, SPLIT)),
                (_producer, (k_ptr, r_ptr, v_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m,
                             num_seqs, n_tiles, num_keys, num_heads, stride_kt, stride_kh,
                             stride_rt, stride_rh, stride_vt, stride_vh, k_s, r_s, v_s, kr_ready,
                             kr_empty, v_ready, v_empty, v_land, CAUSAL, PERSISTENT, BLOCK_M,
                             BLOCK_N, D1, D2, DV, STAGES, SPLIT)),
            ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])
        else:  # one consumer warpgroup: 64-row programs, two to an SM
            gl.warp_specialize([
                (_consumer, (q_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m,
                             num_seqs, n_tiles, num_queries, num_heads, stride_qt, stride_qh,
                             stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, q1_s, q2_s, k_s,
                             r_s, v_s, kr_ready, kr_empty, v_ready, v_empty, q_bars, 0, CAUSAL,
                             PERSISTENT, ACCUMULATE, BLOCK_M, BLOCK_N, D1, D2, DV, STAGES, SPLIT)),
                (_producer, (k_ptr, r_ptr, v_ptr, cu_q_ptr, cu_k_ptr, dense, split, n_m,
                             num_seqs, n_tiles, num_keys, num_heads, stride_kt, stride_kh,
                             stride_rt, stride_rh, stride_vt, stride_vh, k_s, r_s, v_s, kr_ready,
                             kr_empty, v_ready, v_empty, v_land, CAUSAL, PERSISTENT, BLOCK_M,
                             BLOCK_N, D1, D2, DV, STAGES, SPLIT)),
            ], [1], [_PRODUCER_REGS])


if HAS_TRITON:

    @triton.jit
    def _merge_tail_kernel(ws_o_ptr, ws_l_ptr, out_ptr, lse_ptr, cu_q_ptr, n_main, n_split, n_m,
                           num_heads, num_seqs, stride_ot, stride_oh, stride_lt, stride_lh,
                           ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, DV: tl.constexpr,
                           ROWS: tl.constexpr):
        # Tile n_main + program_id(0)'s rows [ROWS * program_id(1), + ROWS) of a context part run
        # as n_split work units (_unit_tile): their partial results (workspace slots
        # j * n_split + c) merged by LSE in order c = 0, 1, ..., then written to out / lse, or
        # with ACCUMULATE merged into them, rows of no key left untouched: the rules of
        # kernels.merge (merge_rows), as the attention kernel's epilogue applies them.
        j = tl.program_id(0)
        t = n_main + j
        m_block = t % n_m  # _decode's context order
        head = (t // n_m) % num_heads
        seq = (t // (n_m * num_heads)) % num_seqs
        q_start = tl.load(cu_q_ptr + seq)
        seqlen_q = tl.load(cu_q_ptr + seq + 1) - q_start
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, DV)
        q_row = m_block * BLOCK_M + rows
        ok = q_row < seqlen_q
        o = tl.zeros([ROWS, DV], tl.float32)
        lse = tl.full([ROWS], float("-inf"), tl.float32)
        for c in range(n_split):
            slot = (j * n_split + c).to(tl.int64) * BLOCK_M + rows
            l_c = tl.load(ws_l_ptr + slot)
            o_c = tl.load(ws_o_ptr + slot[:, None] * DV + cols[None, :])
            o, lse = merge_rows(lse, o, l_c, o_c)
        tok = (q_start + q_row).to(tl.int64)
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head * stride_oh + cols[None, :]
        l_ptrs = lse_ptr + tok * stride_lt + head * stride_lh
        if ACCUMULATE:
            write = ok & (lse != float("-inf"))  # merging nothing is the identity: no write
            l1 = tl.load(l_ptrs, mask=write, other=float("-inf"))
            o1 = tl.load(o_ptrs, mask=write[:, None], other=0.0).to(tl.float32)
            o, lse = merge_rows(l1, o1, lse, o)
        else:
            write = ok
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=write[:, None])
        tl.store(l_ptrs, lse, mask=write)

#: Context parts whose tiles do not fill the programs' last round (4096 tiles on 132 SMs: 31
#: rounds and 4 tiles) run that round's tiles in parts of their keys spread over the programs,
#: merged by LSE (_split_plan, _merge_tail_kernel); False: every tile whole (the kernel before).
SPLIT_TAIL = True
#: a work unit's fixed cost in key blocks (its Q load, pipeline fill, epilogue and partial
#: store), for _split_plan
_UNIT_COST_BLOCKS = 8
#: the fewest key blocks in a part (2048 keys)
_MIN_PART_BLOCKS = 16
#: the fewest key blocks (estimated) in a tile for a split at all (65536 keys): the first H200
#: A/B gained 2-3 % from 131072 keys and 0-3 % at 65536, nothing beyond its spread at 32768 and
#: 8192 (tile_ab_split_h200.json)
_MIN_TILE_BLOCKS = 512
#: split only where the busiest program saves at least this many tiles' time
_MIN_GAIN_TILES = 0.5
_MAX_SPLIT = 64


def _split_plan(n_tiles: int, programs: int, blocks_per_tile: float) -> tuple[int, int, int]:
    """How a context part of ``n_tiles`` tiles of equal cost (``blocks_per_tile`` key blocks
    each, an estimate) runs on at most ``programs`` persistent programs: ``(grid, n_main,
    n_split)``, tiles ``[0, n_main)`` whole, each later tile in ``n_split`` parts of its keys.

    The tiles past the last full round (``n_tiles % programs`` of them, or all when there are
    fewer than programs) are split into parts of at least ``_MIN_PART_BLOCKS`` key blocks, as
    many as make the busiest program's work least, counting each unit's fixed cost
    (``_UNIT_COST_BLOCKS``); ``n_split = 1`` (no split) unless that saves the busiest program
    ``_MIN_GAIN_TILES`` tiles' time, and only for tiles of ``_MIN_TILE_BLOCKS`` key blocks or
    more. H200 A/B (tile_ab_split_h200.json): 2-3 % off 4096 queries over 131072 keys at 128
    heads (4 tail tiles), but 1.5-2 % on at 16 heads over 32768 (116 tail tiles in 9 parts:
    0.12 tile at best, against their parts' workspace traffic), so the gain must be large.
    """
    whole = (max(1, min(n_tiles, programs)), n_tiles, 1)
    if n_tiles <= 0 or programs <= 0:
        return whole
    rounds, tail = divmod(n_tiles, programs)
    most = min(_MAX_SPLIT, int(max(blocks_per_tile, 0.0) // _MIN_PART_BLOCKS))
    if not SPLIT_TAIL or tail == 0 or most < 2 or blocks_per_tile < _MIN_TILE_BLOCKS:
        return whole
    fixed = _UNIT_COST_BLOCKS / blocks_per_tile

    def busiest(parts: int) -> float:  # the tail's cost to its busiest program, in tiles
        return cdiv(tail * parts, programs) * (1.0 / parts + fixed)

    best = min(range(2, most + 1), key=lambda n: (busiest(n), n))
    if busiest(1) - busiest(best) < _MIN_GAIN_TILES:
        return whole
    return min(programs, rounds * programs + tail * best), rounds * programs, best


def _merge_tail(ws_o: torch.Tensor, ws_l: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                cu_seqlens_q: torch.Tensor, *, n_main: int, n_split: int, n_m: int,
                accumulate: bool) -> None:
    """Merge the split tiles' parts (``ws_o [slots, BLOCK_M, DV]`` fp32, ``ws_l [slots,
    BLOCK_M]``, slot ``j * n_split + c`` part c of tile ``n_main + j``) into ``out [Tq, H, DV]``
    and ``lse [Tq, H]``: written, or with ``accumulate`` merged in (rows of no key untouched).
    One launch of ``_merge_tail_kernel``, no host sync."""
    rows = 32
    _merge_tail_kernel[(ws_l.shape[0] // n_split, BLOCK_M // rows)](
        ws_o, ws_l, out, lse, cu_seqlens_q, n_main, n_split, n_m, out.shape[1],
        cu_seqlens_q.shape[0] - 1, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        ACCUMULATE=bool(accumulate), BLOCK_M=BLOCK_M, DV=out.shape[2], ROWS=rows, num_warps=4)


def _num_sms(device: torch.device) -> int:
    # multiprocessors of a CUDA device (asked once per device: hopper_attention runs per call)
    index = torch.cuda.current_device() if device.index is None else device.index
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms


def _device_reason(device: torch.device) -> str | None:
    # the device half of unsupported_reason; the compute capability is asked once per device
    if os.environ.get(DISABLE_ENV) == "1":
        return f"disabled ({DISABLE_ENV}=1)"
    if not HAS_GLUON:
        return "needs Triton's Gluon with its Hopper API (Triton 3.6)"
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    index = torch.cuda.current_device() if device.index is None else device.index
    sm90 = _SM90.get(index)
    if sm90 is None:
        sm90 = _SM90[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return None if sm90 else "needs an sm_90 (Hopper) GPU"


def available(device: torch.device) -> bool:
    """Whether this kernel runs on ``device`` at all (enabled, Gluon, an sm_90 GPU): the device
    half of :func:`unsupported_reason`, for decisions made before the tensors exist."""
    return _device_reason(device) is None


def _aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in strides)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_rope: torch.Tensor | None,
                       dense: tuple[tuple[int, int, int, int], ...] = (), *,
                       causal: bool = False, accumulate: bool = False) -> str | None:
    """Why this kernel cannot run a call that :func:`~mlaprefill.kernels.attention.varlen_attention`
    has already validated (None: it can): the device, then :func:`layout_reason`. Host metadata
    only, no device work."""
    why = _device_reason(q.device)
    if why is not None:
        return why
    failed = _FAILED.get((q.dtype, bool(causal), bool(accumulate)))
    if failed is not None:
        return f"failed to compile here: {failed}"
    return layout_reason(q, k, v, k_rope, dense)


def layout_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_rope: torch.Tensor | None,
                  dense: tuple[tuple[int, int, int, int], ...] = ()) -> str | None:
    """The device-independent half of :func:`unsupported_reason`: dtype, MLA's head dims, the
    TMA alignment of every key / rope / value base and row / head stride (16 bytes), and dense
    rectangles on this kernel's tiles. None: the layout qualifies."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"needs bfloat16 or float16, got {q.dtype}"
    if q.shape[2] != _D1 + _D2 or v.shape[2] != _DV:
        return f"needs qk_head_dim {_D1 + _D2} and v_head_dim {_DV} (MLA's)"
    if k_rope is None:
        if k.shape[2] != _D1 + _D2:
            return f"needs joined keys of {_D1 + _D2} dims"
        rope, rope_strides = k[:, :, _D1:], k.stride()[:2]
    else:
        if k.shape[2] != _D1 or k_rope.shape[-1] != _D2:
            return f"needs split keys of {_D1} + {_D2} dims"
        rope = k_rope
        rope_strides = (k_rope.stride(0), k_rope.stride(1) if k_rope.dim() == 3 else 0)
    for t, strides in ((q, q.stride()[:2]), (k, k.stride()[:2]), (rope, rope_strides),
                       (v, v.stride()[:2])):
        if not _aligned(t, strides):
            return "TMA needs 16-byte aligned query / key / value bases and strides"
    for _, _, q_rows, k_rows in dense:
        if q_rows % BLOCK_M or k_rows % BLOCK_N:
            return f"dense rectangles must be multiples of {BLOCK_M} x {BLOCK_N}"
    return None


def hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                     max_seqlen_q: int, causal: bool, softmax_scale: float,
                     dense_args: list[int], k_rope: torch.Tensor | None,
                     out: torch.Tensor, lse: torch.Tensor, accumulate: bool) -> bool:
    """One launch of the kernel into ``(out, lse)`` (merged into them when ``accumulate``).

    Called by :func:`~mlaprefill.kernels.attention.varlen_attention` after its checks and after
    :func:`unsupported_reason` said None, with the 16 rectangle scalars of its ``dense=``. Returns
    False, having launched nothing, when the kernel fails to build here (remembered: later calls
    of that dtype, causal and accumulate get a reason from :func:`unsupported_reason`); the caller
    then runs the Triton kernel. Never synchronizes.
    """
    if k_rope is None:
        rope, stride_rt, stride_rh = k[:, :, _D1:], k.stride(0), k.stride(1)
    else:
        rope = k_rope
        stride_rt = k_rope.stride(0)
        stride_rh = k_rope.stride(1) if k_rope.dim() == 3 else 0
    ensure_allocator()  # device-side tensor descriptors need global scratch
    num_seqs = cu_seqlens_q.shape[0] - 1
    # Persistent (one program per SM walking the tiles, the next tile's loads overlapping this
    # one's epilogue; two per SM for 64-row programs): a context part's tiles cost the same, a
    # causal part's come in pairs of equal cost (_decode); one program per tile only past
    # CAUSAL_PERSISTENT_MAX_BLOCKS query blocks (the tests' comparison form). Every causal form
    # a length can select is built on the first causal call (_causal_form).
    form = (_causal_form(cdiv(max_seqlen_q, BLOCK_M)) if causal
            else (True, BLOCK_M, BLOCK_N, STAGES))
    persistent, block_m = form[:2]
    n_m = cdiv(max_seqlen_q, block_m)
    n_tiles = n_m * num_seqs * q.shape[1]
    if not persistent:
        grid = (n_tiles,)
    elif causal:  # pair units (_decode), two rounds each past one query block: n_tiles counts
        # every program's slots
        n_units = (n_m + 1) // 2 * num_seqs * q.shape[1]
        progs = max(1, min(n_units, _num_sms(q.device) * (BLOCK_M // block_m)))
        if n_m > 1:
            n_tiles = 2 * cdiv(n_units, progs) * progs
        grid = (progs,)
    n_main, n_split, ws_o, ws_l = n_tiles, 1, out, lse
    if persistent and not causal:
        # keys per tile estimated from the mean sequence (lengths stay on the device)
        progs, n_main, n_split = _split_plan(
            n_tiles, _num_sms(q.device), k.shape[0] / max(num_seqs, 1) / BLOCK_N)
        grid = (progs,)
        if n_split > 1:
            slots = (n_tiles - n_main) * n_split
            ws_o = torch.empty(slots, BLOCK_M, _DV, dtype=torch.float32, device=q.device)
            ws_l = torch.empty(slots, BLOCK_M, dtype=torch.float32, device=q.device)
            n_tiles = n_main + slots  # work units
    args = (q, k, rope, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E,
            *dense_args, n_m, num_seqs, n_tiles, q.shape[0], max(k.shape[0], 1), q.shape[1],
            q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), stride_rt, stride_rh, v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            n_main, n_split, ws_o, ws_l)
    consts = dict(CAUSAL=bool(causal), ACCUMULATE=bool(accumulate), D1=_D1, D2=_D2, DV=_DV,
                  SPLIT=n_split > 1, num_warps=4)
    try:
        built = (q.dtype, bool(accumulate), q.device.index if q.device.index is not None
                 else torch.cuda.current_device())
        if causal and built not in _CAUSAL_BUILT:  # the other forms too, compiled, not run
            for other in _causal_forms() - {form}:
                _hopper_attention_kernel.warmup(*args, grid=(1,), **_form_consts(other),
                                                **consts)
            _CAUSAL_BUILT.add(built)
        _hopper_attention_kernel[grid](*args, **_form_consts(form), **consts)
    except torch.OutOfMemoryError:  # its descriptor scratch: the caller's problem, not a build's
        raise
    except Exception as exc:  # this Triton / toolchain cannot build it: the Triton kernel runs
        _FAILED[(q.dtype, bool(causal), bool(accumulate))] = \
            f"{type(exc).__name__}: {str(exc)[:200]}"
        return False
    if n_split > 1:  # plain Triton; not a fallback: the whole tiles are written (or merged)
        _merge_tail(ws_o, ws_l, out, lse, cu_seqlens_q, n_main=n_main, n_split=n_split, n_m=n_m,
                    accumulate=accumulate)
    return True


def _causal_form(n_m: int) -> tuple[bool, int, int, int]:
    # (persistent, query rows, keys per block, ring stages) of a causal part of n_m query blocks
    # of BLOCK_M
    # 64-row programs run persistent only: one program per 64-row tile left NaN in the output
    # of a few tiles' first rows, different ones each run (H200, 128 heads x 24 x 256 queries;
    # not found yet), while the 128-row form of the same rows gave the same bits every run
    persistent = n_m <= CAUSAL_PERSISTENT_MAX_BLOCKS
    if n_m <= CAUSAL_SINGLE_MAX_BLOCKS and persistent:
        shape = _SINGLE
    elif n_m <= CAUSAL_NARROW_MAX_BLOCKS:
        shape = (BLOCK_M, *_NARROW)
    else:
        shape = (BLOCK_M, BLOCK_N, STAGES)
    return (persistent, *shape)


def _form_consts(form: tuple[bool, int, int, int]) -> dict:
    # a form's compile-time constants and register budget
    persistent, block_m, block_n, stages = form
    return dict(PERSISTENT=persistent, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                maxnreg=_MAXNREG if block_m == BLOCK_M else _MAXNREG_SINGLE)


def _causal_forms() -> set[tuple[bool, int, int, int]]:
    # every form _causal_form selects for some reachable length, under the current thresholds
    cuts = {CAUSAL_SINGLE_MAX_BLOCKS, CAUSAL_NARROW_MAX_BLOCKS, CAUSAL_PERSISTENT_MAX_BLOCKS}
    return {_causal_form(n) for n in {1} | {c + 1 for c in cuts if 0 <= c < _MAX_BLOCKS}}


def num_compiled_kernels() -> int:
    """Binaries of this kernel compiled in this process so far (all devices); 0 without Gluon."""
    if not HAS_GLUON:
        return 0
    caches = getattr(_hopper_attention_kernel, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in caches.values())
    return 0
