"""Merge two partial attention results by their log-sum-exp (in place into the first).

For one (token, head) with partial results ``(o1, l1)`` and ``(o2, l2)`` (natural-log LSE)::

    l   = log(exp(l1) + exp(l2))
    out = o1 * exp(l1 - l) + o2 * exp(l2 - l)

computed stably around ``m = max(l1, l2)``. A ``-inf`` LSE means "no keys": it contributes
nothing, whatever its output holds (even NaN); two ``-inf`` merge to ``out = 0, lse = -inf``,
never NaN. Math in float32; the running output keeps its dtype.

In place because the running state is ours: reading ``o1``, ``o2`` and writing ``o1`` is 3 passes
over ``[T, H, v_head_dim]``, against 4 (plus an allocation) for an out-of-place merge.
Bandwidth model: ``3 * T * H * v_head_dim * elt + 3 * T * H * 4`` bytes.
"""

from __future__ import annotations

import torch

from mlaprefill.kernels._triton import HAS_TRITON, tl, triton, use_triton

__all__ = ["merge_attention_states", "merge_attention_states_torch"]


if HAS_TRITON:

    @triton.jit
    def _merge_kernel(
        out_ptr,            # [T, H, V] running output, updated in place
        lse_ptr,            # float32 [T, H] running LSE, updated in place
        part_out_ptr,       # [T, H, V] partial output (any strides, last dim contiguous)
        part_lse_ptr,       # float32 [T, H] partial LSE (any strides)
        num_heads,
        num_rows,           # T * H (host int)
        stride_out_t, stride_out_h,
        stride_lse_t, stride_lse_h,
        stride_part_t, stride_part_h,
        stride_plse_t, stride_plse_h,
        HEAD_DIM: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        t = rows // num_heads
        h = rows % num_heads
        l1 = tl.load(lse_ptr + t * stride_lse_t + h * stride_lse_h, mask=row_mask,
                     other=float("-inf")).to(tl.float32)
        l2 = tl.load(part_lse_ptr + t * stride_plse_t + h * stride_plse_h, mask=row_mask,
                     other=float("-inf")).to(tl.float32)
        m = tl.maximum(l1, l2)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w1 = tl.exp(l1 - m_safe)
        w2 = tl.exp(l2 - m_safe)
        s = w1 + w2
        nonempty = s > 0.0
        s_safe = tl.where(nonempty, s, 1.0)
        c1 = w1 / s_safe
        c2 = w2 / s_safe
        new_lse = tl.where(nonempty, m_safe + tl.log(s_safe), float("-inf"))

        cols = tl.arange(0, BLOCK_D)
        col_mask = cols < HEAD_DIM
        mask = row_mask[:, None] & col_mask[None, :]
        o_off = (t * stride_out_t + h * stride_out_h)[:, None] + cols[None, :]
        p_off = (t * stride_part_t + h * stride_part_h)[:, None] + cols[None, :]
        o1 = tl.load(out_ptr + o_off, mask=mask, other=0.0).to(tl.float32)
        o2 = tl.load(part_out_ptr + p_off, mask=mask, other=0.0).to(tl.float32)
        # where(), not multiply: a -inf side may carry NaN/garbage and must not leak (0 * NaN).
        o = (tl.where((c1 > 0.0)[:, None], o1 * c1[:, None], 0.0)
             + tl.where((c2 > 0.0)[:, None], o2 * c2[:, None], 0.0))
        # The [BLOCK_ROWS] LSE values are replicated across the program's warps: every warp
        # loads l1 itself. Storing the merged LSE in place before *all* warps have read l1 let a
        # late warp read the merged value and scale its columns of `out` wrongly: the likely
        # cause of the run-to-run differences of the long-context forward measured on the H200
        # (benchmarks/results/determinism_h200.json, taken before this barrier). So: every load
        # is consumed above, all warps meet here, and only then is anything written.
        tl.debug_barrier()
        tl.store(lse_ptr + t * stride_lse_t + h * stride_lse_h, new_lse, mask=row_mask)
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask)


def _check(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
           part_lse: torch.Tensor) -> None:
    if out.dim() != 3:
        raise ValueError(f"out must be [T, H, v_head_dim], got shape {tuple(out.shape)}")
    if part_out.shape != out.shape:
        raise ValueError(f"part_out shape {tuple(part_out.shape)} != out shape "
                         f"{tuple(out.shape)}")
    if lse.shape != out.shape[:2] or part_lse.shape != out.shape[:2]:
        raise ValueError(f"lse {tuple(lse.shape)} and part_lse {tuple(part_lse.shape)} must be "
                         f"[T, H] = {tuple(out.shape[:2])}")
    if lse.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"lse must be float32 (or float64), got {lse.dtype}")
    devices = {t.device for t in (out, lse, part_out, part_lse)}
    if len(devices) != 1:
        raise ValueError(f"out, lse, part_out, part_lse must share one device, got {devices}")


def merge_attention_states_torch(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                                 part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference/fallback of :func:`merge_attention_states` (same semantics, in place)."""
    _check(out, lse, part_out, part_lse)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    l1 = lse.to(acc)
    l2 = part_lse.to(acc)
    m = torch.maximum(l1, l2)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w1 = torch.exp(l1 - m_safe)
    w2 = torch.exp(l2 - m_safe)
    s = w1 + w2
    nonempty = s > 0
    s_safe = torch.where(nonempty, s, torch.ones_like(s))
    c1 = (w1 / s_safe).unsqueeze(-1)
    c2 = (w2 / s_safe).unsqueeze(-1)
    zero = torch.zeros((), dtype=acc, device=out.device)
    merged = (torch.where(c1 > 0, out.to(acc) * c1, zero)
              + torch.where(c2 > 0, part_out.to(acc) * c2, zero))
    out.copy_(merged)
    lse.copy_(torch.where(nonempty, m_safe + torch.log(s_safe),
                          torch.full_like(m, float("-inf"))))
    return out, lse


def merge_attention_states(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
                           part_lse: torch.Tensor, *, use_kernel: bool | None = None,
                           block_rows: int = 16, num_warps: int = 4,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``(part_out, part_lse)`` into the running ``(out, lse)`` in place.

    Parameters
    ----------
    out : [T, H, v_head_dim], float dtype, last dim contiguous; updated in place
    lse : float32 [T, H], natural log; updated in place
    part_out : [T, H, v_head_dim], any strides with a contiguous last dim (e.g. a slice of a
        V-padded output)
    part_lse : float32 [T, H], natural log, any strides (e.g. a transposed ``[H, T]`` tensor)
    use_kernel : bool, optional
        Force/forbid the Triton kernel; default: Triton on CUDA when available.

    Returns
    -------
    ``(out, lse)``, the same tensors. Never synchronizes; CUDA-graph safe. ``-inf`` rules: see the
    module docstring.
    """
    if use_kernel is None:
        use_kernel = use_triton(out, part_out)
    if not use_kernel or out.dtype == torch.float64:
        return merge_attention_states_torch(out, lse, part_out, part_lse)
    _check(out, lse, part_out, part_lse)
    if out.stride(2) != 1 or part_out.stride(2) != 1:
        raise ValueError("out and part_out need a contiguous last dim")
    num_tokens, num_heads, head_dim = out.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out, lse
    grid = (triton.cdiv(num_rows, block_rows),)
    _merge_kernel[grid](
        out, lse, part_out, part_lse, num_heads, num_rows,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=num_warps,
    )
    return out, lse
