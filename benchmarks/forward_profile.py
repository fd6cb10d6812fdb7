"""Where the whole forward's time goes, per kernel, on the issue-#11 shapes (one GPU).

    PYTHONPATH=src python benchmarks/forward_profile.py --backends mlaprefill,fa2 \
        --out benchmarks/results/forward_profile_h200.json

For each (heads, requests x queries, context) and backend: the forward's time as
``benchmarks/attention.py`` measures it (``triton.testing.do_bench`` median, L2 flushed before
each call), ten forwards back to back (what an engine's next layer sees when the host keeps
ahead), the host enqueue time (p50 of 20 calls), and the device time of each kernel name summed
over the forward (``torch.profiler``, mean of 5 forwards). ``device_sum_ms`` against
``do_bench_ms`` shows how long the device waited for the host inside one call; ``idle`` says
where: the device's idle time between kernels of the 5 profiled forwards (queued back to back),
per forward, and the largest gaps with the kernels on either side. ``--host-profile`` adds where
the host time of one forward goes (``cProfile``, own time per function) on the shape with the
most workspace iterations and on a one-iteration shape (``--host-only``: that alone).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from _common import add_cpu_smoke, empty_cache, host_enqueue_ms, kernel_ms, sync, write_json
from attention import _auto_forward, _forward_inputs, _label, parse_shapes

SHAPES = [(128, 1, 4096, 4096), (128, 4, 1024, 32768), (128, 16, 256, 8192),
          (128, 4, 1000, 30000), (16, 1, 4096, 4096), (16, 4, 1024, 32768),
          (16, 16, 256, 8192)]
WORKSPACE = 65536


def idle_gaps(prof: Any, forwards: int, top: int = 4) -> dict[str, Any]:
    """Idle device time between consecutive kernels in a profile of ``forwards`` forwards run
    back to back (one stream): per forward, and the ``top`` largest gaps (us) with the kernel
    names around them."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = []
    end_so_far = kernels[0][1] if kernels else 0.0
    prev = kernels[0][2] if kernels else ""
    for start, end, name in kernels[1:]:
        if start > end_so_far:
            gaps.append((start - end_so_far, prev, name))
        if end >= end_so_far:
            end_so_far, prev = end, name
    gaps.sort(key=lambda g: -g[0])
    return {"idle_ms_per_forward": sum(g[0] for g in gaps) / 1e3 / forwards,
            "span_ms_per_forward": ((kernels[-1][1] - kernels[0][0]) / 1e3 / forwards
                                    if kernels else 0.0),
            "largest_gaps": [{"us": round(us, 1), "after": a[:60], "before": b[:60]}
                             for us, a, b in gaps[:top]]}


