"""Gather one iteration's context rows from the paged latent cache into the workspace.

Workspace row ``j`` of iteration ``i`` (``0 <= j < iteration_tokens[i]``) holds::

    r   = the request with cu_seq_lens[i, r] <= j < cu_seq_lens[i, r + 1]
    pos = chunk_starts[i, r] + j - cu_seq_lens[i, r]   # context-token index inside request r
    workspace[j] = kv_cache[block_table[r, pos // page_size], pos % page_size]

The row -> request mapping is computed on the device from ``cu_seq_lens`` (a branch-free binary
search over ``num_reqs + 1`` offsets, ``ceil(log2(num_reqs))`` cached loads per row), so the plan
ships O(num_iterations x num_reqs) integers instead of vLLM's per-token ``token_to_seq`` table
(4 bytes per context token: MiBs per step at long context). ``rows_to_requests`` gives that
table on the device for callers that want it.

A block id outside ``[0, num_blocks)`` never reads another page: the Triton kernel writes NaN
rows for it (the request's output becomes NaN, other requests are untouched) and the torch path
raises ``ValueError`` on CPU tensors, where checking is free; on CUDA it writes NaN too (checking
on the host would need a sync).

The Triton kernel moves each 576-wide bf16 row (1152 bytes) as tiles of ``BLOCK_D`` columns, so
every thread issues 16-byte loads/stores; row offsets are int64 (a cache of 2**31 elements is
only ~4 GB). ``num_rows`` and ``num_reqs`` are host ints from the plan, so the launch never reads
device memory.

Bandwidth model (benchmarks/attention.py): bytes = rows * latent_dim * elt (read) + the same
(written) + rows * 4 (block_table reads); the binary search and the per-request values hit cache.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaprefill.kernels._triton import HAS_TRITON, cdiv, tl, triton, use_triton
from mlaprefill.kvcache import DS_MLA_RANK, KVCacheSpec, dequantize_rows, resolve_kv_cache
from mlaprefill.staging import rows_to_requests

__all__ = ["gather_context_records", "gather_context_rows", "gather_context_rows_torch",
           "gather_context_rows_with_spec", "rows_to_requests"]


if HAS_TRITON:

    @triton.jit
    def _row_requests(cu_seq_lens_ptr, rows, row_mask, num_reqs, LOG2_REQS: tl.constexpr):
        """The request of each workspace row (int32, 0 where ``row_mask`` is off): the largest
        r in [0, num_reqs) with cu_seq_lens[r] <= row (binary lifting: cu_seq_lens is
        non-decreasing, cu_seq_lens[0] = 0; ``LOG2_REQS = ceil(log2(num_reqs))`` steps).
        Requests with an empty piece share their offset with the next one, so the largest such
        r is the one whose piece holds the row."""
        req = tl.zeros(rows.shape, dtype=tl.int32)
        for k in tl.static_range(LOG2_REQS):
            cand = req + (1 << (LOG2_REQS - 1 - k))
            ok = row_mask & (cand < num_reqs)
            off = tl.load(cu_seq_lens_ptr + cand, mask=ok, other=0)
            req = tl.where(ok & (off <= rows), cand, req)
        return req

    @triton.jit
    def _gather_tile(kv_cache_ptr, scales_ptr, workspace_ptr, src, dst, d0, cols, bad, row_mask,
                     load_mask, scale, out_ty: tl.constexpr, FORMAT: tl.constexpr,
                     BYTES: tl.constexpr):
        x = tl.load(kv_cache_ptr + src[:, None] + (d0 + cols)[None, :], mask=load_mask)
        if FORMAT == 1:
            x = (x.to(tl.float32) * scale).to(out_ty)
        if FORMAT == 2:  # one float32 scale per 128 values (a tile never spans two)
            s = tl.load(scales_ptr + src // 4 + (128 + d0 // 128), mask=row_mask & ~bad)
            x = (x.to(tl.float32) * s[:, None]).to(out_ty)
        x = tl.where(bad[:, None], 255 if BYTES else float("nan"), x)
        tl.store(workspace_ptr + dst[:, None] + (d0 + cols)[None, :], x, mask=row_mask[:, None])

    @triton.jit
    def _gather_kernel(
        kv_cache_ptr,        # [num_blocks, PAGE_SIZE, record]: last dim contiguous (FORMAT 2:
                             # the uint8 records viewed as float8_e4m3fn, strides in bytes)
        scales_ptr,          # FORMAT 1 with SCALE_FROM_PTR: float32 [1]; FORMAT 2: the same
                             # records viewed as float32 (offsets = byte offsets / 4)
        rope_ptr,            # FORMAT 2: the same records viewed as bfloat16; else unused
        workspace_ptr,       # [>= num_rows, LATENT_DIM], last dim contiguous
        block_table_ptr,     # int32 [num_reqs, max_blocks]
        cu_seq_lens_ptr,     # int32 [num_reqs + 1] (this iteration's row)
        chunk_starts_ptr,    # int32 [num_reqs]     (this iteration's row)
        scale,               # FORMAT 1 without SCALE_FROM_PTR: the float32 scale
        num_rows,            # rows to gather (host int)
        num_reqs,            # requests (host int)
        num_blocks,          # cache pages (host int): block ids outside [0, num_blocks) -> NaN
        stride_cache_block,
        stride_cache_page,
        stride_bt_req,
        stride_ws_row,
        PAGE_SIZE: tl.constexpr,
        LATENT_DIM: tl.constexpr,
        LOG2_REQS: tl.constexpr,   # ceil(log2(num_reqs)): binary-search steps
        BLOCK_ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        FORMAT: tl.constexpr,      # 0: copy records, 1: e4m3 x one scale, 2: fp8_ds_mla
        SCALE_FROM_PTR: tl.constexpr,
        BYTES: tl.constexpr,       # FORMAT 0 of uint8 records: a bad block is 0xFF bytes
        VALUES: tl.constexpr,      # columns read as values (FORMAT 2: the 512 e4m3 ones)
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        # Rows past the iteration's total (num_rows may pad it, e.g. for a replayed CUDA graph)
        # are left as they are.
        total = tl.load(cu_seq_lens_ptr + num_reqs).to(tl.int64)
        if pid.to(tl.int64) * BLOCK_ROWS >= total:
            return  # a launch over a capacity (num_rows) far past this iteration's rows
        row_mask = (rows < num_rows) & (rows < total)
        req = _row_requests(cu_seq_lens_ptr, rows, row_mask, num_reqs, LOG2_REQS)
        start = tl.load(chunk_starts_ptr + req, mask=row_mask, other=0).to(tl.int64)
        first_row = tl.load(cu_seq_lens_ptr + req, mask=row_mask, other=0).to(tl.int64)
        pos = start + rows - first_row
        block = tl.load(block_table_ptr + req.to(tl.int64) * stride_bt_req + pos // PAGE_SIZE,
                        mask=row_mask, other=0).to(tl.int64)
        bad = (block < 0) | (block >= num_blocks)
        load_mask = (row_mask & ~bad)[:, None]
        src = tl.where(bad, 0, block) * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_page
        dst = rows * stride_ws_row
        cols = tl.arange(0, BLOCK_D)
        out_ty = workspace_ptr.dtype.element_ty
        if FORMAT == 1 and SCALE_FROM_PTR:
            scale = tl.load(scales_ptr)
        # fp8_ds_mla: 512 e4m3 values, then 4 float32 scales, then 64 bfloat16 rope values.
        # Columns [0, VALUES) in tiles of BLOCK_D, the last VALUES % BLOCK_D (a power of two)
        # as one narrower tile.
        for d0 in tl.static_range(0, VALUES - VALUES % BLOCK_D, BLOCK_D):
            _gather_tile(kv_cache_ptr, scales_ptr, workspace_ptr, src, dst, d0, cols, bad,
                         row_mask, load_mask, scale, out_ty, FORMAT, BYTES)
        if VALUES % BLOCK_D > 0:
            _gather_tile(kv_cache_ptr, scales_ptr, workspace_ptr, src, dst,
                         VALUES - VALUES % BLOCK_D, tl.arange(0, VALUES % BLOCK_D), bad,
                         row_mask, load_mask, scale, out_ty, FORMAT, BYTES)
        if FORMAT == 2:
            ropes = tl.arange(0, 64)
            r = tl.load(rope_ptr + src[:, None] // 2 + (264 + ropes)[None, :], mask=load_mask)
            r = tl.where(bad[:, None], float("nan"), r.to(out_ty))
            tl.store(workspace_ptr + dst[:, None] + (512 + ropes)[None, :], r,
                     mask=row_mask[:, None])


def _block_d(latent_dim: int) -> int:
    """Largest power of two dividing ``latent_dim``, capped at 128 (576 -> 64)."""
    return min(latent_dim & -latent_dim, 128)


#: Tile width of the e4m3 gathers (FP8 reads half the bytes per column: wider tiles move more
#: bytes per load). H200, benchmarks/results/fp8_cache_gather_sweep_h200.json, 16-row tiles of 4
#: warps against the bf16 gather in the same run: e4m3 0.90-0.93x its time at 64 columns,
#: 0.79-0.81x at 256 (the four shapes of 40 us or more); fp8_ds_mla 0.94-0.96x at 64, 0.87-0.88x
#: at 128 (its widest: one scale per 128 values).
FP8_BLOCK_D = 256


def default_block_d(kind: str, latent_dim: int) -> int:
    """The gather's tile width for a cache format (``plain``, ``fp8``, ``fp8_ds_mla``)."""
    if kind in ("fp8", "fp8_ds_mla"):
        return min(FP8_BLOCK_D, 128) if kind == "fp8_ds_mla" else FP8_BLOCK_D
    return _block_d(latent_dim)


