"""``hostsync lint PATH... [--format text|json|sarif|github] [--select CODES] [--exclude GLOB]``.

Static host-sync lint (see :mod:`hostsync.lint` for the codes; ``--explain CODE`` prints
one in full). Directories are searched recursively for ``*.py`` (hidden directories and
``__pycache__`` skipped). Output: one ``path:line:col: CODE message`` line per finding, a JSON
object, a SARIF 2.1.0 log (code-scanning upload) or GitHub Actions annotations. A file that
cannot be read, decoded or parsed is one HS000 finding and the run goes on. Files linted in
one run know what the functions and classes they import from each other return (cross-module
summaries: module names are paths relative to the directories given). Exit status: 0
clean, 1 findings, 2 usage error (a path that does not exist, a directory that cannot be
listed, an unknown code), always as one line on stderr.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from typing import Any

from hostsync.cli_common import UsageError, one_line_errors
from hostsync.lint import CODES, OPT_IN, LintFinding

__all__ = ["add_parser", "collect_files", "collect_rooted", "lint_files", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "lint", help="static host-sync lint (HS101 pageable non_blocking copy, HS102, HS201)",
        description=re.sub(r":\w+:`([^`]*)`", r"\1", __doc__.split("\n\n")[1]).replace("``", ""))
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or directories")
    p.add_argument("--format", choices=("text", "json", "sarif", "github"), default="text",
                   help="output: text (default), json, sarif (code scanning), github "
                        "(workflow annotations)")
    p.add_argument("--select", default="HS", metavar="CODES",
                   help="comma-separated code prefixes to report (default: HS); opt-in codes "
                        f"({', '.join(sorted(OPT_IN))}) only when named in full, e.g. HS,HS103")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip files whose path matches GLOB (repeatable)")
    p.add_argument("--explain", metavar="CODE", help="explain a code (e.g. HS101) and exit")
    p.set_defaults(prog=p.prog)
    return one_line_errors(p)


def collect_files(paths: list[str], exclude: list[str]) -> list[str]:
    """Python files under ``paths`` (sorted per directory), minus ``exclude`` globs.

    Raises
    ------
    UsageError
        If a path does not exist or a directory cannot be listed.
    """
    return [f for f, _ in collect_rooted(paths, exclude)]


def collect_rooted(paths: list[str], exclude: list[str]) -> list[tuple[str, str | None]]:
    """:func:`collect_files` with the directory each file was found under (None for a file
    given itself): module names of the cross-module summaries are relative to it."""
    files: list[tuple[str, str | None]] = []
    for path in paths:
        if os.path.isdir(path):
            if not os.access(path, os.R_OK | os.X_OK):
                raise UsageError(f"PATH {path!r} is a directory that cannot be read; "
                                 "fix its permissions or pass --exclude")
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                files.extend((os.path.join(root, n), path) for n in sorted(names)
                             if n.endswith(".py"))
        elif os.path.exists(path):
            files.append((path, None))
        else:
            raise UsageError(f"PATH {path!r} does not exist; pass an existing file or directory")
    return [(f, r) for f, r in files if not any(fnmatch.fnmatch(f, g) for g in exclude)]


def _parse_select(select: str) -> list[str]:
    codes = [c.strip().upper() for c in select.split(",") if c.strip()]
    if not codes:
        raise UsageError("--select is empty; pass code prefixes such as HS or HS101,HS201")
    for c in codes:
        if not any(code.startswith(c) for code in CODES):
            raise UsageError(f"--select {c!r} matches no code; known codes: "
                             f"{', '.join(sorted(CODES))}")
    return codes


def _explain(code: str) -> str:
    from hostsync.lint_report import EXPLANATIONS

    key = code.strip().upper()
    if key not in EXPLANATIONS:
        raise UsageError(f"--explain {code!r} is not a code; pass one of "
                         f"{', '.join(sorted(EXPLANATIONS))}")
    return EXPLANATIONS[key]


def lint_files(files: list[str] | list[tuple[str, str | None]],
               select: list[str]) -> list[LintFinding]:
    """Findings of every file, in order, linted together (:mod:`hostsync.lint_modules`);
    ``files``: paths, or ``(path, root)`` pairs from :func:`collect_rooted`. A file that cannot
    be read, decoded or parsed is one ``HS000`` finding and the others are still linted."""
    from hostsync.lint_modules import lint_modules

    rooted = [f if isinstance(f, tuple) else (f, None) for f in files]
    return lint_modules(rooted, select=select)


def run(args: argparse.Namespace) -> int:
    from hostsync.lint_report import format_findings

    prog = getattr(args, "prog", "hostsync lint")  # `mlaprefill lint` when run through it
    try:
        if args.explain is not None:
            print(_explain(args.explain))
            return 0
        if not args.paths:
            raise UsageError("PATH is missing; pass the files or directories to lint "
                             "(or --explain CODE)")
        select = _parse_select(args.select)
        files = collect_rooted(list(args.paths), list(args.exclude))
        findings = lint_files(files, select)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    out = format_findings(findings, args.format, num_files=len(files))
    if out:
        print(out)
    if args.format == "text":
        print(f"{len(findings)} finding(s) in {len(files)} file(s)", file=sys.stderr)
    return 1 if findings else 0
