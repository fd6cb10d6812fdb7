"""Our own flash-attention forward alone, the base of the ``mlaprefill`` backend
(:mod:`mlaprefill.backends.mlaprefill`, which adds cuDNN rectangles where they win); not a
registered backend name. :func:`mlaprefill.kernels.attention.varlen_attention` runs, on an
sm_90 GPU, the warp-specialized Gluon kernel of :mod:`mlaprefill.kernels.hopper_attention`,
elsewhere the Triton kernel.

One launch per call, no padding of V (the kernel handles ``v_head_dim != qk_head_dim``), LSE
natural log, empty sequences ``out = 0, lse = -inf`` and the NaN rules of :mod:`.base` inside the
kernel, so no fix-up pass after it. It takes split keys (``wants_joined_keys`` is False: MLA's
rope key ``k_rope [Tk, rope]`` apart, read with head stride 0) and merges into the forward's
running ``(out, lse)`` in the kernel's epilogue (``attend_and_merge``): no merge pass.
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import AttentionBackend, VarlenSeqs
from mlaprefill.kernels._triton import device_reason
from mlaprefill.kernels.attention import (
    MAX_HEAD_DIM,
    MIN_QK_HEAD_DIM,
    AttentionConfig,
    num_compiled_kernels,
    varlen_attention,
)

__all__ = ["TritonBackend"]


class TritonBackend(AttentionBackend):
    """Our varlen flash attention alone (CUDA fp16/bf16; CPU under ``TRITON_INTERPRET=1``).

    Parameters
    ----------
    config : AttentionConfig, optional
        Tiles and launch options (default: the kernel's Hopper default); for config sweeps.
    """

    name = "mlaprefill-kernel"  # not registered: the base of MLAPrefillBackend
    # One program per (query block, sequence, head) over all of the sequence's keys, no split-KV:
    # the same shape of work as FlashAttention-2 varlen, so the same policy. ``packed`` can leave
    # one long request alone in an iteration; with few heads (tensor parallelism) and a short
    # query count that is fewer programs than the 132 SMs (e.g. 8 heads x 1k queries / 128 = 64).
    preferred_policy = "balanced"
    needs_seq_ids = False
    takes_split_keys = True

    def __init__(self, config: AttentionConfig | None = None) -> None:
        self.config = config

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        why = device_reason(device.type)  # the rule of kernels._triton.use_triton
        if why is not None:
            return why
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "CUDA is not available"
            if dtype not in (torch.float16, torch.bfloat16):
                return f"needs float16/bfloat16 on CUDA, got {dtype}"
        elif dtype not in (torch.float16, torch.float32):
            # bfloat16 tl.dot is wrong in Triton's interpreter (it multiplies the raw bits).
            return f"the Triton interpreter runs float16/float32, got {dtype}"
        if not (MIN_QK_HEAD_DIM <= qk_head_dim <= MAX_HEAD_DIM
                and 1 <= v_head_dim <= MAX_HEAD_DIM):
            return (f"head dims qk={qk_head_dim}, v={v_head_dim} unsupported (need "
                    f"{MIN_QK_HEAD_DIM} <= qk <= {MAX_HEAD_DIM}, v <= {MAX_HEAD_DIM})")
        return None

    def head_split_reason(self, qk_nope_head_dim: int, qk_rope_head_dim: int) -> str | None:
        # The kernel reads k_rope apart (kernels.attention._check): the nope part is its first
        # QK dot, a power of two >= MIN_QK_HEAD_DIM, and the rope part is at least one column.
        nope, rope = qk_nope_head_dim, qk_rope_head_dim
        if nope < MIN_QK_HEAD_DIM or nope & (nope - 1):
            return (f"qk_nope_head_dim={nope} must be a power of two >= {MIN_QK_HEAD_DIM} (the "
                    f"kernel's first QK dot; the rope key is read apart)")
        if rope < 1:
            return f"qk_rope_head_dim={rope} must be >= 1 (the kernel reads the rope key apart)"
        return None

    def builds(self) -> int | None:
        """Kernels compiled in this process (one per dtype, head dims, causal and config; never
        per sequence length)."""
        return num_compiled_kernels()

    def wants_joined_keys(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> bool:
        return False  # the kernel reads the rope key apart (head stride 0)

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
                causal: bool, softmax_scale: float, k_rope: torch.Tensor | None,
                **into: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # into: nothing (new tensors), state= (merged in the epilogue) or out= (stored there)
        return varlen_attention(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                max_seqlen_q=seqs.max_seqlen_q, causal=causal,
                                softmax_scale=softmax_scale, config=self.config, k_rope=k_rope,
                                **into)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float, k_rope: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._varlen(q, k, v, seqs, causal, softmax_scale, k_rope)

    def attend_and_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
                         out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                         softmax_scale: float, k_rope: torch.Tensor | None = None) -> None:
        # The kernel merges into (out, lse) in its epilogue: no partial result, no merge pass.
        self._varlen(q, k, v, seqs, causal, softmax_scale, k_rope, state=(out, lse))

    def attend_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seqs: VarlenSeqs, out: torch.Tensor, lse: torch.Tensor, *,
                         causal: bool, softmax_scale: float,
                         k_rope: torch.Tensor | None = None) -> None:
        # The kernel stores straight into (out, lse): no result tensors, no copy.
        self._varlen(q, k, v, seqs, causal, softmax_scale, k_rope, out=(out, lse))
