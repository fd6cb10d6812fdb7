"""A small prefill-only engine: scheduler + paged latent cache + MLA model, with overlapped steps.

One step::

    host:   schedule -> engine arrays + ChunkPlanner.plan -> StagingRing.upload(StepPlan)
            -> enqueue all layers (MLAChunkedPrefill, one DevicePlan shared by every layer)
            -> enqueue argmax of finishing requests + non_blocking D2H copy into a pinned slot
            -> record the step's end event
    device: runs the queue in order

The host never synchronizes per step. It keeps at most one step queued behind the one running:
after enqueuing step N it waits on the end event of step N-1 (so it plans and uploads step N+1 while
the device runs step N). Finished requests are observed by ``event.query()`` on those end events
and read from the pinned token buffer; ``event.synchronize()`` is called only for that
back-pressure, or when nothing can be scheduled until a request finishes. In ``pageable`` mode the
upload of step N+1 may block inside the copy until step N has finished: that is the bug measured.

Prefix caching (``EngineConfig.shared_prefix_len``, ``doc_groups``): every prompt starts with one
system prompt, some continue with one of a few documents, then a unique tail. Before each run
(untimed) the engine prefills the system prompt and each document once into pages of their own
(an earlier request's prefix cache); requests are admitted with those pages as the first entries
of their block table and prefill only the rest, so the steps' contexts share leading blocks and
the planner (``Variant.share_prefixes``) gathers and up-projects the shared rows once.
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mlaprefill.batch import PrefillBatch
from mlaprefill.bench.cache import KV_CACHE_DTYPES, BlockAllocator, PagedLatentCache
from mlaprefill.bench.metrics import RunResult, StepRecord
from mlaprefill.bench.model import BenchModel, model_dims
from mlaprefill.bench.scheduler import (
    SHARE_POLICIES,
    Request,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)
from mlaprefill.bench.step import StepPlan, build_engine_arrays
from mlaprefill.graphs import IterationGraphs
from mlaprefill.plan import POLICIES, ChunkPlanner
from mlaprefill.staging import MODES, HostEvent, StagingRing

__all__ = ["TABLES", "EngineConfig", "PrefillEngine", "ProgressFn", "Variant",
           "allocate_prefix_pages", "prefix_lens", "workload"]

# progress(variant, repeat, steps_done, requests_finished, num_requests)
ProgressFn = Callable[[str, int, int, int, int], None]


#: Step metadata layouts a variant can ship: ``compact`` (the plan's O(iterations x requests)
#: arrays; rows are mapped to requests on the device) or ``vllm`` (also vLLM's per-token
#: ``token_to_seq``, built on the host each step: 4 bytes per context token).
TABLES = ("compact", "vllm")


#: Suffix of a variant's backend that runs the fast path as an engine integrates it:
#: ``MLAChunkedPrefill(..., graphs=IterationGraphs())`` shared by the layers, and each layer's
#: q written into ``io_buffers(T).q`` and its output taken as ``out=io.out`` (no copies).
GRAPHS = "+graphs"


def graphs_base(backend: str) -> str:
    """``backend`` without the :data:`GRAPHS` suffix."""
    return backend.removesuffix(GRAPHS)


def backend_error(backend: str, field: str) -> str | None:
    """Why ``backend`` is not a bench backend name (``field`` names the option in the
    message), or None: ``auto`` or a backend, optionally with :data:`GRAPHS`."""
    from mlaprefill.backends import BACKENDS

    if graphs_base(backend) not in ("auto", *BACKENDS):
        return (f"{field} {backend!r} is unknown; choose one of {['auto', *BACKENDS]}, "
                f"optionally with {GRAPHS!r} (CUDA-graph replays with their own I/O buffers).")
    return None


class _GcClock:
    """Milliseconds Python's garbage collector ran while entered (``gc.callbacks``): says
    whether a slow step's host time was the collector's, not the code's."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)


