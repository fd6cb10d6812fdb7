"""Device kernels of the forward, each a Triton kernel beside its torch fallback.

* :mod:`mlaprefill.kernels.gather` — one iteration's context rows from the paged latent cache into
  the contiguous workspace.
* :mod:`mlaprefill.kernels.merge` — merge two partial attention results by their log-sum-exp.
* :mod:`mlaprefill.kernels.rope` — MLA's shared rope key into every head's key (joined layout).
* :mod:`mlaprefill.kernels.attention` — our varlen flash attention with LSE (Triton only).
* :mod:`mlaprefill.kernels.hopper_attention` — the same contract as a warp-specialized Gluon
  kernel for sm_90, which :func:`~mlaprefill.kernels.attention.varlen_attention` runs by default
  where it applies.
* :mod:`mlaprefill.kernels.fp8_attention` — the opt-in FP8 (e4m3) context attention and its
  quantizing pass (Triton only; the ``mlaprefill-fp8`` backend).

Triton is optional: without it (or on CPU tensors) the torch fallbacks run. Both paths are
sync-free and CUDA-graph safe (shapes come from host ints only).
"""

from __future__ import annotations

from mlaprefill.kernels.gather import gather_context_rows, gather_context_rows_torch
from mlaprefill.kernels.merge import merge_attention_states, merge_attention_states_torch
from mlaprefill.kernels.rope import broadcast_rope_

__all__ = [
    "broadcast_rope_",
    "gather_context_rows",
    "gather_context_rows_torch",
    "merge_attention_states",
    "merge_attention_states_torch",
    "triton_available",
]


def triton_available() -> bool:
    """True when Triton can be imported (the kernels then run on CUDA tensors)."""
    from mlaprefill.kernels._triton import HAS_TRITON

    return HAS_TRITON
