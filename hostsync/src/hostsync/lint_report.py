"""Output of the static lint for people and tools: text, JSON, SARIF 2.1.0, GitHub annotations,
and the long explanation of each code (``hostsync lint --explain CODE``)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hostsync
from hostsync.lint import CODES, OPT_IN, LintFinding

__all__ = ["EXPLANATIONS", "FORMATS", "format_findings", "to_github", "to_sarif"]

FORMATS = ("text", "json", "sarif", "github")

EXPLANATIONS: dict[str, str] = {
    "HS000": """\
HS000  file not checked

What: a file the lint could not check: it cannot be read, is not a regular file (a device such
as /dev/zero, a FIFO) or is larger than 16 MiB, is not UTF-8 (nor declares its coding), does not
parse, or is nested too deeply for the parser or the analysis.

Why: a file that was not checked is not clean. The finding keeps the run going (the other files'
findings are reported) and makes its exit status 1.

Fix: fix the file, or leave it out with --exclude GLOB.""",
    "HS101": """\
HS101  non_blocking copy to a device from pageable host memory

What: `x.to(device, non_blocking=True)`, `x.cuda(non_blocking=True)` or
`dst.copy_(x, non_blocking=True)` where `x` is known to be ordinary (pageable) host memory:
made on the host by torch or NumPy without pin_memory, or computed from host tensors, or
returned by a function whose every return is such a tensor (`def make(n): return
torch.tensor(...)` ... `make(n).to(dev, non_blocking=True)`), of the same module or of another
file linted in the same run that this one imports (`from .plan import make`, `import plan;
plan.make(n)`: cross-module summaries), or returned by a plain function call the lint cannot
see into (imported from a file not linted, or of no known summary) that is given host
tensors and no device ones (`prepare_chunk_indices(cu_seqlens_cpu, 64)`; not methods, nor
callees named pin/gpu/cuda/device/upload/stage/async), or read from a checkpoint onto the CPU
(`torch.load(..., map_location="cpu")`, safetensors `load_file(path)` and `f.get_tensor(k)` of
`with safe_open(path, framework="pt") as f`, the CPU by default; their dicts' `.items()` /
`.values()` too), or gathered by indexing a host tensor with a list or a boolean comparison
(`pinned[idx_list]`: a fresh copy), or attached to an object with `setattr(obj, "name", t)` and
read back with `getattr(obj, "name", None)` (the name written out: `obj.name`).
`if not x.is_pinned:` (the method left uncalled, always true) never pins.

Why: non_blocking is only asynchronous from pinned memory. From pageable memory CUDA may make
the host wait until every kernel already queued has finished (measured on an H200: with 50 ms
of kernels queued, a copy from 2120 KiB up blocked the host for the whole queue; the size
depends on the platform and driver). `torch.cuda.set_sync_debug_mode` does not report it.

Fix: allocate the source with pin_memory=True, or copy it into a pinned staging buffer that is
reused only after an event says its last copy is done (see mlaprefill.StagingRing):

    starts = torch.arange(n, dtype=torch.int32) * chunk
    starts_dev = starts.to(device, non_blocking=True)          # HS101
    host = torch.empty(n, dtype=torch.int32, pin_memory=True)
    torch.mul(torch.arange(n, dtype=torch.int32), chunk, out=host)
    starts_dev = host.to(device, non_blocking=True)             # clean

Reported when one path makes the source pageable and no path pins it or puts it on a device.
Not reported: `dst.copy_(dev.cpu(), non_blocking=True)` (a host copy just made of a device
tensor: that blocking read, HS201, drained the queue; into a host buffer it is staging, into a
device one a round trip with no queued work left to wait for).
A pageable fallback on purpose (no CUDA, a benchmark baseline): add `# noqa: HS101`.""",
    "HS102": """\
HS102  pinning inside a loop

What: `.pin_memory()` or a torch factory with pin_memory=True inside a `for`/`while` body.

Why: each call allocates page-locked memory (cudaHostAlloc, or the caching host allocator):
slow, and pinned memory is a scarce resource.

Fix: allocate one pinned staging buffer outside the loop and copy into slices of it; guard its
reuse with a CUDA event so a pending copy is never overwritten.""",
    "HS103": """\
HS103  non_blocking copy to a device from memory the lint cannot place (opt-in)

What: like HS101, but the source is an argument, an attribute set in a module not linted
with this one (or not of a class it imports), or a
host value whose pinnedness is unknown (`*_cpu`), so it may be pinned, pageable or on the
device already. Off by default so that the default output stays precise; turn it on with
`--select HS,HS103` (flake8: `--hostsync-enable HS103`) to review every upload.

Fix: make sure the source is pinned (or already on the device); when it is, say so where it is
made (pin_memory=True in this module) or add `# noqa: HS103`.""",
    "HS201": """\
HS201  host read of a device tensor

