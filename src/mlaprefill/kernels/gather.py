"""Gather one iteration's context rows from the paged latent cache into the workspace.

Workspace row ``j`` of iteration ``i`` (``0 <= j < iteration_tokens[i]``) holds::

    r   = token_to_seq[i, j]                            # request of the row
    pos = chunk_starts[i, r] + j - cu_seq_lens[i, r]   # context-token index inside request r
    workspace[j] = kv_cache[block_table[r, pos // page_size], pos % page_size]

The Triton kernel moves each 576-wide bf16 row (1152 bytes) as tiles of ``BLOCK_D`` columns, so
every thread issues 16-byte loads/stores; row offsets are int64 (a cache of 2**31 elements is
only ~4 GB). ``num_rows`` is a host int from the plan, so the launch never reads device memory.

Bandwidth model (benchmarks/attention.py): bytes = rows * latent_dim * elt (read) + the same
(written) + rows * 4 * 4 (token_to_seq, chunk_starts, cu_seq_lens, block_table reads).
"""

from __future__ import annotations

import torch

from mlaprefill.kernels._triton import HAS_TRITON, tl, triton, use_triton

__all__ = ["gather_context_rows", "gather_context_rows_torch"]


if HAS_TRITON:

    @triton.jit
    def _gather_kernel(
        kv_cache_ptr,        # [num_blocks, PAGE_SIZE, LATENT_DIM], last dim contiguous
        workspace_ptr,       # [>= num_rows, LATENT_DIM], last dim contiguous
        block_table_ptr,     # int32 [num_reqs, max_blocks]
        token_to_seq_ptr,    # int32 [>= num_rows]  (this iteration's row)
        cu_seq_lens_ptr,     # int32 [num_reqs + 1] (this iteration's row)
        chunk_starts_ptr,    # int32 [num_reqs]     (this iteration's row)
        num_rows,            # rows to gather (host int)
        stride_cache_block,
        stride_cache_page,
        stride_bt_req,
        stride_ws_row,
        PAGE_SIZE: tl.constexpr,
        LATENT_DIM: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        req = tl.load(token_to_seq_ptr + rows, mask=row_mask, other=0)
        start = tl.load(chunk_starts_ptr + req, mask=row_mask, other=0).to(tl.int64)
        first_row = tl.load(cu_seq_lens_ptr + req, mask=row_mask, other=0).to(tl.int64)
        pos = start + rows - first_row
        block = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt_req + pos // PAGE_SIZE,
                        mask=row_mask, other=0).to(tl.int64)
        src = block * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_page
        dst = rows * stride_ws_row
        cols = tl.arange(0, BLOCK_D)
        for d0 in tl.static_range(0, LATENT_DIM, BLOCK_D):
            x = tl.load(kv_cache_ptr + src[:, None] + (d0 + cols)[None, :], mask=row_mask[:, None])
            tl.store(workspace_ptr + dst[:, None] + (d0 + cols)[None, :], x,
                     mask=row_mask[:, None])


def _block_d(latent_dim: int) -> int:
    """Largest power of two dividing ``latent_dim``, capped at 128 (576 -> 64)."""
    return min(latent_dim & -latent_dim, 128)


def _check(kv_cache: torch.Tensor, block_table: torch.Tensor, token_to_seq: torch.Tensor,
           cu_seq_lens: torch.Tensor, chunk_starts: torch.Tensor, workspace: torch.Tensor,
           num_rows: int) -> None:
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, page_size, latent_dim], got shape "
                         f"{tuple(kv_cache.shape)}")
    if workspace.dim() != 2 or workspace.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"workspace must be [rows, {kv_cache.shape[2]}], got shape "
                         f"{tuple(workspace.shape)}")
    if workspace.shape[0] < num_rows:
        raise ValueError(f"workspace has {workspace.shape[0]} rows, the iteration needs "
                         f"{num_rows}; allocate at least plan.max_iteration_tokens rows")
    if workspace.dtype != kv_cache.dtype:
        raise ValueError(f"workspace dtype {workspace.dtype} != kv_cache dtype {kv_cache.dtype}")
    for name, t in (("block_table", block_table), ("token_to_seq", token_to_seq),
                    ("cu_seq_lens", cu_seq_lens), ("chunk_starts", chunk_starts)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}; "
                             f"move it to the cache's device")
    if token_to_seq.shape[0] < num_rows:
        raise ValueError(f"token_to_seq has {token_to_seq.shape[0]} entries, need {num_rows}")


