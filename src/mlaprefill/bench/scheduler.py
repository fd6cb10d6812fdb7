"""Chunked-prefill scheduler of the bench engine (pure CPU, no torch).

Each step gets a budget of ``token_budget`` new tokens. Requests are admitted in arrival order
while fewer than ``max_concurrent`` are running and the cache has free pages for the whole prompt.
Running requests share the budget by one of two policies:

``fcfs`` (vLLM V1's default)
    In admission order, each running request takes ``min(remaining, budget_left)``; with 80k
    prompts and a 4096-token budget a step holds one or two requests.
``fair``
    The budget is split evenly over the running requests with prompt tokens left
    (``budget // n`` each, capped by what each has left); the rest of the budget is then handed
    out in admission order. Every step then carries the long contexts of all running requests,
    which is what makes the chunk metadata large (see the ``stall`` scenario in ``bench.cli``).

Prefix caching: a request may arrive with ``prefix_blocks``, cache pages that already hold its
first ``num_scheduled`` prompt tokens (a system prompt or document shared with other requests,
prefilled earlier). It is admitted with those pages first in its block table and allocates pages
only for the rest, so requests over one prefix hold the same leading block ids.

A request is *scheduled out* once its last prompt token is in a step; it keeps its pages and its
concurrency slot until :meth:`Scheduler.finish` is called (when the engine has observed its first
token), like a real engine that reads the sampled token before retiring the request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mlaprefill.bench.cache import BlockAllocator, blocks_needed

__all__ = ["SHARE_POLICIES", "Request", "ScheduledStep", "Scheduler", "SchedulerConfig"]

SHARE_POLICIES = ("fcfs", "fair")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler settings.

    Parameters
    ----------
    token_budget : int
        Most new tokens in one step (vLLM's ``max_num_batched_tokens``).
    max_concurrent : int
        Most requests running (admitted, not yet finished) at once.
    page_size : int
        Tokens per cache page.
    share : str
        ``"fcfs"`` or ``"fair"`` (see the module docstring).
    """

    token_budget: int = 4096
    max_concurrent: int = 16
    page_size: int = 64
    share: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_concurrent", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {v!r}.")
        if self.share not in SHARE_POLICIES:
            raise ValueError(f"SchedulerConfig.share = {self.share!r}; choose one of "
                             f"{SHARE_POLICIES}.")


@dataclass(slots=True)
class Request:
    """One prefill request (host bookkeeping only).

    ``num_scheduled`` counts prompt tokens already put into some step (or, at arrival, already
    in the cache: ``prefix_blocks``); the next step's context length for this request is exactly
    that number. ``prefix_blocks`` (int32, optional): shared cache pages holding the first
    ``num_scheduled`` tokens (a multiple of the page size), owned by nobody the scheduler frees.
    """

    req_id: int
    prompt_len: int
    arrival_s: float = 0.0
    num_scheduled: int = 0
    blocks: np.ndarray | None = field(default=None, repr=False)
    prefix_blocks: np.ndarray | None = field(default=None, repr=False)

    @property
    def remaining(self) -> int:
        """Prompt tokens not yet scheduled."""
        return self.prompt_len - self.num_scheduled


