"""The up-projection GEMM with its row count read on the device: ``a[:m] @ w.T``.

A replayed CUDA graph records every launch's shape, so with ``torch.mm`` a context iteration's
graph is only valid for one row count (the forward buckets rows; each bucket is a graph of its
own, and a step whose rows fall in a bucket not met before runs eagerly). Here ``m`` is a device
int32 (the iteration's total rows, ``cu_seq_lens[i, -1]``, which the forward already has on the
device), and the grid covers a fixed capacity: one persistent program per SM walks the ``m``-row
tiles (grouped, so the programs working at once share tiles of ``a``) and nothing else, so one
launch (and one graph) serves every row count up to the capacity, and padding rows cost nothing.
Where torch has it, ``torch._grouped_mm`` (CUTLASS grouped GEMM, group ends on the device) does
the same with one group, faster than this kernel on the H200 (benchmarks/upproj.py).

Layouts: ``a [cap, K]`` rows of stride ``stride_a`` (the workspace's latent rows, ``kv_c``
part), ``w [N, K]`` contiguous (Hugging Face's ``kv_b_proj.weight``: ``N = H * (nope + v)``),
``c [cap, N]`` contiguous rows. Rows ``>= m`` of ``c`` are left as they are.
"""

from __future__ import annotations

import torch

from mlaprefill.kernels._triton import HAS_TRITON, tl, triton, use_triton

__all__ = ["METHODS", "matmul_device_rows"]

#: Tile (rows, columns, depth), warps, pipeline stages and tile-group height on CUDA.
_CUDA_CONFIG = (128, 256, 64, 8, 3, 8)

if HAS_TRITON:

    @triton.jit
    def _matmul_rows_kernel(
        a_ptr,               # [cap, K], row stride stride_a, last dim contiguous
        w_ptr,               # [N, K] contiguous
        c_ptr,               # [cap, N] contiguous
        m_ptr,               # int32 [1]: rows to compute (device)
        cap,                 # rows a and c hold (host int): m is clamped to it
        N,
        stride_a,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PROGRAMS: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32), else "tf32" (unused)
    ):
        m = tl.minimum(tl.load(m_ptr), cap)
        tiles_m = tl.cdiv(m, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        ks = tl.arange(0, BLOCK_K)
        for tile in range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS):
            group = tile // per_group
            first_m = group * GROUP_M
            height = tl.minimum(tiles_m - first_m, GROUP_M)
            in_group = tile % per_group
            rows = (first_m + in_group % height) * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = (in_group // height) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < m
            col_ok = cols < N
            a_tile = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
            w_tile = w_ptr + cols.to(tl.int64)[None, :] * K + ks[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for _ in range(0, K, BLOCK_K):
                a = tl.load(a_tile, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_tile, mask=col_ok[None, :], other=0.0)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
                a_tile += BLOCK_K
                w_tile += BLOCK_K
            out = c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            tl.store(out, acc.to(c_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


_SMS: dict[int, int] = {}


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(index)
    if sms is None:
        sms = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return sms


#: Methods of :func:`matmul_device_rows`.
METHODS = ("auto", "grouped_mm", "triton")


def _grouped_mm_ok(a: torch.Tensor) -> bool:
    return (a.device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and a.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(a.device)[0] >= 9)


def matmul_device_rows(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, m: torch.Tensor, *,
                       method: str = "auto") -> torch.Tensor:
    """``a[:m] @ w.T`` with ``m`` read on the device, in ``c`` or a new tensor (returned).

    Parameters
    ----------
    a : [cap, K], last dim contiguous (any row stride)
    w : [N, K], contiguous, a's dtype
    c : [cap, N], contiguous rows, a's dtype: where the ``triton`` method writes
    m : int32 tensor of one element on a's device: the rows to compute, at most ``cap`` (read
        on the device, so not checked; ``triton`` clamps it)
    method : ``"grouped_mm"`` (``torch._grouped_mm``, one group whose end ``m`` is read on the
        device: CUTLASS on Hopper, bfloat16), ``"triton"`` (the persistent kernel here), or
        ``"auto"``: ``grouped_mm`` where it runs, else ``triton``.

    Returns
    -------
    [cap, N]: rows ``< m`` hold the product; rows ``>= m`` are undefined (``triton``: ``c``'s
    values kept; ``grouped_mm``: a new tensor's).

    One launch whatever ``m`` (CUDA-graph safe for every row count up to ``cap``); never
    synchronizes. Without Triton for these tensors (CPU outside the interpreter) every ``cap``
    row is computed with ``torch.mm`` into ``c``.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    cap, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or c.shape != (cap, n) or m.numel() != 1:
        raise ValueError(f"matmul_device_rows: a {tuple(a.shape)}, w {tuple(w.shape)}, c "
                         f"{tuple(c.shape)}, m {tuple(m.shape)}; expected a [cap, K], w [N, K], "
                         f"c [cap, N], m [1]")
    if a.stride(1) != 1 or not w.is_contiguous() or c.stride() != (n, 1):
        raise ValueError("matmul_device_rows: a needs a contiguous last dim, w and c contiguous")
    if m.dtype != torch.int32 or not a.dtype == w.dtype == c.dtype:
        raise ValueError(f"matmul_device_rows: m must be int32 and a, w, c one dtype; got m "
                         f"{m.dtype}, a {a.dtype}, w {w.dtype}, c {c.dtype}")
    if cap == 0 or n == 0:
        return c
    if method != "triton" and _grouped_mm_ok(a):
        # W^T as [1, K, N], column-major (CUTLASS's layout for the second operand)
        return torch._grouped_mm(a, w.t().unsqueeze(0), offs=m.view(1))
    if method == "grouped_mm":
        raise ValueError("method='grouped_mm' needs torch._grouped_mm, a CUDA device of compute "
                         "capability >= 9.0 and bfloat16")
    if not use_triton(a, w, c, m):
        torch.mm(a, w.t(), out=c)
        return c
    if a.device.type == "cuda":
        block_m, block_n, block_k, warps, stages, group = _CUDA_CONFIG
    else:  # the interpreter: small tiles, so tests reach partial tiles
        block_m, block_n, block_k, warps, stages, group = 16, 16, 16, 1, 1, 2
    block_k = min(block_k, k & -k)  # a power of two dividing K
    if block_k < 16:
        raise ValueError(f"matmul_device_rows: K = {k} needs a power-of-two factor >= 16")
    programs = _programs(a.device)
    _matmul_rows_kernel[(programs,)](
        a, w, c, m, cap, n, a.stride(0), K=k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group, PROGRAMS=programs,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return c
