"""``hybrid`` backend: cuDNN on the large rectangles of long sequences, Triton on the rest.

cuDNN's fused attention is the fastest kernel on Hopper here (~600 TFLOP/s against ~440-460 for
our Triton kernel, H200, qk 192 / v 128) but it builds one graph per distinct shape (40-90 ms of
host time) and launches once per sequence (~0.1-0.2 ms of host time each). So this backend gives
cuDNN only what pays for that, with shapes from a small fixed grid, and exactly:

* For each sequence, the rectangle ``[0, Qf) x [0, Kf)`` of its queries x keys, where ``Qf`` and
  ``Kf`` are the lengths rounded *down* to :func:`bucket_floor`'s grid (``Qf`` a multiple of 256,
  ``Kf`` of 128; at most 1/8 resp. 1/16 of the length is left over). Rounding down needs no mask
  and no padding: the cuDNN call reads views of the sequence's own rows, so its result is exact
  and a NaN of another sequence can never reach it. Causal: ``Kf = Qf`` (top-left causal over
  the first ``Qf`` rows is exact for them).
* Only rectangles with ``Qf * Kf * H >= BIG_WORK`` (a cuDNN kernel of about a millisecond or
  more, so its host launch hides behind the device), at most
  :data:`~mlaprefill.kernels.attention.MAX_DENSE_BLOCKS` per call, the largest first.
* One Triton launch does everything else: every other sequence whole, and for a rectangle's
  sequence the rows ``>= Qf`` over all keys and the rows ``< Qf`` over keys ``>= Kf`` only
  (``dense=`` of :func:`~mlaprefill.kernels.attention.varlen_attention`). Each rectangle's
  ``(out, lse)`` is then merged into those rows by LSE (:func:`merge_attention_states`).

Graph cache: one cuDNN graph per (heads, Qf, Kf, causal, dtype, head dims); the grid bounds the
count (about 30 ``Qf`` values up to 16k queries x about 110 ``Kf`` values up to 128k keys, and
fewer pass ``BIG_WORK``). :meth:`HybridBackend.warmup` builds the graphs of given lengths ahead of
time; :meth:`HybridBackend.builds` counts them with the Triton compiles.

Without host offsets in :class:`VarlenSeqs` (``cu_seqlens_*_host``) it is the ``triton`` backend.
Never synchronizes: every decision is made from host ints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

from mlaprefill.backends.base import VarlenSeqs, flag_inf_lse_as_nan
from mlaprefill.backends.triton import TritonBackend
from mlaprefill.kernels.attention import MAX_DENSE_BLOCKS, num_compiled_kernels, varlen_attention
from mlaprefill.kernels.merge import merge_attention_states

__all__ = ["BIG_WORK", "HybridBackend", "bucket_floor", "dense_rectangles"]

#: A rectangle goes to cuDNN when ``Qf * Kf * heads`` reaches this (2^30: about 1.1 ms of cuDNN
#: at 600 TFLOP/s with qk 192 / v 128, against ~0.1-0.2 ms of host time per cuDNN launch).
BIG_WORK = 1 << 30
Q_ALIGN, Q_PER_OCTAVE = 256, 8     # Qf: a multiple of every default Triton block_m
K_ALIGN, K_PER_OCTAVE = 128, 16    # Kf: a multiple of every block_n

# (q, k, v, q0, k0, q_rows, k_rows, causal, scale) -> (out [q_rows, H, Dv], lse [q_rows, H])
DenseFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def bucket_floor(n: int, *, per_octave: int, align: int) -> int:
    """The largest grid value ``<= n``: a multiple of ``max(align, 2**floor(log2 n) /
    per_octave)`` (``per_octave`` a power of two), or 0 when ``n < align``.

    So at most ``1 / per_octave`` of ``n`` is left over, and an octave holds at most
    ``per_octave`` grid values.
    """
    if n < align:
        return 0
    step = max(align, (1 << (n.bit_length() - 1)) // per_octave)
    return n // step * step


def dense_rectangles(cu_q: Iterable[int], cu_k: Iterable[int], *, num_heads: int, causal: bool,
                     big_work: int = BIG_WORK) -> list[tuple[int, int, int]]:
    """``(seq, Qf, Kf)`` of the rectangles worth a cuDNN call, largest first, at most
    ``MAX_DENSE_BLOCKS`` (host ints in, host ints out; see the module docstring)."""
    cq, ck = [int(x) for x in cu_q], [int(x) for x in cu_k]
    found = []
    for s in range(len(cq) - 1):
        nq, nk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        qf = bucket_floor(nq, per_octave=Q_PER_OCTAVE, align=Q_ALIGN)
        kf = qf if causal else bucket_floor(nk, per_octave=K_PER_OCTAVE, align=K_ALIGN)
        if causal and nk != nq:
            continue  # causal is defined for equal lengths only; leave it to the kernel
        work = qf * kf * num_heads // (2 if causal else 1)
        if qf and kf and work >= big_work:
            found.append((work, s, qf, kf))
    found.sort(key=lambda t: -t[0])
    return [(s, qf, kf) for _, s, qf, kf in found[:MAX_DENSE_BLOCKS]]


def _rows_view(x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """``[1, H, rows, D]`` view of rows ``start:start+rows`` of a ``[T, H, D]`` tensor, its
    (size-1) batch stride fixed by the shape alone, so equal shapes give equal cuDNN graph keys."""
    _, h, d = x.shape
    return x.as_strided((1, h, rows, d), (rows * x.stride(0), x.stride(1), x.stride(0), 1),
                        x.storage_offset() + start * x.stride(0))


def cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int,
                q_rows: int, k_rows: int, causal: bool, scale: float,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN SDPA of queries ``q0:q0+q_rows`` over keys ``k0:k0+k_rows`` (views, no copies).

    Returns out ``[q_rows, H, Dv]`` and lse float32 ``[q_rows, H]`` (natural log), both views.
    """
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _rows_view(q, q0, q_rows), _rows_view(k, k0, k_rows), _rows_view(v, k0, k_rows), None,
        True, 0.0, causal, False, scale=scale)
    out = res[0][0].transpose(0, 1)                        # [q_rows, H, Dv]
    lse = res[1].reshape(q.shape[1], q_rows).t()           # [q_rows, H]
    return out, lse


