"""Token-interleaved layout of a context-parallel (DCP) paged cache: the index math (numpy only).

With ``world`` ranks and interleave ``I``, context token ``t`` of a request lives on rank
``(t // I) % world`` at local index ``(t // (I * world)) * I + t % I`` (vLLM's decode context
parallelism). Each rank holds its own paged cache and block table over its local tokens.

Pure numpy, so the DCP planner stays torch-free. The torch helpers that move cache rows
(``shard_paged_cache``, ``dcp_unshard_context``, ``context_rows``) live in
:mod:`mlaprefill.dcp.shard`.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "check_dcp_config",
    "dcp_global_token",
    "dcp_local_context_lens",
    "dcp_local_count",
    "dcp_token_location",
]

#: Most ranks a DCP group may have: the plan holds O(world x iterations x requests) ints, so a
#: world of 10**6 spent 10 s and one of 2**40 tried to allocate 8 TiB before any error.
MAX_DCP_WORLD = 4096
#: Most tokens per interleave unit (int32 token indices).
MAX_DCP_INTERLEAVE = 2**31 - 1


def check_dcp_config(world: int, interleave: int) -> None:
    """Raise ``ValueError`` unless ``world`` is an int in ``[1, MAX_DCP_WORLD]`` and
    ``interleave`` one in ``[1, MAX_DCP_INTERLEAVE]`` (checked before anything is sized)."""
    for name, value, most in (("world", world, MAX_DCP_WORLD),
                              ("dcp_interleave", interleave, MAX_DCP_INTERLEAVE)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
            raise ValueError(
                f"{name} must be a positive int, got {value!r}; pass e.g. {name}=1"
            )
        if value > most:
            raise ValueError(f"{name} = {value} is more than {most:,}; pass the size of the "
                             f"DCP process group (ranks that shard the context)")


def dcp_token_location(tokens: np.ndarray, *, world: int,
                       interleave: int) -> tuple[np.ndarray, np.ndarray]:
    """Map context-token indices to ``(rank, local_index)``.

    Parameters
    ----------
    tokens : int array of any shape, values >= 0
        Context-token indices within a request.

    Returns
    -------
    rank, local_index : np.int64 arrays, same shape as ``tokens``
        ``rank = (t // I) % world``, ``local_index = (t // (I * world)) * I + t % I``.
    """
    check_dcp_config(world, interleave)
    t = np.asarray(tokens, dtype=np.int64)
    rank = (t // interleave) % world
    local = (t // (interleave * world)) * interleave + t % interleave
    return rank, local


def dcp_global_token(rank: np.ndarray | int, local: np.ndarray, *, world: int,
                     interleave: int) -> np.ndarray:
    """Inverse of :func:`dcp_token_location`: global token of ``local`` on ``rank`` (np.int64)."""
    check_dcp_config(world, interleave)
    local = np.asarray(local, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    return (local // interleave) * (interleave * world) + rank * interleave + local % interleave


def dcp_local_count(x: np.ndarray, rank: np.ndarray | int, *, world: int,
                    interleave: int) -> np.ndarray:
    """Number of tokens ``t < x`` owned by ``rank`` (broadcasting, np.int64).

    The tokens a rank owns in any global range ``[s, e)`` have contiguous local indices
    ``[count(s), count(e))``, which is what makes per-rank chunk starts/lengths exact.
    """
    x = np.asarray(x, dtype=np.int64)
    rank = np.asarray(rank, dtype=np.int64)
    cycle = interleave * world
    rem = x % cycle
    # np.minimum/np.maximum: np.clip's Python wrapper costs more than the math at these sizes
    return (x // cycle) * interleave + np.minimum(np.maximum(rem - rank * interleave, 0),
                                                  interleave)


def dcp_local_context_lens(context_lens: np.ndarray, *, world: int,
                           interleave: int) -> np.ndarray:
    """Per-rank local context lengths, np.int64 ``[world, num_reqs]``."""
    check_dcp_config(world, interleave)
    lens = np.asarray(context_lens, dtype=np.int64)
    ranks = np.arange(world, dtype=np.int64)[:, None]
    return dcp_local_count(lens[None, :], ranks, world=world, interleave=interleave)
