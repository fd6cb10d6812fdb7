"""What ``hostsync audit`` and ``hostsync lint`` share: user errors as one line, and reading
Python source the way Python does.

Every user error (a missing or unreadable path, a file that is not UTF-8 or does not parse, a
bad flag) is one ``prog: error: ...`` line on stderr naming the field and the fix, exit status
2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import stat
import tokenize
from typing import Any, NoReturn

__all__ = ["MAX_SOURCE_BYTES", "UsageError", "one_line_errors", "read_python"]

#: Larger than any Python file people write (the largest in torch is ~1 MB); a bigger "source"
#: is generated data or a device, and reading it whole would exhaust memory.
MAX_SOURCE_BYTES = 16 * 2**20


class UsageError(Exception):
    """A user error: the message names the field and the fix, fit for one stderr line."""


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report argument errors as one ``prog: error: ...`` line, exit 2.

    argparse prints the whole usage block first; a user who typed one wrong flag needs the
    line that names it (``--help`` still shows the usage).
    """
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}; see {parser.prog} --help\n")

    parse_known_args = parser.parse_known_args

    def parse_strictly(args: Any = None, namespace: Any = None) -> Any:
        # As a subcommand, leftovers would reach the top-level parser, which prints its usage.
        ns, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_strictly  # type: ignore[method-assign]
    return parser


def read_python(path: str, *, field: str, skip: str) -> str:
    """Text of a Python file, decoded as Python does (UTF-8 unless a coding cookie says
    otherwise).

    ``field`` names the argument in errors (``PATH``, ``SCRIPT``); ``skip`` is the way around
    a bad file offered in the message (e.g. ``"pass --exclude"``).

    Raises
    ------
    UsageError
        If the file is not a regular file (``/dev/zero``, a FIFO), is larger than
        :data:`MAX_SOURCE_BYTES`, or cannot be read or decoded.
    """
    try:
        # stat before open: opening a FIFO would block, reading /dev/zero would never end
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UsageError(f"{field} {path!r} is not a regular file (a device, FIFO or "
                             f"socket) and cannot be Python source; {skip}")
        with open(path, "rb") as fh:
            data = fh.read(MAX_SOURCE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"{field} {path!r} cannot be read ({e.strerror or e}); fix its "
                         f"permissions or {skip}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise UsageError(f"{field} {path!r} is larger than {MAX_SOURCE_BYTES >> 20} MiB, not "
                         f"Python source people write; {skip}")
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as e:
        reason = getattr(e, "reason", None) or getattr(e, "msg", None) or str(e)
        raise UsageError(f"{field} {path!r} is not valid UTF-8 Python source ({reason}); save "
                         f"it as UTF-8 (or declare its coding) or {skip}") from None
