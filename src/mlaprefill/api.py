"""The one-call API: plan, upload and forward in one function, on one rank or over DCP ranks.

This module sits above the stages (imports point one way: ``plan <- staging <- prefill/dcp
<- api``), so the forward (:mod:`mlaprefill.prefill`) and the context-parallel pieces
(:mod:`mlaprefill.dcp`) never import each other. Engines that keep a planner and a staging ring
per step call the stages directly; these functions build both per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mlaprefill.batch import PrefillBatch
from mlaprefill.dcp.forward import (
    DCPContextSource,
    check_dcp_consistency,
    check_local_cache,
    dcp_world,
)
from mlaprefill.dcp.layout import check_dcp_config
from mlaprefill.dcp.plan import DCPChunkPlanner, dcp_config_digest
from mlaprefill.kvcache import resolve_kv_cache
from mlaprefill.plan import ChunkPlanner
from mlaprefill.prefill import DEFAULT_WORKSPACE_TOKENS, MLAChunkedPrefill
from mlaprefill.staging import StagingRing
from mlaprefill.validation import check_bool, infer_head_dims

__all__ = ["mla_chunked_prefill", "mla_chunked_prefill_dcp"]


def mla_chunked_prefill(q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor,
                        query_lens: Sequence[int] | Any, context_lens: Sequence[int] | Any,
                        kv_b_proj_weight: torch.Tensor, *, softmax_scale: float | None = None,
                        workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
                        page_size: int | None = None, policy: str = "auto",
                        backend: str = "auto", return_lse: bool = False,
                        process_group: Any = None, dcp_interleave: int = 1,
                        qk_nope_head_dim: int | None = None, v_head_dim: int | None = None,
                        validate: bool = False,
                        kv_cache_scale: float | torch.Tensor | None = None,
                        kv_cache_format: str | None = None,
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One call: PrefillBatch -> ChunkPlanner.plan -> StagingRing.upload -> forward.

    ``query_lens`` / ``context_lens`` are host ints (a list, numpy array or CPU tensor; a CUDA
    tensor is rejected because reading it would sync). Head dims are inferred: ``qk_rope_head_dim
    = k_pe_new.shape[1]``, ``qk_nope_head_dim = q.shape[2] - rope``, ``v_head_dim =
    weight rows / H - nope`` (pass them to check). ``page_size`` defaults to ``kv_cache.shape[1]``.
    ``policy="auto"`` plans with the backend's :attr:`~MLAChunkedPrefill.preferred_policy`
    (``balanced`` for mlaprefill and fa2, ``packed`` for cudnn/flex/math); or name a planner
    policy. ``kv_cache`` may be FP8: ``float8_e4m3fn`` with ``kv_cache_scale`` (a float or a
    1-element float32 device tensor, default 1.0), or ``uint8`` 656-byte records with
    ``kv_cache_format="fp8_ds_mla"`` (:mod:`mlaprefill.kvcache`); it is dequantized to q's dtype
    as it is gathered.
    With ``process_group`` of world size > 1 this is the context-parallel version
    (:func:`mlaprefill.dcp.mla_chunked_prefill_dcp`, same arguments); world size 1 or None is the
    single-rank path. Returns what :meth:`MLAChunkedPrefill.forward` returns.

    ``validate=True`` adds the checks that read device memory (and so **synchronize**): see
    :meth:`MLAChunkedPrefill.forward`; on the DCP path, the one collective check that every
    rank passed the same lengths and config (see :func:`mla_chunked_prefill_dcp`). Every
    argument is checked on the host first (``TypeError``/``ValueError`` naming it); the README's
    "Validation contract" lists what is checked when.
    """
    if process_group is not None and dcp_world(process_group)[1] > 1:
        return mla_chunked_prefill_dcp(
            q, kv_c_new, k_pe_new, kv_cache, block_table, query_lens, context_lens,
            kv_b_proj_weight, softmax_scale=softmax_scale, workspace_tokens=workspace_tokens,
            page_size=page_size, policy=policy, backend=backend, return_lse=return_lse,
            process_group=process_group, dcp_interleave=dcp_interleave, validate=validate,
            kv_cache_scale=kv_cache_scale, kv_cache_format=kv_cache_format)

    nope, v_dim, rope = infer_head_dims(q, k_pe_new, kv_b_proj_weight, qk_nope_head_dim,
                                        v_head_dim)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, page_size, latent_dim], got "
                         f"{tuple(kv_cache.shape)}")
    if page_size is not None and page_size != kv_cache.shape[1]:
        raise ValueError(f"page_size={page_size!r} but kv_cache has {kv_cache.shape[1]} tokens "
                         f"per page (kv_cache.shape[1]); leave page_size out to use the cache's")
    for name, value in (("policy", policy), ("backend", backend)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    page = kv_cache.shape[1]
    batch = PrefillBatch(query_lens, context_lens, page_size=page, block_table=block_table)
    if batch.num_query_tokens != q.shape[0]:
        raise ValueError(f"sum(query_lens) = {batch.num_query_tokens} but q has {q.shape[0]} "
                         f"tokens; the lengths must describe q's packing")
    op = MLAChunkedPrefill(kv_b_proj_weight, qk_nope_head_dim=nope, v_head_dim=v_dim,
                           softmax_scale=softmax_scale, backend=backend, qk_rope_head_dim=rope)
    plan = ChunkPlanner(workspace_tokens, page, policy=op.resolve_policy(policy)).plan(batch)
    device_plan = StagingRing(kv_cache.device).upload(plan)
    return op.forward(q, kv_c_new, k_pe_new, kv_cache, block_table, device_plan,
                      return_lse=return_lse, validate=validate, kv_cache_scale=kv_cache_scale,
                      kv_cache_format=kv_cache_format)


def mla_chunked_prefill_dcp(
    q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor, kv_cache: torch.Tensor,
    block_table: torch.Tensor, query_lens: Any, context_lens: Any,
    kv_b_proj_weight: torch.Tensor, *, process_group: Any, dcp_interleave: int,
    softmax_scale: float | None = None, workspace_tokens: int = DEFAULT_WORKSPACE_TOKENS,
    page_size: int | None = None, policy: str = "auto", backend: str = "auto",
    return_lse: bool = False, validate: bool = False, staging: Any = None,
    kv_cache_scale: float | torch.Tensor | None = None, kv_cache_format: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked-context MLA prefill over a token-sharded (DCP) paged cache, in one call.

    Parameters
    ----------
    q : [num_query_tokens, num_heads, qk_nope_head_dim + qk_rope_head_dim] (roped)
    kv_c_new : [num_query_tokens, kv_lora_rank]
    k_pe_new : [num_query_tokens, qk_rope_head_dim] (roped)
    kv_cache : [local_num_blocks, page_size, kv_lora_rank + qk_rope_head_dim]
        **This rank's** shard (layout: :mod:`mlaprefill.dcp.layout`).
    block_table : int32 [num_reqs, local_max_blocks]
        **This rank's** block table over its local tokens.
    query_lens, context_lens : host ints [num_reqs]
        **Global** lengths, identical on every rank.
    kv_b_proj_weight : [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    process_group : ProcessGroup or None
        DCP group; ``None`` or world size 1 runs the single-rank path unchanged.
    dcp_interleave : int
        Interleave ``I >= 1`` of the sharded layout.
    softmax_scale, workspace_tokens, page_size, policy, backend, return_lse
        As in :func:`mla_chunked_prefill`; ``workspace_tokens`` also bounds
        the all-gathered rows of an iteration, ``page_size`` defaults to ``kv_cache.shape[1]``.
    validate : bool
        Check with one small collective that all ranks passed the same lengths and config
        (raises ``ValueError`` naming what differs). Synchronizes the host once.
    staging : StagingRing, optional
        Reused for the upload; default a fresh ``StagingRing(q.device)``.
    kv_cache_scale, kv_cache_format
        An FP8 cache, as in :func:`mla_chunked_prefill`. Ranks all-gather the FP8 records
        (half the bytes of bf16 rows for e4m3) and dequantize after the gather.

    Returns
    -------
    out : [num_query_tokens, num_heads, v_head_dim], q's dtype — identical on every rank and
        equal to the single-rank result on the unsharded cache; with ``return_lse`` also
        ``lse`` [num_query_tokens, num_heads] float32, natural log.

    Raises
    ------
    ValueError
        Before any collective: non-positive ``dcp_interleave``, a workspace that cannot hold an
        iteration's gathered rows, a local block table too short for this rank's share, and
        the planner's own errors. With ``validate`` the input errors are raised right after the
        one check collective, on every rank (also ranks whose own inputs were fine), and ranks
        that disagree on the global lengths/config raise naming what differs.

    Notes
    -----
    Collective: every rank of ``process_group`` must call it with the same global lengths.
    Host work is the plan (numpy) and one upload; no host synchronization unless ``validate``.
    """
    check_bool("validate", validate)

    check_dcp_config(1, dcp_interleave)
    rank, world = dcp_world(process_group)
    if world == 1:
        return mla_chunked_prefill(
            q, kv_c_new, k_pe_new, kv_cache, block_table, query_lens, context_lens,
            kv_b_proj_weight, softmax_scale=softmax_scale, workspace_tokens=workspace_tokens,
            page_size=page_size, policy=policy, backend=backend, return_lse=return_lse,
            validate=validate, kv_cache_scale=kv_cache_scale, kv_cache_format=kv_cache_format)
    page = kv_cache.shape[1] if page_size is None else page_size
    batch = PrefillBatch(query_lens, context_lens, page_size=page)
    resolved = policy
    try:
        nope, v_dim, rope = infer_head_dims(q, k_pe_new, kv_b_proj_weight)
        mla = MLAChunkedPrefill(kv_b_proj_weight, qk_nope_head_dim=nope, v_head_dim=v_dim,
                                softmax_scale=softmax_scale, backend=backend,
                                qk_rope_head_dim=rope)
        resolved = mla.resolve_policy(policy)  # the digest below compares what ranks plan with
        planner = DCPChunkPlanner(workspace_tokens, page, world=world, interleave=dcp_interleave,
                                  policy=resolved)
        plan = planner.plan(batch, rank=rank)
        check_local_cache(kv_cache, block_table, plan)
        resolve_kv_cache(kv_cache, kv_cache_scale, kv_cache_format,
                         latent_dim=kv_b_proj_weight.shape[1] + rope, dtype=q.dtype)
    except ValueError as exc:
        if not validate:
            raise  # before any collective; identical inputs fail identically on every rank
        error: ValueError | None = exc
    else:
        error = None
    if validate:
        # Inconsistent inputs can fail on some ranks only: agree first, then raise everywhere.
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(process_group) == "gloo" else q.device
        digest = dcp_config_digest(batch, world=world, interleave=dcp_interleave,
                                   workspace_tokens=workspace_tokens, policy=resolved)
        check_dcp_consistency(digest, process_group, device, local_error=error)
    if staging is None:
        staging = StagingRing(q.device)
    device_plan = staging.upload(plan)
    source = DCPContextSource(kv_cache, block_table, device_plan, process_group,
                              kv_cache_scale=kv_cache_scale, kv_cache_format=kv_cache_format)
    return mla.forward(q, kv_c_new, k_pe_new, kv_cache, block_table,
                       device_plan, return_lse=return_lse, context_source=source,
                       kv_cache_scale=kv_cache_scale, kv_cache_format=kv_cache_format)
