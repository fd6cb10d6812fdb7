"""What an attention backend is, and the helpers every backend shares.

A backend computes, for a packed varlen batch of ``num_seqs`` sequences,

    out[t, h] = softmax(q[t, h] . k[s, h]^T * softmax_scale) . v[s, h]

over the keys ``s`` of the query's own sequence (``cu_seqlens_k``), optionally causal (only used
with equal query/key lengths per sequence, where top-left and bottom-right alignment agree),
returning ``out [Tq, H, Dv]`` and ``lse [Tq, H]`` (natural log, float32; float64 for float64
inputs). A query whose sequence has no keys gets ``lse = -inf`` and ``out = 0`` (never NaN).

NaN: a NaN (or inf) in a sequence's ``q``, ``k`` or ``v`` gives NaN in that sequence's rows
(output and/or LSE, as plain softmax attention would) and never changes another sequence's rows.
Kernels that mix sequences in one tile (FlexAttention's document mask, the ``math`` backend's
dense matmul) multiply masked probabilities (0) by other sequences' values, and ``0 * NaN`` is
NaN: they use :func:`isolate_nonfinite_values`.

``max_seqlen_q`` / ``max_seqlen_k`` are host ints (from the plan): a backend never reads device
memory to decide a shape, so ``attend`` never synchronizes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

__all__ = [
    "AttentionBackend",
    "fix_empty_rows",
    "flag_inf_lse_as_nan",
    "isolate_nonfinite_values",
    "seq_ids_from_cu",
]

if TYPE_CHECKING:
    from mlaprefill.weights import UpProjection


def seq_ids_from_cu(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """int64 [total]: sequence index of each packed token, from int32 ``cu_seqlens [n + 1]``.

    ``output_size`` is the host int ``total`` so repeat_interleave does not sync.
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lens.shape[0], device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lens, output_size=total)


