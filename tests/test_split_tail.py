"""The Hopper kernel's split last round (``hopper_attention._split_plan``, pure host arithmetic)
and the merge of the split tiles' parts (``_merge_tail``, in Triton's interpreter:
tests/interpreter/test_interp_split_merge.py, in its own process). The kernel itself runs only
on an sm_90 GPU: tests/test_attention_gpu.py."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_interpreter_tests
from mlaprefill.kernels import hopper_attention as ha


def _busiest(n_tiles: int, programs: int, n_main: int, n_split: int, blocks: float) -> float:
    """The model's cost, in tiles, of the busiest program of a plan."""
    fixed = ha._UNIT_COST_BLOCKS / max(blocks, 1.0)
    whole = math.ceil(n_main / programs) * (1 + fixed) if n_main else 0.0
    units = (n_tiles - n_main) * n_split
    return whole + math.ceil(units / programs) * (1 / n_split + fixed)


def test_split_plan_on_the_vs_ideal_context_parts():
    """4096 tiles on 132 SMs (31 rounds and 4 tiles) over 1024 key blocks: the 4 tiles in 33
    parts, one unit per program; 512 tiles (3 rounds and 116) stay whole (splitting them saves
    little); full rounds are never split; parts keep at least _MIN_PART_BLOCKS blocks."""
    assert ha._split_plan(4096, 132, 1024) == (132, 4092, 33)
    assert ha._split_plan(4096, 132, 512) == (132, 4092, 32)
    assert ha._split_plan(4096, 132, 256) == (132, 4096, 1)  # tiles under _MIN_TILE_BLOCKS
    assert ha._split_plan(512, 132, 1024) == (132, 512, 1)  # 116 tail tiles: 0.12 tile at best
    assert ha._split_plan(264, 132, 1024) == (132, 264, 1)  # no partial round
    assert ha._split_plan(16, 132, 1024) == (128, 0, 8)  # fewer tiles than programs: split-KV
    assert ha._split_plan(100, 132, 1024) == (100, 100, 1)
    assert ha._split_plan(131, 132, 1024) == (131, 131, 1)  # k parts each: k units a program
    assert ha._split_plan(0, 132, 8) == (1, 0, 1)


def test_split_plan_part_size(monkeypatch):
    """Parts of at least _MIN_PART_BLOCKS key blocks: two parts need twice that."""
    monkeypatch.setattr(ha, "_MIN_TILE_BLOCKS", 0)
    assert ha._split_plan(4, 132, 2 * ha._MIN_PART_BLOCKS - 1) == (4, 4, 1)
    assert ha._split_plan(4, 132, 2 * ha._MIN_PART_BLOCKS) == (8, 0, 2)
    assert ha._split_plan(4096, 132, 256) == (132, 4092, 256 // ha._MIN_PART_BLOCKS)


def test_split_plan_switch(monkeypatch):
    monkeypatch.setattr(ha, "SPLIT_TAIL", False)
    assert ha._split_plan(4096, 132, 1024) == (132, 4096, 1)
    assert ha._split_plan(16, 132, 1024) == (16, 16, 1)


@settings(max_examples=300, deadline=None)
@given(n_tiles=st.integers(1, 20000), programs=st.integers(1, 264),
       blocks=st.floats(0.0, 5000.0, allow_nan=False))
def test_split_plan_properties(n_tiles, programs, blocks):
    """Any plan: a grid of at most ``programs`` (and at least 1), whole tiles in full rounds,
    every tile run once (whole, or in ``n_split`` parts), only tiles of ``_MIN_TILE_BLOCKS``
    blocks or more split, at most ``_MAX_SPLIT`` parts of at least ``_MIN_PART_BLOCKS`` blocks,
    and a busiest program at least ``_MIN_GAIN_TILES`` tiles cheaper than without a split."""
    grid, n_main, n_split = ha._split_plan(n_tiles, programs, blocks)
    assert 1 <= grid <= programs and 0 <= n_main <= n_tiles
    assert 1 <= n_split <= ha._MAX_SPLIT
    if n_split == 1:
        assert n_main == n_tiles and grid == min(n_tiles, programs)
    else:
        assert blocks >= ha._MIN_TILE_BLOCKS and blocks / n_split >= ha._MIN_PART_BLOCKS
        assert n_main % programs == 0 and n_tiles - n_main == n_tiles % programs
        assert grid == min(programs, n_main + (n_tiles - n_main) * n_split)
        assert (_busiest(n_tiles, programs, n_main, n_split, blocks) + ha._MIN_GAIN_TILES
                <= _busiest(n_tiles, programs, n_tiles, 1, blocks) + 1e-9)


def test_merge_tail_in_interpreter():
    """``_merge_tail`` against a float64 log-sum-exp of the parts: written and accumulated, parts
    without keys, rows without any, a NaN part, rows past a sequence left alone."""
    run_interpreter_tests("test_interp_split_merge.py", passed=2)
