"""What the benchmark scripts share: kernel and host timing, and the JSON write.

Scripts run as ``python benchmarks/<name>.py``, so this directory is on ``sys.path`` and they
``from _common import ...``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def kernel_ms(fn: Callable[[], Any], *, warmup: int = 10, rep: int = 60,
              graph: bool = False) -> dict[str, Any]:
    """Device time of ``fn``: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each
    call) median and 20th / 80th percentiles, in ms. ``graph``: replay of ``fn`` captured in a
    CUDA graph (no host launch cost: small memory-bound kernels would otherwise time the host),
    falling back to eager timing when capture fails (``"graph"`` says which ran)."""
    import triton.testing

    quantiles = [0.5, 0.2, 0.8]
    if graph:
        try:
            q = triton.testing.do_bench_cudagraph(fn, rep=rep, quantiles=quantiles,
                                                  return_mode="median")
            return {"median_ms": q[0], "p20_ms": q[1], "p80_ms": q[2], "graph": True}
        except Exception:  # capture failed: eager timing below
            pass
    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=quantiles,
                                return_mode="median")
    result: dict[str, Any] = {"median_ms": q[0], "p20_ms": q[1], "p80_ms": q[2]}
    if graph:
        result["graph"] = False
    return result


def host_enqueue_ms(fn: Callable[[], Any], calls: int = 20) -> list[float]:
    """Host time of ``calls`` calls of ``fn``, each after a device synchronize, sorted (ms): what
    enqueuing the work costs the CPU, with nothing queued ahead of it."""
    import torch

    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """``doc`` as indented JSON at ``path`` (nothing when ``path`` is None); values JSON cannot
    hold are written as their ``str``."""
    if path:
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)


def apply_overrides(items: list[str]) -> dict[str, Any]:
    """Set module constants for an A/B run in one process: each ``MODULE.NAME=VALUE`` (e.g.
    ``mlaprefill.backends.hybrid.MIN_QUERIES_PER_KEY_FEW_HEADS=2048``). VALUE is ``true`` or
    ``false`` for a bool constant (``mlaprefill.kernels.hopper_attention.ENABLED=false``: the
    Triton kernel instead of the Hopper one), else an int, or the name of a
    :func:`~mlaprefill.kernels.attention.attention_configs` preset (for a config constant such as
    ``mlaprefill.kernels.attention.CONTEXT_ATTENTION_CONFIG``). Only constants the code reads at
    call time take effect. Returns what was set, for the JSON."""
    import importlib

    from mlaprefill.kernels.attention import attention_configs

    done: dict[str, Any] = {}
    for item in items:
        target, sep, text = item.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name or not name:
            raise ValueError(f"--override {item!r} is not MODULE.NAME=VALUE")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            raise ValueError(f"--override {item!r}: no module {module_name!r}") from None
        if not hasattr(module, name):
            raise ValueError(f"--override {item!r}: {module_name} has no {name}")
        presets = attention_configs()
        if isinstance(getattr(module, name), bool):
            if text.lower() not in ("true", "false"):
                raise ValueError(f"--override {item!r}: {name} is a bool, VALUE must be true or "
                                 f"false")
            value: Any = text.lower() == "true"
        elif text.lstrip("-").isdigit():
            value = int(text)
        elif text in presets:
            value = presets[text]
        else:
            raise ValueError(f"--override {item!r}: VALUE must be an int or one of the presets "
                             f"{sorted(presets)}")
        setattr(module, name, value)
        done[target] = text
    return done