def fix_empty_rows(out: torch.Tensor, lse: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   seq_ids_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Force ``out = 0, lse = -inf`` (in place) for queries whose sequence has no keys, and
    ``out = lse = NaN`` for queries with keys whose LSE came back ``+inf``.

    Kernels disagree on the empty case (FlashAttention-2 writes ``lse = +inf``; others may leave
    NaN or garbage), so backends normalize it here, on device, without a sync. FlashAttention-2
    also writes ``+inf`` for a row whose softmax sum is NaN (a NaN in q or k) or 0; finite inputs
    never give ``+inf``, so such a row with keys is reported as NaN, not as a huge weight.
    """
    flag_inf_lse_as_nan(out, lse)
    k_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    empty = (k_lens == 0)[seq_ids_q]  # [Tq]
    lse.masked_fill_(empty[:, None], float("-inf"))
    out.masked_fill_(empty[:, None, None], 0.0)
    return out, lse


def flag_inf_lse_as_nan(out: torch.Tensor, lse: torch.Tensor) -> None:
    """Set ``out`` and ``lse`` to NaN (in place) where ``lse == +inf``.

    Kernels report a row whose softmax sum is NaN (a NaN in q or k) or 0 as ``lse = +inf``
    (FlashAttention-2 does); finite inputs never give ``+inf``, and merged as a weight it would
    be read as "all the mass". Device ops only, never synchronizes.
    """
    flagged = lse == float("inf")  # [Tq, H]
    lse.masked_fill_(flagged, float("nan"))
    out.masked_fill_(flagged[..., None], float("nan"))


def isolate_nonfinite_values(v: torch.Tensor, seq_ids_k: torch.Tensor, seq_ids_q: torch.Tensor,
                             num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a non-finite value of one sequence out of every other sequence's output.

    Parameters
    ----------
    v : [Tk, H, Dv]
    seq_ids_k : int64 [Tk], sequence of each key; seq_ids_q : int64 [Tq], of each query
    num_seqs : int, host int

    Returns
    -------
    v_clean : [Tk, H, Dv], ``v`` with non-finite entries set to 0 (a copy)
    poisoned : bool [Tq, H], True where the query's own sequence has a non-finite value in that
        head: the caller sets those rows' output and LSE to NaN after the kernel.

    Per (sequence, head), so a NaN value also poisons queries that a causal mask hides it from
    (as the float64 reference's ``softmax @ v`` does). Device ops only: never synchronizes.
    Costs one read of ``v`` and one write of the copy.
    """
    bad = ~torch.isfinite(v)                       # [Tk, H, Dv]
    v_clean = v.masked_fill(bad, 0)
    bad_rows = bad.any(dim=-1).to(torch.int32)     # [Tk, H]
    per_seq = torch.zeros(num_seqs, v.shape[1], dtype=torch.int32, device=v.device)
    per_seq.index_add_(0, seq_ids_k, bad_rows)     # [num_seqs, H]: non-finite values per head
    return v_clean, (per_seq > 0)[seq_ids_q]       # [Tq, H]


@dataclass(frozen=True, slots=True)
class VarlenSeqs:
    """How one attention call's packed queries and keys split into sequences.

    Attributes
    ----------
    cu_seqlens_q, cu_seqlens_k : int32 [num_seqs + 1], on the tensors' device
    max_seqlen_q, max_seqlen_k : int
        Host ints, upper bounds of the per-sequence lengths (never read from the device).
    seq_ids_q : int64 [Tq], optional
        Sequence of each query (saves recomputing it).
    cu_seqlens_q_host, cu_seqlens_k_host : host int arrays [num_seqs + 1], optional
        The same offsets as host ints (the plan has them). Backends that launch one kernel per
        sequence (``cudnn``) use them; without them they fall back to a ragged kernel.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seq_ids_q: torch.Tensor | None = None
    cu_seqlens_q_host: Any = None
    cu_seqlens_k_host: Any = None

    def unpack(self) -> tuple[Any, ...]:
        """The fields in declaration order (no copies)."""
        return (self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k,
                self.seq_ids_q, self.cu_seqlens_q_host, self.cu_seqlens_k_host)


class AttentionBackend(abc.ABC):
    """Varlen attention with LSE. Subclasses set ``name`` and implement ``attend``."""

    name: str = "?"
    #: Kernel needs ``v_head_dim == qk_head_dim`` (FlashAttention-2): callers may pass V already
    #: zero-padded to the QK width (the forward does, through its weight layout, for free) and
    #: slice the output; otherwise ``attend`` pads (a copy).
    needs_v_padded: bool = False
    #: Planner policy that suits the kernel (what ``policy="auto"`` picks). ``packed`` (fewest
    #: iterations, so fewest launches) for backends that launch once per sequence; ``balanced``
    #: for one-launch ragged kernels without split-KV, where a request alone in an iteration
    #: leaves SMs idle (DESIGN.md section 2; benchmarks/results/attention_h200.json "policies").
    preferred_policy: str = "packed"
    #: ``attend`` reads ``seqs.seq_ids_q`` (else it would compute it per call): the forward then
    #: computes it once per step. Kernels that read ``cu_seqlens`` on the device do not need it.
    needs_seq_ids: bool = True
    #: Some calls run on split keys (``k_rope``; :meth:`wants_joined_keys` False), through our
    #: own kernels, which a CUDA graph captures: ``MLAChunkedPrefill(graphs=IterationGraphs())``
    #: replays context iterations for such backends only (``mlaprefill``, its joined-key
    #: iterations too, keyed by :meth:`launch_key`).
    takes_split_keys: bool = False

    def head_split_reason(self, qk_nope_head_dim: int, qk_rope_head_dim: int) -> str | None:
        """None if the backend runs this split of ``qk_head_dim`` into MLA's nope and rope parts,
        else a short reason naming the dim. Backends that take the key joined run any split."""
        return None

    @abc.abstractmethod
    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        """None if the backend runs these inputs, else a short reason (for errors and ``auto``)."""

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of a packed varlen batch.

        Parameters
        ----------
        q : [Tq, H, Dqk]; k : [Tk, H, Dqk]; v : [Tk, H, Dv] — contiguous, one device and dtype
        seqs : :class:`VarlenSeqs`
            The packing of queries and keys into sequences.
        causal : query i of a sequence attends keys 0..i (equal q/k lengths per sequence)
        softmax_scale : float

        Returns
        -------
        out : [Tq, H, Dv] in q's dtype (may be a view); lse : [Tq, H] float32 natural log (may be
        a strided view). Never synchronizes.
        """

    def wants_joined_keys(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> bool:
        """Whether ``attend`` needs each head's key as one ``[Tk, H, qk_head_dim]`` tensor for
        this call (host ints only). ``False``: the caller may pass the key's first part ``k
        [Tk, H, nope]`` and MLA's rope key apart as ``k_rope [Tk, rope]`` (one row shared by
        every head), which saves the up-projection its batched GEMM (one plain GEMM instead) and
        the copy of the rope key into every head. Default: joined keys (every kernel but our
        own needs them)."""
        return True

    def launch_key(self, seqs: VarlenSeqs, num_heads: int, causal: bool) -> tuple:
        """What, besides the tensors' shapes and the grid's host ints (``max_seqlen_q``, the
        sequence count), a call's launches depend on: host values a CUDA graph of the call
        records. ``MLAChunkedPrefill``'s iteration graphs put it in their key. Default: nothing
        (one launch whose arguments are the shapes)."""
        return ()

    def project_context(self, upproj: UpProjection, kv_c: torch.Tensor, k_pe: torch.Tensor,
                        buf: torch.Tensor, seqs: VarlenSeqs, *, joined: bool,
                        v_padded: bool) -> tuple[Any, Any]:
        """One context iteration's keys and values from its latent rows ``kv_c [n, rank]``,
        ``k_pe [n, rope]``, in the form this backend's :meth:`attend_and_merge` /
        :meth:`attend_and_store` take for ``seqs`` (a non-causal call). The default is the
        up-projection's ``(k, v)`` in the compute dtype, written into ``buf``
        (:meth:`mlaprefill.weights.UpProjection.project`); ``mlaprefill-fp8`` returns its
        e4m3 keys and values instead, written by the GEMM's epilogue."""
        return upproj.project(kv_c, k_pe, buf, k_pe.shape[1], joined=joined, v_padded=v_padded)

    def context_writes_buffer(self, seqs: VarlenSeqs, *, joined: bool) -> bool:
        """Whether :meth:`project_context` for a call with these host offsets (``max_seqlen_q``
        as the forward passes it) writes its keys and values into the caller's ``buf`` (host
        ints only): graph arenas size their compute-dtype key/value buffer by the calls that
        do. The default's always do; ``mlaprefill-fp8``'s FP8 calls do not."""
        return True

    def attend_and_merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs,
                         out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                         softmax_scale: float, k_rope: torch.Tensor | None = None) -> None:
        """Merge this call's attention into the running ``out [Tq, H, Dv]`` and float32 ``lse
        [Tq, H]`` in place, by LSE (:func:`mlaprefill.kernels.merge.merge_attention_states`).

        The default runs :meth:`attend` and a merge pass; kernels that merge in their epilogue
        override it. ``k_rope``: see :meth:`wants_joined_keys` (only where that said False).
        """
        from mlaprefill.kernels.merge import merge_attention_states

        part_out, part_lse = self._attend_joined(q, k, v, seqs, causal, softmax_scale, k_rope)
        merge_attention_states(out, lse, part_out[..., :out.shape[2]], part_lse)

    def attend_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         seqs: VarlenSeqs, out: torch.Tensor, lse: torch.Tensor, *,
                         causal: bool, softmax_scale: float,
                         k_rope: torch.Tensor | None = None) -> None:
        """:meth:`attend`, its result written into ``out [Tq, H, Dv]`` and float32 ``lse [Tq,
        H]`` (overwritten, not merged; rows of no sequence hold anything afterwards): a caller's
        static buffers, e.g. a CUDA graph's.

        The default runs :meth:`attend` and copies; kernels that can write to given tensors
        override it (no copy). ``k_rope``: see :meth:`wants_joined_keys`.
        """
        part_out, part_lse = self._attend_joined(q, k, v, seqs, causal, softmax_scale, k_rope)
        out.copy_(part_out[..., :out.shape[2]])
        lse.copy_(part_lse)

    def _attend_joined(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       seqs: VarlenSeqs, causal: bool, softmax_scale: float,
                       k_rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend` for the defaults of :meth:`attend_and_merge` /
        :meth:`attend_and_store`, which take joined keys only."""
        if k_rope is not None:
            raise ValueError(f"backend {self.name!r} needs joined keys (wants_joined_keys is "
                             f"True): pass k [Tk, H, qk_head_dim] and no k_rope")
        return self.attend(q, k, v, seqs, causal=causal, softmax_scale=softmax_scale)

    def builds(self) -> int | None:
        """Kernel builds this backend has caused in this process so far: cuDNN graphs built for
        new shapes, Triton kernels compiled; 0 for precompiled kernels; None when unknown.

        An engine reads it before and after a run: after a warm-up run, a serving engine wants
        0 new builds (each costs tens of milliseconds of host time in the middle of a step).
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def pad_v(v: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last dim of ``v`` to ``width`` (a copy; the forward avoids it)."""
    if v.shape[-1] == width:
        return v
    return torch.nn.functional.pad(v, (0, width - v.shape[-1]))


def lse_to_tokens_heads(lse: torch.Tensor, num_tokens: int, num_heads: int,
                        seq_ids_q: torch.Tensor | None, cu_seqlens_q: torch.Tensor
                        ) -> torch.Tensor:
    """Bring a kernel's LSE to ``[Tq, H]`` (a view where possible), deciding by shape only.

    Accepted layouts: ``[Tq, H]``, ``[Tq, H, 1]`` (cuDNN ragged), ``[H, Tq]`` (unpadded FA2),
    ``[num_seqs, H, max_seqlen_q]`` (padded FA2).
    """
    shape = tuple(lse.shape)
    if shape == (num_tokens, num_heads):
        return lse
    if shape == (num_tokens, num_heads, 1):
        return lse[..., 0]
    if shape == (num_heads, num_tokens):
        return lse.t()
    if lse.dim() == 3 and shape[1] == num_heads:
        if seq_ids_q is None:
            seq_ids_q = seq_ids_from_cu(cu_seqlens_q, num_tokens)
        pos = torch.arange(num_tokens, device=lse.device) - cu_seqlens_q.long()[seq_ids_q]
        return lse[seq_ids_q, :, pos]
    raise RuntimeError(f"unexpected LSE shape {shape} for Tq={num_tokens}, H={num_heads}")
