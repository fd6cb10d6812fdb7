"""``flex`` backend: FlexAttention (``torch.nn.attention.flex_attention``) with a document mask.

The packed batch is one "sequence" of ``Tq`` queries and ``Tk`` keys; a block mask built from
document (sequence) ids keeps each query on its own sequence's keys (and causal when asked).
``flex_attention`` is compiled once per backend instance (first call per shape compiles). The
block mask is built on device from ``cu_seqlens`` (no host reads). FlexAttention supports
``Dv != Dqk``. LSE comes back natural-log ``[1, H, Tq]``; fully masked rows are normalized by
:func:`fix_empty_rows`. Non-finite values are kept inside their sequence by
:func:`isolate_nonfinite_values` (a copy of V: one more pass over it).
"""

from __future__ import annotations

from typing import Any

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    VarlenSeqs,
    fix_empty_rows,
    isolate_nonfinite_values,
    seq_ids_from_cu,
)

__all__ = ["FlexBackend"]


class FlexBackend(AttentionBackend):
    """FlexAttention on CUDA (fp16/bf16/fp32), compiled lazily."""

    name = "flex"

    def __init__(self) -> None:
        self._compiled: Any = None

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device (compiled Triton kernels)"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype {dtype} not supported"
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return "torch has no FlexAttention"
        return None

    def _flex(self) -> Any:
        if self._compiled is None:
            from torch.nn.attention.flex_attention import flex_attention

            # dynamic=None: the first shape change marks lengths dynamic instead of recompiling per
            # shape (dynamic=False hit dynamo's recompile limit and fell back to the unfused path).
            self._compiled = torch.compile(flex_attention)
        return self._compiled

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cu_seqlens_q, cu_seqlens_k, seq_ids_q = (seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                                   seqs.seq_ids_q)
        from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

        num_q, num_k = q.shape[0], k.shape[0]
        if seq_ids_q is None:
            seq_ids_q = seq_ids_from_cu(cu_seqlens_q, num_q)
        seq_ids_k = seq_ids_from_cu(cu_seqlens_k, num_k)
        doc_q, doc_k = seq_ids_q, seq_ids_k

        if causal:
            # Same packing for q and k (new tokens over themselves): global index order is the
            # in-sequence order.
            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (doc_q[q_idx] == doc_k[kv_idx]) & (q_idx >= kv_idx)
        else:
            def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return doc_q[q_idx] == doc_k[kv_idx]

        block_mask = create_block_mask(mask_mod, None, None, num_q, num_k, device=q.device)
        # A block on a sequence boundary computes p @ v over both sequences' keys with p = 0 on
        # the masked ones: 0 * NaN would carry one sequence's NaN value into the other.
        v, poisoned = isolate_nonfinite_values(v, seq_ids_k, seq_ids_q,
                                               cu_seqlens_k.shape[0] - 1)
        # FlexAttention reports a query row whose scores are all NaN as LSE -inf ("no keys",
        # measured on the H200): a NaN in q would then merge as no contribution. Poison it.
        poisoned |= ~torch.isfinite(q).all(dim=-1)
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, Tq, Dqk]
        k4 = k.transpose(0, 1).unsqueeze(0)  # [1, H, Tk, Dqk]
        v4 = v.transpose(0, 1).unsqueeze(0)  # [1, H, Tk, Dv]
        out4, aux = self._flex()(q4, k4, v4, block_mask=block_mask, scale=softmax_scale,
                                 return_aux=AuxRequest(lse=True))
        out = out4[0].transpose(0, 1)  # [Tq, H, Dv] view
        lse = aux.lse[0].t().float()  # [Tq, H] view (natural log)
        out, lse = fix_empty_rows(out, lse, cu_seqlens_k, seq_ids_q)
        out.masked_fill_(poisoned[..., None], float("nan"))
        lse.masked_fill_(poisoned, float("nan"))
        return out, lse
