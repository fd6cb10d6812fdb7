"""Latent cache formats: the compute dtype, FP8 e4m3 with one scale, DeepSeek's ``fp8_ds_mla``.

A paged latent cache is ``[num_blocks, page_size, record]``; one record per cached token. The
forward dequantizes while it gathers (:mod:`mlaprefill.kernels.gather`), so the workspace and
everything after it hold rows in the compute dtype (q's) whatever the cache holds.

=================  ==========================  ==========================================
format             cache dtype, record         dequantized row ``[kv_lora_rank + rope]``
=================  ==========================  ==========================================
compute dtype      q's dtype, ``rank + rope``  the row itself
``fp8`` (e4m3)     ``float8_e4m3fn``,          ``(x.to(float32) * kv_cache_scale)`` cast
                   ``rank + rope``             to the compute dtype (vLLM's
                                               ``kv_cache_dtype="fp8"``: one scale per layer)
``fp8_ds_mla``     ``uint8``, 656 bytes        bytes ``[0, 512)``: 512 e4m3 latent values;
                                               ``[512, 528)``: 4 float32 scales, one per
                                               128 values; ``[528, 656)``: 64 bfloat16 rope
                                               values (not quantized). Latent value ``j`` is
                                               ``e4m3[j].to(float32) * scales[j // 128]``
=================  ==========================  ==========================================

A float8 cache is recognised by its dtype (``float8_e4m3fn``; ``e5m2`` is refused: vLLM's MLA
caches are e4m3). ``fp8_ds_mla`` is a byte layout in a ``uint8`` tensor, so it is never guessed
from a shape: it is named (``kv_cache_format="fp8_ds_mla"``), and a ``uint8`` cache without the
name is an error. ``kv_cache_scale`` (fp8 only) is a Python float or a 1-element float32 tensor
on the cache's device; a tensor is read by the device only (never on the host: no sync), which
is what an engine with a per-layer scale tensor passes.

e4m3fn has NaN but no inf: :func:`write_kv_cache` stores an inf of its input as NaN (a cast
would saturate it to 448, a silent wrong value), so a non-finite input stays non-finite in the
request that owns it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FP8_DS_MLA_RECORD_BYTES", "KV_CACHE_FORMATS", "KVCacheSpec", "dequantize_rows",
           "kv_cache_dims", "resolve_kv_cache", "write_kv_cache"]

#: The named byte layouts ``kv_cache_format`` accepts (``None``: the cache's dtype says it).
KV_CACHE_FORMATS = ("fp8_ds_mla",)
#: Bytes per token of ``fp8_ds_mla``: 512 e4m3 + 4 float32 scales + 64 bfloat16 rope values.
FP8_DS_MLA_RECORD_BYTES = 656
DS_MLA_RANK, DS_MLA_ROPE, DS_MLA_GROUP = 512, 64, 128
_DS_SCALES_AT, _DS_ROPE_AT = 512, 528  # byte offsets inside a record
#: Largest finite e4m3fn value.
FP8_E4M3_MAX = 448.0

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """How to read a cache's records as compute-dtype rows (checked: :func:`resolve_kv_cache`).

    Attributes
    ----------
    kind : ``"plain"`` (the compute dtype), ``"fp8"`` or ``"fp8_ds_mla"``
    scale : float or None
        fp8 with a host scale: the scale, already rounded to float32 (the kernel multiplies in
        float32). None otherwise.
    scale_tensor : float32 tensor of one element or None
        fp8 with a device scale (read on the device only).
    latent_dim : int
        Width of a dequantized row, ``kv_lora_rank + qk_rope_head_dim``.
    """

    kind: str
    scale: float | None
    scale_tensor: torch.Tensor | None
    latent_dim: int

    @property
    def key(self) -> tuple[Any, ...]:
        """What a captured launch depends on (a CUDA graph records the scale's value or
        address)."""
        ptr = None if self.scale_tensor is None else self.scale_tensor.data_ptr()
        return (self.kind, self.scale, ptr)


PLAIN = "plain"


def _check_scale(scale: Any, kv_cache: torch.Tensor) -> tuple[float | None, torch.Tensor | None]:
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1 or scale.dim() > 1:
            raise ValueError(f"kv_cache_scale must be a float or a 1-element float32 tensor, "
                             f"got a {scale.dtype} tensor of shape {tuple(scale.shape)}")
        if scale.device != kv_cache.device:
            raise ValueError(f"kv_cache_scale is on {scale.device}, kv_cache on "
                             f"{kv_cache.device}; put the scale tensor on the cache's device")
        return None, scale.reshape(1)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"kv_cache_scale must be a float, a 1-element float32 tensor or None, "
                        f"got {type(scale).__name__}")
    try:
        value = float(torch.tensor(float(scale), dtype=torch.float32))  # what the kernel uses
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"kv_cache_scale must be a finite number > 0 in float32, got "
                         f"{scale!r} (the dequantized value is fp8 x scale)")
    return value, None


def resolve_kv_cache(kv_cache: torch.Tensor, kv_cache_scale: Any = None,
                     kv_cache_format: Any = None, *, latent_dim: int,
                     dtype: torch.dtype, dtype_of: str = "q") -> KVCacheSpec:
    """Check a cache against the rows the forward needs and say how to read it (host only).

    Parameters
    ----------
    kv_cache : [num_blocks, page_size, record]
    kv_cache_scale : float, 1-element float32 tensor or None
        Only for a ``float8_e4m3fn`` cache (default 1.0).
    kv_cache_format : None or ``"fp8_ds_mla"``
    latent_dim : int
        ``kv_lora_rank + qk_rope_head_dim``: the dequantized row's width.
    dtype : the compute dtype
    dtype_of : what has the compute dtype, for messages (``"q"``, ``"workspace"``)

    Raises ``TypeError``/``ValueError`` naming ``kv_cache``, ``kv_cache_scale`` or
    ``kv_cache_format``, with what was expected.
    """
    if kv_cache_format is not None and not isinstance(kv_cache_format, str):
        raise TypeError(f"kv_cache_format must be None or one of {list(KV_CACHE_FORMATS)}, "
                        f"got {type(kv_cache_format).__name__}")
    if kv_cache_format is not None and kv_cache_format not in KV_CACHE_FORMATS:
        raise ValueError(f"kv_cache_format must be None (the cache's dtype says it) or one of "
                         f"{list(KV_CACHE_FORMATS)}, got {kv_cache_format!r}")
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected [num_blocks, "
                         f"page_size, record]")
    record = kv_cache.shape[2]
    if kv_cache_format == "fp8_ds_mla":
        if kv_cache.dtype != torch.uint8:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' needs a torch.uint8 cache of "
                             f"{FP8_DS_MLA_RECORD_BYTES}-byte records, got {kv_cache.dtype}")
        if latent_dim != DS_MLA_RANK + DS_MLA_ROPE:
            raise ValueError(f"kv_cache_format='fp8_ds_mla' holds kv_lora_rank 512 + rope 64 = "
                             f"576 per token, but the weight and k_pe_new give {latent_dim}")
        if record != FP8_DS_MLA_RECORD_BYTES:
            raise ValueError(f"kv_cache has {record} bytes per token, expected "
                             f"{FP8_DS_MLA_RECORD_BYTES} for kv_cache_format='fp8_ds_mla'")
        if kv_cache_scale is not None:
            raise ValueError("kv_cache_scale must be None with kv_cache_format='fp8_ds_mla' "
                             "(its scales are in the records)")
        if any(s % 4 for s in kv_cache.stride()[:2]) or kv_cache.stride(2) != 1 or (
                kv_cache.storage_offset() % 4):
            raise ValueError("an fp8_ds_mla kv_cache needs contiguous 656-byte records at "
                             "4-byte aligned offsets (its float32 scales are read in place)")
        return KVCacheSpec("fp8_ds_mla", None, None, latent_dim)
    if kv_cache.dtype == torch.uint8:
        raise ValueError("kv_cache is torch.uint8: name its byte layout, e.g. "
                         "kv_cache_format='fp8_ds_mla' (DeepSeek's 656-byte records)")
    if kv_cache.dtype == torch.float8_e5m2:
        raise ValueError("kv_cache is float8_e5m2; only float8_e4m3fn (vLLM's fp8 MLA cache) "
                         "is read")
    if record != latent_dim:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected [num_blocks, "
                         f"page_size, {latent_dim}] (kv_lora_rank + qk_rope_head_dim)")
    if kv_cache.dtype == torch.float8_e4m3fn:
        scale, tensor = _check_scale(1.0 if kv_cache_scale is None else kv_cache_scale,
                                     kv_cache)
        return KVCacheSpec("fp8", scale, tensor, latent_dim)
    if kv_cache.dtype != dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != {dtype_of} dtype {dtype}; the "
                         f"cache holds {dtype_of}'s dtype, float8_e4m3fn (with kv_cache_scale) "
                         f"or uint8 records (with kv_cache_format='fp8_ds_mla')")
    if kv_cache_scale is not None:
        raise ValueError(f"kv_cache_scale is for a float8_e4m3fn cache; this one is "
                         f"{kv_cache.dtype}: pass None")
    return KVCacheSpec(PLAIN, None, None, latent_dim)


def kv_cache_dims(kv_cache_format: str | None, latent_dim: int) -> int:
    """Last dim of a cache of ``kv_cache_format`` for rows of ``latent_dim``."""
    return FP8_DS_MLA_RECORD_BYTES if kv_cache_format == "fp8_ds_mla" else latent_dim


def dequantize_rows(records: torch.Tensor, spec: KVCacheSpec, dtype: torch.dtype) -> torch.Tensor:
    """Compute-dtype rows ``[n, latent_dim]`` of cache records ``[n, record]`` (torch ops).

    Exactly the formula of the module table: float32 products, one cast to ``dtype``. Device
    work only (a scale tensor is read by the device).
    """
    if spec.kind == PLAIN:
        return records if records.dtype == dtype else records.to(dtype)
    if spec.kind == "fp8":
        scale = spec.scale if spec.scale_tensor is None else spec.scale_tensor
        return (records.to(torch.float32) * scale).to(dtype)
    n = records.shape[0]
    records = records.contiguous()
    values = records[:, :_DS_SCALES_AT].view(torch.float8_e4m3fn)  # [n, 512]
    scales = records[:, _DS_SCALES_AT:_DS_ROPE_AT].view(torch.float32)  # [n, 4]
    rope = records[:, _DS_ROPE_AT:].view(torch.bfloat16)  # [n, 64]
    out = torch.empty(n, spec.latent_dim, dtype=dtype, device=records.device)
    groups = DS_MLA_RANK // DS_MLA_GROUP
    grouped = values.to(torch.float32).view(n, groups, DS_MLA_GROUP) * scales[:, :, None]
    out[:, :DS_MLA_RANK] = grouped.view(n, DS_MLA_RANK)
    out[:, DS_MLA_RANK:] = rope
    return out


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn, saturating finite values (as the cast does) and inf -> NaN."""
    x = torch.where(torch.isinf(x), torch.nan, x)
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def write_kv_cache(kv_cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, *,
                   kv_cache_scale: Any = None, kv_cache_format: str | None = None) -> None:
    """Store compute-dtype latent rows into a cache of any format, at flat token slots.

    What an engine does when it caches a step's tokens (vLLM's ``concat_and_cache_mla``).

    Parameters
    ----------
    kv_cache : [num_blocks, page_size, record] (q's dtype, float8_e4m3fn or fp8_ds_mla uint8)
    slots : int [n] on the cache's device
        ``block * page_size + offset`` of each row (vLLM's ``slot_mapping``); every slot in
        ``[0, num_blocks * page_size)``.
    rows : [n, kv_lora_rank + qk_rope_head_dim], a float dtype
        ``[kv_c | k_pe]`` per token.
    kv_cache_scale, kv_cache_format
        As in the forward. fp8 stores ``rows / scale`` as e4m3 (finite values saturate at
        ±448; inf is stored as NaN); ``fp8_ds_mla`` picks, per token and per 128 latent
        values, the power-of-two scale ``2**ceil(log2(amax / 448))`` (amax floored at 1e-4;
        the dequantization is then exact up to e4m3's rounding) and stores the rope part as
        bfloat16.

    Device work only (a scale tensor is read by the device); writes ``kv_cache`` in place.
    """
    for name, t in (("kv_cache", kv_cache), ("slots", slots), ("rows", rows)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if rows.dim() != 2 or rows.dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"rows must be [n, kv_lora_rank + qk_rope_head_dim] in a float dtype, "
                         f"got {tuple(rows.shape)} {rows.dtype}")
    if slots.dim() != 1 or slots.shape[0] != rows.shape[0] or slots.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [n = {rows.shape[0]}], got "
                         f"{tuple(slots.shape)} {slots.dtype}")
    for name, t in (("slots", slots), ("rows", rows)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")
    spec = resolve_kv_cache(kv_cache, kv_cache_scale, kv_cache_format,
                            latent_dim=rows.shape[1], dtype=rows.dtype)
    flat = kv_cache.view(-1, kv_cache.shape[2]) if kv_cache.is_contiguous() else None
    if flat is None:
        raise ValueError("kv_cache must be contiguous to be written by slot")
    if kv_cache.device.type == "cpu" and slots.numel():
        host = slots.numpy()  # noqa: HS201 (a CPU tensor: no device read)
        if ((host < 0) | (host >= flat.shape[0])).any():
            raise ValueError(f"slots hold values outside [0, num_blocks * page_size = "
                             f"{flat.shape[0]})")
    x = rows.to(torch.float32)
    if spec.kind == PLAIN:
        flat.index_copy_(0, slots.long(), rows.to(kv_cache.dtype))
        return
    if spec.kind == "fp8":
        scale = spec.scale if spec.scale_tensor is None else spec.scale_tensor
        flat.view(torch.uint8).index_copy_(0, slots.long(), _to_fp8(x / scale).view(torch.uint8))
        return
    n = rows.shape[0]
    latent = x[:, :DS_MLA_RANK].view(n, DS_MLA_RANK // DS_MLA_GROUP, DS_MLA_GROUP)  # [n, 4, 128]
    amax = latent.abs().amax(dim=2).clamp_min(1e-4)  # NaN amax stays NaN
    scales = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))  # [n, 4] powers of two
    values = _to_fp8(latent / scales[:, :, None]).view(n, DS_MLA_RANK)
    record = torch.empty(n, FP8_DS_MLA_RECORD_BYTES, dtype=torch.uint8, device=rows.device)
    record[:, :_DS_SCALES_AT] = values.view(torch.uint8)
    record[:, _DS_SCALES_AT:_DS_ROPE_AT] = scales.contiguous().view(torch.uint8)
    record[:, _DS_ROPE_AT:] = rows[:, DS_MLA_RANK:].to(torch.bfloat16).contiguous().view(
        torch.uint8)
    flat.index_copy_(0, slots.long(), record)
