"""Prefix sharing: which leading context rows several requests of a step share (pure numpy).

With prefix caching, requests of one step often hold the same leading cache blocks (a system
prompt, few-shot examples, a document): the same block ids in the **host** block table. Token
``t`` of two requests is then the same physical cache row whenever both contexts reach ``t`` and
both tables hold the same block id at ``t // page_size``, so those rows can be gathered and
up-projected once and attended by the queries of every request that shares them.

What is shared, precisely. Sharing is found between *neighbours* in batch order: ``shared[r]``
(``r < num_reqs - 1``) is the number of leading context tokens requests ``r`` and ``r + 1``
have in common (``min(common leading blocks * page_size, context_lens[r],
context_lens[r + 1])``). The tokens a *run* of consecutive requests ``[a, b)`` all share are
then ``min(shared[a : b - 1])`` (equality is transitive). Requests that share but are not
neighbours are not deduplicated across the request between them (an engine that orders a
step's requests by prefix gets the most; vLLM's and SGLang's schedulers keep arrival order,
where requests of one system prompt are mostly neighbours anyway). Why consecutive only: the
queries of a run ``[a, b)`` are the contiguous range ``[cu_query_lens[a], cu_query_lens[b])``,
so a shared run is one dense rectangle of the existing varlen call, with no permutation of the
queries and no copy.

The runs form a tree (the Cartesian tree of ``shared``): a **node** is a run ``[first, end)`` of
requests with a token range ``[lo, hi)`` that exactly those requests share and no larger run
does; a leaf is one request's unshared tail. For every request the nodes that contain it tile
its context ``[0, context_lens[r])`` exactly once (property-tested). Nodes of one **depth**
(number of nodes that contain them) are disjoint runs, so their pieces can share one iteration:
:class:`mlaprefill.plan.ChunkPlanner` plans each depth as a batch of its own with its policy,
puts a node's pieces at slot ``first`` (that request's block table, from ``lo``) and runs the
iteration's attention over request runs: the node's sequence has the queries ``[cu_query_lens[
first], cu_query_lens[end])``, the requests between runs are keyless sequences.

Cost: one vectorized compare of neighbouring block-table rows over the pages both contexts use
(64 requests x 2,048 blocks: see ``benchmarks/prefix_sharing.py``), then O(num_reqs^2) boolean
array work for the tree (nothing per token or per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MIN_SAVED_ROWS", "SharedTree", "host_block_table", "neighbour_shared_tokens",
           "shared_tree"]

#: ``ChunkPlanner``'s default ``min_saved_rows``: a shared run that saves fewer gathered and
#: up-projected rows than this is not planned apart (each of its requests reads those rows on
#: its own). Why: a run planned apart can add an iteration (a depth of the tree), whose fixed
#: cost -- a gather, a GEMM and an attention launch, ~15 us on the H200 -- is about what 1,500
#: rows of gather + up-projection cost at 16 heads (~10 ns a row: 2.3 KB gathered, 8 KB of
#: K/V written, 4 MFLOP). An estimate from that cost model, not a measured optimum:
#: ``benchmarks/prefix_sharing.py --min-saved-rows`` times other values.
MIN_SAVED_ROWS = 2048


def host_block_table(block_table: Any) -> np.ndarray | None:
    """``block_table`` as a host int32 numpy view, or None when it is not in host memory.

    A torch tensor on any device other than the CPU gives None from its ``.device`` alone (its
    values are never read: that would synchronize with the GPU). numpy arrays and CPU tensors are
    viewed without a copy. Duck-typed: this module never imports torch.
    """
    if block_table is None:
        return None
    if type(block_table).__module__.startswith("torch"):
        if block_table.device.type != "cpu":
            return None
        return block_table.detach().numpy()
    return np.asarray(block_table)


def neighbour_shared_tokens(block_table: np.ndarray, context_lens: np.ndarray,
                            page_size: int) -> np.ndarray:
    """int64 [num_reqs - 1]: leading context tokens requests ``r`` and ``r + 1`` share.

    Parameters
    ----------
    block_table : int32 [num_reqs, max_blocks], host memory
    context_lens : int [num_reqs]
    page_size : int

    ``shared[r] = min(p * page_size, context_lens[r], context_lens[r + 1])`` with ``p`` the
    number of leading block ids the two rows have in common. Only the columns both contexts
    read are compared (one vectorized ``!=`` over ``[num_reqs - 1, pages]``).
    """
    ctx = np.asarray(context_lens, dtype=np.int64)
    if ctx.shape[0] < 2:
        return np.zeros(0, dtype=np.int64)
    both = np.minimum(ctx[:-1], ctx[1:])                     # [R - 1]
    pages = int(-(-int(both.max()) // page_size))
    if pages == 0:
        return np.zeros(ctx.shape[0] - 1, dtype=np.int64)
    cols = block_table[:, :pages]
    differ = cols[:-1] != cols[1:]                           # [R - 1, pages]
    # First differing column; a row without any difference shares all `pages` columns.
    first = np.where(differ.any(axis=1), differ.argmax(axis=1), pages).astype(np.int64)
    return np.minimum(first * page_size, both)


@dataclass(frozen=True, slots=True)
class SharedTree:
    """The shared runs of one batch (host numpy, every array int64 ``[num_nodes]``).

    Attributes
    ----------
    first, end : the run of requests ``[first, end)`` of each node (a leaf: ``end = first + 1``)
    lo, hi : the context tokens ``[lo, hi)`` of request ``first`` that the node stands for (the
        same rows for every request of the run), ``lo < hi``
    depth : how many other nodes contain the node's run; nodes of one depth are disjoint
    num_levels : int, ``max(depth) + 1`` (0 for no nodes)
    """

    first: np.ndarray
    end: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    depth: np.ndarray
    num_levels: int

    @property
    def num_nodes(self) -> int:
        return int(self.first.shape[0])

    @property
    def shares(self) -> bool:
        """Whether some node is a run of several requests."""
        return bool((self.end - self.first > 1).any())


def shared_tree(shared: np.ndarray, context_lens: np.ndarray, *,
                min_saved_rows: int = 0) -> SharedTree:
    """The runs of :func:`neighbour_shared_tokens`' ``shared [num_reqs - 1]`` as a tree.

    Internal nodes: for each pair ``i`` with ``shared[i] > 0``, the maximal run of pairs around
    ``i`` whose shared length is ``>= shared[i]`` (pairs ``[pl, pr]``, requests ``[pl, pr +
    2)``), holding tokens ``[max(shared[pl - 1], shared[pr + 1]), shared[i])`` (neighbours outside
    the array count 0); equal runs found from several pairs are one node. Leaves: each request's
    tail ``[max(shared[r - 1], shared[r]), context_lens[r])`` when not empty. Array work over
    ``[pairs, pairs]`` and ``[nodes, nodes]`` booleans; no Python loop.

    ``min_saved_rows``: a run whose sharing saves fewer gathered rows (``(members - 1) * (hi -
    lo)``) than this is not a node: its tokens go to the nearest node below it for each member
    (its child runs start lower, a member without one gets a leaf). Decided once, on the runs
    as found (a run whose parent is dropped is judged on its own tokens).
    """
    ctx = np.asarray(context_lens, dtype=np.int64)
    r = ctx.shape[0]
    s = np.asarray(shared, dtype=np.int64)
    padded = np.zeros(r + 1, dtype=np.int64)                 # shared with 0 on both sides
    padded[1:r] = s
    # Leaves: request r's tail past what it shares with either neighbour.
    leaf_lo = np.maximum(padded[:-1], padded[1:])            # [R]
    leaf = np.flatnonzero(ctx > leaf_lo)
    firsts, ends, los, his = [leaf], [leaf + 1], [leaf_lo[leaf]], [ctx[leaf]]
    pairs = np.flatnonzero(s > 0)
    if pairs.size:
        j = np.arange(s.shape[0])
        lower = s[None, :] < s[pairs, None]                  # [P, R - 1]: pair j below pair i
        left = np.where(lower & (j[None, :] < pairs[:, None]), j[None, :], -1).max(axis=1) + 1
        right = np.where(lower & (j[None, :] > pairs[:, None]), j[None, :],
                         s.shape[0]).min(axis=1) - 1
        # The run of pair i has min shared[i]: pairs of one run with equal values give it once.
        # (one key per run: np.unique of 1-D ints, much cheaper than of rows)
        keys, once = np.unique(left * s.shape[0] + right, return_index=True)
        pl, pr = keys // s.shape[0], keys % s.shape[0]       # [N] pair ranges
        firsts.append(pl)
        ends.append(pr + 2)
        los.append(np.maximum(padded[pl], padded[pr + 2]))  # shared[pl - 1], shared[pr + 1]
        his.append(s[pairs[once]])
    first = np.concatenate(firsts)
    end = np.concatenate(ends)
    lo = np.concatenate(los)
    hi = np.concatenate(his)
    if min_saved_rows > 0 and pairs.size:
        first, end, lo, hi = _drop_small_runs(first, end, lo, hi, ctx, min_saved_rows)
    # Depth: nodes whose run contains this node's (a laminar family: nested or disjoint).
    contains = (first[None, :] <= first[:, None]) & (end[:, None] <= end[None, :])
    depth = contains.sum(axis=1) - 1
    order = np.lexsort((first, depth))
    return SharedTree(first=first[order], end=end[order], lo=lo[order], hi=hi[order],
                      depth=depth[order], num_levels=int(depth.max()) + 1 if depth.size else 0)


def _drop_small_runs(first: np.ndarray, end: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                     ctx: np.ndarray, min_saved_rows: int) -> tuple[np.ndarray, ...]:
    """The nodes without the runs that save fewer than ``min_saved_rows`` rows, re-tiled: a
    kept run starts at the end of its nearest kept ancestor (its ``hi``: ancestors' ``hi`` grow
    with depth), every request's leaf at the end of its deepest kept run."""
    internal = end - first > 1
    keep = internal & ((end - first - 1) * (hi - lo) >= min_saved_rows)
    first, end, hi = first[keep], end[keep], hi[keep]
    # kept run j strictly contains run i (distinct runs of a laminar family)
    inside = ((first[None, :] <= first[:, None]) & (end[:, None] <= end[None, :])
              & ((first[None, :] != first[:, None]) | (end[None, :] != end[:, None])))
    lo = np.where(inside, hi[None, :], 0).max(axis=1, initial=0)
    reqs = np.arange(ctx.shape[0])
    covers = (first[None, :] <= reqs[:, None]) & (reqs[:, None] < end[None, :])  # [R, N]
    leaf_lo = np.where(covers, hi[None, :], 0).max(axis=1, initial=0)
    leaf = np.flatnonzero(ctx > leaf_lo)
    return (np.concatenate([leaf, first]), np.concatenate([leaf + 1, end]),
            np.concatenate([leaf_lo[leaf], lo]), np.concatenate([ctx[leaf], hi]))
