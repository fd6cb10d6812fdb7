"""Static host-sync lint (AST only; imports neither torch nor the runtime audit).

Codes
-----
HS000  The file was not checked: it cannot be read, is not a regular file or is too large, does
       not decode, does not parse, or is too deeply nested for the analysis. One finding per
       such file; the run goes on with the others. Always reported, whatever ``select`` says.
HS101  ``non_blocking=True`` copy to a device (``.to(dev, ...)``, ``.cuda(...)``,
       ``dst.copy_(src, ...)``) whose source is known to be pageable host memory.
HS102  Pinning inside a loop (``.pin_memory()``, ``torch.*(pin_memory=True)``): a pinned
       allocation per iteration.
HS103  (opt-in) like HS101, but the lint cannot tell where the source lives or whether it is
       pinned. Off by default so the default stays precise; select it explicitly.
HS201  A host read of a tensor known to be on a device: ``.item()``, ``.tolist()``, ``.cpu()``,
       ``.numpy()``, ``.to("cpu")``; ``bool()`` / ``int()`` / ``float()``; an ``if`` / ``while`` /
       ``assert`` / comprehension / conditional-expression test (``if torch.any(mask):``,
       ``if t[i] != c:``); an f-string of it; ``torch.equal`` / ``torch.allclose`` of it, and
       ``x in t``; not in a ``raise`` or an ``assert`` message (an error path, read once as
       the program fails). Conditions, casts and f-strings count only
       device-ness shown by the code (construction, ``.to``, a ``device = x.device`` alias),
       never names alone.

Where a value lives is tracked per function in statement order, with ``if``/``else`` branches
merged (see :mod:`hostsync.lint_flow`, :mod:`hostsync.lint_kinds` and
:mod:`hostsync.lint_where`): a host tensor made without pinning is pageable; results of
device tensors' ops are on the device; a tensor made with ``device=`` anything not known to be
the CPU is on the device; names follow engine conventions (``*_cpu`` / ``*_np`` host,
``*_gpu`` / ``*_dev`` device, ``x`` is on the device when ``x.device`` is used as a device or
``x_cpu`` exists beside it); attributes, return values and module names carry what is assigned
to them anywhere in the module. What is not known stays unknown and is not reported by default.

Only a literal ``non_blocking=True`` (or a positional ``True``) is checked. ``# noqa`` and
``# noqa: HS101[,...]`` (prefixes allowed, as in flake8) on the reported line suppress.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable

from hostsync.lint_flow import analyze
from hostsync.lint_kinds import Imported

__all__ = ["CODES", "NOT_CHECKED", "OPT_IN", "LintFinding", "is_selected", "lint_path",
           "lint_source", "lint_tree", "not_checked"]

NOT_CHECKED = "HS000"
CODES: dict[str, str] = {
    NOT_CHECKED: "file not checked: it cannot be read, decoded or parsed (the run goes on)",
    "HS101": "non_blocking copy to a device from pageable host memory",
    "HS102": "pinning inside a loop (a pinned allocation per iteration)",
    "HS103": "non_blocking copy to a device from memory not known to be pinned (opt-in)",
    "HS201": "host read (.item/.tolist/.cpu/.numpy, bool/int/float, if/while/assert) of a "
             "device tensor synchronizes the host",
}
# Reported only when selected by their full code (e.g. ``--select HS,HS103``).
OPT_IN = frozenset({"HS103"})

_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]*(?:[,\s]+[A-Z]+[0-9]*)*))?",
                   re.IGNORECASE)


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class LintFinding:
    """One lint finding; ``col`` is 0-based (flake8 convention), shown 1-based in text.

    ``end_line`` / ``end_col`` (exclusive, 0-based) close the span of the whole flagged
    expression, e.g. every line of a chained call written over several lines; 0 when unknown.
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    end_line: int = 0
    end_col: int = 0

    def format_text(self) -> str:
        """``path:line:col: CODE message`` (column 1-based)."""
        return f"{self.path}:{self.line}:{self.col + 1}: {self.code} {self.message}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict (column 1-based, like the text form)."""
        return {"path": self.path, "line": self.line, "col": self.col + 1,
                "end_line": self.end_line or self.line, "end_col": self.end_col + 1,
                "code": self.code, "message": self.message}


