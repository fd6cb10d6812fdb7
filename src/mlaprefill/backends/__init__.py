"""Attention backends returning ``(out, lse)`` for a packed varlen batch.

``mlaprefill`` (our flash attention, one launch per call: the warp-specialized Gluon kernel on
Hopper, the Triton kernel elsewhere, there with cuDNN on the large rectangles of long sequences),
``cudnn`` (cuDNN fused attention, one launch per sequence), ``fa2`` (PyTorch's FlashAttention-2
varlen, V padded to the QK width), ``flex`` (FlexAttention, document block mask) and ``math``
(masked dense torch, CPU/float64). ``get_backend("auto", ...)`` picks the
first of :data:`AUTO_ORDER` that supports the device, dtype and head dims; the choice is visible
as ``backend.name``.
"""

from __future__ import annotations

import torch

from mlaprefill.backends.base import (
    AttentionBackend,
    VarlenSeqs,
    fix_empty_rows,
    isolate_nonfinite_values,
    seq_ids_from_cu,
)
from mlaprefill.backends.cudnn import CudnnBackend
from mlaprefill.backends.fa2 import FA2Backend
from mlaprefill.backends.flex import FlexBackend
from mlaprefill.backends.fp8 import MLAPrefillFP8Backend
from mlaprefill.backends.math import MathBackend
from mlaprefill.backends.mlaprefill import MLAPrefillBackend

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "AttentionBackend",
    "VarlenSeqs",
    "fix_empty_rows",
    "get_backend",
    "isolate_nonfinite_values",
    "seq_ids_from_cu",
]

BACKENDS: dict[str, type[AttentionBackend]] = {
    "mlaprefill": MLAPrefillBackend,
    "cudnn": CudnnBackend,
    "fa2": FA2Backend,
    "flex": FlexBackend,
    "math": MathBackend,
    # opt-in (never auto): the context attention in FP8 (backends/fp8.py)
    "mlaprefill-fp8": MLAPrefillFP8Backend,
}

#: ``auto`` preference (H200, bf16, qk 192 / v 128; docs/RESULTS.md): ``mlaprefill`` (on Hopper
#: our Gluon kernel at 0.90-1.08x cuDNN's time; elsewhere our Triton kernel, 430-510 TFLOP/s on
#: long non-causal chunks of an H200, with cuDNN on the large rectangles of long sequences from
#: a fixed grid of shapes), ``cudnn`` (~600 TFLOP/s but one graph build of 40-90 ms per new
#: (q_len, k_len) and one launch per sequence), ``fa2`` (~270), ``flex`` (compiles per new shape)
#: and ``math`` (CPU / float64).
AUTO_ORDER: tuple[str, ...] = ("mlaprefill", "cudnn", "fa2", "flex", "math")


def get_backend(name: str, *, device: torch.device | str, dtype: torch.dtype, qk_head_dim: int,
                v_head_dim: int, qk_rope_head_dim: int | None = None) -> AttentionBackend:
    """Instantiate backend ``name`` (or the best for ``"auto"``) for these inputs.

    With ``qk_rope_head_dim`` the split of ``qk_head_dim`` into MLA's nope and rope parts is
    checked too (:meth:`AttentionBackend.head_split_reason`).

    Raises
    ------
    ValueError
        Unknown name, or a named backend that cannot run these inputs (the reason is given).
    """
    device = torch.device(device)

    def reason(backend: AttentionBackend) -> str | None:
        why = backend.unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
        if why is None and qk_rope_head_dim is not None:
            why = backend.head_split_reason(qk_head_dim - qk_rope_head_dim, qk_rope_head_dim)
        return why

    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]()
            why = reason(backend)
            if why is None:
                return backend
            reasons.append(f"{candidate}: {why}")
        raise ValueError("no attention backend supports these inputs: " + "; ".join(reasons))
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *BACKENDS]}")
    backend = BACKENDS[name]()
    why = reason(backend)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run on {device} with {dtype}, "
                         f"qk_head_dim={qk_head_dim}, v_head_dim={v_head_dim}: {why}; "
                         f"use backend='auto' or 'math'")
    return backend
