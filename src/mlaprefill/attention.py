"""The forward: MLA chunked-context prefill (device work only, never synchronizes).

For each request, query ``i`` attends to the whole cached context and to new tokens ``0..i``:

1. **new tokens** — up-project ``kv_c_new`` to per-head ``k_nope``/``v`` (``k_pe_new`` joined to
   each head's key or passed apart, as the backend wants), causal varlen attention with LSE: the
   running ``(out, lse)``;
2. **context**, one plan iteration at a time (a Python loop over *iterations*, shapes from the
   plan's host ints): gather the iteration's latent rows into a preallocated workspace (or take
   them from ``context_source``), up-project them (one matmul for split keys, two for joined),
   non-causal varlen attention of all queries against them (``cu_seq_lens[i]``), merged into
   ``(out, lse)`` by LSE (``backend.attend_into``: in the attention kernel's epilogue for
   ``triton``/``hybrid``, a merge pass for the others).

Up-projection layout: where the backend takes split keys for a call (``backend.wants_joined_keys``
is False: our Triton kernel, which reads MLA's rope key once per token with head stride 0), one
matmul with the Hugging Face ``kv_b_proj.weight [H*(nope+v), rank]`` as it is gives ``[n, H,
nope+v]``, and K and V are its two views: no zero rows in the GEMM, no rope copy, one launch.
Otherwise (joined keys) each row is ``[n, H, v+nope+rope]``, every head's ``[v | k_nope | k_pe]``:
one strided-batched GEMM over the heads (the shared ``kv_c`` against each head's ``[W_UV |
W_UK]^T``, re-laid once per dtype and device) writes the ``[v | k_nope]`` columns in place and
:func:`~mlaprefill.kernels.rope.broadcast_rope_` fills the rope slots; ``k`` and ``v`` are views.
For FlashAttention-2 (which needs ``v_out == qk_head_dim``) the weight is re-laid with zero rows
instead: ``W_K [H*(nope+rope), rank]`` (zero rows in each head's rope slot) and ``W_V`` padded to
the key's width, two matmuls, so V arrives padded for free.

Sync property: ``forward`` reads only host ints of the plan (``iteration_tokens``,
``max_chunk_lens``, ``max_query_len``, ``num_query_tokens``) to decide shapes; it never calls
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or branches on device values. With
``cudnn``/``varlen`` the launch sequence depends on host ints only (``flex`` compiles lazily).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mlaprefill.backends import AttentionBackend, VarlenSeqs, get_backend, seq_ids_from_cu
from mlaprefill.batch import INT32_MAX
from mlaprefill.graphs import (
    EAGER,
    MIN_QUERY_BUCKET,
    Arena,
    IterationGraphs,
    LayerGraphs,
    pow2_at_least,
    row_bucket,
)
from mlaprefill.kernels.gather import gather_context_rows
from mlaprefill.kernels.rope import broadcast_rope_
from mlaprefill.kernels.upproj import matmul_device_rows
from mlaprefill.plan import ChunkPlan
from mlaprefill.staging import DevicePlan, parse_device

__all__ = ["DEFAULT_WORKSPACE_TOKENS", "MLAChunkedPrefill", "infer_head_dims"]

#: Default workspace of :func:`mla_chunked_prefill` (context tokens up-projected per iteration).
DEFAULT_WORKSPACE_TOKENS = 32 * 1024

ContextSource = Callable[[int, torch.Tensor], torch.Tensor]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class MLAChunkedPrefill:
    """MLA prefill over paged context, chunked to a fixed workspace (plan/run split).

    Parameters
    ----------
    kv_b_proj_weight : [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
        Hugging Face DeepSeek layout, per head ``[nope rows | v rows]``. ``num_heads`` and
        ``kv_lora_rank`` are read from its shape.
    qk_nope_head_dim, v_head_dim : int
    softmax_scale : float, optional
        Default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (rope dim read from the inputs).
        A finite number > 0 (``TypeError`` for a non-number, ``ValueError`` for NaN, inf or
        <= 0: a NaN scale would make every output NaN).
    backend : ``"auto" | "hybrid" | "triton" | "cudnn" | "flex" | "varlen" | "math"``
        ``auto`` picks the fastest backend that runs the weight's device and dtype (see
        :data:`mlaprefill.backends.AUTO_ORDER`); :attr:`backend_name` tells which.
    qk_rope_head_dim : int, optional
        Only used to pick the backend before the first forward and to size
        :meth:`static_query` (default 64); the forward reads the real rope dim from
        ``k_pe_new`` and re-checks.
    iteration_graphs : bool or IterationGraphs
        Experimental, off by default; for the ``triton`` and ``hybrid`` backends and forwards
        without ``context_source`` (a DCP forward runs eagerly). Each context iteration runs as
        one replay of a CUDA graph (gather, up-projection, the backend's attention: our
        kernel, and ``hybrid``'s cuDNN rectangles where it places them; sized to the
        iteration's row bucket, at most 1/32 more rows) instead of three or more kernel
        launches from Python. Graphs are captured once per launch shape and layer and
        replayed in later forwards (see :mod:`mlaprefill.graphs`): their inputs live in static
        buffers that each such forward fills with a few device copies. Pass one
        :class:`~mlaprefill.graphs.IterationGraphs` to every layer to share those buffers
        (``True``: this object gets its own), and call its ``capture_pending()`` where the
        host would otherwise wait, so that new shapes are captured there rather than inside a
        forward. Which kernel runs an iteration does not change. On devices without CUDA
        graphs the same padded iterations run eagerly.
        Attribute ``iteration_graphs``: the :class:`~mlaprefill.graphs.IterationGraphs` in
        use, or None.

    Notes
    -----
    What is checked, and when: see :meth:`forward` and the README's "Validation contract".
    """

    def __init__(self, kv_b_proj_weight: torch.Tensor, *, qk_nope_head_dim: int,
                 v_head_dim: int, softmax_scale: float | None = None, backend: str = "auto",
                 qk_rope_head_dim: int | None = None,
                 iteration_graphs: bool | IterationGraphs = False) -> None:
        if not isinstance(iteration_graphs, (bool, IterationGraphs)):
            raise TypeError(f"iteration_graphs must be a bool or an IterationGraphs, got "
                            f"{type(iteration_graphs).__name__}")
        for name, value in (("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_rope_dim(qk_rope_head_dim)
        softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('auto', 'hybrid', 'triton', 'cudnn', 'flex', "
                            f"'varlen' or 'math'), got {type(backend).__name__}")
        if not isinstance(kv_b_proj_weight, torch.Tensor) or kv_b_proj_weight.dim() != 2:
            raise ValueError(
                "kv_b_proj_weight must be a 2-D tensor [H * (qk_nope_head_dim + v_head_dim), "
                f"kv_lora_rank], got {getattr(kv_b_proj_weight, 'shape', type(kv_b_proj_weight))}")
        if kv_b_proj_weight.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"kv_b_proj_weight dtype {kv_b_proj_weight.dtype} is not a float "
                             f"dtype; expected one of {_FLOAT_DTYPES}")
        rows, rank = kv_b_proj_weight.shape
        per_head = qk_nope_head_dim + v_head_dim
        if rows == 0 or rows % per_head:
            raise ValueError(
                f"kv_b_proj_weight has {rows} rows, not a positive multiple of qk_nope_head_dim + "
                f"v_head_dim = {per_head}; expected [H * {per_head}, kv_lora_rank]")
        self.weight = kv_b_proj_weight
        self.num_heads = rows // per_head
        self.kv_lora_rank = rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.v_head_dim = v_head_dim
        self.softmax_scale = softmax_scale
        self._backend_request = backend
        rope = self._rope = 64 if qk_rope_head_dim is None else qk_rope_head_dim
        self._backend = self._make_backend(kv_b_proj_weight.device, kv_b_proj_weight.dtype, rope)
        # (rope, dtype, device, V padded, "k" | "v") -> W_K or W_V (joined keys); (dtype, device,
        # "kv") -> the weight as split keys use it; per instance.
        self._weights: dict[tuple[Any, ...], torch.Tensor] = {}
        self._checked: tuple[Any, ...] | None = None  # (device, dtype, qk) the backend runs
        if iteration_graphs is True:
            iteration_graphs = IterationGraphs()
        self.iteration_graphs: IterationGraphs | None = iteration_graphs or None
        # This object's captured graphs (they record its weights and its cache's address).
        self._graphs = None if self.iteration_graphs is None else LayerGraphs(
            self.iteration_graphs)

    # -- configuration ---------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """Name of the attention backend in use (``auto`` resolved)."""
        return self._backend.name

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @property
    def preferred_policy(self) -> str:
        """The planner policy that suits the backend in use (what ``policy="auto"`` picks)."""
        return self._backend.preferred_policy

    def resolve_policy(self, policy: str) -> str:
        """``policy`` itself, or :attr:`preferred_policy` for ``"auto"``; ``ValueError`` for a
        name that is neither ``"auto"`` nor a planner policy."""
        from mlaprefill.plan import POLICIES

        if policy == "auto":
            return self.preferred_policy
        if policy not in POLICIES:
            raise ValueError(f"policy must be 'auto' or one of {list(POLICIES)}, got {policy!r}")
        return policy

    def _make_backend(self, device: torch.device, dtype: torch.dtype,
                      rope: int) -> AttentionBackend:
        return get_backend(self._backend_request, device=device, dtype=dtype,
                           qk_head_dim=self.qk_nope_head_dim + rope, v_head_dim=self.v_head_dim)

    def _v_out(self, qk_head_dim: int) -> int:
        return qk_head_dim if self._backend.needs_v_padded else self.v_head_dim

    def _up_weights(self, rope: int, dtype: torch.dtype, device: torch.device,
                    joined: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The up-projection weights in the compute dtype and device, built once each.

        Split keys: ``(W_KV, None)`` with ``W_KV [H*(nope+v), rank]`` the weight itself (no copy
        when it already has that dtype and device), so one GEMM gives each head's ``[k_nope |
        v]``. Joined keys: ``(W_B [H, rank, v+nope], None)``, each head's ``[W_UV | W_UK]^T``
        for the batched GEMM of :meth:`_up_project`; for a backend that wants V padded, ``(W_K
        [H*(nope+rope), rank]`` with zero rows in each head's rope slot, ``W_V [H*v_out,
        rank])``. Each layout is built only when a call first wants it (the ``triton`` backend
        never holds a joined one).
        """
        if not joined:
            key = (dtype, device, "kv")
            w_kv = self._weights.get(key)
            if w_kv is None:
                w_kv = self._weights[key] = self.weight.to(device=device, dtype=dtype)
            return w_kv, None
        h, nope, v, rank = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        if not self._backend.needs_v_padded:
            key = (dtype, device, "vk")
            w_b = self._weights.get(key)
            if w_b is None:
                w = self.weight.to(device=device, dtype=dtype).view(h, nope + v, rank)
                w_b = self._weights[key] = torch.cat([w[:, nope:], w[:, :nope]], dim=1) \
                    .transpose(1, 2).contiguous()
            return w_b, None
        base = (rope, dtype, device, "padded")
        w_key = self._weights.get((*base, "k"))
        w_v = self._weights.get((*base, "v"))
        if w_key is not None and w_v is not None:
            return w_key, w_v
        w = self.weight.to(device=device, dtype=dtype).view(h, nope + v, rank)
        if w_key is None:
            w_k = torch.zeros(h, nope + rope, rank, dtype=dtype, device=device)
            w_k[:, :nope] = w[:, :nope]
            w_key = self._weights[(*base, "k")] = w_k.view(h * (nope + rope), rank)
        if w_v is None:
            v_out = self._v_out(nope + rope)
            w_pad = torch.zeros(h, v_out, rank, dtype=dtype, device=device)
            w_pad[:, :v] = w[:, nope:]
            w_v = self._weights[(*base, "v")] = w_pad.view(h * v_out, rank)
        return w_key, w_v

    # -- pieces ----------------------------------------------------------------------------
    def _kv_numel(self, n: int, qk: int) -> int:
        """Elements of the buffer :meth:`_up_project` needs for ``n`` rows (either layout)."""
        return n * self.num_heads * max(qk + self._v_out(qk), self.qk_nope_head_dim
                                        + self.v_head_dim)

    def _up_project(self, kv_c: torch.Tensor, k_pe: torch.Tensor, buf: torch.Tensor, rope: int,
                    joined: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``n`` latent rows, written into the flat buffer's first elements
        (at least :meth:`_kv_numel`).

        split: one GEMM ``kv [n, H, nope+v] = kv_c W_KV^T``, and ``k = kv[..., :nope]``, ``v =
        kv[..., nope:]`` are views (row stride ``H*(nope+v)``); the backend reads ``k_pe``
        itself. joined: rows ``[n, H, v+nope+rope]`` hold each head's ``[v | k_nope | k_pe]``,
        so ``k = [k_nope | k_pe]`` and ``v`` are views (row stride ``H*(v+nope+rope)``); one
        strided-batched GEMM over the heads writes ``[v | k_nope]`` (the shared ``kv_c`` against
        each head's ``W_B``: no zero weight columns, which cost the old layout ~10-25 % more
        GEMM time, benchmarks/results/joined_keys_h200.json), then :func:`broadcast_rope_`
        fills the rope slots. A backend that wants V padded gets ``k [n, H, nope+rope]`` (one
        GEMM whose zero weight rows leave the rope slots to the copy) and ``v [n, H, v_out]``
        from a second GEMM.
        """
        n, h, nope = kv_c.shape[0], self.num_heads, self.qk_nope_head_dim
        if not joined and self._backend.needs_v_padded:
            raise RuntimeError(f"backend {self.backend_name!r} asked for split keys and padded V; "
                               f"split keys come with V unpadded")
        w_key, w_v = self._up_weights(rope, kv_c.dtype, kv_c.device, joined)
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

    def _validate(self, q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                  kv_cache: torch.Tensor, block_table: torch.Tensor, device_plan: Any, *,
                  context_source: Any = None, return_lse: Any = False,
                  validate: Any = False, static_output: Any = False) -> int:
        """Check every input against the weight and the plan's host ints; return rope dim.

        Host-only (never reads device memory) unless ``validate``; see :meth:`forward`. With a
        ``context_source`` the forward never reads ``block_table`` (the source gathers the rows,
        e.g. from a rank's local shard), so it is not checked against the contexts.
        """
        for name, flag in (("return_lse", return_lse), ("validate", validate),
                           ("static_output", static_output)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
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
        h, nope, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
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
        if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + rope:
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected [num_blocks, "
                             f"page_size, {rank + rope}] (kv_lora_rank + qk_rope_head_dim)")
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
        dtype = q.dtype
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"q dtype {dtype} is not a float dtype; expected one of "
                             f"{_FLOAT_DTYPES}")
        for name, t in (("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new), ("kv_cache", kv_cache)):
            if t.dtype != dtype:
                raise ValueError(f"{name} dtype {t.dtype} != q dtype {dtype}; cast them to one "
                                 f"dtype")
        device = q.device
        for name, t in (("kv_c_new", kv_c_new), ("k_pe_new", k_pe_new), ("kv_cache", kv_cache),
                        ("block_table", block_table), ("kv_b_proj_weight", self.weight)):
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
        if validate:
            check_device_plan_matches(device_plan)
        return rope

    # -- the forward -----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                kv_cache: torch.Tensor, block_table: torch.Tensor, device_plan: Any, *,
                return_lse: bool = False, context_source: ContextSource | None = None,
                validate: bool = False, static_output: bool = False,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention output of every new token over its context and the new tokens before it.

        Parameters
        ----------
        q : [T, H, qk_nope_head_dim + qk_rope_head_dim] (roped), contiguous
        kv_c_new : [T, kv_lora_rank]
        k_pe_new : [T, qk_rope_head_dim] (roped)
        kv_cache : [num_blocks, page_size, kv_lora_rank + qk_rope_head_dim], q's dtype
        block_table : int32 [num_reqs, max_blocks] on the cache's device
        device_plan : :class:`mlaprefill.staging.DevicePlan` of a ChunkPlan (or a DCP plan)
        return_lse : also return the LSE
        context_source : callable ``(iteration, workspace) -> rows``, optional
            Supplies iteration ``i``'s latent rows ``[iteration_tokens[i], kv_lora_rank +
            qk_rope_head_dim]`` in workspace order (DCP all-gathers them); default: paged gather.
        validate : bool
            Also check what only device memory can tell, **synchronizing the host** (one D2H copy
            of the block table's used columns and of the DevicePlan's tensors): every block id a
            context reads is in ``[0, num_blocks)``, and the DevicePlan's device tensors still
            hold its plan (a ring slot is reused after ``valid_uploads`` later uploads). For
            debugging and first integration, not for the hot path.
        static_output : bool
            With ``iteration_graphs``, return ``out`` (and ``lse``) as views of its static
            buffers instead of copies: valid until the next forward through the same
            :class:`~mlaprefill.graphs.IterationGraphs` overwrites them, i.e. whatever the
            caller queues on the stream before that forward (e.g. the output projection) reads
            them intact; ``clone()`` to keep them longer. Saves a device copy of ``out`` per
            forward. Forwards that run eagerly (no ``iteration_graphs``, a ``context_source``, a
            backend without split keys) return their own tensors as always. See
            :meth:`static_query` for the input side.

        Returns
        -------
        out : [T, H, v_head_dim] in q's dtype; with ``return_lse`` also lse [T, H], natural log,
        float32 (float64 for float64 inputs); ``-inf`` only for a query with no keys at all.
        A NaN in a request's inputs gives NaN in that request's rows and never changes another
        request's rows.

        Raises
        ------
        TypeError
            A tensor argument that is not a tensor, ``device_plan`` that is not a
            :class:`~mlaprefill.staging.DevicePlan` (e.g. a host ``ChunkPlan``), a non-bool flag.
        ValueError
            Shapes, dtypes or devices that do not match each other, the weight or the plan; on
            CPU tensors (or with ``validate``) a block id outside ``[0, num_blocks)``.

        Never synchronizes unless ``validate=True``: shapes come from the plan's host ints only.
        Checked always, on the host, for free: types, shapes, dtypes, devices, the plan against
        the inputs, block ids of CPU block tables. Undefined: tensors modified while the forward
        runs, a DevicePlan used after its ring slot was reused (see ``validate``) or (with
        ``iteration_graphs``) whose tensors were written in place between forwards, block ids
        outside the cache on CUDA without ``validate`` (the gather writes NaN rows for them, so
        the request's output is NaN and other requests are unaffected).
        """
        rope = self._validate(q, kv_c_new, k_pe_new, kv_cache, block_table, device_plan,
                              context_source=context_source, return_lse=return_lse,
                              validate=validate, static_output=static_output)
        plan = device_plan.chunk_plan
        device, dtype = q.device, q.dtype
        nope, h, rank = self.qk_nope_head_dim, self.num_heads, self.kv_lora_rank
        qk = nope + rope
        checked = (device, dtype, qk)
        if checked != self._checked:  # the backend's device checks, once per input kind
            why = self._backend.unsupported_reason(device, dtype, qk, self.v_head_dim)
            if why is not None:
                if self._backend_request != "auto":
                    raise ValueError(f"backend {self._backend.name!r} cannot run {dtype} on "
                                     f"{device} with qk_head_dim={qk}: {why}")
                self._backend = self._make_backend(device, dtype, rope)
            self._checked = checked
        backend = self._backend
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(qk)
        lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32

        num_tokens = plan.num_query_tokens
        if num_tokens == 0:
            out = q.new_zeros(0, h, self.v_head_dim)
            lse = torch.zeros(0, h, dtype=lse_dtype, device=device)
            return (out, lse) if return_lse else out

        if (self._graphs is not None and context_source is None
                and backend.takes_split_keys):
            return self._forward_graphs(q, kv_c_new, k_pe_new, kv_cache, block_table,
                                        device_plan, rope, scale, lse_dtype, return_lse,
                                        static_output)
        tensors = plan_tensors(plan, device_plan)
        cu_q = tensors["cu_query_lens"]
        # int64 [T], for backends that read it (computed once per step, not per iteration)
        seq_ids_q = seq_ids_from_cu(cu_q, num_tokens) if backend.needs_seq_ids else None

        # (a) new tokens over themselves, causal: the running (out, lse).
        cu_q_host = plan.cu_query_lens
        cu_k_host = plan.cu_seq_lens  # host ints for per-sequence backends
        new_seqs = VarlenSeqs(cu_q, cu_q, plan.max_query_len, plan.max_query_len,
                              seq_ids_q=seq_ids_q, cu_seqlens_q_host=cu_q_host,
                              cu_seqlens_k_host=cu_q_host)
        joined = backend.wants_joined_keys(new_seqs, h, True)
        k_new, v_new = self._up_project(
            kv_c_new, k_pe_new,
            torch.empty(self._kv_numel(num_tokens, qk), dtype=dtype, device=device), rope, joined)
        if joined:
            out_a, lse_a = backend.attend(q, k_new, v_new, new_seqs, causal=True,
                                          softmax_scale=scale)
        else:
            out_a, lse_a = backend.attend(q, k_new, v_new, new_seqs, causal=True,
                                          softmax_scale=scale, k_rope=k_pe_new)
        out = out_a[..., :self.v_head_dim]
        if not out.is_contiguous():
            out = out.contiguous()  # merged in place below; must be our own dense buffer
        lse = lse_a.to(lse_dtype).contiguous()
        del k_new, v_new

        # (b) context, one workspace iteration at a time, merged into (out, lse).
        if plan.num_iterations == 0:
            return (out, lse) if return_lse else out
        max_rows = plan.max_iteration_tokens
        chunk_starts, cu_seq_lens = tensors["chunk_starts"], tensors["cu_seq_lens"]
        workspace = torch.empty(max_rows, rank + rope, dtype=kv_cache.dtype, device=device)
        kv_buf = torch.empty(self._kv_numel(max_rows, qk), dtype=dtype, device=device)
        for i in range(plan.num_iterations):
            num_rows = plan.iteration_tokens[i]
            if not num_rows:
                continue
            seqs_i = VarlenSeqs(cu_q, cu_seq_lens[i], plan.max_query_len,
                                plan.max_chunk_lens[i], seq_ids_q=seq_ids_q,
                                cu_seqlens_q_host=cu_q_host, cu_seqlens_k_host=cu_k_host[i])
            joined = backend.wants_joined_keys(seqs_i, h, False)
            if context_source is None:
                rows = gather_context_rows(kv_cache, block_table, cu_seq_lens[i],
                                           chunk_starts[i], workspace, num_rows)
            else:
                rows = context_source(i, workspace)
                if tuple(rows.shape) != (num_rows, rank + rope):
                    raise ValueError(f"context_source({i}) returned shape {tuple(rows.shape)}, "
                                     f"expected ({num_rows}, {rank + rope})")
                if rows.stride(1) != 1:
                    rows = rows.contiguous()
            k_i, v_i = self._up_project(rows[:, :rank], rows[:, rank:], kv_buf, rope, joined)
            backend.attend_into(q, k_i, v_i, seqs_i, out, lse, causal=False,
                                softmax_scale=scale, k_rope=None if joined else rows[:, rank:])
        return (out, lse) if return_lse else out

    def _forward_graphs(self, q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                        kv_cache: torch.Tensor, block_table: torch.Tensor,
                        device_plan: DevicePlan, rope: int, scale: float,
                        lse_dtype: torch.dtype, return_lse: bool, static_output: bool,
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` through the static buffers of ``iteration_graphs``: the new tokens'
        stage, then runs of context iterations, each a replay of a cached CUDA graph (or, at a
        launch shape's first sight, the same launches run eagerly); see :class:`_ArenaReplay`."""
        backend, h, plan = self._backend, self.num_heads, device_plan.chunk_plan
        cu_q_host, cu_k_host = plan.cu_query_lens, plan.cu_seq_lens
        # (i, row bucket, host offsets of joined keys or None) of every iteration with rows
        units = []
        for i, num_rows in enumerate(plan.iteration_tokens):
            if num_rows:
                host = VarlenSeqs(None, None, plan.max_query_len, plan.max_chunk_lens[i],
                                  cu_seqlens_q_host=cu_q_host, cu_seqlens_k_host=cu_k_host[i])
                joined = host if backend.wants_joined_keys(host, h, False) else None
                units.append((i, row_bucket(num_rows), joined))
        new = VarlenSeqs(None, None, plan.max_query_len, plan.max_query_len,
                         cu_seqlens_q_host=cu_q_host, cu_seqlens_k_host=cu_q_host)
        tokens = row_bucket(plan.num_query_tokens)
        replay = _ArenaReplay(self, q, kv_c_new, k_pe_new, kv_cache, block_table, device_plan,
                              rope, scale, tokens,
                              max([tokens, *(rows for _, rows, _ in units)]))
        replay.new_tokens(tokens, new if backend.wants_joined_keys(new, h, True) else None)
        device_rows = replay.shared.device_rows
        k = 0
        while k < len(units):  # a run of consecutive split-key iterations: one launch
            i, rows, joined = units[k]
            if joined is not None:  # cuDNN rectangles: sized on the host, one iteration
                replay.run(i, rows, 1, joined)
                k += 1
                continue
            run = 1  # of one row bucket, unless the row counts are read on the device
            while (k + run < len(units) and units[k + run][0] == i + run
                   and units[k + run][2] is None
                   and (device_rows or units[k + run][1] == rows)):
                run += 1
            run = 1 << (run.bit_length() - 1)  # a power of two: few keys
            replay.run(i, None if device_rows else rows, run)
            k += run
        return replay.result(lse_dtype, return_lse, static_output)

    __call__ = forward

    def _arena(self, shared: IterationGraphs, need: dict[str, int], device: torch.device,
               dtype: torch.dtype, rope: int) -> Arena:
        """The static buffers of ``shared`` for this layer's shapes in ``dtype`` on ``device``
        (its cache has q's dtype), with at least the capacities ``need``."""
        h, qk, rank = self.num_heads, self.qk_nope_head_dim + rope, self.kv_lora_rank
        return shared.arena((device, dtype, dtype, h, qk, self.v_head_dim, rank + rope), need,
                            device=device, dtype=dtype, kv_dtype=dtype, heads=h, qk=qk,
                            v=self.v_head_dim, latent=rank + rope)

    def static_query(self, num_tokens: int, *, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None,
                     qk_rope_head_dim: int | None = None) -> torch.Tensor:
        """Where to write a forward's ``q`` so that it is not copied: ``[num_tokens, H,
        qk_nope_head_dim + qk_rope_head_dim]``, a view of the static query buffer of
        ``iteration_graphs`` (shared by the layers that share it).

        Write the step's roped queries into it (e.g. ``torch.cat(..., out=)`` or a GEMM's
        ``out=``) and pass it as :meth:`forward`'s ``q``: the forward sees that q already is
        the buffer and skips its copy (with ``static_output``, the copies of q in and ``(out,
        lse)`` out took 0.022 ms of device time per forward at 4096 tokens of 16 heads in bf16
        on the H200, 0.16 ms at 128 heads: benchmarks/results/forward_profile_h200_static.json). It
        holds one layer's queries at a time: write a layer's only after the previous layer's
        forward was queued (in stream order, as a layer stack does). A q elsewhere is copied in
        as always, so using it is never required; should the buffer have grown since (more
        tokens than any forward before), the view is no longer the buffer and the forward
        copies it. Without ``iteration_graphs``: a new tensor (the forward reads q where it
        is).

        ``dtype`` / ``device`` default to the weight's; ``qk_rope_head_dim`` to the one given
        at construction (64 if none). Host-only: never synchronizes.
        """
        if (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                or not 0 <= num_tokens <= INT32_MAX):
            raise ValueError(f"num_tokens must be an int in [0, 2**31 - 1] (a plan's "
                             f"num_query_tokens), got {num_tokens!r}")
        rope = self._rope if check_rope_dim(qk_rope_head_dim) is None else qk_rope_head_dim
        dtype = self.weight.dtype if dtype is None else dtype
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
        device = self.weight.device if device is None else parse_device(
            device, "static_query device")
        qk = self.qk_nope_head_dim + rope
        if self.iteration_graphs is None:
            return torch.empty(num_tokens, self.num_heads, qk, dtype=dtype, device=device)
        arena = self._arena(self.iteration_graphs, {"tokens": row_bucket(num_tokens)}, device,
                            dtype, rope)
        return arena.q[:num_tokens]


class _NewTokens:
    """The new tokens' stage, sized to a graph key and reading only static buffers: the
    up-projection of the arena's first ``tokens`` latent rows (the step's ``kv_c_new | k_pe_new``,
    then rows of no sequence) and the backend's causal attention of the arena's queries over
    them (``seqs`` sequences, grid of ``max_q`` queries), stored as the arena's running
    ``(out, lse)`` (``attend_to``: no result tensors, no copy). ``host``: the plan's host
    ``cu_query_lens`` when the backend wants joined keys (``hybrid``'s cuDNN rectangles are
    placed from them; part of the key), else None.
    """

    __slots__ = ("arena", "host", "launch", "op")

    def __init__(self, op: MLAChunkedPrefill, arena: Arena, seqs: int, max_q: int, tokens: int,
                 rope: int, scale: float, host: Any) -> None:
        self.op, self.arena, self.host = op, arena, host
        self.launch = (seqs, max_q, tokens, rope, scale)

    def __call__(self) -> None:
        arena, op = self.arena, self.op
        seqs, max_q, tokens, rope, scale = self.launch
        joined, rank = self.host is not None, op.kv_lora_rank
        latent = arena.workspace[:tokens]
        k, v = op._up_project(latent[:, :rank], latent[:, rank:], arena.kv_buf, rope, joined)
        cu = arena.cu_q[:seqs + 1]
        op._backend.attend_to(
            arena.q[:tokens], k, v, VarlenSeqs(cu, cu, max_q, max_q, cu_seqlens_q_host=self.host,
                                               cu_seqlens_k_host=self.host),
            arena.out[:tokens], arena.lse[:tokens], causal=True, softmax_scale=scale,
            k_rope=None if joined else latent[:, rank:])


class _PaddedIteration:
    """``count`` consecutive context iterations' launches, sized to a graph key and reading only
    static buffers; per iteration: the arena's offsets row ``counter`` -> gather of its rows ->
    the up-projection of them -> the backend's attention over ``seqs`` sequences (grid of
    ``max_q`` queries) merging into the arena's ``(out, lse)`` -> counter + 1. What a graph of the
    key records; eager on first sight.

    ``rows``: the iterations' row bucket (the gather's and ``torch.mm``'s size), or None
    (``IterationGraphs.device_rows``, split keys): the gather and the up-projection GEMM
    (:func:`~mlaprefill.kernels.upproj.matmul_device_rows`) read each iteration's row count on
    the device (``cu_k[i, -1]``) and cover the arena's capacity, so the launches fit every row
    count. ``host`` (joined keys, ``count`` 1): the iteration's host offsets ``(cu_q, cu_k)``,
    from which the backend places its cuDNN rectangles (part of the key: ``launch_key``).
    """

    __slots__ = ("arena", "host", "kv_cache", "launch", "op")

    def __init__(self, op: MLAChunkedPrefill, arena: Arena, kv_cache: torch.Tensor, seqs: int,
                 max_q: int, rows: int | None, count: int, rope: int, scale: float,
                 host: tuple[Any, Any] | None) -> None:
        self.op, self.arena, self.kv_cache, self.host = op, arena, kv_cache, host
        self.launch = (seqs, max_q, rows, count, rope, scale)

    def __call__(self) -> None:
        arena, op, kv_cache = self.arena, self.op, self.kv_cache
        seqs, max_q, rows, count, rope, scale = self.launch
        joined = self.host is not None
        rank, h, nope = op.kv_lora_rank, op.num_heads, op.qk_nope_head_dim
        cq, ck = self.host if joined else (None, None)
        device_rows = rows is None
        if device_rows:  # every row the arena holds; the kernels stop at the device's count
            width = nope + op.v_head_dim
            rows = min(arena.workspace.shape[0], arena.kv_buf.shape[0] // (h * width))
            w_kv = op._up_weights(rope, arena.q.dtype, arena.q.device, False)[0].contiguous()
            kv = arena.kv_buf[:rows * h * width].view(rows, h, width)
        for _ in range(count):
            cu = arena.cu_k[:, :seqs + 1].index_select(0, arena.counter)[0]
            starts = arena.starts[:, :seqs].index_select(0, arena.counter)[0]
            latent = gather_context_rows(kv_cache, arena.block_table[:seqs], cu, starts,
                                         arena.workspace, rows, use_kernel=True)
            if not device_rows:
                k_i, v_i = op._up_project(latent[:, :rank], latent[:, rank:], arena.kv_buf,
                                          rope, joined)
            else:
                kv_i = matmul_device_rows(latent[:, :rank], w_kv, kv.view(rows, -1),
                                          cu[seqs:]).view(rows, h, width)
                k_i, v_i = kv_i[..., :nope], kv_i[..., nope:]
            op._backend.attend_into(arena.q, k_i, v_i,
                                    VarlenSeqs(arena.cu_q[:seqs + 1], cu, max_q, rows,
                                               cu_seqlens_q_host=cq, cu_seqlens_k_host=ck),
                                    arena.out, arena.lse, causal=False, softmax_scale=scale,
                                    k_rope=None if joined else latent[:, rank:])
            arena.counter.add_(1)


class _ArenaReplay:
    """One forward's launches, run as replays of cached CUDA graphs.

    On construction, copies the forward's queries (unless they are the arena's own:
    :meth:`MLAChunkedPrefill.static_query`) and new latent rows into the
    :class:`~mlaprefill.graphs.IterationGraphs` arena, and the plan's offsets (padded to the
    bucketed sequence count: padded sequences get no queries and no keys) and block table unless
    the arena holds them already: the previous forward through this arena (e.g. the previous
    layer of the step) ran the same DevicePlan object, whose tensors staging never changes (a
    new upload makes a new DevicePlan); the block table only when it is one of the DevicePlan's
    tensors too (a caller's own block table may have changed in place: always copied).
    ``new_tokens(tokens, host)`` runs the new tokens' stage (:class:`_NewTokens`),
    ``run(i, rows, count)`` iterations ``i .. i + count - 1`` as one
    :class:`_PaddedIteration` of ``rows`` rows each (their row bucket). The first time a forward
    object meets a graph key its launches run eagerly (that loads every kernel) and the key is
    queued for capture; it is captured at the next ``capture_pending`` (until that is first
    called: at its second sight), then replayed, in this forward and the next ones with the same
    key. ``result()`` copies the arena's ``(out, lse)`` out (or returns them, for
    ``static_output``). On a device without CUDA graphs the
    padded launches always run eagerly.
    """

    def __init__(self, op: MLAChunkedPrefill, q: torch.Tensor, kv_c_new: torch.Tensor,
                 k_pe_new: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 device_plan: DevicePlan, rope: int, scale: float, tokens: int,
                 max_rows: int) -> None:
        assert op._graphs is not None
        shared, plan = op._graphs.shared, device_plan.chunk_plan
        num_tokens, num_seqs, num_iters = plan.num_query_tokens, plan.num_reqs, plan.num_iterations
        seqs = pow2_at_least(num_seqs)
        max_q = pow2_at_least(plan.max_query_len, MIN_QUERY_BUCKET)
        qk, rank = op.qk_nope_head_dim + rope, op.kv_lora_rank
        device = q.device
        arena = self.arena = op._arena(
            shared, {"tokens": tokens, "seqs": seqs, "iters": num_iters,
                     "blocks": block_table.shape[1], "rows": max_rows,
                     "kv": op._kv_numel(max_rows, qk)}, device, q.dtype, rope)
        # Inputs in (device copies, stream ordered after the previous forward's replays); q
        # not when it is the arena's own (static_query): q is contiguous, of num_tokens rows.
        if q.data_ptr() != arena.q.data_ptr():
            arena.q[:num_tokens].copy_(q)
        arena.workspace[:num_tokens, :rank].copy_(kv_c_new)
        arena.workspace[:num_tokens, rank:].copy_(k_pe_new)
        staged = device_plan.tensors
        cu_q, cu_k, starts = staged["cu_query_lens"], staged["cu_seq_lens"], staged["chunk_starts"]
        if arena.offsets_from is not device_plan:
            arena.offsets_from = device_plan
            arena.cu_q[:num_seqs + 1].copy_(cu_q)
            arena.cu_k[:num_iters, :num_seqs + 1].copy_(cu_k)
            # Padded sequences, up to the arena's capacity (so a graph of a bigger sequence
            # bucket can stand in): empty, at the end of the queries and keys.
            cap = arena.cu_q.shape[0] - 1
            if cap > num_seqs:
                arena.cu_q[num_seqs + 1:].fill_(num_tokens)
                arena.cu_k[:num_iters, num_seqs + 1:].copy_(
                    cu_k[:, num_seqs:].expand(num_iters, cap - num_seqs))
            arena.starts[:num_iters, :num_seqs].copy_(starts)
        # A caller's block table may have changed since; a DevicePlan's tensors do not.
        staged_table = any(t is block_table for t in staged.values())
        if not staged_table or arena.table_from is not device_plan:
            arena.table_from = device_plan if staged_table else None
            arena.block_table[:block_table.shape[0], :block_table.shape[1]].copy_(block_table)
        self.op, self.shared, self.device = op, shared, device
        self.use_graphs = device.type == "cuda"
        self.num_tokens = num_tokens
        self.kv_cache, self.launch = kv_cache, (seqs, max_q, rope, scale)
        self.key = (seqs, max_q, rope, scale, op._backend.name, kv_cache.data_ptr(),
                    tuple(kv_cache.shape), tuple(kv_cache.stride()))

    def new_tokens(self, tokens: int, joined: VarlenSeqs | None) -> None:
        """The new tokens' stage over ``tokens`` rows (their bucket); ``joined``: their
        VarlenSeqs (the plan's host offsets) when the backend wants joined keys for it."""
        op = self.op
        seqs, max_q, rope, scale = self.launch
        host = None if joined is None else joined.cu_seqlens_q_host
        key = (*self.key, tokens, "new") if joined is None else (
            *self.key, tokens, "new", op._backend.launch_key(joined, op.num_heads, True))
        self._launch(key, lambda: _NewTokens(op, self.arena, seqs, max_q, tokens, rope, scale,
                                             host), stand_in=joined is None)

    def run(self, i: int, rows: int | None, count: int = 1,
            joined: VarlenSeqs | None = None) -> None:
        """Iterations ``i .. i + count - 1``, split keys with their row counts read on the
        device (``rows`` None); or iteration ``i`` padded to ``rows`` rows with ``joined``, its
        VarlenSeqs (with the plan's host offsets), when the backend wants joined keys for it."""
        arena, op = self.arena, self.op
        seqs, max_q, rope, scale = self.launch
        key = (*self.key, rows, count) if joined is None else (
            *self.key, rows, count, "joined", op._backend.launch_key(joined, op.num_heads, False))
        host = None if joined is None else (joined.cu_seqlens_q_host, joined.cu_seqlens_k_host)
        if arena.next != i:
            arena.counter.fill_(i)
        arena.next = -1  # unknown, should the launches below raise
        self._launch(key, lambda: _PaddedIteration(op, arena, self.kv_cache, seqs, max_q, rows,
                                                   count, rope, scale, host),
                     stand_in=rows is not None and joined is None)
        arena.next = i + count  # each iteration added one to the counter

    def result(self, lse_dtype: torch.dtype, return_lse: bool, static: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward's ``out`` (and ``lse``): new tensors copied from the arena, or with
        ``static`` the arena's own (views, overwritten by the next forward through it)."""
        t = self.num_tokens
        out = self.arena.out[:t] if static else self.arena.out[:t].clone()
        if not return_lse:
            return out
        lse = self.arena.lse[:t]
        return out, (lse if static and lse.dtype == lse_dtype else lse.to(lse_dtype, copy=True))

    def _launch(self, key: tuple[Any, ...], make: Callable[[], Any], *,
                stand_in: bool = False) -> None:
        """Replay ``key``'s graph; at its first sight run ``make()``'s launches eagerly and
        queue the key (or capture it here, at its second sight, until capture_pending runs).
        ``stand_in`` (the new tokens' stage, or split-key iterations sized to a row bucket
        ``key[-2]``): instead of running eagerly, replay a captured graph of the same launches
        over bigger buckets (:meth:`~mlaprefill.graphs.LayerGraphs.stand_in`): the extra
        sequences are empty, the extra query blocks exit, the extra rows are never attended
        (the gather leaves them alone): the same result for a little more work, this once."""
        layer = self.op._graphs
        seen, graph = layer.lookup(key, self.arena.generation)
        if graph is None or graph is EAGER:
            padded = make()
            if (not self.use_graphs or not seen or graph is EAGER
                    or not self.shared.captures_in_forward):
                # first sight of this key (real work, and loads every kernel), its capture left
                # to capture_pending, or a key that cannot be captured
                other = (layer.stand_in(key)
                         if stand_in and self.use_graphs and graph is not EAGER else None)
                if other is not None:
                    other.replay()
                    self.shared.replays += 1
                    self.shared.stand_ins += 1
                else:
                    padded()
                    self.shared.warm_runs += 1
                if self.use_graphs and graph is not EAGER:
                    layer.store(key, None)
                    self.shared.defer(layer, key, self.device, padded)
                return
            graph = self.shared.capture(self.device, padded)
            layer.store(key, graph)
            if graph is EAGER:
                padded()
                self.shared.warm_runs += 1
                return
        graph.replay()
        self.shared.replays += 1


def check_rope_dim(qk_rope_head_dim: Any) -> int | None:
    """``qk_rope_head_dim`` itself: an int >= 0 or None; ``ValueError`` naming it otherwise."""
    if qk_rope_head_dim is not None and (isinstance(qk_rope_head_dim, bool) or not isinstance(
            qk_rope_head_dim, int) or qk_rope_head_dim < 0):
        raise ValueError(f"qk_rope_head_dim must be an int >= 0 or None, got "
                         f"{qk_rope_head_dim!r}")
    return qk_rope_head_dim


def check_softmax_scale(softmax_scale: Any) -> float | None:
    """``softmax_scale`` as a float (None stays None); ``TypeError``/``ValueError`` naming it."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a number (e.g. 1 / sqrt(qk_head_dim) times the "
                        f"YaRN mscale) or None, got {type(softmax_scale).__name__} "
                        f"{softmax_scale!r:.40}")
    value = float(softmax_scale)
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
    missing = [n for n in _PLAN_TENSORS if n not in device_plan.tensors]
    needed = ("num_reqs", "num_query_tokens", "page_size", "context_lens", "num_iterations",
              "iteration_tokens", "max_chunk_lens", "max_query_len", "cu_query_lens")
    chunk_plan = getattr(device_plan.plan, "chunk_plan", None)
    missing += [f"plan.chunk_plan.{n}" for n in needed if not hasattr(chunk_plan, n)]
    if missing:
        raise ValueError(f"device_plan lacks {missing}; pass StagingRing(device).upload(plan) "
                         f"of a ChunkPlanner plan")
    return chunk_plan


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


def plan_tensors(plan: Any, device_plan: Any = None) -> dict[str, torch.Tensor]:
    """The device tensors of a DevicePlan the forward reads (validation helper)."""
    if device_plan is None:
        return {}
    return {name: device_plan.tensors[name] for name in _PLAN_TENSORS}


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


def __getattr__(name: str) -> Any:
    # The one-call API moved to mlaprefill.api (above both this module and mlaprefill.dcp); the
    # old import path keeps working without importing it at module load (no cycle).
    if name == "mla_chunked_prefill":
        from mlaprefill import api

        return api.mla_chunked_prefill
    raise AttributeError(f"module 'mlaprefill.attention' has no attribute {name!r}")
