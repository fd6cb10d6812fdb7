"""Where and when a run happened: the pieces every writer of results JSON records.

Each benchmark keeps its own ``machine`` keys (results already written use them); the helpers
here are the parts they share. Nothing here imports torch at module level.
"""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

__all__ = ["cpu_name", "machine_info", "triton_version", "utc_now"]


def utc_now(*, offset: bool = False) -> str:
    """The current UTC time to the second: ``2026-01-31T12:00:00Z``, or with ``offset=True``
    ``2026-01-31T12:00:00+00:00`` (the form ``benchmarks/*.py`` write)."""
    now = datetime.datetime.now(datetime.UTC)
    return now.isoformat(timespec="seconds") if offset else now.strftime("%Y-%m-%dT%H:%M:%SZ")


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), else ``platform.processor() or platform.machine()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def triton_version() -> str | None:
    """``triton.__version__``, or None when triton does not import (it is optional)."""
    try:
        import triton
    except Exception:  # any import failure just means "not available"
        return None
    return triton.__version__


def machine_info(device: Any) -> dict[str, Any]:
    """Hardware and software versions of a run on ``device`` (a ``torch.device``): the
    ``machine`` of ``mlaprefill bench`` and ``mlaprefill dcp`` results."""
    import torch

    info: dict[str, Any] = {
        "device_type": device.type,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "triton": triton_version(),
    }
    try:
        import numpy
        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover - numpy is a dependency
        info["numpy"] = None
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        props = torch.cuda.get_device_properties(device)
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["driver"] = _nvidia_smi_driver()
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        info["device_name"] = cpu_name()
    return info


def _nvidia_smi_driver() -> str | None:
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError):
        return None
