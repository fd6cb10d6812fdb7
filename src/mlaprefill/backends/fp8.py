"""``mlaprefill-fp8`` backend (opt-in): the context attention in FP8 on Hopper's FP8 tensor cores.

The ``mlaprefill`` backend for everything but the context iterations' attention, which runs
:func:`~mlaprefill.kernels.fp8_attention.fp8_context_attention`. Each chunk's keys and values
are written as ``float8_e4m3fn`` by the up-projection's epilogue
(:func:`~mlaprefill.kernels.fp8_upproj.upproject_fp8`: no bf16 K/V, no quantizing pass), with one
float32 scale per chunk for K and one for V, bounded from the latent rows' and the weight's row
norms; the queries get one scale per token and head (:func:`~mlaprefill.kernels.fp8_attention.
quantize_rows`, once per context iteration: a cached copy would go stale under graph replay);
the softmax and the merge stay in float32. Given bf16 keys and values directly (``attend``, or
latent rows a TMA descriptor cannot read), it quantizes them first
(:func:`~mlaprefill.kernels.fp8_attention.quantize_context`). The new tokens' causal attention
runs in bf16, as in ``mlaprefill``.

Where it pays: the FP8 kernel saves part of the attention's time, which grows with the queries
per key, while the queries' quantizing and the kernel's fixed costs do not shrink with them. A
context call runs FP8 only when its ``max_seqlen_q`` (a host int) is at least ``min_queries``
(default :data:`FP8_MIN_QUERIES`, from the H200's measured break-even:
benchmarks/results/attention_vs_ideal_fp8*_h200.json), bf16 otherwise; ``min_queries=0`` runs
FP8 always. The result is *not* the bf16 path's to rounding: e4m3 keeps 3 mantissa bits, and
the error it adds is measured against the float64 reference in benchmarks/fp8_attention.py
(docs/RESULTS.md). Never picked by ``auto``: select it by name,
``MLAChunkedPrefill(..., backend="mlaprefill-fp8")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mlaprefill.backends.base import VarlenSeqs
from mlaprefill.backends.mlaprefill import MLAPrefillBackend
from mlaprefill.kernels.fp8_attention import (
    FP8Context,
    fp8_context_attention,
    quantize_context,
    quantize_rows,
)
from mlaprefill.kernels.fp8_upproj import (
    aligned_for_upproject_fp8,
    upproject_fp8,
    weight_row_norms,
)

if TYPE_CHECKING:
    from mlaprefill.weights import UpProjection

__all__ = ["FP8_MIN_QUERIES", "MLAPrefillFP8Backend"]

#: Context calls with at least this many queries in a sequence (``max_seqlen_q``) run in FP8: the
#: smallest count measured faster on the H200, one context step from latent rows with the fused
#: up-projection and the Gluon kernel (0.87-0.90x the bf16 step's time at 1,024 queries, 1.06x at
#: 256; benchmarks/results/fp8_attention_h200.json "chunk").
FP8_MIN_QUERIES = 1024


def _pow2_in(n: int, lo: int, hi: int) -> bool:
    return lo <= n <= hi and not n & (n - 1)


def _fitting(upproj: UpProjection, buf: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
             v_padded: bool) -> torch.Tensor:
    # buf, or a new buffer where it is too small: a graph arena sizes it by
    # context_writes_buffer, which counts FP8 calls as not writing it; a call that falls back
    # here after all (a layout the FP8 up-projection does not take) still gets room.
    need = upproj.kv_numel(kv_c.shape[0], upproj.qk_nope_head_dim + k_pe.shape[-1], v_padded)
    return buf if buf.numel() >= need else torch.empty(need, dtype=buf.dtype, device=buf.device)


class MLAPrefillFP8Backend(MLAPrefillBackend):
    """``mlaprefill`` with the context attention in FP8 (module docstring)."""

    name = "mlaprefill-fp8"

    def __init__(self, *, min_queries: int = FP8_MIN_QUERIES, **kwargs) -> None:
        if isinstance(min_queries, bool) or not isinstance(min_queries, int) or min_queries < 0:
            raise ValueError(f"MLAPrefillFP8Backend min_queries must be an int >= 0, got "
                             f"{min_queries!r}")
        super().__init__(**kwargs)
        self.min_queries = min_queries

    def runs_fp8(self, seqs: VarlenSeqs, causal: bool) -> bool:
        """Whether a call with these offsets runs the FP8 kernel (host ints only): context calls
        (non-causal) with ``max_seqlen_q >= min_queries``."""
        return not causal and seqs.max_seqlen_q >= self.min_queries

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
        # The FP8 kernel reads split keys; other calls are the bf16 backend's own.
        return not self.runs_fp8(seqs, causal) and super().wants_joined_keys(seqs, num_heads,
                                                                             causal)

    def context_writes_buffer(self, seqs: VarlenSeqs, *, joined: bool) -> bool:
        return joined or not self.runs_fp8(seqs, False)

    def launch_key(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> tuple:
        if self.runs_fp8(seqs, causal):
            return ("fp8",)
        return super().launch_key(seqs, num_heads, causal)

    def project_context(self, upproj: UpProjection, kv_c: torch.Tensor, k_pe: torch.Tensor,
                        buf: torch.Tensor, seqs: VarlenSeqs, *, joined: bool,
                        v_padded: bool) -> tuple[Any, Any]:
        # FP8 calls: (FP8Context, None) from the GEMM's e4m3 epilogue; others as mlaprefill,
        # also under a caller's strided weight (then quantized by attend)
        w_kv = None
        if not (joined or not self.runs_fp8(seqs, False) or k_pe.dim() != 2
                or kv_c.dtype not in (torch.bfloat16, torch.float16)
                or not aligned_for_upproject_fp8(kv_c)):
            w_kv, _ = upproj.weights(k_pe.shape[1], kv_c.dtype, kv_c.device, joined=False,
                                     v_padded=False)
        if w_kv is None or not w_kv.is_contiguous():
            return super().project_context(upproj, kv_c, k_pe, _fitting(upproj, buf, kv_c, k_pe,
                                                                     v_padded),
                                           seqs, joined=joined, v_padded=v_padded)
        nope, v = upproj.qk_nope_head_dim, upproj.v_head_dim
        norms = upproj.derived(("fp8-row-norms", kv_c.dtype, kv_c.device),
                               lambda: weight_row_norms(w_kv, nope, v))
        # Rows past the attention's last key are a graph bucket's padding: not in the scales.
        return upproject_fp8(kv_c, k_pe, w_kv, norms, nope=nope, v=v,
                             valid_rows=seqs.cu_seqlens_k[-1:]), None

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
             state: tuple[torch.Tensor, torch.Tensor] | None, causal: bool,
             softmax_scale: float, k_rope: torch.Tensor | None,
             into: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # What attend, attend_and_merge and attend_and_store all run (state: merged into; into:
        # overwritten).
        # FP8 takes an FP8Context (project_context) or split bf16 keys with the rope key shared
        # by every head, which it quantizes first.
        if isinstance(k, FP8Context):
            ctx = k
        elif not self.runs_fp8(seqs, causal) or k_rope is None or k_rope.dim() != 2:
            return super()._run(q, k, v, seqs, state, causal, softmax_scale, k_rope, into)
        else:
            ctx = quantize_context(k, k_rope, v, valid_rows=seqs.cu_seqlens_k[-1:])
        q8, q_scale = quantize_rows(q)
        return fp8_context_attention(q8, q_scale, ctx, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                     max_seqlen_q=seqs.max_seqlen_q, softmax_scale=softmax_scale,
                                     state=state, out=into, out_dtype=q.dtype)
