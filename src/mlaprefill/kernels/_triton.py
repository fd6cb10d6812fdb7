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

__all__ = ["HAS_TRITON", "cdiv", "check_tiles", "device_reason", "ensure_allocator",
           "next_power_of_2", "pow2_at_least_16", "tl", "triton", "use_triton"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` costs ~2 us a call in newer Triton, where it
    is a constexpr function; launches compute grids with this one)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), host ints."""
    return 1 << max(n - 1, 0).bit_length()


def pow2_at_least_16(n: int) -> int:
    """The smallest power of two >= ``max(n, 16)``: a tile width for ``n`` columns (tl.dot and
    tl.arange want powers of two, the MMA at least 16)."""
    return max(16, next_power_of_2(n))


def check_tiles(owner: str, block_m: object, block_n: object, num_warps: object,
                num_stages: object, *, names: tuple[str, str] = ("block_m", "block_n")) -> None:
    """``ValueError`` naming ``owner.field`` unless the tiles are powers of two >= 16 (tl.dot's
    minimum), ``num_warps`` one of 1, 2, 4, 8, 16 and ``num_stages`` an int >= 1: the fields a
    kernel config of :mod:`~mlaprefill.kernels.attention`,
    :mod:`~mlaprefill.kernels.fp8_attention` or :mod:`~mlaprefill.kernels.fp8_upproj` shares
    (``names``: the two tile fields' names)."""
    for name, value in zip(names, (block_m, block_n), strict=True):
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{owner}.{name} must be a power of two >= 16 (tl.dot's minimum "
                             f"tile), got {value!r}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{owner}.num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"{owner}.num_stages must be an int >= 1, got {num_stages!r}")


def device_reason(device_type: str) -> str | None:
    """Why Triton kernels cannot run on tensors of this device type, or None: they run on CUDA,
    and on CPU only under ``TRITON_INTERPRET=1`` (the tests check kernel logic that way)."""
    if not HAS_TRITON:
        return "Triton is not installed"
    if device_type == "cuda":
        return None
    if device_type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "needs a CUDA device (CPU only under TRITON_INTERPRET=1)"
    return f"needs a CUDA device, got {device_type}"


def use_triton(*tensors: object) -> bool:
    """Whether the Triton path should run for these tensors: all on one device type that
    :func:`device_reason` accepts."""
    kinds = {t.device.type for t in tensors}  # type: ignore[attr-defined]
    return len(kinds) == 1 and device_reason(kinds.pop()) is None


def _torch_scratch(size: int, alignment: int, stream: object) -> object:
    import torch

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    """Give Triton an allocator for kernels' scratch memory (device-side tensor descriptors need
    one) unless one is set in this context: ours takes it from torch's caching allocator, stream
    ordered, so it never synchronizes. A caller's own allocator is left in place."""
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        unset = isinstance(current, _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton layout: set ours
        unset = True
    if unset:
        triton.set_allocator(_torch_scratch)