@dataclass(frozen=True, slots=True)
class ScheduledStep:
    """What one step computes (host data only).

    Attributes
    ----------
    req_ids : int64 [num_reqs]
    query_lens : int64 [num_reqs]
        New tokens per request this step (each >= 1).
    context_lens : int64 [num_reqs]
        Prompt tokens of each request already scheduled in earlier steps (= cached).
    block_table : int32 [num_reqs, max_blocks]
        Each request's pages, zero-padded.
    finishing : bool [num_reqs]
        Whether this step holds the request's last prompt token (its first token is sampled).
    """

    req_ids: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_table: np.ndarray
    finishing: np.ndarray

    @property
    def num_reqs(self) -> int:
        return int(self.req_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


class Scheduler:
    """Admits requests by free pages and splits each step's token budget (see module docstring).

    Parameters
    ----------
    config : SchedulerConfig
    allocator : BlockAllocator
        Pages of the cache; the scheduler allocates on admission and frees in :meth:`finish`.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order, includes scheduled-out ones
        self._requests: dict[int, Request] = {}
        self.num_finished = 0

    def add(self, request: Request) -> None:
        """Queue ``request`` (requests must be added in arrival order)."""
        need = blocks_needed(request.prompt_len, self.config.page_size)
        if request.prompt_len <= 0:
            raise ValueError(f"Request {request.req_id}: prompt_len must be >= 1, got "
                             f"{request.prompt_len}.")
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"Request {request.req_id}: a {request.prompt_len}-token prompt needs {need} "
                f"pages but the cache has only {self.allocator.num_blocks}; enlarge the cache "
                f"(--num-blocks) or shorten the prompt."
            )
        if request.req_id in self._requests:
            raise ValueError(f"Request id {request.req_id} was already added.")
        if self._waiting and request.arrival_s < self._waiting[-1].arrival_s:
            raise ValueError("Scheduler.add: requests must be added in arrival order.")
        self._requests[request.req_id] = request
        self._waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        """Whether some request is waiting or running (not yet finished)."""
        return bool(self._waiting or self._running)

    def next_arrival_s(self) -> float | None:
        """Arrival time of the oldest waiting request (None if none waits)."""
        return self._waiting[0].arrival_s if self._waiting else None

    def _admit(self, now_s: float) -> None:
        cfg = self.config
        while self._waiting and len(self._running) < cfg.max_concurrent:
            req = self._waiting[0]
            if req.arrival_s > now_s:
                break
            prefix = req.prefix_blocks
            num_prefix = 0 if prefix is None else int(prefix.shape[0])
            need = blocks_needed(req.prompt_len, cfg.page_size) - num_prefix
            if not self.allocator.can_allocate(need):
                break  # FCFS admission: never let a younger request overtake the head
            self._waiting.popleft()
            own = self.allocator.allocate(req.req_id, need)
            req.blocks = own if prefix is None else np.concatenate([prefix, own])
            self._running.append(req)

    def schedule(self, now_s: float = float("inf")) -> ScheduledStep | None:
        """Admit what fits and return the next step, or None if no running request has tokens.

        Parameters
        ----------
        now_s : float
            Current time in seconds on the arrival clock; requests arriving later wait.
        """
        self._admit(now_s)
        active = [r for r in self._running if r.remaining > 0]
        if not active:
            return None
        remaining = np.array([r.remaining for r in active], dtype=np.int64)
        budget = self.config.token_budget
        if self.config.share == "fair":
            base = np.minimum(remaining, budget // len(active))
        else:
            base = np.zeros_like(remaining)
        # Hand the rest of the budget out in admission order (all of it for fcfs).
        extra_want = remaining - base
        left = budget - int(base.sum())
        before = np.concatenate(([0], np.cumsum(extra_want)[:-1]))
        extra = np.clip(left - before, 0, extra_want)
        query_lens = base + extra
        keep = np.flatnonzero(query_lens > 0)
        chosen = [active[i] for i in keep]
        query_lens = query_lens[keep]
        context_lens = np.array([r.num_scheduled for r in chosen], dtype=np.int64)
        max_blocks = max(int(r.blocks.shape[0]) for r in chosen)
        block_table = np.zeros((len(chosen), max_blocks), dtype=np.int32)
        for i, r in enumerate(chosen):  # loop over requests (<= max_concurrent), not tokens
            block_table[i, : r.blocks.shape[0]] = r.blocks
            r.num_scheduled += int(query_lens[i])
        finishing = np.array([r.remaining == 0 for r in chosen], dtype=bool)
        return ScheduledStep(
            req_ids=np.array([r.req_id for r in chosen], dtype=np.int64),
            query_lens=query_lens,
            context_lens=context_lens,
            block_table=block_table,
            finishing=finishing,
        )

    def finish(self, req_id: int) -> None:
        """Retire a scheduled-out request: free its pages and its concurrency slot."""
        req = self._requests.get(req_id)
        if req is None or req not in self._running:
            raise ValueError(f"Scheduler.finish: request {req_id} is not running.")
        if req.remaining != 0:
            raise ValueError(f"Scheduler.finish: request {req_id} still has {req.remaining} "
                             f"prompt tokens to prefill.")
        self._running.remove(req)
        self.allocator.free(req_id)
        req.blocks = None
        self.num_finished += 1
