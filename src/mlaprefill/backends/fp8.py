"""``mlaprefill-fp8`` backend (opt-in): the context attention in FP8 on Hopper's FP8 tensor cores.

The ``mlaprefill`` backend for everything but the context iterations' attention, which runs
:func:`~mlaprefill.kernels.fp8_attention.fp8_context_attention`: the queries and each chunk's
up-projected keys and values are rounded to ``float8_e4m3fn`` with one float32 scale per token
and head (:func:`~mlaprefill.kernels.fp8_attention.quantize_context`, one pass over the
up-projection's output), the softmax and the merge stay in float32. The new tokens' causal
attention runs in bf16, as in ``mlaprefill``. The result is *not* the bf16 path's to rounding:
e4m3 keeps 3 mantissa bits, and the error it adds is measured against the float64 reference in
benchmarks/fp8_attention.py (docs/RESULTS.md). Never picked by ``auto``: select it by name,
``MLAChunkedPrefill(..., backend="mlaprefill-fp8")``.
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import VarlenSeqs
from mlaprefill.backends.mlaprefill import MLAPrefillBackend
from mlaprefill.kernels.fp8_attention import (
    fp8_context_attention,
    quantize_context,
    quantize_rows,
)

__all__ = ["MLAPrefillFP8Backend"]


def _pow2_in(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and not n & (n - 1)


class MLAPrefillFP8Backend(MLAPrefillBackend):
    """``mlaprefill`` with the context attention in FP8 (module docstring)."""

    name = "mlaprefill-fp8"

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        why = super().unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
        if why is not None:
            return why
        if dtype not in (torch.bfloat16, torch.float16):
            return f"the FP8 path takes bfloat16 or float16 inputs, got {dtype}"
        if not _pow2_in(v_head_dim, 16, 256):
            return f"v_head_dim must be a power of two in [16, 256], got {v_head_dim}"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 matrix products need compute capability 8.9 or newer (Ada, Hopper)"
        return None

    def head_split_reason(self, qk_nope_head_dim: int, qk_rope_head_dim: int) -> str | None:
        for name, dim in (("qk_nope_head_dim", qk_nope_head_dim),
                          ("qk_rope_head_dim", qk_rope_head_dim)):
            if not _pow2_in(dim, 16, 256):
                return f"the FP8 kernel needs {name} a power of two in [16, 256], got {dim}"
        return None

    def wants_joined_keys(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> bool:
        # The FP8 kernel reads split keys; causal calls are the bf16 backend's own.
        return causal and super().wants_joined_keys(seqs, num_heads, causal)

    def launch_key(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> tuple:
        return super().launch_key(seqs, num_heads, causal) if causal else ()

    def _fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
             softmax_scale: float, k_rope: torch.Tensor, state=None, into=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        q8, q_scale = quantize_rows(q)
        ctx = quantize_context(k, k_rope, v)
        return fp8_context_attention(q8, q_scale, ctx, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                     max_seqlen_q=seqs.max_seqlen_q, softmax_scale=softmax_scale,
                                     state=state, out=into, out_dtype=q.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float, k_rope: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if causal or k_rope is None or k_rope.dim() != 2:
            return super().attend(q, k, v, seqs, causal=causal, softmax_scale=softmax_scale,
                                  k_rope=k_rope)
        return self._fp8(q, k, v, seqs, softmax_scale, k_rope)

    def attend_and_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
                         out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                         softmax_scale: float, k_rope: torch.Tensor | None = None) -> None:
        if causal or k_rope is None or k_rope.dim() != 2:
            super().attend_and_merge(q, k, v, seqs, out, lse, causal=causal,
                                     softmax_scale=softmax_scale, k_rope=k_rope)
            return
        self._fp8(q, k, v, seqs, softmax_scale, k_rope, state=(out, lse))

    def attend_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seqs: VarlenSeqs, out: torch.Tensor, lse: torch.Tensor, *,
                         causal: bool, softmax_scale: float,
                         k_rope: torch.Tensor | None = None) -> None:
        if causal or k_rope is None or k_rope.dim() != 2:
            super().attend_and_store(q, k, v, seqs, out, lse, causal=causal,
                                     softmax_scale=softmax_scale, k_rope=k_rope)
            return
        self._fp8(q, k, v, seqs, softmax_scale, k_rope, into=(out, lse))