def is_selected(code: str, select: Iterable[str] | None = None) -> bool:
    """Whether ``code`` is reported under ``select`` (code prefixes; default ``["HS"]``).

    Opt-in codes (:data:`OPT_IN`) need their full code in ``select``.
    """
    if code == NOT_CHECKED:
        return True
    prefixes = [s.strip().upper() for s in (select or ("HS",)) if s.strip()]
    if code in OPT_IN:
        return code in prefixes
    return any(code.startswith(p) for p in prefixes)


def lint_tree(tree: ast.AST, path: str = "<string>", *,
              select: Iterable[str] | None = None,
              imported: Imported | None = None) -> list[LintFinding]:
    """Findings of a parsed module, ignoring ``# noqa`` (flake8 applies those itself).

    ``select`` as in :func:`is_selected`; ``imported``: summaries of what the module imports
    from other linted modules (see :mod:`hostsync.lint_modules`). Where one copy is both
    HS101 (on one path) and HS103 (on another), only HS101 is kept.
    """
    select = list(select) if select is not None else None
    found: dict[tuple[int, int, str], LintFinding] = {}

    def report(node: ast.AST, code: str, message: str) -> None:
        key = (node.lineno, node.col_offset, code)  # a loop body is walked twice
        found.setdefault(key, LintFinding(
            path, node.lineno, node.col_offset, code, message,
            getattr(node, "end_lineno", None) or node.lineno,
            getattr(node, "end_col_offset", None) or node.col_offset))

    analyze(tree, report, imported)
    definite = {(f.line, f.col) for f in found.values() if f.code == "HS101"}
    return sorted(f for f in found.values() if is_selected(f.code, select)
                  and not (f.code == "HS103" and (f.line, f.col) in definite))


def _suppressed(finding: LintFinding, lines: list[str]) -> bool:
    if not 0 < finding.line <= len(lines):
        return False
    match = _NOQA.search(lines[finding.line - 1])
    if match is None:
        return False
    codes = match.group("codes")
    if not codes:
        return True
    return any(finding.code.upper().startswith(c.upper()) for c in re.split(r"[,\s]+", codes)
               if c)


def lint_source(source: str, path: str = "<string>", *,
                select: Iterable[str] | None = None,
                imported: Imported | None = None) -> list[LintFinding]:
    """Lint Python source text; ``# noqa`` comments are honoured.

    Parameters
    ----------
    source
        Module source.
    path
        Name used in the findings.
    select
        Code prefixes to keep (default: every ``HS`` code that is not opt-in); opt-in codes
        (``HS103``) need their full code, e.g. ``["HS", "HS103"]``.
    imported
        Summaries of names imported from other linted modules (:mod:`hostsync.lint_modules`).

    Raises
    ------
    SyntaxError
        If ``source`` does not parse.
    """
    tree = ast.parse(source, filename=path)
    lines = source.splitlines()
    return [f for f in lint_tree(tree, path, select=select, imported=imported)
            if not _suppressed(f, lines)]


def not_checked(path: str, reason: str) -> LintFinding:
    """The :data:`NOT_CHECKED` finding of a file the lint could not check."""
    return LintFinding(path, 1, 0, NOT_CHECKED, f"file not checked: {reason}")


def lint_path(path: str, *, select: Iterable[str] | None = None,
              imported: Imported | None = None) -> list[LintFinding]:
    """Lint one file; a file that cannot be checked is one :data:`NOT_CHECKED` finding
    (unreadable, not a regular file, too large, not UTF-8, a syntax error, too deeply nested),
    never an exception, so that a run over many files goes on.
    """
    from hostsync.cli_common import UsageError, read_python

    prefix = f"PATH {path!r} "
    try:
        source = read_python(path, field="PATH", skip="pass --exclude")
        return lint_source(source, path, select=select, imported=imported)
    except UsageError as e:
        return [not_checked(path, str(e).removeprefix(prefix))]
    except SyntaxError as e:
        if e.lineno is None:  # null bytes
            return [not_checked(path, f"cannot be parsed ({e.msg}); pass --exclude")]
        return [not_checked(path, f"does not parse (line {e.lineno}: {e.msg}); fix the "
                                  "syntax error or pass --exclude")]
    except ValueError as e:  # null bytes
        return [not_checked(path, f"cannot be parsed ({e}); pass --exclude")]
    except (RecursionError, MemoryError):
        return [not_checked(path, "is nested too deeply to analyse (the parser or the flow "
                                  "analysis ran out of stack or memory); pass --exclude")]
