"""PrefillBatch: the validated scheduler input of one prefill step (host data only).

Validation never reads device memory: a CUDA tensor passed where host integers are required is
rejected by looking at its ``.device`` before any value is touched, so constructing a batch can
never synchronize. ``block_table`` is only inspected for shape and dtype, so it may live anywhere
(the planner reads the values of a host one: prefix sharing, :mod:`mlaprefill.prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["INT32_MAX", "PrefillBatch"]

INT32_MAX = 2**31 - 1


def _is_torch_tensor(x: Any) -> bool:
    # Duck-typed so this module (and the planner) never has to import torch.
    return type(x).__module__.startswith("torch") and hasattr(x, "device") and hasattr(x, "dtype")


def _as_host_lengths(name: str, value: Any) -> np.ndarray:
    """Return ``value`` as a fresh read-only np.int64 [num_reqs] array, or raise naming ``name``."""
    if _is_torch_tensor(value):
        if value.device.type != "cpu":
            # Checked before touching any value: reading a CUDA tensor here would sync the host.
            raise ValueError(
                f"PrefillBatch.{name} is a tensor on {value.device}; host data is required "
                f"(reading it would synchronize with the GPU). Pass the scheduler's host ints or "
                f"a CPU tensor instead."
            )
        dt = value.dtype
        if dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool":
            raise ValueError(
                f"PrefillBatch.{name} has dtype {dt}; expected an integer dtype "
                f"(e.g. torch.int32 or torch.int64). Convert with .to(torch.int64)."
            )
        arr = value.detach().numpy()
        shares = True
    else:
        shares = isinstance(value, np.ndarray)
        if isinstance(value, list | tuple):
            # np.asarray([0, True]) is an int array: a bool among ints must be caught here.
            r = next((i for i, v in enumerate(value) if isinstance(v, bool | np.bool_)), None)
            if r is not None:
                raise ValueError(
                    f"PrefillBatch.{name}[{r}] is the bool {value[r]!r}; expected an int length. "
                    f"Pass ints, not floats/bools/objects."
                )
        try:
            arr = np.asarray(value)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ValueError(
                f"PrefillBatch.{name} could not be read as a 1-D sequence of ints ({exc}); "
                f"pass a list of ints, an integer numpy array or a CPU int tensor."
            ) from None
        if arr.dtype == object and arr.ndim == 1 and arr.size and all(
                type(v) is int for v in arr.tolist()):
            # Python ints in an object array (also those beyond 64 bits, which numpy keeps as
            # objects): too large ones are reported, the rest read as int64 (negatives are
            # reported below).
            values = arr.tolist()
            r = next((i for i, v in enumerate(values) if v > INT32_MAX), None)
            if r is not None:
                raise ValueError(_overflow_message(name, r, values[r]))
            r = next((i for i, v in enumerate(values) if v < -INT32_MAX), None)
            if r is not None:
                raise ValueError(f"PrefillBatch.{name}[{r}] = {values[r]} is negative; a length "
                                 f"counts tokens (>= 0)")
            arr = np.asarray(values, dtype=np.int64)
        # np.asarray([]) is float64: let it through to the empty-batch message
        if arr.dtype.kind not in "iu" and (arr.size or arr.dtype.kind != "f"):
                raise ValueError(
                    f"PrefillBatch.{name} has dtype {arr.dtype}; expected integers "
                    f"(got e.g. {arr.ravel()[:1].tolist()}). Pass ints, not floats/bools/objects."
                )
    if arr.ndim != 1:
        raise ValueError(
            f"PrefillBatch.{name} must be 1-D [num_reqs], got shape {tuple(arr.shape)}; "
            f"pass one length per request."
        )
    # Every length must fit int32 (kernels index tokens with int32) *before* anything is summed:
    # int64 sums wrap silently (4 x 2**62 sums to 0), and uint64 values wrap in astype(int64).
    if arr.size and int(arr.max()) > INT32_MAX:
        r = int(np.argmax(arr))
        raise ValueError(_overflow_message(name, r, int(arr[r])))
    # np.asarray of a list is already fresh; an array/tensor is copied so later changes to the
    # caller's data cannot change the batch.
    out = arr.astype(np.int64, copy=shares)
    out.flags.writeable = False
    return out


def _overflow_message(name: str, r: int, value: int) -> str:
    if value < 0:
        return (f"PrefillBatch.{name}[{r}] = {value} is negative; lengths count tokens and "
                f"must be >= 0.")
    fix = (f"split request {r}'s new tokens over several steps" if name == "query_lens" else
           "contexts beyond int32 tokens are not supported")
    return (f"PrefillBatch.{name}[{r}] = {value} overflows int32 (max {INT32_MAX}: kernels index "
            f"tokens with int32); {fix}.")


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Validated lengths of one prefill batch (host data only).

    Parameters
    ----------
    query_lens : sequence of int, np.ndarray or CPU int tensor, [num_reqs]
        New tokens per request (each >= 1).
    context_lens : sequence of int, np.ndarray or CPU int tensor, [num_reqs]
        Tokens already in the paged cache per request (each >= 0).
    page_size : int
        Tokens per cache page (block).
    block_table : int32 tensor/array [num_reqs, max_blocks], optional
        Here only its shape and dtype are read, so any device is accepted; it must have
        ``max_blocks * page_size >= context_lens[r]`` for every request. In host memory (numpy,
        a CPU tensor: the engine's CPU copy) the planner reads its values to find shared
        prefixes (``ChunkPlanner(share_prefixes=True)``, the default); it must then hold the
        same ids as the table the forward reads. A device tensor's values are never read.

    Raises
    ------
    ValueError
        Naming the field, the request index and the fix, for: an empty batch, mismatched lengths,
        negative lengths, a zero query length, non-int dtypes, CUDA tensors for the lengths, a
        block table of the wrong dtype/shape or too short, any length, total or
        ``context_lens + query_lens`` beyond int32 (checked before summing, so int64 sums never
        wrap), a ``page_size`` beyond int32.

    Notes
    -----
    Never synchronizes: a CUDA tensor is rejected from its ``.device`` before any value is read.
    """

    query_lens: np.ndarray
    context_lens: np.ndarray
    page_size: int = field(kw_only=True)
    block_table: Any = field(default=None, kw_only=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        ps = self.page_size
        if isinstance(ps, bool) or not isinstance(ps, int | np.integer) or ps <= 0:
            raise ValueError(
                f"PrefillBatch.page_size must be a positive int (tokens per cache page), "
                f"got {ps!r}."
            )
        if ps > INT32_MAX:
            raise ValueError(
                f"PrefillBatch.page_size = {ps} overflows int32 (max {INT32_MAX}); use the "
                f"cache's page size (tokens per page, e.g. 64)."
            )
        object.__setattr__(self, "page_size", int(ps))
        q = _as_host_lengths("query_lens", self.query_lens)
        c = _as_host_lengths("context_lens", self.context_lens)
        if q.shape[0] == 0:
            raise ValueError(
                "PrefillBatch is empty (query_lens has 0 requests); a prefill step needs at "
                "least one request. Skip the step instead of planning an empty batch."
            )
        if q.shape != c.shape:
            raise ValueError(
                f"PrefillBatch.query_lens has {q.shape[0]} requests but context_lens has "
                f"{c.shape[0]}; pass one query length and one context length per request."
            )
        # Few reductions on the happy path; the index of a bad value is searched only on error.
        if int(c.min()) < 0:
            r = int(np.flatnonzero(c < 0)[0])
            raise ValueError(
                f"PrefillBatch.context_lens[{r}] = {int(c[r])} is negative; context lengths "
                f"count cached tokens and must be >= 0."
            )
        if int(q.min()) <= 0:
            r = int(np.flatnonzero(q <= 0)[0])
            raise ValueError(
                f"PrefillBatch.query_lens[{r}] = {int(q[r])}; every request in a prefill batch "
                f"needs >= 1 new token. Drop request {r} from the batch (a request with no new "
                f"tokens has nothing to prefill)."
            )
        # Values are in [0, INT32_MAX] here, so these int64 sums cannot wrap (that would need
        # 2**32 requests); the totals are then checked against int32.
        q_total = int(q.sum())
        c_total = int(c.sum())
        for name, total in (("query_lens", q_total), ("context_lens", c_total)):
            if total > INT32_MAX:
                raise ValueError(
                    f"PrefillBatch.{name} sums to {total} tokens, which overflows int32 "
                    f"(max {INT32_MAX}); split the batch into smaller steps."
                )
        if q_total + c_total > INT32_MAX:  # else every context_len + query_len fits
            pos = c + q
            bad = np.flatnonzero(pos > INT32_MAX)
            if bad.size:
                r = int(bad[0])
                raise ValueError(
                    f"PrefillBatch request {r}: context_lens + query_lens = {int(pos[r])} "
                    f"overflows int32 positions (max {INT32_MAX}); shorten request {r}."
                )
        object.__setattr__(self, "query_lens", q)
        object.__setattr__(self, "context_lens", c)
        if self.block_table is not None:
            self._check_block_table()

    def _check_block_table(self) -> None:
        bt = self.block_table
        shape = getattr(bt, "shape", None)
        dtype = getattr(bt, "dtype", None)
        if shape is None or dtype is None:
            raise ValueError(
                f"PrefillBatch.block_table must be an int32 tensor/array [num_reqs, max_blocks], "
                f"got {type(bt).__name__}."
            )
        if str(dtype) not in ("torch.int32", "int32"):
            raise ValueError(
                f"PrefillBatch.block_table has dtype {dtype}; expected int32. "
                f"Convert it once with .to(torch.int32) (kernels index pages with int32)."
            )
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or shape[0] != self.num_reqs:
            raise ValueError(
                f"PrefillBatch.block_table has shape {shape}; expected "
                f"[num_reqs={self.num_reqs}, max_blocks]. Pass one row of page ids per request."
            )
        capacity = shape[1] * self.page_size
        bad = np.flatnonzero(self.context_lens > capacity)
        if bad.size:
            r = int(bad[0])
            need = -(-int(self.context_lens[r]) // self.page_size)
            raise ValueError(
                f"PrefillBatch.block_table is too short for request {r}: context_lens[{r}] = "
                f"{int(self.context_lens[r])} needs {need} pages of page_size={self.page_size}, "
                f"but block_table has max_blocks={shape[1]}. Widen block_table to >= {need} "
                f"columns."
            )

    @property
    def num_reqs(self) -> int:
        """Number of requests."""
        return int(self.query_lens.shape[0])

    @property
    def num_query_tokens(self) -> int:
        """Total new tokens, ``sum(query_lens)``."""
        return int(self.query_lens.sum())

    @property
    def num_context_tokens(self) -> int:
        """Total cached context tokens, ``sum(context_lens)``."""
        return int(self.context_lens.sum())

    @property
    def max_query_len(self) -> int:
        """Longest new-token run of any request."""
        return int(self.query_lens.max())

    @property
    def max_context_len(self) -> int:
        """Longest context of any request (0 if none has context)."""
        return int(self.context_lens.max())

    @property
    def cu_query_lens(self) -> np.ndarray:
        """np.int64 [num_reqs + 1]: exclusive prefix sum of ``query_lens`` (starts at 0)."""
        out = np.zeros(self.num_reqs + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=out[1:])
        return out
