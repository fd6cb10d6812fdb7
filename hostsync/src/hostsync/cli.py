"""``hostsync`` command line: ``lint | audit`` (and ``--version``).

The same subcommands as ``mlaprefill lint`` / ``mlaprefill audit`` (that command line imports
these modules' ``add_parser`` and ``run``). Nothing here imports torch: ``hostsync lint`` and
``hostsync --version`` stay fast; ``audit`` imports torch when it runs a script.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["OneLineParser", "main", "run_subcommand"]

# subcommand -> module providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS: dict[str, str] = {"lint": "hostsync.lint_cli", "audit": "hostsync.audit_cli"}


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line on stderr (exit status 2) instead of
    the whole usage block; its subcommands' parsers are of this class too (also
    ``mlaprefill``'s command line)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def _build_parser() -> argparse.ArgumentParser:
    from hostsync import __version__

    parser = OneLineParser(
        prog="hostsync",
        description="Find hidden host syncs in PyTorch code: a static lint and a runtime audit.",
        epilog="Exit status: 0 ok, 1 findings, 2 invalid input (one line on stderr naming the "
               "option and the fix; never a traceback).",
    )
    parser.add_argument("--version", action="version", version=f"hostsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hostsync`` console script; returns the process exit code."""
    parser = _build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command is None:
        parser.print_help()
        return 2
    return run_subcommand("hostsync", SUBCOMMANDS[args.command], args)


def run_subcommand(prog: str, module: str, args: argparse.Namespace) -> int:
    """``module.run(args)`` as an exit code: Ctrl-C is ``PROG COMMAND: interrupted`` and 130,
    a reader that went away (``PROG lint src | head``) is 0, not our error; stdout then points
    at devnull so the interpreter's final flush does not raise again."""
    try:
        return int(importlib.import_module(module).run(args))
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