def profile(backends: list[str], shapes: list[tuple[int, int, int, int]] | None = None,
            device: str = "cuda") -> list[dict[str, Any]]:
    rows = []
    for heads, nr, q, c in shapes or SHAPES:
        x = _forward_inputs([q] * nr, [c] * nr, heads, torch.bfloat16, device)
        for name in backends:
            op, plan, fwd = _auto_forward(x, name, WORKSPACE, device)
            for _ in range(3):
                fwd()
            sync()
            isolated = kernel_ms(fwd, warmup=5, rep=100)["median_ms"]
            cuda = device == "cuda"  # --cpu-smoke: no CUDA events, no device kernels
            t0 = time.perf_counter()
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            for _ in range(10):
                fwd()
            if cuda:
                end.record()
            sync()
            back_to_back = (start.elapsed_time(end) if cuda
                            else (time.perf_counter() - t0) * 1e3) / 10
            host = host_enqueue_ms(fwd)
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA if cuda
                                else torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    fwd()
                sync()
            kernels = sorted(((k.key[:80], k.device_time_total / 5e3, k.count // 5)
                              for k in prof.key_averages() if k.device_time_total > 0),
                             key=lambda r: -r[1])
            rows.append({"heads": heads, "num_reqs": nr, "query_len": q, "context_len": c,
                         "backend": _label(op, name), "policy": plan.policy,
                         "iterations": plan.num_iterations, "do_bench_ms": isolated,
                         "back_to_back_ms": back_to_back,
                         "host_enqueue_ms_p50": host[len(host) // 2],
                         "device_sum_ms": sum(k[1] for k in kernels),
                         "idle": idle_gaps(prof, 5),
                         "kernels": [{"name": n, "ms_per_forward": ms, "launches": cnt}
                                     for n, ms, cnt in kernels[:14]]})
            r = rows[-1]
            print(f"H={heads:>3} {nr:>2}x{q:<5} ctx {c:>6} {r['backend']:<7} do_bench "
                  f"{isolated:7.3f} back-to-back {r['back_to_back_ms']:7.3f} device "
                  f"{r['device_sum_ms']:7.3f} idle {r['idle']['idle_ms_per_forward']:6.3f} host "
                  f"{r['host_enqueue_ms_p50']:6.3f} ms | " + ", ".join(
                      f"{n[:28]} {ms:.3f}" for n, ms, _ in kernels[:5]), flush=True)
            del op
        del x
        empty_cache()
    return rows


#: Shapes of ``--host-profile``: the most workspace iterations (32), and one iteration where the
#: host time is as long as the device's (issue #11's 1 x 4096 over 4k at 16 heads).
HOST_PROFILE_SHAPES = [(16, 16, 256, 131072), (16, 1, 4096, 4096)]


def host_profile(backends: list[str], shape: tuple[int, int, int, int],
                 calls: int = 5, top: int = 25, device: str = "cuda") -> list[dict[str, Any]]:
    """Where the host time of the forward goes (``cProfile`` over ``calls`` forwards, the device
    synchronized before and after only): the ``top`` functions by own time, per forward."""
    import cProfile
    import pstats

    heads, nr, q, c = shape
    x = _forward_inputs([q] * nr, [c] * nr, heads, torch.bfloat16, device)
    rows = []
    for name in backends:
        op, plan, fwd = _auto_forward(x, name, WORKSPACE, device)
        for _ in range(3):
            fwd()
        sync()
        host = host_enqueue_ms(fwd)  # without the profiler, which slows Python code down
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fwd()
        prof.disable()
        sync()
        stats = pstats.Stats(prof).stats  # (file, line, func) -> (cc, nc, tottime, cumtime, _)
        total = sum(v[2] for v in stats.values())
        entries = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        rows.append({"heads": heads, "num_reqs": nr, "query_len": q, "context_len": c,
                     "backend": _label(op, name), "iterations": plan.num_iterations,
                     "host_enqueue_ms_p50": host[len(host) // 2],
                     "host_ms_per_forward_under_cprofile": total * 1e3 / calls,
                     "top_own_time": [{"function": f"{k[0].rsplit('/', 2)[-1]}:{k[1]} {k[2]}",
                                       "calls_per_forward": v[1] / calls,
                                       "own_us_per_forward": v[2] * 1e6 / calls,
                                       "cum_us_per_forward": v[3] * 1e6 / calls}
                                      for k, v in entries]})
        r = rows[-1]
        print(f"host profile H={heads} {nr}x{q} ctx {c} {r['backend']}: enqueue p50 "
              f"{r['host_enqueue_ms_p50']:.2f} ms, "
              f"{r['host_ms_per_forward_under_cprofile']:.2f} ms per forward under cProfile, "
              f"{plan.num_iterations} iterations", flush=True)
        for e in r["top_own_time"][:12]:
            print(f"  {e['own_us_per_forward']:8.1f} us {e['calls_per_forward']:6.1f} calls "
                  f"{e['function'][:90]}", flush=True)
        del op
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="mlaprefill,fa2", help="comma list of backends")
    ap.add_argument("--out", help="JSON output path")
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile the host side of the forward on HOST_PROFILE_SHAPES")
    ap.add_argument("--host-only", action="store_true",
                    help="only the host profile (implies --host-profile)")
    ap.add_argument("--shapes", default="",
                    help="HEADS:NREQSxQUERIES:CONTEXT,... instead of SHAPES")
    add_cpu_smoke(ap)
    args = ap.parse_args()
    from mlaprefill._env import machine_info, utc_now

    backends = [b for b in args.backends.split(",") if b]
    shapes, host_shapes, device = parse_shapes(args.shapes), HOST_PROFILE_SHAPES, "cuda"
    if args.cpu_smoke:  # both parts, one tiny shape, CPU tensors, math backend
        backends, device = ["math"], "cpu"
        shapes = host_shapes = [(4, 2, 16, 200)]
        args.host_profile = True
    elif not torch.cuda.is_available():
        print("needs CUDA (or --cpu-smoke)", file=sys.stderr)
        return 2
    result = {"benchmark": "forward_profile", "command": " ".join(sys.argv), "argv": sys.argv,
              "date_utc": utc_now(offset=True),
              "machine": machine_info(torch.device(device)), "workspace_tokens": WORKSPACE,
              "rows": [] if args.host_only else profile(backends, shapes, device)}
    if args.host_profile or args.host_only:
        result["host_profile"] = [row for shape in host_shapes
                                  for row in host_profile(backends, shape, device=device)]
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
