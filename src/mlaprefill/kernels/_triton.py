"""Guarded Triton import: the package must import on machines without Triton."""

from __future__ import annotations

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]


def use_triton(*tensors: object) -> bool:
    """Whether the Triton path should run for these tensors.

    Triton runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (used by the
    tests to check kernel logic without a GPU).
    """
    import os

    if not HAS_TRITON:
        return False
    devices = {t.device.type for t in tensors}  # type: ignore[attr-defined]
    if devices == {"cuda"}:
        return True
    return devices == {"cpu"} and os.environ.get("TRITON_INTERPRET") == "1"
