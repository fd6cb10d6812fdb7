"""``mlaprefill lint PATH... [--format text|json] [--select CODES] [--exclude GLOB]``.

Static host-sync lint (see :mod:`mlaprefill.audit.lint` for the codes). Directories are searched
recursively for ``*.py`` (hidden directories and ``__pycache__`` skipped). Output: one
``path:line:col: CODE message`` line per finding, or a JSON object. Exit status: 0 clean,
1 findings, 2 usage error (a path that does not exist, a file that does not parse).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
from typing import Any

from mlaprefill.audit.lint import LintFinding, lint_source

__all__ = ["add_parser", "collect_files", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "lint", help="static host-sync lint (HS101 pageable non_blocking copy, HS102, HS201)",
        description=re.sub(r":\w+:`([^`]*)`", r"\1", __doc__.split("\n\n")[1]).replace("``", ""))
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or directories")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--select", default="HS", metavar="CODES",
                   help="comma-separated code prefixes to report (default: HS)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip files whose path matches GLOB (repeatable)")
    return p


def collect_files(paths: list[str], exclude: list[str]) -> list[str]:
    """Python files under ``paths`` (sorted per directory), minus ``exclude`` globs.

    Raises
    ------
    FileNotFoundError
        If a path does not exist.
    """
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(path)
    return [f for f in files if not any(fnmatch.fnmatch(f, g) for g in exclude)]


def run(args: argparse.Namespace) -> int:
    try:
        files = collect_files(list(args.paths), list(args.exclude))
    except FileNotFoundError as e:
        print(f"mlaprefill lint: error: PATH {str(e)!r} does not exist", file=sys.stderr)
        return 2
    select = [c.strip() for c in args.select.split(",") if c.strip()]
    findings: list[LintFinding] = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            findings.extend(lint_source(source, path, select=select))
        except (SyntaxError, UnicodeDecodeError) as e:
            print(f"mlaprefill lint: error: cannot parse {path}: {e}", file=sys.stderr)
            return 2
    if args.format == "json":
        print(json.dumps({"num_files": len(files), "num_findings": len(findings),
                          "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        for f in findings:
            print(f.format_text())
        print(f"{len(findings)} finding(s) in {len(files)} file(s)", file=sys.stderr)
    return 1 if findings else 0
