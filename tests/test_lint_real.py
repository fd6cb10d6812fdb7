"""Precision and recall of the lint on real engine code (tests/lint_corpus/real/README.md).

Prints one row per code and split; asserts the values reached, so that a change that loses a
finding or adds a false positive fails here. Skipped when the corpus text is not fetched.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from hostsync.lint_modules import lint_modules

REAL = pathlib.Path(__file__).parent / "lint_corpus" / "real"
ENTRIES = json.loads((REAL / "corpus.json").read_text())
_LABEL = re.compile(r"^(\d+)\s+(HS\d{3})\b")
CODES = ("HS101", "HS201")


def _labels(name: str) -> set[tuple[int, str]]:
    out = set()
    for line in (REAL / "labels" / f"{name}.expected").read_text().splitlines():
        m = _LABEL.match(line)
        if m:
            out.add((int(m.group(1)), m.group(2)))
    return out


def _in_range(entry: dict, line: int) -> bool:
    lo, hi = entry["lines"] or (1, 10**9)
    return lo <= line <= hi


def _findings(entry: dict, tmp: pathlib.Path) -> list:
    """The entry's findings, linted together with its ``siblings`` (the files of its repository
    it imports), each at its repository path under ``tmp`` so that imports resolve."""
    root = tmp / entry["name"]
    main = root / entry["path"]
    main.parent.mkdir(parents=True, exist_ok=True)
    main.write_bytes((REAL / ".cache" / f"{entry['name']}.py").read_bytes())
    files = [(str(main), str(root))]
    for sibling in entry.get("siblings", []):
        out = root / sibling
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes((REAL / ".cache" / f"{entry['name']}.siblings" / sibling).read_bytes())
        files.append((str(out), str(root)))
    return [f for f in lint_modules(files) if f.path == str(main)]


def _scores(split: str, tmp: pathlib.Path) -> dict[str, tuple[int, int, int]]:
    tp = dict.fromkeys(CODES, 0)
    fp = dict.fromkeys(CODES, 0)
    fn = dict.fromkeys(CODES, 0)
    for entry in ENTRIES:
        if entry["split"] != split:
            continue
        found = {(f.line, f.code) for f in _findings(entry, tmp)
                 if f.code in CODES and _in_range(entry, f.line)}
        expected = _labels(entry["name"])
        for _, code in found & expected:
            tp[code] += 1
        for _, code in found - expected:
            fp[code] += 1
        for _, code in expected - found:
            fn[code] += 1
    return {c: (tp[c], fp[c], fn[c]) for c in CODES}


def _ratio(num: int, den: int) -> float:
    return num / den if den else 1.0


#: What the lint reaches today, per (split, code): (precision, recall) lower bounds (history in
#: README.md). Fourth round: 17 files labelled and committed before being linted, measured
#: once with no rule changed (HS101 4/12, HS201 8/28, one false positive); then the callable-
#: component tuple rule and the device/dev-call merge were written from their misses, so those
#: 17 are dev now (dev HS101 13/24, HS201 25/46, the false positive mla_cp.py:133 kept).
#: Fifth round: 11 fresh files labelled and committed (d354d4a) before being linted, measured
#: once with the rules of 2017062: HS101 0/3, HS201 7/26, one false positive (ascend
#: op_backend.py:421). Held-out now: those 11 and the seven earlier files, pooled HS101 1/4,
#: HS201 11/31 (precision 11/12). Issue #29's targets are not met.
#: Then (README, "after the fifth round") the constructor-keyword fix for that false positive and
#: the min()/max() and device-attribute rules, which moved ascend op_backend.py and mini-sglang
#: scheduler/cache.py to dev: dev HS201 29/56 (one false positive, mla_cp.py:133), held-out
#: HS201 10/21 with none.
#: Sixth round: 11 fresh files labelled and committed (c2f6239) before being linted, measured
#: once with the rules of 02ea132: HS101 0/2, HS201 24/36 with one false positive (310p
#: attention_v1.py:222; two labels missed by oversight added after, see README). Held-out now
#: (27 files): HS101 1/6, HS201 34/57 (precision 34/35). Issue #29's targets are not met.
#: Seventh round (README, "Seventh round, rules"): call-site parameter facts (tgi_utils_tokens
#: linted with its callers as siblings) and no `self` device hint: dev HS201 33/56, no false
#: positive (mla_cp.py:133 gone); held-out unchanged. Then lmdeploy_nn_attention (round 6,
#: held out) was read for the register_buffer rule, so it is dev now with its two HS101
#: misses: dev HS101 13/24 -> 13/26 (the one bound lowered, by the move, not by a rule),
#: held-out HS101 1/6 -> 1/4 (its bound left as it was).
#: Seventh round, held-out batch: 21 files of 10 engines labelled and committed (82c96e6..bf24046)
#: before being linted, measured once with the rules above (README): HS101 18/25, HS201 15/64
#: with four false positives. Held-out now (47 files): HS101 19/29, HS201 49/121 (precision
#: 49/54). Issue #29's targets are not met.
#: Eighth round: the 21 round-7 files moved to dev (8d99497), measured once right after with no
#: rule changed: dev HS101 31/51, HS201 48/120 (precision 48/52); held-out (26 files) HS101 1/4,
#: HS201 34/57 (precision 34/35). The held-out bounds are these and are not tuned on.
#: Eighth round, rules (README): called attributes are not tensors, local pin flags bound only
#: to False: dev HS101 33/51, HS201 48/120 (precision 48/49).
#: Ninth round, rules (README): closures, torch.distributed collectives, loop items and strict
#: loop targets, host guards, fresh NumPy arrays: dev HS101 36/51, HS201 67/120 (precision
#: 67/68, the one false positive cache_3d.py:664 as before); held-out unchanged (HS101 1/4,
#: HS201 34/57, precision 34/35), so its bounds are as they were.
#: Ninth round, held-out batch: 15 files labelled and committed (111860e) before being linted,
#: measured once with the rules above: HS101 3/4 with three false positives, HS201 11/37 with
#: one. Held-out now (41 files): HS101 4/8 (precision 4/7), HS201 45/94 (precision 45/47): the
#: bounds, lowered because the split grew, not because a rule lost a finding.
#: Tenth round: the 15 round-9 files moved to dev, measured once right after with no rule
#: changed: dev HS101 39/55 (precision 39/42), HS201 78/157 (precision 78/80); held-out (26
#: files) HS101 1/4, HS201 34/57 (precision 34/35), as in the eighth round.
#: Tenth round, rules (README): error paths, host staging copies, per-position tuple returns,
#: min()/max() results, zip names iterated later, submodule parameters' devices: dev HS101
#: 39/55 (precision 39/40), HS201 82/157 (precision 82/83); held-out unchanged (HS101 1/4,
#: HS201 34/57, precision 34/35), so its bounds are as they were.
#: Tenth round, held-out batch: 17 files labelled and committed (ccc29fc) before being linted,
#: measured once with the rules above: HS101 2/12 with two false positives, HS201 22/32 with
#: none. Held-out now (43 files): HS101 3/16 (precision 3/5), HS201 56/89 (precision 56/57):
#: the bounds, lowered because the split grew, not because a rule lost a finding.
#: Eleventh round: the 17 round-10 files moved to dev, measured once right after with no rule
#: changed: dev HS101 41/67 (precision 41/44), HS201 104/189 (precision 104/105); held-out (26
#: files) HS101 1/4, HS201 34/57 (precision 34/35), as in the eighth round.
#: Eleventh round, rules (README): uncalled `is_pinned` tests, `copy_` of `dev.cpu()` never
#: HS101, checkpoint reads onto the CPU: dev HS101 42/67 (precision 42/43), HS201 104/189
#: (precision 104/105); held-out unchanged (HS101 1/4, HS201 34/57, precision 34/35), so its
#: bounds are as they were.
#: Eleventh round, held-out batch: 13 files labelled and committed (47bdeb6) before being
#: linted, measured once with the rules above: HS101 0/6, HS201 10/38, no false positive.
#: Held-out now (39 files): HS101 1/10, HS201 44/95 (precision 44/45): the bounds, lowered
#: because the split grew, not because a rule lost a finding.
#: Twelfth round: the 13 round-11 files moved to dev, measured once right after with no rule
#: changed: dev HS101 42/73 (precision 42/43), HS201 114/227 (precision 114/115); held-out (26
#: files) HS101 1/4, HS201 34/57 (precision 34/35), as in the eighth round.
#: Twelfth round, rules (README): siblings for four dev entries and dict entries written out on
#: the device in another linted module: dev HS101 42/73 (precision 42/43), HS201 137/227
#: (precision 137/138); held-out unchanged (HS101 1/4, HS201 34/57, precision 34/35).
#: Twelfth round, held-out batch: 12 files labelled and committed (1800194) before being
#: linted, measured once with the rules above: HS101 1/3, HS201 16/35, no false positive.
#: Held-out now (38 files): HS101 2/7, HS201 50/92 (precision 50/51).
#: Thirteenth round: the 12 round-12 files moved to dev, measured once right after with no rule
#: changed: dev HS101 43/76 (precision 43/44), HS201 153/262 (precision 153/154); held-out (26
#: files) HS101 1/4, HS201 34/57 (precision 34/35), as in the eighth round.
#: Thirteenth round, rules (README): getattr/setattr with the name written out, fields of a
#: value on the device, torch.equal/allclose and membership in a device tensor: dev HS101
#: 45/76 (precision 45/46), HS201 156/262 (precision 156/157); held-out unchanged (HS101 1/4,
#: HS201 34/57, precision 34/35), so its bounds are as they were.
REACHED = {
    ("dev", "HS101"): (45 / 46, 45 / 76), ("dev", "HS201"): (156 / 157, 156 / 262),
    ("held-out", "HS101"): (1.0, 7 / 23), ("held-out", "HS201"): (44 / 45, 44 / 86),
}


@pytest.mark.skipif(not (REAL / ".cache").is_dir() or not all(
    (REAL / ".cache" / f"{e['name']}.py").is_file() and all(
        (REAL / ".cache" / f"{e['name']}.siblings" / s).is_file() for s in e.get("siblings", []))
    for e in ENTRIES),
    reason="real corpus not fetched (python tests/lint_corpus/real/fetch.py)")
@pytest.mark.parametrize("split", ["dev", "held-out"])
def test_precision_and_recall_on_real_engine_code(split: str, tmp_path: pathlib.Path) -> None:
    scores = _scores(split, tmp_path)
    rows = []
    for code, (tp, fp, fn) in scores.items():
        p, r = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
        rows.append((f"{split:8} {code}  tp={tp} fp={fp} fn={fn}  precision={p:.2f} "
                     f"recall={r:.2f}", p, r, REACHED[(split, code)]))
    print("\n" + "\n".join(row for row, *_ in rows))
    for row, p, r, (min_p, min_r) in rows:
        assert p >= min_p and r >= min_r, row
