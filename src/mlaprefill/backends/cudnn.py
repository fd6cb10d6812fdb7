"""``cudnn`` backend: cuDNN's fused attention through ``aten._cudnn_attention_forward``.

The ragged (varlen) form takes packed ``q [Tq, H, Dqk]``, ``k [Tk, H, Dqk]``, ``v [Tk, H, Dv]``
with ``cum_seq_q`` / ``cum_seq_k`` and supports ``Dv != Dqk`` (192/128 without padding). cuDNN
computes ragged offsets as ``cum_seq * H * D``, so q, k and v must be contiguous. Its softmax
stats come back as ``[Tq, H, 1]`` (natural log). A sequence with no keys is undefined in cuDNN;
:func:`fix_empty_rows` sets those rows to ``out = 0, lse = -inf``.
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    fix_empty_rows,
    lse_to_tokens_heads,
    seq_ids_from_cu,
)

__all__ = ["CudnnBackend"]


class CudnnBackend(AttentionBackend):
    """cuDNN SDPA, ragged batch (CUDA, fp16/bf16, head dims <= 256 and multiples of 8)."""

    name = "cudnn"

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
        if not hasattr(torch.ops.aten, "_cudnn_attention_forward"):
            return "torch has no aten._cudnn_attention_forward"
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, *, causal: bool, softmax_scale: float,
               seq_ids_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        num_q, num_heads, _ = q.shape
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
