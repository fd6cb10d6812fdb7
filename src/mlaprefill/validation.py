"""Input checks of the forward: host-only (types, shapes, dtypes, devices, host plan ints)
unless asked to read device memory (``validate=True``), which synchronizes.

The README's "Validation contract" lists what is checked when. Every error is a ``TypeError`` or
``ValueError`` that names the field, says what it got and what it expected, and how to fix it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mlaprefill.kvcache import KVCacheSpec, resolve_kv_cache
from mlaprefill.plan import ChunkPlan
from mlaprefill.staging import DevicePlan

__all__ = ["FLOAT_DTYPES", "check_block_ids", "check_bool", "check_device_plan",
           "check_device_plan_matches", "check_forward_inputs", "check_rope_dim",
           "check_scale_value", "check_softmax_scale", "infer_head_dims", "lse_dtype_for"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

def check_rope_dim(qk_rope_head_dim: Any) -> int | None:
    """``qk_rope_head_dim`` itself: an int >= 0 or None; ``ValueError`` naming it otherwise."""
    if qk_rope_head_dim is not None and (isinstance(qk_rope_head_dim, bool) or not isinstance(
            qk_rope_head_dim, int) or qk_rope_head_dim < 0):
        raise ValueError(f"qk_rope_head_dim must be an int >= 0 or None, got "
                         f"{qk_rope_head_dim!r}")
    return qk_rope_head_dim


def lse_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The LSE's dtype for inputs of ``dtype``: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_bool(name: str, flag: Any) -> bool:
    """``flag`` itself if it is a Python bool; ``TypeError`` naming ``name`` and the type
    otherwise (``numpy.bool`` is named as such, not as a bare "bool")."""
    if not isinstance(flag, bool):
        kind = type(flag)
        named = kind.__name__ if kind.__module__ == "builtins" else \
            f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name} must be a bool (True or False), got {named}")
    return flag


def check_softmax_scale(softmax_scale: Any) -> float | None:
    """``softmax_scale`` as a float (None stays None); ``TypeError``/``ValueError`` naming it."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a number (e.g. 1 / sqrt(qk_head_dim) times the "
                        f"YaRN mscale) or None, got {type(softmax_scale).__name__} "
                        f"{softmax_scale!r:.40}")
    try:
        value = float(softmax_scale)
    except OverflowError:  # an int past float's range (2**1100): not a finite scale either
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {value!r}; leave it "
                         f"None for 1 / sqrt(qk_head_dim)")
    return value


def check_device_plan(device_plan: Any) -> ChunkPlan:
    """The host chunk plan of ``device_plan``, or ``TypeError``/``ValueError`` saying what to
    pass."""
    if not isinstance(device_plan, DevicePlan):
        hint = (" (a host plan: upload it first)" if hasattr(device_plan, "device_arrays")
                else "")
        raise TypeError(f"device_plan must be a DevicePlan, got {type(device_plan).__name__}"
                        f"{hint}; pass StagingRing(device).upload(plan)")
    if not isinstance(device_plan.tensors, Mapping):
        raise TypeError(f"device_plan.tensors must be a mapping name -> tensor, got "
                        f"{type(device_plan.tensors).__name__}; pass "
                        f"StagingRing(device).upload(plan)")
    missing = [n for n in _PLAN_TENSORS if n not in device_plan.tensors]
    needed = ("num_reqs", "num_query_tokens", "page_size", "context_lens", "num_iterations",
              "iteration_tokens", "max_chunk_lens", "max_query_len", "cu_query_lens")
    chunk_plan = getattr(device_plan.plan, "chunk_plan", None)
    missing += [f"plan.chunk_plan.{n}" for n in needed if not hasattr(chunk_plan, n)]
    if getattr(chunk_plan, "iteration_cu_query_lens", None) is not None:
        missing += [n for n in _SHARED_PLAN_TENSORS if n not in device_plan.tensors]
    if not callable(getattr(device_plan.plan, "device_arrays", None)):
        missing.append("plan.device_arrays")
    if missing:
        raise ValueError(f"device_plan lacks {missing}; pass StagingRing(device).upload(plan) "
                         f"of a ChunkPlanner plan")
    if not device_plan.staged:  # an upload matches its plan by construction
        _check_plan_tensor_metadata(device_plan, chunk_plan)
    return chunk_plan


