"""mlaprefill: MLA chunked-context prefill whose host side never stalls the GPU.

Three stages (see docs/DESIGN.md): ``ChunkPlanner.plan`` (pure CPU) -> ``StagingRing.upload``
(the only host-to-device crossing, one copy from pinned memory) -> the device forward.
"""

from mlaprefill.config import PRESETS, MLAConfig

__all__ = ["PRESETS", "MLAConfig"]
__version__ = "0.1.0"
