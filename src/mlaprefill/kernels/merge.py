"""Merge two partial attention results by their log-sum-exp (in place into the first).

For one (token, head) with partial results ``(o1, l1)`` and ``(o2, l2)`` (natural-log LSE)::

    l   = log(exp(l1) + exp(l2))
    out = o1 * exp(l1 - l) + o2 * exp(l2 - l)

computed stably around ``m = max(l1, l2)``. Rules, per (token, head):

- a ``-inf`` LSE means "no keys": that side contributes nothing, whatever its output holds (even
  NaN: kernels leave garbage in rows without keys); two ``-inf`` merge to ``out = 0, lse = -inf``;
- NaN propagates: a NaN LSE on a side that is not ``-inf`` makes the merged output row and LSE
  NaN, and a NaN in a contributing output stays NaN in the merged output (also where its weight
  underflows to 0: ``0 * NaN``). Emptiness is decided by ``lse == -inf`` only, never by
  ``weight > 0`` (which is false for NaN and read NaN as "no keys" before);
- a ``+inf`` LSE (what kernels report for a softmax sum of 0 or NaN) merges to NaN
  (``exp(inf - inf)``), never to "all the mass".

Math in float32; the running output keeps its dtype.

In place because the running state is ours: reading ``o1``, ``o2`` and writing ``o1`` is 3 passes
over ``[T, H, v_head_dim]``, against 4 (plus an allocation) for an out-of-place merge.
Bandwidth model: ``3 * T * H * v_head_dim * elt + 3 * T * H * 4`` bytes.
"""

from __future__ import annotations

import torch

from mlaprefill.kernels._triton import HAS_TRITON, cdiv, next_power_of_2, tl, triton, use_triton

__all__ = ["merge_attention_states", "merge_attention_states_torch"]


if HAS_TRITON:

    @triton.jit
    def merge_rows(l1, o1, l2, o2):
        """The merge of one tile: LSEs ``l1, l2`` fp32 ``[R]``, outputs ``o1, o2`` fp32 ``[R, D]``
        -> ``(o [R, D], lse [R])`` by the rules of this module (the attention kernel's epilogue
        merge calls it too, so both follow one definition)."""
        # "No keys" is exactly lse == -inf (false for NaN). A NaN LSE makes its weight NaN
        # (whatever tl.maximum does with NaN), hence s, both coefficients and the new LSE.
        e1 = l1 == float("-inf")
        e2 = l2 == float("-inf")
        empty = e1 & e2
        m = tl.maximum(l1, l2)
        m_safe = tl.where(empty, 0.0, m)
        w1 = tl.where(e1, 0.0, tl.exp(l1 - m_safe))
        w2 = tl.where(e2, 0.0, tl.exp(l2 - m_safe))
        s_safe = tl.where(empty, 1.0, w1 + w2)
        c1 = w1 / s_safe
        c2 = w2 / s_safe
        new_lse = tl.where(empty, float("-inf"), m_safe + tl.log(s_safe))
        # where(), not multiply: a -inf side may carry NaN/garbage and must not leak (0 * NaN);
        # a side with keys is always multiplied, so its NaN survives even a 0 weight.
        o = (tl.where(e1[:, None], 0.0, o1 * c1[:, None])
             + tl.where(e2[:, None], 0.0, o2 * c2[:, None]))
        return o, new_lse

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
        cols = tl.arange(0, BLOCK_D)
        col_mask = cols < HEAD_DIM
        mask = row_mask[:, None] & col_mask[None, :]
        o_off = (t * stride_out_t + h * stride_out_h)[:, None] + cols[None, :]
        p_off = (t * stride_part_t + h * stride_part_h)[:, None] + cols[None, :]
        o1 = tl.load(out_ptr + o_off, mask=mask, other=0.0).to(tl.float32)
        o2 = tl.load(part_out_ptr + p_off, mask=mask, other=0.0).to(tl.float32)
        o, new_lse = merge_rows(l1, o1, l2, o2)
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
    # Same rules as the kernel: "no keys" is exactly -inf; NaN propagates (see module doc).
    e1 = l1 == float("-inf")
    e2 = l2 == float("-inf")
    empty = e1 & e2
    zero = torch.zeros((), dtype=acc, device=out.device)
    one = torch.ones((), dtype=acc, device=out.device)
    m_safe = torch.where(empty, zero, torch.maximum(l1, l2))  # torch.maximum propagates NaN
    w1 = torch.where(e1, zero, torch.exp(l1 - m_safe))
    w2 = torch.where(e2, zero, torch.exp(l2 - m_safe))
    s_safe = torch.where(empty, one, w1 + w2)
    c1 = (w1 / s_safe).unsqueeze(-1)
    c2 = (w2 / s_safe).unsqueeze(-1)
    merged = (torch.where(e1.unsqueeze(-1), zero, out.to(acc) * c1)
              + torch.where(e2.unsqueeze(-1), zero, part_out.to(acc) * c2))
    out.copy_(merged)
    lse.copy_(torch.where(empty, torch.full_like(m_safe, float("-inf")),
                          m_safe + torch.log(s_safe)))
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
    grid = (cdiv(num_rows, block_rows),)
    _merge_kernel[grid](
        out, lse, part_out, part_lse, num_heads, num_rows,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        part_out.stride(0), part_out.stride(1), part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, BLOCK_D=next_power_of_2(head_dim),
        num_warps=num_warps,
    )
    return out, lse
