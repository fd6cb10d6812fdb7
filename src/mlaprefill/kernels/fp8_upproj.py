"""The up-projection with an e4m3 epilogue: latent rows to FP8 keys and values, no bf16 copy.

What :class:`~mlaprefill.backends.fp8.MLAPrefillFP8Backend` runs for a context chunk instead of
the bf16 GEMM and :func:`~mlaprefill.kernels.fp8_attention.quantize_context`: one GEMM whose
epilogue scales, rounds and stores e4m3, in the layouts
:func:`~mlaprefill.kernels.fp8_attention.fp8_context_attention` reads (``k8 [n, H, nope]``,
``vt8 [H, v, n_pad]``, ``p8 [n, rope]``)::

    k[t, h, i] = c_t . W_K[h, i]        v[t, h, i] = c_t . W_V[h, i]     (c_t = kv_c[t])

The scales need each tensor's largest magnitude before the GEMM has made it. Cauchy-Schwarz
bounds it from inputs that are cheap to read: ``|k[t, h, i]| <= ||c_t|| ||W_K[h, i]||``, so ::

    bound_K = max(max_t ||c_t|| * max_{h,i} ||W_K[h, i]|| * (1 + 2^-8), max |k_pe|)
    bound_V =     max_t ||c_t|| * max_{h,i} ||W_V[h, i]|| * (1 + 2^-8)

and ``scale = bound / 448``, one per chunk for K (nope and rope) and one for V, as
``quantize_context``'s amaxes. ``max_t ||c_t||`` and ``max |k_pe|`` (finite rows and values
only, on the device: an atomic max per tile) take one pass over the latent rows, ``(rank +
rope) / (2 H (nope + v))`` of the bf16 K/V's bytes; the weights' row norms are computed once
per weight (:func:`weight_row_norms`). The bound is looser than the amax (4.6-5.4x on random
latent rows at rank 512: benchmarks/results/fp8_attention_h200.json), which costs e4m3 range,
not precision: its relative step is
the same over its whole normal range (``2^-6 .. 448``, a factor of 2^14.8), so only values below
``bound / 28,672`` lose mantissa bits (subnormals); the margin ``2^-8`` covers the float32
rounding of the norms and of the GEMM, and the epilogue clamps to ``+-448`` besides.

Non-finite values: a latent row holding NaN or inf is left out of ``max ||c_t||`` and makes NaN
its own keys and values (the GEMM's products; e4m3fn has no inf), as ``quantize_context`` does;
a non-finite ``k_pe`` value is stored as NaN. Other rows are unaffected. A finite latent row so
large that its float32 norm overflows (``|c| ~ 1e37``) is out of range for this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
from mlaprefill.kernels.fp8_attention import FP8Context, _quantize

__all__ = ["BOUND_MARGIN", "FP8UpProjConfig", "aligned_for_upproject_fp8", "upproject_fp8",
           "weight_row_norms"]

#: The Cauchy-Schwarz bounds are raised by this factor (module docstring).
BOUND_MARGIN = 1.0 + 2.0 ** -8


@dataclass(frozen=True, slots=True)
class FP8UpProjConfig:
    """Tiles of :func:`upproject_fp8`'s GEMMs (``block_m`` tokens by one head's ``nope`` or ``v``
    columns, ``block_k`` of the rank per step; powers of two >= 16)."""

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_tiles("FP8UpProjConfig", self.block_m, self.block_k, self.num_warps,
                    self.num_stages, names=("block_m", "block_k"))


def weight_row_norms(w_kv: torch.Tensor, nope: int, v: int) -> torch.Tensor:
    """``float32 [2]``: the largest L2 norm of a key row and of a value row of ``w_kv [H * (nope +
    v), rank]`` (per head ``[nope rows | v rows]``, Hugging Face's ``kv_b_proj.weight``), on its
    device; computed in float32 from the weight as the GEMM reads it. Never synchronizes."""
    if w_kv.dim() != 2 or nope <= 0 or v <= 0 or w_kv.shape[0] % (nope + v):
        raise ValueError(f"w_kv must be [H * (nope + v), rank] with nope = {nope}, v = {v}, got "
                         f"{tuple(w_kv.shape)}")
    norms = torch.linalg.vector_norm(w_kv.float().view(-1, nope + v, w_kv.shape[1]), dim=2)
    if norms.shape[0] == 0:
        return torch.zeros(2, dtype=torch.float32, device=w_kv.device)
    return torch.stack([norms[:, :nope].amax(), norms[:, nope:].amax()])


if HAS_TRITON:
    from mlaprefill.kernels.fp8_attention import _to_e4m3

    @triton.jit
    def _latent_stats_kernel(
        c_ptr,              # [n, rank], last dim contiguous
        pe_ptr,             # [n, rope], last dim contiguous
        stats_ptr,          # float32 [2], zeroed: raised to max ||c_t||, max |k_pe| (finite)
        valid_ptr,          # HAS_VALID: int32, rows at and past it are padding (left out)
        num_rows, stride_c, stride_pe,
        RANK: tl.constexpr, BLOCK_R: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr,
        BLOCK_T: tl.constexpr, HAS_VALID: tl.constexpr,
    ):
        if HAS_VALID:
            num_rows = tl.minimum(num_rows, tl.load(valid_ptr))
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        r64 = rows.to(tl.int64)
        row_ok = rows < num_rows
        cols = tl.arange(0, BLOCK_R)
        c = tl.load(c_ptr + r64[:, None] * stride_c + cols[None, :],
                    mask=row_ok[:, None] & (cols < RANK)[None, :], other=0.0).to(tl.float32)
        mag = tl.abs(c)
        finite = tl.max(tl.where(mag < float("inf"), 0, 1), 1) == 0  # False for NaN too
        # ||c|| as m * ||c / m||: no overflow of the squares for any finite bf16 row.
        m = tl.max(tl.where(mag < float("inf"), mag, 0.0), 1)
        m_safe = tl.where(m > 0, m, 1.0)
        norm = m * tl.sqrt(tl.sum((c / m_safe[:, None]) * (c / m_safe[:, None]), 1))
        tl.atomic_max(stats_ptr, tl.max(tl.where(finite, norm, 0.0), 0))
        pcols = tl.arange(0, BLOCK_P)
        pe = tl.load(pe_ptr + r64[:, None] * stride_pe + pcols[None, :],
                     mask=row_ok[:, None] & (pcols < ROPE)[None, :], other=0.0).to(tl.float32)
        pmag = tl.abs(pe)
        tl.atomic_max(stats_ptr + 1, tl.max(tl.max(tl.where(pmag < float("inf"), pmag, 0.0), 1),
                                            0))

    @triton.jit
    def _e4m3_scaled(x, inv, ROUND: tl.constexpr):
        # x * inv rounded to e4m3, clamped to +-448 (the bound's float32 margin); NaN and inf
        # stored as NaN
        y = x * inv
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))  # NaN stays NaN
        return _to_e4m3(tl.where(tl.abs(x) < float("inf"), y, float("nan")), ROUND)

    @triton.jit
    def _upproj_fp8_kernel(
        c_ptr,              # [n, rank] (16-byte aligned rows), last dim contiguous
        w_ptr,              # [H * (NOPE + DV), rank] contiguous: per head [nope rows | v rows]
        stats_ptr,          # float32 [2]: max ||c_t||, max |k_pe|
        wn_ptr,             # float32 [2]: max row norms of W_K and W_V
        bound_ptr,          # float32 [2] out: bound_K, bound_V (written by block (0, 0))
        k8_ptr,             # e4m3 [n, H, NOPE]
        vt8_ptr,            # e4m3 [H, DV, keys_pad]
        pe_ptr,             # [n, ROPE] (head 0's blocks quantize it into p8)
        p8_ptr,             # e4m3 [n, ROPE]
        valid_ptr,          # HAS_VALID: int32, tiles wholly past it (padding) are skipped
        num_rows, num_heads, stride_c, stride_pe, keys_pad,
        RANK: tl.constexpr, NOPE: tl.constexpr, DV: tl.constexpr, ROPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROUND: tl.constexpr,
        HAS_VALID: tl.constexpr,
    ):
        # One head's K and V for BLOCK_M tokens: a [BLOCK_M, NOPE] tile of c W_K^T and a
        # [DV, BLOCK_M] tile of W_V c^T (V^T's own layout: the store needs no transpose), both
        # from one pass over the tokens' latent rows. The head is the fastest grid axis, so the
        # H blocks that read the same latent rows run together (the rows come from L2).
        head = tl.program_id(0)
        pid_m = tl.program_id(1)
        # The bounds (module docstring); 1.00390625 = BOUND_MARGIN.
        norm_c = tl.load(stats_ptr)
        bound_k = tl.maximum(norm_c * tl.load(wn_ptr) * 1.00390625, tl.load(stats_ptr + 1))
        bound_v = norm_c * tl.load(wn_ptr + 1) * 1.00390625
        if pid_m == 0 and head == 0:
            tl.store(bound_ptr, bound_k)
            tl.store(bound_ptr + 1, bound_v)
        if HAS_VALID:  # noqa: SIM102 (a constexpr guard: no load without the pointer)
            if pid_m * BLOCK_M >= tl.load(valid_ptr):
                return
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[num_rows, RANK], strides=[stride_c, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        wk_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_heads * (NOPE + DV), RANK],
                                            strides=[RANK, 1], block_shape=[NOPE, BLOCK_K])
        wv_desc = tl.make_tensor_descriptor(w_ptr, shape=[num_heads * (NOPE + DV), RANK],
                                            strides=[RANK, 1], block_shape=[DV, BLOCK_K])
        w_row = head * (NOPE + DV)
        acc_k = tl.zeros([BLOCK_M, NOPE], dtype=tl.float32)
        acc_vt = tl.zeros([DV, BLOCK_M], dtype=tl.float32)
        for k in tl.range(0, RANK, BLOCK_K):
            a = c_desc.load([pid_m * BLOCK_M, k])
            acc_k = tl.dot(a, tl.trans(wk_desc.load([w_row, k])), acc=acc_k)
            acc_vt = tl.dot(wv_desc.load([w_row + NOPE, k]), tl.trans(a), acc=acc_vt)

        inv_k = tl.where(bound_k > 0, tl.div_rn(448.0, tl.where(bound_k > 0, bound_k, 1.0)), 1.0)
        inv_v = tl.where(bound_v > 0, tl.div_rn(448.0, tl.where(bound_v > 0, bound_v, 1.0)), 1.0)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        r64 = rows.to(tl.int64)
        row_ok = rows < num_rows
        tl.store(k8_ptr + (r64[:, None] * num_heads + head) * NOPE + tl.arange(0, NOPE)[None, :],
                 _e4m3_scaled(acc_k, inv_k, ROUND), mask=row_ok[:, None])
        tl.store(vt8_ptr + head.to(tl.int64) * DV * keys_pad
                 + tl.arange(0, DV)[:, None].to(tl.int64) * keys_pad + r64[None, :],
                 _e4m3_scaled(acc_vt, inv_v, ROUND), mask=row_ok[None, :])
        if head == 0:  # the rope key, shared by every head, on K's scale
            pcols = tl.arange(0, ROPE)
            pe = tl.load(pe_ptr + r64[:, None] * stride_pe + pcols[None, :], mask=row_ok[:, None],
                         other=0.0).to(tl.float32)
            tl.store(p8_ptr + r64[:, None] * ROPE + pcols[None, :],
                     _e4m3_scaled(pe, inv_k, ROUND), mask=row_ok[:, None])


def aligned_for_upproject_fp8(kv_c: torch.Tensor) -> bool:
    """Whether :func:`upproject_fp8` can read ``kv_c`` through a TMA descriptor: 16-byte aligned
    start and row stride, last dim contiguous."""
    size = kv_c.element_size()
    return (kv_c.dim() == 2 and kv_c.stride(1) == 1 and kv_c.data_ptr() % 16 == 0
            and (kv_c.stride(0) * size) % 16 == 0 and (kv_c.shape[1] * size) % 16 == 0)


def upproject_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor, w_kv: torch.Tensor,
                  w_norms: torch.Tensor, *, nope: int, v: int,
                  valid_rows: torch.Tensor | None = None,
                  config: FP8UpProjConfig | None = None) -> FP8Context:
    """One chunk's keys and values for :func:`~mlaprefill.kernels.fp8_attention.
    fp8_context_attention`, written as e4m3 by the up-projection's epilogue (module docstring).

    Parameters
    ----------
    kv_c : [n, rank] bfloat16 or float16, last dim contiguous, 16-byte aligned start and rows
        (:func:`aligned_for_upproject_fp8`); the latent rows.
    k_pe : [n, rope], last dim contiguous; the rope key, shared by every head.
    w_kv : [H * (nope + v), rank] contiguous, ``kv_c``'s dtype and device; per head ``[nope rows |
        v rows]``.
    w_norms : float32 [2], :func:`weight_row_norms` of ``w_kv``.
    nope, v : the key's nope width and the value width (powers of two in [16, 256]).
    valid_rows : int32 tensor of one element on the device, optional
        Rows at and past it are padding (a CUDA graph's row bucket): left out of the bounds, and
        tiles wholly past it are not computed (their values are unspecified). E.g. the
        attention's ``cu_seqlens_k[-1:]``, whose keys end there.

    Returns an :class:`~mlaprefill.kernels.fp8_attention.FP8Context` whose ``bound`` holds the
    Cauchy-Schwarz bounds. Three launches (a zero fill, the latent pass, the GEMM that writes
    K, V and the rope key); never synchronizes.
    """
    cfg = config or FP8UpProjConfig()
    if kv_c.dim() != 2 or kv_c.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"kv_c must be bfloat16 or float16 [n, rank], got {kv_c.dtype} "
                         f"{tuple(kv_c.shape)}")
    n, rank = kv_c.shape
    if not aligned_for_upproject_fp8(kv_c):
        raise ValueError(f"kv_c must have a contiguous last dim and 16-byte aligned rows, got "
                         f"shape {tuple(kv_c.shape)} strides {kv_c.stride()}")
    if k_pe.dim() != 2 or k_pe.shape[0] != n or k_pe.stride(1) != 1:
        raise ValueError(f"k_pe must be [n, rope] with n = {n} and a contiguous last dim, got "
                         f"{tuple(k_pe.shape)}")
    for name, dim in (("nope", nope), ("v", v), ("rope", k_pe.shape[1])):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 16 or dim > 256 \
                or dim & (dim - 1):
            raise ValueError(f"upproject_fp8 needs {name} a power of two in [16, 256], got "
                             f"{dim!r}")
    if (w_kv.dim() != 2 or w_kv.shape[1] != rank or w_kv.shape[0] % (nope + v)
            or not w_kv.is_contiguous() or w_kv.dtype != kv_c.dtype):
        raise ValueError(f"w_kv must be contiguous [H * (nope + v), rank] = [H * {nope + v}, "
                         f"{rank}] of {kv_c.dtype}, got {w_kv.dtype} {tuple(w_kv.shape)}")
    if w_norms.shape != (2,) or w_norms.dtype != torch.float32:
        raise ValueError(f"w_norms must be float32 [2] (weight_row_norms), got {w_norms.dtype} "
                         f"{tuple(w_norms.shape)}")
    if valid_rows is not None and (valid_rows.numel() != 1 or valid_rows.dtype != torch.int32):
        raise ValueError(f"valid_rows must be an int32 tensor of one element, got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)}")
    given = [kv_c, k_pe, w_kv, w_norms] + ([valid_rows] if valid_rows is not None else [])
    devices = {t.device for t in given}
    if len(devices) != 1:
        raise ValueError(f"kv_c, k_pe, w_kv and w_norms must share one device, got {devices}")
    h, rope, device = w_kv.shape[0] // (nope + v), k_pe.shape[1], kv_c.device
    pad = -(-n // 16) * 16
    k8 = torch.empty(n, h, nope, dtype=torch.float8_e4m3fn, device=device)
    p8 = torch.empty(n, rope, dtype=torch.float8_e4m3fn, device=device)
    vt8 = torch.empty(h, v, pad, dtype=torch.float8_e4m3fn, device=device)
    if n == 0:
        return FP8Context(k8, p8, vt8, torch.zeros(2, dtype=torch.float32, device=device))
    if not use_triton(kv_c):
        raise ValueError(f"upproject_fp8 runs on CUDA tensors (on CPU only under "
                         f"TRITON_INTERPRET=1), got {device}")
    stats = torch.zeros(2, dtype=torch.float32, device=device)
    bound = torch.empty(2, dtype=torch.float32, device=device)  # written by the GEMM's block 0
    _latent_stats_kernel[(cdiv(n, 16),)](
        kv_c, k_pe, stats, valid_rows, n, kv_c.stride(0), k_pe.stride(0), RANK=rank,
        BLOCK_R=pow2_at_least_16(rank), ROPE=rope, BLOCK_P=pow2_at_least_16(rope), BLOCK_T=16,
        HAS_VALID=valid_rows is not None, num_warps=4)
    if h == 0:  # no heads: the rope key still gets its scale (its amax); V has none
        bound[0:1].copy_(stats[1:2])
        bound[1:2].zero_()
        _quantize(k_pe.unsqueeze(1), p8.view(n, 1, rope), bound[0:1], rope, per_row=False,
                  transposed=False)
        return FP8Context(k8, p8, vt8, bound)
    ensure_allocator()
    _upproj_fp8_kernel[(h, cdiv(n, cfg.block_m))](
        kv_c, w_kv, stats, w_norms, bound, k8, vt8, k_pe, p8, valid_rows, n, h, kv_c.stride(0),
        k_pe.stride(0), pad, RANK=rank, NOPE=nope, DV=v, ROPE=rope, BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k, ROUND=device.type == "cpu", HAS_VALID=valid_rows is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return FP8Context(k8, p8, vt8, bound)
