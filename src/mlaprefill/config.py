"""MLA head dimensions and named presets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["PRESETS", "MLAConfig"]


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Head dimensions of one multi-head latent attention layer.

    Each cached token is one latent row ``[kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)]``
    shared by all heads; per head, keys are ``[k_nope (qk_nope_head_dim) | k_pe]`` and values
    have ``v_head_dim``.
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``qk_nope_head_dim + qk_rope_head_dim`` (192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def default_softmax_scale(self) -> float:
        """``1 / sqrt(qk_head_dim)``; callers with YaRN mscale pass their own scale."""
        return self.qk_head_dim ** -0.5

    @classmethod
    def from_preset(cls, name: str) -> MLAConfig:
        """Return the named preset (see :data:`PRESETS`)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown MLA preset {name!r}; choose one of {sorted(PRESETS)}"
            ) from None


PRESETS: Mapping[str, MLAConfig] = MappingProxyType({
    "deepseek-v3": MLAConfig(num_heads=128),
    "deepseek-v2-lite": MLAConfig(num_heads=16),
    "kimi-k2": MLAConfig(num_heads=64),
    # Not a real model: a tiny shape for CPU runs and tests.
    "tiny": MLAConfig(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                      v_head_dim=16),
})
