"""``cudnn`` backend: cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention``).

Measured on the H200 (benchmarks/results/attention_h200.json): the *ragged* form
(``aten._cudnn_attention_forward`` with ``cum_seq_q/k``) rebuilds its cuDNN graph on every call in
torch 2.11 (no graph cache on that path), ~75 ms of host time per call. So, when the caller passes
the sequence offsets as host ints (the forward always does, from the plan), this backend launches
the *dense* cached-graph kernel once per sequence, on ``[1, H, n, D]`` views of the packed tensors
(no copies in), and writes each result into the packed output. Sequences with no keys are never
launched: their rows stay ``out = 0, lse = -inf``. Without host offsets it falls back to the
ragged call (correct, slow). cuDNN supports ``Dv != Dqk`` (192/128 without padding); stats are
natural-log LSE.

Host cost: a cuDNN graph is built once per distinct (q_len, k_len) shape and cached by torch; a
step with never-seen lengths pays that build on the host (see the benchmark's ``first_call_ms``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    VarlenSeqs,
    fix_empty_rows,
    flag_inf_lse_as_nan,
    lse_to_tokens_heads,
    seq_ids_from_cu,
)

__all__ = ["CudnnBackend", "dense_cudnn_attention"]


def _batch_view(x: torch.Tensor, start: int, batch: int, rows: int) -> torch.Tensor:
    """``[batch, H, rows, D]`` view of ``batch`` consecutive runs of ``rows`` rows of a
    ``[T, H, D]`` tensor from row ``start``. Every stride is a function of the shape (the batch
    stride of a single run too), so equal shapes give equal cuDNN graph keys."""
    _, h, d = x.shape
    return x.as_strided((batch, h, rows, d), (rows * x.stride(0), x.stride(1), x.stride(0), 1),
                        x.storage_offset() + start * x.stride(0))


def dense_cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
                          k_start: int, batch: int, q_rows: int, k_rows: int, *, causal: bool,
                          softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One (batched) dense cuDNN SDPA call on views of packed q, k, v (no copies in).

    Sequence ``b < batch`` owns query rows ``q_start + b * q_rows`` onwards (``q_rows`` of them)
    and key rows ``k_start + b * k_rows`` onwards (``k_rows``): consecutive equal runs.

    Returns out ``[batch * q_rows, H, Dv]`` and lse float32 ``[batch * q_rows, H]`` (natural
    log) for query rows ``q_start : q_start + batch * q_rows``: views where the layouts allow
    (torch allocates cuDNN's output in the query's layout). Never synchronizes.
    """
    h = q.shape[1]
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _batch_view(q, q_start, batch, q_rows), _batch_view(k, k_start, batch, k_rows),
        _batch_view(v, k_start, batch, k_rows), None, True, 0.0, causal, False,
        scale=softmax_scale)
    out = res[0].transpose(1, 2).reshape(batch * q_rows, h, v.shape[2])       # [B*q, H, Dv]
    lse = res[1].reshape(batch, h, q_rows).transpose(1, 2).reshape(batch * q_rows, h)
    return out, lse


class CudnnBackend(AttentionBackend):
    """cuDNN SDPA (CUDA, fp16/bf16, head dims <= 256 and multiples of 8)."""

    name = "cudnn"
    # torch's cuDNN graph cache is process-wide, so the record of the shapes it has seen is too:
    # the count of builds (see builds()) must not restart with a new backend object.
    _graph_keys: ClassVar[set[tuple]] = set()
    _ragged_calls: ClassVar[list[int]] = [0]

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"cuDNN attention needs fp16/bf16, got {dtype}"
        if qk_head_dim > 256 or v_head_dim > 256 or qk_head_dim % 8 or v_head_dim % 8:
            return f"head dims qk={qk_head_dim}, v={v_head_dim} unsupported"
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available"
        if (torch.backends.cudnn.version() or 0) < 90000:
            return f"cuDNN {torch.backends.cudnn.version()} < 9.0"
        if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            return "torch has no aten._scaled_dot_product_cudnn_attention"
        return None

    def builds(self) -> int:
        """Distinct dense shapes launched in this process (torch builds one cuDNN graph per
        shape, ~40-90 ms of host time each on the H200) plus every ragged call (that path
        rebuilds its graph on each call in torch 2.11)."""
        return len(self._graph_keys) + self._ragged_calls[0]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seq_ids_q, cu_seqlens_q_host,
         cu_seqlens_k_host) = seqs.unpack()
        if cu_seqlens_q_host is None or cu_seqlens_k_host is None:
            return self._ragged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal=causal, softmax_scale=softmax_scale, seq_ids_q=seq_ids_q)
        num_q, num_heads, _ = q.shape
        out = torch.zeros(num_q, num_heads, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((num_q, num_heads), float("-inf"), dtype=torch.float32,
                         device=q.device)
        cq = [int(x) for x in cu_seqlens_q_host]
        ck = [int(x) for x in cu_seqlens_k_host]
        for r in range(len(cq) - 1):  # a loop over sequences (host ints), not tokens
            q0, q1, k0, k1 = cq[r], cq[r + 1], ck[r], ck[r + 1]
            if q1 == q0 or k1 == k0:
                continue
            self._graph_keys.add((num_heads, q1 - q0, k1 - k0, q.shape[-1], v.shape[-1], causal,
                                  q.dtype, q.stride(0), k.stride(0), v.stride(0)))
            o_r, l_r = dense_cudnn_attention(q, k, v, q0, k0, 1, q1 - q0, k1 - k0,
                                             causal=causal, softmax_scale=softmax_scale)
            out[q0:q1].copy_(o_r)  # [nq, H, Dv]
            lse[q0:q1].copy_(l_r)  # [nq, H]
        flag_inf_lse_as_nan(out, lse)  # a NaN row never reads as "all the mass"
        return out, lse

    def _ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                max_seqlen_k: int, *, causal: bool, softmax_scale: float,
                seq_ids_q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Ragged offsets are computed as cum_seq * H * D: q, k, v must be contiguous.
        num_q, num_heads, _ = q.shape
        self._ragged_calls[0] += 1
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        res = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 1),
            max(max_seqlen_k, 1), True, 0.0, causal, False, scale=softmax_scale,
        )
        out, lse = res[0], res[1]
        if seq_ids_q is None:
            seq_ids_q = seq_ids_from_cu(cu_seqlens_q, num_q)
        lse = lse_to_tokens_heads(lse, num_q, num_heads, seq_ids_q, cu_seqlens_q)
        return fix_empty_rows(out, lse, cu_seqlens_k, seq_ids_q)