def torch_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q0: int, k0: int,
                q_rows: int, k_rows: int, causal: bool, scale: float,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rectangle in float32/float64 torch (CPU runs and tests of the composition)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qq, kk = q[q0:q0 + q_rows].to(acc), k[k0:k0 + k_rows].to(acc)
    s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(q_rows, k_rows, dtype=torch.bool,
                                     device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                       # [H, q_rows]
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]),
                       v[k0:k0 + k_rows].to(acc))
    return out.to(q.dtype), lse.t().to(torch.float32)


class HybridBackend(TritonBackend):
    """cuDNN for the large rectangles of long sequences, Triton for the rest (see the module).

    Parameters
    ----------
    big_work : int
        Threshold of ``Qf * Kf * heads`` for a cuDNN call (default :data:`BIG_WORK`).
    """

    name = "hybrid"
    # The same process-wide reasoning as CudnnBackend: torch's graph cache outlives this object.
    _graph_keys: ClassVar[set[tuple]] = set()

    def __init__(self, *, big_work: int = BIG_WORK) -> None:
        super().__init__()
        self.big_work = big_work

    def unsupported_reason(self, device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> str | None:
        why = super().unsupported_reason(device, dtype, qk_head_dim, v_head_dim)
        if why is not None or device.type != "cuda":
            return why
        if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) \
                < 90000 or not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            return "needs cuDNN >= 9 attention (aten._scaled_dot_product_cudnn_attention)"
        if qk_head_dim % 8 or v_head_dim % 8:
            return f"cuDNN needs head dims that are multiples of 8, got {qk_head_dim}, {v_head_dim}"
        return None

    def builds(self) -> int | None:
        """Triton compiles plus the cuDNN graphs of the distinct rectangle shapes launched."""
        compiled = num_compiled_kernels()
        return None if compiled is None else compiled + len(self._graph_keys)

    def _dense_fn(self, device: torch.device) -> DenseFn:
        return cudnn_dense if device.type == "cuda" else torch_dense

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: VarlenSeqs, *,
               causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        cq, ck = seqs.cu_seqlens_q_host, seqs.cu_seqlens_k_host
        if cq is None or ck is None:
            return super().attend(q, k, v, seqs, causal=causal, softmax_scale=softmax_scale)
        rects = dense_rectangles(cq, ck, num_heads=q.shape[1], causal=causal,
                                 big_work=self.big_work)
        out, lse = varlen_attention(q, k, v, seqs.cu_seqlens_q, seqs.cu_seqlens_k,
                                    max_seqlen_q=seqs.max_seqlen_q, causal=causal,
                                    softmax_scale=softmax_scale, dense=tuple(rects))
        dense = self._dense_fn(q.device)
        for s, qf, kf in rects:
            q0, k0 = int(cq[s]), int(ck[s])
            self._graph_keys.add((q.shape[1], qf, kf, q.shape[2], v.shape[2], causal, q.dtype))
            d_out, d_lse = dense(q, k, v, q0, k0, qf, kf, causal, softmax_scale)
            flag_inf_lse_as_nan(d_out, d_lse)  # a NaN row never reads as "all the mass"
            merge_attention_states(out[q0:q0 + qf], lse[q0:q0 + qf], d_out, d_lse)
        return out, lse

    def warmup(self, lengths: Iterable[tuple[int, int, bool]], *, num_heads: int,
               qk_head_dim: int, v_head_dim: int, dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cuda") -> int:
        """Build the cuDNN graphs (and Triton kernels) that sequences of these ``(q_len, k_len,
        causal)`` lengths will use, before serving. Returns the number of builds it caused.

        Synchronizes (it runs each shape once on zero tensors); call it at start-up.
        """
        device = torch.device(device)
        before = self.builds() or 0
        for q_len, k_len, causal in lengths:
            q = torch.zeros(q_len, num_heads, qk_head_dim, dtype=dtype, device=device)
            k = torch.zeros(k_len, num_heads, qk_head_dim, dtype=dtype, device=device)
            v = torch.zeros(k_len, num_heads, v_head_dim, dtype=dtype, device=device)
            cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, k_len], dtype=torch.int32, device=device)
            self.attend(q, k, v, VarlenSeqs(cu_q, cu_k, q_len, k_len,
                                            cu_seqlens_q_host=[0, q_len],
                                            cu_seqlens_k_host=[0, k_len]),
                        causal=causal, softmax_scale=1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (self.builds() or 0) - before
