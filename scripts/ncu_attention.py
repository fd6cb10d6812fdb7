"""Where the context-attention kernels' time goes: one call each of our bf16 kernel
(``varlen_attention``) and PyTorch's cuDNN SDPA on a few vs-ideal parts, under Nsight Compute.

Every call is made (compiled, its cuDNN graph built) before the profiled window, which holds one
call of each; run it under ``ncu --profile-from-start off`` so that only that window is profiled:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \\
        python scripts/ncu_attention.py > ncu.csv

``--parts 128:4x1024:causal,16:4x1024x32768:context`` picks the parts (heads:seqs x q_len[x k_len]:
part). GPU only; benchmarks/fp8_attention.py times the same calls. Then, on any machine,
``python scripts/ncu_attention.py --summarize ncu.csv --out ncu_attention.json`` turns that CSV
into JSON: per part, our kernel's and cuDNN's kernels with every metric of the sections.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fp8_attention import cudnn_call, make_inputs, run_bf16

DEFAULT = "128:4x1024:causal,128:16x256:causal,128:1x4096:causal,128:4x1024x32768:context"


def parse(spec: str) -> list[tuple[int, int, int, int, bool]]:
    parts = []
    for item in spec.split(","):
        heads, dims, part = item.split(":")
        n = [int(v) for v in dims.split("x")]
        seqs, q_len = n[0], n[1]
        k_len = n[2] if len(n) > 2 else q_len
        if part not in ("causal", "context"):
            raise SystemExit(f"--parts: part {part!r} of {item!r} is not causal or context")
        parts.append((int(heads), seqs, q_len, k_len, part == "causal"))
    return parts


def _number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def summarize(csv_path: Path, parts: list[tuple[int, int, int, int, bool]]) -> dict:
    """ncu's ``--csv --page details`` rows, grouped per kernel launch, then per part: each part's
    launches are our kernel's (its name holds ``hopper_attention``) and cuDNN's that follow it."""
    lines = csv_path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    launches: dict[str, dict] = {}
    for rec in csv.DictReader(lines[start:]):
        k = launches.setdefault(rec["ID"], {"kernel": rec["Kernel Name"],
                                            "block": rec["Block Size"], "grid": rec["Grid Size"],
                                            "metrics": {}})
        unit = f" [{rec['Metric Unit']}]" if rec.get("Metric Unit") else ""
        k["metrics"][f"{rec['Section Name']}: {rec['Metric Name']}{unit}"] = _number(
            rec["Metric Value"])
    out, current = [], None
    for k in launches.values():
        if "hopper_attention" in k["kernel"]:
            if len(out) == len(parts):
                raise SystemExit(f"{csv_path}: more of our launches than --parts ({len(parts)})")
            heads, seqs, q_len, k_len, causal = parts[len(out)]
            current = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                       "causal": causal, "ours": k, "cudnn": []}
            out.append(current)
        elif current is not None:
            current["cudnn"].append(k)
    if len(out) != len(parts):
        raise SystemExit(f"{csv_path}: {len(out)} of our launches for {len(parts)} parts")
    return {"parts": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=DEFAULT)
    ap.add_argument("--summarize", type=Path, help="ncu's CSV of a run: write it as JSON")
    ap.add_argument("--out", type=Path, help="with --summarize: the JSON file")
    args = ap.parse_args()
    if args.summarize:
        doc = summarize(args.summarize, parse(args.parts))
        text = json.dumps(doc, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        else:
            print(text)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    calls = []
    for heads, seqs, q_len, k_len, causal in parse(args.parts):
        x = make_inputs(heads, seqs, q_len, k_len, torch.bfloat16, "cuda")

        calls.append((f"H={heads} {seqs}x{q_len} over {k_len} causal={causal}",
                      lambda x=x, causal=causal: run_bf16(x, causal), cudnn_call(x, causal)))
    for _, ours, cudnn in calls:  # compile and build outside the window
        for _ in range(3):
            ours()
            cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, ours, cudnn in calls:
        print(f"# {name}: ours then cuDNN", file=sys.stderr, flush=True)
        ours()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
