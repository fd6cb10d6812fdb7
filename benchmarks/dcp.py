"""DCP check and benchmark: DCP forward vs one GPU holding the whole cache.

    torchrun --nproc-per-node 2 benchmarks/dcp.py --out benchmarks/results/dcp_h200x2.json
    torchrun --nproc-per-node 3 benchmarks/dcp.py --device cpu      # gloo, tiny shapes

See :mod:`mlaprefill.dcp.check` for what is checked and timed, and the formulas. Uses this
checkout's ``src/`` (no install needed).
"""

import sys
from pathlib import Path

# This checkout's package first, so the code measured is the code in the tree.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mlaprefill.dcp.check import main

if __name__ == "__main__":
    sys.exit(main())
