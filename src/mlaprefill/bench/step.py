"""StepPlan: everything one engine step ships to the device, as one staging upload.

The engine's own per-step metadata (token ids, positions, slot mapping, block table, sampled rows)
goes through the same :class:`mlaprefill.staging.StagingRing` upload as the chunk plan, so the
``pageable`` variant is the pre-fix behaviour for *every* host-to-device copy of a step and the
``ring`` variant is one pinned copy for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlaprefill.bench.scheduler import ScheduledStep
from mlaprefill.plan import ChunkPlan

__all__ = ["ENGINE_ARRAYS", "StepPlan", "build_engine_arrays"]

# Names of the engine arrays appended to the chunk plan's device arrays (all int32). A step may
# also carry vLLM's per-token ``token_to_seq`` (the ``+vllm`` bench variants' baseline layout).
ENGINE_ARRAYS = ("token_ids", "positions", "slot_mapping", "sample_index", "block_table")
_PLAN_EXTRAS = ("token_to_seq",)


def build_engine_arrays(step: ScheduledStep, *, prompt_tokens: np.ndarray,
                        prompt_offsets: np.ndarray, page_size: int) -> dict[str, np.ndarray]:
    """Per-token device inputs of ``step`` (vectorized, no loop over tokens).

    Parameters
    ----------
    step : ScheduledStep
    prompt_tokens : int32 [sum of all prompt lengths]
        All prompts concatenated in request-id order.
    prompt_offsets : int64 [num_requests + 1]
        Where request ``r``'s prompt starts in ``prompt_tokens``.
    page_size : int

    Returns
    -------
    dict name -> int32 array
        ``token_ids [T]``, ``positions [T]`` (position of each new token in its prompt),
        ``slot_mapping [T]`` (flat cache slot ``page * page_size + row``), ``sample_index [S]``
        (packed row of the last prompt token of each finishing request) and
        ``block_table [num_reqs, max_blocks]``.
    """
    q = step.query_lens
    T = int(q.sum())
    cu = np.zeros(q.shape[0] + 1, dtype=np.int64)
    np.cumsum(q, out=cu[1:])
    req_of_token = np.repeat(np.arange(q.shape[0]), q)  # [T]
    positions = np.arange(T, dtype=np.int64) - cu[req_of_token] + step.context_lens[req_of_token]
    pages = step.block_table[req_of_token, positions // page_size].astype(np.int64)
    slot_mapping = pages * page_size + positions % page_size
    token_ids = prompt_tokens[prompt_offsets[step.req_ids[req_of_token]] + positions]
    sample_index = cu[1:][step.finishing] - 1
    return {
        "token_ids": token_ids.astype(np.int32),
        "positions": positions.astype(np.int32),
        "slot_mapping": slot_mapping.astype(np.int32),
        "sample_index": sample_index.astype(np.int32),
        "block_table": np.ascontiguousarray(step.block_table, dtype=np.int32),
    }


@dataclass(frozen=True, slots=True)
class StepPlan:
    """A :class:`ChunkPlan` plus the engine's arrays of the same step (host data only).

    ``engine_arrays`` holds :data:`ENGINE_ARRAYS` and, for the vLLM-shaped baseline, the chunk
    plan's ``token_to_seq`` (built by the caller, so its host cost lands in the step's prep
    time). A :class:`~mlaprefill.plan.StagedPlan`: the forward reads its host ints from
    ``chunk_plan``.
    """

    chunk_plan: ChunkPlan
    engine_arrays: dict[str, np.ndarray]

    def device_arrays(self, *, token_tables: bool = False) -> dict[str, np.ndarray]:
        """Chunk plan arrays, then ``token_to_seq`` if given (in ``engine_arrays``, or built now
        with ``token_tables=True``), then :data:`ENGINE_ARRAYS`."""
        out = dict(self.chunk_plan.device_arrays(
            token_tables=token_tables and "token_to_seq" not in self.engine_arrays))
        for name in (*_PLAN_EXTRAS, *ENGINE_ARRAYS):
            if name in self.engine_arrays:
                out[name] = self.engine_arrays[name]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes shipped to the device by this step."""
        return sum(int(a.nbytes) for a in self.device_arrays().values())

    @property
    def plan_nbytes(self) -> int:
        """Bytes of chunk-plan metadata in this step (the plan's arrays + per-token tables)."""
        return (sum(int(a.nbytes) for a in self.chunk_plan.device_arrays().values())
                + sum(int(self.engine_arrays[n].nbytes) for n in _PLAN_EXTRAS
                      if n in self.engine_arrays))

    @property
    def largest_array_nbytes(self) -> int:
        """The largest single array (what one pageable copy of ``pageable`` mode moves)."""
        return max(int(a.nbytes) for a in self.device_arrays().values())
