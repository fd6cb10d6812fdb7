"""Opt-in FP8 (e4m3) context attention, with LSE (Triton; Hopper's FP8 tensor cores).

The bf16 path's contract (:func:`~mlaprefill.kernels.attention.varlen_attention`) for the
*context* part of MLA prefill (non-causal: every query of a sequence over every key of its chunk),
with the matrix products in ``float8_e4m3fn``::

    q8[t, h] = round(q[t, h] / sq[t, h])          sq = amax(|q[t, h]|) / 448   (192 values)
    k8[j, h] = round(k_nope[j, h] / sk[j, h])     sk = amax(|k_nope[j, h]|) / 448  (128)
    p8[j]    = round(k_pe[j] / sp[j])             sp = amax(|k_pe[j]|) / 448    (64, all heads)
    v8[j, h] = round(v[j, h] / sv[j, h])          sv = amax(|v[j, h]|) / 448    (128)

    score[t, j] = sq[t] * (sk[j] * q8_nope . k8[j] + sp[j] * q8_pe . p8[j])  (fp32 accumulators)

Scales are per token and head (per token for the shared rope key), float32, computed on the
device in the quantizing pass: an outlier token costs precision only in its own row, and no
pass over the whole tensor is needed first (no global amax). The softmax runs in float32 as
in the bf16 kernel; the probabilities of one key block are scaled by ``sv[j] / max(sv)`` over
the block (in ``[0, 1]``), rounded to e4m3 for the ``P V`` product, and the block's product is
multiplied back by ``max(sv)``. LSE is float32, natural log.

Layouts (what Hopper's FP8 MMA wants: both operands K-major): K as ``k8 [Tk, H, 128]``, the
rope key ``p8 [Tk, 64]``, and V transposed, ``vt8 [H, 128, Tk]`` (keys contiguous), all written
by :func:`quantize_context` in one pass over the up-projection's bf16 output (it reads each
value once and writes one byte; no full-size copy in between). K, rope and V^T tiles are
loaded through device-side tensor descriptors, so a sequence may start at any key offset.

NaN and empty rows: keys outside a sequence are masked (scores ``-inf`` by ``where``; V columns
zeroed by ``where`` in the blocks that hold the sequence's ends), so a non-finite value reaches
only its own sequence's rows; a query with no keys gives ``out = 0, lse = -inf``; a row whose
softmax sum is 0 or whose LSE is ``+inf`` is NaN. One rule differs from the bf16 kernel: a NaN or
inf in a query, key or value row makes that row's scale NaN, so every row of its sequence (for a
query: that row) that reads it is NaN, also where the bf16 path's score would be ``-inf`` and its
row finite. With ``state``
the epilogue merges into a running ``(out, lse)`` by the rules of :mod:`mlaprefill.kernels.merge`.

Accuracy and speed against the bf16 kernel and cuDNN: benchmarks/fp8_attention.py (H200 numbers
in docs/RESULTS.md). Causal attention (the new tokens over themselves) stays in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlaprefill.kernels._triton import HAS_TRITON, cdiv, ensure_allocator, tl, triton, use_triton

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
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"FP8AttentionConfig.{name} must be a power of two >= 16, got "
                                 f"{value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FP8AttentionConfig.num_warps must be 1, 2, 4, 8 or 16, got "
                             f"{self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"FP8AttentionConfig.num_stages must be an int >= 1, got "
                             f"{self.num_stages!r}")

    @property
    def name(self) -> str:
        return f"m{self.block_m}_n{self.block_n}_w{self.num_warps}_s{self.num_stages}"


@dataclass(frozen=True, slots=True)
class FP8Context:
    """One chunk's keys and values in e4m3 with their scales (:func:`quantize_context`).

    ``k8 [Tk, H, nope]``, ``k_scale float32 [Tk, H]``; ``p8 [Tk, rope]``, ``p_scale float32
    [Tk]``; ``vt8 [H, v, Tk_pad]`` (V transposed, ``Tk_pad`` = ``Tk`` rounded up to 16 so every
    row is 16-byte aligned), ``v_scale float32 [Tk, H]``.
    """

    k8: torch.Tensor
    k_scale: torch.Tensor
    p8: torch.Tensor
    p_scale: torch.Tensor
    vt8: torch.Tensor
    v_scale: torch.Tensor

    @property
    def num_keys(self) -> int:
        return self.k8.shape[0]


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
            x = tl.where(mag > 0, r * ulp, x)
        return x.to(tl.float8e4nv)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,              # [T, H, D] (any float dtype), last dim contiguous
        y_ptr,              # float8_e4m3fn [T, H, D] contiguous     (TRANSPOSED: [H, D, T_pad])
        s_ptr,              # float32 [T, H] contiguous
        num_rows,           # T
        num_heads,
        stride_xt, stride_xh,
        stride_yt,          # TRANSPOSED: T_pad
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
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
        # amax of each row. A NaN or inf anywhere in the row makes its scale NaN (max ignores
        # NaN in some lowerings, so that is checked apart), which every score or product of the
        # row then carries: its sequence's rows become NaN, no other's.
        amax = tl.max(tl.abs(x), 1)
        finite = tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), 1) == 0  # False for NaN too
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        scale = tl.where(finite, scale, float("nan"))
        y = x * (448.0 / tl.where(amax > 0, amax, 448.0))[:, None]
        # |y| <= 448 up to the division's rounding: clamp (a comparison is False for NaN, which
        # stays NaN).
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
        y8 = _to_e4m3(y, ROUND)
        if TRANSPOSED:
            tl.store(y_ptr + head * D * stride_yt + cols[None, :].to(tl.int64) * stride_yt
                     + r64[:, None], y8, mask=ok)
        else:
            tl.store(y_ptr + (r64[:, None] * num_heads + head) * D + cols[None, :], y8, mask=ok)
        tl.store(s_ptr + r64 * num_heads + head, scale, mask=rows < num_rows)

    @triton.jit
    def _fp8_loop(
        acc, l_i, m_i,          # running state: fp32 [BLOCK_M, DV], [BLOCK_M], [BLOCK_M]
        q1, q2, qf,             # e4m3 queries [BLOCK_M, D1], [BLOCK_M, D2]; fp32 row factor
        k_desc, p_desc, v_desc,
        ks_ptr, ps_ptr, vs_ptr,
        num_heads, head,
        lo, hi,                 # key blocks [lo, hi) in steps of BLOCK_N (packed key order)
        k_start, k_end,         # the sequence's keys
        MASKED: tl.constexpr,   # False: every block lies inside [k_start, k_end)
        BLOCK_N: tl.constexpr, D1: tl.constexpr, DV: tl.constexpr, ROUND: tl.constexpr,
    ):
        offs_n = tl.arange(0, BLOCK_N)
        head64 = head.to(tl.int64)
        for key in tl.range(lo, hi, BLOCK_N):
            kidx = (key + offs_n).to(tl.int64)
            if MASKED:
                n_ok = (key + offs_n >= k_start) & (key + offs_n < k_end)
                ks = tl.load(ks_ptr + kidx * num_heads + head64, mask=n_ok, other=0.0)
                ps = tl.load(ps_ptr + kidx, mask=n_ok, other=0.0)
                vs = tl.load(vs_ptr + kidx * num_heads + head64, mask=n_ok, other=0.0)
            else:
                ks = tl.load(ks_ptr + kidx * num_heads + head64)
                ps = tl.load(ps_ptr + kidx)
                vs = tl.load(vs_ptr + kidx * num_heads + head64)
            k1 = k_desc.load([key, head * D1])
            qk = tl.dot(q1, tl.trans(k1)) * ks[None, :]
            k2 = p_desc.load([key, 0])
            qk += tl.dot(q2, tl.trans(k2)) * ps[None, :]
            if MASKED:  # another sequence's keys, or past the tensor: -inf by where
                qk = tl.where(n_ok[None, :], qk, float("-inf"))
            # qf > 0 per row, so max(qk) * qf == max(qk * qf).
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qf)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk * qf[:, None] - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            # The block's largest V scale (> 0), NaN when one is NaN (tl.max may skip NaN): the
            # product below carries it without relying on e4m3's NaN.
            vmax = tl.max(vs, 0)
            vmax = tl.where(vmax > 0, vmax, 1.0)
            vmax = tl.where(tl.max(tl.where(vs == vs, 0, 1), 0) > 0, float("nan"), vmax)
            vt = v_desc.load([head * DV, key])
            if MASKED:  # another sequence's NaN times p = 0 would be NaN: zero those columns
                vt = tl.where(n_ok[None, :], vt, tl.zeros_like(vt))
            p8 = _to_e4m3(p * (vs / vmax)[None, :], ROUND)
            acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt)) * vmax
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _fp8_attention_kernel(
        q_ptr,              # e4m3 [Tq, H, D1 + D2] contiguous
        qs_ptr,             # float32 [Tq, H]
        k_ptr,              # e4m3 [Tk, H, D1] contiguous
        ks_ptr,             # float32 [Tk, H]
        p_ptr,              # e4m3 [Tk, D2] contiguous (one rope key for every head)
        ps_ptr,             # float32 [Tk]
        vt_ptr,             # e4m3 [H, DV, Tk_pad] contiguous
        vs_ptr,             # float32 [Tk, H]
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
        # The query's scale and the softmax scale in one per-row factor (> 0 or NaN).
        qf = tl.load(qs_ptr + t64 * num_heads + head64, mask=m_ok, other=1.0) * qk_scale

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
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, ks_ptr,
                                  ps_ptr, vs_ptr, num_heads, head, a0,
                                  tl.where(a0 < k_start, a0 + 1, a0), k_start, k_end, True,
                                  BLOCK_N, D1, DV, ROUND)
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, ks_ptr,
                                  ps_ptr, vs_ptr, num_heads, head, mid, tail, k_start, k_end,
                                  False, BLOCK_N, D1, DV, ROUND)
        acc, l_i, m_i = _fp8_loop(acc, l_i, m_i, q1, q2, qf, k_desc, p_desc, v_desc, ks_ptr,
                                  ps_ptr, vs_ptr, num_heads, head, tail, k_end, k_start, k_end,
                                  True, BLOCK_N, D1, DV, ROUND)

        lse2 = m_i + tl.log2(l_i)
        bad = (l_i == 0.0) | (lse2 == float("inf"))
        o = acc * (1.0 / l_i)[:, None]
        o = tl.where(bad[:, None], float("nan"), o)
        lse = tl.where(bad, float("nan"), lse2 * 0.6931471805599453)
        if ACCUMULATE:
            l1 = tl.load(l_ptrs, mask=m_ok, other=float("-inf"))
            o1 = tl.load(o_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32)
            o, lse = merge_rows(l1, o1, lse, o)
            tl.debug_barrier()
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(l_ptrs, lse, mask=m_ok)


def _pow2(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def quantize_rows(x: torch.Tensor, *, transposed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one float32 scale per ``[token, head]`` row of ``x [T, H, D]``.

    Returns ``(y, scale)`` with ``y [T, H, D]`` (``transposed``: ``[H, D, T_pad]``, ``T_pad`` =
    ``T`` rounded up to 16, the padding columns unwritten) and ``scale [T, H]`` = ``amax / 448``
    (1 for an all-zero row, NaN for a row holding NaN or inf): ``y * scale`` approximates ``x``. One
    launch, on the device; never synchronizes.
    """
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be [T, H, D] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    t, h, d = x.shape
    if transposed:
        pad = -(-t // 16) * 16
        y = torch.empty(h, d, pad, dtype=torch.float8_e4m3fn, device=x.device)
        stride_yt = pad
    else:
        y = torch.empty(t, h, d, dtype=torch.float8_e4m3fn, device=x.device)
        stride_yt = h * d
    scale = torch.empty(t, h, dtype=torch.float32, device=x.device)
    if t == 0 or h == 0:
        return y, scale
    if not use_triton(x):
        raise ValueError(f"quantize_rows runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got {x.device}")
    block_t = 32 if transposed else 16
    _quantize_rows_kernel[(cdiv(t, block_t), h)](
        x, y, scale, t, h, x.stride(0), x.stride(1), stride_yt, D=d, BLOCK_D=_pow2(d),
        BLOCK_T=block_t, TRANSPOSED=transposed, ROUND=x.device.type == "cpu", num_warps=4)
    return y, scale


def quantize_context(k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor) -> FP8Context:
    """Quantize one chunk's keys and values for :func:`fp8_context_attention`.

    ``k_nope [Tk, H, nope]``, ``v [Tk, H, v]`` (e.g. the two views of the up-projection's
    split-key output), ``k_rope [Tk, rope]`` (shared by every head); any float dtype, last dims
    contiguous. Three launches, each reading its input once; never synchronizes.
    """
    if k_rope.dim() != 2 or k_rope.shape[0] != k_nope.shape[0]:
        raise ValueError(f"k_rope must be [Tk, rope] with Tk = {k_nope.shape[0]}, got "
                         f"{tuple(k_rope.shape)}")
    k8, ks = quantize_rows(k_nope)
    p8, ps = quantize_rows(k_rope.unsqueeze(1))
    vt8, vs = quantize_rows(v, transposed=True)
    return FP8Context(k8, ks, p8.view(p8.shape[0], p8.shape[2]), ps.view(-1), vt8, vs)


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

    Returns ``(out [Tq, H, v], lse float32 [Tq, H])``, natural-log LSE.
    """
    if not HAS_TRITON:
        raise RuntimeError("fp8_context_attention needs Triton: pip install triton")
    cfg = config or FP8AttentionConfig()
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
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    if state is not None and out is not None:
        raise ValueError("pass state= (merge into a running result) or out= (overwrite), not "
                         "both")
    if state is not None or out is not None:
        out, lse = state if state is not None else out
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
    ensure_allocator()
    grid = (cdiv(max_seqlen_q, cfg.block_m), num_seqs, h)
    _fp8_attention_kernel[grid](
        q8, q_scale, ctx.k8, ctx.k_scale, ctx.p8, ctx.p_scale, ctx.vt8, ctx.v_scale, out, lse,
        cu_seqlens_q, cu_seqlens_k, softmax_scale * _LOG2E, h, ctx.num_keys, ctx.vt8.shape[2],
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        ACCUMULATE=state is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D1=nope,
        D2=rope, DV=dv, ROUND=q8.device.type == "cpu", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out, lse