def _check_plan_tensor_metadata(device_plan: DevicePlan, chunk_plan: Any) -> None:
    """Every tensor the plan ships is an int32, contiguous tensor of its host array's shape,
    all on one device: metadata only (whether they still hold the plan's values is
    ``validate=True``'s check), so a hand-built DevicePlan fails here, not in a kernel."""
    devices = set()
    for name, host in device_plan.plan.device_arrays().items():
        t = device_plan.tensors.get(name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"device_plan.tensors[{name!r}] must be a torch.Tensor, got "
                            f"{type(t).__name__}; pass StagingRing(device).upload(plan)")
        if tuple(t.shape) != host.shape or t.dtype != torch.int32 or not t.is_contiguous():
            layout = "" if t.is_contiguous() else " non-contiguous"
            raise ValueError(
                f"device_plan.{name} is {tuple(t.shape)} {t.dtype}{layout}, expected "
                f"{host.shape} torch.int32 contiguous as its plan has it "
                f"({chunk_plan.num_iterations} iterations x {chunk_plan.num_reqs} requests); pass "
                f"StagingRing(device).upload(plan) instead of building a DevicePlan by hand")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"device_plan's tensors are on {sorted(map(str, devices))}; they must "
                         f"be on one device: pass StagingRing(device).upload(plan)")


