"""``fa2`` backend: PyTorch's FlashAttention-2 varlen kernel (``aten._flash_attention_forward``).

FA2 needs ``v_head_dim == qk_head_dim``: V is zero-padded to the QK width (192 for DeepSeek) and
the output sliced back. The forward pads for free by laying zero columns into its up-projection
weight; standalone calls pad with a copy. FA2 reports a query without keys as ``lse = +inf``
(``out = 0``); :func:`fix_empty_rows` turns that into ``-inf``. LSE is natural log.
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    VarlenSeqs,
    fix_empty_rows,
    lse_to_tokens_heads,
    pad_v,
    seq_ids_from_cu,
)

__all__ = ["FA2Backend"]


class FA2Backend(AttentionBackend):
    """FlashAttention-2 varlen (CUDA, fp16/bf16, head dim <= 256 and a multiple of 8)."""

    name = "fa2"
    needs_v_padded = True
    preferred_policy = "balanced"  # one launch, one CTA per (query block, head): no split-KV

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashAttention-2 needs fp16/bf16, got {dtype}"
        if qk_head_dim > 256 or qk_head_dim % 8 or v_head_dim > qk_head_dim:
            return f"head dims qk={qk_head_dim}, v={v_head_dim} unsupported"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this torch build has no FlashAttention"
        return None

    def builds(self) -> int:
        return 0  # precompiled FlashAttention-2 kernels: nothing is built per shape

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cu_seqlens_q, cu_seqlens_k, seq_ids_q = (seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                                   seqs.seq_ids_q)
        max_seqlen_q, max_seqlen_k = seqs.max_seqlen_q, seqs.max_seqlen_k
        num_q, num_heads, qk_dim = q.shape
        v_dim = v.shape[-1]
        v_in = pad_v(v, qk_dim)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v_in, cu_seqlens_q, cu_seqlens_k, max(max_seqlen_q, 1), max(max_seqlen_k, 1),
            0.0, causal, False, scale=softmax_scale,
        )
        if seq_ids_q is None:
            seq_ids_q = seq_ids_from_cu(cu_seqlens_q, num_q)
        lse = lse_to_tokens_heads(lse, num_q, num_heads, seq_ids_q, cu_seqlens_q)
        out, lse = fix_empty_rows(out, lse, cu_seqlens_k, seq_ids_q)
        return out[..., :v_dim], lse
