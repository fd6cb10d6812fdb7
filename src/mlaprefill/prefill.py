"""The forward: MLA chunked-context prefill (device work only, never synchronizes).

For each request, query ``i`` attends to the whole cached context and to new tokens ``0..i``:

1. **new tokens** — up-project ``kv_c_new`` to per-head ``k_nope``/``v`` (:mod:`mlaprefill.weights`:
   ``k_pe_new`` joined to each head's key or passed apart, as the backend wants), causal varlen
   attention with LSE: the running ``(out, lse)``;
2. **context**, one plan iteration at a time (a Python loop over *iterations*, shapes from the
   plan's host ints): gather the iteration's latent rows into a preallocated workspace (or take
   them from ``context_source``), up-project them, non-causal varlen attention of all queries
   against them (``cu_seq_lens[i]``), merged into ``(out, lse)`` by LSE
   (``backend.attend_and_merge``: in the attention kernel's epilogue for ``mlaprefill``, a merge
   pass for the others).

With ``graphs=IterationGraphs()`` the same launches run as replays of CUDA graphs
(:mod:`mlaprefill.replay`). Input checks live in :mod:`mlaprefill.validation`.

Sync property: ``forward`` reads only host ints of the plan (``iteration_tokens``,
``max_chunk_lens``, ``max_query_len``, ``num_query_tokens``) to decide shapes; it never calls
``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero`` or branches on device values.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from mlaprefill.backends import AttentionBackend, VarlenSeqs, get_backend, seq_ids_from_cu
from mlaprefill.batch import INT32_MAX
from mlaprefill.graphs import IterationGraphs, LayerGraphs, row_bucket
from mlaprefill.kernels.gather import gather_context_rows_with_spec
from mlaprefill.plan import POLICIES
from mlaprefill.replay import forward_graphs, layer_arena
from mlaprefill.staging import DevicePlan, parse_device
from mlaprefill.validation import (
    FLOAT_DTYPES,
    check_forward_inputs,
    check_rope_dim,
    check_softmax_scale,
    lse_dtype_for,
    plan_tensors,
)
from mlaprefill.weights import UpProjection

__all__ = ["DEFAULT_WORKSPACE_TOKENS", "IOBuffers", "MLAChunkedPrefill"]

#: Default workspace of :func:`mla_chunked_prefill` (context tokens up-projected per iteration).
DEFAULT_WORKSPACE_TOKENS = 32 * 1024

ContextSource = Callable[[int, torch.Tensor], torch.Tensor]


class IOBuffers(NamedTuple):
    """Where a forward reads ``q`` and writes ``out`` / ``lse`` with no copy (see
    :meth:`MLAChunkedPrefill.io_buffers`): ``q [T, H, qk_head_dim]``, ``out [T, H,
    v_head_dim]`` (q's dtype), ``lse`` float32 ``[T, H]`` (float64 for float64)."""

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


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
    backend : ``"auto" | "mlaprefill" | "cudnn" | "fa2" | "flex" | "math"``
        ``auto`` picks the fastest backend that runs the weight's device and dtype and the head
        dims (see :data:`mlaprefill.backends.AUTO_ORDER`); inputs of a kind that pick cannot run
        (float64, another device, a rope dim its kernel cannot split) run on auto's pick for
        them, and inputs it can run are back on it. :attr:`backend_name` tells which ran last.
        A named backend that cannot run the head dims is a ``ValueError`` here (at the first
        forward for a rope dim read from ``k_pe_new``).
    qk_rope_head_dim : int, optional
        Only used to pick the backend before the first forward and to size
        :meth:`io_buffers` (default 64); the forward reads the real rope dim from ``k_pe_new``.
    graphs : IterationGraphs, optional
        Run the forward as replays of CUDA graphs captured once per launch shape and reused by
        later forwards (the ``mlaprefill`` backend; forwards without ``context_source``). Give
        every layer the same object: they share its static buffers. Call its
        ``capture_pending()`` where the host would otherwise wait. See :mod:`mlaprefill.graphs`.
        On devices without CUDA graphs the same padded launches run eagerly.

    Notes
    -----
    What is checked, and when: see :meth:`forward` and the README's "Validation contract".
    """

    def __init__(self, kv_b_proj_weight: torch.Tensor, *, qk_nope_head_dim: int,
                 v_head_dim: int, softmax_scale: float | None = None, backend: str = "auto",
                 qk_rope_head_dim: int | None = None,
                 graphs: IterationGraphs | None = None) -> None:
        if graphs is not None and not isinstance(graphs, IterationGraphs):
            raise TypeError(f"graphs must be an IterationGraphs or None, got "
                            f"{type(graphs).__name__}; pass graphs=mlaprefill.IterationGraphs()")
        for name, value in (("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_rope_dim(qk_rope_head_dim)
        softmax_scale = check_softmax_scale(softmax_scale)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('auto', 'mlaprefill', 'cudnn', 'fa2', "
                            f"'flex' or 'math'), got {type(backend).__name__}")
        if not isinstance(kv_b_proj_weight, torch.Tensor) or kv_b_proj_weight.dim() != 2:
            raise ValueError(
                "kv_b_proj_weight must be a 2-D tensor [H * (qk_nope_head_dim + v_head_dim), "
                f"kv_lora_rank], got {getattr(kv_b_proj_weight, 'shape', type(kv_b_proj_weight))}")
        if kv_b_proj_weight.dtype not in FLOAT_DTYPES:
            raise ValueError(f"kv_b_proj_weight dtype {kv_b_proj_weight.dtype} is not a float "
                             f"dtype; expected one of {FLOAT_DTYPES}")
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
        self.upproj = UpProjection(kv_b_proj_weight, num_heads=self.num_heads,
                                   qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)
        self._backend_request = backend
        rope = self._rope = 64 if qk_rope_head_dim is None else qk_rope_head_dim
        self._backend = self._make_backend(kv_b_proj_weight.device, kv_b_proj_weight.dtype, rope)
        self._checked: tuple[Any, ...] | None = None  # (device, dtype, rope) the backend runs
        # auto: the construction pick, and the pick per input kind it cannot run (float64, ...)
        self._auto_picks: dict[tuple[Any, ...], AttentionBackend] = {}
        self._auto_default = self._backend
        self.graphs = graphs
        # This object's captured graphs (they record its weights and its cache's address).
        self.layer_graphs = None if graphs is None else LayerGraphs(graphs)

    # -- configuration ---------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        """Name of the attention backend in use (``auto`` resolved; after a forward, the one
        that ran it)."""
        return self._backend.name

    @property
    def backend(self) -> AttentionBackend:
        """The attention backend object in use."""
        return self._backend

    @property
    def preferred_policy(self) -> str:
        """The planner policy that suits the backend in use (what ``policy="auto"`` picks)."""
        return self._backend.preferred_policy

    def resolve_policy(self, policy: str) -> str:
        """``policy`` itself, or :attr:`preferred_policy` for ``"auto"``; ``ValueError`` for a
        name that is neither ``"auto"`` nor a planner policy."""
        if policy == "auto":
            return self.preferred_policy
        if policy not in POLICIES:
            raise ValueError(f"policy must be 'auto' or one of {list(POLICIES)}, got {policy!r}")
        return policy

    def _make_backend(self, device: torch.device, dtype: torch.dtype,
                      rope: int) -> AttentionBackend:
        return get_backend(self._backend_request, device=device, dtype=dtype,
                           qk_head_dim=self.qk_nope_head_dim + rope, v_head_dim=self.v_head_dim,
                           qk_rope_head_dim=rope)

    def _backend_for(self, device: torch.device, dtype: torch.dtype,
                     rope: int) -> AttentionBackend:
        """The backend for inputs of this kind. A named backend is the only one (``ValueError``
        if it cannot run them); ``auto`` runs the construction pick wherever it can and auto's
        pick for each kind it cannot, so float32 after float64 is back on the first pick."""
        qk = self.qk_nope_head_dim + rope

        def reason(backend: AttentionBackend) -> str | None:
            return (backend.unsupported_reason(device, dtype, qk, self.v_head_dim)
                    or backend.head_split_reason(self.qk_nope_head_dim, rope))

        if self._backend_request != "auto":
            why = reason(self._backend)
            if why is not None:
                raise ValueError(f"backend {self._backend.name!r} cannot run {dtype} on "
                                 f"{device} with qk_head_dim={qk} (qk_rope_head_dim={rope} from "
                                 f"k_pe_new): {why}; use backend='auto' or 'math'")
            return self._backend
        key = (device, dtype, rope)
        if key not in self._auto_picks:
            default = self._auto_default
            self._auto_picks[key] = default if reason(default) is None else \
                self._make_backend(device, dtype, rope)
        return self._auto_picks[key]

    # -- the forward -----------------------------------------------------------------------
    def forward(self, q: torch.Tensor, kv_c_new: torch.Tensor, k_pe_new: torch.Tensor,
                kv_cache: torch.Tensor, block_table: torch.Tensor, device_plan: DevicePlan, *,
                return_lse: bool = False, out: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, context_source: ContextSource | None = None,
                validate: bool = False, kv_cache_scale: float | torch.Tensor | None = None,
                kv_cache_format: str | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention output of every new token over its context and the new tokens before it.

        Parameters
        ----------
        q : [T, H, qk_nope_head_dim + qk_rope_head_dim] (roped), contiguous
        kv_c_new : [T, kv_lora_rank]
        k_pe_new : [T, qk_rope_head_dim] (roped)
        kv_cache : [num_blocks, page_size, record]
            Records of q's dtype (``record = kv_lora_rank + qk_rope_head_dim``),
            ``float8_e4m3fn`` (with ``kv_cache_scale``) or ``uint8`` 656-byte records of
            ``kv_cache_format="fp8_ds_mla"``; see :mod:`mlaprefill.kvcache`. Rows are
            dequantized to q's dtype while they are gathered.
        block_table : int32 [num_reqs, max_blocks] on the cache's device
        device_plan : :class:`mlaprefill.staging.DevicePlan` of a ChunkPlan (or a DCP plan)
        return_lse : also return the LSE
        out : [T, H, v_head_dim] in q's dtype, contiguous, optional
            Written with the result (and returned). With ``graphs``, the arena's own buffers
            (:meth:`io_buffers`) cost no copy; any other tensor costs one device copy.
        lse : float32 [T, H] (float64 for float64 inputs), contiguous, optional
            Written with the LSE, as ``out``; implies ``return_lse``.
        context_source : callable ``(iteration, workspace) -> rows``, optional
            Supplies iteration ``i``'s latent rows ``[iteration_tokens[i], kv_lora_rank +
            qk_rope_head_dim]`` in workspace order (DCP all-gathers them); default: paged gather.
        validate : bool
            Also check what only device memory can tell, **synchronizing the host** (one D2H copy
            of the block table's used columns and of the DevicePlan's tensors): every block id a
            context reads is in ``[0, num_blocks)``, and the DevicePlan's device tensors still
            hold its plan (a ring slot is reused after ``valid_uploads`` later uploads). For
            debugging and first integration, not for the hot path. With a scale tensor, also
            that it holds a finite value > 0.
        kv_cache_scale : float or 1-element float32 tensor on the cache's device, optional
            The scale of a ``float8_e4m3fn`` cache (default 1.0): row = fp8 x scale. A tensor is
            read by the device only (never on the host).
        kv_cache_format : None or ``"fp8_ds_mla"``
            Names the byte layout of a ``uint8`` cache (never guessed from a shape).

        Returns
        -------
        out : [T, H, v_head_dim] in q's dtype; with ``return_lse`` (or ``lse``) also lse [T, H],
        natural log, float32 (float64 for float64 inputs); ``-inf`` only for a query with no
        keys at all. A NaN in a request's inputs gives NaN in that request's rows and never
        changes another request's rows.

        Raises
        ------
        TypeError
            A tensor argument that is not a tensor, ``device_plan`` that is not a
            :class:`~mlaprefill.staging.DevicePlan` (e.g. a host ``ChunkPlan``), a non-bool flag.
        ValueError
            Shapes, dtypes or devices that do not match each other, the weight or the plan; on
            CPU tensors (or with ``validate``) a block id outside ``[0, num_blocks)``.

        Never synchronizes unless ``validate=True``: shapes come from the plan's host ints only.
        With ``graphs`` it runs as CUDA-graph replays (see :mod:`mlaprefill.graphs`). Undefined:
        tensors modified while the forward runs, a DevicePlan used after its ring slot was reused
        (see ``validate``) or (with ``graphs``) whose tensors were written in place between
        forwards, block ids outside the cache on CUDA without ``validate`` (the gather writes NaN
        rows for them, so the request's output is NaN and other requests are unaffected).
        """
        rope, cache_spec = check_forward_inputs(
            q, kv_c_new, k_pe_new, kv_cache, block_table, device_plan, weight=self.weight,
            num_heads=self.num_heads, qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim, context_source=context_source, return_lse=return_lse,
            validate=validate, out=out, lse=lse, kv_cache_scale=kv_cache_scale,
            kv_cache_format=kv_cache_format)
        return_lse = return_lse or lse is not None
        plan = device_plan.chunk_plan
        device, dtype = q.device, q.dtype
        nope, h, rank = self.qk_nope_head_dim, self.num_heads, self.kv_lora_rank
        qk = nope + rope
        if rope > 1 and k_pe_new.stride(1) != 1:  # split-key kernels read rope rows densely
            k_pe_new = k_pe_new.contiguous()  # T x rope elements: one small device copy
        checked = (device, dtype, rope)
        if checked != self._checked:  # the backend's checks, once per input kind
            self._backend = self._backend_for(device, dtype, rope)
            self._checked = checked
        backend = self._backend
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(qk)
        lse_dtype = lse_dtype_for(dtype)

        num_tokens = plan.num_query_tokens
        if num_tokens == 0:
            out = q.new_zeros(0, h, self.v_head_dim) if out is None else out
            lse = torch.zeros(0, h, dtype=lse_dtype, device=device) if lse is None else lse
            return (out, lse) if return_lse else out

        if self.graphs is not None and context_source is None and backend.takes_split_keys:
            return forward_graphs(self, q, kv_c_new, k_pe_new, kv_cache, block_table,
                                  device_plan, rope, scale, lse_dtype, return_lse, out, lse,
                                  cache_spec)
        tensors = plan_tensors(plan, device_plan)
        cu_q = tensors["cu_query_lens"]
        # int64 [T], for backends that read it (computed once per step, not per iteration)
        seq_ids_q = seq_ids_from_cu(cu_q, num_tokens) if backend.needs_seq_ids else None
        v_padded = backend.needs_v_padded

        # (a) new tokens over themselves, causal: the running (out, lse).
        cu_q_host = plan.cu_query_lens
        new_seqs = VarlenSeqs(cu_q, cu_q, plan.max_query_len, plan.max_query_len,
                              seq_ids_q=seq_ids_q, cu_seqlens_q_host=cu_q_host,
                              cu_seqlens_k_host=cu_q_host)
        joined = backend.wants_joined_keys(new_seqs, h, True)
        k_new, v_new = self.upproj.project(
            kv_c_new, k_pe_new,
            torch.empty(self.upproj.kv_numel(num_tokens, qk, v_padded), dtype=dtype,
                        device=device), rope, joined=joined, v_padded=v_padded)
        split = {} if joined else {"k_rope": k_pe_new}  # joined-key backends take no k_rope
        if out is not None:  # the caller's buffer: the backend stores into it
            lse = torch.empty(num_tokens, h, dtype=lse_dtype, device=device) if lse is None \
                else lse
            backend.attend_and_store(q, k_new, v_new, new_seqs, out, lse, causal=True,
                                     softmax_scale=scale, **split)
        else:
            out_a, lse_a = backend.attend(q, k_new, v_new, new_seqs, causal=True,
                                          softmax_scale=scale, **split)
            out = out_a[..., :self.v_head_dim]
            if not out.is_contiguous():
                out = out.contiguous()  # merged in place below; must be our own dense buffer
            if lse is None:
                lse = lse_a.to(lse_dtype).contiguous()
            else:
                lse.copy_(lse_a)
        del k_new, v_new

        # (b) context, one workspace iteration at a time, merged into (out, lse).
        if plan.num_iterations == 0:
            return (out, lse) if return_lse else out
        max_rows = plan.max_iteration_tokens
        chunk_starts, cu_seq_lens = tensors["chunk_starts"], tensors["cu_seq_lens"]
        workspace = torch.empty(max_rows, rank + rope, dtype=dtype, device=device)
        kv_buf = torch.empty(self.upproj.kv_numel(max_rows, qk, v_padded), dtype=dtype,
                             device=device)
        # Prefix sharing: each iteration's attention has its own sequences (a shared run's
        # spans the queries of every request under it; mlaprefill.prefix); the gather is as ever.
        seq_q_dev = tensors.get("iteration_cu_query_lens")
        seq_k_dev = tensors.get("iteration_cu_seq_lens")
        for i in range(plan.num_iterations):
            num_rows = plan.iteration_tokens[i]
            if not num_rows:
                continue
            seq_q, seq_k, n, max_q_i = plan.iteration_sequences(i)
            if seq_q_dev is None:
                seqs_i = VarlenSeqs(cu_q, cu_seq_lens[i], max_q_i, plan.max_chunk_lens[i],
                                    seq_ids_q=seq_ids_q, cu_seqlens_q_host=seq_q,
                                    cu_seqlens_k_host=seq_k)
            else:
                cu_q_i = seq_q_dev[i, :n + 1]
                seqs_i = VarlenSeqs(
                    cu_q_i, seq_k_dev[i, :n + 1], max_q_i, plan.max_chunk_lens[i],
                    seq_ids_q=seq_ids_from_cu(cu_q_i, num_tokens) if backend.needs_seq_ids
                    else None, cu_seqlens_q_host=seq_q, cu_seqlens_k_host=seq_k)
            joined = backend.wants_joined_keys(seqs_i, h, False)
            if context_source is None:
                rows = gather_context_rows_with_spec(kv_cache, cache_spec, block_table,
                                                     cu_seq_lens[i], chunk_starts[i],
                                                     workspace, num_rows)
            else:
                rows = context_source(i, workspace)
                if tuple(rows.shape) != (num_rows, rank + rope):
                    raise ValueError(f"context_source({i}) returned shape {tuple(rows.shape)}, "
                                     f"expected ({num_rows}, {rank + rope})")
                if rows.stride(1) != 1:
                    rows = rows.contiguous()
            k_i, v_i = backend.project_context(self.upproj, rows[:, :rank], rows[:, rank:], kv_buf,
                                               seqs_i, joined=joined, v_padded=v_padded)
            backend.attend_and_merge(q, k_i, v_i, seqs_i, out, lse, causal=False,
                                          softmax_scale=scale,
                                          k_rope=None if joined else rows[:, rank:])
        return (out, lse) if return_lse else out

    __call__ = forward

    def io_buffers(self, num_tokens: int, *, dtype: torch.dtype | None = None,
                   device: torch.device | str | None = None,
                   qk_rope_head_dim: int | None = None) -> IOBuffers:
        """Buffers for a forward of ``num_tokens`` tokens that cost no copy: write the step's
        roped queries into ``.q`` (e.g. the q projection's ``torch.cat(..., out=)``) and call
        ``forward(io.q, ..., out=io.out, lse=io.lse)``.

        With ``graphs`` they are views of the graphs' static buffers (shared by every layer
        that shares the :class:`~mlaprefill.graphs.IterationGraphs`), so the forward neither
        copies q in nor ``(out, lse)`` out (at 4096 tokens of 16 heads in bf16 on the H200 those
        copies took 0.022 ms per forward, 0.16 ms at 128 heads). They hold one layer's data at a
        time: the next forward through the same graphs overwrites them, so queue their
        consumer (the output projection) before it, as a layer stack does, and ``clone()`` to
        keep a result. Should the buffers have grown since (a forward of more tokens), these
        are no longer theirs and the forward copies, correctly. Without ``graphs``: new
        tensors, which the forward reads and writes where they are.

        ``dtype`` / ``device`` default to the weight's; ``qk_rope_head_dim`` to the one given
        at construction (64 if none). Host-only: never synchronizes. Buffers larger than the
        device's (or the host's) memory are a ``ValueError`` before anything is allocated.
        """
        if (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                or not 0 <= num_tokens <= INT32_MAX):
            raise ValueError(f"num_tokens must be an int in [0, 2**31 - 1] (a plan's "
                             f"num_query_tokens), got {num_tokens!r}")
        rope = self._rope if check_rope_dim(qk_rope_head_dim) is None else qk_rope_head_dim
        dtype = self.weight.dtype if dtype is None else dtype
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        device = self.weight.device if device is None else parse_device(
            device, "io_buffers device")
        h, qk, v = self.num_heads, self.qk_nope_head_dim + rope, self.v_head_dim
        lse_dtype = lse_dtype_for(dtype)
        rows = num_tokens if self.graphs is None else row_bucket(num_tokens)
        _check_fits(rows * h * ((qk + v) * dtype.itemsize + lse_dtype.itemsize), device,
                    f"io_buffers(num_tokens={num_tokens:,}) ({num_tokens:,} x {h} heads x "
                    f"({qk} + {v}) dims of q and out, plus lse)")
        if self.graphs is None or lse_dtype != torch.float32:
            return IOBuffers(torch.empty(num_tokens, h, qk, dtype=dtype, device=device),
                             torch.empty(num_tokens, h, v, dtype=dtype, device=device),
                             torch.empty(num_tokens, h, dtype=lse_dtype, device=device))
        arena = layer_arena(self, {"tokens": row_bucket(num_tokens)}, device, dtype, rope)
        return IOBuffers(arena.q[:num_tokens], arena.out[:num_tokens], arena.lse[:num_tokens])


def _check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """``ValueError`` if ``nbytes`` exceed ``device``'s whole memory (host metadata only).

    A bound, not a promise: it turns sizes that can never fit (``io_buffers(2**31 - 1)``) into
    an error naming the argument instead of the allocator's ``RuntimeError``/``MemoryError``.
    """
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    elif device.type == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:  # meta allocates nothing; other devices: the allocator decides
        return
    if nbytes > total:
        raise ValueError(f"{what} needs {nbytes / 2**30:,.1f} GiB, more than the "
                         f"{total / 2**30:,.1f} GiB of {device}; lower num_tokens (one step's "
                         f"query tokens)")
