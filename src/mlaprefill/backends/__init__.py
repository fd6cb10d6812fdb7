"""Attention backends returning ``(out, lse)`` for a packed varlen batch.

``hybrid`` (cuDNN on large rectangles + ``triton``; on Hopper no rectangles), ``triton`` (our
flash attention, varlen: the warp-specialized Gluon kernel on Hopper, the Triton kernel
elsewhere), ``cudnn`` (cuDNN fused attention), ``flex`` (FlexAttention, document block mask),
``varlen`` (FlashAttention-2 varlen, V padded to the QK width) and ``math`` (masked dense torch,
CPU/float64). ``get_backend("auto", ...)`` picks the
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
from mlaprefill.backends.flex import FlexBackend
from mlaprefill.backends.hybrid import HybridBackend
from mlaprefill.backends.math import MathBackend
from mlaprefill.backends.triton import TritonBackend
from mlaprefill.backends.varlen import VarlenFlashBackend

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
    "hybrid": HybridBackend,
    "triton": TritonBackend,
    "cudnn": CudnnBackend,
    "flex": FlexBackend,
    "varlen": VarlenFlashBackend,
    "math": MathBackend,
}

#: ``auto`` preference (H200, bf16, qk 192 / v 128; benchmarks/results/triton_attention_h200.json,
#: attention_h200.json "vs_ideal"): ``hybrid`` (cuDNN on the large rectangles of long sequences,
#: from a fixed grid of shapes, our kernel on everything else: one launch per call, compiled
#: once, plus at most 4 cuDNN launches that each run >= ~1 ms; on Hopper our Gluon kernel alone,
#: which runs at 0.90-1.08x cuDNN's time), ``triton`` (ours alone: on Hopper the Gluon kernel,
#: elsewhere the Triton one, 430-510 TFLOP/s on long non-causal chunks of an H200), ``cudnn``
#: (~600 TFLOP/s but one graph build of 40-90 ms per new (q_len, k_len) and one launch per
#: sequence), FA2 ``varlen`` (~270), ``flex`` (compiles per new shape) and ``math`` (CPU /
#: float64).
AUTO_ORDER: tuple[str, ...] = ("hybrid", "triton", "cudnn", "varlen", "flex", "math")


def get_backend(name: str, *, device: torch.device | str, dtype: torch.dtype, qk_head_dim: int,
                v_head_dim: int) -> AttentionBackend:
    """Instantiate backend ``name`` (or the best for ``"auto"``) for these inputs.

    Raises
    ------
    ValueError
        Unknown name, or a named backend that cannot run these inputs (the reason is given).
    """
    device = torch.device(device)
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            backend = BACKENDS[candidate]()
            why = backend.unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
            if why is None:
                return backend
            reasons.append(f"{candidate}: {why}")
        raise ValueError("no attention backend supports these inputs: " + "; ".join(reasons))
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *BACKENDS]}")
    backend = BACKENDS[name]()
    why = backend.unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
    if why is not None:
        raise ValueError(f"backend {name!r} cannot run on {device} with {dtype}, "
                         f"qk_head_dim={qk_head_dim}, v_head_dim={v_head_dim}: {why}; "
                         f"use backend='auto' or 'math'")
    return backend
