"""Copy MLA's rope key (one row per token, shared by every head) into every head's key.

``k[t, h, start:start + rope] = k_pe[t]`` for every head ``h``, in place. Backends that need
each head's key as one ``qk_head_dim``-wide row (cuDNN, FlashAttention-2) get it this way after
the up-projection GEMM has written the ``nope`` part.

Why a kernel: torch's broadcasting copy into the strided rope slots
(``k[:, :, nope:].copy_(k_pe[:, None].expand(...))``) runs its generic strided path, measured
at 2.6 ms for 135k rows x 128 heads on the H200 (``scratch`` profile of issue #11: ~0.85 TB/s).
Here each program loads ``BLOCK_T`` rope rows once and stores them into every head (128-byte
contiguous pieces for rope 64 in bf16), so the copy runs at store bandwidth.

Bandwidth model: ``n * H * rope * elt`` bytes written + ``n * rope * elt`` read.
"""

from __future__ import annotations

import torch

from mlaprefill.kernels._triton import HAS_TRITON, cdiv, next_power_of_2, tl, triton, use_triton

__all__ = ["broadcast_rope_"]


if HAS_TRITON:

    @triton.jit
    def _broadcast_rope_kernel(
        k_ptr,              # [n, H, >= start + ROPE] (the rope slots at `start`)
        pe_ptr,             # [n, ROPE]
        num_rows,
        num_heads,
        stride_kt, stride_kh,
        stride_pt,
        ROPE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_R)
        mask = (rows < num_rows)[:, None] & (cols < ROPE)[None, :]
        x = tl.load(pe_ptr + rows[:, None] * stride_pt + cols[None, :], mask=mask)
        dst = k_ptr + rows[:, None] * stride_kt + cols[None, :]
        for h in range(num_heads):
            tl.store(dst + h * stride_kh, x, mask=mask)


def broadcast_rope_(k: torch.Tensor, k_pe: torch.Tensor, start: int, *,
                    block_t: int = 32, num_warps: int = 4) -> torch.Tensor:
    """``k[:, :, start:start + rope] = k_pe[:, None, :]`` in place; returns ``k``.

    Parameters
    ----------
    k : [n, H, D], last dim contiguous, ``start + rope <= D``
    k_pe : [n, rope], last dim contiguous, ``k``'s dtype and device
    start : int, the first rope slot of each head's key (``qk_nope_head_dim``)

    Never synchronizes. Triton on CUDA (and on CPU under ``TRITON_INTERPRET=1``), else torch.
    """
    if k.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != k.shape[0]:
        raise ValueError(f"need k [n, H, D] and k_pe [n, rope], got {tuple(k.shape)} and "
                         f"{tuple(k_pe.shape)}")
    rope = k_pe.shape[1]
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= k.shape[2] - rope:
        raise ValueError(f"start must be an int with 0 <= start <= D - rope = "
                         f"{k.shape[2] - rope}, got {start!r}")
    if k_pe.dtype != k.dtype or k_pe.device != k.device:
        raise ValueError(f"k_pe ({k_pe.dtype}, {k_pe.device}) must have k's dtype and device "
                         f"({k.dtype}, {k.device})")
    n, heads = k.shape[0], k.shape[1]
    if n == 0 or heads == 0 or rope == 0:
        return k
    if not use_triton(k, k_pe) or k.stride(2) != 1 or k_pe.stride(1) != 1:
        k[:, :, start:start + rope].copy_(k_pe[:, None, :].expand(n, heads, rope))
        return k
    _broadcast_rope_kernel[(cdiv(n, block_t),)](
        k[:, :, start:], k_pe, n, heads, k.stride(0), k.stride(1), k_pe.stride(0),
        ROPE=rope, BLOCK_R=next_power_of_2(rope), BLOCK_T=block_t, num_warps=num_warps,
    )
    return k
