"""Attention backends returning ``(out, lse)`` for a packed varlen batch.

``cudnn`` (cuDNN fused attention, ragged), ``flex`` (FlexAttention, document block mask),
``varlen`` (FlashAttention-2 varlen, V padded to the QK width) and ``math`` (masked dense torch,
CPU/float64). ``get_backend("auto", ...)`` picks the first of :data:`AUTO_ORDER` that supports the
device, dtype and head dims; the choice is visible as ``backend.name``.
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
from mlaprefill.backends.math import MathBackend
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
    "cudnn": CudnnBackend,
    "flex": FlexBackend,
    "varlen": VarlenFlashBackend,
    "math": MathBackend,
}

#: ``auto`` preference, fastest first (H200, benchmarks/results/attention_h200.json: cuDNN 520-620
#: TFLOP/s on 4k x 16k-64k chunks, FA2 varlen ~250-270, flex ~160-290). cuDNN builds one graph per
#: new (q_len, k_len) shape (~50-90 ms of host time, cached after); pass ``backend="varlen"`` where
#: lengths never repeat. flex is last of the GPU backends: it compiles per new shape.
AUTO_ORDER: tuple[str, ...] = ("cudnn", "varlen", "flex", "math")


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
