"""``math`` backend: masked dense attention in plain torch (CPU or any device, float64-capable).

All sequences at once with a document mask (no Python loop over sequences, no host reads), so it
is sync-free like the GPU backends. Memory is ``H * Tq * Tk`` scores: meant for CPU, tests and
small batches, not for 64k-token contexts.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaprefill.backends.base import AttentionBackend, seq_ids_from_cu

__all__ = ["MathBackend"]


class MathBackend(AttentionBackend):
    """Reference-quality attention: float32 math for half inputs, native for float32/float64."""

    name = "math"

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"dtype {dtype} not supported"
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, *, causal: bool, softmax_scale: float,
               seq_ids_q: torch.Tensor | None = None, cu_seqlens_q_host: Any = None,
               cu_seqlens_k_host: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        num_q, num_k = q.shape[0], k.shape[0]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        if seq_ids_q is None:
            seq_ids_q = seq_ids_from_cu(cu_seqlens_q, num_q)
        seq_ids_k = seq_ids_from_cu(cu_seqlens_k, num_k)
        mask = seq_ids_q[:, None] == seq_ids_k[None, :]  # [Tq, Tk]
        if causal:
            pos_q = torch.arange(num_q, device=q.device) - cu_seqlens_q.long()[seq_ids_q]
            pos_k = torch.arange(num_k, device=q.device) - cu_seqlens_k.long()[seq_ids_k]
            mask &= pos_q[:, None] >= pos_k[None, :]
        scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * softmax_scale
        scores.masked_fill_(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]; -inf for rows without keys
        lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - lse_safe[..., None])  # masked entries: exp(-inf) = 0
        out = torch.einsum("hqk,khd->qhd", probs, v.to(acc))
        lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
        return out.to(q.dtype), lse.t().to(lse_dtype)
