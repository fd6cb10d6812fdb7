"""One stall-threshold figure everywhere: the one the H200's stall map measured.

The README, the lint's explanation of HS101, the bench's dry run and help all state the size from
which a pageable ``non_blocking`` copy blocked the host; each must say what
``benchmarks/results/stallmap_h200.json`` says, so a new measurement cannot leave an old figure
behind.
"""

from __future__ import annotations

import json
from pathlib import Path

from hostsync.lint_report import EXPLANATIONS as EXPLAIN
from mlaprefill.bench import cli as bench_cli
from mlaprefill.bench.dryrun import STALL_THRESHOLD_BYTES

REPO = Path(__file__).resolve().parents[1]
MEASURED = json.loads((REPO / "benchmarks/results/stallmap_h200.json").read_text())


def test_the_figure_is_the_stall_maps():
    assert MEASURED["threshold_bytes"] == STALL_THRESHOLD_BYTES
    figure = MEASURED["threshold_human"]
    assert figure == f"{STALL_THRESHOLD_BYTES >> 10} KiB"
    assert figure in (REPO / "README.md").read_text()
    assert figure in " ".join(EXPLAIN["HS101"].split())
    assert figure in " ".join(bench_cli.__doc__.split())
    for text in ((REPO / "README.md").read_text(), EXPLAIN["HS101"], bench_cli.__doc__):
        assert "3 MiB" not in " ".join(text.split())  # the figure of an older, coarser run
