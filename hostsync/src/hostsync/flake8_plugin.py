"""flake8 plugin (entry point ``flake8.extension``, prefix ``HS``): the host-sync lint.

``flake8 --select HS path/`` reports HS101/HS102/HS201 (see :mod:`hostsync.lint`);
opt-in codes need ``--hostsync-enable HS103`` (or ``hostsync-enable = HS103`` in the flake8
config). flake8 itself applies ``# noqa`` comments.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import Any, ClassVar

from hostsync.lint import OPT_IN, lint_tree, not_checked

__all__ = ["HostSyncChecker"]


class HostSyncChecker:
    """AST checker yielding ``(line, col, "HSxxx message", type)`` tuples."""

    name = "hostsync"
    version = "0.1.0"
    enabled: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tree: ast.AST, filename: str = "<unknown>") -> None:
        self.tree = tree
        self.filename = filename

    @classmethod
    def add_options(cls, option_manager: Any) -> None:
        option_manager.add_option(
            "--hostsync-enable", default="", parse_from_config=True,
            comma_separated_list=True,
            help=f"opt-in host-sync codes to report too ({', '.join(sorted(OPT_IN))})")

    @classmethod
    def parse_options(cls, options: Any) -> None:
        cls.enabled = tuple(c.strip().upper() for c in options.hostsync_enable if c.strip())

    def run(self) -> Iterator[tuple[int, int, str, type[Any]]]:
        try:
            found = lint_tree(self.tree, self.filename, select=["HS", *self.enabled])
        except (RecursionError, MemoryError):
            found = [not_checked(self.filename, "is nested too deeply to analyse")]
        for f in found:
            yield f.line, f.col, f"{f.code} {f.message}", type(self)