def _check(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
           chunk_starts: torch.Tensor, workspace: torch.Tensor, num_rows: int,
           kv_cache_scale: Any, kv_cache_format: Any, records: bool,
           spec: KVCacheSpec | None = None) -> KVCacheSpec | None:
    """The cache's :class:`KVCacheSpec` (None for ``records``: a verbatim copy) after checking
    every argument; a given ``spec`` (already resolved for this cache) is not resolved again."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, page_size, record], got shape "
                         f"{tuple(kv_cache.shape)}")
    if workspace.dim() != 2:
        raise ValueError(f"workspace must be [rows, latent_dim], got shape "
                         f"{tuple(workspace.shape)}")
    if records:
        spec = None
        if workspace.dtype != kv_cache.dtype or workspace.shape[1] != kv_cache.shape[2]:
            raise ValueError(f"workspace must be [rows, {kv_cache.shape[2]}] {kv_cache.dtype} "
                             f"(a verbatim copy of the records), got {tuple(workspace.shape)} "
                             f"{workspace.dtype}")
    else:
        if not workspace.dtype.is_floating_point:
            raise ValueError(f"workspace must have a float dtype (the compute dtype), got "
                             f"{workspace.dtype}")
        if spec is None:
            spec = resolve_kv_cache(kv_cache, kv_cache_scale, kv_cache_format,
                                    latent_dim=workspace.shape[1], dtype=workspace.dtype,
                                    dtype_of="workspace")
        elif spec.latent_dim != workspace.shape[1]:
            raise ValueError(f"workspace has {workspace.shape[1]} columns, the cache's rows "
                             f"{spec.latent_dim}")
    if workspace.shape[0] < num_rows:
        raise ValueError(f"workspace has {workspace.shape[0]} rows, the iteration needs "
                         f"{num_rows}; allocate at least plan.max_iteration_tokens rows")
    for name, t in (("block_table", block_table), ("cu_seq_lens", cu_seq_lens),
                    ("chunk_starts", chunk_starts)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}; "
                             f"move it to the cache's device")
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [num_reqs, max_blocks], got shape "
                         f"{tuple(block_table.shape)}")
    num_reqs = block_table.shape[0]
    if cu_seq_lens.shape != (num_reqs + 1,) or chunk_starts.shape != (num_reqs,):
        raise ValueError(f"cu_seq_lens must be [num_reqs + 1] and chunk_starts [num_reqs] with "
                         f"num_reqs = block_table.shape[0] = {num_reqs}; got "
                         f"{tuple(cu_seq_lens.shape)} and {tuple(chunk_starts.shape)} (pass one "
                         f"iteration's row of the plan)")
    return spec


def _gather_torch(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                  chunk_starts: torch.Tensor, workspace: torch.Tensor, num_rows: int,
                  spec: KVCacheSpec | None) -> torch.Tensor:
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    j = torch.arange(num_rows, device=kv_cache.device, dtype=torch.int64)
    req = rows_to_requests(cu_seq_lens, num_rows)
    valid = j < cu_seq_lens[-1].long()  # rows past the total: padding, left as they are
    pos = torch.where(valid, chunk_starts.long()[req] + j - cu_seq_lens.long()[req], 0)
    block = block_table[req, pos // page_size].long()
    bad = ((block < 0) | (block >= num_blocks)) & valid
    on_cpu = kv_cache.device.type == "cpu"
    if on_cpu and num_rows:
        # Host memory: checking is free (read through numpy, not a device read).
        bad_np = bad.numpy()  # noqa: HS201 (on_cpu: host memory)
        if bad_np.any():
            j0 = int(bad_np.argmax())
            # CPU tensors here (on_cpu): reading them is no device sync
            r = int(req.numpy()[j0])  # noqa: HS201
            tok = int(pos.numpy()[j0])  # noqa: HS201
            raise ValueError(
                f"block_table[{r}] holds block id {int(block.numpy()[j0])} outside [0, "
                f"num_blocks={num_blocks}) for context token {tok} of request {r}; every block "
                f"the context needs must index kv_cache")
    rows = workspace[:num_rows]
    src = kv_cache[block.clamp(0, max(num_blocks - 1, 0)), pos % page_size]
    if spec is not None:
        src = dequantize_rows(src, spec, workspace.dtype)
    if not on_cpu:
        src.masked_fill_(bad[:, None], 255 if src.dtype == torch.uint8 else float("nan"))
    rows.copy_(torch.where(valid[:, None], src, rows))  # padding rows keep their values
    return rows


def gather_context_rows_torch(kv_cache: torch.Tensor, block_table: torch.Tensor,
                              cu_seq_lens: torch.Tensor, chunk_starts: torch.Tensor,
                              workspace: torch.Tensor, num_rows: int, *,
                              kv_cache_scale: Any = None,
                              kv_cache_format: str | None = None) -> torch.Tensor:
    """Torch reference/fallback of :func:`gather_context_rows` (same arguments and result).

    On CPU tensors a block id outside ``[0, num_blocks)`` raises ``ValueError`` (before anything
    is written); on CUDA its rows are NaN (checking would synchronize).
    """
    spec = _check(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows,
                  kv_cache_scale, kv_cache_format, records=False)
    return _gather_torch(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows,
                         spec)


def gather_context_rows(kv_cache: torch.Tensor, block_table: torch.Tensor,
                        cu_seq_lens: torch.Tensor, chunk_starts: torch.Tensor,
                        workspace: torch.Tensor, num_rows: int, *,
                        kv_cache_scale: Any = None, kv_cache_format: str | None = None,
                        use_kernel: bool | None = None, block_rows: int = 16,
                        num_warps: int = 4, block_d: int | None = None) -> torch.Tensor:
    """Copy one iteration's context rows from the paged cache into ``workspace[:num_rows]``,
    dequantized to the workspace's dtype.

    Parameters
    ----------
    kv_cache : [num_blocks, page_size, record], last dim contiguous
        Records in the workspace's dtype, ``float8_e4m3fn`` or ``fp8_ds_mla`` uint8 (see
        :mod:`mlaprefill.kvcache`).
    block_table : int32 [num_reqs, max_blocks], same device
    cu_seq_lens : int32 [num_reqs + 1]
        Workspace offset of each request's piece in this iteration (the plan's row ``i``); the
        request of every row is derived from it on the device.
    chunk_starts : int32 [num_reqs]
        Context-token index where each request's piece starts.
    workspace : [>= num_rows, kv_lora_rank + qk_rope_head_dim], the compute dtype, contiguous
        rows
    num_rows : int
        Host int (``plan.iteration_tokens[i]``). A larger value pads: rows from the iteration's
        total ``cu_seq_lens[-1]`` (read on the device) to ``num_rows`` are left as they are, so
        a launch of fixed size can serve every iteration (what a replayed CUDA graph needs).
    kv_cache_scale, kv_cache_format
        The cache's format (:func:`mlaprefill.kvcache.resolve_kv_cache`).
    use_kernel : bool, optional
        Force (True) or forbid (False) the Triton kernel; default: Triton on CUDA when available.
    block_rows, num_warps : int
        Triton tile height (rows per program, a power of two) and warps per program.
    block_d : int, optional
        Triton tile width in columns (a power of two >= 16; at most 128 for ``fp8_ds_mla``,
        whose scales cover 128 values each); default: the format's (:func:`default_block_d`).

    Returns
    -------
    ``workspace[:num_rows]`` (a view), filled. Never synchronizes on CUDA; CUDA-graph safe (a
    scale tensor is read on the device; a float scale is recorded in a captured graph). A
    block id outside ``[0, num_blocks)`` gives NaN rows (Triton, torch on CUDA) or
    ``ValueError`` (torch on CPU).
    """
    spec = _check(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows,
                  kv_cache_scale, kv_cache_format, records=False)
    return _launch(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows, spec,
                   use_kernel, block_rows, num_warps, block_d)


def gather_context_rows_with_spec(kv_cache: torch.Tensor, cache_spec: KVCacheSpec,
                                  block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
                                  chunk_starts: torch.Tensor, workspace: torch.Tensor,
                                  num_rows: int, *, use_kernel: bool | None = None
                                  ) -> torch.Tensor:
    """:func:`gather_context_rows` with the cache's format given as ``cache_spec`` (what
    :func:`mlaprefill.kvcache.resolve_kv_cache` returned for ``kv_cache``): the forward resolves
    the format once per call, not once per iteration. Same arguments otherwise."""
    _check(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows, None, None,
           records=False, spec=cache_spec)
    return _launch(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace, num_rows,
                   cache_spec, use_kernel, 16, 4)


def gather_context_records(kv_cache: torch.Tensor, block_table: torch.Tensor,
                           cu_seq_lens: torch.Tensor, chunk_starts: torch.Tensor,
                           records: torch.Tensor, num_rows: int, *,
                           use_kernel: bool | None = None) -> torch.Tensor:
    """:func:`gather_context_rows` without dequantization: the cache's records verbatim.

    ``records`` is ``[>= num_rows, record]`` in the cache's dtype (view an FP8 cache and the
    buffer as ``torch.uint8``). A bad block id gives NaN rows, for uint8 all-0xFF bytes (NaN in
    e4m3fn, in the float32 scales and the bfloat16 rope of ``fp8_ds_mla``). What a DCP rank
    gathers before the all-gather, which so moves the FP8 bytes.
    """
    _check(kv_cache, block_table, cu_seq_lens, chunk_starts, records, num_rows, None, None,
           records=True)
    return _launch(kv_cache, block_table, cu_seq_lens, chunk_starts, records, num_rows, None,
                   use_kernel, 16, 4)


_FORMATS = {"plain": 0, "fp8": 1, "fp8_ds_mla": 2}


def _launch(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor,
            chunk_starts: torch.Tensor, workspace: torch.Tensor, num_rows: int,
            spec: KVCacheSpec | None, use_kernel: bool | None, block_rows: int,
            num_warps: int, block_d: int | None = None) -> torch.Tensor:
    kind = "plain" if spec is None else spec.kind
    latent_dim = workspace.shape[1]
    if block_d is None:
        block_d = default_block_d(kind, latent_dim)
    elif (isinstance(block_d, bool) or not isinstance(block_d, int) or block_d < 16
          or block_d & (block_d - 1) or (kind == "fp8_ds_mla" and block_d > 128)):
        raise ValueError(f"block_d must be a power of two >= 16 (<= 128 for fp8_ds_mla), got "
                         f"{block_d!r}")
    if use_kernel is None:
        use_kernel = use_triton(kv_cache, workspace)
    if not use_kernel:
        return _gather_torch(kv_cache, block_table, cu_seq_lens, chunk_starts, workspace,
                             num_rows, spec)
    if kv_cache.stride(2) != 1 or workspace.stride(1) != 1 or block_table.stride(1) != 1:
        raise ValueError("kv_cache, workspace and block_table need a contiguous last dim")
    for name, t in (("cu_seq_lens", cu_seq_lens), ("chunk_starts", chunk_starts)):
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous 1-D row, got stride {t.stride()}")
    if num_rows == 0:
        return workspace[:0]
    cache, scales, rope, scale, from_ptr = kv_cache, kv_cache, kv_cache, 1.0, False
    if kind == "fp8":
        from_ptr = spec.scale_tensor is not None
        scales = spec.scale_tensor if from_ptr else kv_cache
        scale = 1.0 if from_ptr else spec.scale
    elif kind == "fp8_ds_mla":
        # One set of records seen three ways; offsets are the byte offsets / element size.
        cache = kv_cache.view(torch.float8_e4m3fn)
        scales, rope = kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)
    num_reqs = block_table.shape[0]
    grid = (cdiv(num_rows, block_rows),)
    _gather_kernel[grid](
        cache, scales, rope, workspace, block_table, cu_seq_lens, chunk_starts, scale,
        num_rows, num_reqs, kv_cache.shape[0], kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0), workspace.stride(0),
        PAGE_SIZE=kv_cache.shape[1], LATENT_DIM=latent_dim,
        LOG2_REQS=max(num_reqs - 1, 0).bit_length(), BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        FORMAT=_FORMATS[kind], SCALE_FROM_PTR=from_ptr,
        BYTES=workspace.dtype == torch.uint8,
        VALUES=DS_MLA_RANK if kind == "fp8_ds_mla" else latent_dim, num_warps=num_warps,
    )
    return workspace[:num_rows]
