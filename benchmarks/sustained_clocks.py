"""Short against sustained timing of the context-attention kernels, with the SM clock and power
read while each runs (one GPU).

    PYTHONPATH=src python benchmarks/sustained_clocks.py \
        --out benchmarks/results/sustained_clocks_h200.json

Why: the other scripts' ``graph`` timings (``triton.testing.do_bench_cudagraph``) replay a graph
of back-to-back calls for about 0.6 s, and a GPU that runs at its power limit lowers its clock
there; a kernel that draws more power loses more. For each shape (a context part, bf16) and
kernel (ours through ``varlen_attention``, cuDNN through PyTorch's SDPA):

* ``gapped``: one call per CUDA-graph replay, 2 ms idle between replays, median of 30;
* ``sustained``: ``do_bench_cudagraph``'s median (60 ms of calls per replay, 10 replays).

``nvidia-smi`` samples the SM clock (MHz), the board power (W) and the temperature (C) every
50 ms during each mode, where it exists (``sampling`` in the JSON says whether it did). A
gapped mode is short, so it gets few samples. ``--cpu-smoke`` runs a tiny case on CPU tensors
through the same library call (float16 under Triton's interpreter, host-timed, nothing sampled).
"""

from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:  # before triton is imported: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

import torch

from _common import add_cpu_smoke, empty_cache, kernel_ms, sync, write_json
from attention import parse_shapes
from fp8_attention import NOPE, ROPE, VDIM, cudnn_call, make_inputs, run_bf16
from mlaprefill._env import machine_info, utc_now

# (heads, num_seqs, q_len, k_len): the context parts where our kernel timed slower as graph
# replays than eagerly (fp8_attention_halves_h200.json), and one at 128 heads
SHAPES = [(16, 4, 1024, 32768), (16, 1, 4096, 131072), (128, 1, 4096, 32768)]
SMOKE_SHAPES = [(2, 2, 20, 40)]
GAPPED_CALLS, GAP_S = 30, 0.002
SAMPLE_MS = 50
DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float16}  # the interpreter's bf16 was garbage


class ClockSampler:
    """``nvidia-smi`` read every ``SAMPLE_MS`` ms in the background: (time, SM MHz, W, C)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi") and torch.cuda.is_available():
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS),
                 "-i", str(torch.cuda.current_device())],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                mhz, watts, temp = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((time.time(), mhz, watts, temp))

    def between(self, t0: float, t1: float) -> dict[str, Any] | None:
        """Summary of the samples taken in [t0, t1] (None when there are none)."""
        sel = [s for s in self.samples if t0 <= s[0] <= t1]
        if not sel:
            return None
        mhz = [s[1] for s in sel]
        return {"samples": len(sel), "sm_mhz_min": min(mhz), "sm_mhz_median":
                statistics.median(mhz), "power_w_max": max(s[2] for s in sel),
                "temp_c_max": max(s[3] for s in sel)}

    def stop(self) -> None:
        if self.proc is not None:
            time.sleep(2 * SAMPLE_MS / 1e3)
            self.proc.terminate()


def gapped_ms(fn) -> float:
    """Median device time of single calls, each a CUDA-graph replay with GAP_S idle between
    (host-timed single calls on CPU)."""
    if not torch.cuda.is_available():
        return kernel_ms(fn)["median_ms"]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
        with torch.cuda.graph(graph):
            fn()
    times = []
    for _ in range(GAPPED_CALLS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        time.sleep(GAP_S)
    return statistics.median(times)


def run(shapes, device: str) -> tuple[list[dict[str, Any]], bool]:
    sampler = ClockSampler()
    rows = []
    try:
        for heads, seqs, q_len, k_len in shapes:
            empty_cache()
            x = make_inputs(heads, seqs, q_len, k_len, DTYPE[device], device)
            flop = 2 * seqs * q_len * k_len * heads * (NOPE + ROPE + VDIM)
            kernels = {"ours": lambda x=x: run_bf16(x)}  # varlen_attention, keys split
            if device == "cuda":
                kernels["cudnn"] = cudnn_call(x, False)
            row: dict[str, Any] = {"heads": heads, "num_seqs": seqs, "q_len": q_len,
                                   "k_len": k_len, "flop": flop, "kernels": {}}
            for name, fn in kernels.items():
                fn()
                sync()
                res: dict[str, Any] = {}
                for mode in ("gapped", "sustained"):
                    time.sleep(1.0 if device == "cuda" else 0.0)  # cool down between modes
                    t0 = time.time()
                    ms = gapped_ms(fn) if mode == "gapped" else \
                        kernel_ms(fn, graph=True)["median_ms"]
                    res[mode] = {"ms": ms, "tflops": flop / (ms * 1e-3) / 1e12,
                                 "clocks": sampler.between(t0, time.time())}
                res["sustained_over_gapped"] = res["sustained"]["ms"] / res["gapped"]["ms"]
                row["kernels"][name] = res
            if "cudnn" in row["kernels"]:
                k = row["kernels"]
                for mode in ("gapped", "sustained"):
                    row[f"ours_over_cudnn_{mode}"] = k["ours"][mode]["ms"] / k["cudnn"][mode]["ms"]
            print(f"H={heads} {seqs}x{q_len} over {k_len}: " + "; ".join(
                f"{n} gapped {r['gapped']['ms']:.3f} ms, sustained {r['sustained']['ms']:.3f} ms"
                + "".join(f" ({m} min {r[m]['clocks']['sm_mhz_min']:.0f} MHz, max "
                          f"{r[m]['clocks']['power_w_max']:.0f} W)"
                          for m in ("gapped", "sustained") if r[m]["clocks"])
                for n, r in row["kernels"].items()), flush=True)
            rows.append(row)
            x = None
    finally:
        sampler.stop()
    return rows, sampler.proc is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="",
                    help="HEADS:NSEQSxQUERIES:KEYS,... (default: the three of SHAPES)")
    ap.add_argument("--out", default=None, help="write the JSON here")
    add_cpu_smoke(ap)
    args = ap.parse_args()
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    except ValueError as exc:
        ap.error(str(exc).replace("--ideal-shapes", "--shapes"))
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --cpu-smoke)")
    rows, sampled = run(SMOKE_SHAPES if args.cpu_smoke else shapes, device)
    write_json(args.out, {
        "benchmark": "sustained_clocks", "date_utc": utc_now(),
        "machine": machine_info(torch.device(device)),
        "command": sys.argv, "gapped": f"{GAPPED_CALLS} single-call graph replays, "
        f"{GAP_S * 1e3:.0f} ms idle between, median",
        "sustained": "triton.testing.do_bench_cudagraph median (60 ms of calls per replay)",
        "sampling": f"nvidia-smi every {SAMPLE_MS} ms" if sampled else "none",
        "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
