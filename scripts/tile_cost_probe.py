"""Where the Gluon kernel's time goes, and A/B of its forms: variants of
``mlaprefill.kernels.hopper_attention``, timed under CUDA graphs beside cuDNN in one process.

Variants, each written from the current kernel source (an edit that no longer applies stops the
script, naming it), each run on the parts it changes (``causal``, ``context``):

* ``headslow``: tiles ordered with the head slowest, the sequence in between (the kernel before
  ``_decode`` put the sequence slowest; causal and context);
* ``single4``: causal parts of up to 512 queries in the 64-row form, two programs to an SM (up to
  256 now);
* ``nosplit``: context parts with every tile whole (``SPLIT_TAIL`` off: the last, partial round
  of tiles not split over the programs); ``short``: tiles of fewer than ``_MIN_TILE_BLOCKS``
  key blocks split too;
* ``notail`` (a measure, not a kernel: wrong output rows): a context part without its last,
  partial round of tiles (4096 tiles on 132 SMs: 31 full rounds and 4 tiles), i.e. the most that
  splitting those tiles' keys over every SM could save;
* ``ctx_narrow``: context parts in 64-key blocks with a 4-deep ring (the narrow causal form's);
* ``kwin`` (not a kernel edit; one-sequence context parts past ``KWIN`` keys): the kernel once per
  window of ``KWIN`` keys, each call merged into the previous one's result (``state=``);
* ``single4``, ``ctx_narrow``, ``qsmem`` / ``qreg_all`` / ``qearly`` (only with
  ``--variants``): the scores' Q operand from
  shared memory in every form (the kernel before ``Q_REG``); Q in registers in the context form
  too; with Q in registers, the next tile's Q loaded as soon as this tile's is in registers;
* ``pingpong`` (only with ``--variants``): FA3's consumer ping-pong in the narrow causal form,
  the two consumer warpgroups taking turns to issue each ring iteration's products (tried
  before the 64-key forms existed: docs/DESIGN.md, tried and dropped).

The script checks each variant's outputs against the kernel's bit for bit. Earlier variants and
their times are in benchmarks/results/tile_*.json and in git history (O stored from the MMA
layout; O not stored; no masks; O by TMA store with a 3-deep narrow ring, commit 56485b4;
the first key block masked, commit d1116c8; a tile's first key block run at the end of the
previous tile's call, its scores before that tile's epilogue, ``xfirst_*``, commit 0b44098).

    PYTHONPATH=src:hostsync/src python scripts/tile_cost_probe.py --out probe.json   # on an H200
    python scripts/tile_cost_probe.py --write DIR   # only write the variant modules (any machine;
    # then PYTHONPATH=/tmp/t36:src:DIR python scripts/gluon_sm90_build.py hv_headslow builds one)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "src" / "mlaprefill" / "kernels" / "hopper_attention.py"
# (heads, sequences, queries per sequence, keys per sequence, causal)
SHAPES = [(128, 4, 1024, 1024, True), (128, 4, 1000, 1000, True), (16, 4, 1024, 1024, True),
          (128, 8, 512, 512, True), (16, 8, 600, 600, True), (128, 16, 256, 256, True),
          (16, 16, 256, 256, True), (128, 1, 4096, 4096, True),
          (16, 4, 1024, 32768, False), (128, 4, 1024, 32768, False),
          (128, 16, 256, 8192, False), (16, 16, 256, 8192, False),
          (128, 1, 4096, 65536, False), (128, 1, 4096, 131072, False)]
#: keys per window of the ``kwin`` entry: a one-sequence context part past this many keys also
#: runs as one call per window of its keys, each merged into the last (``state=``)
KWIN = 32768


def _lines(*rows: tuple[int, str]) -> str:
    """Source lines at their indents (the kernel's text, matched exactly)."""
    return "\n".join(" " * n + text for n, text in rows)


_QREG = _lines((8, "Q_REG: gl.constexpr = CAUSAL"))
_QLOAD = _lines((16, "q2 = q2w.load(qa_layout)"))
_QLATE = _lines((12, "if Q_TMA:  # every warp's scores are done: the Q buffer takes the next "
                     "tile's"))
_QEARLY = _QLOAD + "\n" + _lines(
    (16, "if Q_TMA:  # the buffer is free now: the next tile's Q"),
    (20, "gl.thread_barrier()"),
    (20, "fence_async_shared()"),
    (20, "nmb, nseq, nhead, nvalid = _load_q(qd1, qd2, q_bar, q1w, q2w, t_next, qa_next,"),
    (55, "n_m, num_seqs, num_heads, n_tiles, stride_qh,"),
    (55, "WG, BLOCK_M, D1, D2)"))
# _decode's tile order (causal pair units; context and one-tile-per-program tiles) and the one
# before it, with the head slowest
_PAIR_ORDER = _lines((12, "head = (u // n_pairs) % num_heads"),
                     (12, "seq = (u // (n_pairs * num_heads)) % num_seqs"))
_PAIR_HEADSLOW = _lines((12, "seq = (u // n_pairs) % num_seqs"),
                        (12, "head = u // (n_pairs * num_seqs)"))
_PAIR_VALID = "valid = (u < n_pairs * num_heads * num_seqs) & (heavy | (n_m - 1 - j != j))"
_TILE_ORDER = _lines((12, "head = (t // n_m) % num_heads"),
                     (12, "seq = (t // (n_m * num_heads)) % num_seqs"))
_TILE_HEADSLOW = _lines((12, "seq = (t // n_m) % num_seqs"),
                        (12, "head = t // (n_m * num_seqs)"))
_TILE_VALID = "valid = t < n_m * num_heads * num_seqs  # true for t < n_tiles: the loops stop there"
_SPLIT_ON = "SPLIT_TAIL = True"
_PLAN = "    n_main, n_split, ws_o, ws_l = n_tiles, 1, out, lse"
_CTX_FORM = "else (True, BLOCK_M, BLOCK_N, STAGES))"

# pingpong: FA3's consumer ping-pong in the narrow causal form (128 rows, 64-key blocks): the two
# consumer warpgroups take turns to issue each ring iteration's wgmma (warpgroup 0 first), on two
# mbarriers past the Q ones, so that one's softmax runs while the other's products do. Every
# ring iteration is a turn for both (a skipped one in _release too), so both count the same turns.
_QBARS = _lines(
    (8, "q_bars = gl.allocate_shared_memory(gl.int64, [NC, 1], bar_layout)  # a consumer's Q "
        "loads"),
    (8, "for i in gl.static_range(NC):"),
    (12, "mbarrier.init(q_bars.index(i), count=1)"))
_CT_SIG = _lines(
    (23, "qb, ka, kb, dense, t_next, n_m, num_seqs, num_heads, n_tiles, qa_next, qd1,"),
    (23, "qd2, q_bar,")) + "\n"
_CT_BODY = _lines((8, "WM: gl.constexpr = 64"), (8, "s_layout"))
_CT_CALL = "kb, dense, t + progs, n_m, num_seqs, num_heads, n_tiles, na, qd1, qd2, q_bar,"
_CT_CALL1 = "ka, kb, dense, 0, n_m, num_seqs, num_heads, n_tiles, 0, 0, 0, 0,"
_KB_SIG = _lines((20, "STAGES: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):"))
_KB_END = _lines((0, "kv_end, {},"), (43, "CAUSAL, BLOCK_N, STAGES, o_layout, p_layout)"))
_KB_ISSUE = _lines((12, "t = _scores(q1_s, q2_s, k_s, r_s, kr_ready, g, s_zero, STAGES)"),
                   (12, "o = _values(p, acc, v_s, v_ready, g - 1, STAGES)")) + "\n"
_FIRST = _lines((12, "t = _scores(q1, q2, k_s, r_s, kr_ready, it0, s_zero, STAGES)")) + "\n"
_SKIP = _lines((20, "_release(kr_empty, v_empty, it0 + i, STAGES)")) + "\n"
_TURNS = _lines(
    (4, "@gluon.jit"),
    (4, "def _turn_wait(q_bars, g, WG: gl.constexpr, PP: gl.constexpr):"),
    (8, "if PP:  # ring iteration g: warpgroup 0 first, then 1 (turn barriers q_bars[2 + WG])"),
    (12, "mbarrier.wait(q_bars.index(2 + WG), (g & 1) ^ (1 - WG))"),
    (0, ""),
    (4, "@gluon.jit"),
    (4, "def _turn_pass(q_bars, WG: gl.constexpr, PP: gl.constexpr):"),
    (8, "if PP:"),
    (12, "mbarrier.arrive(q_bars.index(3 - WG), count=1)"),
    (0, ""))


def _turn(text: str, indent: int, g: str) -> str:
    """``text`` (lines ending in a newline) as one turn of ring iteration ``g``: the warpgroup
    waits for its turn, runs them, then passes the turn."""
    return (_lines((indent, f"_turn_wait(q_bars, {g}, WG, PP)")) + "\n" + text
            + _lines((indent, "_turn_pass(q_bars, WG, PP)")) + "\n")


_PINGPONG = [
    (_QBARS, _QBARS.replace("[NC, 1]", "[NC + 2, 1]").replace("static_range(NC)",
                                                               "static_range(NC + 2)")),
    (_CT_SIG, _CT_SIG.replace("q_bar,", "q_bars,")),
    (_CT_BODY, _lines((8, "q_bar = q_bars.index(WG)"),
                      (8, "PP: gl.constexpr = CAUSAL and PERSISTENT and BLOCK_M == 128 and "
                          "BLOCK_N == 64")) + "\n" + _CT_BODY),
    (_CT_CALL, _CT_CALL.replace("q_bar,", "q_bars,")),
    (_CT_CALL1, _CT_CALL1.replace("0, 0, 0, 0,", "0, 0, 0, q_bars,")),
    (_KB_SIG, _KB_SIG.replace("):", ",") + "\n" + _lines(
        (20, "q_bars, WG: gl.constexpr, PP: gl.constexpr):"))),
    (_KB_END.format("False"), _KB_END.format("False")[:-1] + ", q_bars, WG, PP)"),
    (_KB_END.format("True"), _KB_END.format("True")[:-1] + ", q_bars, WG, PP)"),
    (_KB_ISSUE, _turn(_KB_ISSUE, 12, "g")),
    (_FIRST, _turn(_FIRST, 12, "it0")),
    (_SKIP, _turn(_SKIP, 20, "it0 + i")),
    (_lines((4, "@gluon.jit"), (4, "def _release(")),
     _TURNS + "\n" + _lines((4, "@gluon.jit"), (4, "def _release("))),
]

# name -> (edits (old, new), the parts it changes: "causal", "context")
EDITS: dict[str, list[tuple[str, str]]] = {
    "headslow": [(_PAIR_ORDER, _PAIR_HEADSLOW),
                 (_PAIR_VALID, _PAIR_VALID.replace("u < n_pairs * num_heads * num_seqs",
                                                   "head < num_heads")),
                 (_TILE_ORDER, _TILE_HEADSLOW),
                 (_TILE_VALID, _TILE_VALID.replace("t < n_m * num_heads * num_seqs",
                                                   "head < num_heads"))],
    "single4": [("CAUSAL_SINGLE_MAX_BLOCKS = 2", "CAUSAL_SINGLE_MAX_BLOCKS = 4")],
    "nosplit": [(_SPLIT_ON, "SPLIT_TAIL = False")],
    "short": [("_MIN_TILE_BLOCKS = 512", "_MIN_TILE_BLOCKS = 0")],
    "notail": [(_SPLIT_ON, "SPLIT_TAIL = False"),
               (_PLAN, "    n_tiles = max(n_tiles // _num_sms(q.device) * _num_sms(q.device), 1)"
                       "\n" + _PLAN)],
    "ctx_narrow": [(_CTX_FORM, "else (True, BLOCK_M, *_NARROW))")],
    "qsmem": [(_QREG, _QREG.replace("CAUSAL", "False"))],
    "qreg_all": [(_QREG, _QREG.replace("CAUSAL", "True"))],
    "qearly": [(_QLOAD, _QEARLY),
               (_QLATE, _QLATE.replace("if Q_TMA:", "if Q_TMA and not Q_REG:"))],
    "pingpong": _PINGPONG,
}
PARTS = {"headslow": ("causal", "context"), "notail": ("context",), "single4": ("causal",),
         "nosplit": ("context",), "short": ("context",), "ctx_narrow": ("context",),
         "qsmem": ("causal",), "qreg_all": ("context",), "qearly": ("causal",),
         "pingpong": ("causal",)}
DEFAULT_VARIANTS = ("headslow",)


def write_variants(out_dir: Path, only: tuple[str, ...] | None = None) -> list[str]:
    """Write hv_<name>.py for every variant (or those in ``only``) into out_dir; returns the
    module names."""
    src = KERNEL.read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for name, edits in EDITS.items():
        if only is not None and name not in only:
            continue
        text = src
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"variant {name}: its edit matches {text.count(old)} places of "
                                 f"{KERNEL.name}, not one; update EDITS to the kernel's source")
            text = text.replace(old, new)
        (out_dir / f"hv_{name}.py").write_text(text)
        names.append(f"hv_{name}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="only write the variant modules here")
    ap.add_argument("--out", type=Path, default=Path("tile_cost_probe.json"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, of {', '.join(EDITS)}")
    ap.add_argument("--parts", choices=("causal", "context", "all"), default="all",
                    help="which of the shapes to run")
    args = ap.parse_args()
    only = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in only if v not in EDITS]
    if unknown:
        raise SystemExit(f"--variants: {', '.join(unknown)} not among {', '.join(EDITS)}")
    if args.write:
        print(" ".join(write_variants(args.write, only)))
        return 0
    import tempfile

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (--write works anywhere)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import kernel_ms
    from fp8_attention import cudnn_call, make_inputs, run_bf16
    from mlaprefill.kernels import attention as att
    from mlaprefill.kernels import hopper_attention as base

    tmp = Path(tempfile.mkdtemp(prefix="tile_cost_probe_"))
    sys.path.insert(0, str(tmp))
    variants = [("base", base)] + [(n[3:], importlib.import_module(n))
                                   for n in write_variants(tmp, only)]
    rows = []
    try:
        for heads, seqs, q_len, k_len, causal in SHAPES:
            part = "causal" if causal else "context"
            if args.parts not in (part, "all"):
                continue
            mine = [(n, m) for n, m in variants if n == "base" or part in PARTS[n]]
            x = make_inputs(heads, seqs, q_len, k_len, torch.bfloat16, "cuda")

            def run(x=x, causal=causal):  # varlen_attention: att.hopper_attention at call time
                return run_bf16(x, causal)

            # the kwin windows (lo, hi) and their cu_seqlens_k, made before anything is timed
            wins = [(lo, min(lo + KWIN, k_len)) for lo in range(0, k_len, KWIN)]
            win_cu = {n: torch.tensor([0, n], dtype=torch.int32, device="cuda")
                      for n in {hi - lo for lo, hi in wins}}

            def run_kwin(x=x, wins=wins, win_cu=win_cu):  # each window's call merged into the last
                state = None
                for lo, hi in wins:
                    state = att.varlen_attention(
                        x["q"], x["k"][lo:hi], x["v"][lo:hi], x["cu_q"], win_cu[hi - lo],
                        max_seqlen_q=x["q_len"], causal=False, softmax_scale=x["scale"],
                        k_rope=x["k_rope"][lo:hi], state=state)
                return state
            if not causal and seqs == 1 and k_len > KWIN:
                mine.append(("kwin", base))
            row = {"heads": heads, "num_seqs": seqs, "q_len": q_len, "k_len": k_len,
                   "causal": causal, "graph_ms": {}}
            outs = {}
            for rnd in range(args.rounds):
                row["graph_ms"].setdefault("cudnn", []).append(
                    kernel_ms(cudnn_call(x, causal), graph=True)["median_ms"])
                # odd rounds in reverse order: no variant always runs right after cuDNN
                for name, mod in (mine if rnd % 2 == 0 else mine[::-1]):
                    att.hopper_attention = mod
                    fn = run_kwin if name == "kwin" else run
                    if rnd == 0:
                        outs[name] = fn()
                    row["graph_ms"].setdefault(name, []).append(
                        kernel_ms(fn, graph=True)["median_ms"])
            bo, bl = outs["base"]
            row["bitwise_equal_base"] = {n: bool(torch.equal(o, bo) and torch.equal(lse, bl))
                                         for n, (o, lse) in outs.items()}
            # where not equal (another key-block size sums in another order): how far apart
            row["max_abs_diff_base"] = {
                n: [float((o.float() - bo.float()).abs().nan_to_num(float("inf")).max()),
                    float((lse - bl).abs().nan_to_num(float("inf")).max())]
                for n, (o, lse) in outs.items() if not row["bitwise_equal_base"][n]}
            cud = row["graph_ms"]["cudnn"]
            row["over_cudnn"] = {n: [t / c for t, c in zip(ts, cud, strict=True)]
                                 for n, ts in row["graph_ms"].items()}
            print(f"H={heads} {seqs}x{q_len} over {k_len} causal={causal}: " + ", ".join(
                f"{n} {' '.join(f'{r:.3f}' for r in v)}" for n, v in row["over_cudnn"].items())
                + f"; equal {row['bitwise_equal_base']}", flush=True)
            rows.append(row)
            x = outs = None
            failed = _write(args.out, variants, rows)  # after every shape: a cut run keeps them
    finally:
        att.hopper_attention = base
    print(f"wrote {args.out}; failed builds: {failed or 'none'}")
    return 0


def _write(out: Path, variants: list, rows: list[dict]) -> dict:
    """The JSON so far; returns the variants' failed builds."""
    failed = {n: dict(m._FAILED) for n, m in variants if m._FAILED}
    out.write_text(json.dumps({"benchmark": "tile_cost_probe", "argv": sys.argv,
                               "failed_builds": failed, "rows": rows}, indent=1) + "\n")
    return failed


if __name__ == "__main__":
    sys.exit(main())
