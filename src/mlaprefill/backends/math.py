"""``math`` backend: masked dense attention in plain torch (CPU or any device, float64-capable).

All sequences at once with a document mask (no Python loop over sequences, no host reads), so it
is sync-free like the GPU backends. Memory is ``H * Tq * Tk`` scores: meant for CPU, tests and
small batches, not for 64k-token contexts. Masking uses where (``masked_fill``), never a multiply
by the mask, so a NaN of one sequence never reaches another (see
:func:`~mlaprefill.backends.base.isolate_nonfinite_values`).
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    VarlenSeqs,
    isolate_nonfinite_values,
    seq_ids_from_cu,
)

__all__ = ["MathBackend"]


class MathBackend(AttentionBackend):
    """Reference-quality attention: float32 math for half inputs, native for float32/float64."""

    name = "math"

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"dtype {dtype} not supported"
        return None

    def builds(self) -> int:
        return 0  # plain torch ops

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cu_seqlens_q, cu_seqlens_k, seq_ids_q = (seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                                   seqs.seq_ids_q)
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
        # masked_fill (a where), not a multiply: a NaN score of another sequence becomes -inf
        scores.masked_fill_(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]; -inf for rows without keys, NaN stays
        # A query with keys whose scores are all -inf, or any +inf (an inf in q or k), has no
        # softmax: NaN, as the float64 reference's, never "no keys" (0, -inf) or all the mass.
        has_keys = mask.any(dim=-1)  # [Tq]
        lse = lse.masked_fill(((lse == float("-inf")) & has_keys) | (lse == float("inf")),
                              float("nan"))
        lse_safe = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
        probs = torch.exp(scores - lse_safe[..., None])  # masked entries: exp(-inf) = 0
        # probs @ v sums over every key of the batch: 0 * NaN of another sequence's value would
        # be NaN, so non-finite values are zeroed here and their own sequence's rows poisoned.
        v_clean, poisoned = isolate_nonfinite_values(v, seq_ids_k, seq_ids_q,
                                                     cu_seqlens_k.shape[0] - 1)
        out = torch.einsum("hqk,khd->qhd", probs, v_clean.to(acc))
        lse = lse.t()
        out.masked_fill_(poisoned[..., None], float("nan"))
        lse = lse.masked_fill(poisoned, float("nan"))
        lse_dtype = torch.float64 if acc == torch.float64 else torch.float32
        return out.to(q.dtype), lse.to(lse_dtype)