def check_block_ids(block_table: torch.Tensor, context_lens: Any, page_size: int,
                    num_blocks: int) -> None:
    """``ValueError`` if a page that a context reads is outside ``[0, num_blocks)``.

    Reads the used columns of ``block_table`` on the host: free for a CPU tensor, a
    synchronizing D2H copy for a device tensor (only done with ``validate=True``).
    """
    ctx = np.asarray(context_lens, dtype=np.int64)
    need = -(-ctx // page_size)  # pages each request reads
    width = int(need.max(initial=0))
    table = block_table[:, :width].cpu().numpy().astype(np.int64)
    used = np.arange(width)[None, :] < need[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        r, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table[{r}, {j}] = {int(table[r, j])} is outside [0, num_blocks={num_blocks}) "
            f"but request {r}'s context ({int(ctx[r])} tokens) reads pages 0..{int(need[r]) - 1};"
            f" every page a context reads must index kv_cache (a negative id would read another "
            f"page)")


def check_device_plan_matches(device_plan: Any) -> None:
    """``ValueError`` if the DevicePlan's device tensors no longer hold its host plan (reads
    them: synchronizes on a device)."""
    host = device_plan.plan.device_arrays()
    for name, t in device_plan.tensors.items():
        if name in host and not np.array_equal(t.cpu().numpy(), host[name]):
            raise ValueError(
                f"device_plan.{name} on {t.device} differs from its host plan: the staging slot "
                f"was reused (a ring-mode DevicePlan stays valid for the ring's valid_uploads "
                f"later uploads). Upload the plan again right before the forward.")


_PLAN_TENSORS = ("cu_query_lens", "chunk_starts", "cu_seq_lens")
#: What the forward reads besides in a plan that shares prefixes (ChunkPlan.shares_prefixes).
_SHARED_PLAN_TENSORS = ("iteration_cu_query_lens", "iteration_cu_seq_lens")


def plan_tensors(plan: Any, device_plan: Any = None) -> dict[str, torch.Tensor]:
    """The device tensors of a DevicePlan the forward reads (validation helper); with
    ``iteration_cu_query_lens`` when the plan shares prefixes."""
    if device_plan is None:
        return {}
    names = _PLAN_TENSORS
    if getattr(plan, "iteration_cu_query_lens", None) is not None:
        names = (*names, *_SHARED_PLAN_TENSORS)
    return {name: device_plan.tensors[name] for name in names}


def infer_head_dims(q: torch.Tensor, k_pe_new: torch.Tensor, kv_b_proj_weight: torch.Tensor,
                    qk_nope_head_dim: int | None = None,
                    v_head_dim: int | None = None) -> tuple[int, int, int]:
    """``(qk_nope_head_dim, v_head_dim, qk_rope_head_dim)`` from the shapes of ``q [T, H, nope +
    rope]``, ``k_pe_new [T, rope]`` and ``kv_b_proj_weight [H * (nope + v), rank]``; given dims
    are checked against them. Raises ``TypeError``/``ValueError`` naming the field."""
    for name, t in (("q", q), ("k_pe_new", k_pe_new), ("kv_b_proj_weight", kv_b_proj_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3 or k_pe_new.dim() != 2 or kv_b_proj_weight.dim() != 2:
        raise ValueError(f"q must be [T, H, qk_head_dim], k_pe_new [T, qk_rope_head_dim], "
                         f"kv_b_proj_weight [H * (nope + v), rank]; got {tuple(q.shape)}, "
                         f"{tuple(k_pe_new.shape)}, {tuple(kv_b_proj_weight.shape)}")
    num_heads, rope = q.shape[1], k_pe_new.shape[1]
    nope = q.shape[2] - rope if qk_nope_head_dim is None else qk_nope_head_dim
    if nope <= 0 or nope + rope != q.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} must be qk_nope_head_dim ({nope}) + "
                         f"qk_rope_head_dim ({rope}, from k_pe_new)")
    rows = kv_b_proj_weight.shape[0]
    if num_heads == 0 or rows % num_heads:
        raise ValueError(f"kv_b_proj_weight has {rows} rows, not a multiple of H = {num_heads} "
                         f"(from q); expected [H * (qk_nope_head_dim + v_head_dim), rank]")
    v_dim = rows // num_heads - nope if v_head_dim is None else v_head_dim
    if v_dim <= 0 or num_heads * (nope + v_dim) != rows:
        raise ValueError(f"kv_b_proj_weight has {rows} rows, expected H * (qk_nope_head_dim + "
                         f"v_head_dim) = {num_heads} * ({nope} + {v_dim})")
    return nope, v_dim, rope



def check_forward_inputs(q: Any, kv_c_new: Any, k_pe_new: Any, kv_cache: Any,
                         block_table: Any, device_plan: Any, *, weight: torch.Tensor,
                         num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                         context_source: Any = None, return_lse: Any = False,
                         validate: Any = False, out: Any = None, lse: Any = None,
                         kv_cache_scale: Any = None,
                         kv_cache_format: Any = None) -> tuple[int, KVCacheSpec]:
    """Check every input of ``MLAChunkedPrefill.forward`` against the weight and the plan's host
    ints; return the rope dim (``k_pe_new.shape[1]``) and how to read the cache.

    Host-only (never reads device memory) unless ``validate``. With a ``context_source`` the
    forward never reads ``block_table`` (the source gathers the rows, e.g. from a rank's local
    shard), so it is not checked against the contexts.
    """
    check_bool("return_lse", return_lse)
    check_bool("validate", validate)
    if context_source is not None and not callable(context_source):
        raise TypeError(f"context_source must be a callable (iteration, workspace) -> rows "
                        f"or None, got {type(context_source).__name__}")
    plan = check_device_plan(device_plan)
    for name, t in (("q", q), ("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new),
                    ("kv_cache", kv_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_pe_new.dim() != 2:
        raise ValueError(f"k_pe_new must be [T, qk_rope_head_dim], got shape "
                         f"{tuple(k_pe_new.shape)}")
    rope = k_pe_new.shape[1]
    h, nope, rank = num_heads, qk_nope_head_dim, weight.shape[1]
    num_tokens = plan.num_query_tokens
    expected = {
        "q": (num_tokens, h, nope + rope),
        "kv_c_new": (num_tokens, rank),
        "k_pe_new": (num_tokens, rope),
    }
    for name, t in (("q", q), ("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}, expected {expected[name]} (T = "
                f"plan.num_query_tokens = {num_tokens}, H = {h} and kv_lora_rank = {rank} "
                f"from kv_b_proj_weight, qk = qk_nope_head_dim {nope} + rope {rope} from "
                f"k_pe_new)")
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"q dtype {dtype} is not a float dtype; expected one of "
                         f"{FLOAT_DTYPES}")
    spec = resolve_kv_cache(kv_cache, kv_cache_scale, kv_cache_format,
                            latent_dim=rank + rope, dtype=dtype)
    if kv_cache.shape[1] != plan.page_size:
        raise ValueError(f"kv_cache page_size {kv_cache.shape[1]} != plan.page_size "
                         f"{plan.page_size}; plan with the cache's page size")
    if block_table.dim() != 2 or block_table.shape[0] != plan.num_reqs:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}, expected "
                         f"[num_reqs={plan.num_reqs}, max_blocks]")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table dtype is {block_table.dtype}, expected torch.int32")
    max_ctx = int(plan.context_lens.max()) if plan.num_reqs else 0
    if context_source is None and block_table.shape[1] * plan.page_size < max_ctx:
        raise ValueError(f"block_table has {block_table.shape[1]} blocks per request "
                         f"(x page_size {plan.page_size}), fewer than the longest context "
                         f"{max_ctx} tokens needs")
    for name, t in (("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new)):
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} != q dtype {dtype}; cast them to one "
                             f"dtype")
    device = q.device
    for name, t in (("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new), ("kv_cache", kv_cache),
                    ("block_table", block_table), ("kv_b_proj_weight", weight)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q is on {device}; put every input "
                             f"on one device")
    for name, t in plan_tensors(plan, device_plan).items():
        if t.device != device:
            raise ValueError(f"device_plan.{name} is on {t.device}, q is on {device}; "
                             f"upload the plan with StagingRing({device!s})")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous [T, H, qk_head_dim]; call .contiguous()")
    if context_source is None and max_ctx > 0 and (block_table.device.type == "cpu"
                                                  or validate):
        # Free on host memory; on a device it copies the used columns to the host: a sync.
        check_block_ids(block_table, plan.context_lens, plan.page_size, kv_cache.shape[0])
    check_out_buffers(out, lse, (num_tokens, h), v_head_dim, dtype, lse_dtype_for(dtype), device)
    if validate:
        check_device_plan_matches(device_plan)
        if spec.scale_tensor is not None:
            check_scale_value(spec.scale_tensor)
    return rope, spec


def check_scale_value(scale: torch.Tensor) -> None:
    """``ValueError`` unless the device scale tensor holds a finite value > 0 (reads it:
    synchronizes on a device; ``validate=True`` only)."""
    value = float(scale.cpu().numpy()[0])
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"kv_cache_scale holds {value!r}; the scale must be a finite number "
                         f"> 0 (the dequantized value is fp8 x scale)")


def check_out_buffers(out: Any, lse: Any, tokens_heads: tuple[int, int], v_head_dim: int,
                      dtype: torch.dtype, lse_dtype: torch.dtype, device: torch.device) -> None:
    """``out [T, H, v_head_dim]`` (q's dtype) and ``lse [T, H]`` (``lse_dtype``) given to the
    forward to write into: each None or a contiguous tensor of that shape, dtype and device."""
    for name, t, shape, want in (("out", out, (*tokens_heads, v_head_dim), dtype),
                                 ("lse", lse, tokens_heads, lse_dtype)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != shape or t.dtype != want or t.device != device:
            raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                             f"{shape} {want} on {device} (T = plan.num_query_tokens); pass "
                             f"None to have the forward allocate it")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; pass a dense tensor or None")
