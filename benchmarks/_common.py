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
    import torch

    if not torch.cuda.is_available():  # --cpu-smoke: a few host-timed calls
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        result = {"median_ms": times[1], "p20_ms": times[0], "p80_ms": times[2],
                  "timing": "host perf_counter (CPU smoke)"}
        if graph:
            result["graph"] = False
        return result
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
    if not torch.cuda.is_available():
        calls = min(calls, 3)
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return sorted(times)


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """``doc`` as indented JSON at ``path`` (nothing when ``path`` is None); values JSON cannot
    hold are written as their ``str``."""
    if path:
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)


def apply_overrides(items: list[str]) -> dict[str, Any]:
    """Set module constants for an A/B run in one process: each ``MODULE.NAME=VALUE`` (e.g.
    ``mlaprefill.backends.mlaprefill.MIN_QUERIES_PER_KEY_FEW_HEADS=2048``; a public name of a
    public module: ``_`` names are refused; the Hopper kernel's A/B is the environment variable
    ``MLAPREFILL_DISABLE_HOPPER_KERNEL=1``). VALUE is ``true`` or ``false`` for a bool
    constant, else an int, or the name of a
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
        if any(part.startswith("_") for part in target.split(".")):
            raise ValueError(f"--override {item!r}: {target} is private; override a public "
                             f"constant of a public module")
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


def add_cpu_smoke(parser: Any) -> None:
    """The flag every script takes: ``--cpu-smoke``, a tiny case on CPU tensors through the same
    library calls as the GPU run (what CI runs, ``tests/test_benchmarks_cpu.py``)."""
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny case on CPU tensors (math backend) through the same code "
                             "path; times are host wall clock and mean nothing")


def sync() -> None:
    """``torch.cuda.synchronize()`` where there is CUDA (a no-op in ``--cpu-smoke``)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    """``torch.cuda.empty_cache()`` where there is CUDA."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
