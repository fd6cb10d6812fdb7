"""The up-projection: latent rows ``[kv_c | k_pe]`` to per-head keys and values.

Two layouts, chosen per attention call by the backend (``AttentionBackend.wants_joined_keys``):

* **split keys** (our kernel, which reads MLA's rope key once per token with head stride 0):
  one matmul with the Hugging Face ``kv_b_proj.weight [H*(nope+v), rank]`` as it is gives ``[n,
  H, nope+v]``, and K and V are its two views: no zero rows in the GEMM, no rope copy, one launch.
* **joined keys**: each row is ``[n, H, v+nope+rope]``, every head's ``[v | k_nope | k_pe]``: one
  strided-batched GEMM over the heads (the shared ``kv_c`` against each head's ``[W_UV |
  W_UK]^T``, re-laid once per dtype and device) writes the ``[v | k_nope]`` columns in place and
  :func:`~mlaprefill.kernels.rope.broadcast_rope_` fills the rope slots; ``k`` and ``v`` are views.
  For FlashAttention-2 (which needs ``v_out == qk_head_dim``) the weight is re-laid with zero rows
  instead: ``W_K [H*(nope+rope), rank]`` (zero rows in each head's rope slot) and ``W_V`` padded to
  the key's width, two matmuls, so V arrives padded for free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mlaprefill.kernels.rope import broadcast_rope_

__all__ = ["UpProjection"]


class UpProjection:
    """The weight of one layer and its re-laid copies, built once per dtype and device.

    ``weight [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``, per head ``[nope rows | v
    rows]`` (checked by the caller).
    """

    def __init__(self, weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                 v_head_dim: int) -> None:
        self.weight = weight
        self.num_heads = num_heads
        self.kv_lora_rank = weight.shape[1]
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        # (rope, dtype, device, "padded", "k" | "v") -> W_K or W_V; (dtype, device, "kv" | "vk")
        # -> the split weight or the joined batched one.
        self._cache: dict[tuple[Any, ...], torch.Tensor] = {}

    def v_out(self, qk_head_dim: int, v_padded: bool) -> int:
        """V's width as the backend reads it: ``qk_head_dim`` when it wants V padded."""
        return qk_head_dim if v_padded else self.v_head_dim

    def weights(self, rope: int, dtype: torch.dtype, device: torch.device, *, joined: bool,
                v_padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights in the compute dtype and device, each layout built when first wanted.

        Split keys: ``(W_KV, None)``, the weight itself (no copy when it already has that dtype
        and device). Joined keys: ``(W_B [H, rank, v+nope], None)``, each head's ``[W_UV |
        W_UK]^T``; with ``v_padded``, ``(W_K [H*(nope+rope), rank]`` with zero rows in each
        head's rope slot, ``W_V [H*v_out, rank])``.
        """
        if not joined:
            key = (dtype, device, "kv")
            w_kv = self._cache.get(key)
            if w_kv is None:
                w_kv = self._cache[key] = self.weight.to(device=device, dtype=dtype)
            return w_kv, None
        h, nope, v, rank = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if not v_padded:
            key = (dtype, device, "vk")
            w_b = self._cache.get(key)
            if w_b is None:
                w = self.weight.to(device=device, dtype=dtype).view(h, nope + v, rank)
                w_b = self._cache[key] = torch.cat([w[:, nope:], w[:, :nope]], dim=1) \
                    .transpose(1, 2).contiguous()
            return w_b, None
        base = (rope, dtype, device, "padded")
        w_key = self._cache.get((*base, "k"))
        w_v = self._cache.get((*base, "v"))
        if w_key is not None and w_v is not None:
            return w_key, w_v
        w = self.weight.to(device=device, dtype=dtype).view(h, nope + v, rank)
        if w_key is None:
            w_k = torch.zeros(h, nope + rope, rank, dtype=dtype, device=device)
            w_k[:, :nope] = w[:, :nope]
            w_key = self._cache[(*base, "k")] = w_k.view(h * (nope + rope), rank)
        if w_v is None:
            v_out = self.v_out(nope + rope, True)
            w_pad = torch.zeros(h, v_out, rank, dtype=dtype, device=device)
            w_pad[:, :v] = w[:, nope:]
            w_v = self._cache[(*base, "v")] = w_pad.view(h * v_out, rank)
        return w_key, w_v

    def derived(self, key: tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor derived from the weight (e.g. a backend's row norms of it), made by
        ``make()`` when ``key`` is first asked for and kept with the re-laid copies."""
        key = ("derived", *key)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def kv_numel(self, n: int, qk: int, v_padded: bool) -> int:
        """Elements of the buffer :meth:`project` needs for ``n`` rows (either layout)."""
        return n * self.num_heads * max(qk + self.v_out(qk, v_padded),
                                        self.qk_nope_head_dim + self.v_head_dim)

    def project(self, kv_c: torch.Tensor, k_pe: torch.Tensor, buf: torch.Tensor, rope: int, *,
                joined: bool, v_padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``n`` latent rows ``kv_c [n, rank]``, ``k_pe [n, rope]``, written
        into the first elements of the flat ``buf`` (at least :meth:`kv_numel`).

        split: one GEMM ``kv [n, H, nope+v] = kv_c W_KV^T``, and ``k = kv[..., :nope]``, ``v =
        kv[..., nope:]`` are views (row stride ``H*(nope+v)``); the backend reads ``k_pe``
        itself. joined: rows ``[n, H, v+nope+rope]`` hold each head's ``[v | k_nope | k_pe]``,
        so ``k = [k_nope | k_pe]`` and ``v`` are views (row stride ``H*(v+nope+rope)``); one
        strided-batched GEMM over the heads writes ``[v | k_nope]`` (no zero weight columns,
        which cost ~10-25 % more GEMM time), then :func:`broadcast_rope_` fills the rope slots.
        With ``v_padded``: ``k [n, H, nope+rope]`` (one GEMM whose zero weight rows leave the
        rope slots to the copy) and ``v [n, H, v_out]`` from a second GEMM.
        """
        n, h, nope = kv_c.shape[0], self.num_heads, self.qk_nope_head_dim
        if not joined and v_padded:
            raise RuntimeError("split keys come with V unpadded; the backend asked for both")
        w_key, w_v = self.weights(rope, kv_c.dtype, kv_c.device, joined=joined,
                                  v_padded=v_padded)
        if not joined:
            width = w_key.shape[0] // h
            kv = buf[:n * h * width].view(n, h, width)
            torch.mm(kv_c, w_key.t(), out=kv.view(n, -1))  # [n, rank] x [rank, H*(nope+v)]
            return kv[..., :nope], kv[..., nope:]
        if w_v is None:
            vd = self.v_head_dim
            rows = buf[:n * h * (vd + nope + rope)].view(n, h, vd + nope + rope)
            # [H, n, rank] (kv_c shared: batch stride 0) x [H, rank, v+nope] -> the rows'
            # [v | k_nope] columns ([H, n, v+nope] with strides (v+nope+rope, H*(...), 1)):
            # cuBLAS writes them in place, no copy.
            torch.bmm(kv_c.unsqueeze(0).expand(h, n, kv_c.shape[1]), w_key,
                      out=rows[..., :vd + nope].transpose(0, 1))
            broadcast_rope_(rows, k_pe, vd + nope)
            return rows[..., vd:], rows[..., :vd]
        width = w_key.shape[0] // h
        k = buf[:n * h * width].view(n, h, width)
        torch.mm(kv_c, w_key.t(), out=k.view(n, -1))  # [n, rank] x [rank, H*(nope+rope)]
        broadcast_rope_(k, k_pe, nope)
        v_out = w_v.shape[0] // h
        v = buf[n * h * width:n * h * (width + v_out)].view(n, h, v_out)
        torch.mm(kv_c, w_v.t(), out=v.view(n, -1))  # [n, rank] x [rank, H*v_out]
        return k, v