What: reading a device tensor's value on the host, in any of these forms:
  - `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, a blocking `.to("cpu")`;
  - `bool(t)`, `int(t)`, `float(t)`, and builtin `min()`/`max()` comparing device tensors
    (`max(start, t[0])`, `min(range(n), key=lambda i: t[i])`; what `max(a, t)` returns is a
    device tensor too, so `if 0 <= max(a, t) - a:` reads it again);
  - a condition: `if torch.any(mask):`, `while t.any():`, `assert torch.all(t >= 0)`,
    `x if t[i] > 0 else y`, `[... for i in r if t[i] != c]`, `if t[i] != c:` in a loop;
  - an f-string of a device tensor (`f"{t}"`, e.g. in a log message);
  - a comparison that returns a Python bool: `torch.equal(a, b)`, `torch.allclose(a, b)`,
    `a.equal(b)`, and membership in a device tensor, `x in t` / `x not in t`
    (`Tensor.__contains__` is `bool((t == x).any())`).
A read built only on the way to an exception (a `raise` statement, an `assert`'s message) is
not reported: it waits once, as the program fails; the test that decides to fail still is.
A tensor is known to be on the device when it is made with device= something not known to be the
CPU (a free function's own device parameter excepted: the caller chooses it), also through a
local alias (`device = out.device; torch.zeros(n, device=device)` puts both `out` and the new
tensor on the device), or on the device of a submodule's parameter (`self.embed.weight.device`,
the device the component serves; `x.device` of a tensor of unknown place says nothing), moved
there, computed from device tensors, or named so (`*_gpu`, `x` beside `x_cpu`); so is a field of
a value moved to the device whole (`enc = tokenizer(...).to(dev)`: `enc.attention_mask`).
`.item()`/`.tolist()`/`.cpu()`/`.numpy()` of what a call given device tensors returns count too
(`self.sampler(logits_dev).tolist()`, `kernel(x=dev).cpu()`), and so do fields and tuple items
of such a result (of a plain function, or of a callable held by another object: `ids, probs =
batch.chooser(logits)`; not of a method of `self` guessed from its arguments), the items of a
tuple that every return of a function or method of the module writes out (`return dev, n, host`:
`ts, n, host = self._steps(...)` makes `ts` a device tensor, in conditions too, and leaves
`host` on the host), loop items of a name bound once to `zip(...)` and iterated later, and what
a function returns whose every return is on the device, in the same module or in another file
linted in the same run that this one imports (`from .post import sample` ... `ids, probs =
sample(logits); ids.cpu()`: cross-module summaries; lint a package's files together to use
them). Conditions, casts and f-strings are judged from what the code does, not from names (`if
has_cuda:`, `if device.type == "cuda":`, `assert t.dim() == 2` are silent); an attribute of
`self` that every assignment in its class puts on the device (`self.free = torch.arange(n,
device=dev)` in `__init__`, then slices and cats of itself) counts in another method's
condition. What a constructor is given by keyword (`Meta(seq_lens=x)`) is what an object of
unknown class holds only when that constructor's arguments cover every attribute the function
uses of the object.

Why: the host stops until the device has finished everything queued before the read, so the
next step's host work cannot overlap the GPU.

Fix: keep a host copy of the integers you need (compute them on the host, e.g. in the plan), or
keep the value on the device (`torch.where`, masks instead of a branch); if it must come back,
copy non_blocking into pinned memory and wait on an event where it is read. An intended read
(a debug check): `# noqa: HS201`.""",
}

_LEVELS = {"HS000": "error", "HS101": "warning", "HS102": "warning", "HS103": "note",
           "HS201": "warning"}
_RULE_NAMES = {"HS000": "FileNotChecked", "HS101": "PageableNonBlockingCopy",
               "HS102": "PinMemoryInLoop",
               "HS103": "UnplacedNonBlockingCopy", "HS201": "DeviceTensorHostRead"}


def _uri(path: str) -> str:
    """Repository-relative POSIX path when under the working directory, else a file URI."""
    rel = os.path.relpath(os.path.abspath(path))
    if rel.startswith(".."):
        return Path(path).resolve().as_uri()
    return Path(rel).as_posix()


def to_sarif(findings: Sequence[LintFinding]) -> dict[str, Any]:
    """A SARIF 2.1.0 log (one run) for code-scanning upload."""
    codes = sorted(CODES)
    rules = [{
        "id": code,
        "name": _RULE_NAMES[code],
        "shortDescription": {"text": CODES[code]},
        "fullDescription": {"text": EXPLANATIONS[code].split("\n\n")[1]},
        "help": {"text": EXPLANATIONS[code]},
        "defaultConfiguration": {"level": _LEVELS[code], "enabled": code not in OPT_IN},
    } for code in codes]
    results = [{
        "ruleId": f.code,
        "ruleIndex": codes.index(f.code),
        "level": _LEVELS[f.code],
        "message": {"text": f.message},
        "locations": [{"physicalLocation": {
            "artifactLocation": {"uri": _uri(f.path)},
            "region": {"startLine": f.line, "startColumn": f.col + 1,
                       "endLine": f.end_line or f.line, "endColumn": f.end_col + 1},
        }}],
    } for f in findings]
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "hostsync", "version": hostsync.__version__,
                                "rules": rules}},
            "results": results,
        }],
    }


def _escape(value: str, *, prop: bool) -> str:
    value = value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return value.replace(":", "%3A").replace(",", "%2C") if prop else value


def to_github(findings: Sequence[LintFinding]) -> list[str]:
    """GitHub Actions workflow commands: one ``::warning file=...`` line per finding."""
    return [
        f"::{'notice' if f.code in OPT_IN else 'warning'} "
        f"file={_escape(f.path, prop=True)},line={f.line},col={f.col + 1},"
        f"title={f.code}::{_escape(f.message, prop=False)}"
        for f in findings
    ]


def format_findings(findings: Sequence[LintFinding], fmt: str, *, num_files: int) -> str:
    """The whole stdout of ``hostsync lint`` in format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "json":
        return json.dumps({"num_files": num_files, "num_findings": len(findings),
                           "findings": [f.to_dict() for f in findings]}, indent=2)
    if fmt == "sarif":
        return json.dumps(to_sarif(findings), indent=2)
    if fmt == "github":
        return "\n".join(to_github(findings))
    if fmt == "text":
        return "\n".join(f.format_text() for f in findings)
    raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
