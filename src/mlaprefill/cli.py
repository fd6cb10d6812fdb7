"""``mlaprefill`` command line: ``plan | bench | audit | lint | stallmap``.

Each subcommand lives beside the code it drives and exposes ``add_parser(subparsers)`` and
``run(args) -> int``; this module only dispatches, importing a subcommand's module lazily so
that ``mlaprefill lint`` does not pay for importing the forward.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "plan": "mlaprefill.plan_cli",
    "bench": "mlaprefill.bench.cli",
    "audit": "mlaprefill.audit.cli",
    "lint": "mlaprefill.audit.lint_cli",
    "stallmap": "mlaprefill.audit.stallmap",
}


def _build_parser(only: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlaprefill",
        description="MLA chunked-context prefill without host stalls, and tools that find them.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            # Cheap placeholder so `--help` lists every subcommand without importing it.
            sub.add_parser(name, add_help=False)
            continue
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mlaprefill`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in SUBCOMMANDS else None
    parser = _build_parser(only)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(importlib.import_module(SUBCOMMANDS[args.command]).run(args))


if __name__ == "__main__":
    sys.exit(main())
