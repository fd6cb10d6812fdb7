"""Opt-in FP8 (e4m3) context attention, with LSE (Triton; Hopper's FP8 tensor cores).

The bf16 path's contract (:func:`~mlaprefill.kernels.attention.varlen_attention`) for the
*context* part of MLA prefill (non-causal: every query of a sequence over every key of its chunk),
with both matrix products in ``float8_e4m3fn`` and float32 accumulators::

    q8[t, h] = round(q[t, h] / sq[t, h])      sq[t, h] = amax(|q[t, h]|) / 448  (per row)
    k8, p8   = round(k_nope / sk), round(k_pe / sk)    sk = amax(|k_nope|, |k_pe|) / 448
    v8       = round(v / sv)                           sv = amax(|v|) / 448   (per chunk)
    score[t, j] = sq[t] * sk * (q8_nope . k8[j] + q8_pe . p8[j])
    out[t]      = sv * sum_j round(448 * p[t, j]) v8[j] / (448 * sum_j p[t, j])

e4m3 is a floating-point format (3 mantissa bits over a 2^15 range of normal values), so one
scale per chunk for K and one for V lose no precision against per-token scales unless values
span more than that range; they keep the inner loop free of per-key scale loads and multiplies.
The amaxes are taken over finite values only, on the device (an atomic max per tile), so a
non-finite value in one sequence changes no other sequence's scale. The probabilities are
rounded as ``448 * p`` (``p <= 1``: e4m3's whole range, folded into the exponent's offset for
free) and the row sum divides it out. LSE is float32, natural log.

Layouts (what Hopper's FP8 MMA wants: both operands K-major): K as ``k8 [Tk, H, 128]``, the
rope key ``p8 [Tk, 64]``, and V transposed, ``vt8 [H, 128, Tk_pad]`` (keys contiguous), written by
the up-projection's epilogue (:func:`~mlaprefill.kernels.fp8_upproj.upproject_fp8`: what the
``mlaprefill-fp8`` forward runs) or by :func:`quantize_context` from bf16 keys and values (a max
pass, then one pass that reads each value once and writes one byte). On an sm_90 GPU at MLA's
head dims the kernel is the warp-specialized Gluon one
(:mod:`~mlaprefill.kernels.hopper_fp8_attention`), same contract; elsewhere, or with ``config=``,
the Triton kernel below. K, rope and V^T tiles are loaded through device-side
tensor descriptors; key blocks start at multiples of 16 in the packed order, so a V^T tile is
16-byte aligned whatever the sequence's first key.

NaN and empty rows: keys outside a sequence are masked (scores ``-inf`` by ``where``; V columns
zeroed by ``where`` in the blocks that hold the sequence's ends), so a non-finite value reaches
only its own sequence's rows; a query with no keys gives ``out = 0, lse = -inf``; a row whose
softmax sum is 0 or whose LSE is ``+inf`` is NaN. One rule differs from the bf16 kernel: a NaN or
inf is stored as e4m3's NaN (e4m3fn has no inf), so a key or value holding one makes NaN every
row of its sequence that reads it (a query: its own row), also where the bf16 path's score
would be ``-inf`` and its row finite. With ``state`` the epilogue merges into a running ``(out,
lse)`` by the rules of :mod:`mlaprefill.kernels.merge`.

Accuracy and speed against the bf16 kernel and cuDNN: benchmarks/fp8_attention.py (H200 numbers
in docs/RESULTS.md). Causal attention (the new tokens over themselves) stays in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlaprefill.kernels import hopper_fp8_attention as hopper_fp8
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

__all__ = ["FP8_MAX", "FP8AttentionConfig", "FP8Context", "fp8_context_attention",
           "quantize_context", "quantize_rows"]

#: Largest finite ``float8_e4m3fn`` value: a row's largest magnitude maps to it.
FP8_MAX = 448.0
_LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class FP8AttentionConfig:
    """Tiles and launch options of :func:`fp8_context_attention` (powers of two >= 16)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tiles("FP8AttentionConfig", self.block_m, self.block_n, self.num_warps,
                    self.num_stages)


