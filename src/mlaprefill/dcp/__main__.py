"""``torchrun --nproc-per-node N -m mlaprefill.dcp [--out X.json]``: the DCP check/benchmark."""

import sys

from mlaprefill.dcp.check import main

sys.exit(main())
