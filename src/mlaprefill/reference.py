"""Float64 reference of MLA chunked prefill: materialize everything, one request at a time.

Used by benchmarks, the engine bench and the DCP tests as ground truth. Deliberately plain: for
each request, read its whole context from the paged cache by indexing, append the new tokens,
up-project every latent row to per-head keys/values, and run causal softmax attention in float64
on the CPU. Host loops and host reads are fine here (this is not the forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["mla_prefill_reference"]


def mla_prefill_reference(q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                          kv_cache: torch.Tensor, block_table: torch.Tensor,
                          query_lens: Sequence[int], context_lens: Sequence[int],
                          kv_b_proj_weight: torch.Tensor, *, qk_nope_head_dim: int,
                          v_head_dim: int, softmax_scale: float | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention over context + new tokens, float64, on the CPU.

    Parameters
    ----------
    q : [T, H, qk_nope_head_dim + qk_rope_head_dim] (roped)
    kv_c_new : [T, kv_lora_rank]
    k_pe_new : [T, qk_rope_head_dim]
    kv_cache : [num_blocks, page_size, kv_lora_rank + qk_rope_head_dim]
    block_table : int [num_reqs, max_blocks]
    query_lens, context_lens : host ints [num_reqs]
    kv_b_proj_weight : [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank] (Hugging Face layout:
        per head ``[nope rows | v rows]``)
    softmax_scale : default ``1 / sqrt(qk_head_dim)``

    Returns
    -------
    out : float64 [T, H, v_head_dim]; lse : float64 [T, H] (natural log). CPU tensors.
    """
    query_lens = [int(x) for x in query_lens]
    context_lens = [int(x) for x in context_lens]
    q64 = q.detach().to("cpu", torch.float64)
    kv_c_new64 = kv_c_new.detach().to("cpu", torch.float64)
    k_pe_new64 = k_pe_new.detach().to("cpu", torch.float64)
    cache64 = kv_cache.detach().to("cpu", torch.float64)
    table = block_table.detach().to("cpu", torch.int64)
    weight64 = kv_b_proj_weight.detach().to("cpu", torch.float64)

    num_tokens, num_heads, qk_head_dim = q64.shape
    kv_lora_rank = weight64.shape[1]
    page_size = cache64.shape[1]
    scale = qk_head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    w = weight64.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]  # [H, nope, rank], [H, v, rank]

    out = torch.zeros(num_tokens, num_heads, v_head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float64)
    start = 0
    for r, (n_new, n_ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        positions = torch.arange(n_ctx)
        ctx_rows = cache64[table[r, positions // page_size], positions % page_size]
        new_rows = torch.cat([kv_c_new64[start:start + n_new], k_pe_new64[start:start + n_new]], 1)
        rows = torch.cat([ctx_rows, new_rows], 0)  # [n_ctx + n_new, rank + rope]
        kv_c, k_pe = rows[:, :kv_lora_rank], rows[:, kv_lora_rank:]
        k_nope = torch.einsum("sc,hdc->shd", kv_c, w_uk)
        v = torch.einsum("sc,hdc->shd", kv_c, w_uv)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], -1)
        qr = q64[start:start + n_new]
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale
        allowed = (torch.arange(n_ctx + n_new)[None, :]
                   <= n_ctx + torch.arange(n_new)[:, None])  # [n_new, n_ctx + n_new]
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse_r = torch.logsumexp(scores, -1)  # [H, n_new]
        out[start:start + n_new] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
        lse[start:start + n_new] = lse_r.t()
        start += n_new
    return out, lse
