"""Paged latent KV cache of the bench engine: a block allocator (pure CPU) and the device pages.

The allocator is a free list of page ids. A request gets all pages for its whole prompt when the
scheduler admits it (prefill-only: the prompt length is known up front, so admission by free pages
can never dead-lock half way) and gives them back when its first token has been observed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mlaprefill.kvcache import FP8_DS_MLA_RECORD_BYTES, write_kv_cache

__all__ = ["KV_CACHE_DTYPES", "BlockAllocator", "PagedLatentCache", "blocks_needed"]


def blocks_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ``ceil(num_tokens / page_size)``."""
    return -(-int(num_tokens) // int(page_size))


@dataclass(slots=True)
class BlockAllocator:
    """Free list of cache pages ``0 .. num_blocks-1`` (host only, never touches the device).

    Parameters
    ----------
    num_blocks : int
        Pages in the cache.

    Notes
    -----
    ``allocate`` hands out the lowest free ids first (a stack popped from the end of a list kept
    in descending order), so runs are reproducible.
    """

    num_blocks: int
    _free: list[int] = field(init=False, repr=False)
    _owned: dict[int, np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) \
                or self.num_blocks <= 0:
            raise ValueError(
                f"BlockAllocator.num_blocks must be a positive int, got {self.num_blocks!r}; "
                f"size the cache with at least one page."
            )
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._owned = {}

    @property
    def num_free(self) -> int:
        """Pages currently free."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages currently owned by some request."""
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        """Whether ``num`` pages are free right now."""
        return num <= len(self._free)

    def allocate(self, owner: int, num: int) -> np.ndarray:
        """Give ``num`` free pages to ``owner``; returns their ids, int32 [num].

        Raises
        ------
        ValueError
            If ``owner`` already holds pages, or fewer than ``num`` pages are free (check with
            :meth:`can_allocate` first).
        """
        if owner in self._owned:
            raise ValueError(f"BlockAllocator: request {owner} already holds pages; free them "
                             f"before allocating again.")
        if num < 0 or num > len(self._free):
            raise ValueError(f"BlockAllocator: asked for {num} pages but {len(self._free)} are "
                             f"free; check can_allocate() before allocating.")
        ids = np.array(self._free[len(self._free) - num:][::-1], dtype=np.int32)
        del self._free[len(self._free) - num:]
        self._owned[owner] = ids
        return ids

    def free(self, owner: int) -> None:
        """Return every page of ``owner`` to the free list (ValueError if it holds none)."""
        ids = self._owned.pop(owner, None)
        if ids is None:
            raise ValueError(f"BlockAllocator: request {owner} holds no pages (double free?).")
        # Keep the list descending so the lowest ids are handed out first.
        self._free.extend(int(i) for i in ids[::-1])
        self._free.sort(reverse=True)

    def owned(self, owner: int) -> np.ndarray:
        """Pages of ``owner``, int32 [num] (empty if none)."""
        return self._owned.get(owner, np.zeros(0, dtype=np.int32))


#: ``--kv-cache-dtype`` values (vLLM's names): ``auto`` = the compute dtype, ``fp8`` =
#: float8_e4m3fn with one scale per layer (1.0, vLLM's default without calibration),
#: ``fp8_ds_mla`` = DeepSeek's 656-byte records (kv_lora_rank 512, rope 64 only).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")


class PagedLatentCache:
    """One latent page pool per layer: ``kv_cache[layer]`` is ``[num_blocks, page_size, record]``.

    Parameters
    ----------
    num_layers, num_blocks, page_size, latent_dim : int
        ``latent_dim = kv_lora_rank + qk_rope_head_dim`` (each row ``[kv_c | k_pe]``).
    device, dtype : torch.device, torch.dtype
        ``dtype``: the compute dtype (the model's).
    kv_cache_dtype : one of :data:`KV_CACHE_DTYPES`
        How the pages store a row (:mod:`mlaprefill.kvcache`).

    Notes
    -----
    Allocated once with ``torch.empty`` (no initialisation kernel): the forward only ever reads
    rows that an earlier step wrote through the slot mapping.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, page_size: int, latent_dim: int,
                 device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r} is unknown; choose one of "
                             f"{list(KV_CACHE_DTYPES)}")
        if kv_cache_dtype == "fp8_ds_mla" and latent_dim != 576:
            raise ValueError(f"--kv-cache-dtype fp8_ds_mla stores kv_lora_rank 512 + rope 64 = "
                             f"576 per token; this model's latent rows are {latent_dim} wide "
                             f"(use --preset deepseek-v3 or kimi-k2)")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.latent_dim = latent_dim
        self.kv_cache_dtype = kv_cache_dtype
        record, store = {"auto": (latent_dim, dtype),
                         "fp8": (latent_dim, torch.float8_e4m3fn),
                         "fp8_ds_mla": (FP8_DS_MLA_RECORD_BYTES, torch.uint8)}[kv_cache_dtype]
        self.layers = [
            torch.empty(num_blocks, page_size, record, device=device, dtype=store)
            for _ in range(num_layers)
        ]
        #: The forward's ``kv_cache_scale`` / ``kv_cache_format`` for these pages.
        self.forward_kwargs: dict[str, object] = {
            "kv_cache_scale": 1.0 if kv_cache_dtype == "fp8" else None,
            "kv_cache_format": "fp8_ds_mla" if kv_cache_dtype == "fp8_ds_mla" else None}

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes per token over all layers."""
        page = self.layers[0]
        return len(self.layers) * page.shape[2] * page.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        """Write latent ``rows[T, latent]`` of ``layer`` to the flat slots ``slot_mapping[T]``
        (int64), quantized to the pages' format.

        Slot ``s`` is row ``s % page_size`` of page ``s // page_size``. Device-only, never syncs.
        """
        write_kv_cache(self.layers[layer], slot_mapping, rows, **self.forward_kwargs)
