"""``mlaprefill`` backend: our own flash attention with LSE, one launch per call (the
warp-specialized Gluon kernel on Hopper, the Triton kernel elsewhere: :func:`~mlaprefill.kernels.
attention.varlen_attention` picks), reading MLA's shared rope key once per token and merging
into the running result in its epilogue; where the Hopper kernel does not run, cuDNN takes the
large rectangles of long sequences, where that wins (below).

cuDNN's fused attention is faster than our Triton kernel (~550-600 TFLOP/s against ~450-505,
H200, qk 192 / v 128) but it builds one graph per distinct shape (40-90 ms of
host time) and launches once per sequence (~0.1-0.2 ms of host time each). So this backend gives
cuDNN only what pays for that, with shapes from a small fixed grid, and exactly:

* For each sequence, the rectangle ``[0, Qf) x [0, Kf)`` of its queries x keys, where ``Qf`` and
  ``Kf`` are the lengths rounded *down* to :func:`bucket_floor`'s grid (``Qf`` a multiple of 256,
  ``Kf`` of 128; at most 1/8 resp. 1/16 of the length is left over). Rounding down needs no mask
  and no padding: the cuDNN call reads views of the sequence's own rows, so its result is exact
  and a NaN of another sequence can never reach it. Causal: ``Kf = Qf`` (top-left causal over
  the first ``Qf`` rows is exact for them).
* Consecutive sequences whose exact lengths are equal and on the grid form one rectangle of
  ``batch`` sequences: one batched cuDNN call (their rows are contiguous and every stride is a
  function of the grid shape).
* Tail (non-causal, one sequence off the query grid): a second cuDNN call over the sequence's
  last ``T`` queries x the same ``Kf`` keys, ``T`` the grid step at its length (a power of two
  >= 256, on the grid), merged for rows ``>= Qf`` only; the few rows both calls computed are
  dropped once. So every query row of the sequence sees keys ``[0, Kf)`` on cuDNN. Added where
  ``T * Kf * H >= BIG_WORK / 4``.
* Only rectangles with ``batch * Qf * Kf * H >= BIG_WORK`` (with a tail, the sequence's whole
  ``Lq * Kf * H``; about 0.3 ms of cuDNN or more, so its host launch hides behind the device),
  at most :data:`~mlaprefill.kernels.attention.MAX_DENSE_BLOCKS` per call, the largest first;
  and only when they hold at least :data:`MIN_QUERIES_PER_KEY` query-key pairs per key row of
  the call and head, since cuDNN needs each head's key whole (a batched up-projection GEMM
  ~10-20 % slower than the split one, and a rope copy) while our kernel reads split keys.
* One Triton launch does everything else: every other sequence whole, and for a rectangle's
  sequence the rows not in a cuDNN call over all keys and the others over keys ``>= Kf`` only
  (``dense=`` of :func:`~mlaprefill.kernels.attention.varlen_attention`), merging into the
  running ``(out, lse)`` in its epilogue where the caller has one (``attend_and_merge``). Each cuDNN
  call's ``(out, lse)`` is then merged into its rows by LSE (:func:`merge_attention_states`).

Graph cache: one cuDNN graph per (batch, heads, Qf or T, Kf, causal, dtype, head dims); the grid
bounds the count (about 30 ``Qf`` values up to 16k queries x about 110 ``Kf`` values up to 128k
keys per batch size, fewer above ``BIG_WORK``). :meth:`MLAPrefillBackend.warmup` builds the graphs
of given lengths ahead of time; :meth:`MLAPrefillBackend.builds` counts them with the Triton
compiles.

Where the warp-specialized Hopper kernel runs (:mod:`mlaprefill.kernels.hopper_attention`: an
sm_90 GPU with Gluon) and ``min_queries_per_key`` is left to its default, there are no rectangles:
that kernel reads split keys at 0.90-1.08x cuDNN's time, so joined keys (a slower up-projection
and a rope copy) no longer pay. Measured on the H200 in one run
(benchmarks/results/attention_vs_ideal_h200_hopper.json), whole forwards with iteration graphs
without rectangles against with them (then named ``triton+graphs`` and
``hybrid+graphs``): 0.83-1.00x the time
on 11 of 14 shapes (4 x 1024 over 128k at 128 heads 106.1 against 122.1 ms), 1.003-1.024x on the
other three, where no rectangle was taken either (the same launches); eager 0.43-1.10x.

Without host offsets in :class:`VarlenSeqs` (``cu_seqlens_*_host``) it is the ``triton`` backend.
Never synchronizes: every decision is made from host ints.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from mlaprefill.backends.base import VarlenSeqs
from mlaprefill.backends.cudnn import CudnnBackend, dense_cudnn_attention
from mlaprefill.backends.triton import TritonBackend
from mlaprefill.kernels import hopper_attention
from mlaprefill.kernels.attention import MAX_DENSE_BLOCKS, num_compiled_kernels, varlen_attention
from mlaprefill.kernels.merge import merge_attention_states

__all__ = ["BIG_WORK", "MANY_HEADS", "MIN_QUERIES_PER_KEY", "MIN_QUERIES_PER_KEY_FEW_HEADS",
           "MLAPrefillBackend", "Rectangle", "bucket_floor", "dense_rectangles"]

#: A rectangle goes to cuDNN when ``batch * Qf * Kf * heads`` reaches this (2^28: about 0.3 ms
#: of cuDNN at 600 TFLOP/s with qk 192 / v 128, against ~0.1-0.2 ms of host time per launch).
BIG_WORK = 1 << 28
#: ...and only when the rectangles hold at least this many query-key pairs per key row of the
#: call and head: cuDNN needs each head's key whole (``[Tk, H, 192]``), which cost the
#: up-projection GEMM 64 zero columns per head and a rope copy (~1.5e-10 s x H per key row on the
#: H200; with the batched GEMM of joined keys since 9b4d257, less), while it saves ~3.9e-13 s
#: per pair against our kernel (600 vs 440 TFLOP/s at 640 FLOP per pair): break-even near 372.
#: Measured on the H200 in a profiling call before this rule (the per-kernel breakdown of
#: benchmarks/forward_profile.py; that JSON was not kept): 16 requests x 256 queries (256 per
#: key) ran 1.86 ms with split keys on Triton against 1.98 ms with cuDNN at 16 heads, 15.0
#: against 16.0 ms at 128 heads; 4 x 1024 faster with cuDNN (29.7 against 33.1). Since then our
#: kernel's default config runs 450-505 TFLOP/s (triton_attention_split_h200.json), which moves
#: the modelled break-even to ~560; not re-measured per shape, so the value stays.
MIN_QUERIES_PER_KEY = 384
#: The same for context (non-causal) calls below ``MANY_HEADS`` heads, where the joined keys
#: weigh more against the attention they speed up. At 16 heads (H200, one batched cuDNN call
#: against our kernel on split keys, benchmarks/results/joined_keys_h200.json) cuDNN runs a 4 x
#: 1024 x 16k rectangle in 1.13 ms against 1.43, 8 x 256 x 8k in 0.30 against 0.39, while joined
#: keys cost the up-projection of 64k rows 0.53 ms against 0.44 (the batched GEMM and the rope
#: copy): a gain from about 1024 queries per key, none at 256. Whole forwards, this rule against
#: the earlier 2048 in one run (attention_vs_ideal_h200_bmm_ws{,_ab}.json, hybrid+graphs): 4 x
#: 1024 over 32k 3.90 against 4.07 ms, over 128k 14.45 against 15.19. Each rectangle costs
#: several launches and joined keys per iteration (~0.8 ms of host per iteration in ``uneven``).
MIN_QUERIES_PER_KEY_FEW_HEADS = 1024
MANY_HEADS = 64
#: Rectangle decisions the backend remembers (a forward asks about each of its context
#: iterations once before running them; a step has at most a few dozen).
_MEMO_SIZE = 256
Q_ALIGN, Q_PER_OCTAVE = 256, 8     # Qf: a multiple of every default Triton block_m
K_ALIGN, K_PER_OCTAVE = 128, 16    # Kf: a multiple of every block_n

# (q, k, v, q0, k0, batch, q_rows, k_rows, causal, scale) -> (out [B*q_rows, H, Dv], lse)
DenseFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def bucket_floor(n: int, *, per_octave: int, align: int) -> int:
    """The largest grid value ``<= n``: a multiple of ``max(align, 2**floor(log2 n) /
    per_octave)`` (``per_octave`` a power of two), or 0 when ``n < align``.

    So at most ``1 / per_octave`` of ``n`` is left over, and an octave holds at most
    ``per_octave`` grid values.
    """
    if isinstance(per_octave, bool) or not isinstance(per_octave, int) or per_octave < 1 \
            or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two >= 1, got {per_octave!r}")
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    return _floor(n, per_octave, align)


def _floor(n: int, per_octave: int, align: int) -> int:
    # bucket_floor without the argument checks (the hot path passes the module's constants)
    if n < align:
        return 0
    step = grid_step(n, per_octave=per_octave, align=align)
    return n // step * step


@dataclass(frozen=True, slots=True)
class Rectangle:
    """Queries ``[0, q_rows)`` x keys ``[0, k_rows)`` of each sequence in ``[seq_lo, seq_hi)``,
    left to cuDNN (host ints); with a tail, the rest of the sequence's queries too.

    A rectangle of several sequences (a batched cuDNN call) only groups consecutive sequences
    whose lengths are equal and on the grid (``q_rows``, ``k_rows`` exactly), so its rows are
    contiguous and every stride of the call is a function of the grid shape: the graph count
    stays bounded.

    Tail (one sequence, non-causal, ``q_len > q_rows``): a second cuDNN call over the sequence's
    last ``tail_rows`` queries (``tail_rows`` = the grid step at ``q_len``, a power of two on the
    grid and larger than ``q_len - q_rows``), of which only rows ``[q_rows, q_len)`` are merged:
    the overlap is computed twice and dropped once, so no query row is left to the slower Triton
    kernel over ``[0, k_rows)`` and the shape is still from the grid.
    """

    seq_lo: int
    seq_hi: int
    q_rows: int
    k_rows: int
    q_start: int   # first query row of sequence seq_lo in the packed q
    k_start: int   # its first key row in the packed k / v
    work: int      # query-key pairs x heads it takes from the Triton kernel (halved when causal)
    tail_rows: int = 0
    q_len: int = 0  # the sequence's query count (with a tail)

    @property
    def batch(self) -> int:
        return self.seq_hi - self.seq_lo

    @property
    def kernel_args(self) -> tuple[int, int, int, int]:
        """``(seq_lo, seq_hi, skipped rows, k_rows)``: the ``dense=`` entry of
        ``varlen_attention`` (with a tail every row of the sequence: ``q_len`` rounded up to
        ``Q_ALIGN``, which the kernel's blocks divide)."""
        rows = -(-self.q_len // Q_ALIGN) * Q_ALIGN if self.tail_rows else self.q_rows
        return (self.seq_lo, self.seq_hi, rows, self.k_rows)


def grid_step(n: int, *, per_octave: int, align: int) -> int:
    """The spacing of :func:`bucket_floor`'s grid at ``n`` (``n >= align``): a power of two
    (for ``align`` a power of two) on the grid, > ``n - bucket_floor(n)`` and <= ``n``."""
    return max(align, (1 << (n.bit_length() - 1)) // per_octave)


def _host_ints(values: Iterable[int]) -> list[int]:
    # numpy arrays (the plan's offsets) convert in one call: ~10x faster than int() per element
    tolist = getattr(values, "tolist", None)
    return [int(x) for x in (tolist() if tolist is not None else values)]


def dense_rectangles(cu_q: Iterable[int], cu_k: Iterable[int], *, num_heads: int, causal: bool,
                     big_work: int = BIG_WORK) -> list[Rectangle]:
    """The rectangles worth a cuDNN call, largest first, at most ``MAX_DENSE_BLOCKS`` (host ints
    in, host ints out; see the module docstring). A tail is added where it holds at least
    ``big_work / 4``."""
    cq, ck = _host_ints(cu_q), _host_ints(cu_k)
    num_seqs = len(cq) - 1
    found = []
    s = 0
    while s < num_seqs:
        nq, nk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        qf = _floor(nq, Q_PER_OCTAVE, Q_ALIGN)
        end = s + 1
        if not qf:
            s = end
            continue
        kf = qf if causal else _floor(nk, K_PER_OCTAVE, K_ALIGN)
        if not kf or (causal and nk != nq):
            s = end  # causal is defined for equal lengths only: left to the Triton kernel
            continue
        if (nq, nk) == (qf, kf):  # on the grid: batch the run of equal sequences after it
            while end < num_seqs and (cq[end + 1] - cq[end], ck[end + 1] - ck[end]) == (nq, nk):
                end += 1
        work = (end - s) * qf * kf * num_heads // (2 if causal else 1)
        tail = 0
        if not causal and nq > qf:
            step = grid_step(nq, per_octave=Q_PER_OCTAVE, align=Q_ALIGN)
            if step * kf * num_heads >= big_work // 4:
                tail, work = step, nq * kf * num_heads
        if work >= big_work:
            found.append(Rectangle(s, end, qf, kf, cq[s], ck[s], work, tail, nq if tail else 0))
        s = end
    found.sort(key=lambda r: -r.work)
    return found[:MAX_DENSE_BLOCKS]


def cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int, batch: int,
                q_rows: int, k_rows: int, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of ``q_rows`` x ``k_rows`` from rows ``q0`` / ``k0`` in one cuDNN call on
    views of q, k, v: out ``[batch * q_rows, H, Dv]``, lse ``[batch * q_rows, H]`` (see
    :func:`~mlaprefill.backends.cudnn.dense_cudnn_attention`)."""
    return dense_cudnn_attention(q, k, v, q0, k0, batch, q_rows, k_rows, causal=causal,
                                 softmax_scale=scale)


def torch_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int, batch: int,
                q_rows: int, k_rows: int, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in float32/float64 torch (CPU runs and tests of the composition)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for i in range(batch):
        qs, ks = q0 + i * q_rows, k0 + i * k_rows
        s = torch.einsum("qhd,khd->hqk", q[qs:qs + q_rows].to(acc),
                         k[ks:ks + k_rows].to(acc)) * scale
        if causal:
            s = s.masked_fill(torch.ones(q_rows, k_rows, dtype=torch.bool,
                                         device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                   # [H, q_rows]
        outs.append(torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]),
                                 v[ks:ks + k_rows].to(acc)))
        lses.append(lse.t())
    return torch.cat(outs).to(q.dtype), torch.cat(lses).to(torch.float32)


class MLAPrefillBackend(TritonBackend):
    """Our kernel, with cuDNN on the large rectangles of long sequences where that wins (see
    the module).

    Parameters
    ----------
    big_work : int
        Threshold of ``Qf * Kf * heads`` for a cuDNN call (default :data:`BIG_WORK`).
    min_queries_per_key : int, optional
        A call uses cuDNN only when its rectangles hold at least this many query-key pairs per
        key row and head (0: always). Default: :data:`MIN_QUERIES_PER_KEY`, and
        :data:`MIN_QUERIES_PER_KEY_FEW_HEADS` for non-causal (context) calls of fewer than
        :data:`MANY_HEADS` heads.
    """

    name = "mlaprefill"
    # balanced: with the 128-row default kernel config it led equal in every bench `uneven` run
    # on the H200 (one repeat each, 2026-12-01; bench_uneven_h200*.json): 210.8k / 209.0k,
    # 223.1k / 217.7k, 208.1k / 206.2k, 205.0k / 201.8k, 208.6k / 204.0k (beside GPU tests) tok/s,
    # with fewer iterations (1,846 against 2,375 a run). Before that config equal had led (194.9k /
    # 190.6k, 185.8k / 172.9k): its W / n chunks batch on-grid neighbours into one cuDNN call.
    preferred_policy = "balanced"
    # The same process-wide reasoning as CudnnBackend: torch's graph cache outlives this object.
    _graph_keys: ClassVar[set[tuple]] = set()

    def __init__(self, *, big_work: int = BIG_WORK,
                 min_queries_per_key: int | None = None) -> None:
        for name, value in (("big_work", big_work), ("min_queries_per_key", min_queries_per_key)):
            if name == "min_queries_per_key" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MLAPrefillBackend {name} must be an int >= 0, got {value!r}")
        super().__init__()
        self.big_work = big_work
        self.min_queries_per_key = min_queries_per_key
        # id(seqs) -> (seqs, num_heads, causal, rectangles): the forward asks about every
        # context iteration (wants_joined_keys) before it runs them (attend_and_merge)
        self._memo: dict[int, tuple] = {}

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        why = super().unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
        if why is not None or device.type != "cuda":
            return why
        # its rectangles run on the cudnn backend's kernel: the same requirements
        why = CudnnBackend().unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
        return None if why is None else f"its cuDNN part: {why}"

    def builds(self) -> int | None:
        """Triton compiles plus the cuDNN graphs of the distinct rectangle shapes launched."""
        compiled = num_compiled_kernels()
        return None if compiled is None else compiled + len(self._graph_keys)

    def _dense_fn(self, device: torch.device) -> DenseFn:
        return cudnn_dense if device.type == "cuda" else torch_dense

    def _rectangles(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> list[Rectangle]:
        memo = self._memo.get(id(seqs))
        if memo is not None and memo[0] is seqs and memo[1:3] == (num_heads, causal):
            return memo[3]  # asked by wants_joined_keys, then by attend: decide once
        cq, ck = seqs.cu_seqlens_q_host, seqs.cu_seqlens_k_host
        rects: list[Rectangle] = []
        floor = self.min_queries_per_key
        # The Hopper kernel reads split keys at cuDNN's speed: rectangles, which need joined
        # keys, no longer pay there (module docstring); an explicit floor still gets them.
        hopper = floor is None and self._hopper_runs(seqs)
        if floor is None:
            floor = (MIN_QUERIES_PER_KEY if num_heads >= MANY_HEADS or causal
                     else MIN_QUERIES_PER_KEY_FEW_HEADS)
        # Rectangles hold at most max_seqlen_q query rows per key row (a rectangle's work is at
        # most its sequence's q_len x k_len x heads), so below the floor none can pay: skip the
        # per-sequence search (~10 us of Python per call at 8 sequences).
        if (not hopper and cq is not None and ck is not None  # no host offsets: triton alone
                and not 0 < seqs.max_seqlen_q < floor):
            rects = dense_rectangles(cq, ck, num_heads=num_heads, causal=causal,
                                     big_work=self.big_work)
            num_keys = int(ck[-1]) - int(ck[0])
            if sum(r.work for r in rects) < floor * num_heads * num_keys:
                rects = []  # cuDNN would not pay for the joined keys it needs
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[id(seqs)] = (seqs, num_heads, causal, rects)  # keeps seqs: its id stays its own
        return rects

    @staticmethod
    def _hopper_runs(seqs: VarlenSeqs) -> bool:
        """Whether the Hopper kernel runs this call's device: the offsets' device, or for host
        offsets alone (the iteration graphs decide layouts before any tensor exists) the current
        CUDA device."""
        device = getattr(seqs.cu_seqlens_q, "device", None)
        if device is None:
            if not torch.cuda.is_available():
                return False
            device = torch.device("cuda")
        return hopper_attention.available(device)

    def wants_joined_keys(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> bool:
        # cuDNN needs whole keys; a call without rectangles is our kernel's alone.
        return bool(self._rectangles(seqs, num_heads, causal))

    def launch_key(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> tuple:
        # The rectangles: each cuDNN call's offsets and sizes, and the Triton kernel's dense=.
        return tuple(self._rectangles(seqs, num_heads, causal))

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
             state: tuple[torch.Tensor, torch.Tensor] | None, causal: bool,
             softmax_scale: float, k_rope: torch.Tensor | None,
             into: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        # With k_rope (split keys) no rectangle: cuDNN cannot read them (wants_joined_keys).
        # state: merged into; into: overwritten (attend_and_store).
        rects = [] if k_rope is not None else self._rectangles(seqs, q.shape[1], causal)
        out, lse = varlen_attention(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                    max_seqlen_q=seqs.max_seqlen_q, causal=causal,
                                    softmax_scale=softmax_scale, k_rope=k_rope, state=state,
                                    out=into, dense=tuple(r.kernel_args for r in rects))
        dense = self._dense_fn(q.device)
        graph = (q.shape[1], q.shape[2], v.shape[2], causal, q.dtype)
        for r in rects:
            self._graph_keys.add((r.batch, r.q_rows, r.k_rows, *graph))
            d_out, d_lse = dense(q, k, v, r.q_start, r.k_start, r.batch, r.q_rows, r.k_rows,
                                 causal, softmax_scale)
            # No flag_inf_lse_as_nan pass: the merge already turns a part's +inf LSE into NaN
            # (exp(inf - inf)), so a NaN row never reads as "all the mass".
            rows = slice(r.q_start, r.q_start + r.batch * r.q_rows)
            merge_attention_states(out[rows], lse[rows], d_out, d_lse)
            if r.tail_rows:  # the sequence's last tail_rows queries; rows >= q_rows are new
                t = r.tail_rows
                self._graph_keys.add((1, t, r.k_rows, *graph))
                t_out, t_lse = dense(q, k, v, r.q_start + r.q_len - t, r.k_start, 1, t,
                                     r.k_rows, False, softmax_scale)
                new = r.q_len - r.q_rows
                rows = slice(r.q_start + r.q_rows, r.q_start + r.q_len)
                merge_attention_states(out[rows], lse[rows], t_out[t - new:], t_lse[t - new:])
        return out, lse

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float, k_rope: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(q, k, v, seqs, None, causal, softmax_scale, k_rope)

    def attend_and_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
                         out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                         softmax_scale: float, k_rope: torch.Tensor | None = None) -> None:
        # The Triton part merges into (out, lse) in its epilogue (rows a rectangle covers whole
        # are not touched there); each rectangle is then merged into its rows.
        self._run(q, k, v, seqs, (out, lse), causal, softmax_scale, k_rope)

    def attend_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seqs: VarlenSeqs, out: torch.Tensor, lse: torch.Tensor, *,
                         causal: bool, softmax_scale: float,
                         k_rope: torch.Tensor | None = None) -> None:
        # The Triton part stores into (out, lse); rectangles are then merged into their rows.
        self._run(q, k, v, seqs, None, causal, softmax_scale, k_rope, (out, lse))

    def warmup(self, calls: Iterable[tuple[Sequence[int], Sequence[int], bool]], *,
               num_heads: int, qk_head_dim: int, v_head_dim: int,
               dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda") -> int:
        """Build the cuDNN graphs (and Triton kernels) of calls with these per-sequence lengths,
        ``(q_lens, k_lens, causal)`` each, before serving. Returns the builds it caused.

        Rectangles depend on the lengths only (and on neighbours with equal on-grid lengths,
        which batch), so a call with the same lengths later builds nothing. Synchronizes (it runs
        each call once on zero tensors): call it at start-up.
        """
        device = torch.device(device)
        before = self.builds() or 0
        for q_lens, k_lens, causal in calls:
            cq = [0, *itertools.accumulate(int(n) for n in q_lens)]
            ck = [0, *itertools.accumulate(int(n) for n in k_lens)]
            q = torch.zeros(cq[-1], num_heads, qk_head_dim, dtype=dtype, device=device)
            k = torch.zeros(ck[-1], num_heads, qk_head_dim, dtype=dtype, device=device)
            v = torch.zeros(ck[-1], num_heads, v_head_dim, dtype=dtype, device=device)
            seqs = VarlenSeqs(torch.tensor(cq, dtype=torch.int32, device=device),
                              torch.tensor(ck, dtype=torch.int32, device=device),
                              max(q_lens, default=0), max(k_lens, default=0),
                              cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
            self.attend(q, k, v, seqs, causal=causal, softmax_scale=1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (self.builds() or 0) - before