@dataclass(frozen=True, slots=True)
class FP8Context:
    """One chunk's keys and values in e4m3 (:func:`quantize_context`).

    ``k8 [Tk, H, nope]`` and ``p8 [Tk, rope]`` (the rope key, shared by every head) with the
    scale ``bound[0] / 448``; ``vt8 [H, v, Tk_pad]`` (V transposed, ``Tk_pad`` = ``Tk`` rounded
    up to 16 so every row is 16-byte aligned; the padding columns unwritten) with ``bound[1] /
    448``. ``bound`` float32 ``[2]`` on the device: bounds of the finite magnitudes of K (nope
    and rope) and of V (0 for none: scale 1): the amaxes themselves from
    :func:`quantize_context`, upper bounds of them from
    :func:`~mlaprefill.kernels.fp8_upproj.upproject_fp8`.
    """

    k8: torch.Tensor
    p8: torch.Tensor
    vt8: torch.Tensor
    bound: torch.Tensor

    @property
    def num_keys(self) -> int:
        return self.k8.shape[0]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_nope, k_rope, v)`` in float64 as the kernel sees them (tests, accuracy)."""
        bound = self.bound.double()
        s = torch.where(bound > 0, bound.float() / 448, 1.0).double()
        n = self.num_keys
        return (self.k8.double() * s[0], self.p8.double() * s[0],
                self.vt8[:, :, :n].permute(2, 0, 1).double() * s[1])


if HAS_TRITON:
    from mlaprefill.kernels.merge import merge_rows  # the epilogue merge: one definition

    @triton.jit
    def _to_e4m3(x, ROUND: tl.constexpr):
        # ROUND (the CPU interpreter only): round to e4m3's grid in float32 first, to nearest
        # even, so the cast below is exact; Triton's interpreter rounds some values wrongly
        # (126.8 -> 64: a carry into the exponent is lost). On the GPU the cast rounds itself.
        if ROUND:
            mag = tl.abs(x)
            e = tl.floor(tl.log2(tl.where(mag > 0, mag, 1.0)))
            ulp = tl.exp2(tl.maximum(e, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2^-6
            z = x / ulp
            r = tl.floor(z + 0.5)
            r = tl.where((r - z == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
            res = r * ulp
            x = tl.where(mag > 0, tl.where(res == 0, x * 0.0, res), x)  # x * 0: keeps -0's sign
        return x.to(tl.float8e4nv)

    @triton.jit
    def _amax_kernel(
        x_ptr,              # [T, H, D] (any float dtype), last dim contiguous
        amax_ptr,           # float32 [1]: atomically raised to the largest finite |x|
        valid_ptr,          # HAS_VALID: int32, rows at and past it are padding (left out)
        num_rows, stride_xt, stride_xh,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, HAS_VALID: tl.constexpr,
    ):
        if HAS_VALID:
            num_rows = tl.minimum(num_rows, tl.load(valid_ptr))
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        ok = (rows < num_rows)[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xt + head * stride_xh
                    + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mag = tl.abs(x)
        mag = tl.where(mag < float("inf"), mag, 0.0)  # finite values only (False for NaN)
        tl.atomic_max(amax_ptr, tl.max(tl.max(mag, 1), 0))

    @triton.jit
    def _quantize_kernel(
        x_ptr,              # [T, H, D] (any float dtype), last dim contiguous
        y_ptr,              # float8_e4m3fn [T, H, D] contiguous     (TRANSPOSED: [H, D, T_pad])
        s_ptr,              # PER_ROW: float32 [T, H] scales out; else float32 [1] amax in
        num_rows,           # T
        num_heads,
        stride_xt, stride_xh,
        stride_yt,          # TRANSPOSED: T_pad
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        PER_ROW: tl.constexpr,     # one scale per [token, head] row (the queries)
        TRANSPOSED: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        ok = (rows < num_rows)[:, None] & (cols < D)[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * stride_xt + head * stride_xh + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")  # False for NaN
        if PER_ROW:
            # A row holding NaN or inf gets a NaN scale, which its scores then carry.
            amax = tl.max(tl.abs(x), 1)
            row_ok = tl.max(tl.where(finite, 0, 1), 1) == 0
            scale = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
            tl.store(s_ptr + r64 * num_heads + head, tl.where(row_ok, scale, float("nan")),
                     mask=rows < num_rows)
            inv = tl.where(amax > 0, tl.div_rn(448.0, tl.where(amax > 0, amax, 1.0)), 1.0)
            y = x * inv[:, None]
        else:
            amax = tl.load(s_ptr)
            y = x * tl.where(amax > 0, tl.div_rn(448.0, tl.where(amax > 0, amax, 1.0)), 1.0)
        # |y| <= 448 up to rounding: clamp; NaN and inf are stored as e4m3's NaN.
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
        y = tl.where(finite, y, float("nan"))
        y8 = _to_e4m3(y, ROUND)
        if TRANSPOSED:
            tl.store(y_ptr + head * D * stride_yt + cols[None, :].to(tl.int64) * stride_yt
                     + r64[:, None], y8, mask=ok)
        else:
            tl.store(y_ptr + (r64[:, None] * num_heads + head) * D + cols[None, :], y8, mask=ok)

    @triton.jit
    def _fp8_loop(
        acc, l_i, m_i,          # running state: fp32 [BLOCK_M, DV], [BLOCK_M], [BLOCK_M]
        q1, q2, qf,             # e4m3 queries [BLOCK_M, D1], [BLOCK_M, D2]; fp32 row factor
        k_desc, p_desc, v_desc,
        head,
        lo, hi,                 # key blocks [lo, hi) in steps of BLOCK_N (packed key order)
        k_start, k_end,         # the sequence's keys
        MASKED: tl.constexpr,   # False: every block lies inside [k_start, k_end)
        BLOCK_N: tl.constexpr, D1: tl.constexpr, DV: tl.constexpr, ROUND: tl.constexpr,
    ):
        offs_n = tl.arange(0, BLOCK_N)
        for key in tl.range(lo, hi, BLOCK_N):
            k1 = k_desc.load([key, head * D1])
            qk = tl.dot(q1, tl.trans(k1))
            k2 = p_desc.load([key, 0])
            qk = tl.dot(q2, tl.trans(k2), acc=qk)
            if MASKED:  # another sequence's keys, or past the tensor: -inf by where
                n_ok = (key + offs_n >= k_start) & (key + offs_n < k_end)
                qk = tl.where(n_ok[None, :], qk, float("-inf"))
            # qf > 0 per row, so max(qk) * qf == max(qk * qf).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qf)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            # 448 * p: e4m3's whole range for the rounding below (log2(448) in the offset).
            p = tl.exp2(qk * qf[:, None] - (m_safe - 8.807354922057604)[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = v_desc.load([head * DV, key])
            if MASKED:  # another sequence's NaN times p = 0 would be NaN: zero those columns
                vt = tl.where(n_ok[None, :], vt, tl.zeros_like(vt))
            acc = tl.dot(_to_e4m3(p, ROUND), tl.trans(vt), acc=acc * alpha[:, None])
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _fp8_attention_kernel(
        q_ptr,              # e4m3 [Tq, H, D1 + D2] contiguous
        qs_ptr,             # float32 [Tq, H]
        k_ptr,              # e4m3 [Tk, H, D1] contiguous
        p_ptr,              # e4m3 [Tk, D2] contiguous (one rope key for every head)
        vt_ptr,             # e4m3 [H, DV, Tk_pad] contiguous
        bound_ptr,          # float32 [2]: K's and V's bounds (FP8Context.bound)
        out_ptr,            # [Tq, H, DV] (ACCUMULATE: the running output)
        lse_ptr,            # float32 [Tq, H] (ACCUMULATE: the running LSE)
        cu_seqlens_q_ptr,
        cu_seqlens_k_ptr,
        qk_scale,           # softmax_scale * log2(e)
        num_heads,
        num_keys,           # Tk
        keys_pad,           # Tk_pad
        stride_ot, stride_oh,
        stride_lt, stride_lh,
        ACCUMULATE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        D1: tl.constexpr,
        D2: tl.constexpr,
        DV: tl.constexpr,
        ROUND: tl.constexpr,
    ):
        m_block = tl.program_id(0)
        seq = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        seqlen_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        m0 = m_block * BLOCK_M
        if m0 >= seqlen_q:
            return
        k_start = tl.load(cu_seqlens_k_ptr + seq)
        seqlen_k = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
        rows = tl.arange(0, BLOCK_M)
        m_ok = (m0 + rows) < seqlen_q
        offs_dv = tl.arange(0, DV)
        head64 = head.to(tl.int64)
        t64 = (q_start + m0).to(tl.int64) + rows
        o_ptrs = out_ptr + t64[:, None] * stride_ot + head64 * stride_oh + offs_dv[None, :]
        l_ptrs = lse_ptr + t64 * stride_lt + head64 * stride_lh
        if seqlen_k <= 0:
            if not ACCUMULATE:
                tl.store(o_ptrs, tl.zeros([BLOCK_M, DV], dtype=out_ptr.dtype.element_ty),
                         mask=m_ok[:, None])
                tl.store(l_ptrs, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=m_ok)
            return

        width = D1 + D2
        q_rows = q_ptr + (t64 * num_heads + head64) * width
        q1 = tl.load(q_rows[:, None] + tl.arange(0, D1)[None, :], mask=m_ok[:, None], other=0.0)
        q2 = tl.load(q_rows[:, None] + (D1 + tl.arange(0, D2))[None, :], mask=m_ok[:, None],
                     other=0.0)
        bound_k = tl.load(bound_ptr)
        bound_v = tl.load(bound_ptr + 1)
        sk = tl.where(bound_k > 0, tl.div_rn(bound_k, 448.0), 1.0)
        sv = tl.where(bound_v > 0, tl.div_rn(bound_v, 448.0), 1.0)
        # The query's scale, K's and the softmax scale in one per-row factor (> 0 or NaN).
        qf = tl.load(qs_ptr + t64 * num_heads + head64, mask=m_ok, other=1.0) * (sk * qk_scale)

        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[num_keys, num_heads * D1],
                                           strides=[num_heads * D1, 1], block_shape=[BLOCK_N, D1])
        p_desc = tl.make_tensor_descriptor(p_ptr, shape=[num_keys, D2], strides=[D2, 1],
                                           block_shape=[BLOCK_N, D2])
        v_desc = tl.make_tensor_descriptor(vt_ptr, shape=[num_heads * DV, keys_pad],
                                           strides=[keys_pad, 1], block_shape=[DV, BLOCK_N])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
        # Key blocks start at multiples of 16 in the packed key order (V^T's tiles then start
        # 16-byte aligned, as its descriptor wants): a first block that starts before the
        # sequence's first key, and the last block where it passes its end, are masked; the
        # blocks between need no mask.
        k_end = k_start + seqlen_k
        a0 = (k_start // 16) * 16
        mid = tl.where(a0 < k_start, a0 + BLOCK_N, a0)
        tail = mid + tl.maximum(k_end - mid, 0) // BLOCK_N * BLOCK_N
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, head, a0,
                                  tl.where(a0 < k_start, a0 + 1, a0), k_start, k_end, True,
                                  BLOCK_N, D1, DV, ROUND)
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, head, mid,
                                  tail, k_start, k_end, False, BLOCK_N, D1, DV, ROUND)
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, head, tail,
                                  k_end, k_start, k_end, True, BLOCK_N, D1, DV, ROUND)

        # l_i and acc both hold 448 * p: the output divides it out, the LSE subtracts log2(448).
        lse2 = m_i + tl.log2(l_i) - 8.807354922057604
        bad = (l_i == 0.0) | (lse2 == float("inf"))
        o = acc * (sv / l_i)[:, None]
        o = tl.where(bad[:, None], float("nan"), o)
        lse = tl.where(bad, float("nan"), lse2 * 0.6931471805599453)
        if ACCUMULATE:
            l1 = tl.load(l_ptrs, mask=m_ok, other=float("-inf"))
            o1 = tl.load(o_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
            o, lse = merge_rows(l1, o1, lse, o)
            tl.debug_barrier()
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(l_ptrs, lse, mask=m_ok)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"{name} must be [T, H, D] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if not x.dtype.is_floating_point or x.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{name} must hold float values to quantize, got {x.dtype}")


def _quantize(x: torch.Tensor, y: torch.Tensor, scales: torch.Tensor, stride_yt: int, *,
              per_row: bool, transposed: bool) -> None:
    t, h, d = x.shape
    if t == 0 or h == 0:
        return
    if not use_triton(x):
        raise ValueError(f"the FP8 quantizing pass runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got {x.device}")
    block_t = 32 if transposed else 16
    _quantize_kernel[(cdiv(t, block_t), h)](
        x, y, scales, t, h, x.stride(0), x.stride(1), stride_yt, D=d, BLOCK_D=pow2_at_least_16(d),
        BLOCK_T=block_t, PER_ROW=per_row, TRANSPOSED=transposed, ROUND=x.device.type == "cpu",
        num_warps=4)


def _amax(x: torch.Tensor, out: torch.Tensor, valid_rows: torch.Tensor | None) -> None:
    t, h, d = x.shape
    if t and h:
        _amax_kernel[(cdiv(t, 64), h)](x, out, valid_rows, t, x.stride(0), x.stride(1), D=d,
                                       BLOCK_D=pow2_at_least_16(d), BLOCK_T=64,
                                       HAS_VALID=valid_rows is not None, num_warps=4)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one float32 scale per ``[token, head]`` row of ``x [T, H, D]`` (the
    queries).

    Returns ``(y [T, H, D], scale [T, H])``, ``scale = amax / 448`` of the row (1 for an all-zero
    row, NaN for a row holding NaN or inf): ``y * scale`` approximates ``x``. One launch;
    never synchronizes.
    """
    _check_rows(x, "x")
    t, h, d = x.shape
    y = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, h, dtype=torch.float32, device=x.device)
    _quantize(x, y, scale, h * d, per_row=True, transposed=False)
    return y, scale


