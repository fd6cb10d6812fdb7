"""``mlaprefill`` command line: ``plan | bench | audit | lint | stallmap`` (and ``--version``).

Each subcommand lives beside the code it drives and exposes ``add_parser(subparsers)`` and
``run(args) -> int``; this module only dispatches, importing a subcommand's module lazily so
that ``mlaprefill lint`` does not pay for importing the forward.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hostsync.cli import OneLineParser, run_subcommand

__all__ = ["main"]

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {
    "plan": "mlaprefill.plan_cli",
    "bench": "mlaprefill.bench.cli",
    "audit": "hostsync.audit_cli",
    "lint": "hostsync.lint_cli",
    "stallmap": "mlaprefill.stallmap",
}


# Options whose value may start with "-" (a comma list of ints such as "-5,1000"): argparse
# would read such a value as an option and report "expected one argument", hiding the real error
# (a negative length) that the subcommand reports with the field and the fix.
_LIST_OPTIONS = ("--context-lens", "--query-lens")


def _join_dash_values(argv: list[str]) -> list[str]:
    """``["--context-lens", "-5,1000"]`` -> ``["--context-lens=-5,1000"]`` (list options only)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if (arg in _LIST_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-")
                and argv[i + 1][1:2].isdigit()):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _build_parser(only: str | None) -> argparse.ArgumentParser:
    from mlaprefill import __version__

    parser = OneLineParser(
        prog="mlaprefill",
        description="MLA chunked-context prefill without host stalls, and tools that find them.",
        epilog="Exit status: 0 ok, 1 findings (audit, lint), 2 invalid input (one line on "
               "stderr naming the option and the fix; never a traceback).",
    )
    parser.add_argument("--version", action="version", version=f"mlaprefill {__version__}")
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C at any moment (torch's import takes seconds): no traceback
        print("mlaprefill: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    only = command if command in SUBCOMMANDS else None
    if only == "plan":
        argv = _join_dash_values(argv)
    parser = _build_parser(only)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return run_subcommand("mlaprefill", SUBCOMMANDS[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