def gather_context_rows_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                              token_to_seq: torch.Tensor, cu_seq_lens: torch.Tensor,
                              chunk_starts: torch.Tensor, workspace: torch.Tensor,
                              num_rows: int) -> torch.Tensor:
    """Torch reference/fallback of :func:`gather_context_rows` (same arguments and result)."""
    _check(kv_cache, block_table, token_to_seq, cu_seq_lens, chunk_starts, workspace, num_rows)
    page_size = kv_cache.shape[1]
    j = torch.arange(num_rows, device=kv_cache.device, dtype=torch.int64)
    req = token_to_seq[:num_rows].long()
    pos = chunk_starts.long()[req] + j - cu_seq_lens.long()[req]
    block = block_table[req, pos // page_size].long()
    rows = workspace[:num_rows]
    rows.copy_(kv_cache[block, pos % page_size])
    return rows


def gather_context_rows(kv_cache: torch.Tensor, block_table: torch.Tensor,
                        token_to_seq: torch.Tensor, cu_seq_lens: torch.Tensor,
                        chunk_starts: torch.Tensor, workspace: torch.Tensor,
                        num_rows: int, *, use_kernel: bool | None = None,
                        block_rows: int = 16, num_warps: int = 4) -> torch.Tensor:
    """Copy one iteration's context rows from the paged cache into ``workspace[:num_rows]``.

    Parameters
    ----------
    kv_cache : [num_blocks, page_size, latent_dim], any float dtype, last dim contiguous
    block_table : int32 [num_reqs, max_blocks], same device
    token_to_seq : int32 [>= num_rows]
        Request of each workspace row (this iteration's row of the plan's table).
    cu_seq_lens : int32 [num_reqs + 1]
        Workspace offset of each request's piece in this iteration.
    chunk_starts : int32 [num_reqs]
        Context-token index where each request's piece starts.
    workspace : [>= num_rows, latent_dim], kv_cache's dtype, contiguous rows
    num_rows : int
        Host int (``plan.iteration_tokens[i]``).
    use_kernel : bool, optional
        Force (True) or forbid (False) the Triton kernel; default: Triton on CUDA when available.
    block_rows, num_warps : int
        Triton tile height (rows per program, a power of two) and warps per program.

    Returns
    -------
    ``workspace[:num_rows]`` (a view), filled. Never synchronizes; CUDA-graph safe.
    """
    if use_kernel is None:
        use_kernel = use_triton(kv_cache, workspace)
    if not use_kernel:
        return gather_context_rows_torch(kv_cache, block_table, token_to_seq, cu_seq_lens,
                                         chunk_starts, workspace, num_rows)
    _check(kv_cache, block_table, token_to_seq, cu_seq_lens, chunk_starts, workspace, num_rows)
    latent_dim = kv_cache.shape[2]
    if kv_cache.stride(2) != 1 or workspace.stride(1) != 1 or block_table.stride(1) != 1:
        raise ValueError("kv_cache, workspace and block_table need a contiguous last dim")
    for name, t in (("token_to_seq", token_to_seq), ("cu_seq_lens", cu_seq_lens),
                    ("chunk_starts", chunk_starts)):
        if t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous 1-D row, got shape {tuple(t.shape)} "
                             f"stride {t.stride()}")
    if num_rows == 0:
        return workspace[:0]
    grid = (triton.cdiv(num_rows, block_rows),)
    _gather_kernel[grid](
        kv_cache, workspace, block_table, token_to_seq, cu_seq_lens, chunk_starts,
        num_rows, kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        workspace.stride(0),
        PAGE_SIZE=kv_cache.shape[1], LATENT_DIM=latent_dim, BLOCK_ROWS=block_rows,
        BLOCK_D=_block_d(latent_dim), num_warps=num_warps,
    )
    return workspace[:num_rows]
