"""Flash-attention forward for packed variable-length sequences, with LSE (Triton).

For each sequence ``s`` (``cu_seqlens_q`` / ``cu_seqlens_k``) and head ``h``::

    out[t, h] = softmax(q[t, h] . k[j, h]^T * softmax_scale) . v[j, h]   over the keys j of s
    lse[t, h] = log(sum_j exp(q[t, h] . k[j, h]^T * softmax_scale))      natural log

``causal=True``: query ``i`` of a sequence attends keys ``0..i`` (top-left aligned; meant for
equal query/key lengths). A query whose sequence has no keys gets ``out = 0, lse = -inf``.

Design, for Hopper (H200, sm_90) and DeepSeek's MLA shapes (``qk_head_dim = 192 = 128 + 64``,
``v_head_dim = 128``):

* One program per (query block, sequence, head), no split over keys; ``BLOCK_M = 128`` query rows
  over 8 warps (two warpgroups), fp32 accumulators, the standard online softmax in the exp2
  domain. The query tile is loaded once and stays on chip for the whole key loop.
* ``qk_head_dim`` is not a power of two: the QK dot is two dots, over the largest power of two
  ``D1 <= qk_head_dim`` and over the rest, padded to a power of two (>= 16, the MMA minimum) with
  masked loads. For 192 that is 128 + 64 and nothing is masked. ``v_head_dim`` is padded the same
  way.
* The key loop runs in two parts: full key blocks without any mask (all of them for non-causal;
  the blocks entirely below the diagonal for causal), then the masked blocks (the partial tail
  block; for causal the diagonal blocks).
* The softmax scale is applied to the fp32 scores, not folded into ``q``: ``qk * qk_scale - m``
  is one FMA per score (the same instruction count as ``qk - m``), while scaling ``q`` would
  round the scaled queries back to bf16 (up to 2^-9 relative error on every score).
* Causal query blocks are launched heaviest (last) first, so the short ones fill the tail.
* The key may come in two parts with their own strides (``k_rope``): MLA's rope key is one row
  per token shared by every head, read with head stride 0, so nobody copies it into each head.
* ``state=(out, lse)``: the epilogue merges the block's result into a running one by LSE (the
  rules of :mod:`mlaprefill.kernels.merge`), so the chunked forward needs no merge pass. A query
  block with no key left to it returns before loading anything.

NaN isolation: keys outside the sequence are masked at *load* time (``other=0``) for K and V and
their scores are set to ``-inf`` with ``where`` (never a multiply by a mask), so a NaN/inf in one
sequence's ``q``, ``k`` or ``v`` can only reach that sequence's rows. A row with keys whose
softmax sum is 0 or whose LSE would be ``+inf`` is reported as NaN (the rule of
:func:`mlaprefill.backends.base.flag_inf_lse_as_nan`).

Costs: ``4 * sum_s(Lq_s * Lk_s) * H * (qk_head_dim + v_head_dim) / 2`` FLOP (non-causal; about
half for causal); K and V are read once per query block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlaprefill.kernels import hopper_attention
from mlaprefill.kernels._triton import (
    HAS_TRITON,
    cdiv,
    check_tiles,
    ensure_allocator,
    pow2_at_least_16,
    tl,
    triton,
    use_triton,
)

__all__ = [
    "CONTEXT_ATTENTION_CONFIG",
    "DEFAULT_ATTENTION_CONFIG",
    "MAX_DENSE_BLOCKS",
    "MAX_HEAD_DIM",
    "MIN_QK_HEAD_DIM",
    "WIDE_ATTENTION_CONFIG",
    "AttentionConfig",
    "attention_configs",
    "default_config",
    "num_compiled_kernels",
    "varlen_attention",
]

#: Largest ``qk_head_dim`` / ``v_head_dim`` (register budget of the on-chip query and output tiles).
MAX_HEAD_DIM = 256
#: Smallest ``qk_head_dim``: the first QK dot spans a power of two >= 16 (the MMA K minimum).
MIN_QK_HEAD_DIM = 16
_LOG2E = 1.4426950408889634
#: Most rectangles a call can leave to another kernel (``dense=``): scalar kernel arguments.
MAX_DENSE_BLOCKS = 4
_MAX_GRID_YZ = 65535  # CUDA grid limit of axes 1 and 2


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes and launch options of :func:`varlen_attention`.

    Attributes
    ----------
    block_m : int
        Query rows per program (power of two >= 16).
    block_n : int
        Keys per loop step (power of two >= 16).
    num_warps : int
        Warps per program (1, 2, 4, 8 or 16).
    num_stages : int
        Software-pipelining depth of the K/V loads (>= 1).
    tma : bool
        Load K / V tiles through device-side tensor descriptors (TMA on Hopper) instead of
        pointer tiles. Needs 16-byte aligned K / V bases and strides.
    warp_specialize : bool
        Ask Triton to warp-specialize the key loops (``tl.range(..., warp_specialize=True)``).
        With Triton 3.6 on Hopper it changes nothing for this kernel: the binary compiled with
        it is identical to the one without (one cubin for both, checked on the H200 in
        benchmarks/results/attention_variants_h200.json, and with TMA loads by compiling for
        sm_90a); at 4 warps it does not compile. Kept for Triton versions that partition it.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 4
    tma: bool = False
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        check_tiles("AttentionConfig", self.block_m, self.block_n, self.num_warps,
                    self.num_stages)
        for name in ("tma", "warp_specialize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AttentionConfig.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")


#: Hopper default for qk 192 / v 128, every call: at 8 warps a 128 x 64 score tile is 32 fp32
#: registers per thread, P 16 and the 128 x 128 output accumulator 64, clear of spills, and four
#: stages of K/V (24 + 16 KiB each) fit the 227 KiB of shared memory; 128 x 128 tiles with 3
#: stages do not fit. Measured on the H200 (benchmarks/results/triton_attention_split_h200.json,
#: split keys as the forward passes them): 450-505 TFLOP/s non-causal, 330-450 causal.
DEFAULT_ATTENTION_CONFIG = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=4)
#: 256 query rows over 16 warps. It was the default for non-causal calls with more than 128
#: queries per sequence (455-464 against 430-440 TFLOP/s, 128 heads, 4k queries x 16k-64k keys,
#: before split keys and the epilogue merge); in the latest run it is 5-19 % slower than the
#: default on every non-causal shape, 16 and 128 heads, split or joined keys (same JSON).
WIDE_ATTENTION_CONFIG = AttentionConfig(block_m=256, block_n=64, num_warps=16, num_stages=2)
#: Non-causal (context) calls: the default's tiles with three stages instead of four. Two sweeps
#: on the H200, split keys, time against the default in the same run
#: (triton_attention_ws_h200{,_run2}.json, where this config ran as ``m128_n64_w8_s3_ws``: the
#: warp_specialize flag it carried then compiles to the same binary, see the field): 0.88-0.99x
#: on every non-causal shape of 16 and 128 heads but one (16 x 256 over 8k: 0.88x, then 1.03x),
#: 0.97x on 4k causal calls and 1.15-1.22x on 16 x 256 causal ones, so causal calls keep the
#: default. With TMA loads it is no faster. Whole forwards on our kernel against the old
#: default in one run: 0.95-1.00x on 12 of 14 vs-ideal shapes, 1.004x and 1.10x on two (16 x 250
#: over 8000: a noisy shape) (attention_vs_ideal_h200_bmm_ws{,_ab}.json).
CONTEXT_ATTENTION_CONFIG = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def default_config(*, causal: bool, max_seqlen_q: int) -> AttentionConfig:
    """The config :func:`varlen_attention` uses when given none: a pure function of the two host
    values, so one call shape always gets the same compiled kernel: :data:`DEFAULT_ATTENTION_CONFIG`
    for causal calls, :data:`CONTEXT_ATTENTION_CONFIG` for the others (see
    :data:`WIDE_ATTENTION_CONFIG` for the measurement that retired a third)."""
    del max_seqlen_q  # kept in the signature: the choice may depend on it again
    return DEFAULT_ATTENTION_CONFIG if causal else CONTEXT_ATTENTION_CONFIG


# Named presets for a sweep on the GPU (a tuple, so no module-level mutable state).
_PRESETS: tuple[tuple[str, AttentionConfig], ...] = (
    ("m128_n64_w8_s4", DEFAULT_ATTENTION_CONFIG),
    ("m256_n64_w16_s2", WIDE_ATTENTION_CONFIG),
    ("m128_n64_w8_s3", CONTEXT_ATTENTION_CONFIG),
    ("m128_n64_w8_s2", AttentionConfig(128, 64, 8, 2)),
    ("m128_n128_w8_s2", AttentionConfig(128, 128, 8, 2)),
    ("m128_n32_w8_s4", AttentionConfig(128, 32, 8, 4)),
    ("m256_n64_w8_s2", AttentionConfig(256, 64, 8, 2)),
    ("m128_n64_w4_s3", AttentionConfig(128, 64, 4, 3)),
    ("m64_n64_w4_s3", AttentionConfig(64, 64, 4, 3)),
    ("m128_n64_w8_s4_tma", AttentionConfig(128, 64, 8, 4, tma=True)),
    ("m128_n64_w8_s3_tma", AttentionConfig(128, 64, 8, 3, tma=True)),
    ("m256_n64_w16_s2_tma", AttentionConfig(256, 64, 16, 2, tma=True)),
    ("m256_n64_w16_s3_tma", AttentionConfig(256, 64, 16, 3, tma=True)),
    ("m128_n128_w8_s2_tma", AttentionConfig(128, 128, 8, 2, tma=True)),
)  # no warp_specialize presets: with Triton 3.6 each compiles to its twin's binary


def attention_configs() -> dict[str, AttentionConfig]:
    """The named presets to sweep on the GPU (a new dict each call; the default is first).

    Some may not compile for every head dim (shared memory or registers); a sweep should skip
    those that raise ``triton.runtime.errors.OutOfResources``.
    """
    return dict(_PRESETS)


if HAS_TRITON:
    from mlaprefill.kernels.merge import merge_rows  # the epilogue merge: one definition

    @triton.jit
    def _load_tile(ptrs, row_ok, col_ok, ROW_MASK: tl.constexpr, COL_MASK: tl.constexpr):
        # Masks only where needed (constexpr): unmasked loads vectorize best. Masked-off entries
        # load 0, never memory of another sequence (whose NaN must not reach this one).
        if ROW_MASK:
            if COL_MASK:
                x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            else:
                x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        elif COL_MASK:
            x = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _attn_loop(
        acc, l_i, m_i,          # running state: fp32 [BLOCK_M, BLOCK_DV], [BLOCK_M], [BLOCK_M]
        q1, q2,                 # queries [BLOCK_M, D1], [BLOCK_M, BLOCK_D2] (input dtype)
        k_base, p_base, v_base,  # key 0's first part, its second part, value 0 (seq, head)
        k_desc, p_desc, v_desc,  # TMA: the same as tensor descriptors of the sequence's rows
        stride_kt, stride_pt, stride_vt,
        offs_m,                 # int32 [BLOCK_M]: query positions within the sequence
        seqlen_k,
        qk_scale,               # softmax_scale * log2(e)
        lo, hi,                 # key range [lo, hi); lo a multiple of BLOCK_N
        MASKED: tl.constexpr,   # False: every block in [lo, hi) is full and fully visible
        CAUSAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr,
        DV: tl.constexpr, BLOCK_DV: tl.constexpr,
        TMA: tl.constexpr,      # load K / V tiles through the descriptors
        WS: tl.constexpr,       # warp-specialize the key loop
    ):
        offs_n = tl.arange(0, BLOCK_N)
        offs_d1 = tl.arange(0, D1)
        offs_d2 = tl.arange(0, BLOCK_D2)
        offs_dv = tl.arange(0, BLOCK_DV)
        d2_ok = offs_d2 < D2
        dv_ok = offs_dv < DV
        # Tile offsets relative to the block's first key: small, int32; the block base is int64.
        k1_offs = offs_n[:, None] * stride_kt + offs_d1[None, :]
        k2_offs = offs_n[:, None] * stride_pt + offs_d2[None, :]
        v_offs = offs_n[:, None] * stride_vt + offs_dv[None, :]
        # WS: ask Triton to warp-specialize the loop (with Triton 3.6 on sm_90 the binary is the
        # same as without; see AttentionConfig.warp_specialize).
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            kb = k_base + start_n.to(tl.int64) * stride_kt
            vb = v_base + start_n.to(tl.int64) * stride_vt
            n_ok = (start_n + offs_n) < seqlen_k
            if TMA:  # rows past the sequence and columns past D2 / DV read 0 (descriptor bounds)
                k1 = k_desc.load([start_n, 0])
            else:
                k1 = _load_tile(kb + k1_offs, n_ok, offs_d1, MASKED, False)
            qk = tl.dot(q1, tl.trans(k1))  # fp32 [BLOCK_M, BLOCK_N]
            if D2 > 0:
                if TMA:
                    k2 = p_desc.load([start_n, 0])
                else:
                    pb = p_base + start_n.to(tl.int64) * stride_pt
                    k2 = _load_tile(pb + k2_offs, n_ok, d2_ok, MASKED, BLOCK_D2 != D2)
                qk = tl.dot(q2, tl.trans(k2), acc=qk)
            if MASKED:
                visible = n_ok[None, :]
                if CAUSAL:
                    visible = visible & ((start_n + offs_n)[None, :] <= offs_m[:, None])
                qk = tl.where(visible, qk, float("-inf"))  # where, not a multiply (0 * NaN)
            # qk_scale > 0, so max(qk) * qk_scale == max(qk * qk_scale).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # Safe max: a row that has seen only -inf scores keeps m = -inf; subtracting it would
            # give exp2(-inf - -inf) = NaN. With 0 instead, p = exp2(-inf) = 0 and alpha = 0.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk * qk_scale - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if TMA:
                v = v_desc.load([start_n, 0])
            else:
                v = _load_tile(vb + v_offs, n_ok, dv_ok, MASKED, BLOCK_DV != DV)
            acc = tl.dot(p.to(v.dtype), v, acc=acc)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit(do_not_specialize=["dlo0", "dhi0", "dq0", "dk0", "dlo1", "dhi1", "dq1", "dk1",
                                   "dlo2", "dhi2", "dq2", "dk2", "dlo3", "dhi3", "dq3", "dk3"])
    def _varlen_attention_kernel(
        q_ptr,                  # [Tq, H, D1 + D2], last dim contiguous
        k_ptr,                  # keys' first D1 dims: [Tk, H, >= D1], last dim contiguous
        p_ptr,                  # keys' other D2 dims: [Tk, H or 1 (head stride 0), D2]
        v_ptr,                  # [Tk, H, DV], last dim contiguous
        out_ptr,                # [Tq, H, DV], q's dtype (ACCUMULATE: the running output)
        lse_ptr,                # float32 [Tq, H], natural log (ACCUMULATE: the running LSE)
        cu_seqlens_q_ptr,       # int32 [num_seqs + 1]
        cu_seqlens_k_ptr,       # int32 [num_seqs + 1]
        qk_scale,               # softmax_scale * log2(e), > 0
        # Up to 4 rectangles left to another kernel: for every sequence in [dloJ, dhiJ), query
        # rows [0, dqJ) skip keys [0, dkJ) (dqJ a multiple of BLOCK_M, dkJ of BLOCK_N; an empty
        # range: unused). Scalars, not specialized on their values: new rectangles never
        # recompile.
        dlo0, dhi0, dq0, dk0, dlo1, dhi1, dq1, dk1, dlo2, dhi2, dq2, dk2, dlo3, dhi3, dq3, dk3,
        stride_qt, stride_qh,
        stride_kt, stride_kh,
        stride_pt, stride_ph,
        stride_vt, stride_vh,
        stride_ot, stride_oh,
        stride_lt, stride_lh,
        CAUSAL: tl.constexpr,
        ACCUMULATE: tl.constexpr,  # merge into (out, lse) by LSE instead of overwriting them
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D1: tl.constexpr,       # first QK part (from k_ptr): a power of two
        D2: tl.constexpr,       # second QK part (from p_ptr): qk_head_dim - D1 (0: none)
        BLOCK_D2: tl.constexpr,  # D2 padded to a power of two >= 16
        DV: tl.constexpr,
        BLOCK_DV: tl.constexpr,  # DV padded to a power of two >= 16
        TMA: tl.constexpr,       # K / V tiles through device-side tensor descriptors
        WS: tl.constexpr,        # warp-specialized key loops
    ):
        # Heaviest causal query blocks (the last ones) first; grid axis 0 is
        # cdiv(max_seqlen_q, BLOCK_M), so program 0 gets the last block any sequence can have.
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        m0 = m_block * BLOCK_M
        if m0 >= seqlen_q:
            return
        k_start = tl.load(cu_seqlens_k_ptr + seq)
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start

        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seqlen_q
        rows = tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < DV
        head64 = head.to(tl.int64)
        o_ptrs = (out_ptr + (q_start + m0).to(tl.int64) * stride_ot + head64 * stride_oh
                  + rows[:, None] * stride_ot + offs_dv[None, :])
        l_ptrs = lse_ptr + (q_start + m0).to(tl.int64) * stride_lt + head64 * stride_lh \
            + rows * stride_lt
        o_mask = m_ok[:, None] & dv_ok[None, :]

        if CAUSAL:
            # Key block [n0, n0 + BLOCK_N) is fully visible to every row of the query block iff
            # n0 + BLOCK_N - 1 <= m0 (its first row) and it lies inside the sequence.
            kv_end = tl.minimum(seqlen_k, m0 + BLOCK_M)
            free_end = (tl.minimum(seqlen_k, m0 + 1) // BLOCK_N) * BLOCK_N
        else:
            kv_end = seqlen_k
            free_end = (seqlen_k // BLOCK_N) * BLOCK_N
        # Keys [0, k_lo) of this block were left to another kernel (a dense rectangle).
        m_end = m0 + BLOCK_M
        k_lo = tl.where((seq >= dlo0) & (seq < dhi0) & (m_end <= dq0), dk0, 0)
        k_lo = tl.where((seq >= dlo1) & (seq < dhi1) & (m_end <= dq1), dk1, k_lo)
        k_lo = tl.where((seq >= dlo2) & (seq < dhi2) & (m_end <= dq2), dk2, k_lo)
        k_lo = tl.where((seq >= dlo3) & (seq < dhi3) & (m_end <= dq3), dk3, k_lo)
        if k_lo >= kv_end:
            # No key of this block is left to this kernel: merging nothing is the identity;
            # otherwise the block's rows have no keys here (out = 0, lse = -inf), written without
            # loading anything.
            if not ACCUMULATE:
                tl.store(o_ptrs, tl.zeros([BLOCK_M, BLOCK_DV], dtype=out_ptr.dtype.element_ty),
                         mask=o_mask)
                tl.store(l_ptrs, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=m_ok)
            return

        offs_d1 = tl.arange(0, D1)
        offs_d2 = tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2 < D2
        # int64 bases: Tk * H * D can exceed 2^31; offsets inside a tile stay int32.
        q_base = q_ptr + (q_start + m0).to(tl.int64) * stride_qt + head64 * stride_qh
        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + head64 * stride_kh
        p_base = p_ptr + k_start.to(tl.int64) * stride_pt + head64 * stride_ph
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + head64 * stride_vh
        if TMA:
            # One descriptor per (sequence, head) over exactly the sequence's key rows: a tile
            # past them reads zeros, never another sequence's rows (NaN isolation as above).
            k_desc = tl.make_tensor_descriptor(k_base, shape=[seqlen_k, D1],
                                               strides=[stride_kt, 1], block_shape=[BLOCK_N, D1])
            if D2 > 0:
                p_desc = tl.make_tensor_descriptor(p_base, shape=[seqlen_k, D2],
                                                   strides=[stride_pt, 1],
                                                   block_shape=[BLOCK_N, BLOCK_D2])
            else:
                p_desc = p_base  # unused
            v_desc = tl.make_tensor_descriptor(v_base, shape=[seqlen_k, DV],
                                               strides=[stride_vt, 1],
                                               block_shape=[BLOCK_N, BLOCK_DV])
        else:
            k_desc, p_desc, v_desc = k_base, p_base, v_base  # unused

        # The query tile, loaded once (rows past the sequence read 0 and are never stored).
        q1 = _load_tile(q_base + rows[:, None] * stride_qt + offs_d1[None, :], m_ok, offs_d1,
                        True, False)
        if D2 > 0:
            q2 = _load_tile(q_base + rows[:, None] * stride_qt + (D1 + offs_d2)[None, :], m_ok,
                            d2_ok, True, BLOCK_D2 != D2)
        else:
            q2 = q1  # unused

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        acc, l_i, m_i = _attn_loop(acc, l_i, m_i, q1, q2, k_base, p_base, v_base, k_desc,
                                   p_desc, v_desc, stride_kt, stride_pt, stride_vt, offs_m,
                                   seqlen_k, qk_scale, k_lo, free_end, False, CAUSAL, BLOCK_N,
                                   D1, D2, BLOCK_D2, DV, BLOCK_DV, TMA, WS)
        acc, l_i, m_i = _attn_loop(acc, l_i, m_i, q1, q2, k_base, p_base, v_base, k_desc,
                                   p_desc, v_desc, stride_kt, stride_pt, stride_vt, offs_m,
                                   seqlen_k, qk_scale, tl.maximum(free_end, k_lo), kv_end, True,
                                   CAUSAL, BLOCK_N, D1, D2, BLOCK_D2, DV, BLOCK_DV, TMA, WS)

        # Finish. A row with keys always has l >= 1 for finite inputs (its max term is 1); l == 0
        # (all scores -inf) or an LSE of +inf only come from non-finite inputs: report NaN, like
        # flag_inf_lse_as_nan. A NaN l already gives NaN in both.
        lse2 = m_i + tl.log2(l_i)
        bad = (l_i == 0.0) | (lse2 == float("inf"))
        o = acc * (1.0 / l_i)[:, None]
        o = tl.where(bad[:, None], float("nan"), o)
        lse = tl.where(bad, float("nan"), lse2 * 0.6931471805599453)  # log2 -> natural log
        if ACCUMULATE:
            # The merge of kernels.merge, on this block's rows: "no keys" is exactly -inf, NaN
            # propagates, a +inf LSE merges to NaN.
            l1 = tl.load(l_ptrs, mask=m_ok, other=float("-inf"))
            o1 = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            o, lse = merge_rows(l1, o1, lse, o)
            # Every warp has read its running LSE before any warp overwrites it (the LSE vector
            # is replicated across warps; see kernels.merge).
            tl.debug_barrier()

        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(l_ptrs, lse, mask=m_ok)


def num_compiled_kernels() -> int | None:
    """Binaries of the attention kernels (the Triton one and the Hopper Gluon one) compiled in
    this process so far (all devices), or None where this Triton does not expose its JIT cache.

    The kernel is compiled once per (dtype, head dims, causal, config) and never per sequence
    length: lengths are read from ``cu_seqlens`` on the device, and every host int it takes
    (strides) is fixed by the tensor layout.
    """
    if not HAS_TRITON:
        return None
    kernel = _varlen_attention_kernel
    hopper = hopper_attention.num_compiled_kernels()
    caches = getattr(kernel, "device_caches", None)  # Triton >= 3.2: device -> (cache, ...)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in caches.values()) + hopper
    cache = getattr(kernel, "cache", None)  # older Triton: device -> {key: binary}
    if isinstance(cache, dict):
        return sum(len(c) for c in cache.values()) + hopper
    return None


def _dense_args(dense: tuple[tuple[int, int, int, int], ...], cfg: AttentionConfig,
                num_seqs: int) -> list[int]:
    """The kernel's 16 rectangle scalars (unused slots: an empty range), after host checks."""
    if len(dense) > MAX_DENSE_BLOCKS:
        raise ValueError(f"dense holds {len(dense)} rectangles; at most {MAX_DENSE_BLOCKS}")
    args: list[int] = []
    for rect in dense:
        seq_lo, seq_hi, q_rows, k_rows = rect
        if not 0 <= seq_lo < seq_hi <= num_seqs:
            raise ValueError(f"dense rectangle {rect}: sequences [{seq_lo}, {seq_hi}) are not a "
                             f"non-empty range inside [0, {num_seqs})")
        if q_rows <= 0 or q_rows % cfg.block_m or k_rows <= 0 or k_rows % cfg.block_n:
            raise ValueError(f"dense rectangle {rect}: q_rows must be a positive multiple of "
                             f"block_m={cfg.block_m} and k_rows of block_n={cfg.block_n}")
        args += [int(seq_lo), int(seq_hi), int(q_rows), int(k_rows)]
    return args + [0, 0, 0, 0] * (MAX_DENSE_BLOCKS - len(dense))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float,
           k_rope: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    k_dim = k.shape[2] + (0 if k_rope is None else k_rope.shape[-1])
    if q.shape[1] != k.shape[1] or q.shape[2] != k_dim or k.shape[:2] != v.shape[:2]:
        what = "k [Tk, H, Dqk]" if k_rope is None else "k [Tk, H, Dqk - Drope]"
        raise ValueError(f"need q [Tq, H, Dqk], {what}, v [Tk, H, Dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16,
                                                              torch.float32):
        raise TypeError(f"q, k, v must share one dtype of float16/bfloat16 (float32: tf32 dots "
                        f"on GPU), got {q.dtype}, {k.dtype}, {v.dtype}")
    qk_dim, v_dim = q.shape[2], v.shape[2]
    if not MIN_QK_HEAD_DIM <= qk_dim <= MAX_HEAD_DIM or not 1 <= v_dim <= MAX_HEAD_DIM:
        raise ValueError(f"need {MIN_QK_HEAD_DIM} <= qk_head_dim <= {MAX_HEAD_DIM} and "
                         f"1 <= v_head_dim <= {MAX_HEAD_DIM}, got {qk_dim}, {v_dim}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k and v need a contiguous last dim (stride 1); call .contiguous()")
    if k_rope is not None:
        d1 = k.shape[2]
        if d1 < MIN_QK_HEAD_DIM or d1 & (d1 - 1):
            raise ValueError(f"with k_rope, k's head dim (the first QK part) must be a power of "
                             f"two >= {MIN_QK_HEAD_DIM}, got {d1}")
        if k_rope.dtype != k.dtype or k_rope.device != k.device:
            raise ValueError(f"k_rope must have k's dtype and device, got {k_rope.dtype} on "
                             f"{k_rope.device}")
        ok_shape = (k_rope.dim() == 2 and k_rope.shape[0] == k.shape[0]) or (
            k_rope.dim() == 3 and k_rope.shape[:2] == k.shape[:2])
        if not ok_shape or k_rope.shape[-1] == 0 or k_rope.stride(-1) != 1:
            raise ValueError(f"k_rope must be [Tk, Drope] (shared by every head) or [Tk, H, "
                             f"Drope] with a contiguous last dim, Drope >= 1; got "
                             f"{tuple(k_rope.shape)} for k {tuple(k.shape)}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be int32 [num_seqs + 1], got {cu.dtype} "
                             f"{tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must both be [num_seqs + 1]")
    devices = {t.device for t in (q, k, v, cu_seqlens_q, cu_seqlens_k)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, cu_seqlens_q, cu_seqlens_k must share one device, "
                         f"got {devices}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise TypeError(f"max_seqlen_q must be a host int >= 0, got {max_seqlen_q!r:.40}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    num_seqs, num_heads = cu_seqlens_q.shape[0] - 1, q.shape[1]
    if num_seqs > _MAX_GRID_YZ or num_heads > _MAX_GRID_YZ:
        raise ValueError(f"num_seqs={num_seqs} and num_heads={num_heads} must be <= "
                         f"{_MAX_GRID_YZ} (CUDA grid axes 1 and 2); split the batch")


def _key_parts(k: torch.Tensor, k_rope: torch.Tensor | None
               ) -> tuple[int, torch.Tensor, int, int]:
    """``(D1, second part, its token stride, its head stride)``: the key as the kernel reads it
    (with ``k_rope`` absent the second part is ``k``'s columns past the largest power of two
    <= its width; unused when there are none)."""
    if k_rope is None:
        d1 = 1 << (k.shape[2].bit_length() - 1)  # largest power of two <= qk_dim
        return d1, (k[:, :, d1:] if k.shape[2] > d1 else k), k.stride(0), k.stride(1)
    return k.shape[2], k_rope, k_rope.stride(0), k_rope.stride(1) if k_rope.dim() == 3 else 0


def _check_tma(parts: list[tuple[str, torch.Tensor, tuple[int, ...]]]) -> None:
    """TMA descriptors need 16-byte aligned bases and token / head strides (every (sequence,
    head) base is the tensor's plus whole strides); ``(name, tensor, strides)`` per key / value
    part the kernel reads through a descriptor. Host metadata only."""
    for name, t, strides in parts:
        ptr, size = t.data_ptr(), t.element_size()
        if ptr % 16 or any(st * size % 16 for st in strides):
            raise ValueError(f"config.tma needs {name} 16-byte aligned with token and head "
                             f"strides a multiple of 16 bytes (got address % 16 = {ptr % 16}, "
                             f"strides {tuple(strides)} x {size} bytes); use a config with "
                             f"tma=False or a contiguous copy")


def _check_state(state: object, q: torch.Tensor, v_dim: int, name: str = "state"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(state, tuple) and len(state) == 2
            and all(isinstance(t, torch.Tensor) for t in state)):
        raise TypeError(f"{name} must be a tuple (out, lse) of tensors, got "
                        f"{type(state).__name__}")
    out, lse = state
    want = (q.shape[0], q.shape[1], v_dim)
    if tuple(out.shape) != want or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"{name} out must be [Tq, H, Dv] = {want} in q's dtype {q.dtype} with a "
                         f"contiguous last dim, got {tuple(out.shape)} {out.dtype}")
    if tuple(lse.shape) != want[:2] or lse.dtype != torch.float32:
        raise ValueError(f"{name} lse must be float32 [Tq, H] = {want[:2]}, got "
                         f"{tuple(lse.shape)} {lse.dtype}")
    if out.device != q.device or lse.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}")
    return out, lse


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                     max_seqlen_q: int, causal: bool, softmax_scale: float,
                     config: AttentionConfig | None = None,
                     dense: tuple[tuple[int, int, int, int], ...] = (),
                     k_rope: torch.Tensor | None = None,
                     state: tuple[torch.Tensor, torch.Tensor] | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a packed varlen batch, with LSE (one Triton launch).

    Parameters
    ----------
    q : [Tq, H, qk_head_dim]; k : [Tk, H, qk_head_dim]; v : [Tk, H, v_head_dim]
        float16/bfloat16 (float32 is accepted: tf32 dots on GPU, exact in the interpreter), one
        device; last dim contiguous, other strides arbitrary. ``16 <= qk_head_dim <= 256``,
        ``v_head_dim <= 256``.
    cu_seqlens_q, cu_seqlens_k : int32 [num_seqs + 1], same device
        Sequence ``s`` owns queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys
        ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; ``cu_seqlens_q[-1] == Tq``, ``cu_seqlens_k[-1] <=
        Tk``. Not validated on the device (that would need a sync).
    max_seqlen_q : int
        Host int, an upper bound of every sequence's query count; sizes the grid only. A
        sequence longer than it has its later query rows left unwritten.
    causal : bool
        Query ``i`` of a sequence attends keys ``0..i`` (top-left; equal lengths per sequence).
    softmax_scale : float, > 0
    config : AttentionConfig, optional
        Tiles and launch options of the Triton kernel. None (the default): on an sm_90 GPU, for
        MLA's head dims (qk 192 as 128 + 64, v 128) in bf16 / fp16 with 16-byte aligned key and
        value strides, the warp-specialized Gluon kernel of
        :mod:`mlaprefill.kernels.hopper_attention` (same contract; its ``unsupported_reason``
        says why a call does not qualify); otherwise the Triton kernel with
        :func:`default_config`. A config always runs the Triton kernel.
    dense : tuple of ``(seq_lo, seq_hi, q_rows, k_rows)``, at most :data:`MAX_DENSE_BLOCKS`
        Rectangles computed by another kernel: for each sequence in ``[seq_lo, seq_hi)``, query
        rows ``[0, q_rows)`` skip keys ``[0, k_rows)`` here (``q_rows`` a multiple of the
        config's ``block_m``, ``k_rows`` of its ``block_n``, both within each sequence: host
        ints, checked against nothing on the device). Those rows' results cover the other keys
        only (``lse = -inf``, ``out = 0`` when there are none); the caller merges the
        rectangle's in.
    k_rope : [Tk, rope] or [Tk, H, rope], optional
        The keys' last ``rope`` dims apart from ``k`` (then ``k`` is ``[Tk, H, qk_head_dim -
        rope]``, a power of two >= 16): MLA's rope key is one row shared by every head, read
        here with head stride 0, so nobody has to copy it into every head's key.
    state : ``(out [Tq, H, v_head_dim], lse float32 [Tq, H])``, optional
        A running result to merge this call's into, in place, by LSE (the rules of
        :func:`mlaprefill.kernels.merge.merge_attention_states`), instead of new tensors: no
        separate merge pass. Rows with no key in this call are not touched (merging nothing is
        the identity), so a rectangle left to another kernel costs no write here.
    out : ``(out [Tq, H, v_head_dim], lse float32 [Tq, H])``, optional
        Tensors to write the result into instead of new ones (overwritten, not merged: not
        with ``state``); a caller's static buffers, e.g. a CUDA graph's. Rows of no sequence
        hold anything afterwards, as in new tensors.

    Returns
    -------
    out : [Tq, H, v_head_dim], q's dtype; lse : float32 [Tq, H], natural log (``state``'s or
    ``out``'s tensors when given, else new contiguous ones)

    A sequence without keys gives ``out = 0, lse = -inf``; a non-finite input gives NaN only in
    its own sequence's rows. Never synchronizes (the grid comes from host ints only); CUDA-graph
    safe. Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if not HAS_TRITON:
        raise RuntimeError("varlen_attention needs Triton: pip install triton")
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, k_rope)
    cfg = default_config(causal=causal, max_seqlen_q=max_seqlen_q) if config is None else config
    dense_args = _dense_args(dense, cfg, cu_seqlens_q.shape[0] - 1)
    d1, rope, stride_pt, stride_ph = _key_parts(k, k_rope)
    d2 = q.shape[2] - d1
    if cfg.tma:
        parts = [("k", k, k.stride()[:2]), ("v", v, v.stride()[:2])]
        if d2:
            parts.append(("k_rope" if k_rope is not None else "k's rope part", rope,
                          (stride_pt, stride_ph)))
        _check_tma(parts)
        ensure_allocator()
    v_dim = v.shape[2]
    if state is not None and out is not None:
        raise ValueError("pass state= (merge into a running result) or out= (overwrite), not "
                         "both")
    if state is not None:
        state = _check_state(state, q, v_dim)
    if out is not None:
        out = _check_state(out, q, v_dim, "out")
    if not use_triton(q):
        raise ValueError(f"varlen_attention runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got device {q.device}; on CPU use the 'math' "
                         f"backend")
    num_tokens_q, num_heads = q.shape[:2]
    if state is not None:
        out, lse = state
    elif out is not None:
        out, lse = out
    else:
        out = torch.empty(num_tokens_q, num_heads, v_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(num_tokens_q, num_heads, dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_tokens_q == 0 or num_heads == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0:
        # No keys at all: every sequence is empty. Filled here rather than launched, because an
        # empty tensor may have a null data pointer that Triton's launcher rejects.
        if state is None:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    if config is None and hopper_attention.unsupported_reason(
            q, k, v, k_rope, dense, causal=causal, accumulate=state is not None) is None \
            and hopper_attention.hopper_attention(
                q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                max_seqlen_q=max_seqlen_q, causal=causal, softmax_scale=softmax_scale,
                dense_args=dense_args, k_rope=k_rope, out=out, lse=lse,
                accumulate=state is not None):
        return out, lse
    grid = (cdiv(max_seqlen_q, cfg.block_m), num_seqs, num_heads)
    _varlen_attention_kernel[grid](
        q, k, rope, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
        softmax_scale * _LOG2E, *dense_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), stride_pt, stride_ph,
        v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        CAUSAL=bool(causal), ACCUMULATE=state is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, D1=d1, D2=d2, BLOCK_D2=pow2_at_least_16(d2) if d2 else 16,
        DV=v_dim, BLOCK_DV=pow2_at_least_16(v_dim), TMA=cfg.tma, WS=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