@dataclass(frozen=True, slots=True)
class Variant:
    """One measured configuration: staging transfer mode, planner policy, metadata layout and
    (optionally) the attention backend, which otherwise is the engine's ``EngineConfig.backend``."""

    transfer: str
    policy: str
    tables: str = "compact"
    backend: str | None = None
    share_prefixes: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.transfer not in MODES:
            raise ValueError(f"Variant.transfer = {self.transfer!r}; choose one of {MODES}.")
        if self.policy not in POLICIES:
            raise ValueError(f"Variant.policy = {self.policy!r}; choose one of {POLICIES}.")
        if self.tables not in TABLES:
            raise ValueError(f"Variant.tables = {self.tables!r}; choose one of {TABLES}.")
        if self.backend is not None:
            why = backend_error(self.backend, "Variant.backend")
            if why is not None:
                raise ValueError(why)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Variant.kv_cache_dtype = {self.kv_cache_dtype!r}; choose one of "
                             f"{KV_CACHE_DTYPES}.")

    @property
    def name(self) -> str:
        base = f"{self.transfer}+{self.policy}"
        base = base if self.tables == "compact" else f"{base}+{self.tables}"
        base = base if self.share_prefixes else f"{base}+noshare"
        base = base if self.backend is None else f"{base}@{self.backend}"
        return base if self.kv_cache_dtype == "auto" else f"{base}:{self.kv_cache_dtype}"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``"ring+packed"`` -> Variant("ring", "packed"); ``"pageable+equal+vllm"`` ships
        vLLM-shaped per-token tables too; ``"ring+balanced@fa2"`` runs that attention backend;
        ``"ring+balanced@mlaprefill+graphs"`` runs it with CUDA graphs (one
        :class:`~mlaprefill.graphs.IterationGraphs` shared by the layers); ``+noshare`` plans
        without prefix sharing (``ChunkPlanner(share_prefixes=False)``); a ``:fp8`` or
        ``:fp8_ds_mla`` suffix keeps the latent cache in that format."""
        text, colon, kv = text.strip().partition(":")
        body, at, backend = text.partition("@")
        parts = body.split("+")
        share = parts[-1] != "noshare"
        if not share:
            parts.pop()
        if len(parts) not in (2, 3) or (at and not backend) or (colon and not kv):
            raise ValueError(f"variant {text!r} must look like TRANSFER+POLICY[+vllm][+noshare]"
                             f"[@BACKEND][:KV_CACHE_DTYPE], e.g. 'ring+packed', "
                             f"'pageable+equal+vllm' or 'ring+balanced@fa2:fp8' (transfer in "
                             f"{MODES}, policy in "
                             f"{POLICIES}; '+vllm' also ships vLLM's per-token token_to_seq; "
                             f"'+noshare' (last) plans without prefix sharing; "
                             f"@BACKEND picks the attention backend for this variant, "
                             f"@BACKEND+graphs also turns on its CUDA graphs; :KV_CACHE_DTYPE "
                             f"in {KV_CACHE_DTYPES}).")
        return cls(*parts, backend=backend or None, share_prefixes=share,
                   kv_cache_dtype=kv or "auto")

    def with_kv_cache_dtype(self, kv_cache_dtype: str) -> Variant:
        """This variant with its latent cache in ``kv_cache_dtype``."""
        return Variant(self.transfer, self.policy, self.tables, self.backend,
                       self.share_prefixes, kv_cache_dtype)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Workload, model and engine settings (see ``mlaprefill bench --help``).

    ``num_blocks=None`` sizes the cache for the ``max_concurrent`` longest prompts.
    ``request_rate`` is in requests/s (``inf``: all arrive at once; else Poisson arrivals with
    ``seed``). ``prompt_len_spread`` ``s`` draws prompt lengths uniformly from
    ``[prompt_len * (1 - s), prompt_len * (1 + s)]`` (0: all equal). Prefix caching: with
    ``shared_prefix_len > 0`` every prompt starts with that many system-prompt tokens, and with
    ``doc_groups = G > 0`` request ``r`` of group ``g = r * (G + 1) // num_requests`` (``g >= 1``;
    contiguous in arrival order, group 0 has none) continues with document ``g`` of ``doc_len``
    tokens; ``prompt_len`` (and its spread) is then the unique tail. Both lengths must be page
    multiples (prefix caching shares whole pages).
    """

    preset: str = "deepseek-v3"
    tp: int = 8
    num_layers: int = 4
    vocab_size: int = 4096
    prompt_len: int = 81920
    num_requests: int = 16
    request_rate: float = math.inf
    prompt_len_spread: float = 0.0
    max_concurrent: int = 16
    token_budget: int = 4096
    workspace_tokens: int = 65536
    page_size: int = 64
    share: str = "fcfs"
    num_blocks: int | None = None
    seed: int = 0
    shared_prefix_len: int = 0
    doc_groups: int = 0
    doc_len: int = 0
    backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("tp", "num_layers", "vocab_size", "prompt_len", "num_requests",
                     "max_concurrent", "token_budget", "workspace_tokens", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}.")
        if self.share not in SHARE_POLICIES:
            raise ValueError(f"EngineConfig.share = {self.share!r}; choose one of "
                             f"{SHARE_POLICIES}.")
        for name in ("shared_prefix_len", "doc_groups", "doc_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"EngineConfig.{name} must be an int >= 0, got {v!r}.")
        for name in ("shared_prefix_len", "doc_len"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"EngineConfig.{name} = {getattr(self, name)} must be a "
                                 f"multiple of page_size = {self.page_size} (prefix caching "
                                 f"shares whole pages).")
        if (self.doc_groups > 0) != (self.doc_len > 0):
            raise ValueError(f"EngineConfig.doc_groups = {self.doc_groups} and doc_len = "
                             f"{self.doc_len}: give both or neither.")
        if not self.request_rate > 0:
            raise ValueError(f"EngineConfig.request_rate must be > 0 (inf = all at once), got "
                             f"{self.request_rate!r}.")
        if not 0.0 <= self.prompt_len_spread < 1.0:
            raise ValueError(f"EngineConfig.prompt_len_spread must be in [0, 1), got "
                             f"{self.prompt_len_spread!r}.")
        if self.workspace_tokens < self.page_size:
            raise ValueError(f"EngineConfig.workspace_tokens={self.workspace_tokens} must be >= "
                             f"page_size={self.page_size}.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "float64"):
            raise ValueError(f"EngineConfig.dtype = {self.dtype!r}; choose auto, bfloat16, "
                             f"float16, float32 or float64.")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def workload(config: EngineConfig) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lengths (int64 [num_requests]) and arrival times (s, float64 [num_requests]).

    Deterministic in ``config.seed`` (its own generator, independent of the prompt tokens).
    """
    rng = np.random.default_rng([config.seed, 1])
    n, length, s = config.num_requests, config.prompt_len, config.prompt_len_spread
    prefix = prefix_lens(config)[1]
    if s > 0:
        lens = np.rint(rng.uniform(length * (1 - s), length * (1 + s), size=n)).astype(np.int64)
        lens = np.maximum(lens, 1)
    else:
        lens = np.full(n, length, dtype=np.int64)
    if math.isinf(config.request_rate):
        arrivals = np.zeros(n)
    else:
        gaps = rng.exponential(1.0 / config.request_rate, size=n)
        arrivals = np.cumsum(gaps) - gaps[0]
    return lens + prefix, arrivals


def allocate_prefix_pages(config: EngineConfig,
                          allocator: BlockAllocator) -> dict[int, np.ndarray]:
    """Pages of the cached prefixes, allocated from ``allocator`` (owners -1, -2, ...: never
    freed in a run): group -> int32 pages of its whole prefix, the system prompt's first."""
    ps = config.page_size
    sys_pages = allocator.allocate(-1, config.shared_prefix_len // ps)
    pages = {0: sys_pages}
    for g in range(1, config.doc_groups + 1):
        pages[g] = np.concatenate([sys_pages, allocator.allocate(-1 - g, config.doc_len // ps)])
    return pages


def prefix_lens(config: EngineConfig) -> tuple[np.ndarray, np.ndarray]:
    """Document group (0 = none) and cached prefix tokens of every request, int64
    [num_requests] each (zeros without prefix caching; see :class:`EngineConfig`)."""
    n = config.num_requests
    if config.doc_groups:
        group = np.arange(n, dtype=np.int64) * (config.doc_groups + 1) // n
    else:
        group = np.zeros(n, dtype=np.int64)
    return group, config.shared_prefix_len + config.doc_len * (group > 0)


def default_num_blocks(config: EngineConfig, prompt_lens: np.ndarray) -> int:
    """Cache pages for the ``max_concurrent`` longest prompts (or ``config.num_blocks``)."""
    if config.num_blocks is not None:
        return config.num_blocks
    need = -(-np.sort(prompt_lens)[::-1] // config.page_size)
    return int(need[:config.max_concurrent].sum())


@dataclass(slots=True)
class _InFlight:
    step: int
    event: Any
    slot: int
    finishing: np.ndarray  # request ids sampled in this step


@dataclass(slots=True)
class _RunState:
    scheduler: Scheduler
    pinned_tokens: torch.Tensor
    pending: deque = field(default_factory=deque)
    first_tokens: dict = field(default_factory=dict)
    finish_step: dict = field(default_factory=dict)
    wait_ms: float = 0.0
    # +graphs: captures the graph keys the forwards met for the first time, where the host
    # would otherwise block on an event (counted in wait_ms: it is that idle time)
    idle: Callable[[], int] | None = None


def _staging_counters(ring: StagingRing) -> dict[str, int]:
    st = ring.stats
    return {"uploads": st.uploads, "bytes": st.bytes, "arenas_grown": st.arenas_grown,
            "arenas_resized": st.arenas_resized, "stalls": st.stalls}


class PrefillEngine:
    """Builds the model and cache once; :meth:`run` measures one variant on the workload.

    Parameters
    ----------
    config : EngineConfig
    attention_factory : callable, optional
        ``factory(kv_b_proj_weight, qk_nope_head_dim=, v_head_dim=, backend=,
        qk_rope_head_dim=[, graphs=])`` returning an object with the
        ``MLAChunkedPrefill.forward`` signature (and its ``io_buffers`` for a ``+graphs``
        backend); defaults to :class:`mlaprefill.MLAChunkedPrefill`.
    """

    def __init__(self, config: EngineConfig, *,
                 attention_factory: Callable[..., Any] | None = None) -> None:
        self.config = cfg = config
        self.device = cfg.resolve_device()
        self.dtype = cfg.resolve_dtype(self.device)
        self.cuda = self.device.type == "cuda"
        self.dims = model_dims(cfg.preset, tp=cfg.tp, vocab_size=cfg.vocab_size)
        self.model = BenchModel(self.dims, cfg.num_layers, device=self.device, dtype=self.dtype,
                                seed=cfg.seed)
        if attention_factory is None:
            from mlaprefill.prefill import MLAChunkedPrefill
            attention_factory = MLAChunkedPrefill
        self._attention_factory = attention_factory
        # One set of attention layers per backend a variant asks for (weights shared); the
        # config's set is built now, so a backend that cannot run here fails at construction.
        self._attention: dict[str, list[Any]] = {}
        self.attention_layers(cfg.backend)
        self.prompt_lens, self.arrivals_s = workload(cfg)
        self.num_blocks = default_num_blocks(cfg, self.prompt_lens)
        # One page pool per cache format a variant asks for (block ids are the same in each);
        # the compute dtype's now.
        self._caches: dict[str, PagedLatentCache] = {}
        self.cache = self.latent_cache("auto")
        if self.cuda:
            self._prewarm_allocator()
        # One staging ring per transfer mode for the engine's lifetime, as a serving engine keeps
        # one: its arenas grow during the warm-up run and are reused by every measured run, so no
        # arena is re-allocated in the middle of a measurement.
        self._rings: dict[str, StagingRing] = {}
        self.prompt_offsets = np.zeros(cfg.num_requests + 1, dtype=np.int64)
        np.cumsum(self.prompt_lens, out=self.prompt_offsets[1:])
        rng = np.random.default_rng(cfg.seed)
        self.prompt_tokens = rng.integers(0, cfg.vocab_size, size=int(self.prompt_offsets[-1]),
                                          dtype=np.int32)
        # Prefix caching: request r's prompt starts with the system prompt and its document
        # (request 0's first tokens and the first request of its group's: one loop over requests)
        self.prefix_group, self.prefix_lens = prefix_lens(cfg)
        sys_len = cfg.shared_prefix_len
        for r in range(1, cfg.num_requests if sys_len or cfg.doc_groups else 0):
            start = int(self.prompt_offsets[r])
            self.prompt_tokens[start:start + sys_len] = self.prompt_tokens[:sys_len]
            g = int(self.prefix_group[r])
            first = int(np.argmax(self.prefix_group == g))
            if g and first != r:
                src = int(self.prompt_offsets[first]) + sys_len
                self.prompt_tokens[start + sys_len:start + sys_len + cfg.doc_len] = \
                    self.prompt_tokens[src:src + cfg.doc_len]

    def latent_cache(self, kv_cache_dtype: str) -> PagedLatentCache:
        """The engine's pages in ``kv_cache_dtype`` (made at first use, then kept)."""
        if kv_cache_dtype not in self._caches:
            cfg = self.config
            self._caches[kv_cache_dtype] = PagedLatentCache(
                num_layers=cfg.num_layers, num_blocks=self.num_blocks, page_size=cfg.page_size,
                latent_dim=self.dims.mla.latent_dim, device=self.device, dtype=self.dtype,
                kv_cache_dtype=kv_cache_dtype)
        return self._caches[kv_cache_dtype]

    def _prewarm_allocator(self) -> None:
        """Reserve the forward's largest per-iteration buffers once, then free them.

        Contexts grow every step, so without this each step asks the caching allocator for a
        slightly larger workspace than any cached block: a fresh ``cudaMalloc`` per step and, once
        memory fills up, a cache flush (``cudaFree`` synchronizes the device) in the middle of a
        run. One block of the maximal size up front is split for every later request instead.
        """
        cfg, m = self.config, self.dims.mla
        rows = min(cfg.workspace_tokens,
                   int(np.sort(self.prompt_lens)[::-1][:cfg.max_concurrent].sum()))
        # gathered latent rows + K (nope|rope) + V (padded to the QK width in the worst case)
        per_row = m.latent_dim + 2 * m.num_heads * m.qk_head_dim
        per_tok = 2 * m.num_heads * m.qk_head_dim + 4 * self.dims.hidden_size \
            + 3 * self.dims.intermediate_size
        nbytes = (rows * per_row + cfg.token_budget * per_tok) * self.model.embed.element_size()
        block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        del block

    def ring(self, transfer: str) -> StagingRing:
        """The engine's staging ring for ``transfer`` mode (created on first use, then kept)."""
        if transfer not in self._rings:
            self._rings[transfer] = StagingRing(self.device, mode=transfer)
        return self._rings[transfer]

    def attention_layers(self, backend: str | None = None) -> list[Any]:
        """The attention module of every layer for ``backend`` (default: the config's), built on
        first use and kept."""
        backend = self.config.backend if backend is None else backend
        if backend not in self._attention:
            m = self.dims.mla
            # +graphs: one IterationGraphs for the layers, so they share its static buffers
            base = graphs_base(backend)
            graphs = {} if base == backend else {"graphs": IterationGraphs()}
            self._attention[backend] = [
                self._attention_factory(w, qk_nope_head_dim=m.qk_nope_head_dim,
                                        v_head_dim=m.v_head_dim, backend=base,
                                        qk_rope_head_dim=m.qk_rope_head_dim, **graphs)
                for w in self.model.kv_b_proj]
        return self._attention[backend]

    def backend_name(self, backend: str | None = None) -> str:
        """The resolved attention backend a variant with ``backend`` runs (``auto`` resolved;
        ``+graphs`` where its graphs are on)."""
        layers = self.attention_layers(backend)
        name = str(getattr(layers[0], "backend_name", "unknown"))
        return name + (GRAPHS if self.uses_graphs(backend) else "")

    def uses_graphs(self, backend: str | None = None) -> bool:
        """Whether the layers of ``backend`` (default: the config's) run with graphs (and their
        I/O buffers)."""
        return getattr(self.attention_layers(backend)[0], "graphs", None) is not None

    def kernel_builds(self, backend: str | None = None) -> int | None:
        """Attention kernel builds so far in this process (graphs or compiles; see
        :meth:`mlaprefill.backends.AttentionBackend.builds`), None when the backend cannot tell."""
        be = getattr(self.attention_layers(backend)[0], "backend", None)
        return None if be is None else be.builds()

    def graph_counts(self, backend: str | None = None) -> tuple[int, int, float] | None:
        """(CUDA graphs captured, graph replays, host ms spent capturing) so far by the layers
        of ``backend`` (one :class:`~mlaprefill.graphs.IterationGraphs` for all of them), None
        without ``+graphs``."""
        graphs = getattr(self.attention_layers(backend)[0], "graphs", None)
        return None if graphs is None else (graphs.captures, graphs.replays,
                                            graphs.capture_seconds * 1e3)

    def prompt(self, req_id: int) -> np.ndarray:
        """Token ids of request ``req_id``'s prompt, int32 [prompt_len]."""
        return self.prompt_tokens[self.prompt_offsets[req_id]:self.prompt_offsets[req_id + 1]]

    def _event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.cuda else HostEvent()

    # ------------------------------------------------------------------ run

    def run(self, variant: Variant, *, repeat: int = 0, max_steps: int | None = None,
            deadline: float | None = None, progress: ProgressFn | None = None) -> RunResult:
        """Prefill every request of the workload once with ``variant``; returns the measurements.

        ``max_steps`` stops early (warm-up); ``deadline`` (a ``time.perf_counter()`` value) stops
        scheduling new steps once passed and marks the result ``truncated``. Synchronizes the
        device only before the first step and after the last one (plus the event waits
        described in the module docstring).
        """
        cfg = self.config
        if variant.policy == "equal" and cfg.workspace_tokens < cfg.max_concurrent * cfg.page_size:
            # equal gives each request with context floor(W / n) page-aligned tokens per chunk
            raise ValueError(
                f"policy 'equal' needs workspace_tokens >= max_concurrent x page_size = "
                f"{cfg.max_concurrent} x {cfg.page_size}, got {cfg.workspace_tokens}; raise "
                f"--workspace, lower --concurrency or use the packed policy.")
        with torch.inference_mode():
            return self._run(variant, repeat, max_steps, deadline, progress)

    def _run(self, variant: Variant, repeat: int, max_steps: int | None, deadline: float | None,
             progress: ProgressFn | None) -> RunResult:
        cfg = self.config
        scheduler = Scheduler(
            SchedulerConfig(token_budget=cfg.token_budget, max_concurrent=cfg.max_concurrent,
                            page_size=cfg.page_size, share=cfg.share),
            BlockAllocator(self.num_blocks))
        planner = ChunkPlanner(cfg.workspace_tokens, cfg.page_size, policy=variant.policy,
                               share_prefixes=variant.share_prefixes)
        ring = self.ring(variant.transfer)
        layers = self.attention_layers(variant.backend)
        cache = self.latent_cache(variant.kv_cache_dtype)
        prefix_pages = self._prefill_prefixes(scheduler.allocator, ring, layers, cache)
        for r in range(cfg.num_requests):
            pages = prefix_pages[int(self.prefix_group[r])]
            scheduler.add(Request(r, int(self.prompt_lens[r]),
                                  arrival_s=float(self.arrivals_s[r]),
                                  num_scheduled=int(self.prefix_lens[r]),
                                  prefix_blocks=pages if pages.size else None))
        base = _staging_counters(ring)
        builds_before = self.kernel_builds(variant.backend)
        graphs_before = self.graph_counts(variant.backend)
        iteration_graphs = getattr(layers[0], "graphs", None)
        static = iteration_graphs is not None
        # Pinned landing slots for sampled tokens: a slot is reused only after its step's event
        # was observed (at most 2 steps are in flight, so 4 slots never collide).
        state = _RunState(scheduler, torch.zeros((4, cfg.max_concurrent), dtype=torch.int32,
                                                 pin_memory=self.cuda))
        if iteration_graphs is not None and self.cuda:
            state.idle = iteration_graphs.capture_pending
        records: list[StepRecord] = []
        events: list[tuple[Any, Any]] = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        origin = self._event()
        origin.record()
        origin.synchronize()
        t0 = time.perf_counter()
        step_idx = 0
        truncated = False
        wait_mark = 0.0  # waits since the last record, including ones with nothing to schedule
        while scheduler.has_unfinished() and (max_steps is None or step_idx < max_steps):
            if deadline is not None and step_idx and time.perf_counter() > deadline:
                truncated = True
                break
            self._observe(state, block=False)
            now = time.perf_counter() - t0
            step = scheduler.schedule(now)
            if step is None:
                if state.pending:
                    self._observe(state, block=True)  # a request must finish first
                else:
                    nxt = scheduler.next_arrival_s()
                    until = nxt if nxt is not None else now
                    if deadline is not None:  # never sleep past it: the check above then stops
                        until = min(until, deadline - t0)
                    time.sleep(max(0.0, until - now))
                continue
            ta = time.perf_counter()
            arrays = build_engine_arrays(step, prompt_tokens=self.prompt_tokens,
                                         prompt_offsets=self.prompt_offsets,
                                         page_size=cfg.page_size)
            # the scheduler's host block table: the planner finds shared prefixes in it
            chunk_plan = planner.plan(PrefillBatch(step.query_lens, step.context_lens,
                                                   page_size=cfg.page_size,
                                                   block_table=step.block_table))
            if variant.tables == "vllm":  # built on the host each step, as vLLM does
                arrays["token_to_seq"] = np.ascontiguousarray(chunk_plan.token_to_seq)
            step_plan = StepPlan(chunk_plan, arrays)
            tb = time.perf_counter()
            dplan = ring.upload(step_plan)
            tc = time.perf_counter()
            start, end = self._event(), self._event()
            start.record()
            slot = step_idx % state.pinned_tokens.shape[0]
            warm0 = None if iteration_graphs is None else iteration_graphs.warm_runs
            forward_ms, forward_gc_ms = self._launch(
                dplan, int(arrays["sample_index"].shape[0]), state.pinned_tokens[slot], layers,
                cache, static)
            end.record()
            td = time.perf_counter()
            events.append((start, end))
            state.pending.append(_InFlight(step_idx, end, slot, step.req_ids[step.finishing]))
            while len(state.pending) > 1:  # keep one step queued behind the running one
                self._observe(state, block=True)
            records.append(StepRecord(
                num_reqs=step.num_reqs, num_tokens=step.num_tokens,
                num_context_tokens=int(step.context_lens.sum()),
                num_iterations=chunk_plan.num_iterations,
                num_gathered_rows=chunk_plan.num_gathered_rows,
                metadata_bytes=step_plan.nbytes, plan_bytes=step_plan.plan_nbytes,
                largest_array_bytes=step_plan.largest_array_nbytes,
                token_to_seq_bytes=int(arrays["token_to_seq"].nbytes)
                if "token_to_seq" in arrays else 0,
                host_prep_ms=(tb - ta) * 1e3, host_upload_ms=(tc - tb) * 1e3,
                host_launch_ms=(td - tc) * 1e3, host_wait_ms=state.wait_ms - wait_mark,
                host_forward_ms_per_layer=forward_ms / cfg.num_layers,
                host_forward_gc_ms=forward_gc_ms,
                graph_first_sights=None if warm0 is None
                else iteration_graphs.warm_runs - warm0))
            wait_mark = state.wait_ms
            step_idx += 1
            if progress is not None:
                progress(variant.name, repeat, step_idx, scheduler.num_finished,
                         cfg.num_requests)
        while state.pending:
            self._observe(state, block=True)
        wall_ms = (time.perf_counter() - t0) * 1e3
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for rec, (start, end) in zip(records, events, strict=True):
            rec.device_start_ms = origin.elapsed_time(start)
            rec.device_end_ms = origin.elapsed_time(end)
        finished = sorted(state.first_tokens)
        ttft = np.array([records[state.finish_step[r]].device_end_ms - self.arrivals_s[r] * 1e3
                         for r in finished], dtype=np.float64)
        # this run's share of the layers' graph counters (None without +graphs)
        graphs_run = (None,) * 3 if graphs_before is None else tuple(
            a - b for a, b in zip(self.graph_counts(variant.backend), graphs_before, strict=True))
        return RunResult(
            variant=variant.name, repeat=repeat, steps=records, ttft_ms=ttft,
            first_tokens=dict(state.first_tokens),
            prompt_tokens=int(sum(rec.num_tokens for rec in records)),
            duration_ms=records[-1].device_end_ms if records else math.nan, wall_ms=wall_ms,
            truncated=truncated,
            kernel_builds=None if builds_before is None
            else self.kernel_builds(variant.backend) - builds_before,
            graph_captures=graphs_run[0], graph_replays=graphs_run[1],
            graph_capture_ms=graphs_run[2],
            # this run's share of the engine ring's counters; pinned_bytes is the ring's total
            staging={**{k: v - base[k] for k, v in _staging_counters(ring).items()},
                     "pinned_bytes": ring.stats.pinned_bytes})

    def _prefill_prefixes(self, allocator: BlockAllocator, ring: StagingRing,
                          layers: list[Any], cache: PagedLatentCache) -> dict[int, np.ndarray]:
        """Prefill the system prompt and each document into pages of their own, in steps of at
        most ``token_budget`` tokens (untimed: the prefix cache earlier traffic left); returns
        group -> int32 pages of its whole prefix (group 0: the system prompt alone; empty
        without prefix caching). The pages are never freed in the run."""
        cfg, ps = self.config, self.config.page_size
        pages = allocate_prefix_pages(cfg, allocator)
        slot = torch.zeros(1, dtype=torch.int32)
        planner = ChunkPlanner(cfg.workspace_tokens, ps, share_prefixes=False)
        for g, table in pages.items():
            members = np.flatnonzero(self.prefix_group == g)
            if not members.size:
                continue
            done = 0 if g == 0 else cfg.shared_prefix_len  # the documents follow the prompt
            end = cfg.shared_prefix_len + (cfg.doc_len if g else 0)
            while done < end:
                n = min(cfg.token_budget, end - done)
                step = ScheduledStep(req_ids=members[:1], query_lens=np.array([n]),
                                     context_lens=np.array([done]), block_table=table[None],
                                     finishing=np.zeros(1, dtype=bool))
                arrays = build_engine_arrays(step, prompt_tokens=self.prompt_tokens,
                                             prompt_offsets=self.prompt_offsets, page_size=ps)
                plan = planner.plan(PrefillBatch(step.query_lens, step.context_lens,
                                                 page_size=ps))
                self._launch(ring.upload(StepPlan(plan, arrays)), 0, slot, layers, cache,
                             getattr(layers[0], "graphs", None) is not None)
                done += n
        graphs = getattr(layers[0], "graphs", None)
        if graphs is not None and self.cuda:  # their first sights' captures: untimed too
            graphs.capture_pending()
        return pages

    def _launch(self, dplan: Any, num_sampled: int, token_slot: torch.Tensor,
                attention: list[Any], cache: PagedLatentCache,
                static: bool = False) -> tuple[float, float]:
        """Enqueue one step's device work; never synchronizes. Returns the host time (ms) spent
        enqueuing the attention forwards of all layers, and how much of it was Python's garbage
        collector. ``static``: the model writes q into each layer's ``io_buffers(T).q`` and the
        forward writes its output into ``.out`` (with graphs: no copies, :data:`GRAPHS`)."""
        slot_mapping = dplan["slot_mapping"].to(torch.int64)  # index_copy_ wants int64
        block_table = dplan["block_table"]
        caches = cache.layers
        # only a quantized cache's keywords (an attention_factory's objects need not know them)
        cache_kwargs = {k: v for k, v in cache.forward_kwargs.items() if v is not None}
        forward_ms = gc_ms = 0.0
        clock = _GcClock()
        # layer -> its I/O buffers of this step (static only: an attention_factory's objects
        # need not know io_buffers)
        ios: dict[int, Any] = {}

        def attend(i: int, q: torch.Tensor, kv_c: torch.Tensor,
                   k_pe: torch.Tensor) -> torch.Tensor:
            nonlocal forward_ms, gc_ms
            # New latent rows go to the cache first; the forward reads only context rows
            # (positions < context_lens), so this write never races its own step's reads.
            cache.write(i, slot_mapping, torch.cat((kv_c, k_pe), dim=-1))
            gc0 = clock.ms
            t = time.perf_counter()
            io = ios.pop(i, None)
            out = attention[i].forward(q, kv_c, k_pe, caches[i], block_table, dplan,
                                       **cache_kwargs,
                                       **({} if io is None else {"out": io.out}))
            forward_ms += (time.perf_counter() - t) * 1e3
            gc_ms += clock.ms - gc0
            return out

        def query_buffer(i: int, num_tokens: int) -> torch.Tensor:
            io = ios[i] = attention[i].io_buffers(num_tokens)
            return io.q

        with clock:
            tokens = self.model.forward(dplan["token_ids"], dplan["positions"],
                                        dplan["sample_index"] if num_sampled else None, attend,
                                        query_buffer=query_buffer if static else None)
        if tokens is not None:
            token_slot[:num_sampled].copy_(tokens, non_blocking=True)
        return forward_ms, gc_ms

    def _observe(self, state: _RunState, *, block: bool) -> None:
        """Retire completed steps (``event.query()``); with ``block`` wait for the oldest one."""
        pending = state.pending
        if block and pending:
            t = time.perf_counter()
            if state.idle is not None and not pending[0].event.query():
                state.idle()
            pending[0].event.synchronize()
            state.wait_ms += (time.perf_counter() - t) * 1e3
        while pending and pending[0].event.query():
            done = pending.popleft()
            if done.finishing.size:
                tokens = state.pinned_tokens[done.slot, :done.finishing.size].numpy()
                for rid, tok in zip(done.finishing.tolist(), tokens.tolist(), strict=True):
                    state.first_tokens[rid] = tok
                    state.finish_step[rid] = done.step
                    state.scheduler.finish(rid)
