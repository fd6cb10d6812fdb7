"""Guarded Triton import: the package must import on machines without Triton."""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "cdiv", "next_power_of_2", "tl", "triton", "use_triton"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` costs ~2 us a call in newer Triton, where it
    is a constexpr function; launches compute grids with this one)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), host ints."""
    return 1 << max(n - 1, 0).bit_length()


def use_triton(*tensors: object) -> bool:
    """Whether the Triton path should run for these tensors.

    Triton runs on CUDA tensors, and on CPU tensors only under ``TRITON_INTERPRET=1`` (used by the
    tests to check kernel logic without a GPU).
    """
    if not HAS_TRITON:
        return False
    kinds = [t.device.type for t in tensors]  # type: ignore[attr-defined]
    if all(kind == "cuda" for kind in kinds):
        return bool(kinds)
    return all(kind == "cpu" for kind in kinds) and os.environ.get("TRITON_INTERPRET") == "1"