def quantize_context(k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor, *,
                     valid_rows: torch.Tensor | None = None) -> FP8Context:
    """Quantize one chunk's keys and values for :func:`fp8_context_attention`.

    ``k_nope [Tk, H, nope]``, ``v [Tk, H, v]`` (e.g. the two views of the up-projection's
    split-key output), ``k_rope [Tk, rope]`` (shared by every head); any float dtype, last dims
    contiguous, any other strides. ``valid_rows`` (an int32 tensor of one element on the
    device, optional): rows at and past it are padding, left out of the amaxes (a CUDA graph's
    row bucket; e.g. the attention's ``cu_seqlens_k[-1:]``). Seven launches on the device (a
    zero fill, the amaxes of K and V over finite values, then one pass per tensor that reads it
    once); never synchronizes.
    """
    _check_rows(k_nope, "k_nope")
    _check_rows(v, "v")
    if k_rope.dim() != 2 or k_rope.shape[0] != k_nope.shape[0] or k_rope.stride(1) != 1:
        raise ValueError(f"k_rope must be [Tk, rope] with Tk = {k_nope.shape[0]} and a "
                         f"contiguous last dim, got {tuple(k_rope.shape)}")
    if v.shape[:2] != k_nope.shape[:2]:
        raise ValueError(f"v {tuple(v.shape)} and k_nope {tuple(k_nope.shape)} must share [Tk, H]")
    t, h = k_nope.shape[:2]
    device = k_nope.device
    amax = torch.zeros(2, dtype=torch.float32, device=device)
    rope = k_rope.unsqueeze(1)
    if t and not use_triton(k_nope):  # (no heads: the rope key is still quantized)
        raise ValueError(f"quantize_context runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got {device}")
    if valid_rows is not None and (valid_rows.numel() != 1 or valid_rows.dtype != torch.int32
                                   or valid_rows.device != device):
        raise ValueError(f"valid_rows must be an int32 tensor of one element on {device}, got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)} on {valid_rows.device}")
    _amax(k_nope, amax[0:1], valid_rows)
    _amax(rope, amax[0:1], valid_rows)
    _amax(v, amax[1:2], valid_rows)
    k8 = torch.empty(t, h, k_nope.shape[2], dtype=torch.float8_e4m3fn, device=device)
    p8 = torch.empty(t, 1, k_rope.shape[1], dtype=torch.float8_e4m3fn, device=device)
    pad = -(-t // 16) * 16
    vt8 = torch.empty(h, v.shape[2], pad, dtype=torch.float8_e4m3fn, device=device)
    _quantize(k_nope, k8, amax[0:1], h * k8.shape[2], per_row=False, transposed=False)
    _quantize(rope, p8, amax[0:1], p8.shape[2], per_row=False, transposed=False)
    _quantize(v, vt8, amax[1:2], pad, per_row=False, transposed=True)
    return FP8Context(k8, p8.view(t, k_rope.shape[1]), vt8, amax)


def fp8_context_attention(q8: torch.Tensor, q_scale: torch.Tensor, ctx: FP8Context,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                          max_seqlen_q: int, softmax_scale: float,
                          state: tuple[torch.Tensor, torch.Tensor] | None = None,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None,
                          out_dtype: torch.dtype = torch.bfloat16,
                          config: FP8AttentionConfig | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of a packed varlen batch in FP8, with LSE (one launch).

    Parameters
    ----------
    q8 : float8_e4m3fn [Tq, H, nope + rope] contiguous; q_scale : float32 [Tq, H]
        :func:`quantize_rows` of the queries.
    ctx : FP8Context
        :func:`quantize_context` of the keys (``nope`` and ``v`` 16..256, powers of two; rope a
        power of two >= 16).
    cu_seqlens_q, cu_seqlens_k : int32 [num_seqs + 1]
        As in :func:`~mlaprefill.kernels.attention.varlen_attention`.
    max_seqlen_q : host int; softmax_scale : float > 0
    state : ``(out [Tq, H, v], lse float32 [Tq, H])``, optional
        Merged into in place by LSE.
    out : ``(out, lse)`` as ``state``, optional
        Overwritten instead (not with ``state``). Neither: new tensors, ``out`` of ``out_dtype``.
    config : FP8AttentionConfig, optional
        The Triton kernel's tiles. None: on an sm_90 GPU at MLA's head dims the warp-specialized
        Gluon kernel (:mod:`~mlaprefill.kernels.hopper_fp8_attention`, same contract), else the
        Triton kernel with the default tiles; given: the Triton kernel with these.

    Returns ``(out [Tq, H, v], lse float32 [Tq, H])``, natural-log LSE.
    """
    if not HAS_TRITON:
        raise RuntimeError("fp8_context_attention needs Triton: pip install triton")
    cfg = config or FP8AttentionConfig()
    if q8.dim() != 3:
        raise ValueError(f"q8 must be float8_e4m3fn [Tq, H, nope + rope], got shape "
                         f"{tuple(q8.shape)}")
    if ctx.k8.dim() != 3 or ctx.p8.dim() != 2 or ctx.vt8.dim() != 3 or ctx.bound.shape != (2,):
        raise ValueError("ctx must come from quantize_context: k8 [Tk, H, nope], p8 [Tk, rope], "
                         "vt8 [H, v, Tk_pad], bound [2]")
    tq, h, width = q8.shape
    nope, rope, dv = ctx.k8.shape[2], ctx.p8.shape[1], ctx.vt8.shape[1]
    for name, dim in (("nope", nope), ("rope", rope), ("v", dv)):
        if dim < 16 or dim > 256 or dim & (dim - 1):
            raise ValueError(f"fp8_context_attention needs the {name} head dim a power of two in "
                             f"[16, 256], got {dim}")
    if q8.dtype != torch.float8_e4m3fn or not q8.is_contiguous() or width != nope + rope:
        raise ValueError(f"q8 must be contiguous float8_e4m3fn [Tq, H, {nope + rope}], got "
                         f"{q8.dtype} {tuple(q8.shape)}")
    if ctx.k8.shape[1] != h or tuple(q_scale.shape) != (tq, h):
        raise ValueError(f"heads differ: q8 {tuple(q8.shape)}, q_scale {tuple(q_scale.shape)}, "
                         f"k8 {tuple(ctx.k8.shape)}")
    if q_scale.dtype != torch.float32:
        raise ValueError(f"q_scale must be float32 [Tq, H] (quantize_rows), got {q_scale.dtype}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be int32 [num_seqs + 1], got {cu.dtype} "
                             f"{tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k "
                         f"{tuple(cu_seqlens_k.shape)} must both be [num_seqs + 1]")
    devices = {t.device for t in (q8, q_scale, ctx.k8, ctx.p8, ctx.vt8, ctx.bound, cu_seqlens_q,
                                  cu_seqlens_k)}
    if len(devices) != 1:
        raise ValueError(f"q8, q_scale, ctx and the offsets must share one device, got {devices}")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be a host int >= 0, got {max_seqlen_q!r:.40}")
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
            and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    if state is not None and out is not None:
        raise ValueError("pass state= (merge into a running result) or out= (overwrite), not "
                         "both")
    if state is not None or out is not None:
        given = state if state is not None else out
        name = "state" if state is not None else "out"
        if not (isinstance(given, tuple) and len(given) == 2
                and all(isinstance(t, torch.Tensor) for t in given)):
            raise TypeError(f"{name} must be a tuple (out, lse) of tensors, got "
                            f"{type(given).__name__}")
        out, lse = given
        if (tuple(out.shape) != (tq, h, dv) or not out.dtype.is_floating_point
                or out.dtype == torch.float8_e4m3fn or out.stride(2) != 1
                or tuple(lse.shape) != (tq, h) or lse.dtype != torch.float32
                or out.device != q8.device or lse.device != q8.device):
            raise ValueError(f"{name} must be (out [Tq, H, v] = {(tq, h, dv)} float, last dim "
                             f"contiguous; lse float32 [Tq, H]) on {q8.device}, got "
                             f"{tuple(out.shape)} {out.dtype} and {tuple(lse.shape)} {lse.dtype}")
    else:
        out = torch.empty(tq, h, dv, dtype=out_dtype, device=q8.device)
        lse = torch.empty(tq, h, dtype=torch.float32, device=q8.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if tq == 0 or h == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out, lse
    if ctx.num_keys == 0:
        if state is None:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    if not use_triton(q8):
        raise ValueError(f"fp8_context_attention runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got {q8.device}")
    if config is None and hopper_fp8.unsupported_reason(q8, ctx.k8, ctx.p8, ctx.vt8, out) is None \
            and hopper_fp8.hopper_fp8_attention(
                q8, q_scale, ctx.k8, ctx.p8, ctx.vt8, ctx.bound, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale, out=out, lse=lse,
                accumulate=state is not None):
        return out, lse
    ensure_allocator()
    grid = (cdiv(max_seqlen_q, cfg.block_m), num_seqs, h)
    _fp8_attention_kernel[grid](
        q8, q_scale, ctx.k8, ctx.p8, ctx.vt8, ctx.bound, out, lse,
        cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E, h, ctx.num_keys, ctx.vt8.shape[2],
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        ACCUMULATE=state is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D1=nope,
        D2=rope, DV=dv, ROUND=q8.device.type == "cpu", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out, lse
